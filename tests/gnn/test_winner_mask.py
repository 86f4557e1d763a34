"""max/min spmm winners as a bit mask per nonzero (segment_reduce's wmask, mask_gather,
mask_weight_grad): the same forward and the same gradients as the int32 winner index, the format
chosen by size, gradcheck through both, torch.compile, and bad masks refused before any write."""
import pytest
import torch

from cpu_opt import gnn, native
from cpu_opt.gnn import _kernels as K

from gnn_testutil import GRAPH_CASES, RUNNABLE_VARIANTS, csr_case, ref_spmm


_graph = csr_case


@pytest.mark.parametrize("variant", RUNNABLE_VARIANTS)
@pytest.mark.parametrize("case", GRAPH_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("F", [5, 16, 24, 32, 48, 64, 70, 128])  # one partial word (24: three float32 vectors; 16,
# 32, 48: one, two, three AVX-512 vectors), one full word, two words (128: two whole words, the vector path per word)
def test_mask_path_equals_index_path(case, variant, dtype, F):
    g, n_rows, n_cols, *_ = _graph(case, torch.int32 if F == 70 else torch.int64)
    torch.manual_seed(3)
    x = torch.randn(n_cols, F).to(dtype)
    go = torch.randn(n_rows, F).to(dtype)
    w = (torch.rand(g.nnz) + 0.5).to(dtype)
    colptr, row_t, perm_t = g.csc()
    tol = dict(rtol=1e-2, atol=1e-2) if dtype == torch.bfloat16 else {}
    with gnn.use_variant(variant):
        for reduce in ("amax", "amin"):
            for weight in (None, w):
                out_a, arg = K.segment_reduce(g.rowptr, g.col, weight, x, reduce)
                out_m, wmask = K.segment_reduce(g.rowptr, g.col, weight, x, reduce, mask=True)
                assert torch.equal(out_a, out_m)
                assert wmask.dtype == torch.int64 and tuple(wmask.shape) == (g.nnz, K.mask_words(F))
                # the mask holds exactly the winners of the index: bit j of nonzero rowptr[r] + arg[r, j]
                want = torch.zeros(g.nnz, K.mask_words(F) * 64, dtype=torch.bool)
                r, j = torch.nonzero(arg >= 0, as_tuple=True)
                want[g.rowptr[r] + arg[r, j].long(), j] = True
                bits = (wmask.unsqueeze(-1) >> torch.arange(64)) & 1
                assert torch.equal(bits.reshape(g.nnz, K.mask_words(F) * 64).bool(), want)
                gx_a = K.arg_gather(colptr, row_t, perm_t, arg, g.rowptr, go, weight, n_cols)
                gx_m = K.mask_gather(colptr, row_t, perm_t, wmask, go, weight, n_cols)
                torch.testing.assert_close(gx_m, gx_a, **tol)
                gw_a = K.arg_weight_grad(arg, go, x, g.rowptr, g.col)
                gw_m = K.mask_weight_grad(wmask, go, x, g.rowptr, g.col)
                torch.testing.assert_close(gw_m, gw_a, **tol)


@pytest.mark.parametrize("variant", RUNNABLE_VARIANTS)
@pytest.mark.parametrize("case", ["random", "hub", "duplicates", "isolated"])
@pytest.mark.parametrize("F", [32, 64, 128])
def test_register_winners_with_ties_zeros_and_infinities(case, variant, F):
    """The float32 register path of max/min with winners (unweighted, F = 32 or whole words of 64: the
    maximum and the position of its first edge in registers, one pass) against the generic loop's
    int32 index: the first edge equal to the result wins, on data full of ties (few distinct values,
    +0 and -0, as after a ReLU), with and without infinities, in short rows (each edge's mask word
    formed by comparing positions) and the hub's long row (bits set one by one). +inf and -inf in
    one lane of a row trip the register path's NaN check (a running sum) and send the row to the
    generic loop: the same answer; a NaN sends it there too (NaN wins, PyG's rule)."""
    g, n_rows, n_cols, *_ = _graph(case)
    gen = torch.Generator().manual_seed(F)
    ties = torch.randint(-2, 3, (n_cols, F), generator=gen).float().relu()  # 0, 1, 2: ties everywhere
    ties[torch.rand(n_cols, F, generator=gen) < 0.1] = -0.0
    pos_inf = ties.clone()
    pos_inf[torch.rand(n_cols, F, generator=gen) < 0.05] = float("inf")
    x = pos_inf.clone()
    x[torch.rand(n_cols, F, generator=gen) < 0.05] = -float("inf")
    cases = [ties, pos_inf, -pos_inf, x]
    if n_cols > 3:
        xn = x.clone()
        xn[1, F - 1] = float("nan")
        cases.append(xn)
    with gnn.use_variant(variant):
        for xi in cases:
            for reduce in ("amax", "amin"):
                out_a, arg = K.segment_reduce(g.rowptr, g.col, None, xi, reduce)
                out_m, wmask = K.segment_reduce(g.rowptr, g.col, None, xi, reduce, mask=True)
                assert torch.equal(out_a.isnan(), out_m.isnan())
                assert torch.equal(out_a.nan_to_num(), out_m.nan_to_num())
                want = torch.zeros(g.nnz, K.mask_words(F) * 64, dtype=torch.bool)
                r, j = torch.nonzero(arg >= 0, as_tuple=True)
                want[g.rowptr[r] + arg[r, j].long(), j] = True
                bits = (wmask.unsqueeze(-1) >> torch.arange(64)) & 1
                assert torch.equal(bits.reshape(g.nnz, K.mask_words(F) * 64).bool(), want), (reduce, variant)


@pytest.mark.parametrize("case", ["random", "hub", "duplicates"])
def test_mask_gather_variants_agree_bit_for_bit(case):
    """mask_gather's avx512 rows (masked loads, no branches) add the same values in the same order as
    the avx2 rows (and-masked vectors) and the scalar loop: equal bit for bit, weighted or not."""
    g, n_rows, n_cols, *_ = _graph(case)
    colptr, row_t, perm_t = g.csc()
    gen = torch.Generator().manual_seed(11)
    for F in (16, 32, 48, 64, 128, 24):
        x = torch.randn(n_cols, F, generator=gen).relu()
        go = torch.randn(n_rows, F, generator=gen)
        w = torch.rand(g.nnz, generator=gen) - 0.3  # negative weights too
        _, wmask = K.segment_reduce(g.rowptr, g.col, None, x, "amax", mask=True)
        got = {}
        for variant in RUNNABLE_VARIANTS:
            with gnn.use_variant(variant):
                got[variant] = [K.mask_gather(colptr, row_t, perm_t, wmask, go, weight, n_cols) for weight in (None, w)]
        first = got[RUNNABLE_VARIANTS[0]]
        for variant, outs in got.items():
            assert all(torch.equal(a, b) for a, b in zip(outs, first)), (variant, F)


def test_format_chosen_by_size_and_both_pass_gradcheck():
    torch.manual_seed(4)
    sparse = gnn.CSRGraph.from_edge_index(torch.randint(0, 30, (2, 60)), 30)  # average degree 2
    dense = gnn.CSRGraph.from_edge_index(torch.randint(0, 12, (2, 600)), 12)  # average degree 50
    colptr, row_t, perm_t = sparse.csc()
    x = torch.randn(30, 8, dtype=torch.float64)
    _, win = torch.ops.cpu_opt.spmm(sparse.rowptr, sparse.col, None, colptr, row_t, perm_t, x, "amax")
    assert win.dtype == torch.int64 and tuple(win.shape) == (sparse.nnz, 1)
    colptr, row_t, perm_t = dense.csc()
    _, win = torch.ops.cpu_opt.spmm(dense.rowptr, dense.col, None, colptr, row_t, perm_t, x[:12], "amax")
    assert win.dtype == torch.int32 and tuple(win.shape) == (12, 8)
    assert K.use_winner_mask(1000, 100, 64) and not K.use_winner_mask(4000, 100, 64)
    for g in (sparse, dense):
        xg = torch.randn(g.n_cols, 8, dtype=torch.float64, requires_grad=True)
        w = (torch.rand(g.nnz, dtype=torch.float64) + 0.5).requires_grad_()
        for reduce in ("amax", "amin"):
            assert torch.autograd.gradcheck(lambda x, w: gnn.spmm(g, x, reduce, weight=w), (xg, w))


@pytest.mark.parametrize("case", ["random", "hub", "duplicates", "isolated"])
def test_mask_gradients_match_reference(case):
    g, n_rows, n_cols, dst, src, perm = _graph(case)
    assert K.use_winner_mask(g.nnz, n_rows, 64)
    torch.manual_seed(5)
    x = torch.randn(n_cols, 64, requires_grad=True)
    w = (torch.rand(g.nnz) + 0.5).requires_grad_()
    go = torch.randn(n_rows, 64)
    for reduce in ("amax", "amin"):
        gx, gw = torch.autograd.grad(gnn.spmm(g, x, reduce, weight=w), (x, w), go)
        w_edges = torch.empty_like(w.detach())
        w_edges[perm] = w.detach()
        xr, wr = x.detach().clone().requires_grad_(), w_edges.clone().requires_grad_()
        rx, rw = torch.autograd.grad(ref_spmm(n_rows, dst, src, xr, reduce, wr), (xr, wr), go)
        torch.testing.assert_close(gx, rx, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(gw, rw[perm], rtol=1e-4, atol=1e-5)


def test_ties_give_the_gradient_to_one_edge():
    # row 0 reaches node 1 twice (equal values): one of the two copies wins each feature
    g = gnn.CSRGraph(torch.tensor([0, 3]), torch.tensor([1, 1, 0]), 2)
    x = torch.tensor([[0.0, 5.0], [2.0, 1.0]], requires_grad=True)
    gnn.spmm(g, x, "amax").backward(torch.ones(1, 2))
    assert torch.equal(x.grad, torch.tensor([[0.0, 1.0], [1.0, 0.0]]))


def test_compiled_spmm_max_with_mask():
    g, n_rows, n_cols, *_ = _graph("random")
    colptr, row_t, perm_t = g.csc()
    assert K.use_winner_mask(g.nnz, n_rows, 64)

    def f(x, w):
        a, _ = torch.ops.cpu_opt.spmm(g.rowptr, g.col, w, colptr, row_t, perm_t, x, "amax")
        return (a * a).sum()

    x = torch.randn(n_cols, 64, requires_grad=True)
    w = torch.rand(g.nnz, requires_grad=True)
    eager = torch.autograd.grad(f(x, w), (x, w))
    compiled = torch.autograd.grad(torch.compile(f, fullgraph=True, backend="aot_eager")(x, w), (x, w))
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b)
    torch.library.opcheck(torch.ops.cpu_opt.spmm.default, (g.rowptr, g.col, None, colptr, row_t, perm_t, x, "amin"))


def test_bad_masks_are_refused():
    g, n_rows, n_cols, *_ = _graph("random")
    x, go = torch.randn(n_cols, 5), torch.randn(n_rows, 5)
    _, wmask = K.segment_reduce(g.rowptr, g.col, None, x, "amax", mask=True)
    colptr, row_t, perm_t = g.csc()
    past_f = wmask.clone()
    past_f[7, 0] |= 1 << 5  # feature 5 of 5
    with pytest.raises(ValueError, match="mask_gather: wmask has a bit set at or past F = 5"):
        K.mask_gather(colptr, row_t, perm_t, past_f, go, None, n_cols)
    with pytest.raises(ValueError, match="mask_weight_grad: wmask has a bit set at or past F = 5"):
        K.mask_weight_grad(past_f, go, x, g.rowptr, g.col)
    with pytest.raises(ValueError, match=r"wmask must have shape \(nnz, ceil\(F / 64\)\)"):
        K.mask_gather(colptr, row_t, perm_t, wmask[:-1], go, None, n_cols)
    with pytest.raises(TypeError, match="wmask"):
        K.mask_gather(colptr, row_t, perm_t, wmask.int(), go, None, n_cols)
    bad_perm = perm_t.clone()
    bad_perm[4] = g.nnz
    with pytest.raises(IndexError, match=rf"mask_gather: perm\[4\] = {g.nnz} is out of range"):
        K.mask_gather(colptr, row_t, bad_perm, wmask, go, None, n_cols)
    bad_row = row_t.clone()
    bad_row[2] = -1
    with pytest.raises(IndexError, match=r"mask_gather: row_t\[2\] = -1 is out of range"):
        K.mask_gather(colptr, bad_row, perm_t, wmask, go, None, n_cols)
    bad_col = g.col.clone()
    bad_col[1] = n_cols
    with pytest.raises(IndexError, match=rf"mask_weight_grad: col\[1\] = {n_cols} is out of range"):
        K.mask_weight_grad(wmask, go, x, g.rowptr, bad_col)


@pytest.mark.parametrize("variant", RUNNABLE_VARIANTS)
def test_mask_kernels_check_before_writing(variant):
    """Called directly, the C kernels reject a bit past F and leave the output untouched."""
    ffi = native.ffi()
    p = lambda t, c: ffi.cast(c, t.data_ptr())  # noqa: E731
    g, n_rows, n_cols, *_ = _graph("random")
    x, go = torch.randn(n_cols, 5), torch.randn(n_rows, 5)
    _, wmask = K.segment_reduce(g.rowptr, g.col, None, x, "amax", mask=True)
    wmask[-1, 0] |= 1 << 40
    colptr, row_t, perm_t = g.csc()
    out = torch.full((n_cols, 5), 123.0)
    bad = ffi.new("int64_t *", -1)
    st = native.kernel("mask_gather_f32_i64", variant)(
        p(colptr, "int64_t *"), n_cols, p(row_t, "int64_t *"), p(perm_t, "int64_t *"), g.nnz,
        p(wmask, "uint64_t *"), p(go, "float *"), n_rows, 5, ffi.NULL, p(out, "float *"), 1, bad)
    assert st == -2 and bool((out == 123.0).all())
    out_w = torch.full((g.nnz,), 123.0)
    st = native.kernel("mask_weight_grad_f32_i64", variant)(
        p(wmask, "uint64_t *"), p(g.rowptr, "int64_t *"), n_rows, p(g.col, "int64_t *"), p(x, "float *"), n_cols,
        p(go, "float *"), 5, p(out_w, "float *"), 1, bad)
    assert st == -2 and bool((out_w == 123.0).all())
