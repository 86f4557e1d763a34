"""cpu_opt.graviton on aarch64 (emulated Neoverse V1 and N1; see graviton/emulation/).

The V1 run starts without any fast-math environment; the N1 run starts with
CPU_OPT_FAST_MATH=1 (process-wide fast-math requested), which a core without BF16 must ignore.
"""
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

import cpu_opt.graviton as g
from cpu_opt import hw
from cpu_opt.errors import UnsupportedError
from cpu_opt.graviton import verbose

import graviton_zoo as zoo


def cosine(a, b):
    a, b = a.double().flatten(), b.double().flatten()
    return float(a @ b / (a.norm() * b.norm()))


def eager(case):
    with torch.no_grad():
        return case.model(case.example)


_OPTIMIZED = {}


def optimized(name, dtype):
    """One optimize_for_arm per (model, dtype) per process: later calls reuse the warmed module."""
    key = (name, dtype)
    if key not in _OPTIMIZED:
        case = zoo.make(name)
        _OPTIMIZED[key] = (case, g.optimize_for_arm(case.model, case.example, dtype=dtype))
    return _OPTIMIZED[key]


# ----------------------------------------------------------------------------- both cores

def test_detection_matches_the_emulated_core(expect_core):
    info = hw.detect()
    assert info.arch == "aarch64"
    assert info.arm_core == expect_core
    if expect_core == "Neoverse V1":
        assert info.sve_vector_bits == 256
        assert {"sve", "bf16", "i8mm", "asimd"} <= info.isa
        assert info.graviton == "Graviton3"
        assert info.torch_capability == "SVE256"
    else:
        assert "bf16" not in info.isa and "sve" not in info.isa and "asimd" in info.isa
        assert info.sve_vector_bits == 0
        assert info.graviton == "Graviton2"


def test_applicable_with_acl_and_without_cpu_opt_native_or_dnnl():
    a = g.applicability()
    assert a.applicable and a.acl, a.reason
    assert torch.ops.mkldnn._is_mkldnn_acl_supported()
    assert torch.__version__.startswith("2.9.1")
    # the aarch64 path must not have loaded cpu_opt's C kernels (there is no compiler in the root)
    assert "cpu_opt._native" not in sys.modules


@pytest.mark.parametrize("name", zoo.NAMES)
def test_repeated_calls_hit_the_primitive_cache(name):
    case, opt = optimized(name, "auto")   # optimize warmed it with the example shape
    out, recs, text = verbose.capture(opt, case.example, level="create")
    misses = [r.line for r in recs if r.cache_miss]
    assert not misses, "new primitives created on a repeated call:\n" + "\n".join(misses)
    assert len(verbose.gemm_execs(recs)) >= case.gemms_layers, text
    out2 = opt(case.example)
    assert torch.equal(out, out2)


def test_tuning_knobs():
    prev = g.set_num_threads(1)
    try:
        assert torch.get_num_threads() == 1
    finally:
        g.set_num_threads(prev)
    assert torch.get_num_threads() == prev
    with pytest.raises(ValueError):
        g.set_num_threads(0)
    st = g.set_primitive_cache_capacity(512)
    assert st.capacity == 512 and st.in_time is None   # torch is imported: cannot be sure
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "512" == os.environ["LRU_CACHE_CAPACITY"]
    assert g.primitive_cache_capacity() == 512
    with pytest.raises(RuntimeError, match="already imported"):
        g.enable_thp()
    assert g.thp_status().system_mode in ("always", "madvise", "never", None)
    assert g.recommended_num_threads() >= 1


# ----------------------------------------------------------------------------- Neoverse V1 (BF16)

@pytest.mark.v1
@pytest.mark.parametrize("name", zoo.NAMES)
def test_v1_auto_runs_every_gemm_on_acl_with_bf16_fast_math(name):
    case, opt = optimized(name, "auto")
    assert opt.plan.dtype == "bfloat16", opt.report()
    ref = eager(case)
    out, recs, text = verbose.capture(opt, case.example)
    gemms = verbose.gemm_execs(recs)
    assert len(gemms) >= case.gemms_fast_math, text
    bad = verbose.not_acl_bf16(recs)
    assert not bad, "GEMMs not on ACL with attr-fpmath:bf16:\n" + "\n".join(r.line for r in bad)
    assert cosine(out, ref) >= 0.999
    # bf16 multiplies really happened: not bit-identical to fp32
    assert (out - ref).abs().max() > 1e-6


@pytest.mark.v1
def test_v1_runtime_switch_covers_mm_bmm_linear_without_bias_and_conv():
    torch.manual_seed(0)
    x, w = torch.randn(16, 64), torch.randn(32, 64)
    a, b = torch.randn(4, 16, 64), torch.randn(4, 64, 16)
    img, cw = torch.randn(2, 8, 16, 16), torch.randn(8, 8, 3, 3)
    ops = {
        "mm": lambda: x @ w.t(),
        "linear_no_bias": lambda: F.linear(x, w),
        "bmm": lambda: torch.bmm(a, b),
        "conv": lambda: torch.mkldnn_convolution(img, cw, None, [1, 1], [1, 1], [1, 1], 1),
    }
    refs = {k: f() for k, f in ops.items()}
    st = g.enable_fast_math()
    try:
        assert st.runtime and st.active and st.core_has_bf16
        for k, f in ops.items():
            out, recs, text = verbose.capture(f)
            gemms = verbose.gemm_execs(recs)
            assert len(gemms) >= 1 and not verbose.not_acl_bf16(recs), f"{k}:\n{text}"
            assert cosine(out, refs[k]) >= 0.999
    finally:
        st = g.disable_fast_math()
    assert not st.runtime
    # off again: the same ops are fp32 (mm goes back to OpenBLAS, conv to fp32 ACL)
    for k, f in ops.items():
        out, recs, _ = verbose.capture(f)
        assert all(r.fpmath is None for r in verbose.gemm_execs(recs)), k
        torch.testing.assert_close(out, refs[k], rtol=1e-4, atol=1e-5)


@pytest.mark.v1
def test_v1_fast_math_context_restores_the_previous_setting():
    mk = torch.backends.mkldnn
    before = (mk.matmul.fp32_precision, mk.conv.fp32_precision)
    with g.fast_math():
        assert mk.matmul.fp32_precision == "bf16" == mk.conv.fp32_precision
        with g.fast_math(False):
            assert mk.matmul.fp32_precision == "none"
        assert mk.matmul.fp32_precision == "bf16"
    assert (mk.matmul.fp32_precision, mk.conv.fp32_precision) == before
    with pytest.raises(TypeError):
        with g.fast_math("yes"):
            pass


@pytest.mark.v1
@pytest.mark.parametrize("name", zoo.NAMES)
def test_v1_float32_is_exact_and_strict(name):
    case, opt = optimized(name, "float32")
    assert opt.plan.dtype == "float32" and opt.plan.linear_mode == "packed"
    ref = eager(case)
    with g.fast_math():          # a global run-time switch must not leak into an fp32 module
        out, recs, text = verbose.capture(opt, case.example)
    gemms = verbose.gemm_execs(recs)
    assert len(gemms) == case.gemms_layers, text
    assert all(r.uses_acl and r.fpmath is None for r in gemms), text
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.v1
def test_v1_process_default_is_fp32_without_opt_in():
    assert g.process_fast_math() == "f32"


@pytest.mark.v1
@pytest.mark.parametrize("how", ["CPU_OPT_FAST_MATH=1", "DNNL_DEFAULT_FPMATH_MODE=BF16"])
def test_v1_process_wide_fast_math(how):
    """A fresh process started with process-wide fast-math (cpu_opt's opt-in, or oneDNN's own
    variable): eager Linear with bias (addmm) gets bf16 too, and optimize packs Linear weights once
    in bf16 layout (no per-call weight reorder)."""
    script = textwrap.dedent("""
        import ctypes, sys
        import cpu_opt.graviton as g, torch
        libc = ctypes.CDLL(None)
        def mark(s):  # oneDNN prints through C stdio: flush it before Python prints the marker
            libc.fflush(None)
            print(s, flush=True)
        sys.path.insert(0, sys.argv[1])
        import graviton_zoo as zoo
        mark(f"HOOK torch_was_imported={g.startup.state().torch_was_imported}")
        pm = g.process_fast_math()
        mark(f"PROCESS {pm}")
        lin = torch.nn.Linear(64, 32).eval()
        x = torch.randn(2, 16, 64)
        with torch.no_grad():
            lin(x)
        mark("MARK-OPT")
        case = zoo.make("mlp")
        opt = g.optimize_for_arm(case.model, case.example)
        mark(f"LINEAR-MODE {opt.plan.linear_mode}")
        mark("MARK-RUN")
        opt(case.example)
        mark("MARK-END")
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DNNL_", "ONEDNN_", "CPU_OPT_FAST"))}
    var, value = how.split("=")
    env.update({var: value, "ONEDNN_VERBOSE": "1"})
    r = subprocess.run([sys.executable, "-c", script, os.path.dirname(zoo.__file__)], env=env,
                       capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = r.stdout
    if var == "CPU_OPT_FAST_MATH":
        # oneDNN takes its default fpmath when torch loads: cpu_opt's start-up hook must run first
        assert "HOOK torch_was_imported=False" in out, (
            "cpu_opt.graviton.startup.apply() ran after torch was imported, so CPU_OPT_FAST_MATH came too "
            "late; `import cpu_opt` must call it before anything imports torch (first lines of "
            "cpu_opt/__init__.py)")
    assert "PROCESS bf16" in out, out[:3000]
    eager_part = out.split("PROCESS", 1)[1].split("MARK-OPT")[0]
    eager_gemms = verbose.gemm_execs(verbose.parse(eager_part))
    assert eager_gemms and not verbose.not_acl_bf16(eager_gemms), eager_part
    assert "LINEAR-MODE packed" in out
    run_part = out.split("MARK-RUN")[1].split("MARK-END")[0]
    recs = verbose.parse(run_part)
    gemms = verbose.gemm_execs(recs)
    assert len(gemms) == 3 and not verbose.not_acl_bf16(gemms), run_part
    assert all(r.kind == "inner_product" and r.weights_dtype == "bf16" for r in gemms), run_part
    assert not [r for r in recs if r.kind == "reorder"], "weights were reordered per call:\n" + run_part


# ----------------------------------------------------------------------------- Neoverse N1 (no BF16)

@pytest.mark.n1
def test_n1_ignores_process_wide_fast_math_request():
    assert os.environ.get("CPU_OPT_FAST_MATH") == "1"
    assert os.environ.get("DNNL_DEFAULT_FPMATH_MODE") == "BF16"   # set by cpu_opt's start-up hook
    assert g.process_fast_math() == "f32"


@pytest.mark.n1
@pytest.mark.parametrize("name", zoo.NAMES)
def test_n1_auto_is_fp32_exact_on_acl(name):
    case, opt = optimized(name, "auto")
    assert opt.plan.dtype == "float32" and not opt.plan.core_has_bf16, opt.report()
    ref = eager(case)
    out, recs, text = verbose.capture(opt, case.example)
    gemms = verbose.gemm_execs(recs)
    assert len(gemms) == case.gemms_layers and all(r.uses_acl for r in gemms), text
    assert all(r.weights_dtype == "f32" for r in gemms), text
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.n1
def test_n1_explicit_bf16_is_refused():
    case = zoo.make("mlp")
    with pytest.raises(UnsupportedError, match="BF16"):
        g.optimize_for_arm(case.model, case.example, dtype="bfloat16")


@pytest.mark.n1
def test_n1_runtime_fast_math_stays_fp32():
    torch.manual_seed(0)
    a, b = torch.randn(4, 16, 64), torch.randn(4, 64, 16)
    ref = torch.bmm(a.double(), b.double())
    with g.fast_math():
        st = g.fast_math_status()
        assert st.runtime and not st.active and not st.core_has_bf16
        out = torch.bmm(a, b)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
