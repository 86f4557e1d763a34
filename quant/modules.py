"""Modules of the int8 workflow: the observed layers ``prepare`` puts in, the int8 layers ``convert``
puts in their place.

Layers taken: ``nn.Linear``, ``nn.Conv2d`` (groups and depthwise included, zeros padding) and
``transformers``' ``Conv1D`` (GPT-2's linear layers, weights stored (in, out)). Each is wrapped, not
rewritten, so the model's own Python code runs unchanged: that is what makes the workflow work on
any model, Hugging Face ones included.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import kernels as K
from .observer import MinMaxObserver, PerChannelMinMaxObserver
from .qconfig import QConfig, _is_hf_conv1d

__all__ = ["ObservedLayer", "QuantizedLinear", "QuantizedConv2d", "DynamicQuantizedLinear", "WeightOnlyLinear",
           "layer_kind", "linear_weight"]


def layer_kind(m: nn.Module) -> str | None:
    """``"linear"``, ``"conv2d"`` or ``None`` (not a layer the int8 backend takes)."""
    if isinstance(m, nn.Linear) or _is_hf_conv1d(m):
        return "linear"
    if isinstance(m, nn.Conv2d) and m.padding_mode == "zeros" and not isinstance(m.padding, str):
        return "conv2d"
    return None


def linear_weight(m: nn.Module) -> torch.Tensor:
    """The (out, in) weight of a linear layer (HF's Conv1D keeps (in, out))."""
    return m.weight.t() if _is_hf_conv1d(m) else m.weight


class ObservedLayer(nn.Module):
    """An fp32 layer with its observers: calls run the layer unchanged and record the input (and,
    with SmoothQuant, each input channel's range) and output statistics. Observer state lives in
    buffers, so ``state_dict()`` saves a calibration and ``load_state_dict`` resumes it."""

    def __init__(self, layer: nn.Module, qconfig: QConfig):
        super().__init__()
        self.layer = layer
        self.qconfig = qconfig
        self.kind = layer_kind(layer)
        static = qconfig.activation is not None and not qconfig.dynamic
        self.smooth = self.kind == "linear" and static and qconfig.smoothquant_alpha is not None
        self.input_observer = qconfig.activation() if static and not self.smooth else None
        self.output_observer = qconfig.activation() if static else None
        # SmoothQuant: the per-input-channel range (min and max per channel; the per-tensor range of
        # x / s follows from it exactly once s is known)
        if self.smooth:
            act = qconfig.activation()
            self.channel_observer = PerChannelMinMaxObserver(ch_axis=1, dtype=act.dtype,
                                                             qscheme=torch.per_channel_affine,
                                                             reduce_range=act.reduce_range)
        else:
            self.channel_observer = None
        self.register_buffer("rows", torch.zeros((), dtype=torch.int64))
        self.observing = True

    def forward(self, x, *args, **kwargs):
        if self.observing and isinstance(x, torch.Tensor) and x.is_floating_point() and x.numel():
            xd = x.detach()
            if self.input_observer is not None:
                self.input_observer(xd)
            if self.channel_observer is not None:
                self.channel_observer(xd.reshape(-1, xd.shape[-1]).float())
            rows = xd.numel() // xd.shape[-1] if self.kind == "linear" else xd.shape[0]
            self.rows.fill_(max(int(self.rows), rows))
            self.last_shape = tuple(xd.shape)
        y = self.layer(x, *args, **kwargs)
        if self.observing and self.output_observer is not None and isinstance(y, torch.Tensor) and y.numel():
            self.output_observer(y.detach())
        return y

    def extra_repr(self):
        return f"kind={self.kind}, smoothquant={self.smooth}"

    def __getattr__(self, name):
        # model code reads its layers' attributes (``self.proj.weight.dtype``, ``in_features``)
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["layer"], name)


def _qparams(obs) -> tuple[float, int]:
    s, z = obs.calculate_qparams()
    return float(s.reshape(-1)[0]), int(z.reshape(-1)[0])


def _weight_qparams(qconfig: QConfig, w: torch.Tensor):
    """Per-output-channel symmetric int8 weights: (int8 tensor, scales)."""
    obs = qconfig.weight()
    obs(w.detach().float())
    scale, zp = obs.calculate_qparams()
    scale = scale.float().reshape(-1)
    if scale.numel() == 1:
        scale = scale.expand(w.shape[0]).contiguous()
    zp = zp.reshape(-1)
    if bool((zp != 0).any()):
        raise ValueError(f"weights need symmetric quantization (zero point 0) for the x86 int8 kernels; "
                         f"the weight observer {obs!r} gave zero points {zp.unique().tolist()}")
    shape = (-1,) + (1,) * (w.dim() - 1)
    lo, hi = obs.qmin, obs.qmax
    wq = torch.clamp(torch.round(w.detach().float() / scale.reshape(shape)), lo, hi).to(torch.int8)
    return wq, scale


def smoothquant_scales(ch_min: torch.Tensor, ch_max: torch.Tensor, w: torch.Tensor, alpha: float) -> torch.Tensor:
    """SmoothQuant's per-input-channel migration scale ``s_j = max|X_j|^a / max|W_j|^(1-a)``
    (Xiao et al., 2023): ``X / s`` and ``W * s`` give the same product with the activation outliers
    moved into the weights, which quantize per output channel."""
    act = torch.maximum(ch_min.abs(), ch_max.abs()).float().clamp(min=1e-5)
    wmax = w.detach().abs().amax(dim=0).float().clamp(min=1e-5)
    return (act.pow(alpha) / wmax.pow(1 - alpha)).clamp(min=1e-5)


class _QuantizedBase(nn.Module):
    def __init__(self, kernel, name: str, why: str, in_features: int, out_features: int, weight_shape=None):
        super().__init__()
        # what model code reads of a layer's weight (dtype, device, shape: ``x.to(self.proj.weight.dtype)``
        # in ViT, T5) without keeping the fp32 weights alive: a zero-stride view of one float, read-only
        # in spirit (the int8 weights are in the kernel)
        self.register_buffer("weight", torch.zeros((), dtype=torch.float32).expand(
            weight_shape or (out_features, in_features)), persistent=False)
        self.kernel = kernel
        self.family = kernel.family if kernel is not None else "?"
        self.why = why
        self.layer_name = name
        self.in_features, self.out_features = in_features, out_features

    def info(self) -> dict:
        k = self.kernel
        return {"layer": self.layer_name, "kind": self.kind, "family": self.family, "why": self.why,
                "post_op": getattr(k, "post_op", None), "int8": True}

    def extra_repr(self):
        return f"{self.in_features} -> {self.out_features}, kernel={self.family}"


class QuantizedLinear(_QuantizedBase):
    """Static int8 linear: input quantized with the calibrated scale, u8 x s8 kernel, fp32 out."""
    kind = "linear"

    def __init__(self, kernel, name, why, in_features, out_features, smooth_inv=None):
        super().__init__(kernel, name, why, in_features, out_features)
        self.register_buffer("smooth_inv", smooth_inv, persistent=False)
        self.register_buffer("bias", kernel.bias, persistent=False)

    def forward(self, x):
        if self.smooth_inv is not None:
            x = x * self.smooth_inv
        return self.kernel(x)

    def info(self) -> dict:
        return {**super().info(), "smoothquant": self.smooth_inv is not None}


class QuantizedConv2d(_QuantizedBase):
    kind = "conv2d"

    def __init__(self, kernel, name, why, in_channels, out_channels, weight_shape):
        super().__init__(kernel, name, why, in_channels, out_channels, weight_shape)
        self.register_buffer("bias", kernel.bias, persistent=False)

    def forward(self, x):
        return self.kernel(x)


class DynamicQuantizedLinear(_QuantizedBase):
    """int8 weights, activations quantized per call: per tensor (FBGEMM ``linear_dynamic``) or per
    token (one scale per row, s8 x s8 ``torch._int_mm``)."""
    kind = "linear"

    def __init__(self, wq, w_scales, bias, name, per_token: bool, reduce_range: bool):
        super().__init__(None, name, "", wq.shape[1], wq.shape[0])
        self.per_token = per_token
        self.reduce_range = reduce_range
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone(), persistent=False)
        if per_token:
            self.family = "torch_int_mm"
            self.why = "dynamic per-token activations: s8 x s8 torch._int_mm, one scale per row"
            self.register_buffer("wq_t", wq.t().contiguous(), persistent=False)
            self.register_buffer("w_scales", w_scales.float().clone(), persistent=False)
        else:
            self.family = "fbgemm"
            self.why = ("dynamic per-tensor activations: FBGEMM quantized::linear_dynamic (the only dynamic int8 linear "
                        "kernel torch has on x86)")
            self.kernel = K.FbgemmLinear(wq, w_scales, bias, (1.0, 0))

    def forward(self, x):
        lead, k = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, k).float()
        if not self.per_token:
            y = torch.ops.quantized.linear_dynamic(x2, self.kernel.packed, self.reduce_range)
        else:
            s = x2.abs().amax(dim=1, keepdim=True).clamp(min=1e-8) / 127.0
            xq = torch.clamp(torch.round(x2 / s), -127, 127).to(torch.int8)
            y = torch._int_mm(xq, self.wq_t).float() * s * self.w_scales
            if self.bias is not None:
                y = y + self.bias
        return y.reshape(*lead, y.shape[-1]).to(x.dtype)


class WeightOnlyLinear(_QuantizedBase):
    """int8 weights, float activations: the memory-bound case (LLM decode, batch 1), where reading
    a quarter of the weight bytes is the speedup. GEMVs and small batches run
    ``aten._weight_int8pack_mm`` in bf16 (its fp32 form is ~10x slower here); larger batches
    dequantize the weights and run the float GEMM (compute-bound there, nothing to gain)."""
    kind = "linear"
    MAX_INT8PACK_ROWS = 16

    def __init__(self, wq, w_scales, bias, name):
        super().__init__(None, name, "", wq.shape[1], wq.shape[0])
        self.family = "weight_only"
        self.why = (f"int8 weights: aten._weight_int8pack_mm (bf16) up to {self.MAX_INT8PACK_ROWS} rows, "
                    "dequantized weights above")
        self.register_buffer("wq", wq.contiguous(), persistent=False)
        self.register_buffer("w_scales", w_scales.float().clone(), persistent=False)
        self.register_buffer("w_scales_bf16", w_scales.bfloat16(), persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone(), persistent=False)

    def forward(self, x):
        lead, k = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, k)
        if x2.shape[0] <= self.MAX_INT8PACK_ROWS:
            y = torch.ops.aten._weight_int8pack_mm(x2.bfloat16().contiguous(), self.wq, self.w_scales_bf16).to(x.dtype)
        else:
            w = (self.wq.to(x.dtype) * self.w_scales.to(x.dtype)[:, None])
            y = F.linear(x2, w)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*lead, y.shape[-1])


def build_static(obs: ObservedLayer, name: str, family: str, why: str, post_op=None, out_qparams=None):
    """The int8 replacement of one observed layer, on kernel ``family``."""
    layer, qc = obs.layer, obs.qconfig
    if obs.kind == "linear":
        w = linear_weight(layer)
        smooth_inv = None
        if obs.smooth:
            co = obs.channel_observer
            if co.min_val.numel() == 0:
                raise RuntimeError(f"{name}: not calibrated (no input was observed)")
            s = smoothquant_scales(co.min_val, co.max_val, w, qc.smoothquant_alpha)
            w = w.detach().float() * s[None, :]
            smooth_inv = (1.0 / s).float()
            act = qc.activation()
            mm = MinMaxObserver(dtype=act.dtype, qscheme=act.qscheme, reduce_range=act.reduce_range)
            mm(torch.stack([(co.min_val / s).min(), (co.max_val / s).max()]))
            x_qp = _qparams(mm)
        else:
            x_qp = _qparams(obs.input_observer)
        wq, ws = _weight_qparams(qc, w)
        kw = {"rows": int(obs.rows)} if family == "torch_onednn" else {}
        kernel = K.LINEAR_KERNELS[family](wq, ws, layer.bias, x_qp, post_op=post_op, out_qparams=out_qparams, **kw)
        if obs.output_observer is not None:
            kernel.own_out_qparams = K.full_range(_qparams(obs.output_observer))
        return QuantizedLinear(kernel, name, why, w.shape[1], w.shape[0], smooth_inv)
    wq, ws = _weight_qparams(qc, layer.weight)
    x_qp = _qparams(obs.input_observer)
    kw = dict(stride=layer.stride, padding=layer.padding, dilation=layer.dilation, groups=layer.groups)
    kernel = K.CONV_KERNELS[family](wq, ws, layer.bias, x_qp, post_op=post_op, out_qparams=out_qparams, **kw)
    if obs.output_observer is not None:
        kernel.own_out_qparams = K.full_range(_qparams(obs.output_observer))
    return QuantizedConv2d(kernel, name, why, layer.in_channels, layer.out_channels, tuple(layer.weight.shape))
