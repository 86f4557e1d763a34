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


def main(quick: bool = False, argv=None) -> int:
    import cpu_opt
    from cpu_opt import hw, routing
    from cpu_opt.models import ZOO

    ap = argparse.ArgumentParser(prog="python -m cpu_opt demo")
    ap.add_argument("--models", default=",".join(DEFAULT_MODELS), help=f"zoo models ({', '.join(ZOO)})")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5 if quick else 10)
    args = ap.parse_args(argv or [])
    size = "small" if quick else "full"
    info = hw.detect()
    dtype = routing.auto_dtype(info)
    print(f"cpu_opt demo — {info.model_name}, ISA {' '.join(sorted(info.isa))}, {torch.get_num_threads()} threads, "
          f"dtype='auto' -> {dtype}")
    rows = []
    for name in args.models.split(","):
        spec = ZOO[name]
        model = spec.build(size)
        inputs = spec.example_inputs(args.batch, size)
        opt = cpu_opt.optimize(model, inputs, verbose=True)
        rep = opt.report()
        with torch.no_grad():
            ref = spec.call(model, inputs)
            out = spec.call(opt, inputs)
            err = _max_rel_err(out, ref)
            spec.call(model, inputs)  # warm-up
            eager = _median_ms(lambda: spec.call(model, inputs), args.repeats)
            fast = _median_ms(lambda: spec.call(opt, inputs), args.repeats)
        ok = err < (1e-4 if dtype == "fp32" else 5e-2)
        rows.append((name, size, args.batch, dtype, rep["num_partitions"], len(rep["fallbacks"]), eager, fast,
                     eager / fast, err, "ok" if ok else "MISMATCH", rep["optimize_seconds"]))
        if not ok:
            print(f"{name}: output differs from eager (max rel err {err:.2e})")
    print()
    head = ("model", "size", "batch", "dtype", "partitions", "fallbacks", "eager ms", "cpu_opt ms", "speedup",
            "max rel err", "check", "optimize s")
    fmt = "{:<10} {:<6} {:>5} {:<5} {:>10} {:>9} {:>9} {:>10} {:>7} {:>11} {:>6} {:>10}"
    print(fmt.format(*head))
    for r in rows:
        print(fmt.format(r[0], r[1], r[2], r[3], r[4], r[5], f"{r[6]:.1f}", f"{r[7]:.1f}", f"{r[8]:.2f}x",
                         f"{r[9]:.1e}", r[10], f"{r[11]:.1f}"))
    print(f"\nmedians of {args.repeats} runs each, {torch.get_num_threads()} threads; "
          "full benchmark: python -m bench optimize")
    return 0 if all(r[10] == "ok" for r in rows) else 1
