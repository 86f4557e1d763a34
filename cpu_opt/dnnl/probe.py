"""Ask the library, not the machine's name: does oneDNN create this primitive here, and with which
implementation?

The answers depend on the ISA oneDNN sees (after ``ONEDNN_MAX_CPU_ISA``, which follows
``CPU_OPT_MAX_ISA``), so they are the ground truth for routing decisions that features alone get
wrong. Two conditions that look alike and are not:

* oneDNN *accepts* bf16 (``accepts("bf16")``): a bf16 matmul primitive is created. oneDNN 3.2 does
  this from avx512_core up — on a CPU without AVX512_BF16 by emulation (``gemm:jit:bf16``, about 4x
  slower than fp32 on an Ice Lake) — and answers ``dnnl_unimplemented`` below avx512_core.
* the CPU has *native* bf16 math (``native("bf16")``): the implementation is one of the
  avx512_core_bf16 / AMX kernels (``brg:avx512_core_bf16``, ``brg:avx512_core_amx``).

Each answer is computed once per process (oneDNN's ISA cannot change after its first primitive).
"""
from __future__ import annotations

import functools

import torch

from ..errors import DnnlError

PROBE_SHAPE = (64, 256, 96)  # M, K, N: small enough to cost ~1 ms, big enough for brgemm kernels
DTYPES = ("fp32", "bf16", "fp16", "int8")
TORCH_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Implementation strings of kernels that compute bf16 natively (dot products in hardware).
NATIVE_BF16_IMPLS = ("avx512_core_bf16", "avx512_core_amx", "avx2_vnni_2", "avx10")
NATIVE_INT8_IMPLS = ("vnni", "amx")


@functools.lru_cache(maxsize=None)
def matmul_impl(dtype: str) -> str | None:
    """The implementation string oneDNN gives a (64x256) x (256x96) matmul of ``dtype``
    (``"fp32"``, ``"bf16"``, ``"fp16"``, or ``"int8"`` = u8 x s8 -> s32) on this CPU, or ``None`` when oneDNN
    answers ``dnnl_unimplemented``. Any other failure (no library, no CPU engine) raises."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    from .memory import MemoryDesc
    from .primitives import _Attr, _matmul_primitive

    m, k, n = PROBE_SHAPE
    src_dt, wei_dt, dst_dt = ((torch.uint8, torch.int8, torch.int32) if dtype == "int8"
                              else (TORCH_DTYPE[dtype],) * 3)
    try:
        # weights in format "any", as the Matmul layer creates them (oneDNN then picks its packed brgemm
        # kernels where it has them; a strided weight can get a plain gemm instead)
        prim = _matmul_primitive(MemoryDesc.strided((m, k), src_dt), MemoryDesc.any((k, n), wei_dt), None,
                                 MemoryDesc.strided((m, n), dst_dt), _Attr(), f"probe {dtype} matmul")
        return prim.impl
    except DnnlError as e:
        if e.status == "dnnl_unimplemented":
            return None
        raise


def accepts(dtype: str) -> bool:
    """Does oneDNN (cpu_opt's binding) create a ``dtype`` matmul here at all (maybe emulated)?"""
    return matmul_impl(dtype) is not None


def native(dtype: str) -> bool:
    """Does oneDNN run ``dtype`` matmuls here on kernels with hardware support for the dtype
    (bf16: AVX512_BF16 / AMX dot products; int8: VNNI / AMX)? fp32 is always native."""
    impl = matmul_impl(dtype)
    if impl is None:
        return False
    if dtype == "bf16":
        return any(tag in impl for tag in NATIVE_BF16_IMPLS)
    if dtype == "int8":
        return any(tag in impl for tag in NATIVE_INT8_IMPLS)
    if dtype == "fp16":
        return "fp16" in impl or "amx" in impl
    return True


def require(dtype: torch.dtype, what: str) -> None:
    """Refuse, with a Python exception, work in a reduced-precision float dtype oneDNN has no
    kernels for at the ISA it uses: its Graph API does not return a status there but throws a C++
    ``dnnl::error`` nobody catches, which aborts the process (oneDNN 3.2, bf16 eltwise below
    avx512_core)."""
    name = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype)
    if name is None or accepts(name):
        return
    from .. import hw

    info = hw.detect()
    raise DnnlError("dnnl_unimplemented", what,
                    f"oneDNN {_version()} creates no {name} matmul on this CPU"
                    f"{' under the cap ' + info.isa_cap if info.isa_cap else ''} (oneDNN 3.2 takes {name} from "
                    f"avx512_core up); cpu_opt refuses {name} graphs here, where oneDNN would abort the process")


def _version() -> str:
    from .lib import version

    return version()


def summary() -> dict:
    """``{dtype: {"impl": str | None, "accepted": bool, "native": bool}}`` for ``info``."""
    out = {}
    for d in ("fp32", "bf16", "int8"):
        try:
            impl = matmul_impl(d)
        except Exception as e:  # noqa: BLE001 - no binding: say so, do not fail `info`
            out[d] = {"impl": None, "accepted": False, "native": False, "error": f"{type(e).__name__}: {e}"}
            continue
        out[d] = {"impl": impl, "accepted": impl is not None, "native": native(d)}
    return out
