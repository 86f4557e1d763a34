"""native/kernels/segment.c — the forward segment reduction, through gnn.spmm and
gnn.scatter_reduce, against torch's own ops."""
import pytest
import torch

from cpu_opt import native
from cpu_opt import gnn
from cpu_opt.gnn import _kernels as K

from gnn_testutil import GRAPH_CASES, RUNNABLE_VARIANTS, assert_bf16_close, make_graph, ref_spmm

SPMM_REDUCES = ["sum", "mean", "amax", "amin"]
SCATTER_REDUCES = ["sum", "mean", "amax", "amin", "prod"]


@pytest.mark.parametrize("variant", RUNNABLE_VARIANTS)
@pytest.mark.parametrize("case", GRAPH_CASES)
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
# float32 sum/mean with F a multiple of 8 up to 64 (or of 64) keep their accumulators in registers
# (8: one vector, 56: seven, 128: two chunks of 64); 7 takes the generic loop. 16 float32: 32-byte
# rows, written with streaming stores on AVX2
@pytest.mark.parametrize("F", [7, 8, 16, 56, 128])
def test_spmm_matches_torch(case, variant, index_dtype, F):
    n_rows, n_cols, dst, src = make_graph(case)
    g = gnn.CSRGraph.from_edge_index(torch.stack([src, dst]), n_rows if n_rows == n_cols else None,
                                     index_dtype=index_dtype) if n_rows == n_cols else None
    if g is None:  # bipartite: build the CSR directly
        rowptr, perm = K.index_to_csr(dst, n_rows)
        g = gnn.CSRGraph(rowptr, src[perm].to(index_dtype), n_cols)
    x = torch.randn(n_cols, F)
    w = torch.rand(dst.numel()) + 0.5
    # weights in CSR order for the kernel, in edge order for the reference
    _, perm = K.index_to_csr(dst, n_rows)
    with gnn.use_variant(variant):
        for reduce in SPMM_REDUCES:
            torch.testing.assert_close(gnn.spmm(g, x, reduce), ref_spmm(n_rows, dst, src, x, reduce),
                                       rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(gnn.spmm(g, x, reduce, weight=w[perm]),
                                       ref_spmm(n_rows, dst, src, x, reduce, w), rtol=1e-5, atol=1e-5)


def test_spmm_matches_torch_sparse_mm():
    n, _, dst, src = make_graph("random")
    g = gnn.CSRGraph.from_edge_index(torch.stack([src, dst]), n)
    csr = torch.sparse_csr_tensor(g.rowptr, g.col, torch.ones(g.nnz), (n, n))
    x = torch.randn(n, 16)
    for reduce in SPMM_REDUCES:
        ref = torch.sparse.mm(csr, x) if reduce == "sum" else torch.sparse.mm(csr, x, reduce=reduce.replace("a", "", 1) if reduce in ("amax", "amin") else reduce)
        torch.testing.assert_close(gnn.spmm(g, x, reduce), ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(gnn.spmm(csr, x, reduce), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", GRAPH_CASES)
def test_spmm_bf16_and_f64(case):
    n_rows, n_cols, dst, src = make_graph(case)
    rowptr, perm = K.index_to_csr(dst, n_rows)
    g = gnn.CSRGraph(rowptr, src[perm], n_cols)
    x = torch.randn(n_cols, 33)
    for reduce in SPMM_REDUCES:
        xb = x.bfloat16()
        assert_bf16_close(gnn.spmm(g, xb, reduce), ref_spmm(n_rows, dst, src, xb.float(), reduce))
        torch.testing.assert_close(gnn.spmm(g, x.double(), reduce), ref_spmm(n_rows, dst, src, x.double(), reduce))


@pytest.mark.parametrize("variant", RUNNABLE_VARIANTS)
@pytest.mark.parametrize("case", GRAPH_CASES)
@pytest.mark.parametrize("reduce", SCATTER_REDUCES)
@pytest.mark.parametrize("include_self", [True, False])
def test_scatter_reduce_matches_torch(case, variant, reduce, include_self):
    n_rows, _, dst, _ = make_graph(case)
    torch.manual_seed(1)
    src = torch.randn(dst.numel(), 5)
    if reduce == "prod":
        src = src.clamp(-1.5, 1.5)
    base = torch.randn(n_rows, 5)
    ref = base.scatter_reduce(0, dst.unsqueeze(1).expand_as(src), src, reduce, include_self=include_self)
    with gnn.use_variant(variant):
        for idx in (dst, dst.int()):
            out = gnn.scatter_reduce(src, idx, 0, n_rows, reduce, input=base, include_self=include_self)
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
        # no input: zeros, as torch.zeros(...).scatter_reduce(...)
        ref0 = torch.zeros(n_rows, 5).scatter_reduce(0, dst.unsqueeze(1).expand_as(src), src, reduce,
                                                     include_self=include_self)
        torch.testing.assert_close(gnn.scatter_reduce(src, dst, 0, n_rows, reduce, include_self=include_self),
                                   ref0, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("reduce", SCATTER_REDUCES)
def test_scatter_reduce_other_dims_and_bf16(reduce):
    torch.manual_seed(2)
    index = torch.randint(0, 6, (9,))
    src = torch.randn(3, 9, 4).clamp(-1.5, 1.5)
    base = torch.randn(3, 6, 4)
    ref = base.scatter_reduce(1, index.view(1, -1, 1).expand_as(src), src, reduce, include_self=False)
    torch.testing.assert_close(gnn.scatter_reduce(src, index, 1, reduce=reduce, input=base, include_self=False),
                               ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gnn.scatter_reduce(src, index, -2, reduce=reduce, input=base, include_self=False),
                               ref, rtol=1e-5, atol=1e-6)
    # 1-D
    s1 = torch.randn(9)
    ref1 = torch.zeros(6).scatter_reduce(0, index, s1, reduce, include_self=False)
    torch.testing.assert_close(gnn.scatter_reduce(s1, index, 0, 6, reduce, include_self=False), ref1)
    # bf16, accumulated in fp32
    sb = src.bfloat16()
    refb = torch.zeros(3, 6, 4).scatter_reduce(1, index.view(1, -1, 1).expand_as(src), sb.float(), reduce,
                                               include_self=False)
    assert_bf16_close(gnn.scatter_reduce(sb, index, 1, 6, reduce, include_self=False), refb)
    # float64
    sd = src.double()
    refd = torch.zeros(3, 6, 4, dtype=torch.float64).scatter_reduce(1, index.view(1, -1, 1).expand_as(src), sd,
                                                                    reduce, include_self=False)
    torch.testing.assert_close(gnn.scatter_reduce(sd, index, 1, 6, reduce, include_self=False), refd)


def test_scatter_matches_pyg_semantics():
    from torch_geometric.utils import scatter as pyg_scatter

    n, _, dst, _ = make_graph("isolated")
    src = torch.randn(dst.numel(), 8)
    for reduce in ["sum", "mean", "max", "min", "mul"]:
        torch.testing.assert_close(gnn.scatter(src, dst, 0, n, reduce), pyg_scatter(src, dst, 0, n, reduce),
                                   rtol=1e-5, atol=1e-6)


def test_nan_propagates_in_max_and_min():
    index = torch.tensor([0, 0, 1])
    src = torch.tensor([[1.0], [float("nan")], [2.0]])
    for reduce in ("amax", "amin"):
        out = gnn.scatter_reduce(src, index, 0, 2, reduce, include_self=False)
        ref = torch.zeros(2, 1).scatter_reduce(0, index.view(-1, 1), src, reduce, include_self=False)
        torch.testing.assert_close(out, ref, equal_nan=True)
        assert torch.isnan(out[0, 0])


def test_sorted_index_is_reused():
    index = torch.randint(0, 10, (100,))
    src = torch.randn(100, 3)
    gnn.scatter(src, index, 0, 10)
    hits = gnn.sort_cache.hits
    gnn.scatter(src * 2, index, 0, 10, reduce="max")
    assert gnn.sort_cache.hits == hits + 1
    # an in-place change of the index must not reuse the stale sort
    index[0] = (index[0] + 1) % 10
    ref = torch.zeros(10, 3).scatter_add(0, index.view(-1, 1).expand(-1, 3), src)
    torch.testing.assert_close(gnn.scatter(src, index, 0, 10), ref)


def test_balanced_split_many_threads_same_result():
    # a large hub row and many empty rows, more rows than the parallel threshold
    n = 3000
    dst = torch.cat([torch.full((20000,), 7), torch.randint(0, n, (20000,))])
    src = torch.randint(0, n, (40000,))
    g = gnn.CSRGraph.from_edge_index(torch.stack([src, dst]), n)
    x = torch.randn(n, 16)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = {r: gnn.spmm(g, x, r) for r in SPMM_REDUCES}
        torch.set_num_threads(max(2, old))
        for r in SPMM_REDUCES:
            torch.testing.assert_close(gnn.spmm(g, x, r), one[r], rtol=0, atol=0)
            torch.testing.assert_close(one[r], ref_spmm(n, dst, src, x, r), rtol=1e-4, atol=1e-4)
    finally:
        torch.set_num_threads(old)


def test_avx512_variant_compiled():
    if native.compiled_variants() == ("base",):
        pytest.skip("not an x86-64 build: only the base variant exists")
    for name in ("segment_reduce_f32_i64", "segment_reduce_bf16_i32", "sddmm_f64_i64", "arg_scatter_bf16_i64",
                 "arg_weight_grad_f32_i32", "mask_gather_bf16_i64", "mask_weight_grad_f64_i32", "index_to_csr_i64", "csr_transpose_i32", "gather_rows_bytes_i64"):
        for v in ("base", "avx2", "avx512"):
            assert hasattr(native.lib(), f"{name}_{v}")


# ------------------------------------------------------------------------------------ errors

def test_scatter_reduce_errors():
    src = torch.randn(5, 3)
    with pytest.raises(IndexError, match=r"index\[2\] = 7"):
        gnn.scatter(src, torch.tensor([0, 1, 7, 2, 0]), 0, 4)
    with pytest.raises(IndexError, match=r"index\[1\] = -1"):
        gnn.scatter(src, torch.tensor([0, -1, 1, 2, 0]), 0, 4)
    with pytest.raises(ValueError, match="index has 4 entries"):
        gnn.scatter(src, torch.tensor([0, 1, 2, 0]), 0, 4)
    with pytest.raises(TypeError, match="index must have dtype"):
        gnn.scatter(src, torch.tensor([0.0, 1, 2, 0, 1]), 0, 4)
    with pytest.raises(TypeError, match="src must have dtype"):
        gnn.scatter(src.half(), torch.tensor([0, 1, 2, 0, 1]), 0, 4)
    with pytest.raises(TypeError, match="src must have dtype"):
        gnn.scatter(src.long(), torch.tensor([0, 1, 2, 0, 1]), 0, 4)
    with pytest.raises(ValueError, match="index must be 1-D"):
        gnn.scatter(src, torch.zeros(5, 3, dtype=torch.long), 0, 4)
    with pytest.raises(ValueError, match="reduce must be one of"):
        gnn.scatter(src, torch.tensor([0, 1, 2, 0, 1]), 0, 4, reduce="median")
    with pytest.raises(ValueError, match="input shape"):
        gnn.scatter_reduce(src, torch.tensor([0, 1, 2, 0, 1]), 0, reduce="sum", input=torch.zeros(4, 2))
    with pytest.raises(TypeError, match="input dtype"):
        gnn.scatter_reduce(src, torch.tensor([0, 1, 2, 0, 1]), 0, reduce="sum", input=torch.zeros(4, 3).double())
    with pytest.raises(IndexError, match="dim 2 is out of range"):
        gnn.scatter(src, torch.tensor([0, 1, 2, 0, 1]), 2, 4)


def test_spmm_errors():
    n, _, dst, src = make_graph("random")
    g = gnn.CSRGraph.from_edge_index(torch.stack([src, dst]), n)
    with pytest.raises(ValueError, match="x must have adj.shape"):
        gnn.spmm(g, torch.randn(n + 1, 4))
    with pytest.raises(TypeError, match="x must have dtype"):
        gnn.spmm(g, torch.randn(n, 4).half())
    with pytest.raises(ValueError, match="x must be 2-D"):
        gnn.spmm(g, torch.randn(n))
    with pytest.raises(ValueError, match="weight must have one entry per nonzero"):
        gnn.spmm(g, torch.randn(n, 4), weight=torch.ones(3))
    with pytest.raises(ValueError, match="reduce must be one of"):
        gnn.spmm(g, torch.randn(n, 4), "prod")
    with pytest.raises(TypeError, match="adj must be"):
        gnn.spmm(torch.randn(n, n), torch.randn(n, 4))
    with pytest.raises(IndexError, match="out of range"):
        gnn.CSRGraph.from_edge_index(torch.tensor([[0, 5], [1, 2]]), 4)
    with pytest.raises(IndexError, match="out of range"):
        gnn.CSRGraph(torch.tensor([0, 1, 2]), torch.tensor([0, 3]), 3)
    with pytest.raises(ValueError, match="never decrease"):
        gnn.CSRGraph(torch.tensor([0, 2, 1, 2]), torch.tensor([0, 1]), 3)
    with pytest.raises(ValueError, match=r"shape \(2, E\)"):
        gnn.CSRGraph.from_edge_index(torch.zeros(3, 4, dtype=torch.long), 4)


@pytest.mark.parametrize("variant", RUNNABLE_VARIANTS)
def test_kernel_checks_before_writing(variant):
    """Called directly, the C kernel rejects a bad col / rowptr and leaves out untouched."""
    ffi = native.ffi()
    rowptr = torch.tensor([0, 2, 3, 5])
    x = torch.randn(4, 8)
    out = torch.full((3, 8), 123.0)
    arg = torch.full((3, 8), 77, dtype=torch.int32)
    bad = ffi.new("int64_t *", -1)
    fn = native.kernel("segment_reduce_f32_i64", variant)
    p = lambda t, c: ffi.cast(c, t.data_ptr())  # noqa: E731
    for col, want_status, want_pos in ((torch.tensor([0, 1, 2, 3, 4]), -1, 4),
                                       (torch.tensor([0, -1, 2, 3, 1]), -1, 1)):
        st = fn(p(rowptr, "int64_t *"), 3, p(col, "int64_t *"), ffi.NULL, p(x, "float *"), 4, 8, 2, ffi.NULL, 0,
                p(out, "float *"), p(arg, "int32_t *"), ffi.NULL, 1, bad)
        assert (st, bad[0]) == (want_status, want_pos)
        assert bool((out == 123.0).all()) and bool((arg == 77).all())
    bad_rowptr, col = torch.tensor([0, 3, 2, 5]), torch.tensor([0, 1, 2, 3, 0])  # kept alive across the call
    st = fn(p(bad_rowptr, "int64_t *"), 3, p(col, "int64_t *"), ffi.NULL,
            p(x, "float *"), 4, 8, 0, ffi.NULL, 0, p(out, "float *"), ffi.NULL, ffi.NULL, 1, bad)
    assert (st, bad[0]) == (-3, 2)
    assert bool((out == 123.0).all())
    with pytest.raises(ValueError, match="rowptr must start at 0 and never decrease"):
        K.segment_reduce(torch.tensor([0, 3, 2, 5]), torch.tensor([0, 1, 2, 3, 0]), None, x, "sum")
