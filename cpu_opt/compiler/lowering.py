"""Lowering: an ATen-level FX graph -> a oneDNN Graph -> partitions -> a runnable FX graph.

Every FX node with a mapping in :data:`LOWERINGS` becomes oneDNN Graph ops; every other node
becomes a ``Wildcard`` so oneDNN sees the data flow, and graph outputs are marked with ``End``.
oneDNN then returns partitions; each supported one becomes a single call to a
:class:`PartitionStep` in a new FX graph, and everything else stays a torch call. The new
graph's generated code is the runtime: a straight list of steps, no graph walking per call.

Views (reshape / permute / transpose / ...) are not lowered: torch runs them without copying,
where oneDNN would copy. They are reported as views, not as fallbacks.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx

from ..platform import routing
from ..dnnl import graph as G
from ..dnnl.memory import TORCH_TO_DNNL

aten = torch.ops.aten

VIEW_OPS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.permute.default,
            aten.transpose.int, aten.t.default, aten.flatten.using_ints, aten.unsqueeze.default,
            aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.expand.default, aten.slice.Tensor,
            aten.select.int, aten.split.Tensor, aten.unbind.int, aten.split_with_sizes.default,
            aten.chunk.default, aten.contiguous.default, aten.clone.default, aten.alias.default,
            aten.detach.default, aten.unflatten.int, operator.getitem}
ATTENTION_OPS = {aten.scaled_dot_product_attention.default}


def _attention_taken(n: torch.fx.Node, dtype: str) -> "routing.Route | None":
    """The attention route node ``n`` really takes (None: not an attention op): the kernel its target
    names (``passes.route_attention`` put cpu_opt's kernels there), torch's SDPA for an aten node the
    route left alone (dropout, or a route that is torch's kernel). Its reason is the table's or the
    profile's where that route is the one ``dtype`` (or an int8 graph's attention) has."""
    if n.op != "call_function":
        return None
    from ..backends import attention as battn

    backend = battn.route_of(n.target)
    if backend is None:
        if n.target not in ATTENTION_OPS:
            return None
        backend = "torch_flash"
    for dt in dict.fromkeys((dtype, "int8")):
        r = routing.route("attention", dt)
        if r.backend == backend:
            return r
    return routing.Route("attention", dtype, backend, "torch's SDPA: what the routed kernel does not take (dropout)"
                         if backend == "torch_flash" else f"cpu_opt's {backend} attention")


class LoweringError(Exception):
    """A node cannot be lowered (the reason becomes the fallback reason)."""


def _val(n):
    return n.meta.get("val") if isinstance(n, torch.fx.Node) else None


def _is_tensor(n) -> bool:
    return isinstance(_val(n), torch.Tensor)


def _ok_dtype(t: torch.Tensor) -> bool:
    return t.dtype in TORCH_TO_DNNL


@dataclass
class Ctx:
    gm: torch.fx.GraphModule
    g: G.Graph
    dtype: str
    lts: dict = field(default_factory=dict)           # FX node -> LogicalTensor
    lt_node: dict = field(default_factory=dict)       # lt id -> FX node
    op_node: dict = field(default_factory=dict)       # oneDNN op id -> FX node
    consts: dict = field(default_factory=dict)        # lt id -> torch tensor (scalars)
    constant_nodes: set = field(default_factory=set)  # get_attr nodes (weights)
    # get_attr nodes the graph writes into (a buffer used as state): not constants to oneDNN, whose
    # constant tensor cache would keep their first value
    state: set = field(default_factory=set)
    inner_ids: set = field(default_factory=set)       # lts of decomposed ops with no FX node

    def key(self, lt_id: int):
        """The runtime value an lt stands for: its FX node, or ("lt", id) for an inner value."""
        if lt_id in self.lt_node:
            return self.lt_node[lt_id]
        if lt_id in self.inner_ids:
            return ("lt", lt_id)
        return None

    def lt(self, n: torch.fx.Node) -> G.LogicalTensor:
        if n in self.lts:
            return self.lts[n]
        v = _val(n)
        if not isinstance(v, torch.Tensor) or not _ok_dtype(v):
            raise LoweringError(f"{n.name} is not a tensor oneDNN can take ({getattr(v, 'dtype', type(v).__name__)})")
        const = n.op == "get_attr" and n not in self.state
        t = self.g.tensor(tuple(v.shape), v.dtype, layout="any" if not const else "strided",
                          strides=None if not const else v.stride(), constant=const)
        self.lts[n] = t
        self.lt_node[t.id] = n
        if const:
            self.constant_nodes.add(n)
        return t

    def scalar(self, value, like: torch.Tensor) -> G.LogicalTensor:
        t = torch.tensor([value], dtype=like.dtype)
        lt = self.g.tensor((1,), like.dtype, constant=True)
        self.consts[lt.id] = t
        return lt

    def operand(self, a, like: torch.Tensor) -> G.LogicalTensor:
        if isinstance(a, torch.fx.Node):
            v = _val(a)
            if not isinstance(v, torch.Tensor) or v.dtype != like.dtype:
                raise LoweringError(f"operand {a.name} has dtype {getattr(v, 'dtype', None)}, output {like.dtype}")
            return self.lt(a)
        if isinstance(a, (int, float)) and not isinstance(a, bool):
            return self.scalar(a, like)
        raise LoweringError(f"operand of type {type(a).__name__}")

    def op(self, n: torch.fx.Node, kind: str, inputs, outputs, **attrs) -> None:
        oid = self.g.op(kind, inputs, outputs, name=f"{n.name}_{kind}", **attrs)
        self.op_node[oid] = n

    def out(self, n: torch.fx.Node) -> G.LogicalTensor:
        return self.lt(n)

    def inner(self, n: torch.fx.Node, tag: str) -> G.LogicalTensor:
        v = _val(n)
        t = self.g.tensor(tuple(v.shape), v.dtype, layout="any")
        self.inner_ids.add(t.id)
        return t


def _ints(v, n=2):
    if isinstance(v, int):
        return [v] * n
    v = [int(x) for x in v]
    return v * n if len(v) == 1 else v


# --------------------------------------------------------------------------- lowerings
# Each takes (ctx, node) and adds ops, or raises LoweringError with the reason.

def _linear(ctx: Ctx, n):
    x, w = n.args[0], n.args[1]
    b = n.args[2] if len(n.args) > 2 else None
    if _val(w).dim() != 2:
        raise LoweringError("linear weight is not 2-D")
    ins = [ctx.lt(x), ctx.lt(w)] + ([ctx.lt(b)] if b is not None else [])
    ctx.op(n, "MatMul", ins, [ctx.out(n)], transpose_b=True)


def _addmm(ctx: Ctx, n):
    bias, a, b = n.args[:3]
    if n.kwargs.get("beta", 1) != 1 or n.kwargs.get("alpha", 1) != 1 or _val(bias).dim() != 1:
        raise LoweringError("addmm with alpha/beta or a 2-D bias")
    ctx.op(n, "MatMul", [ctx.lt(a), ctx.lt(b), ctx.lt(bias)], [ctx.out(n)])


def _matmul(ctx: Ctx, n):
    a, b = n.args[:2]
    va, vb = _val(a), _val(b)
    if va.dim() < 2 or vb.dim() < 2:
        raise LoweringError("matmul of a 1-D operand")
    ctx.op(n, "MatMul", [ctx.lt(a), ctx.lt(b)], [ctx.out(n)])


def _conv2d(ctx: Ctx, n):
    args = list(n.args) + [None] * (7 - len(n.args))
    x, w, b, stride, padding, dilation, groups = args[:7]
    stride, dilation, groups = stride or 1, dilation or 1, groups or 1
    padding = 0 if padding is None else padding
    if isinstance(padding, str) or _val(w).dim() != 4:
        raise LoweringError(f"conv2d with padding={padding!r}")
    pads = _ints(padding)
    ins = [ctx.lt(x), ctx.lt(w)] + ([ctx.lt(b)] if b is not None else [])
    ctx.op(n, "Convolution", ins, [ctx.out(n)], strides=_ints(stride), pads_begin=pads, pads_end=pads,
           dilations=_ints(dilation), groups=int(groups), data_format="NCX", weights_format="OIX")


def _batch_norm(ctx: Ctx, n):
    x, w, b, mean, var, training, _mom, eps = n.args[:8]
    if training or w is None or b is None:
        raise LoweringError("training-mode or non-affine batch_norm")
    ctx.op(n, "BatchNormInference", [ctx.lt(x), ctx.lt(w), ctx.lt(b), ctx.lt(mean), ctx.lt(var)], [ctx.out(n)],
           epsilon=float(eps), data_format="NCX")


def _layer_norm(ctx: Ctx, n):
    x, shape = n.args[:2]
    w = n.args[2] if len(n.args) > 2 else None
    b = n.args[3] if len(n.args) > 3 else None
    eps = n.args[4] if len(n.args) > 4 else 1e-5
    if (w is None) != (b is None):
        raise LoweringError("layer_norm with weight but no bias")
    ins = [ctx.lt(x)] + ([ctx.lt(w), ctx.lt(b)] if w is not None else [])
    ctx.op(n, "LayerNorm", ins, [ctx.out(n)], begin_norm_axis=-len(shape), epsilon=float(eps),
           use_affine=w is not None, keep_stats=False)


def _softmax(ctx: Ctx, n):
    x, dim = n.args[:2]
    if n.target == aten._softmax.default and n.args[2]:
        raise LoweringError("half-to-float softmax")
    if _val(x).dtype != _val(n).dtype:
        raise LoweringError("softmax with a dtype change")
    ctx.op(n, "SoftMax", [ctx.lt(x)], [ctx.out(n)], axis=int(dim))


def _eltwise(kind, **attrs):
    def lower(ctx: Ctx, n):
        ctx.op(n, kind, [ctx.lt(n.args[0])], [ctx.out(n)], **attrs)
    lower.kind = kind
    return lower


def _gelu_approximate(n) -> str:
    return n.kwargs.get("approximate", n.args[1] if len(n.args) > 1 else "none")


def _gelu(ctx: Ctx, n):
    if _gelu_approximate(n) == "none":
        ctx.op(n, "GELU", [ctx.lt(n.args[0])], [ctx.out(n)])
        return
    # oneDNN Graph 3.2's GELU is erf-only: write the tanh form out,
    # 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), which oneDNN fuses as post-op chains.
    x = ctx.lt(n.args[0])
    like = _val(n)
    t = [ctx.inner(n, f"gelu{i}") for i in range(7)]
    bc = {"auto_broadcast": "numpy"}
    ctx.op(n, "Multiply", [x, x], [t[0]], **bc)                                      # x^2
    ctx.op(n, "Multiply", [t[0], ctx.scalar(0.044715, like)], [t[1]], **bc)          # c x^2
    ctx.op(n, "Add", [t[1], ctx.scalar(1.0, like)], [t[2]], **bc)                    # 1 + c x^2
    ctx.op(n, "Multiply", [x, t[2]], [t[3]], **bc)                                   # x + c x^3
    ctx.op(n, "Multiply", [t[3], ctx.scalar(0.7978845608028654, like)], [t[4]], **bc)
    ctx.op(n, "Tanh", [t[4]], [t[5]])
    ctx.op(n, "Add", [t[5], ctx.scalar(1.0, like)], [t[6]], **bc)
    half = ctx.inner(n, "half_x")
    ctx.op(n, "Multiply", [x, ctx.scalar(0.5, like)], [half], **bc)
    ctx.op(n, "Multiply", [half, t[6]], [ctx.out(n)], **bc)


def _silu(ctx: Ctx, n):
    x = n.args[0]
    sig = ctx.inner(n, "sigmoid")
    ctx.op(n, "Sigmoid", [ctx.lt(x)], [sig])
    ctx.op(n, "Multiply", [ctx.lt(x), sig], [ctx.out(n)], auto_broadcast="numpy")


def _hardsigmoid(ctx: Ctx, n):
    ctx.op(n, "HardSigmoid", [ctx.lt(n.args[0])], [ctx.out(n)], alpha=1.0 / 6.0, beta=0.5)


_hardsigmoid.kind = "HardSigmoid"
# a lowering's kind: the oneDNN op it emits when it emits one; GELU's tanh form is a chain of ops
_gelu.kind = lambda n: "GELU" if _gelu_approximate(n) == "none" else None


def _binary(kind):
    def lower(ctx: Ctx, n):
        a, b = n.args[:2]
        if n.kwargs.get("alpha", 1) != 1 or (len(n.args) > 2 and n.args[2] != 1):
            raise LoweringError(f"{kind} with alpha")
        out = _val(n)
        if not isinstance(a, torch.fx.Node):
            if kind in ("Subtract", "Divide"):
                raise LoweringError(f"scalar-first {kind}")
            a, b = b, a
        ctx.op(n, kind, [ctx.operand(a, out), ctx.operand(b, out)], [ctx.out(n)], auto_broadcast="numpy")
    lower.kind = kind
    return lower


def _pool(kind):
    def lower(ctx: Ctx, n):
        a = list(n.args) + [None] * 7
        x, kernel = a[0], _ints(a[1])
        stride = _ints(a[2]) if a[2] else kernel
        pads = _ints(a[3] if a[3] is not None else 0)
        if kind == "MaxPool":
            dil = _ints(a[4] if a[4] is not None else 1)
            ceil = bool(a[5])
            ctx.op(n, "MaxPool", [ctx.lt(x)], [ctx.out(n)], kernel=kernel, strides=stride, pads_begin=pads,
                   pads_end=pads, dilations=dil, rounding_type="ceil" if ceil else "floor", data_format="NCX")
        else:
            ceil, include_pad = bool(a[4]), a[5] if a[5] is not None else True
            if a[6] is not None:
                raise LoweringError("avg_pool2d with divisor_override")
            ctx.op(n, "AvgPool", [ctx.lt(x)], [ctx.out(n)], kernel=kernel, strides=stride, pads_begin=pads,
                   pads_end=pads, exclude_pad=not include_pad, rounding_type="ceil" if ceil else "floor",
                   data_format="NCX")
    return lower


def _adaptive_avg_pool2d(ctx: Ctx, n):
    x, out_size = n.args[:2]
    H, W = _val(x).shape[-2:]
    oh, ow = _ints(out_size)
    if H % oh or W % ow:
        raise LoweringError("adaptive pooling with uneven windows")
    k = [H // oh, W // ow]
    ctx.op(n, "AvgPool", [ctx.lt(x)], [ctx.out(n)], kernel=k, strides=k, pads_begin=[0, 0], pads_end=[0, 0],
           exclude_pad=True, rounding_type="floor", data_format="NCX")


def _mean(ctx: Ctx, n):
    x, dims = n.args[:2]
    keep = bool(n.args[2]) if len(n.args) > 2 else bool(n.kwargs.get("keepdim", False))
    if n.kwargs.get("dtype") is not None:
        raise LoweringError("mean with dtype")
    shape = _val(x).shape
    for d in dims:
        try:
            one = bool(shape[int(d)] == 1)
        except Exception:  # a symbolic size that cannot be decided here: it may be 1
            one = True
        if one:
            # oneDNN 3.2's reduction cannot be created when nothing is reduced, and its Graph
            # compile then throws a C++ exception through the C API, which aborts the process
            raise LoweringError(f"mean over dimension {int(d)} of size 1 (oneDNN's reduction refuses it)")
    ctx.op(n, "ReduceMean", [ctx.lt(x)], [ctx.out(n)], axes=[int(d) for d in dims], keep_dims=keep)


def _cat(ctx: Ctx, n):
    tensors, dim = n.args[0], (n.args[1] if len(n.args) > 1 else 0)
    out = _val(n)
    if any(_val(t).dtype != out.dtype or _val(t).dim() != out.dim() for t in tensors):
        raise LoweringError("cat with mixed dtypes or ranks")
    ctx.op(n, "Concat", [ctx.lt(t) for t in tensors], [ctx.out(n)], axis=int(dim))


def _typecast(ctx: Ctx, n):
    x = n.args[0]
    if _val(x).dtype == _val(n).dtype:
        raise LoweringError("no-op cast")
    ctx.op(n, "TypeCast", [ctx.lt(x)], [ctx.out(n)])


LOWERINGS = {
    aten.linear.default: _linear,
    aten.addmm.default: _addmm,
    aten.mm.default: _matmul,
    aten.bmm.default: _matmul,
    aten.matmul.default: _matmul,
    aten.conv2d.default: _conv2d,
    aten.batch_norm.default: _batch_norm,
    aten.layer_norm.default: _layer_norm,
    aten.softmax.int: _softmax,
    aten._softmax.default: _softmax,
    aten.relu.default: _eltwise("ReLU"),
    aten.relu_.default: _eltwise("ReLU"),
    aten.gelu.default: _gelu,
    aten.silu.default: _silu,
    aten.silu_.default: _silu,
    aten.sigmoid.default: _eltwise("Sigmoid"),
    aten.tanh.default: _eltwise("Tanh"),
    aten.hardswish.default: _eltwise("HardSwish"),
    aten.hardswish_.default: _eltwise("HardSwish"),
    aten.hardsigmoid.default: _hardsigmoid,
    aten.hardsigmoid_.default: _hardsigmoid,
    aten.add.Tensor: _binary("Add"),
    aten.add_.Tensor: _binary("Add"),
    aten.sub.Tensor: _binary("Subtract"),
    aten.mul.Tensor: _binary("Multiply"),
    aten.mul_.Tensor: _binary("Multiply"),
    aten.div.Tensor: _binary("Divide"),
    aten.max_pool2d.default: _pool("MaxPool"),
    aten.avg_pool2d.default: _pool("AvgPool"),
    aten.adaptive_avg_pool2d.default: _adaptive_avg_pool2d,
    aten.mean.dim: _mean,
    aten.cat.default: _cat,
    aten.to.dtype: _typecast,
    aten._to_copy.default: _typecast,
}

# What kind of work each lowered op is, for routing.
WORK_OF = {aten.linear.default: "gemm", aten.addmm.default: "gemm", aten.mm.default: "gemm",
           aten.bmm.default: "gemm", aten.matmul.default: "gemm", aten.conv2d.default: "conv"}


@dataclass
class LoweredGraph:
    partitions: list                       # [(Partition, [fx nodes], route)]
    fallbacks: dict                        # fx node -> reason (ran in torch)
    views: list                            # fx nodes run as torch views
    attention: list                        # (fx node, route)
    ctx: Ctx
    routed: list = field(default_factory=list)  # (fx node, (backend, why)): sent elsewhere by routing


# A partition of a lone LayerNorm fuses nothing: torch's own kernel does the same work without a partition
# step's per-call cost. Measured (Xeon with AMX, 2 threads, int8 BERT-base's 25 LayerNorms over 128 x 768,
# their adds fused into the int8 GEMMs): 80 us a call as a oneDNN Graph partition (31 us of it in oneDNN
# 3.2's jit:uni kernel), 16 us as aten.layer_norm; int8 BERT-base 22.5 -> 21.6 ms a call, fp32 BERT-base
# 86.7 -> 85.4, bf16 level (A/B in one process). Other lone ops stay partitions: lone adds in torch too
# gained fp32 BERT-base another 3% but left models whose linears all route to MKL with no partition.
# A lone mean (a classifier's global pooling) too: ConvNeXt-T's 1 x 768 x 7 x 7 bf16 mean took 714 us as
# a partition (oneDNN 3.2's reduction on that layout), 16 us in torch.
ONE_OP_IN_TORCH = {aten.layer_norm.default, aten.native_layer_norm.default, aten.mean.dim}
ONE_OP_PARTITION = ("a partition of this one op would fuse nothing: torch's kernel is faster than a partition "
                    "step's per-call cost (128 x 768 LayerNorm: 16 vs 80 us; ConvNeXt-T's pooling mean over "
                    "1 x 768 x 7 x 7 bf16: 16 vs 714 us)")

# oneDNN Graph fuses an elementwise op on a partition's input and a binary op reading its result into
# one eltwise primitive with a binary post-op, and oneDNN 3.2 has no jit eltwise kernel that takes
# post-ops: it runs `ref:any` (ONEDNN_VERBOSE). relu(x) * 2 over 1 x 120 x 28 x 28 took 5.4 ms as a
# partition, 0.02 in torch; MobileNetV3's squeeze-excitation scale hardsigmoid(s) * x, standing alone
# in int8 graphs (its convolutions are int8 primitives), 1.3-5.1 ms each, 25 of the int8 model's 34 ms
# (AMD EPYC Zen 4, 2 threads). Such a partition of elementwise and binary ops only runs in torch.
# oneDNN takes the eltwise result as either operand of Add and Multiply (x * relu(t) and
# x + relu(t) run `ref:any` too) but only as the first of Subtract and Divide (x - relu(t) is two jit
# primitives). Others keep their jit kernels: a binary op first (x * 2 + 1 then ReLU: a binary primitive
# with post-ops), and x * sigmoid(x) in either order, which oneDNN makes one swish eltwise (Zen 1).
ELTWISE_KINDS = frozenset({"ReLU", "GELU", "Sigmoid", "Tanh", "HardSwish", "HardSigmoid"})
BINARY_KINDS = frozenset({"Add", "Subtract", "Multiply", "Divide"})
COMMUTATIVE_KINDS = frozenset({"Add", "Multiply"})
ELTWISE_BINARY = ("oneDNN 3.2 runs an elementwise op with a fused binary op after it on its reference kernel "
                  "(relu(x) * 2 over 1 x 120 x 28 x 28: 5.4 ms as a partition, 0.02 in torch)")


def _kind(n: torch.fx.Node) -> str | None:
    """The oneDNN op kind node ``n`` lowers to, None for chains and unmapped nodes."""
    kind = getattr(LOWERINGS.get(n.target), "kind", None)
    return kind(n) if callable(kind) else kind


def _eltwise_binary(kinds, nodes: list) -> bool:
    """The partition is elementwise and binary ops only, and one of its elementwise ops reads the
    partition's input and feeds a binary op where oneDNN makes it an eltwise primitive with a binary
    post-op (the first operand; either operand of Add and Multiply; not x * sigmoid(x), a swish)."""
    if not set(kinds) <= ELTWISE_KINDS | BINARY_KINDS:
        return False
    inside = set(nodes)
    for n in nodes:
        kind = _kind(n)
        if kind not in ELTWISE_KINDS or any(a in inside for a in n.all_input_nodes):
            continue
        for u in n.users:
            ukind = _kind(u) if u in inside else None
            if ukind not in BINARY_KINDS:
                continue
            operands = [a for a in u.args[:2] if isinstance(a, torch.fx.Node)]   # a scalar first is swapped
            other = [a for a in operands if a is not n]
            if kind == "Sigmoid" and ukind == "Multiply" and other and other[0] is n.args[0]:
                continue   # swish
            if operands[0] is n or ukind in COMMUTATIVE_KINDS:
                return True
    return False


def _tensor_args(n: torch.fx.Node) -> list[torch.fx.Node]:
    return [a for a in n.all_input_nodes if _is_tensor(a) and _ok_dtype(_val(a))]


def lower(gm: torch.fx.GraphModule, dtype: str, exclude: dict | None = None) -> LoweredGraph:
    """Build the oneDNN graph for ``gm`` and partition it. ``exclude``: node name -> why that node
    must run in torch (validation found the partition holding it wrong)."""
    exclude = exclude or {}
    from .passes import mutated_state

    g = G.Graph()
    ctx = Ctx(gm, g, dtype)
    ctx.state = mutated_state(gm)
    fallbacks, views, attention, routed = {}, [], [], []
    routes = {w: routing.route(w, dtype) for w in set(WORK_OF.values())}
    pos = {n: i for i, n in enumerate(gm.graph.nodes)}
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "get_attr"):
            continue
        chosen = n.meta.get("cpu_opt_route")  # a linear layer's own route (passes.route_linears)
        if chosen is not None and chosen[0] != "onednn":
            routed.append((n, chosen))  # sent to another backend
            _wildcard(ctx, n)
            continue
        if n.op == "output":
            outs = [a for a in _flatten(n.args[0]) if isinstance(a, torch.fx.Node) and _is_tensor(a) and _ok_dtype(_val(a))]
            for k, a in enumerate(dict.fromkeys(outs)):
                g.op("End", [ctx.lt(a)], [], name=f"graph_output_{k}")
            continue
        fn = LOWERINGS.get(n.target) if n.op == "call_function" else None
        reason = None
        if fn is not None and (why := _inplace_hazard(n, pos)) is not None:
            reason, fn = why, None
        if fn is not None and n.name in exclude:
            reason, fn = exclude[n.name], None
        work = WORK_OF.get(n.target) if chosen is None else None  # routed linear layers are decided
        if fn is not None and work is not None and routes[work].backend != "onednn":
            reason = f"routed to {routes[work].backend}: {routes[work].why}"
            fn = None
        if fn is not None:
            try:
                fn(ctx, n)
                continue
            except LoweringError as e:
                reason = f"not lowered: {e}"
            except Exception as e:  # noqa: BLE001 - oneDNN refused the op: run it in torch
                reason = f"oneDNN rejected it: {e}"
        if n.target in VIEW_OPS:
            views.append(n)
        elif (taken := _attention_taken(n, dtype)) is not None:
            attention.append((n, taken))
        else:
            fallbacks[n] = reason or f"no oneDNN Graph mapping for {_target_name(n)}"
        _wildcard(ctx, n)
    parts = []
    for p in g.partitions():
        nodes = list(dict.fromkeys(ctx.op_node[i] for i in p.op_ids if i in ctx.op_node))
        if not nodes:
            continue  # wildcard / End partitions
        if not p.supported:
            for nd in nodes:
                fallbacks.setdefault(nd, "oneDNN returned this op in an unsupported partition")
            continue
        if len(nodes) == 1 and nodes[0].target in ONE_OP_IN_TORCH:
            routed.append((nodes[0], ("torch", ONE_OP_PARTITION)))
            continue
        if _eltwise_binary(p.op_kinds, nodes):
            routed.extend((nd, ("torch", ELTWISE_BINARY)) for nd in nodes)
            continue
        parts.append((p, nodes))
    return LoweredGraph(parts, fallbacks, views, attention, ctx, routed)


def _inplace_hazard(n: torch.fx.Node, pos: dict) -> str | None:
    """Why an in-place op must stay in torch, or None when running it out of place is the same.
    oneDNN Graph ops write new tensors; that equals the in-place op only if nobody can see the
    tensor it writes into: not a model input, parameter or buffer (the caller or the next call would
    see the write), and no other node reading it after the write."""
    from .passes import storage_root, writes_in_place

    for w in writes_in_place(n):
        root = storage_root(w)
        if root.op in ("placeholder", "get_attr"):
            what = "a model input" if root.op == "placeholder" else "a parameter or buffer"
            return f"writes into {what} ({root.name}) in place: kept in torch, so the write happens"
        if w is not root or any(u is not n and pos.get(u, -1) > pos[n] for u in w.users):
            return f"writes in place into {w.name}, which is read elsewhere: kept in torch for its aliasing"
    return None


def _flatten(a):
    if isinstance(a, (list, tuple)):
        for x in a:
            yield from _flatten(x)
    else:
        yield a


def _target_name(n) -> str:
    """``aten.cumsum.default`` for ATen ops, the function name otherwise."""
    t = n.target
    return str(t) if hasattr(t, "_schema") else getattr(t, "__name__", str(t))


def _wildcard(ctx: Ctx, n: torch.fx.Node) -> None:
    """Tell oneDNN about a node it will not run: its tensor inputs and outputs."""
    if n.target is operator.getitem:
        return  # its output lt is an output of the producer's wildcard
    ins = [ctx.lt(a) for a in dict.fromkeys(_tensor_args(n))]
    v = _val(n)
    outs = []
    if isinstance(v, torch.Tensor):
        if _ok_dtype(v):
            outs.append(ctx.lt(n))
    elif isinstance(v, (tuple, list)):
        for u in n.users:
            if u.target is operator.getitem and _is_tensor(u) and _ok_dtype(_val(u)):
                outs.append(ctx.lt(u))
    if not ins and not outs:
        return
    ctx.g.op("Wildcard", ins, outs, name=f"{n.name}_wildcard")
