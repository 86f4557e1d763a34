"""Linear layers routed per the table (or per measurement) between cpu_opt's oneDNN 3.2 and
torch's own oneDNN (passes.route_linears)."""
from pathlib import Path

import pytest
import torch
from torch import nn

import cpu_opt
import optimize_testutil
from cpu_opt import hw, native, routing
from cpu_opt.compiler import passes
from cpu_opt.compiler.passes import linear as linear_pass
from cpu_opt.compiler.capture import capture

FIX = Path(__file__).parent.parent / "fixtures" / "cpuinfo"


class Mixed(nn.Module):
    """nn.Linear, a GPT-2 style Conv1D (addmm with a (K, N) weight), mm with a parameter, and a
    matmul of two activations (not a linear layer)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(24, 32)
        self.w_kn = nn.Parameter(torch.randn(32, 40) / 6)
        self.b_kn = nn.Parameter(torch.randn(40))
        self.w_mm = nn.Parameter(torch.randn(40, 16) / 6)

    def forward(self, x):
        h = torch.relu(self.fc(x))                                   # aten.linear
        h = torch.addmm(self.b_kn, h.reshape(-1, 32), self.w_kn)     # aten.addmm, weight (K, N)
        h = torch.mm(torch.tanh(h), self.w_mm)                       # aten.mm, weight (K, N)
        return h @ h.t()                                             # activation x activation


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def _table_route():
    return routing.route("linear", "fp32").backend


# (K, N) of Mixed's three layers on constant weights, in graph order
MIXED_LAYERS = [(24, 32), (32, 40), (40, 16)]


@pytest.mark.parametrize("rows", [6, 4096])
def test_routes_follow_the_table_and_answers_match_eager(rows):
    """Each layer takes the route the table gives its row count and size (small GEMMs stay on
    addmm; from 16M multiply-adds on AVX2, torch's oneDNN); the activation x activation matmul
    stays with oneDNN Graph either way."""
    m = Mixed().eval()
    x = torch.randn(rows, 24)
    opt = cpu_opt.optimize(m, x, dtype="fp32")
    assert _rel(opt(x), m(x).detach()) < 1e-5
    rep = opt.report()
    if not optimize_testutil.onednn_graph_used():
        assert not rep["routed"] and rep["num_partitions"] == 0
        return
    want = [routing.route("linear", "fp32", rows=rows, macs=rows * k * n) for k, n in MIXED_LAYERS]
    routed = list(rep["routed"])  # in graph order; layers kept on cpu_opt's oneDNN are not listed
    moved = [w for w in want if w.backend != "onednn"]
    assert [r["route"] for r in routed] == [w.backend for w in moved]
    assert all(r["why"] == w.why for r, w in zip(routed, moved))
    if any(w.backend == "torch_onednn" for w in want):
        assert any("brg_matmul:avx2" in r["why"] or "avx512" in r["why"] for r in routed)
    assert any("MatMul" in p["ops"] for p in rep["partitions"])
    assert rep["routes"]["linear"] == _table_route()


def test_new_shape_and_bigger_batch_after_routing():
    m = Mixed().eval()
    opt = cpu_opt.optimize(m, torch.randn(6, 24), dtype="fp32")
    x = torch.randn(50, 24)
    assert _rel(opt(x), m(x).detach()) < 1e-5


@pytest.mark.parametrize("winner", ["onednn", "torch_onednn", "native", "native_gemm"])
def test_measured_route_takes_the_faster(monkeypatch, winner):
    loser = "onednn" if winner != "onednn" else "torch_onednn"
    seen = []

    def fake(m, k, n, bias, repeats=7):
        seen.append((m, k, n, bias))
        return {winner: 1e-3, loser: 2e-3}

    monkeypatch.setattr(linear_pass, "measure_linear", fake)
    m = Mixed().eval()
    x = torch.randn(6, 24)
    gm = capture(m, x).gm
    passes.run_passes(gm)
    log = passes.route_linears(gm, "fp32", measure=True)
    # (M, K, N, bias) of the three layers on constant weights, from the captured shapes
    assert sorted(seen) == [(6, 24, 32, True), (6, 32, 40, True), (6, 40, 16, False)]
    chosen = [n.meta["cpu_opt_route"] for n in gm.graph.nodes if "cpu_opt_route" in n.meta]
    # no vector kernels: the GEMV's layers go to torch, the packed GEMM's to torch's oneDNN
    expect = winner if native.vectorized() else {"native": "torch", "native_gemm": "torch_onednn"}.get(winner, winner)
    assert [b for b, _ in chosen] == [expect] * 3
    assert all("measured on this shape" in why for _, why in chosen)
    assert bool(log) == (winner != "onednn")
    assert _rel(gm(x)[0], m(x).detach()) < 1e-5
    # optimize(autotune=True) measures the same way
    seen.clear()
    opt = cpu_opt.optimize(m, x, dtype="fp32", autotune=True)
    assert len(seen) == 3 and _rel(opt(x), m(x).detach()) < 1e-5


def test_measure_linear_times_every_backend():
    from cpu_opt.backends import mkl

    both = {"onednn", "torch_onednn"} | ({"mkl"} if mkl.available() else set())
    # from 4 rows cpu_opt's packed GEMM is timed too, where the vector kernels run
    t = passes.measure_linear(16, 16, 12, True, repeats=3)
    assert set(t) == both | ({"native_gemm"} if native.vectorized() else set()) and all(v > 0 for v in t.values())
    assert passes.measure_linear(16, 16, 12, True, repeats=3) is t  # cached per shape
    # a GEMV-sized layer also times cpu_opt's GEMV where the vector kernels run
    t = passes.measure_linear(2, 16, 12, True, repeats=3)
    assert set(t) == both | ({"native"} if native.vectorized() else set())


def test_mkl_route_runs_mkl_with_packed_weights_and_matches_eager(monkeypatch):
    """Forced onto MKL (the table's route for big fp32 GEMMs on Intel AVX-512): every linear layer on
    constant weights runs mkl::_mkl_linear on weights packed for its rows, with nn.Linear's (N, K) and
    Conv1D's (K, N) weights alike, the answer within fp32 rounding of eager; another row count works
    (torch's own fallback to the original weights)."""
    from cpu_opt.backends import mkl

    if not mkl.available():
        pytest.skip("torch without MKL (not an x86-64 wheel)")
    orig = routing.table_route

    def to_mkl(work, dtype, info=None, **kw):
        r = orig(work, dtype, info, **kw)
        return routing.Route(work, dtype, "mkl", "forced") if work == "linear" and dtype == "fp32" else r

    monkeypatch.setattr(routing, "table_route", to_mkl)
    m = Mixed().eval()
    x = torch.randn(12, 24)
    opt = cpu_opt.optimize(m, x, dtype="fp32")
    plan = next(iter(opt._plans.values()))
    with torch.no_grad():
        assert _rel(opt(x), m(x)) < 1e-5
        x2 = torch.randn(5, 24)
        assert _rel(opt(x2), m(x2)) < 1e-5
    if not optimize_testutil.onednn_graph_used():   # below AVX2 routing keeps the whole graph in torch
        assert not opt.report()["routed"]
        return
    nodes = [n for n in plan.program.graph.nodes if n.target is mkl.MKL_LINEAR]
    assert len(nodes) == 3
    assert all(n.args[4] == 12 for n in nodes)                       # packed for the example's rows
    assert [r["route"] for r in opt.report()["routed"]] == ["mkl"] * 3


def test_bf16_and_float64_are_not_rerouted():
    m = Mixed().eval()
    gm = torch.fx.symbolic_trace(m)
    assert passes.route_linears(gm, "bf16") == []
    m64 = Mixed().double().eval()
    x = torch.randn(6, 24, dtype=torch.float64)
    opt = cpu_opt.optimize(m64, x, dtype="fp32")
    assert not opt.report()["routed"]
    assert _rel(opt(x), m64(x).detach()) < 1e-10


@pytest.mark.parametrize("cpu,want", [("amd_zen3", "native_gemm"), ("amd_zen5", "onednn"),
                                      ("intel_sapphirerapids", "mkl"), ("intel_icelake", "mkl"),
                                      ("intel_cascadelake", "mkl"), ("graviton3_v1", "acl")])
def test_linear_route_per_cpu(cpu, want):
    info = hw.build_info((FIX / f"{cpu}.txt").read_text())
    assert routing.route("linear", "fp32", info).backend == want


def test_mkl_route_is_for_big_fp32_gemms_on_intel_avx512():
    """MKL's packed sgemm for Intel AVX-512 GEMMs from 16M multiply-adds; small ones stay on addmm,
    GEMVs on their own rules, AMD's AVX-512 (MKL picks kernels by vendor) on oneDNN, bf16 never (with
    AMX it goes to torch's oneDNN)."""
    spr = hw.build_info((FIX / "intel_sapphirerapids.txt").read_text())
    z5 = hw.build_info((FIX / "amd_zen5.txt").read_text())
    assert routing.route("linear", "fp32", spr, rows=128, macs=128 * 768 * 3072).backend == "mkl"
    assert routing.route("linear", "fp32", spr, rows=1, macs=4096 * 4096).backend == "torch"   # a GEMV: addmm
    assert routing.route("linear", "fp32", spr, rows=64, macs=64 * 128 * 512).backend != "mkl"
    # bf16 with AMX: torch's oneDNN (measured inside models), GEMVs included; without AMX cpu_opt's oneDNN
    assert routing.route("linear", "bf16", spr, rows=128, macs=128 * 768 * 3072).backend == "torch_onednn"
    assert routing.route("linear", "bf16", spr, rows=1, macs=768 * 3072).backend == "torch_onednn"
    assert routing.route("linear", "bf16", z5, rows=128, macs=128 * 768 * 3072).backend == "onednn"
    assert routing.route("linear", "fp32", z5, rows=128, macs=128 * 768 * 3072).backend == "onednn"
    capped = hw.build_info((FIX / "intel_sapphirerapids.txt").read_text(), cap="avx2")
    assert routing.route("linear", "fp32", capped, rows=128, macs=128 * 768 * 3072).backend == "native_gemm"


def test_zen5_capped_to_avx2_moves_linears_to_the_packed_gemm():
    info = hw.build_info((FIX / "amd_zen5.txt").read_text(), cap="avx2")
    assert routing.route("linear", "fp32", info).backend == "native_gemm"
    assert routing.route("linear", "fp32", info, rows=128, macs=128 * 768 * 3072).backend == "native_gemm"


def test_each_plan_routes_its_layers_for_its_own_row_count():
    """A GEMV (1 row) and a 4-row batch of the same model take the table's route for their row
    count (on AVX2: cpu_opt's native GEMV for the 1-row one, torch's oneDNN from 4 rows), each plan its own."""
    m = nn.Sequential(nn.Linear(24, 32), nn.ReLU(), nn.Linear(32, 8)).eval()
    x = torch.randn(routing.LINEAR_TORCH_MIN_ROWS, 24)
    one = cpu_opt.optimize(m, torch.randn(1, 24), dtype="fp32")
    assert _rel(one(x), m(x).detach()) < 1e-5 and _rel(one(torch.ones(1, 24)), m(torch.ones(1, 24)).detach()) < 1e-5
    assert len(one._plans) == 2
    for rows, plan in ((s[0][0][0], p) for s, p in one._plans.items()):
        want = [routing.route("linear", "fp32", rows=rows, macs=rows * k * n).backend for k, n in ((24, 32), (32, 8))]
        if not native.vectorized():
            want = [{"native": "torch", "native_gemm": "torch_onednn"}.get(w, w) for w in want]
        if plan.lowered is None:  # routing kept the whole graph in torch
            assert not optimize_testutil.onednn_graph_used()
            continue
        chosen = [n.meta["cpu_opt_route"][0] for n in plan.lowered.ctx.gm.graph.nodes if "cpu_opt_route" in n.meta]
        assert chosen == want, (rows, chosen)
        assert len(plan.lowered.routed) == sum(w != "onednn" for w in want)


def test_table_gives_gemvs_their_own_rule_on_avx2():
    z3 = hw.build_info((FIX / "amd_zen3.txt").read_text())
    assert routing.route("linear", "fp32", z3, rows=1, macs=768 * 2304).backend == "native"  # decode: the GEMV kernel
    assert routing.route("linear", "fp32", z3, rows=1).backend == "onednn"  # size unknown: the GEMV rule
    assert routing.route("linear", "fp32", z3, rows=1, macs=4096 * 4096).backend == "native"
    assert routing.route("linear", "fp32", z3, rows=1, macs=768 * 50257).backend == "onednn"  # a wide LM head
    assert routing.route("linear", "fp32", z3, rows=64, macs=64 * 128 * 512).backend == "torch"  # small: addmm
    # from 4 rows and 16M multiply-adds: cpu_opt's packed GEMM
    assert routing.route("linear", "fp32", z3, rows=128, macs=128 * 768 * 768).backend == "native_gemm"
    assert routing.route("linear", "fp32", z3, rows=routing.LINEAR_TORCH_MIN_ROWS - 1, macs=10**6).backend == "native"
    assert routing.route("linear", "fp32", z3, rows=routing.LINEAR_TORCH_MIN_ROWS).backend == "native_gemm"
    assert routing.route("linear", "fp32", z3).backend == "native_gemm"  # no rows: the many-row rule
    z5 = hw.build_info((FIX / "amd_zen5.txt").read_text())
    assert routing.route("linear", "fp32", z5, rows=1).backend == "onednn"


class PostOps(nn.Module):
    """Linear layers followed by what torch's oneDNN linear fuses (erf and tanh GELU, ReLU, SiLU, a
    residual add), and two it must not: a layer whose output is also returned, and an add that
    broadcasts."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(32, 64), nn.Linear(64, 32), nn.Linear(32, 32)
        self.d, self.e, self.f = nn.Linear(32, 48), nn.Linear(48, 32), nn.Linear(32, 32)
        self.g = nn.Linear(32, 32)
        self.shift = nn.Parameter(torch.randn(32))

    def forward(self, x):
        h = torch.nn.functional.gelu(self.a(x))
        y = self.b(h) + x                                              # residual: binary add
        z = torch.relu(self.c(y))
        w = torch.nn.functional.silu(self.d(z))
        t = torch.nn.functional.gelu(self.e(w), approximate="tanh")
        kept = self.f(t)                                               # also returned: not fused
        return torch.relu(kept), kept, self.g(t) + self.shift          # broadcast add: not fused


class PermutedResidual(nn.Module):
    """ConvNeXt's block end: a linear layer over channels-last activations, permuted back to NCHW,
    plus the block's input."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        return x + self.fc(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


def _to_torch_onednn(monkeypatch):
    orig = routing.table_route

    def to_torch(work, dtype, info=None, **kw):
        r = orig(work, dtype, info, **kw)
        return routing.Route(work, dtype, "torch_onednn", "forced") if work == "linear" and dtype == "bf16" else r

    monkeypatch.setattr(routing, "table_route", to_torch)


def test_bf16_linear_takes_a_residual_added_after_a_permute(monkeypatch):
    """linear -> permute -> + residual becomes the linear with a binary add of the residual permuted
    the linear's way (a view), the sum permuted back: no separate add; eager's answer within bf16."""
    from cpu_opt.backends.torch_onednn import TORCH_LINEAR_BINARY, bf16_linear_runs

    _to_torch_onednn(monkeypatch)
    torch.manual_seed(0)
    m = PermutedResidual().eval()
    x = torch.randn(2, 16, 5, 5)
    opt = cpu_opt.optimize(m, x, dtype="bf16")
    with torch.no_grad():
        assert _rel(opt(x), m(x)) < 3e-2
        x2 = torch.randn(2, 16, 5, 5).contiguous(memory_format=torch.channels_last)
        assert _rel(opt(x2), m(x2)) < 3e-2
    nodes = [n for n in next(iter(opt._plans.values())).program.graph.nodes if n.op == "call_function"]
    if not bf16_linear_runs():
        return
    assert sum(n.target is TORCH_LINEAR_BINARY for n in nodes) == 1
    assert not any(n.target == torch.ops.aten.add.Tensor for n in nodes)


def test_bf16_linears_on_torch_onednn_fuse_activation_and_residual(monkeypatch):
    """bf16 linear layers routed to torch's oneDNN (the table's route with AMX; forced here, so every
    CPU runs it) run on weights packed for their rows, with the GELU (erf, tanh), ReLU, SiLU or
    residual add after them as the kernel's post-op; a layer whose output has another reader, or an
    add that broadcasts, stays apart. Answers within bf16 rounding of the model run in bf16 eagerly.
    Where torch's oneDNN has no bf16 at all the layers stay on cpu_opt's oneDNN, and say why."""
    from cpu_opt.backends.torch_onednn import TORCH_LINEAR, TORCH_LINEAR_BINARY, bf16_linear_runs

    _to_torch_onednn(monkeypatch)
    torch.manual_seed(0)
    m = PostOps().eval()
    x = torch.randn(1, 20, 32)
    opt = cpu_opt.optimize(m, x, dtype="bf16")
    ref16 = [o.float() for o in m.to(torch.bfloat16)(x.bfloat16())]
    m.float()
    with torch.no_grad():
        got, ref = opt(x), m(x)
    for g, r16, r in zip(got, ref16, ref):
        assert _rel(g.float(), r16) < 3e-2 and _rel(g.float(), r) < 3e-2
    plan = next(iter(opt._plans.values()))
    nodes = [n for n in plan.program.graph.nodes if n.op == "call_function"]
    lin = [n for n in nodes if n.target is TORCH_LINEAR]
    if not bf16_linear_runs():
        assert not lin
        return
    attrs = sorted((n.args[3], n.args[5]) for n in lin)
    assert attrs == sorted([("gelu", "none"), ("relu", ""), ("swish", ""), ("gelu", "tanh"), ("none", ""), ("none", "")])
    binary = [n for n in nodes if n.target is TORCH_LINEAR_BINARY]
    assert len(binary) == 1 and binary[0].args[4] == "add"
    assert all(n.args[1].op == "get_attr" for n in lin)  # the packed weights: constants of the plan
    aten = torch.ops.aten
    # the kept layer's ReLU and the broadcast add stay separate ops (in torch or a partition)
    assert not any(n.target in (aten.gelu.default, aten.silu.default) for n in nodes)
    if optimize_testutil.onednn_graph_used("bf16"):   # else the report has no oneDNN plan to route within
        assert sum(r["route"] == "torch_onednn" for r in opt.report()["routed"]) == 7


def _to_packed_gemm(monkeypatch):
    orig = routing.table_route

    def to_packed(work, dtype, info=None, **kw):
        r = orig(work, dtype, info, **kw)
        rows = kw.get("rows")
        if work == "linear" and dtype == "fp32" and (rows is None or rows >= routing.LINEAR_TORCH_MIN_ROWS):
            return routing.Route(work, dtype, "native_gemm", "forced")
        return r

    monkeypatch.setattr(routing, "table_route", to_packed)


def test_linears_on_the_packed_gemm_match_eager(monkeypatch):
    """nn.Linear, a Conv1D-style addmm on a (K, N) weight and mm on a parameter all become cpu_opt's
    packed GEMM (the kernel really runs: the graph calls PackedLinear on packed panels, the report
    says native_gemm); the answers equal eager's, at the captured shape and at a new row count, and a
    returned tensor does not change when the model is called again."""
    from cpu_opt.backends import native_linear

    _to_packed_gemm(monkeypatch)
    torch.manual_seed(0)
    m = Mixed().eval()
    x = torch.randn(6, 24)
    opt = cpu_opt.optimize(m, x, dtype="fp32")
    with torch.no_grad():
        y = opt(x)
        ref = m(x)
        assert _rel(y, ref) < 1e-5
        keep = y.clone()
        x2 = torch.randn(37, 24)
        assert _rel(opt(x2), m(x2)) < 1e-5
        assert torch.equal(y, keep)
    routed = [r["route"] for r in opt.report()["routed"]]
    if not native.vectorized():   # no vector kernels: never the packed GEMM (torch's oneDNN, or all in torch)
        assert set(routed) <= {"torch_onednn"}, routed
        return
    assert routed == ["native_gemm"] * 3
    plan = next(iter(opt._plans.values()))   # the first shape's plan
    gemms = [n for n in plan.lowered.ctx.gm.graph.nodes if isinstance(n.target, native_linear.PackedLinear)]
    assert [(g.target.k, g.target.n) for g in gemms] == [(24, 32), (32, 40), (40, 16)]


def test_packed_gemm_route_is_for_avx2_cpus_only():
    """The packed GEMM's rule holds on AVX2 CPUs (Zen 3, and an AVX-512 CPU capped to AVX2) for 4+
    rows past the small-GEMM size; AVX-512 CPUs keep their measured rules (its AVX2 tile was never
    measured against them)."""
    big = dict(rows=128, macs=128 * 768 * 3072)
    for cpu, cap in (("amd_zen3", None), ("intel_icelake", "avx2"), ("amd_zen5", "avx2")):
        info = hw.build_info((FIX / f"{cpu}.txt").read_text(), cap=cap)
        assert routing.route("linear", "fp32", info, **big).backend == "native_gemm", cpu
        assert routing.route("linear", "fp32", info, rows=3, macs=3 * 768 * 3072).backend != "native_gemm"
        assert routing.route("linear", "fp32", info, rows=64, macs=64 * 128 * 512).backend == "torch"
        assert routing.route("linear", "bf16", info, **big).backend != "native_gemm"
    for cpu in ("amd_zen5", "intel_icelake", "intel_sapphirerapids", "intel_cascadelake"):
        info = hw.build_info((FIX / f"{cpu}.txt").read_text())
        assert routing.route("linear", "fp32", info, **big).backend != "native_gemm", cpu
    assert "sgemm" in routing.table_route("linear", "fp32", hw.build_info((FIX / "amd_zen3.txt").read_text()),
                                          **big).why
