"""PyTorch Geometric on cpu_opt's kernels.

``optimize(model)`` wraps a PyG model so that, while it runs:

* ``edge_index`` (2 x E) is converted once to a CSR ``adj_t`` (targets x sources) and cached per
  graph; the CSC transpose that backward needs is built on first use and kept with it. PyG then
  takes the fused ``message_and_aggregate`` path of GCNConv, SAGEConv, GINConv and GraphConv,
  whose ``spmm`` runs on :func:`cpu_opt.gnn.spmm`;
* aggregation through ``scatter`` (sum / mean / max / min / mul; convs without a fused path, and
  any PyG code in the patched modules) runs on :func:`cpu_opt.gnn.scatter`;
* GCN normalisation of a cached ``adj_t`` is computed once (by PyG's own ``gcn_norm``) and kept;
* a SAGEConv with sum/mean aggregation, or a GINConv whose ``nn`` starts with a Linear layer,
  that maps to fewer channels than it takes applies that linear map *before* aggregating
  (``lin(aggr(x)) == aggr(x W^T) + b`` for sum and mean; DGL's SAGEConv does the same), so the
  sparse work runs on the narrower features. Results equal PyG's within float rounding;
* GATConv, GATv2Conv and TransformerConv compute their projections in torch and their attention
  (per-edge scores, softmax over each target's incoming edges, attention dropout, weighted sum over
  heads) in one native kernel, forward and backward, without an E x H x C message tensor
  (:func:`attention_layers`); self-loops and dropout exactly as PyG's layer (the dropout mask is
  drawn by torch in PyG's edge order);
* the aggregation of a tensor passed to the model that needs no gradient (the node features into
  the first layer: the same every epoch of full-batch training) is kept across calls on the same
  graph and checked by content on each call (:class:`_AggregationCache`);
* the model's Linear layers (torch's and PyG's) on node features run on cpu_opt's tall-skinny
  GEMM (``native/kernels/tsgemm.c``: forward, input gradient, weight and bias gradients in one
  pass) where the routing table sends ``gnn_linear`` work there (AVX2 and AVX-512), else on torch's own oneDNN 3.12
  (``mkldnn._linear_pointwise``, forward and input gradient) where the routing table sends fp32
  linear layers there: :func:`linear`. On the tall-skinny route a ``Linear -> ReLU -> Linear`` run inside an
  ``nn.Sequential`` (a GINConv's ``nn``) is one :class:`_NativeMLP`: the ReLU in the first GEMM's
  epilogue, its gradient in the epilogue of the second layer's input-gradient GEMM
  (:func:`mlp_layers`).

PyG binds ``scatter``, ``spmm`` and ``gcn_norm`` by name into many modules, so patching
``torch_geometric.utils`` alone would change nothing: :func:`patched` swaps every bound name (in
every loaded ``torch_geometric.*`` module) for the duration of a call and restores the originals
afterwards. Nothing of torch's own operators is overridden. Anything the kernels do not cover
(another device or dtype, a broadcast index, an unsupported reduce) falls back to PyG's
original function, and ``report()`` counts what went where.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import math
import sys
import threading
import weakref
from collections import Counter, OrderedDict

import torch
from torch.autograd import forward_ad

from cpu_opt import native
from cpu_opt.backends import native_linear
from cpu_opt.platform import hw

from . import _kernels as K
from . import ops
from .graph import CSRGraph, outside_inference_mode, torch_csr_registry

_counts: Counter = Counter()
_lock = threading.RLock()
_depth = 0
_saved: list = []
# True inside a patched() block of this thread (or task): the replacements, installed process-wide
# while any thread is inside one, hand everyone else PyG's own function.
_active: contextvars.ContextVar = contextvars.ContextVar("cpu_opt_gnn_patched", default=False)


def _originals():
    import torch_geometric.nn.conv.gcn_conv as gcn_conv
    import torch_geometric.utils as U

    return {"scatter": U.scatter, "spmm": U.spmm, "gcn_norm": gcn_conv.gcn_norm}


# ----------------------------------------------------------------------------- replacements

def _cpu_float(t):
    return isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.dtype in K.FEATURE_DTYPES


def _make_spmm(orig):
    def spmm(src, other, reduce: str = "sum"):
        if not _active.get():
            return orig(src, other, reduce)
        r = "sum" if reduce == "add" else reduce
        if (isinstance(src, torch.Tensor) and src.layout == torch.sparse_csr and _cpu_float(other)
                and other.dim() == 2 and r in ("sum", "mean", "max", "min") and src.device.type == "cpu"):
            _counts["spmm:cpu_opt"] += 1
            return ops.spmm(src, other, r)
        _counts["spmm:pyg (unsupported input)"] += 1
        return orig(src, other, reduce)

    spmm.__wrapped__ = orig
    return spmm


def _make_scatter(orig):
    def scatter(src, index, dim: int = 0, dim_size=None, reduce: str = "sum"):
        if not _active.get():
            return orig(src, index, dim, dim_size, reduce)
        ok = (_cpu_float(src) and isinstance(index, torch.Tensor) and index.dim() == 1
              and index.dtype in K.INDEX_DTYPES and reduce in ("sum", "add", "mean", "max", "min", "mul")
              and src.dim() > 0 and -src.dim() <= dim < src.dim() and index.numel() == src.shape[dim])
        if ok:
            _counts["scatter:cpu_opt"] += 1
            return ops.scatter(src, index, dim, dim_size, reduce)
        _counts["scatter:pyg (unsupported input)"] += 1
        return orig(src, index, dim, dim_size, reduce)

    scatter.__wrapped__ = orig
    return scatter


class _GCNNormCache:
    """gcn_norm of a registered (unit-weight) adj_t, computed once per (graph, options)."""

    def __init__(self):
        self._d: dict = {}

    def get(self, orig, adj, args):
        key = (id(adj),) + args
        hit = self._d.get(key)
        if hit is not None and hit[0]() is adj:
            _counts["gcn_norm:cached"] += 1
            return hit[1]
        num_nodes, improved, add_self_loops, flow, dtype = args
        ei = torch_csr_registry.source_edge_index(adj)
        with outside_inference_mode(), torch.no_grad():
            if ei is not None:
                # PyG's edge_index path (add_remaining_self_loops), so results equal PyG's default
                ei2, w2 = orig(ei, None, num_nodes, improved, add_self_loops, "source_to_target", dtype)
                g = CSRGraph.from_edge_index(ei2, num_nodes if num_nodes is not None else adj.shape[0], w2,
                                             index_dtype=torch_csr_registry.lookup(adj)[0].col.dtype)
                norm = g.to_torch()
            else:
                norm, _ = orig(adj, None, num_nodes, improved, add_self_loops, flow, dtype)
                norm = norm.to_sparse_csr() if norm.layout != torch.sparse_csr else norm
                g = CSRGraph.from_torch(norm)
        torch_csr_registry.register(norm, g.with_weight(None), unit_weight=False)
        self._d[key] = (weakref.ref(adj, lambda _r, k=key: self._d.pop(k, None)), (norm, None))
        _counts["gcn_norm:computed once"] += 1
        return norm, None


_gcn_cache = _GCNNormCache()


def _make_gcn_norm(orig):
    def gcn_norm(edge_index, edge_weight=None, num_nodes=None, improved=False, add_self_loops=True,
                 flow="source_to_target", dtype=None):
        if _active.get() and (isinstance(edge_index, torch.Tensor) and edge_index.layout == torch.sparse_csr and edge_weight is None):
            hit = torch_csr_registry.lookup(edge_index)
            if hit is not None and hit[1]:  # ones made by cpu_opt: the normalisation is fixed
                return _gcn_cache.get(orig, edge_index, (num_nodes, improved, add_self_loops, flow, dtype))
        _counts["gcn_norm:pyg"] += 1
        return orig(edge_index, edge_weight, num_nodes, improved, add_self_loops, flow, dtype)

    gcn_norm.__wrapped__ = orig
    return gcn_norm


_MAKERS = {"scatter": _make_scatter, "spmm": _make_spmm, "gcn_norm": _make_gcn_norm}


_sites_cache: dict = {}


def _sites(originals):
    """(module, name) pairs in loaded torch_geometric modules bound to an original function.
    Rescanned only when the set of loaded modules changed (scanning costs milliseconds)."""
    key = (len(sys.modules), tuple(id(f) for f in originals.values()))
    hit = _sites_cache.get("sites")
    if hit is not None and hit[0] == key:
        return hit[1]
    out = []
    for modname, mod in list(sys.modules.items()):
        if mod is None or not modname.startswith("torch_geometric"):
            continue
        d = getattr(mod, "__dict__", {})
        for name, fn in originals.items():
            if d.get(name) is fn:
                out.append((mod, name))
    _sites_cache["sites"] = (key, out)
    return out


def _replacements(originals):
    """The cpu_opt version of each original, made once per set of originals."""
    key = tuple(id(f) for f in originals.values())
    hit = _sites_cache.get("replacements")
    if hit is None or hit[0] != key:
        hit = (key, {n: _MAKERS[n](f) for n, f in originals.items()})
        _sites_cache["replacements"] = hit
    return hit[1]


@contextlib.contextmanager
def patched():
    """Within this block, PyG's ``scatter``, ``spmm`` and ``gcn_norm`` (every bound copy) run on
    cpu_opt's kernels, in this thread (or asyncio task) only: the replacements are installed in
    PyG's modules while any thread is inside a block, and hand PyG's own function to callers
    outside one, so another thread running PyG meanwhile sees PyG unchanged. Re-entrant; the
    originals are restored when the last block exits."""
    global _depth
    with _lock:
        if _depth == 0:
            originals = _originals()
            repl = _replacements(originals)
            _saved.clear()
            for mod, name in _sites(originals):
                _saved.append((mod, name, mod.__dict__[name]))
                setattr(mod, name, repl[name])
        _depth += 1
    token = _active.set(True)
    try:
        yield
    finally:
        _active.reset(token)
        with _lock:
            _depth -= 1
            if _depth == 0:
                for mod, name, fn in _saved:
                    setattr(mod, name, fn)
                _saved.clear()


# ----------------------------------------------------------------------------- linear layers

class _OneDNNLinear(torch.autograd.Function):
    """``F.linear`` on torch's own oneDNN (``mkldnn._linear_pointwise``): forward and the input
    gradient (``g @ W``, a linear with ``W^T``); the weight gradient ``g^T x`` stays on ``mm``."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        g = g.contiguous()
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            if torch.is_grad_enabled():  # create_graph=True: differentiable ops (oneDNN's has no derivative)
                gx = g.mm(weight)
            else:
                gx = torch.ops.mkldnn._linear_pointwise(g, weight.t().contiguous(), None, "none", [], "")
        if ctx.needs_input_grad[1]:
            gw = g.t().mm(x)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = g.sum(0)
        return gx, gw, gb


class _NativeLinear(torch.autograd.Function):
    """``F.linear`` on cpu_opt's tall-skinny GEMM (``native/kernels/tsgemm.c``): node-feature
    layers, 10^4+ rows by a few dozen features. The weight and bias gradients run in one pass over
    ``g`` and ``x``; the forward and the input gradient where their inner dimension is at most
    :func:`native_linear_max_k` (wider ones are compute-bound, where torch's oneDNN wins)."""

    @staticmethod
    def forward(ctx, x, weight, bias, relu=False):
        w = weight.contiguous()
        ctx.has_bias, ctx.relu = bias is not None, relu
        if w.shape[1] <= native_linear_max_k():
            out = native_linear.ts_linear(x, w, None if bias is None else bias.contiguous(), relu=relu)
        else:
            out = _torch_linear(x, w, bias)
            if relu:
                out.relu_()  # our own output, not yet seen by anyone
        ctx.save_for_backward(x, w, out if relu else None)
        return out

    @staticmethod
    def backward(ctx, g):
        x, w, out = ctx.saved_tensors
        g = g.contiguous()
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        need_b = need_b and ctx.has_bias
        if torch.is_grad_enabled():  # create_graph=True: differentiable ops
            if ctx.relu:
                g = torch.ops.aten.threshold_backward(g, out, 0)
            return (g.mm(w) if need_x else None, g.t().mm(x) if need_w else None, g.sum(0) if need_b else None, None)
        keep = None
        if ctx.relu and need_x:  # the masked gradient feeds two GEMMs: written once
            g = _relu_grad(g, out)
        elif ctx.relu:  # the weight gradient masks g as it reads it
            keep = out
        gx = gw = gb = None
        if need_x:
            gx = native_linear.ts_matmul(g, w) if w.shape[0] <= native_linear_max_k() else \
                _torch_linear(g, w.t().contiguous(), None)
        if need_w:
            gw, gb = native_linear.ts_weight_grad(g, x, bias=need_b, keep=keep)
        elif need_b:
            gb = (g if keep is None else _relu_grad(g, keep)).sum(0)
        return gx, gw, gb, None


def _relu_grad(g: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``g`` through a ReLU whose output was ``out`` (torch's ``threshold_backward``), into a
    buffer of huge pages (no page fault per 4 KiB of a 100k-row gradient)."""
    return torch.ops.aten.threshold_backward.grad_input(g, out, 0, grad_input=native.empty(*g.shape))


def _torch_linear(x, w, b):
    if torch.backends.mkldnn.is_available():
        return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
    return torch.nn.functional.linear(x, w, b)


# The forward and input-gradient GEMMs of _NativeLinear take inner dimensions up to
# native_linear_max_k(); above it torch's oneDNN is faster or unmeasured.
# AVX-512 (the zmm tiles), measured to K = 64 (routing's gnn_linear rule): NATIVE_LINEAR_MAX_K.
# AVX2, AMD EPYC Zen 3, 100k rows, ms, cpu_opt / torch's oneDNN / addmm, 1 | 2 threads (December 7,
# after the tile's accumulators stopped spilling to the stack): K x N 128x64 21.7 / 23.3 / 27.1 |
# 10.7 / 13.1 / 16.8; 128x128 42.3 / 47.9 / 54.2 | 22.7 / 41.2 / 41.3; 256x64 45.4 / 45.5 / 57.4 |
# 24.9 / 25.5 / 35.5 (level: so 128). Before that fix 128x64 was 20-21 / 17.5-20 at 2 threads.
# Weight gradients (g^T x over the 100k rows; cpu_opt / mm): 64x64 10.5-12.8 / 14.5-17.2; 8x64
# 3.2-5.5 / 6.6-8.2; 64x8 4.2-6.1 / 38-52; 128x64 19-24 / 24-30.
NATIVE_LINEAR_MAX_K = 64
NATIVE_LINEAR_MAX_K_AVX2 = 128


@functools.lru_cache(maxsize=None)
def native_linear_max_k() -> int:
    """The widest inner dimension the tall-skinny GEMM takes in :class:`_NativeLinear` (and the fused
    MLP and linear-sum paths) on this CPU's kernel variant."""
    return NATIVE_LINEAR_MAX_K_AVX2 if native.select_variant() == "avx2" else NATIVE_LINEAR_MAX_K


@functools.lru_cache(maxsize=None)
def _native_linear_route() -> bool:
    """Whether node-feature linear layers run on cpu_opt's tall-skinny GEMM here: a vectorized
    build where the routing table sends ``gnn_linear`` work there (AVX2: measured on Zen 3; AVX-512,
    whose zmm tiles beat torch's addmm and oneDNN on Emerald Rapids, and the AVX2 tiles beat MKL on
    Zen 4)."""
    from ..platform import routing

    return native.vectorized() and routing.route("gnn_linear", "fp32").backend == "tall_skinny"


@functools.lru_cache(maxsize=None)
def _onednn_linear_route() -> bool:
    """Whether fp32 linear layers go to torch's oneDNN on this machine (decided once: the routing
    table needs hw.detect())."""
    from ..platform import routing

    return torch.backends.mkldnn.is_available() and \
        routing.route("linear", "fp32", rows=ONEDNN_LINEAR_MIN_ROWS).backend == "torch_onednn"


# Node-feature GEMMs below this many rows stay on F.linear: each mkldnn._linear_pointwise call
# costs 30-70 us more than addmm (no prepacked weights), which only large GEMMs earn back.
# Measured on the AMD EPYC Zen 3 (AVX2), November 2026 (medians, F.linear time / oneDNN time, K x N
# in 64x64, 34x16, 16x4): 1 thread 4096 rows 0.83-1.12, 16384 rows 1.09-1.74; 2 threads 4096 rows
# 0.78-1.05, 16384 rows 0.92-1.42.
ONEDNN_LINEAR_MIN_ROWS = 16384


def linear(x, weight, bias=None, *, relu: bool = False):
    """``torch.nn.functional.linear``; on cpu_opt's tall-skinny GEMM (:class:`_NativeLinear`) where
    ``routing.route("gnn_linear", "fp32")`` says ``tall_skinny``, else on torch's oneDNN 3.12 where
    the routing table sends fp32 linear layers there (``routing.route("linear", "fp32")``, AVX2 machines), for 2-D float32
    inputs of at least ``ONEDNN_LINEAR_MIN_ROWS`` rows. Measured here (100k rows, K=64,
    N=8..128, ``torch.addmm`` against ``mkldnn._linear_pointwise``, medians): 1.1-1.9x at 1 thread,
    0.99-1.8x at 2; the input-gradient GEMMs (K=8..32, N=64) 1.3-1.8x. ``relu``: ``torch.relu`` of
    the result, in the tall-skinny GEMM's epilogue (and its gradient in the weight gradient's pass)
    where that is the route."""
    if (_linear_on.get() and x.dim() == 2 and x.dtype == torch.float32 and weight.dtype == torch.float32
            and x.device.type == "cpu" and x.shape[0] >= ONEDNN_LINEAR_MIN_ROWS
            and not isinstance(weight, torch.nn.parameter.UninitializedParameter)
            and (bias is None or bias.dtype == torch.float32) and not torch.compiler.is_compiling()
            and (_native_linear_route() or _onednn_linear_route())):
        if _native_linear_route() and native_linear.ts_fits(*weight.shape):
            _counts["linear: cpu_opt tall-skinny GEMM"] += 1
            if relu:
                _counts["ReLU after a layer: in the tall-skinny GEMM's epilogue"] += 1
            return _NativeLinear.apply(x.contiguous(), weight, bias, relu)
        if _onednn_linear_route():
            _counts["linear: torch's oneDNN"] += 1
            out = _OneDNNLinear.apply(x.contiguous(), weight, bias)
            return torch.relu(out) if relu else out
    out = torch.nn.functional.linear(x, weight, bias)
    return torch.relu(out) if relu else out


# the running OptimizedGNN's onednn_linear option (also for the linear-first forwards' own linears)
_linear_on: contextvars.ContextVar = contextvars.ContextVar("cpu_opt_gnn_onednn_linear", default=True)


def _linear_forward(self, x):
    """forward of torch.nn.Linear and PyG's Linear (both ``F.linear(x, weight, bias)``)."""
    return linear(x, self.weight, self.bias)


def linear_layers(model: torch.nn.Module) -> dict:
    """``{module: forward}`` for the Linear layers of ``model`` (torch's and PyG's)."""
    from torch_geometric.nn.dense.linear import Linear as PygLinear

    if not (_native_linear_route() or _onednn_linear_route()):
        return {}
    return {m: _linear_forward for m in model.modules()
            if type(m) in (torch.nn.Linear, PygLinear) and "forward" not in m.__dict__}


class _NativeLinearSum(torch.autograd.Function):
    """``F.linear(a1, w1, b1) + F.linear(a2, w2, b2)`` on the tall-skinny GEMM, both products summed
    in registers and the output written once (no second 100k-row tensor, no separate add); in
    backward one column sum of ``g`` serves both biases. SAGEConv's ``lin_l(aggr) + lin_r(x)``."""

    @staticmethod
    def forward(ctx, a1, w1, b1, a2, w2, b2, relu=False):
        w1, w2 = w1.contiguous(), w2.contiguous()
        ctx.biases, ctx.relu = (b1 is not None, b2 is not None), relu
        bias = b1 if b2 is None else (b2 if b1 is None else b1 + b2)
        out = native_linear.ts_linear_sum(a1, w1, a2, w2, None if bias is None else bias.contiguous(), relu=relu)
        ctx.save_for_backward(a1, w1, a2, w2, out if relu else None)
        return out

    @staticmethod
    def backward(ctx, g):
        a1, w1, a2, w2, out = ctx.saved_tensors
        return (*_linear_sum_grads(g, a1, w1, a2, w2, out, ctx.relu, ctx.biases, ctx.needs_input_grad)[1:], None)


def _linear_sum_grads(g, a1, w1, a2, w2, out, relu: bool, biases, n):
    """The gradients of ``[relu](a1 w1^T + b1 + a2 w2^T + b2)`` for :class:`_NativeLinearSum` and
    :class:`_NativeMaxSage`: ``(g through the ReLU, ga1, gw1, gb1, ga2, gw2, gb2)``, each None where
    ``n`` (needs_input_grad of a1, w1, b1, a2, w2, b2) does not ask for it; ``biases`` says which
    bias exists. With create_graph (grad mode on) differentiable torch ops; else the tall-skinny
    kernels, both weight gradients in one pass over ``g``."""
    g = g.contiguous()
    need_b = (n[2] and biases[0]) or (n[5] and biases[1])
    if torch.is_grad_enabled():  # create_graph=True: differentiable ops
        if relu:
            g = torch.ops.aten.threshold_backward(g, out, 0)
        gb = g.sum(0) if need_b else None
        return (g, g.mm(w1) if n[0] else None, g.t().mm(a1) if n[1] else None, gb if n[2] else None,
                g.mm(w2) if n[3] else None, g.t().mm(a2) if n[4] else None, gb if n[5] else None)
    keep = None
    if relu and (n[0] or n[3]):  # the masked gradient feeds the input-gradient GEMMs: written once
        g = _relu_grad(g, out)
    elif relu:  # only weight gradients: each masks g as it reads it
        keep = out
    ga1 = native_linear.ts_matmul(g, w1) if n[0] else None
    ga2 = native_linear.ts_matmul(g, w2) if n[3] else None
    gw1 = gw2 = gb = None
    if n[1] and n[4]:  # both weight gradients in one pass over g
        gw1, gw2, gb = native_linear.ts_weight_grad2(g, a1, a2, bias=need_b, keep=keep)
    elif n[1]:
        gw1, gb = native_linear.ts_weight_grad(g, a1, bias=need_b, keep=keep)
    elif n[4]:
        gw2, gb = native_linear.ts_weight_grad(g, a2, bias=need_b, keep=keep)
    if need_b and gb is None:
        gb = (g if keep is None else _relu_grad(g, keep)).sum(0)
    return (g, ga1, gw1, gb if n[2] and biases[0] else None, ga2, gw2, gb if n[5] and biases[1] else None)


class _NativeMaxSage(torch.autograd.Function):
    """A max-aggregating SAGEConv with its root weight, ``[relu](lin_l(max_{j->i} x_j) + lin_r(x_r))``,
    as one Function. Forward: the max spmm (winners as a bit mask) and :class:`_NativeLinearSum`'s
    GEMM. Backward: the gradient of ``x`` through the aggregation is ``mask_gather_proj`` of the
    (narrow) output gradient and ``W_l``: each edge forms the row of ``g W_l`` it needs where it won a
    feature, so the n x F product is never written nor gathered at random (the power-law graph of
    ``python -m bench gnn``, F = 64 -> 8, Zen 4, 2 threads: 7.0 ms against 14-18 for the product and
    ``mask_gather``); it is added into ``g W_r`` when the root reads the same ``x`` (no separate sum
    of the two gradients). ``x_r`` None: the root term reads ``x``."""

    @staticmethod
    def forward(ctx, x, x_r, w1, b1, w2, b2, rowptr, col, colptr, row_t, perm_t, relu):
        w1, w2, x = w1.contiguous(), w2.contiguous(), x.contiguous()   # the kernels read dense rows
        a2 = x if x_r is None else x_r.contiguous()
        aggr, wmask = K.segment_reduce(rowptr, col, None, x, "amax", mask=True)
        ctx.biases, ctx.relu, ctx.same, ctx.n_x = (b1 is not None, b2 is not None), relu, x_r is None, x.shape[0]
        bias = b1 if b2 is None else (b2 if b1 is None else b1 + b2)
        out = native_linear.ts_linear_sum(aggr, w1, a2, w2, None if bias is None else bias.contiguous(), relu=relu)
        ctx.save_for_backward(aggr, w1, a2, w2, out if relu else None, wmask, colptr, row_t, perm_t)
        return out

    @staticmethod
    def backward(ctx, g):
        aggr, w1, a2, w2, out, wmask, colptr, row_t, perm_t = ctx.saved_tensors
        n = ctx.needs_input_grad
        need_x, need_xr = n[0], (n[0] if ctx.same else n[1])
        # lin_l's input gradient is not formed here: mask_gather_proj takes its place
        g, _, gw1, gb1, gxr, gw2, gb2 = _linear_sum_grads(g, aggr, w1, a2, w2, out, ctx.relu, ctx.biases,
                                                          (False, n[2], n[3], need_xr, n[4], n[5]))
        gx = None
        if need_x:
            if torch.is_grad_enabled():  # create_graph: the custom op (differentiating it raises, as spmm's does)
                ga = torch.ops.cpu_opt.mask_gather(colptr, row_t, perm_t, wmask, g.mm(w1), None, ctx.n_x)
                gx = ga + gxr if ctx.same else ga
            else:
                gx = K.mask_gather_proj(colptr, row_t, perm_t, wmask, g, w1, ctx.n_x,
                                        out=gxr if ctx.same else None)
        if ctx.same:
            return gx, None, gw1, gb1, gw2, gb2, None, None, None, None, None, None
        return gx, gxr, gw1, gb1, gw2, gb2, None, None, None, None, None, None


class _NativeMLP(torch.autograd.Function):
    """``Linear -> ReLU -> Linear`` (a GINConv's ``nn``) on the tall-skinny GEMM with the ReLU in the
    epilogues: forward, the first GEMM writes ``relu(x W1^T + b1)`` (no pass of torch's ReLU over the
    hidden features, no second hidden tensor); backward, the second layer's input gradient ``g W2``
    is written already masked by the hidden features (torch's ``threshold_backward``, in the same
    pass). The same numbers as the three modules, to float rounding of the GEMMs."""

    @staticmethod
    def forward(ctx, x, w1, b1, w2, b2, relu=False):
        w1, w2 = w1.contiguous(), w2.contiguous()
        h = native_linear.ts_linear(x, w1, None if b1 is None else b1.contiguous(), relu=True)
        ctx.biases, ctx.relu = (b1 is not None, b2 is not None), relu
        out = native_linear.ts_linear(h, w2, None if b2 is None else b2.contiguous(), relu=relu)
        ctx.save_for_backward(x, w1, b1, h, w2, out if relu else None)
        return out

    @staticmethod
    def backward(ctx, g):
        x, w1, b1, h, w2, out = ctx.saved_tensors
        g = g.contiguous()
        nx, nw1, nb1, nw2, nb2 = ctx.needs_input_grad[:5]
        nb1, nb2 = nb1 and ctx.biases[0], nb2 and ctx.biases[1]
        if ctx.relu:  # a ReLU after the second layer (relu=True): g through it first
            g = torch.ops.aten.threshold_backward(g, out, 0) if torch.is_grad_enabled() else _relu_grad(g, out)
        if torch.is_grad_enabled():  # create_graph=True: differentiable ops, the hidden features recomputed
            h = torch.relu(torch.nn.functional.linear(x, w1, b1))
            gh = torch.ops.aten.threshold_backward(g.mm(w2), h, 0)
            return (gh.mm(w1) if nx else None, gh.t().mm(x) if nw1 else None, gh.sum(0) if nb1 else None,
                    g.t().mm(h) if nw2 else None, g.sum(0) if nb2 else None, None)
        gw2 = gb2 = gx = gw1 = gb1 = None
        if nw2:
            gw2, gb2 = native_linear.ts_weight_grad(g, h, bias=nb2)
        elif nb2:
            gb2 = g.sum(0)
        if nx or nw1 or nb1:
            gh = native_linear.ts_matmul(g, w2, keep=h)
            if nx:
                gx = native_linear.ts_matmul(gh, w1)
            if nw1:
                gw1, gb1 = native_linear.ts_weight_grad(gh, x, bias=nb1)
            elif nb1:
                gb1 = gh.sum(0)
        return gx, gw1, gb1, gw2, gb2, None


def _plain(m) -> bool:
    """A module without hooks of its own or global ones (whose call is its forward)."""
    from torch.nn.modules import module as M

    return not (m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks
                or M._global_forward_hooks or M._global_forward_pre_hooks or M._global_backward_hooks
                or M._global_backward_pre_hooks)


def _mlp_fits(x, lin1, act, lin2) -> bool:
    """Whether ``lin2(act(lin1(x)))`` can run as one :class:`_NativeMLP`."""
    return (type(lin1) is torch.nn.Linear and type(act) is torch.nn.ReLU and type(lin2) is torch.nn.Linear
            and all(_plain(m) for m in (lin1, act, lin2)) and _native_linear_route() and _linear_on.get()
            and not torch.compiler.is_compiling() and isinstance(x, torch.Tensor) and x.dim() == 2
            and x.dtype == torch.float32 and x.device.type == "cpu" and x.shape[0] >= ONEDNN_LINEAR_MIN_ROWS
            and all(_initialized(m.weight) and m.weight.dtype == torch.float32 and m.weight.device.type == "cpu"
                    and (m.bias is None or m.bias.dtype == torch.float32) for m in (lin1, lin2))
            and lin1.in_features == x.shape[1] and lin2.in_features == lin1.out_features
            and max(lin1.in_features, lin1.out_features, lin2.out_features) <= native_linear_max_k())


def _mlp_forward(self, x, relu: bool = False):
    """``nn.Sequential.forward`` with each ``Linear -> ReLU -> Linear`` run of its children as one
    :class:`_NativeMLP` where it fits; the other children as they are. ``relu``: ``torch.relu`` of
    the result, in the last GEMM's epilogue where the run is last."""
    mods = list(self)
    i = 0
    while i < len(mods):
        if i + 2 < len(mods) and _mlp_fits(x, *mods[i:i + 3]):
            _counts["linear: cpu_opt tall-skinny GEMM (Linear -> ReLU -> Linear, the ReLU in the epilogues)"] += 1
            last = relu and i + 3 == len(mods)
            x = _NativeMLP.apply(x.contiguous(), mods[i].weight, mods[i].bias, mods[i + 2].weight, mods[i + 2].bias,
                                 last)
            relu = relu and not last
            i += 3
        else:
            x = mods[i](x)
            i += 1
    return torch.relu(x) if relu else x


def mlp_layers(model: torch.nn.Module) -> dict:
    """``{module: forward}`` for the ``nn.Sequential`` containers of ``model`` holding a ``Linear ->
    ReLU -> Linear`` run (a GINConv's ``nn``), where the tall-skinny GEMM is the route."""
    if not _native_linear_route():
        return {}
    out = {}
    for m in model.modules():
        kids = list(m) if type(m) is torch.nn.Sequential else []
        if "forward" not in m.__dict__ and _plain(m) and any(
                type(a) is torch.nn.Linear and type(b) is torch.nn.ReLU and type(c) is torch.nn.Linear
                for a, b, c in zip(kids, kids[1:], kids[2:])):
            out[m] = _mlp_forward
    return out


class _TorchLinearSum(torch.autograd.Function):
    """:class:`_NativeLinearSum` on torch's GEMMs, where the tall-skinny kernels are not the route
    (a CPU without AVX2, or a layer wider than the kernel takes):
    the second product accumulates into the first's output (``addmm_``, beta = 1: no separate
    add pass over a 100k-row tensor, no second output), one column sum of ``g`` for both biases."""

    @staticmethod
    def forward(ctx, a1, w1, b1, a2, w2, b2, relu=False):
        ctx.biases, ctx.relu = (b1 is not None, b2 is not None), relu
        bias = b1 if b2 is None else (b2 if b1 is None else b1 + b2)
        out = a2.mm(w2.t()) if bias is None else torch.addmm(bias, a2, w2.t())
        out.addmm_(a1, w1.t())
        if relu:
            out.relu_()  # our own output, not yet seen by anyone
        ctx.save_for_backward(a1, w1, a2, w2, out if relu else None)
        return out

    @staticmethod
    def backward(ctx, g):
        a1, w1, a2, w2, out = ctx.saved_tensors
        if ctx.relu:
            g = torch.ops.aten.threshold_backward(g, out, 0)
        n = ctx.needs_input_grad
        need_b = (n[2] and ctx.biases[0]) or (n[5] and ctx.biases[1])
        gb = g.sum(0) if need_b else None
        return (g.mm(w1) if n[0] else None, g.t().mm(a1) if n[1] else None, gb if n[2] and ctx.biases[0] else None,
                g.mm(w2) if n[3] else None, g.t().mm(a2) if n[4] else None, gb if n[5] and ctx.biases[1] else None,
                None)


def _sum_fits(a1, w1, a2, w2) -> bool:
    """Whether ``F.linear(a1, w1, b1) + F.linear(a2, w2, b2)`` can run as one output (2-D float32
    CPU tensors of matching shapes, at least ONEDNN_LINEAR_MIN_ROWS rows, not while compiling)."""
    return (_linear_on.get() and not torch.compiler.is_compiling()
            and all(isinstance(t, torch.Tensor) and t.dim() == 2 and t.dtype == torch.float32 and t.device.type == "cpu"
                    for t in (a1, w1, a2, w2))
            and a1.shape[0] == a2.shape[0] and a1.shape[0] >= ONEDNN_LINEAR_MIN_ROWS
            and w1.shape[0] == w2.shape[0] and w1.shape[1] == a1.shape[1] and w2.shape[1] == a2.shape[1])


def _native_sum_fits(a1, w1, a2, w2) -> bool:
    return (_native_linear_route() and _sum_fits(a1, w1, a2, w2)
            and max(w1.shape[1], w2.shape[1], w1.shape[0]) <= native_linear_max_k())


def _sage_forward_fused_root(self, x, edge_index, size=None):
    """SAGEConv.forward (no ``project``) with ``lin_l(aggr) + lin_r(x_r)`` as one
    :class:`_NativeLinearSum` where it fits, PyG's two linears and their sum otherwise."""
    if isinstance(x, torch.Tensor):
        x = (x, x)
    graph = _max_sage_graph(self, x, edge_index, size)
    if graph is not None:
        _counts[_MAX_SAGE] += 1
        b = [getattr(self.lin_l, "bias", None), getattr(self.lin_r, "bias", None)]
        relu = not self.normalize and _take_relu(self)
        out = _NativeMaxSage.apply(x[0], None if x[1] is x[0] else x[1], self.lin_l.weight, b[0], self.lin_r.weight,
                                   b[1], *graph, relu)
        return torch.nn.functional.normalize(out, p=2.0, dim=-1) if self.normalize else out
    out = self.propagate(edge_index, x=x, size=size)
    x_r = x[1]
    if self.root_weight and x_r is not None and _sum_fits(out, self.lin_l.weight, x_r, self.lin_r.weight):
        b = [getattr(self.lin_l, "bias", None), getattr(self.lin_r, "bias", None)]
        if _native_sum_fits(out, self.lin_l.weight, x_r, self.lin_r.weight):
            _counts["linear: cpu_opt tall-skinny GEMM (lin_l + lin_r in one output)"] += 1
            fn = _NativeLinearSum
        else:
            _counts["linear: torch GEMMs, lin_r accumulated into lin_l's output"] += 1
            fn = _TorchLinearSum
        relu = not self.normalize and _take_relu(self)
        out = fn.apply(out.contiguous(), self.lin_l.weight, b[0], x_r.contiguous(), self.lin_r.weight, b[1], relu)
    else:
        out = self.lin_l(out)
        if self.root_weight and x_r is not None:
            out = out + self.lin_r(x_r)
    if self.normalize:
        out = torch.nn.functional.normalize(out, p=2.0, dim=-1)
    return out


_MAX_SAGE = ("linear: cpu_opt tall-skinny GEMM (lin_l + lin_r in one output), the max aggregation before it in "
             "the same Function (backward: mask_gather_proj, no g @ W_l)")


def _max_sage_fits(F: int, C: int) -> bool:
    """Whether mask_gather_proj's vector rows take F input features to C outputs here: F a multiple of
    16 on the avx512 kernels, of 8 on the avx2 ones, and C < F (each winning edge does C x F
    multiply-adds in place of reading F floats). The power-law graph of ``python -m bench gnn``
    (100k nodes, 1M edges, 64 -> 8), medians of 21, 2 threads, mask_gather_proj against ts_matmul +
    mask_gather: avx512 7.0 vs 9.9-17.9 ms, avx2 10.2 vs 12.9 (both variants on an AMD EPYC Zen 4,
    2026-12-07; the avx2 one not timed on an AVX2-only CPU)."""
    v = K.variant()
    return C < F and ((v == "avx512" and F % 16 == 0) or (v == "avx2" and F % 8 == 0))


def _max_sage_graph(conv, x, edge_index, size):
    """``(rowptr, col, colptr, row_t, perm_t)`` where :class:`_NativeMaxSage` takes this call of a
    max-aggregating SAGEConv (float32 features that need a gradient, the graph a torch CSR ``adj_t``
    without edge weights whose winners are kept as a bit mask, :func:`_max_sage_fits`, no hooks,
    eager), else None: PyG's propagate and :class:`_NativeLinearSum` then."""
    x0, x_r = x
    if (conv.aggr != "max" or not conv.root_weight or x_r is None or not isinstance(edge_index, torch.Tensor)
            or edge_index.layout != torch.sparse_csr or size is not None or torch.compiler.is_compiling()
            or not torch.is_grad_enabled() or not isinstance(x0, torch.Tensor) or not x0.requires_grad
            or conv.explain or conv.decomposed_layers != 1 or any(getattr(conv, h, None) for h in _MP_HOOKS)
            or x0.dtype != torch.float32 or x0.dim() != 2 or x0.device.type != "cpu"
            or not _native_sum_fits(x0, conv.lin_l.weight, x_r, conv.lin_r.weight)):
        return None
    if not _max_sage_fits(x0.shape[1], conv.lin_l.weight.shape[0]):
        return None
    g, w = ops._graph_and_weight(edge_index, None)
    if (w is not None or x0.shape[0] != g.n_cols or x_r.shape[0] != g.n_rows
            or not K.use_winner_mask(g.nnz, g.n_rows, x0.shape[1])):
        return None
    return (g.rowptr, g.col, *g.csc())


def _fused_root_what() -> str:
    return ("lin_l(aggr) + lin_r(x) as one tall-skinny GEMM output" if _native_linear_route() else
            "lin_l(aggr) + lin_r(x) as one output (torch GEMMs, the second accumulated into the first)")


def fused_root_layers(model: torch.nn.Module, linear_first: dict) -> dict:
    """``{module: forward}`` for the SAGEConv layers (not applying their linear map first, no
    ``project``) whose ``lin_l(aggr) + lin_r(x)`` can run as one output: :class:`_NativeLinearSum`
    on the tall-skinny route, :class:`_TorchLinearSum` elsewhere."""
    from torch_geometric.nn import SAGEConv

    return {m: _sage_forward_fused_root for m in model.modules()
            if type(m) is SAGEConv and m not in linear_first and not m.project and m.root_weight
            and "forward" not in m.__dict__}


# ----------------------------------------------------------------------------- linear before aggregation

def _sage_forward_linear_first(self, x, edge_index, size=None):
    """SAGEConv.forward (sum/mean, no ``project``) with lin_l applied before propagate. When the
    root term reads the same ``x``, both maps are one GEMM ``x [W_l; W_r]^T`` (with the biases on
    the root half): one pass over ``x``, and in backward one input-gradient GEMM instead of two
    and their sum."""
    if isinstance(x, torch.Tensor):
        x = (x, x)
    x_r = x[1]
    root = self.root_weight and x_r is not None
    if root and x_r is x[0] and _initialized(self.lin_r.weight):
        c = self.lin_l.weight.shape[0]
        biases = [b for b in (self.lin_l.bias, self.lin_r.bias) if b is not None]
        bias = None if not biases else torch.cat([biases[0].new_zeros(c), sum(biases[1:], biases[0])])
        y = linear(x_r, torch.cat([self.lin_l.weight, self.lin_r.weight]), bias)
        out = self.propagate(edge_index, x=(y[:, :c], x_r), size=size)
        out = _AddReLU.apply(out, y[:, c:]) if not self.normalize and _take_relu(self) else out + y[:, c:]
    else:
        h = linear(x[0], self.lin_l.weight)
        out = self.propagate(edge_index, x=(h, x_r), size=size)
        if self.lin_l.bias is not None:
            out = out + self.lin_l.bias
        if root:
            out = out + self.lin_r(x_r)
    if self.normalize:
        out = torch.nn.functional.normalize(out, p=2.0, dim=-1)
    return out


def _add_root(self, out, x_r):
    """GINConv's ``out + (1 + eps) * x_r``, as one pass where ``eps`` is not trained."""
    if isinstance(self.eps, torch.Tensor) and self.eps.requires_grad:
        return out + (1 + self.eps) * x_r
    return torch.add(out, x_r, alpha=1 + float(self.eps))


def _gin_forward_linear_first(self, x, edge_index, size=None):
    """GINConv.forward with the first Linear of ``nn`` applied before propagate:
    ``L(aggr(x) + (1 + eps) x_r) == aggr(x W^T) + (1 + eps) x_r W^T + b``."""
    if isinstance(x, torch.Tensor):
        x = (x, x)
    first = self.nn[0]
    h = linear(x[0], first.weight)
    h_r = None if x[1] is None else (h if x[1] is x[0] else linear(x[1], first.weight))
    out = self.propagate(edge_index, x=(h, h_r), size=size)
    if h_r is not None:
        out = _add_root(self, out, h_r)
    if first.bias is not None:
        out = out + first.bias
    rest = list(self.nn)[1:]
    last = rest[-1] if rest and type(rest[-1]) is torch.nn.Linear and _plain(rest[-1]) else None
    for layer in rest[:-1] if last is not None else rest:
        out = layer(out)
    if last is not None:  # a ReLU after the layer goes into the last Linear's GEMM
        out = linear(out, last.weight, last.bias, relu=True) if _take_relu(self) else last(out)
    return out


def _initialized(weight) -> bool:
    return isinstance(weight, torch.Tensor) and not isinstance(weight, torch.nn.parameter.UninitializedParameter)


def _narrowing(weight) -> bool:
    return _initialized(weight) and weight.dim() == 2 and weight.shape[0] < weight.shape[1]


def linear_first_layers(model: torch.nn.Module) -> dict:
    """``{module: forward}`` for the layers of ``model`` that can apply their linear map before
    aggregating and gain from it (fewer output than input channels)."""
    from torch_geometric.nn import GINConv, SAGEConv

    out = {}
    for m in model.modules():
        if (isinstance(m, SAGEConv) and isinstance(m.aggr, str) and m.aggr in ("sum", "add", "mean")
                and not m.project and _narrowing(getattr(m.lin_l, "weight", None))):
            out[m] = _sage_forward_linear_first
        elif (isinstance(m, GINConv) and isinstance(m.aggr, str) and m.aggr in ("sum", "add")
              and isinstance(m.nn, torch.nn.Sequential) and len(m.nn) > 0
              and isinstance(m.nn[0], torch.nn.Linear) and _narrowing(m.nn[0].weight)):
            out[m] = _gin_forward_linear_first
    return out


# ----------------------------------------------------------------------------- attention layers

_ATTENTION_WHY = "fused attention (scores, segment softmax, dropout, aggregation in one kernel)"
# every hook dict of MessagePassing: a layer with any hook registered runs PyG's own forward
_MP_HOOKS = ("_propagate_forward_pre_hooks", "_propagate_forward_hooks", "_message_forward_pre_hooks",
             "_message_forward_hooks", "_aggregate_forward_pre_hooks", "_aggregate_forward_hooks",
             "_message_and_aggregate_forward_pre_hooks", "_message_and_aggregate_forward_hooks",
             "_edge_update_forward_pre_hooks", "_edge_update_forward_hooks")


class _AttentionGraphs:
    """The graphs attention layers run on: PyG's ``edge_index`` (for ``loops=N``: with its self-loops
    removed and loops 0..N-1 added, by PyG's own ``remove_self_loops`` / ``add_self_loops``, as the
    layer does) as a CSR over targets, and ``perm`` (CSR position -> position in PyG's edge order,
    the order PyG draws dropout in). Keyed by the contents of ``edge_index`` (its fingerprint), the
    sizes and the loop count; the CSC for backward is built on first use and kept with the graph."""

    def __init__(self, capacity: int = 8):
        self.capacity = capacity
        self._d: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def get(self, edge_index: torch.Tensor, n_src: int, n_dst: int, loops):
        """(CSRGraph, perm), or None when edge_index does not fit the sizes (PyG then raises its own error)."""
        key = (native.fingerprint(edge_index), tuple(edge_index.shape), edge_index.dtype, n_src, n_dst, loops)
        with self._lock:
            hit = self._d.get(key)
            if hit is not None:
                self._d.move_to_end(key)
                return hit
        with outside_inference_mode():
            built = self._build(edge_index, n_src, n_dst, loops)
        if built is None:
            return None
        with self._lock:
            self._d[key] = built
            while len(self._d) > self.capacity:
                self._d.popitem(last=False)
        return built

    @staticmethod
    def _build(edge_index, n_src, n_dst, loops):
        from torch_geometric.utils import add_self_loops, remove_self_loops

        ei = edge_index.to(torch.int64)
        if ei.numel() and (int(ei[0].min()) < 0 or int(ei[0].max()) >= n_src or int(ei[1].min()) < 0
                           or int(ei[1].max()) >= n_dst):
            return None
        if loops is not None:
            ei, _ = remove_self_loops(ei)
            ei, _ = add_self_loops(ei, num_nodes=loops)
        rowptr, perm = K.index_to_csr(ei[1].contiguous(), n_dst)
        col = ei[0].index_select(0, perm).to(torch.int32 if n_src < 2 ** 31 else torch.int64)
        return CSRGraph(rowptr, col, n_src, validate=False), perm


_attention_graphs = _AttentionGraphs()


def _attention_edge_index(edge_index):
    """PyG's edge_index behind what an attention layer was handed: itself (a plain (2, E) integer
    tensor) or, for an adj_t cpu_opt made (OptimizedGNN converts edge_index), the edge_index it was
    made from; None for anything else (PyG's own forward takes those)."""
    if isinstance(edge_index, torch.Tensor) and edge_index.layout == torch.sparse_csr:
        hit = torch_csr_registry.lookup(edge_index)
        return torch_csr_registry.source_edge_index(edge_index) if hit is not None and hit[1] else None
    if (type(edge_index) is torch.Tensor and edge_index.dim() == 2 and edge_index.shape[0] == 2
            and edge_index.dtype in K.INDEX_DTYPES and edge_index.device.type == "cpu"):
        return edge_index
    return None


def _attention_why_not(conv, x_pair, edge_index, edge_attr_ok: bool, return_attention_weights) -> str | None:
    """Why ``conv`` cannot take the fused path for these inputs (None: it can)."""
    if torch.compiler.is_compiling():
        return "traced by torch.compile"
    if return_attention_weights is not None:
        return "return_attention_weights"
    if not edge_attr_ok:
        return "edge_attr"
    if conv.explain or conv.decomposed_layers != 1 or any(getattr(conv, h, None) for h in _MP_HOOKS):
        return "explain mode, decomposed layers or message-passing hooks"
    if not (isinstance(conv.aggr, str) and conv.aggr in ("add", "sum")) or conv.flow != "source_to_target" \
            or conv.node_dim != 0:
        return "aggr/flow/node_dim other than PyG's default"
    xs, xd = x_pair
    if not (isinstance(xs, torch.Tensor) and isinstance(xd, torch.Tensor)):
        return "x is a pair with a missing side"
    if not all(_cpu_float(t) and t.dim() == 2 and t.dtype == xs.dtype for t in (xs, xd)):
        return "x is not a 2-D CPU float tensor (pair) of one dtype"
    if _attention_edge_index(edge_index) is None:
        return "edge_index is not a (2, E) integer tensor"
    return None


def _attention_fallback(conv, why: str, x, edge_index, *rest):
    """PyG's own forward, given the edge_index it would have had (not the adj_t cpu_opt made)."""
    _counts[f"attention:pyg ({type(conv).__name__}: {why})"] += 1
    ei = _attention_edge_index(edge_index)
    return type(conv).forward(conv, x, ei if ei is not None else edge_index, *rest)


def _attention_setup(conv, edge_index, n_src: int, n_dst: int, loops, heads: int, dtype):
    """(graph, perm, mask in CSR order or None): the graph with PyG's self-loop handling and, when the
    layer drops attention out, the mask drawn exactly as PyG draws it (``F.dropout`` of an E x H
    tensor in PyG's edge order, then put in CSR order). None when edge_index does not fit."""
    built = _attention_graphs.get(_attention_edge_index(edge_index), n_src, n_dst, loops)
    if built is None:
        return None
    g, perm = built
    mask = None
    if conv.training and conv.dropout > 0 and g.nnz > 0:
        mask = K.gather_rows(dropout_multipliers(conv.dropout, (g.nnz, heads), dtype), perm)
    return g, perm, mask


def dropout_multipliers(p: float, shape, dtype) -> torch.Tensor:
    """What ``F.dropout(t, p, training=True)`` multiplies a contiguous ``t`` of this shape and dtype by,
    drawn the same way from torch's generator (torch's CPU dropout: ``empty_like(t).bernoulli_(1 - p)
    .div_(1 - p)``; p = 1 draws nothing and zeroes), so a layer that drops attention out consumes the
    random stream exactly as PyG's ``F.dropout(alpha)`` does (tests/gnn/test_attention.py checks
    this against F.dropout)."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    if p == 1.0:
        return torch.zeros(shape, dtype=dtype)
    if dtype == torch.float32 and _native_bernoulli_ok():
        # the same draws from the same generator, without torch's per-element serial dispatch
        # (20 ns an element here: 2/3 of a GAT train step's dropout cost was this call)
        out = native.empty(shape, dtype=torch.float32)  # huge pages for a large mask
        state = torch.get_rng_state()
        K.bernoulli_mt19937(state, out.numel(), math.ceil((1 - p) * 2.0 ** 53),
                            torch.ones(1).div_(1 - p).item(), out)
        torch.set_rng_state(state)
        return out
    return torch.empty(shape, dtype=dtype).bernoulli_(1 - p).div_(1 - p)


_NATIVE_BERNOULLI: list[bool] = []


def _native_bernoulli_ok() -> bool:
    """Whether native/kernels/random.c reproduces this torch's ``bernoulli_`` (checked once per
    process on 1000 draws at two probabilities, and on the generator state they leave; the check
    consumes no randomness). Otherwise dropout masks come from torch itself."""
    if not _NATIVE_BERNOULLI:
        ok = False
        saved = torch.get_rng_state()
        try:
            for keep in (0.4, 0.9):
                torch.set_rng_state(saved)
                ref = torch.empty(1001).bernoulli_(keep).div_(keep)
                after = torch.get_rng_state()
                state = saved.clone()
                got = K.bernoulli_mt19937(state, 1001, math.ceil(keep * 2.0 ** 53),
                                          torch.ones(1).div_(keep).item(), torch.empty(1001))
                ok = torch.equal(got, ref) and torch.equal(state, after)
                if not ok:
                    break
        except Exception:  # noqa: BLE001 - any failure means: use torch's own draws
            ok = False
        finally:
            torch.set_rng_state(saved)
        _NATIVE_BERNOULLI.append(ok)
    return _NATIVE_BERNOULLI[0]


def _heads_out(conv, out, res=None):
    """PyG's tail of GATConv / GATv2Conv: concat or mean over heads, residual, bias."""
    out = out.reshape(-1, conv.heads * conv.out_channels) if conv.concat else out.mean(dim=1)
    if res is not None:
        out = out + res
    if conv.bias is not None:
        out = out + conv.bias
    return out


def _gat_project(conv, x):
    """GATConv.forward's projections: (x_src, x_dst, res), as PyG computes them."""
    H, C = conv.heads, conv.out_channels
    if isinstance(x, torch.Tensor):
        res = conv.res(x) if conv.res is not None else None
        if conv.lin is not None:
            x_src = x_dst = conv.lin(x).view(-1, H, C)
        else:
            x_src, x_dst = conv.lin_src(x).view(-1, H, C), conv.lin_dst(x).view(-1, H, C)
        return x_src, x_dst, res
    x_src, x_dst = x
    res = conv.res(x_dst) if conv.res is not None else None
    lin_s, lin_d = (conv.lin, conv.lin) if conv.lin is not None else (conv.lin_src, conv.lin_dst)
    return lin_s(x_src).view(-1, H, C), lin_d(x_dst).view(-1, H, C), res


def _folds(lin) -> bool:
    """A bias-free, initialised Linear whose map can absorb the attention vector (see _gat_logits)."""
    from torch_geometric.nn.dense.linear import Linear as PygLinear

    w = getattr(lin, "weight", None)
    own = getattr(lin.__dict__.get("forward"), "__func__", _linear_forward)  # OptimizedGNN's oneDNN route is fine
    return (type(lin) in (torch.nn.Linear, PygLinear) and lin.bias is None and isinstance(w, torch.Tensor)
            and not isinstance(w, torch.nn.parameter.UninitializedParameter) and own is _linear_forward
            and not lin._forward_hooks and not lin._forward_pre_hooks)


def _att_map(conv, lin, att):
    """``V`` (H, in) with ``x @ V^T == (lin(x).view(-1, H, C) * att).sum(-1)`` for a bias-free ``lin``."""
    H, C = conv.heads, conv.out_channels
    return torch.einsum("hc,hcf->hf", att.reshape(H, C), lin.weight.view(H, C, -1))


def _gat_logits(conv, x, x_src, x_dst):
    """GATConv's per-node attention logits ``(x_src * att_src).sum(-1)`` and ``(x_dst * att_dst).sum(-1)``
    (n, H each). Where a side is ``lin(x)`` with a bias-free Linear, its logits are ``x @ V^T``
    (:func:`_att_map`): one narrow GEMM (both sides in one when they share x and lin) instead of an
    n x H x C product and sum, forward and backward; equal up to float rounding, the gradients
    reach W and att through V by autograd."""
    xs_in, xd_in = (x, x) if isinstance(x, torch.Tensor) else x
    lin_s, lin_d = (conv.lin, conv.lin) if conv.lin is not None else (conv.lin_src, conv.lin_dst)
    if xs_in is xd_in and lin_s is lin_d and _folds(lin_s) and xs_in.dim() == 2:
        H = conv.heads
        a = linear(xs_in, torch.cat([_att_map(conv, lin_s, conv.att_src), _att_map(conv, lin_s, conv.att_dst)]))
        return a[:, :H], a[:, H:]
    a_src = (linear(xs_in, _att_map(conv, lin_s, conv.att_src)) if _folds(lin_s) and xs_in.dim() == 2
             else (x_src * conv.att_src).sum(dim=-1))
    a_dst = (linear(xd_in, _att_map(conv, lin_d, conv.att_dst)) if _folds(lin_d) and xd_in.dim() == 2
             else (x_dst * conv.att_dst).sum(dim=-1))
    return a_src, a_dst


def _gat_edge_logits(conv, edge_index, edge_attr, loops, perm):
    """GATConv's per-edge logit term from edge_attr (E x H, CSR order), with PyG's self-loop fill."""
    from torch_geometric.utils import add_self_loops, remove_self_loops

    if edge_attr is None or conv.lin_edge is None or perm.numel() == 0:
        return None
    ei = _attention_edge_index(edge_index)
    if loops is not None:
        ei, edge_attr = remove_self_loops(ei, edge_attr)
        ei, edge_attr = add_self_loops(ei, edge_attr, fill_value=conv.fill_value, num_nodes=loops)
    if edge_attr.dim() == 1:
        edge_attr = edge_attr.view(-1, 1)
    e = conv.lin_edge(edge_attr).view(-1, conv.heads, conv.out_channels)
    return (e * conv.att_edge).sum(dim=-1).index_select(0, perm)


def _gat_forward(self, x, edge_index, edge_attr=None, size=None, return_attention_weights=None):
    """GATConv.forward on :func:`cpu_opt.gnn.gat_attention` (PyG's forward for what it does not cover)."""
    args = (x, edge_index, edge_attr, size, return_attention_weights)
    pair = (x, x) if isinstance(x, torch.Tensor) else tuple(x)
    edge_ok = edge_attr is None or self.lin_edge is None or isinstance(edge_attr, torch.Tensor)
    why = _attention_why_not(self, pair, edge_index, edge_ok, return_attention_weights)
    if why is None and size is not None and tuple(size) != (pair[0].shape[0], pair[1].shape[0]):
        why = "size other than the node counts"
    if why is not None:
        return _attention_fallback(self, why, *args)
    x_src, x_dst, res = _gat_project(self, x)
    n_src, n_dst = x_src.shape[0], x_dst.shape[0]
    loops = min(n_src, n_dst) if self.add_self_loops else None
    setup = _attention_setup(self, edge_index, n_src, n_dst, loops, self.heads, x_src.dtype)
    if setup is None:
        return _attention_fallback(self, "edge_index out of range for x", *args)
    g, perm, mask = setup
    a_src, a_dst = _gat_logits(self, x, x_src, x_dst)
    a_edge = _gat_edge_logits(self, edge_index, edge_attr, loops, perm)
    _counts["attention:cpu_opt (GATConv)"] += 1
    out = ops.gat_attention(g, x_src, a_src, a_dst, negative_slope=self.negative_slope, a_edge=a_edge, mask=mask)
    return _heads_out(self, out, res)


def _gatv2_forward(self, x, edge_index, edge_attr=None, return_attention_weights=None):
    """GATv2Conv.forward on :func:`cpu_opt.gnn.gatv2_attention`."""
    args = (x, edge_index, edge_attr, return_attention_weights)
    pair = (x, x) if isinstance(x, torch.Tensor) else tuple(x)
    why = _attention_why_not(self, pair, edge_index, edge_attr is None, return_attention_weights)
    if why is not None:
        return _attention_fallback(self, why, *args)
    H, C = self.heads, self.out_channels
    if isinstance(x, torch.Tensor):
        res = self.res(x) if self.res is not None else None
        x_l = self.lin_l(x).view(-1, H, C)
        x_r = x_l if self.share_weights else self.lin_r(x).view(-1, H, C)
    else:
        res = self.res(x[1]) if self.res is not None else None
        x_l, x_r = self.lin_l(x[0]).view(-1, H, C), self.lin_r(x[1]).view(-1, H, C)
    n_src, n_dst = x_l.shape[0], x_r.shape[0]
    loops = min(n_src, n_dst) if self.add_self_loops else None
    setup = _attention_setup(self, edge_index, n_src, n_dst, loops, H, x_l.dtype)
    if setup is None:
        return _attention_fallback(self, "edge_index out of range for x", *args)
    g, _, mask = setup
    _counts["attention:cpu_opt (GATv2Conv)"] += 1
    out = ops.gatv2_attention(g, x_l, x_r, self.att, negative_slope=self.negative_slope, mask=mask)
    return _heads_out(self, out, res)


def _transformer_forward(self, x, edge_index, edge_attr=None, return_attention_weights=None):
    """TransformerConv.forward on :func:`cpu_opt.gnn.transformer_attention`."""
    import math

    args = (x, edge_index, edge_attr, return_attention_weights)
    pair = (x, x) if isinstance(x, torch.Tensor) else tuple(x)
    why = _attention_why_not(self, pair, edge_index, edge_attr is None, return_attention_weights)
    if why is not None:
        return _attention_fallback(self, why, *args)
    H, C = self.heads, self.out_channels
    query = self.lin_query(pair[1]).view(-1, H, C)
    key = self.lin_key(pair[0]).view(-1, H, C)
    value = self.lin_value(pair[0]).view(-1, H, C)
    setup = _attention_setup(self, edge_index, key.shape[0], query.shape[0], None, H, value.dtype)
    if setup is None:
        return _attention_fallback(self, "edge_index out of range for x", *args)
    g, _, mask = setup
    _counts["attention:cpu_opt (TransformerConv)"] += 1
    out = ops.transformer_attention(g, query, key, value, score_div=math.sqrt(C), mask=mask)
    self._alpha = None
    out = out.reshape(-1, H * C) if self.concat else out.mean(dim=1)
    if self.root_weight:
        x_r = self.lin_skip(pair[1])
        if self.lin_beta is not None:
            beta = self.lin_beta(torch.cat([out, x_r, out - x_r], dim=-1)).sigmoid()
            out = beta * x_r + (1 - beta) * out
        else:
            out = out + x_r
    return out


def _pyg_edge_index_forward(self, x, edge_index, *args, **kwargs):
    """The layer's own forward, handed the edge_index an adj_t made by cpu_opt came from: PyG's
    attention layers compute something else on a sparse adj_t when the graph has duplicate edges
    (GATConv on an R-MAT graph: 0.5 off), so layers that do not take the fused path get PyG's
    default edge_index path, exactly."""
    _counts[f"attention:pyg ({type(self).__name__}: not fused (a subclass, or fused_attention=False))"] += 1
    ei = _attention_edge_index(edge_index)
    return type(self).forward(self, x, ei if ei is not None else edge_index, *args, **kwargs)


def attention_layers(model: torch.nn.Module, fused: bool = True) -> dict:
    """``{module: forward}`` for the GATConv, GATv2Conv and TransformerConv layers of ``model``: the
    fused forwards for those exact classes (a subclass may have changed what its forward or message
    computes), :func:`_pyg_edge_index_forward` for subclasses (and for all with ``fused=False``)."""
    from torch_geometric.nn import GATConv, GATv2Conv, TransformerConv

    table = {GATConv: _gat_forward, GATv2Conv: _gatv2_forward, TransformerConv: _transformer_forward}
    return {m: table[type(m)] if fused and type(m) in table else _pyg_edge_index_forward for m in model.modules()
            if isinstance(m, tuple(table)) and "forward" not in m.__dict__}


@contextlib.contextmanager
def _forwards(layers: dict):
    """Give each layer its own forward for the duration of one call (instance attribute, removed
    afterwards: the wrapped model itself is left as it was)."""
    import types

    for m, fn in layers.items():
        m.forward = types.MethodType(fn, m)
    try:
        yield
    finally:
        for m in layers:
            m.__dict__.pop("forward", None)


# ----------------------------------------------------------------------------- a ReLU after a layer

# Set by _conv_then_relu while a layer whose output goes straight into a ReLU runs: [layer, taken].
# A forward that applies the ReLU itself (in a GEMM's epilogue, or in the pass that writes its output)
# takes it with _take_relu(self); otherwise _conv_then_relu applies torch's.
_relu_after: contextvars.ContextVar = contextvars.ContextVar("cpu_opt_gnn_relu_after", default=None)


def _take_relu(layer) -> bool:
    """Whether ``layer``'s output goes into a ReLU the caller left to it (then it must apply it)."""
    st = _relu_after.get()
    if st is not None and st[0] is layer and not st[1]:
        st[1] = True
        return True
    return False


def _conv_then_relu(layer, *args, **kwargs):
    """``torch.relu(layer(*args, **kwargs))``, the ReLU inside ``layer``'s forward where it takes it."""
    st = [layer, False]
    token = _relu_after.set(st)
    try:
        out = layer(*args, **kwargs)
    finally:
        _relu_after.reset(token)
    if st[1]:
        _counts[f"ReLU after {type(layer).__name__}: in the layer's output pass"] += 1
        return out
    return torch.relu(out)


class _AddReLU(torch.autograd.Function):
    """``relu(a + b)`` in one pass into huge pages (torch's ``_add_relu``); backward masks ``g`` once
    for both. SAGEConv's linear-first ``aggr(x W_l^T) + x W_r^T`` followed by a ReLU."""

    @staticmethod
    def forward(ctx, a, b):
        out = torch.ops.aten._add_relu.out(a, b, out=native.empty(*a.shape))
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, g):
        (out,) = ctx.saved_tensors
        if torch.is_grad_enabled():
            g = torch.ops.aten.threshold_backward(g, out, 0)
        else:
            g = _relu_grad(g.contiguous(), out)
        return g, g


def _is_relu(node, modules: dict) -> bool:
    """An FX node computing ``relu`` of its one tensor argument (any of torch's spellings)."""
    F = torch.nn.functional
    if node.op == "call_method":
        return node.target in ("relu", "relu_") and len(node.args) == 1 and not node.kwargs
    if node.op == "call_function":
        return node.target in (torch.relu, torch.relu_, F.relu) and len(node.args) == 1 and \
            set(node.kwargs) <= {"inplace"}
    if node.op == "call_module":
        return type(modules.get(node.target)) is torch.nn.ReLU and len(node.args) == 1 and not node.kwargs
    return False


def _bound(gm) -> list:
    """``[(attribute path, object)]`` for every module and attribute a traced graph reads from its root."""
    if gm is None:
        return []
    return [(n.target, _attr(gm, n.target)) for n in gm.graph.nodes if n.op in ("call_module", "get_attr")]


def _attr(root, path: str):
    for name in path.split("."):
        root = getattr(root, name, None)
    return root


def _still_bound(model, gm, bound: list) -> bool:
    """Whether ``model`` still holds the very modules and attributes its traced graph calls (a
    submodule replaced after the trace makes the graph stale: it is traced again)."""
    return all(_attr(model, path) is obj for path, obj in bound)


def _mentions_relu(model: torch.nn.Module) -> bool:
    """Whether ``model`` may apply a ReLU (an ``nn.ReLU`` child, or "relu" in its forward's source;
    True where the source cannot be read): models without one are not traced at all."""
    if any(type(m) is torch.nn.ReLU for m in model.modules()):
        return True
    try:
        return "relu" in inspect.getsource(type(model).forward)
    except (OSError, TypeError):
        return True


def relu_fusion_graph(model: torch.nn.Module, takers, concrete_args: dict):
    """``(graph_module, fused, why_not)``: ``model``'s forward traced by ``torch.fx`` (every submodule
    but ``nn.Sequential`` a leaf; ``concrete_args`` the non-tensor arguments of this call, fixed)
    with each ``relu(layer(...))`` whose layer is in ``takers`` and whose output nothing else reads
    rewritten to ``_conv_then_relu(layer, ...)``: the layer applies the ReLU as it writes its
    output, and in backward masks the gradient as its weight-gradient GEMM reads it (no separate
    ReLU pass over a 100k-row tensor, forward or backward: 12 of 102 ms of a GraphSAGE-max step on
    Zen 3). ``graph_module`` is None where nothing is fused or the forward cannot be traced
    (``why_not`` says why: tensor-dependent control flow, an attribute set during forward ...);
    the model then runs as written."""
    import torch.fx as fx

    class Tracer(fx.Tracer):
        def is_leaf_module(self, m, qualname):
            return type(m) is not torch.nn.Sequential

    # a forward that stores a tensor on a module (self.h = x) would store a Proxy while tracing:
    # what the modules hold is compared before and after, and put back
    before = {m: dict(m.__dict__) for m in model.modules()}
    try:
        graph = Tracer().trace(model, concrete_args=concrete_args or None)
    except Exception as e:  # noqa: BLE001 - any failure to trace leaves the model as written
        return None, 0, f"not traceable by torch.fx ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''})"
    finally:
        changed = [m for m, d in before.items() if m.__dict__.keys() != d.keys()
                   or any(m.__dict__[k] is not v for k, v in d.items())]
        for m in changed:
            m.__dict__.clear()
            m.__dict__.update(before[m])
    if changed:
        return None, 0, "its forward sets module attributes"
    modules = dict(model.named_modules())
    fused = 0
    for node in list(graph.nodes):
        if not _is_relu(node, modules):
            continue
        src = node.args[0]
        if not (isinstance(src, fx.Node) and src.op == "call_module" and modules.get(src.target) in takers
                and len(src.users) == 1):
            continue
        with graph.inserting_before(src):
            layer = graph.get_attr(src.target)
            call = graph.call_function(_conv_then_relu, (layer, *src.args), dict(src.kwargs))
        node.replace_all_uses_with(call)
        graph.erase_node(node)
        graph.erase_node(src)
        fused += 1
    if not fused:
        return None, 0, "no ReLU right after a layer that takes one"
    graph.lint()
    return fx.GraphModule(model, graph), fused, None


# ----------------------------------------------------------------------------- constant aggregations

# The default bound of one model's cached aggregations (OptimizedGNN(aggregation_cache_mb=...)).
AGGREGATION_CACHE_MB = 1024
_CONSTANT_AGGR = ("sum", "add", "mean", "max", "min")
_AGGR_METHODS = ("propagate", "message", "aggregate", "message_and_aggregate", "update")


def aggregation_cache_layers(model: torch.nn.Module) -> list:
    """The layers whose ``propagate`` output is a function of the source features and the graph
    alone: stock SAGEConv, GINConv and GraphConv (exactly those classes) with a fixed aggregation
    (sum / mean / max / min: no learnable aggregation module)."""
    from torch_geometric.nn import GINConv, GraphConv, SAGEConv

    return [m for m in model.modules()
            if type(m) in (SAGEConv, GINConv, GraphConv) and isinstance(m.aggr, str) and m.aggr in _CONSTANT_AGGR
            and not any(f in m.__dict__ for f in _AGGR_METHODS[1:])]


class _AggregationCache:
    """Aggregations of a tensor the caller handed to the model that needs no gradient (the node
    features into the first layer, the same every epoch of full-batch training), on a graph this
    wrapper converted: kept across calls, one per layer. A hit needs the same graph object, the
    same features by content (:func:`native.fingerprint`, as the graph cache), shapes, strides,
    dtype, ``size``, aggregation (and GINConv's ``eps``), and the cached tensor unchanged since
    (``_version``); anything else computes and replaces it. Computed outside inference mode, so
    that training calls can save it for backward. Results larger than what is left of
    ``max_bytes`` are not kept."""

    def __init__(self, max_bytes: int):
        self.max_bytes = int(max_bytes)
        self._entries: dict = {}  # layer -> (key, weakref to the graph, out, version of out)
        self._lock = threading.Lock()

    def _bytes(self) -> int:
        return sum(e[2].numel() * e[2].element_size() for e in self._entries.values())

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def lookup(self, conv, call, edge_index, x0, x1, size, tag, compute):
        """``compute()``, or what it returned before for the same inputs; ``call`` is the
        wrapper's current call (:data:`_agg_call`)."""
        _, graph, inputs, notes = call
        if (torch.compiler.is_compiling()  # a traced graph would hold the result as a constant
                or edge_index is not graph or not isinstance(x0, torch.Tensor) or x0.requires_grad
                or x0.layout != torch.strided or not any(x0 is t for t in inputs)
                or forward_ad.unpack_dual(x0).tangent is not None  # forward-mode AD: not a constant
                or not (isinstance(conv.aggr, str) and conv.aggr in _CONSTANT_AGGR)  # changed since optimize
                or conv.explain or conv.decomposed_layers != 1 or any(getattr(conv, h, None) for h in _MP_HOOKS)):
            return compute()
        key = (native.fingerprint(x0), tuple(x0.shape), x0.stride(), x0.dtype,
               None if x1 is None else (tuple(x1.shape), x1.dtype), None if size is None else tuple(size),
               conv.aggr, tag)
        with self._lock:
            e = self._entries.get(conv)
        if e is not None and e[0] == key and e[1]() is graph and _version(e[2]) == e[3]:
            notes["aggregation of a constant input: cached"] += 1
            return e[2]
        with outside_inference_mode():  # a normal tensor: later training calls can save it for backward
            out = compute()
        with self._lock:
            self._entries.pop(conv, None)
            if (isinstance(out, torch.Tensor) and not out.requires_grad
                    and self._bytes() + out.numel() * out.element_size() <= self.max_bytes):
                # the graph by weak reference: an entry does not keep a graph the graph cache dropped
                self._entries[conv] = (key, weakref.ref(graph), out, _version(out))
                notes["aggregation of a constant input: computed and kept"] += 1
            else:
                notes["aggregation of a constant input: computed, over the cache bound"] += 1
        return out


def _version(t: torch.Tensor):
    # inference tensors have no version counter (and cannot be changed in place outside inference mode)
    return None if t.is_inference() else t._version


# (cache, graph, inputs, notes) of the wrapped model's current call in this thread: its
# _AggregationCache, the adj_t it converted, the tensors the caller passed, the wrapper's notes; None
# outside one (or when nothing was converted or the cache is off)
_agg_call: contextvars.ContextVar = contextvars.ContextVar("cpu_opt_gnn_aggregation_call", default=None)


def _cached_propagate(conv, orig, prior):
    def propagate(edge_index, size=None, **kwargs):
        call = _agg_call.get()
        x = kwargs.get("x")
        if call is None or set(kwargs) - {"x", "edge_weight"} or kwargs.get("edge_weight") is not None:
            return orig(edge_index, size=size, **kwargs)
        x0, x1 = x if isinstance(x, tuple) and len(x) == 2 else (x, None)
        return call[0].lookup(conv, call, edge_index, x0, x1, size, None, lambda: orig(edge_index, size=size, **kwargs))

    propagate.__wrapped__ = orig
    propagate._cpu_opt_prior = prior  # the instance's own propagate before any wrapper (None: the class's)
    return propagate


def _gin_forward_root(self, x, edge_index, size=None):
    """GINConv.forward with ``out + (1 + eps) * x_r`` in one pass (:func:`_add_root`); when the
    input is constant (:class:`_AggregationCache`) and ``eps`` is not trained, the whole
    ``aggr(x) + (1 + eps) x`` is kept, not only the aggregation."""
    if isinstance(x, torch.Tensor):
        x = (x, x)
    x_r = x[1]
    call = _agg_call.get()

    def h(propagate):
        out = propagate(edge_index, x=x, size=size)
        return out if x_r is None else _add_root(self, out, x_r)

    if call is not None and x_r is x[0] and not (isinstance(self.eps, torch.Tensor) and self.eps.requires_grad):
        # PyG's propagate underneath the caching one: one kept result per layer, this one
        plain = getattr(self.propagate, "__wrapped__", self.propagate)
        h_ = call[0].lookup(self, call, edge_index, x[0], None, size, ("root", float(self.eps)), lambda: h(plain))
    else:
        h_ = h(self.propagate)
    fwd = self.nn.__dict__.get("forward")
    if getattr(fwd, "__func__", None) is _mlp_forward and _take_relu(self):  # the ReLU after the layer, in nn's last GEMM
        return _mlp_forward(self.nn, h_, relu=True)
    out = self.nn(h_)
    # an nn that hands back its input (Identity, eval-mode Dropout) must not return a kept tensor:
    # the caller could change it, and the next call would return the same object again
    if isinstance(out, torch.Tensor) and out.untyped_storage().data_ptr() == h_.untyped_storage().data_ptr():
        out = out.clone()
    return out


@contextlib.contextmanager
def _propagates(layers: list):
    """Route each layer's ``propagate`` through ``cache`` for one call (instance attribute: PyG sets
    its own there for explain mode and decomposed layers, which is put back afterwards)."""
    import types

    saved = []
    for m in layers:
        own = m.__dict__.get("propagate")
        if hasattr(own, "_cpu_opt_prior"):  # another thread's call is running: wrap what it wrapped
            own = own._cpu_opt_prior
        saved.append((m, own))
        m.propagate = _cached_propagate(m, own if own is not None else types.MethodType(type(m).propagate, m), own)
    try:
        yield
    finally:
        for m, own in saved:  # back to what was there before any call (never another call's wrapper)
            if own is None:
                m.__dict__.pop("propagate", None)
            else:
                m.propagate = own


# ----------------------------------------------------------------------------- the wrapper

class OptimizedGNN(torch.nn.Module):
    """A PyG model whose message passing runs on cpu_opt kernels (see the module docstring).
    Shares the parameters of the wrapped model (``.model``)."""

    def __init__(self, model: torch.nn.Module, *, edge_arg: str | None = None,
                 index_dtype: torch.dtype = torch.int64, cache_size: int = 4, linear_first: bool = True,
                 onednn_linear: bool = True, fused_attention: bool = True,
                 aggregation_cache_mb: float | None = AGGREGATION_CACHE_MB, fuse_relu: bool = True,
                 narrow_log_softmax: bool = True):
        super().__init__()
        if aggregation_cache_mb is not None and (isinstance(aggregation_cache_mb, bool)
                                                 or not isinstance(aggregation_cache_mb, (int, float))
                                                 or not 0 <= aggregation_cache_mb < math.inf):
            raise ValueError(f"aggregation_cache_mb must be a number of MiB >= 0 or None (no cache), "
                             f"got {aggregation_cache_mb!r}")
        self.model = model
        params = list(inspect.signature(model.forward).parameters)
        if edge_arg is None:
            edge_arg = next((p for p in ("edge_index", "adj_t", "adj") if p in params), None)
            if edge_arg is None and len(params) >= 2:
                edge_arg = params[1]
        if edge_arg is None or edge_arg not in params:
            raise ValueError(f"cannot find the edge_index argument of {type(model).__name__}.forward{params}; "
                             f"pass edge_arg=")
        self._edge_arg = edge_arg
        self._params = params
        self._signature = inspect.signature(model.forward)
        self._index_dtype = index_dtype
        self._cache: OrderedDict = OrderedDict()
        self._cache_lock = threading.Lock()
        self._cache_size = cache_size
        self._notes: Counter = Counter()
        from torch_geometric.nn import MessagePassing

        # adj_t is built for flow="source_to_target"; a model with another flow keeps edge_index
        self._convertible = all(getattr(m, "flow", "source_to_target") == "source_to_target"
                                for m in model.modules() if isinstance(m, MessagePassing))
        self._linear_first = linear_first_layers(model) if linear_first else {}
        for m in self._linear_first:
            w = m.lin_l.weight if hasattr(m, "lin_l") else m.nn[0].weight
            self._notes[f"{type(m).__name__}({w.shape[1]} -> {w.shape[0]}): linear before aggregation"] += 1
        linears = linear_layers(model) if onednn_linear else {}
        if linears and _native_linear_route():
            self._notes["Linear layers on cpu_opt's tall-skinny GEMM where float32 with 16384+ rows "
                        "(routing: gnn_linear fp32 -> tall_skinny)"] = len(linears)
        elif linears:
            self._notes["Linear layers on torch's oneDNN where float32 (routing: linear fp32 -> torch_onednn)"] = len(linears)
        mlps = mlp_layers(model) if onednn_linear else {}
        if mlps:
            self._notes["Linear -> ReLU -> Linear on cpu_opt's tall-skinny GEMM, the ReLU in the GEMMs' "
                        "epilogues (forward and backward)"] = len(mlps)
        fused_root = fused_root_layers(model, self._linear_first) if onednn_linear else {}
        if fused_root:
            self._notes[f"SAGEConv: {_fused_root_what()}"] = len(fused_root)
        attention = attention_layers(model, fused_attention)
        self._attention = {m: f for m, f in attention.items() if f is not _pyg_edge_index_forward}
        for m in attention:
            what = _ATTENTION_WHY if m in self._attention else "PyG's forward on the original edge_index"
            if m in self._attention and type(m).__name__ != "GATConv" and m.edge_dim is not None:
                what += "; PyG's forward for calls with edge_attr"
            self._notes[f"{type(m).__name__}(heads={m.heads}, {m.out_channels} per head): {what}"] += 1
        self._agg_layers = aggregation_cache_layers(model) if aggregation_cache_mb else []
        from torch_geometric.nn import GINConv

        gin_root = {m: _gin_forward_root for m in aggregation_cache_layers(model)
                    if type(m) is GINConv and m not in self._linear_first and "forward" not in m.__dict__}
        self._forwards = {**linears, **mlps, **fused_root, **gin_root, **self._linear_first, **attention}
        self._onednn_linear = onednn_linear
        self._agg_cache = _AggregationCache(int((aggregation_cache_mb or 0) * 2**20))
        takers = (_sage_forward_fused_root, _sage_forward_linear_first, _gin_forward_linear_first, _gin_forward_root)
        self._relu_takers = {m for m, f in self._forwards.items() if f in takers} if fuse_relu else set()
        self._relu_graphs: dict = {}  # (training flags, fixed arguments) -> GraphModule or None
        self._trace_lock = threading.Lock()
        self._mentions_relu = bool(self._relu_takers) and _mentions_relu(model)
        if narrow_log_softmax:
            from . import log_softmax

            log_softmax.install()
            self._notes[_NARROW_LOG_SOFTMAX_NOTE] = 1

    def _relu_graph(self, bound):
        """The model's forward with each ReLU after a layer that takes it moved into that layer
        (:func:`relu_fusion_graph`), traced once per training/eval state of its modules and per
        value of its non-tensor arguments; None: run the model as written."""
        if not self._relu_takers or not _plain(self.model) or torch.compiler.is_compiling() or not self._mentions_relu:
            return None
        fixed = {}
        for name, p in self._signature.parameters.items():
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                return None
            v = bound.arguments.get(name, p.default)
            if name in bound.arguments and isinstance(v, torch.Tensor):
                continue
            if isinstance(v, torch.Tensor) or v is inspect.Parameter.empty:
                return None
            fixed[name] = v
        key = (tuple(m.training for m in self.model.modules()), tuple(fixed.items()))
        try:
            hash(key)
        except TypeError:
            return None
        with self._cache_lock:
            if key in self._relu_graphs and _still_bound(self.model, *self._relu_graphs[key]):
                return self._relu_graphs[key][0]
        with self._trace_lock:  # one trace at a time (tracing runs the forward's Python once)
            with self._cache_lock:
                if key in self._relu_graphs and _still_bound(self.model, *self._relu_graphs[key]):
                    return self._relu_graphs[key][0]
            gm, fused, why = relu_fusion_graph(self.model, self._relu_takers, fixed)
        with self._cache_lock:
            self._relu_graphs[key] = (gm, _bound(gm))
            if gm is not None:
                self._notes["ReLU right after a layer: applied in the layer's output pass, its gradient in the "
                            "weight-gradient GEMM (torch.fx rewrite of the model's forward)"] = fused
            else:
                self._notes[f"ReLU after a layer: torch's (the model's forward {why})"] += 1
        return gm

    @torch.compiler.disable  # dynamo cannot trace the cffi fingerprint; run eagerly, graph-break around it
    def _adj_t(self, edge_index: torch.Tensor, num_nodes: int) -> torch.Tensor:
        # keyed by the contents of edge_index (see graph._SortCache): a batch written into a reused
        # buffer, through .data or numpy, is a new graph even though its pointer and version are not
        key = (native.fingerprint(edge_index), tuple(edge_index.shape), edge_index.dtype, num_nodes)
        with self._cache_lock:  # one model may serve several threads
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self._notes["edge_index -> adj_t: cached"] += 1
                return hit[1]
        with outside_inference_mode():  # kept for later calls, which may train
            g = CSRGraph.from_edge_index(edge_index, num_nodes, index_dtype=self._index_dtype)
            adj_t = g.to_torch()
            # the adj_t's gcn_norm is computed from this edge_index: keep a copy the caller cannot edit
            torch_csr_registry.register(adj_t, g, unit_weight=True, edge_index=edge_index.clone())
        with self._cache_lock:
            self._cache[key] = (edge_index, adj_t)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            self._notes["edge_index -> adj_t: converted"] += 1
        return adj_t

    def forward(self, *args, **kwargs):
        bound = self._signature.bind(*args, **kwargs)
        a = bound.arguments
        ei = a.get(self._edge_arg)
        x = a.get(self._params[0]) if self._params else None
        has_weight = any(a.get(n) is not None for n in ("edge_weight", "edge_attr"))
        graph = None
        if (isinstance(ei, torch.Tensor) and ei.layout == torch.strided and ei.dim() == 2 and ei.shape[0] == 2
                and ei.dtype in K.INDEX_DTYPES and not has_weight and isinstance(x, torch.Tensor)
                and self._convertible):
            a[self._edge_arg] = graph = self._adj_t(ei, x.shape[0])
        elif has_weight:
            self._notes["edge weights/attrs given: edge_index kept (scatter path)"] += 1
        elif not self._convertible:
            self._notes["a layer has flow='target_to_source': edge_index kept (scatter path)"] += 1
        run = self._relu_graph(bound) or self.model
        token = _linear_on.set(self._onednn_linear)
        try:
            with patched(), _forwards(self._forwards), contextlib.ExitStack() as stack:
                if graph is not None and self._agg_layers:
                    inputs = [v for v in a.values() if isinstance(v, torch.Tensor) and v is not graph]
                    stack.enter_context(_propagates(self._agg_layers))
                    token_agg = _agg_call.set((self._agg_cache, graph, inputs, self._notes))
                    stack.callback(_agg_call.reset, token_agg)
                return run(*bound.args, **bound.kwargs)
        finally:
            _linear_on.reset(token)

    def report(self) -> dict:
        """What ran where (the same keys as ``cpu_opt.optimize(...).report()``): ``routed`` lists the
        layers cpu_opt took over, ``notes`` the plan notes, ``counts`` how often each path ran since
        the process started (PyG calls that went back to PyG's own code count as fallbacks)."""
        counts = dict(_counts)
        counts.update(_log_softmax_counts())
        return {
            "capability": "gnn", "dtype": "as the model", "num_partitions": 0, "partitions": [],
            "fallbacks": [{"node": k.split(":", 1)[0], "op": k.split(":", 1)[0], "reason": k.split(":", 1)[1].strip(),
                           "count": v} for k, v in sorted(counts.items()) if "pyg" in k.split(":", 1)[-1]],
            "routed": [{"node": type(m).__name__, "op": type(m).__name__, "route": "cpu_opt.gnn",
                        "why": self._why(m)} for m, f in self._forwards.items() if f is not _pyg_edge_index_forward],
            "notes": [f"{k}: {v}" for k, v in sorted(self._notes.items())],
            "validation": None, "counts": counts,
        }

    def _why(self, m) -> str:
        if m in self._linear_first:
            return "linear map before aggregation"
        if m in self._attention:
            return _ATTENTION_WHY
        if self._forwards.get(m) is _sage_forward_fused_root:
            return _fused_root_what()
        if self._forwards.get(m) is _gin_forward_root:
            return "aggr(x) + (1 + eps) x in one pass (kept across calls for a constant input)"
        if self._forwards.get(m) is _mlp_forward:
            return "Linear -> ReLU -> Linear on cpu_opt's tall-skinny GEMM, the ReLU in the epilogues"
        return "Linear on cpu_opt's tall-skinny GEMM" if _native_linear_route() else "Linear on torch's oneDNN"

    def report_text(self) -> str:
        """What ran where since creation (counts), as text."""
        lines = [f"cpu_opt.gnn.optimize({type(self.model).__name__}):"]
        for k, v in sorted(self._notes.items()):
            lines.append(f"  {k}: {v}")
        for k, v in sorted({**_counts, **_log_softmax_counts()}.items()):
            lines.append(f"  {k}: {v}")
        return "\n".join(lines)


_NARROW_LOG_SOFTMAX_NOTE = ("log_softmax (cross_entropy) over 1-15 classes on cpu_opt's kernel, process wide "
                            "(cpu_opt.gnn.log_softmax; torch 2.13's is 12x slower there)")


def _log_softmax_counts() -> dict:
    from . import log_softmax

    names = {"forward": "log_softmax:cpu_opt", "backward": "log_softmax backward:cpu_opt",
             "forward_torch": "log_softmax:torch (not narrow float32)",
             "backward_torch": "log_softmax backward:torch (not narrow float32)"}
    return {names[k]: v for k, v in log_softmax.counts.items()}


def optimize(model: torch.nn.Module, *, edge_arg: str | None = None, index_dtype: torch.dtype = torch.int64,
             linear_first: bool = True, onednn_linear: bool = True, fused_attention: bool = True,
             aggregation_cache_mb: float | None = AGGREGATION_CACHE_MB, fuse_relu: bool = True,
             narrow_log_softmax: bool = True, verbose: bool = False) -> OptimizedGNN:
    """Wrap a PyG model so its message passing runs on cpu_opt kernels. The model's forward must
    take node features first and ``edge_index`` (or ``edge_arg``) as a (2, E) integer tensor.
    ``index_dtype=torch.int32`` halves the column index traffic. ``linear_first``: narrowing
    SAGEConv (sum/mean) and GINConv layers apply their linear map before aggregating (see the
    module docstring); ``False`` keeps PyG's order exactly. ``onednn_linear``: the model's Linear
    layers on node features run on cpu_opt's tall-skinny GEMM (routing's ``gnn_linear`` route; SAGEConv's two
    linears then share one output) or on torch's oneDNN where the routing table says so
    (:func:`linear`); ``False`` keeps ``F.linear`` (the name is older than the native kernel). ``fused_attention``: GATConv, GATv2Conv and TransformerConv run their attention on
    cpu_opt's fused kernels (:func:`attention_layers`; PyG's forward for what those do not cover, counted
    in ``report()``); ``False`` keeps PyG's. ``aggregation_cache_mb``: SAGEConv, GINConv and GraphConv
    layers aggregating a tensor passed to the model that needs no gradient (the node features into
    the first layer) keep that aggregation across calls on the same graph, checked by content on
    every call (:class:`_AggregationCache`), up to this many MiB per model; ``0`` or ``None`` turns it off.
    ``fuse_relu``: a ReLU applied to a layer's output (``conv(x, edge_index).relu()``, ``F.relu``,
    ``nn.ReLU``) where nothing else reads that output runs inside the layer (SAGEConv and GINConv on
    cpu_opt's paths): the model's forward is traced by ``torch.fx`` on its first call (per
    train/eval state and non-tensor arguments) and rewritten (:func:`relu_fusion_graph`); a forward
    that cannot be traced runs as written, and ``report()`` says why. ``False`` runs it as written.
    ``narrow_log_softmax``: install :mod:`cpu_opt.gnn.log_softmax`, the native kernels for torch's
    CPU ``log_softmax`` and its backward over a last dimension of 1 to 15 columns (a node classifier's
    ``cross_entropy``), process wide; other inputs keep torch's kernels. ``False`` leaves torch's."""
    from torch_geometric.nn import MessagePassing

    convs = [type(m).__name__ for m in model.modules() if isinstance(m, MessagePassing)]
    if not convs:
        raise ValueError(f"{type(model).__name__} contains no torch_geometric MessagePassing layer")
    opt = OptimizedGNN(model, edge_arg=edge_arg, index_dtype=index_dtype, linear_first=linear_first,
                       onednn_linear=onednn_linear, fused_attention=fused_attention,
                       aggregation_cache_mb=aggregation_cache_mb, fuse_relu=fuse_relu,
                       narrow_log_softmax=narrow_log_softmax)
    if verbose:
        fused = [c for c in convs if c in ("GCNConv", "SAGEConv", "GINConv", "GraphConv")]
        print(f"cpu_opt.gnn.optimize: {len(convs)} message-passing layers ({', '.join(sorted(set(convs)))}); "
              f"fused spmm path for {len(fused)}, fused attention for {len(opt._attention)}, "
              f"scatter path for the rest")
    return opt
