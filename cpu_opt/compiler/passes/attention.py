"""Attention routing: :func:`route_attention` sends each ``scaled_dot_product_attention`` where the
attention route says (torch's flash kernel, or :mod:`cpu_opt.backends.attention`)."""
from __future__ import annotations

import torch
import torch.fx

from ...platform import routing

aten = torch.ops.aten


def route_attention(gm: torch.fx.GraphModule, dtype: str, int8: bool = False) -> list[str]:
    """Attention ops go where the attention route says: torch's flash kernel (the SDPA node as it is)
    or matmul -> softmax -> matmul in the graph's dtype (:mod:`cpu_opt.backends.attention`).

    ``int8``: the float32 attention of an int8 graph (its matmuls are not quantized) runs torch's flash
    kernel in bf16 where the CPU has native bf16 math and the bf16 route is that kernel: BERT-base's
    (1x12x128x64, padding mask, inputs strided views of the projections) 239 us with the casts against
    282 in fp32 alone, 375 against 410 inside the int8 model, relative error 3.7e-3 (Xeon with AMX,
    2 threads); the int8 layers around it are 1e-2 off already."""
    if int8 and dtype == "fp32" and routing.auto_dtype() == "bf16":
        rb = routing.route("attention", "bf16")
        if rb.backend == "torch_flash":
            from ...backends.attention import bf16_flash_attention

            done = []
            for n in gm.graph.nodes:
                if n.op == "call_function" and n.target == aten.scaled_dot_product_attention.default and \
                        not n.kwargs.get("dropout_p", n.args[4] if len(n.args) > 4 else 0.0):
                    n.target = bf16_flash_attention
                    done.append(n)
            n_bf16 = bf16_projections(gm, done)
            gm.recompile()
            return [f"{len(done)} attention op(s) of the int8 graph on torch's flash kernel in bf16 (native bf16 "
                    f"math here; {rb.why})" + (f"; {n_bf16} int8 projection(s) feeding them write bf16" if n_bf16 else "")
                    ] if done else []
    r = routing.route("attention", dtype)
    if r.backend not in ("bf16_matmul_softmax", "matmul_softmax"):
        return []
    from ...backends.attention import bf16_matmul_softmax_attention, matmul_softmax_attention

    target = bf16_matmul_softmax_attention if r.backend == "bf16_matmul_softmax" else matmul_softmax_attention
    n_done = 0
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target == aten.scaled_dot_product_attention.default:
            if n.kwargs.get("dropout_p", n.args[4] if len(n.args) > 4 else 0.0):
                continue  # dropout in attention: torch's kernel keeps its semantics
            n.target = target
            n_done += 1
    gm.recompile()
    return [f"{n_done} attention op(s) routed to {r.backend.replace('_', ' ')} ({r.why})"] if n_done else []


# ops that only re-view a projection's output on its way to an attention's query / key / value
_QKV_VIEWS = {aten.slice.Tensor, aten.view.default, aten.reshape.default, aten._unsafe_view.default,
              aten.transpose.int, aten.permute.default, aten.unsqueeze.default, aten.squeeze.dim}


def bf16_projections(gm: torch.fx.GraphModule, attention: list) -> int:
    """int8 layers whose float32 output is read only, through views, as the query, key or value of
    the bf16 ``attention`` nodes write bfloat16 themselves (the kernel converts in its epilogue), so
    the attention does not cast each of them (int8 BERT-base, Xeon with AMX: 36 casts of 12 x 128 x
    64 strided views, 13-30 us each). Returns how many layers changed."""
    qkv = {a for n in attention for a in n.args[:3] if isinstance(a, torch.fx.Node)}
    targets = set(attention)

    def only_qkv(v: torch.fx.Node) -> bool:
        for u in v.users:
            if u.op == "call_function" and u.target in _QKV_VIEWS and u.args[0] is v and \
                    all(a is not v for a in list(u.args[1:]) + list(u.kwargs.values())):
                if not only_qkv(u):
                    return False
            elif not (u in targets and v in u.args[:3] and all(a is not v for a in list(u.args[3:]) + list(u.kwargs.values()))):
                return False
        return True

    changed = set()
    for a in qkv:
        p = a
        while p.op == "call_function" and p.target in _QKV_VIEWS:
            p = p.args[0]
        k = p.target if p.op == "call_function" else None
        if p in changed or not getattr(k, "writes_bf16", False) or k.out_qparams is not None or \
                len(p.args) != 1 or not only_qkv(p):
            continue
        k.write_bf16()
        changed.add(p)
    return len(changed)
