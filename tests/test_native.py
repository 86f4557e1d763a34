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
