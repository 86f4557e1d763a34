"""torch's own oneDNN (3.12, inside libtorch; reached only through torch ops): the fp32 and bf16
linear (``mkldnn._linear_pointwise`` on weights prepacked once, with an activation or a residual add
fused: ``.binary``) and, in ``cpu_opt.quant``, the int8
``onednn.qlinear_pointwise`` / ``qconv2d_pointwise`` kernels."""
from __future__ import annotations

import torch

from .int8 import Conv2dKernel, LinearKernel, as_u8, chain_u8, input_u8, quantize_input


TORCH_LINEAR = torch.ops.mkldnn._linear_pointwise.default
TORCH_LINEAR_BINARY = torch.ops.mkldnn._linear_pointwise.binary


def bf16_linear_runs() -> bool:
    """Does torch's oneDNN run bf16 linear layers natively here (avx512_bf16 / AMX)?"""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (RuntimeError, AttributeError):
        return False


def packed_linear_weight(w_nk: torch.Tensor, rows: int) -> torch.Tensor:
    """``mkldnn._reorder_linear_weight``: (N, K) weights in the layout torch's oneDNN linear wants
    for ``rows`` activation rows (an mkldnn tensor); the plain weights where torch cannot pack."""
    try:
        return torch.ops.mkldnn._reorder_linear_weight(w_nk.detach().contiguous(), rows)
    except (RuntimeError, AttributeError):
        return w_nk.detach().contiguous()


# ------------------------------------------------------------------------------------- int8
# torch's oneDNN qlinear_pointwise post-op names (shared/KNOWN.md: "silu" is refused, "swish" works)
QLINEAR_POST = {None: ("none", [], ""), "relu": ("relu", [], ""), "gelu_erf": ("gelu", [], "none"),
                 "gelu_tanh": ("gelu", [], "tanh"), "silu": ("swish", [], ""), "hardswish": ("hardswish", [], "")}
QCONV_POST = {None: ("none", [], ""), "relu": ("relu", [], ""), "silu": ("swish", [], ""),
              "hardswish": ("hardswish", [], "")}


class TorchOnednnLinear(LinearKernel):
    family = "torch_onednn"

    def __init__(self, wq, w_scales, bias, x_qparams, *, rows: int = 1, **kw):
        super().__init__(wq, w_scales, bias, x_qparams, **kw)
        self.packed = torch.ops.onednn.qlinear_prepack(wq.contiguous(), [max(int(rows), 1), wq.shape[1]])
        self.w_zps = torch.zeros(wq.shape[0], dtype=torch.int64)
        self.post = QLINEAR_POST[self.post_op]
        self.fused_post_op = True

    def run(self, x, other=None):
        u = input_u8(x, self.x_scale, self.x_zp)
        lead = u.shape[:-1]
        u2 = u.reshape(-1, u.shape[-1])
        if other is not None:   # a residual: the linear in fp32, the add, then the activation (and chain)
            y = torch.ops.onednn.qlinear_pointwise(u2, self.x_scale, self.x_zp, self.packed, self.w_scales,
                                                   self.w_zps, self.bias, 1.0, 0, torch.float32, "none", [], "")
            return self._finish(y.reshape(*lead, y.shape[-1]) + self._float_other(other), fused=False)
        if self.out_qparams is not None:
            ys, yz = self.out_qparams
            y = torch.ops.onednn.qlinear_pointwise(u2, self.x_scale, self.x_zp, self.packed, self.w_scales,
                                                   self.w_zps, self.bias, ys, yz, torch.uint8, *self.post)
            return chain_u8(y).reshape(*lead, y.shape[-1])
        y = torch.ops.onednn.qlinear_pointwise(u2, self.x_scale, self.x_zp, self.packed, self.w_scales, self.w_zps,
                                               self.bias, 1.0, 0, torch.float32, *self.post)
        return y.reshape(*lead, y.shape[-1])


class TorchOnednnConv2d(Conv2dKernel):
    family = "torch_onednn"

    def __init__(self, wq, w_scales, bias, x_qparams, *, x_shape=None, **kw):
        super().__init__(wq, w_scales, bias, x_qparams, **kw)
        self.packed = torch.ops.onednn.qconv_prepack(wq.contiguous(), self.w_scales, self.x_scale, self.x_zp,
                                                     self.stride, self.padding, self.dilation, self.groups,
                                                     list(x_shape) if x_shape is not None else None)
        self.w_zps = torch.zeros(wq.shape[0], dtype=torch.int64)
        self.fused_post_op = self.post_op in QCONV_POST

    def _with_residual(self, u, other):
        """conv + residual (+ ReLU) in one oneDNN primitive (``qconv2d_pointwise.binary``, "sum"):
        oneDNN accumulates into, and writes its result over, the ``accum`` buffer, so accum is
        always a fresh copy (uint8 for a uint8 result, fp32 for fp32): the caller's residual is
        never written."""
        unary = "relu" if self.post_op == "relu" else "none"
        cl = torch.channels_last
        if self.out_qparams is not None:
            ys, yz = self.out_qparams
            if other.dtype == torch.uint8:
                accum, (a_s, a_z) = other.clone(memory_format=cl), self.other_qparams
            else:
                a_s, a_z = self.other_qparams
                accum = as_u8(quantize_input(other, a_s, a_z, clamp=False)).clone(memory_format=cl)
            dt = torch.uint8
        else:
            ys, yz, a_s, a_z, dt = 1.0, 0, 1.0, 0, torch.float32
            accum = (self._float_other(other).float() if other.dtype == torch.uint8 else other.float()) \
                .clone(memory_format=cl)
        y = torch.ops.onednn.qconv2d_pointwise.binary(
            u, self.x_scale, self.x_zp, self.packed, self.w_scales, self.w_zps, accum, self.bias, self.stride,
            self.padding, self.dilation, self.groups, ys, yz, dt, a_s, a_z, "sum", 1.0, unary, [], "")
        return chain_u8(y) if dt == torch.uint8 else y

    def run(self, x, other=None):
        u = input_u8(x, self.x_scale, self.x_zp).contiguous(memory_format=torch.channels_last)
        if other is not None and self.post_op in (None, "relu") and self.other_qparams is not None:
            return self._with_residual(u, other)
        post = QCONV_POST.get(self.post_op, ("none", [], ""))
        fused = self.post_op in QCONV_POST and other is None
        if not fused:
            post = ("none", [], "")
        if fused and self.out_qparams is not None:
            ys, yz = self.out_qparams
            y = torch.ops.onednn.qconv2d_pointwise(u, self.x_scale, self.x_zp, self.packed, self.w_scales, self.w_zps,
                                                   self.bias, self.stride, self.padding, self.dilation, self.groups,
                                                   ys, yz, torch.uint8, *post)
            return chain_u8(y)
        y = torch.ops.onednn.qconv2d_pointwise(u, self.x_scale, self.x_zp, self.packed, self.w_scales, self.w_zps,
                                               self.bias, self.stride, self.padding, self.dilation, self.groups,
                                               1.0, 0, torch.float32, *post)
        if other is not None:
            y = y + self._float_other(other)
        return self._finish(y, fused=fused)
