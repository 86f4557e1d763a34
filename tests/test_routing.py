"""The routing table on fixture CPUs: routes follow features and the ISA cap."""
from pathlib import Path

import pytest

from cpu_opt import hw, routing

FIX = Path(__file__).parent / "fixtures" / "cpuinfo"


def info(name, cap=None):
    return hw.build_info((FIX / f"{name}.txt").read_text(), cap=cap)


def test_zen5_routes():
    z5 = info("amd_zen5")
    assert routing.route("gemm", "bf16", z5).backend == "onednn"
    assert routing.route("gemm", "fp32", z5).backend == "onednn"
    assert routing.route("gemm", "int8", z5).backend == "onednn"
    # AVX512_BF16 without AMX: cpu_opt's fused dot-product kernel for bf16 graphs and int8 graphs alike
    assert routing.route("attention", "bf16", z5).backend == "dpbf16"
    assert routing.route("attention", "int8", z5).backend == "dpbf16"
    assert routing.route("gnn", "fp32", z5).backend == "native_avx512"
    assert routing.auto_dtype(z5) == "bf16"


def test_zen5_capped_to_avx2_changes_routes():
    z5 = info("amd_zen5", cap="avx2")
    assert routing.route("gemm", "bf16", z5).backend == "torch"
    assert routing.route("gemm", "int8", z5).backend == "fbgemm"
    assert routing.route("attention", "bf16", z5).backend == "torch_flash"
    assert routing.route("attention", "int8", z5).backend == "torch_flash"
    assert routing.route("gnn", "fp32", z5).backend == "native_avx2"
    assert routing.auto_dtype(z5) == "fp32"


def test_amx_takes_flash_attention():
    spr = info("intel_sapphirerapids")
    assert routing.route("attention", "bf16", spr).backend == "torch_flash"
    assert routing.route("attention", "int8", spr).backend == "amx_bf16"
    assert routing.route("gemm", "bf16", spr).backend == "onednn"


@pytest.mark.parametrize("name,cap,want", [("amd_zen5", None, "f32_fused"), ("intel_sapphirerapids", None, "f32_fused"),
                                           ("intel_icelake", None, "f32_fused"), ("amd_zen5", "avx2", "f32_fused"),
                                           ("amd_zen3", None, "f32_fused"), ("amd_zen3", "sse41", "torch_flash")])
def test_fp32_attention_takes_the_fused_kernel_where_a_vector_variant_runs(name, cap, want):
    """The float32 attention route: cpu_opt's fused kernel on every CPU that runs the native avx512 or
    avx2 variant (measured against torch's flash kernel on a Zen 4 and a Zen 3: the rules say so),
    torch's flash kernel below AVX2 (a cap to sse41 too) and, on AVX2, for a decoder's one-query
    step and short prompts, where the call costs more than the work (from 12 queries on AVX2, 48 on
    AVX-512: measured on a Zen 3 and a Zen 4)."""
    from cpu_opt import native

    c = info(name, cap=cap)
    assert routing.route("attention", "fp32", c).backend == want
    assert (native.select_variant(c) in ("avx2", "avx512")) == (want == "f32_fused")
    assert routing.route("attention", "fp32", c, rows=1).backend == "torch_flash"
    first = {"avx2": 12, "avx512": 48}.get(native.select_variant(c))
    if first is not None:
        assert routing.route("attention", "fp32", c, rows=first - 1).backend == "torch_flash"
        assert routing.route("attention", "fp32", c, rows=first).backend == "f32_fused"


def test_every_attention_route_names_a_kernel_or_leaves_torch_sdpa():
    """Each attention backend the table (or calibrate, which times what the table of kernels names)
    can choose is either in backends.attention.ROUTES for its dtype, or torch's SDPA left as it is
    (torch_flash in fp32 / bf16): a route the rewriting pass did not know would silently run torch.
    The report reads the same table backward."""
    from cpu_opt.backends import attention as battn

    for r in routing.RULES:
        if r.work != "attention" or r.arch == "aarch64":
            continue
        assert (r.backend, r.dtype) in battn.ROUTES or (r.backend == "torch_flash" and r.dtype != "int8"), r
    for (backend, dtype), (fn, _) in battn.ROUTES.items():
        assert battn.route_of(fn) == backend
    assert battn.routed("torch_flash", "fp32") is None            # the aten node stays
    assert battn.routed("matmul_softmax", "fp32") is battn.matmul_softmax_attention
    assert battn.routed("f32_fused", "bf16") is None              # no float32 kernel for a bf16 graph


def test_zen3_has_no_bf16_onednn():
    z3 = info("amd_zen3")
    assert routing.route("gemm", "bf16", z3).backend == "torch"
    assert routing.route("conv", "bf16", z3).backend == "torch"
    assert routing.auto_dtype(z3) == "fp32"


@pytest.mark.parametrize("name", ["graviton2_n1", "graviton3_v1", "graviton4_v2"])
def test_aarch64_never_routes_to_own_onednn(name):
    g = info(name)
    table = routing.routes(g)
    assert all(r["backend"] != "onednn" for per in table.values() for r in per.values())
    want = "acl" if "bf16" in g.isa else "torch"
    assert routing.route("gemm", "bf16", g).backend == want


def test_every_rule_cites_why():
    assert all(len(r.why) > 10 for r in routing.RULES)


def test_bad_arguments():
    with pytest.raises(ValueError, match="work kind"):
        routing.route("fft", "fp32")
    with pytest.raises(ValueError, match="dtype"):
        routing.route("gemm", "fp8")


@pytest.mark.parametrize("name,cap,want", [("amd_zen3", None, "tall_skinny"), ("amd_zen4", None, "tall_skinny"), ("amd_zen5", None, "tall_skinny"),
                                           ("amd_zen5", "avx2", "tall_skinny"), ("intel_icelake", None, "tall_skinny"),
                                           ("intel_sapphirerapids", None, "tall_skinny"), ("intel_icelake", "sse41", "torch"),
                                           ("intel_icelake", "avx2", "tall_skinny")])
def test_gnn_linear_route(name, cap, want):
    """cpu_opt.gnn's node-feature Linear layers: the tall-skinny GEMM wherever it has vector tiles, AVX2
    (measured on Zen 3) or AVX-512 (Zen 4 with the AVX2 tiles, Emerald Rapids with the zmm tiles); without
    AVX2, torch's own; fp32 only."""
    assert routing.route("gnn_linear", "fp32", info(name, cap=cap)).backend == want
    assert "gnn_linear" in routing.routes(info(name, cap=cap))
    assert set(routing.routes(info(name, cap=cap))["gnn_linear"]) == {"fp32"}
