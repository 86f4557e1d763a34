"""Convolution routing: :func:`route_convs` sends stride-1 ungrouped 3x3 convolutions on constant weights
to cpu_opt's Winograd kernel (F(2x2) or F(4x4, 3x3)) where their route (``conv3x3``) says so, and :func:`fuse_conv_post_ops`
gives them the ReLU, or the residual add and ReLU, that read them alone. Every other convolution stays
on the ``conv`` route (oneDNN Graph partitions with their own fused post-ops).

1x1 convolutions are left there on purpose: on channels-last activations they are GEMMs, and cpu_opt's
packed GEMM ran ResNet-50's 1x1 shapes 3-12% faster than oneDNN 3.2's brgconv_1x1 primitive alone, but
inside the network it lost: the oneDNN partitions that chain a block's convolutions (HF ResNet-50: 42
convolutions in 3 partitions) ran them in 24 ms where the packed GEMM took 27 plus 4 for the strided
ones left in partitions, and the whole model was 1.5% slower than with only the 3x3 ones moved (Zen 3,
2 threads, paired)."""
from __future__ import annotations

import torch
import torch.fx

from ... import native
from ...backends import native_conv
from .fx import NotConstant, add_constant, drop_unused_constants, get_constant, node_value, swap_routed

aten = torch.ops.aten


def _pair(v, default):
    v = default if v is None else v
    v = [v] if isinstance(v, int) else list(v)
    return tuple(v * 2) if len(v) == 1 else tuple(v)


def conv3x3_operands(gm, n):
    """``(x, weight node, weight tensor, bias node, (pad_h, pad_w))`` if ``n`` is a float32 ``conv2d`` with
    a constant (Cout, Cin, 3, 3) weight, stride 1, dilation 1, one group and numeric padding whose output
    is channels-last (what a convolution network's plan keeps: the kernel writes that layout), else
    ``None``."""
    if n.op != "call_function" or n.target != aten.conv2d.default:
        return None
    args = list(n.args) + [None] * (7 - len(n.args))
    x, w, b, stride, padding, dilation, groups = args[:7]
    for k, v in n.kwargs.items():
        if k not in ("bias", "stride", "padding", "dilation", "groups"):
            return None
    b = n.kwargs.get("bias", b)
    stride, padding = n.kwargs.get("stride", stride), n.kwargs.get("padding", padding)
    dilation, groups = n.kwargs.get("dilation", dilation), n.kwargs.get("groups", groups)
    if isinstance(padding, str) or _pair(stride, 1) != (1, 1) or _pair(dilation, 1) != (1, 1) or (groups or 1) != 1:
        return None
    if not isinstance(w, torch.fx.Node) or w.op != "get_attr" or (b is not None and (
            not isinstance(b, torch.fx.Node) or b.op != "get_attr")):
        return None
    try:
        wt, bt = get_constant(gm, w), get_constant(gm, b)
    except NotConstant:
        return None
    vx, vy = node_value(x), node_value(n)
    if not isinstance(vx, torch.Tensor) or not isinstance(vy, torch.Tensor) or vx.dim() != 4 or \
            vx.dtype != torch.float32 or wt.dtype != torch.float32 or wt.dim() != 4 or tuple(wt.shape[2:]) != (3, 3):
        return None
    if bt is not None and (bt.dtype != torch.float32 or bt.dim() != 1):
        return None
    if not vy.is_contiguous(memory_format=torch.channels_last):
        return None
    pad = _pair(padding, 0)
    if len(pad) != 2 or min(pad) < 0:
        return None
    return x, w, wt, b, pad


def _tiles(v: torch.Tensor, m: int) -> int:
    """The m x m output tiles of an (N, C, OH, OW) convolution output."""
    return v.shape[0] * ((v.shape[2] + m - 1) // m) * ((v.shape[3] + m - 1) // m)


def route_convs(gm: torch.fx.GraphModule, dtype: str) -> list[str]:
    """Give every stride-1 ungrouped 3x3 convolution on constant weights the ``conv3x3`` route
    (``routing.route("conv3x3", dtype, rows=2x2 tiles, macs=...)``): ``native_winograd`` becomes a call
    to :class:`cpu_opt.backends.native_conv.WinogradConv2d` with the weight transformed and packed once,
    for F(4x4, 3x3) where the layer has ``routing.WINOGRAD_MIN_TILES`` 4x4 tiles, else F(2x2, 3x3) (the
    node records ``("native_winograd", why)`` in ``meta["cpu_opt_route"]`` and leaves oneDNN Graph);
    ``conv`` leaves it to the convolution route."""
    from ...platform import routing

    if dtype != "fp32" or not native.vectorized():
        return []
    moved = 0
    for n in list(gm.graph.nodes):
        ops = conv3x3_operands(gm, n)
        if ops is None:
            continue
        x, _w, wt, b, pad = ops
        cout, cin = wt.shape[:2]
        vy = node_value(n)
        r = routing.route("conv3x3", dtype, rows=_tiles(vy, 2), macs=vy.numel() * cin * 9)
        if r.backend != "native_winograd":
            continue
        # 4x4 tiles where there are as many of them as the route asks of 2x2 ones
        m = 4 if _tiles(vy, 4) >= routing.WINOGRAD_MIN_TILES else 2
        packed = native_conv.pack_weight(wt, m)
        w_node = add_constant(gm, packed, n, "conv_winograd_packed", meta_like=torch.empty(packed.shape, device="meta"))
        swap_routed(gm, n, native_conv.WinogradConv2d(cout, cin, pad, m=m), (x, w_node, b), "native_winograd",
                    f"F({m}x{m}, 3x3); {r.why}")
        moved += 1
    if not moved:
        return []
    gm.graph.eliminate_dead_code()
    drop_unused_constants(gm)
    relu, add = fuse_conv_post_ops(gm)
    gm.recompile()
    fused = [f"{relu} with their ReLU"] if relu else []
    fused += [f"{add} with their residual add"] if add else []
    return [f"{moved} 3x3 convolution(s) on cpu_opt's Winograd kernel" + (f" ({', '.join(fused)} fused)" if fused else "")]


def _relu_of(n: torch.fx.Node):
    """The ReLU that is ``n``'s only reader, or ``None``; an in-place one (``nn.ReLU(inplace=True)``)
    too: with no other reader, nothing sees ``n`` before it."""
    if len(n.users) != 1:
        return None
    u = next(iter(n.users))
    ok = u.op == "call_function" and u.target in (aten.relu.default, aten.relu_.default) and len(u.args) == 1 \
        and u.args[0] is n
    return u if ok and not u.kwargs else None


def fuse_conv_post_ops(gm: torch.fx.GraphModule) -> tuple[int, int]:
    """A convolution on the Winograd kernel whose only reader is a ReLU applies it as it stores its
    output; one whose only reader adds a tensor of its own shape (ResNet's basic block: the second
    convolution, then + the shortcut, then ReLU; also ``h += shortcut`` into the convolution's own
    output, as `transformers`' ResNet writes it) takes that tensor as its ``add``, and the ReLU after
    the sum too when the sum has no other reader. Returns (layers with a ReLU, with an add)."""
    relus = adds = 0
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or not isinstance(n.target, native_conv.WinogradConv2d) or \
                n.target.act != "none" or len(n.args) != 3 or n.kwargs or len(n.users) != 1:
            continue
        conv, tail, extra = n.target, n, ()
        u = next(iter(n.users))
        # out-of-place, or in place into the convolution's own (fresh, unread) output: `h += shortcut`
        if u.op == "call_function" and len(u.args) == 2 and not u.kwargs and u.args[0] is not u.args[1] and \
                (u.target == aten.add.Tensor or (u.target == aten.add_.Tensor and u.args[0] is n)):
            other = u.args[1] if u.args[0] is n else u.args[0]
            vo, vn, vu = node_value(other), node_value(n), node_value(u)
            if isinstance(vo, torch.Tensor) and isinstance(vu, torch.Tensor) and vo.shape == vn.shape == vu.shape \
                    and vo.dtype == vn.dtype == vu.dtype:
                tail, extra = u, (other,)
        relu = _relu_of(tail)
        if relu is None and not extra:
            continue
        n.target = conv.with_act("relu" if relu is not None else "none")
        n.args = (*n.args, *extra)
        if extra:
            u.prepend(n)  # the shortcut may be computed after the convolution: n moves to the add's place
        last = relu if relu is not None else tail
        if last is not n:
            n.meta["val"] = node_value(last)
            last.replace_all_uses_with(n)
            for dead in (relu, u if extra else None):
                if dead is not None:
                    gm.graph.erase_node(dead)
        relus += relu is not None
        adds += bool(extra)
    return relus, adds
