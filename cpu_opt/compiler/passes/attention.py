"""Attention routing: :func:`route_attention` sends each ``scaled_dot_product_attention`` where the
attention route says (torch's flash kernel, or :mod:`cpu_opt.backends.attention`)."""
from __future__ import annotations

import torch
import torch.fx

from ...platform import routing

aten = torch.ops.aten


def route_attention(gm: torch.fx.GraphModule, dtype: str) -> list[str]:
    """Attention ops go where the attention route says: torch's flash kernel (the SDPA node as it is)
    or matmul -> softmax -> matmul in the graph's dtype (:mod:`cpu_opt.backends.attention`)."""
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
