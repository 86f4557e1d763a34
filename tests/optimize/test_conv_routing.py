"""3x3 convolutions on cpu_opt's Winograd kernel (``passes.route_convs``, the ``conv3x3`` route):
which CPUs take the route, that the kernel really runs inside optimized models (ours and a
`transformers` ResNet) with its ReLU / residual add fused, the same answers as eager at two shapes,
and the convolutions it must leave alone."""
from pathlib import Path

import pytest
import torch
from torch import nn

import cpu_opt
from cpu_opt import hw, native, routing
from cpu_opt.backends import native_conv

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "cpuinfo"


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("cpu,want", [("amd_zen3", "native_winograd"), ("amd_zen5", "conv"),
                                      ("intel_icelake", "conv"), ("graviton3_v1", "conv")])
def test_conv3x3_route_per_cpu(cpu, want):
    info = hw.build_info((FIX / f"{cpu}.txt").read_text())
    assert routing.route("conv3x3", "fp32", info, macs=56 * 56 * 64 * 64 * 9).backend == want
    # small layers, layers of few output tiles (ResNet-50's 7x7 stage), and other dtypes stay with the
    # convolution route
    assert routing.route("conv3x3", "fp32", info, macs=routing.WINOGRAD_MIN_MACS - 1).backend == "conv"
    assert routing.route("conv3x3", "fp32", info, rows=routing.WINOGRAD_MIN_TILES - 1, macs=10 ** 9).backend == "conv"
    for dtype in ("bf16", "int8"):
        assert routing.route("conv3x3", dtype, info).backend == "conv"
    capped = hw.build_info((FIX / "amd_zen5.txt").read_text(), cap="avx2")
    assert routing.route("conv3x3", "fp32", capped, macs=10 ** 9).backend == "native_winograd"


def _force_winograd(monkeypatch):
    orig = routing.table_route

    def forced(work, dtype, info=None, **kw):
        if work == "conv3x3" and dtype == "fp32":
            return routing.Route(work, dtype, "native_winograd", "forced")
        return orig(work, dtype, info, **kw)

    monkeypatch.setattr(routing, "table_route", forced)


class Blocks(nn.Module):
    """A basic residual block (3x3 + BN + in-place ReLU, 3x3 + BN, + shortcut, ReLU), a 3x3 read twice
    (nothing to fuse), one without padding, and the 3x3s the kernel does not take: stride 2, dilated,
    grouped."""

    def __init__(self, c=16):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.c2, self.b2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.relu = nn.ReLU(inplace=True)
        self.twice = nn.Conv2d(c, c, 3, padding=1)
        self.valid = nn.Conv2d(c, 24, 3, padding=0)
        self.strided = nn.Conv2d(24, 24, 3, stride=2, padding=1)
        self.dilated = nn.Conv2d(24, 24, 3, padding=2, dilation=2)
        self.grouped = nn.Conv2d(24, 24, 3, padding=1, groups=4)
        for bn in (self.b1, self.b2):
            bn.running_mean.uniform_(-0.5, 0.5)
            bn.running_var.uniform_(0.5, 2.0)

    def forward(self, x):
        h = self.relu(self.b1(self.c1(x)))
        h = self.relu(self.b2(self.c2(h)) + x)
        t = self.twice(h)
        h = t * torch.sigmoid(t)
        h = self.valid(h)
        return self.grouped(self.dilated(self.strided(h)))


def _winograd_nodes(opt):
    plan = next(iter(opt._plans.values()))   # the first shape's plan: the program it runs
    return [n for n in plan.program.graph.nodes if isinstance(n.target, native_conv.WinogradConv2d)]


def test_winograd_convolutions_match_eager_and_take_their_post_ops(monkeypatch):
    """The four stride-1, ungrouped 3x3s run on the Winograd kernel (the graph calls it, the report
    says native_winograd): the first with its folded BatchNorm and in-place ReLU, the second with the
    shortcut add and the ReLU after it; the others stay convolutions of the `conv` route. Answers
    equal eager's at the captured shape and at a new one, and a returned tensor does not change when
    the model is called again."""
    _force_winograd(monkeypatch)
    torch.manual_seed(0)
    m = Blocks().eval()
    x = torch.randn(2, 16, 12, 12)
    opt = cpu_opt.optimize(m, x, dtype="fp32")
    with torch.no_grad():
        y, ref = opt(x), m(x)
        assert _rel(y, ref) < 1e-5
        keep = y.clone()
        x2 = torch.randn(1, 16, 9, 15)
        assert _rel(opt(x2), m(x2)) < 1e-5
        assert torch.equal(y, keep)
    routed = [r["route"] for r in opt.report()["routed"] if r["route"] == "native_winograd"]
    if not native.vectorized():   # no vector kernels: the route is never taken
        assert not routed and not _winograd_nodes(opt)
        return
    assert len(routed) == 4
    convs = sorted(((n.target.cin, n.target.cout, n.target.padding, n.target.act, len(n.args))
                    for n in _winograd_nodes(opt)), key=str)
    assert convs == sorted([(16, 16, (1, 1), "relu", 3), (16, 16, (1, 1), "relu", 4), (16, 16, (1, 1), "none", 3),
                            (16, 24, (0, 0), "none", 3)], key=str)
    assert "4 3x3 convolution(s) on cpu_opt's Winograd kernel (2 with their ReLU, 1 with their residual add fused)" \
        in opt.report()["passes"]


def test_a_transformers_resnet_runs_its_3x3s_on_the_winograd_kernel(monkeypatch):
    """A `transformers` ResNet (basic blocks, small random config): every stride-1 3x3 on the kernel,
    the same answers as eager at two batch sizes."""
    transformers = pytest.importorskip("transformers")
    _force_winograd(monkeypatch)
    torch.manual_seed(0)
    cfg = transformers.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[2, 1], layer_type="basic")
    m = transformers.ResNetModel(cfg).eval()
    x = torch.randn(1, 3, 64, 64)
    opt = cpu_opt.optimize(m, x, dtype="fp32")
    with torch.no_grad():
        for xx in (x, torch.randn(3, 3, 64, 64)):
            got, ref = opt(xx), m(xx)
            assert _rel(got.last_hidden_state, ref.last_hidden_state) < 1e-5
            assert _rel(got.pooler_output, ref.pooler_output) < 1e-5
    if not native.vectorized():
        assert not _winograd_nodes(opt)
        return
    # stage 1: two blocks of two stride-1 3x3s; stage 2: a stride-2 3x3 (left alone), then one stride-1
    convs = _winograd_nodes(opt)
    assert len(convs) == 5 and sum(n.target.act == "relu" for n in convs) == 5
    assert sum(len(n.args) == 4 for n in convs) >= 2   # the residual adds of stage 1's blocks
    assert opt.report()["num_partitions"] > 0          # the stem, the 1x1 shortcut: oneDNN Graph


def test_layers_with_many_tiles_take_4x4_ones(monkeypatch):
    """F(4x4, 3x3) where a layer has at least WINOGRAD_MIN_TILES 4x4 output tiles (28 x 28: 49), F(2x2)
    below (12 x 12: 9); each shape's plan picks for its own sizes, and both answer as eager does."""
    _force_winograd(monkeypatch)
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 8, 3, padding=1)).eval()
    opt = cpu_opt.optimize(m, torch.randn(1, 16, 28, 28), dtype="fp32")
    with torch.no_grad():
        for size in (28, 12):
            x = torch.randn(1, 16, size, size)
            assert _rel(opt(x), m(x)) < 2e-5
    if not native.vectorized():
        return
    sides = [[n.target.m for n in plan.program.graph.nodes if isinstance(n.target, native_conv.WinogradConv2d)]
             for plan in opt._plans.values()]
    assert sides == [[4, 4], [2, 2]]
