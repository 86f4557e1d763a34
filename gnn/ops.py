"""The GNN ops of cpu_opt, all signatures in one place (as pyg-lib keeps them).

Torch custom ops (namespace ``cpu_opt``), with fake (meta) implementations here and autograd in
:mod:`cpu_opt.gnn._autograd`:

==========================  ===========================================================  ========
op                          computes                                                     autograd
==========================  ===========================================================  ========
``cpu_opt::spmm``           CSR (rowptr, col, weight) x dense, sum/mean/amax/amin         x, weight
``cpu_opt::scatter_reduce`` segments of a 1-D index, sum/mean/amax/amin/prod, include_self src, base
``cpu_opt::gather``         ``src.index_select(0, index)``                               src
``cpu_opt::gather_out``     the same into a preallocated ``out`` (mutates it)            no
``cpu_opt::segment_reduce`` the raw kernel (forward of both above; backward building block) no
``cpu_opt::sddmm``          ``<a[row(e)], b[col[e]]>`` per nonzero                        no
``cpu_opt::arg_scatter``    max/min backward scatter from the saved winner index          no
``cpu_opt::arg_gather``     max/min spmm backward for x, gathered over the CSC           no
``cpu_opt::arg_weight_grad`` max/min backward for edge weights                            no
``cpu_opt::mask_gather``    max/min spmm backward for x from the winner bit mask          no
``cpu_opt::mask_weight_grad`` max/min spmm backward for edge weights from the bit mask    no
``cpu_opt::index_add``      sum of rows by a 1-D index (gather's backward)                no
``cpu_opt::gat_attention``  GATConv: leaky_relu(a_src + a_dst (+ a_edge)) scores, softmax x, a_src,
                            per target, dropout mask, weighted sum of x (H heads)        a_dst, a_edge
``cpu_opt::gatv2_attention`` GATv2Conv: att . leaky_relu(x_l[j] + x_r[i]) scores, ...     x_l, x_r, att
``cpu_opt::transformer_attention`` TransformerConv: <q_i, k_j> / sqrt(C) scores, ... v    q, k, v
``cpu_opt::*_attention_backward`` their backward (SDDMM, softmax backward, CSC gathers)   no
==========================  ===========================================================  ========

Feature dtypes float32, bfloat16 (accumulated in float32, rounded to nearest even) and float64
(its own kernels, accumulated in double: gradcheck runs on those). Index dtypes int64 and int32.

Public functions (what users call): :func:`spmm`, :func:`scatter_reduce`, :func:`scatter`,
:func:`gather` / :func:`index_select`, :func:`gat_attention`, :func:`gatv2_attention`,
:func:`transformer_attention`.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from . import _kernels as K
from .graph import CSRGraph, sort_cache, torch_csr_registry

_ARG_REDUCES = ("amax", "amin")

# ============================================================================ custom ops


@torch.library.custom_op("cpu_opt::segment_reduce", mutates_args=())
def segment_reduce_op(rowptr: Tensor, col: Tensor, weight: Optional[Tensor], x: Tensor, reduce: str,
                      base: Optional[Tensor], include_self: bool) -> tuple[Tensor, Tensor]:
    return K.segment_reduce(rowptr, col, weight, x, reduce, base, include_self)


@segment_reduce_op.register_fake
def _(rowptr, col, weight, x, reduce, base, include_self):
    n = rowptr.shape[0] - 1
    arg_shape = (n, x.shape[1]) if reduce in _ARG_REDUCES else (0,)
    return x.new_empty(n, x.shape[1]), x.new_empty(arg_shape, dtype=torch.int32)


@torch.library.custom_op("cpu_opt::sddmm", mutates_args=())
def sddmm_op(rowptr: Tensor, col: Tensor, a: Tensor, b: Tensor) -> Tensor:
    return K.sddmm(rowptr, col, a, b)


@sddmm_op.register_fake
def _(rowptr, col, a, b):
    return a.new_empty(col.shape[0])


@torch.library.custom_op("cpu_opt::arg_scatter", mutates_args=())
def arg_scatter_op(arg: Tensor, grad: Tensor, rowptr: Tensor, col: Optional[Tensor], weight: Optional[Tensor],
                   n_out: int) -> Tensor:
    return K.arg_scatter(arg, grad, rowptr, col, weight, n_out)


@arg_scatter_op.register_fake
def _(arg, grad, rowptr, col, weight, n_out):
    return grad.new_empty(n_out, grad.shape[1])


@torch.library.custom_op("cpu_opt::arg_gather", mutates_args=())
def arg_gather_op(colptr: Tensor, row_t: Tensor, perm: Tensor, arg: Tensor, rowptr: Tensor, grad: Tensor,
                  weight: Optional[Tensor], n_out: int) -> Tensor:
    return K.arg_gather(colptr, row_t, perm, arg, rowptr, grad, weight, n_out)


@arg_gather_op.register_fake
def _(colptr, row_t, perm, arg, rowptr, grad, weight, n_out):
    return grad.new_empty(n_out, grad.shape[1])


@torch.library.custom_op("cpu_opt::arg_weight_grad", mutates_args=())
def arg_weight_grad_op(arg: Tensor, grad: Tensor, x: Tensor, rowptr: Tensor, col: Tensor) -> Tensor:
    return K.arg_weight_grad(arg, grad, x, rowptr, col)


@arg_weight_grad_op.register_fake
def _(arg, grad, x, rowptr, col):
    return grad.new_empty(col.shape[0])


@torch.library.custom_op("cpu_opt::mask_gather", mutates_args=())
def mask_gather_op(colptr: Tensor, row_t: Tensor, perm: Tensor, wmask: Tensor, grad: Tensor,
                   weight: Optional[Tensor], n_out: int) -> Tensor:
    return K.mask_gather(colptr, row_t, perm, wmask, grad, weight, n_out)


@mask_gather_op.register_fake
def _(colptr, row_t, perm, wmask, grad, weight, n_out):
    return grad.new_empty(n_out, grad.shape[1])


@torch.library.custom_op("cpu_opt::mask_weight_grad", mutates_args=())
def mask_weight_grad_op(wmask: Tensor, grad: Tensor, x: Tensor, rowptr: Tensor, col: Tensor) -> Tensor:
    return K.mask_weight_grad(wmask, grad, x, rowptr, col)


@mask_weight_grad_op.register_fake
def _(wmask, grad, x, rowptr, col):
    return grad.new_empty(col.shape[0])


@torch.library.custom_op("cpu_opt::index_add", mutates_args=())
def index_add_op(src: Tensor, index: Tensor, dim_size: int) -> Tensor:
    """``out = zeros(dim_size, ...); out[index[i]] += src[i]``, by sorted segments (no atomics)."""
    K.check_tensor(src, "src", dtypes=tuple(K.FEATURE_DTYPES))
    K.check_tensor(index, "index", dtypes=tuple(K.INDEX_DTYPES), dim=1)
    if src.dim() < 1 or src.shape[0] != index.numel():
        raise ValueError(f"src must have index.numel() = {index.numel()} rows, got shape {tuple(src.shape)}")
    rowptr, perm = sort_cache.get(index, dim_size)
    out, _ = K.segment_reduce(rowptr, perm, None, src.reshape(src.shape[0], -1), "sum")
    return out.reshape((dim_size,) + tuple(src.shape[1:]))


@index_add_op.register_fake
def _(src, index, dim_size):
    return src.new_empty((dim_size,) + tuple(src.shape[1:]))


@torch.library.custom_op("cpu_opt::gather", mutates_args=())
def gather_op(src: Tensor, index: Tensor) -> Tensor:
    return K.gather_rows(src, index)


@gather_op.register_fake
def _(src, index):
    return src.new_empty((index.shape[0],) + tuple(src.shape[1:]))


@torch.library.custom_op("cpu_opt::gather_out", mutates_args=("out",))
def gather_out_op(src: Tensor, index: Tensor, out: Tensor) -> None:
    K.gather_rows(src, index, out)


@gather_out_op.register_fake
def _(src, index, out):
    return None


@torch.library.custom_op("cpu_opt::spmm", mutates_args=())
def spmm_op(rowptr: Tensor, col: Tensor, weight: Optional[Tensor], colptr: Tensor, row_t: Tensor,
            perm_t: Tensor, x: Tensor, reduce: str) -> tuple[Tensor, Tensor]:
    """CSR x dense. (colptr, row_t, perm_t) is the cached CSC transpose, used by backward.
    Returns (out, winners): for amax/amin the winner index (int32, n x F) or, where it is smaller
    (:func:`_kernels.use_winner_mask`), the winner bit mask (int64, nnz x ceil(F / 64))."""
    return spmm_forward(rowptr, col, weight, x, reduce)


def spmm_forward(rowptr: Tensor, col: Tensor, weight: Optional[Tensor], x: Tensor, reduce: str):
    """The forward of ``cpu_opt::spmm`` (the op, and its eager fast path in _autograd.py)."""
    n = rowptr.shape[0] - 1
    return K.segment_reduce(rowptr, col, weight, x, reduce, mask=K.use_winner_mask(col.shape[0], n, x.shape[1]))


@spmm_op.register_fake
def _(rowptr, col, weight, colptr, row_t, perm_t, x, reduce):
    n, F = rowptr.shape[0] - 1, x.shape[1]
    out = x.new_empty(n, F)
    if reduce not in _ARG_REDUCES:
        return out, x.new_empty(0, dtype=torch.int32)
    if K.use_winner_mask(col.shape[0], n, F):
        return out, x.new_empty(col.shape[0], K.mask_words(F), dtype=torch.int64)
    return out, x.new_empty(n, F, dtype=torch.int32)


@torch.library.custom_op("cpu_opt::scatter_reduce", mutates_args=())
def scatter_reduce_op(src: Tensor, index: Tensor, dim_size: int, reduce: str, base: Optional[Tensor],
                      include_self: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """2-D ``src`` (E x F), 1-D ``index`` (E). Returns (out, arg, count, perm): count is the number
    of src rows per output row, perm the stable sort of index (output row r reduces src rows
    ``perm[rowptr[r]:rowptr[r+1]]``, rowptr = [0, cumsum(count)]); arg (int32) holds the winner
    for amax/amin as a position in that range (-1: base or nothing)."""
    K.check_tensor(src, "src", dtypes=tuple(K.FEATURE_DTYPES), dim=2)
    K.check_tensor(index, "index", dtypes=tuple(K.INDEX_DTYPES), dim=1)
    if index.numel() != src.shape[0]:
        raise ValueError(f"index has {index.numel()} entries but src has {src.shape[0]} rows along dim")
    rowptr, perm = sort_cache.get(index, dim_size)
    out, arg = K.segment_reduce(rowptr, perm, None, src, reduce, base, include_self)
    return out, arg, rowptr[1:] - rowptr[:-1], perm.clone()


@scatter_reduce_op.register_fake
def _(src, index, dim_size, reduce, base, include_self):
    arg_shape = (dim_size, src.shape[1]) if reduce in _ARG_REDUCES else (0,)
    return (src.new_empty(dim_size, src.shape[1]), src.new_empty(arg_shape, dtype=torch.int32),
            src.new_empty(dim_size, dtype=torch.int64), src.new_empty(index.shape[0], dtype=torch.int64))


# ---------------------------------------------------------------------------- attention
# Node tensors are (num_nodes, H, C); per-head tensors (num_nodes or E, H); edge tensors in the CSR
# order of the graph. Each op returns (out (n_dst, H, C), alpha (E, H): the softmax before dropout).
# (colptr, row_t, perm_t) is the graph's cached CSC transpose, used by backward.


def _unwanted(t: Optional[Tensor], like: Tensor) -> Tensor:
    """A gradient the caller did not ask for, as an empty tensor (custom ops return no None)."""
    return t if t is not None else like.new_empty(0)


@torch.library.custom_op("cpu_opt::gat_attention", mutates_args=())
def gat_attention_op(rowptr: Tensor, col: Tensor, colptr: Tensor, row_t: Tensor, perm_t: Tensor, x: Tensor,
                     a_src: Tensor, a_dst: Tensor, a_edge: Optional[Tensor], mask: Optional[Tensor],
                     negative_slope: float) -> tuple[Tensor, Tensor]:
    return K.gat_forward(rowptr, col, x, a_src, a_dst, a_edge, mask, negative_slope)


@gat_attention_op.register_fake
def _(rowptr, col, colptr, row_t, perm_t, x, a_src, a_dst, a_edge, mask, negative_slope):
    return x.new_empty(rowptr.shape[0] - 1, x.shape[1], x.shape[2]), x.new_empty(col.shape[0], x.shape[1])


@torch.library.custom_op("cpu_opt::gat_attention_backward", mutates_args=())
def gat_attention_backward_op(rowptr: Tensor, col: Tensor, colptr: Tensor, row_t: Tensor, perm_t: Tensor, x: Tensor,
                              a_src: Tensor, a_dst: Tensor, a_edge: Optional[Tensor], mask: Optional[Tensor],
                              negative_slope: float, alpha: Tensor, grad_out: Tensor,
                              needs: list[bool]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients wrt (x, a_src, a_dst, a_edge); an empty tensor where ``needs`` is False."""
    grads = K.gat_backward(rowptr, col, colptr, row_t, perm_t, x, a_src, a_dst, a_edge, mask, negative_slope,
                           alpha, grad_out, needs)
    return tuple(_unwanted(g, x) for g in grads)


@gat_attention_backward_op.register_fake
def _(rowptr, col, colptr, row_t, perm_t, x, a_src, a_dst, a_edge, mask, negative_slope, alpha, grad_out, needs):
    shapes = (x.shape, a_src.shape, a_dst.shape, (col.shape[0], x.shape[1]))
    return tuple(x.new_empty(s if want and (i < 3 or a_edge is not None) else (0,))
                 for i, (s, want) in enumerate(zip(shapes, needs)))


@torch.library.custom_op("cpu_opt::gatv2_attention", mutates_args=())
def gatv2_attention_op(rowptr: Tensor, col: Tensor, colptr: Tensor, row_t: Tensor, perm_t: Tensor, x_l: Tensor,
                       x_r: Tensor, att: Tensor, mask: Optional[Tensor], negative_slope: float) -> tuple[Tensor, Tensor]:
    return K.gatv2_forward(rowptr, col, x_l, x_r, att, mask, negative_slope)


@gatv2_attention_op.register_fake
def _(rowptr, col, colptr, row_t, perm_t, x_l, x_r, att, mask, negative_slope):
    return x_l.new_empty(rowptr.shape[0] - 1, x_l.shape[1], x_l.shape[2]), x_l.new_empty(col.shape[0], x_l.shape[1])


@torch.library.custom_op("cpu_opt::gatv2_attention_backward", mutates_args=())
def gatv2_attention_backward_op(rowptr: Tensor, col: Tensor, colptr: Tensor, row_t: Tensor, perm_t: Tensor,
                                x_l: Tensor, x_r: Tensor, att: Tensor, mask: Optional[Tensor], negative_slope: float,
                                alpha: Tensor, grad_out: Tensor, needs: list[bool]) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients wrt (x_l, x_r, att); an empty tensor where ``needs`` is False."""
    gl, gr, ga = K.gatv2_backward(rowptr, col, colptr, row_t, perm_t, x_l, x_r, att, mask, negative_slope, alpha,
                                  grad_out, needs)
    return _unwanted(gl, x_l), _unwanted(gr, x_l), _unwanted(None if ga is None else ga.reshape(att.shape), x_l)


@gatv2_attention_backward_op.register_fake
def _(rowptr, col, colptr, row_t, perm_t, x_l, x_r, att, mask, negative_slope, alpha, grad_out, needs):
    return tuple(x_l.new_empty(s if want else (0,)) for s, want in zip((x_l.shape, x_r.shape, att.shape), needs))


@torch.library.custom_op("cpu_opt::transformer_attention", mutates_args=())
def transformer_attention_op(rowptr: Tensor, col: Tensor, colptr: Tensor, row_t: Tensor, perm_t: Tensor, q: Tensor,
                             k: Tensor, v: Tensor, mask: Optional[Tensor], score_div: float) -> tuple[Tensor, Tensor]:
    return K.transformer_forward(rowptr, col, q, k, v, mask, score_div)


@transformer_attention_op.register_fake
def _(rowptr, col, colptr, row_t, perm_t, q, k, v, mask, score_div):
    return v.new_empty(rowptr.shape[0] - 1, v.shape[1], v.shape[2]), v.new_empty(col.shape[0], v.shape[1])


@torch.library.custom_op("cpu_opt::transformer_attention_backward", mutates_args=())
def transformer_attention_backward_op(rowptr: Tensor, col: Tensor, colptr: Tensor, row_t: Tensor, perm_t: Tensor,
                                      q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], score_div: float,
                                      alpha: Tensor, grad_out: Tensor,
                                      needs: list[bool]) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients wrt (q, k, v); an empty tensor where ``needs`` is False."""
    grads = K.transformer_backward(rowptr, col, colptr, row_t, perm_t, q, k, v, mask, score_div, alpha, grad_out,
                                   needs)
    return tuple(_unwanted(g, v) for g in grads)


@transformer_attention_backward_op.register_fake
def _(rowptr, col, colptr, row_t, perm_t, q, k, v, mask, score_div, alpha, grad_out, needs):
    return tuple(v.new_empty(s if want else (0,)) for s, want in zip((q.shape, k.shape, v.shape), needs))


# ============================================================================ public API


def _graph_and_weight(adj, weight):
    if isinstance(adj, CSRGraph):
        return adj, (weight if weight is not None else adj.weight)
    if isinstance(adj, torch.Tensor) and adj.layout == torch.sparse_csr:
        g, unit = torch_csr_registry.graph_for(adj)
        if weight is None and not unit:
            weight = adj.values()
        return g, weight
    if isinstance(adj, torch.Tensor) and adj.layout in (torch.sparse_coo, torch.sparse_csc):
        g = CSRGraph.from_torch(adj)  # converted on every call: pass CSR (or a CSRGraph) to avoid it
        return g.with_weight(None), (weight if weight is not None else g.weight)
    raise TypeError(f"adj must be a cpu_opt.gnn.CSRGraph or a torch sparse CSR tensor, got "
                    f"{type(adj).__name__}{'' if not isinstance(adj, torch.Tensor) else ' ' + str(adj.layout)}")


def spmm(adj, x: Tensor, reduce: str = "sum", weight: Optional[Tensor] = None) -> Tensor:
    """``out[i] = reduce_{j in adj[i]} w_ij * x[j]`` for a CSR ``adj`` (n x m) and dense ``x`` (m x F).

    ``adj``: a :class:`CSRGraph` or a torch sparse CSR tensor (its values are the weights, unless
    it was made by :func:`cpu_opt.gnn.graph.adj_t_from_edge_index`, whose ones are skipped).
    ``reduce``: sum, mean, amax (max), amin (min). Rows without nonzeros give 0. Differentiable in
    ``x`` and the weights; backward uses the CSC transpose, built once per graph and cached."""
    reduce = K.canonical_reduce(reduce, ("sum", "mean", "amax", "amin"))
    g, w = _graph_and_weight(adj, weight)
    K.check_tensor(x, "x", dtypes=tuple(K.FEATURE_DTYPES), dim=2)
    if x.shape[0] != g.n_cols:
        raise ValueError(f"x must have adj.shape[1] = {g.n_cols} rows, got {x.shape[0]}")
    if w is not None:
        K.check_tensor(w, "weight", dtypes=tuple(K.FEATURE_DTYPES), dim=1)
        if w.numel() != g.nnz:
            raise ValueError(f"weight must have one entry per nonzero ({g.nnz}), got {w.numel()}")
        if w.dtype != x.dtype:
            w = w.to(x.dtype)
    if reduce in _ARG_REDUCES and not torch.compiler.is_compiling() and not (
            torch.is_grad_enabled() and (x.requires_grad or (w is not None and w.requires_grad))):
        # inference: no backward will come, so no winner index (and no CSC transpose) is needed
        out, _ = K.segment_reduce(g.rowptr, g.col, w, x, reduce, want_arg=False)
        return out
    colptr, row_t, perm_t = g.csc()
    if torch.compiler.is_compiling():
        out, _ = torch.ops.cpu_opt.spmm(g.rowptr, g.col, w, colptr, row_t, perm_t, x, reduce)
    else:  # the same forward and backward without the custom-op dispatcher (see _autograd.SpmmFunction)
        from ._autograd import SpmmFunction

        out, _ = SpmmFunction.apply(g.rowptr, g.col, w, colptr, row_t, perm_t, x, reduce)
    return out


def _flatten_dim(t: Tensor, dim: int) -> Tensor:
    t = t.movedim(dim, 0)
    f = 1
    for d in t.shape[1:]:
        f *= d
    return t.reshape(t.shape[0], f)


def scatter_reduce(src: Tensor, index: Tensor, dim: int = 0, dim_size: Optional[int] = None,
                   reduce: str = "sum", *, input: Optional[Tensor] = None, include_self: bool = True) -> Tensor:
    """``input.scatter_reduce(dim, index_broadcast, src, reduce, include_self=...)`` with a 1-D
    ``index`` of length ``src.size(dim)`` (PyG's convention), ``input`` defaulting to zeros of
    size ``dim_size`` along ``dim``. Reduces: sum, mean, amax, amin, prod.

    No atomics: the index is sorted once (counting sort; kept in a small cache, so the same
    index tensor is not sorted again) and every output row reduced in parallel. amax/amin
    record the winning row, so their backward is a scatter; on ties the gradient goes to one
    winner (the input when it ties, else the first in index order), where torch splits it."""
    reduce = K.canonical_reduce(reduce)
    K.check_tensor(src, "src", dtypes=tuple(K.FEATURE_DTYPES))
    K.check_tensor(index, "index", dtypes=tuple(K.INDEX_DTYPES))
    if index.dim() != 1:
        raise ValueError(f"index must be 1-D (one entry per slice of src along dim), got shape {tuple(index.shape)}")
    if src.dim() == 0:
        raise ValueError("src must have at least one dimension")
    if not isinstance(dim, int):
        raise TypeError(f"dim must be an int, got {type(dim).__name__}")
    if not -src.dim() <= dim < src.dim():
        raise IndexError(f"dim {dim} is out of range for src of {src.dim()} dimensions")
    dim = dim % src.dim()
    if index.numel() != src.shape[dim]:
        raise ValueError(f"index has {index.numel()} entries but src.size({dim}) = {src.shape[dim]}")
    if input is not None:
        K.check_tensor(input, "input", dtypes=tuple(K.FEATURE_DTYPES))
        if input.dtype != src.dtype:
            raise TypeError(f"input dtype {input.dtype} must match src dtype {src.dtype}")
        if input.dim() != src.dim() or any(input.shape[d] != src.shape[d] for d in range(src.dim()) if d != dim):
            raise ValueError(f"input shape {tuple(input.shape)} must match src shape {tuple(src.shape)} "
                             f"except along dim {dim}")
        if dim_size is not None and dim_size != input.shape[dim]:
            raise ValueError(f"dim_size {dim_size} must equal input.size({dim}) = {input.shape[dim]}")
        dim_size = input.shape[dim]
    if dim_size is None:
        dim_size = int(index.max()) + 1 if index.numel() else 0
    if not isinstance(dim_size, int) or dim_size < 0:
        raise ValueError(f"dim_size must be a non-negative int, got {dim_size!r}")
    rest = tuple(src.shape[:dim]) + tuple(src.shape[dim + 1:])
    s2 = _flatten_dim(src, dim).contiguous()
    b2 = _flatten_dim(input, dim).contiguous() if input is not None else None
    out = torch.ops.cpu_opt.scatter_reduce(s2, index, dim_size, reduce, b2, include_self)[0]
    moved = src.movedim(dim, 0).shape[1:]
    return out.reshape((dim_size,) + tuple(moved)).movedim(0, dim) if rest else out.reshape(dim_size)


def scatter(src: Tensor, index: Tensor, dim: int = 0, dim_size: Optional[int] = None,
            reduce: str = "sum") -> Tensor:
    """PyG's / torch_scatter's ``scatter``: reduce slices of ``src`` into zeros, empty rows 0,
    mean over the number of entries (``include_self=False``); for prod ("mul") empty rows are 1,
    as in PyG and torch_scatter."""
    if K.canonical_reduce(reduce) == "prod":
        if dim_size is None:
            dim_size = int(index.max()) + 1 if index.numel() else 0
        d = dim % src.dim() if src.dim() else 0
        shape = list(src.shape)
        shape[d] = dim_size
        return scatter_reduce(src, index, dim, dim_size, "prod", input=src.new_ones(shape), include_self=True)
    return scatter_reduce(src, index, dim, dim_size, reduce, include_self=False)


def gather(src: Tensor, index: Tensor, out: Optional[Tensor] = None) -> Tensor:
    """``src.index_select(0, index)`` (differentiable in ``src``), or written into ``out``
    (preallocated, contiguous; not differentiable)."""
    K.check_tensor(src, "src")
    K.check_tensor(index, "index", dtypes=tuple(K.INDEX_DTYPES))
    if index.dim() != 1:
        raise ValueError(f"index must be 1-D, got shape {tuple(index.shape)}")
    if out is not None:
        if torch.is_grad_enabled() and src.requires_grad:
            raise RuntimeError("gather(..., out=...) is not differentiable; call it without out")
        torch.ops.cpu_opt.gather_out(src, index, out)
        return out
    return torch.ops.cpu_opt.gather(src, index)


index_select = gather


# ---------------------------------------------------------------------------- attention


def _attention_graph(adj) -> CSRGraph:
    if isinstance(adj, CSRGraph):
        return adj
    if isinstance(adj, torch.Tensor) and adj.layout == torch.sparse_csr:
        return torch_csr_registry.graph_for(adj)[0]
    raise TypeError(f"adj must be a cpu_opt.gnn.CSRGraph or a torch sparse CSR tensor (targets x sources), got "
                    f"{type(adj).__name__}{'' if not isinstance(adj, torch.Tensor) else ' ' + str(adj.layout)}")


def _run_attention(name: str, adj, nodes: tuple, extra: tuple, return_alpha: bool, n_src: int):
    """Calls ``cpu_opt::<name>`` over ``adj``: without the CSC transpose (and the dispatcher) when no
    gradient can be wanted."""
    g = _attention_graph(adj)
    if g.n_cols != n_src:
        raise ValueError(f"the source features must have adj.shape[1] = {g.n_cols} rows, got {n_src}")
    wants_grad = torch.is_grad_enabled() and any(isinstance(t, Tensor) and t.requires_grad for t in nodes)
    if not wants_grad and not torch.compiler.is_compiling():
        out, alpha = getattr(K, name.replace("_attention", "_forward"))(g.rowptr, g.col, *nodes, *extra)
    else:
        colptr, row_t, perm_t = g.csc()
        out, alpha = getattr(torch.ops.cpu_opt, name)(g.rowptr, g.col, colptr, row_t, perm_t, *nodes, *extra)
    return (out, alpha) if return_alpha else out


def gat_attention(adj, x: Tensor, a_src: Tensor, a_dst: Tensor, *, negative_slope: float = 0.2,
                  a_edge: Optional[Tensor] = None, mask: Optional[Tensor] = None, return_alpha: bool = False):
    """GATConv's attention over the graph ``adj`` (a :class:`CSRGraph` or torch sparse CSR, targets x
    sources): ``out[i, h] = sum_{j in adj[i]} alpha_ijh * mask_ijh * x[j, h]`` with ``alpha`` the softmax
    over row i of ``leaky_relu(a_src[j, h] + a_dst[i, h] (+ a_edge[e, h]))`` (PyG's: max-subtracted,
    1e-16 added to the sum). ``x`` (n_src, H, C), ``a_src`` (n_src, H), ``a_dst`` (n_dst, H); ``a_edge``
    and ``mask`` (dropout multipliers) (E, H) in the graph's CSR order. Differentiable in x, a_src,
    a_dst and a_edge; nothing of size E x H x C is made. ``return_alpha``: also return alpha (E, H,
    before dropout, CSR order)."""
    return _run_attention("gat_attention", adj, (x, a_src, a_dst, a_edge), (mask, float(negative_slope)),
                          return_alpha, x.shape[0] if isinstance(x, Tensor) and x.dim() else -1)


def gatv2_attention(adj, x_l: Tensor, x_r: Tensor, att: Tensor, *, negative_slope: float = 0.2,
                    mask: Optional[Tensor] = None, return_alpha: bool = False):
    """GATv2Conv's attention: scores ``sum_c att[h, c] * leaky_relu(x_l[j, h, c] + x_r[i, h, c])``,
    computed in the kernel per edge (no E x H x C tensor), softmax per target row, messages
    ``x_l[j]``. ``x_l`` (n_src, H, C), ``x_r`` (n_dst, H, C), ``att`` (H, C) (or (1, H, C)).
    Differentiable in x_l, x_r and att."""
    return _run_attention("gatv2_attention", adj, (x_l, x_r, att), (mask, float(negative_slope)), return_alpha,
                          x_l.shape[0] if isinstance(x_l, Tensor) and x_l.dim() else -1)


def transformer_attention(adj, q: Tensor, k: Tensor, v: Tensor, *, score_div: Optional[float] = None,
                          mask: Optional[Tensor] = None, return_alpha: bool = False):
    """TransformerConv's attention: scores ``<q[i, h], k[j, h]> / score_div`` (default ``sqrt(C)``),
    softmax per target row, messages ``v[j]``. ``q`` (n_dst, H, C), ``k`` and ``v`` (n_src, H, C).
    Differentiable in q, k and v."""
    if score_div is None:
        score_div = math.sqrt(v.shape[-1]) if isinstance(v, Tensor) and v.dim() == 3 else 1.0
    return _run_attention("transformer_attention", adj, (q, k, v), (mask, float(score_div)), return_alpha,
                          v.shape[0] if isinstance(v, Tensor) and v.dim() else -1)
