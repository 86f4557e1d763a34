"""max/min spmm: the gathered backward (arg_gather over the CSC transpose) against the scatter
(arg_scatter) and torch, the forward without winner tracking (inference), and the huge-page
output buffers."""
from pathlib import Path

import pytest
import torch

from cpu_opt import gnn, native
from cpu_opt.gnn import _kernels as K

from gnn_testutil import GRAPH_CASES, RUNNABLE_VARIANTS, csr_case, make_graph, ref_spmm


_graph = csr_case


@pytest.mark.parametrize("variant", RUNNABLE_VARIANTS)
@pytest.mark.parametrize("case", GRAPH_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_arg_gather_equals_arg_scatter(case, variant, dtype):
    g, n_rows, n_cols, *_ = _graph(case)
    x = torch.randn(n_cols, 21).to(dtype)
    go = torch.randn(n_rows, 21).to(dtype)
    w = (torch.rand(g.nnz) + 0.5).to(dtype)
    colptr, row_t, perm_t = g.csc()
    with gnn.use_variant(variant):
        for reduce in ("amax", "amin"):
            for weight in (None, w):
                _, arg = K.segment_reduce(g.rowptr, g.col, weight, x, reduce)
                want = K.arg_scatter(arg, go, g.rowptr, g.col, weight, n_cols)
                got = K.arg_gather(colptr, row_t, perm_t, arg, g.rowptr, go, weight, n_cols)
                # one winner per (row, feature): the same terms, summed in another order
                tol = dict(rtol=1e-2, atol=1e-2) if dtype == torch.bfloat16 else {}
                torch.testing.assert_close(got, want, **tol)


@pytest.mark.parametrize("case", ["random", "hub", "duplicates"])
def test_max_gradient_matches_torch_sparse_mm(case):
    n_rows, n_cols, dst, src = make_graph(case)
    g = gnn.CSRGraph.from_edge_index(torch.stack([src, dst]), n_rows)
    x = torch.randn(n_cols, 9, dtype=torch.float64, requires_grad=True)
    csr = torch.sparse_csr_tensor(g.rowptr, g.col, torch.ones(g.nnz, dtype=torch.float64), (n_rows, n_cols))
    x2 = x.detach().clone().requires_grad_()
    go = torch.randn(n_rows, 9, dtype=torch.float64)
    gnn.spmm(g, x, "amax").backward(go)
    torch.sparse.mm(csr, x2, reduce="amax").backward(go)
    torch.testing.assert_close(x.grad, x2.grad)


@pytest.mark.parametrize("variant", RUNNABLE_VARIANTS)
@pytest.mark.parametrize("case", GRAPH_CASES)
def test_inference_max_min_skips_the_winner_and_agrees(case, variant):
    g, n_rows, n_cols, dst, src, perm = _graph(case)
    x = torch.randn(n_cols, 13)
    w = torch.rand(g.nnz) + 0.5
    with gnn.use_variant(variant):
        for reduce in ("amax", "amin"):
            out, arg = K.segment_reduce(g.rowptr, g.col, w, x, reduce, want_arg=False)
            assert arg.numel() == 0
            with_arg, _ = K.segment_reduce(g.rowptr, g.col, w, x, reduce)
            assert torch.equal(out, with_arg)
            torch.testing.assert_close(out, ref_spmm(n_rows, dst, src, x, reduce, torch.empty_like(w).scatter_(0, perm, w)))
            with torch.no_grad():
                assert torch.equal(gnn.spmm(g, x.requires_grad_(), reduce, weight=w), with_arg)
            x.requires_grad_(False)


def test_inference_max_propagates_nan():
    g = gnn.CSRGraph(torch.tensor([0, 2, 3]), torch.tensor([0, 1, 2]), 3)
    x = torch.tensor([[1.0], [float("nan")], [2.0]])
    for reduce in ("amax", "amin"):
        out = gnn.spmm(g, x, reduce)
        assert torch.isnan(out[0, 0]) and out[1, 0] == 2.0


def test_arg_gather_errors():
    g, n_rows, n_cols, *_ = _graph("random")
    x, go = torch.randn(n_cols, 4), torch.randn(n_rows, 4)
    _, arg = K.segment_reduce(g.rowptr, g.col, None, x, "amax")
    colptr, row_t, perm_t = g.csc()
    bad_row = row_t.clone()
    bad_row[3] = n_rows
    with pytest.raises(IndexError, match=r"arg_gather: row_t\[3\] = 40 is out of range \[0, 40\)"):
        K.arg_gather(colptr, bad_row, perm_t, arg, g.rowptr, go, None, n_cols)
    bad_perm = perm_t.clone()
    bad_perm[5] = -1
    with pytest.raises(IndexError, match=r"perm\[5\] = -1"):
        K.arg_gather(colptr, row_t, bad_perm, arg, g.rowptr, go, torch.ones(g.nnz), n_cols)
    with pytest.raises(ValueError, match="colptr must have n_out"):
        K.arg_gather(colptr, row_t, perm_t, arg, g.rowptr, go, None, n_cols + 1)
    with pytest.raises(ValueError, match="arg shape"):
        K.arg_gather(colptr, row_t, perm_t, arg[:, :2], g.rowptr, go, None, n_cols)
    with pytest.raises(ValueError, match="perm must have one entry per nonzero"):
        K.arg_gather(colptr, row_t, perm_t[:-1], arg, g.rowptr, go, None, n_cols)
    unsorted = colptr.clone()
    unsorted[2], unsorted[3] = colptr[3] + 1, colptr[2]
    with pytest.raises(ValueError, match="never decrease"):
        K.arg_gather(unsorted, row_t, perm_t, arg, g.rowptr, go, None, n_cols)


def _thp_available() -> bool:
    p = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    return p.exists() and "[never]" not in p.read_text()


def test_hugepage_advice():
    lib, ffi = native.lib(), native.ffi()
    small = torch.empty(256)
    assert lib.co_advise_hugepages(ffi.cast("void *", small.data_ptr()), small.numel() * 4) == 1
    big = torch.empty(4 << 20)  # 16 MiB: holds whole 2 MiB-aligned pages
    ret = lib.co_advise_hugepages(ffi.cast("void *", big.data_ptr()), big.numel() * 4)
    assert ret == 0 if _thp_available() else ret <= 0  # without THP madvise may refuse (-EINVAL)
    t = native.empty(1 << 20, 3, dtype=torch.float64)
    assert t.shape == (1 << 20, 3) and t.dtype == torch.float64
    t.fill_(1.5)
    assert float(t.sum()) == 1.5 * 3 * (1 << 20)


def test_winner_index_outside_its_row_is_refused_before_any_write():
    g, n_rows, n_cols, *_ = _graph("random")
    x, go = torch.randn(n_cols, 4), torch.randn(n_rows, 4)
    _, arg = K.segment_reduce(g.rowptr, g.col, None, x, "amax")
    assert arg.dtype == torch.int32
    deg = g.rowptr[1:] - g.rowptr[:-1]
    r = int(torch.nonzero(deg > 0)[0])
    bad = arg.clone()
    bad[r, 2] = int(deg[r])  # one past the row's last nonzero
    with pytest.raises(IndexError, match=rf"arg_scatter: arg\[{r}, 2\] = {int(deg[r])} is not -1 or a position in row {r}"):
        K.arg_scatter(bad, go, g.rowptr, g.col, None, n_cols)
    bad[r, 2] = -2
    with pytest.raises(IndexError, match="arg_weight_grad: arg"):
        K.arg_weight_grad(bad, go, x, g.rowptr, g.col)
    with pytest.raises(TypeError, match="arg"):
        K.arg_scatter(arg.long(), go, g.rowptr, g.col, None, n_cols)
