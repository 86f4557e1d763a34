"""cpu_opt's 3x3 convolution by Winograd's F(2x2, 3x3) and F(4x4, 3x3) (native/kernels/winograd.c;
cpu_opt.backends.native_conv): every runnable variant and tile side against float64 at 1-3 threads,
with channel tails, outputs that leave a last tile partly outside, padding 0-2, bias / residual /
ReLU epilogues, more tiles than one chunk, and the errors on bad input."""
import pytest
import torch
import torch.nn.functional as F

from cpu_opt import hw, native
from cpu_opt.backends import native_conv as NC


BAD = -2  # CO_ERR_BAD_ARGUMENT (native.STATUS_NAMES)


def runnable():
    info = hw.detect()
    return [v for v in native.compiled_variants() if native.VARIANT_REQUIRES[v] <= info.isa_uncapped]


def _p(t):
    return native.ptr(t, "float *")


def _ref(x, w, b, pad, add=None, relu=False):
    y = F.conv2d(x.double(), w.double(), None if b is None else b.double(), padding=pad)
    if add is not None:
        y = y + add.double()
    return torch.relu(y) if relu else y


# relative error bound against float64 per tile side (the direct convolution's is about 1e-6)
TOL = {2: 2e-6, 4: 2e-5}


def _call(variant, x, wp, cout, b, pad, add, relu, nt, m):
    n, c, h, w = x.shape
    out = torch.full((n, cout, h + 2 * pad[0] - 2, w + 2 * pad[1] - 2), float("nan")).contiguous(
        memory_format=torch.channels_last)
    x = x.contiguous(memory_format=torch.channels_last)
    add = None if add is None else add.contiguous(memory_format=torch.channels_last)  # alive through the call
    ffi = native.ffi()
    st = native.kernel("wino_conv_f32", variant)(
        _p(x), n, h, w, c, pad[0], pad[1], m, _p(wp), cout, ffi.NULL if b is None else _p(b),
        ffi.NULL if add is None else _p(add), int(relu), _p(out), nt)
    assert st == 0
    return out


def _pack(variant, w, m):
    cout, cin = w.shape[:2]
    wp = torch.empty(int(native.kernel("wino_packed_size", variant)(cout, cin, m)))
    assert native.kernel("wino_pack_f32", variant)(_p(w.contiguous()), cout, cin, m, _p(wp)) == 0
    return wp


def _rel(y, ref):
    return ((y.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


# (batch, cin, cout, h, w, padding): 8-channel vectors and scalar channel tails, odd and even outputs
# (a last tile half outside), padding 0 / 1 / 2 and uneven, 1x1 outputs
SHAPES = [(1, 64, 64, 14, 14, (1, 1)), (2, 13, 21, 9, 7, (1, 1)), (1, 3, 40, 5, 6, (0, 0)),
          (1, 16, 8, 3, 3, (2, 2)), (3, 8, 24, 8, 5, (1, 0)), (1, 40, 17, 3, 3, (0, 0)), (1, 1, 1, 4, 4, (1, 1))]


@pytest.mark.parametrize("variant", runnable())
@pytest.mark.parametrize("m", [2, 4])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s[:5])) + f"p{s[5][0]}{s[5][1]}")
def test_winograd_matches_float64_at_any_thread_count(variant, m, shape):
    bsz, cin, cout, h, w, pad = shape
    g = torch.Generator().manual_seed(cin * 31 + cout)
    x = torch.randn(bsz, cin, h, w, generator=g)
    wt = torch.randn(cout, cin, 3, 3, generator=g) / (9 * cin) ** 0.5
    b = torch.randn(cout, generator=g)
    wp = _pack(variant, wt, m)
    for bias, add, relu in ((b, None, False), (None, None, True), (b, "add", True)):
        ref_shape = _ref(x, wt, None, pad).shape
        a = torch.randn(ref_shape, generator=g) if add else None
        ref = _ref(x, wt, bias, pad, a, relu)
        outs = [_call(variant, x, wp, cout, bias, pad, a, relu, nt, m) for nt in (1, 2, 3)]
        assert _rel(outs[0], ref) < TOL[m], (variant, m, shape, bias is not None, add, relu)
        # every tile's outputs by the same sums: the result does not depend on the thread count
        assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
        if relu:
            assert (outs[0] >= 0).all()


@pytest.mark.parametrize("variant", runnable())
@pytest.mark.parametrize("m", [2, 4])
def test_winograd_over_several_chunks_of_tiles(variant, m):
    """1024 + 1024 channels: a chunk holds 60 2x2 tiles (CO_WG_SCRATCH floats of V and M), the 16 x 16
    output has 64: two chunks, the second of 4 tiles; with 4x4 tiles 24 a chunk, 36 in the 24 x 24
    output: two chunks, the second of 12."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(1, 1024, 32, 32, generator=g)
    wt = torch.randn(1024, 1024, 3, 3, generator=g) / (9 * 1024) ** 0.5
    x = x[:, :, :16, :16] if m == 2 else x[:, :, :24, :24]
    y = _call(variant, x, _pack(variant, wt, m), 1024, None, (1, 1), None, False, 2, m)
    ref = F.conv2d(x, wt, padding=1)   # float32: a float64 reference of 2.4G multiply-adds is too slow here
    assert ((y - ref).abs().max() / ref.abs().max()).item() < TOL[m] * 5


def test_conv3x3_wrapper_matches_torch_and_keeps_channels_last():
    torch.manual_seed(0)
    x = torch.randn(2, 24, 11, 10)       # NCHW: the wrapper reads it channels-last (a copy)
    wt = torch.randn(32, 24, 3, 3) / 15
    b = torch.randn(32)
    wp = NC.pack_weight(wt)
    res = torch.randn(2, 32, 11, 10)
    y = NC.conv3x3(x, wp, b, 32, padding=(1, 1), add=res, act="relu")
    ref = torch.relu(F.conv2d(x, wt, b, padding=1) + res)
    assert y.is_contiguous(memory_format=torch.channels_last) and y.shape == ref.shape
    assert _rel(y, ref.double()) < 2e-6
    conv = NC.WinogradConv2d(32, 24, (0, 0), m=4)
    y0 = conv(x, NC.pack_weight(wt, 4), None)
    assert _rel(y0, F.conv2d(x, wt, padding=0).double()) < 2e-5
    y1 = conv(x, NC.pack_weight(wt, 4), None)
    assert y1.data_ptr() != y0.data_ptr() and torch.equal(y0, y1)   # a new tensor on every call


def test_winograd_bad_input_raises():
    wt = torch.randn(8, 4, 3, 3)
    wp = NC.pack_weight(wt)
    x = torch.randn(1, 4, 6, 6)
    with pytest.raises(ValueError, match=r"\(Cout, Cin, 3, 3\)"):
        NC.pack_weight(torch.randn(8, 4, 5, 5))
    with pytest.raises(ValueError, match="float32"):
        NC.pack_weight(wt.double())
    with pytest.raises(ValueError, match="not packed for 8 outputs of 5 input channels"):
        NC.conv3x3(torch.randn(1, 5, 6, 6), wp, None, 8)
    with pytest.raises(ValueError, match="not packed for 17 outputs"):   # 9-16 fill the same one panel
        NC.conv3x3(x, wp, None, 17)
    with pytest.raises(ValueError, match="4-D float32"):
        NC.conv3x3(x[0], wp, None, 8)
    with pytest.raises(ValueError, match="leaves no output"):
        NC.conv3x3(torch.randn(1, 4, 2, 2), wp, None, 8, padding=(0, 0))
    with pytest.raises(ValueError, match="bias must be 8"):
        NC.conv3x3(x, wp, torch.randn(7), 8)
    with pytest.raises(ValueError, match="add must be a float32 tensor of the output's shape"):
        NC.conv3x3(x, wp, None, 8, add=torch.randn(1, 8, 4, 4))
    with pytest.raises(ValueError, match="act must be one of"):
        NC.conv3x3(x, wp, None, 8, act="gelu")
    with pytest.raises(ValueError, match="act must be one of"):
        NC.WinogradConv2d(8, 4, act="tanh")
    with pytest.raises(ValueError, match="tile side m must be one of"):
        NC.WinogradConv2d(8, 4, m=3)
    with pytest.raises(ValueError, match="tile side m must be one of"):
        NC.pack_weight(wt, 6)
    with pytest.raises(ValueError, match="not packed for 8 outputs of 4 input channels with m = 4"):
        NC.conv3x3(x, wp, None, 8, m=4)   # packed for m = 2
    # the kernel itself refuses what the wrapper would never pass, before touching memory
    y = torch.empty(1, 6, 6, 8)
    k = native.kernel("wino_conv_f32")
    ffi = native.ffi()
    xl = x.contiguous(memory_format=torch.channels_last)
    for args in ((0, 6, 6, 4, 1, 1, 2), (1, 6, 6, 0, 1, 1, 2), (1, 6, 6, 4, -1, 1, 2), (1, 1, 1, 4, 0, 0, 2),
                 (1, 6, 6, 4, 1, 1, 3)):
        assert k(_p(xl), *args, _p(wp), 8, ffi.NULL, ffi.NULL, 0, _p(y), 1) == BAD
    assert k(_p(xl), 1, 6, 6, 4, 1, 1, 2, _p(wp), 8, ffi.NULL, ffi.NULL, 2, _p(y), 1) == BAD
    assert k(_p(xl), 1, 6, 6, 4, 1, 1, 2, _p(wp), 8, ffi.NULL, ffi.NULL, 0, _p(y), 0) == BAD
    assert k(ffi.NULL, 1, 6, 6, 4, 1, 1, 2, _p(wp), 8, ffi.NULL, ffi.NULL, 0, _p(y), 1) == BAD
    assert native.kernel("wino_packed_size")(0, 4, 2) == -1 and native.kernel("wino_packed_size")(8, 4, 3) == -1
    assert native.kernel("wino_pack_f32")(_p(wt), 8, 4, 5, _p(wp)) == BAD
