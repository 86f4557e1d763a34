"""Neighbour sampling for mini-batch GNN training, and PyG's NeighborLoader on it.

:func:`neighbor_sample` draws, for a batch of seed nodes, a uniform sample of their k-hop
neighbourhood over a CSR graph (native/kernels/sample.c: OpenMP across the nodes of each hop,
reproducible for a given ``seed`` whatever the thread count) and returns it relabelled to local
ids::

    from cpu_opt import gnn
    sub = gnn.neighbor_sample(rowptr, col, seeds, [15, 10, 5], seed=0)
    sub.node           # global ids of the sampled nodes: the seeds first, then hop by hop
    sub.row, sub.col   # each sampled edge: local id of the node it was drawn for, and of the neighbour
    sub.edge           # its position in col (the global edge id)

For PyG's message passing (neighbours send to the seeds) pass the CSC of ``edge_index`` -- the CSR
of ``adj_t``, one row per target listing its sources -- and use ``stack([sub.col, sub.row])`` as
the subgraph's ``edge_index``.

:func:`install_sampler` makes ``torch_geometric.loader.NeighborLoader`` and ``LinkNeighborLoader``
run on this sampler when neither pyg-lib nor torch-sparse is installed (PyG refuses otherwise);
see its docstring for what exactly it changes.
"""
from __future__ import annotations

import importlib.util
import threading
from typing import NamedTuple, Optional, Sequence

import torch

from . import _kernels as K

__all__ = ["SampledSubgraph", "install_sampler", "neighbor_sample", "sampler_installed", "uninstall_sampler"]


class SampledSubgraph(NamedTuple):
    """A sampled subgraph in local ids (see :func:`neighbor_sample`)."""

    node: torch.Tensor                 # (N,) global id of each sampled node: seeds first, then by hop
    row: torch.Tensor                  # (E,) local id of the node each edge was drawn for (its CSR row)
    col: torch.Tensor                  # (E,) local id of the drawn neighbour (the CSR column)
    edge: Optional[torch.Tensor]       # (E,) position of the edge in the input col; None unless asked
    batch: Optional[torch.Tensor]      # (N,) the seed (subgraph) each node belongs to; None unless disjoint
    num_sampled_nodes: list            # nodes added per hop, seeds first (num_hops + 1 entries)
    num_sampled_edges: Optional[list]  # edges added per hop (num_hops entries); None when directed=False

    def csr(self):
        """The subgraph as a local CSR ``(rowptr, col)`` over its N nodes. Edges come grouped by
        row already, so this is a count and a cumulative sum."""
        n = self.node.numel()
        rowptr = torch.zeros(n + 1, dtype=torch.int64)
        torch.cumsum(torch.bincount(self.row, minlength=n), 0, out=rowptr[1:])
        return rowptr, self.col


def _int_tensor(t, name: str) -> torch.Tensor:
    K.check_tensor(t, name, dim=1)
    if t.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{name} must be an int64 (or int32) tensor, got {t.dtype}")
    return t.to(torch.int64).contiguous()


def _check_fanouts(fanouts) -> list:
    if isinstance(fanouts, torch.Tensor):
        if fanouts.dim() != 1 or fanouts.dtype.is_floating_point or fanouts.dtype == torch.bool:
            raise TypeError(f"fanouts must be a list of ints (one per hop), got a {fanouts.dtype} tensor "
                            f"of shape {tuple(fanouts.shape)}")
        fanouts = fanouts.tolist()
    if isinstance(fanouts, (str, bytes)) or not isinstance(fanouts, Sequence):
        raise TypeError(f"fanouts must be a list of ints (one per hop, -1 for all neighbours), "
                        f"got {type(fanouts).__name__}")
    out = []
    for h, k in enumerate(fanouts):
        if isinstance(k, bool) or not isinstance(k, int):
            raise TypeError(f"fanouts[{h}] must be an int (-1 for all neighbours), got {k!r}")
        if k < -1:
            raise ValueError(f"fanouts[{h}] = {k}: a fan-out is the number of neighbours to draw (>= 0) or -1 "
                             "for all of them")
        out.append(int(k))
    return out


def _check_time(t, name: str, n: int, what: str):
    if t is None:
        return None
    K.check_tensor(t, name, dim=1)
    if t.dtype == torch.bool or t.is_complex():
        raise TypeError(f"{name} must be an integer or floating-point tensor, got {t.dtype}")
    if t.numel() != n:
        raise ValueError(f"{name} must have one entry per {what} ({n}), got {t.numel()}")
    return t


def neighbor_sample(rowptr: torch.Tensor, col: torch.Tensor, seeds: torch.Tensor, fanouts, *, replace: bool = False,
                    directed: bool = True, disjoint: bool = False, node_time: Optional[torch.Tensor] = None,
                    edge_time: Optional[torch.Tensor] = None, seed_time: Optional[torch.Tensor] = None,
                    temporal_strategy: str = "uniform", seed: Optional[int] = None,
                    return_edge_id: bool = True) -> SampledSubgraph:
    """Uniform k-hop neighbour sampling from ``seeds`` over the CSR graph ``(rowptr, col)``.

    At hop ``h`` every node found at hop ``h - 1`` (the seeds at hop 0) draws ``fanouts[h]`` of
    its neighbours ``col[rowptr[v]:rowptr[v + 1]]`` uniformly, without replacement (all of them
    when it has fewer) or with ``replace=True``; ``-1`` takes all. A node is added once, when first
    drawn; every draw is an edge.

    Args:
        rowptr, col: the graph, int64; ``rowptr`` has one entry per node plus one, ``col`` values
            are node ids in ``[0, len(rowptr) - 1)``.
        seeds: int64/int32 node ids, unique unless ``disjoint``.
        fanouts: one int per hop.
        directed: False returns, instead of the drawn edges, every edge of the graph between two
            sampled nodes (the induced subgraph; ``num_sampled_edges`` is then None).
        disjoint: one subgraph per seed (nodes are not shared between seeds); ``batch`` says
            which seed each node belongs to.
        node_time / edge_time: temporal sampling (needs ``disjoint=True``): only neighbours whose
            time (of the neighbour node / of the edge, one entry per nonzero of col) is <= the
            seed's time, ``seed_time`` (one per seed; defaults to ``node_time[seeds]``, required
            with ``edge_time``). ``temporal_strategy="last"`` takes the last ``fanouts[h]``
            valid neighbours in CSR order instead of a uniform draw (the most recent ones when
            neighbourhoods are sorted by time, as PyG sorts them).
        seed: the random stream; None draws one from torch's default generator (so
            ``torch.manual_seed`` and DataLoader workers' seeding govern it). The same seed gives
            the same sample at any ``torch.get_num_threads()``.

    Returns a :class:`SampledSubgraph`. Raises TypeError for wrong types or dtypes, ValueError
    for bad fan-outs, seeds out of range or repeated, an empty graph or a malformed rowptr, and
    IndexError for a col entry out of range (checked as it is drawn).
    """
    rowptr = K.check_tensor(rowptr, "rowptr", dim=1)
    col = K.check_tensor(col, "col", dim=1)
    for name, t in (("rowptr", rowptr), ("col", col)):
        if t.dtype != torch.int64:
            raise TypeError(f"{name} must be an int64 tensor, got {t.dtype}")
    if rowptr.numel() < 2:
        raise ValueError(f"the graph is empty: rowptr has {rowptr.numel()} entries, so no nodes to sample from "
                         "(rowptr needs one entry per node plus one)")
    n_nodes = rowptr.numel() - 1
    if int(rowptr[0]) != 0 or int(rowptr[-1]) != col.numel():
        raise ValueError(f"rowptr must start at 0 and end at col.numel() = {col.numel()}, got rowptr[0] = "
                         f"{int(rowptr[0])}, rowptr[-1] = {int(rowptr[-1])}")
    seeds = _int_tensor(seeds, "seeds")
    fanouts = _check_fanouts(fanouts)
    if seeds.numel():
        lo, hi = int(seeds.min()), int(seeds.max())
        if lo < 0 or hi >= n_nodes:
            b = int(torch.nonzero((seeds < 0) | (seeds >= n_nodes))[0])
            raise ValueError(f"seeds[{b}] = {int(seeds[b])} is out of range: the graph has {n_nodes} nodes")
    if not isinstance(temporal_strategy, str) or temporal_strategy not in K.SAMPLE_STRATEGIES:
        raise ValueError(f"temporal_strategy must be one of {sorted(K.SAMPLE_STRATEGIES)}, got {temporal_strategy!r}")
    node_time = _check_time(node_time, "node_time", n_nodes, "node")
    edge_time = _check_time(edge_time, "edge_time", col.numel(), "edge (nonzero of col)")
    seed_time = _check_time(seed_time, "seed_time", seeds.numel(), "seed")
    temporal = node_time is not None or edge_time is not None
    if seed_time is not None and not temporal:
        raise ValueError("seed_time is given but neither node_time nor edge_time: nothing to compare it with")
    if temporal and not disjoint:
        raise ValueError("temporal sampling needs disjoint=True: each seed's subgraph is limited by its own time")
    if edge_time is not None and seed_time is None and seeds.numel():
        raise ValueError("edge_time needs seed_time (the time of each seed), there being no node times to take it from")
    if temporal:  # one time type for the kernel: int64 when all are integers, else float64
        times = [t for t in (node_time, edge_time, seed_time) if t is not None]
        tdt = torch.float64 if any(t.dtype.is_floating_point for t in times) else torch.int64
        node_time, edge_time, seed_time = (None if t is None else t.to(tdt) for t in (node_time, edge_time, seed_time))
    if disjoint and seeds.numel() > (2**63 - 1) // n_nodes:
        raise ValueError(f"disjoint sampling of {seeds.numel()} seeds over {n_nodes} nodes: too many (subgraph "
                         "keys overflow int64)")
    if seed is None:
        seed = int(torch.randint(-2**63, 2**63 - 1, (), dtype=torch.int64))
    elif isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int or None, got {type(seed).__name__}")
    node, batch, row, col_l, edge, nph, eph = K.neighbor_sample(
        rowptr, col, seeds, fanouts, replace=replace, directed=directed, disjoint=disjoint, node_time=node_time,
        edge_time=edge_time, seed_time=seed_time, strategy=temporal_strategy, rng_seed=seed)
    return SampledSubgraph(node, row, col_l, edge if return_edge_id else None, batch, nph, eph if directed else None)


# ----------------------------------------------------------------------------- the PyG plug-in

class _View:
    """An object that answers like ``target`` except for the names in ``overrides``."""

    def __init__(self, target, overrides: dict):
        object.__setattr__(self, "_target", target)
        object.__setattr__(self, "_overrides", overrides)

    def __getattr__(self, name):
        over = object.__getattribute__(self, "_overrides")
        if name in over:
            return over[name]
        return getattr(object.__getattribute__(self, "_target"), name)

    def __repr__(self):
        return f"<cpu_opt view of {object.__getattribute__(self, '_target')!r}>"


_PYG_SCHEMA = ("neighbor_sample(Tensor rowptr, Tensor col, Tensor seed, int[] num_neighbors, Tensor? node_time=None, "
               "Tensor? edge_time=None, Tensor? seed_time=None, bool csc=False, bool replace=False, "
               "bool directed=True, bool disjoint=False, str temporal_strategy='uniform', bool return_edge_id=True) "
               "-> (Tensor, Tensor, Tensor, Tensor?, int[], int[])")
_PYG_HETERO_SCHEMA = (
    "hetero_neighbor_sample(str[] node_types, (str, str, str)[] edge_types, Dict(str, Tensor) rowptr_dict, "
    "Dict(str, Tensor) col_dict, Dict(str, Tensor) seed_dict, Dict(str, int[]) num_neighbors_dict, "
    "Dict(str, Tensor)? node_time_dict=None, Dict(str, Tensor)? edge_time_dict=None, "
    "Dict(str, Tensor)? seed_time_dict=None, bool csc=False, bool replace=False, bool directed=True, "
    "bool disjoint=False, str temporal_strategy='uniform', bool return_edge_id=True) "
    "-> (Dict(str, Tensor), Dict(str, Tensor), Dict(str, Tensor), Dict(str, Tensor)?, Dict(str, int[]), "
    "Dict(str, int[]))")
_TS_SCHEMA = ("neighbor_sample(Tensor colptr, Tensor row, Tensor input_node, int[] num_neighbors, bool replace, "
              "bool directed) -> (Tensor, Tensor, Tensor, Tensor)")
_TS_HETERO_SCHEMA = ("hetero_neighbor_sample(str[] node_types, (str, str, str)[] edge_types, Dict(str, Tensor) colptr_dict, "
                     "Dict(str, Tensor) row_dict, Dict(str, Tensor) input_node_dict, Dict(str, int[]) num_neighbors_dict, "
                     "int num_hops, bool replace, bool directed) -> (Dict(str, Tensor), Dict(str, Tensor), "
                     "Dict(str, Tensor), Dict(str, Tensor))")


def _pyg_neighbor_sample(rowptr, col, seed, num_neighbors, node_time=None, edge_time=None, seed_time=None, csc=False,
                         replace=False, directed=True, disjoint=False, temporal_strategy="uniform",
                         return_edge_id=True):
    """``pyg::neighbor_sample`` as pyg-lib defines it (without edge weights), on cpu_opt."""
    out = neighbor_sample(rowptr, col, seed, list(num_neighbors), replace=replace, directed=directed,
                          disjoint=disjoint, node_time=node_time, edge_time=edge_time, seed_time=seed_time,
                          temporal_strategy=temporal_strategy, return_edge_id=return_edge_id)
    row, col_l = (out.col, out.row) if csc else (out.row, out.col)  # csc: row = neighbour (source)
    node = torch.stack([out.batch, out.node], 1) if disjoint else out.node
    edges = out.num_sampled_edges if out.num_sampled_edges is not None else [0] * len(num_neighbors)
    return row, col_l, node, out.edge, out.num_sampled_nodes, edges


def _torch_sparse_neighbor_sample(colptr, row, input_node, num_neighbors, replace, directed):
    """``torch_sparse::neighbor_sample`` (PyG's path for ``subgraph_type='induced'``), on cpu_opt."""
    out = neighbor_sample(colptr, row, input_node, list(num_neighbors), replace=replace, directed=directed)
    return out.node, out.col, out.row, out.edge


def _hetero_not_implemented(*args, **kwargs):
    raise NotImplementedError(
        "cpu_opt.gnn's neighbour sampler handles homogeneous graphs (Data) only: heterogeneous sampling "
        "(HeteroData, hetero_neighbor_sample) is not implemented; it needs pyg-lib or torch-sparse")


class _Installation:
    def __init__(self):
        self.libraries: list = []
        self.module = None            # torch_geometric.sampler.neighbor_sampler
        self.module_global = None     # its original `torch_geometric`
        self.reduce_classes: list = []  # (class, original __reduce_ex__ in its __dict__ or None)


_installed: Optional[_Installation] = None
_install_lock = threading.RLock()

# What PyG's NeighborSampler reads, through `torch_geometric.typing`, to pick its sampling routine.
# WITH_WEIGHTED_NEIGHBOR_SAMPLE stays False: weighted sampling is not implemented here, and with
# the flag False PyG refuses `weight_attr` up front (ImportError) instead of failing in a batch.
_SAMPLER_FLAGS = {"WITH_PYG_LIB": True, "WITH_EDGE_TIME_NEIGHBOR_SAMPLE": True,
                  "WITH_WEIGHTED_NEIGHBOR_SAMPLE": False}


def _sampler_reduce_ex(self, protocol):
    """Pickles a PyG sampler so that unpickling it (in a spawned DataLoader worker) installs the
    hook first (:func:`_rebuild_with_sampler`)."""
    rv = object.__reduce_ex__(self, protocol)
    return (_rebuild_with_sampler, (rv[0], rv[1])) + tuple(rv[2:])


def _rebuild_with_sampler(func, args):
    install_sampler()
    return func(*args)


def install_sampler() -> bool:
    """Make PyG's ``NeighborLoader`` / ``LinkNeighborLoader`` (``NeighborSampler``) sample with
    :func:`neighbor_sample` when pyg-lib is not installed. Returns True when the hook is in place,
    False when pyg-lib is installed (PyG then uses it and nothing is changed). Idempotent;
    :func:`uninstall_sampler` undoes it. PyG's files are not modified. What it does:

    * registers the operator PyG calls, ``torch.ops.pyg.neighbor_sample`` (pyg-lib's schema,
      without edge weights), as a ``torch.library`` op running :func:`neighbor_sample`; and, when
      torch-sparse is not installed either, ``torch.ops.torch_sparse.neighbor_sample``, which PyG
      calls for ``subgraph_type='induced'``. Their ``hetero_neighbor_sample`` counterparts raise
      NotImplementedError (heterogeneous graphs are not supported);
    * PyG's ``NeighborSampler`` decides by ``torch_geometric.typing.WITH_PYG_LIB`` (and
      ``WITH_EDGE_TIME_NEIGHBOR_SAMPLE``, ``WITH_WEIGHTED_NEIGHBOR_SAMPLE``,
      ``WITH_TORCH_SPARSE``), read through its module's global name ``torch_geometric``. That one
      global of ``torch_geometric.sampler.neighbor_sampler`` is pointed at a view of the package
      whose ``typing`` reports those flags; ``torch_geometric.typing`` itself is unchanged, so
      the rest of PyG (``dropout_path``, ``Node2Vec``, ``to_hetero``...) still sees no pyg-lib;
    * DataLoader workers: forked workers inherit all of this. For spawned workers
      (``multiprocessing_context='spawn'``), ``NeighborSampler`` objects pickle with a
      reconstructor that calls ``install_sampler()`` in the worker before rebuilding them (a
      ``__reduce_ex__`` set on the class while installed).

    Not supported (clear errors): heterogeneous graphs, weighted sampling (``weight_attr``: PyG
    raises ImportError), and edge-level temporal sampling without seed times.
    """
    global _installed
    if importlib.util.find_spec("pyg_lib") is not None:
        return False
    with _install_lock:
        if _installed is not None:
            return True
        import torch_geometric
        import torch_geometric.sampler.neighbor_sampler as ns
        import torch_geometric.typing as tg_typing

        if ns.__dict__.get("torch_geometric") is not torch_geometric:
            raise RuntimeError("cpu_opt.gnn.install_sampler: torch_geometric.sampler.neighbor_sampler no longer reads "
                               "its flags through the global name 'torch_geometric' (a PyG version this hook does "
                               f"not know: {torch_geometric.__version__}); not installed")
        inst = _Installation()
        try:
            lib = torch.library.Library("pyg", "FRAGMENT")
            inst.libraries.append(lib)
            lib.define(_PYG_SCHEMA)
            lib.impl("neighbor_sample", _pyg_neighbor_sample, "CompositeExplicitAutograd")
            lib.define(_PYG_HETERO_SCHEMA)
            lib.impl("hetero_neighbor_sample", _hetero_not_implemented, "CompositeExplicitAutograd")
            flags = dict(_SAMPLER_FLAGS)
            if not tg_typing.WITH_TORCH_SPARSE and _op_defined("torch_sparse", "neighbor_sample"):
                # torch-sparse's own op library is loaded though PyG could not import the package
                # (it needs torch-scatter): PyG may call that op; defining ours again would fail
                flags["WITH_TORCH_SPARSE"] = True
            elif not tg_typing.WITH_TORCH_SPARSE:
                ts = torch.library.Library("torch_sparse", "FRAGMENT")
                inst.libraries.append(ts)
                ts.define(_TS_SCHEMA)
                ts.impl("neighbor_sample", _torch_sparse_neighbor_sample, "CompositeExplicitAutograd")
                ts.define(_TS_HETERO_SCHEMA)
                ts.impl("hetero_neighbor_sample", _hetero_not_implemented, "CompositeExplicitAutograd")
                flags["WITH_TORCH_SPARSE"] = True
            inst.module, inst.module_global = ns, torch_geometric
            ns.torch_geometric = _View(torch_geometric, {"typing": _View(tg_typing, flags)})
            for cls in (ns.NeighborSampler,):
                inst.reduce_classes.append((cls, cls.__dict__.get("__reduce_ex__")))
                cls.__reduce_ex__ = _sampler_reduce_ex
        except Exception:
            _undo(inst)
            raise
        _installed = inst
        return True


def _op_defined(namespace: str, name: str) -> bool:
    try:
        return torch._C._dispatch_has_kernel(f"{namespace}::{name}") or \
            any(s.name == f"{namespace}::{name}" for s in torch._C._jit_get_all_schemas())
    except Exception:  # noqa: BLE001 - private API moved: ask the ops namespace instead
        try:
            getattr(getattr(torch.ops, namespace), name)
            return True
        except (AttributeError, RuntimeError):
            return False


def _undo(inst: _Installation) -> None:
    for cls, orig in reversed(inst.reduce_classes):
        if orig is None:
            if "__reduce_ex__" in cls.__dict__:
                del cls.__reduce_ex__
        else:
            cls.__reduce_ex__ = orig
    if inst.module is not None:
        inst.module.torch_geometric = inst.module_global
    for lib in reversed(inst.libraries):
        destroy = getattr(lib, "_destroy", None)
        if destroy is not None:
            destroy()
    inst.libraries.clear()


def uninstall_sampler() -> None:
    """Undo :func:`install_sampler` (a no-op when it is not installed): PyG again refuses to
    sample without pyg-lib or torch-sparse."""
    global _installed
    with _install_lock:
        if _installed is None:
            return
        inst, _installed = _installed, None
        _undo(inst)


def sampler_installed() -> bool:
    """Whether :func:`install_sampler`'s hook is in place in this process."""
    return _installed is not None
