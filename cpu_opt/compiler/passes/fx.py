"""FX helpers the passes share: node values, replacing nodes, the graph's constants (parameters,
buffers and the tensors cpu_opt adds), and which nodes write into or alias which storage."""
from __future__ import annotations

import torch
import torch.fx

aten = torch.ops.aten

ASSERTS = {aten._assert_tensor_metadata.default, aten._assert_async.msg, aten._assert_scalar.default,
           aten.sym_constrain_range_for_size.default}


def region_graphs(gm: torch.fx.GraphModule):
    """``(submodule, operands)`` for every region a higher-order op runs (``wrap_with_set_grad_enabled``,
    ``wrap_with_autocast``: export's form of a ``torch.no_grad()`` / ``torch.autocast(enabled=False)``
    block in the model's code): the region's GraphModule and the outer nodes bound to its
    placeholders, in order."""
    for n in gm.graph.nodes:
        if n.op != "call_function" or not isinstance(n.target, torch._ops.HigherOrderOperator):
            continue
        for i, a in enumerate(n.args):
            if isinstance(a, torch.fx.Node) and a.op == "get_attr":
                sub = getattr(gm, a.target, None)
                if isinstance(sub, torch.fx.GraphModule):
                    yield sub, list(n.args[i + 1:])
                    break


def asserted_float32_state(gm: torch.fx.GraphModule) -> set:
    """Names of the parameters / buffers the model's code reads as float32 by its own choice: an
    ``_assert_tensor_metadata(t, dtype=float32)`` on them (export writes one for ``t.float()`` /
    ``t.to(torch.float32)``) in the graph or in a region it runs (a RoPE's ``inv_freq`` inside
    ``autocast(enabled=False)``)."""
    out = set()

    def scan(graph, bound):
        for n in graph.nodes:
            if n.op == "call_function" and n.target == aten._assert_tensor_metadata.default and \
                    n.kwargs.get("dtype") == torch.float32 and isinstance(n.args[0], torch.fx.Node):
                src = bound.get(n.args[0], n.args[0])
                if isinstance(src, torch.fx.Node) and src.op == "get_attr":
                    out.add(src.target)

    scan(gm.graph, {})
    for sub, operands in region_graphs(gm):
        phs = [n for n in sub.graph.nodes if n.op == "placeholder"]
        scan(sub.graph, dict(zip(phs, operands)))
    return out


def node_value(n):
    return n.meta.get("val") if isinstance(n, torch.fx.Node) else None


def replace_node(node: torch.fx.Node, with_: torch.fx.Node) -> None:
    node.replace_all_uses_with(with_)
    node.graph.erase_node(node)


def get_constant(gm, node):
    if node is None:
        return None
    if node.op != "get_attr":
        raise NotConstant
    obj = gm
    for part in node.target.split("."):
        obj = getattr(obj, part)
    return obj


class NotConstant(Exception):
    pass


_new_attr = iter(range(1 << 30))


def add_constant(gm, tensor, before: torch.fx.Node, hint: str, meta_like: torch.Tensor | None = None) -> torch.fx.Node:
    """A constant of cpu_opt's making (folded, transposed, prepacked) as a buffer of ``gm``;
    ``meta_like`` describes it where the tensor itself has no plain layout (an mkldnn-packed weight)."""
    name = f"_cpu_opt_{hint}_{next(_new_attr)}"
    gm.register_buffer(name, tensor.detach() if tensor.layout != torch.strided else tensor.detach().contiguous())
    with gm.graph.inserting_before(before):
        node = gm.graph.get_attr(name)
    node.meta["val"] = torch.empty_like(meta_like if meta_like is not None else tensor, device="meta")
    return node


def swap_routed(gm: torch.fx.GraphModule, n: torch.fx.Node, target, args, route: str, why: str) -> torch.fx.Node:
    """Replace node ``n`` (a linear layer, a convolution) by ``target(*args)`` on ``route``, under
    ``n``'s name (the report names the layer as the captured graph did); returns the new node."""
    with gm.graph.inserting_before(n):
        new = gm.graph.call_function(target, args)
    new.meta = dict(n.meta)
    new.meta["cpu_opt_route"] = (route, why)
    name = n.name
    replace_node(n, new)
    new._rename(name)
    return new


def drop_unused_constants(gm):
    used = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    for name, _ in list(gm.named_buffers()) + list(gm.named_parameters()):
        if name.startswith("_cpu_opt_") and name not in used:
            delattr(gm, name)


def writes_in_place(n: torch.fx.Node) -> list[torch.fx.Node]:
    """The argument nodes ``n`` writes into (in-place ops, ``out=`` variants, ``copy_``): the schema
    arguments annotated ``Tensor(a!)``. Empty for everything else."""
    schema = getattr(n.target, "_schema", None) if n.op == "call_function" else None
    if schema is None or not schema.is_mutable:
        return []
    out = []
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        v = n.args[i] if i < len(n.args) else n.kwargs.get(arg.name)
        if isinstance(v, torch.fx.Node):
            out.append(v)
    return out


def storage_root(n: torch.fx.Node) -> torch.fx.Node:
    """The node whose storage ``n`` may view: follows ops whose schema says the output aliases
    their first input (views, in-place ops) back to where the memory was made."""
    seen = set()
    while n.op == "call_function" and n not in seen:
        seen.add(n)
        schema = getattr(n.target, "_schema", None)
        if schema is None or not any(r.alias_info is not None for r in schema.returns):
            break
        src = n.args[0] if n.args and isinstance(n.args[0], torch.fx.Node) else None
        if src is None:
            break
        n = src
    return n


def mutated_state(gm: torch.fx.GraphModule) -> set:
    """Placeholders and get_attr nodes (model inputs, parameters, buffers) the graph writes into."""
    out = set()
    for n in gm.graph.nodes:
        for w in writes_in_place(n):
            root = storage_root(w)
            if root.op in ("placeholder", "get_attr"):
                out.add(root)
    return out
