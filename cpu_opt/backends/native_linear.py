"""cpu_opt's own GEMV (``native/kernels/gemv.c``) as an FX call target: the linear layers of a
language model's decode step (1-3 activation rows), where the time is the weight stream from
memory. Each thread reads one contiguous stretch of the weight (its block of K rows for a (K, N)
weight, of N rows for an (N, K) one), which is what the hardware prefetchers follow best.

``passes.route_linears`` sends a layer here when the route for its row count says ``native``;
:func:`linear` keeps the weight in the layout the model has (no copy) and hands anything the
kernel does not take (more rows than ``MAX_ROWS`` at a later call, other dtypes, strided inputs)
to torch."""
from __future__ import annotations

import functools

import torch

from .. import native

MAX_ROWS = 8  # CO_GEMV_MAX_ROWS in native/kernels/gemv.c


def _torch(x, w, b, kn: bool):
    if kn:
        y = x.reshape(-1, x.shape[-1]) @ w
        if b is not None:
            y = y + b
        return y.reshape(*x.shape[:-1], w.shape[1])
    return torch.nn.functional.linear(x, w, b)


class Gemv:
    """One linear layer's call target (``gemv(x, w, b)``): the kernel resolved once, when the layer is
    routed (a lookup per call cost 11 us of the 33 the call took), for the weight layout ``kn``."""

    def __init__(self, kn: bool):
        self.kn = bool(kn)
        self._kernel = native.kernel("gemv_f32")
        self.__name__ = "gemv_kn" if kn else "gemv_nk"
        self.__qualname__ = f"Gemv({'KxN' if kn else 'NxK'})"

    def __call__(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        return linear(x, w, b, self.kn, self._kernel)


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, kn: bool, kernel=None) -> torch.Tensor:
    """``x @ w + b`` when ``kn`` (``w`` is (K, N)), else ``F.linear(x, w, b)`` (``w`` is (N, K))."""
    K = x.shape[-1]
    N = w.shape[1] if kn else w.shape[0]
    M = x.numel() // K if K else 0
    ok = (x.dtype == w.dtype == torch.float32 and (b is None or (b.dtype == torch.float32 and b.is_contiguous()
                                                                and b.numel() == N))
          and x.is_contiguous() and w.is_contiguous() and 1 <= M <= MAX_ROWS and K >= 1 and N >= 1
          and w.shape[0 if kn else 1] == K)
    if not ok:
        return _torch(x, w, b, kn)
    y = torch.empty(*x.shape[:-1], N, dtype=torch.float32)
    ffi = native.ffi()
    fp = ffi.NULL if b is None else ffi.cast("float *", b.data_ptr())
    st = (kernel or native.kernel("gemv_f32"))(ffi.cast("float *", x.data_ptr()), M, K, ffi.cast("float *", w.data_ptr()),
                                               N, int(kn), fp, ffi.cast("float *", y.data_ptr()), torch.get_num_threads())
    if st:
        native.check(st, "gemv_f32")
    return y


# ----------------------------------------------------------------------------- tall-skinny GEMMs

TS_MAX_DIM = 1024  # CO_TS_MAX_DIM in native/kernels/tsgemm.c: the small dimensions' bound


def _ts_check(what: str, *named) -> None:
    for name, t in named:
        if t.dtype != torch.float32 or t.dim() != 2 or not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError(f"{what}: {name} must be a contiguous 2-D float32 CPU tensor, got "
                             f"{t.dtype} {tuple(t.shape)} (contiguous={t.is_contiguous()}, {t.device})")


def _ptr(t):
    return native.ptr(t, "float *")


def ts_fits(k: int, n: int) -> bool:
    """Whether a GEMM with small dimensions ``k`` and ``n`` is within the kernel's bounds."""
    return 1 <= k <= TS_MAX_DIM and 1 <= n <= TS_MAX_DIM


def ts_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, *,
              out: torch.Tensor | None = None, accumulate: bool = False, relu: bool = False) -> torch.Tensor:
    """``x @ w.T + b`` (``w`` (N, K): nn.Linear's layout) on cpu_opt's tall-skinny GEMM, written into
    ``out`` when given, added to it when ``accumulate``; ``relu``: ``torch.relu`` of it, applied
    before the output is written (not with ``accumulate``)."""
    return _ts_nn("ts_linear", x, w, True, b, out, accumulate, relu=relu)


def ts_linear_sum(a1: torch.Tensor, w1: torch.Tensor, a2: torch.Tensor, w2: torch.Tensor,
                  bias: torch.Tensor | None = None, *, relu: bool = False) -> torch.Tensor:
    """``a1 @ w1.T + a2 @ w2.T + bias`` in one pass over the output (both weights (N, K_i));
    ``relu``: ``torch.relu`` of that, in the same pass."""
    _ts_check("ts_linear_sum", ("a1", a1), ("w1", w1), ("a2", a2), ("w2", w2))
    M, K1 = a1.shape
    K2, N = a2.shape[1], w1.shape[0]
    if a2.shape[0] != M or w1.shape[1] != K1 or tuple(w2.shape) != (N, K2):
        raise ValueError(f"ts_linear_sum: shapes {tuple(a1.shape)} x {tuple(w1.shape)} + {tuple(a2.shape)} x "
                         f"{tuple(w2.shape)} do not match")
    if not (ts_fits(K1, N) and ts_fits(K2, N)):
        raise ValueError(f"ts_linear_sum: K1={K1}, K2={K2}, N={N}: the small dimensions must be in [1, {TS_MAX_DIM}]")
    if bias is not None and (bias.dtype != torch.float32 or bias.numel() != N or not bias.is_contiguous()):
        raise ValueError(f"ts_linear_sum: bias must be {N} contiguous float32 values, got {bias.dtype} {tuple(bias.shape)}")
    out = native.empty(M, N)
    if M == 0:
        return out
    ffi = native.ffi()
    st = native.kernel("ts_gemm_nn2_ep_f32")(_ptr(a1), M, K1, _ptr(w1), _ptr(a2), K2, _ptr(w2), N,
                                             ffi.NULL if bias is None else _ptr(bias), int(relu), _ptr(out),
                                             torch.get_num_threads())
    if st:
        native.check(st, "ts_gemm_nn2_ep_f32", f"{tuple(a1.shape)}, {tuple(a2.shape)} -> {N}")
    return out


def ts_matmul(a: torch.Tensor, b: torch.Tensor, *, keep: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b`` (``b`` (K, N), small) on cpu_opt's tall-skinny GEMM: a linear layer's input gradient
    ``g @ W``. ``keep`` (the output's shape): zero where ``keep <= 0``, as
    ``torch.ops.aten.threshold_backward(a @ b, keep, 0)`` (the gradient through a ReLU whose output
    was ``keep``), in the same pass."""
    return _ts_nn("ts_matmul", a, b, False, None, None, False, keep=keep)


def _ts_nn(what, a, b, b_nk: bool, bias, out, accumulate, *, relu: bool = False, keep=None):
    _ts_check(what, ("a", a), ("b", b))
    M, K = a.shape
    N = b.shape[0] if b_nk else b.shape[1]
    if (b.shape[1] if b_nk else b.shape[0]) != K:
        raise ValueError(f"{what}: shapes {tuple(a.shape)} and {tuple(b.shape)} do not multiply")
    if not ts_fits(K, N):
        raise ValueError(f"{what}: K={K}, N={N}: the small dimensions must be in [1, {TS_MAX_DIM}]")
    if bias is not None and (bias.dtype != torch.float32 or bias.numel() != N or not bias.is_contiguous()):
        raise ValueError(f"{what}: bias must be {N} contiguous float32 values, got {bias.dtype} {tuple(bias.shape)}")
    if out is None:
        if accumulate:
            raise ValueError(f"{what}: accumulate=True needs out")
        out = native.empty(M, N)  # huge pages for a large output: no page fault per 4 KiB
    elif out.dtype != torch.float32 or tuple(out.shape) != (M, N) or not out.is_contiguous():
        raise ValueError(f"{what}: out must be a contiguous float32 ({M}, {N}) tensor, got {out.dtype} {tuple(out.shape)}")
    if keep is not None:
        _ts_check(what, ("keep", keep))
        if tuple(keep.shape) != (M, N):
            raise ValueError(f"{what}: keep must have the output's shape ({M}, {N}), got {tuple(keep.shape)}")
    if accumulate and (relu or keep is not None):
        raise ValueError(f"{what}: relu and keep apply to a written output, not with accumulate=True")
    if M == 0:  # an empty tensor's data pointer may be NULL, which the kernel refuses
        return out
    ffi = native.ffi()
    if relu or keep is not None:
        st = native.kernel("ts_gemm_nn_ep_f32")(_ptr(a), M, K, _ptr(b), N, int(b_nk),
                                                ffi.NULL if bias is None else _ptr(bias), int(relu),
                                                ffi.NULL if keep is None else _ptr(keep), _ptr(out),
                                                torch.get_num_threads())
        if st:
            native.check(st, "ts_gemm_nn_ep_f32", f"{tuple(a.shape)} x {tuple(b.shape)}")
        return out
    st = native.kernel("ts_gemm_nn_f32")(_ptr(a), M, K, _ptr(b), N, int(b_nk), ffi.NULL if bias is None else _ptr(bias),
                                         int(accumulate), _ptr(out), torch.get_num_threads())
    if st:
        native.check(st, "ts_gemm_nn_f32", f"{tuple(a.shape)} x {tuple(b.shape)}")
    return out


def ts_weight_grad(g: torch.Tensor, x: torch.Tensor, bias: bool = False, *, keep: torch.Tensor | None = None):
    """``(g.T @ x, g.sum(0) if bias else None)`` in one pass over the rows of ``g`` and ``x``: a
    linear layer's weight and bias gradients. ``keep`` (``g``'s shape): ``g`` taken as 0 where
    ``keep <= 0``, as ``torch.ops.aten.threshold_backward(g, keep, 0)`` (the layer's output went
    through a ReLU whose output was ``keep``), masked as it is read (no masked copy of ``g``)."""
    _ts_check("ts_weight_grad", ("g", g), ("x", x))
    if g.shape[0] != x.shape[0]:
        raise ValueError(f"ts_weight_grad: g {tuple(g.shape)} and x {tuple(x.shape)} have different row counts")
    if keep is not None:
        _ts_check("ts_weight_grad", ("keep", keep))
        if keep.shape != g.shape:
            raise ValueError(f"ts_weight_grad: keep must have g's shape {tuple(g.shape)}, got {tuple(keep.shape)}")
    M, N1 = g.shape
    N2 = x.shape[1]
    if not ts_fits(N1, N2):
        raise ValueError(f"ts_weight_grad: {N1} x {N2} output is outside [1, {TS_MAX_DIM}]")
    gw = torch.empty(N1, N2, dtype=torch.float32)
    gb = torch.empty(N1, dtype=torch.float32) if bias else None
    if M == 0:  # no rows: zero gradients (and an empty tensor's data pointer may be NULL)
        return gw.zero_(), None if gb is None else gb.zero_()
    ffi = native.ffi()
    st = native.kernel("ts_gemm_tn_ep_f32")(_ptr(g), M, N1, _ptr(x), N2, ffi.NULL if keep is None else _ptr(keep),
                                            _ptr(gw), ffi.NULL if gb is None else _ptr(gb), torch.get_num_threads())
    if st:
        native.check(st, "ts_gemm_tn_ep_f32", f"{tuple(g.shape)}^T x {tuple(x.shape)}")
    return gw, gb


def ts_weight_grad2(g: torch.Tensor, x1: torch.Tensor, x2: torch.Tensor, bias: bool = False, *,
                    keep: torch.Tensor | None = None):
    """``(g.T @ x1, g.T @ x2, g.sum(0) if bias else None)`` in one pass over the rows of ``g`` (and
    ``keep``, as in :func:`ts_weight_grad`): the weight gradients of two linear layers whose outputs
    were summed (SAGEConv's ``lin_l`` and ``lin_r``), ``g`` read and masked once for both."""
    _ts_check("ts_weight_grad2", ("g", g), ("x1", x1), ("x2", x2))
    if not g.shape[0] == x1.shape[0] == x2.shape[0]:
        raise ValueError(f"ts_weight_grad2: g {tuple(g.shape)}, x1 {tuple(x1.shape)} and x2 {tuple(x2.shape)} "
                         f"have different row counts")
    if keep is not None:
        _ts_check("ts_weight_grad2", ("keep", keep))
        if keep.shape != g.shape:
            raise ValueError(f"ts_weight_grad2: keep must have g's shape {tuple(g.shape)}, got {tuple(keep.shape)}")
    M, N1 = g.shape
    N2, N3 = x1.shape[1], x2.shape[1]
    if not (ts_fits(N1, N2) and ts_fits(N1, N3)):
        raise ValueError(f"ts_weight_grad2: {N1} x {N2} and {N1} x {N3} outputs must be within [1, {TS_MAX_DIM}]")
    gw1, gw2 = torch.empty(N1, N2, dtype=torch.float32), torch.empty(N1, N3, dtype=torch.float32)
    gb = torch.empty(N1, dtype=torch.float32) if bias else None
    if M == 0:
        return gw1.zero_(), gw2.zero_(), None if gb is None else gb.zero_()
    ffi = native.ffi()
    st = native.kernel("ts_gemm_tn2_ep_f32")(_ptr(g), M, N1, _ptr(x1), N2, _ptr(x2), N3,
                                             ffi.NULL if keep is None else _ptr(keep), _ptr(gw1), _ptr(gw2),
                                             ffi.NULL if gb is None else _ptr(gb), torch.get_num_threads())
    if st:
        native.check(st, "ts_gemm_tn2_ep_f32", f"{tuple(g.shape)}^T x {tuple(x1.shape)}, {tuple(x2.shape)}")
    return gw1, gw2, gb


# ----------------------------------------------------------------------------- packed GEMMs

@functools.lru_cache(maxsize=None)
def _packed_size(n: int, k: int) -> int:
    """Floats in the packed form of an (n, k) weight (the kernel's own answer, asked once per shape:
    :func:`packed_linear` checks it on every call)."""
    return int(native.kernel("sgemm_packed_size")(n, k))


def pack_weight(w: torch.Tensor, kn: bool = False) -> torch.Tensor:
    """The weight of a linear layer (``w`` (N, K), nn.Linear's layout, or (K, N) when ``kn``) packed
    for :func:`packed_linear`: ceil(N / 16) panels of K x 16 floats (``native/kernels/sgemm.c``), a
    flat float32 tensor made once per layer."""
    if w.dtype != torch.float32 or w.dim() != 2 or w.device.type != "cpu":
        raise ValueError(f"pack_weight: w must be a 2-D float32 CPU tensor, got {w.dtype} {tuple(w.shape)} ({w.device})")
    w = w.detach().contiguous()
    n, k = (w.shape[1], w.shape[0]) if kn else tuple(w.shape)
    if n < 1 or k < 1:
        raise ValueError(f"pack_weight: an empty weight {tuple(w.shape)}")
    size = _packed_size(n, k)
    packed = torch.empty(size, dtype=torch.float32)
    native.check(native.kernel("sgemm_pack_f32")(_ptr(w), n, k, int(kn), _ptr(packed)), "sgemm_pack_f32",
                 f"{tuple(w.shape)}")
    return packed


# the activation a packed GEMM applies as it stores its output (sgemm.c's act codes)
ACTIVATIONS = {"none": 0, "relu": 1, "gelu": 2, "gelu_tanh": 3}


class PackedLinear:
    """One linear layer's call target on cpu_opt's packed GEMM: ``PackedLinear(n, k, act)(x, wp, b,
    add=None)`` is ``F.linear(x, W, b)`` (``+ add``), then the activation ``act`` (``"none"``,
    ``"relu"``, ``"gelu"``: the erf form, ``"gelu_tanh"``, computed as
    :mod:`cpu_opt.backends.native_eltwise` computes them) for the weight ``W`` (n, k) that
    :func:`pack_weight` made ``wp`` from. The kernel resolved once, when the layer is routed."""

    returns_fresh = True   # a new tensor on every call: the graph's passes may write into it

    def __init__(self, n: int, k: int, act: str = "none"):
        if act not in ACTIVATIONS:
            raise ValueError(f"PackedLinear: act must be one of {sorted(ACTIVATIONS)}, got {act!r}")
        self.n, self.k, self.act = int(n), int(k), act
        self._kernel = native.kernel("sgemm_packed_f32")
        self.__name__ = "sgemm" if act == "none" else f"sgemm_{act}"
        self.__qualname__ = f"PackedLinear({self.k}->{self.n}{'' if act == 'none' else ', ' + act})"

    def __call__(self, x: torch.Tensor, wp: torch.Tensor, b: torch.Tensor | None,
                 add: torch.Tensor | None = None) -> torch.Tensor:
        return packed_linear(x, wp, b, self.n, add=add, act=self.act, kernel=self._kernel)


def packed_linear(x: torch.Tensor, wp: torch.Tensor, b: torch.Tensor | None, n: int, *,
                  add: torch.Tensor | None = None, act: str = "none", kernel=None) -> torch.Tensor:
    """``x @ W.T + b`` (``+ add``), then the activation ``act`` (see :class:`PackedLinear`), with ``wp =
    pack_weight(W)``, ``W`` (n, K) where K is ``x``'s last dimension; a new (…, n) tensor on every call."""
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() < 1:
        raise ValueError(f"packed_linear: x must be a float32 CPU tensor, got {x.dtype} {tuple(x.shape)} ({x.device})")
    if act not in ACTIVATIONS:
        raise ValueError(f"packed_linear: act must be one of {sorted(ACTIVATIONS)}, got {act!r}")
    k = x.shape[-1]
    if k < 1 or n < 1 or wp.dtype != torch.float32 or not wp.is_contiguous() or \
            wp.numel() != _packed_size(n, k):
        raise ValueError(f"packed_linear: the packed weight ({wp.dtype}, {wp.numel()} values) was not packed for "
                         f"{n} outputs of {k} inputs")
    if b is not None and (b.dtype != torch.float32 or b.numel() != n or not b.is_contiguous()):
        raise ValueError(f"packed_linear: bias must be {n} contiguous float32 values, got {b.dtype} {tuple(b.shape)}")
    x2 = x.reshape(-1, k)
    if x2.stride(1) != 1 or x2.stride(0) < k:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = torch.empty(*x.shape[:-1], n, dtype=torch.float32)
    if add is not None:
        if add.dtype != torch.float32 or tuple(add.shape) != tuple(out.shape):
            raise ValueError(f"packed_linear: add must be a float32 tensor of the output's shape {tuple(out.shape)}, "
                             f"got {add.dtype} {tuple(add.shape)}")
        add = add.contiguous()
    if m == 0:
        return out
    ffi = native.ffi()
    st = (kernel or native.kernel("sgemm_packed_f32"))(
        _ptr(x2), m, k, x2.stride(0), _ptr(wp), n, ffi.NULL if b is None else _ptr(b),
        ffi.NULL if add is None else _ptr(add), ACTIVATIONS[act], _ptr(out), torch.get_num_threads())
    if st:
        native.check(st, "sgemm_packed_f32", f"{tuple(x.shape)} -> {n}")
    return out
