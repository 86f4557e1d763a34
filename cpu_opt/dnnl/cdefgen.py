"""Generate the cffi cdef of the oneDNN C API from the installed headers.

Used at build time by ``setup.py`` (which loads this file by path, without importing
``cpu_opt``), so the binding follows whatever oneDNN version the headers describe. The recipe
is the one recorded in shared/KNOWN.md: preprocess ``dnnl.h`` and ``dnnl_graph.h`` with gcc
against empty stub system headers, drop what cffi cannot parse, and append the integer macros
(``DNNL_ARG_*`` and friends) as ``#define NAME <int>`` lines cffi understands.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

HEADERS = ("oneapi/dnnl/dnnl.h", "oneapi/dnnl/dnnl_graph.h")

# Types the stub headers must provide; cffi knows them natively.
_STUB_TYPES = {
    "stddef.h": "",
    "stdint.h": "",
    "limits.h": "",
    "stdbool.h": "",
    "stdlib.h": "",
}

_INT_MACRO = re.compile(r"^#define\s+((?:DNNL|ONEDNN)_[A-Z0-9_]+)\s+(.+?)\s*$")


def find_include_dir() -> Path | None:
    """Locate ``include/`` holding ``oneapi/dnnl/dnnl.h``.

    Order: ``CPU_OPT_DNNL_INCLUDE``; the files of the installed ``onednn-devel-cpu-gomp``
    distribution (works inside pip's isolated build environment); ``sys.prefix/include``.
    """
    env = os.environ.get("CPU_OPT_DNNL_INCLUDE")
    if env:
        return Path(env)
    try:
        from importlib import metadata

        for dist_name in ("onednn-devel-cpu-gomp", "onednn-devel"):
            try:
                dist = metadata.distribution(dist_name)
            except metadata.PackageNotFoundError:
                continue
            for f in dist.files or ():
                if str(f).replace("\\", "/").endswith("include/oneapi/dnnl/dnnl.h"):
                    header = Path(dist.locate_file(f)).resolve()
                    return header.parent.parent.parent
    except Exception:  # pragma: no cover - metadata quirks
        pass
    import sys

    for prefix in (sys.prefix, sys.base_prefix):
        cand = Path(prefix) / "include"
        if (cand / HEADERS[0]).exists():
            return cand
    return None


def _run_gcc(args: list[str], src: str) -> str:
    cc = os.environ.get("CC", "gcc").split()[0]
    if shutil.which(cc) is None:
        raise RuntimeError(f"generating the oneDNN cdef needs a C preprocessor; '{cc}' was not found")
    res = subprocess.run([cc, *args, "-"], input=src, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"gcc failed while preprocessing the oneDNN headers:\n{res.stderr[-2000:]}")
    return res.stdout


def _resolve_int(name: str, raw: dict, seen: set) -> int | None:
    """Integer value of macro ``name``, following references to other macros (``DNNL_ARG_SRC``
    is ``DNNL_ARG_SRC_0``); None for anything that is not an integer expression."""
    if name in seen:
        return None
    seen.add(name)
    expr = raw[name]

    def sub(m):
        v = _resolve_int(m.group(0), raw, seen) if m.group(0) in raw else None
        if v is None:
            raise ValueError(m.group(0))
        return str(v)

    try:
        expr = re.sub(r"\b(?:DNNL|ONEDNN)_[A-Z0-9_]+\b", sub, expr)
        expr = re.sub(r"(?<=\d)[uUlL]+\b", "", expr)
        if not re.fullmatch(r"[0-9a-fA-FxX()+\-*/<>| ~&]+", expr):
            return None
        return int(eval(expr, {"__builtins__": {}}, {}))  # noqa: S307 - checked: integer arithmetic only
    except Exception:
        return None


def generate(include_dir: Path) -> tuple[str, str]:
    """Return ``(cdef_text, version_string)`` for the headers under ``include_dir``."""
    include_dir = Path(include_dir)
    for h in HEADERS:
        if not (include_dir / h).exists():
            raise FileNotFoundError(f"oneDNN header {include_dir / h} not found")
    src = "".join(f'#include "{h}"\n' for h in HEADERS)
    with tempfile.TemporaryDirectory() as stub:
        for name, text in _STUB_TYPES.items():
            Path(stub, name).write_text(text)
        common = ["-nostdinc", "-I", stub, "-I", str(include_dir), "-x", "c"]
        body = _run_gcc(["-E", "-P", *common, "-D__attribute__(x)=", "-D__declspec(x)="], src)
        macros = _run_gcc(["-E", "-dM", *common], src)

    # cffi cannot parse these initialised static objects.
    body = re.sub(r"static\s+const\s+(?:union|struct)?\s*(?:\{[^{}]*\})?\s*\w+\s*=\s*\{[^{}]*\}\s*;", "", body)
    body = re.sub(r"static\s+const\s+[^;{}]*;", "", body)
    raw = {}
    for line in macros.splitlines():
        m = _INT_MACRO.match(line)
        if m:
            raw[m.group(1)] = m.group(2)
    values = {name: v for name in raw if (v := _resolve_int(name, raw, set())) is not None}
    lines = [body] + [f"#define {name} {ival}" for name, ival in sorted(values.items())]
    version = {k: values.get(k, 0) for k in ("DNNL_VERSION_MAJOR", "DNNL_VERSION_MINOR", "DNNL_VERSION_PATCH")}
    ver = "{}.{}.{}".format(
        version.get("DNNL_VERSION_MAJOR", 0),
        version.get("DNNL_VERSION_MINOR", 0),
        version.get("DNNL_VERSION_PATCH", 0),
    )
    return "\n".join(lines) + "\n", ver


def write_module(path: Path, include_dir: Path) -> str:
    """Write a Python module holding ``CDEF`` and ``HEADER_VERSION``; return the version."""
    cdef, ver = generate(include_dir)
    Path(path).write_text(
        '"""Generated by cpu_opt/dnnl/cdefgen.py at build time from the oneDNN headers. Do not edit."""\n'
        f"HEADER_VERSION = {ver!r}\n"
        f"CDEF = {cdef!r}\n"
    )
    return ver
