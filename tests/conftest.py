"""Suite-wide set-up.

* A private cache directory: a routing profile the user made with ``python -m cpu_opt calibrate``
  changes routes, and tests must see the table (tests that need a profile write their own).
* The ``isa`` marker on every test whose outcome depends on the ISA in force: ``make test`` runs
  them again under each ``CPU_OPT_MAX_ISA`` cap below this CPU's own level (tests/run_capped.py).
"""
import os
import tempfile

import pytest

os.environ["CPU_OPT_CACHE_DIR"] = tempfile.mkdtemp(prefix="cpu_opt-test-cache-")
os.environ.pop("CPU_OPT_ROUTING_PROFILE", None)

# Test files whose assertions branch on (or exercise code that branches on) the features after the cap.
ISA_SENSITIVE = ("tests/test_hw.py", "tests/test_native.py", "tests/test_routing.py", "tests/test_profile.py",
                 "tests/dnnl/", "tests/optimize/", "tests/gnn/", "tests/fuzz/", "tests/quant/")


def pytest_configure(config):
    config.addinivalue_line("markers", "isa: depends on the ISA in force; re-run under each lower CPU_OPT_MAX_ISA cap")


def pytest_collection_modifyitems(config, items):
    root = str(config.rootpath)
    for item in items:
        rel = os.path.relpath(str(item.path), root).replace(os.sep, "/")
        if rel.startswith(ISA_SENSITIVE):
            item.add_marker(pytest.mark.isa)
