"""aarch64-only tests, run by `make test-arm64` under qemu-user (graviton/emulation/).

On any other machine they are skipped, with the reason. Under the emulation script
(CPU_OPT_ARM64_REQUIRED=1) a skip is turned into a failure: a feature missing there must show.
"""
import os
import platform
import sys

import pytest

# graviton_zoo.py sits beside the tests; make it importable whatever pytest's import mode.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

REQUIRED = os.environ.get("CPU_OPT_ARM64_REQUIRED") == "1"
IS_ARM = platform.machine() in ("aarch64", "arm64")


def pytest_configure(config):
    config.addinivalue_line("markers", "v1: needs a core with BF16 (Neoverse V1); deselected in the N1 run")
    config.addinivalue_line("markers", "n1: needs a core without BF16 (Neoverse N1); deselected in the V1 run")


def pytest_collection_modifyitems(config, items):
    if IS_ARM:
        return
    skip = pytest.mark.skip(reason=f"aarch64-only test; this machine is {platform.machine()} "
                                   "(run them with `make test-arm64`)")
    for item in items:
        if "/arm64/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(skip)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if REQUIRED and rep.skipped:
        rep.outcome = "failed"
        rep.longrepr = f"skipped under the aarch64 emulation run, which must run every test: {rep.longrepr}"


@pytest.fixture(scope="session")
def expect_core():
    core = os.environ.get("CPU_OPT_EXPECT_CORE")
    if REQUIRED and not core:
        pytest.fail("CPU_OPT_EXPECT_CORE is not set by the emulation script")
    return core
