"""cpu_opt's decode-step GEMV (native/kernels/gemv.c, backends/native_linear.py) and its route
(passes.route_linears sends 1-3 row linear layers to it where the native kernels are vectorized)."""
import pytest
import torch
from torch import nn

import cpu_opt
from cpu_opt import hw, native, routing
from cpu_opt.backends import native_linear


def runnable():
    info = hw.detect()
    return [v for v in native.compiled_variants() if native.VARIANT_REQUIRES[v] <= info.isa_uncapped]


def _gemv(x, w, b, kn, variant, nthreads):
    M, K = x.shape
    N = w.shape[1] if kn else w.shape[0]
    y = torch.full((M, N), float("nan"))
    st = native.kernel("gemv_f32", variant)(native.ptr(x, "float *"), M, K, native.ptr(w, "float *"), N, int(kn),
                                            native.ffi().NULL if b is None else native.ptr(b, "float *"),
                                            native.ptr(y, "float *"), nthreads)
    native.check(st, "gemv_f32")
    return y


@pytest.mark.parametrize("kn", [True, False], ids=["KxN", "NxK"])
@pytest.mark.parametrize("M,K,N", [(1, 1, 1), (1, 3, 7), (2, 17, 33), (1, 768, 2304), (3, 1000, 65), (8, 64, 129),
                                   (1, 4097, 9)])
def test_gemv_matches_torch_in_every_variant_and_thread_count(kn, M, K, N):
    g = torch.Generator().manual_seed(M * 1000 + K + N)
    x = torch.randn(M, K, generator=g)
    w = torch.randn(K, N, generator=g) if kn else torch.randn(N, K, generator=g)
    b = torch.randn(N, generator=g)
    ref64 = x.double() @ (w.double() if kn else w.double().t())
    for v in runnable():
        for nt in (1, 2, 3):
            for bias in (None, b):
                got = _gemv(x, w, bias, kn, v, nt)
                ref = ref64 + (bias.double() if bias is not None else 0)
                err = ((got.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()
                assert err < 1e-5, (v, nt, bias is None, err)


def test_gemv_refuses_bad_sizes_before_touching_memory():
    k = native.kernel("gemv_f32")
    x, w, y = torch.randn(8, 4), torch.randn(4, 4), torch.zeros(8, 4)
    px, pw, py = (native.ptr(t, "float *") for t in (x, w, y))
    NULL = native.ffi().NULL
    for args in [(px, 0, 4, pw, 4, 1, NULL, py, 1), (px, 9, 4, pw, 4, 1, NULL, py, 1),
                 (px, 1, 0, pw, 4, 1, NULL, py, 1), (px, 1, 4, pw, 0, 1, NULL, py, 1),
                 (px, 1, 4, pw, 4, 2, NULL, py, 1), (px, 1, 4, pw, 4, 1, NULL, py, 0),
                 (NULL, 1, 4, pw, 4, 1, NULL, py, 1), (px, 1, 4, NULL, 4, 1, NULL, py, 1),
                 (px, 1, 4, pw, 4, 1, NULL, NULL, 1)]:
        assert k(*args) == -2, args  # CO_ERR_BAD_ARGUMENT
    assert torch.equal(y, torch.zeros(8, 4))


def test_wrapper_hands_what_the_kernel_does_not_take_to_torch():
    torch.manual_seed(0)
    w_nk, w_kn, b = torch.randn(16, 24), torch.randn(24, 16), torch.randn(16)
    for x in (torch.randn(9, 24),                 # more rows than the kernel takes
              torch.randn(24, 2).t(),              # strided
              torch.randn(2, 3, 24)):              # 6 rows in a 3-D batch: the kernel, reshaped
        assert torch.allclose(native_linear.linear(x, w_nk, b, False), nn.functional.linear(x, w_nk, b), atol=1e-5)
        assert torch.allclose(native_linear.linear(x, w_kn, b, True), x @ w_kn + b, atol=1e-5)
    xd = torch.randn(2, 24, dtype=torch.float64)
    assert native_linear.linear(xd, w_nk.double(), None, False).dtype == torch.float64


class DecodeStep(nn.Module):
    """What a decode step's layers look like: nn.Linear, a GPT-2 Conv1D (addmm with a (K, N) weight)
    and a bias-free head."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(256, 512)
        self.w_kn = nn.Parameter(torch.randn(512, 384) / 20)
        self.b_kn = nn.Parameter(torch.randn(384))
        self.head = nn.Linear(384, 1000, bias=False)

    def forward(self, x):
        h = torch.relu(self.fc(x))
        h = torch.addmm(self.b_kn, h.reshape(-1, 512), self.w_kn).reshape(*h.shape[:-1], 384)
        return self.head(torch.tanh(h))


@pytest.mark.parametrize("rows", [1, 3, 16])
def test_decode_rows_route_to_the_native_gemv_and_match_eager(rows, monkeypatch):
    torch.manual_seed(0)
    m = DecodeStep().eval()
    x = torch.randn(1, rows, 256)
    opt = cpu_opt.optimize(m, x, dtype="fp32")
    calls, fallbacks = [], []
    real_linear, real_torch = native_linear.linear, native_linear._torch
    monkeypatch.setattr(native_linear, "linear", lambda *a: calls.append(1) or real_linear(*a))
    monkeypatch.setattr(native_linear, "_torch", lambda *a: fallbacks.append(1) or real_torch(*a))
    out, ref = opt(x), m(x).detach()
    assert ((out - ref).abs().max() / ref.abs().max()) < 1e-5
    routes = {r["node"]: r["route"] for r in opt.report()["routed"]}
    expect_native = rows <= 3 and native.vectorized() and routing.route("linear", "fp32", rows=rows, macs=rows * 256 * 512).backend == "native"
    n_native = sum(1 for r in routes.values() if r == "native")
    if expect_native:
        assert n_native == 3, routes
        assert len(calls) == 3 and not fallbacks, (calls, fallbacks)  # the kernel ran, once per layer
    else:
        assert n_native == 0 and not calls, routes
    out2 = opt(x)  # fresh outputs each call: the first call's result is not overwritten
    assert torch.equal(out, out2) and out is not out2
