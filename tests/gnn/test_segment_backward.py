"""native/kernels/segment_backward.c — sddmm, arg_scatter, arg_weight_grad — through the
autograd of gnn.spmm / gnn.scatter_reduce: gradcheck in float64 (the f64 kernels), float32
gradients against torch autograd, bf16 gradients within tolerance, torch.compile."""
import pytest
import torch

from cpu_opt import gnn
from cpu_opt.gnn import _kernels as K

from gnn_testutil import GRAPH_CASES, RUNNABLE_VARIANTS, assert_bf16_close, make_graph, ref_spmm

GRAD_CASES = ["random", "isolated", "duplicates", "single_node", "no_edges", "bipartite"]


def _graph(case, index_dtype=torch.int64):
    n_rows, n_cols, dst, src = make_graph(case)
    rowptr, perm = K.index_to_csr(dst, n_rows)
    return gnn.CSRGraph(rowptr, src[perm].to(index_dtype), n_cols), dst, src, perm


@pytest.mark.parametrize("case", GRAD_CASES)
@pytest.mark.parametrize("reduce", ["sum", "mean", "amax", "amin"])
def test_spmm_gradcheck(case, reduce):
    g, dst, src, perm = _graph(case)
    torch.manual_seed(0)
    x = torch.randn(g.n_cols, 3, dtype=torch.float64, requires_grad=True)
    w = (torch.rand(g.nnz, dtype=torch.float64) + 0.5).requires_grad_()
    assert torch.autograd.gradcheck(lambda x: gnn.spmm(g, x, reduce), (x,))
    assert torch.autograd.gradcheck(lambda x, w: gnn.spmm(g, x, reduce, weight=w), (x, w), fast_mode=True)


@pytest.mark.parametrize("variant", RUNNABLE_VARIANTS)
@pytest.mark.parametrize("case", GRAD_CASES)
@pytest.mark.parametrize("reduce", ["sum", "mean", "amax", "amin"])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_spmm_grad_matches_torch(case, reduce, variant, index_dtype):
    g, dst, src, perm = _graph(case, index_dtype)
    torch.manual_seed(1)
    x = torch.randn(g.n_cols, 20, requires_grad=True)
    w = (torch.rand(g.nnz) + 0.5).requires_grad_()
    go = torch.randn(g.n_rows, 20)
    with gnn.use_variant(variant):
        gx, gw = torch.autograd.grad(gnn.spmm(g, x, reduce, weight=w), (x, w), go, allow_unused=True)
    # reference: edges in CSR order
    w_edges = torch.empty_like(w.detach())
    w_edges[perm] = w.detach()
    xr = x.detach().clone().requires_grad_()
    wr = w_edges.clone().requires_grad_()
    rx, rw = torch.autograd.grad(ref_spmm(g.n_rows, dst, src, xr, reduce, wr), (xr, wr), go, allow_unused=True)
    torch.testing.assert_close(gx, rx, rtol=1e-4, atol=1e-5)
    if rw is not None:
        torch.testing.assert_close(gw, rw[perm], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("reduce", ["sum", "mean", "amax", "amin"])
def test_spmm_bf16_backward(reduce):
    g, dst, src, perm = _graph("random")
    torch.manual_seed(2)
    x = torch.randn(g.n_cols, 40).bfloat16().requires_grad_()
    go = torch.randn(g.n_rows, 40).bfloat16()
    (gx,) = torch.autograd.grad(gnn.spmm(g, x, reduce), (x,), go)
    xr = x.detach().float().requires_grad_()
    if reduce in ("amax", "amin"):
        # bf16 values tie often; torch splits a tie's gradient, cpu_opt gives it to one winner:
        # compare with cpu_opt's float32 path on the same (exactly widened) values instead
        (rx,) = torch.autograd.grad(gnn.spmm(g, xr, reduce), (xr,), go.float())
    else:
        (rx,) = torch.autograd.grad(ref_spmm(g.n_rows, dst, src, xr, reduce), (xr,), go.float())
    assert_bf16_close(gx, rx)


@pytest.mark.parametrize("case", ["random", "isolated", "duplicates", "single_node", "no_edges"])
@pytest.mark.parametrize("reduce", ["sum", "mean", "amax", "amin", "prod"])
@pytest.mark.parametrize("include_self", [True, False])
def test_scatter_reduce_gradcheck(case, reduce, include_self):
    n, _, dst, _ = make_graph(case)
    torch.manual_seed(3)
    src = torch.randn(dst.numel(), 3, dtype=torch.float64, requires_grad=True)
    base = torch.randn(n, 3, dtype=torch.float64, requires_grad=True)
    f = lambda s, b: gnn.scatter_reduce(s, dst, 0, n, reduce, input=b, include_self=include_self)  # noqa: E731
    assert torch.autograd.gradcheck(f, (src, base), fast_mode=True)  # full gradients compared below
    # and equal to torch's own gradients
    go = torch.randn(n, 3, dtype=torch.float64)
    mine = torch.autograd.grad(f(src, base), (src, base), go)
    ref = torch.autograd.grad(base.scatter_reduce(0, dst.view(-1, 1).expand(-1, 3), src, reduce,
                                                  include_self=include_self), (src, base), go)
    for a, b in zip(mine, ref):
        torch.testing.assert_close(a, b)


def test_scatter_prod_gradient_with_zeros():
    index = torch.tensor([0, 0, 0, 1, 1, 2])
    src = torch.tensor([[2.0], [0.0], [3.0], [0.0], [0.0], [5.0]], dtype=torch.float64, requires_grad=True)
    base = torch.tensor([[1.5], [2.0], [0.0]], dtype=torch.float64, requires_grad=True)
    go = torch.tensor([[1.0], [1.0], [1.0]], dtype=torch.float64)
    mine = torch.autograd.grad(gnn.scatter_reduce(src, index, 0, 3, "prod", input=base), (src, base), go)
    ref = torch.autograd.grad(base.scatter_reduce(0, index.view(-1, 1), src, "prod"), (src, base), go)
    for a, b in zip(mine, ref):
        torch.testing.assert_close(a, b)


def test_gather_gradcheck_and_bf16():
    torch.manual_seed(4)
    index = torch.randint(0, 9, (30,))
    src = torch.randn(9, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda s: gnn.gather(s, index), (src,))
    assert torch.autograd.gradcheck(lambda s: gnn.gather(s, index.int()), (src,))
    sb = torch.randn(9, 4).bfloat16().requires_grad_()
    go = torch.randn(30, 4).bfloat16()
    (gb,) = torch.autograd.grad(gnn.gather(sb, index), (sb,), go)
    ref = torch.zeros(9, 4).index_add_(0, index, go.float())
    assert_bf16_close(gb, ref)


def test_scatter_max_tie_goes_to_one_winner():
    """Documented difference from torch: a tie gives the whole gradient to one winner."""
    index = torch.tensor([0, 0])
    src = torch.tensor([[1.0], [1.0]], requires_grad=True)
    (g,) = torch.autograd.grad(gnn.scatter(src, index, 0, 1, "max"), (src,), torch.ones(1, 1))
    assert sorted(g.flatten().tolist()) == [0.0, 1.0]


def test_spmm_csc_built_once_and_reused():
    g, *_ = _graph("random")
    x = torch.randn(g.n_cols, 4, requires_grad=True)
    gnn.spmm(g, x).sum().backward()
    csc = g._csc
    assert csc is not None
    gnn.spmm(g, x, "mean").sum().backward()
    assert g._csc is csc


def test_torch_compile_ops():
    g, dst, src, perm = _graph("random")
    colptr, row_t, perm_t = g.csc()
    torch.manual_seed(5)

    def f(x, w, s):
        a, _ = torch.ops.cpu_opt.spmm(g.rowptr, g.col, w, colptr, row_t, perm_t, x, "mean")
        b, _ = torch.ops.cpu_opt.spmm(g.rowptr, g.col, None, colptr, row_t, perm_t, x, "amax")
        c = torch.ops.cpu_opt.scatter_reduce(s, dst, g.n_rows, "amin", None, False)[0]
        d = torch.ops.cpu_opt.gather(x, src)
        return (a * 2).sum() + b.sum() + c.sum() + d.sum()

    x = torch.randn(g.n_cols, 6, requires_grad=True)
    w = torch.rand(g.nnz, requires_grad=True)
    s = torch.randn(dst.numel(), 6, requires_grad=True)
    eager = f(x, w, s)
    ge = torch.autograd.grad(eager, (x, w, s))
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    out = compiled(x, w, s)
    gc = torch.autograd.grad(out, (x, w, s))
    torch.testing.assert_close(out, eager)
    for a, b in zip(gc, ge):
        torch.testing.assert_close(a, b)


def test_opcheck():
    """torch.library.opcheck: schema, fake tensors and autograd registration agree."""
    g, dst, src, perm = _graph("random")
    colptr, row_t, perm_t = g.csc()
    x = torch.randn(g.n_cols, 5, requires_grad=True)
    torch.library.opcheck(torch.ops.cpu_opt.spmm.default,
                          (g.rowptr, g.col, None, colptr, row_t, perm_t, x, "sum"))
    torch.library.opcheck(torch.ops.cpu_opt.spmm.default,
                          (g.rowptr, g.col, None, colptr, row_t, perm_t, x, "amax"))
    s = torch.randn(dst.numel(), 5, requires_grad=True)
    torch.library.opcheck(torch.ops.cpu_opt.scatter_reduce.default, (s, dst, g.n_rows, "mean", None, False))
    torch.library.opcheck(torch.ops.cpu_opt.gather.default, (x, src))


@pytest.mark.parametrize("reduce", ["mean", "amax"])
def test_spmm_eager_fast_path_and_compiled_op_agree(reduce):
    """gnn.spmm runs SpmmFunction (no dispatcher) in eager mode and the custom op under
    torch.compile (fullgraph: a cffi call would break the graph); same values and gradients."""
    from cpu_opt.gnn import _autograd

    g, dst, src, perm = _graph("random")
    torch.manual_seed(6)
    x = torch.randn(g.n_cols, 70, requires_grad=True)
    w = (torch.rand(g.nnz) + 0.5).requires_grad_()
    go = torch.randn(g.n_rows, 70)
    calls = []
    orig = _autograd.SpmmFunction.forward
    _autograd.SpmmFunction.forward = staticmethod(lambda ctx, *a: calls.append(1) or orig(ctx, *a))
    try:
        eager = gnn.spmm(g, x, reduce, weight=w)
        ge = torch.autograd.grad(eager, (x, w), go)
        assert calls, "eager gnn.spmm did not take SpmmFunction"
        calls.clear()
        compiled = torch.compile(lambda x, w: gnn.spmm(g, x, reduce, weight=w), fullgraph=True, backend="aot_eager")
        out = compiled(x, w)
        gc = torch.autograd.grad(out, (x, w), go)
        assert not calls, "compiled gnn.spmm took the eager path"
    finally:
        _autograd.SpmmFunction.forward = orig
    torch.testing.assert_close(out, eager)
    for a, b in zip(gc, ge):
        torch.testing.assert_close(a, b)


def test_spmm_double_backward_raises_instead_of_returning_zero():
    g, dst, src, perm = _graph("random")
    x = torch.randn(g.n_cols, 4, dtype=torch.float64, requires_grad=True)
    out = gnn.spmm(g, x, "sum")
    (gx,) = torch.autograd.grad(out.pow(2).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="no autograd formula was registered"):
        torch.autograd.grad(gx.sum(), x)
