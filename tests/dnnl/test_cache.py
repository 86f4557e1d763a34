"""The primitive cache: a repeated call with the same shapes creates nothing; LRU capacity;
thread safety; counters."""
import threading

import pytest
import torch

from cpu_opt import dnnl
from cpu_opt.dnnl import primitives as P
from cpu_opt.dnnl.cache import PrimitiveCache


def test_repeated_call_creates_no_primitive():
    mm = P.Matmul(torch.randn(64, 32), torch.randn(32), ["relu"])
    x = torch.randn(16, 64)
    mm(x)
    before = dnnl.cache_stats()
    for _ in range(5):
        mm(x)
    after = dnnl.cache_stats()
    assert after.creations == before.creations
    assert after.hits == before.hits + 5
    # a new batch size is a new primitive, exactly one
    mm(torch.randn(17, 64))
    assert dnnl.cache_stats().creations == after.creations + 1


def test_same_shapes_share_primitive_across_layers():
    x = torch.randn(8, 64)
    P.Matmul(torch.randn(64, 48))(x)
    c0 = dnnl.cache_stats().creations
    P.Matmul(torch.randn(64, 48))(x)  # different weights, same shapes: the primitive is reused
    assert dnnl.cache_stats().creations == c0


def test_lru_capacity_and_eviction():
    c = PrimitiveCache(capacity=2)
    made = []
    for k in ["a", "b", "a", "c", "b"]:
        c.get_or_create(k, lambda k=k: made.append(k) or k)
    # a, b created; a hit; c created evicts b (LRU is b); b created again evicts a
    assert made == ["a", "b", "c", "b"]
    s = c.stats()
    assert (s.hits, s.misses, s.creations, s.evictions, s.size) == (1, 4, 4, 2, 2)
    c.set_capacity(1)
    assert len(c) == 1
    with pytest.raises(ValueError):
        c.set_capacity(-1)


def test_concurrent_calls_create_once_and_agree():
    mm = P.Matmul(torch.randn(128, 64))
    x = torch.randn(31, 128)
    ref = x @ mm._packed.src
    before = dnnl.cache_stats().creations
    errors, outs = [], []

    def worker():
        try:
            for _ in range(20):
                outs.append(mm(x))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert dnnl.cache_stats().creations == before + 1
    assert all(((o - ref).abs().max() / ref.abs().max()).item() < 1e-5 for o in outs)


def test_capacity_from_setter():
    old = dnnl.CACHE.capacity
    try:
        dnnl.set_capacity(3)
        assert dnnl.cache_stats().capacity == 3
    finally:
        dnnl.set_capacity(old)
