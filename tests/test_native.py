"""The native build: per-ISA variants compiled, the runtime choice follows the CPU and the cap,
and the proof kernel is right in every variant this CPU can run."""
import pytest
import torch

from cpu_opt import hw, native
from cpu_opt.errors import NativeKernelError


def runnable():
    info = hw.detect()
    return [v for v in native.compiled_variants() if native.VARIANT_REQUIRES[v] <= info.isa_uncapped]


def test_variants_compiled_for_this_arch():
    built = native.compiled_variants()
    assert "base" in built
    if hw.detect().arch == "x86_64":
        assert set(built) == {"base", "avx2", "avx512"}


def test_selection_follows_features():
    info = hw.detect()
    v = native.select_variant(info)
    assert native.VARIANT_REQUIRES[v] <= info.isa
    better = [w for w in native.VARIANT_ORDER[:native.VARIANT_ORDER.index(v)] if w in native.compiled_variants()]
    assert all(not native.VARIANT_REQUIRES[w] <= info.isa for w in better)


@pytest.mark.parametrize("cap,expected", [("sse41", "base"), ("avx2", "avx2")])
def test_selection_follows_isa_cap(cap, expected):
    info = hw.detect()
    if not native.VARIANT_REQUIRES[expected] <= info.isa_uncapped:
        expected = "base"
    capped = hw.build_info(open("/proc/cpuinfo").read(), cap=cap)
    assert native.select_variant(capped) == expected


def test_fixture_cpus_pick_widest_variant():
    from pathlib import Path

    fix = Path(__file__).parent / "fixtures" / "cpuinfo"
    z5 = hw.build_info((fix / "amd_zen5.txt").read_text())
    z3 = hw.build_info((fix / "amd_zen3.txt").read_text())
    assert native.select_variant(z5) == "avx512"
    assert native.select_variant(z3) == "avx2"
    assert native.select_variant(hw.build_info((fix / "amd_zen5.txt").read_text(), cap="avx2")) == "avx2"


@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_gather_rows_every_runnable_variant(index_dtype):
    torch.manual_seed(0)
    src = torch.randn(1000, 37)
    idx = torch.randint(0, 1000, (5000,), dtype=index_dtype)
    for v in runnable():
        assert torch.equal(native.gather_rows(src, idx, variant=v), src[idx.long()]), v


def test_gather_rows_checks_before_writing():
    src = torch.randn(10, 4)
    out = torch.full((3, 4), 7.0)
    with pytest.raises(IndexError, match=r"index\[2\] = 10"):
        native.gather_rows(src, torch.tensor([0, 1, 10]), out=out)
    assert torch.equal(out, torch.full((3, 4), 7.0))  # nothing was written
    with pytest.raises(IndexError, match="-1"):
        native.gather_rows(src, torch.tensor([-1]))
    with pytest.raises(TypeError, match="float32"):
        native.gather_rows(src.double(), torch.tensor([0]))
    with pytest.raises(TypeError, match="index"):
        native.gather_rows(src, torch.tensor([0.0]))
    with pytest.raises(ValueError, match="out"):
        native.gather_rows(src, torch.tensor([0]), out=torch.empty(2, 4))


def test_unrunnable_variant_is_refused_not_executed():
    missing = [v for v in native.compiled_variants() if v not in runnable()]
    for v in missing:
        with pytest.raises(RuntimeError, match="lacks"):
            native.kernel("gather_rows_f32_i64", v)
    with pytest.raises(ValueError, match="unknown native variant"):
        native.kernel("gather_rows_f32_i64", "sve9")


def test_status_check_names_the_error():
    with pytest.raises(NativeKernelError, match="CO_ERR_BAD_ARGUMENT"):
        native.check(-2, "kernel")
    native.check(0, "kernel")


# ------------------------------------------------------------------ variant requirements vs the compiler

# gcc's predefined macros -> /proc/cpuinfo flag names (the baseline x86-64 ones, SSE/SSE2/MMX/FXSR, are
# what every variant may use and are left out by diffing against no -m flags)
MACRO_TO_FLAG = {
    "__SSE3__": "pni", "__SSSE3__": "ssse3", "__SSE4_1__": "sse4_1", "__SSE4_2__": "sse4_2",
    "__CRC32__": "sse4_2", "__POPCNT__": "popcnt", "__XSAVE__": "xsave", "__AVX__": "avx", "__AVX2__": "avx2",
    "__FMA__": "fma", "__F16C__": "f16c", "__BMI__": "bmi1", "__BMI2__": "bmi2", "__LZCNT__": "abm",
    "__MOVBE__": "movbe", "__AVX512F__": "avx512f", "__AVX512BW__": "avx512bw", "__AVX512VL__": "avx512vl",
    "__AVX512DQ__": "avx512dq", "__AVX512CD__": "avx512cd", "__AVX512VNNI__": "avx512_vnni",
    "__AVX512BF16__": "avx512_bf16", "__AVXVNNI__": "avx_vnni", "__AMX_TILE__": "amx_tile",
}


def _pragma_targets() -> dict:
    """variant -> the feature list of its ``#pragma GCC target("...")`` in native/variants.c."""
    import re
    from pathlib import Path

    src = (Path(__file__).resolve().parent.parent / "native" / "variants.c").read_text()
    found = re.findall(r'#pragma GCC target\("([^"]+)"\)\s*\n#define KSUFFIX _(\w+)', src)
    return {variant: target.split(",") for target, variant in found}


def _implied_flags(features: list) -> set:
    import shutil
    import subprocess

    gcc = shutil.which("gcc") or shutil.which("cc")
    assert gcc, "the native build needs a C compiler; so does this test"

    def macros(args):
        out = subprocess.run([gcc, *args, "-dM", "-E", "-x", "c", "-"], input="", capture_output=True,
                             text=True, check=True).stdout
        return {line.split()[1] for line in out.splitlines() if line.startswith("#define __")}

    extra = macros([f"-m{f}" for f in features]) - macros([])
    # ISA macros are spelled __NAME__; __FP_FAST_FMA and the like describe float semantics
    isa_macros = {m for m in extra if m.endswith("__") and not m.startswith("__FP_")}
    unknown = isa_macros - set(MACRO_TO_FLAG)
    assert not unknown, f"map these gcc ISA macros to /proc/cpuinfo flags: {sorted(unknown)}"
    return {MACRO_TO_FLAG[m] for m in isa_macros}


@pytest.mark.skipif(hw.detect().arch != "x86_64", reason="the ISA variants exist on x86-64 only (aarch64 builds base)")
def test_variant_requirements_match_the_compiler_targets():
    targets = _pragma_targets()
    assert set(targets) == {"avx2", "avx512"}, targets
    for variant, features in targets.items():
        implied = _implied_flags(features)
        assert implied == set(native.VARIANT_REQUIRES[variant]), (
            f"variant {variant}: #pragma GCC target({','.join(features)}) lets gcc use {sorted(implied)}, "
            f"VARIANT_REQUIRES says {sorted(native.VARIANT_REQUIRES[variant])}")
    assert "bmi2" in native.VARIANT_REQUIRES["avx2"]


@pytest.mark.parametrize("masked", ["bmi2", "f16c", "fma", "popcnt"])
def test_a_vm_that_masks_one_flag_gets_the_lower_variant(masked):
    """A hypervisor may hide one flag (bmi2, say) while keeping avx2: the avx2 variant would then
    die on an illegal instruction, so selection must fall back to base."""
    from pathlib import Path

    fix = Path(__file__).parent / "fixtures" / "cpuinfo" / "amd_zen3.txt"
    text = "\n".join(line.replace(f" {masked} ", " ") if line.startswith("flags") else line
                     for line in fix.read_text().splitlines())
    info = hw.build_info(text)
    assert masked not in info.isa and "avx2" in info.isa
    assert native.select_variant(info) == "base"
    assert native.select_variant(hw.build_info(fix.read_text())) == "avx2"


def test_sanitized_build_is_the_one_loaded_under_make_test_asan():
    """`make test-asan` must really run the sanitized kernels, not the installed ones."""
    import os

    if os.environ.get("CPU_OPT_EXPECT_SANITIZED"):
        assert native.module_path() == os.environ["CPU_OPT_NATIVE_PATH"]
        assert "asan" in native.module_path()
    else:
        assert "CPU_OPT_NATIVE_PATH" not in os.environ or native.module_path() == os.environ["CPU_OPT_NATIVE_PATH"]


def test_empty_takes_shapes_and_a_keyword_dtype_and_refuses_the_rest():
    """``native.empty`` as ``torch.empty``: a shape (ints, a tuple, a torch.Size) and ``dtype=``; a dtype
    passed where a dimension goes, or a dimension that is not an integer, is a clear TypeError."""
    assert native.empty(3, 4).shape == (3, 4) and native.empty(3, 4).dtype == torch.float32
    assert native.empty((2, 5), dtype=torch.int32).dtype == torch.int32
    assert native.empty(torch.Size([2, 3]), dtype=torch.bfloat16).shape == (2, 3)
    with pytest.raises(TypeError, match="dtype by keyword"):
        native.empty((2, 3), torch.float32)
    with pytest.raises(TypeError, match="dimensions are ints"):
        native.empty(2, 3.5)
