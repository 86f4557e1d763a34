"""native/kernels/attention.c — the fused GAT / GATv2 / TransformerConv attention — through
gnn.gat_attention / gatv2_attention / transformer_attention (pure-torch references, gradients
against autograd of the reference, gradcheck in float64, bf16 within tolerance, both runnable ISA
variants and index dtypes, bad inputs), and through gnn.optimize on PyG 2.8's GATConv,
GATv2Conv and TransformerConv: outputs and parameter gradients equal PyG's default path, in
eval and in training with attention dropout (the same torch random stream), with the fused kernel
counted as having run, and PyG's own forward for what is not covered."""
import copy
import math

import pytest
import torch
import torch.nn.functional as F

from cpu_opt import gnn
from cpu_opt.gnn import _kernels as K

from gnn_testutil import RUNNABLE_VARIANTS, assert_bf16_close, csr_case

CASES = ["random", "isolated", "duplicates", "single_node", "single_node_no_edges", "no_edges", "bipartite", "hub"]
KINDS = ["gat", "gatv2", "transformer"]


# ------------------------------------------------------------------ pure-torch reference

def _softmax_ref(s, dst, n):
    """PyG's softmax: per target, max-subtracted, 1e-16 added to the sum."""
    m = torch.zeros(n, s.shape[1], dtype=s.dtype).scatter_reduce(0, dst[:, None].expand_as(s), s.detach(), "amax",
                                                                 include_self=False)
    p = (s - m[dst]).exp()
    z = torch.zeros(n, s.shape[1], dtype=s.dtype).index_add(0, dst, p) + 1e-16
    return p / z[dst]


def _ref(kind, dst, src, n_dst, nodes, mask=None, a_edge=None, slope=0.2):
    """(out, alpha) over edges src -> dst (in the order given); nodes as the op takes them."""
    if kind == "gat":
        x, a_s, a_d = nodes
        z = a_s[src] + a_d[dst] + (a_edge if a_edge is not None else 0)
        score, val = F.leaky_relu(z, slope), x
    elif kind == "gatv2":
        x_l, x_r, att = nodes
        score, val = (F.leaky_relu(x_l[src] + x_r[dst], slope) * att.reshape(att.shape[-2:])).sum(-1), x_l
    else:
        q, k, v = nodes
        score, val = (q[dst] * k[src]).sum(-1) / math.sqrt(v.shape[-1]), v
    alpha = _softmax_ref(score, dst, n_dst)
    w = alpha * mask if mask is not None else alpha
    out = torch.zeros((n_dst,) + tuple(val.shape[1:]), dtype=val.dtype).index_add(0, dst, w[..., None] * val[src])
    return out, alpha


def _inputs(kind, n_dst, n_src, nnz, H, C, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)

    if kind == "gat":
        return [r(n_src, H, C), r(n_src, H), r(n_dst, H)], r(nnz, H)
    if kind == "gatv2":
        return [r(n_src, H, C), r(n_dst, H, C), r(1, H, C)], None
    return [r(n_dst, H, C), r(n_src, H, C), r(n_src, H, C)], None


def _call(kind, graph, nodes, mask=None, a_edge=None, return_alpha=False):
    if kind == "gat":
        return gnn.gat_attention(graph, *nodes, a_edge=a_edge, mask=mask, return_alpha=return_alpha)
    if kind == "gatv2":
        return gnn.gatv2_attention(graph, *nodes, mask=mask, return_alpha=return_alpha)
    return gnn.transformer_attention(graph, *nodes, mask=mask, return_alpha=return_alpha)


def _mask(nnz, H, p=0.4, seed=3, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(nnz, H, generator=g) > p).to(dtype) / (1 - p)


# ------------------------------------------------------------------ the ops against the reference

# every graph case on the default variant and int64; each runnable variant and int32 on two of them
VARIANT_CASES = ([(c, torch.int64, None) for c in CASES]
                 + [(c, i, v) for c in ("random", "hub") for i in (torch.int64, torch.int32) for v in RUNNABLE_VARIANTS])


@pytest.mark.parametrize("case,index_dtype,variant", VARIANT_CASES)
@pytest.mark.parametrize("kind", KINDS)
def test_forward_and_gradients_match_reference(kind, case, index_dtype, variant):
    graph, n_dst, n_src, dst, src, perm = csr_case(case, index_dtype)
    d, s = dst[perm], src[perm]  # edges in CSR order
    for H, C, with_mask in ((1, 8, False), (3, 5, True), (8, 4, True), (2, 16, True)):  # fixed-length loops and not
        nodes, a_edge = _inputs(kind, n_dst, n_src, graph.nnz, H, C)
        mask = _mask(graph.nnz, H) if with_mask else None
        nodes = [t.requires_grad_() for t in nodes]
        a_edge = a_edge.requires_grad_() if a_edge is not None else None
        go = torch.randn(n_dst, H, C)
        with gnn.use_variant(variant):  # None: this CPU's own
            out, alpha = _call(kind, graph, nodes, mask, a_edge, return_alpha=True)
            grads = torch.autograd.grad(out, nodes + ([a_edge] if a_edge is not None else []), go)
        ref_nodes = [t.detach().clone().requires_grad_() for t in nodes]
        ref_edge = a_edge.detach().clone().requires_grad_() if a_edge is not None else None
        r_out, r_alpha = _ref(kind, d, s, n_dst, ref_nodes, mask, ref_edge)
        r_grads = torch.autograd.grad(r_out, ref_nodes + ([ref_edge] if ref_edge is not None else []), go,
                                      allow_unused=True)
        torch.testing.assert_close(out, r_out, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(alpha, r_alpha, rtol=1e-4, atol=1e-6)
        for i, (a, b) in enumerate(zip(grads, r_grads)):
            torch.testing.assert_close(a, b if b is not None else torch.zeros_like(a), rtol=1e-4, atol=1e-5,
                                       msg=lambda m, i=i: f"{kind} H={H} C={C} grad {i}: {m}")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", ["random", "isolated", "bipartite"])
def test_gradcheck_float64(kind, case):
    graph, n_dst, n_src, dst, src, perm = csr_case(case)
    nodes, a_edge = _inputs(kind, n_dst, n_src, graph.nnz, 2, 3, torch.float64)
    mask = _mask(graph.nnz, 2, dtype=torch.float64)
    nodes = [t.requires_grad_() for t in nodes]
    if kind == "gat":
        a_edge.requires_grad_()
        assert torch.autograd.gradcheck(lambda *t: gnn.gat_attention(graph, *t[:3], a_edge=t[3], mask=mask),
                                        (*nodes, a_edge))
    else:
        assert torch.autograd.gradcheck(lambda *t: _call(kind, graph, list(t), mask), tuple(nodes))


@pytest.mark.parametrize("kind", KINDS)
def test_bfloat16_within_tolerance(kind):
    graph, n_dst, n_src, dst, src, perm = csr_case("random")
    nodes, a_edge = _inputs(kind, n_dst, n_src, graph.nnz, 2, 8, torch.bfloat16)
    out = _call(kind, graph, nodes, a_edge=a_edge)
    ref, _ = _ref(kind, dst[perm], src[perm], n_dst, [t.float() for t in nodes],
                  a_edge=a_edge.float() if a_edge is not None else None)
    assert_bf16_close(out, ref)


def test_empty_rows_are_zero_and_need_no_csc_without_grad():
    graph, n_dst, n_src, dst, src, perm = csr_case("isolated")  # rows 12..29 have no in-edges
    nodes, _ = _inputs("gat", n_dst, n_src, graph.nnz, 2, 4)
    out = gnn.gat_attention(graph, *nodes)
    assert torch.equal(out[12:], torch.zeros_like(out[12:]))
    assert graph._csc is None  # inference: the transpose is not built


def test_opcheck():
    graph, n_dst, n_src, dst, src, perm = csr_case("random")
    cp, rt, pt = graph.csc()
    for kind, op in (("gat", torch.ops.cpu_opt.gat_attention), ("gatv2", torch.ops.cpu_opt.gatv2_attention),
                     ("transformer", torch.ops.cpu_opt.transformer_attention)):
        nodes, a_edge = _inputs(kind, n_dst, n_src, graph.nnz, 2, 4)
        nodes = [t.requires_grad_() for t in nodes]
        extra = [a_edge, _mask(graph.nnz, 2), 0.2] if kind == "gat" else [_mask(graph.nnz, 2), 0.2 if kind == "gatv2" else 2.0]
        torch.library.opcheck(op, (graph.rowptr, graph.col, cp, rt, pt, *nodes, *extra))


def test_torch_compile_ops():
    """The three ops (forward and backward) traced by torch.compile(fullgraph=True) equal eager."""
    graph, n_dst, n_src, dst, src, perm = csr_case("random")
    cp, rt, pt = graph.csc()
    (x, a_s, a_d), _ = _inputs("gat", n_dst, n_src, graph.nnz, 2, 4)
    (xl, xr, att), _ = _inputs("gatv2", n_dst, n_src, graph.nnz, 2, 4)
    mask = _mask(graph.nnz, 2)
    leaves = [t.requires_grad_() for t in (x, a_s, a_d, xl, xr, att)]

    def f(x, a_s, a_d, xl, xr, att):
        o1, _ = torch.ops.cpu_opt.gat_attention(graph.rowptr, graph.col, cp, rt, pt, x, a_s, a_d, None, mask, 0.2)
        o2, _ = torch.ops.cpu_opt.gatv2_attention(graph.rowptr, graph.col, cp, rt, pt, xl, xr, att, mask, 0.2)
        o3, _ = torch.ops.cpu_opt.transformer_attention(graph.rowptr, graph.col, cp, rt, pt, xr, x, xl, None, 2.0)
        return (o1 * 2).sum() + o2.sum() + o3.sum()

    eager = f(*leaves)
    ge = torch.autograd.grad(eager, leaves)
    out = torch.compile(f, fullgraph=True, backend="aot_eager")(*leaves)
    gc = torch.autograd.grad(out, leaves)
    torch.testing.assert_close(out, eager)
    for a, b in zip(gc, ge):
        torch.testing.assert_close(a, b)


# ------------------------------------------------------------------ bad inputs

def test_bad_inputs_raise_naming_the_argument():
    graph, n_dst, n_src, dst, src, perm = csr_case("random")
    (x, a_s, a_d), _ = _inputs("gat", n_dst, n_src, graph.nnz, 2, 4)
    with pytest.raises(ValueError, match="a_src must have shape"):
        gnn.gat_attention(graph, x, a_s[:, :1], a_d)
    with pytest.raises(TypeError, match="a_dst dtype"):
        gnn.gat_attention(graph, x, a_s, a_d.double())
    with pytest.raises(ValueError, match="x must be 3-D"):
        gnn.gat_attention(graph, x.reshape(n_src, -1), a_s, a_d)
    with pytest.raises(ValueError, match="mask must have shape"):
        gnn.gat_attention(graph, x, a_s, a_d, mask=torch.ones(graph.nnz + 1, 2))
    with pytest.raises(ValueError, match="source features must have adj.shape\\[1\\]"):
        gnn.gat_attention(graph, x[:-1], a_s[:-1], a_d)
    with pytest.raises(TypeError, match="adj must be"):
        gnn.gat_attention("graph", x, a_s, a_d)
    with pytest.raises(ValueError, match="att must hold"):
        gnn.gatv2_attention(graph, x, torch.randn(n_dst, 2, 4), torch.randn(3, 4))
    with pytest.raises(ValueError, match="q must have shape"):
        gnn.transformer_attention(graph, torch.randn(n_dst, 2, 3), x, x)
    with pytest.raises(ValueError, match="score_div"):
        gnn.transformer_attention(graph, torch.randn(n_dst, 2, 4), x, x, score_div=0.0)
    # indices: checked in C before anything is written
    bad_col = graph.col.clone()
    bad_col[5] = n_src
    with pytest.raises(IndexError, match=r"col\[5\] = %d is out of range \[0, %d\)" % (n_src, n_src)):
        K.gat_forward(graph.rowptr, bad_col, x, a_s, a_d)
    bad_rowptr = graph.rowptr.clone()
    bad_rowptr[3] = bad_rowptr[4] + 1
    with pytest.raises(ValueError, match=r"rowptr must start at 0, never decrease"):
        K.transformer_forward(bad_rowptr, graph.col, torch.randn(n_dst, 2, 4), x, x)
    with pytest.raises(ValueError, match="rowptr\\[-1\\]"):
        K.gat_forward(graph.rowptr, graph.col[:-1], x, a_s, a_d)
    out, alpha = K.gat_forward(graph.rowptr, graph.col, x, a_s, a_d)
    g = torch.randn(n_dst, 2, 4)
    cp, rt, pt = graph.csc()
    for name, t, bound in (("row_t", rt, n_dst), ("perm", pt, graph.nnz)):
        bad = t.clone()
        bad[7] = bound
        args = {"row_t": rt, "perm": pt, name: bad}
        with pytest.raises(IndexError, match=rf"{name}\[7\] = {bound} is out of range"):
            K.gat_backward(graph.rowptr, graph.col, cp, args["row_t"], args["perm"], x, a_s, a_d, None, None, 0.2,
                           alpha, g)
    bad_cp = cp.clone()
    bad_cp[-1] += 1
    with pytest.raises(ValueError, match="colptr"):
        K.gat_backward(graph.rowptr, graph.col, bad_cp, rt, pt, x, a_s, a_d, None, None, 0.2, alpha, g)
    with pytest.raises(ValueError, match="grad_out must have shape"):
        K.gat_backward(graph.rowptr, graph.col, cp, rt, pt, x, a_s, a_d, None, None, 0.2, alpha, g[:, :1])


# ------------------------------------------------------------------ PyG layers through gnn.optimize

pyg = pytest.importorskip("torch_geometric")
from torch_geometric.nn import GATConv, GATv2Conv, TransformerConv  # noqa: E402

from cpu_opt.gnn import pyg as gpyg  # noqa: E402
from cpu_opt.gnn.rmat import node_task, rmat_edge_index  # noqa: E402


class Net(torch.nn.Module):
    """Two attention layers with feature dropout between, like PyG's GAT example."""

    def __init__(self, make, f_in, p=0.0):
        super().__init__()
        self.c1, self.c2, self.p = make(f_in, True), make(None, False), p

    def forward(self, x, edge_index):
        x = F.dropout(x, self.p, self.training)
        x = F.elu(self.c1(x, edge_index))
        x = F.dropout(x, self.p, self.training)
        return self.c2(x, edge_index)


def _layers(kind, **kw):
    """make(f_in, first) for a layer kind; the second layer maps the first's output to 4 classes."""
    heads = kw.pop("heads", 3)
    cls = {"gat": GATConv, "gatv2": GATv2Conv, "transformer": TransformerConv}[kind]
    concat = kw.pop("concat", True)

    def make(f_in, first):
        if first:
            return cls(f_in, 6, heads=heads, concat=concat, **kw)
        return cls(6 * heads if concat else 6, 4, heads=2, concat=False, **kw)

    return make


def _task(n=150, e=900, f=10):
    ei = rmat_edge_index(n, e, seed=1)  # has self-loops and duplicate edges
    x, y = node_task(n, f, 4, ei, seed=1)
    return x, ei, y


def _fused_count():
    return sum(v for k, v in gpyg._counts.items() if k.startswith("attention:cpu_opt"))


def _compare(ref, fast, args, y, *, seed=7, fused=True, atol=1e-5):
    """Same seed, same inputs: outputs and every parameter gradient of ref (PyG) and fast (optimized)."""
    before = _fused_count()
    torch.manual_seed(seed)
    out_r = ref(*args)
    torch.manual_seed(seed)
    out_f = fast(*args)
    torch.testing.assert_close(out_f, out_r, rtol=1e-4, atol=atol)
    F.cross_entropy(out_r, y).backward()
    F.cross_entropy(out_f, y).backward()
    for (name, p_r), p_f in zip(ref.named_parameters(), fast.model.parameters()):
        torch.testing.assert_close(p_f.grad, p_r.grad, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"grad of {n}: {m}")
    ran = _fused_count() - before
    assert (ran > 0) == fused, f"fused attention calls: {ran}"
    return ran


CONFIGS = [
    pytest.param("gat", {}, id="gat"),
    pytest.param("gat", {"concat": False, "heads": 2}, id="gat-concat-false"),
    pytest.param("gat", {"add_self_loops": False}, id="gat-no-self-loops"),
    pytest.param("gat", {"residual": True, "bias": False, "negative_slope": 0.1}, id="gat-residual-no-bias"),
    pytest.param("gatv2", {}, id="gatv2"),
    pytest.param("gatv2", {"share_weights": True, "concat": False}, id="gatv2-shared-concat-false"),
    pytest.param("gatv2", {"add_self_loops": False, "residual": True}, id="gatv2-no-loops-residual"),
    pytest.param("transformer", {}, id="transformer"),
    pytest.param("transformer", {"beta": True, "concat": False}, id="transformer-beta"),
    pytest.param("transformer", {"root_weight": False, "bias": False}, id="transformer-no-root"),
]


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train-dropout"])
@pytest.mark.parametrize("kind,kw", CONFIGS)
def test_pyg_layers_match_pyg(kind, kw, train):
    torch.manual_seed(0)
    x, ei, y = _task()
    ref = Net(_layers(kind, dropout=0.5 if train else 0.0, **kw), x.shape[1], p=0.3 if train else 0.0)
    fast = gnn.optimize(copy.deepcopy(ref))
    ref.train(train)
    fast.train(train)
    assert _compare(ref, fast, (x, ei), y) == 2  # both layers fused
    rep = fast.report()
    assert any(r["why"] == gpyg._ATTENTION_WHY for r in rep["routed"])
    assert any("fused attention" in n for n in rep["notes"])


@pytest.mark.parametrize("kind", KINDS)
def test_training_steps_match_pyg_with_dropout(kind):
    """Four Adam steps in training mode (attention dropout 0.6, feature dropout 0.5) from one seed:
    the same losses, so the dropout masks are PyG's, step after step."""
    x, ei, y = _task()
    torch.manual_seed(0)
    ref = Net(_layers(kind, dropout=0.6), x.shape[1], p=0.5)
    fast_model = copy.deepcopy(ref)
    fast = gnn.optimize(fast_model)
    curves = []
    for model, params in ((ref, ref.parameters()), (fast, fast_model.parameters())):
        model.train()
        torch.manual_seed(11)
        opt = torch.optim.Adam(params, lr=0.01)
        losses = []
        for _ in range(4):
            opt.zero_grad()
            loss = F.cross_entropy(model(x, ei), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        curves.append(losses)
    assert curves[0] == pytest.approx(curves[1], rel=1e-4, abs=1e-5)


def test_dropout_multipliers_are_pyg_dropouts():
    """F.dropout's multipliers, drawn from the same place in torch's random stream."""
    for p in (0.25, 0.6):
        torch.manual_seed(5)
        ref = F.dropout(torch.ones(333, 3), p, training=True)
        state = torch.get_rng_state()
        torch.manual_seed(5)
        got = gpyg.dropout_multipliers(p, (333, 3), torch.float32)
        assert torch.equal(got, ref)
        assert torch.equal(torch.get_rng_state(), state)
    torch.manual_seed(5)
    state = torch.get_rng_state()
    assert torch.equal(gpyg.dropout_multipliers(1.0, (4, 2), torch.float32), torch.zeros(4, 2))
    assert torch.equal(torch.get_rng_state(), state)  # as F.dropout(p=1): nothing drawn


def test_native_bernoulli_reproduces_torch_draws_and_state(monkeypatch):
    """native/kernels/random.c draws what torch's bernoulli_ draws from the same MT19937 state, and
    leaves the state where torch leaves it: right after seeding, at odd word positions, across the
    624-word regeneration, for lengths of 0 to 2000 elements and keep probabilities near 0 and 1."""
    assert gpyg._native_bernoulli_ok()
    for pre in (0, 1, 311, 623, 624):  # words consumed before: torch.rand draws one 32-bit word each
        for n in (0, 1, 2, 311, 312, 313, 624, 2000):
            for keep in (0.4, 1e-9, 1 - 1e-12, 1.0):
                torch.manual_seed(11)
                if pre:
                    torch.randint(0, 2 ** 31 - 1, (pre,), dtype=torch.int32)  # advances the stream
                state = torch.get_rng_state()
                ref = torch.empty(n).bernoulli_(keep).div_(keep)
                got = K.bernoulli_mt19937(state, n, math.ceil(keep * 2.0 ** 53), torch.ones(1).div_(keep).item(),
                                          torch.empty(n))
                assert torch.equal(got, ref), (pre, n, keep)
                assert torch.equal(state, torch.get_rng_state()), (pre, n, keep)
    # dropout_multipliers takes the native path (the kernel is called) and matches F.dropout
    calls = []
    real = K.bernoulli_mt19937
    monkeypatch.setattr(K, "bernoulli_mt19937", lambda *a: calls.append(1) or real(*a))
    torch.manual_seed(2)
    got = gpyg.dropout_multipliers(0.6, (1000, 8), torch.float32)
    after = torch.rand(4)
    torch.manual_seed(2)
    assert torch.equal(got, F.dropout(torch.ones(1000, 8), 0.6, training=True)) and calls == [1]
    assert torch.equal(after, torch.rand(4))


def test_native_bernoulli_bad_input_and_fallback(monkeypatch):
    state = torch.get_rng_state()
    with pytest.raises(ValueError, match="layout"):
        K.bernoulli_mt19937(state[:100].clone(), 4, 1 << 52, 2.0, torch.empty(4))
    bad = state.clone()
    bad[8:12] = torch.tensor([0, 0, 0, 0], dtype=torch.uint8)  # left = 0: not a state torch makes
    with pytest.raises(ValueError, match="layout"):
        K.bernoulli_mt19937(bad, 4, 1 << 52, 2.0, torch.empty(4))
    with pytest.raises(ValueError, match="n = 5"):
        K.bernoulli_mt19937(state.clone(), 5, 1 << 52, 2.0, torch.empty(4))
    with pytest.raises(ValueError, match="keep_below"):
        K.bernoulli_mt19937(state.clone(), 4, (1 << 53) + 1, 2.0, torch.empty(4))
    with pytest.raises(TypeError):
        K.bernoulli_mt19937(state.clone(), 4, 1 << 52, 2.0, torch.empty(4, dtype=torch.float64))
    # a torch whose draws the kernel does not reproduce: the check says so, torch's own draws are used
    monkeypatch.setattr(gpyg, "_NATIVE_BERNOULLI", [])
    monkeypatch.setattr(K, "bernoulli_mt19937", lambda state, n, kb, sc, out: out.fill_(sc))
    assert not gpyg._native_bernoulli_ok()
    torch.manual_seed(4)
    got = gpyg.dropout_multipliers(0.5, (50, 2), torch.float32)
    torch.manual_seed(4)
    assert torch.equal(got, F.dropout(torch.ones(50, 2), 0.5, training=True))


class BipartiteNet(torch.nn.Module):
    def __init__(self, conv):
        super().__init__()
        self.conv = conv

    def forward(self, x_src, x_dst, edge_index):
        return self.conv((x_src, x_dst), edge_index)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train-dropout"])
def test_bipartite_inputs(kind, train):
    g = torch.Generator().manual_seed(2)
    n_src, n_dst = 40, 25
    ei = torch.stack([torch.randint(0, n_src, (160,), generator=g), torch.randint(0, n_dst, (160,), generator=g)])
    xs, xd = torch.randn(n_src, 7, generator=g), torch.randn(n_dst, 5, generator=g)
    y = torch.randint(0, 4, (n_dst,), generator=g)
    torch.manual_seed(0)
    cls = {"gat": GATConv, "gatv2": GATv2Conv, "transformer": TransformerConv}[kind]
    ref = BipartiteNet(cls((7, 5), 4, heads=2, concat=False, dropout=0.5 if train else 0.0))
    fast = gnn.optimize(copy.deepcopy(ref), edge_arg="edge_index")
    ref.train(train)
    fast.train(train)
    assert _compare(ref, fast, (xs, xd, ei), y) == 1


def test_gat_edge_attr_is_fused_and_others_fall_back():
    x, ei, y = _task()
    ea = torch.randn(ei.shape[1], 3)

    class EdgeNet(torch.nn.Module):
        def __init__(self, conv):
            super().__init__()
            self.conv = conv

        def forward(self, x, edge_index, edge_attr):
            return self.conv(x, edge_index, edge_attr)

    for conv, fused in ((GATConv(x.shape[1], 4, heads=2, concat=False, edge_dim=3, dropout=0.3), True),
                        (GATConv(x.shape[1], 4, heads=2, concat=False, edge_dim=3, fill_value=0.5), True),
                        (GATv2Conv(x.shape[1], 4, heads=2, concat=False, edge_dim=3), False),
                        (TransformerConv(x.shape[1], 4, heads=2, concat=False, edge_dim=3), False)):
        torch.manual_seed(0)
        ref = EdgeNet(conv)
        fast = gnn.optimize(copy.deepcopy(ref))
        ref.train(True)
        fast.train(True)
        _compare(ref, fast, (x, ei, ea), y, fused=fused)
        if not fused:
            assert any(f["op"] == "attention" and "edge_attr" in f["reason"] for f in fast.report()["fallbacks"])


def test_return_attention_weights_falls_back_to_pyg():
    x, ei, y = _task()
    torch.manual_seed(0)
    conv = GATConv(x.shape[1], 4, heads=2)
    fast_conv = copy.deepcopy(conv)
    before = _fused_count()
    with gnn.patched(), gpyg._forwards({fast_conv: gpyg._gat_forward}):
        out_f, (ei_f, a_f) = fast_conv(x, ei, return_attention_weights=True)
    out_r, (ei_r, a_r) = conv(x, ei, return_attention_weights=True)
    torch.testing.assert_close(out_f, out_r)
    torch.testing.assert_close(a_f, a_r)
    assert torch.equal(ei_f, ei_r) and _fused_count() == before
    assert gpyg._counts["attention:pyg (GATConv: return_attention_weights)"] > 0


def test_fused_attention_off_and_subclasses_keep_pyg():
    class MyGAT(GATConv):
        pass

    x, ei, y = _task()
    torch.manual_seed(0)
    ref = Net(lambda f_in, first: (MyGAT(f_in, 6, heads=2) if first else GATConv(12, 4)), x.shape[1])
    fast = gnn.optimize(copy.deepcopy(ref))
    assert _compare(ref, fast, (x, ei), y) == 1  # only the exact GATConv
    off = gnn.optimize(copy.deepcopy(ref), fused_attention=False)
    _compare(copy.deepcopy(ref), off, (x, ei), y, fused=False)
    assert not off.report()["routed"] or all(r["why"] != gpyg._ATTENTION_WHY for r in off.report()["routed"])


def test_edge_index_out_of_range_gives_pyg_error():
    x, ei, y = _task()
    bad = ei.clone()
    bad[0, 3] = x.shape[0] + 5
    model = gnn.optimize(Net(_layers("gat"), x.shape[1]))
    with pytest.raises((IndexError, RuntimeError, ValueError)):
        model(x, bad)
