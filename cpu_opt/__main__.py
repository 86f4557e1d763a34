"""Command line: ``python -m cpu_opt info [--json]`` and ``python -m cpu_opt demo``."""
from __future__ import annotations

import argparse
import json
import sys


def info_dict() -> dict:
    import torch

    from .platform import hw, routing

    info = hw.detect()
    out = {
        "arch": info.arch,
        "cpu": info.model_name,
        "vendor": info.vendor,
        "physical_cores": info.physical_cores,
        "threads": torch.get_num_threads(),
        "cache_sizes": dict(info.cache_sizes),
        "isa": sorted(info.isa),
        "isa_cap": info.isa_cap,
        "sve_vector_bits": info.sve_vector_bits,
        "arm_core": info.arm_core,
        "torch": torch.__version__,
        "torch_capability": info.torch_capability,
        "auto_dtype": routing.auto_dtype(info),
        "routes": routing.routes(info),
        "disagreements": list(info.disagreements),
    }
    try:
        from . import dnnl

        out["onednn"] = dnnl.version()
        out["onednn_library"] = dnnl.library_path()
    except Exception as e:
        out["onednn"] = None
        out["onednn_error"] = str(e)
    try:
        from . import native

        out["native_variant"] = native.select_variant(info)
    except Exception as e:
        out["native_variant"] = None
        out["native_error"] = str(e)
    return out


def print_info(d: dict) -> None:
    def kb(n):
        return f"{n // 1024} KiB" if n < 1 << 20 else f"{n / (1 << 20):.0f} MiB"

    print(f"cpu_opt — {d['cpu']} ({d['vendor']}, {d['arch']})")
    print(f"  cores: {d['physical_cores']} physical, torch threads {d['threads']}")
    if d["cache_sizes"]:
        print("  caches: " + ", ".join(f"{k} {kb(v)}" for k, v in d["cache_sizes"].items()))
    print(f"  ISA: {' '.join(d['isa'])}" + (f"   (capped at {d['isa_cap']} by CPU_OPT_MAX_ISA)" if d["isa_cap"] else ""))
    if d["arch"] == "aarch64":
        print(f"  Arm core: {d['arm_core']}, SVE {d['sve_vector_bits']} bits")
    print(f"  torch {d['torch']} (kernels: {d['torch_capability']}), oneDNN binding: "
          f"{d['onednn'] or 'unavailable — ' + d.get('onednn_error', '')}, native kernels: {d['native_variant']}")
    print(f"  dtype='auto' means {d['auto_dtype']} here")
    for note in d["disagreements"]:
        print(f"  note: {note}")
    print("\nroutes:")
    print(f"  {'work':<10} {'dtype':<5} {'backend':<20} why")
    for work, per in d["routes"].items():
        for dt, r in per.items():
            print(f"  {work:<10} {dt:<5} {r['backend']:<20} {r['why']}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m cpu_opt")
    sub = p.add_subparsers(dest="cmd", required=True)
    pi = sub.add_parser("info", help="what was detected and where each kind of work is routed")
    pi.add_argument("--json", action="store_true", help="machine-readable output")
    pd = sub.add_parser("demo", help="optimize example models from the zoo and print their speedups")
    pd.add_argument("--quick", action="store_true", help="small model configurations")
    args, rest = p.parse_known_args(argv)
    if args.cmd == "info":
        d = info_dict()
        if args.json:
            print(json.dumps(d, indent=1))
        else:
            print_info(d)
        return 0
    if args.cmd == "demo":
        from .demo import main as demo_main

        return demo_main(quick=args.quick, argv=rest)
    return 2


if __name__ == "__main__":
    sys.exit(main())
