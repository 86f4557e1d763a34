"""python -m bench quant: the int8 benchmark in one command (a benchmark, not a test).

1. Full-size Hugging Face BERT-base (seq 128, padding mask) and ResNet-50 (224²) against the int8
   runtimes users pick instead, each implementation in a process of its own, alternating rounds
   (``python -m bench hf --int8``): eager fp32, cpu_opt fp32 and int8, torchao pt2e + inductor
   (freezing), torch.ao's FX flow, torch's ``quantize_dynamic``, OpenVINO + NNCF, ONNX Runtime dynamic
   and static int8 —
   at each ``--batches`` (default 1 and 16). Results: ``hf_int8[_b16]_<cpu>.json`` + ``.png``.
2. The zoo (``python -m bench optimize``): eager fp32, cpu_opt fp32, cpu_opt bf16 where the CPU has
   native bf16 math, and cpu_opt int8 (calibrated on 8 seeded batches) — int8 must beat cpu_opt's own
   fp32 on every zoo model. Results: ``quant_zoo_<cpu>.json`` + ``.png`` (``bench.runner.machine_slug()``).

``--skip-hf`` / ``--skip-zoo`` run one part; ``--quick`` runs small models with few repeats. The
runtimes compared against install with ``pip install 'cpu_opt[compare]'`` and ``pip install torchao
--no-deps``; an implementation that is not installed shows as an error row, the rest still run.
"""
from __future__ import annotations

import argparse

LOCKS_ITSELF = True   # its hf part locks per process, its zoo part holds the lock (bench.__main__)


def main(quick: bool = False, argv=None) -> None:
    from bench import hf, optimize
    from bench.runner import bench_lock, machine_slug
    from cpu_opt import hw

    ap = argparse.ArgumentParser(prog="python -m bench quant", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default=None, help="comma-separated batch sizes (default 1,16; quick 1)")
    ap.add_argument("--hf-models", default="bert,resnet50", help="Hugging Face models (bench hf names)")
    ap.add_argument("--zoo", default=None, help="zoo models (default: the whole zoo)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds of the Hugging Face part (default 3; quick 2)")
    ap.add_argument("--skip-hf", action="store_true", help="only the zoo part")
    ap.add_argument("--skip-zoo", action="store_true", help="only the Hugging Face part")
    ap.add_argument("--quick", action="store_true", help="small models, few repeats")
    args, _ = ap.parse_known_args(argv or [])   # flags of other benchmarks (python -m bench) pass by
    quick = quick or args.quick
    batches = [int(b) for b in (args.batches or ("1" if quick else "1,16")).split(",") if b.strip()]
    if not batches or min(batches) < 1:
        ap.error(f"--batches must name batch sizes >= 1, got {args.batches!r}")
    if not args.skip_hf:
        for b in batches:
            hf_argv = ["--int8", "--batch", str(b), "--models", args.hf_models]
            if args.rounds:
                hf_argv += ["--rounds", str(args.rounds)]
            hf.main(quick, hf_argv + (["--quick"] if quick else []))
    if not args.skip_zoo:
        impls = ["eager_fp32", "cpu_opt_fp32", "cpu_opt_int8"]
        if hw.has_native_bf16(hw.detect()):
            impls.insert(2, "cpu_opt_bf16")
        zoo_argv = ["--impls", ",".join(impls), "--batches", ",".join(map(str, batches)),
                    "--name", f"quant_zoo{'_quick' if quick else ''}_{machine_slug()}"]
        if args.zoo:
            zoo_argv += ["--models", args.zoo]
        with bench_lock():
            optimize.main(quick, zoo_argv + (["--quick"] if quick else []))


if __name__ == "__main__":
    import sys

    main(argv=sys.argv[1:])
