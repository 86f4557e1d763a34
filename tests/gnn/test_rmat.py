"""gnn/rmat.py — the seeded synthetic graphs used by the example and the benchmark."""
import pytest
import torch

from cpu_opt.gnn.rmat import node_task, rmat_edge_index, uniform_edge_index


def test_rmat_is_seeded_in_range_and_skewed():
    a = rmat_edge_index(1000, 20000, seed=3)
    assert a.shape == (2, 20000) and a.dtype == torch.int64
    assert int(a.min()) >= 0 and int(a.max()) < 1000
    assert torch.equal(a, rmat_edge_index(1000, 20000, seed=3))
    assert not torch.equal(a, rmat_edge_index(1000, 20000, seed=4))
    deg = torch.bincount(a[1], minlength=1000).float()
    u = torch.bincount(uniform_edge_index(1000, 20000, seed=3)[1], minlength=1000).float()
    assert deg.max() > 4 * u.max()          # power-law: a few very high in-degrees
    assert (deg == 0).sum() > (u == 0).sum()  # and many isolated targets
    nl = rmat_edge_index(64, 500, seed=0, self_loops=False)
    assert bool((nl[0] != nl[1]).all())


def test_node_task_and_errors():
    ei = rmat_edge_index(50, 200)
    x, y = node_task(50, 6, 3, ei)
    assert x.shape == (50, 6) and y.shape == (50,) and int(y.max()) < 3
    with pytest.raises(ValueError):
        rmat_edge_index(0, 5)
    with pytest.raises(ValueError):
        rmat_edge_index(10, 5, a=0.9, b=0.2, c=0.1)
