# The README's two commands: `make demo` and `make test`. Both set up .venv from scratch when
# needed (idempotent, quick once done) and then run.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.cpu_opt-installed
# Anything that changes what `pip install -e .` builds (the native kernels, the oneDNN cdef).
BUILD_INPUTS := pyproject.toml setup.py cpu_opt/dnnl/cdefgen.py $(wildcard native/*.py native/*.c native/*.h native/kernels/*)

.PHONY: setup demo test test-fast test-arm64 bench info calibrate fuzz test-asan clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(PY) $(BUILD_INPUTS)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[test,gnn,bench]'
	@touch $@

setup: $(STAMP)

demo: setup
	$(PY) -m cpu_opt demo $(ARGS)

info: setup
	$(PY) -m cpu_opt info

# tests/graviton/arm64 are aarch64-only: on other machines `make test-arm64` runs them under QEMU.
ARM64_ONLY := $(if $(filter aarch64 arm64,$(shell uname -m)),,--ignore=tests/graviton/arm64)

# The whole suite once as the machine is, then the ISA-sensitive tests (marker `isa`) once more under
# each ISA cap below this CPU's own level (tests/run_capped.py; CAPS="sse41 avx2" picks, CAPS=none skips).
test: setup
	$(PY) -m pytest -q tests $(ARM64_ONLY)
	$(PY) tests/run_capped.py $(ARM64_ONLY)

calibrate: setup
	$(PY) -m cpu_opt calibrate

# The native kernels rebuilt with AddressSanitizer + UBSan, and the kernel and binding tests run on them.
test-asan: setup
	$(PY) native/sanitize.py $(ARGS)

# The fuzz tests with random cases, many of them (make test runs them derandomized and bounded).
FUZZ_EXAMPLES ?= 2000
fuzz: setup
	CPU_OPT_FUZZ_PROFILE=fuzz CPU_OPT_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(PY) -m pytest -q tests/fuzz --hypothesis-show-statistics

bench: setup
	$(PY) -m bench

test-arm64:
	bash graviton/emulation/run_arm64_tests.sh

clean:
	rm -rf build *.egg-info cpu_opt/_native*.so cpu_opt/dnnl/_cdef_generated.py
