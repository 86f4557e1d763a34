"""Process-start settings for the aarch64 path: what must be in the environment before torch runs.

oneDNN and torch's allocator read some settings once, the first time they are used, and never
again in that process:

========================================  ==========================================  ============================
variable                                  read by                                      read when
========================================  ==========================================  ============================
``DNNL_DEFAULT_FPMATH_MODE=BF16``         oneDNN: bf16 fast-math for every primitive   ``import torch`` (seen: set
                                                                                       after it, before any oneDNN
                                                                                       call, it is ignored)
``ONEDNN_PRIMITIVE_CACHE_CAPACITY=N``     oneDNN's primitive cache (default 1024)       first oneDNN use
``LRU_CACHE_CAPACITY=N``                  ideep's cache of primitives inside torch      first ideep op
``THP_MEM_ALLOC_ENABLE=1``                torch's CPU allocator: madvise huge pages     first tensor allocation
                                          for blocks of 2 MB and more                   (``import torch``)
========================================  ==========================================  ============================

So cpu_opt offers them as opt-ins read at ``import cpu_opt`` time, *before* torch is imported,
under its own names (nothing is switched on behind the user's back):

* ``CPU_OPT_FAST_MATH=1``            -> ``DNNL_DEFAULT_FPMATH_MODE=BF16``
* ``CPU_OPT_PRIMITIVE_CACHE_CAPACITY=N`` -> ``ONEDNN_PRIMITIVE_CACHE_CAPACITY=N`` and ``LRU_CACHE_CAPACITY=N``
* ``CPU_OPT_THP=1``                  -> ``THP_MEM_ALLOC_ENABLE=1``

:func:`apply` does that. It imports nothing heavy (no torch), acts on aarch64 only, never
overrides a value the user already exported, and records what it did and whether torch was
already imported (in which case the allocator setting is too late, and the oneDNN ones take
effect only if no oneDNN primitive has run yet; the fpmath default was seen to come too
late then). :func:`state` returns that record. For this to work, ``import cpu_opt`` must call
:func:`apply` before it imports torch.
"""
from __future__ import annotations

import os
import platform
import sys
from dataclasses import dataclass, field

# cpu_opt's opt-in variable -> the variables it sets, and the value each gets.
FAST_MATH_VAR = "CPU_OPT_FAST_MATH"
CACHE_VAR = "CPU_OPT_PRIMITIVE_CACHE_CAPACITY"
THP_VAR = "CPU_OPT_THP"

ONEDNN_FPMATH_VAR = "DNNL_DEFAULT_FPMATH_MODE"
ONEDNN_FPMATH_VAR_NEW = "ONEDNN_DEFAULT_FPMATH_MODE"
ONEDNN_CACHE_VAR = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"
IDEEP_CACHE_VAR = "LRU_CACHE_CAPACITY"
TORCH_THP_VAR = "THP_MEM_ALLOC_ENABLE"

_TRUE = {"1", "true", "yes", "on", "bf16"}
_FALSE = {"", "0", "false", "no", "off"}

# oneDNN's own default capacity of its primitive cache (and ideep's default LRU capacity).
DEFAULT_PRIMITIVE_CACHE_CAPACITY = 1024
MAX_PRIMITIVE_CACHE_CAPACITY = 1 << 20


class StartupEnvError(ValueError):
    """A CPU_OPT_* start-up variable has a value cpu_opt does not understand."""


@dataclass(frozen=True)
class StartupState:
    """What :func:`apply` found and did."""

    machine: str
    applied: bool                          # False off aarch64: nothing is touched there
    torch_was_imported: bool               # torch already in sys.modules when apply() ran
    set_vars: dict = field(default_factory=dict)       # variables apply() set -> value
    kept_vars: dict = field(default_factory=dict)      # variables the user had set -> value (left alone)
    notes: tuple = ()

    @property
    def fast_math_env(self) -> bool:
        """DNNL_DEFAULT_FPMATH_MODE=BF16 is in this process's environment (set by anyone)."""
        v = self.set_vars.get(ONEDNN_FPMATH_VAR) or self.kept_vars.get(ONEDNN_FPMATH_VAR) or ""
        return v.upper() == "BF16"


def parse_flag(name: str, value: str | None) -> bool:
    """A yes/no start-up variable: 1/true/yes/on (or bf16 for fast-math) or 0/false/no/off/empty."""
    v = (value or "").strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise StartupEnvError(f"{name}={value!r}: expected 1/true/yes/on or 0/false/no/off")


def parse_capacity(name: str, value: str | int) -> int:
    """A primitive-cache capacity: an integer in [0, 2**20]; 0 disables the cache."""
    if isinstance(value, bool):
        raise StartupEnvError(f"{name}={value!r}: expected an integer number of primitives, not a bool")
    try:
        n = int(str(value).strip(), 10)
    except ValueError:
        raise StartupEnvError(f"{name}={value!r}: expected an integer number of primitives (0 disables the cache)") from None
    if not 0 <= n <= MAX_PRIMITIVE_CACHE_CAPACITY:
        raise StartupEnvError(f"{name}={n}: expected 0 <= capacity <= {MAX_PRIMITIVE_CACHE_CAPACITY}")
    return n


def plan(environ: dict, machine: str) -> tuple[dict, dict, list]:
    """Which variables to set for ``environ`` on ``machine`` -> (to_set, kept, notes). Pure."""
    to_set, kept, notes = {}, {}, []
    if machine not in ("aarch64", "arm64"):
        for var in (FAST_MATH_VAR, CACHE_VAR, THP_VAR):
            if environ.get(var, "").strip() not in ("", "0"):
                notes.append(f"{var} is set but this is {machine}, not aarch64: ignored")
        return to_set, kept, notes

    def want(var, value):
        if var in environ and environ[var] != "":
            kept[var] = environ[var]
            if environ[var] != value:
                notes.append(f"{var}={environ[var]!r} was already set by the user; cpu_opt leaves it")
        else:
            to_set[var] = value

    if parse_flag(FAST_MATH_VAR, environ.get(FAST_MATH_VAR)):
        want(ONEDNN_FPMATH_VAR, "BF16")
    elif environ.get(ONEDNN_FPMATH_VAR):
        kept[ONEDNN_FPMATH_VAR] = environ[ONEDNN_FPMATH_VAR]
    if environ.get(ONEDNN_FPMATH_VAR_NEW):
        kept[ONEDNN_FPMATH_VAR_NEW] = environ[ONEDNN_FPMATH_VAR_NEW]
    if environ.get(CACHE_VAR, "").strip():
        n = str(parse_capacity(CACHE_VAR, environ[CACHE_VAR]))
        want(ONEDNN_CACHE_VAR, n)
        want(IDEEP_CACHE_VAR, n)
    if parse_flag(THP_VAR, environ.get(THP_VAR)):
        want(TORCH_THP_VAR, "1")
    return to_set, kept, notes


_STATE: StartupState | None = None


def apply(environ=None, machine: str | None = None) -> StartupState:
    """Translate the CPU_OPT_* opt-ins into the variables oneDNN and torch read (aarch64 only).

    Safe to call more than once; only the first call in a process acts on ``os.environ``.
    Call it before ``import torch`` (``import cpu_opt`` does, when cpu_opt is imported first).
    """
    global _STATE
    if environ is None and _STATE is not None:
        return _STATE
    env = os.environ if environ is None else environ
    machine = machine or platform.machine()
    torch_imported = "torch" in sys.modules
    to_set, kept, notes = plan(env, machine)
    for k, v in to_set.items():
        env[k] = v
    if to_set and torch_imported:
        if TORCH_THP_VAR in to_set:
            notes.append("torch was imported before cpu_opt: THP_MEM_ALLOC_ENABLE comes too late for this "
                         "process (export it, or import cpu_opt first)")
        if ONEDNN_FPMATH_VAR in to_set:
            notes.append("torch was imported before cpu_opt: DNNL_DEFAULT_FPMATH_MODE comes too late for this "
                         "process (oneDNN takes its default when torch loads); export it, or import cpu_opt first")
        if set(to_set) & {ONEDNN_CACHE_VAR, IDEEP_CACHE_VAR}:
            notes.append("torch was imported before cpu_opt: the cache capacity takes effect only if no oneDNN "
                         "primitive has run yet in this process")
    st = StartupState(machine=machine, applied=machine in ("aarch64", "arm64"), torch_was_imported=torch_imported,
                      set_vars=dict(to_set), kept_vars=dict(kept), notes=tuple(notes))
    if environ is None:
        _STATE = st
    return st


def state() -> StartupState:
    """The record of the process's start-up settings (runs :func:`apply` if nothing has yet)."""
    return _STATE if _STATE is not None else apply()
