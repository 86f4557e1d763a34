"""Attention routing: :func:`route_attention` sends each ``scaled_dot_product_attention`` where the
attention route says (torch's flash kernel, or :mod:`cpu_opt.backends.attention`)."""
from __future__ import annotations

import torch
import torch.fx

from ...platform import routing

aten = torch.ops.aten


def route_attention(gm: torch.fx.GraphModule, dtype: str, int8: bool = False) -> list[str]:
    """Attention ops go where the attention route says: torch's flash kernel (the SDPA node as it is),
    matmul -> softmax -> matmul in the graph's dtype, or cpu_opt's fused kernels
    (:mod:`cpu_opt.backends.attention`: bf16 graphs on CPUs with AVX512_BF16 and no AMX, float32 graphs
    on CPUs with AVX-512 or AVX2; on AVX2 only from 12 queries: a decoder's one-token steps stay on torch's kernel).

    ``int8``: the float32 attention of an int8 graph (its matmuls are not quantized) runs cpu_opt's fused
    bf16 kernel where the ``attention``/``int8`` route says so (:func:`cpu_opt.backends.attention.amx_attention`
    on CPUs with AMX tiles, :func:`~cpu_opt.backends.attention.dpbf16_attention` on CPUs with AVX512_BF16
    and no AMX; the table :data:`cpu_opt.backends.attention.ROUTES`), else (the int8 route is torch's
    flash kernel, or its own kernel does not run under the ISA cap) torch's flash kernel in bf16: BERT-base's
    (1x12x128x64, padding mask, inputs strided views of the projections) 239 us with the casts against
    282 in fp32 alone, 375 against 410 inside the int8 model, relative error 3.7e-3 (Xeon with AMX,
    2 threads); the int8 layers around it are 1e-2 off already."""
    if int8 and dtype == "fp32" and routing.auto_dtype() == "bf16":
        from ...backends import attention as battn

        ra, rb = routing.route("attention", "int8"), routing.route("attention", "bf16")
        fn = battn.routed(ra.backend, "int8")
        if fn is None and ((ra.backend, "int8") in battn.ROUTES or rb.backend == "torch_flash"):
            fn = battn.bf16_flash_attention   # the int8 route's kernel does not run here (ISA cap)
        if fn is not None:
            done = []
            for n in gm.graph.nodes:
                if n.op == "call_function" and n.target == aten.scaled_dot_product_attention.default and \
                        not n.kwargs.get("dropout_p", n.args[4] if len(n.args) > 4 else 0.0):
                    n.target = fn
                    done.append(n)
            n_bf16 = bf16_projections(gm, done)
            gm.recompile()
            where = f"cpu_opt's fused {ra.backend} kernel ({ra.why})" if fn is not battn.bf16_flash_attention else \
                f"torch's flash kernel in bf16 (native bf16 math here; {rb.why})"
            return [f"{len(done)} attention op(s) of the int8 graph on {where}"
                    + (f"; {n_bf16} int8 projection(s) feeding them write bf16" if n_bf16 else "")] if done else []
    from ...backends import attention as battn

    done: dict = {}   # route -> how many attention ops took it
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target == aten.scaled_dot_product_attention.default:
            if n.kwargs.get("dropout_p", n.args[4] if len(n.args) > 4 else 0.0):
                continue  # dropout in attention: torch's kernel keeps its semantics
            # the route by the number of queries where the graph fixes it (a decoder's one-token step
            # stays on torch's kernel where a rule's min_rows says so), else the route of any count
            r = routing.route("attention", dtype, rows=_queries(n))
            target = battn.routed(r.backend, dtype)
            if target is None:
                continue
            n.target = target
            done[r] = done.get(r, 0) + 1
    if not done:
        return []
    gm.recompile()
    return [f"{k} attention op(s) routed to {r.backend.replace('_', ' ')} ({r.why})" for r, k in done.items()]


def _queries(n: torch.fx.Node):
    """The query count of an SDPA node (its query's second-to-last dimension) when the captured
    graph fixes it, else None (symbolic or unknown)."""
    qv = n.args[0].meta.get("val") if isinstance(n.args[0], torch.fx.Node) else None
    if isinstance(qv, torch.Tensor) and qv.dim() >= 2 and isinstance(qv.shape[-2], int):
        return qv.shape[-2]
    return None


def shared_masks(gm: torch.fx.GraphModule) -> list[str]:
    """A boolean mask read by several attention ops on torch's kernel becomes one additive mask,
    made once per call, which they all read. torch's SDPA turns a boolean mask into that additive
    mask (0 / -inf in the query's dtype) inside every call: BERT-base's 12 layers made 12 of them
    from one padding mask (the flash kernel 1x12x128x64 bf16: 157 us with the boolean mask, 142 with
    the additive one; Xeon with AMX, 2 threads). The numbers are the same: torch computes exactly
    this tensor itself. The matmul -> softmax -> matmul route (bf16 without AMX) reads it too, in
    float32, its scores' dtype: adding 0 / -inf gives what its ``masked_fill`` of the boolean mask gave."""
    from ...backends.attention import (additive_mask, amx_attention, bf16_flash_attention,
                                       bf16_matmul_softmax_attention, dpbf16_attention, dpbf16_attention_bf16,
                                       f32_attention, matmul_softmax_attention)

    float32_scores = (amx_attention, dpbf16_attention, dpbf16_attention_bf16, f32_attention, matmul_softmax_attention,
                      bf16_matmul_softmax_attention)
    groups: dict = {}
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target not in (aten.scaled_dot_product_attention.default, bf16_flash_attention,
                                                       *float32_scores):
            continue
        in_args = len(n.args) > 3
        mask = n.args[3] if in_args else n.kwargs.get("attn_mask")
        mv, qv = getattr(mask, "meta", {}).get("val"), n.args[0].meta.get("val") if isinstance(n.args[0], torch.fx.Node) else None
        if not isinstance(mv, torch.Tensor) or mv.dtype != torch.bool or not isinstance(qv, torch.Tensor):
            continue
        # the mask in the dtype the kernel adds it in: bf16 for torch's bf16 flash kernel, float32 where the
        # scores are float32 (the fused kernels, matmul -> softmax -> matmul), else the query's
        dt = torch.bfloat16 if n.target is bf16_flash_attention else torch.float32 if n.target in float32_scores \
            else qv.dtype
        groups.setdefault((mask, dt), []).append((n, in_args))
    made = 0
    for (mask, dt), users in groups.items():
        if len(users) < 2:
            continue  # one reader: nothing to share
        with gm.graph.inserting_after(mask):
            add = gm.graph.call_function(additive_mask, (mask, dt))
        add.meta["val"] = torch.empty(mask.meta["val"].shape, dtype=dt, device="meta")
        for n, in_args in users:
            if in_args:
                n.update_arg(3, add)
            else:
                n.update_kwarg("attn_mask", add)
        made += 1
    if not made:
        return []
    gm.recompile()
    n_ops = sum(len(u) for u in groups.values() if len(u) > 1)
    return [f"{made} boolean attention mask(s) made additive once per call for the {n_ops} attention ops reading them"]


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
