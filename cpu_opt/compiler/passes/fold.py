"""Folding passes: :func:`fold_batchnorm` (inference BatchNorm after a convolution or linear layer
becomes part of its weights and bias), :func:`fold_constants` (nodes computed only from
parameters/buffers are computed once), :func:`fold_linear_scale` (a constant per-output-channel
scale after a linear layer, the layer scale of ConvNeXt / CaiT / DeiT-III blocks, becomes part of
its weight and bias) and :func:`cast_params` (floating parameters and buffers converted once, for
bf16)."""
from __future__ import annotations

import operator

import torch
import torch.fx

from .fx import (ASSERTS, NotConstant, add_constant, drop_unused_constants, get_constant, mutated_state,
                 replace_node, writes_in_place)

aten = torch.ops.aten


def _bn_params(gm, n):
    """(weight, bias, mean, var, eps) of an inference batch-norm node, or None."""
    if n.target == aten.batch_norm.default:
        x, w, b, mean, var, training, _mom, eps = n.args[:8]
        if training:
            return None
    elif n.target == aten._native_batch_norm_legit_no_training.default:
        x, w, b, mean, var, _mom, eps = n.args[:7]
    else:
        return None
    try:
        return [get_constant(gm, t) for t in (w, b, mean, var)] + [float(eps)]
    except NotConstant:
        return None


def fold_batchnorm(gm: torch.fx.GraphModule) -> list[str]:
    folded = 0
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or n.target not in (aten.batch_norm.default,
                                                       aten._native_batch_norm_legit_no_training.default):
            continue
        prod = n.args[0]
        if not isinstance(prod, torch.fx.Node) or prod.op != "call_function" or len(prod.users) != 1:
            continue
        if prod.target not in (aten.conv2d.default, aten.linear.default, aten.convolution.default):
            continue
        p = _bn_params(gm, n)
        if p is None:
            continue
        bw, bb, mean, var, eps = p
        try:
            w = get_constant(gm, prod.args[1])
            b = get_constant(gm, prod.args[2] if len(prod.args) > 2 else None)
        except NotConstant:
            continue
        if prod.target == aten.convolution.default and prod.args[6]:  # transposed
            continue
        with torch.no_grad():
            scale = (bw if bw is not None else torch.ones_like(var)) / torch.sqrt(var + eps)
            shift = (bb if bb is not None else torch.zeros_like(mean)) - mean * scale
            shape = (-1,) + (1,) * (w.dim() - 1)
            new_w = (w.double() * scale.double().reshape(shape)).to(w.dtype)
            new_b = ((b.double() if b is not None else torch.zeros_like(mean, dtype=torch.float64)) * scale.double()
                     + shift.double()).to(w.dtype)
        wn = add_constant(gm, new_w, prod, "w")
        bn = add_constant(gm, new_b, prod, "b")
        args = list(prod.args)
        args[1] = wn
        if len(args) > 2:
            args[2] = bn
        else:
            args.append(bn)
        prod.args = tuple(args)
        if n.target == aten._native_batch_norm_legit_no_training.default:
            for u in list(n.users):
                if u.target is operator.getitem and u.args[1] == 0:
                    replace_node(u, prod)
            if not n.users:
                gm.graph.erase_node(n)
        else:
            replace_node(n, prod)
        folded += 1
    gm.graph.eliminate_dead_code()
    drop_unused_constants(gm)
    return [f"folded {folded} BatchNorm(s) into conv/linear weights"] if folded else []


_NONDETERMINISTIC = {aten.rand.default, aten.randn.default, aten.randint.low, aten.bernoulli.default,
                     aten.empty.memory_format, aten.empty_like.default}


def fold_constants(gm: torch.fx.GraphModule) -> list[str]:
    """Evaluate nodes whose inputs are all parameters/buffers/literals, once. A buffer the graph
    writes into (a running count, a cache) is state, not a constant: nothing reading it is folded,
    and no in-place op is ever evaluated here (it would write into the model's own tensors)."""
    const: dict[torch.fx.Node, object] = {}
    state = mutated_state(gm)
    folded = 0
    for n in list(gm.graph.nodes):
        if n.op == "get_attr":
            if n in state:
                continue
            try:
                const[n] = get_constant(gm, n)
            except Exception:
                pass
            continue
        if n.op != "call_function" or n.target in _NONDETERMINISTIC or n.target in ASSERTS or writes_in_place(n):
            continue
        inputs = n.all_input_nodes
        if not inputs or not all(i in const for i in inputs):
            continue
        args, kwargs = torch.fx.node.map_arg((n.args, n.kwargs), lambda a: const[a])
        try:
            with torch.no_grad():
                val = n.target(*args, **kwargs)
        except Exception:
            continue
        if isinstance(val, torch.Tensor):
            node = add_constant(gm, val.clone(), n, "const")
            const[node] = val
            replace_node(n, node)
            folded += 1
        else:
            const[n] = val
    gm.graph.eliminate_dead_code()
    drop_unused_constants(gm)
    return [f"folded {folded} constant subexpression(s)"] if folded else []


def _channel_scale(gm, n, lin, state):
    """The constant of ``mul(lin, c)`` / ``mul(c, lin)`` as a vector over ``lin``'s output channels
    (its last dimension), or None: ``c`` must be a float tensor constant of ``lin``'s dtype that only
    varies along that dimension (shape ``(N,)``, ``(1, .., N)`` or one element)."""
    other = n.args[1] if n.args[0] is lin else n.args[0]
    if not isinstance(other, torch.fx.Node) or other.op != "get_attr" or other in state:
        return None
    try:
        c = get_constant(gm, other)
    except NotConstant:
        return None
    vl, vm = lin.meta.get("val"), n.meta.get("val")
    if not isinstance(c, torch.Tensor) or not isinstance(vl, torch.Tensor) or not isinstance(vm, torch.Tensor):
        return None
    out = vl.shape[-1]
    if c.dtype != vl.dtype or vm.dtype != vl.dtype or tuple(vm.shape) != tuple(vl.shape) or c.dim() > vl.dim():
        return None
    if c.numel() == 1:
        return c.reshape(1).expand(out)
    if c.dim() == 0 or c.shape[-1] != out or c.numel() != out:
        return None
    return c.reshape(out)


def fold_linear_scale(gm: torch.fx.GraphModule) -> list[str]:
    """``linear(x, W, b) * gamma`` with a constant ``gamma`` over the output channels becomes
    ``linear(x, gamma[:, None] * W, gamma * b)``: one elementwise pass less per block (ConvNeXt's
    layer scale). Only where the linear layer's result has no other reader."""
    from .linear import linear_operands

    state = mutated_state(gm)
    folded = 0
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or n.target != aten.mul.Tensor or len(n.args) != 2:
            continue
        lin = next((a for a in n.args if isinstance(a, torch.fx.Node) and a.op == "call_function"
                    and len(a.users) == 1), None)
        ops = linear_operands(gm, lin) if lin is not None else None
        if ops is None or ops[1] in state or (ops[4] is not None and ops[4] in state):
            continue
        gamma = _channel_scale(gm, n, lin, state)
        if gamma is None:
            continue
        _x, w, wt, kn, b = ops
        with torch.no_grad():
            g64 = gamma.double()
            new_w = (wt.double() * (g64.reshape(1, -1) if kn else g64.reshape(-1, 1))).to(wt.dtype)
            bt = get_constant(gm, b)
            new_b = (bt.double() * g64).to(bt.dtype) if bt is not None else None
        args = list(lin.args)
        wpos = 1 if lin.target == aten.linear.default else 2 if lin.target == aten.addmm.default else 1
        args[wpos] = add_constant(gm, new_w, lin, "w")
        if new_b is not None:
            args[0 if lin.target == aten.addmm.default else 2] = add_constant(gm, new_b, lin, "b")
        lin.args = tuple(args)
        replace_node(n, lin)
        folded += 1
    if folded:
        gm.graph.eliminate_dead_code()
        drop_unused_constants(gm)
    return [f"folded {folded} per-channel scale(s) into linear weights"] if folded else []


def _layer_norm_affine(gm: torch.fx.GraphModule) -> set:
    """Qualified names of the parameters read only as a ``layer_norm``'s weight or bias."""
    keep = set()
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target == aten.layer_norm.default:
            for a in n.args[2:4]:
                if isinstance(a, torch.fx.Node) and a.op == "get_attr" and all(
                        u.op == "call_function" and u.target == aten.layer_norm.default and a in u.args[2:4]
                        for u in a.users):
                    keep.add(a.target)
    return keep


def cast_params(gm: torch.fx.GraphModule, dtype: torch.dtype) -> list[str]:
    """Convert every floating parameter/buffer to ``dtype`` once, except the affine weight and bias
    of LayerNorms, which stay fp32: oneDNN Graph 3.2 takes a bf16 LayerNorm only with fp32 gamma and
    beta (with bf16 ones it returns the op as an unsupported partition, and the 25 LayerNorms of
    BERT-base ran in torch), and torch's layer_norm takes that mix too; and the state the model reads
    as float32 itself (``remove_noops`` notes it from export's dtype asserts: Llama's RoPE
    ``inv_freq``, whose angles the model computes in float32 with autocast off)."""
    n = 0
    keep = _layer_norm_affine(gm) | set(gm.meta.get("cpu_opt_float32_state", ())) if dtype == torch.bfloat16 else set()
    for prefix, mod in gm.named_modules():
        for name, p in list(mod.named_parameters(recurse=False)):
            if f"{prefix}.{name}".lstrip(".") in keep:
                continue
            if p.is_floating_point() and p.dtype != dtype:
                mod._parameters[name] = torch.nn.Parameter(p.detach().to(dtype), requires_grad=False)
                n += 1
        for name, b in list(mod.named_buffers(recurse=False)):
            if f"{prefix}.{name}".lstrip(".") in keep:
                continue
            if b is not None and b.is_floating_point() and b.dtype != dtype:
                mod._buffers[name] = b.to(dtype)
                n += 1
    return [f"cast {n} parameter/buffer tensor(s) to {dtype}"] if n else []


# ops whose floating operands must share a dtype (autocast's lower-precision list, the ones models use)
_SAME_DTYPE = {aten.linear.default: 3, aten.addmm.default: 3, aten.mm.default: 2, aten.bmm.default: 2,
               aten.matmul.default: 2, aten.baddbmm.default: 3, aten.scaled_dot_product_attention.default: 3,
               aten.conv1d.default: 3, aten.conv2d.default: 3}
# in-place writes: the position of the value written (cast to the destination's dtype)
_WRITTEN = {aten.index_copy_.default: 3, aten.index_copy.default: 3, aten.index_put_.default: 2,
            aten.index_put.default: 2, aten.slice_scatter.default: 1, aten.select_scatter.default: 1}


def match_operand_dtypes(gm: torch.fx.GraphModule, flat_in, dtype: torch.dtype = torch.bfloat16) -> list[str]:
    """In a graph cast to ``dtype``, what the model computes in float32 by its own choice (RMSNorm's
    ``x.to(torch.float32)``, RoPE angles in ``autocast(enabled=False)``: the trace wrote ``.to(x.dtype)``
    back as float32, a no-op then) meets bf16 operands. As ``torch.autocast`` would, a GEMM, convolution
    or attention with mixed floating operands casts its float32 ones to ``dtype``, and an in-place write
    (a KV cache's ``index_copy_``) casts the value to its destination's dtype. Runs the graph on fake
    tensors to see the dtypes (no compute). Llama in bf16 failed without it (SDPA with float32 q/k and
    bf16 v, linear layers with a float32 input)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    graph = gm.graph
    inserted = 0

    def cast(n, i, a, to, env):
        nonlocal inserted
        with graph.inserting_before(n):
            c = graph.call_function(aten._to_copy.default, (a,), {"dtype": to})
        env[c] = env[a].to(to)
        n.update_arg(i, c)
        inserted += 1

    class _Match(torch.fx.Interpreter):
        def run_node(self, n):
            if n.op == "call_function" and (n.target in _SAME_DTYPE or n.target in _WRITTEN):
                def fl(a):
                    v = self.env.get(a) if isinstance(a, torch.fx.Node) else None
                    return v if isinstance(v, torch.Tensor) and v.is_floating_point() else None
                if n.target in _SAME_DTYPE:
                    ops = [(i, a) for i, a in enumerate(n.args[:_SAME_DTYPE[n.target]]) if fl(a) is not None]
                    dts = {fl(a).dtype for _, a in ops}
                    if dtype in dts and len(dts) > 1:
                        for i, a in ops:
                            if fl(a).dtype == torch.float32:
                                cast(n, i, a, dtype, self.env)
                else:
                    i = _WRITTEN[n.target]
                    dst, src = fl(n.args[0]), fl(n.args[i]) if len(n.args) > i else None
                    if dst is not None and src is not None and dst.dtype != src.dtype:
                        cast(n, i, n.args[i], dst.dtype, self.env)
            return super().run_node(n)

    with torch.no_grad():
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        fake_in = [mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in flat_in]
        with mode:
            _Match(gm).run(*fake_in)
    if not inserted:
        return []
    gm.recompile()
    return [f"{inserted} float32 operand(s) cast to {dtype} where a GEMM, attention or in-place write meets {dtype} "
            f"(autocast's rule)"]
