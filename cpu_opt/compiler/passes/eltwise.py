"""Elementwise routing: :func:`route_gelu` sends the exact GELU after a linear layer that runs
outside oneDNN Graph (on torch's oneDNN or in torch) to cpu_opt's vectorized kernel
(:mod:`cpu_opt.backends.native_eltwise`). Where the linear layer is lowered into oneDNN Graph the
GELU stays there: oneDNN fuses it into the MatMul as a post-op."""
from __future__ import annotations

import torch
import torch.fx

aten = torch.ops.aten


def route_gelu(gm: torch.fx.GraphModule, dtype: str) -> list[str]:
    from ...backends import native_eltwise

    log = _route_tanh_gelu(gm, dtype)
    if dtype != "fp32" or not native_eltwise.available():
        return log
    done = in_place = 0
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target != aten.gelu.default:
            continue
        if (n.kwargs.get("approximate", n.args[1] if len(n.args) > 1 else "none")) != "none":
            continue
        x = n.args[0]
        route = x.meta.get("cpu_opt_route") if isinstance(x, torch.fx.Node) else None
        v = n.meta.get("val")
        if route is None or route[0] == "onednn" or not isinstance(v, torch.Tensor) or v.dtype != torch.float32:
            continue
        # the linear layer's fresh output read by nothing else: overwrite it
        alone = len(x.users) == 1 and x.op == "call_function"
        n.target = native_eltwise.gelu_ if alone else native_eltwise.gelu
        n.args, n.kwargs = (x,), {}
        n.meta["cpu_opt_route"] = ("native", "cpu_opt's vectorized erf GELU after a linear layer outside oneDNN Graph "
                                   "(2.3-2.6x torch's GELU, measured)")
        done += 1
        in_place += alone
    if done:
        gm.recompile()
    return log + ([f"{done} GELU(s) on cpu_opt's native kernel ({in_place} in place)"] if done else [])


def _route_tanh_gelu(gm: torch.fx.GraphModule, dtype: str) -> list[str]:
    """Every tanh GELU out of oneDNN Graph, in place where nothing else reads the input: oneDNN Graph
    3.2 has only the erf GELU, so the tanh form lowered into three partitions (508 us at 128x3072 fp32,
    4.7 ms of GPT-2's bf16 step), and torch's own tanh GELU is scalar (343 us). fp32 goes to cpu_opt's
    vectorized kernel (:func:`cpu_opt.backends.native_eltwise.gelu_tanh`: 0.15 ms there; GPT-2's 12 took
    14.7 ms on the oneDNN primitive at batch 1, Zen 3), bf16 (and fp32 without the vector kernels) to
    cpu_opt's oneDNN eltwise primitive (:class:`cpu_opt.backends.onednn_primitives.OnednnEltwise`)."""
    from ...backends import native_eltwise
    from ...backends.onednn_primitives import OnednnEltwise

    if dtype not in ("fp32", "bf16"):
        return []
    on_native = dtype == "fp32" and native_eltwise.available()
    done = 0
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target != aten.gelu.default:
            continue
        if (n.kwargs.get("approximate", n.args[1] if len(n.args) > 1 else "none")) != "tanh":
            continue
        x, v = n.args[0], n.meta.get("val")
        if not isinstance(v, torch.Tensor) or v.dtype not in (torch.float32, torch.bfloat16):
            continue
        native_here = on_native and v.dtype == torch.float32
        if not native_here and not _eltwise_runs(v.dtype):
            continue   # no kernel here for it (bf16 below avx512_core): torch keeps it
        alone = isinstance(x, torch.fx.Node) and _only_reader(x, n)
        n.args, n.kwargs = (x,), {}
        if native_here:
            n.target = native_eltwise.gelu_tanh_ if alone else native_eltwise.gelu_tanh
            n.meta["cpu_opt_route"] = ("native", "the tanh GELU on cpu_opt's vectorized kernel (oneDNN Graph 3.2 has "
                                       "only the erf GELU; 128x3072: 0.15 ms, torch 0.72, measured)")
        else:
            n.target = OnednnEltwise("gelu_tanh", in_place=alone)
            n.meta["cpu_opt_route"] = ("onednn_eltwise", "the tanh GELU on cpu_opt's oneDNN eltwise primitive (oneDNN "
                                       "Graph 3.2 has only the erf GELU; measured 508 us as three partitions, 343 in "
                                       "torch)")
        done += 1
    if done:
        gm.recompile()
    where = "cpu_opt's native kernel" if on_native else "cpu_opt's oneDNN eltwise primitive"
    return [f"{done} tanh GELU(s) on {where}"] if done else []


_ELTWISE_RUNS: dict = {}


def _eltwise_runs(dtype: torch.dtype) -> bool:
    """Does cpu_opt's oneDNN create a tanh-GELU eltwise primitive for ``dtype`` at the ISA in force (bf16
    needs avx512_core: below it oneDNN 3.2 answers unimplemented)? Asked once per dtype and ISA cap."""
    from ...platform import hw

    key = (dtype, hw.detect().isa_cap)
    if key not in _ELTWISE_RUNS:
        try:
            from ...dnnl.primitives import Eltwise

            Eltwise("gelu_tanh", (16,), dtype)(torch.zeros(16, dtype=dtype))
            _ELTWISE_RUNS[key] = True
        except Exception:  # noqa: BLE001 - no library, or no kernel for the dtype here: the node stays
            _ELTWISE_RUNS[key] = False
    return _ELTWISE_RUNS[key]


def _only_reader(x: torch.fx.Node, user: torch.fx.Node) -> bool:
    """Is ``user`` the only reader of ``x``'s memory: ``x`` and every node it views back to where the
    memory was made (an op's fresh output, not a graph input or constant) have exactly one user each?
    Then ``user`` may write into it."""
    n, reader = x, user
    for _ in range(64):
        if n.op != "call_function" or list(n.users) != [reader]:
            return False
        schema = getattr(n.target, "_schema", None)
        if schema is None:   # a Python callable: its output may alias anything, unless it says otherwise
            return getattr(n.target, "returns_fresh", False)
        if not any(r.alias_info is not None for r in schema.returns):
            return True    # a fresh output, read only through the chain
        src = n.args[0] if n.args and isinstance(n.args[0], torch.fx.Node) else None
        if src is None:
            return False
        n, reader = src, n
    return False
