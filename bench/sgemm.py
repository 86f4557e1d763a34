"""python -m bench sgemm: cpu_opt's packed fp32 GEMM (``native/kernels/sgemm.c``, through
``native_linear.packed_linear``) against torch's oneDNN 3.12 linear on weights packed for the row
count (``mkldnn._linear_pointwise`` on ``_reorder_linear_weight``: what the ``torch_onednn`` route
runs), on transformer shapes (BERT-base at 128 tokens, ViT-B/16's 197, a batch of 1024 rows), at 1
and 2 threads. Each shape's two callables are timed interleaved in one process; both results are
checked against float64 first. Reports ms, GFLOP/s and the ratio (torch's oneDNN / cpu_opt)."""
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
    rep.print_table(["threads", "shape", "cpu_opt_ms", "torch_onednn_ms", "cpu_opt_gflops", "torch_onednn_gflops",
                     "ratio", "cpu_opt_err", "torch_onednn_err"])
    if not quick:
        rep.save(RESULTS_DIR / f"sgemm_{machine_slug()}.json")


if __name__ == "__main__":
    main()
