"""Tuning knobs from AWS's Graviton guide, each applied only when asked and each reported.

* Threads: ``set_num_threads(n)`` -> ``torch.set_num_threads`` (torch's OpenMP pool, which
  oneDNN/ACL share). Graviton vCPUs are physical cores (no SMT), so the guide's advice is one
  thread per vCPU for one process, fewer per process when several share the machine.
  :func:`recommended_num_threads` gives that number (``os.sched_getaffinity``).
* Transparent huge pages: torch's allocator calls ``madvise(MADV_HUGEPAGE)`` on blocks of 2 MB
  and more when ``THP_MEM_ALLOC_ENABLE=1`` was in the environment at ``import torch``; the kernel
  honours it when ``/sys/kernel/mm/transparent_hugepage/enabled`` is ``always`` or ``madvise``.
  cpu_opt never writes to /sys (a machine-wide setting); :func:`thp_status` reports both.
* Primitive cache: oneDNN keeps created primitives (an ACL GEMM is expensive to configure)
  in an LRU cache of ``ONEDNN_PRIMITIVE_CACHE_CAPACITY`` entries (default 1024), ideep in
  torch keeps its own (``LRU_CACHE_CAPACITY``). Both are read once, at first use:
  :func:`set_primitive_cache_capacity` sets both and says whether it came in time.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

from . import startup

THP_SYSFS = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _check_int(name: str, value, lo: int, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < lo or (hi is not None and value > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{name}={value}: expected an integer {rng}")
    return value


# ----------------------------------------------------------------------------- threads

def recommended_num_threads(processes: int = 1) -> int:
    """vCPUs this process may run on, divided among ``processes`` processes (at least 1)."""
    _check_int("processes", processes, 1)
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    return max(1, n // processes)


def set_num_threads(n: int) -> int:
    """Set torch's (and so oneDNN/ACL's) OpenMP thread count; returns the previous count."""
    _check_int("n", n, 1, 4096)
    import torch

    prev = torch.get_num_threads()
    torch.set_num_threads(n)
    return prev


# ----------------------------------------------------------------------------- THP

@dataclass(frozen=True)
class THPStatus:
    system_mode: str | None      # "always", "madvise", "never", or None when /sys does not say
    torch_env: bool              # THP_MEM_ALLOC_ENABLE=1 in the environment
    effective: bool              # torch asked for huge pages AND the kernel grants them (or always)
    note: str


def parse_thp_mode(text: str) -> str | None:
    """The bracketed choice of ``always [madvise] never`` -> "madvise"."""
    for word in text.split():
        if word.startswith("[") and word.endswith("]"):
            return word[1:-1]
    return None


def thp_status(sysfs: Path = THP_SYSFS, environ=None) -> THPStatus:
    env = os.environ if environ is None else environ
    try:
        mode = parse_thp_mode(sysfs.read_text())
    except OSError:
        mode = None
    torch_env = env.get(startup.TORCH_THP_VAR, "").strip() == "1"
    if mode == "always":
        eff, note = True, "the kernel gives huge pages to every large anonymous mapping"
    elif mode == "madvise":
        eff = torch_env
        note = ("torch madvises blocks of 2 MB and more" if torch_env else
                f"set {startup.THP_VAR}=1 (or {startup.TORCH_THP_VAR}=1) before torch starts to use them")
    elif mode == "never":
        eff, note = False, "disabled machine-wide; cpu_opt does not change /sys"
    else:
        eff, note = False, "kernel THP setting not readable"
    return THPStatus(system_mode=mode, torch_env=torch_env, effective=eff, note=note)


def enable_thp() -> THPStatus:
    """Ask torch's allocator for huge pages (THP_MEM_ALLOC_ENABLE=1).

    torch reads the variable at its first allocation, i.e. during ``import torch``: called after
    that, this raises rather than pretend (set ``CPU_OPT_THP=1`` before starting Python).
    """
    if os.environ.get(startup.TORCH_THP_VAR, "").strip() == "1":
        return thp_status()
    if "torch" in sys.modules:
        raise RuntimeError(
            f"enable_thp(): torch is already imported and reads {startup.TORCH_THP_VAR} only at its first "
            f"allocation; export {startup.THP_VAR}=1 (or {startup.TORCH_THP_VAR}=1) before starting Python")
    os.environ[startup.TORCH_THP_VAR] = "1"
    return thp_status()


# ----------------------------------------------------------------------------- primitive cache

@dataclass(frozen=True)
class CacheCapacity:
    capacity: int
    in_time: bool | None    # True: set before torch was imported; None: torch imported, unknown
    note: str


def primitive_cache_capacity() -> int:
    """The capacity oneDNN will use (or uses): the environment's value, else oneDNN's default."""
    v = os.environ.get(startup.ONEDNN_CACHE_VAR, "").strip()
    return startup.parse_capacity(startup.ONEDNN_CACHE_VAR, v) if v else startup.DEFAULT_PRIMITIVE_CACHE_CAPACITY


def set_primitive_cache_capacity(n: int) -> CacheCapacity:
    """Set oneDNN's and ideep's primitive cache capacity to ``n`` (0 disables caching).

    Both libraries read the value once, when they are first used. Set before ``import torch``
    it always applies; after, it applies only if no oneDNN primitive has run yet, which cpu_opt
    cannot see from outside, so ``in_time`` is None then. For certainty set
    ``CPU_OPT_PRIMITIVE_CACHE_CAPACITY`` before starting Python.
    """
    _check_int("n", n, 0, startup.MAX_PRIMITIVE_CACHE_CAPACITY)
    os.environ[startup.ONEDNN_CACHE_VAR] = str(n)
    os.environ[startup.IDEEP_CACHE_VAR] = str(n)
    if "torch" not in sys.modules:
        return CacheCapacity(n, True, "set before torch was imported")
    return CacheCapacity(n, None, "torch is imported: applies only if oneDNN has created no primitive yet")
