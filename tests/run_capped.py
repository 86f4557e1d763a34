"""Run the ISA-sensitive tests (marker ``isa``) once more under each ISA cap below this CPU's own
level, so the lower paths run for real on a machine that has higher ones: on an AVX-512 machine
the avx2 and avx512_core caps run the AVX2 and non-bf16 paths (the native kernels' avx2 variant
included), on any x86-64 the sse41 cap runs the baseline ones.

Each cap caps cpu_opt (``CPU_OPT_MAX_ISA``), both oneDNNs (``ONEDNN_MAX_CPU_ISA``, which the oneDNN
inside torch reads too), MKL (``MKL_ENABLE_INSTRUCTIONS``) and torch's own kernels
(``ATEN_CPU_CAPABILITY``), in a fresh pytest process. FBGEMM cannot be capped: it picks its kernels
from CPUID, so int8 FBGEMM runs at the machine's own level under every cap.

    python tests/run_capped.py            # every cap below this CPU's level
    CAPS="sse41 avx2" python tests/run_capped.py
    CAPS=none python tests/run_capped.py  # nothing (exit 0)
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The levels that select different code: routes, oneDNN kernels and native variants change at each.
PATH_LEVELS = ("sse41", "avx2", "avx512_core", "avx512_core_vnni")
ATEN_FOR_LEVEL = {"sse41": "default", "avx2": "avx2", "avx2_vnni": "avx2"}


def levels_below(info) -> list[str]:
    """The path levels whose capped feature set is a strict subset of this CPU's, lowest first."""
    from cpu_opt import hw

    if info.arch != "x86_64":
        return []
    out, seen = [], set()
    for level in PATH_LEVELS:
        capped = frozenset(hw.apply_isa_cap(info.arch, set(info.isa_uncapped), level))
        if capped < info.isa_uncapped and capped not in seen:
            out.append(level)
            seen.add(capped)
    return out


def env_for(level: str) -> dict:
    from cpu_opt import hw

    env = {k: v for k, v in os.environ.items()
           if k not in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")}
    env["CPU_OPT_MAX_ISA"] = level
    env["ONEDNN_MAX_CPU_ISA"] = hw.ONEDNN_ISA_FOR_CAP[level]
    if hw.MKL_ISA_FOR_CAP.get(level):
        env["MKL_ENABLE_INSTRUCTIONS"] = hw.MKL_ISA_FOR_CAP[level]
    env["ATEN_CPU_CAPABILITY"] = ATEN_FOR_LEVEL.get(level, "avx512")
    return env


def main(argv: list[str]) -> int:
    sys.path.insert(0, str(ROOT))
    from cpu_opt import hw

    info = hw.detect()
    wanted = os.environ.get("CAPS", "").split()
    if wanted == ["none"]:
        print("run_capped: CAPS=none, nothing to run")
        return 0
    levels = wanted or levels_below(info)
    if not levels:
        print(f"run_capped: {info.label} has no ISA level below its own to cap to; nothing to run")
        return 0
    failed = []
    for level in levels:
        t0 = time.perf_counter()
        print(f"\n=== ISA-sensitive tests under CPU_OPT_MAX_ISA={level} on {info.label} ===", flush=True)
        cmd = [sys.executable, "-m", "pytest", "-q", "-m", "isa", "tests", *argv]
        r = subprocess.run(cmd, cwd=ROOT, env=env_for(level))
        print(f"=== cap {level}: {'passed' if r.returncode == 0 else 'FAILED'} in {time.perf_counter() - t0:.0f} s ===",
              flush=True)
        if r.returncode != 0:
            failed.append(level)
    if failed:
        print(f"run_capped: failures under {failed}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
