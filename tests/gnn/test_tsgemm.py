"""cpu_opt's tall-skinny GEMMs (native/kernels/tsgemm.c) and the GNN linear layers on them."""
import copy

import pytest
import torch

from cpu_opt import gnn, hw, native
from cpu_opt.backends import native_linear as NL
from cpu_opt.gnn import pyg as gpyg

NULL = None


def runnable():
    info = hw.detect()
    return [v for v in native.compiled_variants() if native.VARIANT_REQUIRES[v] <= info.isa_uncapped]


def _p(t):
    return native.ptr(t, "float *")


def _nn(a, b, b_nk, bias, c, acc, variant, nt):
    M, K = a.shape
    N = b.shape[0] if b_nk else b.shape[1]
    st = native.kernel("ts_gemm_nn_f32", variant)(_p(a), M, K, _p(b), N, int(b_nk),
                                                  native.ffi().NULL if bias is None else _p(bias), int(acc), _p(c), nt)
    native.check(st, "ts_gemm_nn_f32")
    return c


def _rel(got, ref):
    return ((got.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()


@pytest.mark.parametrize("M,K,N", [(1, 1, 1), (5, 3, 7), (13, 8, 64), (6, 64, 8), (100, 64, 64), (101, 17, 33),
                                   (7, 100, 129), (40000, 64, 64), (2, 1024, 5),
                                   # N <= 8 runs 12 x 8 tiles: remainders of 12 rows, masked columns,
                                   # streaming stores (M * N >= 2^21 with N = 8)
                                   (25, 9, 8), (100003, 64, 3), (262147, 16, 8)])
def test_nn_matches_float64_in_every_variant_and_thread_count(M, K, N):
    g = torch.Generator().manual_seed(M + 31 * K + N)
    a = torch.randn(M, K, generator=g)
    w = torch.randn(N, K, generator=g)
    bias = torch.randn(N, generator=g)
    c0 = torch.randn(M, N, generator=g)
    ref = a.double() @ w.double().t()
    for v in runnable():
        for nt in (1, 2, 3):
            for b_nk in (True, False):
                b = w if b_nk else w.t().contiguous()
                got = _nn(a, b, b_nk, bias, torch.full((M, N), float("nan")), False, v, nt)
                assert _rel(got, ref + bias.double()) < 1e-5, (v, nt, b_nk)
                got = _nn(a, b, b_nk, None, c0.clone(), True, v, nt)
                assert _rel(got, ref + c0.double()) < 1e-5, (v, nt, b_nk, "accumulate")


@pytest.mark.parametrize("M,N1,N2", [(1, 1, 1), (3, 7, 5), (300, 8, 64), (300, 64, 8), (1000, 64, 64),
                                     (257, 13, 33), (5, 1024, 3), (100003, 6, 16), (2001, 64, 160)])
def test_tn_matches_float64_with_column_sums(M, N1, N2):
    g = torch.Generator().manual_seed(M + N1 * 7 + N2)
    a = torch.randn(M, N1, generator=g)
    b = torch.randn(M, N2, generator=g)
    ref, ref_s = a.double().t() @ b.double(), a.double().sum(0)
    for v in runnable():
        for nt in (1, 2, 3):
            c = torch.full((N1, N2), float("nan"))
            s = torch.full((N1,), float("nan"))
            st = native.kernel("ts_gemm_tn_f32", v)(_p(a), M, N1, _p(b), N2, _p(c), _p(s), nt)
            native.check(st, "ts_gemm_tn_f32")
            assert _rel(c, ref) < 1e-5 and _rel(s, ref_s) < 1e-5, (v, nt)
            c2 = torch.full((N1, N2), float("nan"))
            native.check(native.kernel("ts_gemm_tn_f32", v)(_p(a), M, N1, _p(b), N2, _p(c2), native.ffi().NULL, nt), "tn")
            assert torch.equal(c, c2), "the column sums must not change the product"



@pytest.mark.parametrize("M,K,N", [(37, 64, 64), (25, 9, 8), (1000, 64, 48), (999, 17, 33), (100003, 64, 64),
                                   (2049, 128, 16), (300, 5, 100)])
def test_vector_variants_agree_bit_for_bit(M, K, N):
    """The AVX-512 tiles (12 rows, a zmm per row, pairs of panels) add the same products in the same
    order per output element as the AVX2 tiles (6 rows, two ymm halves): forward, accumulate, the
    two-product sum and the weight gradient are equal bit for bit, rows remainders and masked
    columns included (M = 100003 with N = 64: streaming stores)."""
    variants = [v for v in ("avx2", "avx512") if v in runnable()]
    if len(variants) < 2:
        pytest.skip("needs both the avx2 and the avx512 variant to run on this CPU")
    g = torch.Generator().manual_seed(M + K + N)
    a, a2 = torch.randn(M, K, generator=g), torch.randn(M, K, generator=g)
    w, w2, bias = torch.randn(N, K, generator=g), torch.randn(N, K, generator=g), torch.randn(N, generator=g)
    gr, c0 = torch.randn(M, N, generator=g), torch.randn(M, N, generator=g)
    outs = {}
    for v in variants:
        for nt in (1, 2):
            fwd = _nn(a, w, True, bias, torch.empty(M, N), False, v, nt)
            acc = _nn(a, w.t().contiguous(), False, None, c0.clone(), True, v, nt)
            two = torch.empty(M, N)
            native.check(native.kernel("ts_gemm_nn2_f32", v)(_p(a), M, K, _p(w), _p(a2), K, _p(w2), N, _p(bias),
                                                             _p(two), nt), "nn2")
            gw, gs = torch.empty(N, K), torch.empty(N)
            native.check(native.kernel("ts_gemm_tn_f32", v)(_p(gr), M, N, _p(a), K, _p(gw), _p(gs), nt), "tn")
            outs[v, nt] = (fwd, acc, two, gw, gs)
    for nt in (1, 2):
        for name, x, y in zip(("forward", "accumulate", "sum of two", "weight grad", "column sums"),
                              outs["avx2", nt], outs["avx512", nt]):
            assert torch.equal(x, y), (name, nt)
    assert _rel(outs["avx512", 2][0], a.double() @ w.double().t() + bias.double()) < 1e-5

def test_zero_rows():
    a, w = torch.empty(0, 4), torch.randn(3, 4)
    assert NL.ts_linear(a, w).shape == (0, 3)
    gw, gb = NL.ts_weight_grad(torch.empty(0, 3), a, bias=True)
    assert torch.equal(gw, torch.zeros(3, 4)) and torch.equal(gb, torch.zeros(3))


def test_kernels_refuse_bad_sizes_before_touching_memory():
    a, b, c = torch.randn(8, 4), torch.randn(4, 4), torch.zeros(8, 4)
    pa, pb, pc = _p(a), _p(b), _p(c)
    N0 = native.ffi().NULL
    nn = native.kernel("ts_gemm_nn_f32")
    for args in [(pa, -1, 4, pb, 4, 1, N0, 0, pc, 1), (pa, 8, 0, pb, 4, 1, N0, 0, pc, 1),
                 (pa, 8, 1025, pb, 4, 1, N0, 0, pc, 1), (pa, 8, 4, pb, 0, 1, N0, 0, pc, 1),
                 (pa, 8, 4, pb, 4, 2, N0, 0, pc, 1), (pa, 8, 4, pb, 4, 1, N0, 3, pc, 1),
                 (pa, 8, 4, pb, 4, 1, N0, 0, pc, 0), (N0, 8, 4, pb, 4, 1, N0, 0, pc, 1),
                 (pa, 8, 4, N0, 4, 1, N0, 0, pc, 1), (pa, 8, 4, pb, 4, 1, N0, 0, N0, 1)]:
        assert nn(*args) == -2, args  # CO_ERR_BAD_ARGUMENT
    tn = native.kernel("ts_gemm_tn_f32")
    for args in [(pa, -1, 4, pb, 4, pc, N0, 1), (pa, 8, 0, pb, 4, pc, N0, 1), (pa, 8, 4, pb, 1025, pc, N0, 1),
                 (pa, 8, 4, pb, 4, pc, N0, 0), (N0, 8, 4, pb, 4, pc, N0, 1), (pa, 8, 4, pb, 4, N0, N0, 1)]:
        assert tn(*args) == -2, args
    assert torch.equal(c, torch.zeros(8, 4))


def test_wrappers_name_what_is_wrong():
    x, w = torch.randn(10, 4), torch.randn(3, 4)
    with pytest.raises(ValueError, match="float32"):
        NL.ts_linear(x.double(), w)
    with pytest.raises(ValueError, match="contiguous"):
        NL.ts_linear(torch.randn(4, 10).t(), w)
    with pytest.raises(ValueError, match="do not multiply"):
        NL.ts_linear(x, torch.randn(3, 5))
    with pytest.raises(ValueError, match="bias"):
        NL.ts_linear(x, w, torch.randn(4))
    with pytest.raises(ValueError, match="accumulate"):
        NL.ts_linear(x, w, accumulate=True)
    with pytest.raises(ValueError, match="out must be"):
        NL.ts_linear(x, w, out=torch.empty(10, 4))
    with pytest.raises(ValueError, match="1024"):
        NL.ts_linear(torch.randn(2, 1025), torch.randn(3, 1025))
    with pytest.raises(ValueError, match="row counts"):
        NL.ts_weight_grad(torch.randn(5, 3), torch.randn(6, 3))
    with pytest.raises(ValueError, match="1024"):
        NL.ts_weight_grad(torch.randn(5, 1025), torch.randn(5, 3))


@pytest.mark.parametrize("K,N", [(64, 64), (64, 8), (8, 64), (100, 16)])
def test_native_linear_forward_and_gradients_match_autograd(K, N):
    g = torch.Generator().manual_seed(K * N)
    x = torch.randn(20000, K, generator=g, requires_grad=True)
    w = torch.randn(N, K, generator=g, requires_grad=True)
    b = torch.randn(N, generator=g, requires_grad=True)
    go = torch.randn(20000, N, generator=g)
    y = gpyg._NativeLinear.apply(x, w, b)
    y.backward(go)
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, w, b))
    ref = torch.nn.functional.linear(x64, w64, b64)
    ref.backward(go.double())
    assert _rel(y.detach(), ref.detach()) < 1e-5
    for got, r in ((x.grad, x64.grad), (w.grad, w64.grad), (b.grad, b64.grad)):
        assert _rel(got, r) < 1e-5


@pytest.mark.parametrize("fn", ["_NativeLinearSum", "_TorchLinearSum"])
def test_linear_sum_matches_two_linears_and_their_sum(fn):
    g = torch.Generator().manual_seed(5)
    a1 = torch.randn(20000, 64, generator=g, requires_grad=True)
    a2 = torch.randn(20000, 32, generator=g, requires_grad=True)
    w1 = torch.randn(16, 64, generator=g, requires_grad=True)
    w2 = torch.randn(16, 32, generator=g, requires_grad=True)
    b1 = torch.randn(16, generator=g, requires_grad=True)
    go = torch.randn(20000, 16, generator=g)
    y = getattr(gpyg, fn).apply(a1, w1, b1, a2, w2, None)
    y.backward(go)
    leaves = [t.detach().double().requires_grad_() for t in (a1, w1, b1, a2, w2)]
    ref = torch.nn.functional.linear(leaves[0], leaves[1], leaves[2]) + torch.nn.functional.linear(leaves[3], leaves[4])
    ref.backward(go.double())
    assert _rel(y.detach(), ref.detach()) < 1e-5
    for t, r in zip((a1, w1, b1, a2, w2), leaves):
        assert _rel(t.grad, r.grad) < 1e-5


def _models():
    from torch_geometric.nn import GCNConv, GINConv, SAGEConv

    class Net(torch.nn.Module):
        def __init__(self, make):
            super().__init__()
            self.c1, self.c2 = make(32, 64), make(64, 8)

        def forward(self, x, edge_index):
            return self.c2(self.c1(x, edge_index).relu(), edge_index)

    def gin(i, o):
        return GINConv(torch.nn.Sequential(torch.nn.Linear(i, o), torch.nn.ReLU(), torch.nn.Linear(o, o)))

    return {"sage_max": lambda: Net(lambda i, o: SAGEConv(i, o, aggr="max")),
            "sage_mean": lambda: Net(lambda i, o: SAGEConv(i, o, aggr="mean")),
            "gcn": lambda: Net(GCNConv), "gin": lambda: Net(gin)}


@pytest.mark.parametrize("name", ["sage_max", "sage_mean", "gcn", "gin"])
def test_pyg_models_train_on_the_tall_skinny_gemm_where_routed(name):
    pytest.importorskip("torch_geometric")
    from cpu_opt.gnn.rmat import rmat_edge_index

    n = 20000
    ei = rmat_edge_index(n, 120000, seed=1)
    torch.manual_seed(0)
    base = _models()[name]()
    x = torch.randn(n, 32)
    y = torch.randint(0, 8, (n,))
    fast = gnn.optimize(copy.deepcopy(base))
    before = dict(gpyg._counts)
    outs, grads = [], []
    for model in (base, fast):
        model.zero_grad()
        out = model(x, ei)
        torch.nn.functional.cross_entropy(out, y).backward()
        outs.append(out.detach())
        params = model.parameters() if model is base else model.model.parameters()
        grads.append([p.grad.clone() for p in params])
    ran = {k: v - before.get(k, 0) for k, v in gpyg._counts.items() if k.startswith("linear:")}
    native_ran = sum(v for k, v in ran.items() if "tall-skinny" in k)
    if gpyg._native_linear_route():
        assert native_ran > 0, ran
        assert not any("oneDNN" in k and v for k, v in ran.items()), ran
    else:  # AVX-512 or no vectorized build: the kernel is not used
        assert native_ran == 0, ran
    if name == "gin" and gpyg._native_linear_route():  # layer 1's nn (32 -> 64 -> 64) as one fused call
        assert sum(v for k, v in ran.items() if "Linear -> ReLU -> Linear" in k) == 1, ran
    if name.startswith("sage"):  # lin_l(aggr) + lin_r(x) as one output where PyG's order is kept: layer 1
        # (32 -> 64 widens) and, for max (no linear map before a max), layer 2
        assert sum(v for k, v in ran.items() if "lin_l + lin_r" in k or "accumulated into lin_l" in k) == \
            (2 if name == "sage_max" else 1), ran
    if name == "sage_max":  # layer 2 (64 -> 8, its input needing a gradient): aggregation and GEMM as one
        # Function on the vector kernels (backward through mask_gather_proj)
        assert ran.get(gpyg._MAX_SAGE, 0) == (1 if gpyg._max_sage_fits(64, 8) else 0), ran
    assert _rel(outs[1], outs[0].double()) < 1e-4
    for gf, gb in zip(grads[1], grads[0]):
        assert _rel(gf, gb.double()) < 1e-3



@pytest.mark.parametrize("k", [64, 128, 192])
def test_native_linear_takes_inner_dimensions_up_to_the_variants_bound(monkeypatch, k):
    """_NativeLinear runs its forward (ts_linear) and input gradient (ts_matmul) on the tall-skinny
    GEMM up to native_linear_max_k() (128 on the AVX2 variant, measured on Zen 3; 64 elsewhere) and
    on torch's GEMM beyond it; the answers and gradients equal autograd's either way."""
    calls = {"ts_linear": 0, "ts_matmul": 0}
    for name in calls:
        real = getattr(NL, name)

        def spy(*a, _real=real, _name=name, **kw):
            calls[_name] += 1
            return _real(*a, **kw)
        monkeypatch.setattr(NL, name, spy)
    bound = 128 if native.select_variant() == "avx2" else 64
    assert gpyg.native_linear_max_k() == bound
    g = torch.Generator().manual_seed(k)
    x = torch.randn(3001, k, generator=g, requires_grad=True)
    w = torch.randn(k, k, generator=g, requires_grad=True)  # square: the input gradient's inner dimension is k too
    b = torch.randn(k, generator=g, requires_grad=True)
    gy = torch.randn(3001, k, generator=g)
    y = gpyg._NativeLinear.apply(x, w, b)
    grads = torch.autograd.grad(y, (x, w, b), gy)
    ref = torch.nn.functional.linear(x.double(), w.double(), b.double())
    ref_grads = torch.autograd.grad(ref, (x, w, b), gy.double())
    assert calls == ({"ts_linear": 1, "ts_matmul": 1} if k <= bound else {"ts_linear": 0, "ts_matmul": 0})
    assert _rel(y, ref) < 1e-5
    for got, want in zip(grads, ref_grads):
        assert _rel(got, want) < 1e-4


@pytest.mark.parametrize("M,K,N", [(37, 64, 64), (25, 9, 8), (1000, 64, 48), (999, 17, 33), (100003, 64, 64),
                                   (13, 5, 3), (40001, 16, 8)])
def test_epilogue_relu_and_keep_equal_torch_on_the_kernels_own_product(M, K, N):
    """ts_gemm_nn_ep_f32's relu is torch.relu of the plain kernel's output and its keep is torch's
    threshold_backward(., keep, 0), bit for bit, in every variant and thread count: NaN passes relu
    and passes where keep is NaN, -0 passes relu, keep <= 0 (including -0) zeroes; rows remainders,
    masked columns, N <= 8 tiles and streaming stores (M * N >= 2^21) included."""
    g = torch.Generator().manual_seed(M * 3 + K + N)
    a = torch.randn(M, K, generator=g)
    a[::7, 0] = float("nan")       # NaN outputs in those rows
    w, bias = torch.randn(N, K, generator=g), torch.randn(N, generator=g)
    keep = torch.randn(M, N, generator=g)
    keep[::5] = 0.0
    keep[1::5] = -0.0
    keep[2::11, : min(N, 3)] = float("nan")
    for v in runnable():
        for nt in (1, 2):
            ep = native.kernel("ts_gemm_nn_ep_f32", v)
            for relu, kp in ((1, None), (0, keep), (1, keep)):
                out = torch.full((M, N), 7.0)
                st = ep(_p(a), M, K, _p(w), N, 1, _p(bias), relu, native.ffi().NULL if kp is None else _p(kp), _p(out), nt)
                native.check(st, "ts_gemm_nn_ep_f32")
                ref = _nn(a, w, True, bias, torch.empty(M, N), False, v, nt)
                if relu:
                    ref = torch.relu(ref)
                if kp is not None:
                    ref = torch.ops.aten.threshold_backward(ref, kp, 0)
                assert torch.equal(out.nan_to_num(5.0), ref.nan_to_num(5.0)), (v, nt, relu, kp is not None)
                assert torch.equal(out.isnan(), ref.isnan()) and torch.equal(out.signbit(), ref.signbit())
    # -0 through relu: an output of exactly -0 (a zero row times anything, negative bias none) stays -0
    z = torch.zeros(3, 4)
    for v in runnable():
        out = torch.empty(3, 2)
        wneg = -torch.ones(2, 4)
        native.check(native.kernel("ts_gemm_nn_ep_f32", v)(_p(z), 3, 4, _p(wneg), 2, 1, native.ffi().NULL, 1,
                                                           native.ffi().NULL, _p(out), 1), "ep")
        assert torch.equal(out.signbit(), torch.relu(z @ wneg.t()).signbit()), v


def test_epilogue_wrappers_check_their_arguments():
    x, w = torch.randn(10, 4), torch.randn(3, 4)
    with pytest.raises(ValueError, match="keep must have the output's shape"):
        NL.ts_matmul(x, w.t().contiguous(), keep=torch.randn(10, 4))
    with pytest.raises(ValueError, match="keep.*float32"):
        NL.ts_matmul(x, w.t().contiguous(), keep=torch.randn(10, 3).double())
    with pytest.raises(ValueError, match="not with accumulate"):
        NL.ts_linear(x, w, out=torch.zeros(10, 3), accumulate=True, relu=True)
    assert torch.equal(NL.ts_linear(x, w, relu=True), torch.relu(NL.ts_linear(x, w)))
    ep = native.kernel("ts_gemm_nn_ep_f32")
    c = torch.zeros(10, 3)
    assert ep(_p(x), 10, 4, _p(w), 3, 1, native.ffi().NULL, 2, native.ffi().NULL, _p(c), 1) == -2  # relu not 0/1
    assert torch.equal(c, torch.zeros(10, 3))


@pytest.mark.parametrize("biases", [(True, True), (False, True), (True, False)])
def test_native_mlp_matches_autograd_and_double_backward(biases):
    """Linear -> ReLU -> Linear as one _NativeMLP: output and all five gradients against float64
    autograd (ReLU zeros included: a third of the hidden units negative), and create_graph=True
    (double backward) against torch's own modules."""
    g = torch.Generator().manual_seed(sum(biases))
    x = torch.randn(20000, 32, generator=g, requires_grad=True)
    w1 = torch.randn(48, 32, generator=g).mul_(0.2).requires_grad_()
    w2 = torch.randn(16, 48, generator=g).mul_(0.2).requires_grad_()
    b1 = torch.randn(48, generator=g).requires_grad_() if biases[0] else None
    b2 = torch.randn(16, generator=g).requires_grad_() if biases[1] else None
    go = torch.randn(20000, 16, generator=g)
    leaves = [t for t in (x, w1, b1, w2, b2) if t is not None]
    y = gpyg._NativeMLP.apply(x, w1, b1, w2, b2)
    y.backward(go)
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    d = dict(zip([n for n, t in zip("x w1 b1 w2 b2".split(), (x, w1, b1, w2, b2)) if t is not None], ref_leaves))
    ref = torch.nn.functional.linear(torch.relu(torch.nn.functional.linear(d["x"], d["w1"], d.get("b1"))),
                                     d["w2"], d.get("b2"))
    ref.backward(go.double())
    assert _rel(y.detach(), ref.detach()) < 1e-5
    for t, r in zip(leaves, ref_leaves):
        assert _rel(t.grad, r.grad) < 1e-5
    # double backward: d/dw1 of sum(grad_x^2), fused against torch's modules (float32 both)
    def second(fn):
        out = fn()
        gx, = torch.autograd.grad(out, x, go, create_graph=True)
        return torch.autograd.grad(gx.pow(2).sum(), w1)[0]
    fused = second(lambda: gpyg._NativeMLP.apply(x, w1, b1, w2, b2))
    eager = second(lambda: torch.nn.functional.linear(torch.relu(torch.nn.functional.linear(x, w1, b1)), w2, b2))
    assert _rel(fused, eager.double()) < 1e-4


def test_mlp_fusion_in_a_gin_and_hooks_keep_the_modules():
    """gnn.optimize runs a GINConv's Linear -> ReLU -> Linear as one fused call (counted), the same
    numbers as PyG; a forward hook on the ReLU makes it run the three modules (the hook is called)."""
    pytest.importorskip("torch_geometric")
    from torch_geometric.nn import GINConv

    from cpu_opt.gnn.rmat import rmat_edge_index

    n = 20000
    ei = rmat_edge_index(n, 100000, seed=3)
    torch.manual_seed(1)
    base = GINConv(torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32)))
    x = torch.randn(n, 16)
    fast = gnn.optimize(copy.deepcopy(base))
    key = "linear: cpu_opt tall-skinny GEMM (Linear -> ReLU -> Linear, the ReLU in the epilogues)"
    before = gpyg._counts[key]
    out = fast(x, ei)
    fused = gpyg._counts[key] - before
    assert fused == (1 if gpyg._native_linear_route() else 0)
    assert _rel(out, base(x, ei).double()) < 1e-4
    if fused:
        assert any("the ReLU in the epilogues" in r["why"] for r in fast.report()["routed"])
    before = gpyg._counts[key]
    with torch.inference_mode():   # serving: the same fused call, no graph kept
        assert _rel(fast(x, ei), out.double()) < 1e-6
    assert gpyg._counts[key] - before == fused
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, i, o: None)
    try:   # a global module hook must see every module: nothing fused while one is registered
        before = gpyg._counts[key]
        fast(x, ei)
        assert gpyg._counts[key] == before
    finally:
        handle.remove()
    calls = []
    fast.model.nn[1].register_forward_hook(lambda m, i, o: calls.append(o.shape))
    before = gpyg._counts[key]
    out2 = fast(x, ei)
    assert gpyg._counts[key] == before and calls == [(n, 64)]
    assert _rel(out2, out.double()) < 1e-5

def test_outputs_are_fresh_tensors_each_call():
    w = torch.randn(8, 16)
    x = torch.randn(30000, 16)
    y1 = gpyg._NativeLinear.apply(x, w, None)
    keep = y1.clone()
    y2 = gpyg._NativeLinear.apply(x * 2, w, None)
    assert torch.equal(y1, keep) and y1.data_ptr() != y2.data_ptr()


def test_linear_sum_kernel_matches_float64_and_checks_its_arguments():
    g = torch.Generator().manual_seed(9)
    for M, K1, K2, N in [(1, 1, 1, 1), (13, 64, 32, 8), (40000, 64, 64, 64), (7, 5, 100, 33), (40001, 64, 64, 8),
                         (29, 7, 9, 5)]:
        a1, a2 = torch.randn(M, K1, generator=g), torch.randn(M, K2, generator=g)
        w1, w2, b = torch.randn(N, K1, generator=g), torch.randn(N, K2, generator=g), torch.randn(N, generator=g)
        ref = a1.double() @ w1.double().t() + a2.double() @ w2.double().t()
        for v in runnable():
            c = torch.full((M, N), float("nan"))
            st = native.kernel("ts_gemm_nn2_f32", v)(_p(a1), M, K1, _p(w1), _p(a2), K2, _p(w2), N, _p(b), _p(c), 2)
            native.check(st, "ts_gemm_nn2_f32")
            assert _rel(c, ref + b.double()) < 1e-5, (v, M, K1, K2, N)
        assert _rel(NL.ts_linear_sum(a1, w1, a2, w2), ref) < 1e-5
    a, w, c = torch.randn(4, 3), torch.randn(2, 3), torch.zeros(4, 2)
    N0 = native.ffi().NULL
    k = native.kernel("ts_gemm_nn2_f32")
    for args in [(_p(a), 4, 3, _p(w), N0, 3, _p(w), 2, N0, _p(c), 1), (_p(a), 4, 3, _p(w), _p(a), 0, _p(w), 2, N0, _p(c), 1),
                 (_p(a), 4, 3, _p(w), _p(a), 3, N0, 2, N0, _p(c), 1), (_p(a), 4, 3, _p(w), _p(a), 1025, _p(w), 2, N0, _p(c), 1)]:
        assert k(*args) == -2, args
    assert torch.equal(c, torch.zeros(4, 2))
    with pytest.raises(ValueError, match="do not match"):
        NL.ts_linear_sum(a, w, torch.randn(5, 3), w)


@pytest.mark.parametrize("F", [32, 64, 128])
def test_register_max_min_path_equals_the_generic_loops(F):
    """float32 max/min without weights over 32 or a multiple of 64 features run a register loop in
    the vector variants; the base variant runs the generic loops: outputs and winner masks equal,
    with ties (few distinct values), -inf everywhere in some rows (nothing wins) and NaN rows."""
    from cpu_opt.gnn import _kernels as K
    from gnn_testutil import RUNNABLE_VARIANTS

    torch.manual_seed(F)
    n = 400
    graph = gnn.CSRGraph.from_edge_index(torch.randint(0, n, (2, 6000)), n)
    x = torch.randint(-3, 4, (n, F)).float()  # ties everywhere
    x[5] = float("-inf")
    x[7, 3] = float("nan")
    x[11, F - 1] = float("inf")
    fast = [v for v in RUNNABLE_VARIANTS if v != "base"]
    if not fast:
        pytest.skip("no vector variant runs here: the register loop is not built in the base variant")
    for reduce in ("amax", "amin"):
        with gnn.use_variant("base"):
            ref_out, ref_mask = K.segment_reduce(graph.rowptr, graph.col, None, x, reduce, mask=True)
            ref_plain, _ = K.segment_reduce(graph.rowptr, graph.col, None, x, reduce, want_arg=False)
        for v in fast:
            with gnn.use_variant(v):
                out, mask = K.segment_reduce(graph.rowptr, graph.col, None, x, reduce, mask=True)
                plain, _ = K.segment_reduce(graph.rowptr, graph.col, None, x, reduce, want_arg=False)
            assert torch.equal(out.nan_to_num(7.5), ref_out.nan_to_num(7.5)), (v, reduce)
            assert torch.equal(plain.nan_to_num(7.5), ref_plain.nan_to_num(7.5)), (v, reduce)
            assert torch.equal(mask, ref_mask), (v, reduce)


def test_relu_epilogue_of_the_linear_sum_and_keep_mask_of_the_weight_gradient_match_torch():
    """ts_gemm_nn2_ep_f32's relu is torch.relu of ts_gemm_nn2_f32's output, bit for bit; ts_gemm_tn_ep_f32's
    keep gives what ts_gemm_tn_f32 gives on threshold_backward(g, keep, 0) (NaN in keep passes g, as
    torch's does), bit for bit, with the column sums, on every variant, for row counts that leave partial
    blocks and N1 / N2 that leave partial tiles."""
    gen = torch.Generator().manual_seed(11)
    N0 = native.ffi().NULL
    for M, K1, K2, N in [(1, 1, 1, 1), (37, 64, 64, 64), (40001, 64, 64, 8), (777, 13, 7, 33), (130, 5, 9, 100)]:
        a1, a2 = torch.randn(M, K1, generator=gen), torch.randn(M, K2, generator=gen)
        w1, w2, b = torch.randn(N, K1, generator=gen), torch.randn(N, K2, generator=gen), torch.randn(N, generator=gen)
        g = torch.randn(M, N, generator=gen)
        for v in runnable():
            plain, ep = torch.full((M, N), float("nan")), torch.full((M, N), float("nan"))
            native.check(native.kernel("ts_gemm_nn2_f32", v)(_p(a1), M, K1, _p(w1), _p(a2), K2, _p(w2), N, _p(b),
                                                            _p(plain), 2), "nn2")
            native.check(native.kernel("ts_gemm_nn2_ep_f32", v)(_p(a1), M, K1, _p(w1), _p(a2), K2, _p(w2), N, _p(b), 1,
                                                               _p(ep), 2), "nn2_ep")
            assert torch.equal(ep, torch.relu(plain)), (v, M, N)
            keep = ep.clone()
            keep[::7, ::3] = float("nan")
            for a in (a1, a2):
                K = a.shape[1]
                masked = torch.ops.aten.threshold_backward(g, keep, 0)
                c_ref, s_ref = torch.empty(N, K), torch.empty(N)
                native.check(native.kernel("ts_gemm_tn_f32", v)(_p(masked), M, N, _p(a), K, _p(c_ref), _p(s_ref), 2), "tn")
                c, s = torch.full((N, K), float("nan")), torch.full((N,), float("nan"))
                native.check(native.kernel("ts_gemm_tn_ep_f32", v)(_p(g), M, N, _p(a), K, _p(keep), _p(c), _p(s), 2),
                             "tn_ep")
                assert torch.equal(c, c_ref) and torch.equal(s, s_ref), (v, M, N, K)
                assert _rel(c, masked.double().t() @ a.double()) < 1e-5
                c2 = torch.full((N, K), float("nan"))
                native.check(native.kernel("ts_gemm_tn_ep_f32", v)(_p(g), M, N, _p(a), K, N0, _p(c2), N0, 2), "tn_ep")
                assert _rel(c2, g.double().t() @ a.double()) < 1e-5
    gw, gb = NL.ts_weight_grad(g, a2, bias=True, keep=keep)
    assert _rel(gw, torch.ops.aten.threshold_backward(g, keep, 0).double().t() @ a2.double()) < 1e-5
    with pytest.raises(ValueError, match="keep must have g's shape"):
        NL.ts_weight_grad(g, a2, keep=keep[:, :1].contiguous())
    assert torch.equal(NL.ts_linear_sum(a1, w1, a2, w2, b, relu=True), torch.relu(NL.ts_linear_sum(a1, w1, a2, w2, b)))


def test_two_weight_gradients_in_one_pass_match_two_calls():
    """ts_gemm_tn2_ep_f32 (SAGEConv's g^T aggr and g^T x from one pass over g, masked or not) against
    float64 and against ts_gemm_tn_ep_f32 called twice, on every variant; bad sizes and NULL operands
    are refused before anything is written."""
    gen = torch.Generator().manual_seed(13)
    N0 = native.ffi().NULL
    for M, N1, N2, N3 in [(1, 1, 1, 1), (37, 64, 64, 64), (40001, 64, 64, 64), (777, 13, 7, 33), (130, 20, 100, 5),
                          (5000, 8, 64, 64)]:
        g, x1, x2 = torch.randn(M, N1, generator=gen), torch.randn(M, N2, generator=gen), torch.randn(M, N3, generator=gen)
        keep = torch.randn(M, N1, generator=gen)
        keep[::5, ::2] = float("nan")
        for v in runnable():
            for k in (None, keep):
                c1, c2, s = torch.full((N1, N2), float("nan")), torch.full((N1, N3), float("nan")), torch.full((N1,), float("nan"))
                st = native.kernel("ts_gemm_tn2_ep_f32", v)(_p(g), M, N1, _p(x1), N2, _p(x2), N3,
                                                            N0 if k is None else _p(k), _p(c1), _p(c2), _p(s), 2)
                native.check(st, "tn2_ep")
                gm = g if k is None else torch.ops.aten.threshold_backward(g, k, 0)
                assert _rel(c1, gm.double().t() @ x1.double()) < 1e-5, (v, M, N1, N2, N3)
                assert _rel(c2, gm.double().t() @ x2.double()) < 1e-5, (v, M, N1, N2, N3)
                assert _rel(s, gm.double().sum(0)) < 1e-5
    w1, w2, b = NL.ts_weight_grad2(g, x1, x2, bias=True, keep=keep)
    r1, rb = NL.ts_weight_grad(g, x1, bias=True, keep=keep)
    r2, _ = NL.ts_weight_grad(g, x2, keep=keep)
    assert _rel(w1, r1.double()) < 1e-6 and _rel(w2, r2.double()) < 1e-6 and _rel(b, rb.double()) < 1e-6
    k = native.kernel("ts_gemm_tn2_ep_f32")
    a, c = torch.randn(4, 3), torch.zeros(3, 3)
    for args in [(_p(a), 4, 3, _p(a), 3, N0, 3, N0, _p(c), _p(c), N0, 1), (_p(a), 4, 3, _p(a), 3, _p(a), 0, N0, _p(c), _p(c), N0, 1),
                 (_p(a), 4, 3, _p(a), 3, _p(a), 3, N0, _p(c), N0, N0, 1), (_p(a), 4, 3, _p(a), 1025, _p(a), 3, N0, _p(c), _p(c), N0, 1)]:
        assert k(*args) == -2, args
    assert torch.equal(c, torch.zeros(3, 3))
    with pytest.raises(ValueError, match="different row counts"):
        NL.ts_weight_grad2(g, x1, x2[:-1].contiguous())
