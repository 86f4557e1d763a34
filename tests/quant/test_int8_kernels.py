"""quant/kernels.py — every int8 kernel family that builds on this machine, against a float64
reference computed from the dequantized input and dequantized weights.

Inputs lie exactly on their quantization grid (power-of-two scales), so the only differences are
float rounding (fp32 outputs: relative 1e-5 of the output's magnitude) or, where a kernel writes
uint8 or requantizes (FBGEMM's convolution), one output quantization step. Without VNNI the inputs
use 7 bits (0..127), as the default qconfig does there: full-range u8 x s8 products saturate in
vpmaddubsw's int16 pair sums on every family alike.
"""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quant_testutil import (REF_POST, X_QMAX, buildable_families, dequant_u8, dequant_w,  # noqa: E402
                            grid_input, int8_weights, minmax_qparams, quantize_ref, ref_conv2d)

from cpu_opt.backends.fbgemm import depthwise_saturates  # noqa: E402
from cpu_opt.quant import choose_family  # noqa: E402
from cpu_opt.quant import kernels as K  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:.*quantized tensor creation functions:UserWarning")

POSTS = [None, "relu", "gelu_erf", "gelu_tanh", "silu", "hardswish"]
XS, XZ = 2.0 ** -5, 40           # input qparams: a power-of-two scale, a zero point inside the range
N, KD = 24, 40                   # linear: out, in features


LINEAR_FAMILIES = buildable_families("linear")
CONV_FAMILIES = buildable_families("conv2d")


def test_the_expected_families_build_here():
    # FBGEMM and torch's oneDNN ship with torch on x86-64; cpu_opt's oneDNN is the package's own
    # (a pip dependency on x86-64: it loads wherever these tests run)
    assert {"fbgemm", "torch_onednn", "onednn"} <= set(LINEAR_FAMILIES)
    assert {"fbgemm", "torch_onednn", "onednn"} <= set(CONV_FAMILIES)
    assert set(K.CONV_KERNELS) - {"torch"} == {"fbgemm", "torch_onednn", "onednn"}


def _fp32_close(y, ref, rel=1e-5):
    assert y.dtype == torch.float32
    assert y.shape == ref.shape, (y.shape, ref.shape)
    err = (y.double() - ref).abs().max().item()
    bound = rel * ref.abs().max().item() + 1e-6
    assert err <= bound, f"max abs error {err:.3g} > {bound:.3g}"


def _u8_within_one_step(u, ref, qp):
    """A chained uint8 output: the consumer's input bytes, so at most X_QMAX (7 bits without VNNI)."""
    assert u.dtype == torch.uint8
    assert u.shape == ref.shape, (u.shape, ref.shape)
    assert int(u.max()) <= X_QMAX
    d = (u.double() - quantize_ref(ref, *qp).clamp(max=X_QMAX)).abs().max().item()
    assert d <= 1, f"uint8 output {d} steps from the reference"


def _chain_qparams(ref):
    """The qparams a consumer's input observer gives for ``ref``: what a chained output is written with."""
    return minmax_qparams(ref, X_QMAX)


# ------------------------------------------------------------------------------------- linear
def _linear_case(bias: bool, shape=(2, 5, KD), seed=1):
    wq, ws = int8_weights((N, KD), seed)
    b = torch.randn(N, generator=torch.Generator().manual_seed(seed + 7)) if bias else None
    x, u = grid_input(shape, XS, XZ, seed + 11)
    ref = x.double() @ dequant_w(wq, ws).t()
    if b is not None:
        ref = ref + b.double()
    return wq, ws, b, x, u, ref


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("post_op", POSTS, ids=str)
@pytest.mark.parametrize("family", LINEAR_FAMILIES)
def test_linear_fp32_output_matches_float64_reference(family, post_op, bias):
    wq, ws, b, x, u, ref = _linear_case(bias)
    k = K.LINEAR_KERNELS[family](wq, ws, b, (XS, XZ), post_op=post_op)
    assert k.family == family and k.kind == "linear"
    _fp32_close(k(x), REF_POST[post_op](ref))                          # 3-D input
    _fp32_close(k(x[0]), REF_POST[post_op](ref[0]))                    # 2-D input


@pytest.mark.parametrize("post_op", POSTS, ids=str)
@pytest.mark.parametrize("family", LINEAR_FAMILIES)
def test_linear_uint8_output_within_one_step(family, post_op):
    wq, ws, b, x, u, ref = _linear_case(True, seed=3)
    ref = REF_POST[post_op](ref)
    qp = _chain_qparams(ref)
    k = K.LINEAR_KERNELS[family](wq, ws, b, (XS, XZ), post_op=post_op, out_qparams=qp)
    k.own_out_qparams = qp
    _u8_within_one_step(k(x), ref, qp)


@pytest.mark.parametrize("family", LINEAR_FAMILIES)
def test_linear_uint8_output_is_clamped_for_its_consumer(family):
    # values beyond the consumer's calibrated range saturate at X_QMAX (never the 8-bit values
    # that the u8 x s8 kernels without VNNI would get wrong)
    wq, ws, b, x, u, ref = _linear_case(True, seed=4)
    lo, hi = float(ref.min()), float(ref.max())
    qp = minmax_qparams(ref.clamp(max=hi / 2), X_QMAX)          # half the positive range
    y = K.LINEAR_KERNELS[family](wq, ws, b, (XS, XZ), out_qparams=qp)(x)
    assert int(y.max()) == X_QMAX
    d = (y.double() - quantize_ref(ref, *qp).clamp(max=X_QMAX)).abs().max().item()
    assert d <= 1 and lo < 0


@pytest.mark.parametrize("out", ["fp32", "uint8"])
@pytest.mark.parametrize("post_op", [None, "relu", "gelu_tanh"], ids=str)
@pytest.mark.parametrize("family", LINEAR_FAMILIES)
def test_linear_uint8_chained_input_equals_fp32_input(family, post_op, out):
    wq, ws, b, x, u, ref = _linear_case(True, seed=5)
    qp = _chain_qparams(REF_POST[post_op](ref)) if out == "uint8" else None
    k = K.LINEAR_KERNELS[family](wq, ws, b, (XS, XZ), post_op=post_op, out_qparams=qp)
    # the bytes a previous int8 layer writes with this layer's input qparams
    assert torch.equal(u, K.as_u8(torch.quantize_per_tensor(x, XS, XZ, torch.quint8)))
    y_f, y_u = k(x), k(u)
    assert y_f.dtype == y_u.dtype == (torch.uint8 if qp else torch.float32)
    assert torch.equal(y_f, y_u)


@pytest.mark.parametrize("relu", [False, True])
def test_fbgemm_linear_uint8_input_requantizes_within_one_own_step(relu):
    # chained u8 in, fp32 out: FBGEMM writes int8 with the layer's own observed output range, then
    # dequantizes (its requantizing output stage): one own-output step from the fp32-input answer
    wq, ws, b, x, u, ref = _linear_case(True, seed=9)
    ref = REF_POST["relu" if relu else None](ref)
    own = minmax_qparams(ref)
    k = K.FbgemmLinear(wq, ws, b, (XS, XZ), post_op="relu" if relu else None)
    k.own_out_qparams = own
    y = k(u)
    assert y.dtype == torch.float32
    assert (y.double() - ref).abs().max().item() <= own[0] * (1 + 1e-4)
    _fp32_close(k(x), ref)


# ------------------------------------------------------------------------------------- conv2d
# name: (in channels, out channels, kernel, stride, padding, dilation, groups, channels-last input)
GEOMETRIES = {
    "3x3": (8, 16, 3, 1, 1, 1, 1, False),
    "1x1": (8, 16, 1, 1, 0, 1, 1, False),
    "stride2": (8, 16, 3, 2, 1, 1, 1, False),
    "dilation2": (8, 16, 3, 1, 2, 2, 1, False),
    "groups4": (8, 16, 3, 1, 1, 1, 4, False),
    "depthwise": (16, 16, 3, 1, 1, 1, 16, False),
    "channels_last": (8, 16, 3, 1, 1, 1, 1, True),
}


def _conv_case(geom: str, bias: bool, seed=21, batch=2, hw=9):
    cin, cout, ks, stride, pad, dil, groups, cl = GEOMETRIES[geom]
    wq, ws = int8_weights((cout, cin // groups, ks, ks), seed)
    b = torch.randn(cout, generator=torch.Generator().manual_seed(seed + 1)) if bias else None
    x, u = grid_input((batch, cin, hw, hw), XS, XZ, seed + 2, channels_last=cl)
    ref = ref_conv2d(x, dequant_w(wq, ws), b, stride, pad, dil, groups)
    conv = dict(stride=stride, padding=pad, dilation=dil, groups=groups)
    return wq, ws, b, x, u, ref, conv


def _conv_kernel(family, wq, ws, b, conv, x_shape, **kw):
    """The kernel, or None where FBGEMM's depthwise kernel would saturate with this CPU's 8-bit
    activations: then the refusal is what is asserted (and that the layer is routed elsewhere)."""
    extra = {"x_shape": tuple(x_shape)} if family == "torch_onednn" else {}
    if family == "fbgemm" and depthwise_saturates(tuple(wq.shape), conv["groups"], conv["dilation"]):
        with pytest.raises(ValueError, match="saturates with the 8-bit activations"):
            K.CONV_KERNELS[family](wq, ws, b, (XS, XZ), **conv, **extra, **kw)
        fam, why = choose_family("conv2d", x_shape[0], 10**9, conv=(tuple(wq.shape), conv["groups"], conv["dilation"]))
        assert K.CONV_KERNELS[fam] is not K.FbgemmConv2d, (fam, why)
        return None
    return K.CONV_KERNELS[family](wq, ws, b, (XS, XZ), **conv, **extra, **kw)


REQUANT_POSTS = ("gelu_erf", "gelu_tanh", "silu", "hardswish")   # FBGEMM runs these after an int8 convolution
# half a raw step times the activation's largest slope: GELU 1.13, SiLU 1.10, HardSwish 1.5 (at x = 3)
HALF_STEP_SLOPE = {"gelu_erf": 0.57, "gelu_tanh": 0.57, "silu": 0.57, "hardswish": 0.75}


def _qparams_as_graph_sets_them(k, raw, ref, chained):
    """own_out (the layer's observed value) and, as quant/graph.py does when an activation or add
    follows the convolution, raw (its output before them)."""
    k.own_out_qparams = _chain_qparams(ref) if chained else minmax_qparams(ref)
    if k.post_op is not None:
        k.raw_qparams = minmax_qparams(raw)


def _check_conv(family, post_op, y, ref, k, chained):
    """fp32: exact for torch's oneDNN; FBGEMM writes int8 and is dequantized: within one output step,
    or, where GELU/SiLU/HardSwish runs after it, within half a raw step times the activation's largest
    slope (:data:`HALF_STEP_SLOPE`). uint8 (chained): one step; FBGEMM + those: that bound + half a step."""
    if not chained and family != "fbgemm":
        return _fp32_close(y, ref)
    assert y.shape == ref.shape
    if chained and not (family == "fbgemm" and post_op in REQUANT_POSTS):
        return _u8_within_one_step(y, ref, k.out_qparams)
    if chained:
        assert y.dtype == torch.uint8 and int(y.max()) <= X_QMAX
        y = dequant_u8(y, *k.out_qparams)
        bound = HALF_STEP_SLOPE[post_op] * k.raw_qparams[0] + 0.5 * k.out_qparams[0]
    else:
        assert y.dtype == torch.float32
        bound = HALF_STEP_SLOPE[post_op] * k.raw_qparams[0] if post_op in REQUANT_POSTS else k.own_out_qparams[0]
    err = (y.double() - ref).abs().max().item()
    assert err <= bound * (1 + 1e-4) + 1e-6, f"{err:.4g} > {bound:.4g}"


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("post_op", POSTS, ids=str)
@pytest.mark.parametrize("geom", list(GEOMETRIES))
@pytest.mark.parametrize("family", CONV_FAMILIES)
def test_conv_fp32_output_matches_float64_reference(family, geom, post_op, bias):
    wq, ws, b, x, u, raw, conv = _conv_case(geom, bias)
    ref = REF_POST[post_op](raw)
    k = _conv_kernel(family, wq, ws, b, conv, x.shape, post_op=post_op)
    if k is None:
        return
    _qparams_as_graph_sets_them(k, raw, ref, chained=False)
    assert k.family == family and k.kind == "conv2d"
    y = k(x)
    assert tuple(y.shape) == k.out_shape(tuple(x.shape))
    _check_conv(family, post_op, y, ref, k, chained=False)


@pytest.mark.parametrize("post_op", POSTS, ids=str)
@pytest.mark.parametrize("geom", ["3x3", "stride2", "depthwise", "channels_last"])
@pytest.mark.parametrize("family", CONV_FAMILIES)
def test_conv_uint8_output_within_one_step(family, geom, post_op):
    wq, ws, b, x, u, raw, conv = _conv_case(geom, True, seed=31)
    ref = REF_POST[post_op](raw)
    k = _conv_kernel(family, wq, ws, b, conv, x.shape, post_op=post_op, out_qparams=_chain_qparams(ref))
    if k is None:
        return
    _qparams_as_graph_sets_them(k, raw, ref, chained=True)
    _check_conv(family, post_op, k(x), ref, k, chained=True)


@pytest.mark.parametrize("geom", list(GEOMETRIES))
def test_a_route_to_fbgemm_leaves_depthwise_layers_that_would_saturate(geom, monkeypatch):
    """Where the routing table or profile says FBGEMM for int8 convolutions, a depthwise layer whose
    FBGEMM kernel saturates with this CPU's 8-bit activations goes to torch's oneDNN instead."""
    from cpu_opt.platform import routing

    monkeypatch.setattr(routing, "route", lambda work, dtype, **kw: routing.Route(work, dtype, "fbgemm", "forced"))
    wq, ws, b, x, u, raw, conv = _conv_case(geom, True)
    geometry = (tuple(wq.shape), conv["groups"], conv["dilation"])
    fam, why = choose_family("conv2d", 2, 10**9, conv=geometry)
    if depthwise_saturates(*geometry):
        assert geom == "depthwise" and X_QMAX == 255
        assert fam == "torch_onednn" and "saturates" in why, (fam, why)
    else:
        assert fam == "fbgemm" and why == "routing (table): forced"


@pytest.mark.parametrize("out", ["fp32", "uint8"])
@pytest.mark.parametrize("geom", ["3x3", "groups4", "channels_last"])
@pytest.mark.parametrize("family", CONV_FAMILIES)
def test_conv_uint8_chained_input_equals_fp32_input(family, geom, out):
    wq, ws, b, x, u, raw, conv = _conv_case(geom, True, seed=41)
    ref = torch.relu(raw)
    qp = _chain_qparams(ref)
    k = _conv_kernel(family, wq, ws, b, conv, x.shape, post_op="relu", out_qparams=qp if out == "uint8" else None)
    _qparams_as_graph_sets_them(k, raw, ref, chained=out == "uint8")
    y_f, y_u = k(x), k(u)
    assert y_f.dtype == y_u.dtype == (torch.uint8 if out == "uint8" else torch.float32)
    assert torch.equal(y_f, y_u)


@pytest.mark.parametrize("out", ["fp32", "uint8"])
@pytest.mark.parametrize("post_op", REQUANT_POSTS)
def test_fbgemm_conv_gelu_silu_keeps_values_below_the_activation_minimum(post_op, out):
    # a 1x1 identity convolution: the answer is post_op(x) itself, x spanning -8..8 (7 bits: -4..4),
    # far below GELU's / SiLU's minimum (-0.17 / -0.28 at -0.75 / -1.28): the convolution's int8
    # output must be written with its raw range, not the activation's (which would turn silu(-8)
    # into silu(-0.28) = -0.12 instead of -0.003: fixed in 1f29273)
    c = 8
    wq = (torch.eye(c, dtype=torch.int8) * 64).reshape(c, c, 1, 1)
    ws = torch.full((c,), 1 / 64)
    zp = 128 if X_QMAX == 255 else 64
    xq = (2.0 ** -4, zp)
    x, _ = grid_input((1, c, 6, 6), xq[0], zp, 3)
    raw = x.double()
    ref = REF_POST[post_op](raw)
    chained = out == "uint8"
    k = K.FbgemmConv2d(wq, ws, None, xq, stride=1, padding=0, dilation=1, groups=1, post_op=post_op,
                       out_qparams=_chain_qparams(ref) if chained else None)
    _qparams_as_graph_sets_them(k, raw, ref, chained)
    _check_conv("fbgemm", post_op, k(x), ref, k, chained)


# residual: y = post_op(conv(x) + other), ``other`` fp32 or uint8 from an int8 layer
OS, OZ = 2.0 ** -4, 64          # the residual's qparams (other lies on this grid)


def _residual_case(family, post_op, other_dtype, seed=51):
    wq, ws, b, x, u, raw, conv = _conv_case("3x3", True, seed=seed)
    other_f, other_u = grid_input(tuple(raw.shape), OS, OZ, seed + 5, qmax=255)
    ref = REF_POST[post_op](raw + other_f.double())
    k = _conv_kernel(family, wq, ws, b, conv, x.shape, post_op=post_op)
    # as quant/graph.py sets them: the residual's qparams, the range of the convolution before
    # the add ("raw") and of the layer's value after add and activation ("own")
    k.other_qparams = (OS, OZ)
    k.raw_qparams = minmax_qparams(raw)
    k.own_out_qparams = minmax_qparams(ref)
    other = other_f if other_dtype == "fp32" else other_u
    return k, x, other, ref


def _check_residual(family, k, y, ref):
    if family == "fbgemm":
        # int8 convolution (raw qparams) then the quantized add (+ ReLU) or the fp32 add + GELU/SiLU:
        # half a raw step (times the activation's slope) + one output step
        bound = HALF_STEP_SLOPE.get(k.post_op, 0.5) * k.raw_qparams[0] + k.own_out_qparams[0]
        err = (y.double() - ref).abs().max().item()
        assert y.dtype == torch.float32 and y.shape == ref.shape
        assert err <= bound * (1 + 1e-4), f"{err:.4g} > {bound:.4g}"
    else:
        _fp32_close(y, ref)


@pytest.mark.parametrize("other_dtype", ["fp32", "uint8"])
@pytest.mark.parametrize("post_op", POSTS, ids=str)
@pytest.mark.parametrize("family", CONV_FAMILIES)
def test_conv_residual_add(family, post_op, other_dtype):
    k, x, other, ref = _residual_case(family, post_op, other_dtype)
    _check_residual(family, k, k(x, other), ref)


@pytest.mark.parametrize("family", CONV_FAMILIES)
def test_conv_residual_uint8_without_its_qparams_raises(family):
    k, x, other, ref = _residual_case(family, "relu", "uint8")
    k.other_qparams = None
    with pytest.raises(RuntimeError, match="uint8 residual"):
        k(x, other)


def test_fbgemm_conv_fp32_output_needs_an_output_scale():
    wq, ws, b, x, u, ref, conv = _conv_case("3x3", True)
    k = K.FbgemmConv2d(wq, ws, b, (XS, XZ), **conv)
    with pytest.raises(RuntimeError, match="output scale"):
        k(x)


# ------------------------------------------------------------------------------------- guards
def _build(kind, family, wq=None, ws=None, xq=(XS, XZ), **kw):
    if kind == "linear":
        d_wq, d_ws = int8_weights((N, KD), 0)
        return K.LINEAR_KERNELS[family](d_wq if wq is None else wq, d_ws if ws is None else ws, None, xq, **kw)
    d_wq, d_ws = int8_weights((16, 8, 3, 3), 0)
    return K.CONV_KERNELS[family](d_wq if wq is None else wq, d_ws if ws is None else ws, None, xq,
                                  stride=1, padding=1, dilation=1, groups=1, **kw)


ALL = [("linear", f) for f in LINEAR_FAMILIES] + [("conv2d", f) for f in CONV_FAMILIES]
IDS = [f"{k}-{f}" for k, f in ALL]


def _wshape(kind):
    return (N, KD) if kind == "linear" else (16, 8, 3, 3)


@pytest.mark.parametrize("kind,family", ALL, ids=IDS)
def test_nonzero_weight_zero_points_raise(kind, family):
    zps = torch.zeros(_wshape(kind)[0], dtype=torch.int64)
    _build(kind, family, w_zero_points=zps)        # all zero: fine
    zps[3] = 2
    with pytest.raises(ValueError, match="zero points"):
        _build(kind, family, w_zero_points=zps)


@pytest.mark.parametrize("kind,family", ALL, ids=IDS)
@pytest.mark.parametrize("wdtype", [torch.float32, torch.uint8, torch.int32])
def test_non_int8_weights_raise_type_error(kind, family, wdtype):
    w = torch.ones(_wshape(kind), dtype=wdtype)
    with pytest.raises(TypeError, match="int8 weights"):
        _build(kind, family, wq=w)


@pytest.mark.parametrize("kind,family", ALL, ids=IDS)
def test_wrong_number_of_weight_scales_raises(kind, family):
    n = _wshape(kind)[0]
    for ws in (torch.full((n - 1,), 0.01), torch.full((n + 1,), 0.01), torch.full((2, n), 0.01)):
        with pytest.raises(ValueError, match="weight scales"):
            _build(kind, family, ws=ws)
    with pytest.raises(ValueError, match="positive"):
        _build(kind, family, ws=torch.zeros(n))
    # one scale for every channel is accepted (broadcast)
    assert _build(kind, family, ws=torch.tensor([0.01])).w_scales.shape == (n,)


@pytest.mark.parametrize("kind,family", ALL, ids=IDS)
@pytest.mark.parametrize("xq", [(0.0, 10), (-0.1, 10), (float("nan"), 10), (0.1, -1), (0.1, 256)], ids=str)
def test_bad_input_qparams_raise(kind, family, xq):
    with pytest.raises(ValueError, match="input qparams"):
        _build(kind, family, xq=xq)


@pytest.mark.parametrize("kind,family", ALL, ids=IDS)
def test_bad_post_op_raises(kind, family):
    with pytest.raises(ValueError, match="post_op"):
        _build(kind, family, post_op="swish")


def test_conv_needs_4d_weights():
    wq, ws = int8_weights((16, 8, 3), 0)
    with pytest.raises(ValueError, match="4-D"):
        K.FbgemmConv2d(wq, ws, None, (XS, XZ), stride=1, padding=1, dilation=1, groups=1)


def _bad_input_cases():
    cases = []
    for kind, family in ALL:
        for own in (False, True):
            cases.append(pytest.param(kind, family, own, id=f"{kind}-{family}-own{int(own)}"))
    return cases


@pytest.mark.parametrize("kind,family,own", _bad_input_cases())
def test_non_float_non_uint8_input_raises_type_error(kind, family, own):
    k = _build(kind, family)
    k.own_out_qparams = (0.1, 128) if own or kind == "conv2d" else None
    shape = (4, KD) if kind == "linear" else (1, 8, 6, 6)
    for dt in (torch.int8, torch.int32, torch.int64):
        with pytest.raises(TypeError):
            k(torch.ones(shape, dtype=dt))


# ------------------------------------------------------------------------------------- fake tensors
@pytest.mark.parametrize("out", ["fp32", "uint8"])
@pytest.mark.parametrize("kind,family", ALL, ids=IDS)
def test_fake_tensor_calls_give_shape_and_dtype_without_computing(kind, family, out, monkeypatch):
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    qp = (0.1, 128) if out == "uint8" else None
    if kind == "linear":
        k = _build(kind, family, out_qparams=qp)
        real_x = torch.randn(3, 7, KD)
    else:
        wq, ws = int8_weights((16, 4, 3, 3), 0)     # groups 2, stride 2, padding 2, dilation 2
        k = K.CONV_KERNELS[family](wq, ws, None, (XS, XZ), stride=2, padding=2, dilation=2, groups=2,
                                   out_qparams=qp)
        real_x = torch.randn(2, 8, 13, 11)
    k.own_out_qparams = (0.1, 128)
    real = k(real_x)
    calls = []
    monkeypatch.setattr(type(k), "run", lambda self, x, other=None: calls.append(1))
    with FakeTensorMode():
        fx = torch.empty(real_x.shape)
        y = k(fx)
        assert isinstance(y, FakeTensor)
    assert not calls                                # no kernel ran
    assert tuple(y.shape) == tuple(real.shape)
    assert y.dtype == real.dtype == (torch.uint8 if qp else torch.float32)
    # meta tensors too (what the graph pass writes into node.meta)
    y = k(torch.empty(real_x.shape, device="meta"))
    assert y.device.type == "meta" and tuple(y.shape) == tuple(real.shape) and not calls


# ------------------------------------------------------------------------------------- u8 helpers
def test_as_u8_and_from_u8_round_trip_without_copy():
    x, u = grid_input((3, 5, 7), XS, XZ, 99)
    q = torch.quantize_per_tensor(x, XS, XZ, torch.quint8)
    b = K.as_u8(q)
    assert b.dtype == torch.uint8 and torch.equal(b, u)
    assert b.untyped_storage().data_ptr() == q.untyped_storage().data_ptr()      # no copy
    back = K.from_u8(b, XS, XZ)
    assert torch.equal(back.dequantize(), x)
    assert torch.equal(dequant_u8(b, XS, XZ).float(), x)
    with pytest.raises(TypeError):
        K.as_u8(torch.quantize_per_channel(torch.randn(4, 3), torch.ones(4, dtype=torch.double),
                                           torch.zeros(4, dtype=torch.long), 0, torch.quint8))
    with pytest.raises(TypeError, match="float or uint8"):
        K.quantize_input(torch.ones(3, dtype=torch.int32), XS, XZ)
    assert X_QMAX in (127, 255)


# residual on a linear layer: y = post_op(linear(x) + other) (a transformer's attention output and FFN
# projections + the skip connection); cpu_opt's oneDNN fuses the add, the others add in fp32 after
@pytest.mark.parametrize("other_dtype", ["fp32", "uint8"])
@pytest.mark.parametrize("post_op", [None, "relu", "gelu_erf"], ids=str)
@pytest.mark.parametrize("chained", [False, True], ids=["fp32_out", "uint8_out"])
@pytest.mark.parametrize("family", LINEAR_FAMILIES)
def test_linear_residual_add(family, post_op, other_dtype, chained):
    wq, ws, b, x, u, raw = _linear_case(True, seed=61)
    other_f, other_u = grid_input(tuple(raw.shape), OS, OZ, 66, qmax=255)
    ref = REF_POST[post_op](raw + other_f.double())
    qp = _chain_qparams(ref) if chained else None
    k = K.LINEAR_KERNELS[family](wq, ws, b, (XS, XZ), post_op=post_op, out_qparams=qp)
    k.other_qparams = (OS, OZ)
    k.raw_qparams = minmax_qparams(raw)
    k.own_out_qparams = qp or minmax_qparams(ref)
    other = other_f if other_dtype == "fp32" else other_u
    before = other.clone()
    y = k(x, other)
    assert torch.equal(other, before)                               # the residual is read, never written
    if chained:
        _u8_within_one_step(y, ref, qp)
    else:
        _fp32_close(y, ref)
    if other_dtype == "uint8":
        k.other_qparams = None
        with pytest.raises(RuntimeError, match="uint8 residual"):
            k(x, other)


@pytest.mark.parametrize("other_dtype", ["fp32", "uint8", "int8"])
@pytest.mark.parametrize("post_op", [None, "relu", "silu"], ids=str)
@pytest.mark.parametrize("family", CONV_FAMILIES)
def test_conv_residual_add_into_uint8(family, post_op, other_dtype):
    """conv + residual (+ activation) written as uint8 for the next int8 layer, the residual fp32,
    uint8 (asymmetric) or int8 (symmetric, as cpu_opt's oneDNN writes a shortcut read only as a
    residual): within one output step. cpu_opt's oneDNN folds an integer residual's scale into the
    input scale, bias and output scale where the activation is ReLU or none."""
    wq, ws, b, x, u, raw, conv = _conv_case("3x3", True, seed=71)
    if other_dtype == "int8":
        qp = (OS, 0)
        g = torch.Generator().manual_seed(76)
        other = torch.randint(-120, 121, tuple(raw.shape), generator=g, dtype=torch.int32).to(torch.int8)
        other_f = other.double() * OS
    else:
        qp = (OS, OZ)
        of, ou = grid_input(tuple(raw.shape), OS, OZ, 76, qmax=255)
        other, other_f = (of if other_dtype == "fp32" else ou), of.double()
    ref = REF_POST[post_op](raw + other_f)
    out_qp = _chain_qparams(ref)
    k = _conv_kernel(family, wq, ws, b, conv, x.shape, post_op=post_op, out_qparams=out_qp)
    k.other_qparams = qp
    k.raw_qparams = minmax_qparams(raw)
    k.own_out_qparams = out_qp
    if other_dtype == "int8" and family != "onednn":
        with pytest.raises(TypeError, match="int8 residual is for cpu_opt's oneDNN"):
            k(x, other)      # the graph pass writes int8 residuals only for cpu_opt's oneDNN layers
        return
    y = k(x, other)
    if family == "fbgemm" and post_op == "silu":
        bound = HALF_STEP_SLOPE[post_op] * k.raw_qparams[0] + out_qp[0]
        assert (dequant_u8(y, *out_qp) - ref).abs().max().item() <= bound * 1.0001
    else:
        _u8_within_one_step(y, ref, out_qp)
