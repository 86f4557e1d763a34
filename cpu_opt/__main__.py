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
        "cpu_label": info.label,
        "microarchitecture": info.microarchitecture,
        "family": info.family,
        "model": info.model,
        "vendor": info.vendor,
        "physical_cores": info.physical_cores,
        "threads": torch.get_num_threads(),
        "cache_sizes": dict(info.cache_sizes),
        "isa": sorted(info.isa),
        "isa_uncapped": sorted(info.isa_uncapped),
        "isa_cap": info.isa_cap,
        "isa_cap_source": hw.isa_cap_source() if info.isa_cap else None,
        "flags": sorted(info.flags),
        "sve_vector_bits": info.sve_vector_bits,
        "arm_core": info.arm_core,
        "torch": torch.__version__,
        "torch_capability": info.torch_capability,
        "auto_dtype": routing.auto_dtype(info),
        "routes": routing.routes(),
        "profile": _profile_summary(),
        "disagreements": list(info.disagreements),
    }
    try:
        from . import dnnl

        out["onednn"] = dnnl.version()
        out["onednn_library"] = dnnl.library_path()
        from .dnnl import probe

        out["onednn_matmul"] = probe.summary()
    except Exception as e:
        out["onednn"] = None
        out["onednn_error"] = str(e)
        out["onednn_matmul"] = {}
    try:
        from . import native

        out["native_variant"] = native.select_variant(info)
    except Exception as e:
        out["native_variant"] = None
        out["native_error"] = str(e)
    return out


def _profile_summary() -> dict:
    """Where this machine's profile is (or would be written), and whether one is in force."""
    from .platform import profile

    prof = profile.load()
    out = {"cache_dir": str(profile.cache_dir()), "path": prof.path if prof else None,
           "created": prof.created if prof else None, "expected_path": None}
    try:
        out["expected_path"] = str(profile.path_for())
    except Exception:  # noqa: BLE001
        pass
    return out


def print_info(d: dict) -> None:
    def kb(n):
        return f"{n // 1024} KiB" if n < 1 << 20 else f"{n / (1 << 20):.0f} MiB"

    print(f"cpu_opt — {d['cpu_label']} ({d['vendor']}, {d['arch']})")
    print(f"  cores: {d['physical_cores']} physical, torch threads {d['threads']}")
    if d["cache_sizes"]:
        print("  caches: " + ", ".join(f"{k} {kb(v)}" for k, v in d["cache_sizes"].items()))
    print(f"  ISA: {' '.join(d['isa'])}" + (f"   (capped at {d['isa_cap']} by {d['isa_cap_source']})"
                                               if d["isa_cap"] else ""))
    for dt, m in d.get("onednn_matmul", {}).items():
        slow = {"bf16": "emulated", "int8": "no VNNI: u8 x s8 pairs add in int16, 7-bit activations only"}
        how = ("native" if m["native"] else slow.get(dt, "")) if m["accepted"] else "refused (dnnl_unimplemented)"
        print(f"  oneDNN 3.2 {dt} matmul: {how}" + (f", {m['impl']}" if m.get("impl") else ""))
    if d["arch"] == "aarch64":
        print(f"  Arm core: {d['arm_core']}, SVE {d['sve_vector_bits']} bits")
    print(f"  torch {d['torch']} (kernels: {d['torch_capability']}), oneDNN binding: "
          f"{d['onednn'] or 'unavailable — ' + d.get('onednn_error', '')}, native kernels: {d['native_variant']}")
    print(f"  dtype='auto' means {d['auto_dtype']} here")
    for note in d["disagreements"]:
        print(f"  note: {note}")
    prof = d.get("profile") or {}
    if prof.get("path"):
        print(f"\nroutes (measured profile {prof['path']}, {prof['created']}; it overrides the table where they differ):")
    else:
        print("\nroutes (routing table only: no measured profile for this machine; `python -m cpu_opt calibrate` makes one):")
    print(f"  {'work':<10} {'dtype':<11} {'table':<20} {'measured':<20} figures / why")
    for work, per in d["routes"].items():
        for dt, r in per.items():
            if not r["measured"]:
                print(f"  {work:<10} {dt:<11} {r['table']['backend']:<20} {'-':<20} {r['table']['why']}")
            for m in r["measured"]:
                figs = ", ".join(f"{b} {t:.3g} ms" for b, t in sorted(m["times_ms"].items(), key=lambda kv: kv[1]))
                label = f"{dt}" if m["class"] == "default" else f"{dt} {m['class']}"
                print(f"  {work:<10} {label:<11} {m['table']:<20} {m['winner']:<20} {m['shape']}: {figs}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m cpu_opt")
    sub = p.add_subparsers(dest="cmd", required=True)
    pi = sub.add_parser("info", help="what was detected and where each kind of work is routed")
    pi.add_argument("--json", action="store_true", help="machine-readable output")
    pc = sub.add_parser("calibrate", help="time the candidate backends here and write this machine's routing profile")
    pc.add_argument("--quick", action="store_true", help="tiny shapes, 3 rounds: a smoke run that writes nothing")
    pc.add_argument("--json", action="store_true", help="print the profile as JSON instead of a table")
    pc.add_argument("--no-write", action="store_true", help="measure and print, but write no profile")
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
    if args.cmd == "calibrate":
        from .platform import calibrate

        write = not (args.no_write or args.quick)
        prof = calibrate.calibrate(quick=args.quick, progress=not args.json, write=write)
        if args.json:
            print(json.dumps(dict(prof.to_json(), path=prof.path, table=calibrate.table(prof)), indent=1))
        else:
            calibrate.print_table(prof, written=write)
            if not write:
                print("(nothing written: " + ("--quick" if args.quick else "--no-write") + ")")
        return 0
    if args.cmd == "demo":
        from .demo import main as demo_main

        return demo_main(quick=args.quick, argv=rest)
    return 2


if __name__ == "__main__":
    sys.exit(main())
