"""Autograd of the cpu_opt GNN ops (``register_autograd``); the ops themselves are in ops.py.

Backward formulas, each built from the cpu_opt ops themselves so ``torch.compile`` traces them:

* ``spmm`` sum/mean: dx = A^T g (mean: g scaled by 1/deg first), run as a forward segment
  reduction over the CSC transpose cached with the graph; dw[e] = <g[row(e)], x[col[e]]> (sddmm).
* ``spmm`` amax/amin: from the winners saved by the forward pass (an index per output row and
  feature, or a bit mask per nonzero where that is smaller): dx gathered over the cached CSC
  transpose (each edge adds g where it won), dw summed over each edge's winning features.
* ``scatter_reduce`` sum/mean: dsrc = g[index] (mean: / count); amax/amin: a scatter from the
  saved winners; prod: torch's own formula (zeros handled), in cpu_opt ops.
  d(base) as torch defines it for include_self True / False.
* ``gather``: dsrc = index_add(g, index), by sorted segments.
* attention (``gat_attention``, ``gatv2_attention``, ``transformer_attention``): one backward op each
  (native/kernels/attention.c: the SDDMM and softmax backward over target rows, the source-side
  gradients gathered over the cached CSC transpose), from the alpha the forward saved.
Double backward is not provided.
"""
from __future__ import annotations

import torch

from . import _kernels as K
from . import ops


# ---------------------------------------------------------------------------- spmm

def _spmm_setup(ctx, inputs, output):
    rowptr, col, weight, colptr, row_t, perm_t, x, reduce = inputs
    _, arg = output
    # the winner index is not differentiable: without this autograd hands backward a zero-filled
    # gradient for it (n x F int64; 22 ms of each max/min backward at 100k x 64)
    ctx.set_materialize_grads(False)
    ctx.reduce = reduce
    ctx.n_x = x.shape[0]
    ctx.has_weight = weight is not None
    ctx.save_for_backward(rowptr, col, weight, colptr, row_t, perm_t, x, arg)


def _spmm_backward(ctx, grad_out, _grad_arg, kernels=None):
    """``kernels``: where the backward ops come from: ``torch.ops.cpu_opt`` (traceable; the
    default), or the kernel wrappers in _kernels.py themselves (same names and arguments) for the
    eager path, which skips the dispatcher."""
    k = kernels if kernels is not None else torch.ops.cpu_opt
    rowptr, col, weight, colptr, row_t, perm_t, x, arg = ctx.saved_tensors
    if grad_out is None:
        return None, None, None, None, None, None, None, None
    need_x, need_w = ctx.needs_input_grad[6], ctx.has_weight and ctx.needs_input_grad[2]
    g = grad_out.contiguous()
    grad_x = grad_w = None
    if ctx.reduce in ("sum", "mean"):
        if ctx.reduce == "mean":
            deg = (rowptr[1:] - rowptr[:-1]).clamp(min=1).to(g.dtype)
            g = g / deg.unsqueeze(1)
        if need_x:
            w_t = weight.index_select(0, perm_t) if weight is not None else None
            grad_x, _ = k.segment_reduce(colptr, row_t, w_t, g, "sum", None, False)
        if need_w:
            grad_w = k.sddmm(rowptr, col, g, x)
    elif arg.dtype == torch.int64:  # the winners as a bit mask per nonzero (sparser graphs)
        if need_x:
            grad_x = k.mask_gather(colptr, row_t, perm_t, arg, g, weight, ctx.n_x)
        if need_w:
            grad_w = k.mask_weight_grad(arg, g, x, rowptr, col)
    else:
        if need_x:  # gathered over the cached CSC: each thread owns whole rows of grad_x
            grad_x = k.arg_gather(colptr, row_t, perm_t, arg, rowptr, g, weight, ctx.n_x)
        if need_w:
            grad_w = k.arg_weight_grad(arg, g, x, rowptr, col)
    return None, None, grad_w, None, None, None, grad_x, None


ops.spmm_op.register_autograd(_spmm_backward, setup_context=_spmm_setup)


class SpmmFunction(torch.autograd.Function):
    """``cpu_opt::spmm`` for eager mode: the same forward kernel, setup and backward as the op,
    with the kernels called without the custom-op dispatcher, whose Python layers cost about
    200 us a call (KarateClub: 272 us through the op against 68 us for the kernel call).
    ``gnn.spmm`` takes the op while ``torch.compile`` traces, this otherwise."""

    @staticmethod
    def forward(ctx, rowptr, col, weight, colptr, row_t, perm_t, x, reduce):
        output = ops.spmm_forward(rowptr, col, weight, x, reduce)
        _spmm_setup(ctx, (rowptr, col, weight, colptr, row_t, perm_t, x, reduce), output)
        return output

    @staticmethod
    def backward(ctx, grad_out, grad_arg):
        # create_graph=True (grad mode on here): the ops, so that differentiating this backward
        # raises torch's "no autograd formula" error instead of finding no graph at all
        return _spmm_backward(ctx, grad_out, grad_arg, kernels=None if torch.is_grad_enabled() else K)


# ---------------------------------------------------------------------------- scatter_reduce

def _scatter_setup(ctx, inputs, output):
    src, index, dim_size, reduce, base, include_self = inputs
    out, arg, count, perm = output
    ctx.set_materialize_grads(False)  # arg, count and perm are not differentiable (see _spmm_setup)
    ctx.reduce, ctx.dim_size, ctx.include_self = reduce, dim_size, include_self
    ctx.has_base = base is not None
    ctx.save_for_backward(src, index, base, out, arg, count, perm)


def _gather(t, index):
    return torch.ops.cpu_opt.gather(t.contiguous(), index)


def _scatter_backward(ctx, grad_out, _grad_arg, _grad_count, _grad_perm):
    src, index, base, out, arg, count, perm = ctx.saved_tensors
    if grad_out is None:
        return None, None, None, None, None, None
    g = grad_out.contiguous()
    red, inc, n = ctx.reduce, ctx.include_self, ctx.dim_size
    empty = (count == 0).unsqueeze(1).to(g.dtype)
    grad_src = grad_base = None
    if red == "sum":
        grad_src = _gather(g, index)
        if ctx.has_base:
            grad_base = g if inc else g * empty
    elif red == "mean":
        cnt = (count + int(inc)).clamp(min=1).to(g.dtype).unsqueeze(1)
        gs = g / cnt
        grad_src = _gather(gs, index)
        if ctx.has_base:
            grad_base = gs if inc else g * empty
    elif red in ("amax", "amin"):
        rowptr = torch.cat([count.new_zeros(1), count.cumsum(0)])
        grad_src = torch.ops.cpu_opt.arg_scatter(arg, g, rowptr, perm, None, src.shape[0])
        if ctx.has_base:
            grad_base = g * (arg == -1).to(g.dtype)
    else:  # prod, as torch's scatter_reduce backward, zeros included
        src_zero = src == 0
        n_zero = torch.ops.cpu_opt.scatter_reduce(src_zero.to(src.dtype).contiguous(), index, n, "sum", None, False)[0]
        single = src_zero & (_gather(n_zero, index) == 1)
        masked_src = src.masked_fill(single, 1).contiguous()
        masked_res = torch.ops.cpu_opt.scatter_reduce(masked_src, index, n, "prod", base, inc)[0]
        grad_src = torch.where(single, _gather(g * masked_res, index),
                               _gather(g * out, index) / src.masked_fill(src_zero, 1))
        if ctx.has_base:
            if inc:
                masked_base = base.masked_fill(base == 0, 1).contiguous()
                res2 = torch.ops.cpu_opt.scatter_reduce(src, index, n, "prod", masked_base, True)[0]
                grad_base = g * res2 / masked_base
            else:
                grad_base = g * empty
    return grad_src, None, None, None, grad_base, None


ops.scatter_reduce_op.register_autograd(_scatter_backward, setup_context=_scatter_setup)


# ---------------------------------------------------------------------------- gather

def _gather_setup(ctx, inputs, output):
    src, index = inputs
    ctx.n_src = src.shape[0]
    ctx.save_for_backward(index)


def _gather_backward(ctx, grad_out):
    (index,) = ctx.saved_tensors
    return torch.ops.cpu_opt.index_add(grad_out.contiguous(), index, ctx.n_src), None


ops.gather_op.register_autograd(_gather_backward, setup_context=_gather_setup)


# ---------------------------------------------------------------------------- attention
# Inputs of each op: (rowptr, col, colptr, row_t, perm_t, <node tensors...>, mask, scalar); outputs
# (out, alpha). alpha is not differentiable; the mask (dropout multipliers) is a constant.

_GRAPH_INPUTS = 5


def _attention_setup(n_nodes: int):
    def setup(ctx, inputs, output):
        ctx.set_materialize_grads(False)  # alpha gets no gradient
        ctx.scalar = inputs[_GRAPH_INPUTS + n_nodes + 1]
        ctx.save_for_backward(*inputs[:_GRAPH_INPUTS + n_nodes + 1], output[1])
    return setup


def _attention_backward(backward_op, n_nodes: int):
    def backward(ctx, grad_out, _grad_alpha):
        n_in = _GRAPH_INPUTS + n_nodes + 2
        if grad_out is None:
            return (None,) * n_in
        saved = ctx.saved_tensors
        graph, nodes, mask, alpha = (saved[:_GRAPH_INPUTS], saved[_GRAPH_INPUTS:_GRAPH_INPUTS + n_nodes],
                                     saved[_GRAPH_INPUTS + n_nodes], saved[-1])
        needs = [bool(ctx.needs_input_grad[_GRAPH_INPUTS + i]) and nodes[i] is not None for i in range(n_nodes)]
        grads = backward_op(*graph, *nodes, mask, ctx.scalar, alpha, grad_out.contiguous(), needs)
        return (None,) * _GRAPH_INPUTS + tuple(g if want else None for g, want in zip(grads, needs)) + (None, None)
    return backward


ops.gat_attention_op.register_autograd(
    _attention_backward(lambda *a: torch.ops.cpu_opt.gat_attention_backward(*a), 4), setup_context=_attention_setup(4))
ops.gatv2_attention_op.register_autograd(
    _attention_backward(lambda *a: torch.ops.cpu_opt.gatv2_attention_backward(*a), 3),
    setup_context=_attention_setup(3))
ops.transformer_attention_op.register_autograd(
    _attention_backward(lambda *a: torch.ops.cpu_opt.transformer_attention_backward(*a), 3),
    setup_context=_attention_setup(3))
