"""cpu_opt's packed fp32 GEMM (native/kernels/sgemm.c; cpu_opt.backends.native_linear.pack_weight /
packed_linear): every runnable variant against float64 at 1-3 threads, with row, column and K-block
tails, bias / residual / ReLU epilogues, strided rows, and the errors on bad input."""
import pytest
import torch

from cpu_opt import hw, native
from cpu_opt.backends import native_linear as NL


def runnable():
    info = hw.detect()
    return [v for v in native.compiled_variants() if native.VARIANT_REQUIRES[v] <= info.isa_uncapped]


def _p(t):
    return native.ptr(t, "float *")


_ACT = {False: 0, True: 1, "relu": 1, "gelu": 2, "gelu_tanh": 3}


def _ref(x, w, b=None, add=None, relu=False):
    y = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    if add is not None:
        y = y + add.double()
    if relu in ("gelu", "gelu_tanh"):
        return torch.nn.functional.gelu(y, approximate="tanh" if relu == "gelu_tanh" else "none")
    return torch.relu(y) if relu else y


def _call(variant, x, wp, n, b, add, relu, nt, lda=None):
    m, k = x.shape[0], x.shape[1] if lda is None else lda[0]
    out = torch.full((m, n), float("nan"))
    ffi = native.ffi()
    st = native.kernel("sgemm_packed_f32", variant)(
        _p(x), m, k, lda[1] if lda else k, _p(wp), n, ffi.NULL if b is None else _p(b),
        ffi.NULL if add is None else _p(add), _ACT[relu], _p(out), nt)
    assert st == 0
    return out


@pytest.mark.parametrize("M,K,N", [(1, 1, 1), (4, 7, 17), (7, 385, 33), (13, 769, 48), (128, 64, 16),
                                   (150, 800, 40), (6, 1200, 5),
                                   # a strip's last 1-5 rows on the 6-, 4- and 2-row tiles
                                   (9, 50, 33), (11, 70, 20), (8, 40, 17),
                                   # C beyond L2 per thread: panels in groups through every K block
                                   (128, 800, 1200), (300, 1000, 700),
                                   # narrow N, many rows: threads split the rows
                                   (100, 70, 40), (61, 390, 384),
                                   # A's strips over all of K beyond CO_SG_APACK: packed per K block
                                   (144, 15000, 20)])
def test_matches_float64_in_every_variant_and_thread_count(M, K, N):
    g = torch.Generator().manual_seed(M * 1000 + K + N)
    x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g)
    b, add = torch.randn(N, generator=g), torch.randn(M, N, generator=g)
    for v in runnable():
        wp = torch.empty(int(native.kernel("sgemm_packed_size", v)(N, K)))
        assert native.kernel("sgemm_pack_f32", v)(_p(w), N, K, 0, _p(wp)) == 0
        for nt in (1, 2, 3):
            for bias, res, relu in ((None, None, False), (b, None, False), (b, add, True), (None, add, False),
                                    (b, None, "gelu"), (b, add, "gelu_tanh")):
                y = _call(v, x, wp, N, bias, res, relu, nt)
                ref = _ref(x, w, bias, res, relu)
                err = ((y.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-12)).item()
                assert err < 1e-5, (v, nt, bias is not None, res is not None, relu, err)


def test_k_by_n_weights_and_strided_rows():
    g = torch.Generator().manual_seed(3)
    M, K, N = 20, 400, 37
    big = torch.randn(M, K + 9, generator=g)
    x = big[:, :K]                       # rows K + 9 apart
    w_kn = torch.randn(K, N, generator=g)
    for v in runnable():
        wp = torch.empty(int(native.kernel("sgemm_packed_size", v)(N, K)))
        assert native.kernel("sgemm_pack_f32", v)(_p(w_kn), N, K, 1, _p(wp)) == 0
        y = _call(v, big, wp, N, None, None, False, 2, lda=(K, K + 9))
        assert torch.allclose(y.double(), x.double() @ w_kn.double(), rtol=1e-5, atol=1e-4)


def test_wrapper_shapes_activations_and_fresh_outputs():
    g = torch.Generator().manual_seed(5)
    x, w, b = torch.randn(2, 9, 300, generator=g), torch.randn(70, 300, generator=g), torch.randn(70, generator=g)
    wp = NL.pack_weight(w)
    y1 = NL.packed_linear(x, wp, b, 70)
    assert y1.shape == (2, 9, 70)
    torch.testing.assert_close(y1, torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-4)
    y2 = NL.packed_linear(x, wp, b, 70)
    assert y2.data_ptr() != y1.data_ptr()
    torch.testing.assert_close(y1, y2, rtol=0, atol=0)
    # a permuted (non-contiguous) input is taken too
    xt = x.transpose(0, 1)
    torch.testing.assert_close(NL.packed_linear(xt, wp, b, 70), torch.nn.functional.linear(xt, w, b), rtol=1e-5, atol=1e-4)
    # relu as torch's: NaN passes, negatives become 0
    xs = torch.zeros(4, 300)
    xs[0, 0] = float("nan")
    ws = torch.ones(16, 300)
    bs = torch.full((16,), -1.0)
    r = NL.packed_linear(xs, NL.pack_weight(ws), bs, 16, act="relu")
    assert torch.isnan(r[0]).all() and (r[1:] == 0).all()
    # the GELUs: what cpu_opt's GELU kernels give on the plain GEMM's output, in the body and the
    # column tail (70 = 4 panels + 6: there the scalar form of the same formula, within an ulp), so
    # fusing one into the GEMM changes the result by float32 rounding at most
    from cpu_opt.backends import native_eltwise
    for act, sep in (("gelu", native_eltwise.gelu), ("gelu_tanh", native_eltwise.gelu_tanh)):
        fused = NL.packed_linear(x, wp, b, 70, act=act)
        torch.testing.assert_close(fused[..., :64], sep(y1)[..., :64], rtol=0, atol=0)
        torch.testing.assert_close(fused, sep(y1), rtol=2.5e-7, atol=2.5e-7)
        exact = torch.nn.functional.gelu(y1.double(), approximate="tanh" if act == "gelu_tanh" else "none")
        torch.testing.assert_close(fused.double(), exact, rtol=0, atol=1e-5)
    # the class target: as the linear pass calls it
    pl = NL.PackedLinear(70, 300)
    torch.testing.assert_close(pl(x, wp, b), y1, rtol=0, atol=0)
    torch.testing.assert_close(NL.PackedLinear(70, 300, "gelu")(x, wp, b), native_eltwise.gelu(y1), rtol=2.5e-7,
                               atol=2.5e-7)
    empty = NL.packed_linear(torch.empty(0, 300), wp, b, 70)
    assert empty.shape == (0, 70)


def test_bad_input_raises_and_writes_nothing():
    w = torch.randn(20, 30)
    wp = NL.pack_weight(w)
    with pytest.raises(ValueError, match="not packed for"):
        NL.packed_linear(torch.randn(4, 31), wp, None, 20)
    with pytest.raises(ValueError, match="bias"):
        NL.packed_linear(torch.randn(4, 30), wp, torch.randn(19), 20)
    with pytest.raises(ValueError, match="add"):
        NL.packed_linear(torch.randn(4, 30), wp, None, 20, add=torch.randn(4, 19))
    with pytest.raises(ValueError, match="float32"):
        NL.packed_linear(torch.randn(4, 30, dtype=torch.float64), wp, None, 20)
    with pytest.raises(ValueError, match="2-D float32"):
        NL.pack_weight(torch.randn(3, 4, 5))
    with pytest.raises(ValueError, match="act must be one of"):
        NL.packed_linear(torch.randn(4, 30), wp, None, 20, act="swish")
    with pytest.raises(ValueError, match="act must be one of"):
        NL.PackedLinear(20, 30, "tanh")
    ffi = native.ffi()
    out = torch.full((4, 20), 7.0)
    x = torch.randn(4, 30)
    k = native.kernel("sgemm_packed_f32")
    for args in ((_p(x), 4, 30, 29, _p(wp), 20, ffi.NULL, ffi.NULL, 0, _p(out), 1),   # lda < K
                 (_p(x), -1, 30, 30, _p(wp), 20, ffi.NULL, ffi.NULL, 0, _p(out), 1),  # M < 0
                 (_p(x), 4, 30, 30, _p(wp), 0, ffi.NULL, ffi.NULL, 0, _p(out), 1),    # N < 1
                 (_p(x), 4, 30, 30, _p(wp), 20, ffi.NULL, ffi.NULL, 4, _p(out), 1),   # act not 0-3
                 (_p(x), 4, 30, 30, _p(wp), 20, ffi.NULL, ffi.NULL, -1, _p(out), 1),  # act not 0-3
                 (_p(x), 4, 30, 30, ffi.NULL, 20, ffi.NULL, ffi.NULL, 0, _p(out), 1),  # NULL weight
                 (_p(x), 4, 30, 30, _p(wp), 20, ffi.NULL, ffi.NULL, 0, _p(out), 0)):   # no threads
        assert k(*args) == -2
    assert (out == 7.0).all()
    assert native.kernel("sgemm_pack_f32")(_p(w), 20, 30, 2, _p(wp)) == -2
    assert native.kernel("sgemm_packed_size")(0, 5) == -1


def test_a_smaller_thread_team_still_computes_every_column():
    """OpenMP may give fewer threads than asked (OMP_THREAD_LIMIT, nesting): the work is split over the
    team there is, so no panel or row block is left unwritten."""
    import os
    import subprocess
    import sys

    code = (
        "import torch\n"
        "from cpu_opt.backends import native_linear as NL\n"
        "from cpu_opt import native\n"
        "g = torch.Generator().manual_seed(1)\n"
        "for m, n in ((40, 100), (50, 8)):\n"   # many panels (split over columns); one panel (over rows)
        "    x, w = torch.randn(m, 70, generator=g), torch.randn(n, 70, generator=g)\n"
        "    wp, out = NL.pack_weight(w), torch.full((m, n), float('nan'))\n"
        "    ffi = native.ffi()\n"
        "    st = native.kernel('sgemm_packed_f32')(native.ptr(x, 'float *'), m, 70, 70, native.ptr(wp, 'float *'), n,\n"
        "                                           ffi.NULL, ffi.NULL, 0, native.ptr(out, 'float *'), 4)\n"
        "    assert st == 0\n"
        "    torch.testing.assert_close(out, x @ w.T, rtol=1e-5, atol=1e-4)\n"
        "print('ok')\n")
    env = dict(os.environ, OMP_THREAD_LIMIT="1")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]
