"""cpu_opt's own oneDNN 3.2 binding used op by op (primitives, not Graph partitions): the int8
Linear and Conv2d kernels of the ``onednn`` family (u8 x s8 with scales, zero points, the residual
add and the activation inside the primitive)."""
from __future__ import annotations

import collections
import threading

import torch

from .int8 import Conv2dKernel, LinearKernel, PerThreadState, _is_fake, chain_u8, input_u8


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
        # a fresh output every call, also where the runtime allows reusing one (reuse_output): a buffer kept
        # per layer is cold by the time the layer runs again (49 of them in BERT-base), a fresh one comes
        # back hot from the allocator. HF BERT-base int8, Xeon with AMX, 2 threads, paired in one process:
        # batch 1 17.24 -> 16.74 and 17.18 -> 16.95 ms, batch 4 46.8 -> 39.8, batch 16 151.0 -> 122.9
        y = bound(u2, None, binary=r2)
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

    def _integer_residual(self, residual: torch.Tensor) -> bool:
        """Is the residual added as ``y / a_s + u - a_z`` (an integer residual into an integer output
        through at most a ReLU: one add, scales folded)?"""
        return residual.dtype in (torch.uint8, torch.int8) and self.out_qparams is not None \
            and self.post_op in (None, "relu")

    def _conv(self, shape: tuple, residual: torch.Tensor | None, in_place: bool = False):
        """The bound primitive for input ``shape`` and a residual like ``residual`` (None, uint8
        with :attr:`other_qparams`, or f32, channels-last). ``in_place``: the residual is summed from
        the destination (a ``sum`` post-op; the output overwrites it), for an integer residual of
        the output's shape and layout (see :meth:`chain_bind`)."""
        kind = None if residual is None else (residual.dtype, tuple(residual.shape), tuple(residual.stride()),
                                              self.other_qparams)
        key = (shape, kind, self.out_int8, self.out_qparams, in_place)
        bound = self._bound.get(key)
        if bound is None:
            from cpu_opt.dnnl.primitives import Conv2d

            from cpu_opt.dnnl.primitives import PostOp

            ys, yz = self.out_qparams if self.out_qparams is not None else (None, None)
            dst = torch.float32 if self.out_qparams is None else torch.int8 if self.out_int8 else torch.uint8
            xs, bias = self.x_scale, self.bias
            if residual is not None and self._integer_residual(residual):
                # an integer residual u (scale a_s, zero point a_z) into an integer output: compute
                # z = y / a_s + u - a_z instead of y + a_s (u - a_z), with the input scale and bias / a_s,
                # a_z folded into the bias and the output scale ys / a_s; ReLU commutes with the positive
                # a_s. One binary add instead of two linear post-ops around it (a ResNet-50 64->256 1x1
                # at batch 16: 1.96 vs 2.34 ms)
                a_s, a_z = self.other_qparams
                b = torch.zeros(self.out_features) if bias is None else bias
                xs, bias, ys = xs / a_s, (b / a_s - a_z).float().contiguous(), ys / a_s
                # in place: the same sum, read from the destination (scale 1, zero point 0: the same
                # arithmetic as the add, so the same bits; 16x64x56x56 -> 256 1x1: 1.51 vs 1.93 ms)
                post = [PostOp("sum", dtype=residual.dtype) if in_place else
                        PostOp("add", shape=tuple(residual.shape), dtype=residual.dtype,
                               strides=tuple(residual.stride()))]
            else:
                if in_place:
                    raise ValueError(f"{self!r}: only an integer residual into an integer output is summed in place")
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

    def chain_src(self, x: torch.Tensor) -> torch.Tensor:
        """The input as the bound primitive reads it: uint8 bytes, channels-last."""
        u = input_u8(x, self.x_scale, self.x_zp)
        return u if u.is_contiguous(memory_format=torch.channels_last) else u.contiguous(memory_format=torch.channels_last)

    def chain_other(self, other: torch.Tensor) -> torch.Tensor:
        """The residual as the binary post-op reads it (uint8 / int8 / f32), channels-last."""
        other = _residual_operand(other, self.other_qparams)
        cl = torch.channels_last
        return other if other.is_contiguous(memory_format=cl) else other.contiguous(memory_format=cl)

    @property
    def writes_chained(self) -> bool:
        """Is the output the integer bytes the next member of a :class:`PrimitiveChain` reads as
        they are (not a float it would quantize)?"""
        return self.out_qparams is not None

    def chain_bind(self, src_shape: tuple, other: torch.Tensor | None, in_place: bool = False):
        """The bound primitive for a uint8 channels-last input of ``src_shape`` and a residual like
        ``other`` (as :meth:`chain_other` gives it; a meta tensor will do), for
        :class:`PrimitiveChain`. ``in_place``: the residual is read from the destination, which the
        output overwrites (the chain asks where the residual's buffer is its own and this is its last
        reader); None where that does not apply (a float residual or output, another layout)."""
        if not in_place:
            return self._conv(tuple(src_shape), other)
        if other is None or not self._integer_residual(other):
            return None
        from cpu_opt.dnnl.primitives import _same_strides

        b = self._conv(tuple(src_shape), other, in_place=True)
        if b.out_shape != tuple(other.shape) or not _same_strides(other, b.out_strides):
            return None
        return b

    def run(self, x, other=None):
        u = self.chain_src(x)
        other = None if other is None else self.chain_other(other)
        bound = self._conv(tuple(u.shape), other)
        out = self._output(bound, bound.out_shape, bound.dst_dtype, torch.channels_last) if self.reuse_output else None
        y = bound(u, out) if other is None else bound(u, out, binary=other)
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

    def chain_src(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.uint8:
            raise TypeError(f"int8_max_pool2d takes chained uint8 activations, got {x.dtype}")
        cl = torch.channels_last
        return x if x.is_contiguous(memory_format=cl) else x.contiguous(memory_format=cl)

    writes_chained = True   # uint8 bytes in, uint8 bytes out

    def chain_bind(self, src_shape: tuple, other=None, in_place: bool = False):
        if other is not None:
            raise TypeError("int8_max_pool2d takes no residual")
        return None if in_place else self._pool(tuple(src_shape))

    def __call__(self, x):
        if _is_fake(x):
            k, s, p, d, c = self.args
            shape = torch.nn.functional.max_pool2d(torch.empty(x.shape, device="meta"), k, s, p, d, c).shape
            return torch.empty(shape, dtype=torch.uint8, device=x.device)
        x = self.chain_src(x)
        pool = self._pool(tuple(x.shape))
        out = None
        if self.reuse_output:
            bufs = getattr(self._tls, "buffers", None)
            if bufs is None:
                bufs = self._tls.buffers = {}
            out = bufs.get(pool.out_shape)
            if out is None:
                out = bufs[pool.out_shape] = torch.empty(pool.out_shape, dtype=torch.uint8,
                                                         memory_format=torch.channels_last)
        return pool(x, out)

    def __deepcopy__(self, memo):
        return self

    def __repr__(self):
        return f"MaxPool2dU8{self.args}"


# the kernels a PrimitiveChain takes (one bound primitive per call, chain_src / chain_bind)
CHAIN_MEMBERS = (DnnlConv2d, MaxPool2dU8)
_UNBOUND = object()


class PrimitiveChain(PerThreadState):
    """Consecutive steps of the runtime program that are all primitives of cpu_opt's oneDNN binding
    (an int8 CNN's convolutions and max-pool: ResNet-50's 53 convolutions and its stem pooling), run
    as one step. Per thread and input signature the chain binds every primitive's memory once: the
    values that stay inside it live in buffers it owns, shared by liveness (a buffer is taken again
    once its last reader has run), and one scratchpad serves all members. A call then prepares what
    comes in from outside (as each member would), allocates what a caller may keep, sets those few
    pointers and runs the primitives back to back. It saves the Python around each layer (the checks,
    look-ups and pointer setting of a layer-by-layer call), never kernel time: the numbers are the
    layer-by-layer path's (:meth:`_stepwise`), which still runs where the chain cannot bind (fake
    tensors during shape propagation; a member that would convert a value coming from inside).

    ``members``: ``[(kernel, src_ref, other_ref)]``, a ref being ``("in", i)`` (the chain's i-th
    input), ``("step", j)`` (member j's output) or None; ``exports``: the members whose outputs the
    chain returns, in order; ``fresh``: per export, whether it is a new tensor on every call (a
    caller may keep it) or a buffer reused across calls (the runtime found no caller sees it)."""

    output_aliases_inputs = False
    # input signatures bound per thread (each holds the buffers of the values inside the chain; a
    # model served at many shapes keeps the most recently used ones)
    MAX_BINDINGS = 8

    def __init__(self, members, exports, fresh):
        if len(exports) != len(fresh):
            raise ValueError(f"{len(exports)} exports but {len(fresh)} fresh flags")
        for j, (_kernel, src, other) in enumerate(members):
            for ref in (src, other):
                if ref is not None and not (ref[0] == "in" or (ref[0] == "step" and 0 <= ref[1] < j)):
                    raise ValueError(f"member {j} reads {ref}: a member reads the chain's inputs or earlier members")
            if src is None:
                raise ValueError(f"member {j} has no source")
        self.members = list(members)
        self.exports = list(exports)
        self.fresh = list(fresh)
        self._tls = threading.local()
        self.unbound: dict = {}   # input signature -> why the chain could not bind (it runs layer by layer)
        self.__name__ = "onednn_primitive_chain"

    def __deepcopy__(self, memo):
        return self   # its kernels are immutable and shared by a deep copy; bindings are per thread

    def __repr__(self):
        return f"PrimitiveChain({len(self.members)} primitives, {len(self.exports)} outputs)"

    def bindings(self) -> dict:
        """This thread's bindings: input signature -> the bound per-call function (its ``in_place``:
        member -> the residual's producer whose buffer it sums from), or None where the chain runs
        layer by layer."""
        return dict(getattr(self._tls, "bound", None) or {})

    def _stepwise(self, inputs):
        vals = []
        for kernel, src, other in self.members:
            x = inputs[src[1]] if src[0] == "in" else vals[src[1]]
            if other is None:
                vals.append(kernel(x))
            else:
                vals.append(kernel(x, inputs[other[1]] if other[0] == "in" else vals[other[1]]))
        return tuple(vals[j] for j in self.exports)

    def __call__(self, *inputs):
        if any(_is_fake(t) for t in inputs):
            return self._stepwise(inputs)
        key = tuple((t.dtype, tuple(t.shape), t.stride()) for t in inputs)
        bound = getattr(self._tls, "bound", None)
        if bound is None:
            bound = self._tls.bound = collections.OrderedDict()
        run = bound.get(key, _UNBOUND)
        if run is _UNBOUND:
            try:
                run = self._bind(inputs)
            except Exception as e:  # noqa: BLE001 - the members' own path still runs (and raises what is wrong)
                run = None
                self.unbound[key] = f"{type(e).__name__}: {e}"
            bound[key] = run
            while len(bound) > self.MAX_BINDINGS:   # the least recently used signature's buffers go
                bound.popitem(last=False)
        else:
            bound.move_to_end(key)
        return self._stepwise(inputs) if run is None else run(inputs)

    def _bind(self, inputs):
        """The per-call function for inputs like these, or None where a member would convert a value
        that comes from inside the chain (then every call runs :meth:`_stepwise`)."""
        from cpu_opt.dnnl import lib as L
        from cpu_opt.dnnl.memory import memory, set_handle
        from cpu_opt.dnnl.primitives import _same_strides

        from .int8 import activation_qmax

        if activation_qmax() < 255:   # the layer-by-layer path clamps uint8 outputs (chain_u8)
            return None
        layouts = []      # per member: (shape, strides, dtype) of its output
        external = []     # (member, role, input index, (shape, strides, dtype) after the member's preparation)
        specs = []
        exported = {j: k for k, j in enumerate(self.exports)}
        reads = [[r[1] for r in (src, other) if r is not None and r[0] == "step"] for _k, src, other in self.members]
        last_read = {i: j for j, rs in enumerate(reads) for i in rs}
        in_place = {}     # member -> the member whose buffer (its residual) it sums from and overwrites
        for j, (kernel, src, other) in enumerate(self.members):
            prepared = []
            for role, ref in (("src", src), ("other", other)):
                if ref is None:
                    prepared.append(None)
                    continue
                if ref[0] == "in":
                    t = inputs[ref[1]]
                else:
                    shape, strides, dtype = layouts[ref[1]]
                    t = torch.empty_strided(shape, strides, dtype=dtype, device="meta")
                try:
                    p = kernel.chain_src(t) if role == "src" else kernel.chain_other(t)
                except (NotImplementedError, RuntimeError, TypeError):
                    if ref[0] == "in":
                        raise
                    return None   # a float value inside (quantized by its reader): layer by layer
                if ref[0] == "step" and p is not t:
                    return None
                if ref[0] == "in":
                    external.append((j, role, ref[1], (tuple(p.shape), p.stride(), p.dtype)))
                prepared.append(p)
            b = None
            if other is not None and other[0] == "step" and other != src and other[1] not in exported \
                    and last_read[other[1]] == j:
                # this member is the residual's last reader and the chain owns its buffer
                try:
                    b = kernel.chain_bind(tuple(prepared[0].shape), prepared[1], in_place=True)
                except Exception:  # noqa: BLE001 - no in-place sum here (oneDNN refused it): the add
                    b = None
                if b is not None:
                    in_place[j] = other[1]
            if b is None:
                b = kernel.chain_bind(tuple(prepared[0].shape), prepared[1])
            if b.empty or b.accumulates != (j in in_place) or prepared[0].dtype != b.src_dtype \
                    or not _same_strides(prepared[0], b.src_strides):
                return None
            spec = b.exec_spec()
            if (spec.bin_arg is None) != (prepared[1] is None or j in in_place):
                return None
            if prepared[1] is not None and j not in in_place:
                bshape, bstrides, bdtype = spec.bin_layout
                o = prepared[1]
                if tuple(o.shape) != bshape[len(bshape) - o.dim():] or o.dtype != bdtype \
                        or not _same_strides(o, bstrides[len(bshape) - o.dim():]):
                    return None
            specs.append((b, spec))
            layouts.append((b.out_shape, b.out_strides, b.dst_dtype))

        n = len(self.members)
        dst_bytes = [next(md for a, md in spec.args if a == spec.dst_arg).size_bytes() for _b, spec in specs]
        # buffers of the values that stay inside, by liveness; persistent exports own theirs
        buffers: list = [None] * n
        persistent: dict = {}
        free: list = []   # (nbytes, tensor)
        for j in range(n):
            if j in exported:
                if not self.fresh[exported[j]]:
                    shape, strides, dtype = layouts[j]
                    persistent[j] = buffers[j] = torch.empty_strided(shape, strides, dtype=dtype)
            elif j in in_place:
                buffers[j] = buffers[in_place[j]]   # the residual's buffer, now this member's output
                if buffers[j].numel() < dst_bytes[j]:
                    return None
            else:
                fits = [f for f in free if f[0] >= dst_bytes[j]]
                if fits:
                    best = min(fits, key=lambda f: f[0])
                    free.remove(best)
                    buffers[j] = best[1]
                else:
                    buffers[j] = torch.empty(max(dst_bytes[j], 1), dtype=torch.uint8)
            for i in [*reads[j], j]:
                if i not in exported and buffers[i] is not None and last_read.get(i, j) == j \
                        and in_place.get(j) != i and all(buffers[i] is not f[1] for f in free):
                    free.append((buffers[i].numel(), buffers[i]))
        scratch_bytes = max([md.size_bytes() for _b, spec in specs for a, md in spec.args if a in spec.per_thread],
                            default=0)
        scratch = torch.empty(max(scratch_bytes, 1), dtype=torch.uint8)

        # memory objects of the chain's own: the pointers of inside values and constants set once
        seq, late = [], []   # late: (memory, ("in", member, role, input) | ("fresh", export index))
        keep = [scratch, buffers, specs]
        for j, (kernel, src, other) in enumerate(self.members):
            _b, spec = specs[j]
            args = L.ffi().new("dnnl_exec_arg_t[]", len(spec.args))
            mems = []
            for k, (arg, md) in enumerate(spec.args):
                if arg in spec.per_thread:
                    t = scratch
                elif arg in spec.const:
                    t = spec.const[arg]
                elif arg == spec.dst_arg:
                    t = buffers[j]
                    if t is None:
                        late.append((len(mems), j, ("fresh", exported[j])))
                else:
                    ref = src if arg == spec.src_arg else other if arg == spec.bin_arg else None
                    if ref is None:
                        raise RuntimeError(f"{spec.what}: argument {arg} is neither bound nor a chain value")
                    t = buffers[ref[1]] if ref[0] == "step" else None
                    if ref[0] == "in":
                        late.append((len(mems), j, ("in", "src" if arg == spec.src_arg else "other", ref[1])))
                    elif t is None:   # an earlier member's fresh export
                        late.append((len(mems), j, ("fresh", exported[ref[1]])))
                m = memory(md, t)
                mems.append(m)
                args[k].arg = arg
                args[k].memory = m
            seq.append((spec.prim, len(spec.args), args, mems, spec.what))
        late_mems = [(seq[j][3][pos], j, what) for pos, j, what in late]
        fresh_layouts = [layouts[j] if self.fresh[k] else None for k, j in enumerate(self.exports)]
        members = self.members
        ext_layout = {(j, role, i): lay for j, role, i, lay in external}
        exports, lib = self.exports, L.lib()

        def run(inputs):
            outs = [None if lay is None else torch.empty_strided(lay[0], lay[1], dtype=lay[2]) for lay in fresh_layouts]
            held = []
            for m, j, what in late_mems:
                if what[0] == "fresh":
                    t = outs[what[1]]
                else:
                    _, role, i = what
                    kernel = members[j][0]
                    t = kernel.chain_src(inputs[i]) if role == "src" else kernel.chain_other(inputs[i])
                    shape, strides, dtype = ext_layout[(j, role, i)]
                    if tuple(t.shape) != shape or t.dtype != dtype or not _same_strides(t, strides):
                        raise RuntimeError(f"chain member {j}: input {i} prepared as {t.dtype} {tuple(t.shape)} "
                                           f"{t.stride()}, bound for {dtype} {shape} {strides}")
                    held.append(t)
                set_handle(m, t)
            stream = L.stream()
            for prim, nargs, args, _mems, what in seq:
                st = lib.dnnl_primitive_execute(prim, stream, nargs, args)
                if st:
                    L.check(st, "dnnl_primitive_execute", what)
            L.check(lib.dnnl_stream_wait(stream), "dnnl_stream_wait", "primitive chain")
            del held
            return tuple(outs[k] if outs[k] is not None else persistent[j] for k, j in enumerate(exports))

        run.keep = keep
        run.in_place = dict(in_place)   # what was summed in place (member -> the residual's producer)
        return run


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
