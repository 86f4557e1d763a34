"""Reading oneDNN's verbose output: which kernel ran each primitive, with which attributes.

oneDNN prints one CSV line per primitive creation (verbose level 2) and execution (level 1):

    onednn_verbose,v1,primitive,exec,cpu,inner_product,acl,forward_inference,src:f32::blocked:ab::f0 ...,attr-scratchpad:user attr-fpmath:bf16,,mb8ic64oc32,22.87
    onednn_verbose,v1,primitive,create:cache_hit,cpu,reorder,jit:uni,undef,src:f32::blocked:ab::f0 ...,attr-scratchpad:user,,8x64,0.07

:func:`parse_line` / :func:`parse` turn those lines into :class:`VerboseRecord` (pure Python, no
torch). :func:`capture` runs a function with torch's oneDNN verbose switched on at run time
(``torch.backends.mkldnn.verbose``) and reads what oneDNN printed to file descriptor 1, so
no subprocess is needed; ``ONEDNN_VERBOSE=1`` in a child process's environment gives the same
lines on its stdout.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import tempfile
from dataclasses import dataclass

# Levels of torch.backends.mkldnn.verbose (oneDNN's ONEDNN_VERBOSE values).
LEVELS = {"off": 0, "exec": 1, "create": 2}

# Primitive kinds that do GEMM work (what fast-math changes).
GEMM_KINDS = frozenset({"matmul", "inner_product", "convolution", "deconvolution"})


@dataclass(frozen=True)
class VerboseRecord:
    action: str          # "exec", "create:cache_miss", "create:cache_hit", ...
    engine: str          # "cpu"
    kind: str            # "matmul", "inner_product", "convolution", "reorder", ...
    impl: str            # "gemm:acl", "acl", "indirect_gemm:acl", "jit:uni", "ref:any", ...
    prop_kind: str
    memory: str          # memory descriptors, space separated
    attrs: tuple         # ("attr-scratchpad:user", "attr-fpmath:bf16", ...)
    problem: str
    time_ms: float | None
    line: str

    @property
    def is_exec(self) -> bool:
        return self.action == "exec"

    @property
    def is_create(self) -> bool:
        return self.action.startswith("create")

    @property
    def cache_miss(self) -> bool:
        return self.action == "create:cache_miss"

    @property
    def cache_hit(self) -> bool:
        return self.action == "create:cache_hit"

    @property
    def uses_acl(self) -> bool:
        """Run by an Arm Compute Library kernel (impl names ``acl``, ``gemm:acl``, ``indirect_gemm:acl``...)."""
        return "acl" in self.impl.split(":") or self.impl.endswith(":acl") or self.impl == "acl"

    @property
    def fpmath(self) -> str | None:
        """The fpmath mode attribute (``bf16``), or None when the primitive has none (strict fp32)."""
        for a in self.attrs:
            if a.startswith("attr-fpmath:"):
                return a.split(":")[1]
        return None

    @property
    def is_gemm(self) -> bool:
        return self.kind in GEMM_KINDS

    @property
    def weights_dtype(self) -> str | None:
        for md in self.memory.split():
            if md.startswith("wei:"):
                return md.split(":")[1]
        return None


def parse_line(line: str) -> VerboseRecord | None:
    """One verbose line -> record; None for anything that is not a primitive create/exec line."""
    line = line.strip()
    if not (line.startswith("onednn_verbose,") or line.startswith("dnnl_verbose,")):
        return None
    parts = line.split(",")
    try:
        i = parts.index("primitive")
    except ValueError:
        return None
    rest = parts[i + 1:]
    if len(rest) < 9 or rest[0] == "info" or rest[0].startswith("info"):
        return None
    action, engine, kind, impl, prop, memory, attrs, _aux, problem = rest[:9]
    try:
        t = float(rest[9]) if len(rest) > 9 else None
    except ValueError:
        t = None
    return VerboseRecord(action=action, engine=engine, kind=kind, impl=impl, prop_kind=prop, memory=memory,
                         attrs=tuple(attrs.split()), problem=problem, time_ms=t, line=line)


def parse(text: str) -> list[VerboseRecord]:
    """All primitive create/exec records in ``text``, in order."""
    out = []
    for ln in text.splitlines():
        r = parse_line(ln)
        if r is not None:
            out.append(r)
    return out


def gemm_execs(records) -> list[VerboseRecord]:
    """Executions of GEMM-like primitives (matmul, inner product, (de)convolution)."""
    return [r for r in records if r.is_exec and r.is_gemm]


def not_acl_bf16(records) -> list[VerboseRecord]:
    """GEMM executions that did NOT run on ACL with ``attr-fpmath:bf16`` (empty = all fast-math)."""
    return [r for r in gemm_execs(records) if not (r.uses_acl and r.fpmath == "bf16")]


def _libc_fflush():
    try:
        ctypes.CDLL(None).fflush(None)
    except Exception:  # pragma: no cover - no libc symbol table
        pass


@contextlib.contextmanager
def _stdout_fd_to_file():
    """Point file descriptor 1 at a temporary file for the duration; yields a reader."""
    sys.stdout.flush()
    _libc_fflush()
    saved = os.dup(1)
    tmp = tempfile.TemporaryFile(mode="w+b")
    box = {}
    try:
        os.dup2(tmp.fileno(), 1)
        yield box
    finally:
        _libc_fflush()
        try:
            sys.stdout.flush()
        except Exception:
            pass
        os.dup2(saved, 1)
        os.close(saved)
        tmp.seek(0)
        box["text"] = tmp.read().decode("utf-8", "replace")
        tmp.close()


def capture(fn, *args, level: str = "exec", **kwargs):
    """Run ``fn(*args, **kwargs)`` with oneDNN verbose at ``level`` ("exec" or "create").

    Returns ``(result, records, text)``: the function's result, the parsed primitive records, and
    everything written to file descriptor 1 meanwhile. Level "create" also reports primitive
    creation with its cache outcome (``create:cache_hit`` / ``create:cache_miss``).
    """
    if level not in ("exec", "create"):
        raise ValueError(f"level={level!r}: expected 'exec' or 'create'")
    import torch

    mk = torch.backends.mkldnn
    with _stdout_fd_to_file() as box:
        with mk.verbose(LEVELS[level]):
            result = fn(*args, **kwargs)
    text = box["text"]
    return result, parse(text), text
