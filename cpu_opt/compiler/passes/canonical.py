"""Canonical forms that let the later passes and oneDNN Graph see what a model's code spelled out
by hand:

* :func:`tanh_gelu` — the tanh GELU written element by element (GPT-2's ``NewGELUActivation``:
  ``0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x**3)))``, seven ATen ops, its ``pow`` outside
  oneDNN Graph) becomes one ``aten.gelu(x, approximate="tanh")``;
* :func:`residual_add_after_view` — ``add(view(mm(x, W), shape), r)`` (GPT-2's Conv1D: a 2-D addmm
  viewed back to 3-D before the residual add) becomes ``view(add(mm(x, W), reshape(r)), shape)``,
  so the add directly follows the GEMM: oneDNN Graph fuses it as a post-op, and the int8 pass fuses
  it into the int8 layer.

Both are exact rewrites (the same ops on the same values), checked against eager in the tests.
"""
from __future__ import annotations

import math

import torch
import torch.fx

from .fx import node_value

aten = torch.ops.aten

_MUL = (aten.mul.Tensor,)
_ADD = (aten.add.Tensor,)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def _scaled(n, target_ops=_MUL):
    """``(tensor node, scalar)`` for ``op(t, c)`` / ``op(c, t)`` with a Python number ``c``, else None."""
    if not isinstance(n, torch.fx.Node) or n.op != "call_function" or n.target not in target_ops or n.kwargs:
        return None
    if len(n.args) != 2:
        return None
    a, b = n.args
    if isinstance(a, torch.fx.Node) and isinstance(b, (int, float)) and not isinstance(b, bool):
        return a, float(b)
    if isinstance(b, torch.fx.Node) and isinstance(a, (int, float)) and not isinstance(a, bool):
        return b, float(a)
    return None


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-6 * max(1.0, abs(b))


def _tanh_gelu_input(tanh: torch.fx.Node):
    """``x`` when ``tanh`` is ``tanh(sqrt(2/pi) * (x + 0.044715 * x**3))``, else None."""
    inner = _scaled(tanh.args[0])
    if inner is None or not _close(inner[1], _SQRT_2_OVER_PI):
        return None
    s = inner[0]
    if s.op != "call_function" or s.target not in _ADD or len(s.args) != 2 or s.kwargs:
        return None
    for x, cube in (s.args, s.args[::-1]):
        c = _scaled(cube)
        if c is None or not _close(c[1], 0.044715) or not isinstance(x, torch.fx.Node):
            continue
        p = c[0]
        if p.op == "call_function" and p.target == aten.pow.Tensor_Scalar and p.args[0] is x and p.args[1] in (3, 3.0):
            return x
    return None


def tanh_gelu(gm: torch.fx.GraphModule) -> list[str]:
    done = 0
    for t in list(gm.graph.nodes):
        if t.op != "call_function" or t.target != aten.tanh.default or len(t.users) != 1:
            continue
        x = _tanh_gelu_input(t)
        if x is None:
            continue
        one_plus = next(iter(t.users))
        op = _scaled(one_plus, _ADD)
        if op is None or op[0] is not t or not _close(op[1], 1.0) or len(one_plus.users) != 1:
            continue
        final = next(iter(one_plus.users))
        if final.op != "call_function" or final.target not in _MUL or len(final.args) != 2 or final.kwargs:
            continue
        half = final.args[0] if final.args[1] is one_plus else final.args[1] if final.args[0] is one_plus else None
        h = _scaled(half)
        if h is None or h[0] is not x or not _close(h[1], 0.5):
            continue
        with gm.graph.inserting_before(final):
            g = gm.graph.call_function(aten.gelu.default, (x,), {"approximate": "tanh"})
        g.meta = dict(final.meta)
        final.replace_all_uses_with(g)
        gm.graph.erase_node(final)
        done += 1
    if done:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return [f"{done} tanh GELU(s) written out element by element became aten.gelu(approximate='tanh')"] if done else []


_GEMM = (aten.addmm.default, aten.mm.default, aten.linear.default)
_VIEW = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)


def residual_add_after_view(gm: torch.fx.GraphModule) -> list[str]:
    done = 0
    for add in list(gm.graph.nodes):
        if add.op != "call_function" or add.target != aten.add.Tensor or len(add.args) != 2 \
                or add.kwargs.get("alpha", 1) != 1:
            continue
        for view, r in (add.args, add.args[::-1]):
            if not (isinstance(view, torch.fx.Node) and isinstance(r, torch.fx.Node) and view.op == "call_function"
                    and view.target in _VIEW and len(view.users) == 1):
                continue
            mm = view.args[0]
            if not (isinstance(mm, torch.fx.Node) and mm.op == "call_function" and mm.target in _GEMM
                    and len(mm.users) == 1):
                continue
            vm, vv, vr, va = (node_value(n) for n in (mm, view, r, add))
            if not all(isinstance(v, torch.Tensor) for v in (vm, vv, vr, va)) or vr.shape != vv.shape \
                    or va.shape != vv.shape or len({vm.dtype, vr.dtype, va.dtype}) != 1 or vm.numel() != vr.numel():
                continue
            with gm.graph.inserting_before(add):
                r2 = gm.graph.call_function(aten.reshape.default, (r, list(vm.shape)))
                a2 = gm.graph.call_function(aten.add.Tensor, (mm, r2))
                v2 = gm.graph.call_function(view.target, (a2, *view.args[1:]))
            r2.meta["val"] = torch.empty(vm.shape, dtype=vr.dtype, device="meta")
            a2.meta = {k: v for k, v in add.meta.items() if k != "val"}
            a2.meta["val"] = torch.empty(vm.shape, dtype=va.dtype, device="meta")
            v2.meta = dict(add.meta)
            add.replace_all_uses_with(v2)
            gm.graph.erase_node(add)
            gm.graph.erase_node(view)
            done += 1
            break
    if done:
        gm.recompile()
    return [f"{done} residual add(s) moved before the view after their GEMM (fusable there)"] if done else []
