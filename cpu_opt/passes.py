"""Graph passes on the captured ATen-level FX graph, before lowering.

Each pass takes a GraphModule, rewrites it in place and returns a short log of what it did:

* :func:`drop_dropout` — dropout is the identity in inference
* :func:`remove_noops` — same-shape views/reshapes, ``clone``/``contiguous``/``alias``/``to`` that
  change nothing, export's tensor-metadata asserts and guards
* :func:`fold_batchnorm` — inference BatchNorm after a convolution or linear layer becomes part
  of its weights and bias
* :func:`fold_constants` — nodes computed only from parameters/buffers are computed once
* :func:`cast_params` — floating parameters and buffers converted once (bf16)
"""
from __future__ import annotations

import operator

import torch
import torch.fx

aten = torch.ops.aten

DROPOUT = {aten.dropout.default, aten.dropout_.default, aten.feature_dropout.default,
           aten.alpha_dropout.default, torch.nn.functional.dropout}
VIEW_LIKE = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
IDENTITY_LIKE = {aten.clone.default, aten.contiguous.default, aten.alias.default, aten.detach.default,
                 aten.lift_fresh_copy.default}
ASSERTS = {aten._assert_tensor_metadata.default, aten._assert_async.msg, aten._assert_scalar.default,
           aten.sym_constrain_range_for_size.default}


def _val(n):
    return n.meta.get("val") if isinstance(n, torch.fx.Node) else None


def _replace(node: torch.fx.Node, with_: torch.fx.Node) -> None:
    node.replace_all_uses_with(with_)
    node.graph.erase_node(node)


def drop_dropout(gm: torch.fx.GraphModule) -> list[str]:
    log = []
    for n in list(gm.graph.nodes):
        if n.op == "call_function" and n.target in DROPOUT:
            _replace(n, n.args[0])
            log.append(n.name)
        elif n.op == "call_module" and isinstance(gm.get_submodule(n.target), torch.nn.Dropout):
            _replace(n, n.args[0])
            log.append(n.name)
    return [f"dropped {len(log)} dropout op(s)"] if log else []


def remove_noops(gm: torch.fx.GraphModule) -> list[str]:
    removed = 0
    for n in list(gm.graph.nodes):
        if n.op != "call_function":
            continue
        if n.target in ASSERTS and not n.users:
            gm.graph.erase_node(n)
            removed += 1
            continue
        src = n.args[0] if n.args else None
        vi, vo = _val(src), _val(n)
        same = isinstance(vi, torch.Tensor) and isinstance(vo, torch.Tensor) and vi.shape == vo.shape \
            and vi.dtype == vo.dtype and vi.stride() == vo.stride()
        if not same:
            continue
        fmt = n.kwargs.get("memory_format")
        if n.target in VIEW_LIKE or (n.target in IDENTITY_LIKE and fmt in (None, torch.preserve_format)) \
                or n.target in (aten.to.dtype, aten._to_copy.default, aten.to.dtype_layout):
            _replace(n, src)
            removed += 1
    for n in list(gm.graph.nodes):  # export's guard module, when present
        if n.op == "call_module" and n.target == "_guards_fn":
            gm.graph.erase_node(n)
            removed += 1
    return [f"removed {removed} no-op reshape/copy/assert node(s)"] if removed else []


def _get_param(gm, node):
    if node is None:
        return None
    if node.op != "get_attr":
        raise _NotFoldable
    obj = gm
    for part in node.target.split("."):
        obj = getattr(obj, part)
    return obj


class _NotFoldable(Exception):
    pass


_new_attr = iter(range(1 << 30))


def _add_param(gm, tensor, before: torch.fx.Node, hint: str) -> torch.fx.Node:
    name = f"_cpu_opt_{hint}_{next(_new_attr)}"
    gm.register_buffer(name, tensor.detach().contiguous())
    with gm.graph.inserting_before(before):
        node = gm.graph.get_attr(name)
    node.meta["val"] = torch.empty_like(tensor, device="meta")
    return node


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
        return [_get_param(gm, t) for t in (w, b, mean, var)] + [float(eps)]
    except _NotFoldable:
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
            w = _get_param(gm, prod.args[1])
            b = _get_param(gm, prod.args[2] if len(prod.args) > 2 else None)
        except _NotFoldable:
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
        wn = _add_param(gm, new_w, prod, "w")
        bn = _add_param(gm, new_b, prod, "b")
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
                    _replace(u, prod)
            if not n.users:
                gm.graph.erase_node(n)
        else:
            _replace(n, prod)
        folded += 1
    gm.graph.eliminate_dead_code()
    _drop_unused_attrs(gm)
    return [f"folded {folded} BatchNorm(s) into conv/linear weights"] if folded else []


def _drop_unused_attrs(gm):
    used = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    for name, _ in list(gm.named_buffers()) + list(gm.named_parameters()):
        if name.startswith("_cpu_opt_") and name not in used:
            delattr(gm, name)


_NONDETERMINISTIC = {aten.rand.default, aten.randn.default, aten.randint.low, aten.bernoulli.default,
                     aten.empty.memory_format, aten.empty_like.default}


def fold_constants(gm: torch.fx.GraphModule) -> list[str]:
    """Evaluate nodes whose inputs are all parameters/buffers/literals, once."""
    const: dict[torch.fx.Node, object] = {}
    folded = 0
    for n in list(gm.graph.nodes):
        if n.op == "get_attr":
            try:
                const[n] = _get_param(gm, n)
            except Exception:
                pass
            continue
        if n.op != "call_function" or n.target in _NONDETERMINISTIC or n.target in ASSERTS:
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
            node = _add_param(gm, val.clone(), n, "const")
            const[node] = val
            _replace(n, node)
            folded += 1
        else:
            const[n] = val
    gm.graph.eliminate_dead_code()
    _drop_unused_attrs(gm)
    return [f"folded {folded} constant subexpression(s)"] if folded else []


def cast_params(gm: torch.fx.GraphModule, dtype: torch.dtype) -> list[str]:
    """Convert every floating parameter/buffer to ``dtype`` once."""
    n = 0
    for mod in gm.modules():
        for name, p in list(mod.named_parameters(recurse=False)):
            if p.is_floating_point() and p.dtype != dtype:
                mod._parameters[name] = torch.nn.Parameter(p.detach().to(dtype), requires_grad=False)
                n += 1
        for name, b in list(mod.named_buffers(recurse=False)):
            if b is not None and b.is_floating_point() and b.dtype != dtype:
                mod._buffers[name] = b.to(dtype)
                n += 1
    return [f"cast {n} parameter/buffer tensor(s) to {dtype}"] if n else []


DEFAULT_PASSES = (drop_dropout, remove_noops, fold_batchnorm, fold_constants)


def run_passes(gm: torch.fx.GraphModule, passes=DEFAULT_PASSES) -> list[str]:
    log = []
    for p in passes:
        log += p(gm)
        gm.graph.lint()
    gm.recompile()
    return log
