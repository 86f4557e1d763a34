"""native/kernels/csr.c — index_to_csr (counting sort of a scatter index) and csr_transpose
(the cached CSC of a graph), against torch's stable sort."""
import pytest
import torch

from cpu_opt import gnn
from cpu_opt.gnn import _kernels as K

from gnn_testutil import GRAPH_CASES, RUNNABLE_VARIANTS, make_graph


@pytest.mark.parametrize("variant", RUNNABLE_VARIANTS)
@pytest.mark.parametrize("case", GRAPH_CASES)
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_index_to_csr_is_a_stable_sort(case, variant, index_dtype):
    n, _, dst, _ = make_graph(case)
    with gnn.use_variant(variant):
        rowptr, perm = K.index_to_csr(dst.to(index_dtype), n)
    ref_perm = torch.sort(dst, stable=True).indices
    assert torch.equal(perm, ref_perm)
    assert torch.equal(rowptr, torch.cat([torch.zeros(1, dtype=torch.int64), torch.bincount(dst, minlength=n).cumsum(0)]))


@pytest.mark.parametrize("case", GRAPH_CASES)
def test_csr_transpose(case):
    n_rows, n_cols, dst, src = make_graph(case)
    g = gnn.CSRGraph.from_edge_index(torch.stack([src, dst]), n_rows) if n_rows == n_cols else None
    if g is None:
        rowptr, perm = K.index_to_csr(dst, n_rows)
        g = gnn.CSRGraph(rowptr, src[perm], n_cols)
    colptr, row_t, perm_t = g.csc()
    row = torch.repeat_interleave(torch.arange(n_rows), g.deg())
    # perm_t lists CSR positions in column order (stable), row_t their rows
    assert torch.equal(perm_t, torch.sort(g.col, stable=True).indices)
    assert torch.equal(row_t, row[perm_t])
    assert torch.equal(colptr[1:] - colptr[:-1], torch.bincount(g.col, minlength=n_cols))
    # the transpose of the dense matrix
    dense = torch.zeros(n_rows, n_cols).index_put_((row, g.col), torch.ones(g.nnz), accumulate=True)
    dense_t = torch.zeros(n_cols, n_rows).index_put_(
        (torch.repeat_interleave(torch.arange(n_cols), colptr[1:] - colptr[:-1]), row_t), torch.ones(g.nnz),
        accumulate=True)
    assert torch.equal(dense.t(), dense_t)


def test_from_edge_index_flows_and_torch_roundtrip():
    n, _, dst, src = make_graph("random")
    ei = torch.stack([src, dst])
    g = gnn.CSRGraph.from_edge_index(ei, n)
    g2 = gnn.CSRGraph.from_edge_index(torch.stack([dst, src]), n, flow="target_to_source")
    assert torch.equal(g.rowptr, g2.rowptr) and torch.equal(g.col, g2.col)
    t = g.to_torch()
    assert torch.equal(t.to_dense(), torch.zeros(n, n).index_put_((dst, src), torch.ones(dst.numel()), accumulate=True))
    g3 = gnn.CSRGraph.from_torch(t)
    assert torch.equal(g3.rowptr, g.rowptr) and torch.equal(g3.col, g.col)


def test_csr_errors():
    with pytest.raises(IndexError, match=r"index\[1\] = 9"):
        K.index_to_csr(torch.tensor([0, 9, 1]), 4)
    with pytest.raises(IndexError, match=r"index\[0\] = -2"):
        K.index_to_csr(torch.tensor([-2, 1], dtype=torch.int32), 4)
    with pytest.raises(TypeError, match="index must have dtype"):
        K.index_to_csr(torch.tensor([0.0, 1.0]), 4)
    with pytest.raises(ValueError, match="dim_size must be a non-negative int"):
        K.index_to_csr(torch.tensor([0, 1]), -1)
    with pytest.raises(IndexError, match=r"col\[1\] = 5"):
        K.csr_transpose(torch.tensor([0, 1, 2]), torch.tensor([0, 5]), 3)
    with pytest.raises(ValueError, match="rowptr must start at 0 and never decrease"):
        K.csr_transpose(torch.tensor([0, 2, 1, 2]), torch.tensor([0, 1]), 3)
    with pytest.raises(ValueError, match=r"rowptr\[-1\]"):
        K.csr_transpose(torch.tensor([0, 1, 3]), torch.tensor([0, 1]), 3)
