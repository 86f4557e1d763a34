"""cpu_opt.gnn.optimize / patched on PyG 2.8 models: same outputs, gradients and loss curves as
PyG's default edge_index path; bound names swapped only while running, then restored."""
import copy

import pytest
import torch

pyg = pytest.importorskip("torch_geometric")  # the [gnn] extra; installed in the dev venv
from torch_geometric.nn import GCNConv, GINConv, GraphConv, SAGEConv  # noqa: E402

from cpu_opt import gnn  # noqa: E402
from cpu_opt.gnn import pyg as gpyg  # noqa: E402
from cpu_opt.gnn.rmat import node_task, rmat_edge_index  # noqa: E402


class Net(torch.nn.Module):
    def __init__(self, kind, f_in, hidden, classes):
        super().__init__()

        def conv(i, o):
            if kind == "gcn":
                return GCNConv(i, o)
            if kind == "sage_mean":
                return SAGEConv(i, o, aggr="mean")
            if kind == "sage_max":
                return SAGEConv(i, o, aggr="max")
            if kind == "gin":
                return GINConv(torch.nn.Sequential(torch.nn.Linear(i, o), torch.nn.ReLU(), torch.nn.Linear(o, o)))
            if kind == "graphconv_min":
                return GraphConv(i, o, aggr="min")
            raise ValueError(kind)

        self.c1, self.c2 = conv(f_in, hidden), conv(hidden, classes)

    def forward(self, x, edge_index):
        return self.c2(self.c1(x, edge_index).relu(), edge_index)


KINDS = ["gcn", "sage_mean", "sage_max", "gin", "graphconv_min"]


def _task(n=300, e=2000, f=12, classes=4):
    ei = rmat_edge_index(n, e, seed=1)
    x, y = node_task(n, f, classes, ei, seed=1)
    return x, ei, y


@pytest.mark.parametrize("kind", KINDS)
def test_outputs_and_gradients_match_pyg(kind):
    torch.manual_seed(0)
    x, ei, y = _task()
    ref = Net(kind, x.shape[1], 16, 4)
    fast = gnn.optimize(copy.deepcopy(ref))
    out_r = ref(x, ei)
    out_f = fast(x, ei)
    torch.testing.assert_close(out_f, out_r, rtol=1e-4, atol=1e-5)
    torch.nn.functional.cross_entropy(out_r, y).backward()
    torch.nn.functional.cross_entropy(out_f, y).backward()
    for (name, p_r), p_f in zip(ref.named_parameters(), fast.model.parameters()):
        torch.testing.assert_close(p_f.grad, p_r.grad, rtol=1e-4, atol=1e-5, msg=f"grad of {name}")
    rep = fast.report()
    assert rep["capability"] == "gnn" and rep["counts"]["spmm:cpu_opt"] > 0
    assert "edge_index -> adj_t: converted: 1" in rep["notes"]
    assert "spmm:cpu_opt" in fast.report_text()


@pytest.mark.parametrize("kind", ["gcn", "sage_mean", "sage_max", "gin"])
def test_training_loss_curve_matches_pyg(kind):
    torch.manual_seed(0)
    x, ei, y = _task()
    ref = Net(kind, x.shape[1], 16, 4)
    fast_model = copy.deepcopy(ref)
    fast = gnn.optimize(fast_model)
    curves = []
    for model, params in ((ref, ref.parameters()), (fast, fast_model.parameters())):
        opt = torch.optim.Adam(params, lr=0.01)
        losses = []
        for _ in range(8):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x, ei), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        curves.append(losses)
    torch.testing.assert_close(torch.tensor(curves[1]), torch.tensor(curves[0]), rtol=1e-4, atol=1e-5)
    assert curves[0][-1] < curves[0][0]


def test_karate_club_gcn():
    from torch_geometric.datasets import KarateClub

    data = KarateClub()[0]
    torch.manual_seed(0)
    ref = Net("gcn", data.num_features, 8, 4)
    fast = gnn.optimize(copy.deepcopy(ref))
    torch.testing.assert_close(fast(data.x, data.edge_index), ref(data.x, data.edge_index), rtol=1e-4, atol=1e-5)


def test_names_swapped_only_while_running_and_restored():
    import torch_geometric.nn.aggr.base as aggr_base
    import torch_geometric.nn.conv.gcn_conv as gcn_conv
    import torch_geometric.nn.conv.sage_conv as sage_conv
    import torch_geometric.utils as U

    originals = (aggr_base.scatter, sage_conv.spmm, gcn_conv.spmm, gcn_conv.gcn_norm, U.scatter, U.spmm)
    seen = {}

    class Probe(torch.nn.Module):
        def forward(self, x, edge_index):
            seen["scatter"] = aggr_base.scatter
            seen["spmm"] = sage_conv.spmm
            seen["gcn_norm"] = gcn_conv.gcn_norm
            return x

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = SAGEConv(4, 4)
            self.probe = Probe()

        def forward(self, x, edge_index):
            return self.probe(self.conv(x, edge_index), edge_index)

    x, ei = torch.randn(10, 4), torch.randint(0, 10, (2, 30))
    gnn.optimize(M())(x, ei)
    assert seen["scatter"] is not originals[0] and seen["scatter"].__wrapped__ is originals[0]
    assert seen["spmm"].__wrapped__ is originals[1]
    assert seen["gcn_norm"].__wrapped__ is originals[3]
    assert (aggr_base.scatter, sage_conv.spmm, gcn_conv.spmm, gcn_conv.gcn_norm, U.scatter, U.spmm) == originals
    # restored after an exception too
    with pytest.raises(RuntimeError, match="boom"):
        with gnn.patched():
            assert aggr_base.scatter is not originals[0]
            raise RuntimeError("boom")
    assert aggr_base.scatter is originals[0]


def test_patched_default_path_uses_cpu_opt_scatter():
    """Inside patched(), a model called with plain edge_index aggregates with cpu_opt scatter."""
    torch.manual_seed(0)
    x, ei, _ = _task()
    m = Net("sage_max", x.shape[1], 8, 3)
    ref = m(x, ei)
    before = gpyg._counts["scatter:cpu_opt"]
    with gnn.patched():
        out = m(x, ei)
    assert gpyg._counts["scatter:cpu_opt"] > before
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


def test_gcn_normalisation_cached_and_graph_cached():
    torch.manual_seed(0)
    x, ei, _ = _task()
    fast = gnn.optimize(Net("gcn", x.shape[1], 8, 3))
    fast(x, ei)
    fast(x, ei)
    rep = fast.report_text()
    assert "edge_index -> adj_t: converted: 1" in rep and "edge_index -> adj_t: cached: 1" in rep
    assert "gcn_norm:cached" in rep


def test_unsupported_inputs_fall_back_to_pyg():
    torch.manual_seed(0)
    x, ei, _ = _task()
    m = Net("sage_mean", x.shape[1], 8, 3).double()
    fast = gnn.optimize(m)
    # float64 runs on the f64 kernels; an edge_index with a weight stays on the scatter path
    torch.testing.assert_close(fast(x.double(), ei), m(x.double(), ei))
    with pytest.raises(ValueError, match="no torch_geometric MessagePassing"):
        gnn.optimize(torch.nn.Linear(3, 3))


def test_int32_index_graph():
    torch.manual_seed(0)
    x, ei, _ = _task()
    ref = Net("sage_mean", x.shape[1], 8, 3)
    fast = gnn.optimize(copy.deepcopy(ref), index_dtype=torch.int32)
    torch.testing.assert_close(fast(x, ei), ref(x, ei), rtol=1e-4, atol=1e-5)


LINEAR_FIRST_LAYERS = {
    "sage_sum_normalize": lambda: SAGEConv(12, 3, aggr="sum", normalize=True),
    "sage_mean_no_root": lambda: SAGEConv(12, 3, aggr="mean", root_weight=False),
    "sage_mean_no_bias": lambda: SAGEConv(12, 3, aggr="mean", bias=False),
    "gin_train_eps": lambda: GINConv(torch.nn.Sequential(torch.nn.Linear(12, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3)),
                                     eps=0.25, train_eps=True),
}


@pytest.mark.parametrize("name", sorted(LINEAR_FIRST_LAYERS))
def test_linear_before_aggregation_matches_pyg(name, monkeypatch):
    torch.manual_seed(0)
    x, ei, _ = _task()
    ref = LINEAR_FIRST_LAYERS[name]()
    fast_layer = copy.deepcopy(ref)
    fast = gnn.optimize(fast_layer)
    assert fast_layer in gpyg.linear_first_layers(fast_layer)
    xr, xf = x.clone().requires_grad_(), x.clone().requires_grad_()
    widths = []
    real_linear = gpyg.linear

    def counting_linear(inp, weight, bias=None):
        widths.append(weight.shape[0])
        return real_linear(inp, weight, bias)

    monkeypatch.setattr(gpyg, "linear", counting_linear)
    out_r, out_f = ref(xr, ei), fast(xf, ei)
    torch.testing.assert_close(out_f, out_r, rtol=1e-4, atol=1e-5)
    if isinstance(ref, SAGEConv):  # with a root term: lin_l and lin_r as one GEMM of twice the width
        assert widths == ([2 * ref.out_channels] if ref.root_weight else [ref.out_channels])
    g = torch.randn_like(out_r)
    out_r.backward(g)
    out_f.backward(g)
    torch.testing.assert_close(xf.grad, xr.grad, rtol=1e-4, atol=1e-5)
    for (pname, p_r), p_f in zip(ref.named_parameters(), fast_layer.parameters()):
        torch.testing.assert_close(p_f.grad, p_r.grad, rtol=1e-4, atol=1e-5, msg=f"grad of {pname}")
    assert "linear before aggregation" in fast.report_text()
    assert "forward" not in fast_layer.__dict__  # the layer's own forward is back after the call


def test_linear_first_sage_on_a_bipartite_pair_keeps_two_maps():
    """(x_src, x_dst): the root term reads another tensor, so lin_l and lin_r stay two GEMMs."""
    torch.manual_seed(0)
    x, ei, _ = _task()
    x_dst = torch.randn(x.shape[0], x.shape[1])
    ref = SAGEConv(12, 3, aggr="mean")
    fast_layer = copy.deepcopy(ref)
    fast = gnn.optimize(fast_layer)
    assert fast_layer in gpyg.linear_first_layers(fast_layer)
    torch.testing.assert_close(fast((x, x_dst), ei), ref((x, x_dst), ei), rtol=1e-4, atol=1e-5)


def test_linear_first_only_where_it_narrows_and_can_be_turned_off():
    x, ei, _ = _task()
    for kind, want in (("sage_mean", ["c2"]), ("gin", ["c2"]), ("sage_max", []), ("gcn", []), ("graphconv_min", [])):
        m = Net(kind, x.shape[1], 16, 4)  # c1 widens 12 -> 16, c2 narrows 16 -> 4
        got = sorted(n for n, mod in m.named_children() if mod in gpyg.linear_first_layers(m))
        assert got == want, kind
    m = Net("sage_mean", x.shape[1], 16, 4)
    off = gnn.optimize(m, linear_first=False)
    on = gnn.optimize(copy.deepcopy(m))
    torch.testing.assert_close(on(x, ei), off(x, ei), rtol=1e-4, atol=1e-5)
    assert "linear before aggregation" not in off.report_text() and "linear before aggregation" in on.report_text()


def _linear_routed() -> int:
    """Calls that went to cpu_opt's tall-skinny GEMM or torch's oneDNN (gnn.pyg.linear's routes)."""
    return sum(v for k, v in gpyg._counts.items() if k in ("linear: torch's oneDNN", "linear: cpu_opt tall-skinny GEMM"))


def _linear_route_on() -> bool:
    from cpu_opt import routing

    return gpyg._native_linear_route() or routing.route("linear", "fp32").backend == "torch_onednn"


def test_onednn_linear_matches_f_linear_in_values_and_gradients():

    torch.manual_seed(3)
    rows = gpyg.ONEDNN_LINEAR_MIN_ROWS + 3
    x = torch.randn(rows, 24, requires_grad=True)
    w = torch.randn(40, 24, requires_grad=True)
    b = torch.randn(40, requires_grad=True)
    g = torch.randn(rows, 40)
    for bias in (b, None):
        for grad_x in (True, False):
            xi = x.detach().clone().requires_grad_(grad_x)
            xr = x.detach().clone().requires_grad_(grad_x)
            wr, br = w.detach().clone().requires_grad_(), None if bias is None else b.detach().clone().requires_grad_()
            w.grad = b.grad = None
            before = _linear_routed()
            out = gpyg.linear(xi, w, bias)
            ref = torch.nn.functional.linear(xr, wr, br)
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
            out.backward(g)
            ref.backward(g)
            torch.testing.assert_close(w.grad, wr.grad, rtol=1e-4, atol=1e-4)
            if bias is not None:
                torch.testing.assert_close(b.grad, br.grad, rtol=1e-4, atol=1e-4)
            if grad_x:
                torch.testing.assert_close(xi.grad, xr.grad, rtol=1e-4, atol=1e-4)
            assert _linear_routed() - before == int(_linear_route_on())
    # float64, 1-D and small inputs keep F.linear (counted nowhere), with the same values
    before = _linear_routed()
    small = x.detach()[:gpyg.ONEDNN_LINEAR_MIN_ROWS - 1]
    for xi, wi in ((x.detach().double(), w.detach().double()), (x.detach()[0], w.detach()), (small, w.detach())):
        torch.testing.assert_close(gpyg.linear(xi, wi), torch.nn.functional.linear(xi, wi))
    assert _linear_routed() == before


def test_onednn_linear_layers_swapped_only_while_running_and_can_be_turned_off():
    torch.manual_seed(0)
    x, ei, y = _task(n=gpyg.ONEDNN_LINEAR_MIN_ROWS, e=4 * gpyg.ONEDNN_LINEAR_MIN_ROWS)
    m = Net("gin", x.shape[1], 16, 4)
    lin = m.c1.nn[0]
    on = gnn.optimize(m)
    off = gnn.optimize(copy.deepcopy(m), onednn_linear=False)
    assert (lin in gpyg.linear_layers(m)) == _linear_route_on()
    before = _linear_routed()
    torch.testing.assert_close(on(x, ei), off(x, ei), rtol=1e-4, atol=1e-5)
    assert "forward" not in lin.__dict__  # the Linear's own forward is back after the call
    if _linear_route_on():
        assert _linear_routed() > before
        where = "cpu_opt's tall-skinny GEMM" if gpyg._native_linear_route() else "torch's oneDNN"
        assert f"Linear layers on {where}" in on.report_text() and "Linear layers" not in off.report_text()
    # off means off, also for the linear a linear-first layer applies itself (GIN's c2 narrows 16 -> 4)
    assert m.c2 in gpyg.linear_first_layers(m)
    before = _linear_routed()
    off(x, ei)
    assert _linear_routed() == before


def test_onednn_linear_double_backward_matches_f_linear():
    torch.manual_seed(4)
    x = torch.randn(gpyg.ONEDNN_LINEAR_MIN_ROWS, 6, dtype=torch.float32, requires_grad=True)
    w = torch.randn(5, 6, requires_grad=True)
    got, want = [], []
    for fn, acc in ((gpyg.linear, got), (torch.nn.functional.linear, want)):
        y = fn(x, w)
        (gx,) = torch.autograd.grad(y.pow(2).sum(), x, create_graph=True)
        acc.append(torch.autograd.grad(gx.pow(2).sum(), w)[0])
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-3)


def _notes(fast) -> dict:
    return {k: int(v) for k, v in (n.rsplit(": ", 1) for n in fast.report()["notes"])}


@pytest.mark.parametrize("kind", ["sage_mean", "sage_max", "gin", "graphconv_min"])
def test_constant_input_aggregation_is_kept_and_recomputed_when_anything_changes(kind):
    torch.manual_seed(0)
    x, ei, y = _task()
    ref = Net(kind, x.shape[1], 16, 4)
    fast = gnn.optimize(copy.deepcopy(ref))
    spmm = lambda: gpyg._counts["spmm:cpu_opt"]  # noqa: E731
    torch.testing.assert_close(fast(x, ei), ref(x, ei), rtol=1e-4, atol=1e-5)
    assert _notes(fast)["aggregation of a constant input: computed and kept"] == 1
    before = spmm()
    torch.testing.assert_close(fast(x, ei), ref(x, ei), rtol=1e-4, atol=1e-5)
    assert _notes(fast)["aggregation of a constant input: cached"] == 1
    assert spmm() - before == 1  # only the second layer aggregated: the first layer's came from the cache
    # contents changed behind torch's back (numpy view: no _version bump): recomputed, not stale
    x.numpy()[:5] += 1.0
    torch.testing.assert_close(fast(x, ei), ref(x, ei), rtol=1e-4, atol=1e-5)
    assert _notes(fast)["aggregation of a constant input: computed and kept"] == 2
    # another graph, then the first again (its adj_t is still cached: the aggregation is recomputed once)
    ei2 = rmat_edge_index(x.shape[0], 1500, seed=2)
    torch.testing.assert_close(fast(x, ei2), ref(x, ei2), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(fast(x, ei), ref(x, ei), rtol=1e-4, atol=1e-5)
    assert _notes(fast)["aggregation of a constant input: computed and kept"] == 4
    # a copy of the features (another tensor with equal contents) is a hit; a slice of them is not an input
    torch.testing.assert_close(fast(x.clone(), ei), ref(x, ei), rtol=1e-4, atol=1e-5)
    assert _notes(fast)["aggregation of a constant input: cached"] == 2


def test_constant_input_aggregation_not_kept_for_inputs_that_need_gradients():
    torch.manual_seed(0)
    x, ei, y = _task()
    ref = Net("sage_mean", x.shape[1], 16, 4)
    fast = gnn.optimize(copy.deepcopy(ref))
    xr, xf = x.clone().requires_grad_(), x.clone().requires_grad_()
    for _ in range(2):
        torch.nn.functional.cross_entropy(ref(xr, ei), y).backward()
        torch.nn.functional.cross_entropy(fast(xf, ei), y).backward()
    torch.testing.assert_close(xf.grad, xr.grad, rtol=1e-4, atol=1e-5)
    assert not any("constant input" in n for n in fast.report()["notes"])


@pytest.mark.parametrize("kind", KINDS)
def test_inference_mode_first_then_training(kind):
    """What the caches keep (the adj_t, GCN's normalisation, the constant aggregation) is built
    outside inference mode even when an inference_mode call fills them: autograd cannot save an
    inference tensor, so a training call afterwards failed when it got one."""
    torch.manual_seed(0)
    x, ei, y = _task()
    ref = Net(kind, x.shape[1], 16, 4)
    fast = gnn.optimize(copy.deepcopy(ref))
    with torch.inference_mode():
        torch.testing.assert_close(fast(x, ei), ref(x, ei), rtol=1e-4, atol=1e-5)
        fast(x, ei)
    if kind != "gcn":
        assert _notes(fast)["aggregation of a constant input: cached"] == 1
    loss_f = torch.nn.functional.cross_entropy(fast(x, ei), y)
    loss_f.backward()
    torch.nn.functional.cross_entropy(ref(x, ei), y).backward()
    for (name, p_r), p_f in zip(ref.named_parameters(), fast.model.parameters()):
        torch.testing.assert_close(p_f.grad, p_r.grad, rtol=1e-4, atol=1e-5, msg=f"grad of {name}")


def test_constant_input_aggregation_bound_off_and_bad_values():
    torch.manual_seed(0)
    x, ei, y = _task()
    ref = Net("sage_mean", x.shape[1], 16, 4)
    tiny = gnn.optimize(copy.deepcopy(ref), aggregation_cache_mb=0.001)  # 1 KiB: a 300 x 12 result does not fit
    off = gnn.optimize(copy.deepcopy(ref), aggregation_cache_mb=0)
    for fast in (tiny, off):
        for _ in range(2):
            torch.testing.assert_close(fast(x, ei), ref(x, ei), rtol=1e-4, atol=1e-5)
    assert _notes(tiny)["aggregation of a constant input: computed, over the cache bound"] == 2
    assert not any("constant input" in n for n in off.report()["notes"])
    for bad in (-1, "64", True, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="aggregation_cache_mb"):
            gnn.optimize(copy.deepcopy(ref), aggregation_cache_mb=bad)


def test_constant_input_aggregation_skipped_for_hooks_and_learnable_aggregations():
    from torch_geometric.nn.aggr import SoftmaxAggregation

    torch.manual_seed(0)
    x, ei, y = _task()
    ref = Net("sage_mean", x.shape[1], 16, 4)
    fast = gnn.optimize(copy.deepcopy(ref))
    seen = []
    fast.model.c1.register_propagate_forward_hook(lambda m, inp, out: seen.append(1))
    for _ in range(2):
        torch.testing.assert_close(fast(x, ei), ref(x, ei), rtol=1e-4, atol=1e-5)
    assert len(seen) == 2 and not any("constant input" in n for n in fast.report()["notes"])
    learn = SAGEConv(x.shape[1], 4, aggr=SoftmaxAggregation(learn=True))
    assert gpyg.aggregation_cache_layers(learn) == []


@pytest.mark.parametrize("conv", ["gat", "edge_weight_scatter"])
def test_inference_mode_first_then_training_attention_and_scatter_paths(conv):
    from torch_geometric.nn import GATConv

    torch.manual_seed(0)
    x, ei, y = _task()

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.c = GATConv(x.shape[1], 4, heads=2, concat=False) if conv == "gat" else GraphConv(x.shape[1], 4)

        def forward(self, x, edge_index, edge_weight=None):
            return self.c(x, edge_index) if conv == "gat" else self.c(x, edge_index, edge_weight)

    ref = M()
    fast = gnn.optimize(copy.deepcopy(ref))
    w = torch.rand(ei.shape[1]) if conv != "gat" else None
    with torch.inference_mode():
        torch.testing.assert_close(fast(x, ei, w), ref(x, ei, w), rtol=1e-4, atol=1e-5)
    torch.nn.functional.cross_entropy(fast(x, ei, w), y).backward()
    torch.nn.functional.cross_entropy(ref(x, ei, w), y).backward()
    for (name, p_r), p_f in zip(ref.named_parameters(), fast.model.parameters()):
        torch.testing.assert_close(p_f.grad, p_r.grad, rtol=1e-4, atol=1e-5, msg=f"grad of {name}")


@pytest.mark.parametrize("train_eps", [False, True])
def test_gin_root_term_kept_only_when_eps_is_fixed(train_eps):
    """GINConv's aggr(x) + (1 + eps) x is kept whole for a constant input when eps is not trained;
    with a trained eps only the aggregation is kept, and eps still gets PyG's gradient."""
    torch.manual_seed(0)
    x, ei, y = _task()

    def gin(i, o):
        return GINConv(torch.nn.Sequential(torch.nn.Linear(i, o), torch.nn.ReLU(), torch.nn.Linear(o, o)),
                       eps=0.25, train_eps=train_eps)

    class G(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.c1, self.c2 = gin(x.shape[1], 16), gin(16, 4)

        def forward(self, x, edge_index):
            return self.c2(self.c1(x, edge_index).relu(), edge_index)

    ref = G()
    fast_model = copy.deepcopy(ref)
    fast = gnn.optimize(fast_model)
    kept = []
    for model, params in ((ref, ref.parameters()), (fast, fast_model.parameters())):
        opt = torch.optim.Adam(params, lr=0.01)
        for _ in range(3):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x, ei), y).backward()
            opt.step()
        if model is fast:
            kept = [e[0][-1] for e in fast._agg_cache._entries.values()]
    for (name, p_r), p_f in zip(ref.named_parameters(), fast_model.parameters()):
        torch.testing.assert_close(p_f, p_r, rtol=1e-4, atol=1e-5, msg=name)
    assert _notes(fast)["aggregation of a constant input: cached"] == 2
    assert kept == ([None] if train_eps else [("root", 0.25)])
    assert any("aggr(x) + (1 + eps) x" in r["why"] for r in fast.report()["routed"])


def test_constant_input_aggregation_never_returned_to_the_caller():
    """A GINConv whose nn hands back its input (Identity) must not return the kept tensor: the
    caller could change it (numpy, .data, in place) and the next call would return it again."""
    torch.manual_seed(0)
    x, ei, _ = _task()

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.c = GINConv(torch.nn.Identity(), eps=0.5)

        def forward(self, x, edge_index):
            return self.c(x, edge_index)

    ref = M()
    fast = gnn.optimize(copy.deepcopy(ref))
    y1 = fast(x, ei)
    y1.numpy()[:] = 123.0
    y2 = fast(x, ei)
    assert y2.untyped_storage().data_ptr() != y1.untyped_storage().data_ptr()
    torch.testing.assert_close(y2, ref(x, ei), rtol=1e-5, atol=1e-5)
    assert _notes(fast)["aggregation of a constant input: cached"] == 1
    y2.mul_(0)
    torch.testing.assert_close(fast(x, ei), ref(x, ei), rtol=1e-5, atol=1e-5)


def test_learnable_aggregation_gin_trains_as_pyg_with_no_grad_evaluations_between_steps():
    """A GINConv with a learnable aggregation is not cached (its result changes as it trains), also
    when another layer of the model is; evaluations under no_grad between steps must not leave a
    result without gradient for the next step."""
    from torch_geometric.nn.aggr import SoftmaxAggregation

    torch.manual_seed(0)
    x, ei, y = _task()

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            lin = lambda i, o: torch.nn.Sequential(torch.nn.Linear(i, o), torch.nn.ReLU())  # noqa: E731
            self.c1 = GINConv(lin(x.shape[1], 16), aggr=SoftmaxAggregation(learn=True))
            self.c2 = GINConv(lin(16, 4))
            self.c3 = SAGEConv(x.shape[1], 4)

        def forward(self, x, edge_index):
            return self.c2(self.c1(x, edge_index), edge_index) + self.c3(x, edge_index)

    ref = M()
    fast_model = copy.deepcopy(ref)
    fast = gnn.optimize(fast_model)
    assert fast_model.c1 not in gpyg.aggregation_cache_layers(fast_model)
    for model, params in ((ref, ref.parameters()), (fast, fast_model.parameters())):
        opt = torch.optim.SGD(params, lr=0.1)
        for _ in range(3):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x, ei), y).backward()
            opt.step()
            with torch.no_grad():
                model(x, ei)
    for (name, p_r), p_f in zip(ref.named_parameters(), fast_model.parameters()):
        torch.testing.assert_close(p_f, p_r, rtol=1e-4, atol=1e-5, msg=name)


def test_constant_input_aggregation_skips_forward_mode_ad():
    """A dual tensor does not require grad, but it is not a constant: no cached aggregation."""
    import torch.autograd.forward_ad as fwAD

    torch.manual_seed(0)
    x, ei, _ = _task()
    ref = Net("sage_mean", x.shape[1], 16, 4)
    fast = gnn.optimize(copy.deepcopy(ref))
    fast(x, ei)
    with fwAD.dual_level():
        xd = fwAD.make_dual(x, torch.randn_like(x))
        with pytest.raises(NotImplementedError, match="jvp"):  # the spmm has no forward-mode rule: loud
            fast(xd, ei)
    assert "aggregation of a constant input: cached" not in " ".join(fast.report()["notes"])


def test_overlapping_calls_from_two_threads_leave_the_layers_as_they_were():
    import io
    import threading

    a_in, b_in, a_done = threading.Event(), threading.Event(), threading.Event()
    x, ei, _ = _task()

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.c1 = SAGEConv(x.shape[1], 16, aggr="mean")

        def forward(self, x, edge_index):
            h = self.c1(x, edge_index)
            if threading.current_thread().name == "A":
                a_in.set()
                b_in.wait(5)
            elif threading.current_thread().name == "B":
                b_in.set()
                a_done.wait(5)
            return h

    model = M()
    fast = gnn.optimize(model)
    want = model(x, ei)
    got = {}

    def run(name):
        if name == "B":
            a_in.wait(5)
        got[name] = fast(x, ei)
        if name == "A":
            a_done.set()

    threads = [threading.Thread(target=run, args=(n,), name=n) for n in ("A", "B")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for n in "AB":
        torch.testing.assert_close(got[n], want, rtol=1e-5, atol=1e-5)
    assert "propagate" not in model.c1.__dict__ and "forward" not in model.c1.__dict__
    torch.save(model.c1, io.BytesIO())  # a wrapper left on the layer (a local function) would not pickle


def test_torch_compile_of_the_optimized_model_runs_and_sees_changed_features():
    """torch.compile(gnn.optimize(model)) failed inside dynamo on the graph cache's fingerprint (a
    cffi object it cannot guard); that step now runs eagerly, and nothing is cached while tracing."""
    torch.manual_seed(0)
    x, ei, _ = _task()
    ref = Net("sage_mean", x.shape[1], 16, 4)
    # aot_eager: dynamo (where it failed) without inductor's C++ codegen, which fails under the sse41 ISA cap
    compiled = torch.compile(gnn.optimize(copy.deepcopy(ref)), backend="aot_eager")
    with torch.no_grad():
        for step in range(3):
            if step == 2:
                x.numpy()[:10] *= -1  # behind torch's back
            torch.testing.assert_close(compiled(x, ei), ref(x, ei), rtol=1e-4, atol=1e-5)
