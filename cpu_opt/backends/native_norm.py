"""LayerNorm fused with the uint8 quantization of its output (``native/kernels/layer_norm.c``), for
the norm in front of an int8 linear layer (``passes.int8.fuse_norm_quantize`` puts it there): one
pass over the hidden states writes the float32 output the residual add reads and the uint8 bytes
the int8 matmul reads, instead of torch's layer_norm followed by ``quantize_per_tensor``.

The uint8 bytes are ``clamp(rint(n / scale) + zero_point, 0, qmax)`` with FBGEMM's rounding (the
product by the reciprocal scale, half to even), as :func:`cpu_opt.backends.int8.quantize_input`
gives them; ``qmax`` is :func:`cpu_opt.backends.int8.activation_qmax`."""
from __future__ import annotations

import torch

from .. import native
from .int8 import _is_fake


def available() -> bool:
    """Is a vectorized variant the one this CPU runs? (The base variant is scalar: slower than torch.)"""
    return native.vectorized()


def layer_norm_u8(x: torch.Tensor, normalized_shape, weight: torch.Tensor | None, bias: torch.Tensor | None,
                  eps: float, scale: float, zero_point: int, qmax: int = 255,
                  want_float: bool = True) -> tuple[torch.Tensor | None, torch.Tensor]:
    """``(layer_norm(x, normalized_shape, weight, bias, eps), its uint8 quantization)``; the first is
    None when ``want_float`` is False (:class:`LayerNormU8` called once)."""
    shape = tuple(normalized_shape)
    if len(shape) != 1:
        raise ValueError(f"layer_norm_u8 normalizes over the last dimension only, got normalized_shape {shape}")
    out = LayerNormU8(shape[0], eps, scale, zero_point, qmax, want_float)(x, weight, bias)
    return out if want_float else (None, out)


class LayerNormU8:
    """The FX call target :func:`cpu_opt.quant.graph.fuse_norm_quantize` puts where a ``layer_norm``
    feeds int8 layers: ``(x, weight, bias) -> (float32 norm, uint8 bytes)``, or the bytes alone when
    nothing else reads the norm (``want_float`` False). The kernel is resolved once, at build."""

    output_aliases_inputs = False   # new tensors on every call (cpu_opt.compiler.runtime reads this)

    def __init__(self, cols: int, eps: float, scale: float, zero_point: int, qmax: int, want_float: bool):
        if not (scale > 0) or scale == float("inf"):
            raise ValueError(f"LayerNormU8: the scale must be finite and positive, got {scale}")
        if not 0 <= qmax <= 255 or not 0 <= zero_point <= qmax:
            raise ValueError(f"LayerNormU8: zero point {zero_point} and qmax {qmax} must satisfy 0 <= zp <= qmax <= 255")
        self.cols, self.eps, self.want_float = int(cols), float(eps), bool(want_float)
        self.scale, self.zero_point, self.qmax = float(scale), int(zero_point), int(qmax)
        self._fn = native.kernel("layer_norm_u8_f32")
        self._checked = (False, False)
        self.__name__ = "layer_norm_u8"

    def __call__(self, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None):
        if type(x) is not torch.Tensor and _is_fake(x):   # shape propagation
            q = x.new_empty(x.shape, dtype=torch.uint8)
            return (x.new_empty(x.shape), q) if self.want_float else q
        cols = self.cols
        if x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() < 1 or x.shape[-1] != cols:
            raise ValueError(f"layer_norm_u8 takes float32 CPU input whose last dimension is {cols}; "
                             f"got {x.dtype} {tuple(x.shape)} on {x.device}")
        if not x.is_contiguous():   # the kernel reads dense rows; the outputs are dense either way
            x = x.contiguous()
        if weight is not self._checked[0] or bias is not self._checked[1]:   # once per pair of parameters
            for t, name in ((weight, "weight"), (bias, "bias")):
                if t is not None and (t.dtype != torch.float32 or t.numel() != cols or not t.is_contiguous()):
                    raise ValueError(f"layer_norm_u8: {name} must be {cols} contiguous float32 values, got {t.dtype} "
                                     f"{tuple(t.shape)}")
            self._checked = (weight, bias)
        y = torch.empty_like(x) if self.want_float else None   # x is dense: so are these
        q = torch.empty_like(x, dtype=torch.uint8)
        f = native.ffi()
        null = f.NULL
        native.check(self._fn(
            f.cast("float *", x.data_ptr()), x.numel() // cols, cols, cols,
            null if weight is None else f.cast("float *", weight.data_ptr()),
            null if bias is None else f.cast("float *", bias.data_ptr()), self.eps,
            null if y is None else f.cast("float *", y.data_ptr()), f.cast("uint8_t *", q.data_ptr()),
            1.0 / self.scale, self.zero_point, self.qmax, torch.get_num_threads()), "layer_norm_u8_f32")
        return (y, q) if self.want_float else q

    def __repr__(self):
        return f"LayerNormU8(cols={self.cols}, scale={self.scale:.4g}, zero_point={self.zero_point}, float={self.want_float})"
