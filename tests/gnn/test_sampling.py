"""cpu_opt.gnn.neighbor_sample (native/kernels/sample.c) and the PyG plug-in (install_sampler):
sampled neighbourhoods are subsets of the true ones, fan-outs are respected, every edge exists and
the relabelling inverts (checked against a pure-Python relabelling of the same draws), the same
seed gives the same sample at any thread count, draws are uniform (chi-square), temporal and
disjoint constraints hold, bad input raises clear errors, and PyG's NeighborLoader /
LinkNeighborLoader train with neither pyg-lib nor torch-sparse installed."""
import importlib.util
import itertools
import math
from collections import Counter

import pytest
import torch

from cpu_opt import gnn


def _csr(n, e, seed=0, unique=True):
    """(rowptr, col) of a random graph with n nodes; unique: no repeated (row, col) pairs."""
    g = torch.Generator().manual_seed(seed)
    src, dst = torch.randint(0, n, (e,), generator=g), torch.randint(0, n, (e,), generator=g)
    if unique:
        key = torch.unique(src * n + dst)
        src, dst = key // n, key % n
    order = torch.argsort(src * n + dst)
    src, dst = src[order], dst[order]
    rowptr = torch.zeros(n + 1, dtype=torch.int64)
    rowptr[1:] = torch.bincount(src, minlength=n).cumsum(0)
    return rowptr, dst.contiguous()


def _hop_of(sub):
    """hop (block) of every local node id."""
    return torch.repeat_interleave(torch.arange(len(sub.num_sampled_nodes)), torch.tensor(sub.num_sampled_nodes))


def _relabel_ref(rowptr, col, seeds, sub, disjoint=False):
    """Pure-Python relabelling of the draws the sample made: walk the frontier in order, give each
    neighbour first seen the next local id. Returns (node, batch, row, col) to compare with sub."""
    draws = {}  # local row -> its drawn edge ids, in order
    for r, e in zip(sub.row.tolist(), sub.edge.tolist()):
        draws.setdefault(r, []).append(e)
    node = [int(s) for s in seeds]
    batch = list(range(len(node)))
    local = {((i if disjoint else 0), v): i for i, v in enumerate(node)}
    rows, cols = [], []
    begin, end = 0, len(node)
    for _ in range(len(sub.num_sampled_nodes) - 1):
        for i in range(begin, end):
            b = batch[i] if disjoint else 0
            for e in draws.get(i, []):
                assert rowptr[node[i]] <= e < rowptr[node[i] + 1]
                w = int(col[e])
                if (b, w) not in local:
                    local[(b, w)] = len(node)
                    node.append(w)
                    batch.append(batch[i])
                rows.append(i)
                cols.append(local[(b, w)])
        begin, end = end, len(node)
    return node, batch, rows, cols


# ----------------------------------------------------------------------------- structure

@pytest.mark.parametrize("replace", [False, True])
@pytest.mark.parametrize("fanouts", [[5, 3], [2, -1], [0, 4], [3, 3, 3]])
def test_sample_is_a_subgraph_with_its_fanouts(replace, fanouts):
    n = 300
    rowptr, col = _csr(n, 2400, seed=1)
    deg = (rowptr[1:] - rowptr[:-1])
    seeds = torch.tensor([0, 7, 42, 99, 250, 3])
    sub = gnn.neighbor_sample(rowptr, col, seeds, fanouts, replace=replace, seed=3)
    N, E = sub.node.numel(), sub.row.numel()
    assert sub.num_sampled_nodes[0] == seeds.numel() and sum(sub.num_sampled_nodes) == N
    assert sum(sub.num_sampled_edges) == E and len(sub.num_sampled_edges) == len(fanouts)
    assert torch.equal(sub.node[:seeds.numel()], seeds)
    assert sub.node.unique().numel() == N  # each node once
    # every edge is an edge of the graph, and the ids invert: node[row] owns edge, node[col] = col[edge]
    assert torch.equal(col[sub.edge], sub.node[sub.col])
    v = sub.node[sub.row]
    assert bool(((rowptr[v] <= sub.edge) & (sub.edge < rowptr[v + 1])).all())
    # fan-outs: a node of hop h drew min(fanout, degree) distinct neighbours (fanout when replacing)
    hop = _hop_of(sub)
    per_row = torch.bincount(sub.row, minlength=N)
    for i in range(N):
        h, d = int(hop[i]), int(deg[sub.node[i]])
        if h >= len(fanouts):
            assert per_row[i] == 0
            continue
        k = fanouts[h]
        want = d if k < 0 else (k if d > 0 else 0) if replace else min(k, d)
        assert per_row[i] == want, (i, h, k, d)
        mine = sub.edge[sub.row == i]
        if not replace or k < 0:
            assert mine.unique().numel() == mine.numel()
    # hop blocks: the edges of hop h are drawn by the nodes of block h
    edge_hop = hop[sub.row]
    assert torch.equal(torch.bincount(edge_hop, minlength=len(fanouts))[:len(fanouts)],
                       torch.tensor(sub.num_sampled_edges))
    # the relabelling is exactly first-seen order over the frontier
    node, _, rows, cols = _relabel_ref(rowptr, col, seeds, sub)
    assert sub.node.tolist() == node and sub.row.tolist() == rows and sub.col.tolist() == cols
    # csr(): the local CSR of the same edges
    rp, c = sub.csr()
    assert rp[-1] == E and torch.equal(torch.repeat_interleave(torch.arange(N), rp[1:] - rp[:-1]), sub.row)


def test_fanout_minus_one_takes_every_neighbour():
    rowptr, col = _csr(100, 600, seed=2)
    sub = gnn.neighbor_sample(rowptr, col, torch.tensor([5, 6]), [-1], seed=0)
    for i, v in enumerate([5, 6]):
        assert torch.equal(sub.edge[sub.row == i], torch.arange(int(rowptr[v]), int(rowptr[v + 1])))


def test_isolated_seeds_and_no_hops():
    rowptr = torch.zeros(11, dtype=torch.int64)  # 10 nodes, no edges
    sub = gnn.neighbor_sample(rowptr, torch.zeros(0, dtype=torch.int64), torch.tensor([1, 2]), [3, 3])
    assert sub.node.tolist() == [1, 2] and sub.row.numel() == 0 and sub.num_sampled_nodes == [2, 0, 0]
    rowptr, col = _csr(50, 200)
    sub = gnn.neighbor_sample(rowptr, col, torch.tensor([1, 2]), [])
    assert sub.node.tolist() == [1, 2] and sub.num_sampled_edges == []
    sub = gnn.neighbor_sample(rowptr, col, torch.zeros(0, dtype=torch.int64), [3])
    assert sub.node.numel() == 0 and sub.num_sampled_nodes == [0, 0]


def test_return_edge_id_false_and_int32_seeds():
    rowptr, col = _csr(50, 200)
    a = gnn.neighbor_sample(rowptr, col, torch.tensor([1, 2], dtype=torch.int32), [3], seed=1, return_edge_id=False)
    b = gnn.neighbor_sample(rowptr, col, torch.tensor([1, 2]), [3], seed=1)
    assert a.edge is None and torch.equal(a.node, b.node) and torch.equal(a.col, b.col)


def test_induced_subgraph_has_every_edge_between_sampled_nodes():
    n = 120
    rowptr, col = _csr(n, 900, seed=4, unique=False)  # repeated edges too
    sub = gnn.neighbor_sample(rowptr, col, torch.tensor([3, 17]), [4, 2], directed=False, seed=5)
    assert sub.num_sampled_edges is None
    inside = torch.zeros(n, dtype=torch.bool)
    inside[sub.node] = True
    src = torch.repeat_interleave(torch.arange(n), rowptr[1:] - rowptr[:-1])
    want = torch.nonzero(inside[src] & inside[col]).flatten()
    assert torch.equal(sub.edge.sort().values, want)
    assert torch.equal(sub.node[sub.row], src[sub.edge]) and torch.equal(sub.node[sub.col], col[sub.edge])


# ----------------------------------------------------------------------------- reproducibility

def test_same_seed_same_sample_and_different_seed_differs():
    rowptr, col = _csr(500, 5000, seed=6)
    seeds = torch.arange(0, 500, 7)
    a = gnn.neighbor_sample(rowptr, col, seeds, [4, 3], seed=11)
    b = gnn.neighbor_sample(rowptr, col, seeds, [4, 3], seed=11)
    c = gnn.neighbor_sample(rowptr, col, seeds, [4, 3], seed=12)
    assert all(torch.equal(x, y) for x, y in zip(a[:3], b[:3])) and torch.equal(a.edge, b.edge)
    assert not torch.equal(a.edge, c.edge)
    torch.manual_seed(0)
    d = gnn.neighbor_sample(rowptr, col, seeds, [4, 3])
    torch.manual_seed(0)
    e = gnn.neighbor_sample(rowptr, col, seeds, [4, 3])
    assert torch.equal(d.edge, e.edge)  # seed=None draws from torch's generator


@pytest.mark.parametrize("mode", ["plain", "replace", "disjoint", "temporal", "induced"])
def test_thread_count_does_not_change_the_sample(mode):
    # big enough that every pass runs in parallel (frontiers and draws above 4096)
    n = 20000
    rowptr, col = _csr(n, 200000, seed=7)
    seeds = torch.randperm(n, generator=torch.Generator().manual_seed(0))[:5000]
    kw = dict(replace=mode == "replace", disjoint=mode in ("disjoint", "temporal"), directed=mode != "induced")
    if mode == "temporal":
        kw.update(node_time=torch.randint(0, 100, (n,), generator=torch.Generator().manual_seed(1)),
                  seed_time=torch.full((5000,), 60))
    old = torch.get_num_threads()
    try:
        outs = []
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            outs.append(gnn.neighbor_sample(rowptr, col, seeds, [8, 4], seed=21, **kw))
    finally:
        torch.set_num_threads(old)
    for o in outs[1:]:
        for x, y in zip(outs[0], o):
            assert (x is None and y is None) or (isinstance(x, list) and x == y) or torch.equal(x, y)


# ----------------------------------------------------------------------------- uniformity

def _chi2_p(counts, expected):
    """p-value of the chi-square statistic (regularized upper incomplete gamma, by series)."""
    stat = sum((c - expected) ** 2 / expected for c in counts)
    k = (len(counts) - 1) / 2
    x = stat / 2
    # P(k, x) lower regularized by its series; p = 1 - P
    term = total = 1.0 / k
    for m in range(1, 2000):
        term *= x / (k + m)
        total += term
        if term < 1e-15 * total:
            break
    lower = math.exp(-x + k * math.log(x) - math.lgamma(k)) * total if x > 0 else 0.0
    return stat, 1.0 - lower


def _star(deg):
    """node 0 with neighbours 1..deg."""
    rowptr = torch.tensor([0] + [deg] * (deg + 1), dtype=torch.int64)
    return rowptr, torch.arange(1, deg + 1)


@pytest.mark.parametrize("deg,k,replace", [(20, 5, False), (60, 40, False), (20, 5, True)])
def test_draws_are_uniform(deg, k, replace):
    # one call, 20000 disjoint copies of the same seed: every copy draws from its own stream.
    # (60, 40) takes the partial Fisher-Yates path, (20, 5) Floyd's algorithm.
    rowptr, col = _star(deg)
    draws = 20000
    sub = gnn.neighbor_sample(rowptr, col, torch.zeros(draws, dtype=torch.int64), [k], replace=replace, disjoint=True,
                              seed=2024)
    assert sub.row.numel() == draws * k
    counts = torch.bincount(sub.edge, minlength=deg).tolist()
    stat, p = _chi2_p(counts, draws * k / deg)
    assert p > 1e-3, (stat, p, counts)
    if not replace:  # k distinct per draw
        per = sub.edge.view(draws, k).sort(1).values
        assert bool((per[:, 1:] > per[:, :-1]).all())


def test_subsets_are_uniform():
    # 2 of 5 neighbours without replacement: all 10 pairs equally likely
    rowptr, col = _star(5)
    draws = 20000
    sub = gnn.neighbor_sample(rowptr, col, torch.zeros(draws, dtype=torch.int64), [2], disjoint=True, seed=7)
    pairs = Counter(tuple(sorted(p)) for p in sub.edge.view(draws, 2).tolist())
    assert set(pairs) == set(itertools.combinations(range(5), 2))
    stat, p = _chi2_p(list(pairs.values()), draws / 10)
    assert p > 1e-3, (stat, p, pairs)


# ----------------------------------------------------------------------------- disjoint, temporal

def test_disjoint_gives_one_subgraph_per_seed():
    rowptr, col = _csr(80, 600, seed=8)
    seeds = torch.tensor([3, 3, 10, 55])  # a seed twice: two subgraphs
    sub = gnn.neighbor_sample(rowptr, col, seeds, [3, 2], disjoint=True, seed=1)
    assert torch.equal(sub.batch[:4], torch.arange(4)) and torch.equal(sub.node[:4], seeds)
    assert torch.equal(sub.batch[sub.row], sub.batch[sub.col])  # no edge between subgraphs
    for b in range(4):
        mine = sub.node[sub.batch == b]
        assert mine.unique().numel() == mine.numel()  # a node once per subgraph
        # each subgraph's non-seed nodes were all reached from its own seed: a tree of first visits
        reached = {int(seeds[b])}
        loc = torch.nonzero(sub.batch == b).flatten().tolist()
        for r, c in zip(sub.row.tolist(), sub.col.tolist()):
            if c in loc and int(sub.node[r]) in reached:
                reached.add(int(sub.node[c]))
        assert reached == set(mine.tolist())
    node, batch, rows, cols = _relabel_ref(rowptr, col, seeds, sub, disjoint=True)
    assert sub.node.tolist() == node and sub.batch.tolist() == batch
    assert sub.row.tolist() == rows and sub.col.tolist() == cols
    # a subgraph's hop-h nodes come in seed order
    hop = _hop_of(sub)
    for h in range(3):
        bs = sub.batch[hop == h]
        assert bool((bs[1:] >= bs[:-1]).all())


@pytest.mark.parametrize("dtype", [torch.int64, torch.float32])
def test_temporal_node_time(dtype):
    n = 200
    rowptr, col = _csr(n, 3000, seed=9)
    node_time = torch.randint(0, 50, (n,), generator=torch.Generator().manual_seed(2)).to(dtype)
    seeds = torch.tensor([1, 2, 3, 4])
    seed_time = torch.tensor([10, 20, 30, 49]).to(dtype)
    sub = gnn.neighbor_sample(rowptr, col, seeds, [5, 5], disjoint=True, node_time=node_time, seed_time=seed_time,
                              seed=4)
    nonseed = torch.arange(sub.node.numel()) >= 4
    assert bool((node_time[sub.node][nonseed] <= seed_time[sub.batch][nonseed]).all())
    # fan-outs count the valid neighbours only: min(k, number of valid neighbours)
    hop = _hop_of(sub)
    per_row = torch.bincount(sub.row, minlength=sub.node.numel())
    for i in torch.nonzero(hop < 2).flatten().tolist():
        v, t = int(sub.node[i]), seed_time[sub.batch[i]]
        valid = int((node_time[col[rowptr[v]:rowptr[v + 1]]] <= t).sum())
        assert per_row[i] == min(5, valid)
    # default seed time: the seeds' own node time
    a = gnn.neighbor_sample(rowptr, col, seeds, [5], disjoint=True, node_time=node_time, seed=4)
    assert bool((node_time[a.node] <= node_time[seeds][a.batch]).all())


def test_temporal_edge_time_and_last():
    n = 100
    rowptr, col = _csr(n, 1500, seed=10)
    edge_time = torch.randint(0, 100, (col.numel(),), generator=torch.Generator().manual_seed(3))
    seeds = torch.tensor([5, 6, 7])
    seed_time = torch.tensor([30, 60, 90])
    sub = gnn.neighbor_sample(rowptr, col, seeds, [4, 4], disjoint=True, edge_time=edge_time, seed_time=seed_time,
                              seed=1)
    assert bool((edge_time[sub.edge] <= seed_time[sub.batch[sub.row]]).all())
    last = gnn.neighbor_sample(rowptr, col, seeds, [3], disjoint=True, edge_time=edge_time, seed_time=seed_time,
                               temporal_strategy="last", seed=1)
    for i, v in enumerate(seeds.tolist()):
        e = torch.arange(int(rowptr[v]), int(rowptr[v + 1]))
        valid = e[edge_time[e] <= seed_time[i]]
        assert torch.equal(last.edge[last.row == i], valid[-3:])


# ----------------------------------------------------------------------------- errors

def test_bad_input_raises_clear_errors():
    rowptr, col = _csr(30, 100)
    s = torch.tensor([1, 2])
    for bad in ([-2], [3, -5]):
        with pytest.raises(ValueError, match=r"fanouts\[\d\] = -\d"):
            gnn.neighbor_sample(rowptr, col, s, bad)
    for bad in ([1.5], ["3"], [True], 3, "15", None):
        with pytest.raises(TypeError, match="fanouts"):
            gnn.neighbor_sample(rowptr, col, s, bad)
    for bad in ([30], [-1], [0, 31]):
        with pytest.raises(ValueError, match=r"seeds\[\d\] = -?\d+ is out of range: the graph has 30 nodes"):
            gnn.neighbor_sample(rowptr, col, torch.tensor(bad), [2])
    with pytest.raises(ValueError, match="occurs twice"):
        gnn.neighbor_sample(rowptr, col, torch.tensor([4, 5, 4]), [2])
    with pytest.raises(ValueError, match="graph is empty"):
        gnn.neighbor_sample(torch.zeros(1, dtype=torch.int64), torch.zeros(0, dtype=torch.int64), s[:0], [2])
    with pytest.raises(TypeError, match="seeds must be an int64"):
        gnn.neighbor_sample(rowptr, col, s.float(), [2])
    with pytest.raises(TypeError, match="rowptr must be an int64"):
        gnn.neighbor_sample(rowptr.int(), col, s, [2])
    with pytest.raises(TypeError, match="col must be an int64"):
        gnn.neighbor_sample(rowptr, col.int(), s, [2])
    with pytest.raises(TypeError, match="seeds must be a torch.Tensor"):
        gnn.neighbor_sample(rowptr, col, [1, 2], [2])
    with pytest.raises(ValueError, match="end at col.numel"):
        gnn.neighbor_sample(rowptr, col[:-1], s, [2])
    with pytest.raises(ValueError, match="needs disjoint=True"):
        gnn.neighbor_sample(rowptr, col, s, [2], node_time=torch.zeros(30, dtype=torch.int64))
    with pytest.raises(ValueError, match="node_time must have one entry per node"):
        gnn.neighbor_sample(rowptr, col, s, [2], disjoint=True, node_time=torch.zeros(29, dtype=torch.int64))
    with pytest.raises(ValueError, match="edge_time needs seed_time"):
        gnn.neighbor_sample(rowptr, col, s, [2], disjoint=True, edge_time=torch.zeros(col.numel()))
    with pytest.raises(ValueError, match="temporal_strategy"):
        gnn.neighbor_sample(rowptr, col, s, [2], temporal_strategy="recent")
    # the kernel checks what it reads: a col entry out of range, a decreasing rowptr
    bad_col = col.clone()
    bad_col[int(rowptr[1]):int(rowptr[3])] = 1000
    with pytest.raises(IndexError, match=r"col\[\d+\] = 1000 is out of range \[0, 30\)"):
        gnn.neighbor_sample(rowptr, bad_col, torch.tensor([0, 1, 2]), [-1])
    bad_rp = rowptr.clone()
    bad_rp[2] = bad_rp[3] + 1
    with pytest.raises(ValueError, match="rowptr is not a CSR row pointer"):
        gnn.neighbor_sample(bad_rp, col, torch.tensor([1, 2]), [2])


# ----------------------------------------------------------------------------- PyG

pyg = pytest.importorskip("torch_geometric")


@pytest.fixture
def pyg_sampler():
    assert importlib.util.find_spec("pyg_lib") is None, "pyg-lib is installed: these tests are for its absence"
    assert importlib.util.find_spec("torch_sparse") is None, "torch-sparse is installed"
    assert gnn.install_sampler() is True
    yield
    gnn.uninstall_sampler()


def _pyg_data(n=400, e=3000, f=16, classes=4, seed=0):
    from torch_geometric.data import Data

    from cpu_opt.gnn.rmat import node_task, rmat_edge_index

    ei = rmat_edge_index(n, e, seed=seed)
    x, y = node_task(n, f, classes, ei, seed=seed)
    return Data(x=x, y=y, edge_index=ei, num_nodes=n)


def _check_batch(data, batch, fanouts):
    """The batch's edges are graph edges in local ids (n_id, e_id map them back), seeds first."""
    src, dst = batch.n_id[batch.edge_index[0]], batch.n_id[batch.edge_index[1]]
    assert torch.equal(data.edge_index[:, batch.e_id], torch.stack([src, dst]))
    assert batch.num_sampled_nodes[0] == batch.batch_size
    assert len(batch.num_sampled_edges) == len(fanouts)
    assert torch.equal(batch.x, data.x[batch.n_id])
    # each target drew at most fanout sources at its hop
    hop = torch.repeat_interleave(torch.arange(len(batch.num_sampled_nodes)), torch.tensor(batch.num_sampled_nodes))
    per_dst = torch.bincount(batch.edge_index[1], minlength=batch.num_nodes)
    for h, k in enumerate(fanouts):
        assert int(per_dst[hop == h].max()) <= k


@pytest.mark.parametrize("num_workers", [0, 2])
def test_neighbor_loader_trains_graphsage(pyg_sampler, num_workers):
    from torch_geometric.loader import NeighborLoader
    from torch_geometric.nn import GraphSAGE

    data = _pyg_data()
    torch.manual_seed(0)
    loader = NeighborLoader(data, num_neighbors=[10, 5], batch_size=64, shuffle=True, num_workers=num_workers)
    model = GraphSAGE(16, 32, 2, out_channels=4)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    seen, losses = [], []
    for batch in loader:
        _check_batch(data, batch, [10, 5])
        seen.append(batch.n_id[:batch.batch_size])
        opt.zero_grad()
        out = model(batch.x, batch.edge_index)[:batch.batch_size]
        loss = torch.nn.functional.cross_entropy(out, batch.y[:batch.batch_size])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert torch.equal(torch.cat(seen).sort().values, torch.arange(data.num_nodes))  # every node a seed once
    assert all(math.isfinite(v) for v in losses)


def test_neighbor_loader_disjoint_temporal_and_induced(pyg_sampler):
    from torch_geometric.loader import NeighborLoader

    data = _pyg_data()
    data.time = torch.randint(0, 100, (data.num_nodes,), generator=torch.Generator().manual_seed(0))
    loader = NeighborLoader(data, num_neighbors=[5, 5], batch_size=32, time_attr="time",
                            input_time=torch.full((data.num_nodes,), 50))
    batch = next(iter(loader))
    assert bool((batch.time[batch.batch_size:] <= 50).all())
    assert batch.batch is not None and torch.equal(batch.batch[:32], torch.arange(32))
    batch = next(iter(NeighborLoader(data, num_neighbors=[4, 4], batch_size=32, disjoint=True)))
    assert torch.equal(batch.batch[batch.edge_index[0]], batch.batch[batch.edge_index[1]])
    # subgraph_type='induced' goes through torch_sparse::neighbor_sample
    batch = next(iter(NeighborLoader(data, num_neighbors=[4, 4], batch_size=32, subgraph_type="induced")))
    inside = torch.zeros(data.num_nodes, dtype=torch.bool)
    inside[batch.n_id] = True
    want = int((inside[data.edge_index[0]] & inside[data.edge_index[1]]).sum())
    assert batch.edge_index.shape[1] == want


def test_link_neighbor_loader(pyg_sampler):
    from torch_geometric.loader import LinkNeighborLoader
    from torch_geometric.nn import GraphSAGE

    data = _pyg_data()
    loader = LinkNeighborLoader(data, num_neighbors=[5, 3], batch_size=64, neg_sampling_ratio=1.0, shuffle=True)
    model = GraphSAGE(16, 32, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    n_batches = 0
    for batch in loader:
        src, dst = batch.n_id[batch.edge_index[0]], batch.n_id[batch.edge_index[1]]
        assert torch.equal(data.edge_index[:, batch.e_id], torch.stack([src, dst]))
        pos = batch.edge_label == 1
        lab = batch.n_id[batch.edge_label_index[:, pos]]
        assert torch.equal(lab, data.edge_index[:, batch.input_id])  # the positive links are the input edges
        opt.zero_grad()
        h = model(batch.x, batch.edge_index)
        score = (h[batch.edge_label_index[0]] * h[batch.edge_label_index[1]]).sum(-1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(score, batch.edge_label)
        loss.backward()
        opt.step()
        n_batches += 1
        if n_batches == 5:
            break
    assert n_batches == 5


def test_install_is_reversible_and_local(pyg_sampler):
    import torch_geometric.typing as tg_typing
    from torch_geometric.data import HeteroData
    from torch_geometric.loader import NeighborLoader

    assert gnn.sampler_installed() and gnn.install_sampler()  # idempotent
    assert tg_typing.WITH_PYG_LIB is False  # the rest of PyG still sees no pyg-lib
    hd = HeteroData()
    hd["a"].x = torch.randn(10, 4)
    hd["a", "to", "a"].edge_index = torch.randint(0, 10, (2, 30))
    with pytest.raises(NotImplementedError, match="heterogeneous"):
        next(iter(NeighborLoader(hd, num_neighbors=[2], input_nodes="a", batch_size=4)))
    data = _pyg_data(n=50, e=200)
    gnn.uninstall_sampler()
    assert not gnn.sampler_installed() and not hasattr(torch.ops.pyg, "neighbor_sample")
    with pytest.raises(ImportError, match="requires either 'pyg-lib' or 'torch-sparse'"), \
            pytest.warns(UserWarning, match="without a 'pyg-lib' installation"):
        next(iter(NeighborLoader(data, num_neighbors=[2], batch_size=4)))
    assert gnn.install_sampler()
    assert next(iter(NeighborLoader(data, num_neighbors=[2], batch_size=4))).batch_size == 4


def test_neighbor_loader_spawned_workers(pyg_sampler):
    """Spawned workers (nothing inherited) get the hook when they unpickle the sampler."""
    from torch_geometric.loader import NeighborLoader

    data = _pyg_data(n=100, e=500)
    loader = NeighborLoader(data, num_neighbors=[3], batch_size=50, num_workers=1, multiprocessing_context="spawn")
    batches = list(loader)
    assert len(batches) == 2
    for b in batches:
        _check_batch(data, b, [3])


def test_install_uses_a_torch_sparse_sampler_op_that_is_already_loaded():
    """torch-sparse's op library can be loaded while PyG could not import the package (it needs
    torch-scatter): install_sampler must not define the op again (a RuntimeError), and PyG may call it."""
    import torch_geometric.sampler.neighbor_sampler as ns

    from cpu_opt.gnn import sampling

    gnn.uninstall_sampler()
    lib = torch.library.Library("torch_sparse", "FRAGMENT")
    try:
        lib.define(sampling._TS_SCHEMA)
        lib.impl("neighbor_sample", sampling._torch_sparse_neighbor_sample, "CompositeExplicitAutograd")
        assert gnn.install_sampler() is True
        assert ns.torch_geometric.typing.WITH_TORCH_SPARSE is True
        gnn.uninstall_sampler()
    finally:
        gnn.uninstall_sampler()
        lib._destroy()
    assert not sampling._op_defined("torch_sparse", "neighbor_sample")
