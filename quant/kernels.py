"""The int8 kernel families of the x86 backend, one class per (family, layer kind).

Every kernel is built once from a layer's int8 weights and calibrated input scale, and called as
``kernel(x, other=None) -> y``:

* ``x`` is float32 (quantized on the way in with the layer's input scale) or ``torch.uint8``
  coming straight from the previous int8 layer (a chain: no dequantize between them; the bytes are
  quantized with exactly this layer's input scale and zero point, which the graph pass checks);
* ``y`` is float32, or ``torch.uint8`` quantized with ``out_qparams`` when the consumer is int8 too.
  Chains carry plain ``uint8`` tensors, not torch's quantized dtypes, so fake-tensor shape
  propagation and the runtime's buffer analysis see ordinary tensors;
* ``post_op`` (``relu``, ``gelu_erf``, ``gelu_tanh``, ``silu``) runs fused inside the kernel where the
  family has it, else in float32 after it (the answer is the same, only the cost differs);
* ``other`` (convolutions) is a residual added before the post-op.

Families (names are the routing table's backends):

``fbgemm``        torch's FBGEMM ops (``quantized::linear*``, ``quantized::conv2d*``)
``torch_onednn``  torch's oneDNN 3.12 (``onednn::qlinear_pointwise``, ``onednn::qconv2d_pointwise``)
``onednn``        cpu_opt's own oneDNN 3.2 binding (``cpu_opt.dnnl.primitives.Matmul``, linear only)

Guards against the pitfalls in ``shared/KNOWN.md`` ("int8 in torch 2.13.0"): weights are always
prepacked by the kernel that uses them (an unpacked weight segfaults ``qlinear_pointwise``), packed
weights are never shared between engines, weight zero points must be zero (the kernels ignore
them: refused here), a u8 ``other`` is never handed to oneDNN's "add", and a ``quint8`` tensor is
never ``.view``-ed as ``uint8`` (that segfaults; its storage is re-wrapped instead).
"""
from __future__ import annotations


import torch
import torch.nn.functional as F

__all__ = ["LINEAR_KERNELS", "CONV_KERNELS", "FAMILIES", "POST_OPS", "LinearKernel", "Conv2dKernel",
           "as_u8", "from_u8", "quantize_input"]

POST_OPS = ("relu", "gelu_erf", "gelu_tanh", "silu")
FAMILIES = ("fbgemm", "torch_onednn", "onednn")

_TORCH_POST = {
    None: None,
    "relu": torch.relu,
    "gelu_erf": F.gelu,
    "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
    "silu": F.silu,
}
# torch's oneDNN qlinear_pointwise post-op names (shared/KNOWN.md: "silu" is refused, "swish" works)
_QLINEAR_POST = {None: ("none", [], ""), "relu": ("relu", [], ""), "gelu_erf": ("gelu", [], "none"),
                 "gelu_tanh": ("gelu", [], "tanh"), "silu": ("swish", [], "")}
_QCONV_POST = {None: ("none", [], ""), "relu": ("relu", [], ""), "silu": ("swish", [], "")}


def _engine(name: str):
    """torch's quantized engine for a prepack (packed weights are engine-specific)."""
    from cpu_opt.platform.calibrate import quantized_engine

    return quantized_engine(name)


def warn_if_saturating(observer, where: str) -> None:
    """An activation range wider than the kernels take exactly here (8-bit activations without VNNI)
    is clamped at :func:`activation_qmax`: say so instead of clipping silently."""
    import warnings

    qmax = getattr(observer, "quant_max", None)
    if qmax is not None and observer.dtype == torch.quint8 and qmax > activation_qmax():
        warnings.warn(f"{where}: 8-bit activations (quant_max {qmax}) on a CPU without VNNI: the int8 kernels "
                      f"saturate above {activation_qmax()}, so activations are clamped there and the top half of "
                      "the range is lost; use reduce_range=True (the default on this CPU)", RuntimeWarning,
                      stacklevel=3)


def full_range(qparams):
    """The same real range on all 8 bits: for values FBGEMM requantizes that feed no GEMM (an fp32
    output, a residual add), where 7-bit calibration (made for kernel inputs) would round twice as
    coarsely."""
    if qparams is None or activation_qmax() == 255:
        return qparams
    s, z = qparams
    return (s * 127.0 / 255.0, min(255, max(0, round(z * 255.0 / 127.0))))


def chain_u8(u: torch.Tensor) -> torch.Tensor:
    """A uint8 output for the next int8 layer, clamped (in place: the kernel's own fresh output) to
    what the consumer's kernel takes exactly."""
    qmax = activation_qmax()
    return u.clamp_(max=qmax) if qmax < 255 else u


def as_u8(q: torch.Tensor) -> torch.Tensor:
    """The bytes of a per-tensor ``quint8`` tensor as a plain ``uint8`` tensor, without a copy.

    ``q.view(torch.uint8)`` segfaults in torch 2.13 and ``int_repr()`` copies (78 us at 128x768);
    re-wrapping the storage is what is left."""
    if q.qscheme() != torch.per_tensor_affine:
        raise TypeError(f"int8 chains carry per-tensor affine quint8 tensors, got {q.qscheme()}")
    return torch.empty(0, dtype=torch.uint8).set_(q.untyped_storage(), q.storage_offset(), q.shape, q.stride())


def from_u8(u: torch.Tensor, scale: float, zero_point: int) -> torch.Tensor:
    return torch._make_per_tensor_quantized_tensor(u, scale, zero_point)


_SATURATES = None


def activation_qmax() -> int:
    """The largest uint8 activation the int8 kernels take exactly on this CPU: 255 with VNNI; 127
    without, where every x86 u8 x s8 kernel (FBGEMM's and oneDNN's AVX2 paths: vpmaddubsw) adds pairs
    of products in int16 and saturates above it (fuzzing found FBGEMM 0.13 off at K=2 with 8-bit
    activations here). The kernels clamp to it; calibration's 7-bit range (reduce_range) makes the
    clamp a no-op for values inside the calibrated range."""
    global _SATURATES
    if _SATURATES is None:
        from cpu_opt.platform import hw

        _SATURATES = not hw.has_vnni(hw.detect())
    return 127 if _SATURATES else 255


def quantize_input(x: torch.Tensor, scale: float, zero_point: int, clamp: bool = True) -> torch.Tensor:
    """float32 -> per-tensor quint8 (``quantize_per_tensor``: 13 us at 128x768, 7x faster than the
    decomposed op), clamped to :func:`activation_qmax`; chained uint8 bytes are wrapped as they are
    (their producer clamped them)."""
    if x.dtype == torch.uint8:
        return from_u8(x, scale, zero_point)
    if not x.is_floating_point():
        raise TypeError(f"an int8 layer takes float or uint8 (chained) input, got {x.dtype}")
    qmax = activation_qmax()
    if clamp and qmax < 255:
        x = x.clamp(max=(qmax - zero_point) * scale)
    return torch.quantize_per_tensor(x.float(), scale, zero_point, torch.quint8)  # keeps channels-last


def input_u8(x: torch.Tensor, scale: float, zero_point: int) -> torch.Tensor:
    """The layer's input as uint8 bytes for the oneDNN kernels."""
    if x.dtype == torch.uint8:
        return x
    return as_u8(quantize_input(x, scale, zero_point))


def _is_fake(t) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor) or t.device.type == "meta"


def _check_weights(wq, w_scales, w_zero_points, kind):
    if wq.dtype != torch.int8:
        raise TypeError(f"{kind}: int8 weights expected, got {wq.dtype}")
    if w_zero_points is not None and bool((w_zero_points != 0).any()):
        raise ValueError(f"{kind}: weight zero points must be 0 (symmetric weights): the x86 int8 kernels ignore "
                         "nonzero ones and would return wrong numbers")
    n = wq.shape[0]
    ws = torch.as_tensor(w_scales, dtype=torch.float32).reshape(-1)
    if ws.numel() == 1:
        ws = ws.expand(n).contiguous()
    if ws.numel() != n:
        raise ValueError(f"{kind}: {ws.numel()} weight scales for {n} output channels")
    if not bool((ws > 0).all()):
        raise ValueError(f"{kind}: weight scales must be positive")
    return ws.contiguous()


class _Kernel:
    family = "?"
    kind = "?"

    def __init__(self, wq, w_scales, bias, x_qparams, *, post_op=None, out_qparams=None, w_zero_points=None):
        if post_op not in _TORCH_POST:
            raise ValueError(f"post_op must be one of {POST_OPS} or None, got {post_op!r}")
        self.w_scales = _check_weights(wq, w_scales, w_zero_points, self.kind)
        self.x_scale, self.x_zp = float(x_qparams[0]), int(x_qparams[1])
        if not (self.x_scale > 0 and 0 <= self.x_zp <= 255):
            raise ValueError(f"{self.kind}: input qparams must be a positive scale and a zero point in 0..255 (quint8), "
                             f"got {x_qparams}")
        self.out_qparams = None if out_qparams is None else (float(out_qparams[0]), int(out_qparams[1]))
        self.post_op = post_op
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.out_features = wq.shape[0]
        # the layer's own output range (observed), for kernels that write int8 and need a scale for it
        self.own_out_qparams = None
        # a residual that arrives as uint8 from an int8 layer: its (scale, zero point); for FBGEMM also
        # the scale an fp32 residual is quantized with
        self.other_qparams = None
        self.raw_qparams = None      # the range of the layer's output before a fused post-op / residual add
        self.fused_post_op = False     # set by a family that runs the post-op inside the kernel

    def _finish(self, y: torch.Tensor, fused: bool) -> torch.Tensor:
        """float32 y -> the kernel's output: post-op (unless fused), then quint8 if chained."""
        if not fused and self.post_op is not None:
            y = _TORCH_POST[self.post_op](y)
        if self.out_qparams is not None:
            return chain_u8(as_u8(torch.quantize_per_tensor(y, *self.out_qparams, torch.quint8)))
        return y

    def out_shape(self, x_shape) -> tuple:
        raise NotImplementedError

    def _float_other(self, other):
        if other.dtype == torch.uint8:
            if self.other_qparams is None:
                raise RuntimeError(f"{self.kind}: a uint8 residual without its quantization parameters")
            return from_u8(other, *self.other_qparams).dequantize()
        return other

    def __call__(self, x, other=None):
        if _is_fake(x):  # shape propagation: an empty tensor of the output's shape and dtype
            return x.new_empty(self.out_shape(tuple(x.shape)),
                               dtype=torch.uint8 if self.out_qparams is not None else torch.float32)
        return self.run(x, other)

    def __repr__(self):
        return (f"{type(self).__name__}(out={self.out_features}, post_op={self.post_op}, "
                f"out={'quint8' if self.out_qparams else 'fp32'})")


# ------------------------------------------------------------------------------------- linear
class LinearKernel(_Kernel):
    kind = "linear"

    def out_shape(self, x_shape):
        return x_shape[:-1] + (self.out_features,)


class FbgemmLinear(LinearKernel):
    family = "fbgemm"

    def __init__(self, wq, w_scales, bias, x_qparams, **kw):
        super().__init__(wq, w_scales, bias, x_qparams, **kw)
        n = wq.shape[0]
        qw = torch._make_per_channel_quantized_tensor(wq.contiguous(), self.w_scales.double(),
                                                      torch.zeros(n, dtype=torch.int64), 0)
        with _engine("fbgemm"):
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


class TorchOnednnLinear(LinearKernel):
    family = "torch_onednn"

    def __init__(self, wq, w_scales, bias, x_qparams, *, rows: int = 1, **kw):
        super().__init__(wq, w_scales, bias, x_qparams, **kw)
        self.packed = torch.ops.onednn.qlinear_prepack(wq.contiguous(), [max(int(rows), 1), wq.shape[1]])
        self.w_zps = torch.zeros(wq.shape[0], dtype=torch.int64)
        self.post = _QLINEAR_POST[self.post_op]
        self.fused_post_op = True

    def run(self, x, other=None):
        u = input_u8(x, self.x_scale, self.x_zp)
        lead = u.shape[:-1]
        u2 = u.reshape(-1, u.shape[-1])
        if self.out_qparams is not None:
            ys, yz = self.out_qparams
            y = torch.ops.onednn.qlinear_pointwise(u2, self.x_scale, self.x_zp, self.packed, self.w_scales,
                                                   self.w_zps, self.bias, ys, yz, torch.uint8, *self.post)
            return chain_u8(y).reshape(*lead, y.shape[-1])
        y = torch.ops.onednn.qlinear_pointwise(u2, self.x_scale, self.x_zp, self.packed, self.w_scales, self.w_zps,
                                               self.bias, 1.0, 0, torch.float32, *self.post)
        return y.reshape(*lead, y.shape[-1])


class DnnlLinear(LinearKernel):
    """cpu_opt's oneDNN 3.2 int8 matmul (u8 x s8 -> f32, scales and zero point applied inside)."""
    family = "onednn"

    def __init__(self, wq, w_scales, bias, x_qparams, **kw):
        super().__init__(wq, w_scales, bias, x_qparams, **kw)
        from cpu_opt.dnnl.primitives import Matmul

        self.fused_post_op = self.post_op is not None
        self.mm = Matmul(wq.t(), self.bias, [self.post_op] if self.post_op else [], src_scale=self.x_scale,
                         weight_scales=self.w_scales, src_zero_point=self.x_zp)

    def run(self, x, other=None):
        u = input_u8(x, self.x_scale, self.x_zp).contiguous()
        return self._finish(self.mm(u), fused=True)


# ------------------------------------------------------------------------------------- conv2d
class Conv2dKernel(_Kernel):
    kind = "conv2d"

    def __init__(self, wq, w_scales, bias, x_qparams, *, stride, padding, dilation, groups, **kw):
        super().__init__(wq, w_scales, bias, x_qparams, **kw)
        if wq.dim() != 4:
            raise ValueError(f"conv2d: 4-D int8 weights expected, got shape {tuple(wq.shape)}")
        self.stride, self.padding, self.dilation = (list(_pair(v)) for v in (stride, padding, dilation))
        self.groups = int(groups)
        self.kernel_size = tuple(wq.shape[2:])

    def out_shape(self, x_shape):
        n, _, h, w = x_shape
        hw = [(d + 2 * p - dl * (k - 1) - 1) // s + 1
              for d, p, dl, k, s in zip((h, w), self.padding, self.dilation, self.kernel_size, self.stride)]
        return (n, self.out_features, *hw)


def _pair(v):
    return (v, v) if isinstance(v, int) else tuple(v)


class FbgemmConv2d(Conv2dKernel):
    family = "fbgemm"

    def __init__(self, wq, w_scales, bias, x_qparams, **kw):
        super().__init__(wq, w_scales, bias, x_qparams, **kw)
        qw = torch._make_per_channel_quantized_tensor(wq.contiguous(), self.w_scales.double(),
                                                      torch.zeros(wq.shape[0], dtype=torch.int64), 0)
        with _engine("fbgemm"):
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


class TorchOnednnConv2d(Conv2dKernel):
    family = "torch_onednn"

    def __init__(self, wq, w_scales, bias, x_qparams, *, x_shape=None, **kw):
        super().__init__(wq, w_scales, bias, x_qparams, **kw)
        self.packed = torch.ops.onednn.qconv_prepack(wq.contiguous(), self.w_scales, self.x_scale, self.x_zp,
                                                     self.stride, self.padding, self.dilation, self.groups,
                                                     list(x_shape) if x_shape is not None else None)
        self.w_zps = torch.zeros(wq.shape[0], dtype=torch.int64)
        self.fused_post_op = self.post_op in _QCONV_POST

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
        post = _QCONV_POST.get(self.post_op, ("none", [], ""))
        fused = self.post_op in _QCONV_POST and other is None
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


LINEAR_KERNELS = {"fbgemm": FbgemmLinear, "torch_onednn": TorchOnednnLinear, "onednn": DnnlLinear,
                  "torch": FbgemmLinear}
CONV_KERNELS = {"fbgemm": FbgemmConv2d, "torch_onednn": TorchOnednnConv2d, "torch": FbgemmConv2d}
