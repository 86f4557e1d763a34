"""Memory stays bounded: repeated calls leave resident memory flat, optimizing many models and calling
one at many shapes stays within the caches' bounds, and what the LRU caches evict is really freed.

Bounds (measured on the AMD EPYC Zen 3, 2 threads, when these tests were written; see the README's
"Guarantees" section): RSS growth over 10,000 calls after warm-up at most RSS_SLACK_MB.
"""
import gc
import weakref

import pytest
import torch
from torch import nn

import cpu_opt
from cpu_opt import dnnl, gnn
from cpu_opt.backends.onednn_graph import PartitionStep

RSS_SLACK_MB = 24


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2 ** 20


def _mlp(width=32):
    return nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.LayerNorm(width), nn.Linear(width, 8)).eval()


def _growth(fn, calls=10_000, warmup=300):
    for _ in range(warmup):
        fn()
    gc.collect()
    before = rss_mb()
    for _ in range(calls):
        fn()
    gc.collect()
    return rss_mb() - before


def test_ten_thousand_calls_of_an_optimized_model_leave_rss_flat():
    m = _mlp()
    x = torch.randn(4, 32)
    opt = cpu_opt.optimize(m, x, dtype="fp32")
    grew = _growth(lambda: opt(x))
    assert grew < RSS_SLACK_MB, f"RSS grew {grew:.1f} MB over 10,000 calls"


@pytest.mark.parametrize("op", ["scatter_max", "spmm_sum_backward", "gather"])
def test_ten_thousand_calls_of_each_gnn_op_leave_rss_flat(op):
    g = torch.Generator().manual_seed(0)
    ei = torch.randint(0, 200, (2, 1000), generator=g)
    adj = gnn.CSRGraph.from_edge_index(ei, 200)
    x = torch.randn(200, 16, generator=g)
    src = torch.randn(1000, 16, generator=g)
    if op == "scatter_max":
        fn = lambda: gnn.scatter(src, ei[1], 0, 200, "max")  # noqa: E731
    elif op == "gather":
        fn = lambda: gnn.gather(x, ei[0])  # noqa: E731
    else:
        xg = x.clone().requires_grad_()

        def fn():
            gnn.spmm(adj, xg, "sum").sum().backward()
            xg.grad = None
    grew = _growth(fn)
    assert grew < RSS_SLACK_MB, f"{op}: RSS grew {grew:.1f} MB over 10,000 calls"


def test_optimizing_a_hundred_models_stays_within_the_primitive_cache():
    cap = dnnl.CACHE.capacity
    refs = []
    for i in range(100):
        torch.manual_seed(i)
        m = _mlp(16 + (i % 7) * 8)  # shapes differ, so every model compiles its own partitions
        x = torch.randn(2, m[0].in_features)
        opt = cpu_opt.optimize(m, x, dtype="fp32", validate=False)
        opt(x)
        refs.append(weakref.ref(opt))
        del opt
        assert len(dnnl.CACHE) <= cap
    gc.collect()
    assert all(r() is None for r in refs)  # nothing keeps an optimized model alive behind the user's back


def test_a_model_called_at_two_hundred_shapes_stays_within_its_bounds():
    m = _mlp()
    opt = cpu_opt.optimize(m, torch.randn(3, 32), dtype="fp32", dynamic=True, max_shapes=16, validate=False)
    for rows in range(4, 204):
        x = torch.randn(rows, 32)
        y = opt(x)
        assert y.shape == (rows, 8)
        assert len(opt._plans) <= 16
        assert len(dnnl.CACHE) <= dnnl.CACHE.capacity
    assert opt._base_sig in opt._plans  # the example's plan is kept
    x = torch.randn(150, 32)  # an evicted shape is planned again, and right
    torch.testing.assert_close(opt(x), m(x).detach(), rtol=1e-4, atol=1e-5)


def test_lru_eviction_frees_compiled_partitions_of_evicted_plans(monkeypatch):
    from cpu_opt.compiler import lowering

    # the MLP's one partition is its lone LayerNorm, which runs in torch by default: kept a partition
    # here, since what is tested is what happens to compiled partitions
    monkeypatch.setattr(lowering, "ONE_OP_IN_TORCH", set())
    old = dnnl.CACHE.capacity
    dnnl.set_capacity(2)
    try:
        m = _mlp()
        opt = cpu_opt.optimize(m, torch.randn(3, 32), dtype="fp32", dynamic=True, max_shapes=2, validate=False)
        compiled = []
        for rows in (5, 6, 7, 8):
            opt(torch.randn(rows, 32))
            plan = opt._plans[next(reversed(opt._plans))]
            for step in plan.steps:
                assert isinstance(step, PartitionStep)
                compiled += [weakref.ref(cp) for cp in step._compiled.values()]
        assert compiled
        gc.collect()
        alive = [r for r in compiled if r() is not None]
        # the plans for 5 and 6 rows were evicted (max_shapes=2 keeps the example's and the newest),
        # and the primitive cache holds at most 2 compiled partitions: theirs are gone
        assert len(alive) < len(compiled)
        assert len(alive) <= len(opt._plans) * max(1, len(opt._base_plan.steps)) + dnnl.CACHE.capacity
    finally:
        dnnl.set_capacity(old)
