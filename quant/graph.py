"""int8 in the captured graph: what ``cpu_opt.optimize(model, x, dtype="int8",
calibration_data=...)`` runs between the fp32 passes (BatchNorm folded, dropout gone) and lowering.

1. find each GEMM on constant weights (``linear``/``addmm``/``mm``) and each 2-D convolution the
   qconfig mapping selects (the layer's module name comes from the node's ``nn_module_stack``),
   and the activation right after it (ReLU, GELU erf/tanh, SiLU) when it is the layer's only user:
   that activation is fused into the kernel;
2. observe, in the graph, the input of each layer and the value it produces (after the fused
   activation), and run the calibration data through the graph (so BatchNorm is already folded
   into what is observed);
3. replace each layer (+ activation) by one call of its int8 kernel (:mod:`.kernels`) on the family
   ``cpu_opt.routing`` picks for its shape; where every consumer of a layer's output is an int8
   layer with the same input scale, the producer writes uint8 with that scale and the consumers
   read it as it is: a chain, no dequantize and quantize between them;
4. a LayerNorm whose output int8 linear layers read (a transformer's) writes their uint8 bytes
   itself, beside the float32 output the residual add reads (:func:`fuse_norm_quantize`).

The calibrated parameters are kept (:class:`Int8State`), so a new input shape re-plans without
calibrating again.
"""
from __future__ import annotations

import itertools
import math
import operator

import torch
import torch.fx

from cpu_opt.compiler.passes import fx
from cpu_opt.compiler.passes.linear import linear_operands

from . import kernels as K
from .modules import _weight_qparams, smoothquant_scales
from .observer import MinMaxObserver, PerChannelMinMaxObserver
from .qconfig import QConfigMapping

aten = torch.ops.aten

CONV = (aten.conv2d.default, aten.convolution.default)


def _act(n: torch.fx.Node) -> str | None:
    if n.op != "call_function":
        return None
    if n.target in (aten.relu.default, aten.relu_.default):
        return "relu"
    if n.target in (aten.silu.default, aten.silu_.default):
        return "silu"
    if n.target in (aten.hardswish.default, aten.hardswish_.default):
        return "hardswish"
    if n.target == aten.gelu.default:
        approx = n.kwargs.get("approximate", n.args[1] if len(n.args) > 1 else "none")
        return "gelu_tanh" if approx == "tanh" else "gelu_erf"
    return None


def _module_name(n: torch.fx.Node) -> str | None:
    stack = n.meta.get("nn_module_stack")
    if not stack:
        return None
    path = list(stack.values())[-1][0]
    return path if isinstance(path, str) else None


class Layer:
    __slots__ = ("node", "kind", "name", "key", "qconfig", "x", "w", "b", "conv", "act", "value", "module", "add",
                 "other")

    def __init__(self, **kw):
        for k in self.__slots__:
            setattr(self, k, kw.get(k))


def find_layers(gm: torch.fx.GraphModule, model: torch.nn.Module, mapping: QConfigMapping):
    """The layers to quantize, in graph order, and (node name, why) for those kept in fp32."""
    layers, skipped, seen, claimed = [], [], {}, set()
    for n in gm.graph.nodes:
        ops = linear_operands(gm, n)
        kind = None
        if ops is not None:
            x, w_node, wt, kn, b_node = ops
            w = wt.t() if kn else wt
            kind, conv = "linear", None
        elif n.op == "call_function" and n.target in CONV:
            a = list(n.args)
            if n.target == aten.convolution.default:
                x, w_node, b_node, stride, padding, dilation, transposed, _op, groups = a[:9]
                if transposed:
                    continue
            else:  # conv2d(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1)
                x, w_node = a[:2]
                names = ("bias", "stride", "padding", "dilation", "groups")
                rest = dict(zip(names, (None, [1, 1], [0, 0], [1, 1], 1)))
                rest.update(zip(names, a[2:]))
                rest.update({k: v for k, v in n.kwargs.items() if k in rest})
                b_node, stride, padding, dilation, groups = (rest[k] for k in names)
            if not isinstance(w_node, torch.fx.Node) or w_node.op != "get_attr" or isinstance(padding, str):
                continue
            try:
                w = fx.get_constant(gm, w_node)
                fx.get_constant(gm, b_node)
            except fx.NotConstant:
                continue
            vx = fx.node_value(x)
            if w.dim() != 4 or not isinstance(vx, torch.Tensor) or vx.dim() != 4 or vx.dtype != torch.float32:
                continue
            kind, conv = "conv2d", dict(stride=stride, padding=padding, dilation=dilation, groups=groups)
        if kind is None:
            continue
        name, module = _resolve_module(model, _module_name(n) or n.name)
        qc = mapping.qconfig_for(name, module) if module is not None else mapping.qconfig_for(name, None)
        if qc is None:
            skipped.append((n.name, f"{name}: qconfig None, kept in fp32"))
            continue
        if qc.activation is None or qc.dynamic:
            skipped.append((n.name, f"{name}: {'dynamic' if qc.dynamic else 'weight-only'} qconfigs are not "
                                    "graph-quantized (use quant.quantize_dynamic / quantize_weight_only): kept in fp32"))
            continue
        add, other = _residual(n)
        if add is not None and add in claimed:   # layer + layer: the first one takes the add
            add, other = None, None
        claimed.add(add)
        last = add if add is not None else n
        users = list(last.users)
        act = users[0] if len(users) == 1 and _act(users[0]) else None
        # keyed by the module object (a wrapper around the model, as generate() uses, renames the layers
        # but keeps the modules) and by the how-manieth call of it this is
        ident = id(module) if module is not None else name
        i = seen[ident] = seen.get(ident, -1) + 1
        layers.append(Layer(node=n, kind=kind, name=name, key=(ident, i), qconfig=qc, x=x, w=w,
                            b=fx.get_constant(gm, b_node), conv=conv, act=act, add=add, other=other,
                            value=act if act is not None else last, module=module))
    return layers, skipped


def _residual(n: torch.fx.Node):
    """``(add node, other operand)`` when the layer's only use is ``layer + other`` (a residual, same
    shape, alpha 1): the add runs with the layer (fused into the primitive where the family can)."""
    users = list(n.users)
    if len(users) != 1:
        return None, None
    u = users[0]
    if u.op != "call_function" or u.target not in (aten.add.Tensor, aten.add_.Tensor) \
            or u.kwargs.get("alpha", 1) != 1 or len(u.args) != 2:
        return None, None
    a0, a1 = u.args
    if u.target == aten.add_.Tensor and a0 is not n:   # writes into the other operand: not ours to drop
        return None, None
    other = a1 if a0 is n else a0 if a1 is n else None
    if not isinstance(other, torch.fx.Node) or other is n:
        return None, None
    vo, vn = fx.node_value(other), fx.node_value(n)
    if not isinstance(vo, torch.Tensor) or vo.shape != vn.shape or vo.dtype != torch.float32:
        return None, None
    return u, other


def _resolve_module(model, path: str):
    """``(name, module)`` for a node's module path. Capture may wrap the model (generate() wraps it
    once more), which prefixes the paths ("model.wrapped.transformer.h.0..."): leading parts are
    dropped until the rest names a submodule of ``model``."""
    parts = path.split(".")
    for i in range(len(parts)):
        name = ".".join(parts[i:])
        try:
            return name, model.get_submodule(name)
        except AttributeError:
            continue
    return path, None


class Int8State:
    """What calibration established, kept across re-plans for new shapes: per layer key, the
    input and output quantization parameters (and SmoothQuant's channel ranges)."""

    def __init__(self, mapping: QConfigMapping, calibration, autotune: bool = False, min_cosine: float | None = None):
        self.mapping = mapping
        self.autotune = autotune            # time the kernel families per layer instead of routing
        self.min_cosine = min_cosine        # the accuracy validation holds the int8 plan to (None: the kernels' guard)
        self.calibration = calibration      # list of flat input lists; dropped once used
        self.qparams: dict[str, dict] = {}
        self.layers_report: list[dict] = []
        self.skipped: list = []
        self.fp32_keys: dict = {}            # layer key -> why validation kept it in fp32


def _calibrate(gm, layers, calibration) -> dict:
    """Observers in the graph, the calibration inputs run through it, observers out again."""
    obs = {}
    added = []
    for i, L in enumerate(layers):
        act = L.qconfig.activation
        if L.kind == "linear" and L.qconfig.smoothquant_alpha is not None:
            probe = act()
            o_in = PerChannelMinMaxObserver(ch_axis=1, dtype=probe.dtype, qscheme=torch.per_channel_affine,
                                            reduce_range=probe.reduce_range)
            o_in._cpu_opt_rows = True
        else:
            o_in = act()
        o_out = act()
        K.warn_if_saturating(o_out, f"int8: {L.name}")
        o_other = act() if L.other is not None else None
        o_raw = act() if L.value is not L.node else None   # the layer's output before a fused act / add
        obs[L.key] = (o_in, o_out, o_other, o_raw)
        for role, o, node in (("in", o_in, L.x), ("out", o_out, L.value), ("other", o_other, L.other),
                              ("raw", o_raw, L.node)):
            if o is None:
                continue
            attr = f"_cpu_opt_obs_{i}_{role}"
            gm.add_submodule(attr, _Observe(o))
            with gm.graph.inserting_after(node):
                added.append(gm.graph.call_module(attr, (node,)))
    gm.recompile()
    try:
        with torch.no_grad():
            for flat in calibration:
                gm(*flat)
    finally:
        for a in added:
            gm.graph.erase_node(a)
            delattr(gm, a.target)
        gm.recompile()
    out = {}
    for key, (o_in, o_out, o_other, o_raw) in obs.items():
        if not o_in.observed:
            raise RuntimeError(f"int8: a layer (call {key[1]} of {key[0]!r}) saw no input during calibration")
        out[key] = {"in": o_in, "out": o_out, "other": o_other, "raw": o_raw}
    return out


class _Observe(torch.nn.Module):
    def __init__(self, obs):
        super().__init__()
        self.obs = obs

    def forward(self, x):
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.numel():
            self.obs(x.detach().reshape(-1, x.shape[-1]) if getattr(self.obs, "_cpu_opt_rows", False) else x.detach())
        return x


def _input_qparams(layers, state):
    """Input qparams per layer; SmoothQuant layers quantize x / s, computed from the channel ranges
    (the second dict: layer key -> s)."""
    x_qp, smooth = {}, {}
    for L in layers:
        o_in = state.qparams[L.key]["in"]
        if isinstance(o_in, PerChannelMinMaxObserver):
            s = smoothquant_scales(o_in.min_val, o_in.max_val, L.w, L.qconfig.smoothquant_alpha)
            probe = L.qconfig.activation()
            mm = MinMaxObserver(dtype=probe.dtype, qscheme=probe.qscheme, reduce_range=probe.reduce_range)
            mm(torch.stack([(o_in.min_val / s).min(), (o_in.max_val / s).max()]))
            x_qp[L.key], smooth[L.key] = _qp(mm), s
        else:
            x_qp[L.key] = _qp(o_in)
    return x_qp, smooth


def _sqnr_db(y: torch.Tensor, ref: torch.Tensor) -> float:
    noise = (y.double() - ref.double()).pow(2).sum().item()
    signal = ref.double().pow(2).sum().item()
    if noise == 0:
        return float("inf")
    return 10 * math.log10(max(signal, 1e-300) / noise)


def layer_sensitivity(gm: torch.fx.GraphModule, model: torch.nn.Module, state: Int8State, flat_in) -> list[dict]:
    """Each calibrated layer's own int8 error on these inputs, worst first: the layer's fp32 output
    against the same layer with only its input and weights quantized the way its kernel quantizes
    them (same scales, the same activation clamp), as SQNR in dB. ``gm`` is the fp32 graph after
    the fp32 passes (what :func:`quantize_graph` sees)."""
    import torch.nn.functional as F

    layers, _ = find_layers(gm, model, state.mapping)
    layers = [L for L in layers if L.key in state.qparams]
    x_qp, smooth = _input_qparams(layers, state)
    want = {L.x for L in layers}
    seen: dict = {}

    class _Record(torch.fx.Interpreter):
        def run_node(self, n):
            v = super().run_node(n)
            if n in want:
                seen[n] = v
            return v

    with torch.no_grad():
        _Record(gm).run(*[t.clone() for t in flat_in])
        out = []
        for L in layers:
            x = seen.get(L.x)
            if not isinstance(x, torch.Tensor) or not x.is_floating_point():
                continue
            w = L.w.detach().float()
            run = (lambda a, wt: F.linear(a, wt, L.b)) if L.kind == "linear" else \
                (lambda a, wt: F.conv2d(a, wt, L.b, **L.conv))
            ref = run(x.float(), w)
            xs, wm = x.float(), w
            if L.key in smooth:
                xs, wm = xs / smooth[L.key], w * smooth[L.key][None, :]
            wq, ws = _weight_qparams(L.qconfig, wm)
            wd = wq.float() * ws.reshape((-1,) + (1,) * (w.dim() - 1))
            y = run(K.quantize_input(xs, *x_qp[L.key]).dequantize(), wd)
            out.append({"key": L.key, "layer": L.name, "node": L.node.name, "sqnr_db": _sqnr_db(y, ref)})
    return sorted(out, key=lambda r: r["sqnr_db"])


def _qp(o) -> tuple[float, int]:
    s, z = o.calculate_qparams()
    return float(s.reshape(-1)[0]), int(z.reshape(-1)[0])


_kernel_ids = itertools.count()


def quantize_graph(gm: torch.fx.GraphModule, model: torch.nn.Module, state: Int8State) -> list[str]:
    """The pass (see the module docstring). Returns the log lines; ``state.layers_report`` gets a
    row per layer."""
    from .api import choose_family

    layers, skipped = find_layers(gm, model, state.mapping)
    if state.fp32_keys:   # kept in fp32 by validation (their own error was the largest)
        skipped += [(L.node.name, state.fp32_keys[L.key]) for L in layers if L.key in state.fp32_keys]
        layers = [L for L in layers if L.key not in state.fp32_keys]
    state.skipped = skipped
    if not layers:
        import warnings

        why = f" ({len(skipped)} kept in fp32: report()['int8_fp32_layers'] says why)" if skipped else ""
        warnings.warn(f"dtype='int8': no Linear/Conv2d layer of this model is quantized{why}; it runs in fp32",
                      RuntimeWarning, stacklevel=2)
        return [f"int8: no Linear/Conv2d layer selected by the qconfig mapping; the graph stays fp32{why}"]
    if not state.qparams:
        if not state.calibration:
            raise RuntimeError("int8: no calibration data")
        state.qparams = _calibrate(gm, layers, state.calibration)
        state.calibration = None
    missing = [L.name for L in layers if L.key not in state.qparams]
    if missing:
        raise RuntimeError(f"int8: layers {missing} are new in this graph (not calibrated)")
    x_qp, smooth = _input_qparams(layers, state)
    by_input: dict = {}
    by_other: dict = {}
    for L in layers:
        by_input.setdefault(L.x, []).append(L)
        if L.other is not None:
            by_other.setdefault(L.other, []).append(L)
    report = []
    new_nodes = {}
    chain_qp = {}   # new node writing uint8 -> its (scale, zero point)
    kernels: dict = {}   # layer key -> its kernel
    replaced: dict = {}  # a fused residual add -> the kernel node that took it
    for L in layers:
        # a chain: every user of the value is an int8 layer reading it as its input (all with the
        # same scale) or as the residual of a fused convolution + add, or a max-pool whose every user
        # is such a layer input (max commutes with quantization: the pool runs on the bytes)
        users = list(L.value.users)
        pools = [u for u in users if _max_pool(u) is not None]
        direct = [u for u in users if u not in pools]
        consumers = [c for c in by_input.get(L.value, []) if c.key not in smooth]
        residuals = by_other.get(L.value, [])
        pooled = [c for p in pools for c in by_input.get(p, []) if c.key not in smooth]
        res_nodes = {replaced.get(c.add, c.add) for c in residuals}   # a consumer done already: its kernel
        chained = (bool(users) and len(consumers) + len(residuals) == len(direct)
                   and {c.node for c in consumers} | res_nodes == set(direct)
                   and all(_read_by_int8_layers(p, by_input, by_other, smooth) for p in pools)
                   and len({x_qp[c.key] for c in consumers + pooled}) <= 1
                   and all(sum(1 for a in c.node.args if a is L.value) == 1 for c in consumers)
                   and all(sum(1 for a in (c.add.args if c.add in users else replaced[c.add].args)
                                   if a is L.value) == 1 for c in residuals))
        consumers = consumers + pooled
        out_qp = (x_qp[consumers[0].key] if consumers else _qp(state.qparams[L.key]["out"])) if chained else None
        vx = fx.node_value(L.x)
        rows = vx.numel() // vx.shape[-1] if L.kind == "linear" else vx.shape[0]
        macs = rows * L.w.numel() if L.kind == "linear" else \
            vx.shape[0] * vx.shape[2] * vx.shape[3] * L.w.numel() // max(1, _first(L.conv["stride"]) ** 2)
        post = _act(L.act) if L.act is not None else None
        fam, why = choose_family(L.kind, rows, macs, conv=(tuple(L.w.shape), L.conv["groups"], L.conv["dilation"])
                                 if L.kind == "conv2d" else None, in_features=L.w.shape[-1], post_op=post)
        w = L.w.detach().float()
        if L.key in smooth:
            w = w * smooth[L.key][None, :]
        wq, ws = _weight_qparams(L.qconfig, w)

        def build(fam):
            kw = dict(post_op=post, out_qparams=out_qp)
            if L.kind == "linear":
                if fam == "torch_onednn":
                    kw["rows"] = rows
                k = K.LINEAR_KERNELS[fam](wq, ws, L.b, x_qp[L.key], **kw)
            else:
                if fam in ("torch_onednn", "onednn"):
                    kw["x_shape"] = tuple(vx.shape)
                k = K.CONV_KERNELS[fam](wq, ws, L.b, x_qp[L.key], **L.conv, **kw)
            # ranges FBGEMM requantizes outputs to (fed to no GEMM, so all 8 bits)
            k.own_out_qparams = K.full_range(_qp(state.qparams[L.key]["out"]))
            if state.qparams[L.key]["raw"] is not None:
                k.raw_qparams = K.full_range(_qp(state.qparams[L.key]["raw"]))
            return k

        if state.autotune:
            fam, why = _measure_families(L, build, vx, x_qp[L.key], state) or (fam, why)
        # read only as the residual of layers done already, all on cpu_opt's oneDNN: written as int8 with a
        # symmetric scale (a signed value, as a downsampling shortcut's; a uint8 zero point would take
        # oneDNN 3.2 off its brgconv kernel), which those layers add back exactly
        s8_residual = (chained and residuals and not consumers and fam == "onednn" and L.kind == "conv2d"
                       and all(c.key in kernels and kernels[c.key].family == "onednn" for c in residuals))
        if s8_residual:
            lo, hi = (float(v.reshape(-1)[0]) for v in (state.qparams[L.key]["out"].min_val,
                                                         state.qparams[L.key]["out"].max_val))
            out_qp = (max(abs(lo), abs(hi), 1e-8) / 127.0, 0)
        kernel = build(fam)
        if s8_residual:
            kernel.out_int8 = True
        if chained:   # residual consumers built already read this value with the qparams it is written with
            for c in residuals:
                if c.key in kernels:
                    kernels[c.key].other_qparams = out_qp
        kernels[L.key] = kernel
        kernel.__name__ = f"int8_{L.kind}_{next(_kernel_ids)}"
        x_in = new_nodes.get(L.x, L.x)
        with gm.graph.inserting_before(L.value):
            if L.key in smooth:   # x / s (SmoothQuant), then the kernel on the migrated weights
                inv = fx.add_constant(gm, (1.0 / smooth[L.key]).float(), L.value, "smooth_inv")
                x_in = gm.graph.call_function(aten.mul.Tensor, (x_in, inv))
                x_in.meta["val"] = vx
            args = (x_in,)
            if L.other is not None:
                o_in = new_nodes.get(L.other, L.other)
                kernel.other_qparams = chain_qp.get(o_in) or _qp(state.qparams[L.key]["other"])
                args = (x_in, o_in)
            new = gm.graph.call_function(kernel, args)
        vv = fx.node_value(L.value)
        new.meta = {k: v for k, v in L.value.meta.items() if k != "val"}
        new.meta["val"] = torch.empty_strided(vv.shape, vv.stride(), device="meta",
                                              dtype=torch.int8 if s8_residual else torch.uint8 if chained else vv.dtype)
        if L.add is not None:
            replaced[L.add] = new
        new.meta["cpu_opt_route"] = (f"int8:{fam}", why)
        L.value.replace_all_uses_with(new)
        new_nodes[L.value] = new
        if chained:
            chain_qp[new] = out_qp
            for p in pools:   # the max-pools between this layer and its consumers run on the uint8 bytes
                with gm.graph.inserting_before(p):
                    pn = gm.graph.call_function(_u8_max_pool(*_max_pool(p)), (new,))
                pv = fx.node_value(p)
                pn.meta = {k: v for k, v in p.meta.items() if k != "val"}
                pn.meta["val"] = torch.empty_strided(pv.shape, pv.stride(), dtype=torch.uint8, device="meta")
                p.replace_all_uses_with(pn)
                gm.graph.erase_node(p)
                new_nodes[p] = pn
                chain_qp[pn] = out_qp
        for dead in [d for d in (L.act, L.add) if d is not None] + [L.node]:
            gm.graph.erase_node(dead)
        report.append({"layer": L.name, "node": new.name, "kind": L.kind, "family": fam, "why": why,
                       "post_op": post, "residual_add": L.add is not None, "smoothquant": L.key in smooth,
                       "out": "int8 (residual)" if s8_residual else "uint8 (chained)" if chained else "fp32",
                       "in": "uint8 (chained)" if L.x in new_nodes else "fp32"})
    # inputs that were chained were recorded by their (now replaced) value node: fix the "in" column
    chained_values = {n for n in new_nodes.values() if fx.node_value(n) is not None and fx.node_value(n).dtype == torch.uint8}
    for r, L in zip(report, layers):
        r["in"] = "uint8 (chained)" if new_nodes.get(L.x, L.x) in chained_values else "fp32"
    merged = _merge_parallel_linears(gm, report)
    n_norms = fuse_norm_quantize(gm, report)
    gm.graph.eliminate_dead_code()
    fx.drop_unused_constants(gm)
    gm.graph.lint()
    gm.recompile()
    if not state.layers_report:   # the first (the example's) graph; re-plans for new shapes repeat it
        state.layers_report = report
    fams: dict = {}
    for r in report:
        fams[r["family"]] = fams.get(r["family"], 0) + 1
    n_chain = sum(r["out"].startswith("uint8") for r in report)
    fused = sum(r["post_op"] is not None for r in report)
    return [f"int8: {len(report)} layer(s) quantized ({', '.join(f'{v} on {k}' for k, v in fams.items())}), "
            f"{fused} with the activation fused, {n_chain} writing uint8 straight into the next int8 layer"
            + (f", {merged} group(s) of parallel layers run as one GEMM" if merged else "")
            + (f", {n_norms} LayerNorm(s) writing the uint8 input of the int8 layers after them" if n_norms else "")
            + (f"; {len(skipped)} kept in fp32" if skipped else "")]


def fuse_norm_quantize(gm: torch.fx.GraphModule, report: list[dict]) -> int:
    """A ``layer_norm`` over the last dimension whose output int8 linear layers read as their input
    becomes :class:`cpu_opt.backends.native_norm.LayerNormU8`: one pass writes the uint8 bytes those
    layers read (quantized with their input scale and zero point) and, when anything else reads the
    norm (the residual add after the attention), its float32 output too. The layers then read the
    bytes as a chained input (no ``quantize_per_tensor`` of their own). Int8 BERT-base, Xeon with AMX,
    2 threads: 128 x 768, torch's layer_norm + quantize 28 us, the fused kernel 17. Only where a
    vectorized variant of the native kernel runs; layers with another input scale keep reading the
    float norm. Returns how many norms changed."""
    from cpu_opt.backends import native_norm

    if not native_norm.available():
        return 0
    by_node = {r["node"]: r for r in report}
    done = 0
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or n.target != aten.layer_norm.default:
            continue
        a = list(n.args) + [None] * (5 - len(n.args))
        x, shape, w, b = a[0], a[1], a[2], a[3]
        eps = n.kwargs.get("eps", a[4] if a[4] is not None else 1e-5)
        vx = fx.node_value(x) if isinstance(x, torch.fx.Node) else None
        if vx is None or vx.dtype != torch.float32 or len(shape) != 1 or vx.shape[-1] != shape[0] or \
                any(isinstance(p, torch.fx.Node) and fx.node_value(p) is not None and
                    fx.node_value(p).dtype != torch.float32 for p in (w, b)):
            continue
        readers = [u for u in n.users if u.op == "call_function" and isinstance(u.target, K.LinearKernel)
                   and u.args[0] is n and all(v is not n for v in list(u.args[1:]) + list(u.kwargs.values()))]
        groups: dict = {}
        for u in readers:
            groups.setdefault((u.target.x_scale, u.target.x_zp), []).append(u)
        if not groups:
            continue
        (scale, zp), group = max(groups.items(), key=lambda kv: len(kv[1]))
        want_float = len(group) < len(n.users)
        fn = native_norm.LayerNormU8(shape[0], eps, scale, zp, K.activation_qmax(), want_float)
        with gm.graph.inserting_after(n):
            fused = gm.graph.call_function(fn, (x, w, b))
        vv = fx.node_value(n)
        q_val = torch.empty_strided(vv.shape, vv.stride(), dtype=torch.uint8, device="meta")
        if want_float:
            with gm.graph.inserting_after(fused):
                y = gm.graph.call_function(operator.getitem, (fused, 0))
            with gm.graph.inserting_after(y):
                q = gm.graph.call_function(operator.getitem, (y.args[0], 1))
            fused.meta["val"] = (vv, q_val)
            y.meta = dict(n.meta)
            n.replace_all_uses_with(y)
        else:
            q = fused
        q.meta["val"] = q_val
        for u in group:
            u.update_arg(0, q)
            if u.name in by_node:
                by_node[u.name]["in"] = "uint8 (from the LayerNorm before it)"
        if not want_float:
            n.replace_all_uses_with(q)
        fused.meta["cpu_opt_route"] = ("native", "LayerNorm + uint8 quantization in one pass (int8 layers read it)")
        gm.graph.erase_node(n)
        done += 1
    return done


def _merge_parallel_linears(gm: torch.fx.GraphModule, report: list[dict]) -> int:
    """Linear layers on cpu_opt's oneDNN (or all on its AMX kernel) that read the same input with the same input scale, the same
    activation, no residual and float32 outputs (a transformer's query, key and value projections)
    become one GEMM over their concatenated weights, each layer's output a slice of its result: the
    input is quantized once and one call replaces three (BERT-base int8: 36 calls of 128x768x768 ->
    12 of 128x768x2304). Per-channel weight scales concatenate as they are. Returns the groups made."""
    from cpu_opt.backends.amx_linear import AmxLinear
    from cpu_opt.backends.onednn_primitives import DnnlLinear

    groups: dict = {}
    for n in gm.graph.nodes:
        k = n.target
        if n.op == "call_function" and type(k) in (DnnlLinear, AmxLinear) and len(n.args) == 1 and not n.kwargs \
                and k.out_qparams is None and isinstance(fx.node_value(n), torch.Tensor):
            key = (n.args[0], type(k), k.x_scale, k.x_zp, k.post_op, k.wq_t.shape[0], k.bias is None)
            groups.setdefault(key, []).append(n)
    rows = {r["node"]: r for r in report}
    made = 0
    for (x, cls, xs, xz, post, _k, _nob), nodes in groups.items():
        if len(nodes) < 2:
            continue
        ks = [n.target for n in nodes]
        bias = None if ks[0].bias is None else torch.cat([k.bias for k in ks])
        kernel = cls(torch.cat([k.wq_t.t() for k in ks]), torch.cat([k.w_scales for k in ks]), bias,
                            (xs, xz), post_op=post)
        kernel.__name__ = f"int8_linear_{next(_kernel_ids)}"
        kernel.own_out_qparams = ks[0].own_out_qparams
        with gm.graph.inserting_before(nodes[0]):
            m = gm.graph.call_function(kernel, (x,))
        v0 = fx.node_value(nodes[0])
        m.meta = {"val": torch.empty((*v0.shape[:-1], kernel.out_features), dtype=torch.float32, device="meta"),
                  "cpu_opt_route": nodes[0].meta.get("cpu_opt_route")}
        names = [rows[n.name]["layer"] if n.name in rows else n.name for n in nodes]
        off = 0
        for n, k in zip(nodes, ks):
            with gm.graph.inserting_before(n):
                sl = gm.graph.call_function(aten.slice.Tensor, (m, -1, off, off + k.out_features))
            v = fx.node_value(n)
            sl.meta = {k2: val for k2, val in n.meta.items() if k2 != "val"}
            sl.meta["val"] = torch.empty(v.shape, dtype=v.dtype, device="meta")
            off += k.out_features
            if n.name in rows:
                rows[n.name]["merged_gemm"] = {"node": m.name, "layers": names, "n": kernel.out_features}
            n.replace_all_uses_with(sl)
            gm.graph.erase_node(n)
        made += 1
    return made


def _measure_families(L, build, vx, x_qp, state):
    """``optimize(..., dtype="int8", autotune=True)``: each family that builds here, timed on this
    layer's shape (fp32 input holding values on the calibrated grid; medians of 7, interleaved)."""
    import statistics
    import time

    g = torch.Generator().manual_seed(0)
    s, z = x_qp
    x = ((torch.randint(0, 128, vx.shape, generator=g).float() - z) * s).contiguous(
        memory_format=torch.channels_last if vx.dim() == 4 else torch.contiguous_format)
    other = None
    if L.other is not None:
        other = torch.randn(fx.node_value(L.other).shape, generator=g)
    cands = {}
    for fam in (K.LINEAR_KERNELS if L.kind == "linear" else K.CONV_KERNELS):
        if fam == "torch":
            continue
        try:
            k = build(fam)
            if L.other is not None:
                k.other_qparams = _qp(state.qparams[L.key]["other"])
            k(x, other) if other is not None else k(x)
            cands[fam] = k
        except Exception:  # noqa: BLE001 - a family that cannot build or run here is no candidate
            continue
    if not cands:
        return None
    times = {f: [] for f in cands}
    for _ in range(7):
        for f, k in cands.items():
            t0 = time.perf_counter()
            k(x, other) if other is not None else k(x)
            times[f].append(time.perf_counter() - t0)
    med = {f: statistics.median(v) for f, v in times.items()}
    best = min(med, key=med.get)
    return best, "measured on this layer's shape: " + ", ".join(f"{f} {t * 1e3:.3f} ms" for f, t in med.items())


def _read_by_int8_layers(p: torch.fx.Node, by_input, by_other, smooth) -> bool:
    """Is every use of ``p`` an int8 layer's input (not SmoothQuant's, which scales it first) or the
    residual of a fused convolution + add, each reading it once?"""
    ins = [c for c in by_input.get(p, []) if c.key not in smooth]
    res = by_other.get(p, [])
    return (len(p.users) > 0 and len(ins) + len(res) == len(p.users)
            and {c.node for c in ins} | {c.add for c in res} == set(p.users)
            and all(sum(1 for a in c.node.args if a is p) == 1 for c in ins)
            and all(sum(1 for a in c.add.args if a is p) == 1 for c in res))


def _max_pool(n: torch.fx.Node):
    """``(kernel_size, stride, padding, dilation, ceil_mode)`` of a ``max_pool2d`` node, else None."""
    if n.op != "call_function" or n.target != aten.max_pool2d.default:
        return None
    names = ("input", "kernel_size", "stride", "padding", "dilation", "ceil_mode")
    a = dict(zip(names, (None, None, [], 0, 1, False)))
    a.update(zip(names, n.args))
    a.update({k: v for k, v in n.kwargs.items() if k in a})
    return a["kernel_size"], a["stride"], a["padding"], a["dilation"], a["ceil_mode"]


def _u8_max_pool(kernel_size, stride, padding, dilation, ceil_mode):
    from cpu_opt.backends.onednn_primitives import MaxPool2dU8

    return MaxPool2dU8(kernel_size, stride, padding, dilation, ceil_mode)


def _first(v):
    return v[0] if isinstance(v, (list, tuple)) else v
