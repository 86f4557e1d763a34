"""Memory descriptors and memory objects bound to torch tensors without copies."""
from __future__ import annotations

import threading

import torch

from . import lib as L

TORCH_TO_DNNL = {
    torch.float32: "dnnl_f32",
    torch.bfloat16: "dnnl_bf16",
    torch.float16: "dnnl_f16",
    torch.int32: "dnnl_s32",
    torch.int8: "dnnl_s8",
    torch.uint8: "dnnl_u8",
}
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
               torch.int32: "s32", torch.int8: "s8", torch.uint8: "u8"}


def dnnl_dtype(dtype: torch.dtype) -> int:
    try:
        return getattr(L.lib(), TORCH_TO_DNNL[dtype])
    except KeyError:
        raise TypeError(f"oneDNN has no data type for {dtype}; supported: "
                        f"{', '.join(str(d) for d in TORCH_TO_DNNL)}") from None


def _dims(values) -> object:
    values = list(values)
    if len(values) > 12:
        raise ValueError(f"oneDNN supports at most 12 dimensions, got {len(values)}")
    return L.ffi().new("dnnl_dims_t", [int(v) for v in values])


class MemoryDesc:
    """An owned ``dnnl_memory_desc_t`` (destroyed with this object)."""

    __slots__ = ("handle", "shape", "dtype", "_desc")

    def __init__(self, handle, shape, dtype, desc: str):
        self.handle = handle
        self.shape = tuple(shape)
        self.dtype = dtype
        self._desc = desc

    @classmethod
    def _wrap(cls, p, shape, dtype, desc):
        return cls(L.ffi().gc(p[0], L.lib().dnnl_memory_desc_destroy), shape, dtype, desc)

    @classmethod
    def strided(cls, shape, dtype: torch.dtype, strides=None) -> "MemoryDesc":
        shape = tuple(int(s) for s in shape)
        if strides is None:
            strides, acc = [], 1
            for s in reversed(shape):
                strides.append(acc)
                acc *= max(s, 1)
            strides = tuple(reversed(strides))
        p = L.ffi().new("dnnl_memory_desc_t *")
        L.check(L.lib().dnnl_memory_desc_create_with_strides(p, len(shape), _dims(shape), dnnl_dtype(dtype),
                                                            _dims(strides)),
                "dnnl_memory_desc_create_with_strides", f"shape {shape} strides {tuple(strides)} {dtype}")
        return cls._wrap(p, shape, dtype, f"strided{tuple(strides)}")

    @classmethod
    def any(cls, shape, dtype: torch.dtype) -> "MemoryDesc":
        """Format ``any``: let the primitive pick the layout (used for weights)."""
        shape = tuple(int(s) for s in shape)
        p = L.ffi().new("dnnl_memory_desc_t *")
        L.check(L.lib().dnnl_memory_desc_create_with_tag(p, len(shape), _dims(shape), dnnl_dtype(dtype),
                                                        L.lib().dnnl_format_tag_any),
                "dnnl_memory_desc_create_with_tag", f"shape {shape} any {dtype}")
        return cls._wrap(p, shape, dtype, "any")

    @classmethod
    def of(cls, t: torch.Tensor) -> "MemoryDesc":
        """The descriptor of a tensor as it lies in memory (torch strides are element strides)."""
        if t.layout != torch.strided:
            raise TypeError(f"oneDNN needs a dense strided tensor, got layout {t.layout}")
        return cls.strided(t.shape, t.dtype, t.stride())

    def size_bytes(self) -> int:
        return int(L.lib().dnnl_memory_desc_get_size(self.handle))

    def __eq__(self, other) -> bool:
        return isinstance(other, MemoryDesc) and bool(L.lib().dnnl_memory_desc_equal(self.handle, other.handle))

    def __hash__(self):  # descriptors are compared by value only where needed
        return hash((self.shape, self.dtype))

    def __repr__(self):
        return f"MemoryDesc({self.shape}, {self.dtype}, {self._desc})"


class BorrowedDesc(MemoryDesc):
    """A descriptor owned by a primitive descriptor (queried, not created): not destroyed here."""

    def __init__(self, handle, owner):
        super().__init__(handle, (), None, "queried")
        self._owner = owner  # keep the primitive descriptor alive


def memory(md: MemoryDesc, t: torch.Tensor | None = None):
    """A ``dnnl_memory_t`` over ``t``'s storage (no copy), or with no buffer when ``t`` is None
    (set one later with :func:`set_handle`). Keep ``t`` alive while the memory is used."""
    f, l = L.ffi(), L.lib()
    p = f.new("dnnl_memory_t *")
    handle = f.NULL if t is None else f.cast("void *", t.data_ptr())
    L.check(l.dnnl_memory_create(p, md.handle, L.engine(), handle), "dnnl_memory_create", repr(md))
    return f.gc(p[0], l.dnnl_memory_destroy)


def set_handle(mem, t: torch.Tensor) -> None:
    L.check(L.lib().dnnl_memory_set_data_handle(mem, L.ffi().cast("void *", t.data_ptr())),
            "dnnl_memory_set_data_handle")


def empty_for(md: MemoryDesc) -> torch.Tensor:
    """A torch byte buffer large enough for ``md`` (torch allocations are 64-byte aligned)."""
    return torch.empty(md.size_bytes(), dtype=torch.uint8)


class ThreadSlots:
    """Per-thread reusable memory objects and argument arrays for one compiled primitive, so a
    call only swaps data pointers and several threads can run the same primitive at once.
    ``per_thread`` args (the scratchpad) get a buffer of their own in each thread."""

    def __init__(self, arg_mds: list[tuple[int, MemoryDesc]], fixed: dict[int, torch.Tensor],
                 per_thread: tuple[int, ...] = ()):
        self._arg_mds = arg_mds
        self._fixed = fixed
        self._per_thread = per_thread
        self._tls = threading.local()

    def get(self):
        s = getattr(self._tls, "slots", None)
        if s is None:
            f = L.ffi()
            mems = {}
            args = f.new("dnnl_exec_arg_t[]", len(self._arg_mds))
            own = self._tls.buffers = {a: empty_for(md) for a, md in self._arg_mds if a in self._per_thread}
            for i, (arg, md) in enumerate(self._arg_mds):
                m = memory(md, own.get(arg, self._fixed.get(arg)))
                mems[arg] = m
                args[i].arg = arg
                args[i].memory = m
            s = (mems, args)
            self._tls.slots = s
        return s
