"""Loader and ISA dispatch for cpu_opt._native, the C kernels built from native/.

``kernel("gather_rows_f32_i64")`` returns the best compiled variant (avx512 > avx2 > base) that
the detected CPU and ``CPU_OPT_MAX_ISA`` allow. Kernels return an int64 status; ``check``
turns a non-zero status into :class:`cpu_opt.errors.NativeKernelError`.
"""
from __future__ import annotations

import operator

import functools
import os

from .platform import hw
from .errors import NativeKernelError

# variant -> every feature its ``#pragma GCC target`` in native/variants.c lets the compiler use
# (what gcc's -m flags imply, in /proc/cpuinfo's names: SSE3 is "pni"), so a VM that masks any of
# them (say bmi2) gets a lower variant instead of SIGILL. tests/test_native.py derives this list
# from the pragmas with gcc and compares.
_AVX2_REQUIRES = frozenset({"pni", "ssse3", "sse4_1", "sse4_2", "popcnt", "xsave", "avx", "avx2", "fma", "f16c",
                            "bmi2"})
VARIANT_REQUIRES = {
    "avx512": _AVX2_REQUIRES | {"avx512f", "avx512bw", "avx512vl", "avx512dq"},
    "avx2": _AVX2_REQUIRES,
    "base": frozenset(),
}
VARIANT_ORDER = ("avx512", "avx2", "base")

STATUS_NAMES = {0: "CO_OK", -1: "CO_ERR_INDEX_OUT_OF_RANGE", -2: "CO_ERR_BAD_ARGUMENT", -3: "CO_ERR_UNSORTED",
                -4: "CO_ERR_DUPLICATE", -5: "CO_ERR_NO_MEMORY", -6: "CO_ERR_UNSUPPORTED_AMX"}


@functools.lru_cache(maxsize=1)
def _module():
    import torch  # noqa: F401  - load torch's libgomp first so the kernels share its OpenMP runtime

    path = os.environ.get("CPU_OPT_NATIVE_PATH")
    if path:  # another build of the same sources, e.g. the sanitized one of `make test-asan`
        import importlib.machinery
        import importlib.util
        import sys

        loader = importlib.machinery.ExtensionFileLoader("cpu_opt._native", path)
        spec = importlib.util.spec_from_file_location("cpu_opt._native", path, loader=loader)
        mod = importlib.util.module_from_spec(spec)
        loader.exec_module(mod)
        sys.modules["cpu_opt._native"] = mod
        return mod
    try:
        from . import _native
    except ImportError as e:  # pragma: no cover - broken install
        raise ImportError(
            "cpu_opt._native is not built; reinstall cpu_opt (pip install -e .) with a C compiler present"
        ) from e
    return _native


def module_path() -> str:
    """The file the native kernels were loaded from."""
    return _module().__file__


def ffi():
    return _module().ffi


def lib():
    return _module().lib


@functools.lru_cache(maxsize=None)
def compiled_variants() -> tuple[str, ...]:
    """The variants the loaded library was built with (fixed once it is loaded)."""
    return tuple(ffi().string(lib().co_native_variants()).decode().split(","))


def select_variant(info: hw.CPUInfo | None = None) -> str:
    """The variant this CPU runs: the widest compiled one whose features are all present."""
    info = info or hw.detect()
    built = compiled_variants()
    for v in VARIANT_ORDER:
        if v in built and VARIANT_REQUIRES[v] <= info.isa:
            return v
    return "base"


def vectorized() -> bool:
    """Does this CPU run a vectorized variant (avx2, avx512) of the kernels? The base variant is
    plain C: where cpu_opt's own kernels compete with torch's (GELU, GEMV), only the vector ones do."""
    try:
        return select_variant() in ("avx2", "avx512")
    except Exception:  # noqa: BLE001 - no native build: not vectorized
        return False


_CAP_VARS = ("CPU_OPT_MAX_ISA", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")


def kernel(name: str, variant: str | None = None):
    """The C function ``name_<variant>``; ``variant`` defaults to :func:`select_variant`. Resolved
    once per name, variant and value of the ISA cap variables (a lookup costs 0.3 us, not the 5 us of
    detecting the variant again)."""
    key = (name, variant, *(os.environ.get(k) for k in _CAP_VARS))
    fn = _by_key.get(key)
    if fn is None:
        fn = _by_key[key] = _kernel(name, variant)
    return fn


_by_key: dict = {}


def _kernel(name: str, variant: str | None):
    v = variant or select_variant()
    if v not in VARIANT_REQUIRES:
        raise ValueError(f"unknown native variant {v!r}; expected one of {VARIANT_ORDER}")
    missing = VARIANT_REQUIRES[v] - hw.detect().isa_uncapped
    if missing:
        # Running it would die on an illegal instruction: refuse instead.
        raise RuntimeError(f"native variant {v!r} needs {sorted(missing)}, which this CPU lacks")
    try:
        return getattr(lib(), f"{name}_{v}")
    except AttributeError:
        raise AttributeError(f"native kernel {name!r} has no variant {v!r}") from None




def check(status: int, what: str, detail: str = "") -> None:
    if status != 0:
        name = STATUS_NAMES.get(int(status), f"status {int(status)}")
        raise NativeKernelError(f"{what}: {name}" + (f" ({detail})" if detail else ""))


HUGEPAGE_MIN_BYTES = 4 << 20
CHECKED_ALLOCATION_BYTES = 1 << 28  # buffers from 256 MiB up are checked against the memory available


def _available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_allocation(nbytes: int, what: str) -> None:
    """Refuse, with a MemoryError naming the argument, a buffer larger than the memory available.
    On Linux a huge ``torch.empty`` succeeds (overcommit) and a kernel's first pass over it brings
    the OOM killer instead of an exception."""
    if nbytes < CHECKED_ALLOCATION_BYTES:
        return
    avail = _available_bytes()
    if avail is not None and nbytes > avail:
        raise MemoryError(f"{what} needs {nbytes / 2**30:.1f} GiB; {avail / 2**30:.1f} GiB are available")


def empty(*shape, dtype=None):
    """``torch.empty``, but a buffer of 4 MiB or more gets transparent huge pages before its first
    touch (where the kernel allows them on request): a fresh 50 MB output otherwise pays about
    12,000 page faults on first write, which costs the GNN kernels as much as their work."""
    import torch

    dtype = dtype or torch.float32
    dims = shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)) else shape
    for d in dims:
        if isinstance(d, torch.dtype):
            raise TypeError(f"native.empty: pass the dtype by keyword (dtype={d}), not as a dimension")
    try:
        dims = [operator.index(d) for d in dims]
    except TypeError:
        raise TypeError(f"native.empty: dimensions are ints, got {tuple(dims)}") from None
    numel = 1
    for d in dims:
        numel *= d
    check_allocation(numel * torch.empty((), dtype=dtype).element_size(), f"a {dtype} buffer of shape {shape}")
    t = torch.empty(*shape, dtype=dtype)
    nbytes = t.numel() * t.element_size()
    if nbytes >= HUGEPAGE_MIN_BYTES:
        lib().co_advise_hugepages(ffi().cast("void *", t.data_ptr()), nbytes)
    return t


def ptr(t, ctype: str):
    """A cffi pointer to a (contiguous) tensor's data."""
    return ffi().cast(ctype, t.data_ptr())


def gather_rows(src, index, out=None, variant: str | None = None):
    """``out[i] = src[index[i]]`` for a 2-D float32 ``src`` (index_select along dim 0).

    The proof kernel of the native build; the GNN kernels live beside it. Checks the index
    range before touching memory and raises ``IndexError`` naming the bad position.
    """
    import torch

    if not isinstance(src, torch.Tensor) or not isinstance(index, torch.Tensor):
        raise TypeError("gather_rows: src and index must be torch.Tensor")
    if src.dtype != torch.float32:
        raise TypeError(f"gather_rows: src must be float32, got {src.dtype}")
    if src.dim() != 2:
        raise ValueError(f"gather_rows: src must be 2-D, got {src.dim()}-D")
    if index.dtype not in (torch.int64, torch.int32) or index.dim() != 1:
        raise TypeError(f"gather_rows: index must be a 1-D int64 or int32 tensor, got {index.dtype} {index.dim()}-D")
    src = src.contiguous()
    index = index.contiguous()
    n, f = src.shape
    if out is None:
        out = torch.empty(index.numel(), f, dtype=src.dtype)
    elif out.shape != (index.numel(), f) or out.dtype != src.dtype or not out.is_contiguous():
        raise ValueError(f"gather_rows: out must be a contiguous float32 tensor of shape {(index.numel(), f)}")
    suffix = "i64" if index.dtype == torch.int64 else "i32"
    bad = ffi().new("int64_t *", -1)
    fn = kernel(f"gather_rows_f32_{suffix}", variant)
    st = fn(ptr(src, "float *"), n, f, ptr(index, f"{'int64_t' if suffix == 'i64' else 'int32_t'} *"),
            index.numel(), ptr(out, "float *"), torch.get_num_threads(), bad)
    if st == -1:
        raise IndexError(f"gather_rows: index[{bad[0]}] = {int(index[bad[0]])} is out of range for {n} rows")
    check(st, "gather_rows")
    return out


def fingerprint(t) -> int:
    """A 64-bit fingerprint of a tensor's contents (its bytes in row-major order; dtype, shape and
    strides are the caller's to add to a key). Caches keyed by a tensor use it to notice every
    change of contents — ``_version`` misses writes through ``.data`` or numpy views and raises on
    inference-mode tensors. Memory-bound: about 1 ms per 10 MB here."""
    import torch

    if not isinstance(t, torch.Tensor):
        raise TypeError(f"fingerprint takes a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu" or t.layout != torch.strided:
        raise ValueError(f"fingerprint takes a dense CPU tensor, got {t.device} {t.layout}")
    if t.is_neg() or t.is_conj():
        t = t.resolve_neg().resolve_conj()
    if not t.is_contiguous():
        t = t.contiguous()
    out = ffi().new("uint64_t *")
    nbytes = t.numel() * t.element_size()
    check(lib().co_fingerprint(ffi().cast("void *", t.data_ptr()) if nbytes else ffi().NULL, nbytes,
                               torch.get_num_threads(), out), "co_fingerprint")
    return int(out[0])
