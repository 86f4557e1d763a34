"""Attention kernels that routing can choose instead of torch's fused SDPA.

``matmul_softmax_attention``: two matmuls in the inputs' dtype around a float32 softmax, the score
matrix materialised. ``bf16_matmul_softmax_attention`` is the same on bf16 inputs: on CPUs with
avx512_bf16 but no AMX, torch's flash kernel gains nothing from bf16 while two bf16 matmuls around
a softmax are about 2.7x faster (batch 1, 12 heads, seq 512, dim 64; shared/KNOWN.md). Which of
these or torch's flash kernel runs is the attention route (the table, or a measured profile).
Same signature as ``aten.scaled_dot_product_attention`` (causal and additive/boolean masks).
"""
from __future__ import annotations

import math

import torch


def matmul_softmax_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    if dropout_p:
        raise ValueError("matmul_softmax_attention is for inference: dropout_p must be 0")
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        rep = q.shape[-3] // k.shape[-3]
        k = k.repeat_interleave(rep, dim=-3)
        v = v.repeat_interleave(rep, dim=-3)
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    s = torch.matmul(q, k.transpose(-2, -1))
    s = s.float() * scale
    L, S = q.shape[-2], k.shape[-2]
    if is_causal:
        s = s.masked_fill(torch.ones(L, S, dtype=torch.bool).triu(1), float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            s = s.masked_fill(~attn_mask, float("-inf"))
        else:
            s = s + attn_mask.float()
    p = torch.softmax(s, dim=-1).to(v.dtype)
    return torch.matmul(p, v)


def bf16_matmul_softmax_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                  enable_gqa=False):
    """:func:`matmul_softmax_attention` on bf16 inputs (the route's name for it)."""
    return matmul_softmax_attention(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean attention mask (True: attend) as the additive mask torch's SDPA makes of it before
    its kernel runs (0 where True, -inf where False, in ``dtype``): computed once per call for all
    the attention ops that share the mask (``passes.attention.shared_masks``)."""
    if mask.dtype != torch.bool:
        raise TypeError(f"additive_mask takes a boolean mask; got {mask.dtype}")
    return torch.zeros(mask.shape, dtype=dtype).masked_fill_(mask.logical_not(), float("-inf"))


def bf16_flash_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """torch's flash kernel in bf16 for float32 inputs (cast in, cast back): the attention of an int8
    model on a CPU with native bf16 math (AMX tiles, or AVX512_BF16), where the int8 layers around it
    leave the attention in float32. A mask keeps its own dtype (a float mask is added in float32).
    q, k and v may arrive in bf16 already (int8 projections that write bf16:
    ``passes.attention.bf16_projections``); the result is float32 either way."""
    mask = attn_mask.to(torch.bfloat16) if attn_mask is not None and attn_mask.is_floating_point() else attn_mask
    out = torch.ops.aten.scaled_dot_product_attention.default(
        q.to(torch.bfloat16), k.to(torch.bfloat16), v.to(torch.bfloat16), mask, dropout_p, is_causal, scale=scale,
        enable_gqa=enable_gqa)
    return out.float()
