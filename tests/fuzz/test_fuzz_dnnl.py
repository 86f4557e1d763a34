"""Fuzzing the oneDNN binding: Matmul / matmul / Conv2d on random shapes, dtypes, strides,
post-op combinations and out= buffers (right, wrong dtype, wrong shape, overlapping). Each case
equals torch's reference within the dtype's tolerance or raises a clear error."""
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from cpu_opt.dnnl import primitives as P
from cpu_opt.dnnl import probe
from cpu_opt.errors import DnnlError

from fuzz_util import CLEAR_ERRORS, layouts

ACTS = {"relu": F.relu, "gelu_erf": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"), "silu": F.silu,
        "sigmoid": torch.sigmoid, "tanh": torch.tanh, "hardswish": F.hardswish}
FLOATS = st.sampled_from([torch.float32, torch.bfloat16])


def _tol(dtype):
    return 2e-2 if dtype == torch.bfloat16 else 2e-4


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-6)).item()


def _refused_as_expected(e, dtype):
    """oneDNN 3.2 refuses bf16 below avx512_core (a DnnlError naming dnnl_unimplemented)."""
    return isinstance(e, DnnlError) and e.status == "dnnl_unimplemented" and dtype != torch.float32 \
        and not probe.accepts("bf16")


@given(m=st.integers(0, 9), k=st.integers(1, 40), n=st.integers(1, 33), dtype=FLOATS, bias=st.booleans(),
       acts=st.lists(st.sampled_from(sorted(ACTS)), max_size=2), out_kind=st.sampled_from(
           ["none", "right", "wrong_dtype", "wrong_shape", "transposed"]), data=st.data())
def test_layer_matmul(m, k, n, dtype, bias, acts, out_kind, data):
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2 ** 16)))
    w = torch.randn(k, n, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    x = torch.randn(m, k, generator=g).to(dtype)
    x_l, kind = data.draw(layouts(x))
    out = {"none": None, "right": torch.empty(m, n, dtype=dtype), "wrong_dtype": torch.empty(m, n, dtype=torch.float64),
           "wrong_shape": torch.empty(m + 1, n, dtype=dtype), "transposed": torch.empty(n, m, dtype=dtype).t()}[out_kind]
    try:
        y = P.Matmul(w, b, acts)(x_l, out=out)
    except DnnlError as e:
        assert _refused_as_expected(e, dtype), e
        return
    except CLEAR_ERRORS as e:
        expected = kind in ("neg", "transposed", "sliced", "expanded") and not x_l.is_contiguous() or kind == "neg" \
            or out_kind in ("wrong_dtype", "wrong_shape") or (out_kind == "transposed" and m > 1 and n > 1)
        assert expected, (kind, out_kind, type(e).__name__, e)
        return
    assert kind != "neg"
    ref = x_l.double() @ w.double() + (b.double() if b is not None else 0)
    for a in acts:
        ref = ACTS[a](ref)
    assert y.shape == (m, n) and y.dtype == dtype
    if m:
        assert _rel(y, ref) < _tol(dtype) * (5 if acts else 1)


@given(batch=st.lists(st.integers(1, 3), max_size=2), m=st.integers(1, 8), k=st.integers(1, 20), n=st.integers(1, 12),
       dtype=FLOATS, transpose_b=st.booleans(), use_sum=st.booleans(), out_kind=st.sampled_from(
           ["none", "right", "wrong_dtype", "int8", "alias"]), data=st.data())
def test_functional_matmul(batch, m, k, n, dtype, transpose_b, use_sum, out_kind, data):
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2 ** 16)))
    a = torch.randn(*batch, m, k, generator=g).to(dtype)
    b = torch.randn(*batch, n, k, generator=g).to(dtype).transpose(-1, -2) if transpose_b else \
        torch.randn(*batch, k, n, generator=g).to(dtype)
    out = {"none": None, "right": torch.randn(*batch, m, n, generator=g).to(dtype),
           "wrong_dtype": torch.empty(*batch, m, n, dtype=torch.float32 if dtype == torch.bfloat16 else torch.bfloat16),
           "int8": torch.empty(*batch, m, n, dtype=torch.int8), "alias": a if (m, k) == (m, n) else None}[out_kind]
    base = out.clone() if out is not None else None
    post = [P.PostOp("sum")] if use_sum else []
    try:
        y = P.matmul(a, b, post_ops=post, out=out)
    except DnnlError as e:
        assert _refused_as_expected(e, dtype), e
        return
    except CLEAR_ERRORS as e:
        expected = (use_sum and out is None) or out_kind in ("wrong_dtype", "int8") or (out_kind == "alias" and out is not None)
        assert expected, (out_kind, use_sum, type(e).__name__, e)
        return
    assert not (use_sum and out is None)
    ref = a.double() @ b.double() + (base.double() if use_sum else 0)
    assert _rel(y, ref) < _tol(dtype) * 2


@given(n=st.integers(1, 2), c=st.integers(1, 6), hw=st.integers(1, 9), o=st.integers(1, 6), ks=st.sampled_from([1, 3]),
       stride=st.integers(1, 2), pad=st.integers(0, 1), dtype=FLOATS, channels_last=st.booleans(),
       add=st.sampled_from([None, "per_channel", "scalar", "wrong"]), data=st.data())
def test_conv2d(n, c, hw, o, ks, stride, pad, dtype, channels_last, add, data):
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2 ** 16)))
    w = torch.randn(o, c, ks, ks, generator=g).to(dtype)
    x = torch.randn(n, c, hw, hw, generator=g).to(dtype)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    post = []
    binary = []
    if add is not None:
        shape = {"per_channel": (1, o, 1, 1), "scalar": (), "wrong": (1, o, 1, 1)}[add]
        post = [P.PostOp("add", shape=shape)]
        binary = [torch.randn(*(shape or (1,)), generator=g).to(dtype)] if add != "wrong" else \
            [torch.randn(n, o, 2, 2, generator=g).to(dtype)]
    try:
        conv = P.Conv2d(w, stride=stride, padding=pad, post_ops=post)
        y = conv(x, binary=binary)
    except DnnlError as e:
        assert _refused_as_expected(e, dtype), e
        return
    except CLEAR_ERRORS as e:
        too_small = (hw + 2 * pad - ks) // stride + 1 < 1
        assert add == "wrong" or too_small, (add, type(e).__name__, e)
        return
    assert add != "wrong"
    ref = F.conv2d(x.double(), w.double(), stride=stride, padding=pad)
    if binary:
        ref = ref + binary[0].double().reshape((1,) * (4 - binary[0].dim()) + tuple(binary[0].shape))
    assert y.shape == ref.shape
    assert y.is_contiguous(memory_format=torch.channels_last if channels_last and not x.is_contiguous() else
                           torch.contiguous_format)
    assert _rel(y, ref) < _tol(dtype) * 2
