"""bf16 fast-math for fp32 GEMMs on Arm cores with BF16 (Neoverse V1, V2), through ACL in torch's oneDNN.

Fast-math keeps tensors in fp32 and lets oneDNN/ACL compute matmuls and convolutions with bf16
multiplies (``attr-fpmath:bf16`` in oneDNN's verbose output): about 3 significant digits per
product, fp32 accumulation, cosine similarity to fp32 of 0.999 and better on typical models.
On a core without BF16 (Neoverse N1) oneDNN ignores the request and stays strictly fp32.

There are two switches, and they cover different ops (seen with torch 2.9.1 on aarch64):

**Run-time switch** (:func:`enable_fast_math`, :func:`disable_fast_math`, :func:`fast_math`):
sets ``torch.backends.mkldnn.matmul.fp32_precision`` and ``...conv.fp32_precision`` to
``"bf16"``. torch then sends fp32 ``mm``, ``bmm``, ``matmul`` and ``linear`` *without* bias to
oneDNN with the bf16 attribute (a plain fp32 ``a @ b`` otherwise goes to OpenBLAS), and gives the
attribute to its oneDNN convolutions. It does not reach ``addmm`` — ``nn.Linear`` *with* bias in
eager mode — nor weights pre-packed by torch's ``_reorder_linear_weight``.
Takes effect immediately, can be switched off again, and is what ``optimize_for_arm`` uses
inside the modules it returns.

**Process-wide default** (``DNNL_DEFAULT_FPMATH_MODE=BF16``): every oneDNN primitive, ``addmm``
and weight packing included, gets the bf16 attribute. It must be in the environment before
``import torch`` (set after that, even before any oneDNN call, it was seen to be ignored):
export ``CPU_OPT_FAST_MATH=1`` and import cpu_opt before torch (see
:mod:`cpu_opt.graviton.startup`), or export ``DNNL_DEFAULT_FPMATH_MODE=BF16`` yourself. It
cannot be undone in that process.
:func:`process_fast_math` tells which default is in force, by measuring it (one tiny product
whose fp32 and bf16 results differ).
"""
from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass

from . import startup
from ._platform import require_arm, core_has_bf16

# torch.backends.mkldnn.<backend>.fp32_precision values (torch 2.9+): "none" is torch's default.
PRECISIONS = ("none", "ieee", "bf16")
_BACKENDS = ("matmul", "conv")


def _mkldnn():
    import torch

    return torch.backends.mkldnn


def _get_precisions() -> dict:
    mk = _mkldnn()
    return {b: getattr(mk, b).fp32_precision for b in _BACKENDS}


def _set_precisions(values: dict) -> None:
    mk = _mkldnn()
    for b, v in values.items():
        if v not in PRECISIONS + ("tf32",):
            raise ValueError(f"fp32 precision {v!r} for {b}: expected one of {PRECISIONS}")
        getattr(mk, b).fp32_precision = v
        got = getattr(mk, b).fp32_precision
        if got != v:  # torch only warns on a value it does not know
            raise RuntimeError(f"torch.backends.mkldnn.{b}.fp32_precision={v!r} did not take (reads {got!r})")


@dataclass(frozen=True)
class FastMathStatus:
    runtime: bool                 # matmul/conv fp32_precision is "bf16" now
    process_default: str | None   # "bf16", "f32", or None when not asked (see process_fast_math)
    core_has_bf16: bool
    core: str | None

    @property
    def active(self) -> bool:
        """bf16 multiplies actually happen somewhere (requested and the core can)."""
        return self.core_has_bf16 and (self.runtime or self.process_default == "bf16")

    def describe(self) -> str:
        if not self.core_has_bf16:
            return (f"{self.core or 'this core'} has no BF16 instructions: GEMMs stay fp32 "
                    f"(fast-math requested: runtime={self.runtime}, process default={self.process_default})")
        parts = []
        parts.append("run-time bf16 on (mm, bmm, matmul, linear without bias, oneDNN convolutions)"
                     if self.runtime else "run-time bf16 off")
        if self.process_default is not None:
            parts.append(f"process default fpmath {self.process_default}")
        return "; ".join(parts)


def enable_fast_math() -> FastMathStatus:
    """Switch bf16 fast-math on at run time (see the module doc for what it covers).

    Raises :class:`~cpu_opt.graviton.GravitonNotApplicable` off aarch64 / without ACL. On a core
    without BF16 this still sets torch's switch (oneDNN then stays fp32) and the returned
    status says ``active=False`` and why.
    """
    require_arm("enable_fast_math")
    _set_precisions({b: "bf16" for b in _BACKENDS})
    return status()


def disable_fast_math() -> FastMathStatus:
    """Switch the run-time fast-math off (torch's default, "none"). The process-wide default,
    if it was set before oneDNN's first use, stays: the returned status says so."""
    require_arm("disable_fast_math")
    _set_precisions({b: "none" for b in _BACKENDS})
    return status()


@contextlib.contextmanager
def fast_math(enabled: bool = True):
    """``with fast_math():`` run-time bf16 fast-math inside the block, previous setting after.

    ``fast_math(False)`` forces strict fp32 for the run-time switch inside the block. The setting
    is process-global (torch has no per-thread one): do not flip it while other threads run GEMMs.
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
    require_arm("fast_math")
    prev = _get_precisions()
    _set_precisions({b: ("bf16" if enabled else "none") for b in _BACKENDS})
    try:
        yield
    finally:
        _set_precisions(prev)


def runtime_fast_math() -> bool:
    return all(v == "bf16" for v in _get_precisions().values())


@functools.lru_cache(maxsize=1)
def process_fast_math() -> str:
    """Whether oneDNN does bf16 multiplies by default in this process: "bf16" or "f32".

    Measured, not inferred: a 4x16 by 16x16 product of 1 + 2**-10 (not a bf16 number) by ones
    through torch's packed ACL inner product, with torch's run-time switch off. fp32 gives
    16.015625 exactly; bf16 multiplies give 16. So "bf16" means DNNL_DEFAULT_FPMATH_MODE=BF16 was
    in force at oneDNN's first use *and* the core has BF16 (on N1 the answer is "f32" either way).
    This creates oneDNN's first primitive if none ran yet, which fixes the default for the rest
    of the process; the answer is cached.
    """
    require_arm("process_fast_math")
    import torch

    prev = _get_precisions()
    _set_precisions({b: "none" for b in _BACKENDS})
    try:
        with torch.no_grad():
            x = torch.full((4, 16), 1.0 + 2.0 ** -10)
            packed = torch.ops.mkldnn._reorder_linear_weight(torch.ones(16, 16), 4)
            y = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    finally:
        _set_precisions(prev)
    exact = 16.0 * (1.0 + 2.0 ** -10)
    return "f32" if bool(((y - exact).abs() < 1e-6).all()) else "bf16"


def env_requests_process_fast_math(environ=None) -> bool:
    env = os.environ if environ is None else environ
    return (env.get(startup.ONEDNN_FPMATH_VAR, "") or env.get(startup.ONEDNN_FPMATH_VAR_NEW, "")).upper() == "BF16"


def status(probe: bool = False) -> FastMathStatus:
    """Current fast-math state. ``probe=True`` also asks oneDNN for the process default
    (:func:`process_fast_math`); otherwise it is inferred from the environment, or None."""
    require_arm("fast_math status")
    info = core_has_bf16()
    if probe:
        pd = process_fast_math()
    else:
        pd = "bf16" if env_requests_process_fast_math() else None
    return FastMathStatus(runtime=runtime_fast_math(), process_default=pd, core_has_bf16=info[0], core=info[1])
