"""Graph passes on the captured ATen-level FX graph, before lowering.

Each pass takes a GraphModule, rewrites it in place and returns a short log of what it did:

* :func:`drop_dropout` — dropout is the identity in inference
* :func:`remove_noops` — same-shape views/reshapes, ``clone``/``contiguous``/``alias``/``to`` that
  change nothing, export's tensor-metadata asserts and guards
* :func:`fold_batchnorm` — inference BatchNorm after a convolution or linear layer becomes part
  of its weights and bias
* :func:`fold_constants` — nodes computed only from parameters/buffers are computed once
* :func:`cast_params` — floating parameters and buffers converted once (bf16)
* :func:`route_linears` — GEMMs on constant weights whose route is ``torch_onednn`` become calls to
  torch's own oneDNN (``torch.ops.mkldnn._linear_pointwise``); with ``measure=True`` each weight
  shape is timed on both backends and the faster wins
"""
from __future__ import annotations

import operator

import torch
import torch.fx

aten = torch.ops.aten

DROPOUT = {aten.dropout.default, aten.dropout_.default, aten.feature_dropout.default,
           aten.alpha_dropout.default, torch.nn.functional.dropout}
VIEW_LIKE = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
IDENTITY_LIKE = {aten.clone.default, aten.contiguous.default, aten.alias.default, aten.detach.default,
                 aten.lift_fresh_copy.default}
ASSERTS = {aten._assert_tensor_metadata.default, aten._assert_async.msg, aten._assert_scalar.default,
           aten.sym_constrain_range_for_size.default}


def _val(n):
    return n.meta.get("val") if isinstance(n, torch.fx.Node) else None


def _replace(node: torch.fx.Node, with_: torch.fx.Node) -> None:
    node.replace_all_uses_with(with_)
    node.graph.erase_node(node)


def drop_dropout(gm: torch.fx.GraphModule) -> list[str]:
    log = []
    for n in list(gm.graph.nodes):
        if n.op == "call_function" and n.target in DROPOUT:
            _replace(n, n.args[0])
            log.append(n.name)
        elif n.op == "call_module" and isinstance(gm.get_submodule(n.target), torch.nn.Dropout):
            _replace(n, n.args[0])
            log.append(n.name)
    return [f"dropped {len(log)} dropout op(s)"] if log else []


def remove_noops(gm: torch.fx.GraphModule) -> list[str]:
    removed = 0
    # a copy that an in-place op writes into (or whose source one writes into) is what keeps the
    # two apart: it is not a no-op, whatever its shape
    written = {storage_root(w) for n in gm.graph.nodes for w in writes_in_place(n)}
    for n in list(gm.graph.nodes):
        if n.op != "call_function":
            continue
        if n.target in ASSERTS and not n.users:
            gm.graph.erase_node(n)
            removed += 1
            continue
        src = n.args[0] if n.args else None
        vi, vo = _val(src), _val(n)
        same = isinstance(vi, torch.Tensor) and isinstance(vo, torch.Tensor) and vi.shape == vo.shape \
            and vi.dtype == vo.dtype and vi.stride() == vo.stride()
        if not same:
            continue
        fmt = n.kwargs.get("memory_format")
        copies = n.target in IDENTITY_LIKE or n.target in (aten.to.dtype, aten._to_copy.default, aten.to.dtype_layout)
        if copies and (n in written or (isinstance(src, torch.fx.Node) and storage_root(src) in written)):
            continue
        if n.target in VIEW_LIKE or (n.target in IDENTITY_LIKE and fmt in (None, torch.preserve_format)) \
                or n.target in (aten.to.dtype, aten._to_copy.default, aten.to.dtype_layout):
            _replace(n, src)
            removed += 1
    for n in list(gm.graph.nodes):  # export's guard module, when present
        if n.op == "call_module" and n.target == "_guards_fn":
            gm.graph.erase_node(n)
            removed += 1
    return [f"removed {removed} no-op reshape/copy/assert node(s)"] if removed else []


def _get_param(gm, node):
    if node is None:
        return None
    if node.op != "get_attr":
        raise _NotFoldable
    obj = gm
    for part in node.target.split("."):
        obj = getattr(obj, part)
    return obj


class _NotFoldable(Exception):
    pass


_new_attr = iter(range(1 << 30))


def _add_param(gm, tensor, before: torch.fx.Node, hint: str, meta_like: torch.Tensor | None = None) -> torch.fx.Node:
    """A constant of cpu_opt's making (folded, transposed, prepacked) as a buffer of ``gm``;
    ``meta_like`` describes it where the tensor itself has no plain layout (an mkldnn-packed weight)."""
    name = f"_cpu_opt_{hint}_{next(_new_attr)}"
    gm.register_buffer(name, tensor.detach() if tensor.layout != torch.strided else tensor.detach().contiguous())
    with gm.graph.inserting_before(before):
        node = gm.graph.get_attr(name)
    node.meta["val"] = torch.empty_like(meta_like if meta_like is not None else tensor, device="meta")
    return node


def _bn_params(gm, n):
    """(weight, bias, mean, var, eps) of an inference batch-norm node, or None."""
    if n.target == aten.batch_norm.default:
        x, w, b, mean, var, training, _mom, eps = n.args[:8]
        if training:
            return None
    elif n.target == aten._native_batch_norm_legit_no_training.default:
        x, w, b, mean, var, _mom, eps = n.args[:7]
    else:
        return None
    try:
        return [_get_param(gm, t) for t in (w, b, mean, var)] + [float(eps)]
    except _NotFoldable:
        return None


def fold_batchnorm(gm: torch.fx.GraphModule) -> list[str]:
    folded = 0
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or n.target not in (aten.batch_norm.default,
                                                       aten._native_batch_norm_legit_no_training.default):
            continue
        prod = n.args[0]
        if not isinstance(prod, torch.fx.Node) or prod.op != "call_function" or len(prod.users) != 1:
            continue
        if prod.target not in (aten.conv2d.default, aten.linear.default, aten.convolution.default):
            continue
        p = _bn_params(gm, n)
        if p is None:
            continue
        bw, bb, mean, var, eps = p
        try:
            w = _get_param(gm, prod.args[1])
            b = _get_param(gm, prod.args[2] if len(prod.args) > 2 else None)
        except _NotFoldable:
            continue
        if prod.target == aten.convolution.default and prod.args[6]:  # transposed
            continue
        with torch.no_grad():
            scale = (bw if bw is not None else torch.ones_like(var)) / torch.sqrt(var + eps)
            shift = (bb if bb is not None else torch.zeros_like(mean)) - mean * scale
            shape = (-1,) + (1,) * (w.dim() - 1)
            new_w = (w.double() * scale.double().reshape(shape)).to(w.dtype)
            new_b = ((b.double() if b is not None else torch.zeros_like(mean, dtype=torch.float64)) * scale.double()
                     + shift.double()).to(w.dtype)
        wn = _add_param(gm, new_w, prod, "w")
        bn = _add_param(gm, new_b, prod, "b")
        args = list(prod.args)
        args[1] = wn
        if len(args) > 2:
            args[2] = bn
        else:
            args.append(bn)
        prod.args = tuple(args)
        if n.target == aten._native_batch_norm_legit_no_training.default:
            for u in list(n.users):
                if u.target is operator.getitem and u.args[1] == 0:
                    _replace(u, prod)
            if not n.users:
                gm.graph.erase_node(n)
        else:
            _replace(n, prod)
        folded += 1
    gm.graph.eliminate_dead_code()
    _drop_unused_attrs(gm)
    return [f"folded {folded} BatchNorm(s) into conv/linear weights"] if folded else []


def _drop_unused_attrs(gm):
    used = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    for name, _ in list(gm.named_buffers()) + list(gm.named_parameters()):
        if name.startswith("_cpu_opt_") and name not in used:
            delattr(gm, name)


_NONDETERMINISTIC = {aten.rand.default, aten.randn.default, aten.randint.low, aten.bernoulli.default,
                     aten.empty.memory_format, aten.empty_like.default}


def writes_in_place(n: torch.fx.Node) -> list[torch.fx.Node]:
    """The argument nodes ``n`` writes into (in-place ops, ``out=`` variants, ``copy_``): the schema
    arguments annotated ``Tensor(a!)``. Empty for everything else."""
    schema = getattr(n.target, "_schema", None) if n.op == "call_function" else None
    if schema is None or not schema.is_mutable:
        return []
    out = []
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        v = n.args[i] if i < len(n.args) else n.kwargs.get(arg.name)
        if isinstance(v, torch.fx.Node):
            out.append(v)
    return out


def storage_root(n: torch.fx.Node) -> torch.fx.Node:
    """The node whose storage ``n`` may view: follows ops whose schema says the output aliases
    their first input (views, in-place ops) back to where the memory was made."""
    seen = set()
    while n.op == "call_function" and n not in seen:
        seen.add(n)
        schema = getattr(n.target, "_schema", None)
        if schema is None or not any(r.alias_info is not None for r in schema.returns):
            break
        src = n.args[0] if n.args and isinstance(n.args[0], torch.fx.Node) else None
        if src is None:
            break
        n = src
    return n


def mutated_state(gm: torch.fx.GraphModule) -> set:
    """Placeholders and get_attr nodes (model inputs, parameters, buffers) the graph writes into."""
    out = set()
    for n in gm.graph.nodes:
        for w in writes_in_place(n):
            root = storage_root(w)
            if root.op in ("placeholder", "get_attr"):
                out.add(root)
    return out


def fold_constants(gm: torch.fx.GraphModule) -> list[str]:
    """Evaluate nodes whose inputs are all parameters/buffers/literals, once. A buffer the graph
    writes into (a running count, a cache) is state, not a constant: nothing reading it is folded,
    and no in-place op is ever evaluated here (it would write into the model's own tensors)."""
    const: dict[torch.fx.Node, object] = {}
    state = mutated_state(gm)
    folded = 0
    for n in list(gm.graph.nodes):
        if n.op == "get_attr":
            if n in state:
                continue
            try:
                const[n] = _get_param(gm, n)
            except Exception:
                pass
            continue
        if n.op != "call_function" or n.target in _NONDETERMINISTIC or n.target in ASSERTS or writes_in_place(n):
            continue
        inputs = n.all_input_nodes
        if not inputs or not all(i in const for i in inputs):
            continue
        args, kwargs = torch.fx.node.map_arg((n.args, n.kwargs), lambda a: const[a])
        try:
            with torch.no_grad():
                val = n.target(*args, **kwargs)
        except Exception:
            continue
        if isinstance(val, torch.Tensor):
            node = _add_param(gm, val.clone(), n, "const")
            const[node] = val
            _replace(n, node)
            folded += 1
        else:
            const[n] = val
    gm.graph.eliminate_dead_code()
    _drop_unused_attrs(gm)
    return [f"folded {folded} constant subexpression(s)"] if folded else []


def cast_params(gm: torch.fx.GraphModule, dtype: torch.dtype) -> list[str]:
    """Convert every floating parameter/buffer to ``dtype`` once."""
    n = 0
    for mod in gm.modules():
        for name, p in list(mod.named_parameters(recurse=False)):
            if p.is_floating_point() and p.dtype != dtype:
                mod._parameters[name] = torch.nn.Parameter(p.detach().to(dtype), requires_grad=False)
                n += 1
        for name, b in list(mod.named_buffers(recurse=False)):
            if b is not None and b.is_floating_point() and b.dtype != dtype:
                mod._buffers[name] = b.to(dtype)
                n += 1
    return [f"cast {n} parameter/buffer tensor(s) to {dtype}"] if n else []


TORCH_LINEAR = torch.ops.mkldnn._linear_pointwise.default


def _linear_operands(gm, n, dtype: torch.dtype = torch.float32):
    """``(x, weight node, weight tensor, weight is (K, N), bias node)`` if ``n`` is a ``dtype`` GEMM on
    a constant 2-D weight (``linear``, ``addmm`` with a 1-D constant bias, ``mm``), else ``None``."""
    if n.op != "call_function":
        return None
    if n.target == aten.linear.default:
        x, w = n.args[:2]
        b, kn = (n.args[2] if len(n.args) > 2 else None), False
    elif n.target == aten.addmm.default:
        if n.kwargs.get("beta", 1) != 1 or n.kwargs.get("alpha", 1) != 1:
            return None
        b, x, w = n.args[:3]
        kn = True
    elif n.target == aten.mm.default:
        (x, w), b, kn = n.args[:2], None, True
    else:
        return None
    vx = _val(x)
    if not isinstance(w, torch.fx.Node) or w.op != "get_attr" or not isinstance(vx, torch.Tensor):
        return None
    if b is not None and (not isinstance(b, torch.fx.Node) or b.op != "get_attr"):
        return None
    try:
        wt, bt = _get_param(gm, w), _get_param(gm, b)
    except _NotFoldable:
        return None
    if vx.dtype != dtype or wt.dtype != dtype or wt.dim() != 2 or vx.dim() < 2:
        return None
    if bt is not None and (bt.dim() != 1 or bt.dtype != dtype):
        return None
    return x, w, wt, kn, b


_LINEAR_TIMES: dict = {}


def measure_linear(m: int, k: int, n: int, bias: bool, repeats: int = 7) -> dict:
    """Median seconds of ``(m, k) @ (k, n)`` on cpu_opt's oneDNN 3.2 (packed weights) and on torch's
    oneDNN (``_linear_pointwise``), interleaved on the same random tensors; cached per shape."""
    key = (m, k, n, bias, torch.get_num_threads())
    if key in _LINEAR_TIMES:
        return _LINEAR_TIMES[key]
    import time

    from .dnnl.primitives import Matmul

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    ours = Matmul.from_linear(w, b)
    fns = {"onednn": lambda: ours(x), "torch_onednn": lambda: TORCH_LINEAR(x, w, b, "none", [], "")}
    times = {name: [] for name in fns}
    for f in fns.values():
        f()  # create and pack outside the timing
    for _ in range(repeats):
        for name, f in fns.items():
            t0 = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - t0)
    _LINEAR_TIMES[key] = res = {name: sorted(ts)[len(ts) // 2] for name, ts in times.items()}
    return res


def _packed_linear_weight(w_nk: torch.Tensor, rows: int) -> torch.Tensor:
    """``mkldnn._reorder_linear_weight``: (N, K) weights in the layout torch's oneDNN linear wants
    for ``rows`` activation rows (an mkldnn tensor); the plain weights where torch cannot pack."""
    try:
        return torch.ops.mkldnn._reorder_linear_weight(w_nk.detach().contiguous(), rows)
    except (RuntimeError, AttributeError):
        return w_nk.detach().contiguous()


def route_linears(gm: torch.fx.GraphModule, dtype: str, measure: bool = False) -> list[str]:
    """Give every GEMM on constant weights its own route (``routing.route("linear", dtype,
    rows=...)``: this machine's measured profile for the layer's row class, else the table), or,
    with ``measure``, the faster of cpu_opt's oneDNN and torch's oneDNN timed on the layer's shape.

    Each layer records ``(backend, why)`` in ``node.meta["cpu_opt_route"]``: ``onednn`` stays for
    lowering into oneDNN Graph partitions; ``torch_onednn`` becomes ``mkldnn._linear_pointwise(x, W,
    b)`` with ``W`` an (N, K) buffer (fp32 only); ``torch`` stays the ATen op, run by torch."""
    from .platform import routing

    if dtype not in ("fp32", "bf16"):
        return []
    moved = kept = in_torch = 0
    for n in list(gm.graph.nodes):
        ops = _linear_operands(gm, n, torch.float32 if dtype == "fp32" else torch.bfloat16)
        if ops is None:
            continue
        x, w, wt, kn, b = ops
        w_nk = wt.t() if kn else wt
        vx = _val(x)
        rows = vx.numel() // max(vx.shape[-1], 1)
        r = routing.route("linear", dtype, rows=rows, macs=rows * w_nk.shape[0] * w_nk.shape[1])
        backend, why = r.backend, r.why
        if measure and vx.numel() > 0 and dtype == "fp32":
            t = measure_linear(rows, w_nk.shape[1], w_nk.shape[0], b is not None)
            backend = min(t, key=t.get)
            why = (f"measured on this shape: cpu_opt oneDNN {t['onednn'] * 1e3:.3f} ms, "
                   f"torch's oneDNN {t['torch_onednn'] * 1e3:.3f} ms")
        if backend == "torch_onednn" and dtype != "fp32":
            backend, why = "onednn", f"torch's oneDNN linear is wired for fp32 only; {why}"
        if backend not in ("torch_onednn", "torch"):
            n.meta["cpu_opt_route"] = ("onednn", why)
            kept += 1
            continue
        if backend == "torch":
            n.meta["cpu_opt_route"] = ("torch", why)
            in_torch += 1
            continue
        # the weights packed once into oneDNN's blocked layout for this batch (rows), as torch's own
        # frozen graphs do: 3-7% faster per call than handing it the (N, K) weights (128x768x3072:
        # 7.46 vs 7.67 ms; 2048x768x3072: 74.8 vs 80.4; Zen 3, interleaved medians)
        w_node = _add_param(gm, _packed_linear_weight(w_nk, rows), n, "linear_packed", meta_like=w_nk)
        with gm.graph.inserting_before(n):
            new = gm.graph.call_function(TORCH_LINEAR, (x, w_node, b, "none", [], ""))
        new.meta = dict(n.meta)
        new.meta["cpu_opt_route"] = ("torch_onednn", why)
        name = n.name
        _replace(n, new)
        new._rename(name)  # the report names the layer as the captured graph did
        moved += 1
    if not moved and not in_torch:
        return []
    gm.graph.eliminate_dead_code()
    _drop_unused_attrs(gm)
    gm.recompile()
    how = "measured per shape" if measure else "routing"
    parts = [f"{moved} linear layer(s) on torch's oneDNN 3.12"] if moved else []
    parts += [f"{in_torch} in torch's own kernels"] if in_torch else []
    return [", ".join(parts) + f", {kept} on cpu_opt's oneDNN ({how})"]


DEFAULT_PASSES = (drop_dropout, remove_noops, fold_batchnorm, fold_constants)


def run_passes(gm: torch.fx.GraphModule, passes=DEFAULT_PASSES) -> list[str]:
    log = []
    for p in passes:
        log += p(gm)
        gm.graph.lint()
    gm.recompile()
    return log
