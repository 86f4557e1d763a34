"""cpu_opt's own GEMV (``native/kernels/gemv.c``) as an FX call target: the linear layers of a
language model's decode step (1-3 activation rows), where the time is the weight stream from
memory. Each thread reads one contiguous stretch of the weight (its block of K rows for a (K, N)
weight, of N rows for an (N, K) one), which is what the hardware prefetchers follow best.

``passes.route_linears`` sends a layer here when the route for its row count says ``native``;
:func:`linear` keeps the weight in the layout the model has (no copy) and hands anything the
kernel does not take (more rows than ``MAX_ROWS`` at a later call, other dtypes, strided inputs)
to torch."""
from __future__ import annotations

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
