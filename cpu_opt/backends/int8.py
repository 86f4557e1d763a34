"""The int8 kernel interface of the x86 backends: one class per (family, layer kind), built once
from a layer's int8 weights and calibrated input scale, and called as ``kernel(x, other=None) -> y``.
The families themselves live beside it, one file per backend: ``fbgemm.py``, ``torch_onednn.py``,
``onednn_primitives.py``; ``cpu_opt.quant.kernels`` is the registry the int8 pass chooses from.

* ``x`` is float32 (quantized on the way in with the layer's input scale) or ``torch.uint8``
  coming straight from the previous int8 layer (a chain: no dequantize between them; the bytes are
  quantized with exactly this layer's input scale and zero point, which the graph pass checks);
* ``y`` is float32, or ``torch.uint8`` quantized with ``out_qparams`` when the consumer is int8 too.
  Chains carry plain ``uint8`` tensors, not torch's quantized dtypes, so fake-tensor shape
  propagation and the runtime's buffer analysis see ordinary tensors;
* ``post_op`` (``relu``, ``gelu_erf``, ``gelu_tanh``, ``silu``, ``hardswish``) runs fused inside the kernel where the
  family has it, else in float32 after it (the answer is the same, only the cost differs);
* ``other`` (convolutions) is a residual added before the post-op.

Families (names are the routing table's backends, :data:`FAMILIES`):

``fbgemm``        torch's FBGEMM ops (``quantized::linear*``, ``quantized::conv2d*``)
``torch_onednn``  torch's oneDNN 3.12 (``onednn::qlinear_pointwise``, ``onednn::qconv2d_pointwise``)
``onednn``        cpu_opt's own oneDNN 3.2 binding (``cpu_opt.dnnl.primitives.Matmul``, ``Conv2d``)
``amx``           cpu_opt's own int8 GEMM on AMX tiles (``native/kernels/amx_qlinear.c``, linear only)

Guards against the pitfalls in ``shared/KNOWN.md`` ("int8 in torch 2.13.0"): weights are always
prepacked by the kernel that uses them (an unpacked weight segfaults ``qlinear_pointwise``), packed
weights are never shared between engines, weight zero points must be zero (the kernels ignore
them: refused here), a u8 ``other`` is never handed to oneDNN's "add", and a ``quint8`` tensor is
never ``.view``-ed as ``uint8`` (that segfaults; its storage is re-wrapped instead).
"""
from __future__ import annotations

import threading

import torch
import torch.nn.functional as F


POST_OPS = ("relu", "gelu_erf", "gelu_tanh", "silu", "hardswish")
FAMILIES = ("fbgemm", "torch_onednn", "onednn", "amx")

_TORCH_POST = {
    None: None,
    "relu": torch.relu,
    "gelu_erf": F.gelu,
    "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
    "silu": F.silu,
    "hardswish": F.hardswish,
}


def prepack_engine(name: str):
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


class PerThreadState:
    """An object whose per-thread buffers live in ``self._tls``: a copy or a pickle leaves them
    behind (each thread of the copy makes its own)."""

    def __getstate__(self):
        state = dict(self.__dict__)
        state.pop("_tls", None)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._tls = threading.local()


class _Kernel(PerThreadState):
    family = "?"
    kind = "?"
    # a call returns a tensor of its own (new, or this kernel's reused buffer), never a view of an
    # input: the runtime's escape analysis (cpu_opt.compiler.runtime.may_alias_inputs) reads this
    output_aliases_inputs = False

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
        # the dtype of a float (unchained) output: bfloat16 where the graph pass found that only a bf16
        # consumer reads it (:meth:`write_bf16`, families that support it), else float32
        self.float_out = torch.float32
        # set by the runtime (cpu_opt.compiler.runtime) when no caller can see this layer's output: a
        # family that writes into a buffer of its own then reuses it across calls (one per thread)
        self.reuse_output = False
        self._tls = threading.local()

    def _output(self, key, shape, dtype, memory_format=torch.contiguous_format):
        """The output tensor of a call: this thread's reused buffer for ``key`` when
        :attr:`reuse_output` is set, else a new one."""
        if not self.reuse_output:
            return torch.empty(shape, dtype=dtype, memory_format=memory_format)
        bufs = getattr(self._tls, "buffers", None)
        if bufs is None:
            bufs = self._tls.buffers = {}
        out = bufs.get(key)
        if out is None:
            out = bufs[key] = torch.empty(shape, dtype=dtype, memory_format=memory_format)
        return out

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
        if other.dtype in (torch.uint8, torch.int8):
            if self.other_qparams is None:
                raise RuntimeError(f"{self.kind}: a {'uint8' if other.dtype == torch.uint8 else 'int8'} residual "
                                   "without its quantization parameters")
            if other.dtype == torch.int8:   # symmetric (cpu_opt's oneDNN writes these)
                return other.float() * self.other_qparams[0]
            return from_u8(other, *self.other_qparams).dequantize()
        return other

    # int8 (symmetric) residuals come only from cpu_opt's oneDNN convolutions to layers of the same family
    takes_int8_residual = False

    def __call__(self, x, other=None):
        if other is not None and other.dtype == torch.int8 and not self.takes_int8_residual:
            raise TypeError(f"{self.kind} on {self.family}: an int8 residual is for cpu_opt's oneDNN family only "
                            "(the int8 graph pass writes one only where every reader is on it)")
        if _is_fake(x):  # shape propagation: an empty tensor of the output's shape and dtype
            return x.new_empty(self.out_shape(tuple(x.shape)),
                               dtype=torch.uint8 if self.out_qparams is not None else self.float_out)
        return self.run(x, other)

    # families whose kernel can write a bfloat16 output itself (:meth:`write_bf16`)
    writes_bf16 = False

    def write_bf16(self) -> None:
        """Write the (float, unchained) output as bfloat16: for a layer read only by bf16 kernels."""
        if not self.writes_bf16 or self.out_qparams is not None:
            raise TypeError(f"{self!r} cannot write a bfloat16 output")
        self.float_out = torch.bfloat16

    def __repr__(self):
        out = "quint8" if self.out_qparams else "bf16" if self.float_out == torch.bfloat16 else "fp32"
        return f"{type(self).__name__}(out={self.out_features}, post_op={self.post_op}, out={out})"


# ------------------------------------------------------------------------------------- linear
class LinearKernel(_Kernel):
    kind = "linear"

    def out_shape(self, x_shape):
        return x_shape[:-1] + (self.out_features,)


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
