"""python -m bench optimize: end-to-end latency of the model zoo (cpu_opt.models.ZOO) under
eager PyTorch, torch.compile (inductor, freezing) and cpu_opt.optimize, in fp32 and bf16.

For each model and batch, all implementations are built first (their build / first-call times
recorded), then timed interleaved with bench.runner.measure(), so their ratios are fair on a
shared machine. Implementations:

  eager_fp32     model(*inputs)
  eager_bf16     the same under torch.autocast("cpu", torch.bfloat16)
  compile_fp32   torch.compile(model, dynamic=False) with torch._inductor.config.freezing = True
  compile_bf16   the same, called under bf16 autocast
  cpu_opt_fp32   cpu_opt.optimize(model, example_inputs, dtype="fp32")
  cpu_opt_bf16   cpu_opt.optimize(model, example_inputs, dtype="bf16")
  openvino_fp32  OpenVINO (convert_model from torch, INFERENCE_PRECISION_HINT f32, LATENCY),
  openvino_bf16  the same with bf16 precision: the export-then-run runtime users pick instead
                 (optional: pip install 'cpu_opt[compare]'; a missing package is an error row)

An implementation that fails to build or to run (cpu_opt.optimize missing, an unsupported op, a
compile error) gets its error string in the row instead of a time; the others still run.
Rows carry: median and spread, speedup against eager fp32 and against torch.compile at the same
dtype, achieved GFLOP/s and its fraction of the GEMM peak measured in this run (for GEMM-bound
models; bf16 against the larger of the bf16 and fp32 peaks, see peak_gflops), compile time (torch.compile's first call) or optimize time (optimize() + first call),
and agreement with eager fp32 (cosine similarity of the main output). The summary gives
geometric means of the speedups per implementation.

Options: --models, --batches, --impls, --repeats, --max-seconds, --threads, --quick (small
models, batch 1 and 4, few repeats; writes optimize_quick.* so the full results stay).
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import math
import statistics
import time
import traceback
from dataclasses import dataclass
from typing import Callable

import torch

from bench.runner import RESULTS_DIR, Report, bar_chart, gemm_peak_gflops, machine_peaks, measure
from cpu_opt.models import ZOO, ModelSpec

IMPLS = ("eager_fp32", "eager_bf16", "compile_fp32", "compile_bf16", "cpu_opt_fp32", "cpu_opt_bf16",
         "openvino_fp32", "openvino_bf16", "cpu_opt_int8")


def _dtype(impl: str) -> str:
    return impl.rsplit("_", 1)[1]


def _family(impl: str) -> str:
    return impl.rsplit("_", 1)[0]


def _autocast(dtype: str):
    if dtype == "bf16":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _main_output(out) -> torch.Tensor:
    """The first tensor of a model output (tensor, ModelOutput, tuple/list or dict)."""
    if torch.is_tensor(out):
        return out
    if hasattr(out, "to_tuple"):
        return _main_output(out.to_tuple()[0])
    if isinstance(out, dict):
        return _main_output(next(iter(out.values())))
    if isinstance(out, (tuple, list)):
        return _main_output(out[0])
    raise TypeError(f"cannot find a tensor in a {type(out).__name__}")


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().flatten(), b.detach().double().flatten()
    return float(torch.nn.functional.cosine_similarity(a, b, dim=0))


def _error(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0][:160] if msg else ''}"


# ----------------------------------------------------------------------------- the adapters

def cpu_opt_optimize(model: torch.nn.Module, example_inputs, dtype: str) -> Callable:
    """Call cpu_opt.optimize the way users do (int8: calibrated on 8 seeded batches shaped like the
    example, ``runner.calibration_batches``). Raises when it does not exist yet."""
    import cpu_opt
    from bench.runner import calibration_batches

    optimize = getattr(cpu_opt, "optimize", None)
    if optimize is None:
        raise NotImplementedError("cpu_opt.optimize does not exist (yet)")
    if dtype == "int8":
        return optimize(model, example_inputs, dtype="int8", calibration_data=calibration_batches(example_inputs))
    return optimize(model, example_inputs, dtype=dtype)


def openvino_compile(model: torch.nn.Module, example_inputs, dtype: str) -> Callable:
    """The runtime users pick instead: OpenVINO, converted straight from torch (optional
    dependency: pip install 'cpu_opt[compare]'). Returns a callable taking the zoo's inputs."""
    import openvino as ov
    import torch.utils._pytree as pytree

    names = list(example_inputs) if isinstance(example_inputs, dict) else None

    class _Positional(torch.nn.Module):
        """OpenVINO traces positional inputs and tuple outputs: adapt dict inputs and
        dataclass outputs (as users must when exporting Hugging Face models)."""

        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, *args):
            out = self.m(**dict(zip(names, args))) if names else self.m(*args)
            return tuple(t for t in pytree.tree_leaves(out.to_tuple() if hasattr(out, "to_tuple") else out)
                         if torch.is_tensor(t))

    args = tuple(example_inputs[k] for k in names) if names else tuple(example_inputs)
    with torch.no_grad():
        try:
            ovm = ov.convert_model(_Positional(model).eval(), example_input=args)
        except Exception:  # noqa: BLE001 - its TorchScript tracing refuses some models (HF GPT-2 in
            # transformers 5: "Conversion is failed for: prim::Constant"); OpenVINO also takes torch.export's
            ovm = ov.convert_model(torch.export.export(_Positional(model).eval(), args, strict=False))
    cfg = {"INFERENCE_PRECISION_HINT": "f32" if dtype == "fp32" else "bf16", "PERFORMANCE_HINT": "LATENCY",
           "INFERENCE_NUM_THREADS": torch.get_num_threads()}
    compiled = ov.Core().compile_model(ovm, "CPU", cfg)

    def run(*args, **kwargs):
        feed = [kwargs[k].numpy() for k in names] if kwargs else [a.numpy() for a in args]
        res = compiled(feed)
        return torch.from_numpy(res[compiled.outputs[0]].copy())

    return run


@dataclass
class Prepared:
    fn: Callable[[], object] | None   # one forward call, ready to time
    build_s: float | None = None      # torch.compile() / cpu_opt.optimize() itself
    first_call_s: float | None = None
    output: object = None
    error: str | None = None

    @property
    def compile_s(self) -> float | None:
        if self.build_s is None or self.first_call_s is None:
            return None
        return self.build_s + self.first_call_s


def prepare(impl: str, spec: ModelSpec, model: torch.nn.Module, inputs) -> Prepared:
    """Build one implementation and make its first call (which is where torch.compile compiles)."""
    dtype, family = _dtype(impl), _family(impl)
    try:
        t0 = time.perf_counter()
        if family == "eager":
            target = model
        elif family == "compile":
            torch._inductor.config.freezing = True
            target = torch.compile(model, backend="inductor", dynamic=False)
        elif family == "cpu_opt":
            target = cpu_opt_optimize(model, inputs, dtype)
        elif family == "openvino":
            target = openvino_compile(model, inputs, dtype)
        else:
            raise ValueError(f"unknown implementation {impl!r}")
        build_s = time.perf_counter() - t0
        autocast = family in ("eager", "compile") and dtype == "bf16"

        def fn():
            if autocast:
                with _autocast("bf16"):
                    return spec.call(target, inputs)
            return spec.call(target, inputs)

        t0 = time.perf_counter()
        out = fn()
        first = time.perf_counter() - t0
        return Prepared(fn, build_s if family != "eager" else None, first if family != "eager" else None, out)
    except Exception as e:  # noqa: BLE001 - recorded in the row, the bench goes on
        if "--traceback" in _FLAGS:
            traceback.print_exc()
        return Prepared(None, error=_error(e))


_FLAGS: set[str] = set()


# ----------------------------------------------------------------------------- the run

def measure_peaks(quick: bool) -> dict:
    """runner.machine_peaks, except that on a CPU without native bf16 math the bf16 GEMM peak is
    measured at 256^3: emulated bf16 runs at about 1 GFLOP/s on Zen 3, so 2048^3 takes minutes
    per call."""
    from cpu_opt import hw

    n = 1024 if quick else 2048
    native = hw.has_native_bf16(hw.detect())
    peaks = machine_peaks(dtypes=("fp32", "bf16") if native else ("fp32",), gemm_n=n)
    if not native:
        peaks["gemm_bf16_gflops"] = round(gemm_peak_gflops("bf16", n=256, repeats=3), 1)
        peaks["bf16_note"] = "no native bf16 on this CPU; bf16 peak measured at 256^3"
    return peaks


def peak_gflops(peaks: dict, dtype: str) -> float | None:
    """The GEMM peak a model at ``dtype`` is measured against. For bf16 it is the larger of the
    bf16 and fp32 peaks: on a CPU without native bf16 math (AVX2 only, like Zen 3) bf16 GEMMs are
    emulated and their measured rate (about 1 GFLOP/s here) is no ceiling at all."""
    vals = [peaks.get(f"gemm_{dtype}_gflops")]
    if dtype == "bf16":
        vals.append(peaks.get("gemm_fp32_gflops"))
    vals = [v for v in vals if v]
    return max(vals) if vals else None


def geomean(xs) -> float | None:
    xs = [x for x in xs if x is not None and x > 0 and math.isfinite(x)]
    return math.exp(statistics.fmean(math.log(x) for x in xs)) if xs else None


def run_case(rep: Report, spec: ModelSpec, model, size: str, batch: int, impls, peaks: dict, *,
             repeats: int, max_seconds: float) -> list[dict]:
    inputs = spec.example_inputs(batch, size)
    prepared: dict[str, Prepared] = {}
    torch._dynamo.reset()  # compile afresh per case: no shapes shared between batches
    for impl in impls:
        prepared[impl] = p = prepare(impl, spec, model, inputs)
        state = p.error or (f"first call {p.first_call_s:.2f} s" if p.first_call_s is not None else "ok")
        print(f"  {spec.name} b{batch} {impl}: {state}", flush=True)

    ok = {k: p.fn for k, p in prepared.items() if p.error is None}
    stats = measure(ok, warmup=1, repeats=repeats, max_seconds=max_seconds) if ok else {}

    reference = prepared.get("eager_fp32")
    if reference is None or reference.error is not None:
        with torch.no_grad():
            ref_out = spec.call(model, inputs)
    else:
        ref_out = reference.output
    ref_main = _main_output(ref_out)
    flops = spec.gemm_flops(batch, size)

    def median(impl):
        return stats[impl].median if impl in stats else None

    rows = []
    for impl, p in prepared.items():
        dtype = _dtype(impl)
        row = dict(model=spec.name, batch=batch, impl=impl, dtype=dtype)
        if p.error is not None:
            row.update(median_ms=None, error=p.error)
            rows.append(rep.add(**row))
            continue
        st = stats[impl]
        m = st.median
        gflops = flops / m / 1e9
        eager = median("eager_fp32")
        comp = median(f"compile_{dtype}")
        peak = peak_gflops(peaks, dtype)
        try:
            cos = _cosine(_main_output(p.output), ref_main)
        except Exception as e:  # noqa: BLE001
            cos = None
            row["error"] = f"output check: {_error(e)}"
        row.update(
            median_ms=m * 1e3,
            spread=st.spread,
            runs=st.runs,
            vs_eager_fp32=eager / m if eager else None,
            vs_compile=comp / m if comp else None,
            gflops=gflops,
            frac_gemm_peak=(gflops / peak) if (peak and spec.gemm_bound) else None,
            compile_s=p.compile_s,
            cos_vs_eager_fp32=cos,
        )
        rows.append(rep.add(**row))
    return rows


def main(quick: bool = False, argv=None) -> Report:
    ap = argparse.ArgumentParser(prog="python -m bench optimize", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(ZOO), help="comma-separated zoo names")
    ap.add_argument("--batches", default=None, help="comma-separated batch sizes (default 1,16; quick 1,4)")
    ap.add_argument("--impls", default=",".join(IMPLS), help=f"comma-separated, from {','.join(IMPLS)}")
    ap.add_argument("--quick", action="store_true", help="small models, few repeats")
    ap.add_argument("--repeats", type=int, default=None, help="timed rounds per case (default 10; quick 3)")
    ap.add_argument("--max-seconds", type=float, default=None,
                    help="stop adding rounds to a case after this long (default 120; quick 10)")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--name", default=None, help="results name (default optimize, quick optimize_quick)")
    ap.add_argument("--traceback", action="store_true", help="print tracebacks of failing implementations")
    args = ap.parse_args(argv or [])
    quick = quick or args.quick
    if args.traceback:
        _FLAGS.add("--traceback")

    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in ZOO]
    if unknown:
        ap.error(f"unknown model(s) {unknown}; the zoo has {list(ZOO)}")
    impls = [i.strip() for i in args.impls.split(",") if i.strip()]
    bad = [i for i in impls if i not in IMPLS]
    if bad:
        ap.error(f"unknown implementation(s) {bad}; choose from {list(IMPLS)}")
    batches = [int(b) for b in (args.batches or ("1,4" if quick else "1,16")).split(",")]
    repeats = args.repeats or (3 if quick else 10)
    max_seconds = args.max_seconds or (10.0 if quick else 120.0)
    size = "small" if quick else "full"
    name = args.name or ("optimize_quick" if quick else "optimize")
    if args.threads:
        torch.set_num_threads(args.threads)

    torch._inductor.config.freezing = True
    peaks = measure_peaks(quick)
    rep = Report(name, size=size, batches=batches, impls=impls, models=models, repeats=repeats,
                 peaks=peaks, freezing=True)
    print(f"# peaks this run: {peaks}; threads={torch.get_num_threads()}; size={size}", flush=True)

    with torch.no_grad():
        for mname in models:
            spec = ZOO[mname]
            t0 = time.perf_counter()
            model = spec.build(size)
            print(f"{mname}: built in {time.perf_counter() - t0:.1f} s "
                  f"({sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters)", flush=True)
            for batch in batches:
                run_case(rep, spec, model, size, batch, impls, peaks, repeats=repeats, max_seconds=max_seconds)
            del model
            torch._dynamo.reset()
            gc.collect()

    cols = ["model", "batch", "impl", "median_ms", "spread", "vs_eager_fp32", "vs_compile", "gflops",
            "frac_gemm_peak", "compile_s", "cos_vs_eager_fp32", "error"]
    rep.print_table(cols)

    summary = {}
    for impl in impls:
        rows = [r for r in rep.rows if r["impl"] == impl]
        summary[impl] = dict(
            geomean_vs_eager_fp32=geomean(r.get("vs_eager_fp32") for r in rows),
            geomean_vs_compile=geomean(r.get("vs_compile") for r in rows),
            cases=len(rows),
            failed=sum(1 for r in rows if r.get("median_ms") is None),
        )
    rep.meta["summary"] = summary
    print("\n# geomean speedups over all model/batch cases")
    print(f"{'impl':14s} {'vs eager fp32':>14s} {'vs compile':>11s} {'failed':>7s}")
    for impl, s in summary.items():
        def f(v):
            return f"{v:.2f}x" if v is not None else "-"
        print(f"{impl:14s} {f(s['geomean_vs_eager_fp32']):>14s} {f(s['geomean_vs_compile']):>11s} "
              f"{s['failed']:>3d}/{s['cases']}")

    rep.save()
    labels = [f"{m} b{b}" for m in models for b in batches]
    series = {}
    for impl in impls:
        vals = []
        for m in models:
            for b in batches:
                r = next((r for r in rep.rows if r["model"] == m and r["batch"] == b and r["impl"] == impl), None)
                vals.append((r or {}).get("vs_eager_fp32") or 0.0)
        series[impl] = vals
    speedup_chart(RESULTS_DIR / f"{name}.png", labels, series,
                  title=f"{name}: speedup vs eager fp32, threads={rep.meta['threads']} ({size} models)")
    return rep


def speedup_chart(path, labels: list[str], series: dict[str, list[float]], *, title: str):
    """Grouped bars on a log axis (speedups here span 0.05x-50x), one group per model/batch, a
    line at 1x; failed implementations have no bar. runner.bar_chart's figure grows with
    groups x series and gets unreadable at 14 x 6, so this one has a bounded width."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return bar_chart(path, labels, series, ylabel="speedup vs eager fp32 (x)", title=title, log=True)
    import numpy as np

    x = np.arange(len(labels))
    w = 0.8 / max(1, len(series))
    fig, ax = plt.subplots(figsize=(min(18, max(7, 0.9 * len(labels) + 2)), 4.8))
    for i, (impl, vals) in enumerate(series.items()):
        v = np.array([val if val and val > 0 else np.nan for val in vals])
        ax.bar(x + (i - (len(series) - 1) / 2) * w, v, w, label=impl)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_yscale("log")
    ax.set_xticks(x, labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("speedup vs eager fp32 (x, log)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, ncol=3)
    ax.grid(axis="y", alpha=0.3, which="both")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    import sys

    main(argv=sys.argv[1:])
