"""FBGEMM, torch's x86 int8 library (``torch.ops.quantized.linear*`` / ``conv2d*`` on weights
prepacked for the fbgemm engine): the int8 Linear and Conv2d kernels of the ``fbgemm`` family."""
from __future__ import annotations

import torch

from .int8 import (Conv2dKernel, LinearKernel, _pair, activation_qmax, as_u8, chain_u8, from_u8, prepack_engine,
                   quantize_input)


class FbgemmLinear(LinearKernel):
    family = "fbgemm"

    def __init__(self, wq, w_scales, bias, x_qparams, **kw):
        super().__init__(wq, w_scales, bias, x_qparams, **kw)
        n = wq.shape[0]
        qw = torch._make_per_channel_quantized_tensor(wq.contiguous(), self.w_scales.double(),
                                                      torch.zeros(n, dtype=torch.int64), 0)
        with prepack_engine("fbgemm"):
            self.packed = torch.ops.quantized.linear_prepack(qw, self.bias)
        self.fused_post_op = post = self.post_op in (None, "relu")
        self._fp32_op = (torch.ops.quantized.linear_with_input_q_dq_qweight_dq_relu_output_fp32
                         if post and self.post_op == "relu" else
                         torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32)

    def run(self, x, other=None):
        if x.dtype != torch.uint8 and not x.is_floating_point():
            raise TypeError(f"an int8 layer takes float or uint8 (chained) input, got {x.dtype}")
        relu = self.post_op == "relu"
        out_q = self.out_qparams or self.own_out_qparams
        lead = x.shape[:-1]
        if other is not None:   # a residual: the linear in fp32, the add, then the activation (and chain)
            xf = from_u8(x, self.x_scale, self.x_zp).dequantize() if x.dtype == torch.uint8 else x
            if activation_qmax() < 255:
                xf = xf.clamp(max=(activation_qmax() - self.x_zp) * self.x_scale)
            y = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(
                xf.reshape(-1, x.shape[-1]).float(), self.x_scale, self.x_zp, self.packed)
            return self._finish(y.reshape(*lead, y.shape[-1]) + self._float_other(other), fused=False)
        if self.post_op in (None, "relu") and out_q is not None and (x.dtype == torch.uint8 or self.out_qparams):
            # int8 in, int8 out: requantization fused into FBGEMM's output stage
            qx = quantize_input(x.reshape(-1, x.shape[-1]), self.x_scale, self.x_zp)
            y = (torch.ops.quantized.linear_relu if relu else torch.ops.quantized.linear)(qx, self.packed, *out_q)
            y = chain_u8(as_u8(y)) if self.out_qparams is not None else y.dequantize()
            return y.reshape(*lead, y.shape[-1])
        if x.dtype == torch.uint8:
            x = from_u8(x, self.x_scale, self.x_zp).dequantize()   # FBGEMM's fp32-in op quantizes inside
        elif activation_qmax() < 255:   # ... to the full 0..255, which saturates here: clamp first
            x = x.clamp(max=(activation_qmax() - self.x_zp) * self.x_scale)
        y = self._fp32_op(x.reshape(-1, x.shape[-1]).float(), self.x_scale, self.x_zp, self.packed)
        y = y.reshape(*lead, y.shape[-1])
        return self._finish(y, self.fused_post_op)


def depthwise_saturates(w_shape, groups: int, dilation) -> bool:
    """Whether FBGEMM's depthwise convolution kernel would take this layer with activations it
    cannot multiply exactly. That kernel adds pairs of u8 x s8 products in int16 (vpmaddubsw) on every
    CPU, VNNI included, so activations above 127 saturate: measured on a Xeon with AVX512_VNNI and
    AMX, a 16-channel depthwise 3x3 on uint8 inputs 200..255 came out 3.5 output steps off, 14.5 for
    7x7 (groups == channels, dilation 1, kernel > 1x1; dilated and 1x1 depthwise layers and grouped
    ones with 2+ channels a group were exact). Below VNNI the activations are 7-bit anyway."""
    cout, cin_per_group, kh, kw = w_shape
    return (activation_qmax() == 255 and groups > 1 and cin_per_group == 1 and kh * kw > 1
            and all(d == 1 for d in _pair(dilation)))


class FbgemmConv2d(Conv2dKernel):
    family = "fbgemm"

    def __init__(self, wq, w_scales, bias, x_qparams, **kw):
        super().__init__(wq, w_scales, bias, x_qparams, **kw)
        if depthwise_saturates(tuple(wq.shape), self.groups, self.dilation):
            raise ValueError(
                f"FBGEMM's depthwise convolution ({tuple(wq.shape)}, groups {self.groups}) adds products in int16 "
                "and saturates with the 8-bit activations this CPU's other int8 kernels take (VNNI): use the "
                "torch_onednn family for this layer")
        qw = torch._make_per_channel_quantized_tensor(wq.contiguous(), self.w_scales.double(),
                                                      torch.zeros(wq.shape[0], dtype=torch.int64), 0)
        with prepack_engine("fbgemm"):
            self.packed = torch.ops.quantized.conv2d_prepack(qw, self.bias, self.stride, self.padding,
                                                             self.dilation, self.groups)

    def run(self, x, other=None):
        qx = quantize_input(x, self.x_scale, self.x_zp)
        relu = self.post_op == "relu"
        out_q = self.out_qparams or self.own_out_qparams
        if out_q is None:
            raise RuntimeError("FBGEMM conv2d needs an output scale: the layer's output was not observed")
        if other is None and self.post_op in (None, "relu"):
            op = torch.ops.quantized.conv2d_relu.new if relu else torch.ops.quantized.conv2d.new
            y = op(qx, self.packed, *out_q)
            return chain_u8(as_u8(y)) if self.out_qparams is not None else y.dequantize()
        if other is not None and self.post_op in (None, "relu") and self.other_qparams is not None \
                and self.raw_qparams is not None:
            # FBGEMM has no fused conv + add (quantized::conv2d_add is oneDNN-engine only): the
            # convolution writes int8, the residual add (+ ReLU) runs on int8 (quantized::add_relu,
            # 0.13 ms at 64x56x56 vs 0.36 for the fp32 add + relu)
            y = torch.ops.quantized.conv2d.new(qx, self.packed, *self.raw_qparams)
            qo = quantize_input(other, *self.other_qparams, clamp=False)   # an add's operand: no saturation
            y = (torch.ops.quantized.add_relu if relu else torch.ops.quantized.add)(y, qo, *out_q)
            return chain_u8(as_u8(y)) if self.out_qparams is not None else y.dequantize()
        # the post-op or the add runs after: the convolution's own (raw) output range, not the final one
        y = torch.ops.quantized.conv2d.new(qx, self.packed, *(self.raw_qparams or self.own_out_qparams
                                                              or out_q)).dequantize()
        if other is not None:
            y = y + self._float_other(other)
        return self._finish(y, fused=False)
