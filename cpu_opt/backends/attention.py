"""Attention kernels that routing can choose instead of torch's fused SDPA.

``matmul_softmax_attention``: two matmuls in the inputs' dtype around a float32 softmax, the score
matrix materialised. ``bf16_matmul_softmax_attention`` is the same on bf16 inputs: on CPUs with
avx512_bf16 but no AMX, torch's flash kernel gains nothing from bf16 while two bf16 matmuls around
a softmax are about 2.7x faster (batch 1, 12 heads, seq 512, dim 64; shared/KNOWN.md). Which of
these or torch's flash kernel runs is the attention route (the table, or a measured profile).
cpu_opt's fused kernels (one native call for all heads, q / k / v read where they lie, the output
written in the layout the output projection reads): :func:`amx_attention` (AMX tiles) and
:func:`dpbf16_attention` (AVX512_BF16) in bf16, :func:`f32_attention` (AVX-512 FMA) in float32.
Same signature as ``aten.scaled_dot_product_attention`` (causal and additive/boolean masks).
"""
from __future__ import annotations

import math
import os

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
    dead = None
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            masked = attn_mask.logical_not()
            s = s.masked_fill(masked, float("-inf"))
            dead = masked.all(-1, keepdim=True)
        else:
            s = s + attn_mask.float()
            dead = torch.isneginf(attn_mask).all(-1, keepdim=True)
    p = torch.softmax(s, dim=-1)
    if dead is not None and dead.any():
        # a query row that may attend to no key (a left-padded row under a causal mask): torch's SDPA
        # gives zeros there, a plain softmax NaN. Found from the mask (no heads axis), so the probabilities
        # are only touched when such a row exists.
        p = p.masked_fill(dead, 0.0)
    return torch.matmul(p.to(v.dtype), v)


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


def amx_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """The attention of an int8 graph on a CPU with AMX, in one call of cpu_opt's fused kernel
    (``native/kernels/amx_attention.c``): per head, ``q @ k^T`` and ``p @ v`` on AMX tiles around a
    softmax in registers, q / k / v read where they lie (the strided views of the fused projection),
    the float32 output written straight into the (batch, seq, heads, dim) layout the output projection
    reads. Same answers as :func:`bf16_flash_attention` (bf16 operands, float32 scores, the
    probabilities rounded to bf16 before ``p @ v``), which takes what this kernel does not: dropout,
    a causal flag, grouped heads, other ranks, a CPU or kernel without AMX tiles."""
    return _fused_attention(_amx_kernel(), q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def dpbf16_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """:func:`amx_attention`'s kernel on AVX512_BF16 dot products (``native/kernels/dpbf16_attention.c``)
    for CPUs with AVX512_BF16 and no AMX tiles (AMD Zen 4 / Zen 5): the same operands, answers and
    fallback (:func:`bf16_flash_attention`); it also takes a causal flag and grouped query heads."""
    return _fused_attention(_dpbf16_kernel(), q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                            extended=True)


def dpbf16_attention_bf16(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """The attention of a bf16 graph on a CPU with AVX512_BF16 and no AMX: :func:`dpbf16_attention`'s
    kernel, writing bf16 (the dtype the graph expects; each float rounded to nearest even as it
    stores a block, instead of a float32 output converted by torch afterwards: 216 vs 272 us for
    BERT-base's 12 x 128 x 128 x 64 on a Zen 4); what the kernel does not take runs
    :func:`bf16_matmul_softmax_attention`, this CPU's next best."""
    out = _fused_attention(_dpbf16_bf16out_kernel(), q, k, v, attn_mask, dropout_p, is_causal,
                           scale, enable_gqa, extended=True, fallback=bf16_matmul_softmax_attention,
                           out_dtype=torch.bfloat16)
    return out.to(q.dtype)   # bf16 already (the kernel's, or the fallback's in v's dtype) for a bf16 graph: no copy


def f32_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """The attention of a float32 graph on an AVX-512 or AVX2 CPU in one call of cpu_opt's fused kernel
    (``native/kernels/f32_attention.c``): :func:`dpbf16_attention`'s algorithm and operand handling
    (q / k / v read where they lie, causal, grouped heads, the output written in the projection's
    layout) in float32 throughout, so the answers are torch's SDPA's to float32 rounding. What the
    kernel does not take (dropout, bf16 inputs, other ranks, a CPU without the avx2 or avx512 variant) runs
    torch's SDPA."""
    return _fused_attention(_f32_kernel(), q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                            extended=True, fallback=_torch_sdpa, operands=torch.float32)


def _torch_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    return torch.ops.aten.scaled_dot_product_attention.default(q, k, v, attn_mask, dropout_p, is_causal, scale=scale,
                                                               enable_gqa=enable_gqa)


def _fused_attention(fn, q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, *, extended=False,
                     fallback=None, operands=torch.bfloat16, out_dtype=torch.float32):
    """One call of a fused attention kernel (``fn``: :func:`_fused_kernel`'s, None where it cannot
    run here; ``extended``: it takes a causal flag and grouped query heads; ``operands``: the dtype
    it reads q / k / v in: bf16 kernels take float32 or bf16 inputs, cast; the float32 kernel only
    float32 ones; ``out_dtype``: what it writes, float32 or, for a ``*_bf16out`` kernel, bf16), else
    ``fallback`` (:func:`bf16_flash_attention` by default)."""
    from .. import native
    from .int8 import _is_fake

    fallback = fallback or bf16_flash_attention
    floats = _FLOATS if operands == torch.bfloat16 else (torch.float32,)
    groups = q.dim() == 4 and k.dim() == 4 and k.shape[1] >= 1 and q.shape[1] % k.shape[1] == 0 and \
        (k.shape[1] == q.shape[1] or (enable_gqa and extended))
    if fn is None or dropout_p or (is_causal and not (extended and attn_mask is None)) or not groups or \
            v.dim() != 4 or k.shape[0] != q.shape[0] or v.shape[:3] != k.shape[:3] or q.shape[3] != k.shape[3] or \
            q.dtype not in floats or k.dtype not in floats or v.dtype not in floats or q.device.type != "cpu" or \
            k.device.type != "cpu" or v.device.type != "cpu" or k.shape[2] > 16384 or q.shape[3] > 512 or v.shape[3] > 512 \
            or k.shape[2] == 0 or q.shape[3] == 0:   # no keys / an empty head: torch's answer (the kernels refuse)
        return fallback(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if type(q) is not torch.Tensor and _is_fake(q):   # shape propagation: the same shape, dtype and layout
        return fallback(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    B, H, Sq, D = q.shape
    Hk, Sk, Dv = k.shape[1], k.shape[2], v.shape[3]
    mask = _float_mask(attn_mask, (B, H, Sq, Sk))
    if mask is False:   # a mask of a shape this kernel does not read
        return fallback(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    scale = float(scale) if scale is not None else 1.0 / math.sqrt(D)
    ops = []
    for t in (q, k, v):
        if t.dtype != operands:
            t = t.to(operands)
        if t.stride(3) != 1 and t.shape[3] > 1:
            t = t.contiguous()
        ops.append(t)
    out = torch.empty(B, Sq, H, Dv, dtype=out_dtype)
    res = out.transpose(1, 2)
    if 0 in res.shape:
        return res
    ffi = native.ffi()
    # strides (elements; 0 where a dimension broadcasts) of q, k, v, out, mask: one array
    tensors = (*ops, res) if mask is None else (*ops, res, mask)
    st = ffi.new("int64_t[15]", [t.stride(i) if t.shape[i] > 1 else 0 for t in tensors for i in range(3)])
    lens = [t.untyped_storage().nbytes() // t.element_size() - t.storage_offset() for t in tensors]
    qb, kb, vb = ops
    heads = (B, H, Hk) if extended else (B, H)
    scaling = (scale, int(bool(is_causal))) if extended else (scale,)
    ptr = "uint16_t *" if operands == torch.bfloat16 else "float *"
    status = fn(ffi.cast(ptr, qb.data_ptr()), lens[0], st, ffi.cast(ptr, kb.data_ptr()), lens[1], st + 3,
                ffi.cast(ptr, vb.data_ptr()), lens[2], st + 6, *heads, Sq, Sk, D, Dv, *scaling,
                ffi.NULL if mask is None else ffi.cast("float *", mask.data_ptr()), 0 if mask is None else lens[4],
                ffi.NULL if mask is None else st + 12,
                ffi.cast("float *" if out_dtype == torch.float32 else "uint16_t *", out.data_ptr()), lens[3], st + 9,
                torch.get_num_threads())
    if status == _UNSUPPORTED:   # the kernel cannot run here (the OS refused AMX's tile state, or the CPU has
        # no AVX512_BF16): the fallback from now on
        for key, kfn in _fused_fns.items():
            if kfn is fn:
                _fused_fns[key] = None
        return fallback(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    native.check(status, getattr(fn, "__name__", "fused attention"))
    return res


# the ISA features each fused attention kernel needs beyond its variant (the bf16 ones run in avx512 only:
# every CPU with AMX or AVX512_BF16 has AVX-512)
_KERNEL_NEEDS = {"amx_attention_bf16": frozenset({"amx_bf16", "amx_tile"}),
                 "amx_qlinear_u8s8": frozenset({"amx_int8", "amx_tile"}),   # amx_linear.py's int8 GEMM
                 "dpbf16_attention": frozenset({"avx512_bf16"}),
                 "dpbf16_attention_bf16out": frozenset({"avx512_bf16"}),   # the same kernel, bf16 output
                 "f32_attention": frozenset()}   # the variant alone
# the variants each kernel is built for (default: avx512 only); f32_attention also has AVX2 tiles
_KERNEL_VARIANTS = {"f32_attention": ("avx2", "avx512")}
_fused_fns: dict = {}


def _fused_kernel(name: str):
    """The native kernel ``name`` where this CPU, under the ISA cap in force, has what it needs
    (:data:`_KERNEL_NEEDS`), else None; resolved once per kernel and cap."""
    from .. import native
    from ..platform import hw

    key = (name, *(os.environ.get(k) for k in native._CAP_VARS))
    if key not in _fused_fns:
        info = hw.detect()
        ok = _KERNEL_NEEDS[name] <= info.isa and native.select_variant(info) in _KERNEL_VARIANTS.get(name, ("avx512",))
        _fused_fns[key] = native.kernel(name) if ok else None
    return _fused_fns[key]


def _amx_kernel():
    """The AMX kernel where this CPU has AMX-BF16 tiles, else None."""
    return _fused_kernel("amx_attention_bf16")


def _dpbf16_kernel():
    """The AVX512_BF16 kernel where this CPU has AVX512_BF16, else None."""
    return _fused_kernel("dpbf16_attention")


def _dpbf16_bf16out_kernel():
    """The same kernel writing bf16 (``dpbf16_attention_bf16out``), else None."""
    return _fused_kernel("dpbf16_attention_bf16out")


def _f32_kernel():
    """The float32 kernel where this CPU runs the avx2 or avx512 variant, else None."""
    return _fused_kernel("f32_attention")


# What each attention route runs: (route backend, the attention's dtype) -> (the function an SDPA node
# is given, the probe that says its native kernel runs here; None: torch ops, it always runs). "int8" is
# the float32 attention between the int8 layers of an int8 graph on a CPU with native bf16 math. Read
# forward by ``passes.route_attention`` and ``calibrate`` (:func:`routed`), backward by the report
# (:func:`route_of`). A route not named here (torch_flash for fp32 / bf16) leaves the aten node as it is.
ROUTES = {
    ("amx_bf16", "int8"): (amx_attention, _amx_kernel),
    ("dpbf16", "int8"): (dpbf16_attention, _dpbf16_kernel),
    ("torch_flash", "int8"): (bf16_flash_attention, None),
    ("dpbf16", "bf16"): (dpbf16_attention_bf16, None),   # runs bf16 matmul-softmax where its kernel does not
    ("bf16_matmul_softmax", "bf16"): (bf16_matmul_softmax_attention, None),
    ("matmul_softmax", "fp32"): (matmul_softmax_attention, None),
    ("f32_fused", "fp32"): (f32_attention, _f32_kernel),
}
_ROUTE_OF = {fn: backend for (backend, _), (fn, _) in ROUTES.items()}


def routed(backend: str, dtype: str):
    """The function attention of ``dtype`` runs on route ``backend`` (:data:`ROUTES`), or None: the route
    leaves torch's SDPA as it is, or its native kernel does not run on this CPU under the ISA cap."""
    fn, probe = ROUTES.get((backend, dtype), (None, None))
    return fn if fn is not None and (probe is None or probe() is not None) else None


def route_of(fn) -> "str | None":
    """The route backend whose function ``fn`` is (:data:`ROUTES`), or None: not one of them."""
    return _ROUTE_OF.get(fn)


_FLOATS = (torch.float32, torch.bfloat16)
_UNSUPPORTED = -6   # CO_ERR_UNSUPPORTED_AMX: not the avx512 variant, the OS refused AMX's tile state, or no AVX512_BF16
def _float_mask(attn_mask, shape):
    """``attn_mask`` as a float32 additive mask of rank 4 whose every dimension is 1 or ``shape``'s
    and whose last is dense and full (None stays None); False where it cannot be."""
    if attn_mask is None:
        return None
    m = attn_mask
    if m.dtype == torch.bool:
        m = additive_mask(m, torch.float32)
    elif m.dtype != torch.float32:
        m = m.float()
    if m.dim() > 4:
        return False
    while m.dim() < 4:
        m = m.unsqueeze(0)
    if any(a not in (1, b) for a, b in zip(m.shape, shape)):
        return False
    if m.shape[3] != shape[3] or m.stride(3) != 1:
        m = m.expand(*m.shape[:3], shape[3]).contiguous()
    return m
