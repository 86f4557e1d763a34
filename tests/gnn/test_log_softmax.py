"""cpu_opt.gnn.log_softmax: log_softmax over 1..15 columns and its backward on the native kernel,
against torch's own kernels (every variant that runs here), and installed as torch's CPU kernel:
cross_entropy's loss and gradient through it, the fast path counted, other inputs left to torch's
kernel bit for bit, uninstall restoring torch's, gnn.optimize installing it."""
import pytest
import torch
import torch.nn.functional as F

from cpu_opt import gnn, native
from cpu_opt.gnn import log_softmax as LS

from gnn_testutil import RUNNABLE_VARIANTS


@pytest.fixture
def torch_kernels():
    """Each test starts and ends with torch's own kernels installed (gnn.optimize elsewhere installs ours)."""
    was = LS.uninstall()
    yield
    LS.uninstall()
    if was:
        LS.install()


def _torch_log_softmax(x, dim=-1):
    assert not LS.installed()
    return torch.log_softmax(x, dim)


def _data(rows, dim, seed, scale=3.0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, dim, generator=gen) * scale
    x[rows // 3] *= 40  # a row of very unequal logits: probabilities under 1e-38 (the backward's scalar rows)
    return x


@pytest.mark.parametrize("variant", RUNNABLE_VARIANTS)
@pytest.mark.parametrize("dim", list(range(1, 16)))
def test_forward_and_backward_equal_torch(torch_kernels, variant, dim):
    for rows, threads in ((1, 1), (37, 1), (5003, 2)):
        x = _data(rows, dim, seed=dim + rows)
        g = torch.randn(rows, dim, generator=torch.Generator().manual_seed(7))
        want = _torch_log_softmax(x)
        want_g = torch.ops.aten._log_softmax_backward_data(g, want, 1, torch.float32)
        old = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            with gnn.use_variant(variant):
                got = LS.log_softmax_narrow(x)
                got_g = LS.log_softmax_backward_narrow(g, want)
        finally:
            torch.set_num_threads(old)
        torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
        torch.testing.assert_close(got_g, want_g, rtol=2e-6, atol=2e-6)
        # and against float64 math
        torch.testing.assert_close(got.double(), torch.log_softmax(x.double(), 1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("variant", RUNNABLE_VARIANTS)
@pytest.mark.parametrize("dim", [5, 12])  # one vector a row, two
def test_infinities_and_nan_follow_torch(torch_kernels, variant, dim):
    """Rows with NaN, +inf, -inf (some or all) among finite rows, in the middle of the vector loop
    and in its scalar tail: torch's NaN, inf and finite values."""
    x = torch.randn(40, dim)
    x[0, 1] = float("nan")
    x[1, 2] = float("inf")
    x[2, 3] = -float("inf")
    x[3, :] = -float("inf")
    x[4, 0] = float("inf")
    x[4, 4] = -float("inf")
    x[20:24] = x[:4]
    x[37:40] = x[1:4]  # the scalar tail
    want = _torch_log_softmax(x)
    with gnn.use_variant(variant):
        got = LS.log_softmax_narrow(x)
    torch.testing.assert_close(got, want, equal_nan=True)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf())
    # the backward of rows holding -inf (exp(-inf) = 0 exactly) and of an output out of Cephes' range
    out = want[[2, 5, 6, 7] * 5].clone()
    out[1, 0] = -120.0
    g = torch.randn_like(out)
    want_g = torch.ops.aten._log_softmax_backward_data(g, out, 1, torch.float32)
    with gnn.use_variant(variant):
        got_g = LS.log_softmax_backward_narrow(g, out)
    torch.testing.assert_close(got_g, want_g, equal_nan=True)


@pytest.mark.parametrize("variant", RUNNABLE_VARIANTS)
@pytest.mark.parametrize("dim", [3, 8, 9, 15])
def test_in_place_and_neighbour_rows(torch_kernels, variant, dim):
    """The vector rows read and write whole vectors, reaching into the next rows: written back
    unchanged, so the kernels work in place (out = x, gin = g) and give the same bits as out of
    place, and a tensor that is a slice of a bigger buffer keeps the rest of the buffer."""
    x = _data(301, dim, seed=dim)
    g = torch.randn(301, dim)
    fn = native.kernel("log_softmax_narrow_f32", variant)
    bfn = native.kernel("log_softmax_backward_narrow_f32", variant)
    with gnn.use_variant(variant):
        want = LS.log_softmax_narrow(x)
        want_g = LS.log_softmax_backward_narrow(g, want)
    buf = torch.randn(305 * dim)
    guard = buf.clone()
    view = buf[2 * dim:303 * dim]  # rows 2..302 of the buffer: rows before and after stay
    view.copy_(x.reshape(-1))
    assert fn(native.ptr(view, "float *"), native.ptr(view, "float *"), 301, dim, 2) == 0
    assert torch.equal(view.view(301, dim), want)
    assert torch.equal(buf[:2 * dim], guard[:2 * dim]) and torch.equal(buf[303 * dim:], guard[303 * dim:])
    gg = g.clone()
    assert bfn(native.ptr(gg, "float *"), native.ptr(want, "float *"), native.ptr(gg, "float *"), 301, dim, 1) == 0
    assert torch.equal(gg, want_g)


def _guarded(n_floats: int):
    """A float32 tensor of n_floats ending exactly where an inaccessible page starts (and one
    starting right after another): a kernel reading or writing past either end faults."""
    import ctypes
    import mmap

    page = mmap.PAGESIZE
    body = (n_floats * 4 + page - 1) // page * page
    buf = mmap.mmap(-1, body + 2 * page)
    base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    libc = ctypes.CDLL(None)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    assert libc.mprotect(base, page, 0) == 0 and libc.mprotect(base + page + body, page, 0) == 0
    end = torch.frombuffer(buf, dtype=torch.float32, count=n_floats, offset=page + body - n_floats * 4)
    start = torch.frombuffer(buf, dtype=torch.float32, count=n_floats, offset=page)
    return buf, end, start


@pytest.mark.parametrize("variant", RUNNABLE_VARIANTS)
def test_vectors_stay_inside_the_tensor(torch_kernels, variant):
    """The vector rows read and write whole vectors past their row: never past the tensor (inputs and
    outputs end at an inaccessible page) nor into another thread's rows (2 threads, sizes around
    the split; the result equals torch's)."""
    fn = native.kernel("log_softmax_narrow_f32", variant)
    bfn = native.kernel("log_softmax_backward_narrow_f32", variant)
    for dim in (1, 2, 7, 8, 9, 15):
        for rows in (1, 3, 17, 4095, 4097):
            x = _data(rows, dim, seed=rows)
            want = _torch_log_softmax(x)
            g = torch.randn(rows, dim)
            want_g = torch.ops.aten._log_softmax_backward_data(g, want, 1, torch.float32)
            keep = []
            for place in (1, 2):  # at the end of the mapping, at its start
                bx, ex, sx = _guarded(rows * dim)
                bo, eo, so = _guarded(rows * dim)
                bg, eg, sg = _guarded(rows * dim)
                keep += [bx, bo, bg]
                xs, os_, gs = (ex, eo, eg) if place == 1 else (sx, so, sg)
                xs.copy_(x.reshape(-1))
                assert fn(native.ptr(xs, "float *"), native.ptr(os_, "float *"), rows, dim, 2) == 0
                torch.testing.assert_close(os_.view(rows, dim), want, rtol=2e-6, atol=2e-6)
                gs.copy_(g.reshape(-1))
                assert bfn(native.ptr(gs, "float *"), native.ptr(os_, "float *"), native.ptr(gs, "float *"),
                           rows, dim, 2) == 0
                torch.testing.assert_close(gs.view(rows, dim), want_g, rtol=2e-6, atol=2e-6)
                del xs, os_, gs, ex, eo, eg, sx, so, sg


def test_bad_input_is_refused(torch_kernels):
    with pytest.raises(TypeError, match="torch.Tensor"):
        LS.log_softmax_narrow([1.0, 2.0])
    for bad, why in ((torch.randn(4, 16), "columns"), (torch.randn(4, 8).double(), "float64"),
                     (torch.randn(8, 4).t(), "contiguous False"), (torch.randn(4, 8, 3), "dim 1")):
        with pytest.raises(ValueError, match=why.split()[0]):
            LS.log_softmax_narrow(bad, 1 if why == "dim 1" else -1)
    with pytest.raises(IndexError, match="dim 2 out of range"):
        LS.log_softmax_narrow(torch.randn(4, 8), 2)
    # installed, an out-of-range dim gets torch's own error
    LS.install()
    with pytest.raises(IndexError, match="Dimension out of range"):
        torch.log_softmax(torch.randn(100, 8), 2)
    LS.uninstall()
    with pytest.raises(ValueError, match="one shape"):
        LS.log_softmax_backward_narrow(torch.randn(4, 8), torch.randn(4, 7))
    # the native entry points check sizes and pointers before touching memory
    ffi = native.ffi()
    x = torch.randn(4, 8)
    fn = native.kernel("log_softmax_narrow_f32")
    bfn = native.kernel("log_softmax_backward_narrow_f32")
    p = native.ptr(x, "float *")
    assert fn(p, p, 4, 0, 1) == -2 and fn(p, p, 4, 16, 1) == -2 and fn(p, p, -1, 8, 1) == -2
    assert fn(ffi.NULL, p, 4, 8, 1) == -2 and fn(p, p, 4, 8, 0) == -2 and fn(ffi.NULL, ffi.NULL, 0, 8, 1) == 0
    assert bfn(p, p, ffi.NULL, 4, 8, 1) == -2 and bfn(p, p, p, 4, 16, 1) == -2


def test_installed_cross_entropy_runs_the_kernels_and_equals_torch(torch_kernels):
    torch.manual_seed(0)
    logits = torch.randn(3000, 7) * 2  # at least MIN_ROWS rows
    y = torch.randint(0, 7, (3000,))
    a = logits.clone().requires_grad_()
    loss_t = F.cross_entropy(a, y)
    loss_t.backward()
    assert LS.install() and not LS.install()  # idempotent
    assert LS.installed()
    before = dict(LS.counts)
    b = logits.clone().requires_grad_()
    loss_c = F.cross_entropy(b, y)
    loss_c.backward()
    assert LS.counts["forward"] == before.get("forward", 0) + 1
    assert LS.counts["backward"] == before.get("backward", 0) + 1
    torch.testing.assert_close(loss_c, loss_t, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-7)
    # other inputs go to torch's own kernel: the same bits as before installing
    # (rows under MIN_ROWS: torch's kernel plus the call costs no more than ours)
    for x, dim in ((torch.randn(80, 16), 1), (torch.randn(80, 7).double(), 1), (torch.randn(80, 7), 0),
                   (torch.randn(7, 80).t(), 1), (torch.randn(80, 7).bfloat16(), 1),
                   (torch.randn(LS.MIN_ROWS - 1, 7), 1)):
        n_torch = LS.counts["forward_torch"]
        got = torch.log_softmax(x, dim)
        assert LS.counts["forward_torch"] == n_torch + 1
        LS.uninstall()
        want = torch.log_softmax(x, dim)
        LS.install()
        assert got.dtype == want.dtype and torch.equal(got, want)
        xg = x.clone().requires_grad_()
        torch.log_softmax(xg, dim).sum().backward()
        assert LS.counts["backward_torch"] >= 1
    # half_to_float (a bfloat16 input, float32 result) is torch's too
    h = torch.randn(20, 5).bfloat16()
    got = torch.ops.aten._log_softmax(h, 1, False)
    assert got.dtype == torch.bfloat16
    # uninstalled: torch's kernels, not ours
    assert LS.uninstall() and not LS.uninstall()
    n = LS.counts["forward"]
    F.cross_entropy(logits, y)
    assert LS.counts["forward"] == n


def test_gnn_optimize_installs_it_and_reports(torch_kernels):
    pytest.importorskip("torch_geometric")
    from torch_geometric.nn import SAGEConv

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = SAGEConv(8, 5)

        def forward(self, x, edge_index):
            return self.conv(x, edge_index)

    ei = torch.randint(0, 100, (2, 300))
    x = torch.randn(100, 8)  # at least MIN_ROWS nodes
    y = torch.randint(0, 5, (100,))
    gnn.optimize(Net(), narrow_log_softmax=False)
    assert not LS.installed()
    model = gnn.optimize(Net())
    assert LS.installed()
    n = LS.counts["backward"]
    F.cross_entropy(model(x, ei), y).backward()
    assert LS.counts["backward"] == n + 1
    rep = model.report()
    assert rep["counts"]["log_softmax backward:cpu_opt"] >= 1
    assert any("log_softmax" in note for note in rep["notes"])
