"""Seeded synthetic graphs: R-MAT (power-law degrees) and uniform random, as PyG ``edge_index``.

No real graph data set can be downloaded on these machines, so benchmarks and the example train
on these. R-MAT (Chakrabarti, Zhan, Faloutsos 2004) places each edge by descending ``scale``
levels of the adjacency matrix, choosing a quadrant with probabilities (a, b, c, d) at each
level; the skew gives a power-law degree distribution. Node ids are then shuffled so high-degree
nodes are not clustered at low ids.
"""
from __future__ import annotations

import math

import torch


def rmat_edge_index(num_nodes: int, num_edges: int, *, a: float = 0.57, b: float = 0.19, c: float = 0.19,
                    seed: int = 0, self_loops: bool = True) -> torch.Tensor:
    """A (2, num_edges) int64 ``edge_index`` drawn by R-MAT over ``num_nodes`` nodes (ids outside
    ``[0, num_nodes)`` from the power-of-two square are redrawn). Duplicate edges are kept."""
    if num_nodes < 1 or num_edges < 0:
        raise ValueError(f"need num_nodes >= 1 and num_edges >= 0, got {num_nodes}, {num_edges}")
    d = 1.0 - a - b - c
    if min(a, b, c, d) < 0:
        raise ValueError(f"R-MAT probabilities must be >= 0 and sum to <= 1, got a={a} b={b} c={c}")
    gen = torch.Generator().manual_seed(seed)
    scale = max(1, math.ceil(math.log2(num_nodes)))
    probs = torch.tensor([a, b, c, d], dtype=torch.float64)
    kept_src, kept_dst, have = [], [], 0
    while have < num_edges:
        m = int((num_edges - have) * 1.3) + 16
        src = torch.zeros(m, dtype=torch.int64)
        dst = torch.zeros(m, dtype=torch.int64)
        for _ in range(scale):
            q = torch.multinomial(probs, m, replacement=True, generator=gen)
            src = src * 2 + (q >= 2)
            dst = dst * 2 + (q % 2)
        ok = (src < num_nodes) & (dst < num_nodes)
        if not self_loops:
            ok &= src != dst
        kept_src.append(src[ok])
        kept_dst.append(dst[ok])
        have += int(ok.sum())
    src = torch.cat(kept_src)[:num_edges]
    dst = torch.cat(kept_dst)[:num_edges]
    relabel = torch.randperm(num_nodes, generator=gen)
    return torch.stack([relabel[src], relabel[dst]])


def uniform_edge_index(num_nodes: int, num_edges: int, *, seed: int = 0) -> torch.Tensor:
    """A (2, num_edges) int64 ``edge_index`` with endpoints uniform over the nodes."""
    if num_nodes < 1 or num_edges < 0:
        raise ValueError(f"need num_nodes >= 1 and num_edges >= 0, got {num_nodes}, {num_edges}")
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, num_nodes, (2, num_edges), generator=gen)


def node_task(num_nodes: int, num_features: int, num_classes: int, edge_index: torch.Tensor, *, seed: int = 0):
    """Seeded features and labels that depend on the graph (a label is the argmax of a random
    projection of the node's features plus its neighbours' mean), so a GNN can learn them."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_nodes, num_features, generator=gen)
    proj = torch.randn(num_features, num_classes, generator=gen)
    deg = torch.zeros(num_nodes).index_add_(0, edge_index[1], torch.ones(edge_index.shape[1])).clamp(min=1)
    neigh = torch.zeros(num_nodes, num_features).index_add_(0, edge_index[1], x[edge_index[0]]) / deg[:, None]
    y = ((x + neigh) @ proj).argmax(1)
    return x, y
