"""Is the aarch64 path usable here? (aarch64, torch with oneDNN built with ACL)."""
from __future__ import annotations

import functools
import platform
from dataclasses import dataclass

from cpu_opt.errors import UnsupportedError


class GravitonNotApplicable(UnsupportedError):
    """The aarch64 path was asked for on a machine where it does not apply (not aarch64, or
    torch's oneDNN has no Arm Compute Library)."""


@dataclass(frozen=True)
class Applicability:
    applicable: bool
    reason: str
    machine: str
    acl: bool | None = None        # torch.ops.mkldnn._is_mkldnn_acl_supported(); None if not asked


def applicability(machine: str | None = None) -> Applicability:
    """Whether cpu_opt.graviton applies on this machine, and why not if it does not.

    Off aarch64 this answers without importing torch.
    """
    m = machine or platform.machine()
    if m not in ("aarch64", "arm64"):
        return Applicability(False, f"this machine is {m}, not aarch64: the Graviton path does not apply", m)
    return _applicability_arm(m)


@functools.lru_cache(maxsize=None)
def _applicability_arm(m: str) -> Applicability:
    try:
        import torch
    except ImportError as e:  # pragma: no cover - cpu_opt requires torch
        return Applicability(False, f"torch is not importable: {e}", m)
    if not torch.backends.mkldnn.is_available():
        return Applicability(False, "torch was built without oneDNN (mkldnn)", m, False)
    try:
        acl = bool(torch.ops.mkldnn._is_mkldnn_acl_supported())
    except (AttributeError, RuntimeError):
        acl = False
    if not acl:
        return Applicability(False, "torch's oneDNN has no Arm Compute Library (ACL)", m, False)
    return Applicability(True, f"aarch64, torch {torch.__version__} with oneDNN + ACL", m, True)


def require_arm(what: str) -> None:
    a = applicability()
    if not a.applicable:
        raise GravitonNotApplicable(f"cpu_opt.graviton.{what}: {a.reason}")


def core_has_bf16() -> tuple[bool, str | None]:
    """(BF16 usable after CPU_OPT_MAX_ISA, core name) from cpu_opt.hw."""
    from cpu_opt import hw

    info = hw.detect()
    return info.has("bf16"), info.arm_core
