"""``make demo`` / ``python -m cpu_opt demo``: optimize one convolution network and one
transformer from the zoo, check them against eager PyTorch, and print the speedups."""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.utils._pytree as pytree

DEFAULT_MODELS = ("resnet50", "bert_base")


def _median_ms(fn, repeats: int) -> float:
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def _max_rel_err(out, ref) -> float:
    a = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    b = [t for t in pytree.tree_leaves(ref) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return max(((x.double() - y.double()).abs().max() / y.double().abs().max()).item() for x, y in zip(a, b))


def _why_not_faster(rep: dict, speedup: float) -> str:
    """A plain reason, from the report, for a model that is not faster than eager here."""
    val = rep.get("validation") or {}
    if val.get("fell_back"):
        return f"cpu_opt's plan disagreed with eager ({val['fell_back']}), so it runs in torch"
    at = rep.get("autotune") or {}
    if at.get("chosen") == "torch":
        return (f"autotune measured the oneDNN plan slower here ({at['onednn_ms']} ms vs {at['torch_ms']} ms for "
                "the same graph in torch) and kept torch's; what remains is cpu_opt's per-call cost on a model "
                "this small" if speedup < 1 else "and kept torch's")
    if rep["num_partitions"] == 0:
        why = next((p for p in rep["passes"] if "runs in torch" in p), "no part of it went to oneDNN")
        return f"nothing ran on oneDNN: {why}"
    return (f"{rep['num_partitions']} oneDNN partitions ran, but on this CPU their kernels are about as fast as "
            f"eager's (routes: {', '.join(f'{k} -> {v}' for k, v in rep['routes'].items())}); "
            "`python -m cpu_opt calibrate` measures the routes here")


def main(quick: bool = False, argv=None) -> int:
    import cpu_opt
    from cpu_opt import hw, routing
    from cpu_opt.models import ZOO
    from cpu_opt.platform.timing import measure

    ap = argparse.ArgumentParser(prog="python -m cpu_opt demo")
    ap.add_argument("--models", default=",".join(DEFAULT_MODELS), help=f"zoo models ({', '.join(ZOO)})")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=7 if quick else 15)
    ap.add_argument("--report", action="store_true", help="print each model's full optimize report")
    ap.add_argument("--no-autotune", action="store_true",
                    help="take the routing table's plan instead of measuring it against torch's")
    args = ap.parse_args(argv or [])
    size = "small" if quick else "full"
    info = hw.detect()
    dtype = routing.auto_dtype(info)
    print(f"cpu_opt demo — {info.label}, {torch.get_num_threads()} threads, dtype='auto' -> {dtype}"
          + ("" if args.no_autotune else "; autotune=True (the faster of the oneDNN plan and torch's)"))
    rows, notes = [], []
    for name in args.models.split(","):
        spec = ZOO[name]
        model = spec.build(size)
        inputs = spec.example_inputs(args.batch, size)
        print(f"  optimizing {name} ({size}, batch {args.batch}) ...", flush=True)
        opt = cpu_opt.optimize(model, inputs, autotune=not args.no_autotune)
        rep = opt.report()
        if args.report:
            opt.print_report()
        with torch.no_grad():
            ref = spec.call(model, inputs)
            out = spec.call(opt, inputs)
            err = _max_rel_err(out, ref)
            st = measure({"eager": lambda: spec.call(model, inputs), "cpu_opt": lambda: spec.call(opt, inputs)},
                         warmup=2, repeats=args.repeats)  # interleaved: fair on a shared machine
        eager, fast = st["eager"].median * 1e3, st["cpu_opt"].median * 1e3
        ok = err < (1e-4 if dtype == "fp32" else 5e-2)
        plan = (rep.get("autotune") or {}).get("chosen", "onednn" if rep["num_partitions"] else "torch")
        rows.append((name, size, args.batch, dtype, rep["num_partitions"], len(rep["fallbacks"]), plan, eager, fast,
                     eager / fast, err, "ok" if ok else "MISMATCH", rep["optimize_seconds"]))
        if not ok:
            notes.append(f"{name}: output differs from eager (max rel err {err:.2e})")
        if eager / fast < 1.05:
            notes.append(f"{name}: {eager / fast:.2f}x eager — {_why_not_faster(rep, eager / fast)}")
    print()
    head = ("model", "size", "batch", "dtype", "partitions", "fallbacks", "plan", "eager ms", "cpu_opt ms", "speedup",
            "max rel err", "check", "optimize s")
    fmt = "{:<12} {:<6} {:>5} {:<5} {:>10} {:>9} {:>7} {:>9} {:>10} {:>7} {:>11} {:>6} {:>10}"
    print(fmt.format(*head))
    for r in rows:
        print(fmt.format(r[0], r[1], r[2], r[3], r[4], r[5], r[6], f"{r[7]:.1f}", f"{r[8]:.1f}", f"{r[9]:.2f}x",
                         f"{r[10]:.1e}", r[11], f"{r[12]:.1f}"))
    for n in notes:
        print(f"  note: {n}")
    print(f"\ninterleaved medians of {args.repeats} runs each, {torch.get_num_threads()} threads; the full report: "
          "make demo ARGS=--report; the full benchmark: python -m bench optimize")
    return 0 if all(r[11] == "ok" for r in rows) else 1
