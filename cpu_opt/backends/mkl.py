"""MKL's packed single-precision GEMM (``cblas_sgemm_pack``), reached through torch's own ops: the
fp32 linear layer of the ``mkl`` route, as torch.compile's frozen graphs run them on CPU
(``mkl::_mkl_linear`` on a weight ``mkl::_mkl_reorder_linear_weight`` packed once for the layer's
row count). A call with another row count than the packing's runs torch's plain linear on the
original weight (torch's own rule), so the answer never depends on the packing."""
from __future__ import annotations

import torch

MKL_LINEAR = torch.ops.mkl._mkl_linear.default


def available() -> bool:
    """torch was built with MKL and its packed-GEMM ops are registered (x86-64 wheels)."""
    try:
        return bool(torch.backends.mkl.is_available()) and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight")
    except (AttributeError, RuntimeError):
        return False


def packed_weight(w_nk: torch.Tensor, rows: int) -> torch.Tensor:
    """``w_nk`` (N, K) packed by MKL for ``rows`` activation rows (an opaque tensor in torch's mkldnn
    layout; MKL's packing adds about 8 MB of its own per layer, whatever the size)."""
    if w_nk.dtype != torch.float32 or w_nk.dim() != 2:
        raise TypeError(f"MKL's packed GEMM takes a 2-D float32 weight, got {w_nk.dtype} {tuple(w_nk.shape)}")
    return torch.ops.mkl._mkl_reorder_linear_weight(w_nk.detach().contiguous(), max(int(rows), 1))
