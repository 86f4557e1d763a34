"""oneDNN primitives on torch tensors: matmul, inner product, 2-D convolution, reorder.

Each op has a *layer* form that packs its weights once into the layout the primitive prefers
(:class:`Matmul`, :class:`InnerProduct`, :class:`Conv2d`) and a functional form for two runtime
operands (:func:`matmul`). Compiled primitives come from :data:`cpu_opt.dnnl.cache.CACHE`, keyed by
op, shapes, strides, dtypes and attributes, so a repeated call with the same shapes creates
nothing. Tensors are bound to oneDNN memory by data pointer, without copies.

Post-ops are :class:`PostOp` values: ``PostOp("relu")``, ``"gelu_erf"``, ``"gelu_tanh"``,
``"silu"``, ``"sigmoid"``, ``"tanh"``, ``"hardswish"``, ``PostOp("sum", scale=1.0)`` (accumulate
into the ``out`` tensor passed at call time) and ``PostOp("add")`` (add a broadcastable tensor
passed at call time).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch

from .._memory import overlaps
from . import lib as L
from .cache import CACHE
from .memory import TORCH_TO_DNNL, BorrowedDesc, MemoryDesc, ThreadSlots, dnnl_dtype, empty_for, memory, set_handle

ELTWISE = {
    # name: (alg kind, alpha, beta)
    "relu": ("dnnl_eltwise_relu", 0.0, 0.0),
    "gelu_erf": ("dnnl_eltwise_gelu_erf", 0.0, 0.0),
    "gelu_tanh": ("dnnl_eltwise_gelu_tanh", 0.0, 0.0),
    "silu": ("dnnl_eltwise_swish", 1.0, 0.0),
    "sigmoid": ("dnnl_eltwise_logistic", 0.0, 0.0),
    "tanh": ("dnnl_eltwise_tanh", 0.0, 0.0),
    "hardswish": ("dnnl_eltwise_hardswish", 1.0 / 6.0, 0.5),
    "hardsigmoid": ("dnnl_eltwise_hardsigmoid", 1.0 / 6.0, 0.5),
    "linear": ("dnnl_eltwise_linear", None, None),   # alpha * x + beta: PostOp("linear", alpha=, beta=)
}


@dataclass(frozen=True)
class PostOp:
    kind: str                     # an ELTWISE name, "sum", "add" or "mul"
    scale: float = 1.0            # for "sum" (its dtype: the summand's, where it is integer and not the dst's)
    zero_point: int = 0           # for "sum" into an integer dst: adds scale * (dst - zero_point)
    shape: tuple = ()             # for "add"/"mul": the other operand's shape (broadcastable to dst)
    dtype: torch.dtype = torch.float32
    strides: tuple | None = None  # for "add"/"mul": the other operand's strides (default: row-major)
    alpha: float = 1.0            # for "linear": alpha * x + beta
    beta: float = 0.0

    def __post_init__(self):
        if self.kind not in ELTWISE and self.kind not in ("sum", "add", "mul"):
            raise ValueError(f"unknown post-op {self.kind!r}; expected one of "
                             f"{sorted(ELTWISE) + ['sum', 'add', 'mul']}")


def _post_ops(ops: Sequence[PostOp | str]) -> tuple[PostOp, ...]:
    return tuple(PostOp(o) if isinstance(o, str) else o for o in ops)


class Compiled:
    """A primitive descriptor and its primitive, with per-thread memory slots."""

    def __init__(self, pd, what: str):
        f, l = L.ffi(), L.lib()
        self.pd = f.gc(pd, l.dnnl_primitive_desc_destroy)
        p = f.new("dnnl_primitive_t *")
        L.check(l.dnnl_primitive_create(p, self.pd), "dnnl_primitive_create", what)
        self.prim = f.gc(p[0], l.dnnl_primitive_destroy)
        self.what = what
        self.slots: ThreadSlots | None = None

    def query_md(self, which: str, index: int = 0) -> BorrowedDesc:
        h = L.lib().dnnl_primitive_desc_query_md(self.pd, getattr(L.lib(), f"dnnl_query_{which}_md"), index)
        if h == L.ffi().NULL:
            raise RuntimeError(f"{self.what}: no {which} memory descriptor")
        return BorrowedDesc(h, self)

    @property
    def impl(self) -> str:
        """The implementation oneDNN picked (``brg:avx512_core``, ``gemm:jit`` ...)."""
        out = L.ffi().new("char **")
        L.check(L.lib().dnnl_primitive_desc_query(self.pd, L.lib().dnnl_query_impl_info_str, 0, out),
                "dnnl_primitive_desc_query")
        return L.ffi().string(out[0]).decode()

    def bind(self, args: list[tuple[int, MemoryDesc]], fixed: dict | None = None):
        """The primitive's arguments; with a user scratchpad (:class:`_Attr` asks for one) each
        thread gets its own scratchpad buffer."""
        scratch = self.query_md("scratchpad")
        per_thread = ()
        if scratch.size_bytes() > 0:
            args = [*args, (L.lib().DNNL_ARG_SCRATCHPAD, scratch)]
            per_thread = (L.lib().DNNL_ARG_SCRATCHPAD,)
        self.args, self.per_thread = args, per_thread
        self.slots = ThreadSlots(args, fixed or {}, per_thread)

    def run(self, tensors: dict[int, torch.Tensor]) -> None:
        mems, args = self.slots.get()
        for arg, t in tensors.items():
            set_handle(mems[arg], t)
        L.check(L.lib().dnnl_primitive_execute(self.prim, L.stream(), len(args), args),
                "dnnl_primitive_execute", self.what)
        L.check(L.lib().dnnl_stream_wait(L.stream()), "dnnl_stream_wait", self.what)


class _Attr:
    """An owned dnnl_primitive_attr_t with post-ops, scales and zero points."""

    def __init__(self, post_ops: tuple[PostOp, ...] = (), scales: dict[int, int] | None = None,
                 zero_points: dict[int, int] | None = None, dst_ndims: int = 2):
        f, l = L.ffi(), L.lib()
        p = f.new("dnnl_primitive_attr_t *")
        L.check(l.dnnl_primitive_attr_create(p), "dnnl_primitive_attr_create")
        self.handle = f.gc(p[0], l.dnnl_primitive_attr_destroy)
        self.binary_args: list[tuple[int, MemoryDesc]] = []
        # The scratchpad in user mode, one buffer per calling thread (Compiled.bind): with oneDNN's
        # library-managed scratchpad, the AVX-512 and AMX kernels (brg:*, gemm:jit:bf16) gave wrong
        # numbers (tens off) when two Python threads ran primitives at once; AVX2's gemm:jit did not.
        L.check(l.dnnl_primitive_attr_set_scratchpad_mode(self.handle, l.dnnl_scratchpad_mode_user),
                "dnnl_primitive_attr_set_scratchpad_mode")
        if post_ops:
            pp = f.new("dnnl_post_ops_t *")
            L.check(l.dnnl_post_ops_create(pp), "dnnl_post_ops_create")
            po = f.gc(pp[0], l.dnnl_post_ops_destroy)
            for idx, op in enumerate(post_ops):
                if op.kind in ELTWISE:
                    alg, a, b = ELTWISE[op.kind]
                    if op.kind == "linear":
                        a, b = float(op.alpha), float(op.beta)
                    L.check(l.dnnl_post_ops_append_eltwise(po, getattr(l, alg), a, b),
                            "dnnl_post_ops_append_eltwise", op.kind)
                elif op.kind == "sum":
                    # an integer summand may differ from an integer dst in sign (an s8 residual summed into
                    # a u8 output: oneDNN takes a sum data type of the dst's size); else the dst's type
                    sum_dt = dnnl_dtype(op.dtype) if op.dtype in (torch.uint8, torch.int8) else l.dnnl_data_type_undef
                    L.check(l.dnnl_post_ops_append_sum(po, float(op.scale), int(op.zero_point), sum_dt),
                            "dnnl_post_ops_append_sum")
                else:
                    shape = tuple(op.shape)
                    strides = op.strides
                    if len(shape) < dst_ndims:
                        if strides is not None:
                            strides = (0,) * (dst_ndims - len(shape)) + tuple(strides)
                        shape = (1,) * (dst_ndims - len(shape)) + shape
                    md = MemoryDesc.strided(shape, op.dtype, strides)
                    alg = l.dnnl_binary_add if op.kind == "add" else l.dnnl_binary_mul
                    L.check(l.dnnl_post_ops_append_binary(po, alg, md.handle), "dnnl_post_ops_append_binary")
                    arg = l.DNNL_ARG_ATTR_MULTIPLE_POST_OP_BASE * (idx + 1) | l.DNNL_ARG_SRC_1
                    self.binary_args.append((arg, md))
            L.check(l.dnnl_primitive_attr_set_post_ops(self.handle, po), "dnnl_primitive_attr_set_post_ops")
        for arg, mask in (scales or {}).items():
            L.check(l.dnnl_primitive_attr_set_scales_mask(self.handle, arg, mask), "dnnl_primitive_attr_set_scales_mask")
        for arg, mask in (zero_points or {}).items():
            L.check(l.dnnl_primitive_attr_set_zero_points_mask(self.handle, arg, mask),
                    "dnnl_primitive_attr_set_zero_points_mask")


def _check_tensor(t, name: str, dtypes=None, ndim=None):
    """A dense CPU tensor whose bytes are its values: oneDNN reads and writes ``data_ptr()`` directly,
    so sparse, quantized, meta and lazily negated/conjugated views are refused by name."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{name} must be on the CPU, got {t.device}")
    if t.layout != torch.strided:
        raise ValueError(f"{name} must be a dense (strided) tensor, got layout {t.layout}")
    if t.is_quantized:
        raise TypeError(f"{name} is a quantized tensor ({t.dtype}); pass its int_repr() with scales instead")
    if t.is_neg() or t.is_conj():
        raise ValueError(f"{name} is a lazily {'negated' if t.is_neg() else 'conjugated'} view whose memory does "
                         f"not hold its values; call .resolve_neg() / .resolve_conj() first")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"{name} has dtype {t.dtype}; expected one of {[str(d) for d in dtypes]}")
    if ndim is not None and t.dim() not in (ndim if isinstance(ndim, tuple) else (ndim,)):
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")


FLOAT_DTYPES = (torch.float32, torch.bfloat16)


def _checked_bias(bias, n: int, what: str):
    if bias is None:
        return None
    _check_tensor(bias, "bias", FLOAT_DTYPES, 1)
    if bias.numel() != n:
        raise ValueError(f"bias has {bias.numel()} elements; the layer has {n} {what}")
    return bias.contiguous()
SRC_DTYPES = (torch.float32, torch.bfloat16, torch.uint8, torch.int8)


class _PackedWeights:
    """Weights reordered once per layout the primitives ask for (usually one)."""

    def __init__(self, src: torch.Tensor):
        self.src = src
        self.src_md = MemoryDesc.of(src)
        self.packed: list[tuple[BorrowedDesc, torch.Tensor]] = []

    def for_md(self, md: BorrowedDesc) -> torch.Tensor:
        for have, buf in self.packed:
            if have == md:
                return buf
        buf = empty_for(md)
        reorder_into(self.src, self.src_md, buf, md)
        self.packed.append((md, buf))
        return buf


def _matmul_primitive(src_md, w_md, b_md, dst_md, attr: "_Attr", what: str) -> Compiled:
    pd = L.ffi().new("dnnl_primitive_desc_t *")
    L.check(L.lib().dnnl_matmul_primitive_desc_create(pd, L.engine(), src_md.handle, w_md.handle,
                                                      b_md.handle if b_md is not None else L.ffi().NULL,
                                                      dst_md.handle, attr.handle),
            "dnnl_matmul_primitive_desc_create", what)
    return Compiled(pd[0], what)


def _check_out(out: torch.Tensor, shape, dtype: torch.dtype, *inputs: torch.Tensor, memory_format=None) -> None:
    """``out=`` must be exactly what the primitive writes: the dtype (a bf16 or int8 buffer given fp32
    bytes overflows the heap), the shape, a dense layout with no self-overlap, and no memory shared
    with an input (oneDNN would read what it already overwrote)."""
    _check_tensor(out, "out")
    if out.dtype != dtype:
        raise TypeError(f"out has dtype {out.dtype}; this op writes {dtype}")
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"out has shape {tuple(out.shape)}; expected {tuple(shape)}")
    fmt = memory_format or torch.contiguous_format
    if not out.is_contiguous(memory_format=fmt):
        raise ValueError(f"out must be contiguous ({fmt}); got strides {tuple(out.stride())}")
    for i, t in enumerate(inputs):
        if t is not None and overlaps(out, t):
            raise ValueError(f"out shares memory with input {i}; pass a separate buffer")


def op_strides(post_ops, i: int):
    """The declared strides of the ``i``-th add/mul post-op's operand (None: row-major)."""
    return [p for p in post_ops if p.kind in ("add", "mul")][i].strides


def _binary_operand(t: torch.Tensor, md: MemoryDesc, strides) -> torch.Tensor:
    """``t`` as the binary post-op's memory descriptor reads it: its dtype, and row-major (or the
    declared ``strides``) over the declared shape (a copy where ``t`` lies otherwise)."""
    t = t.to(md.dtype)
    if strides is None:
        return t.contiguous()
    shape = tuple(md.shape)[len(md.shape) - t.dim():] if t.dim() <= len(md.shape) else tuple(t.shape)
    strides = tuple(strides)[len(strides) - t.dim():]
    if tuple(t.stride()) == strides:
        return t
    return torch.empty_strided(shape, strides, dtype=t.dtype).copy_(t.reshape(shape))


def _strip_leading_ones(shape) -> tuple:
    shape = tuple(shape)
    while shape and shape[0] == 1:
        shape = shape[1:]
    return shape


def _post_op_key(post_ops):
    return tuple((p.kind, p.scale, p.zero_point, tuple(p.shape), str(p.dtype), p.strides, p.alpha, p.beta)
                 for p in post_ops)


class _QuantArgs:
    """The int8 scale / zero-point arguments of a layer primitive (``src_scale``, ``weight_scales``,
    ``dst_scale``, ``src_zp``, ``dst_zp``: tensors or None), as ``{DNNL_ARG_ATTR_*: tensor}``."""

    def _quant_args(self) -> dict[int, torch.Tensor]:
        l = L.lib()
        out = {}
        for arg, t in ((l.DNNL_ARG_ATTR_SCALES | l.DNNL_ARG_SRC, self.src_scale),
                       (l.DNNL_ARG_ATTR_SCALES | l.DNNL_ARG_WEIGHTS, self.weight_scales),
                       (l.DNNL_ARG_ATTR_SCALES | l.DNNL_ARG_DST, self.dst_scale),
                       (l.DNNL_ARG_ATTR_ZERO_POINTS | l.DNNL_ARG_SRC, self.src_zp),
                       (l.DNNL_ARG_ATTR_ZERO_POINTS | l.DNNL_ARG_DST, self.dst_zp)):
            if t is not None:
                out[arg] = t
        return out


class Matmul(_QuantArgs):
    """``dst = src @ W (+ bias)`` with post-ops, ``W`` (K, N) packed once.

    ``src`` may have any number of leading dimensions (treated as rows, like ``F.linear``) and
    must be contiguous. ``W`` in torch's ``nn.Linear`` layout (N, K) is accepted through
    :meth:`from_linear` (a transposed view; no copy before the one reorder).

    int8: ``src`` u8 (with ``src_zero_point``) or s8, ``W`` s8; ``src_scale`` (float) and
    ``weight_scales`` (per-output-column tensor of N floats, or a float) dequantize into an f32 or
    bf16 ``dst``; ``dst_dtype=torch.int32`` with no scales gives the exact integer product.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 post_ops: Sequence[PostOp | str] = (), *, src_dtype: torch.dtype | None = None,
                 dst_dtype: torch.dtype | None = None, src_scale: float | None = None,
                 weight_scales=None, src_zero_point: int | None = None, dst_scale: float | None = None,
                 dst_zero_point: int | None = None):
        _check_tensor(weight, "weight", (torch.float32, torch.bfloat16, torch.int8), 2)
        self.K, self.N = weight.shape
        self.weight_dtype = weight.dtype
        int8 = weight.dtype == torch.int8
        self.src_dtype = src_dtype or (torch.uint8 if int8 else weight.dtype)
        if int8 and self.src_dtype not in (torch.uint8, torch.int8):
            raise TypeError(f"int8 weights need a u8 or s8 src, got src_dtype={self.src_dtype}")
        if not int8 and self.src_dtype != weight.dtype:
            raise TypeError(f"src_dtype {self.src_dtype} does not match weight dtype {weight.dtype} "
                            "(cast one of them; mixed fp32/bf16 matmul is not supported)")
        self.dst_dtype = dst_dtype or (torch.float32 if int8 else weight.dtype)
        if self.dst_dtype in (torch.uint8, torch.int8) and not int8:
            raise TypeError(f"a {weight.dtype} matmul writes {weight.dtype}, not {self.dst_dtype}")
        if (dst_scale is not None or dst_zero_point) and self.dst_dtype not in (torch.uint8, torch.int8):
            raise TypeError(f"dst_scale / dst_zero_point are for a u8/s8 dst, not {self.dst_dtype}")
        if bias is not None:
            _check_tensor(bias, "bias", (torch.float32, torch.bfloat16), 1)
            if bias.numel() != self.N:
                raise ValueError(f"bias has {bias.numel()} elements; weight has N={self.N} columns")
            self.bias = bias.reshape(1, self.N).contiguous()
        else:
            self.bias = None
        self.post_ops = _post_ops(post_ops)
        self._packed = _PackedWeights(weight)
        # quantization parameters (all kept as tensors bound at call time)
        self.src_scale = None if src_scale is None else torch.tensor([float(src_scale)], dtype=torch.float32)
        if weight_scales is None:
            self.weight_scales, self._wmask = None, 0
        else:
            ws = torch.as_tensor(weight_scales, dtype=torch.float32).reshape(-1).contiguous()
            if ws.numel() not in (1, self.N):
                raise ValueError(f"weight_scales must have 1 or N={self.N} values, got {ws.numel()}")
            self.weight_scales, self._wmask = ws, (0 if ws.numel() == 1 else 2)
        self.src_zp = None if not src_zero_point else torch.tensor([int(src_zero_point)], dtype=torch.int32)
        self.dst_scale = None if dst_scale is None else _positive_scale(dst_scale, "dst_scale")
        self.dst_zp = _zero_point(dst_zero_point, "dst_zero_point", self.dst_dtype)

    def bind(self, rows: int) -> "BoundMatmul":
        """This matmul compiled for a contiguous (``rows``, K) source, its weights, bias, scales and
        zero points bound once: the per-call path of a layer whose batch is known."""
        return BoundMatmul(self, rows)

    @classmethod
    def from_linear(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, post_ops=(), **kw) -> "Matmul":
        """From an ``nn.Linear`` weight (N, K): uses the transposed view, no copy."""
        _check_tensor(weight, "weight", None, 2)
        return cls(weight.t(), bias, post_ops, **kw)

    @classmethod
    def for_weights(cls, weight: torch.Tensor, *, src_shape=None, src_dtype=None, **kw) -> "Matmul":
        m = cls(weight, src_dtype=src_dtype, **kw)
        if src_shape is not None:  # warm the cache and pack now
            m._compiled(int(torch.Size(src_shape)[:-1].numel()))
        return m

    def _key(self, M: int):
        return ("matmul", M, self.K, self.N, str(self.src_dtype), str(self.weight_dtype), str(self.dst_dtype),
                None if self.bias is None else str(self.bias.dtype), _post_op_key(self.post_ops),
                self.src_scale is not None, self._wmask if self.weight_scales is not None else None,
                self.src_zp is not None, self.dst_scale is not None, self.dst_zp is not None)

    def _compiled(self, M: int) -> tuple[Compiled, torch.Tensor]:
        comp = CACHE.get_or_create(self._key(M), lambda: self._create(M))
        return comp, self._packed.for_md(comp.query_md("weights"))

    def _create(self, M: int) -> Compiled:
        l = L.lib()
        src_md = MemoryDesc.strided((M, self.K), self.src_dtype)
        w_md = MemoryDesc.any((self.K, self.N), self.weight_dtype)
        b_md = None if self.bias is None else MemoryDesc.strided((1, self.N), self.bias.dtype)
        dst_md = MemoryDesc.strided((M, self.N), self.dst_dtype)
        scales, zps = {}, {}
        if self.src_scale is not None:
            scales[l.DNNL_ARG_SRC] = 0
        if self.weight_scales is not None:
            scales[l.DNNL_ARG_WEIGHTS] = self._wmask
        if self.dst_scale is not None:
            scales[l.DNNL_ARG_DST] = 0
        if self.src_zp is not None:
            zps[l.DNNL_ARG_SRC] = 0
        if self.dst_zp is not None:
            zps[l.DNNL_ARG_DST] = 0
        attr = _Attr(self.post_ops, scales, zps, dst_ndims=2)
        comp = _matmul_primitive(src_md, w_md, b_md, dst_md, attr,
                                 f"matmul {M}x{self.K}x{self.N} {self.src_dtype}->{self.dst_dtype}")
        args = [(l.DNNL_ARG_SRC, src_md), (l.DNNL_ARG_WEIGHTS, comp.query_md("weights")), (l.DNNL_ARG_DST, dst_md)]
        if b_md is not None:
            args.append((l.DNNL_ARG_BIAS, b_md))
        args += attr.binary_args
        args += [(arg, MemoryDesc.strided((t.numel(),), t.dtype)) for arg, t in self._quant_args().items()]
        comp.bind(args)
        comp._attr = attr  # keep alive
        return comp

    def __call__(self, src: torch.Tensor, *, out: torch.Tensor | None = None,
                 binary: Sequence[torch.Tensor] = ()) -> torch.Tensor:
        _check_tensor(src, "src", (self.src_dtype,))
        if src.dim() < 1 or src.shape[-1] != self.K:
            raise ValueError(f"src has shape {tuple(src.shape)}; its last dimension must be K={self.K}")
        if not src.is_contiguous():
            raise ValueError("src must be contiguous (call .contiguous() first)")
        lead = src.shape[:-1]
        M = int(lead.numel())
        l = L.lib()
        has_sum = any(p.kind == "sum" for p in self.post_ops)
        if out is None:
            if has_sum:
                raise ValueError("a 'sum' post-op accumulates into out=: pass the tensor to add to")
            out = torch.empty(*lead, self.N, dtype=self.dst_dtype)
        else:
            _check_out(out, (*lead, self.N), self.dst_dtype, src, *binary)
        n_binary = sum(p.kind in ("add", "mul") for p in self.post_ops)
        if len(binary) != n_binary:
            raise ValueError(f"this matmul has {n_binary} binary post-op(s); got {len(binary)} tensor(s)")
        for i, t in enumerate(binary):
            _check_tensor(t, f"binary[{i}]")
        if M == 0:
            return out
        comp, packed = self._compiled(M)
        tensors = {l.DNNL_ARG_SRC: src, l.DNNL_ARG_WEIGHTS: packed, l.DNNL_ARG_DST: out}
        if self.bias is not None:
            tensors[l.DNNL_ARG_BIAS] = self.bias
        keep = []
        for (arg, md), t in zip(comp._attr.binary_args, binary):
            if _strip_leading_ones(t.shape) != _strip_leading_ones(md.shape):
                raise ValueError(f"binary post-op operand has shape {tuple(t.shape)}, expected {tuple(md.shape)}")
            t = _binary_operand(t, md, op_strides(self.post_ops, len(keep)))
            keep.append(t)
            tensors[arg] = t
        tensors.update(self._quant_args())
        comp.run(tensors)
        return out

    def impl(self, M: int) -> str:
        return self._compiled(M)[0].impl

    def __deepcopy__(self, memo):
        """The weights are packed once and never written again, and every thread runs with its own
        memory objects and scratchpad: a deep copy (``copy.deepcopy`` of a converted int8 model) can
        share this object."""
        return self


def matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None,
           post_ops: Sequence[PostOp | str] = (), *, out: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b`` for two runtime operands (2-D, or batched with equal leading dims), fp32 or
    bf16; both are read in place with their strides (transposed views are fine)."""
    _check_tensor(a, "a", FLOAT_DTYPES)
    _check_tensor(b, "b", FLOAT_DTYPES)
    if a.dtype != b.dtype:
        raise TypeError(f"a is {a.dtype} but b is {b.dtype}; matmul needs equal dtypes")
    if a.dim() < 2 or a.dim() != b.dim():
        raise ValueError(f"a and b must have the same rank >= 2, got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.shape[:-2] != b.shape[:-2]:
        raise ValueError(f"batch dimensions differ: {tuple(a.shape[:-2])} vs {tuple(b.shape[:-2])}")
    if a.shape[-1] != b.shape[-2]:
        raise ValueError(f"inner dimensions differ: a is {tuple(a.shape)}, b is {tuple(b.shape)}")
    post_ops = _post_ops(post_ops)
    dst_shape = (*a.shape[:-1], b.shape[-1])
    if bias is not None:
        _check_tensor(bias, "bias", FLOAT_DTYPES, 1)
        if bias.numel() != b.shape[-1]:
            raise ValueError(f"bias has {bias.numel()} elements, expected {b.shape[-1]}")
        bias = bias.reshape((1,) * (len(dst_shape) - 1) + (-1,)).contiguous()
    if any(p.kind in ("add", "mul") for p in post_ops):
        raise ValueError("functional matmul supports eltwise and sum post-ops only; use Matmul for binary ones")
    if out is None:
        if any(p.kind == "sum" for p in post_ops):
            raise ValueError("a 'sum' post-op accumulates into out=: pass the tensor to add to")
        out = torch.empty(dst_shape, dtype=a.dtype)
    else:
        _check_out(out, dst_shape, a.dtype, a, b, bias)
    if out.numel() == 0:
        return out
    l = L.lib()
    key = ("matmul_rt", tuple(a.shape), a.stride(), tuple(b.shape), b.stride(), str(a.dtype),
           None if bias is None else str(bias.dtype), _post_op_key(post_ops))

    def create():
        a_md, b_md, d_md = MemoryDesc.of(a), MemoryDesc.of(b), MemoryDesc.strided(dst_shape, a.dtype)
        bias_md = None if bias is None else MemoryDesc.of(bias)
        attr = _Attr(post_ops, dst_ndims=len(dst_shape))
        comp = _matmul_primitive(a_md, b_md, bias_md, d_md, attr, f"matmul {tuple(a.shape)}x{tuple(b.shape)} {a.dtype}")
        args = [(l.DNNL_ARG_SRC, a_md), (l.DNNL_ARG_WEIGHTS, b_md), (l.DNNL_ARG_DST, d_md)]
        if bias_md is not None:
            args.append((l.DNNL_ARG_BIAS, bias_md))
        comp.bind(args + attr.binary_args)
        comp._attr = attr
        return comp

    comp = CACHE.get_or_create(key, create)
    tensors = {l.DNNL_ARG_SRC: a, l.DNNL_ARG_WEIGHTS: b, l.DNNL_ARG_DST: out}
    if bias is not None:
        tensors[l.DNNL_ARG_BIAS] = bias
    comp.run(tensors)
    return out


class InnerProduct:
    """``dst = src @ W.T + bias`` for ``nn.Linear`` weights (OC, IC), weights packed once."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 post_ops: Sequence[PostOp | str] = ()):
        _check_tensor(weight, "weight", FLOAT_DTYPES, 2)
        self.OC, self.IC = weight.shape
        self.dtype = weight.dtype
        self.bias = _checked_bias(bias, self.OC, "output features")
        self.post_ops = _post_ops(post_ops)
        if any(p.kind in ("add", "mul", "sum") for p in self.post_ops):
            raise ValueError("InnerProduct takes eltwise post-ops only; use Matmul for sum/add")
        self._packed = _PackedWeights(weight.contiguous())

    def _create(self, N: int) -> Compiled:
        l = L.lib()
        src_md = MemoryDesc.strided((N, self.IC), self.dtype)
        w_md = MemoryDesc.any((self.OC, self.IC), self.dtype)
        b_md = None if self.bias is None else MemoryDesc.strided((self.OC,), self.bias.dtype)
        dst_md = MemoryDesc.strided((N, self.OC), self.dtype)
        attr = _Attr(self.post_ops)
        pd = L.ffi().new("dnnl_primitive_desc_t *")
        what = f"inner_product {N}x{self.IC}->{self.OC} {self.dtype}"
        L.check(l.dnnl_inner_product_forward_primitive_desc_create(
            pd, L.engine(), l.dnnl_forward_inference, src_md.handle, w_md.handle,
            b_md.handle if b_md else L.ffi().NULL, dst_md.handle, attr.handle),
            "dnnl_inner_product_forward_primitive_desc_create", what)
        comp = Compiled(pd[0], what)
        args = [(l.DNNL_ARG_SRC, src_md), (l.DNNL_ARG_WEIGHTS, comp.query_md("weights")), (l.DNNL_ARG_DST, dst_md)]
        if b_md is not None:
            args.append((l.DNNL_ARG_BIAS, b_md))
        comp.bind(args)
        comp._attr = attr
        return comp

    def __call__(self, src: torch.Tensor) -> torch.Tensor:
        _check_tensor(src, "src", (self.dtype,), 2)
        if src.shape[1] != self.IC:
            raise ValueError(f"src has {src.shape[1]} features; the layer takes {self.IC}")
        src = src.contiguous()
        N = src.shape[0]
        out = torch.empty(N, self.OC, dtype=self.dtype)
        if N == 0:
            return out
        key = ("inner_product", N, self.IC, self.OC, str(self.dtype),
               None if self.bias is None else str(self.bias.dtype), _post_op_key(self.post_ops))
        comp = CACHE.get_or_create(key, lambda: self._create(N))
        l = L.lib()
        tensors = {l.DNNL_ARG_SRC: src, l.DNNL_ARG_WEIGHTS: self._packed.for_md(comp.query_md("weights")),
                   l.DNNL_ARG_DST: out}
        if self.bias is not None:
            tensors[l.DNNL_ARG_BIAS] = self.bias
        comp.run(tensors)
        return out


def _pair(v, name) -> tuple[int, int]:
    if isinstance(v, int):
        return (v, v)
    v = tuple(int(x) for x in v)
    if len(v) != 2:
        raise ValueError(f"{name} must be an int or a pair, got {v}")
    return v


class Conv2d(_QuantArgs):
    """2-D convolution like ``F.conv2d`` (groups, stride, padding, dilation, post-ops), weights
    (O, I/groups, kH, kW) packed once. Inputs in NCHW or channels-last; the output takes the
    input's memory format (channels-last in, channels-last out).

    int8: int8 weights with a u8 (or s8) ``src``; ``src_scale`` (float), ``weight_scales`` (one per
    output channel, or one) and ``bias`` (float) give the float result, which post-ops (a ``sum``
    with its ``scale`` and ``zero_point`` adds ``scale * (out - zero_point)`` of what ``out`` held)
    transform; a u8/s8 ``dst_dtype`` then stores ``round(result / dst_scale) + dst_zero_point``
    (saturated), an f32/bf16 one the result itself. ``src_zero_point``: for a u8 ``src`` whose real
    zero is not 0 (oneDNN 3.2 then leaves its AMX brgconv kernel for a slower jit one).

    :meth:`bind` compiles the convolution for one input shape and layout and binds the constant
    arguments once: the runtime's per-call path."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, *, stride=1, padding=0,
                 dilation=1, groups: int = 1, post_ops: Sequence[PostOp | str] = (),
                 src_dtype: torch.dtype | None = None, dst_dtype: torch.dtype | None = None,
                 src_scale: float | None = None, weight_scales=None, dst_scale: float | None = None,
                 src_zero_point: int | None = None, dst_zero_point: int | None = None):
        _check_tensor(weight, "weight", (*FLOAT_DTYPES, torch.int8), 4)
        if groups < 1 or weight.shape[0] % groups:
            raise ValueError(f"groups={groups} must divide the {weight.shape[0]} output channels")
        self.O, self.Ig, self.kh, self.kw = weight.shape
        self.groups = groups
        self.stride, self.padding, self.dilation = _pair(stride, "stride"), _pair(padding, "padding"), _pair(dilation, "dilation")
        if min(self.stride) < 1 or min(self.dilation) < 1 or min(self.padding) < 0:
            raise ValueError(f"bad conv geometry: stride {self.stride}, padding {self.padding}, dilation {self.dilation}")
        self.dtype = weight.dtype
        int8 = weight.dtype == torch.int8
        self.src_dtype = src_dtype or (torch.uint8 if int8 else weight.dtype)
        self.dst_dtype = dst_dtype or (torch.float32 if int8 else weight.dtype)
        if self.dst_dtype in (torch.uint8, torch.int8) and not int8:
            raise TypeError(f"a {weight.dtype} matmul writes {weight.dtype}, not {self.dst_dtype}")
        if (dst_scale is not None or dst_zero_point) and self.dst_dtype not in (torch.uint8, torch.int8):
            raise TypeError(f"dst_scale / dst_zero_point are for a u8/s8 dst, not {self.dst_dtype}")
        if int8:
            if self.src_dtype not in (torch.uint8, torch.int8):
                raise TypeError(f"int8 weights need a u8 or s8 src, got src_dtype={self.src_dtype}")
            if self.dst_dtype not in (torch.float32, torch.bfloat16, torch.uint8, torch.int8):
                raise TypeError(f"an int8 convolution writes f32, bf16, u8 or s8, got dst_dtype={self.dst_dtype}")
        else:
            if self.src_dtype != weight.dtype or self.dst_dtype != weight.dtype:
                raise TypeError(f"a {weight.dtype} convolution reads and writes {weight.dtype} (src_dtype "
                                f"{self.src_dtype}, dst_dtype {self.dst_dtype}); int8 needs int8 weights")
            if any(v is not None for v in (src_scale, weight_scales, dst_scale, src_zero_point, dst_zero_point)):
                raise TypeError("scales and zero points are for int8 weights")
        self.bias = _checked_bias(bias, self.O, "output channels")
        self.post_ops = _post_ops(post_ops)
        w = weight.contiguous()
        if groups > 1:
            w = w.view(groups, self.O // groups, self.Ig, self.kh, self.kw)
        self._wshape = tuple(w.shape)
        self._packed = _PackedWeights(w)
        # quantization parameters, bound as tensors at call time (int8 only)
        self.src_scale = None if src_scale is None else _positive_scale(src_scale, "src_scale")
        self.dst_scale = None if dst_scale is None else _positive_scale(dst_scale, "dst_scale")
        if weight_scales is None:
            self.weight_scales = None
        else:
            ws = torch.as_tensor(weight_scales, dtype=torch.float32).reshape(-1)
            if ws.numel() not in (1, self.O):
                raise ValueError(f"weight_scales must have 1 or O={self.O} values, got {ws.numel()}")
            if not bool((ws > 0).all()):
                raise ValueError("weight_scales must be positive")
            self.weight_scales = ws.expand(self.O).contiguous()
        self.src_zp = _zero_point(src_zero_point, "src_zero_point", self.src_dtype)
        self.dst_zp = _zero_point(dst_zero_point, "dst_zero_point", self.dst_dtype)

    def out_hw(self, h: int, w: int) -> tuple[int, int]:
        oh = (h + 2 * self.padding[0] - self.dilation[0] * (self.kh - 1) - 1) // self.stride[0] + 1
        ow = (w + 2 * self.padding[1] - self.dilation[1] * (self.kw - 1) - 1) // self.stride[1] + 1
        return oh, ow

    def _create(self, src_shape, src_strides, dst_shape, dst_strides) -> Compiled:
        l, f = L.lib(), L.ffi()
        src_md = MemoryDesc.strided(src_shape, self.src_dtype, src_strides)
        w_md = MemoryDesc.any(self._wshape, self.dtype)
        b_md = None if self.bias is None else MemoryDesc.strided((self.O,), self.bias.dtype)
        dst_md = MemoryDesc.strided(dst_shape, self.dst_dtype, dst_strides)
        qargs = self._quant_args()
        scale_masks = {arg & ~l.DNNL_ARG_ATTR_SCALES: 0 for arg in qargs if arg & l.DNNL_ARG_ATTR_SCALES}
        if self.weight_scales is not None:  # per output channel: dim 0, or dims 0 and 1 of grouped weights
            scale_masks[l.DNNL_ARG_WEIGHTS] = 1 if self.groups == 1 else 3
        zp_masks = {arg & ~l.DNNL_ARG_ATTR_ZERO_POINTS: 0 for arg in qargs if arg & l.DNNL_ARG_ATTR_ZERO_POINTS}
        attr = _Attr(self.post_ops, scale_masks, zp_masks, dst_ndims=4)
        H, W = src_shape[2], src_shape[3]
        oh, ow = dst_shape[2], dst_shape[3]
        pad_r = [(oh - 1) * self.stride[0] + self.dilation[0] * (self.kh - 1) + 1 - H - self.padding[0],
                 (ow - 1) * self.stride[1] + self.dilation[1] * (self.kw - 1) + 1 - W - self.padding[1]]
        pd = f.new("dnnl_primitive_desc_t *")
        what = (f"convolution {src_shape}->{dst_shape} k{self.kh}x{self.kw} g{self.groups} "
                f"{self.src_dtype}x{self.dtype}->{self.dst_dtype}")
        dims = lambda v: f.new("dnnl_dims_t", list(v))  # noqa: E731
        L.check(l.dnnl_convolution_forward_primitive_desc_create(
            pd, L.engine(), l.dnnl_forward_inference, l.dnnl_convolution_direct, src_md.handle, w_md.handle,
            b_md.handle if b_md else f.NULL, dst_md.handle, dims(self.stride),
            dims([d - 1 for d in self.dilation]), dims(self.padding), dims(pad_r), attr.handle),
            "dnnl_convolution_forward_primitive_desc_create", what)
        comp = Compiled(pd[0], what)
        if self.src_dtype == torch.int8 and not ("vnni" in comp.impl or "amx" in comp.impl):
            # measured on oneDNN 3.2: jit_uni_int8:avx2 and jit_int8:avx512_core return answers 100+ off
            # for s8 sources (with or without padding); its VNNI and AMX kernels (brgconv, jit) are exact
            raise NotImplementedError(f"{what}: oneDNN 3.2's {comp.impl} kernel returns wrong numbers for s8 "
                                      "input; pass u8 input (with a zero point) on this CPU")
        args = [(l.DNNL_ARG_SRC, src_md), (l.DNNL_ARG_WEIGHTS, comp.query_md("weights")), (l.DNNL_ARG_DST, dst_md)]
        if b_md is not None:
            args.append((l.DNNL_ARG_BIAS, b_md))
        args += [(arg, MemoryDesc.strided((t.numel(),), t.dtype)) for arg, t in qargs.items()]
        comp.bind(args + attr.binary_args)
        comp._attr = attr
        return comp

    def _compiled(self, src_shape, src_strides, dst_shape, dst_strides) -> Compiled:
        key = ("conv2d", tuple(src_shape), tuple(src_strides), tuple(dst_shape), tuple(dst_strides), self._wshape,
               self.stride, self.padding, self.dilation, str(self.src_dtype), str(self.dtype), str(self.dst_dtype),
               None if self.bias is None else str(self.bias.dtype), _post_op_key(self.post_ops),
               tuple(sorted(self._quant_args())))
        return CACHE.get_or_create(key, lambda: self._create(tuple(src_shape), tuple(src_strides), tuple(dst_shape),
                                                             tuple(dst_strides)))

    def _constant_args(self, comp: Compiled) -> dict[int, torch.Tensor]:
        l = L.lib()
        args = {l.DNNL_ARG_WEIGHTS: self._packed.for_md(comp.query_md("weights")), **self._quant_args()}
        if self.bias is not None:
            args[l.DNNL_ARG_BIAS] = self.bias
        return args

    def _check_src(self, src: torch.Tensor) -> None:
        _check_tensor(src, "src", (self.src_dtype,), 4)
        self._check_shape(src.shape)

    def _check_shape(self, shape) -> None:
        if shape[1] != self.Ig * self.groups:
            raise ValueError(f"src has {shape[1]} channels; the conv takes {self.Ig * self.groups}")
        oh, ow = self.out_hw(shape[2], shape[3])
        if oh < 1 or ow < 1:
            raise ValueError(f"input {shape[2]}x{shape[3]} is too small for kernel {self.kh}x{self.kw} with "
                             "this padding/dilation")

    def bind(self, src_shape, memory_format=torch.channels_last) -> "BoundConv2d":
        """This convolution compiled for ``src_shape`` in ``memory_format`` (channels-last or
        contiguous), its constant arguments bound once (no ``add``/``mul`` post-ops)."""
        return BoundConv2d(self, tuple(int(v) for v in src_shape), memory_format)

    def __call__(self, src: torch.Tensor, *, out: torch.Tensor | None = None,
                 binary: Sequence[torch.Tensor] = ()) -> torch.Tensor:
        self._check_src(src)
        N = src.shape[0]
        oh, ow = self.out_hw(src.shape[2], src.shape[3])
        cl = src.is_contiguous(memory_format=torch.channels_last) and not src.is_contiguous()
        fmt = torch.channels_last if cl else torch.contiguous_format
        if not src.is_contiguous(memory_format=fmt):
            src = src.contiguous()
        if out is None:
            if any(p.kind == "sum" for p in self.post_ops):
                raise ValueError("a 'sum' post-op accumulates into out=: pass the tensor to add to")
            out = torch.empty(N, self.O, oh, ow, dtype=self.dst_dtype, memory_format=fmt)
        else:
            _check_out(out, (N, self.O, oh, ow), self.dst_dtype, src, *binary, memory_format=fmt)
        bin_ops = [p for p in self.post_ops if p.kind in ("add", "mul")]
        if len(binary) != len(bin_ops):
            raise ValueError(f"this conv has {len(bin_ops)} binary post-op(s); got {len(binary)} tensor(s)")
        for i, (t, op) in enumerate(zip(binary, bin_ops)):
            _check_tensor(t, f"binary[{i}]")
            want = (1,) * (4 - len(op.shape)) + tuple(op.shape)  # as _Attr declared it
            if _strip_leading_ones(t.shape) != _strip_leading_ones(want):
                raise ValueError(f"binary[{i}] has shape {tuple(t.shape)}; the {op.kind} post-op was declared "
                                 f"for {tuple(op.shape) or '(a scalar)'}")
        if out.numel() == 0:
            return out
        comp = self._compiled(tuple(src.shape), src.stride(), tuple(out.shape), out.stride())
        l = L.lib()
        tensors = {l.DNNL_ARG_SRC: src, l.DNNL_ARG_DST: out, **self._constant_args(comp)}
        bargs = comp._attr.binary_args
        keep = []
        for i, ((arg, md), t) in enumerate(zip(bargs, binary)):
            keep.append(_binary_operand(t, md, op_strides(self.post_ops, i)))
            tensors[arg] = keep[-1]
        comp.run(tensors)
        return out

    def __deepcopy__(self, memo):
        """The weights are packed once and never written again: a deep copy can share this object."""
        return self


class ExecSpec(NamedTuple):
    """A bound primitive as :meth:`_Bound.exec_spec` hands it out."""
    prim: object                 # dnnl_primitive_t
    args: list                   # [(DNNL_ARG_*, MemoryDesc)], the scratchpad included
    const: dict                  # DNNL_ARG_* -> the tensor bound once (weights, bias, scales ...)
    per_thread: tuple            # args that need a buffer per calling thread (the scratchpad)
    src_arg: int
    dst_arg: int
    bin_arg: int | None          # the add/mul post-op operand's arg, if any
    bin_layout: tuple | None     # (shape, strides, dtype) the operand was declared with
    accumulates: bool            # a 'sum' post-op: the destination's old contents are an operand
    what: str


class _Bound:
    """The per-call path of a primitive compiled for one source shape and layout, its constant
    arguments (packed weights, bias, scales, zero points) bound to oneDNN memory once: a call checks
    the source's (and the destination's, and the add/mul operand's) shape, strides and dtype against
    what was compiled (nothing of another layout ever reaches the kernel), sets those pointers and
    runs. Several threads may call it (each has its own memory objects and scratchpad)."""

    what = "primitive"

    def _bind(self, comp: "Compiled | None", const: dict, src_shape, src_strides, src_dtype, out_shape,
              out_strides, dst_dtype, memory_format, accumulates: bool, bin_op: "PostOp | None", ndims: int):
        self.src_shape, self.src_strides, self.src_dtype = tuple(src_shape), tuple(src_strides), src_dtype
        self.out_shape, self.out_strides, self.dst_dtype = tuple(out_shape), tuple(out_strides), dst_dtype
        self.memory_format, self.accumulates = memory_format, accumulates
        self.empty = comp is None
        self._bin = None
        if self.empty:
            return
        self._const = const  # kept alive: oneDNN memory points at them
        self._comp = comp
        self._slots = ThreadSlots(comp.args, const, comp.per_thread)
        l = L.lib()
        self._src_arg, self._dst_arg = l.DNNL_ARG_SRC, l.DNNL_ARG_DST
        if bin_op is not None:   # the add/mul operand: exactly the shape, strides and dtype it was declared with
            arg, _md = comp._attr.binary_args[0]
            shape = (1,) * (ndims - len(bin_op.shape)) + tuple(bin_op.shape)
            strides = bin_op.strides or torch.empty(shape, device="meta").stride()
            if len(strides) < ndims:
                strides = (0,) * (ndims - len(strides)) + tuple(strides)
            self._bin = (arg, shape, tuple(strides), bin_op.dtype)

    @property
    def impl(self) -> str:
        return self._comp.impl

    def exec_spec(self) -> "ExecSpec":
        """What a caller that keeps memory objects of its own needs to run this primitive without
        :meth:`__call__` (:class:`cpu_opt.backends.onednn_primitives.PrimitiveChain`, which binds
        its buffers once and runs a whole chain of primitives per call)."""
        if self.empty:
            raise ValueError(f"this {self.what} has an empty output: nothing to run")
        comp = self._comp
        return ExecSpec(comp.prim, list(comp.args), dict(self._const), tuple(comp.per_thread), self._src_arg,
                        self._dst_arg, None if self._bin is None else self._bin[0],
                        None if self._bin is None else self._bin[1:], self.accumulates, comp.what)

    def __deepcopy__(self, memo):
        """Immutable once bound, every thread with its own memory objects: a deep copy can share it."""
        return self

    def __call__(self, src: torch.Tensor, out: torch.Tensor | None = None,
                 binary: torch.Tensor | None = None) -> torch.Tensor:
        """``out``: the tensor a ``sum`` post-op accumulates into and the result overwrites (required
        then; else a new tensor is returned, or the one given is written). ``binary``: the add/mul
        post-op's operand, of exactly the shape, strides and dtype it was declared with (read, never
        written)."""
        if src.shape != self.src_shape or not _same_strides(src, self.src_strides) or src.dtype != self.src_dtype \
                or src.device.type != "cpu" or src.is_quantized or src.layout != torch.strided:
            raise ValueError(f"this {self.what} is bound to {self.src_dtype} input of shape {self.src_shape} with "
                             f"strides {self.src_strides}; got {src.dtype} {tuple(src.shape)} strides "
                             f"{tuple(src.stride())}")
        if out is None:
            if self.accumulates:
                raise ValueError("a 'sum' post-op accumulates into out=: pass the tensor to add to")
            out = torch.empty(self.out_shape, dtype=self.dst_dtype, memory_format=self.memory_format)
        elif out.shape != self.out_shape or not _same_strides(out, self.out_strides) or out.dtype != self.dst_dtype \
                or out.device.type != "cpu" or out.is_quantized or out.layout != torch.strided:
            raise ValueError(f"out must be {self.dst_dtype} of shape {self.out_shape} with strides {self.out_strides}; "
                             f"got {out.dtype} {tuple(out.shape)} strides {tuple(out.stride())}")
        elif overlaps(out, src):
            raise ValueError("out shares memory with src; pass a separate buffer")
        if (binary is None) != (self._bin is None):
            raise ValueError(f"this {self.what} has an add/mul post-op: pass its operand as binary=" if self._bin
                             else f"this {self.what} has no add/mul post-op; binary= is not taken")
        if binary is not None:
            _, bshape, bstrides, bdtype = self._bin
            nd = len(bshape)
            if binary.dim() > nd or tuple(binary.shape) != bshape[nd - binary.dim():] or binary.dtype != bdtype \
                    or not _same_strides(binary, bstrides[nd - binary.dim():]) or binary.device.type != "cpu" \
                    or binary.is_quantized or binary.layout != torch.strided:
                raise ValueError(f"binary must be {bdtype} of shape {bshape} with strides {bstrides}; got "
                                 f"{binary.dtype} {tuple(binary.shape)} strides {tuple(binary.stride())}")
            if overlaps(out, binary):
                raise ValueError("out shares memory with the binary operand; pass a separate buffer")
        if self.empty:
            return out
        lib = L.lib()
        mems, args = self._slots.get()
        ptr = L.ffi().cast
        if binary is not None:
            L.check(lib.dnnl_memory_set_data_handle(mems[self._bin[0]], ptr("void *", binary.data_ptr())),
                    "dnnl_memory_set_data_handle")
        L.check(lib.dnnl_memory_set_data_handle(mems[self._src_arg], ptr("void *", src.data_ptr())),
                "dnnl_memory_set_data_handle")
        L.check(lib.dnnl_memory_set_data_handle(mems[self._dst_arg], ptr("void *", out.data_ptr())),
                "dnnl_memory_set_data_handle")
        stream = L.stream()
        L.check(lib.dnnl_primitive_execute(self._comp.prim, stream, len(args), args), "dnnl_primitive_execute",
                self._comp.what)
        L.check(lib.dnnl_stream_wait(stream), "dnnl_stream_wait", self._comp.what)
        return out


def _single_binary(post_ops, what: str):
    bins = [p for p in post_ops if p.kind in ("add", "mul")]
    if len(bins) > 1:
        raise ValueError(f"a bound {what} takes at most one add/mul post-op operand; call it unbound instead")
    return bins[0] if bins else None


class BoundConv2d(_Bound):
    """A :class:`Conv2d` compiled for one input shape and layout (:class:`_Bound`)."""

    what = "convolution"

    def __init__(self, conv: Conv2d, src_shape: tuple, memory_format):
        if len(src_shape) != 4:
            raise ValueError(f"src_shape must have 4 dimensions, got {src_shape}")
        if memory_format not in (torch.channels_last, torch.contiguous_format):
            raise ValueError(f"memory_format must be channels_last or contiguous_format, got {memory_format}")
        bin_op = _single_binary(conv.post_ops, self.what)
        conv._check_shape(src_shape)
        self.conv = conv
        src_strides = torch.empty(src_shape, device="meta", memory_format=memory_format).stride()
        oh, ow = conv.out_hw(src_shape[2], src_shape[3])
        out_shape = (src_shape[0], conv.O, oh, ow)
        out_strides = torch.empty(out_shape, device="meta", memory_format=memory_format).stride()
        comp = None if 0 in out_shape else conv._compiled(src_shape, src_strides, out_shape, out_strides)
        self._bind(comp, conv._constant_args(comp) if comp is not None else {}, src_shape, src_strides,
                   conv.src_dtype, out_shape, out_strides, conv.dst_dtype, memory_format,
                   any(p.kind == "sum" for p in conv.post_ops), bin_op, 4)


class BoundMatmul(_Bound):
    """A :class:`Matmul` compiled for a contiguous (M, K) source (:class:`_Bound`): the int8 and fp32
    linear layers' per-call path."""

    what = "matmul"

    def __init__(self, mm: "Matmul", rows: int):
        rows = int(rows)
        if rows < 0:
            raise ValueError(f"rows must be >= 0, got {rows}")
        bin_op = _single_binary(mm.post_ops, self.what)
        self.mm = mm
        comp, packed = mm._compiled(rows) if rows else (None, None)
        const = {}
        if comp is not None:
            l = L.lib()
            const = {l.DNNL_ARG_WEIGHTS: packed, **mm._quant_args()}
            if mm.bias is not None:
                const[l.DNNL_ARG_BIAS] = mm.bias
        self._bind(comp, const, (rows, mm.K), (mm.K, 1), mm.src_dtype, (rows, mm.N), (mm.N, 1), mm.dst_dtype,
                   torch.contiguous_format, any(p.kind == "sum" for p in mm.post_ops), bin_op, 2)


class MaxPool2d(_Bound):
    """``F.max_pool2d`` (kernel, stride, padding, dilation, ceil_mode) as a oneDNN pooling primitive
    compiled for one input shape, dtype and layout: f32, bf16, u8 or s8 (max commutes with a monotonic
    quantization, so uint8 bytes pool to the bytes of the pooled values). Padding never wins (oneDNN
    excludes it), as in torch. Called like any bound primitive (:class:`_Bound`)."""

    what = "max_pool2d"

    def __init__(self, src_shape, dtype: torch.dtype, kernel_size, stride=None, padding=0, dilation=1,
                 ceil_mode: bool = False, memory_format=torch.channels_last):
        if dtype not in (torch.float32, torch.bfloat16, torch.uint8, torch.int8):
            raise TypeError(f"max_pool2d runs f32, bf16, u8 or s8, got {dtype}")
        if len(src_shape) != 4:
            raise ValueError(f"max_pool2d takes a 4-D input, got shape {tuple(src_shape)}")
        k = _pair(kernel_size, "kernel_size")
        st = _pair(stride if stride not in (None, [], ()) else kernel_size, "stride")
        pad, dil = _pair(padding, "padding"), _pair(dilation, "dilation")
        if min(k) < 1 or min(st) < 1 or min(dil) < 1 or min(pad) < 0 or any(2 * p > kk for p, kk in zip(pad, k)):
            raise ValueError(f"bad max_pool2d geometry: kernel {k}, stride {st}, padding {pad}, dilation {dil}")
        N, C, H, W = (int(v) for v in src_shape)
        out = []
        for size, kk, s_, p_, d_ in zip((H, W), k, st, pad, dil):
            span = d_ * (kk - 1) + 1
            n = size + 2 * p_ - span
            o = (-(-n // s_) if ceil_mode else n // s_) + 1
            if ceil_mode and (o - 1) * s_ >= size + p_:   # torch: the last window must start inside
                o -= 1
            if o < 1:
                raise ValueError(f"input {H}x{W} is too small for max_pool2d kernel {k} with padding {pad}")
            out.append(o)
        src_shape, out_shape = (N, C, H, W), (N, C, out[0], out[1])
        meta = lambda shp: torch.empty(shp, device="meta", memory_format=memory_format).stride()  # noqa: E731
        src_strides, out_strides = meta(src_shape), meta(out_shape)
        self.dtype = dtype
        pad_r = [(o - 1) * s_ + d_ * (kk - 1) + 1 - size - p_
                 for o, s_, d_, kk, size, p_ in zip(out, st, dil, k, (H, W), pad)]
        key = ("max_pool2d", src_shape, src_strides, out_strides, str(dtype), k, st, pad, dil, tuple(pad_r))
        comp = None
        if 0 not in out_shape:
            comp = CACHE.get_or_create(key, lambda: self._create(src_shape, src_strides, out_shape, out_strides,
                                                                 k, st, pad, dil, pad_r))
        self._bind(comp, {}, src_shape, src_strides, dtype, out_shape, out_strides, dtype, memory_format, False,
                   None, 4)

    def _create(self, src_shape, src_strides, out_shape, out_strides, k, st, pad, dil, pad_r) -> Compiled:
        l, f = L.lib(), L.ffi()
        src_md = MemoryDesc.strided(src_shape, self.dtype, src_strides)
        dst_md = MemoryDesc.strided(out_shape, self.dtype, out_strides)
        attr = _Attr()
        pd = f.new("dnnl_primitive_desc_t *")
        dims = lambda v: f.new("dnnl_dims_t", [int(x) for x in v])  # noqa: E731
        what = f"max_pool2d {src_shape}->{out_shape} {self.dtype}"
        L.check(l.dnnl_pooling_forward_primitive_desc_create(
            pd, L.engine(), l.dnnl_forward_inference, l.dnnl_pooling_max, src_md.handle, dst_md.handle, dims(st),
            dims(k), dims([d - 1 for d in dil]), dims(pad), dims(pad_r), attr.handle),
            "dnnl_pooling_forward_primitive_desc_create", what)
        comp = Compiled(pd[0], what)
        comp.bind([(l.DNNL_ARG_SRC, src_md), (l.DNNL_ARG_DST, dst_md)])
        comp._attr = attr
        return comp


class Eltwise(_Bound):
    """An elementwise op (a :data:`ELTWISE` name: ``gelu_tanh``, ``gelu_erf``, ``silu`` ...) as a oneDNN
    eltwise primitive compiled for one shape, dense layout and dtype (f32 or bf16), the output in the
    input's layout. Called like any bound primitive (:class:`_Bound`); ``out`` may be the input
    itself (oneDNN's eltwise runs in place)."""

    what = "eltwise"

    def __init__(self, kind: str, shape, dtype: torch.dtype, strides=None):
        if kind not in ELTWISE or kind == "linear":
            raise ValueError(f"unknown eltwise op {kind!r}; expected one of {sorted(set(ELTWISE) - {'linear'})}")
        if dtype not in FLOAT_DTYPES:
            raise TypeError(f"eltwise runs f32 or bf16, got {dtype}")
        shape = tuple(int(v) for v in shape)
        strides = tuple(strides) if strides is not None else torch.empty(shape, device="meta").stride()
        self.kind = kind
        key = ("eltwise", kind, shape, strides, str(dtype))
        comp = None
        if 0 not in shape:
            comp = CACHE.get_or_create(key, lambda: self._create(shape, strides, dtype))
        self._bind(comp, {}, shape, strides, dtype, shape, strides, dtype, torch.contiguous_format, False, None,
                   len(shape))
        self._strides = strides

    def _create(self, shape, strides, dtype) -> Compiled:
        l, f = L.lib(), L.ffi()
        md = MemoryDesc.strided(shape, dtype, strides)
        alg, a, b = ELTWISE[self.kind]
        pd = f.new("dnnl_primitive_desc_t *")
        what = f"eltwise {self.kind} {shape} {dtype}"
        attr = _Attr()
        L.check(l.dnnl_eltwise_forward_primitive_desc_create(pd, L.engine(), l.dnnl_forward_inference, getattr(l, alg),
                                                            md.handle, md.handle, a, b, attr.handle),
                "dnnl_eltwise_forward_primitive_desc_create", what)
        comp = Compiled(pd[0], what)
        comp.bind([(l.DNNL_ARG_SRC, md), (l.DNNL_ARG_DST, md)])
        comp._attr = attr
        return comp

    def __call__(self, src: torch.Tensor, out: torch.Tensor | None = None, binary=None) -> torch.Tensor:
        if out is None and not self.empty:
            out = torch.empty_strided(self.out_shape, self._strides, dtype=self.dst_dtype)
        if out is src and not self.empty:   # in place: the shared checks would refuse the overlap
            if src.shape != self.src_shape or not _same_strides(src, self.src_strides) or \
                    src.dtype != self.src_dtype or src.device.type != "cpu" or src.layout != torch.strided:
                raise ValueError(f"this eltwise is bound to {self.src_dtype} input of shape {self.src_shape} with "
                                 f"strides {self.src_strides}")
            lib, ptr = L.lib(), L.ffi().cast
            mems, args = self._slots.get()
            h = ptr("void *", src.data_ptr())
            L.check(lib.dnnl_memory_set_data_handle(mems[self._src_arg], h), "dnnl_memory_set_data_handle")
            L.check(lib.dnnl_memory_set_data_handle(mems[self._dst_arg], h), "dnnl_memory_set_data_handle")
            stream = L.stream()
            L.check(lib.dnnl_primitive_execute(self._comp.prim, stream, len(args), args), "dnnl_primitive_execute",
                    self._comp.what)
            L.check(lib.dnnl_stream_wait(stream), "dnnl_stream_wait", self._comp.what)
            return src
        return super().__call__(src, out, binary)


def _same_strides(t: torch.Tensor, strides) -> bool:
    """Does ``t`` lie in memory as ``strides`` say (of the same shape)? Strides of size-1 dimensions
    address nothing and may differ (torch gives a channels-last 1x1 map either (C, 1, C, C) or
    (C, 1, 1, 1))."""
    have = t.stride()
    if have == tuple(strides):
        return True
    return all(a == b for a, b, n in zip(have, strides, t.shape) if n != 1)


def _positive_scale(v, name: str) -> torch.Tensor:
    v = float(v)
    if not v > 0 or v == float("inf"):
        raise ValueError(f"{name} must be a positive finite float, got {v}")
    return torch.tensor([v], dtype=torch.float32)


def _zero_point(v, name: str, dtype: torch.dtype) -> torch.Tensor | None:
    """A zero point as the int32 tensor oneDNN reads, or None for 0; range-checked for the dtype."""
    if not v:
        return None
    v = int(v)
    lo, hi = {torch.uint8: (0, 255), torch.int8: (-128, 127)}.get(dtype, (None, None))
    if lo is None:
        raise TypeError(f"{name} is for u8/s8 data, not {dtype}")
    if not lo <= v <= hi:
        raise ValueError(f"{name} must be in {lo}..{hi} for {dtype}, got {v}")
    return torch.tensor([v], dtype=torch.int32)


def reorder_into(src: torch.Tensor, src_md: MemoryDesc, dst: torch.Tensor, dst_md: MemoryDesc) -> None:
    """Copy ``src`` (described by ``src_md``) into ``dst``'s buffer in layout ``dst_md``."""
    l, f = L.lib(), L.ffi()
    pd = f.new("dnnl_primitive_desc_t *")
    attr = _Attr()   # a user scratchpad, as for every primitive here (a reorder may be run from any thread)
    L.check(l.dnnl_reorder_primitive_desc_create(pd, src_md.handle, L.engine(), dst_md.handle, L.engine(),
                                                 attr.handle),
            "dnnl_reorder_primitive_desc_create", f"{src_md} -> {dst_md}")
    comp = Compiled(pd[0], "reorder")
    comp.bind([(l.DNNL_ARG_FROM, src_md), (l.DNNL_ARG_TO, dst_md)])
    comp.run({l.DNNL_ARG_FROM: src, l.DNNL_ARG_TO: dst})
    L.check(l.dnnl_stream_wait(L.stream()), "dnnl_stream_wait", "reorder")


def reorder(src: torch.Tensor, dtype: torch.dtype | None = None, memory_format=torch.contiguous_format) -> torch.Tensor:
    """A reorder primitive as a torch op: copy ``src`` into a new tensor of ``dtype`` (conversion
    included, e.g. fp32 -> bf16) in ``memory_format``."""
    _check_tensor(src, "src", tuple(TORCH_TO_DNNL))
    dtype = dtype or src.dtype
    dst = torch.empty(src.shape, dtype=dtype, memory_format=memory_format) if src.dim() == 4 else torch.empty(src.shape, dtype=dtype)
    if src.numel():
        reorder_into(src, MemoryDesc.of(src), dst, MemoryDesc.of(dst))
    return dst
