"""cpu_opt's own 3x3 convolution (``native/kernels/winograd.c``) as an FX call target: stride-1,
ungrouped 3x3 layers in float32 by Winograd's F(m x m, 3x3) on the packed GEMM of
``native/kernels/sgemm.c``: m = 2, 16 multiplications per 2x2 block of the output and channel pair
instead of 36, or m = 4, 36 per 4x4 block instead of 144 (a few 1e-6 relative error against float64
where m = 2 has a few 1e-7 and the direct convolution 1e-6).

``passes.route_convs`` sends a layer here when the ``conv3x3`` route says ``native_winograd``; the
weight is transformed and packed once (:func:`pack_weight`), the activations are NHWC (channels
last: what a convolution network's plan keeps between its convolutions) and a ReLU, or a residual
add and then a ReLU, reading the convolution alone are applied as its output is stored."""
from __future__ import annotations

import functools

import torch

from .. import native

# the activation the kernel applies as it stores its output (winograd.c's act codes)
ACTIVATIONS = {"none": 0, "relu": 1}


def _ptr(t: torch.Tensor):
    return native.ptr(t, "float *")


TILES = (2, 4)   # the output tile sides m the kernel has


@functools.lru_cache(maxsize=None)
def _packed_size(cout: int, cin: int, m: int) -> int:
    return int(native.kernel("wino_packed_size")(cout, cin, m))


def _check_tile(m, who: str) -> None:
    if m not in TILES:
        raise ValueError(f"{who}: the tile side m must be one of {TILES}, got {m!r}")


def pack_weight(w: torch.Tensor, m: int = 2) -> torch.Tensor:
    """A 3x3 convolution's weight (``w`` (Cout, Cin, 3, 3), float32) transformed for F(m x m, 3x3)
    (``G g G^T``, in double) into (m + 2)^2 matrices of Cout x Cin, each packed as the packed GEMM packs
    a weight: a flat float32 tensor made once per layer."""
    _check_tile(m, "winograd pack_weight")
    if w.dtype != torch.float32 or w.dim() != 4 or tuple(w.shape[2:]) != (3, 3) or w.device.type != "cpu":
        raise ValueError(f"winograd pack_weight: w must be a (Cout, Cin, 3, 3) float32 CPU tensor, got {w.dtype} "
                         f"{tuple(w.shape)} ({w.device})")
    cout, cin = w.shape[:2]
    if cout < 1 or cin < 1:
        raise ValueError(f"winograd pack_weight: an empty weight {tuple(w.shape)}")
    w = w.detach().contiguous()
    packed = torch.empty(_packed_size(cout, cin, m), dtype=torch.float32)
    native.check(native.kernel("wino_pack_f32")(_ptr(w), cout, cin, m, _ptr(packed)), "wino_pack_f32",
                 f"{tuple(w.shape)}")
    return packed


class WinogradConv2d:
    """One 3x3 convolution's call target: ``WinogradConv2d(cout, cin, padding, act, m)(x, wp, b, add=None)``
    is ``F.conv2d(x, W, b, padding=padding)`` (``+ add``), then ``act`` (``"none"`` or ``"relu"``),
    for the weight ``W`` that :func:`pack_weight` made ``wp`` from for the same tile side ``m``; a new
    channels-last tensor on every call. The kernel resolved once, when the layer is routed."""

    returns_fresh = True   # a new tensor on every call: the graph's passes may write into it

    def __init__(self, cout: int, cin: int, padding=(1, 1), act: str = "none", m: int = 2):
        if act not in ACTIVATIONS:
            raise ValueError(f"WinogradConv2d: act must be one of {sorted(ACTIVATIONS)}, got {act!r}")
        _check_tile(m, "WinogradConv2d")
        ph, pw = padding
        if ph < 0 or pw < 0:
            raise ValueError(f"WinogradConv2d: padding must be >= 0, got {padding!r}")
        self.cout, self.cin, self.padding, self.act, self.m = int(cout), int(cin), (int(ph), int(pw)), act, int(m)
        self._kernel = native.kernel("wino_conv_f32")
        self.__name__ = "winograd_conv3x3" if act == "none" else f"winograd_conv3x3_{act}"
        self.__qualname__ = (f"WinogradConv2d({self.cin}->{self.cout}, pad {ph}x{pw}, F({m}x{m})"
                             f"{'' if act == 'none' else ', ' + act})")

    def with_act(self, act: str) -> "WinogradConv2d":
        return WinogradConv2d(self.cout, self.cin, self.padding, act, self.m)

    def __call__(self, x: torch.Tensor, wp: torch.Tensor, b: torch.Tensor | None,
                 add: torch.Tensor | None = None) -> torch.Tensor:
        return conv3x3(x, wp, b, self.cout, padding=self.padding, add=add, act=self.act, m=self.m,
                       kernel=self._kernel)


def conv3x3(x: torch.Tensor, wp: torch.Tensor, b: torch.Tensor | None, cout: int, *, padding=(1, 1),
            add: torch.Tensor | None = None, act: str = "none", m: int = 2, kernel=None) -> torch.Tensor:
    """``F.conv2d(x, W, b, padding=padding)`` (``+ add``), then ``act``, with ``wp = pack_weight(W, m)``
    for ``W`` (cout, C, 3, 3) where C is ``x``'s channel count (dim 1): stride 1, no dilation, no
    groups. ``x`` (N, C, H, W) is read channels-last (copied to it when it is not); the result is a
    new (N, cout, OH, OW) tensor in channels-last memory."""
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 4:
        raise ValueError(f"winograd conv3x3: x must be a 4-D float32 CPU tensor, got {x.dtype} {tuple(x.shape)} "
                         f"({x.device})")
    if act not in ACTIVATIONS:
        raise ValueError(f"winograd conv3x3: act must be one of {sorted(ACTIVATIONS)}, got {act!r}")
    _check_tile(m, "winograd conv3x3")
    n, c, h, w = x.shape
    ph, pw = padding
    oh, ow = h + 2 * ph - 2, w + 2 * pw - 2
    if ph < 0 or pw < 0 or oh < 1 or ow < 1:
        raise ValueError(f"winograd conv3x3: padding {padding!r} leaves no output for a {h}x{w} input")
    if c < 1 or cout < 1 or wp.dtype != torch.float32 or not wp.is_contiguous() or wp.numel() != _packed_size(cout, c, m):
        raise ValueError(f"winograd conv3x3: the packed weight ({wp.dtype}, {wp.numel()} values) was not packed for "
                         f"{cout} outputs of {c} input channels with m = {m}")
    if b is not None and (b.dtype != torch.float32 or b.numel() != cout or not b.is_contiguous()):
        raise ValueError(f"winograd conv3x3: bias must be {cout} contiguous float32 values, got {b.dtype} "
                         f"{tuple(b.shape)}")
    out = torch.empty(n, cout, oh, ow, dtype=torch.float32, memory_format=torch.channels_last)
    if add is not None:
        if add.dtype != torch.float32 or tuple(add.shape) != tuple(out.shape):
            raise ValueError(f"winograd conv3x3: add must be a float32 tensor of the output's shape "
                             f"{tuple(out.shape)}, got {add.dtype} {tuple(add.shape)}")
        add = add.contiguous(memory_format=torch.channels_last)
    if out.numel() == 0:
        return out
    x = x.contiguous(memory_format=torch.channels_last)
    ffi = native.ffi()
    st = (kernel or native.kernel("wino_conv_f32"))(
        _ptr(x), n, h, w, c, ph, pw, m, _ptr(wp), cout, ffi.NULL if b is None else _ptr(b),
        ffi.NULL if add is None else _ptr(add), ACTIVATIONS[act], _ptr(out), torch.get_num_threads())
    if st:
        native.check(st, "wino_conv_f32", f"{tuple(x.shape)} -> {cout}")
    return out

