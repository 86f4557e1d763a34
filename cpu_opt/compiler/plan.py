"""A plan: everything compiled for one input signature of a captured graph — the passes run on it,
the int8 / bf16 rewrites, the oneDNN Graph lowering and the runtime program with its partition
steps (:func:`build_plan`). ``pipeline.py`` decides when a plan is built and checks its answers."""
from __future__ import annotations

import time

import torch
import torch.fx
import torch.utils._pytree as pytree

from . import passes
from ..errors import CpuOptError
from ..platform import routing
from ..progress import Progress
from .capture import _propagate_shapes

aten = torch.ops.aten


class KeptState:
    """The model's buffers as they were, put back after every run optimize makes on its own (the
    eager reference, the plan's first run, autotune's timings): a model that updates a buffer in
    forward (a step counter, a cache) has it updated by the user's calls only."""

    def __init__(self, model: torch.nn.Module):
        # cpu_opt's own constants (folded, packed: "_cpu_opt_*") are never written; plain layouts only;
        # a broadcast (zero-stride) buffer cannot be written either (cpu_opt.quant's weight stand-ins)
        self._saved = [(b, b.detach().clone()) for name, b in model.named_buffers()
                       if b.layout == torch.strided and not name.rsplit(".", 1)[-1].startswith("_cpu_opt_")
                       and not (b.numel() > 1 and 0 in b.stride())]

    def restore(self) -> None:
        with torch.no_grad():
            for b, v in self._saved:
                if b.shape == v.shape and b.dtype == v.dtype:
                    b.copy_(v)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.restore()
        return False


def copies(tree):
    """The same structure with every tensor cloned (models may write into their inputs)."""
    return pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, tree)


def cast_inputs_outputs(gm: torch.fx.GraphModule, dtype: torch.dtype, out_dtypes: list) -> None:
    """Cast floating graph inputs to ``dtype`` after the placeholders (those not in ``dtype`` already)
    and outputs back to the model's own dtypes."""
    g = gm.graph
    for n in list(g.nodes):
        if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].is_floating_point() \
                and n.meta["val"].dtype != dtype:  # one already in dtype (a bf16 KV cache) is used, and written, as it is
            with g.inserting_after(n):
                c = g.call_function(aten._to_copy.default, (n,), {"dtype": dtype})
            n.replace_all_uses_with(c, delete_user_cb=lambda u: u is not c)
    out = next(n for n in g.nodes if n.op == "output")
    flat = list(out.args[0])
    with g.inserting_before(out):
        for i, a in enumerate(flat):
            if isinstance(a, torch.fx.Node) and i < len(out_dtypes) and out_dtypes[i] is not None \
                    and out_dtypes[i].is_floating_point and out_dtypes[i] != dtype:
                flat[i] = g.call_function(aten._to_copy.default, (a,), {"dtype": out_dtypes[i]})
    out.args = (tuple(flat),)
    gm.recompile()


def channels_last_inputs(gm: torch.fx.GraphModule) -> bool:
    """For convolution networks: make 4-D float inputs channels-last at the graph input."""
    if not any(n.op == "call_function" and n.target == aten.conv2d.default for n in gm.graph.nodes):
        return False
    g = gm.graph
    for n in list(g.nodes):
        v = n.meta.get("val")
        if n.op == "placeholder" and isinstance(v, torch.Tensor) and v.dim() == 4 and v.is_floating_point():
            with g.inserting_after(n):
                c = g.call_function(aten.clone.default, (n,), {"memory_format": torch.channels_last})
            n.replace_all_uses_with(c, delete_user_cb=lambda u: u is not c)
    gm.recompile()
    return True


def why_not_onednn(dtype: str) -> str | None:
    """Why the oneDNN Graph path is not used for ``dtype`` here, or ``None`` when it is: oneDNN has
    no kernels for the dtype at the ISA it runs (the library is asked: bf16 below avx512_core would
    abort inside oneDNN 3.2), or routing sends every GEMM and convolution of the dtype elsewhere."""
    if dtype != "fp32":
        from ..dnnl import probe

        try:
            accepted = probe.accepts(dtype)
        except Exception as e:  # noqa: BLE001 - no binding: reported by the caller's engine check
            accepted, err = False, e
        else:
            err = None
        if not accepted:
            return (f"routing: {dtype} GEMM/conv work runs in torch on this CPU (oneDNN "
                    f"{'is unavailable: ' + str(err) if err else 'creates no ' + dtype + ' matmul at this ISA'})")
    rs = [routing.route(w, dtype) for w in ("gemm", "linear", "conv")]
    if all(r.backend != "onednn" for r in rs):
        return f"routing: {dtype} GEMM/conv work runs in torch on this CPU ({rs[0].why})"
    return None


class Plan:
    """Everything compiled for one input signature."""

    def __init__(self, program, steps, lowered, log, seconds):
        self.out_spec = None  # None: the module's captured output structure
        self.program = program
        self.steps = steps
        self.lowered = lowered
        self.log = log
        self.seconds = seconds


def build_plan(gm: torch.fx.GraphModule, flat_in, dtype: str, out_dtypes, verbose: bool, progress: Progress,
                use_onednn: bool = True, shapes_known: bool = True, measure: bool = False,
                exclude: dict | None = None, int8=None) -> Plan:
    from .lowering import lower
    from .runtime import build_program, chain_primitives

    t0 = time.perf_counter()
    kept = KeptState(gm)  # shape propagation may fall back to a real run, which updates buffers
    if not shapes_known:  # a re-plan of a dynamic capture for new input shapes
        _propagate_shapes(gm, flat_in)
    log = passes.run_passes(gm)
    progress.step("passes")
    int8_graph = dtype == "int8"
    if int8_graph:  # int8 layers in the graph (cpu_opt.quant.graph), everything else fp32
        from ..quant.graph import quantize_graph

        if int8 is None:
            raise CpuOptError("dtype='int8' needs calibration (optimize(..., calibration_data=...))")
        log += quantize_graph(gm, *int8)
        _propagate_shapes(gm, flat_in)
        dtype = "fp32"
    else:
        log += passes.merge_parallel_linears(gm)
    if dtype == "bf16":
        log += passes.cast_params(gm, torch.bfloat16)
        cast_inputs_outputs(gm, torch.bfloat16, out_dtypes)
        log += passes.match_operand_dtypes(gm, flat_in)
        _propagate_shapes(gm, flat_in)
    log += passes.route_attention(gm, dtype, int8=int8_graph)
    log += passes.shared_masks(gm)
    cl = channels_last_inputs(gm)
    if cl:
        log.append("convolution network: inputs and 4-D activations in channels-last")
    gm.recompile()
    _propagate_shapes(gm, flat_in)
    if use_onednn:
        log += passes.route_convs(gm, dtype)
        log += passes.route_linears(gm, dtype, measure=measure)
        log += passes.route_gelu(gm, dtype)
    progress.step("shapes")
    lowered = None
    if use_onednn:
        why_not = why_not_onednn(dtype)
        if why_not:
            log.append(why_not)
            use_onednn = False
    if use_onednn:
        try:
            from .. import dnnl

            dnnl.engine()
        except Exception as e:  # noqa: BLE001 - no binding here: everything runs in torch
            log.append(f"oneDNN unavailable ({e}); the graph runs in torch")
        else:
            try:
                lowered = lower(gm, dtype, exclude)
            except Exception as e:  # noqa: BLE001 - reported, and the graph still runs
                log.append(f"lowering to oneDNN Graph failed ({type(e).__name__}: {e}); the graph runs in torch")
    progress.step("lower + partition")
    if lowered is not None:
        program, steps = build_program(gm, lowered, channels_last=cl)
        log += chain_primitives(program)
    else:
        program, steps = gm, []
    kept.restore()
    with torch.no_grad():
        # compiles every partition for these shapes, allocates buffers; on copies, so a model that
        # writes into its inputs does not write into the caller's (the real call runs it once more)
        first = program(*copies(flat_in))
    progress.step("compile partitions")
    plan = Plan(program, steps, lowered, log, time.perf_counter() - t0)
    plan.first_output = first  # the caller validates it (or drops it)
    return plan
