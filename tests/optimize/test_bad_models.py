"""Models that do unusual things: each is optimized with eager's semantics, or runs with the
reason reported, or gets a clear error — never a wrong answer, a crash, or a changed input."""
import copy

import pytest
import torch
from torch import nn

import cpu_opt
from optimize_testutil import onednn_graph_used


def _close(a, b, tol=1e-4):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-6)).item() < tol


class WritesItsInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        x.add_(1.0)
        return self.fc(x)


def test_a_model_that_writes_into_its_input_does_so_once_per_call_and_not_during_optimize():
    m = WritesItsInput().eval()
    example = torch.randn(2, 8)
    kept = example.clone()
    opt = cpu_opt.optimize(m, example, dtype="fp32")
    assert torch.equal(example, kept)  # optimize's own runs used copies
    x = torch.randn(2, 8)
    xe = x.clone()
    y = opt(x)
    ye = m(xe)
    assert torch.equal(x, xe), "the optimized model must write into its input as eager does, once"
    assert _close(y, ye.detach())
    if onednn_graph_used():
        fb = {f["node"]: f["reason"] for f in opt.report()["fallbacks"]}
        assert any("writes into a model input" in r for r in fb.values()), fb
        x3 = torch.randn(5, 8)  # a new shape: planned and validated on copies, run once
        x3e = x3.clone()
        assert _close(opt(x3), m(x3e).detach()) and torch.equal(x3, x3e)


class CountsCalls(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.register_buffer("count", torch.zeros(8))

    def forward(self, x):
        self.count.add_(1.0)
        return self.fc(x) + self.count


def test_a_model_that_updates_a_buffer_keeps_eager_state_semantics():
    m = CountsCalls().eval()
    twin = copy.deepcopy(m)
    opt = cpu_opt.optimize(m, torch.randn(2, 8), dtype="fp32")
    assert torch.equal(m.count, torch.zeros(8))  # optimize's runs left the state as it was
    assert opt.report()["validation"]["ok"]
    for rows in (2, 2, 4, 2):
        x = torch.randn(rows, 8)
        assert _close(opt(x), twin(x).detach())
        assert torch.equal(m.count, twin.count)  # one update per call, no more
    if onednn_graph_used():
        assert opt.report()["num_partitions"] >= 1
        assert any("parameter or buffer" in f["reason"] for f in opt.report()["fallbacks"])


class InPlaceOnAShared(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        h2 = h.clone()  # not a no-op: it keeps the in-place add below away from h
        h2.add_(1.0)
        return h2 * 2, h


def test_in_place_on_a_copy_of_a_tensor_read_later_keeps_them_apart():
    m = InPlaceOnAShared().eval()
    x = torch.randn(3, 8)
    opt = cpu_opt.optimize(m, x, dtype="fp32")
    a, b = opt(x)
    ra, rb = m(x)
    assert _close(a, ra.detach()) and _close(b, rb.detach())
    assert opt.report()["validation"]["ok"]


class WithBatchNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        with torch.no_grad():
            self.bn.running_mean.uniform_(-1, 1)
            self.bn.running_var.uniform_(0.5, 2)

    def forward(self, x):
        return self.bn(self.conv(x))


def test_a_model_optimized_in_train_mode_is_planned_in_eval_mode_at_new_shapes_too():
    m = WithBatchNorm().train()
    opt = cpu_opt.optimize(m, torch.randn(2, 3, 8, 8), dtype="fp32")
    assert m.training  # the user's mode is restored
    stats = (m.bn.running_mean.clone(), m.bn.running_var.clone())
    x = torch.randn(5, 3, 10, 10)  # a new shape: re-captured, which used to happen in train mode
    y = opt(x)
    m.eval()
    assert _close(y, m(x).detach())
    assert torch.equal(m.bn.running_mean, stats[0]) and torch.equal(m.bn.running_var, stats[1])
    checks = opt.report()["shape_validation"]
    if onednn_graph_used():
        assert len(checks) == 1 and checks[0]["ok"] and checks[0]["shapes"] == [[5, 3, 10, 10]]
    else:
        assert checks == []  # a plan entirely in torch needs no comparison with torch


def test_a_new_shape_that_disagrees_with_eager_runs_in_torch_and_is_reported(monkeypatch):
    from cpu_opt.compiler import pipeline

    m = WithBatchNorm().eval()
    opt = cpu_opt.optimize(m, torch.randn(2, 3, 8, 8), dtype="fp32")
    real = pipeline._compare
    monkeypatch.setattr(pipeline, "_compare", lambda out, ref, dt, min_cosine=None:
                        {**real(out, ref, dt, min_cosine), "ok": False})
    x = torch.randn(3, 3, 8, 8)
    assert _close(opt(x), m(x).detach())
    if not onednn_graph_used():
        assert opt.report()["shape_validation"] == []
        return
    check = opt.report()["shape_validation"][0]
    assert check["ok"] is False and "runs in torch" in check["fell_back"]
    plan = opt._plans[next(reversed(opt._plans))]
    assert not plan.steps  # that shape's plan has no oneDNN partition


class Branchy(nn.Module):
    def forward(self, x):
        if x.sum() > 0:  # data-dependent control flow
            return x * 2
        return x.numpy()


def test_data_dependent_control_flow_takes_the_right_branch_on_every_call():
    opt = cpu_opt.optimize(Branchy(), torch.ones(3))
    assert opt.report()["capture"] == "dynamo"
    assert "cannot capture Branchy" in opt.report()["capture_notes"][0]
    assert torch.equal(opt(torch.ones(3)), torch.full((3,), 2.0))
    neg = -torch.arange(1.0, 4.0)
    out = opt(neg)  # the other branch: a numpy array, as eager returns
    assert (out == neg.numpy()).all()


class Noisy(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x):
        self.calls += 1  # a Python side effect: it runs while optimize captures, not on optimized calls
        return self.fc(x)


def test_python_side_effects_run_at_capture_not_on_optimized_calls():
    m = Noisy().eval()
    opt = cpu_opt.optimize(m, torch.randn(2, 4), dtype="fp32")
    before = m.calls
    x = torch.randn(2, 4)
    assert _close(opt(x), m.fc(x).detach())
    assert m.calls == before


class NonTensorOutputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return {"y": self.fc(x), "n": 3, "label": "ok", "nothing": None, "pair": (x.shape[0], None)}


def test_non_tensor_and_none_outputs_round_trip():
    m = NonTensorOutputs().eval()
    opt = cpu_opt.optimize(m, torch.randn(2, 4), dtype="fp32")
    x = torch.randn(2, 4)
    out = opt(x)
    assert set(out) == {"y", "n", "label", "nothing", "pair"}
    assert out["n"] == 3 and out["label"] == "ok" and out["nothing"] is None and out["pair"] == (2, None)
    assert _close(out["y"], m.fc(x).detach())


class TakesAFlag(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, scale: float = 1.0):
        return self.fc(x) * scale


class Flags(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, scale: float = 1.0, negate: bool = False, mode: str = "relu", extra=None):
        y = self.fc(x) * scale
        y = torch.relu(y) if mode == "relu" else torch.tanh(y)
        y = -y if negate else y
        return y if extra is None else (y, extra)


def test_non_tensor_inputs_are_constants_of_the_capture():
    m = Flags().eval()
    x = torch.randn(2, 4)
    opt = cpu_opt.optimize(m, {"x": x, "scale": 2.0, "negate": True, "mode": "relu", "extra": None}, dtype="fp32")
    rep = opt.report()
    assert any("non-tensor input(s) captured as constants" in n for n in rep["capture_notes"])
    if onednn_graph_used():
        assert rep["num_partitions"] >= 1
    x2 = torch.randn(3, 4)
    assert _close(opt(x=x2, scale=2.0, negate=True, mode="relu", extra=None), m(x2, 2.0, True, "relu").detach())
    # other constants: captured again for them, and right (also when the output's structure changes)
    y = opt(x=x2, scale=0.5, negate=False, mode="tanh", extra=None)
    assert _close(y, m(x2, 0.5, False, "tanh").detach())
    out = opt(x=x2, scale=2.0, negate=True, mode="relu", extra=7)
    assert isinstance(out, tuple) and out[1] == 7 and _close(out[0], m(x2, 2.0, True, "relu").detach())
    with pytest.raises(TypeError, match="input 1 is a tensor"):
        opt(x=x2, scale=torch.tensor(2.0), negate=True, mode="relu", extra=None)


def test_inputs_that_are_neither_tensors_nor_constants_get_a_clear_error():
    with pytest.raises(TypeError, match="plain constants.*object"):
        cpu_opt.optimize(TakesAFlag(), (torch.randn(2, 4), object()))


class MakesAHugeTensor(nn.Module):
    def forward(self, x):
        return torch.zeros(x.shape[0], 10 ** 12) + 1


def test_an_allocation_that_cannot_succeed_is_a_python_error():
    with pytest.raises(RuntimeError, match="allocate"):
        cpu_opt.optimize(MakesAHugeTensor(), torch.randn(2, 3))


class ConvNeXtBlock(nn.Module):
    """ConvNeXt's block: depthwise 7x7, LayerNorm over channels after a permute to NHWC, MLP, permute back."""

    def __init__(self, c=16):
        super().__init__()
        self.dw = nn.Conv2d(c, c, 7, padding=3, groups=c)
        self.norm = nn.LayerNorm(c)
        self.fc1, self.fc2 = nn.Linear(c, 4 * c), nn.Linear(4 * c, c)

    def forward(self, x):
        h = self.dw(x).permute(0, 2, 3, 1)
        h = self.fc2(nn.functional.gelu(self.fc1(self.norm(h))))
        return x + h.permute(0, 3, 1, 2)


class WindowView(nn.Module):
    """Swin's window partition: a .view() of a partition output after a permute, which only the
    strides torch would have produced allow."""

    def __init__(self, c=8):
        super().__init__()
        self.embed = nn.Conv2d(3, c, 2, stride=2)  # patch embedding: a convolution network, so 4-D
        self.norm = nn.LayerNorm(c)                 # partition outputs used to be forced channels-last

    def forward(self, x):
        x = self.embed(x).permute(0, 2, 3, 1)  # (B, H, W, C)
        b, h, w, c = x.shape
        y = self.norm(x).view(b, h // 2, 2, w // 2, 2, c).permute(0, 1, 3, 2, 4, 5).contiguous()
        return torch.relu(y.view(-1, 4, c))


@pytest.mark.parametrize("make, shape", [(ConvNeXtBlock, (2, 16, 12, 12)), (WindowView, (2, 3, 16, 16))])
def test_partition_outputs_keep_the_strides_the_graph_expects(make, shape, monkeypatch):
    """Both ran wrong or not at all when partition outputs were forced to channels-last: ConvNeXt's
    LayerNorm (an NHWC tensor given channels-last strides) gave cosine 0.04 and the whole graph fell
    back; the window view raised 'view size is not compatible'. (A lone LayerNorm runs in torch now:
    kept a partition here, so its output strides are what is tested.)"""
    from cpu_opt.compiler import lowering

    monkeypatch.setattr(lowering, "ONE_OP_IN_TORCH", set())
    m = make().eval()
    x = torch.randn(*shape)
    opt = cpu_opt.optimize(m, x, dtype="fp32")
    assert _close(opt(x), m(x).detach())
    rep = opt.report()
    assert rep["validation"]["ok"] and "fell_back" not in rep["validation"]
    if onednn_graph_used():
        assert rep["num_partitions"] >= 1
        assert any("LayerNorm" in p["ops"] for p in rep["partitions"])


class LoneLayerNorm(nn.Module):
    """A LayerNorm that nothing fuses with (no add before it) beside an elementwise chain that is a
    partition of several ops."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(16)

    def forward(self, x):
        return self.norm(x), torch.relu(x * 2.0 + 1.0) - 0.5


def test_a_lone_layer_norm_runs_in_torch_and_is_reported():
    """A partition of one LayerNorm fuses nothing, and a partition step costs more per call than
    torch's kernel (16 vs 80 us at 128 x 768): it runs in torch, reported as routed there, with the
    same numbers as eager; the multi-op partition beside it stays in oneDNN."""
    m = LoneLayerNorm().eval()
    x = torch.randn(4, 16)
    opt = cpu_opt.optimize(m, x, dtype="fp32")
    for a, b in zip(opt(x), m(x)):
        assert _close(a, b.detach())
    rep = opt.report()
    assert not any("LayerNorm" in p["ops"] for p in rep["partitions"])
    if onednn_graph_used():   # (below SSE4.1's ISA cap the whole graph runs in torch: nothing is partitioned)
        lone = [r for r in rep["routed"] if r["op"] == "aten.layer_norm.default"]
        assert len(lone) == 1 and lone[0]["route"] == "torch" and "fuse nothing" in lone[0]["why"], rep["routed"]
        assert rep["num_partitions"] >= 1


class LoneMean(nn.Module):
    """A classifier's global pooling (a mean over the spatial dimensions, nothing to fuse with)
    beside a partition of several ops."""

    def forward(self, x):
        return x.mean([-2, -1]), torch.relu(x * 2.0 + 1.0) - 0.5


def test_a_lone_mean_runs_in_torch_and_is_reported():
    """A partition of one mean fuses nothing (ConvNeXt-T's pooling: 714 us as a oneDNN 3.2 partition,
    16 in torch): it runs in torch, reported, with eager's numbers."""
    m = LoneMean().eval()
    x = torch.randn(2, 8, 7, 7)
    opt = cpu_opt.optimize(m, x, dtype="fp32")
    for a, b in zip(opt(x), m(x)):
        assert _close(a, b.detach())
    rep = opt.report()
    assert not any("ReduceMean" in p["ops"] for p in rep["partitions"])
    if onednn_graph_used():
        lone = [r for r in rep["routed"] if r["op"] == "aten.mean.dim"]
        assert len(lone) == 1 and lone[0]["route"] == "torch" and "fuse nothing" in lone[0]["why"], rep["routed"]
        assert rep["num_partitions"] >= 1


class EltwiseThenBinary(nn.Module):
    """Elementwise ops feeding binary ops, as squeeze-excitation blocks and scaled activations write
    them: two of them make oneDNN 3.2 partitions it runs on its reference kernel, one does not."""

    def forward(self, x, s):
        se = nn.functional.hardsigmoid(s) * x          # eltwise on an input, read first by the multiply
        scaled = 2 * torch.relu(x)                     # scalar first: lowered as relu(x) * 2
        chain = torch.relu(x * 2.0 + 1.0) - 0.5        # a binary op first: jit binary with post-ops
        return se, scaled, chain


def test_eltwise_feeding_a_binary_op_runs_in_torch_and_is_reported():
    """relu(x) * 2 took 5.4 ms as a oneDNN 3.2 partition (an eltwise primitive with a binary post-op
    runs `ref:any`), 0.02 in torch; MobileNetV3's int8 squeeze-excitation scales were 25 of its 34 ms.
    Such partitions run in torch, reported; a partition whose first op is binary stays in oneDNN."""
    from cpu_opt.compiler import lowering

    m = EltwiseThenBinary().eval()
    x = torch.randn(1, 8, 6, 6).contiguous(memory_format=torch.channels_last)
    s = torch.randn(1, 8, 1, 1)
    opt = cpu_opt.optimize(m, (x, s), dtype="fp32")
    for _ in range(2):   # the second call too: nothing returned is overwritten
        for a, b in zip(opt(x, s), m(x, s)):
            assert _close(a, b)
    rep = opt.report()
    assert not any(set(p["ops"]) in ({"HardSigmoid", "Multiply"}, {"ReLU", "Multiply"}) for p in rep["partitions"])
    if onednn_graph_used():
        why = {r["op"]: r["why"] for r in rep["routed"] if r["route"] == "torch"}
        for op in ("aten.hardsigmoid.default", "aten.relu.default", "aten.mul.Tensor"):
            assert why.get(op) == lowering.ELTWISE_BINARY, rep["routed"]
        assert [p["ops"] for p in rep["partitions"]] == [["Multiply", "Add", "ReLU", "Subtract"]]


class EltwiseReadSecond(nn.Module):
    """Where oneDNN does and does not make an eltwise primitive with a binary post-op: the eltwise
    result read second by an Add or Multiply, and an exact GELU, do; a Subtract reading it second
    and x * sigmoid(x) (a swish) do not."""

    def forward(self, x, y, z, w):
        added = x + torch.tanh(y)                      # commutative: ref:any like tanh(y) + x
        gelu = nn.functional.gelu(z) * 2.0             # erf GELU then a binary op: ref:any
        swish = w * torch.sigmoid(w)                   # one jit swish eltwise
        sub = x - torch.relu(w)                        # two jit primitives
        mul = y * torch.relu(x)                        # commutative, read second: ref:any
        div = torch.relu(z) / (w.abs() + 1.0)          # read first by a Divide: an eltwise with a post-op
        return added, gelu, swish, sub, mul, div


def test_eltwise_read_second_or_gelu_feeding_a_binary_op_runs_in_torch():
    """ONEDNN_VERBOSE on oneDNN 3.2 (AMD EPYC Zen 1): x * relu(t), x + relu(t) and gelu(t) * 2 run
    `ref:any` (27-35 ms over 1 x 120 x 28 x 28 under load); t * sigmoid(t) runs jit swish and
    x - relu(t) two jit primitives. The first three run in torch, reported; the others stay."""
    from cpu_opt.compiler import lowering

    m = EltwiseReadSecond().eval()
    x, y, z, w = (torch.randn(1, 8, 6, 6) for _ in range(4))
    opt = cpu_opt.optimize(m, (x, y, z, w), dtype="fp32")
    for _ in range(2):
        for a, b in zip(opt(x, y, z, w), m(x, y, z, w)):
            assert _close(a, b)
    rep = opt.report()
    kinds = sorted(sorted(p["ops"]) for p in rep["partitions"])
    assert ["Add", "Tanh"] not in kinds and ["GELU", "Multiply"] not in kinds, kinds
    assert ["Multiply", "ReLU"] not in kinds and not any("Divide" in k and "ReLU" in k for k in kinds), kinds
    if onednn_graph_used():
        why = {r["op"]: r["why"] for r in rep["routed"] if r["route"] == "torch"}
        for op in ("aten.tanh.default", "aten.add.Tensor", "aten.gelu.default", "aten.relu.default",
                   "aten.div.Tensor"):
            assert why.get(op) == lowering.ELTWISE_BINARY, rep["routed"]
        assert ["Multiply", "Sigmoid"] in kinds and ["ReLU"] in kinds and ["Subtract"] in kinds, kinds


class GeluMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 8)

    def forward(self, x):
        h = torch.relu(self.a(x))
        h = nn.functional.gelu(self.b(h))
        return torch.sigmoid(self.c(h))


def test_validation_narrows_a_wrong_partition_down_and_runs_only_it_in_torch(monkeypatch):
    """A partition that computes the wrong thing (here GELU lowered as Tanh, on purpose) is found by
    comparing each partition with torch on its own, and only it runs in torch; the rest stays."""
    from cpu_opt.backends import native_eltwise
    from cpu_opt.compiler import lowering

    monkeypatch.setitem(lowering.LOWERINGS, torch.ops.aten.gelu.default, lowering._eltwise("Tanh"))
    monkeypatch.setattr(native_eltwise, "available", lambda: False)  # the GELU in oneDNN, not on cpu_opt's kernel
    m = GeluMLP().eval()
    x = torch.randn(4, 16)
    opt = cpu_opt.optimize(m, x, dtype="fp32")
    assert _close(opt(x), m(x).detach())
    val = opt.report()["validation"]
    if not onednn_graph_used():  # routing keeps the graph in torch: the broken lowering never runs
        assert val["ok"] and "narrowed" not in val and opt.report()["num_partitions"] == 0
        return
    assert val["ok"] and "fell_back" not in val, val
    assert val["first_try"]["ok"] is False
    narrowed = val["narrowed"]
    assert len(narrowed) == 1 and "Tanh" in narrowed[0]["ops"]
    rep = opt.report()
    assert rep["num_partitions"] >= 1  # the others still run on oneDNN
    gelu = [f for f in rep["fallbacks"] if f["op"] == "aten.gelu.default"]
    assert gelu and "disagreed with torch" in gelu[0]["reason"]
    x2 = torch.randn(9, 16)  # a new shape keeps the exclusion
    assert _close(opt(x2), m(x2).detach())
    assert opt.report()["shape_validation"][-1]["ok"]


def test_weights_updated_in_place_after_optimize_are_seen():
    """optimize derives things from the weights (BatchNorm folded in, transposed and packed copies,
    oneDNN's constant cache of packed weights): a later in-place update (load_state_dict, mul_)
    used to leave the optimized model computing with the old ones (53% off here). It now notices
    the parameters' versions and optimizes again."""
    m = nn.Sequential(nn.Linear(4096, 4096), nn.GELU(), nn.Linear(4096, 4096)).eval()  # GEMVs: oneDNN partitions
    x = torch.randn(1, 4096)
    opt = cpu_opt.optimize(m, x, dtype="fp32")
    assert _close(opt(x), m(x).detach())
    with torch.no_grad():
        m[0].weight.mul_(2.0)
    assert _close(opt(x), m(x).detach())
    new = copy.deepcopy(m.state_dict())
    new["2.bias"] += 1.0
    m.load_state_dict(new)
    assert _close(opt(x), m(x).detach())
    assert opt.report()["weight_refreshes"] == 2
    cnn = WithBatchNorm().eval()
    xc = torch.randn(2, 3, 8, 8)
    optc = cpu_opt.optimize(cnn, xc, dtype="fp32")
    with torch.no_grad():
        cnn.conv.weight.add_(0.5)  # BatchNorm was folded into this weight
    assert _close(optc(xc), cnn(xc).detach())


def test_a_mean_over_a_dimension_of_size_one_runs_in_torch_instead_of_aborting():
    """oneDNN 3.2 cannot create a reduction that reduces nothing, and its Graph compile throws a
    C++ exception through the C API (the process aborts): lowering must keep such a mean in torch.
    Run in a child process so that a regression is a failed test, not a dead test session."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import torch, cpu_opt
        from torch import nn
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(16, 16)
            def forward(self, x):
                return torch.relu(self.fc(x)).mean(1) * 2 + x.mean(-1, keepdim=True).mean(1)
        torch.manual_seed(0)
        m = M().eval()
        x = torch.randn(3, 1, 16)
        o = cpu_opt.optimize(m, (x,), dtype="fp32")
        with torch.no_grad():
            assert torch.allclose(o(x), m(x), atol=1e-5), (o(x) - m(x)).abs().max()
        why = " ".join(str(f.get("reason", "")) for f in o.report()["fallbacks"])
        if ONEDNN:  # elsewhere (an ISA cap, no oneDNN) the whole graph is in torch and says so
            assert "size 1" in why, o.report()["fallbacks"]
        print("ok")
    """).replace("ONEDNN", repr(onednn_graph_used()))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]
