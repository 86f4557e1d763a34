"""Caches that must notice every change of contents, memory the kernels must not overwrite or
over-allocate, and thread safety of gnn.optimize / gnn.patched."""
import copy
import threading

import pytest
import torch

from cpu_opt import gnn, native
from cpu_opt.gnn import _kernels as K
from cpu_opt.gnn.graph import sort_cache

from gnn_testutil import ref_spmm


def _ref_scatter_sum(src, index, n):
    return torch.zeros(n, src.shape[1]).index_add_(0, index, src)


# ------------------------------------------------------------------ caches keyed by contents

def test_fingerprint_follows_contents_not_identity():
    a = torch.arange(10_000)
    h = native.fingerprint(a)
    assert native.fingerprint(a.clone()) == h
    b = a.clone()
    b[7777] += 1
    assert native.fingerprint(b) != h
    assert native.fingerprint(a.view(100, 100).t()) != h  # row-major contents of the view
    with pytest.raises(TypeError):
        native.fingerprint([1, 2])
    threads = torch.get_num_threads()
    try:
        big = torch.randint(0, 1 << 30, (3_000_000,))  # 24 MB: several 1 MiB chunks
        h2 = native.fingerprint(big)
        torch.set_num_threads(1)
        assert native.fingerprint(big) == h2  # independent of the thread count
    finally:
        torch.set_num_threads(threads)


def test_sort_cache_sees_writes_that_bump_no_version():
    src = torch.randn(6, 3)
    idx = torch.tensor([0, 1, 2, 3, 4, 5])
    torch.testing.assert_close(gnn.scatter(src, idx, 0, 6), _ref_scatter_sum(src, idx, 6))
    idx.data[:] = torch.tensor([5, 5, 0, 0, 1, 1])  # .data: a separate version counter
    torch.testing.assert_close(gnn.scatter(src, idx, 0, 6), _ref_scatter_sum(src, idx, 6))
    idx.numpy()[:] = [2, 2, 2, 3, 3, 3]  # a numpy view over the same memory
    torch.testing.assert_close(gnn.scatter(src, idx, 0, 6), _ref_scatter_sum(src, idx, 6))
    hits = sort_cache.hits
    gnn.scatter(src, idx.clone(), 0, 6)  # same contents, other tensor: the sort is reused
    assert sort_cache.hits == hits + 1


def test_inference_mode_tensors_work():
    with torch.inference_mode():
        src = torch.randn(8, 4)
        idx = torch.tensor([0, 1, 1, 2, 3, 3, 3, 0])
        out = gnn.scatter(src, idx, 0, 4, reduce="max")  # reading _version of these raised
        g = gnn.CSRGraph.from_edge_index(torch.tensor([[0, 1, 2, 3], [1, 2, 3, 0]]), 4)
        y = gnn.spmm(g, torch.randn(4, 5), "mean")
    assert out.shape == (4, 4) and y.shape == (4, 5)
    torch.testing.assert_close(out, torch.full((4, 4), float("-inf")).scatter_reduce(
        0, idx[:, None].expand(-1, 4), src, "amax"))


def test_csr_graph_rebuilds_its_transpose_after_an_in_place_edit():
    ei = torch.tensor([[0, 1, 2, 3, 0], [1, 2, 3, 0, 2]])
    g = gnn.CSRGraph.from_edge_index(ei, 4)
    x = torch.randn(4, 3, requires_grad=True)
    gnn.spmm(g, x, "sum").sum().backward()  # builds and caches the CSC
    g.col.data[:] = torch.tensor([3, 3, 3, 3, 3])[: g.nnz]  # every edge now comes from node 3
    x2 = x.detach().clone().requires_grad_()
    y = gnn.spmm(g, x2, "sum")
    (y * torch.arange(12.0).view(4, 3)).sum().backward()
    dst = torch.repeat_interleave(torch.arange(4), g.rowptr[1:] - g.rowptr[:-1])
    xr = x.detach().clone().requires_grad_()
    yr = ref_spmm(4, dst, g.col, xr, "sum")
    (yr * torch.arange(12.0).view(4, 3)).sum().backward()
    torch.testing.assert_close(y, yr)
    torch.testing.assert_close(x2.grad, xr.grad)  # the stale transpose sent gradients to old sources


def test_optimized_gnn_sees_a_reused_edge_index_buffer():
    pytest.importorskip("torch_geometric")
    from torch_geometric.nn import SAGEConv

    torch.manual_seed(0)
    ref = SAGEConv(5, 4, aggr="mean")
    fast = gnn.optimize(copy.deepcopy(ref))
    x = torch.randn(30, 5)
    buf = torch.randint(0, 30, (2, 90))
    torch.testing.assert_close(fast(x, buf), ref(x, buf), rtol=1e-4, atol=1e-5)
    buf.data.copy_(torch.randint(0, 30, (2, 90)))  # the next batch, written into the same buffer
    torch.testing.assert_close(fast(x, buf), ref(x, buf), rtol=1e-4, atol=1e-5)
    buf.numpy()[0, :10] = 0
    torch.testing.assert_close(fast(x, buf), ref(x, buf), rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------ memory

def test_gather_refuses_an_out_that_overlaps_its_inputs():
    x = torch.randn(4, 3)
    with pytest.raises(ValueError, match="shares memory with src"):
        gnn.gather(x, torch.tensor([3, 2, 1, 0]), out=x)
    with pytest.raises(ValueError, match="shares memory with src"):
        gnn.gather(x, torch.tensor([1, 0]), out=x[2:])
    buf = torch.tensor([2, 0, 0])
    table = torch.arange(12).view(4, 3)
    with pytest.raises(ValueError, match="shares memory with index"):
        K.gather_rows(table, buf[:1], out=buf.view(1, 3))  # the index would be overwritten mid-read
    out = torch.empty(4, 3)
    gnn.gather(x, torch.tensor([3, 2, 1, 0]), out=out)
    assert torch.equal(out, x.flip(0))


@pytest.mark.parametrize("call", [
    lambda: gnn.scatter(torch.randn(3, 2), torch.tensor([0, 1, 2]), 0, 10 ** 12),
    lambda: K.index_to_csr(torch.tensor([0, 1]), 10 ** 12),
    lambda: gnn.CSRGraph(torch.tensor([0, 1]), torch.tensor([0]), 10 ** 12).csc(),
])
def test_a_huge_dim_size_is_a_memory_error_not_the_oom_killer(call):
    with pytest.raises(MemoryError, match="GiB are available"):
        call()


def test_lazily_negated_inputs_are_refused():
    x = torch.randn(4, 3)
    with pytest.raises(ValueError, match="negated"):
        gnn.scatter(torch._neg_view(x), torch.tensor([0, 1, 1, 0]), 0, 2)
    g = gnn.CSRGraph.from_edge_index(torch.tensor([[0, 1], [1, 0]]), 4)
    with pytest.raises(ValueError, match="negated"):
        gnn.spmm(g, torch._neg_view(x))


# ------------------------------------------------------------------ threads

def test_optimized_gnn_from_eight_threads_gives_the_serial_answers():
    pytest.importorskip("torch_geometric")
    from torch_geometric.nn import GCNConv

    torch.manual_seed(0)
    fast = gnn.optimize(GCNConv(6, 5))
    graphs = [torch.randint(0, 40, (2, 120), generator=torch.Generator().manual_seed(s)) for s in range(6)]
    x = torch.randn(40, 6)
    with torch.no_grad():
        serial = [fast(x, ei) for ei in graphs]
    errors, results = [], {}

    def work(tid):
        try:
            with torch.no_grad():
                for it in range(25):
                    k = (tid + it) % len(graphs)
                    results.setdefault(tid, []).append((k, fast(x, graphs[k])))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for outs in results.values():
        for k, y in outs:
            torch.testing.assert_close(y, serial[k])
    assert len(fast._cache) <= fast._cache_size


def test_patched_is_per_thread():
    """One thread inside gnn.patched(); another running PyG at the same time sees PyG's own
    functions (the replacements, installed process-wide, pass it through)."""
    pytest.importorskip("torch_geometric")
    from torch_geometric.nn.aggr import base as aggr_base

    from cpu_opt.gnn import pyg as gpyg

    inside, release, seen = threading.Event(), threading.Event(), {}

    def patched_thread():
        with gnn.patched():
            inside.set()
            release.wait(10)

    t = threading.Thread(target=patched_thread)
    t.start()
    try:
        assert inside.wait(10)
        assert getattr(aggr_base.scatter, "__wrapped__", None) is not None  # installed process-wide
        before = dict(gpyg._counts)
        src, idx = torch.randn(5, 2), torch.tensor([0, 1, 0, 1, 2])
        seen["out"] = aggr_base.scatter(src, idx, 0, 3, "sum")  # this thread is outside the block
        after = dict(gpyg._counts)
        assert after.get("scatter:cpu_opt", 0) == before.get("scatter:cpu_opt", 0)
        torch.testing.assert_close(seen["out"], _ref_scatter_sum(src, idx, 3))
        with gnn.patched():
            aggr_base.scatter(src, idx, 0, 3, "sum")
        assert gpyg._counts["scatter:cpu_opt"] == before.get("scatter:cpu_opt", 0) + 1
    finally:
        release.set()
        t.join()
