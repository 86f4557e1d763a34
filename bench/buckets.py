"""python -m bench buckets: a served sequence of calls at random lengths on a Hugging Face BERT
(hidden 256, 4 layers, 4 heads, random weights), with and without padding to buckets.

``cpu_opt.optimize(model, example, dynamic=True)`` builds a plan for each new length (its oneDNN
partitions compiled on the first call of that length); with ``buckets=`` the inputs are padded to
the smallest bucket at least that long, so only one plan per bucket is built, at the price of
computing the padded positions. The served sequence: 50 calls, batch 1, lengths drawn uniformly from
8..128 (seeded), ``input_ids`` and an all-ones ``attention_mask``. Measured per implementation:

  served_s     the 50 calls, first time through: plan building and partition compilation included
  warm_s       the same 50 calls again (every plan built; LRU evictions rebuild, as in serving)
  plans        plans compiled over both passes (``report()["plans_compiled"]``, the example's included)
  padded_tokens  tokens computed with padding / true tokens (bucket implementations)
  optimize_s   ``optimize`` itself (capture + the example's plan)

Implementations: ``eager`` (the model as it is), ``per_shape`` (``dynamic=True``, the default
LRU of 32 plans: more distinct lengths than that evict and rebuild), ``per_shape_unbounded``
(``max_shapes=0``: every length keeps its plan; its warm pass is the unpadded speed), ``buckets``
(sizes 16, 32, 64, 128), ``buckets_fine`` (16, 24, 32, 48, 64, 96, 128). Each runs in a process
of its own (cpu_opt's partition cache would otherwise carry one's compilations into the next),
``--rounds`` times, alternating; the row is the median over rounds. Outputs are checked against
eager (max abs difference of ``last_hidden_state``). 2 threads (``--threads``).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

IMPLS = ("eager", "per_shape", "per_shape_unbounded", "buckets", "buckets_fine")
BUCKETS = {"buckets": (16, 32, 64, 128), "buckets_fine": (16, 24, 32, 48, 64, 96, 128)}
ROOT = Path(__file__).resolve().parent.parent


def _model(quick: bool):
    import torch
    import transformers as T

    torch.manual_seed(0)
    cfg = T.BertConfig(hidden_size=64 if quick else 256, num_hidden_layers=2 if quick else 4, num_attention_heads=4,
                       intermediate_size=256 if quick else 1024, vocab_size=1000, max_position_embeddings=512)
    return T.BertModel(cfg).eval()


def _calls(n: int, lo: int, hi: int, seed: int = 0) -> list:
    import torch

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [{"input_ids": torch.randint(1, 1000, (1, n_), generator=g),
             "attention_mask": torch.ones(1, n_, dtype=torch.long)} for n_ in lengths]


def cpu_opt_max_shapes() -> int:
    from cpu_opt.compiler.pipeline import MAX_SHAPES

    return MAX_SHAPES


def worker(impl: str, calls: int, threads: int, quick: bool) -> dict:
    import torch

    import cpu_opt

    warnings.filterwarnings("ignore")
    torch.set_num_threads(threads)
    model = _model(quick)
    seq = _calls(calls, 8, 128)
    with torch.no_grad():
        refs = [model(**inp).last_hidden_state for inp in seq]
    example = {"input_ids": torch.randint(1, 1000, (1, 16)), "attention_mask": torch.ones(1, 16, dtype=torch.long)}
    t0 = time.perf_counter()
    if impl == "eager":
        run, opt = model, None
    else:
        opt = cpu_opt.optimize(model, example, dtype="fp32", dynamic=True, buckets=BUCKETS.get(impl),
                               max_shapes=0 if impl == "per_shape_unbounded" else cpu_opt_max_shapes())
        run = opt
    optimize_s = time.perf_counter() - t0
    err = 0.0
    with torch.no_grad():
        t0 = time.perf_counter()
        outs = [run(**inp) for inp in seq]
        served_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        for inp in seq:
            run(**inp)
        warm_s = time.perf_counter() - t0
    for o, r in zip(outs, refs):
        err = max(err, (o.last_hidden_state - r).abs().max().item())
    res = {"impl": impl, "optimize_s": optimize_s, "served_s": served_s, "warm_s": warm_s, "max_abs_err": err,
           "distinct_lengths": len({inp["input_ids"].shape[1] for inp in seq})}
    if opt is not None:
        rep = opt.report()
        res.update(plans=rep["plans_compiled"], partitions=rep["num_partitions"])
        if rep["buckets"]:
            b = rep["buckets"]
            lengths = [inp["input_ids"].shape[1] for inp in seq]
            sizes = BUCKETS[impl]
            res.update(calls_per_bucket=b["calls_per_bucket"], bucket_plans=b["plans_compiled"],
                       buckets_disabled=b["disabled"], validated_ok=all(v["ok"] for v in b["validated"]),
                       padded_tokens=round(sum(next(z for z in sizes if z >= n) for n in lengths) / sum(lengths), 3))
    return res


def main(quick: bool = False, argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench buckets")
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=1 if quick else 3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--impls", default=",".join(IMPLS))
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args, _ = ap.parse_known_args(argv or [])
    quick = quick or "--quick" in (argv or [])
    if args.worker:
        print("RESULT " + json.dumps(worker(args.worker, args.calls, args.threads, quick)), flush=True)
        return
    from bench.runner import Report

    impls = [i for i in args.impls.split(",") if i]
    rep = Report("buckets" + ("_quick" if quick else ""), model="BertModel " + ("hidden 64, 2 layers" if quick else
                 "hidden 256, 4 layers, 4 heads, intermediate 1024"), calls=args.calls, lengths="uniform 8..128, batch 1",
                 rounds=args.rounds, buckets={k: list(v) for k, v in BUCKETS.items()},
                 protocol="each implementation in its own process, alternating rounds; median over rounds")
    rep.meta["threads"] = args.threads
    results: dict = {}
    for rnd in range(args.rounds):
        for impl in impls:
            cmd = [sys.executable, "-m", "bench", "buckets", "--worker", impl, "--calls", str(args.calls),
                   "--threads", str(args.threads)] + (["--quick"] if quick else [])
            r = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ), cwd=str(ROOT), timeout=3600)
            line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if line is None:
                err = (r.stderr.strip().splitlines() or ["no output"])[-1][:200]
                print(f"{impl} round {rnd}: FAILED {err}", flush=True)
                results.setdefault(impl, []).append({"error": err})
                continue
            res = json.loads(line[len("RESULT "):])
            print(f"{impl} round {rnd}: served {res['served_s']:.2f} s, warm {res['warm_s']:.2f} s, "
                  f"plans {res.get('plans', '-')}", flush=True)
            results.setdefault(impl, []).append(res)
    for impl, runs in results.items():
        ok = [r for r in runs if "error" not in r]
        row = {"impl": impl}
        if not ok:
            row["error"] = runs[0]["error"]
        else:
            for k in ("served_s", "warm_s", "optimize_s"):
                row[k] = statistics.median(r[k] for r in ok)
            row["served_rounds_s"] = [round(r["served_s"], 2) for r in ok]
            row["max_abs_err"] = max(r["max_abs_err"] for r in ok)
            for k in ("plans", "bucket_plans", "padded_tokens", "calls_per_bucket", "buckets_disabled", "validated_ok", "partitions",
                      "distinct_lengths"):
                if k in ok[0]:
                    row[k] = ok[0][k]
        rep.add(**row)
    by = {r["impl"]: r for r in rep.rows}
    for r in rep.rows:
        if "served_s" in r and "served_s" in by.get("per_shape", {}):
            r["served_vs_per_shape"] = by["per_shape"]["served_s"] / r["served_s"]
        if "warm_s" in r and "warm_s" in by.get("eager", {}):
            r["warm_vs_eager"] = by["eager"]["warm_s"] / r["warm_s"]
    rep.print_table(["impl", "served_s", "served_rounds_s", "served_vs_per_shape", "warm_s", "warm_vs_eager",
                     "optimize_s", "plans", "bucket_plans", "padded_tokens", "max_abs_err", "error"])
    rep.save()
