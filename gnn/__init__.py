"""cpu_opt.gnn — GNN kernels (scatter_reduce, gather, spmm, graph attention) as torch custom ops with autograd,
and their use inside PyTorch Geometric (:func:`optimize`).

    from cpu_opt import gnn
    out = gnn.spmm(adj_t, x, reduce="mean")          # adj_t: gnn.CSRGraph or torch sparse CSR
    out = gnn.scatter(src, index, 0, n, reduce="max")
    out = gnn.gat_attention(adj_t, x, a_src, a_dst)   # fused GAT / GATv2 / Transformer attention
    fast = gnn.optimize(pyg_model)                     # PyG's aggregation on cpu_opt kernels
    sub = gnn.neighbor_sample(rowptr, col, seeds, [15, 10, 5])   # k-hop sampling (gnn/sampling.py)
    gnn.install_sampler()                              # PyG's NeighborLoader without pyg-lib
    from cpu_opt.gnn import distributed                # multi-process training with DDP (gnn/distributed.py)
"""
from . import _autograd  # noqa: F401  (registers autograd on the ops)
from ._kernels import use_variant
from .graph import CSRGraph, adj_t_from_edge_index, sort_cache
from .ops import (gat_attention, gather, gatv2_attention, index_select, scatter, scatter_reduce, spmm,
                  transformer_attention)
from .sampling import SampledSubgraph, install_sampler, neighbor_sample, sampler_installed, uninstall_sampler

__all__ = ["CSRGraph", "DistributedNeighborLoader", "SampledSubgraph", "adj_t_from_edge_index", "gat_attention",
           "gather", "gatv2_attention", "index_select", "install_sampler", "neighbor_sample", "optimize", "patched",
           "sampler_installed", "scatter", "scatter_reduce", "sort_cache", "split_seeds", "spmm",
           "transformer_attention", "uninstall_sampler", "use_variant"]


def __getattr__(name):  # the PyG integration imports torch_geometric: load it on first use
    if name in ("optimize", "patched", "OptimizedGNN"):
        from . import pyg

        return getattr(pyg, name)
    if name in ("DistributedNeighborLoader", "split_seeds"):  # gnn/distributed.py imports torch_geometric too
        import importlib

        return getattr(importlib.import_module(f"{__name__}.distributed"), name)
    raise AttributeError(f"module 'cpu_opt.gnn' has no attribute {name!r}")
