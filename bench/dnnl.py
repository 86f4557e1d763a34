"""python -m bench dnnl: cpu_opt's oneDNN 3.2 matmul (fp32, bf16, int8) against torch.matmul and
against the oneDNN 3.12 inside torch (``torch_onednn``: ``mkldnn._linear_pointwise``, and
``onednn::qlinear_pointwise`` for int8).

Sizes: 1024^3 and the transformer-shaped 128x768x3072. cpu_opt's Matmul packs the weights once
(format ``any`` + one reorder); torch gets the same tensors. int8 is u8 x s8 -> s32 against
torch's int32 matmul of the same integers (the exact reference; torch's oneDNN gives fp32 with unit
scales), and, where the CPU lacks VNNI, with 7-bit activations (x86 kernels without VNNI saturate
8-bit u8 x s8 pairs in int16). Reports GFLOP/s beside the machine's GEMM peak measured in the same
run; the table's header names the CPU.
"""
from __future__ import annotations

import argparse

import torch

from cpu_opt import hw
from cpu_opt.dnnl import primitives as P

from .runner import RESULTS_DIR, Report, machine_peaks, machine_slug, measure

SIZES = [(1024, 1024, 1024), (128, 768, 3072)]


def _case(rep, M, K, N, dtype_name, repeats):
    torch.manual_seed(0)
    flops = 2 * M * K * N
    row = dict(shape=f"{M}x{K}x{N}", dtype=dtype_name)
    if dtype_name in ("fp32", "bf16"):
        dt = torch.float32 if dtype_name == "fp32" else torch.bfloat16
        a, w = torch.randn(M, K).to(dt), torch.randn(K, N).to(dt)
        fns = {"torch": lambda: torch.matmul(a, w)}
        w_nk = w.t().contiguous()
        try:
            torch.ops.mkldnn._linear_pointwise(a, w_nk, None, "none", [], "")
            fns["torch_onednn"] = lambda: torch.ops.mkldnn._linear_pointwise(a, w_nk, None, "none", [], "")
        except RuntimeError as e:
            row["torch_onednn_error"] = str(e).splitlines()[0][:60]
        try:
            mm = P.Matmul(w)
            mm(a)
            fns["cpu_opt"] = lambda: mm(a)
            row["impl"] = mm.impl(M)
        except Exception as e:
            status = getattr(e, "status", None)
            row["cpu_opt_error"] = status or f"{type(e).__name__}: {e}"
    else:
        vnni = hw.has_vnni(hw.detect())
        hi = 256 if vnni else 128
        if not vnni:
            repeats = max(3, repeats // 3)  # torch's int32 matmul has no BLAS: slow reference
        a = torch.randint(0, hi, (M, K), dtype=torch.uint8)
        w = torch.randint(-128, 128, (K, N), dtype=torch.int8)
        ai, wi = a.to(torch.int32), w.to(torch.int32)
        mm = P.Matmul(w, dst_dtype=torch.int32)
        mm(a)
        row["impl"] = mm.impl(M) + ("" if vnni else " (7-bit src: no VNNI)")
        row["exact"] = bool(torch.equal(mm(a), ai @ wi))
        fns = {"torch": lambda: torch.matmul(ai, wi), "cpu_opt": lambda: mm(a)}
        packed = torch.ops.onednn.qlinear_prepack(w.t().contiguous(), [M, K])
        ones, zeros = torch.ones(N), torch.zeros(N, dtype=torch.int64)
        fns["torch_onednn"] = lambda: torch.ops.onednn.qlinear_pointwise(a, 1.0, 0, packed, ones, zeros, None, 1.0, 0,
                                                                          torch.float32, "none", [], "")
    if dtype_name == "bf16" and "cpu_opt" not in fns:
        repeats = 3  # torch's bf16 matmul without native bf16 is emulated and slow
    st = measure(fns, warmup=1, repeats=repeats)
    for name, s in st.items():
        row[f"{name}_ms"] = s.median * 1e3
        row[f"{name}_gflops"] = flops / s.median / 1e9
    if "cpu_opt" in st:
        row["speedup"] = st["torch"].median / st["cpu_opt"].median
        if "torch_onednn" in st:
            row["vs_torch_onednn"] = st["torch_onednn"].median / st["cpu_opt"].median
    rep.add(**row)


def main(quick: bool = False, argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench dnnl")
    ap.add_argument("--repeats", type=int, default=5 if quick else 15)
    args, _ = ap.parse_known_args(argv or [])
    rep = Report("dnnl")
    peaks = machine_peaks(gemm_n=1024 if quick else 2048)
    rep.meta["peaks"] = peaks
    for M, K, N in SIZES:
        for d in ("fp32", "bf16", "int8"):
            _case(rep, M, K, N, d, args.repeats)
    rep.print_table(["shape", "dtype", "torch_ms", "torch_onednn_ms", "cpu_opt_ms", "torch_gflops",
                     "torch_onednn_gflops", "cpu_opt_gflops", "speedup", "vs_torch_onednn", "impl", "exact",
                     "cpu_opt_error", "torch_onednn_error"])
    print(f"machine peaks measured in this run: {peaks}")
    rep.save(RESULTS_DIR / f"dnnl_{machine_slug()}.json")  # one file per CPU: the tables of other machines stay


if __name__ == "__main__":
    main()
