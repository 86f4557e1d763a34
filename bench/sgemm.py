"""python -m bench sgemm: cpu_opt's packed fp32 GEMM (``native/kernels/sgemm.c``, through
``native_linear.packed_linear``) against torch's oneDNN 3.12 linear on weights packed for the row
count (``mkldnn._linear_pointwise`` on ``_reorder_linear_weight``: what the ``torch_onednn`` route
runs), on transformer shapes (BERT-base at 128 tokens, ViT-B/16's 197, a batch of 1024 rows), at 1
and 2 threads. Each shape's two callables are timed interleaved in one process; both results are
checked against float64 first. Reports ms, GFLOP/s and the ratio (torch's oneDNN / cpu_opt).

Then the tall-skinny GEMMs of cpu_opt.gnn (``native/kernels/tsgemm.c``: 100k node-feature rows times
a small weight, ``native_linear.ts_linear`` / ``ts_linear_sum``) against ``torch.addmm``, the same
way: the shapes of GraphSAGE's and GIN's layers (K x N 64 x 64, 64 x 8, 8 x 64, and SAGEConv's
``lin_l(aggr) + lin_r(x)`` 64 + 64 -> 64). A register spill in these kernels once made them 2.3x
slower on AVX2 without any test failing: this is where it shows."""
from __future__ import annotations

import argparse

import torch

from cpu_opt import native
from cpu_opt.backends import native_linear
from cpu_opt.backends.torch_onednn import TORCH_LINEAR, packed_linear_weight

from .runner import RESULTS_DIR, Report, machine_slug, measure

SHAPES = [(128, 768, 768), (128, 768, 2304), (128, 768, 3072), (128, 3072, 768), (197, 768, 3072),
          (197, 3072, 768), (1024, 768, 3072)]
QUICK_SHAPES = [(128, 768, 768), (197, 768, 3072)]
TS_ROWS = 100_000
TS_SHAPES = [(64, 64), (64, 8), (8, 64)]  # (K, N) of node-feature layers


def _rel(y, ref):
    return ((y.double() - ref).abs().max() / ref.abs().max()).item()


def main(quick: bool = False, argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench sgemm")
    ap.add_argument("--repeats", type=int, default=7 if quick else 41)
    ap.add_argument("--threads", default="1,2")
    args, _ = ap.parse_known_args(argv or [])
    if not native.vectorized():
        print("bench sgemm: no vector variant of cpu_opt's kernels runs on this CPU; nothing to compare")
        return
    rep = Report("sgemm")
    before = torch.get_num_threads()
    try:
        for nt in (int(t) for t in args.threads.split(",")):
            torch.set_num_threads(nt)
            for m, k, n in (QUICK_SHAPES if quick else SHAPES):
                g = torch.Generator().manual_seed(m + k + n)
                x, w, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
                wp, tw = native_linear.pack_weight(w), packed_linear_weight(w, m)
                fns = {"cpu_opt": lambda: native_linear.packed_linear(x, wp, b, n),
                       "torch_onednn": lambda: TORCH_LINEAR(x, tw, b, "none", [], "")}
                ref = torch.nn.functional.linear(x.double(), w.double(), b.double())
                row = dict(threads=nt, shape=f"{m}x{k}x{n}", **{f"{name}_err": _rel(f(), ref) for name, f in fns.items()})
                st = measure(fns, warmup=3, repeats=args.repeats)
                for name, s in st.items():
                    row[f"{name}_ms"] = s.median * 1e3
                    row[f"{name}_gflops"] = 2 * m * k * n / s.median / 1e9
                row["ratio"] = st["torch_onednn"].median / st["cpu_opt"].median
                rep.add(**row)
    finally:
        torch.set_num_threads(before)
    ts = _tall_skinny(args.threads, 5 if quick else 21, TS_ROWS // 10 if quick else TS_ROWS)
    rep.print_table(["threads", "shape", "cpu_opt_ms", "torch_onednn_ms", "cpu_opt_gflops", "torch_onednn_gflops",
                     "ratio", "cpu_opt_err", "torch_onednn_err"])
    ts.print_table(["threads", "shape", "cpu_opt_ms", "addmm_ms", "cpu_opt_gflops", "addmm_gflops", "ratio",
                    "cpu_opt_err", "addmm_err"])
    if not quick:
        rep.save(RESULTS_DIR / f"sgemm_{machine_slug()}.json")
        ts.save(RESULTS_DIR / f"sgemm_tall_skinny_{machine_slug()}.json")


def _tall_skinny(threads: str, repeats: int, rows: int) -> Report:
    """cpu_opt's tall-skinny GEMMs against torch.addmm, interleaved, each checked against float64."""
    rep = Report("sgemm_tall_skinny")
    before = torch.get_num_threads()
    try:
        for nt in (int(t) for t in threads.split(",")):
            torch.set_num_threads(nt)
            for k, n, two in [(k, n, False) for k, n in TS_SHAPES] + [(64, 64, True)]:
                g = torch.Generator().manual_seed(k * n)
                x, x2 = torch.randn(rows, k, generator=g), torch.randn(rows, k, generator=g)
                w, w2, b = torch.randn(n, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
                if two:
                    fns = {"cpu_opt": lambda: native_linear.ts_linear_sum(x, w, x2, w2, b),
                           "addmm": lambda: torch.addmm(torch.addmm(b, x, w.t()), x2, w2.t())}
                    ref = torch.nn.functional.linear(x.double(), w.double(), b.double()) + x2.double() @ w2.double().t()
                else:
                    fns = {"cpu_opt": lambda: native_linear.ts_linear(x, w, b), "addmm": lambda: torch.addmm(b, x, w.t())}
                    ref = torch.nn.functional.linear(x.double(), w.double(), b.double())
                flops = 2 * rows * k * n * (2 if two else 1)
                row = dict(threads=nt, shape=f"{rows}x{k}{'+' + str(k) if two else ''}x{n}",
                           **{f"{name}_err": _rel(f(), ref) for name, f in fns.items()})
                st = measure(fns, warmup=2, repeats=repeats)
                for name, sv in st.items():
                    row[f"{name}_ms"] = sv.median * 1e3
                    row[f"{name}_gflops"] = flops / sv.median / 1e9
                row["ratio"] = st["addmm"].median / st["cpu_opt"].median
                rep.add(**row)
    finally:
        torch.set_num_threads(before)
    return rep


if __name__ == "__main__":
    main()
