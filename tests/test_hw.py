"""Tests for cpu_opt.hw: /proc/cpuinfo fixtures of real server CPUs, the ISA cap, cross-source notes,
and the live detect()."""
from __future__ import annotations

import json
import platform
import re
from pathlib import Path

import pytest

from cpu_opt import hw

FIXTURES = Path(__file__).parent / "fixtures" / "cpuinfo"

X86_KEY = ("sse4_2", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
           "avx512_fp16", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8")
ARM_KEY = ("asimd", "sve", "sve2", "bf16", "i8mm")
AVX512_CORE = {"avx512f", "avx512bw", "avx512vl"}
AMX = {"amx_tile", "amx_bf16", "amx_int8"}

# fixture -> what a correct reading of it gives
EXPECTED = {
    "intel_cascadelake": dict(
        arch="x86_64", vendor="GenuineIntel", physical=2, logical=4, family=6, model=85,
        has={"sse4_2", "avx2", "fma"} | AVX512_CORE | {"avx512_vnni"}),
    "intel_icelake": dict(
        arch="x86_64", vendor="GenuineIntel", physical=2, logical=4, family=6, model=106,
        has={"sse4_2", "avx2", "fma"} | AVX512_CORE | {"avx512_vnni"}),
    "intel_sapphirerapids": dict(
        arch="x86_64", vendor="GenuineIntel", physical=2, logical=4, family=6, model=143,
        has={"sse4_2", "avx2", "fma"} | AVX512_CORE | {"avx512_vnni", "avx512_bf16", "avx512_fp16", "avx_vnni"} | AMX),
    "amd_zen3": dict(
        arch="x86_64", vendor="AuthenticAMD", physical=2, logical=4, family=25, model=1,
        has={"sse4_2", "avx2", "fma"}),
    "amd_zen4": dict(
        arch="x86_64", vendor="AuthenticAMD", physical=2, logical=2, family=25, model=17,
        has={"sse4_2", "avx2", "fma"} | AVX512_CORE | {"avx512_vnni", "avx512_bf16"}),
    "amd_zen5": dict(
        arch="x86_64", vendor="AuthenticAMD", physical=2, logical=4, family=26, model=2,
        has={"sse4_2", "avx2", "fma"} | AVX512_CORE | {"avx512_vnni", "avx512_bf16", "avx_vnni"}),
    "graviton2_n1": dict(
        arch="aarch64", vendor="ARM", physical=2, logical=2, part=0xD0C, core="Neoverse N1", sve_bits=0,
        graviton="Graviton2", has={"asimd"}),
    "graviton3_v1": dict(
        arch="aarch64", vendor="ARM", physical=4, logical=4, part=0xD40, core="Neoverse V1", sve_bits=256,
        graviton="Graviton3", has={"asimd", "sve", "bf16", "i8mm"}),
    "graviton4_v2": dict(
        arch="aarch64", vendor="ARM", physical=2, logical=2, part=0xD4F, core="Neoverse V2", sve_bits=128,
        graviton="Graviton4", has={"asimd", "sve", "sve2", "bf16", "i8mm"}),
}
X86_FIXTURES = [k for k, v in EXPECTED.items() if v["arch"] == "x86_64"]
ARM_FIXTURES = [k for k, v in EXPECTED.items() if v["arch"] == "aarch64"]


def text(name: str) -> str:
    return (FIXTURES / f"{name}.txt").read_text()


def info(name: str, **kw) -> hw.CPUInfo:
    return hw.build_info(text(name), **kw)


# ----------------------------------------------------------------------------- the fixtures themselves

@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_fixture_looks_like_a_real_dump(name):
    t = text(name)
    blocks = [b for b in t.split("\n\n") if b.strip()]
    assert len(blocks) == EXPECTED[name]["logical"] >= 2
    assert all(b.startswith("processor\t: ") for b in blocks)
    key = "flags\t\t: " if EXPECTED[name]["arch"] == "x86_64" else "Features\t: "
    assert all(b.count(key) == 1 for b in blocks)


# ----------------------------------------------------------------------------- identity and topology

@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_arch_vendor_and_cores(name):
    exp, i = EXPECTED[name], info(name)
    assert i.arch == exp["arch"]
    assert i.vendor == exp["vendor"]
    assert i.physical_cores == exp["physical"]
    assert i.logical_cpus == exp["logical"]
    assert i.sources == ("/proc/cpuinfo",)
    assert i.disagreements == ()


@pytest.mark.parametrize("name", X86_FIXTURES)
def test_x86_family_model_and_no_arm_fields(name):
    exp, i = EXPECTED[name], info(name)
    assert (i.family, i.model) == (exp["family"], exp["model"])
    assert i.model_name.startswith(("Intel(R) Xeon(R)", "AMD EPYC"))
    assert i.arm_core is None and i.arm_cpu_part is None and i.graviton is None
    assert i.sve_vector_bits == 0


def test_smt_siblings_are_one_physical_core():
    # Cascade Lake fixture: 4 logical CPUs, core ids 0,1,0,1 on one socket.
    i = info("intel_cascadelake")
    assert (i.logical_cpus, i.physical_cores) == (4, 2)
    # The same text with each sibling moved to a second socket: 4 distinct cores.
    two_sockets = re.sub(r"(processor\t: [23]\n(?:.*\n)*?physical id\t: )0", r"\g<1>1", text("intel_cascadelake"))
    assert two_sockets != text("intel_cascadelake")
    assert hw.build_info(two_sockets).physical_cores == 4


# ----------------------------------------------------------------------------- features

@pytest.mark.parametrize("name", X86_FIXTURES)
@pytest.mark.parametrize("feature", X86_KEY)
def test_x86_key_feature_presence(name, feature):
    i = info(name)
    expected = feature in EXPECTED[name]["has"]
    assert (feature in i.isa) is expected
    assert (feature in i.isa_uncapped) is expected
    assert i.has(feature) is expected


@pytest.mark.parametrize("name", ARM_FIXTURES)
@pytest.mark.parametrize("feature", ARM_KEY)
def test_arm_key_feature_presence(name, feature):
    i = info(name)
    expected = feature in EXPECTED[name]["has"]
    assert (feature in i.isa) is expected
    assert i.has(feature) is expected


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_no_foreign_arch_features(name):
    i = info(name)
    own = hw.X86_FEATURES if EXPECTED[name]["arch"] == "x86_64" else hw.ARM_FEATURES
    assert i.isa_uncapped <= set(own)


@pytest.mark.parametrize("name", ARM_FIXTURES)
def test_arm_core_sve_bits_and_graviton(name):
    exp, i = EXPECTED[name], info(name)
    assert i.arm_cpu_part == exp["part"]
    assert i.arm_core == exp["core"]
    assert i.sve_vector_bits == exp["sve_bits"]
    assert i.graviton == exp["graviton"]
    assert i.model_name == exp["core"]
    assert i.to_dict()["graviton"] == exp["graviton"]


def test_live_sve_length_overrides_the_usual_one_with_a_note():
    i = info("graviton3_v1", sve_vector_bits=128)
    assert i.sve_vector_bits == 128
    assert any("Neoverse V1" in n and "256" in n for n in i.disagreements)
    same = info("graviton3_v1", sve_vector_bits=256)
    assert same.sve_vector_bits == 256 and same.disagreements == ()
    # No SVE on N1: a live length is ignored.
    assert info("graviton2_n1", sve_vector_bits=128).sve_vector_bits == 0


def test_unknown_arm_part_has_no_core_name():
    t = text("graviton3_v1").replace("CPU part\t: 0xd40", "CPU part\t: 0xabc")
    i = hw.build_info(t)
    assert i.arm_core is None and i.graviton is None
    assert i.arm_cpu_part == 0xABC
    assert i.model_name == "Arm part 0xabc"
    assert i.sve_vector_bits == 128  # SVE present, width unknown: the architectural minimum


# ----------------------------------------------------------------------------- ISA cap

def test_cap_avx2_on_zen5_removes_all_avx512_and_amx():
    i = info("amd_zen5", cap="avx2")
    assert {"avx2", "fma", "sse4_2", "avx"} <= i.isa
    assert not [f for f in i.isa if f.startswith(("avx512", "amx"))]
    assert "avx_vnni" not in i.isa  # avx2_vnni is above avx2
    assert i.isa_uncapped == info("amd_zen5").isa
    assert i.isa_cap == "avx2"


def test_cap_avx2_on_spr_removes_amx():
    i = info("intel_sapphirerapids", cap="avx2")
    assert not (i.isa & AMX) and not [f for f in i.isa if f.startswith("avx512")]
    assert AMX <= i.isa_uncapped


def test_cap_avx512_core_vnni_keeps_vnni_drops_bf16():
    i = info("intel_sapphirerapids", cap="avx512_core_vnni")
    assert {"avx512_vnni", "avx512f", "avx512bw", "avx512vl", "avx2"} <= i.isa
    assert "avx512_bf16" not in i.isa
    assert "avx512_fp16" not in i.isa
    assert not (i.isa & AMX)


@pytest.mark.parametrize("level, top", [
    ("sse41", {"sse4_2"}),
    ("avx2", {"avx2", "fma"}),
    ("avx2_vnni", {"avx_vnni"}),
    ("avx512_core", {"avx512f", "avx512bw", "avx512vl"}),
    ("avx512_core_vnni", {"avx512_vnni"}),
    ("avx512_core_bf16", {"avx512_bf16"}),
    ("avx512_core_fp16", {"avx512_fp16"}),
    ("avx512_core_amx", AMX),
])
def test_each_x86_level_adds_exactly_its_features_on_spr(level, top):
    levels = list(hw.X86_ISA_LEVELS)
    below = levels[levels.index(level) - 1] if levels.index(level) else None
    if level == "avx512_core":
        below = "avx2"   # avx2_vnni is a side branch: oneDNN's AVX512_CORE does not include it
    here = info("intel_sapphirerapids", cap=level).isa
    assert top <= here
    if below:
        prev = info("intel_sapphirerapids", cap=below).isa
        assert prev < here
        assert not (top & prev)


def test_cap_asimd_on_v1_drops_sve_bf16_i8mm_and_zeroes_sve_bits():
    i = info("graviton3_v1", cap="asimd")
    assert "asimd" in i.isa
    assert not ({"sve", "sve2", "bf16", "i8mm", "svebf16", "svei8mm"} & i.isa)
    assert i.sve_vector_bits == 0
    assert {"sve", "bf16", "i8mm"} <= i.isa_uncapped


def test_cap_sve_on_v2_keeps_sve2_and_bits_but_not_bf16():
    i = info("graviton4_v2", cap="sve")
    assert {"sve", "sve2"} <= i.isa
    assert not ({"bf16", "i8mm"} & i.isa)
    assert i.sve_vector_bits == 128


@pytest.mark.parametrize("name", ["intel_sapphirerapids", "graviton4_v2"])
@pytest.mark.parametrize("cap", [None, "", "all", "ALL"])
def test_no_cap_or_all_keeps_everything(name, cap):
    i = info(name, cap=cap)
    assert i.isa == i.isa_uncapped == info(name).isa_uncapped
    assert i.isa_cap == (None if not cap else "all")


def test_cap_is_case_and_space_insensitive_and_normalized():
    i = info("amd_zen4", cap="  AVX512_Core ")
    assert i.isa == info("amd_zen4", cap="avx512_core").isa
    assert "avx512f" in i.isa and "avx512_vnni" not in i.isa
    assert i.isa_cap == "avx512_core"
    assert hw.ONEDNN_ISA_FOR_CAP[i.isa_cap] == "AVX512_CORE"


@pytest.mark.parametrize("name, cap", [
    ("amd_zen5", "avx1024"),
    ("amd_zen5", "avx512"),      # oneDNN spells it avx512_core
    ("amd_zen5", "sve"),         # an aarch64 level on x86
    ("graviton3_v1", "avx2"),    # an x86 level on aarch64
    ("graviton3_v1", "neon"),
])
def test_unknown_cap_raises_naming_the_value(name, cap):
    with pytest.raises(hw.ISACapError, match=re.escape(repr(cap))):
        info(name, cap=cap)


def test_isa_cap_error_is_a_value_error():
    assert issubclass(hw.ISACapError, ValueError)


# ----------------------------------------------------------------------------- AMX and the kernel

def test_amx_not_counted_when_os_does_not_enable_it():
    i = info("intel_sapphirerapids", amx_os_enabled=False)
    assert not (i.isa & AMX) and not (i.isa_uncapped & AMX)
    assert "avx512_fp16" in i.isa  # only AMX goes
    assert len(i.disagreements) == 1 and "AMX" in i.disagreements[0]


@pytest.mark.parametrize("enabled", [True, None])
def test_amx_counted_when_os_enables_it_or_cannot_say(enabled):
    i = info("intel_sapphirerapids", amx_os_enabled=enabled)
    assert AMX <= i.isa
    assert i.disagreements == ()


def test_amx_os_flag_irrelevant_without_amx():
    i = info("amd_zen5", amx_os_enabled=False)
    assert i.isa == info("amd_zen5").isa and i.disagreements == ()


# ----------------------------------------------------------------------------- py-cpuinfo

def _pycpuinfo_for(name: str, drop=(), add=()) -> dict:
    """What py-cpuinfo reports on Linux: the /proc/cpuinfo flags plus its own CPUID spellings."""
    flags = set(hw.parse_proc_cpuinfo(text(name))["flags"]) - set(drop) | set(add)
    return {"flags": sorted(flags), "brand_raw": "x", "l2_cache_size": 2 * 1024 * 1024}


def test_pycpuinfo_agreeing_gives_no_note():
    # py-cpuinfo's CPUID names ('avx512vnni', 'osxsave') on top of the kernel's
    py = _pycpuinfo_for("intel_cascadelake", drop={"avx512_vnni"}, add={"avx512vnni", "osxsave", "tscdeadline"})
    i = info("intel_cascadelake", pycpuinfo=py)
    assert i.disagreements == ()
    assert "py-cpuinfo" in i.sources


def test_pycpuinfo_disagreeing_gives_a_note_and_proc_wins():
    py = _pycpuinfo_for("intel_icelake", drop={"avx512_vnni"}, add={"avx512_bf16"})
    i = info("intel_icelake", pycpuinfo=py)
    assert i.isa == info("intel_icelake").isa  # /proc/cpuinfo wins
    assert len(i.disagreements) == 1
    note = i.disagreements[0]
    assert "py-cpuinfo" in note and "avx512_vnni" in note and "avx512_bf16" in note


def test_pycpuinfo_disagreeing_on_arm_gives_a_note():
    py = _pycpuinfo_for("graviton3_v1", drop={"sve"})
    i = info("graviton3_v1", pycpuinfo=py)
    assert any("py-cpuinfo" in n and "sve" in n for n in i.disagreements)


def test_pycpuinfo_caches_used_when_no_sysfs_caches():
    i = info("amd_zen4", pycpuinfo=_pycpuinfo_for("amd_zen4"))
    assert dict(i.cache_sizes) == {"L2": 2 * 1024 * 1024}
    i = info("amd_zen4", pycpuinfo=_pycpuinfo_for("amd_zen4"), caches={"L1d": 32768, "L3": 1 << 25})
    assert dict(i.cache_sizes) == {"L1d": 32768, "L3": 1 << 25}


def test_pycpuinfo_non_numeric_cache_size_is_ignored():
    py = _pycpuinfo_for("amd_zen4") | {"l2_cache_size": "1 MiB"}
    i = info("amd_zen4", pycpuinfo=py)  # must not raise
    assert "L2" in i.cache_sizes  # falls back on /proc/cpuinfo 'cache size'
    assert i.cache_sizes["L2"] == 1024 * 1024


# ----------------------------------------------------------------------------- torch

def test_torch_avx512_without_avx512_flags_is_noted():
    i = info("amd_zen3", torch_capability="AVX512")
    assert "torch" in i.sources
    assert len(i.disagreements) == 1
    assert "AVX512" in i.disagreements[0] and "avx512f" in i.disagreements[0]


@pytest.mark.parametrize("name, cap", [("intel_sapphirerapids", "AVX512"), ("amd_zen4", "AVX512"),
                                       ("amd_zen3", "AVX2"), ("graviton3_v1", "SVE256")])
def test_torch_capability_matching_flags_gives_no_note(name, cap):
    i = info(name, torch_capability=cap)
    assert i.disagreements == ()
    assert i.torch_capability == cap


def test_torch_avx2_on_avx512_cpu_is_noted():
    i = info("intel_cascadelake", torch_capability="AVX2")
    assert any("AVX-512" in n for n in i.disagreements)


def test_torch_sve_on_cpu_without_sve_is_noted():
    i = info("graviton2_n1", torch_capability="SVE256")
    assert any("sve" in n for n in i.disagreements)


# ----------------------------------------------------------------------------- caches and the record

@pytest.mark.parametrize("name, level, kib", [
    ("intel_cascadelake", "L3", 36608),      # Intel: 'cache size' is the last-level cache
    ("intel_sapphirerapids", "L3", 107520),
    ("amd_zen3", "L2", 512),                 # AMD: the per-core L2
    ("amd_zen5", "L2", 1024),
])
def test_proc_cache_size_fallback_names_the_right_level(name, level, kib):
    assert dict(info(name).cache_sizes) == {level: kib * 1024}


def test_cpuinfo_is_immutable_hashable_and_serializable():
    i = info("intel_sapphirerapids", caches={"L1d": 49152, "L2": 2 << 20})
    with pytest.raises(TypeError):
        i.cache_sizes["L2"] = 0
    with pytest.raises(AttributeError):
        i.physical_cores = 1
    assert hash(i) == hash(info("intel_sapphirerapids", caches={"L1d": 49152, "L2": 2 << 20}))
    d = json.loads(json.dumps(i.to_dict()))
    assert d["cache_sizes"] == {"L1d": 49152, "L2": 2 << 20}
    assert d["isa"] == sorted(i.isa) and "amx_tile" in d["isa"]


def test_empty_text_does_not_crash():
    i = hw.build_info("")
    assert i.physical_cores == 1 and i.logical_cpus == 1 and i.isa == frozenset()


# ----------------------------------------------------------------------------- the live machine

@pytest.fixture
def fresh_detect(monkeypatch):
    for var in ("CPU_OPT_MAX_ISA", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        monkeypatch.delenv(var, raising=False)
    hw._detect_cached.cache_clear()
    yield
    hw._detect_cached.cache_clear()


def _machine() -> str:
    m = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(m, m)


def test_detect_arch_matches_platform(fresh_detect):
    i = hw.detect()
    assert i.arch == _machine()
    assert 1 <= i.physical_cores <= i.logical_cpus
    assert i.isa == i.isa_uncapped and i.isa_cap is None
    assert i.isa_uncapped, "a live CPU reports some SIMD features"
    assert hw.detect() is i  # cached


def test_detect_consistent_with_torch(fresh_detect):
    torch = pytest.importorskip("torch")
    cap = str(torch.backends.cpu.get_cpu_capability()).upper()
    i = hw.detect()
    assert i.torch_capability is not None and i.torch_capability.upper() == cap
    if cap == "AVX512":
        assert {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= i.isa_uncapped
    if cap in ("AVX2", "AVX512"):
        assert {"avx2", "fma"} <= i.isa_uncapped
    if cap.startswith("SVE"):
        assert "sve" in i.isa_uncapped
    if cap == "SVE256":
        assert i.sve_vector_bits == 256
    assert not [n for n in i.disagreements if n.startswith("torch reports capability")]


def test_detect_honours_cap_env(fresh_detect, monkeypatch):
    uncapped = hw.detect()
    level = "sse41" if uncapped.arch == "x86_64" else "asimd"
    levels = hw.X86_ISA_LEVELS if uncapped.arch == "x86_64" else hw.ARM_ISA_LEVELS
    monkeypatch.setenv("CPU_OPT_MAX_ISA", level)
    capped = hw.detect()
    assert capped.isa_cap == level
    assert capped.isa <= levels[level]
    assert capped.isa_uncapped == uncapped.isa_uncapped
    if uncapped.arch == "x86_64":
        assert "avx2" not in capped.isa and "avx" not in capped.isa
    else:
        assert "sve" not in capped.isa and capped.sve_vector_bits == 0
    monkeypatch.delenv("CPU_OPT_MAX_ISA")
    assert hw.detect().isa == uncapped.isa


def test_detect_rejects_unknown_cap_env(fresh_detect, monkeypatch):
    monkeypatch.setenv("CPU_OPT_MAX_ISA", "avx9000")
    with pytest.raises(hw.ISACapError, match="avx9000"):
        hw.detect()


def test_onednn_cap_variable_caps_detect_and_the_lower_cap_wins(fresh_detect, monkeypatch):
    if hw.detect().arch != "x86_64":
        pytest.skip("ONEDNN_MAX_CPU_ISA is read on x86-64 only (aarch64 oneDNN levels are torch's)")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "SSE41")
    assert hw.isa_cap_from_env() == "sse41" and hw.isa_cap_source() == "ONEDNN_MAX_CPU_ISA"
    assert "avx2" not in hw.detect().isa
    monkeypatch.setenv("CPU_OPT_MAX_ISA", "avx512_core")
    assert hw.isa_cap_from_env() == "sse41"
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "ALL")
    assert hw.isa_cap_from_env() == "avx512_core" and hw.isa_cap_source() == "CPU_OPT_MAX_ISA"
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_AMX_FP16")
    monkeypatch.delenv("CPU_OPT_MAX_ISA")
    assert hw.isa_cap_from_env() == "avx512_core_amx"
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX9000")
    with pytest.warns(RuntimeWarning, match="AVX9000"):
        assert hw.isa_cap_from_env() is None


def test_export_cap_sets_library_variables_only_when_unset(monkeypatch):
    if hw.detect().arch != "x86_64":
        pytest.skip("x86-64 only")
    for var in ("ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS"):
        # set, then delete: monkeypatch then restores the variable's real state afterwards (a bare
        # delenv of an unset variable records nothing, and export_cap's AVX2 leaked into later tests,
        # capping hw.detect() there)
        monkeypatch.setenv(var, "unset")
        monkeypatch.delenv(var)
    monkeypatch.setenv("CPU_OPT_MAX_ISA", "avx2")
    hw.export_cap()
    import os

    assert os.environ["ONEDNN_MAX_CPU_ISA"] == "AVX2"
    assert os.environ["MKL_ENABLE_INSTRUCTIONS"] == "AVX2"
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "SSE41")
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "SSE4_2")
    hw.export_cap()
    assert os.environ["ONEDNN_MAX_CPU_ISA"] == "SSE41"  # the user's own settings stay
    assert os.environ["MKL_ENABLE_INSTRUCTIONS"] == "SSE4_2"


def test_every_reported_feature_belongs_to_a_cap_level():
    """A feature outside every level would survive every cap (CPU_OPT_MAX_ISA=sse41 would keep it)."""
    for features, levels in ((hw.X86_FEATURES, hw.X86_ISA_LEVELS), (hw.ARM_FEATURES, hw.ARM_ISA_LEVELS)):
        leveled = set().union(*levels.values())
        assert set(features) <= leveled, sorted(set(features) - leveled)
    for name in X86_FIXTURES:
        assert hw.build_info(text(name), cap="sse41").isa <= hw.X86_ISA_LEVELS["sse41"]


@pytest.mark.parametrize("name, micro", [("amd_zen3", "Zen 3"), ("amd_zen5", "Zen 5"), ("intel_icelake", "Ice Lake-SP"),
                                         ("intel_sapphirerapids", "Sapphire Rapids"), ("graviton3_v1", "Neoverse V1")])
def test_label_names_the_microarchitecture(name, micro):
    i = info(name)
    assert i.microarchitecture == micro
    assert micro in i.label and i.model_name in i.label
    if i.arch == "x86_64":
        assert f"family {i.family} model {i.model}" in i.label


@pytest.mark.parametrize("name", X86_FIXTURES)
def test_flags_are_the_kernel_flags(name):
    i = info(name)
    line = next(ln for ln in text(name).splitlines() if ln.startswith("flags"))
    assert i.flags == frozenset(line.split(":", 1)[1].split())
    assert i.isa_uncapped <= i.flags


def test_bf16_and_vnni_predicates_separate_accepting_from_native():
    icx, z5, z3, spr = info("intel_icelake"), info("amd_zen5"), info("amd_zen3"), info("intel_sapphirerapids")
    assert hw.has_avx512_core(icx) and not hw.has_native_bf16(icx) and hw.has_vnni(icx)
    assert hw.has_avx512_core(z5) and hw.has_native_bf16(z5) and hw.has_vnni(z5)
    assert not hw.has_avx512_core(z3) and not hw.has_native_bf16(z3) and not hw.has_vnni(z3)
    assert hw.has_native_bf16(spr) and not hw.has_native_bf16(info("intel_sapphirerapids", cap="avx512_core_vnni"))
    assert not hw.has_avx512_core(info("amd_zen5", cap="avx2"))


def test_the_avx512_core_cap_drops_avx_vnni_as_onednn_does():
    """oneDNN's AVX512_CORE excludes AVX2_VNNI: capped there, a CPU with both AVX-VNNI and AVX512_VNNI
    (Sapphire Rapids and later) must have no VNNI at all, or 8-bit activations would saturate."""
    feats = {"avx2", "avx_vnni", "avx512f", "avx512_vnni", "amx_int8"}
    core = hw.apply_isa_cap("x86_64", feats, "avx512_core")
    assert core == {"avx2", "avx512f"}
    assert hw.apply_isa_cap("x86_64", feats, "avx2_vnni") == {"avx2", "avx_vnni"}
    assert hw.apply_isa_cap("x86_64", feats, "avx512_core_vnni") == {"avx2", "avx_vnni", "avx512f", "avx512_vnni"}
