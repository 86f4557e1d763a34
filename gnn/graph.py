"""Graph structures for the GNN kernels: a CSR adjacency with its CSC transpose built once and
cached, and a small cache of sorted scatter indices.

Convention (PyG's ``adj_t``): for ``edge_index`` with sources in row 0 and targets in row 1 and
``flow="source_to_target"``, the CSR has one row per *target* node and its column indices are
the *sources*, so ``spmm(adj_t, x)`` aggregates messages at the targets.
"""
from __future__ import annotations

import contextlib
import threading
import weakref
from collections import OrderedDict

import torch

from cpu_opt import native

from . import _kernels as K


class CSRGraph:
    """A sparse ``n_rows x n_cols`` matrix in CSR form (``rowptr`` int64, ``col`` int64 or int32,
    optional ``weight``), with the CSC transpose that backward passes need built on first use
    and kept. Construct with :meth:`from_edge_index`, :meth:`from_csr` or :meth:`from_torch`."""

    def __init__(self, rowptr: torch.Tensor, col: torch.Tensor, n_cols: int,
                 weight: torch.Tensor | None = None, *, validate: bool = True):
        rowptr = K.check_tensor(rowptr, "rowptr", dtypes=(torch.int64, torch.int32), dim=1)
        col = K.check_tensor(col, "col", dtypes=tuple(K.INDEX_DTYPES), dim=1)
        if rowptr.numel() < 1:
            raise ValueError("rowptr must have n_rows + 1 >= 1 entries")
        if not isinstance(n_cols, int) or n_cols < 0:
            raise ValueError(f"n_cols must be a non-negative int, got {n_cols!r}")
        self.rowptr = rowptr.to(torch.int64).contiguous()
        self.col = col.contiguous()
        self.n_rows = self.rowptr.numel() - 1
        self.n_cols = n_cols
        if weight is not None:
            weight = K.check_tensor(weight, "weight", dtypes=tuple(K.FEATURE_DTYPES), dim=1)
            if weight.numel() != col.numel():
                raise ValueError(f"weight must have one entry per nonzero ({col.numel()}), got {weight.numel()}")
        self.weight = weight
        if validate:
            if int(self.rowptr[0]) != 0 or int(self.rowptr[-1]) != col.numel():
                raise ValueError(f"rowptr must run from 0 to nnz = {col.numel()}, got "
                                 f"{int(self.rowptr[0])}..{int(self.rowptr[-1])}")
            if self.n_rows and bool((self.rowptr[1:] < self.rowptr[:-1]).any()):
                raise ValueError("rowptr must never decrease")
            if col.numel() and (int(col.min()) < 0 or int(col.max()) >= n_cols):
                raise IndexError(f"col holds {int(col.min())}..{int(col.max())}, out of range [0, {n_cols})")
        self._csc = None
        self._csc_fp = None
        self._lock = threading.Lock()
        self._deg = None

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_edge_index(cls, edge_index: torch.Tensor, num_nodes: int | None = None,
                        edge_weight: torch.Tensor | None = None, *, flow: str = "source_to_target",
                        index_dtype: torch.dtype = torch.int64) -> "CSRGraph":
        """``adj_t`` of a PyG ``edge_index`` (2 x E): rows are targets, columns sources (for
        ``flow="source_to_target"``). Duplicate edges stay (they add up, as in PyG)."""
        edge_index = K.check_tensor(edge_index, "edge_index", dtypes=tuple(K.INDEX_DTYPES), dim=2)
        if edge_index.shape[0] != 2:
            raise ValueError(f"edge_index must have shape (2, E), got {tuple(edge_index.shape)}")
        if flow not in ("source_to_target", "target_to_source"):
            raise ValueError(f"flow must be 'source_to_target' or 'target_to_source', got {flow!r}")
        if num_nodes is None:
            num_nodes = int(edge_index.max()) + 1 if edge_index.numel() else 0
        src, dst = (edge_index[0], edge_index[1]) if flow == "source_to_target" else (edge_index[1], edge_index[0])
        if edge_index.numel() and (int(edge_index.min()) < 0 or int(edge_index.max()) >= num_nodes):
            raise IndexError(f"edge_index holds {int(edge_index.min())}..{int(edge_index.max())}, "
                             f"out of range [0, {num_nodes})")
        rowptr, perm = K.index_to_csr(dst.contiguous(), num_nodes)
        col = src.index_select(0, perm).to(index_dtype)
        w = edge_weight.index_select(0, perm) if edge_weight is not None else None
        return cls(rowptr, col, num_nodes, w, validate=False)

    @classmethod
    def from_torch(cls, t: torch.Tensor) -> "CSRGraph":
        """From a torch sparse CSR (or COO/CSC, converted) matrix; its values become the weights."""
        if not isinstance(t, torch.Tensor) or t.layout not in (torch.sparse_csr, torch.sparse_coo, torch.sparse_csc):
            raise TypeError(f"expected a torch sparse tensor, got {getattr(t, 'layout', type(t).__name__)}")
        if t.dim() != 2:
            raise ValueError(f"sparse matrix must be 2-D, got {t.dim()}-D")
        if t.layout != torch.sparse_csr:
            t = t.to_sparse_csr()
        return cls(t.crow_indices(), t.col_indices(), t.shape[1], t.values())

    # ------------------------------------------------------------------ derived, cached
    @property
    def nnz(self) -> int:
        return self.col.numel()

    def _structure_fingerprint(self) -> tuple:
        return native.fingerprint(self.rowptr), native.fingerprint(self.col)

    def csc(self):
        """(colptr, row_t, perm) of the transpose; built once (under a lock) and kept while
        ``rowptr`` and ``col`` hold the same contents: an in-place edit of either (through any view,
        versioned or not) rebuilds it instead of handing backward a stale transpose."""
        if torch.compiler.is_compiling():  # dynamo cannot trace the hash; the traced graph holds the tensors
            if self._csc is None:
                self._csc = K.csr_transpose(self.rowptr, self.col, self.n_cols)
            return self._csc
        fp = self._structure_fingerprint()
        with self._lock:
            if self._csc is None or self._csc_fp != fp:
                with outside_inference_mode():
                    self._csc = K.csr_transpose(self.rowptr, self.col, self.n_cols)
                self._csc_fp = fp
                self._deg = None
            return self._csc

    def deg(self) -> torch.Tensor:
        if self._deg is None:
            self._deg = self.rowptr[1:] - self.rowptr[:-1]
        return self._deg

    def with_weight(self, weight: torch.Tensor | None) -> "CSRGraph":
        """The same structure (sharing the cached CSC) with other edge weights."""
        g = CSRGraph.__new__(CSRGraph)
        g.__dict__.update(self.__dict__)
        if weight is not None and weight.numel() != self.nnz:
            raise ValueError(f"weight must have {self.nnz} entries, got {weight.numel()}")
        g.weight = weight
        g._lock = threading.Lock()
        # share the transpose: compute once on the original
        g.csc = self.csc
        return g

    def to_torch(self) -> torch.Tensor:
        """A torch sparse CSR tensor of this matrix (ones where there is no weight)."""
        values = self.weight if self.weight is not None else torch.ones(self.nnz)
        return torch.sparse_csr_tensor(self.rowptr, self.col.to(torch.int64), values,
                                       size=(self.n_rows, self.n_cols), check_invariants=False)

    def __repr__(self):
        return (f"CSRGraph({self.n_rows}x{self.n_cols}, nnz={self.nnz}, col={self.col.dtype}, "
                f"weighted={self.weight is not None}, csc_cached={self._csc is not None})")


def outside_inference_mode():
    """A context for building what a cache keeps across calls: normal tensors even when the call that
    fills the cache runs under ``torch.inference_mode()`` (an inference tensor cannot be saved for
    backward, so a later training call that got one from the cache would fail)."""
    return torch.inference_mode(False) if torch.is_inference_mode_enabled() else contextlib.nullcontext()


# ----------------------------------------------------------------------------- sorted-index cache

class _SortCache:
    """The (rowptr, perm) of recently seen scatter indices, so the same index is sorted once.

    Keyed by the index's *contents* (a 64-bit fingerprint of its bytes, its length and dtype) and
    ``dim_size``: the sort depends on nothing else. A pointer-and-``_version`` key missed in-place
    writes that bump no version (``.data``, numpy views over a reused buffer) and raised on
    inference-mode tensors; hashing costs one pass over the index (about 1 ms per 8 MB), against a
    sort of it on a miss."""

    def __init__(self, capacity: int = 16):
        self.capacity = capacity
        self._d: OrderedDict = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    @staticmethod
    def _key(index: torch.Tensor, dim_size: int):
        return (native.fingerprint(index), index.numel(), index.dtype, int(dim_size))

    def get(self, index: torch.Tensor, dim_size: int):
        key = self._key(index, dim_size)
        with self._lock:
            hit = self._d.get(key)
            if hit is not None:
                self._d.move_to_end(key)
                self.hits += 1
                return hit
        with outside_inference_mode():
            rowptr, perm = K.index_to_csr(index, dim_size)
        with self._lock:
            self.misses += 1
            self._d[key] = (rowptr, perm)
            while len(self._d) > self.capacity:
                self._d.popitem(last=False)
        return rowptr, perm

    def clear(self):
        with self._lock:
            self._d.clear()


sort_cache = _SortCache()


# ----------------------------------------------------------------------------- torch CSR -> CSRGraph

class _TorchCSRRegistry:
    """Maps torch sparse CSR tensors (by identity, weakly) to their CSRGraph, so a PyG ``adj_t``
    that is passed again reuses its cached transpose."""

    def __init__(self):
        self._d: dict = {}
        self._lock = threading.Lock()

    def register(self, t: torch.Tensor, graph: CSRGraph, unit_weight: bool = False,
                 edge_index: torch.Tensor | None = None):
        """``edge_index``: the PyG edge_index this adj_t was made from, if any."""
        key = id(t)
        with self._lock:
            self._d[key] = (weakref.ref(t, lambda _r, k=key: self._d.pop(k, None)), graph, unit_weight, edge_index)

    def lookup(self, t: torch.Tensor):
        """(graph, unit_weight) of a registered tensor, else None."""
        hit = self._d.get(id(t))
        if hit is not None and hit[0]() is t:
            return hit[1], hit[2]
        return None

    def source_edge_index(self, t: torch.Tensor):
        hit = self._d.get(id(t))
        return hit[3] if hit is not None and hit[0]() is t else None

    def graph_for(self, t: torch.Tensor) -> tuple[CSRGraph, bool]:
        """(structure, unit_weight): unit_weight means the values are all ones and can be skipped."""
        hit = self.lookup(t)
        if hit is not None:
            return hit
        g = CSRGraph.from_torch(t)
        self.register(t, g.with_weight(None), False)
        return g.with_weight(None), False


torch_csr_registry = _TorchCSRRegistry()


def adj_t_from_edge_index(edge_index: torch.Tensor, num_nodes: int, index_dtype=torch.int64) -> torch.Tensor:
    """A torch sparse CSR ``adj_t`` (targets x sources, ones) registered with its CSRGraph."""
    g = CSRGraph.from_edge_index(edge_index, num_nodes, index_dtype=index_dtype)
    t = g.to_torch()
    torch_csr_registry.register(t, g, unit_weight=True, edge_index=edge_index)
    return t
