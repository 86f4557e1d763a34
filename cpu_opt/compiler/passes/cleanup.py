"""Clean-up passes: :func:`drop_dropout` (dropout is the identity in inference) and
:func:`remove_noops` (same-shape views/reshapes, copies that change nothing, export's
tensor-metadata asserts and guards)."""
from __future__ import annotations

import torch
import torch.fx

from .fx import ASSERTS, asserted_float32_state, node_value, region_graphs, replace_node, storage_root, writes_in_place

aten = torch.ops.aten

DROPOUT = {aten.dropout.default, aten.dropout_.default, aten.feature_dropout.default,
           aten.alpha_dropout.default, torch.nn.functional.dropout}
VIEW_LIKE = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
IDENTITY_LIKE = {aten.clone.default, aten.contiguous.default, aten.alias.default, aten.detach.default,
                 aten.lift_fresh_copy.default}


def drop_dropout(gm: torch.fx.GraphModule) -> list[str]:
    log = []
    for n in list(gm.graph.nodes):
        if n.op == "call_function" and n.target in DROPOUT:
            replace_node(n, n.args[0])
            log.append(n.name)
        elif n.op == "call_module" and isinstance(gm.get_submodule(n.target), torch.nn.Dropout):
            replace_node(n, n.args[0])
            log.append(n.name)
    return [f"dropped {len(log)} dropout op(s)"] if log else []


def remove_noops(gm: torch.fx.GraphModule) -> list[str]:
    removed = 0
    # what the asserts say the model reads as float32 (cast_params keeps it so), before they go
    gm.meta.setdefault("cpu_opt_float32_state", set()).update(asserted_float32_state(gm))
    for sub, _ in region_graphs(gm):  # asserts inside regions (a bf16 plan would trip them)
        for n in list(sub.graph.nodes):
            if n.op == "call_function" and n.target in ASSERTS and not n.users:
                sub.graph.erase_node(n)
                removed += 1
        sub.recompile()
    # a copy that an in-place op writes into (or whose source one writes into) is what keeps the
    # two apart: it is not a no-op, whatever its shape
    written = {storage_root(w) for n in gm.graph.nodes for w in writes_in_place(n)}
    for n in list(gm.graph.nodes):
        if n.op != "call_function":
            continue
        if n.target in ASSERTS and not n.users:
            gm.graph.erase_node(n)
            removed += 1
            continue
        src = n.args[0] if n.args else None
        vi, vo = node_value(src), node_value(n)
        same = isinstance(vi, torch.Tensor) and isinstance(vo, torch.Tensor) and vi.shape == vo.shape \
            and vi.dtype == vo.dtype and vi.stride() == vo.stride()
        if not same:
            continue
        fmt = n.kwargs.get("memory_format")
        copies = n.target in IDENTITY_LIKE or n.target in (aten.to.dtype, aten._to_copy.default, aten.to.dtype_layout)
        if copies and (n in written or (isinstance(src, torch.fx.Node) and storage_root(src) in written)):
            continue
        if n.target in VIEW_LIKE or (n.target in IDENTITY_LIKE and fmt in (None, torch.preserve_format)) \
                or n.target in (aten.to.dtype, aten._to_copy.default, aten.to.dtype_layout):
            replace_node(n, src)
            removed += 1
    for n in list(gm.graph.nodes):  # export's guard module, when present
        if n.op == "call_module" and n.target == "_guards_fn":
            gm.graph.erase_node(n)
            removed += 1
    return [f"removed {removed} no-op reshape/copy/assert node(s)"] if removed else []
