"""python -m bench [NAME ...]: run the named benchmarks (all when none is named), each under the
machine's benchmark lock (``bench.runner.bench_lock``) unless it takes that lock itself."""
import argparse
import importlib
import pkgutil
import sys
from pathlib import Path


def available() -> list[str]:
    here = Path(__file__).resolve().parent
    return sorted(m.name for m in pkgutil.iter_modules([str(here)])
                  if m.name not in ("runner", "__main__") and not m.name.startswith("_"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    p.add_argument("names", nargs="*", help=f"benchmarks to run (default: all of {', '.join(available())})")
    p.add_argument("--quick", action="store_true", help="fewer repeats and sizes, for a smoke run")
    args, rest = p.parse_known_args(argv)
    names = args.names or available()
    unknown = [n for n in names if n not in available()]
    if unknown:
        p.error(f"unknown benchmark(s) {unknown}; available: {available()}")
    from bench.runner import bench_lock

    for n in names:
        mod = importlib.import_module(f"bench.{n}")
        if getattr(mod, "LOCKS_ITSELF", False):   # takes the machine lock per process (bench hf)
            mod.main(quick=args.quick, argv=rest)
        else:
            with bench_lock():
                mod.main(quick=args.quick, argv=rest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
