"""The runtime: a straight-line FX program whose steps are compiled oneDNN partitions and torch
calls.

:func:`build_program` rewrites the captured graph: each supported partition's nodes are replaced
by one call to a :class:`PartitionStep` (which returns the partition's outputs), everything else
stays a torch call. ``GraphModule`` code generation then gives a plain Python function: per call
there is no graph walking, only the steps. A :class:`PartitionStep` compiles for the strides of
the tensors it first sees (cached by signature), binds torch storage to oneDNN tensors without
copies, and reuses its output buffers across calls unless they can escape to the caller.
"""
from __future__ import annotations

import operator

import torch
import torch.fx

from ..backends.onednn_graph import PartitionStep
from .lowering import LoweredGraph

aten = torch.ops.aten


def may_alias_inputs(n: torch.fx.Node) -> bool:
    """Can ``n``'s output share memory with one of its inputs? Decided by the op's schema, not by a
    list of view ops: a return with an alias annotation (``Tensor(a)``: narrow, movedim, expand,
    unfold, as_strided, view.dtype, tensor_split, contiguous, in-place ops ...) may alias. Calls
    without a schema (Python functions, getitem of a tuple of views) are assumed to."""
    if n.op != "call_function":
        return n.op in ("call_method", "call_module")
    if n.target is operator.getitem:
        return True
    if getattr(n.target, "output_aliases_inputs", True) is False:  # declared by the callable (int8 kernels)
        return False
    schema = getattr(n.target, "_schema", None)
    if schema is None:
        return True
    return any(r.alias_info is not None for r in schema.returns)


def _escaping(gm: torch.fx.GraphModule) -> set:
    """Nodes whose storage can reach the caller: graph outputs and everything they may alias,
    transitively. A partition output in this set gets a fresh buffer on every call; the others
    reuse theirs (no caller can see them)."""
    out = set()
    stack = []
    for n in gm.graph.nodes:
        if n.op == "output":
            stack += [a for a in n.all_input_nodes]
    while stack:
        n = stack.pop()
        if n in out:
            continue
        out.add(n)
        if may_alias_inputs(n):
            stack += n.all_input_nodes
    return out


def build_program(gm: torch.fx.GraphModule, low: LoweredGraph, channels_last: bool) -> tuple[torch.fx.GraphModule, list]:
    ctx = low.ctx
    in_partition: dict[torch.fx.Node, int] = {}
    for i, (_p, nodes) in enumerate(low.partitions):
        for n in nodes:
            in_partition[n] = i
    escaping = _escaping(gm)

    # Steps in a dependency-respecting order. A unit is a partition or an FX node outside every
    # partition; a unit is emitted once all the values it reads exist. (A decomposed op can
    # span partitions, so partitions are scheduled as units, not through their FX nodes.)
    new = torch.fx.Graph()
    env: dict = {}
    steps = []
    pos = {n: i for i, n in enumerate(gm.graph.nodes)}
    units = []
    for i, (p, nodes) in enumerate(low.partitions):
        needs = [k for k in (ctx.key(lt.id) for lt in p.inputs) if k is not None]
        units.append((min(pos[n] for n in nodes), "partition", i, needs))
    for n in gm.graph.nodes:
        if n not in in_partition:
            units.append((pos[n], "node", n, list(n.all_input_nodes)))
    units.sort(key=lambda u: (u[0], u[1] == "node"))
    pending = units
    while pending:
        rest = []
        for u in pending:
            _, kind, what, needs = u
            if not all(k in env for k in needs):
                rest.append(u)
                continue
            if kind == "partition":
                _emit_partition(what, low, ctx, new, env, steps, escaping, channels_last)
            elif what.op == "output":
                new.output(torch.fx.node.map_arg(what.args[0], lambda a: env[a]))
            else:
                env[what] = new.node_copy(what, lambda a: env[a])
                if what.op == "call_function" and hasattr(what.target, "reuse_output"):
                    # an int8 kernel (cpu_opt.quant): reuses its output buffer where no caller sees it
                    what.target.reuse_output = what not in escaping
        if len(rest) == len(pending):
            raise RuntimeError("could not order steps; stuck at "
                               f"{[str(u[2] if u[1] == 'node' else 'partition %d' % u[2]) for u in rest[:5]]}")
        pending = rest
    prog = torch.fx.GraphModule(gm, new)
    prog._forward_pre_hooks.clear()
    prog._forward_hooks.clear()
    _bind_constants(prog)
    _donate_dead_inputs(prog)
    return prog, steps


def _donate_dead_inputs(prog: torch.fx.GraphModule) -> None:
    """Mark, on each partition step, the inputs it may overwrite: a reused (never escaping) output of
    an earlier partition step that this step reads once and last, every earlier reader of it being a
    call that does not alias it. Such a buffer is dead after the step; where the compiled partition
    has an in-place pair (a residual add fused as a sum post-op) the step writes its output there
    instead of copying the residual into a buffer of its own first (HF ResNet-50 with its 3x3
    convolutions outside oneDNN: 16 such copies, 1.3 ms a call on a Zen 3)."""
    order = {n: i for i, n in enumerate(prog.graph.nodes)}
    for n in prog.graph.nodes:
        if n.op != "call_function" or not isinstance(n.target, PartitionStep):
            continue
        step = n.target
        full = [pos for pos in range(len(n.args) + len(step.consts)) if pos not in step.consts]
        for k, a in enumerate(n.args):
            if _dead_after(a, n, order):
                step.donate.add(full[k])


def _dead_after(a, n: torch.fx.Node, order: dict) -> bool:
    """Is ``a`` a reused output buffer of a partition step, read by ``n`` once and by nothing after it?"""
    if not (isinstance(a, torch.fx.Node) and a.op == "call_function" and a.target is operator.getitem
            and isinstance(a.args[0], torch.fx.Node) and isinstance(a.args[0].target, PartitionStep)
            and a.args[0].target.reuse[a.args[1]] and n.args.count(a) == 1):
        return False
    for u in a.users:
        if u is n:
            continue
        fresh = isinstance(u.target, PartitionStep) or getattr(u.target, "returns_fresh", False) or \
            not may_alias_inputs(u)
        if order[u] > order[n] or u.op != "call_function" or not fresh:
            return False
    return True


def chain_primitives(prog: torch.fx.GraphModule) -> list[str]:
    """Runs of two or more consecutive steps that are each one primitive of cpu_opt's oneDNN binding
    (int8 convolutions and max-pools) become one :class:`PrimitiveChain` step, which returns the
    values read after the run. The members keep their ``reuse_output`` flags: an output a caller may
    see is a new tensor on every call, chained or not."""
    from ..backends.int8 import activation_qmax
    from ..backends.onednn_primitives import CHAIN_MEMBERS, PrimitiveChain

    if activation_qmax() < 255:
        return []
    runs, cur = [], []
    for n in [*prog.graph.nodes]:
        if n.op == "call_function" and isinstance(n.target, CHAIN_MEMBERS) and not n.kwargs \
                and all(isinstance(a, torch.fx.Node) for a in n.args) and 1 <= len(n.args) <= 2:
            src = n.args[0]
            if src in cur and not src.target.writes_chained:
                # a float value inside the run that this member would quantize: a new run starts here
                # (the value comes in from outside it, as into a layer-by-layer call)
                runs.append(cur)
                cur = []
            cur.append(n)
            continue
        runs.append(cur)
        cur = []
    runs = [r for r in runs if len(r) >= 2]
    g = prog.graph
    for run in runs:
        index = {n: j for j, n in enumerate(run)}
        inputs: list = []

        def ref(a, index=index, inputs=inputs):
            if a in index:
                return ("step", index[a])
            if a not in inputs:
                inputs.append(a)
            return ("in", inputs.index(a))

        members = [(n.target, ref(n.args[0]), ref(n.args[1]) if len(n.args) > 1 else None) for n in run]
        inside = set(run)
        exported = [n for n in run if any(u not in inside for u in n.users)]
        chain = PrimitiveChain(members, [index[n] for n in exported], [not n.target.reuse_output for n in exported])
        with g.inserting_before(run[0]):
            node = g.call_function(chain, tuple(inputs))
            for k, n in enumerate(exported):
                item = g.call_function(operator.getitem, (node, k))
                item.meta = dict(n.meta)
                n.replace_all_uses_with(item)
        for n in reversed(run):
            g.erase_node(n)
    if not runs:
        return []
    prog.recompile()
    return [f"{sum(len(r) for r in runs)} oneDNN primitives (int8 convolutions, pooling) run as {len(runs)} chain(s): "
            "one Python step each, buffers bound once"]


def _bind_constants(prog: torch.fx.GraphModule) -> None:
    """Weights are read once per call through plain instance attributes instead of
    ``nn.Module.__getattr__`` down the module tree (``self.encoder.layer[3].attention.query.weight``:
    a few hundred lookups a call on a transformer). The tensors are the model's own objects, so an
    in-place update of a parameter or buffer is seen."""
    for k, n in enumerate([n for n in prog.graph.nodes if n.op == "get_attr"]):
        obj = prog
        for part in n.target.split("."):
            obj = getattr(obj, part)
        if not isinstance(obj, torch.Tensor):
            continue
        name = f"_cpu_opt_bound_{k}"
        object.__setattr__(prog, name, obj)  # the instance dict: found before Module.__getattr__
        n.target = name
    prog.recompile()


def _dense_strides(node, shape) -> tuple | None:
    """The strides ``node``'s recorded value has, when they describe a dense, non-overlapping layout of
    ``shape`` (any dimension order: row-major, channels-last, a permutation); else None."""
    v = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    if not isinstance(v, torch.Tensor) or tuple(v.shape) != tuple(shape):
        return None
    strides = tuple(v.stride())
    dims = sorted((st, n) for n, st in zip(v.shape, strides) if n != 1)
    expect = 1
    for st, n in dims:  # from the fastest dimension out: each stride spans exactly the ones inside it
        if st != expect:
            return None
        expect *= n
    return strides


def _emit_partition(i, low, ctx, new, env, steps, escaping, channels_last):
    p, nodes = low.partitions[i]
    args, consts = [], {}
    for pos, lt in enumerate(p.inputs):
        src = ctx.key(lt.id)
        if src is None:
            consts[pos] = ctx.consts[lt.id]
        else:
            args.append(env[src])
    out_nodes = [ctx.key(lt.id) for lt in p.outputs]
    reuse = [o not in escaping for o in out_nodes]
    step = PartitionStep(i, p, [lt.id for lt in p.inputs], [lt.id for lt in p.outputs], consts, reuse,
                         channels_last, [_dense_strides(o, lt.shape) for o, lt in zip(out_nodes, p.outputs)])
    steps.append(step)
    call = new.call_function(step, tuple(args))
    call.name = f"onednn_partition_{i}"
    for k, o in enumerate(out_nodes):
        g = new.call_function(operator.getitem, (call, k))
        g.meta["val"] = o.meta.get("val") if isinstance(o, torch.fx.Node) else None
        env[o] = g
