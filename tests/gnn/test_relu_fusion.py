"""gnn.optimize's ReLU fusion: a ReLU right after a SAGEConv / GINConv runs inside the layer (its GEMM's
epilogue or output pass, its gradient in the weight-gradient GEMM) after a torch.fx rewrite of the
model's forward. Same outputs and gradients as PyG; the counts show the layer took the ReLU; forwards
that cannot be rewritten safely run as written."""
import copy

import pytest
import torch

pytest.importorskip("torch_geometric")
from torch_geometric.nn import GINConv, SAGEConv  # noqa: E402

from cpu_opt import gnn  # noqa: E402
from cpu_opt.gnn import pyg as gpyg  # noqa: E402
from cpu_opt.gnn.rmat import node_task, rmat_edge_index  # noqa: E402

F = torch.nn.functional
N = 2 * gpyg.ONEDNN_LINEAR_MIN_ROWS  # the fused linear paths start at this many rows


@pytest.fixture(scope="module")
def graph():
    ei = rmat_edge_index(N, 6 * N, seed=3)
    return ei


def _gin(i, o):
    return GINConv(torch.nn.Sequential(torch.nn.Linear(i, o), torch.nn.ReLU(), torch.nn.Linear(o, o)))


# (conv, f_in, hidden): which forward of gnn.pyg runs layer 1, and so takes the ReLU after it
LAYERS = {
    "sage_max": (lambda i, o: SAGEConv(i, o, aggr="max"), 16, 24),             # lin_l + lin_r, one GEMM
    "sage_mean": (lambda i, o: SAGEConv(i, o, aggr="mean"), 16, 24),           # the same, mean cached
    "sage_mean_narrowing": (lambda i, o: SAGEConv(i, o, aggr="mean"), 40, 16),  # linear first: add + relu
    "gin": (_gin, 16, 24),                                                     # the MLP's last GEMM
    "gin_narrowing": (_gin, 40, 16),                                           # linear first: last Linear
}


class Net(torch.nn.Module):
    def __init__(self, kind, spelling="method", classes=4):
        super().__init__()
        make, f, hidden = LAYERS[kind]
        self.c1, self.c2 = make(f, hidden), make(hidden, classes)
        self.act = torch.nn.ReLU()
        self.spelling = spelling

    def forward(self, x, edge_index):
        h = self.c1(x, edge_index)
        if self.spelling == "method":
            h = h.relu()
        elif self.spelling == "functional":
            h = F.relu(h)
        elif self.spelling == "torch":
            h = torch.relu(h)
        else:
            h = self.act(h)
        return self.c2(h, edge_index)


def _taken(kind) -> bool:
    """Whether layer 1's forward takes the ReLU on this machine (GINConv's MLP is fused only on the
    tall-skinny route; SAGEConv's output on either route)."""
    return not kind.startswith("gin") or kind == "gin_narrowing" or gpyg._native_linear_route()


def _key(kind):
    return f"ReLU after {'GINConv' if kind.startswith('gin') else 'SAGEConv'}: in the layer's output pass"


def _check(ref, fast, x, ei, y, rtol=1e-4, atol=1e-5):
    out_r, out_f = ref(x, ei), fast(x, ei)
    torch.testing.assert_close(out_f, out_r, rtol=rtol, atol=atol)
    F.cross_entropy(out_r, y).backward()
    F.cross_entropy(out_f, y).backward()
    for (name, p_r), p_f in zip(ref.named_parameters(), fast.model.parameters()):
        torch.testing.assert_close(p_f.grad, p_r.grad, rtol=rtol, atol=atol, msg=f"grad of {name}")
    return out_f


@pytest.mark.parametrize("kind", sorted(LAYERS))
def test_relu_after_a_layer_runs_inside_it_with_pyg_outputs_and_gradients(kind, graph):
    make, f, _ = LAYERS[kind]
    x, y = node_task(N, f, 4, graph, seed=3)
    torch.manual_seed(0)
    ref = Net(kind)
    fast = gnn.optimize(copy.deepcopy(ref))
    before = gpyg._counts[_key(kind)]
    _check(ref, fast, x, graph, y)
    took = gpyg._counts[_key(kind)] - before
    assert took == (1 if _taken(kind) else 0), (kind, took)
    notes = " ".join(fast.report()["notes"])
    assert "ReLU right after a layer: applied in the layer's output pass" in notes
    # turned off: the same numbers, torch's ReLU
    off = gnn.optimize(copy.deepcopy(ref), fuse_relu=False)
    before = gpyg._counts[_key(kind)]
    torch.testing.assert_close(off(x, graph), ref(x, graph), rtol=1e-4, atol=1e-5)
    assert gpyg._counts[_key(kind)] == before


@pytest.mark.parametrize("spelling", ["functional", "torch", "module"])
def test_every_spelling_of_relu_is_fused(spelling, graph):
    x, y = node_task(N, 16, 4, graph, seed=4)
    torch.manual_seed(1)
    ref = Net("sage_max", spelling)
    fast = gnn.optimize(copy.deepcopy(ref))
    before = gpyg._counts[_key("sage_max")]
    _check(ref, fast, x, graph, y)
    assert gpyg._counts[_key("sage_max")] == before + 1


def test_second_call_reuses_the_rewrite_and_returns_fresh_outputs(graph):
    x, _ = node_task(N, 16, 4, graph, seed=5)
    torch.manual_seed(2)
    fast = gnn.optimize(Net("sage_max"))
    with torch.no_grad():
        a = fast(x, graph)
        keep = a.clone()
        b = fast(x * 2, graph)
    assert torch.equal(a, keep) and a.data_ptr() != b.data_ptr()
    assert len(fast._relu_graphs) == 1


class ReadTwice(Net):
    def forward(self, x, edge_index):
        h = self.c1(x, edge_index)
        return self.c2(h.relu(), edge_index), h


class Untraceable(Net):
    def forward(self, x, edge_index):
        h = self.c1(x, edge_index)
        if h.sum() > 0:  # control flow on a tensor's value: torch.fx cannot trace it
            h = h * 1.0
        return self.c2(h.relu(), edge_index)


class SetsAttribute(Net):
    def forward(self, x, edge_index):
        h = self.c1(x, edge_index).relu()
        self.hidden = h
        return self.c2(h, edge_index)


@pytest.mark.parametrize("cls,why", [(ReadTwice, "no ReLU right after a layer"), (Untraceable, "not traceable"),
                                     (SetsAttribute, "sets module attributes")])
def test_forwards_that_cannot_be_rewritten_run_as_written_and_say_why(cls, why, graph):
    x, y = node_task(N, 16, 4, graph, seed=6)
    torch.manual_seed(3)
    ref = cls("sage_max")
    fast = gnn.optimize(copy.deepcopy(ref))
    before = gpyg._counts[_key("sage_max")]
    out_r, out_f = ref(x, graph), fast(x, graph)
    for a, b in zip(out_f if isinstance(out_f, tuple) else (out_f,), out_r if isinstance(out_r, tuple) else (out_r,)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert gpyg._counts[_key("sage_max")] == before
    assert any(why in n for n in fast.report()["notes"]), fast.report()["notes"]
    if cls is SetsAttribute:  # the real tensor of the real call, not a tracing proxy
        assert type(fast.model.hidden) is torch.Tensor and torch.equal(fast.model.hidden, torch.relu(fast.model.hidden))


class Dropout(Net):
    def forward(self, x, edge_index):
        h = F.dropout(self.c1(x, edge_index).relu(), p=0.5, training=self.training)
        return self.c2(h, edge_index)


def test_train_and_eval_get_their_own_rewrite(graph):
    x, _ = node_task(N, 16, 4, graph, seed=7)
    torch.manual_seed(4)
    ref = Dropout("sage_max").eval()
    fast = gnn.optimize(copy.deepcopy(ref))
    with torch.no_grad():
        torch.testing.assert_close(fast(x, graph), ref(x, graph), rtol=1e-4, atol=1e-5)
        fast.model.train()
        trained = fast(x, graph)
        fast.model.eval()
        again = fast(x, graph)
    assert not torch.allclose(trained, again)  # dropout ran in train mode, not baked in from eval
    torch.testing.assert_close(again, ref(x, graph), rtol=1e-4, atol=1e-5)
    assert len(fast._relu_graphs) == 2


class Flag(Net):
    def forward(self, x, edge_index, relu: bool = True):
        h = self.c1(x, edge_index)
        if relu:
            h = h.relu()
        return self.c2(h, edge_index)


def test_non_tensor_arguments_are_fixed_per_value(graph):
    x, _ = node_task(N, 16, 4, graph, seed=8)
    torch.manual_seed(5)
    ref = Flag("sage_max")
    fast = gnn.optimize(copy.deepcopy(ref))
    with torch.no_grad():
        for flag in (True, False, True):
            torch.testing.assert_close(fast(x, graph, relu=flag), ref(x, graph, relu=flag), rtol=1e-4, atol=1e-5)
    assert len(fast._relu_graphs) == 2


def _fns():
    """(fused function of args, torch's composite of the same) for each autograd Function with a relu flag"""
    lin = F.linear
    return {
        "linear_sum": (lambda a1, w1, b1, a2, w2, b2: gpyg._NativeLinearSum.apply(a1, w1, b1, a2, w2, b2, True)
                       if gpyg._native_linear_route() else gpyg._TorchLinearSum.apply(a1, w1, b1, a2, w2, b2, True),
                       lambda a1, w1, b1, a2, w2, b2: torch.relu(lin(a1, w1, b1) + lin(a2, w2, b2))),
        "torch_linear_sum": (lambda a1, w1, b1, a2, w2, b2: gpyg._TorchLinearSum.apply(a1, w1, b1, a2, w2, b2, True),
                             lambda a1, w1, b1, a2, w2, b2: torch.relu(lin(a1, w1, b1) + lin(a2, w2, b2))),
        "add_relu": (lambda a1, w1, b1, a2, w2, b2: gpyg._AddReLU.apply(lin(a1, w1, b1), lin(a2, w2, b2)),
                     lambda a1, w1, b1, a2, w2, b2: torch.relu(lin(a1, w1, b1) + lin(a2, w2, b2))),
    }


@pytest.mark.parametrize("name", ["linear_sum", "torch_linear_sum", "add_relu"])
@pytest.mark.parametrize("input_grads", [False, True])
def test_fused_relu_functions_match_torch_in_gradients_and_double_backward(name, input_grads):
    """The Functions behind the fusion, against relu(F.linear + F.linear): first gradients (with and
    without input gradients: the weight-gradient-only case masks g inside the GEMM) and, with
    create_graph=True, the gradient of a gradient norm."""
    fused, ref = _fns()[name]
    gen = torch.Generator().manual_seed(12)
    M = N
    args = [torch.randn(M, 12, generator=gen), torch.randn(20, 12, generator=gen), torch.randn(20, generator=gen),
            torch.randn(M, 9, generator=gen), torch.randn(20, 9, generator=gen), torch.randn(20, generator=gen)]
    for i, t in enumerate(args):
        t.requires_grad_(input_grads or i not in (0, 3))
    up = torch.randn(M, 20, generator=gen)
    got, want = fused(*args), ref(*args)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    params = [t for t in args if t.requires_grad]
    g_got = torch.autograd.grad((got * up).sum(), params)
    g_want = torch.autograd.grad((want * up).sum(), params)
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-3)
    gg = []
    for fn in (fused, ref):
        g = torch.autograd.grad((fn(*args) * up).sum(), params, create_graph=True)
        gg.append(torch.autograd.grad(sum((gi * gi).sum() for gi in g), params, allow_unused=True))
    for a, b in zip(*gg):
        if b is None:
            assert a is None or not a.any()
        else:
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-2)


def test_a_layer_replaced_after_the_first_call_is_the_one_that_runs(graph):
    x, _ = node_task(N, 16, 4, graph, seed=10)
    torch.manual_seed(7)
    model = Net("sage_max")
    fast = gnn.optimize(model)
    with torch.no_grad():
        fast(x, graph)
        model.c2 = SAGEConv(24, 4, aggr="max")  # a new layer (runs PyG's own forward: not in the plan)
        torch.testing.assert_close(fast(x, graph), model(x, graph), rtol=1e-4, atol=1e-5)
