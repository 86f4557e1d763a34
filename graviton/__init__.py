"""cpu_opt.graviton: the aarch64 path (AWS Graviton2/3/4: Neoverse N1/V1/V2).

On aarch64 cpu_opt reaches Arm Compute Library (ACL) through the oneDNN inside torch's aarch64
wheel (its symbols are hidden, so only through torch ops); cpu_opt's own oneDNN binding and
native kernels do not exist there, and nothing here imports them.

Public API (torch is imported lazily: ``import cpu_opt.graviton`` is cheap on any machine):

* :func:`optimize_for_arm` — what ``cpu_opt.optimize`` calls on aarch64: bf16 fast-math on
  cores with BF16, strict fp32 elsewhere, Linear/Conv2d weights packed once, primitive caches
  warmed with the example shapes; ``.report()`` on the result says what was done.
* :func:`enable_fast_math`, :func:`disable_fast_math`, :func:`fast_math` (context manager),
  :func:`fast_math_status` — torch's run-time bf16 switch; the process-wide default
  (``CPU_OPT_FAST_MATH=1`` before start-up) is described in :mod:`.fastmath`.
* :func:`set_primitive_cache_capacity`, :func:`primitive_cache_capacity`,
  :func:`set_num_threads`, :func:`recommended_num_threads`, :func:`thp_status`,
  :func:`enable_thp` — tuning knobs (:mod:`.tuning`).
* :func:`applicability` — whether this path applies here, and why not (no exception);
  everything else raises :class:`GravitonNotApplicable` off aarch64.
* :mod:`.verbose` — parse and capture oneDNN's verbose lines (which kernel ran, with which
  attributes, cache hits).

Importing this package applies the ``CPU_OPT_*`` start-up opt-ins (:mod:`.startup`), on
aarch64 only; a bad value there warns rather than breaking ``import cpu_opt``.
"""
from __future__ import annotations

import warnings as _warnings

from . import startup
from ._platform import Applicability, GravitonNotApplicable, applicability
from .tuning import (
    CacheCapacity,
    THPStatus,
    enable_thp,
    primitive_cache_capacity,
    recommended_num_threads,
    set_num_threads,
    set_primitive_cache_capacity,
    thp_status,
)

try:
    startup.apply()
except startup.StartupEnvError as _e:  # do not break `import cpu_opt` over an env typo, but say so
    _warnings.warn(f"cpu_opt.graviton: {_e}; start-up settings not applied", RuntimeWarning, stacklevel=2)

_LAZY = {
    # name -> (module, attribute): these import torch
    "enable_fast_math": ("fastmath", "enable_fast_math"),
    "disable_fast_math": ("fastmath", "disable_fast_math"),
    "fast_math": ("fastmath", "fast_math"),
    "fast_math_status": ("fastmath", "status"),
    "process_fast_math": ("fastmath", "process_fast_math"),
    "FastMathStatus": ("fastmath", "FastMathStatus"),
    "optimize_for_arm": ("optimize", "optimize_for_arm"),
    "ArmOptimizedModule": ("optimize", "ArmOptimizedModule"),
    "ArmOptions": ("optimize", "ArmOptions"),
    "PackedLinear": ("packed", "PackedLinear"),
    "PackedConv2d": ("packed", "PackedConv2d"),
    "verbose": ("verbose", None),
}

__all__ = [
    "applicability", "Applicability", "GravitonNotApplicable", "startup",
    "set_primitive_cache_capacity", "primitive_cache_capacity", "CacheCapacity",
    "set_num_threads", "recommended_num_threads", "thp_status", "enable_thp", "THPStatus",
    *_LAZY,
]


def __getattr__(name):
    if name in _LAZY:
        import importlib

        mod_name, attr = _LAZY[name]
        mod = importlib.import_module(f"{__name__}.{mod_name}")
        value = mod if attr is None else getattr(mod, attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
