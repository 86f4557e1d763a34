"""cpu_opt's native GELU (native/kernels/eltwise.c, backends/native_eltwise.py, passes.route_gelu)
and the folding of a per-channel scale after a linear layer (passes.fold_linear_scale)."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cpu_opt
from cpu_opt import hw, native
from cpu_opt.backends import native_eltwise, native_linear
from cpu_opt.compiler import passes
from cpu_opt.compiler.capture import capture

aten = torch.ops.aten


def runnable():
    info = hw.detect()
    return [v for v in native.compiled_variants() if native.VARIANT_REQUIRES[v] <= info.isa_uncapped]


KERNELS = {"none": "gelu_erf_f32", "tanh": "gelu_tanh_f32"}


def _gelu(x, variant, out=None, approximate="none"):
    y = torch.empty_like(x) if out is None else out
    name = KERNELS[approximate]
    st = native.kernel(name, variant)(native.ptr(x, "float *"), native.ptr(y, "float *"), x.numel(), 2)
    native.check(st, name)
    return y


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("variant", runnable())
def test_gelu_kernel_matches_float64_gelu_in_every_variant(variant, approximate):
    x = torch.linspace(-12, 12, 400_003)  # odd length: the vector body and the scalar tail
    ref = F.gelu(x.double(), approximate=approximate)
    got = _gelu(x, variant, approximate=approximate).double()
    err = (got - ref).abs()
    assert err.max() < 2e-6, err.max()
    big = x > -2  # where GELU is not a cancellation of 1 + erf (below, torch loses digits too)
    rel = err[big] / ref[big].abs().clamp_min(1e-3)
    assert rel.max() < 1e-5, rel.max()
    assert torch.equal(got[x == 0], torch.zeros(int((x == 0).sum()), dtype=torch.float64))


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_kernel_special_values_as_torch(approximate):
    """NaN, +-inf, -0 and inputs far out on either side (where the tanh form's exp would overflow)
    give torch's answers, in the vector body and in the tail."""
    special = [float("nan"), float("inf"), -float("inf"), -0.0, 0.0, 1e30, -1e30, 88.0, -88.0, 1e-30, -1e-30]
    for pad in (0, 16):   # the values in the tail, then in the vector body
        x = torch.tensor([0.5] * pad + special)
        want = F.gelu(x, approximate=approximate)
        # +inf: the limit, inf. torch 2.13's own answer depends on its kernel: inf from its AVX2 path,
        # NaN from its AVX-512 erf (seen on a Zen 4 for the exact form)
        want[x == float("inf")] = float("inf")
        for v in runnable():
            got = _gelu(x, v, approximate=approximate)
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-7, equal_nan=True), (v, pad, got, want)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 33, 32768 * 2 + 5])
def test_gelu_kernel_lengths_and_in_place(n, approximate):
    torch.manual_seed(n)
    x = torch.randn(n) * 3
    for v in runnable():
        out = _gelu(x, v, approximate=approximate)
        assert torch.allclose(out, F.gelu(x, approximate=approximate), rtol=1e-5, atol=2e-6), v
        y = x.clone()
        _gelu(y, v, out=y, approximate=approximate)  # in place: the same numbers
        assert torch.equal(y, out), v


@pytest.mark.parametrize("name", list(KERNELS.values()))
def test_gelu_kernel_refuses_bad_arguments(name):
    k = native.kernel(name)
    x = torch.randn(8)
    p = native.ptr(x, "float *")
    assert k(p, p, -1, 1) == -2   # CO_ERR_BAD_ARGUMENT
    assert k(p, p, 8, 0) == -2
    assert k(native.ffi().NULL, p, 8, 1) == -2
    assert k(native.ffi().NULL, native.ffi().NULL, 0, 1) == 0  # nothing to do


def test_gelu_wrapper_checks_dtype_and_layout():
    x = torch.randn(6, 10)
    with pytest.raises(TypeError, match="contiguous float32"):
        native_eltwise._run(x.double(), x.double())
    with pytest.raises(TypeError, match="contiguous float32"):
        native_eltwise._run(x.t(), torch.empty(10, 6))
    # the public functions hand what the kernel does not take to torch
    assert torch.equal(native_eltwise.gelu(x.t()), F.gelu(x.t()))
    assert torch.equal(native_eltwise.gelu(x.double()), F.gelu(x.double()))
    assert torch.equal(native_eltwise.gelu_tanh(x.t()), F.gelu(x.t(), approximate="tanh"))
    assert torch.equal(native_eltwise.gelu_tanh_(x.double()), F.gelu(x.double(), approximate="tanh"))


class FFN(nn.Module):
    """Linear -> GELU -> Linear (the transformer feed-forward), with a second reader of the first
    layer's output when ``tap`` (so the GELU must not overwrite it)."""

    def __init__(self, tap=False, approximate="none"):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(256, 1024), nn.Linear(1024, 256)
        self.tap, self.approximate = tap, approximate

    def forward(self, x):
        h = self.fc1(x)
        y = self.fc2(F.gelu(h, approximate=self.approximate))
        return (y, h.sum(-1)) if self.tap else y


def _gelu_routes(opt):
    return [r for r in opt.report()["routed"] if r["route"] == "native"]


def _fused_acts(opt):
    """The activations cpu_opt's packed GEMM applies as it stores its output, per layer that has one."""
    prog = next(iter(opt._plans.values())).program
    return [n.target.act for n in prog.graph.nodes
            if isinstance(n.target, native_linear.PackedLinear) and n.target.act != "none"]


def _fused_adds(opt):
    """How many layers on cpu_opt's packed GEMM add a tensor (a residual) as they store their output."""
    prog = next(iter(opt._plans.values())).program
    return sum(1 for n in prog.graph.nodes if isinstance(n.target, native_linear.PackedLinear) and len(n.args) > 3)


@pytest.mark.parametrize("tap", [False, True])
def test_gelu_after_a_routed_linear_runs_on_the_native_kernel(tap, monkeypatch):
    torch.manual_seed(0)
    m = FFN(tap=tap).eval()
    x = torch.randn(2, 128, 256)
    calls = []
    real = native_eltwise._run
    monkeypatch.setattr(native_eltwise, "_run", lambda a, b: calls.append(a is b) or real(a, b))
    opt = cpu_opt.optimize(m, x, dtype="fp32")
    ref = m(x)
    calls.clear()
    out = opt(x)
    outs, refs = (out, ref) if tap else ((out,), (ref,))
    for o, r in zip(outs, refs):
        assert ((o - r).abs().max() / r.abs().max()) < 1e-5
    rep = opt.report()
    linear_routes = {r["route"] for r in rep["routed"] if r["route"] != "native"}
    if native_eltwise.available() and "native_gemm" in linear_routes and not tap:
        # fc1 on cpu_opt's packed GEMM, h read by the GELU alone: the GEMM applies it as it stores h
        assert _fused_acts(opt) == ["gelu"] and not _gelu_routes(opt) and calls == [], rep["routed"]
        assert any(r["op"].endswith("PackedLinear(256->1024, gelu)") for r in rep["routed"]), rep["routed"]
    elif native_eltwise.available() and linear_routes & {"torch_onednn", "torch", "mkl", "native_gemm"}:
        assert not _fused_acts(opt)
        assert len(_gelu_routes(opt)) == 1, rep["routed"]
        assert calls == [not tap], calls  # it ran, and in place only when nothing else reads h
    else:  # the GELU stays where the linear layer is (oneDNN fuses it) or in torch
        assert not _gelu_routes(opt) and not calls
    out2 = opt(x)  # a second call leaves the first call's results alone
    for o, r in zip(outs, refs):
        assert ((o - r).abs().max() / r.abs().max()) < 1e-5
    del out2


@pytest.mark.parametrize("tap", [False, True])
def test_tanh_gelu_runs_on_the_native_kernel(tap):
    """oneDNN Graph 3.2 has no tanh GELU: in fp32 it runs on cpu_opt's kernel wherever the linear layer
    before it runs, where the vector kernels do; in place on the linear layer's fresh output (cpu_opt's
    packed GEMM's too) unless something else reads it."""
    torch.manual_seed(0)
    m = FFN(tap=tap, approximate="tanh").eval()
    x = torch.randn(2, 128, 256)
    opt = cpu_opt.optimize(m, x, dtype="fp32")
    with torch.no_grad():
        ref = m(x)
        out = opt(x)
        outs, refs = (out, ref) if tap else ((out,), (ref,))
        for o, r in zip(outs, refs):
            assert ((o - r).abs().max() / r.abs().max()) < 1e-5
        opt(torch.randn(2, 128, 256))   # a second call leaves the first call's results alone
        for o, r in zip(outs, refs):
            assert ((o - r).abs().max() / r.abs().max()) < 1e-5
    routes = _gelu_routes(opt)
    fused = _fused_acts(opt)
    on_gemm = "native_gemm" in {r["route"] for r in opt.report()["routed"]}
    # fc1 on cpu_opt's packed GEMM and h read by the GELU alone: the GEMM applies it (the same formula)
    assert fused == (["gelu_tanh"] if on_gemm and not tap else []), fused
    assert len(routes) == (1 if native_eltwise.available() and not fused else 0), routes
    assert all("tanh GELU" in r["why"] for r in routes)
    if routes:
        prog = next(iter(opt._plans.values())).program
        gelus = [n.target for n in prog.graph.nodes if n.target in (native_eltwise.gelu_tanh, native_eltwise.gelu_tanh_)]
        assert gelus == [native_eltwise.gelu_tanh if tap else native_eltwise.gelu_tanh_]


class Conv1DMLP(nn.Module):
    """GPT-2's MLP: addmm on (K, N) weights over the rows, viewed back to (batch, seq, N), then the
    activation (its tanh GELU, or a ReLU)."""

    def __init__(self, act):
        super().__init__()
        self.w1, self.b1 = nn.Parameter(torch.randn(256, 1024) * 0.05), nn.Parameter(torch.randn(1024) * 0.1)
        self.w2, self.b2 = nn.Parameter(torch.randn(1024, 256) * 0.05), nn.Parameter(torch.randn(256) * 0.1)
        self.act = act

    def forward(self, x):
        b, t, _ = x.shape
        h = torch.addmm(self.b1, x.view(-1, 256), self.w1).view(b, t, 1024)
        h = F.gelu(h, approximate="tanh") if self.act == "gelu_tanh" else torch.relu(h)
        y = torch.addmm(self.b2, h.view(-1, 1024), self.w2).view(b, t, 256)
        return x + y   # the residual, added to the view of the rows


class LinearResidual(nn.Module):
    """BERT's block ends: a linear layer plus a residual of its output's shape, in either operand order,
    the residual computed after the layer; and adds that must stay (broadcast, alpha, a reused output)."""

    def __init__(self, kind):
        super().__init__()
        self.fc, self.fc2, self.kind = nn.Linear(96, 96), nn.Linear(96, 96), kind
        self.row = nn.Parameter(torch.randn(96))

    def forward(self, x):
        if self.kind == "permuted":   # ConvNeXt's block end: channels-last linear, permuted back, + input
            return x + self.fc(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        h = self.fc(x)
        if self.kind == "after":
            return h + torch.tanh(x)        # the residual made after the layer
        if self.kind == "before":
            return self.fc2(x) + h          # the layer second; fc2's output on the left also fuses
        if self.kind == "broadcast":
            return h + self.row             # not a residual: stays an add
        if self.kind == "alpha":
            return torch.add(h, x, alpha=2.0)
        if self.kind == "reused":
            return h + x, h                 # h read twice: stays an add
        raise ValueError(self.kind)


@pytest.mark.parametrize("kind,fused", [("after", 1), ("before", 1), ("permuted", 1), ("broadcast", 0), ("alpha", 0),
                                        ("reused", 0)])
def test_a_residual_add_is_fused_into_the_packed_gemm(kind, fused):
    torch.manual_seed(0)
    m = LinearResidual(kind).eval()
    x = torch.randn(3, 96, 5, 10) if kind == "permuted" else torch.randn(3, 50, 96)
    with torch.no_grad():
        opt = cpu_opt.optimize(m, x, dtype="fp32")
        ref, out = m(x), opt(x)
        outs, refs = (out, ref) if kind == "reused" else ((out,), (ref,))
        for o, r in zip(outs, refs):
            assert ((o - r).abs().max() / r.abs().max()) < 1e-5
        opt(torch.randn_like(x))   # the first results left alone
        for o, r in zip(outs, refs):
            assert ((o - r).abs().max() / r.abs().max()) < 1e-5
    if "native_gemm" not in {r["route"] for r in opt.report()["routed"]}:
        assert _fused_adds(opt) == 0
        return
    assert _fused_adds(opt) == fused
    if fused:
        prog = next(iter(opt._plans.values())).program
        assert not [n for n in prog.graph.nodes if n.target == torch.ops.aten.add.Tensor]
        assert any("residual add fused" in line for line in opt.report()["passes"]), opt.report()["passes"]


@pytest.mark.parametrize("act", ["gelu_tanh", "relu"])
def test_an_activation_through_a_view_is_fused_into_the_packed_gemm(act):
    torch.manual_seed(0)
    m = Conv1DMLP(act).eval()
    x = torch.randn(2, 64, 256)
    with torch.no_grad():
        opt = cpu_opt.optimize(m, x, dtype="fp32")
        ref, out = m(x), opt(x)
        assert ((out - ref).abs().max() / ref.abs().max()) < 1e-5
        x2 = torch.randn(3, 40, 256)   # another shape: another plan, the same fusion
        ref2 = m(x2)
        assert ((opt(x2) - ref2).abs().max() / ref2.abs().max()) < 1e-5
        assert ((out - ref).abs().max() / ref.abs().max()) < 1e-5   # the first result left alone
    if "native_gemm" not in {r["route"] for r in opt.report()["routed"]}:
        assert not _fused_acts(opt)   # no packed GEMM here (no vector kernels, or another CPU's route)
        return
    assert _fused_acts(opt) == [act] and _fused_adds(opt) == 1   # fc2's view + x too
    prog = next(iter(opt._plans.values())).program
    assert not [n for n in prog.graph.nodes if n.target in (torch.ops.aten.relu.default, torch.ops.aten.gelu.default,
                                                             native_eltwise.gelu_tanh, native_eltwise.gelu_tanh_)]


class LayerScale(nn.Module):
    """ConvNeXt's block end: linear, then a learnt per-channel scale (``gamma * x``), in either
    operand order; and scales that are not per output channel (must stay)."""

    def __init__(self, kind):
        super().__init__()
        self.fc = nn.Linear(32, 48)
        self.kind = kind
        self.gamma = nn.Parameter(torch.rand(48) + 0.5)
        self.rows = nn.Parameter(torch.rand(10, 1) + 0.5)
        self.scalar = nn.Parameter(torch.tensor(0.7))

    def forward(self, x):
        h = self.fc(x)
        if self.kind == "channel":
            return self.gamma * h
        if self.kind == "channel_right":
            return h * self.gamma.view(1, 1, 48)
        if self.kind == "scalar":
            return h * self.scalar
        if self.kind == "rows":       # varies along another dimension: not a weight scale
            return h * self.rows
        if self.kind == "two_readers":  # h is read again: folding would change that reader
            return self.gamma * h + h
        raise ValueError(self.kind)


def _passes_on(m, x):
    cap = capture(m, (x,))
    log = passes.run_passes(cap.gm)
    muls = [n for n in cap.gm.graph.nodes if n.op == "call_function" and n.target == aten.mul.Tensor]
    return cap.gm, log, muls


@pytest.mark.parametrize("kind,folds", [("channel", True), ("channel_right", True), ("scalar", True),
                                        ("rows", False), ("two_readers", False)])
def test_per_channel_scale_after_linear_folds_into_the_weights(kind, folds):
    torch.manual_seed(0)
    m = LayerScale(kind).eval()
    x = torch.randn(3, 10, 32)
    gm, log, muls = _passes_on(m, x)
    assert (not muls) == folds, (kind, log)
    assert any("per-channel scale" in line for line in log) == folds, log
    with torch.no_grad():
        ref = m(x)
        got = gm(x)
        got = got[0] if isinstance(got, (tuple, list)) else got
        assert (got - ref).abs().max() < 1e-5 * ref.abs().max()
        opt = cpu_opt.optimize(m, x, dtype="fp32")
        assert (opt(x) - ref).abs().max() < 1e-5 * ref.abs().max()


def test_scale_fold_leaves_the_model_parameters_alone():
    torch.manual_seed(0)
    m = LayerScale("channel").eval()
    w, b, g = m.fc.weight.detach().clone(), m.fc.bias.detach().clone(), m.gamma.detach().clone()
    x = torch.randn(3, 10, 32)
    opt = cpu_opt.optimize(m, x, dtype="fp32")
    opt(x)
    assert torch.equal(m.fc.weight, w) and torch.equal(m.fc.bias, b) and torch.equal(m.gamma, g)
