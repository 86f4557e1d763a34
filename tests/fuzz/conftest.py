"""Property-based fuzzing (hypothesis) of every public entry point that reaches C.

Two profiles: ``ci`` (the default, in `make test`): derandomized — the same cases on every run —
and a bounded count per test; ``fuzz`` (`make fuzz`): random cases, many of them
(``CPU_OPT_FUZZ_EXAMPLES``, default 2000 per test), statistics printed at the end.
Every case must match the torch reference or raise a clear Python exception (TypeError,
ValueError, IndexError, MemoryError, RuntimeError from torch itself); a crash ends the run.
"""
import os
import sys
from pathlib import Path

from hypothesis import HealthCheck, settings

sys.path.insert(0, str(Path(__file__).resolve().parent))

COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                     HealthCheck.filter_too_much])
settings.register_profile("ci", derandomize=True, max_examples=int(os.environ.get("CPU_OPT_CI_EXAMPLES", "40")),
                          print_blob=True, **COMMON)
settings.register_profile("fuzz", derandomize=False, max_examples=int(os.environ.get("CPU_OPT_FUZZ_EXAMPLES", "2000")),
                          print_blob=True, **COMMON)
settings.load_profile(os.environ.get("CPU_OPT_FUZZ_PROFILE", "ci"))
