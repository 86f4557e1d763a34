"""Fuzzing the GNN ops: scatter / scatter_reduce, spmm and gather on random shapes, dtypes,
layouts (non-contiguous, zero-size, zero-stride, lazily negated), and indices in and out of range,
duplicated and unsorted. Each case equals torch's reference or raises a clear error; a returned
tensor never changes after a later call."""
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from cpu_opt import gnn

from fuzz_util import CLEAR_ERRORS, layouts

DTYPES = st.sampled_from([torch.float32, torch.float64, torch.bfloat16])
TOL = {torch.float32: (1e-4, 1e-5), torch.float64: (1e-10, 1e-12), torch.bfloat16: (2e-2, 2e-2)}


def _close(a, b, dtype):
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(a.double(), b.double(), rtol=rtol, atol=atol, equal_nan=True)


@given(n_src=st.integers(0, 40), f=st.integers(0, 9), dim_size=st.integers(0, 30), dtype=DTYPES,
       reduce=st.sampled_from(["sum", "mean", "max", "min", "mul"]), data=st.data(),
       out_of_range=st.sampled_from([None, "high", "negative"]), index_dtype=st.sampled_from([torch.int64, torch.int32]))
def test_scatter(n_src, f, dim_size, dtype, reduce, data, out_of_range, index_dtype):
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2 ** 16)))
    src = torch.randn(n_src, f, generator=g).to(dtype)
    hi = max(dim_size, 1)
    index = torch.randint(0, hi, (n_src,), generator=g, dtype=torch.int64)
    if dim_size == 0:
        index = index[:0] if n_src == 0 else index
    if out_of_range and n_src:
        pos = data.draw(st.integers(0, n_src - 1))
        index[pos] = dim_size + 3 if out_of_range == "high" else -1
    index = index.to(index_dtype)
    src_l, kind = data.draw(layouts(src))
    try:
        out = gnn.scatter(src_l, index, 0, dim_size, reduce)
    except CLEAR_ERRORS as e:
        bad_index = n_src and (int(index.min()) < 0 or int(index.max()) >= dim_size)
        assert bad_index or kind == "neg", (type(e).__name__, e)
        return
    assert kind != "neg", "a lazily negated src was read as if it were resolved"
    assert n_src == 0 or (int(index.min()) >= 0 and int(index.max()) < dim_size)
    ref_red = {"sum": "sum", "mean": "mean", "max": "amax", "min": "amin", "mul": "prod"}[reduce]
    base = torch.ones(dim_size, f, dtype=torch.float64) if reduce == "mul" else torch.zeros(dim_size, f, dtype=torch.float64)
    ref = base.scatter_reduce(0, index.long()[:, None].expand(-1, f), src_l.double(), ref_red,
                              include_self=(reduce == "mul"))
    if reduce in ("max", "min", "mean"):
        empty = torch.bincount(index.long(), minlength=dim_size) == 0
        ref[empty] = 0
    _close(out, ref.to(dtype), dtype)
    keep = out.clone()
    gnn.scatter(torch.randn(n_src, f, generator=g).to(dtype), index, 0, dim_size, reduce)
    assert torch.equal(out, keep)


@st.composite
def graphs(draw):
    n = draw(st.integers(0, 25))
    m = draw(st.integers(1, 25))
    e = draw(st.integers(0, 80)) if n else 0
    seed = draw(st.integers(0, 2 ** 16))
    g = torch.Generator().manual_seed(seed)
    dst = torch.randint(0, max(n, 1), (e,), generator=g)
    src = torch.randint(0, m, (e,), generator=g)
    return n, m, dst, src, g


@given(graph=graphs(), f=st.integers(1, 70), dtype=DTYPES, reduce=st.sampled_from(["sum", "mean", "max", "min"]),
       weighted=st.booleans(), grad=st.booleans(), data=st.data())
def test_spmm_against_torch_and_autograd(graph, f, dtype, reduce, weighted, grad, data):
    n, m, dst, src, g = graph
    assume(n > 0)
    adj = gnn.CSRGraph.from_edge_index(torch.stack([src, dst]), max(n, m))
    x = torch.randn(max(n, m), f, generator=g).to(dtype)
    w = (torch.rand(adj.nnz, generator=g) + 0.5).to(dtype) if weighted else None
    x_l, kind = data.draw(layouts(x))
    x_l = x_l.detach().requires_grad_(grad and kind != "neg" and dtype != torch.bfloat16)
    try:
        out = gnn.spmm(adj, x_l, reduce, weight=w)
    except CLEAR_ERRORS as e:
        assert kind == "neg", (type(e).__name__, e)
        return
    assert kind != "neg"
    N = max(n, m)
    dst_sorted = torch.repeat_interleave(torch.arange(N), adj.rowptr[1:] - adj.rowptr[:-1])
    xd = x_l.detach().double().requires_grad_(x_l.requires_grad)
    msg = xd.index_select(0, adj.col.long())
    if w is not None:
        msg = msg * w.double().unsqueeze(1)
    red = {"sum": "sum", "mean": "mean", "max": "amax", "min": "amin"}[reduce]
    ref = torch.zeros(N, f, dtype=torch.float64).scatter_reduce(
        0, dst_sorted.unsqueeze(1).expand_as(msg), msg, red, include_self=False)
    _close(out, ref.to(dtype), dtype)
    if x_l.requires_grad and reduce in ("sum", "mean"):
        gout = torch.randn(out.shape, generator=g).to(dtype)
        (out * gout).sum().backward()
        (ref * gout.double()).sum().backward()
        _close(x_l.grad, xd.grad.to(dtype), dtype)


@given(n=st.integers(0, 30), f=st.integers(0, 6), k=st.integers(0, 40), dtype=st.sampled_from(
    [torch.float32, torch.float64, torch.int64, torch.bfloat16]), bad=st.booleans(), data=st.data())
def test_gather(n, f, k, dtype, bad, data):
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2 ** 16)))
    src = (torch.randn(n, f, generator=g) * 10).to(dtype)
    idx = torch.randint(0, max(n, 1), (k,), generator=g)
    if bad and k:
        idx[data.draw(st.integers(0, k - 1))] = n + data.draw(st.integers(0, 5)) if data.draw(st.booleans()) else -1
    use_out = data.draw(st.booleans())
    out = torch.full((k, f), 7, dtype=dtype) if use_out else None
    before = out.clone() if use_out else None
    try:
        y = gnn.gather(src, idx, out=out)
    except CLEAR_ERRORS as e:
        assert (k and (int(idx.min()) < 0 or int(idx.max()) >= n)), (type(e).__name__, e)
        if use_out:
            assert torch.equal(out, before)  # checked before anything was written
        return
    assert torch.equal(y, src.index_select(0, idx))
