"""The shared benchmark runner: warm-up, interleaved repeated runs, medians and spread,
machine peaks measured in the same process, a printed table, JSON and PNG under bench/results/.

Usage::

    from bench.runner import measure, Report, machine_peaks
    stats = measure({"torch": lambda: a @ b, "cpu_opt": lambda: mm(a, b)}, repeats=20)
    rep = Report("dnnl")
    rep.add(case="1024^3", impl="torch", median_ms=stats["torch"].median * 1e3, ...)
    rep.print_table(["case", "impl", "median_ms", "gflops"])
    rep.save()

Timings on a shared machine are noisy: compare ratios of functions measured interleaved in one
process (``measure`` rotates the order each round), and read medians, not means.
"""
from __future__ import annotations

import datetime as _dt
import json
import platform
import sys
from pathlib import Path

# The timing itself lives in cpu_opt (calibrate and autotune use it too).
from cpu_opt.platform.timing import Stats, measure  # noqa: F401

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def machine_slug() -> str:
    """A short file-name tag for this CPU ("zen_3", "ice_lake_sp", else vendor-family-model), so
    results of different machines sit side by side instead of overwriting each other."""
    import re

    from cpu_opt import hw

    info = hw.detect()
    name = info.microarchitecture or f"{info.vendor}-{info.family}-{info.model}"
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def threads() -> int:
    import torch

    return torch.get_num_threads()


def environment() -> dict:
    import torch

    from cpu_opt import hw

    info = hw.detect()
    env = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu": info.model_name,
        "cpu_label": info.label,
        "vendor": info.vendor,
        "family": info.family,
        "model": info.model,
        "microarchitecture": info.microarchitecture,
        "isa": sorted(info.isa),
        "isa_cap": info.isa_cap,
        "machine": platform.machine(),
    }
    try:
        from cpu_opt import dnnl

        env["onednn"] = dnnl.version()
    except Exception as e:  # no binding on this machine
        env["onednn"] = f"unavailable ({type(e).__name__})"
    from cpu_opt.platform import profile

    prof = profile.load()
    env["routing_profile"] = prof.path if prof else None  # a measured profile changes routes: say which
    return env


# ----------------------------------------------------------------------------- the machine lock

BENCH_LOCK = "/tmp/cpu_opt_bench.lock"


class bench_lock:
    """Holds ``flock`` on :data:`BENCH_LOCK` (the lock every benchmark on this machine takes, so no
    two overlap) while the block runs. Benchmarks that run one process per measurement (``bench
    hf``) take it around each process, so a long run lets short ones in between processes instead
    of blocking them for an hour: do not wrap such a run in ``flock`` yourself (it would wait on
    itself). ``CPU_OPT_BENCH_NO_LOCK=1`` skips it."""

    def __enter__(self):
        import fcntl
        import os

        self._f = None
        # a worker started by a benchmark that holds the lock (``-m bench buckets --worker``) inherits
        # HELD and does not wait on its parent
        if os.environ.get("CPU_OPT_BENCH_NO_LOCK") != "1" and os.environ.get(_HELD) != "1":
            self._f = open(BENCH_LOCK, "a")
            fcntl.flock(self._f, fcntl.LOCK_EX)
            os.environ[_HELD] = "1"
        return self

    def __exit__(self, *exc):
        import os

        if self._f is not None:
            os.environ.pop(_HELD, None)
            self._f.close()  # closing the file releases the lock
        return False


_HELD = "CPU_OPT_BENCH_LOCK_HELD"


# ----------------------------------------------------------------------------- machine peaks

def gemm_peak_gflops(dtype: str = "fp32", n: int = 2048, repeats: int = 5) -> float:
    """The best GEMM rate this process reaches at ``n``³: the max over torch's own matmul and
    cpu_opt's oneDNN binding (packed weights), in GFLOP/s — the 'machine peak' the issues
    measure GEMM-bound models against."""
    import torch

    dt = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    a = torch.randn(n, n).to(dt)
    b = torch.randn(n, n).to(dt)
    fns = {"torch": lambda: torch.matmul(a, b)}
    try:
        from cpu_opt.dnnl import primitives as P

        mm = P.Matmul.for_weights(b, src_shape=a.shape, src_dtype=dt)
        fns["onednn"] = lambda: mm(a)
    except Exception:
        pass
    st = measure(fns, warmup=1, repeats=repeats)
    best = min(s.median for s in st.values())
    return 2 * n**3 / best / 1e9


def memory_bandwidth_gbs(nbytes: int = 1 << 28, repeats: int = 7) -> float:
    """Copy bandwidth (read + write bytes per second) of a large tensor copy, in GB/s."""
    import torch

    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    st = measure({"copy": lambda: dst.copy_(src)}, warmup=1, repeats=repeats)
    return 2 * nbytes / st["copy"].median / 1e9


def machine_peaks(dtypes=("fp32", "bf16"), gemm_n: int = 2048) -> dict:
    """GEMM peaks per dtype and the copy bandwidth. On a CPU without native bf16 math the bf16
    peak is measured at 256^3: emulated bf16 runs near 1 GFLOP/s, so 2048^3 takes minutes."""
    from cpu_opt import hw

    native_bf16 = hw.has_native_bf16(hw.detect())
    out = {}
    for d in dtypes:
        n = gemm_n if d != "bf16" or native_bf16 else 256
        out[f"gemm_{d}_gflops"] = round(gemm_peak_gflops(d, n), 1)
        if n != gemm_n:
            out[f"gemm_{d}_note"] = f"no native {d} on this CPU: measured at {n}^3"
    out["mem_bw_gbs"] = round(memory_bandwidth_gbs(), 1)
    return out


# ----------------------------------------------------------------------------- reporting

def calibration_batches(inputs, n: int = 8, seed: int = 1234) -> list:
    """``n`` seeded batches shaped like ``inputs`` (a dict or a tuple of tensors), for int8 calibration:
    token ids (integer tensors named ``input_ids``) drawn again below the example's largest id, float
    tensors drawn again from a normal distribution, everything else (masks) kept."""
    import torch

    g = torch.Generator().manual_seed(seed)

    def draw(key, v):
        if key == "input_ids":
            return torch.randint(0, int(v.max()) + 1, v.shape, generator=g)
        if torch.is_tensor(v) and v.is_floating_point():
            return torch.randn(v.shape, generator=g, dtype=v.dtype)
        return v.clone() if torch.is_tensor(v) else v

    if isinstance(inputs, dict):
        return [{k: draw(k, v) for k, v in inputs.items()} for _ in range(n)]
    return [tuple(draw(None, v) for v in inputs) for _ in range(n)]


class Report:
    """Rows of results plus the environment they were measured in."""

    def __init__(self, name: str, **meta):
        self.name = name
        self.rows: list[dict] = []
        self.meta = {**environment(), **meta}

    def add(self, **row) -> dict:
        self.rows.append(row)
        return row

    def print_table(self, columns: list[str] | None = None, file=None) -> str:
        file = file or sys.stdout
        cols = columns or list(dict.fromkeys(k for r in self.rows for k in r))

        def fmt(v):
            if isinstance(v, float):
                return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
            return "" if v is None else str(v)

        cells = [[fmt(r.get(c)) for c in cols] for r in self.rows]
        widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(cols)]
        lines = [f"# {self.name} — threads={self.meta['threads']}, torch {self.meta['torch']}, "
                 f"oneDNN {self.meta.get('onednn')}, CPU {self.meta.get('cpu_label', self.meta['cpu'])}"
                 + (f", routing profile {self.meta['routing_profile']}" if self.meta.get("routing_profile") else "")]
        lines.append("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
        lines.append("  ".join("-" * w for w in widths))
        lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
        text = "\n".join(lines)
        print(text, file=file, flush=True)
        return text

    def save(self, path: Path | None = None) -> Path:
        RESULTS_DIR.mkdir(parents=True, exist_ok=True)
        path = path or RESULTS_DIR / f"{self.name}.json"
        path.write_text(json.dumps({"benchmark": self.name, "meta": self.meta, "rows": self.rows}, indent=1))
        print(f"wrote {path}")
        return path


def bar_chart(path: Path, labels: list[str], series: dict[str, list[float]], *, ylabel: str,
              title: str, log: bool = False, lines: dict[str, float] | None = None) -> Path | None:
    """A grouped bar chart (PNG); ``lines``: labelled horizontal reference lines (targets).
    Returns None (with a note) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no chart (pip install matplotlib)")
        return None
    import numpy as np

    x = np.arange(len(labels))
    w = 0.8 / max(1, len(series))
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(labels) * max(1, len(series)) / 2), 4.5))
    for i, (name, vals) in enumerate(series.items()):
        ax.bar(x + (i - (len(series) - 1) / 2) * w, vals, w, label=name)
    for (name, y), style in zip((lines or {}).items(), ("--", ":", "-.")):
        ax.axhline(y, color="0.3", linestyle=style, linewidth=1, label=name)
    ax.set_xticks(x, labels, rotation=20, ha="right")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if log:
        from matplotlib.ticker import FuncFormatter

        ax.set_yscale("log")
        plain = FuncFormatter(lambda v, _: f"{v:g}")  # 2, 3, 4 rather than 2x10^0
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(plain)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")
    return path
