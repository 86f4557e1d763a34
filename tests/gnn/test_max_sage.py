"""A max-aggregating SAGEConv as one Function (gnn.pyg._NativeMaxSage): its backward takes the
gradient of x through ``mask_gather_proj``, which forms each edge's row of ``g @ W_l`` where the edge
won a feature instead of the n x F product. The kernel against float64 ``mask_gather(g @ W_l)`` on
every variant that runs here; the layer against PyG and against torch autograd; the layers it must
not take; bad input."""
import copy

import pytest
import torch

from cpu_opt import gnn, native
from cpu_opt.gnn import _kernels as K
from cpu_opt.gnn.rmat import rmat_edge_index

pytest.importorskip("torch_geometric")
from torch_geometric.nn import SAGEConv  # noqa: E402

from cpu_opt.gnn import pyg as gpyg  # noqa: E402

N = 2 * gpyg.ONEDNN_LINEAR_MIN_ROWS  # the tall-skinny layer paths start at this many rows


def _variants():
    from cpu_opt.platform import hw

    here = native.select_variant(hw.detect())
    order = ("base", "avx2", "avx512")
    return [v for v in order if v in native.compiled_variants() and order.index(v) <= order.index(here)]


def _winners(n_dst, n_src, F, seed, index_dtype=torch.int64, src_hi=None):
    """A random bipartite CSR adj_t (n_dst x n_src; sources at or past src_hi have no edges), x and
    the max aggregation's winner mask."""
    g = torch.Generator().manual_seed(seed)
    e = 6 * max(n_dst, n_src)
    src, dst = torch.randint(0, src_hi or n_src, (e,), generator=g), torch.randint(0, n_dst, (e,), generator=g)
    order = torch.sort(dst, stable=True).indices
    rowptr = torch.cat([torch.zeros(1, dtype=torch.int64), torch.bincount(dst, minlength=n_dst).cumsum(0)])
    graph = gnn.CSRGraph(rowptr, src[order].to(index_dtype), n_src)
    x = torch.randn(n_src, F, generator=g)
    _, wmask = K.segment_reduce(graph.rowptr, graph.col, None, x, "amax", mask=True)
    return graph, x, wmask


@pytest.mark.parametrize("variant", _variants())
@pytest.mark.parametrize("F,C", [(64, 8), (128, 8), (48, 3), (32, 16), (16, 4), (24, 8), (70, 5), (8, 2)])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_mask_gather_proj_is_mask_gather_of_the_product(variant, F, C, index_dtype):
    """Whole and partial mask words, 16-wide vector rows (F % 16 == 0 on avx512) and the scalar rows,
    both index types, rows without edges; ``out=`` adds into a given tensor."""
    graph, _, wmask = _winners(300, 200, F, seed=F * 7 + C, index_dtype=index_dtype, src_hi=180)
    colptr, row_t, perm = graph.csc()
    g = torch.randn(300, C, generator=torch.Generator().manual_seed(1))
    wl = torch.randn(C, F, generator=torch.Generator().manual_seed(2))
    ref = K.mask_gather(colptr, row_t, perm, wmask, g.double() @ wl.double(), None, 200)
    with K.use_variant(variant):
        out = K.mask_gather_proj(colptr, row_t, perm, wmask, g, wl, 200)
        base = torch.randn(200, F)
        acc = K.mask_gather_proj(colptr, row_t, perm, wmask, g, wl, 200, out=base.clone())
    assert out.dtype == torch.float32 and out.shape == (200, F)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(acc.double(), base.double() + ref, rtol=1e-5, atol=1e-5)
    assert not out[180:].any() and torch.equal(acc[180:], base[180:])   # sources without edges


def test_mask_gather_proj_refuses_bad_input():
    graph, _, wmask = _winners(50, 40, 32, seed=5)
    colptr, row_t, perm = graph.csc()
    g, wl = torch.randn(50, 4), torch.randn(4, 32)
    with pytest.raises(ValueError, match="wl must have grad's 4 columns"):
        K.mask_gather_proj(colptr, row_t, perm, wmask, g, torch.randn(5, 32), 40)
    with pytest.raises(ValueError, match="out must be a contiguous"):
        K.mask_gather_proj(colptr, row_t, perm, wmask, g, wl, 40, out=torch.zeros(40, 31))
    with pytest.raises(ValueError, match="out must be a contiguous"):
        K.mask_gather_proj(colptr, row_t, perm, wmask, g, wl, 40, out=torch.zeros(32, 40).t())
    with pytest.raises(TypeError):
        K.mask_gather_proj(colptr, row_t, perm, wmask, g.double(), wl, 40)
    bad_row = row_t.clone()
    bad_row[3] = 50
    with pytest.raises(IndexError, match="row_t"):
        K.mask_gather_proj(colptr, bad_row, perm, wmask, g, wl, 40)
    bad_perm = perm.clone()
    bad_perm[7] = perm.numel()
    with pytest.raises(IndexError, match="perm"):
        K.mask_gather_proj(colptr, row_t, bad_perm, wmask, g, wl, 40)
    with pytest.raises(ValueError, match="bit set at or past F = 24"):   # a winner mask of 32 features read as 24
        K.mask_gather_proj(colptr, row_t, perm, wmask, g, torch.randn(4, 24), 40)
    f = native.ffi()
    fn = native.kernel("mask_gather_proj_f32_i64")
    nul = f.NULL
    p = (lambda t, c: f.cast(c, t.data_ptr()))  # noqa: E731
    out = torch.empty(40, 32)
    args = [p(colptr, "int64_t *"), 40, p(row_t, "int64_t *"), p(perm, "int64_t *"), row_t.numel(),
            p(wmask, "uint64_t *"), p(g, "float *"), 50, 4, p(wl, "float *"), 32, p(out, "float *"), 0, 2, nul]
    assert fn(*args) == 0
    for i in (6, 9, 11):   # g, wl, out NULL
        assert fn(*[nul if j == i else a for j, a in enumerate(args)]) == -2
    assert fn(*[-1 if j == 4 else a for j, a in enumerate(args)]) == -2


def _reference(x, x_r, w1, b1, w2, b2, graph, relu):
    """The layer in torch ops (scatter_reduce amax over the in-edges; empty rows 0), for autograd."""
    dst = torch.repeat_interleave(torch.arange(graph.n_rows), graph.rowptr[1:] - graph.rowptr[:-1])
    src = graph.col.long()
    aggr = torch.zeros(graph.n_rows, x.shape[1], dtype=x.dtype).scatter_reduce(
        0, dst.unsqueeze(1).expand(-1, x.shape[1]), x[src], "amax", include_self=False)
    y = torch.nn.functional.linear(aggr, w1, b1) + torch.nn.functional.linear(x_r, w2, b2)
    return y.relu() if relu else y


@pytest.mark.parametrize("same", [True, False])
@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("biases", [(True, False), (False, True), (True, True)])
def test_native_max_sage_matches_autograd(same, relu, biases):
    """Outputs and every gradient against the same layer in torch ops (float64); the root term reading
    x itself (its gradient added into the aggregation's) or a separate x_r (a bipartite layer)."""
    n_src, n_dst = (N, N) if same else (N, N // 2)
    graph, x, _ = _winners(n_dst, n_src, 64, seed=11)
    gen = torch.Generator().manual_seed(3)
    x = x.requires_grad_()
    x_r = x if same else torch.randn(n_dst, 64, generator=gen).requires_grad_()
    w1, w2 = (torch.randn(8, 64, generator=gen).mul_(0.1).requires_grad_() for _ in range(2))
    b1 = torch.randn(8, generator=gen).requires_grad_() if biases[0] else None
    b2 = torch.randn(8, generator=gen).requires_grad_() if biases[1] else None
    leaves = [t for t in (x, None if same else x_r, w1, b1, w2, b2) if t is not None]
    out = gpyg._NativeMaxSage.apply(x, None if same else x_r, w1, b1, w2, b2, graph.rowptr, graph.col, *graph.csc(),
                                    relu)
    g_out = torch.randn(out.shape, generator=gen)
    got = torch.autograd.grad(out, leaves, g_out)
    dbl = [t.detach().double().requires_grad_() for t in leaves]
    it = iter(dbl)
    xd = next(it)
    xrd = xd if same else next(it)
    w1d = next(it)
    b1d = next(it) if biases[0] else None
    w2d = next(it)
    b2d = next(it) if biases[1] else None
    ref = _reference(xd, xrd, w1d, b1d, w2d, b2d, graph, relu)
    want = torch.autograd.grad(ref, dbl, g_out.double())
    torch.testing.assert_close(out.double(), ref.detach(), rtol=1e-5, atol=1e-5)
    for a, b in zip(got, want):   # float32 sums over thousands of rows: to their rounding at the gradient's scale
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-4 * max(1.0, b.abs().max().item()))
    # create_graph: the same first-order gradients (through differentiable ops and the custom op)
    again = torch.autograd.grad(gpyg._NativeMaxSage.apply(x, None if same else x_r, w1, b1, w2, b2, graph.rowptr,
                                                          graph.col, *graph.csc(), relu), leaves, g_out,
                                create_graph=True)
    for a, b in zip(again, want):   # float32 sums over the rows in torch's order: to float32 rounding
        torch.testing.assert_close(a.double(), b, rtol=2e-4, atol=2e-4 * max(1.0, b.abs().max().item()))


class Net(torch.nn.Module):
    def __init__(self, hidden=64, classes=8, **kw):
        super().__init__()
        self.c1 = SAGEConv(16, hidden, aggr="max")
        self.c2 = SAGEConv(hidden, classes, aggr="max", **kw)

    def forward(self, x, edge_index):
        return self.c2(self.c1(x, edge_index).relu(), edge_index)


def _train_step_both(base, seed):
    """One cross-entropy backward of ``base`` and of ``gnn.optimize`` of a copy on an R-MAT graph:
    ``(base, fast, x, edge_index, how many layer calls took _NativeMaxSage)``."""
    ei = rmat_edge_index(N, 6 * N, seed=seed)
    fast = gnn.optimize(copy.deepcopy(base))
    x = torch.randn(N, 16)
    y = torch.randint(0, 8, (N,))
    before = gpyg._counts[gpyg._MAX_SAGE]
    for m in (base, fast):
        torch.nn.functional.cross_entropy(m(x, ei), y).backward()
    return base, fast, x, ei, gpyg._counts[gpyg._MAX_SAGE] - before


def _assert_same_grads(base, fast):
    for (name, p), q in zip(base.named_parameters(), fast.model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5, msg=f"grad of {name}")


@pytest.mark.parametrize("kw", [{}, {"bias": False}, {"normalize": True}])
def test_optimized_sage_max_takes_the_narrowing_layer(kw):
    """gnn.optimize runs layer 2 (64 -> 8, its input needing a gradient) as one Function on the vector
    kernels (avx512, avx2); outputs and every parameter's gradient equal PyG's. Layer 1 (its input a constant) keeps
    PyG's propagate, where the aggregation cache serves it."""
    torch.manual_seed(0)
    base, fast, x, ei, ran = _train_step_both(Net(**kw), seed=2)
    assert ran == (1 if K.variant() in ("avx512", "avx2") else 0)
    assert gpyg._max_sage_fits(64, 8) == (K.variant() in ("avx512", "avx2"))
    torch.testing.assert_close(fast(x, ei), base(x, ei), rtol=1e-4, atol=1e-5)
    _assert_same_grads(base, fast)


class SlicedNet(Net):
    """Layer 2 reads a non-contiguous view of layer 1's output (every other column of a wider one)."""

    def __init__(self):
        super().__init__()
        self.c1 = SAGEConv(16, 128, aggr="max")

    def forward(self, x, edge_index):
        return self.c2(self.c1(x, edge_index).relu()[:, ::2], edge_index)


def test_optimized_sage_max_takes_a_strided_input():
    """A layer reading a strided view of the hidden features (as a model that slices them does) gets
    the same outputs and gradients as PyG: the Function reads dense copies."""
    torch.manual_seed(0)
    base, fast, _, _, ran = _train_step_both(SlicedNet(), seed=6)
    assert ran == (1 if gpyg._max_sage_fits(64, 8) else 0)
    _assert_same_grads(base, fast)


@pytest.mark.parametrize("case", ["widening", "no_grad", "width_not_8", "hooked"])
def test_layers_the_fused_max_sage_leaves_to_propagate(case):
    """The Function takes only what it was built for: a layer whose output is not narrower than its
    input, one called without gradients, features not a multiple of 8 wide, and one with a
    propagate hook all run PyG's propagate (the answers stay PyG's)."""
    ei = rmat_edge_index(N, 6 * N, seed=4)
    torch.manual_seed(0)
    base = Net(hidden=20) if case == "width_not_8" else Net(classes=64 if case == "widening" else 8)
    if case == "hooked":
        base.c2.register_propagate_forward_hook(lambda mod, inputs, out: out)
    fast = gnn.optimize(copy.deepcopy(base))
    x = torch.randn(N, 16)
    before = gpyg._counts[gpyg._MAX_SAGE]
    with torch.set_grad_enabled(case != "no_grad"):
        got, want = fast(x, ei), base(x, ei)
    assert gpyg._counts[gpyg._MAX_SAGE] == before
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
