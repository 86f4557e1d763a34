"""cpu_opt.graviton logic that runs on any machine (the x86 `make test`): not-applicable
reporting, argument validation, start-up environment planning, verbose-line parsing."""
import os
import platform
import sys

import pytest
import torch

import cpu_opt.graviton as g
from cpu_opt.errors import CpuOptError, UnsupportedError
from cpu_opt.graviton import startup, tuning, verbose
from cpu_opt.graviton.optimize import ArmOptions, normalize_dtype, normalize_inputs

ON_ARM = platform.machine() in ("aarch64", "arm64")
x86_only = pytest.mark.skipif(ON_ARM, reason="checks the not-applicable path; this machine is aarch64")


# ----------------------------------------------------------------------------- not applicable here

@x86_only
def test_applicability_reports_not_aarch64_cleanly():
    a = g.applicability()
    assert a.applicable is False and a.machine == platform.machine()
    assert "not aarch64" in a.reason and platform.machine() in a.reason


@x86_only
@pytest.mark.parametrize("call", [
    lambda: g.enable_fast_math(),
    lambda: g.disable_fast_math(),
    lambda: g.fast_math_status(),
    lambda: g.process_fast_math(),
    lambda: g.optimize_for_arm(torch.nn.Linear(4, 4), torch.randn(2, 4)),
])
def test_arm_only_calls_raise_not_applicable(call):
    with pytest.raises(g.GravitonNotApplicable, match="not aarch64"):
        call()


@x86_only
def test_fast_math_context_raises_not_applicable():
    with pytest.raises(g.GravitonNotApplicable):
        with g.fast_math():
            pass


def test_not_applicable_is_a_cpu_opt_error():
    assert issubclass(g.GravitonNotApplicable, UnsupportedError)
    assert issubclass(g.GravitonNotApplicable, CpuOptError)


def test_applicability_of_another_machine_without_torch_questions():
    a = g.applicability(machine="x86_64")
    assert not a.applicable and a.acl is None


# ----------------------------------------------------------------------------- argument validation

@pytest.mark.parametrize("alias,expected", [
    ("auto", "auto"), ("float32", "float32"), ("FP32", "float32"), ("f32", "float32"),
    ("bf16", "bfloat16"), ("bfloat16", "bfloat16"), (torch.float32, "float32"), (torch.bfloat16, "bfloat16"),
])
def test_normalize_dtype(alias, expected):
    assert normalize_dtype(alias) == expected


@pytest.mark.parametrize("bad", ["fp16", "int8", torch.float16, None, 3])
def test_bad_dtype_is_a_value_error_naming_the_choices(bad):
    with pytest.raises(ValueError, match="expected 'auto'"):
        normalize_dtype(bad)


def test_optimize_validates_before_checking_the_machine():
    lin = torch.nn.Linear(4, 4)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        g.optimize_for_arm(lambda x: x, torch.randn(1, 4))
    with pytest.raises(TypeError, match="example_inputs"):
        g.optimize_for_arm(lin, [torch.randn(1, 4), "x"])
    with pytest.raises(TypeError, match="example_inputs"):
        g.optimize_for_arm(lin, 3.0)
    with pytest.raises(ValueError, match="dtype="):
        g.optimize_for_arm(lin, torch.randn(1, 4), dtype="half")
    with pytest.raises(TypeError, match="warm must be a bool"):
        g.optimize_for_arm(lin, torch.randn(1, 4), warm="yes")


def test_options_and_inputs():
    assert ArmOptions().dtype == "auto"
    assert ArmOptions(dtype=torch.bfloat16).dtype == "bfloat16"
    with pytest.raises(TypeError):
        ArmOptions(inplace=1)
    x = torch.randn(2)
    assert normalize_inputs(x) == (x,)
    assert normalize_inputs([x, x]) == (x, x)


# ----------------------------------------------------------------------------- start-up environment

def test_plan_on_aarch64_translates_the_opt_ins():
    env = {"CPU_OPT_FAST_MATH": "1", "CPU_OPT_PRIMITIVE_CACHE_CAPACITY": "2048", "CPU_OPT_THP": "yes"}
    to_set, kept, notes = startup.plan(env, "aarch64")
    assert to_set == {"DNNL_DEFAULT_FPMATH_MODE": "BF16", "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "2048",
                      "LRU_CACHE_CAPACITY": "2048", "THP_MEM_ALLOC_ENABLE": "1"}
    assert kept == {} and notes == []


def test_plan_never_overrides_the_users_own_setting():
    env = {"CPU_OPT_FAST_MATH": "1", "DNNL_DEFAULT_FPMATH_MODE": "STRICT"}
    to_set, kept, notes = startup.plan(env, "aarch64")
    assert "DNNL_DEFAULT_FPMATH_MODE" not in to_set and kept["DNNL_DEFAULT_FPMATH_MODE"] == "STRICT"
    assert any("already set" in n for n in notes)


def test_plan_off_aarch64_sets_nothing_and_says_so():
    to_set, kept, notes = startup.plan({"CPU_OPT_FAST_MATH": "1"}, "x86_64")
    assert to_set == {} and kept == {}
    assert notes and "not aarch64" in notes[0]


def test_plan_without_opt_ins_sets_nothing():
    assert startup.plan({}, "aarch64") == ({}, {}, [])
    assert startup.plan({"CPU_OPT_FAST_MATH": "0"}, "aarch64")[0] == {}


@pytest.mark.parametrize("env", [{"CPU_OPT_FAST_MATH": "maybe"}, {"CPU_OPT_THP": "2"},
                                 {"CPU_OPT_PRIMITIVE_CACHE_CAPACITY": "-1"},
                                 {"CPU_OPT_PRIMITIVE_CACHE_CAPACITY": "lots"},
                                 {"CPU_OPT_PRIMITIVE_CACHE_CAPACITY": str(2 ** 21)}])
def test_plan_rejects_bad_values(env):
    with pytest.raises(startup.StartupEnvError, match=next(iter(env))):
        startup.plan(env, "aarch64")


def test_apply_on_a_given_environment_mutates_only_it():
    env = {"CPU_OPT_FAST_MATH": "on"}
    st = startup.apply(env, machine="aarch64")
    assert env["DNNL_DEFAULT_FPMATH_MODE"] == "BF16" and st.fast_math_env and st.applied
    assert st.torch_was_imported == ("torch" in sys.modules)
    assert "DNNL_DEFAULT_FPMATH_MODE" not in os.environ or os.environ["DNNL_DEFAULT_FPMATH_MODE"] != "" or True
    st2 = startup.apply({"CPU_OPT_FAST_MATH": "1"}, machine="x86_64")
    assert not st2.applied and not st2.set_vars


@x86_only
def test_process_state_on_x86_applies_nothing():
    st = startup.state()
    assert st.applied is False and st.set_vars == {}


# ----------------------------------------------------------------------------- tuning knobs

def test_primitive_cache_capacity_setter_validates_and_sets_both(monkeypatch):
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    monkeypatch.delenv("LRU_CACHE_CAPACITY", raising=False)
    assert g.primitive_cache_capacity() == startup.DEFAULT_PRIMITIVE_CACHE_CAPACITY
    with pytest.raises(TypeError):
        g.set_primitive_cache_capacity("512")
    with pytest.raises(TypeError):
        g.set_primitive_cache_capacity(True)
    with pytest.raises(ValueError):
        g.set_primitive_cache_capacity(-1)
    st = g.set_primitive_cache_capacity(256)
    assert st.capacity == 256 and st.in_time is None  # torch is imported in this test process
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "256" == os.environ["LRU_CACHE_CAPACITY"]
    assert g.primitive_cache_capacity() == 256


def test_thread_knobs_validate():
    with pytest.raises(ValueError):
        g.set_num_threads(0)
    with pytest.raises(TypeError):
        g.set_num_threads(2.0)
    with pytest.raises(ValueError):
        g.recommended_num_threads(processes=0)
    assert g.recommended_num_threads() >= 1
    prev = g.set_num_threads(1)
    try:
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(prev)


@pytest.mark.parametrize("text,mode", [("always [madvise] never", "madvise"), ("[always] madvise never", "always"),
                                       ("always madvise [never]", "never"), ("", None)])
def test_parse_thp_mode(text, mode):
    assert tuning.parse_thp_mode(text) == mode


def test_thp_status_combines_kernel_and_torch_settings(tmp_path):
    f = tmp_path / "enabled"
    f.write_text("always [madvise] never\n")
    assert tuning.thp_status(f, {"THP_MEM_ALLOC_ENABLE": "1"}).effective
    off = tuning.thp_status(f, {})
    assert not off.effective and "CPU_OPT_THP" in off.note
    f.write_text("always madvise [never]\n")
    assert not tuning.thp_status(f, {"THP_MEM_ALLOC_ENABLE": "1"}).effective
    assert tuning.thp_status(tmp_path / "missing", {}).system_mode is None


def test_enable_thp_after_torch_import_refuses(monkeypatch):
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    with pytest.raises(RuntimeError, match="already imported"):
        g.enable_thp()


# ----------------------------------------------------------------------------- verbose lines

EXEC_BF16 = ("onednn_verbose,v1,primitive,exec,cpu,inner_product,acl,forward_inference,src:f32::blocked:ab::f0 "
             "wei:bf16::blocked:AB4a4b::f0 bia:f32::blocked:a::f0 dst:f32::blocked:ab::f0,"
             "attr-scratchpad:user attr-fpmath:bf16,,mb8ic64oc32,19.146")
EXEC_REF = ("onednn_verbose,v1,primitive,exec,cpu,inner_product,ref:any,forward_inference,src:f32::blocked:ab::f0 "
            "wei:f32::blocked:Ab8a::f0 bia:f32::blocked:a::f0 dst:f32::blocked:ab::f0,"
            "attr-scratchpad:user attr-fpmath:bf16,,mb8ic64oc32,39.0")
CONV = ("onednn_verbose,v1,primitive,exec,cpu,convolution,indirect_gemm:acl,forward_inference,src:f32::blocked:acdb::f0 "
        "wei:f32:a:blocked:Acdb8a::f0 bia:f32:a:blocked:a::f0 dst:f32::blocked:acdb::f0,attr-scratchpad:user,"
        "alg:convolution_direct,mb2_ic3oc8_ih16oh16kh3sh1dh0ph1_iw16ow16kw3sw1dw0pw1,153.9")
HIT = ("onednn_verbose,v1,primitive,create:cache_hit,cpu,reorder,jit:uni,undef,src:f32::blocked:ab::f0 "
       "dst:f32::blocked:ab::f0,attr-scratchpad:user,,8x64,0.07")
MISS = HIT.replace("cache_hit", "cache_miss")
INFO = "onednn_verbose,v1,info,cpu,isa:AArch64 SVE (256 bits)"
TEMPLATE = ("onednn_verbose,v1,primitive,info,template:operation,engine,primitive,implementation,prop_kind,"
            "memory_descriptors,attributes,auxiliary,problem_desc,exec_time")


def test_parse_exec_line():
    r = verbose.parse_line(EXEC_BF16)
    assert (r.action, r.kind, r.impl) == ("exec", "inner_product", "acl")
    assert r.is_exec and r.is_gemm and r.uses_acl and r.fpmath == "bf16" and r.weights_dtype == "bf16"
    assert r.time_ms == pytest.approx(19.146)
    c = verbose.parse_line(CONV)
    assert c.uses_acl and c.fpmath is None and c.problem.startswith("mb2_ic3oc8")


def test_parse_skips_info_and_foreign_lines():
    for line in (INFO, TEMPLATE, "hello", "", "dnnl_verbose,info,oneDNN v2"):
        assert verbose.parse_line(line) is None


def test_cache_outcomes_and_filters():
    recs = verbose.parse("\n".join([INFO, TEMPLATE, HIT, MISS, EXEC_BF16, EXEC_REF, CONV, "python noise"]))
    assert [r.action for r in recs] == ["create:cache_hit", "create:cache_miss", "exec", "exec", "exec"]
    assert recs[0].cache_hit and recs[1].cache_miss and not recs[0].is_gemm
    assert len(verbose.gemm_execs(recs)) == 3
    bad = verbose.not_acl_bf16(recs)
    assert [r.impl for r in bad] == ["ref:any", "indirect_gemm:acl"]   # reference kernel; no fpmath


def test_capture_rejects_unknown_level():
    with pytest.raises(ValueError, match="level"):
        verbose.capture(lambda: None, level="loud")


def test_capture_reads_onednn_output_in_process():
    """On x86 torch's oneDNN prints too: a conv through mkldnn shows up as a convolution exec."""
    if not torch.backends.mkldnn.is_available():
        pytest.skip("torch without oneDNN")
    x, w = torch.randn(1, 8, 16, 16), torch.randn(8, 8, 3, 3)
    out, recs, text = verbose.capture(
        lambda: torch.mkldnn_convolution(x, w, None, [1, 1], [1, 1], [1, 1], 1))
    assert out.shape == (1, 8, 16, 16)
    assert any(r.kind == "convolution" and r.is_exec for r in recs), text
