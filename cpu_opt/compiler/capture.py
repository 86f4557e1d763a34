"""Capture: a model and example inputs -> an ATen-level FX graph with shapes on every node.

``torch.export.export(..., strict=False)`` first (training IR: ``aten.linear``, ``aten.conv2d``,
``aten.layer_norm``, ``aten.scaled_dot_product_attention`` stay whole, which is what the lowering
wants); where export fails, ``torch.fx.symbolic_trace`` plus shape propagation, and the report
says so; where both fail, :class:`CaptureError` names the op or construct export complained about.
"""
from __future__ import annotations

import contextlib
import io
import logging
import re
import warnings
from dataclasses import dataclass, field

import torch
import torch.fx
import torch.utils._pytree as pytree

from ..errors import CpuOptError


class CaptureError(CpuOptError):
    """Neither torch.export nor FX tracing could capture the model."""


@dataclass
class Captured:
    gm: torch.fx.GraphModule        # flat positional tensor inputs -> flat outputs
    in_spec: object                 # pytree spec of (args, kwargs)
    out_spec: object                # pytree spec of the model's output
    method: str                     # "torch.export" or "fx.symbolic_trace"
    notes: list = field(default_factory=list)
    n_inputs: int = 0
    # non-tensor leaves of the inputs (bools, ints, floats, strings, None): constants of this
    # capture, as (position among the flat leaves, value); the graph takes only the tensor leaves
    constants: tuple = ()
    # torch.export with dynamic shapes: the symbolic size of every input and output dimension
    # (recorded before shape propagation replaces them with the example's sizes), else None
    symbolic: SymbolicShapes | None = None


@dataclass(frozen=True)
class SymDim:
    """A dimension torch.export kept symbolic: its size expression (``"s53"``, ``"s70 - 1"``) and
    the names of the symbols in it."""
    expr: str
    symbols: frozenset


@dataclass(frozen=True)
class SymbolicShapes:
    """Per graph input (the tensor leaves, in order) and per graph output (the flat outputs): a
    tuple with, for each dimension, an ``int`` (static) or a :class:`SymDim`; ``None`` for an
    output that is not a tensor. ``ranges``: symbol name -> (lowest, highest or None) size
    torch.export allows (e.g. BERT's sequence length ends at ``max_position_embeddings``)."""
    inputs: tuple
    outputs: tuple
    ranges: dict


def flatten_inputs(example_inputs) -> tuple[tuple, dict]:
    """Normalise ``example_inputs`` (a tensor, a tuple/list, or a dict of kwargs) to (args, kwargs)."""
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,), {}
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    raise TypeError("example_inputs must be a tensor, a tuple of inputs, or a dict of keyword arguments; "
                    f"got {type(example_inputs).__name__}")


def _explain(e: Exception) -> str:
    msg = str(e).strip().splitlines()
    head = msg[0] if msg else type(e).__name__
    m = re.search(r"(aten\.\w+[\.\w]*|torch\.\w+[\.\w]*|Unsupported: [^\n]+)", str(e))
    return f"{type(e).__name__}: {head}" + (f" (at {m.group(1)})" if m and m.group(1) not in head else "")


def _flat_module(gm: torch.fx.GraphModule, in_spec, out_spec) -> torch.fx.GraphModule:
    """Turn export's unlifted module (pytree-calling convention) into a flat one:
    placeholders are the flattened tensor inputs, the output is the flat list of outputs."""
    g = gm.graph
    for node in g.nodes:
        if node.op == "output":
            out = node.args[0]
            flat, _ = pytree.tree_flatten(out)
            node.args = (tuple(flat),)
    g._codegen = torch.fx.graph.CodeGen()  # plain positional calling convention
    gm._forward_pre_hooks.clear()  # export's input-structure check is for the pytree convention
    gm._forward_hooks.clear()
    gm.recompile()
    return gm


def capture(model: torch.nn.Module, example_inputs, *, dynamic_shapes=None, eager_output=None) -> Captured:
    """``eager_output``: the model's output on these inputs, when the caller already has it
    (saves one forward pass)."""
    args, kwargs = flatten_inputs(example_inputs)
    leaves, in_spec = pytree.tree_flatten((args, kwargs))
    bad = [type(t).__name__ for t in leaves if not isinstance(t, torch.Tensor) and not _is_constant(t)]
    if bad:
        raise TypeError(f"example inputs must be tensors or plain constants (bool, int, float, str, None) in "
                        f"tuples/lists/dicts; got {bad}")
    constants = tuple((i, t) for i, t in enumerate(leaves) if not isinstance(t, torch.Tensor))
    flat_in = [t for t in leaves if isinstance(t, torch.Tensor)]
    notes = []
    if constants:
        notes.append(f"{len(constants)} non-tensor input(s) captured as constants "
                     f"({', '.join(repr(v) for _, v in constants[:6])}); other values make a new capture")
    _register_library_pytrees(model)
    if eager_output is None:
        with torch.no_grad():  # on copies: a model may write into its inputs
            a, k = pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, (args, kwargs))
            eager_output = model(*a, **k)
    out = eager_output
    flat_out, out_spec = pytree.tree_flatten(out)
    target, t_args, t_kwargs, t_dyn = model, args, kwargs, dynamic_shapes
    if constants:  # export a module of the tensor leaves alone, the constants bound inside it
        target, t_args, t_kwargs = _WithConstants(model, in_spec, constants, len(leaves)), tuple(flat_in), {}
        if dynamic_shapes is not None:
            t_dyn = None
            notes.append("dynamic shapes are not used with non-tensor inputs; each new shape is captured")
    try:
        with warnings.catch_warnings(), _quiet_export():
            warnings.simplefilter("ignore")
            ep = torch.export.export(target, t_args, t_kwargs, strict=False, dynamic_shapes=t_dyn)
        gm = ep.module()
        gm = _flat_module(gm, in_spec, out_spec)
        method = "torch.export"
        symbolic = ep if t_dyn is not None else None
    except Exception as e_export:  # noqa: BLE001 - we report and try the next method
        notes.append(f"torch.export failed ({_explain(e_export)}); used torch.fx.symbolic_trace")
        try:
            gm = _fx_capture(target, t_args, t_kwargs, flat_in)
            method = "fx.symbolic_trace"
            symbolic = None
        except Exception as e_fx:  # noqa: BLE001
            raise CaptureError(f"cannot capture {type(model).__name__}: torch.export: {_explain(e_export)}; "
                               f"FX symbolic_trace: {_explain(e_fx)}") from e_fx
    if symbolic is not None:
        try:
            symbolic = _symbolic_shapes(gm, symbolic)
        except Exception:  # noqa: BLE001 - only buckets read these; without them each shape gets a plan
            symbolic = None
    _propagate_shapes(gm, flat_in)
    return Captured(gm, in_spec, out_spec, method, notes, len(flat_in), constants, symbolic)


def _symbolic_shapes(gm: torch.fx.GraphModule, ep) -> SymbolicShapes | None:
    """The sizes torch.export left symbolic, read from the flat module's placeholders and outputs
    (``meta["val"]`` holds export's fake tensors with ``SymInt`` sizes until shape propagation);
    ``None`` when no dimension is symbolic."""
    def dims(v):
        if not isinstance(v, torch.Tensor):
            return None
        out = []
        for d in v.shape:
            if isinstance(d, torch.SymInt):
                expr = d.node.expr
                out.append(SymDim(str(expr), frozenset(str(x) for x in expr.free_symbols)))
            else:
                out.append(int(d))
        return tuple(out)

    import sympy

    def bound(b):  # torch's int_oo (unbounded) is a sympy Number but not an Integer
        return int(b) if isinstance(b, (int, sympy.Integer)) else None

    nodes = list(gm.graph.nodes)
    inputs = tuple(dims(n.meta.get("val")) for n in nodes if n.op == "placeholder")
    out = next(n for n in nodes if n.op == "output")
    outputs = tuple(dims(a.meta.get("val")) if isinstance(a, torch.fx.Node) else None for a in out.args[0])
    if not any(isinstance(d, SymDim) for t in inputs + outputs if t for d in t):
        return None
    ranges = {str(k): (bound(v.lower), bound(v.upper)) for k, v in getattr(ep, "range_constraints", {}).items()}
    return SymbolicShapes(inputs, outputs, ranges)


@contextlib.contextmanager
def _quiet_export():
    """torch.export's failures on data-dependent code print the partial graph to stderr and log a
    warning; the failure is reported (and another capture tried), so neither reaches the user."""
    log = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        log.setLevel(level)


CONSTANT_TYPES = (bool, int, float, str, type(None))


def _is_constant(v) -> bool:
    return isinstance(v, CONSTANT_TYPES) or isinstance(v, (torch.dtype, torch.device))


def tensor_leaves(leaves) -> list:
    """The tensor leaves of flattened inputs: what a captured graph takes, in order."""
    return [t for t in leaves if isinstance(t, torch.Tensor)]


class _WithConstants(torch.nn.Module):
    """``model`` called with its non-tensor inputs fixed: forward takes the tensor leaves only."""

    def __init__(self, model, spec, constants, n_leaves):
        super().__init__()
        self.model = model
        self._spec, self._constants, self._n = spec, dict(constants), n_leaves

    def forward(self, *tensors):
        it = iter(tensors)
        leaves = [self._constants[i] if i in self._constants else next(it) for i in range(self._n)]
        args, kwargs = pytree.tree_unflatten(leaves, self._spec)
        return self.model(*args, **kwargs)


def _register_library_pytrees(model) -> None:
    """Let torch.export trace through the output objects of model libraries: Hugging Face's cache
    classes (``DynamicCache`` ...), registered as pytree nodes by transformers' own exporter, so a
    decoder's ``past_key_values`` round-trips to the caller as the same type."""
    hf = next((m for m in model.modules() if (type(m).__module__ or "").startswith("transformers")), None)
    if hf is None:
        return
    model = hf
    try:
        from transformers.exporters.exporter_dynamo import register_cache_pytrees_for_model
    except ImportError:  # transformers before its exporters module: no cache outputs through export
        return
    try:
        register_cache_pytrees_for_model(model)
    except Exception:  # noqa: BLE001 - best effort; export says what it cannot trace
        pass


def _fx_capture(model, args, kwargs, flat_in) -> torch.fx.GraphModule:
    """symbolic_trace at module level, then make it flat-positional with ATen-free torch calls."""
    if kwargs:
        names = list(kwargs)

        class _Wrap(torch.nn.Module):
            def __init__(self, m):
                super().__init__()
                self.m = m

            def forward(self, *flat):
                a = flat[:len(args)]
                kw = dict(zip(names, flat[len(args):]))
                return self.m(*a, **kw)

        model = _Wrap(model)
    gm = torch.fx.symbolic_trace(model)
    for node in gm.graph.nodes:
        if node.op == "output":
            flat, _ = pytree.tree_flatten(node.args[0])
            node.args = (tuple(flat),)
    gm.recompile()
    return gm


def _propagate_shapes(gm: torch.fx.GraphModule, flat_in) -> None:
    """Record every node's output metadata (shapes, strides, dtypes) in ``node.meta['val']`` as
    meta tensors, by running the graph on fake tensors shaped like the example inputs (no real
    compute: at batch 16 a real run cost GPT-2 6.7 s of its optimize time). A graph that fake
    tensors cannot run (an op without a fake kernel) is run once on the real inputs instead."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    try:
        with torch.no_grad():
            mode = FakeTensorMode(allow_non_fake_inputs=True)
            fake_in = [mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in flat_in]
            with mode:
                _MetaRecorder(gm).run(*fake_in)
        return
    except Exception:  # noqa: BLE001 - fall back to the exact, slower way
        pass
    with torch.no_grad():  # on copies of the inputs (the graph may write into them)
        _MetaRecorder(gm).run(*[t.clone() if isinstance(t, torch.Tensor) else t for t in flat_in])


class _MetaRecorder(torch.fx.Interpreter):
    def run_node(self, n):
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        out = super().run_node(n)
        with unset_fake_temporarily():  # plain meta tensors, outside any fake mode
            n.meta["val"] = pytree.tree_map(
                lambda t: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
                if isinstance(t, torch.Tensor) else t, out)
        return out
