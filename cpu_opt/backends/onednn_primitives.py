"""cpu_opt's own oneDNN 3.2 binding used op by op (primitives, not Graph partitions): the int8
Linear and Conv2d kernels of the ``onednn`` family (u8 x s8 with scales, zero points, the residual
add and the activation inside the primitive)."""
from __future__ import annotations

import threading

import torch

from .int8 import Conv2dKernel, LinearKernel, _is_fake, chain_u8, input_u8


class DnnlLinear(LinearKernel):
    """cpu_opt's oneDNN 3.2 int8 matmul: u8 x s8 with the input, weight (and, for a chained consumer,
    output) scales and zero points, a residual add (a binary-add post-op reading the residual where it
    lies, as :class:`DnnlConv2d`'s) and the activation inside the primitive, written as uint8 or f32.
    Compiled and bound once per row count (:meth:`cpu_opt.dnnl.primitives.Matmul.bind`): a call sets
    a few pointers and runs."""
    family = "onednn"
    takes_int8_residual = True
    writes_bf16 = True

    def __init__(self, wq, w_scales, bias, x_qparams, **kw):
        super().__init__(wq, w_scales, bias, x_qparams, **kw)
        self.fused_post_op = self.post_op is not None
        self.wq_t = wq.t()
        self._bound: dict = {}
        self.mm = self._matmul(None)

    def _matmul(self, residual: torch.Tensor | None):
        from cpu_opt.dnnl.primitives import Matmul

        post = _residual_post_ops(residual, self.other_qparams) + ([self.post_op] if self.post_op else [])
        ys, yz = self.out_qparams if self.out_qparams is not None else (None, None)
        return Matmul(self.wq_t, self.bias, post, src_scale=self.x_scale, weight_scales=self.w_scales,
                      src_zero_point=self.x_zp, dst_dtype=torch.uint8 if self.out_qparams is not None else self.float_out,
                      dst_scale=ys, dst_zero_point=yz)

    def write_bf16(self) -> None:
        """The matmul writes bfloat16 (oneDNN converts in the kernel's epilogue): for the query, key
        and value projections of an attention that runs in bf16 (no cast of each of them)."""
        super().write_bf16()
        self._bound.clear()
        self._tls = threading.local()   # no float32 output buffer kept from before
        self.mm = self._matmul(None)

    def run(self, x, other=None):
        u = input_u8(x, self.x_scale, self.x_zp)
        lead = u.shape[:-1]
        u2 = u.reshape(-1, u.shape[-1])
        if not u2.is_contiguous():
            u2 = u2.contiguous()
        rows = u2.shape[0]
        r2 = None
        if other is not None:
            r2 = _residual_operand(other, self.other_qparams).reshape(rows, self.out_features)
            if not r2.is_contiguous():
                r2 = r2.contiguous()
        key = (rows, None if r2 is None else (r2.dtype, self.other_qparams))
        bound = self._bound.get(key)
        if bound is None:
            mm = self.mm if r2 is None else self._matmul(r2)
            bound = self._bound[key] = mm.bind(rows)
        y = bound(u2, self._output(key, bound.out_shape, bound.dst_dtype) if self.reuse_output else None, binary=r2)
        y = y.reshape(*lead, self.out_features)
        return chain_u8(y) if self.out_qparams is not None else y

    def __deepcopy__(self, memo):
        """Immutable once built (packed weights, bound primitives with per-thread memory): shared."""
        return self


def _residual_operand(other: torch.Tensor, other_qparams) -> torch.Tensor:
    """A residual as a binary post-op reads it: uint8 / int8 (with its qparams) or float32."""
    if other.dtype in (torch.uint8, torch.int8):
        if other_qparams is None:
            raise RuntimeError(f"a {'uint8' if other.dtype == torch.uint8 else 'int8'} residual without its "
                               "quantization parameters")
        if other.dtype == torch.int8 and other_qparams[1] != 0:
            raise RuntimeError(f"an int8 residual is symmetric (zero point 0), got {other_qparams}")
        return other
    return other if other.dtype == torch.float32 else other.float()


def _residual_post_ops(residual: torch.Tensor | None, other_qparams) -> list:
    """The post-ops that add ``residual`` (laid out as it is) to the result: an f32 one as it is, a
    uint8 one (scale ``a_s``, zero point ``a_z``) as ``a_s * (y / a_s - a_z + u)``."""
    from cpu_opt.dnnl.primitives import PostOp

    if residual is None:
        return []
    add = PostOp("add", shape=tuple(residual.shape), dtype=residual.dtype, strides=tuple(residual.stride()))
    if residual.dtype not in (torch.uint8, torch.int8):
        return [add]
    a_s, a_z = other_qparams
    return [PostOp("linear", alpha=1.0 / a_s, beta=-float(a_z)), add, PostOp("linear", alpha=a_s)]


class DnnlConv2d(Conv2dKernel):
    """cpu_opt's oneDNN 3.2 int8 convolution: u8 x s8 with the input, weight and output scales, the
    residual add and the activation in one primitive, channels-last, written as uint8 for a chained
    consumer or as f32. The residual is a binary-add post-op operand, read where it lies (never
    written, so never copied): an f32 one as it is, a uint8 one (scale ``a_s``, zero point ``a_z``)
    through ``a_s * (y / a_s - a_z + u)`` (two linear post-ops around the add). Compiled and bound
    once per input shape (:meth:`cpu_opt.dnnl.primitives.Conv2d.bind`): a call sets a few pointers
    and runs. With AMX oneDNN 3.2 runs it on ``brgconv:avx512_core_amx`` unless an input or output
    zero point is nonzero (then on a jit kernel, still faster than torch's oneDNN 3.12 there: see
    the routing table's rule)."""
    family = "onednn"
    takes_int8_residual = True

    def __init__(self, wq, w_scales, bias, x_qparams, *, x_shape=None, **kw):
        super().__init__(wq, w_scales, bias, x_qparams, **kw)
        self.wq = wq.contiguous()
        self.fused_post_op = True   # every post-op of cpu_opt.quant is a oneDNN eltwise
        # set by the int8 graph pass for a value read only as residuals: int8 output, symmetric
        # ``out_qparams`` (scale, 0), which keeps oneDNN 3.2 on brgconv (a uint8 zero point does not)
        self.out_int8 = False
        self._bound: dict = {}
        if x_shape is not None:   # compile (and pack the weights) now, not on the first call
            self._conv(tuple(x_shape), None)

    def _conv(self, shape: tuple, residual: torch.Tensor | None):
        """The bound primitive for input ``shape`` and a residual like ``residual`` (None, uint8
        with :attr:`other_qparams`, or f32, channels-last)."""
        kind = None if residual is None else (residual.dtype, tuple(residual.shape), tuple(residual.stride()),
                                              self.other_qparams)
        key = (shape, kind, self.out_int8, self.out_qparams)
        bound = self._bound.get(key)
        if bound is None:
            from cpu_opt.dnnl.primitives import Conv2d

            from cpu_opt.dnnl.primitives import PostOp

            ys, yz = self.out_qparams if self.out_qparams is not None else (None, None)
            dst = torch.float32 if self.out_qparams is None else torch.int8 if self.out_int8 else torch.uint8
            xs, bias = self.x_scale, self.bias
            if residual is not None and residual.dtype in (torch.uint8, torch.int8) and ys is not None \
                    and self.post_op in (None, "relu"):
                # an integer residual u (scale a_s, zero point a_z) into an integer output: compute
                # z = y / a_s + u - a_z instead of y + a_s (u - a_z), with the input scale and bias / a_s,
                # a_z folded into the bias and the output scale ys / a_s; ReLU commutes with the positive
                # a_s. One binary add instead of two linear post-ops around it (a ResNet-50 64->256 1x1
                # at batch 16: 1.96 vs 2.34 ms)
                a_s, a_z = self.other_qparams
                b = torch.zeros(self.out_features) if bias is None else bias
                xs, bias, ys = xs / a_s, (b / a_s - a_z).float().contiguous(), ys / a_s
                post = [PostOp("add", shape=tuple(residual.shape), dtype=residual.dtype,
                               strides=tuple(residual.stride()))]
            else:
                post = _residual_post_ops(residual, self.other_qparams)
            if self.post_op is not None:
                post.append(self.post_op)
            conv = Conv2d(self.wq, bias, stride=self.stride, padding=self.padding, dilation=self.dilation,
                          groups=self.groups, post_ops=post, dst_dtype=dst,
                          src_scale=xs, weight_scales=self.w_scales, dst_scale=ys,
                          src_zero_point=self.x_zp, dst_zero_point=yz)
            bound = self._bound[key] = conv.bind(shape, torch.channels_last)
        return bound

    def impl(self, shape) -> str:
        """oneDNN's implementation for input ``shape`` (``brgconv:avx512_core_amx`` ...)."""
        return self._conv(tuple(shape), None).impl

    def run(self, x, other=None):
        cl = torch.channels_last
        u = input_u8(x, self.x_scale, self.x_zp)
        if not u.is_contiguous(memory_format=cl):
            u = u.contiguous(memory_format=cl)
        if other is None:
            bound = self._conv(tuple(u.shape), None)
            y = bound(u, self._output(bound, bound.out_shape, bound.dst_dtype, cl) if self.reuse_output else None)
        else:
            other = _residual_operand(other, self.other_qparams)
            if not other.is_contiguous(memory_format=cl):
                other = other.contiguous(memory_format=cl)
            bound = self._conv(tuple(u.shape), other)
            y = bound(u, self._output(bound, bound.out_shape, bound.dst_dtype, cl) if self.reuse_output else None,
                      binary=other)
        return chain_u8(y) if y.dtype == torch.uint8 else y

    def __deepcopy__(self, memo):
        """Immutable once built (packed weights, bound primitives with per-thread memory): shared."""
        return self


class MaxPool2dU8:
    """``max_pool2d`` on chained uint8 activations of an int8 graph (``cpu_opt.quant.graph``): max
    commutes with the monotonic quantization, so the pooled bytes are the bytes of the pooled values
    and the chain goes on through the pooling (a ResNet stem: convolution -> max-pool -> convolution)
    without a dequantize and a quantize around it. oneDNN's pooling primitive, compiled per input
    shape, channels-last; the output buffer is reused across calls where the runtime allows (as the
    int8 kernels')."""
    output_aliases_inputs = False

    def __init__(self, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False):
        self.args = (kernel_size, stride if stride not in (None, [], ()) else kernel_size, padding, dilation,
                     bool(ceil_mode))
        self.reuse_output = False
        self._pools: dict = {}
        self._tls = threading.local()
        self.__name__ = "int8_max_pool2d"

    def _pool(self, shape):
        pool = self._pools.get(shape)
        if pool is None:
            from cpu_opt.dnnl.primitives import MaxPool2d

            pool = self._pools[shape] = MaxPool2d(shape, torch.uint8, *self.args)
        return pool

    def __call__(self, x):
        if _is_fake(x):
            k, s, p, d, c = self.args
            shape = torch.nn.functional.max_pool2d(torch.empty(x.shape, device="meta"), k, s, p, d, c).shape
            return torch.empty(shape, dtype=torch.uint8, device=x.device)
        if x.dtype != torch.uint8:
            raise TypeError(f"int8_max_pool2d takes chained uint8 activations, got {x.dtype}")
        cl = torch.channels_last
        if not x.is_contiguous(memory_format=cl):
            x = x.contiguous(memory_format=cl)
        pool = self._pool(tuple(x.shape))
        out = None
        if self.reuse_output:
            bufs = getattr(self._tls, "buffers", None)
            if bufs is None:
                bufs = self._tls.buffers = {}
            out = bufs.get(pool.out_shape)
            if out is None:
                out = bufs[pool.out_shape] = torch.empty(pool.out_shape, dtype=torch.uint8, memory_format=cl)
        return pool(x, out)

    def __deepcopy__(self, memo):
        return self

    def __repr__(self):
        return f"MaxPool2dU8{self.args}"


class OnednnEltwise:
    """An elementwise op on cpu_opt's oneDNN eltwise primitive (:class:`cpu_opt.dnnl.primitives.Eltwise`,
    compiled per shape, layout and dtype), f32 or bf16; ``in_place`` writes over the input (the
    graph pass sets it where nothing else reads the input). The tanh GELU's route: oneDNN Graph 3.2
    has only the erf GELU (the tanh form lowers into three partitions, 508 us at 128x3072 fp32) and
    torch's tanh GELU is scalar (343 us), against this primitive's vectorized kernel."""

    def __init__(self, kind: str, in_place: bool = False):
        self.kind, self.in_place = kind, in_place
        self._prims: dict = {}
        self.__name__ = f"onednn_{kind}" + ("_" if in_place else "")

    def __call__(self, x):
        if _is_fake(x):
            return x if self.in_place else torch.empty_like(x)
        key = (tuple(x.shape), x.stride(), x.dtype)
        prim = self._prims.get(key)
        if prim is None:
            from cpu_opt.dnnl.primitives import Eltwise

            prim = self._prims[key] = Eltwise(self.kind, x.shape, x.dtype, x.stride())
        return prim(x, x if self.in_place else None)

    def __deepcopy__(self, memo):
        return self

    def __repr__(self):
        return f"OnednnEltwise({self.kind!r}, in_place={self.in_place})"
