"""Loading libdnnl through cffi (ABI mode) and turning every oneDNN status into an exception.

Where libdnnl comes from, in order:

1. ``CPU_OPT_LIBDNNL=/path/to/libdnnl.so.3`` — the documented override, e.g. for a newer oneDNN
   3.x build (the cdef was generated from the 3.x headers cpu_opt was built with; the oneDNN 3
   C ABI is stable, and a function missing from an older library fails only when called).
2. ``<sys.prefix>/lib/libdnnl.so.3`` — where the ``onednn-cpu-gomp`` wheel installs it.
3. The dynamic loader's search path (``libdnnl.so.3``).

torch is imported first so that libdnnl binds to the ``libgomp.so.1`` torch already loaded:
then ``torch.set_num_threads`` governs oneDNN's threads too.
"""
from __future__ import annotations

import functools
import os
import sys
import threading
from pathlib import Path

from ..errors import DnnlError, DnnlUnavailableError

INSTALL_HINT = ("pip install onednn-cpu-gomp==2023.2.0 onednn-devel-cpu-gomp==2023.2.0 "
                "(x86-64 only), or set CPU_OPT_LIBDNNL to a libdnnl.so.3")


def candidate_paths() -> list[Path]:
    env = os.environ.get("CPU_OPT_LIBDNNL")
    if env:
        return [Path(env)]
    out = []
    for prefix in dict.fromkeys((sys.prefix, sys.base_prefix, sys.exec_prefix)):
        out.append(Path(prefix) / "lib" / "libdnnl.so.3")
    return out


def _cdef_text() -> str:
    try:
        from ._cdef_generated import CDEF
    except ImportError as e:
        raise DnnlUnavailableError(
            "cpu_opt was built without the oneDNN cdef (no oneDNN headers at build time); "
            f"{INSTALL_HINT}, then reinstall cpu_opt") from e
    return CDEF


@functools.lru_cache(maxsize=1)
def _load():
    import torch  # noqa: F401  - see module docstring (shared libgomp)
    import cffi

    from ..platform import hw

    # Follow cpu_opt's ISA cap inside oneDNN too (oneDNN reads this once, at its first use).
    hw.export_cap()

    ffi = cffi.FFI()
    ffi.cdef(_cdef_text())
    errors = []
    explicit = bool(os.environ.get("CPU_OPT_LIBDNNL"))
    for path in candidate_paths():
        if not path.exists():
            errors.append(f"{path}: not found")
            continue
        try:
            lib = ffi.dlopen(str(path))
            return ffi, lib, str(path)
        except OSError as e:
            errors.append(f"{path}: {e}")
    if not explicit:
        try:
            lib = ffi.dlopen("libdnnl.so.3")
            return ffi, lib, "libdnnl.so.3 (loader search path)"
        except OSError as e:
            errors.append(f"libdnnl.so.3 on the loader path: {e}")
    raise DnnlUnavailableError("libdnnl could not be loaded (" + "; ".join(errors) + f"). {INSTALL_HINT}")


def ffi():
    return _load()[0]


def lib():
    return _load()[1]


def library_path() -> str:
    return _load()[2]


def available() -> bool:
    """True when libdnnl loads and can create a CPU engine."""
    try:
        engine()
        return True
    except Exception:
        return False


@functools.lru_cache(maxsize=1)
def _status_names() -> dict:
    return {v: k for k, v in ffi().typeof("dnnl_status_t").relements.items()}


def status_name(status: int) -> str:
    return _status_names().get(int(status), f"dnnl_status_{int(status)}")


def check(status: int, call: str, detail: str = "") -> None:
    """Raise :class:`DnnlError` naming the status unless it is ``dnnl_success``."""
    if status != 0:
        raise DnnlError(status_name(status), call, detail)


def version() -> str:
    v = lib().dnnl_version()
    return f"{v.major}.{v.minor}.{v.patch}"


def version_info() -> dict:
    v = lib().dnnl_version()
    runtimes = {0: "none", 1: "seq", 2: "omp", 4: "tbb", 8: "threadpool"}
    return {"version": f"{v.major}.{v.minor}.{v.patch}", "hash": ffi().string(v.hash).decode(),
            "cpu_runtime": runtimes.get(v.cpu_runtime, str(v.cpu_runtime)), "path": library_path()}


@functools.lru_cache(maxsize=1)
def engine():
    """The process-wide CPU engine."""
    f, l = ffi(), lib()
    eng = f.new("dnnl_engine_t *")
    check(l.dnnl_engine_create(eng, l.dnnl_cpu, 0), "dnnl_engine_create",
          "no CPU engine (a SYCL/GPU-only oneDNN build?)")
    # oneDNN Graph's constant tensor cache: partitions keep the reordered (packed) form of their
    # constant inputs (weights) across executions. On by default in 3.2; set explicitly so a
    # library default or ONEDNN_GRAPH_CONSTANT_CACHE change cannot silently turn weight packing
    # into a per-call reorder. Weights changed in place are caught by the optimized module's
    # parameter-version check (it re-optimizes), not by this cache.
    configure_graph()
    return eng[0]


def configure_graph() -> None:
    """The process-wide oneDNN Graph settings cpu_opt relies on (see :func:`engine`)."""
    check(lib().dnnl_graph_set_constant_tensor_cache(1), "dnnl_graph_set_constant_tensor_cache")


def constant_cache_enabled() -> bool:
    flag = ffi().new("int *")
    check(lib().dnnl_graph_get_constant_tensor_cache(flag), "dnnl_graph_get_constant_tensor_cache")
    return bool(flag[0])


_tls = threading.local()


def stream():
    """A CPU stream per thread (streams are not shared between threads)."""
    s = getattr(_tls, "stream", None)
    if s is None:
        f, l = ffi(), lib()
        p = f.new("dnnl_stream_t *")
        check(l.dnnl_stream_create(p, engine(), l.dnnl_stream_default_flags), "dnnl_stream_create")
        s = f.gc(p[0], l.dnnl_stream_destroy)
        _tls.stream = s
    return s
