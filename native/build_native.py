"""cffi build script for cpu_opt._native (API mode; run by setup.py at install time).

Expands ``api.h`` (prototypes written with ``KFN(name)``) into one cdef line per ISA variant
and compiles ``variants.c``, which includes each kernel file once per variant.
"""
from __future__ import annotations

import platform
import re
from pathlib import Path

from cffi import FFI

HERE = Path(__file__).resolve().parent


def variants_for_machine(machine: str | None = None) -> list[str]:
    machine = machine or platform.machine()
    return ["base", "avx2", "avx512"] if machine in ("x86_64", "AMD64") else ["base"]


def expand_api(text: str, variant: str) -> str:
    """Turn ``KFN(name)`` into ``name_<variant>`` and drop preprocessor lines."""
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    out = []
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("#"):
            m = re.match(r"#define\s+(CO_[A-Z_]+)\s+(-?\d+)$", s)
            if m and variant == "base":
                out.append(f"#define {m.group(1)} {m.group(2)}")
            continue
        out.append(re.sub(r"KFN\((\w+)\)", rf"\1_{variant}", line))
    return "\n".join(out)


# `make test-asan` builds a second copy with these (CPU_OPT_SANITIZE=1, see native/sanitize.py)
SANITIZE_FLAGS = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-fno-sanitize-recover=undefined",
                  "-g"]


def make_builder(sanitize: bool = False) -> FFI:
    api = (HERE / "api.h").read_text()
    cdef = "\n".join(expand_api(api, v) for v in variants_for_machine())
    cdef += ("\nconst char *co_native_variants(void);\nint co_advise_hugepages(void *p, int64_t nbytes);\n"
             "int64_t co_fingerprint(const void *data, int64_t nbytes, int64_t nthreads, uint64_t *out);\n"
             "void co_free(void *p);\n")
    ffibuilder = FFI()
    ffibuilder.cdef(cdef)
    ffibuilder.set_source(
        "cpu_opt._native",
        '#include "variants.c"\n',
        include_dirs=[str(HERE)],
        extra_compile_args=["-O3" if not sanitize else "-O1", "-fopenmp", "-std=gnu11", "-fno-strict-aliasing",
                            "-Wno-unused-function", "-Wno-unknown-pragmas"] + (SANITIZE_FLAGS if sanitize else []),
        extra_link_args=["-fopenmp"] + (SANITIZE_FLAGS if sanitize else []),
    )
    return ffibuilder


ffibuilder = make_builder()

if __name__ == "__main__":  # build in place, for development
    ffibuilder.compile(tmpdir=str(HERE.parent / "build" / "native"), verbose=True)
