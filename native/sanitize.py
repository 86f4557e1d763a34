"""Build cpu_opt._native with AddressSanitizer and UndefinedBehaviorSanitizer, and run tests
against that build: ``make test-asan`` (``python native/sanitize.py [pytest args]``).

The sanitized module is compiled into ``build/asan/`` and loaded instead of the installed one
through ``CPU_OPT_NATIVE_PATH`` (cpu_opt/native.py); libasan is preloaded into the Python
process (``LD_PRELOAD``), since the interpreter itself is not instrumented. Leak checking is off:
CPython, torch and oneDNN keep allocations alive until exit by design, and those reports would
drown any real one (native/asan.supp says the same for the one interceptor report we suppress).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
OUT = ROOT / "build" / "asan"
DEFAULT_TESTS = ["tests/test_native.py", "tests/gnn", "tests/fuzz/test_fuzz_gnn.py", "tests/dnnl/test_primitives.py",
                 "tests/dnnl/test_graph.py", "tests/fuzz/test_fuzz_dnnl.py",
                 "tests/optimize/test_native_gemv.py", "tests/optimize/test_eltwise_and_scale.py",
                 "tests/quant/test_int8_transformer_kernels.py", "tests/quant/test_amx_linear.py", "tests/optimize/test_f32_attention.py",
                 "tests/test_native_sgemm.py"]


def build() -> Path:
    sys.path.insert(0, str(HERE))
    import build_native

    OUT.mkdir(parents=True, exist_ok=True)
    ffi = build_native.make_builder(sanitize=True)
    so = ffi.compile(tmpdir=str(OUT), verbose=False)
    return Path(so)


def runtime_library(name: str) -> str:
    cc = os.environ.get("CC", "gcc")
    path = subprocess.run([cc, f"-print-file-name={name}"], capture_output=True, text=True, check=True).stdout.strip()
    if not os.path.isabs(path) or not os.path.exists(path):
        raise SystemExit(f"sanitize: {cc} has no {name} (install gcc's sanitizer runtime, e.g. Debian libasan8)")
    return os.path.realpath(path)


def main(argv: list[str]) -> int:
    so = build()
    print(f"sanitize: built {so}", flush=True)
    env = dict(os.environ)
    env["CPU_OPT_NATIVE_PATH"] = str(so)
    env["LD_PRELOAD"] = " ".join([runtime_library("libasan.so"), runtime_library("libubsan.so")])
    env["ASAN_OPTIONS"] = ":".join(["detect_leaks=0", "abort_on_error=1", "halt_on_error=1", "detect_odr_violation=0",
                                    f"suppressions={HERE / 'asan.supp'}"])
    env["UBSAN_OPTIONS"] = "print_stacktrace=1:halt_on_error=1"
    env["CPU_OPT_EXPECT_SANITIZED"] = "1"
    tests = argv or DEFAULT_TESTS
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests]
    print("sanitize: " + " ".join(cmd), flush=True)
    return subprocess.run(cmd, cwd=ROOT, env=env).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
