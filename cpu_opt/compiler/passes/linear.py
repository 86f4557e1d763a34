"""Linear routing: :func:`route_linears` gives every GEMM on constant weights its backend
(cpu_opt's oneDNN Graph partitions, torch's oneDNN with prepacked weights, or torch), from the
routing table, this machine's profile, or a measurement per shape (:func:`measure_linear`)."""
from __future__ import annotations

import torch
import torch.fx

from ... import native
from ...backends import mkl, native_linear
from ...backends.torch_onednn import TORCH_LINEAR, TORCH_LINEAR_BINARY, bf16_linear_runs, packed_linear_weight
from .fx import (NotConstant, add_constant, drop_unused_constants, get_constant, mutated_state, node_value,
                 replace_node, swap_routed)

aten = torch.ops.aten


def linear_operands(gm, n, dtype: torch.dtype = torch.float32):
    """``(x, weight node, weight tensor, weight is (K, N), bias node)`` if ``n`` is a ``dtype`` GEMM on
    a constant 2-D weight (``linear``, ``addmm`` with a 1-D constant bias, ``mm``), else ``None``."""
    if n.op != "call_function":
        return None
    if n.target == aten.linear.default:
        x, w = n.args[:2]
        b, kn = (n.args[2] if len(n.args) > 2 else None), False
    elif n.target == aten.addmm.default:
        if n.kwargs.get("beta", 1) != 1 or n.kwargs.get("alpha", 1) != 1:
            return None
        b, x, w = n.args[:3]
        kn = True
    elif n.target == aten.mm.default:
        (x, w), b, kn = n.args[:2], None, True
    else:
        return None
    vx = node_value(x)
    if not isinstance(w, torch.fx.Node) or w.op != "get_attr" or not isinstance(vx, torch.Tensor):
        return None
    if b is not None and (not isinstance(b, torch.fx.Node) or b.op != "get_attr"):
        return None
    try:
        wt, bt = get_constant(gm, w), get_constant(gm, b)
    except NotConstant:
        return None
    if vx.dtype != dtype or wt.dtype != dtype or wt.dim() != 2 or vx.dim() < 2:
        return None
    if bt is not None and (bt.dim() != 1 or bt.dtype != dtype):
        return None
    return x, w, wt, kn, b


_LINEAR_TIMES: dict = {}
_MEASURED_NAMES = {"onednn": "cpu_opt oneDNN", "torch_onednn": "torch's oneDNN", "native": "cpu_opt's GEMV",
                   "mkl": "MKL packed", "native_gemm": "cpu_opt's packed GEMM"}


def measure_linear(m: int, k: int, n: int, bias: bool, repeats: int = 7) -> dict:
    """Median seconds of ``(m, k) @ (k, n)`` on cpu_opt's oneDNN 3.2 (packed weights), on torch's
    oneDNN (``_linear_pointwise``), on cpu_opt's own kernels (the GEMV for 1-3 rows, the packed GEMM
    from 4) and on MKL's packed GEMM where torch has MKL, interleaved on the same random tensors;
    cached per shape."""
    key = (m, k, n, bias, torch.get_num_threads())
    if key in _LINEAR_TIMES:
        return _LINEAR_TIMES[key]
    import time

    from ...dnnl.primitives import Matmul

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    ours = Matmul.from_linear(w, b)
    fns = {"onednn": lambda: ours(x), "torch_onednn": lambda: TORCH_LINEAR(x, w, b, "none", [], "")}
    if mkl.available():
        packed = mkl.packed_weight(w, m)
        fns["mkl"] = lambda: mkl.MKL_LINEAR(x, packed, w, b, m)
    if m <= native_linear.MAX_ROWS and native.vectorized():
        fns["native"] = lambda: native_linear.linear(x, w, b, False)
    elif native.vectorized():
        wp = native_linear.pack_weight(w)
        fns["native_gemm"] = lambda: native_linear.packed_linear(x, wp, b, n)
    times = {name: [] for name in fns}
    for f in fns.values():
        f()  # create and pack outside the timing
    for _ in range(repeats):
        for name, f in fns.items():
            t0 = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - t0)
    _LINEAR_TIMES[key] = res = {name: sorted(ts)[len(ts) // 2] for name, ts in times.items()}
    return res



def route_linears(gm: torch.fx.GraphModule, dtype: str, measure: bool = False) -> list[str]:
    """Give every GEMM on constant weights its own route (``routing.route("linear", dtype,
    rows=...)``: this machine's measured profile for the layer's row class, else the table), or,
    with ``measure``, the faster of cpu_opt's oneDNN and torch's oneDNN timed on the layer's shape.

    Each layer records ``(backend, why)`` in ``node.meta["cpu_opt_route"]``: ``onednn`` stays for
    lowering into oneDNN Graph partitions; ``torch_onednn`` becomes ``mkldnn._linear_pointwise(x, W,
    b)`` with ``W`` packed for the layer's row count (fp32; bf16 where torch's oneDNN has native bf16,
    its activation or residual add then fused: :func:`fuse_torch_linear_post_ops`); ``native`` becomes cpu_opt's GEMV
    (:func:`cpu_opt.backends.native_linear.linear`, the weight in the model's layout); ``native_gemm``
    becomes cpu_opt's packed GEMM (:class:`cpu_opt.backends.native_linear.PackedLinear`, the weight packed
    once into its panels; a ReLU, GELU or residual add reading it alone then applied as it stores its
    output: :func:`fuse_packed_linear_post_ops`); ``torch`` stays the ATen op, run by torch."""
    from ...platform import routing

    if dtype not in ("fp32", "bf16"):
        return []
    moved = kept = in_torch = gemv = mkl_moved = sgemm = 0
    for n in list(gm.graph.nodes):
        ops = linear_operands(gm, n, torch.float32 if dtype == "fp32" else torch.bfloat16)
        if ops is None:
            continue
        x, w, wt, kn, b = ops
        w_nk = wt.t() if kn else wt
        vx = node_value(x)
        rows = vx.numel() // max(vx.shape[-1], 1)
        r = routing.route("linear", dtype, rows=rows, macs=rows * w_nk.shape[0] * w_nk.shape[1])
        backend, why = r.backend, r.why
        if measure and vx.numel() > 0 and dtype == "fp32":
            t = measure_linear(rows, w_nk.shape[1], w_nk.shape[0], b is not None)
            backend = min(t, key=t.get)
            why = "measured on this shape: " + ", ".join(f"{_MEASURED_NAMES.get(k, k)} {v * 1e3:.3f} ms"
                                                         for k, v in t.items())
        if backend == "torch_onednn" and dtype == "bf16" and not bf16_linear_runs():
            backend, why = "onednn", f"torch's oneDNN has no native bf16 linear here; {why}"
        if backend == "mkl" and (dtype != "fp32" or not mkl.available()):
            backend, why = "onednn", (f"MKL's packed GEMM is fp32 only and needs torch's MKL "
                                      f"({'not built in' if not mkl.available() else dtype}); {why}")
        if backend == "native" and (dtype != "fp32" or not native.vectorized()):
            backend, why = "torch", f"cpu_opt's GEMV runs fp32 on its vector kernels only; {why}"
        if backend == "native_gemm" and (dtype != "fp32" or not native.vectorized()):
            backend, why = "torch_onednn", f"cpu_opt's packed GEMM runs fp32 on its vector kernels only; {why}"
        if backend == "native_gemm":
            packed = native_linear.pack_weight(wt, kn)   # flat panels: described by a tensor of their shape
            w_node = add_constant(gm, packed, n, "linear_sgemm_packed",
                                  meta_like=torch.empty(packed.shape, device="meta"))
            swap_routed(gm, n, native_linear.PackedLinear(*w_nk.shape), (x, w_node, b), "native_gemm", why)
            sgemm += 1
            continue
        if backend == "native":
            swap_routed(gm, n, native_linear.Gemv(kn), (x, w, b), "native", why)
            gemv += 1
            continue
        if backend == "mkl":
            packed = mkl.packed_weight(w_nk, rows)   # an mkldnn-layout tensor: described by a plain one
            w_node = add_constant(gm, packed, n, "linear_mkl_packed", meta_like=torch.empty(packed.shape, device="meta"))
            w_orig = w if not kn else add_constant(gm, w_nk.detach().contiguous(), n, "linear_weight_nk")
            swap_routed(gm, n, mkl.MKL_LINEAR, (x, w_node, w_orig, b, rows), "mkl", why)
            mkl_moved += 1
            continue
        if backend not in ("torch_onednn", "torch"):
            n.meta["cpu_opt_route"] = ("onednn", why)
            kept += 1
            continue
        if backend == "torch":
            n.meta["cpu_opt_route"] = ("torch", why)
            in_torch += 1
            continue
        # the weights packed once into oneDNN's blocked layout for this batch (rows), as torch's own
        # frozen graphs do: 3-7% faster per call than handing it the (N, K) weights (128x768x3072:
        # 7.46 vs 7.67 ms; 2048x768x3072: 74.8 vs 80.4; Zen 3, interleaved medians)
        w_node = add_constant(gm, packed_linear_weight(w_nk, rows), n, "linear_packed", meta_like=w_nk)
        swap_routed(gm, n, TORCH_LINEAR, (x, w_node, b, "none", [], ""), "torch_onednn", why)
        moved += 1
    if not moved and not in_torch and not gemv and not mkl_moved and not sgemm:
        return []
    gm.graph.eliminate_dead_code()
    drop_unused_constants(gm)
    fused = fuse_torch_linear_post_ops(gm) if dtype == "bf16" else 0
    sgemm_act, sgemm_add = fuse_packed_linear_post_ops(gm) if sgemm else (0, 0)
    gm.recompile()
    how = "measured per shape" if measure else "routing"
    parts = [f"{moved} linear layer(s) on torch's oneDNN 3.12" + (f" ({fused} with their activation or residual "
                                                                  f"add fused)" if fused else "")] if moved else []
    fused_here = [f"{sgemm_act} with their activation fused"] if sgemm_act else []
    fused_here += [f"{sgemm_add} with their residual add fused"] if sgemm_add else []
    parts += [f"{sgemm} on cpu_opt's packed GEMM" + (f" ({', '.join(fused_here)})" if fused_here else "")] \
        if sgemm else []
    parts += [f"{mkl_moved} on MKL's packed GEMM"] if mkl_moved else []
    parts += [f"{in_torch} in torch's own kernels"] if in_torch else []
    parts += [f"{gemv} GEMV(s) on cpu_opt's native kernel"] if gemv else []
    return [", ".join(parts) + f", {kept} on cpu_opt's oneDNN ({how})"]


def _same_value(a, b) -> bool:
    """Do nodes ``a`` and ``b`` hold tensors of one shape and dtype?"""
    va, vb = node_value(a), node_value(b)
    return isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor) and va.shape == vb.shape and \
        va.dtype == vb.dtype


# activations torch's oneDNN linear fuses: aten op -> (attr, algorithm)
_TORCH_LINEAR_ACT = {aten.relu.default: "relu", aten.silu.default: "swish", aten.gelu.default: "gelu"}
_RESHAPES = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}


def _activation(u: torch.fx.Node, src: torch.fx.Node):
    """``(attr, [], algorithm)`` of torch's oneDNN linear for the activation ``u`` applies to ``src``
    (ReLU, SiLU, erf or tanh GELU), or ``None``."""
    if u.op != "call_function" or u.target not in _TORCH_LINEAR_ACT or not u.args or u.args[0] is not src:
        return None
    if u.target == aten.gelu.default:
        if len(u.args) > 2 or set(u.kwargs) - {"approximate"}:
            return None
        return "gelu", [], u.kwargs.get("approximate", u.args[1] if len(u.args) > 1 else "none")
    if len(u.args) > 1 or u.kwargs:
        return None
    return _TORCH_LINEAR_ACT[u.target], [], ""


def fuse_torch_linear_post_ops(gm: torch.fx.GraphModule) -> int:
    """A bf16 linear layer on torch's oneDNN (``mkldnn._linear_pointwise``, no post-op yet) whose only
    reader is a ReLU, SiLU or GELU (erf or tanh), directly or through a view, takes it as its post-op; one whose only reader adds a
    tensor of its own shape and dtype (a residual) becomes ``_linear_pointwise.binary(x, other, W, b,
    "add")``, also where the output is permuted before the add (ConvNeXt: the residual is permuted
    the other way, a view, and the sum permuted back). One pass over the output instead of two: the
    sum is rounded to bf16 once (eager rounds the GEMM's output, then the sum). Returns how many
    layers took a post-op."""
    done = 0
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or n.target != TORCH_LINEAR or len(n.users) != 1 or n.args[3] != "none":
            continue
        v = node_value(n)
        if not isinstance(v, torch.Tensor) or v.dtype != torch.bfloat16:
            continue
        u = next(iter(n.users))
        x, w, b = n.args[:3]
        if u.op != "call_function":
            continue
        # the activation read directly, or through a view (GPT-2's Conv1D: addmm rows viewed back to
        # (batch, seq, N), then the GELU): elementwise, so the linear takes it and any view stays
        act, src = u, n
        if _activation(u, n) is None and u.target in _RESHAPES and u.args[0] is n and len(u.users) == 1:
            act, src = next(iter(u.users)), u
        post = _activation(act, src)
        if post is not None:
            n.args = (x, w, b, *post)
            act.replace_all_uses_with(src)
            gm.graph.erase_node(act)
            done += 1
            continue
        if u.target == aten.add.Tensor and len(u.args) == 2 and not u.kwargs and n in u.args:
            other = u.args[1] if u.args[0] is n else u.args[0]
            if not _same_value(other, n) or not _same_value(u, n):
                continue
            args, target = (x, other, w, b, "add"), TORCH_LINEAR_BINARY
        elif u.target == aten.permute.default and len(u.users) == 1:
            # ConvNeXt's block: linear (channels last) -> permute back -> + residual. The residual,
            # permuted the linear's way (a view), is the post-op's operand; the sum is permuted back.
            add = next(iter(u.users))
            dims = list(u.args[1])
            if add.op != "call_function" or add.target != aten.add.Tensor or len(add.args) != 2 or add.kwargs or \
                    u not in add.args or add.args[0] is add.args[1] or not _same_value(add, u):
                continue
            other = add.args[1] if add.args[0] is u else add.args[0]
            if not _same_value(other, u):
                continue
            inv = [dims.index(d) for d in range(len(dims))]
            with gm.graph.inserting_before(add):
                other_t = gm.graph.call_function(aten.permute.default, (other, inv))
                fused = gm.graph.call_function(TORCH_LINEAR_BINARY, (x, other_t, w, b, "add"))
                back = gm.graph.call_function(aten.permute.default, (fused, dims))
            vo = node_value(other)
            other_t.meta["val"] = vo.permute(inv)
            fused.meta = dict(n.meta)
            back.meta = dict(add.meta)
            back.meta["val"] = fused.meta["val"].permute(dims)
            name = n.name
            add.replace_all_uses_with(back)
            for dead in (add, u, n):
                gm.graph.erase_node(dead)
            fused._rename(name)
            done += 1
            continue
        else:
            continue
        with gm.graph.inserting_before(u):
            new = gm.graph.call_function(target, args)
        new.meta = dict(u.meta)
        new.meta["cpu_opt_route"] = n.meta.get("cpu_opt_route")
        name = n.name
        u.replace_all_uses_with(new)
        gm.graph.erase_node(u)
        gm.graph.erase_node(n)
        new._rename(name)
        done += 1
    return done


# activations cpu_opt's packed GEMM applies as it stores C: torch's oneDNN post-op name -> its own
_PACKED_ACT = {("relu", ""): "relu", ("gelu", "none"): "gelu", ("gelu", "tanh"): "gelu_tanh"}


def fuse_packed_linear_post_ops(gm: torch.fx.GraphModule) -> tuple[int, int]:
    """A layer on cpu_opt's packed GEMM whose only reader (directly or through a view: GPT-2's Conv1D
    views its rows back to (batch, seq, N), ConvNeXt permutes its channels-last output to NCHW) is

    * a ReLU or a GELU (erf or tanh) applies it as the GEMM stores each tile
      (:class:`cpu_opt.backends.native_linear.PackedLinear`'s ``act``), the GELUs computed as
      :func:`cpu_opt.compiler.passes.route_gelu` would have computed them on cpu_opt's GELU kernels;
    * an add of a tensor of the sum's own shape and dtype (a transformer's residual) takes that tensor
      as the GEMM's ``add``, added as the tile is stored. Alone, that add was a oneDNN Graph partition
      of one op: 0.20-0.24 ms a call over 128 x 768 under per-node timers (24 of them in GPT-2 or
      BERT-base).

    One pass over the output instead of two. Returns (layers with an activation, with an add)."""
    acts = adds = 0
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or not isinstance(n.target, native_linear.PackedLinear) or \
                n.target.act != "none" or len(n.users) != 1 or len(n.args) != 3 or n.kwargs:
            continue
        u = next(iter(n.users))
        reader, view = u, None
        if u.op == "call_function" and (u.target in _RESHAPES or u.target == aten.permute.default) and \
                u.args[0] is n and len(u.users) == 1:
            reader, view = next(iter(u.users)), u
        src = view or n
        post = _activation(reader, src)
        name = _PACKED_ACT.get((post[0], post[2])) if post else None
        if name is not None:
            n.target = native_linear.PackedLinear(n.target.n, n.target.k, name)
            reader.replace_all_uses_with(src)
            gm.graph.erase_node(reader)
            acts += 1
            continue
        if reader.op != "call_function" or reader.target != aten.add.Tensor or len(reader.args) != 2 or \
                reader.kwargs or src not in reader.args or reader.args[0] is reader.args[1]:
            continue
        other = reader.args[1] if reader.args[0] is src else reader.args[0]
        if not isinstance(other, torch.fx.Node) or not _same_value(other, reader) or not _same_value(src, reader) or \
                node_value(reader).dtype != torch.float32:
            continue
        # the new GEMM where the add was (its operand may be computed after the layer); the operand
        # taken to the GEMM's rows when the layer's output was viewed before the add: reshaped, or
        # permuted back (ConvNeXt: the linear runs channels-last, its output is permuted to NCHW for
        # the residual, which in channels-last memory is then a dense (..., C) operand again)
        with gm.graph.inserting_before(reader):
            operand = other
            if view is not None and view.target == aten.permute.default:
                dims = list(view.args[1])
                inv = [dims.index(d) for d in range(len(dims))]
                operand = gm.graph.call_function(aten.permute.default, (other, inv))
                operand.meta["val"] = node_value(other).permute(inv)
            elif view is not None:
                shape = list(node_value(n).shape)
                operand = gm.graph.call_function(aten.reshape.default, (other, shape))
                operand.meta["val"] = node_value(other).reshape(shape)
            fused = gm.graph.call_function(n.target, (*n.args, operand))
            fused.meta = dict(n.meta)
            out = fused
            if view is not None:
                out = gm.graph.call_function(view.target, (fused, *view.args[1:]), dict(view.kwargs))
                out.meta = dict(view.meta)
        name = n.name
        reader.replace_all_uses_with(out)
        for dead in (reader, view, n):
            if dead is not None:
                gm.graph.erase_node(dead)
        fused._rename(name)
        adds += 1
    return acts, adds


def merge_parallel_linears(gm: torch.fx.GraphModule) -> list[str]:
    """``linear`` layers on constant weights that read the same input (a transformer's query, key and
    value projections) become one GEMM over their concatenated weights, each layer's output a slice of
    its result: one call and one wider GEMM instead of three. Only where every reader of each output
    takes a strided tensor: a ``view`` reader must only split the last dimension (what the attention's
    head split does), anything that may write in place or re-stride (``as_strided``) keeps the layers
    apart. The float form of :func:`cpu_opt.quant.graph._merge_parallel_linears`."""
    state = mutated_state(gm)
    groups: dict = {}
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target != aten.linear.default or n.kwargs:
            continue
        vx = node_value(n.args[0])
        ops = linear_operands(gm, n, vx.dtype) if isinstance(vx, torch.Tensor) and vx.is_floating_point() else None
        if ops is None or ops[1] in state or (ops[4] is not None and ops[4] in state):
            continue
        if not all(_strided_ok(u, n) for u in n.users):
            continue
        x, _w, wt, _kn, b = ops
        groups.setdefault((x, wt.shape[1], wt.dtype, b is None), []).append((n, ops))
    made = 0
    for (x, _k, _dt, _nob), members in groups.items():
        if len(members) < 2:
            continue
        first = members[0][0]
        with torch.no_grad():
            w = torch.cat([ops[2] for _n, ops in members])
            bias = None if members[0][1][4] is None else torch.cat([get_constant(gm, ops[4]) for _n, ops in members])
        args = [x, add_constant(gm, w, first, "qkv_w")]
        if bias is not None:
            args.append(add_constant(gm, bias, first, "qkv_b"))
        with gm.graph.inserting_before(first):
            m = gm.graph.call_function(aten.linear.default, tuple(args))
        v0 = node_value(first)
        m.meta = {k: v for k, v in first.meta.items() if k != "val"}
        m.meta["val"] = torch.empty((*v0.shape[:-1], w.shape[0]), dtype=v0.dtype, device="meta")
        off = 0
        for n, ops in members:
            width = ops[2].shape[0]
            with gm.graph.inserting_before(n):
                sl = gm.graph.call_function(aten.slice.Tensor, (m, -1, off, off + width))
            sl.meta = {k: v for k, v in n.meta.items() if k != "val"}
            sl.meta["val"] = torch.empty_strided(node_value(n).shape, (*m.meta["val"].stride()[:-1], 1),
                                                 dtype=v0.dtype, device="meta")
            off += width
            replace_node(n, sl)
        made += 1
    if made:
        gm.graph.eliminate_dead_code()
        drop_unused_constants(gm)
        gm.recompile()
    return [f"{made} group(s) of linear layers reading one input run as one GEMM each"] if made else []


def _strided_ok(u: torch.fx.Node, lin: torch.fx.Node) -> bool:
    """Can ``u`` read ``lin``'s output as a slice of a wider result (the last dimension strided)?"""
    if u.op == "output" or u.op != "call_function":
        return False
    t = u.target
    if t in (aten.view.default, aten._unsafe_view.default):
        v, out = node_value(lin), node_value(u)
        if not isinstance(v, torch.Tensor) or not isinstance(out, torch.Tensor):
            return False
        lead = tuple(v.shape[:-1])
        return tuple(out.shape[:len(lead)]) == lead   # only the last dimension split
    if t in (aten.as_strided.default,) or not hasattr(t, "_schema"):
        return False
    return not any(a.alias_info is not None and a.alias_info.is_write for a in t._schema.arguments)
