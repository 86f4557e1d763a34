"""log_softmax over a narrow last dimension (1 to 15 classes) on a native kernel, and its
installation as torch's CPU kernel for ``aten::_log_softmax`` / ``aten::_log_softmax_backward_data``.

A node classifier's loss is ``F.cross_entropy`` over a handful of classes (Cora 7, PubMed 3, the
benchmark's 8). torch 2.13 computes log_softmax over a last dimension under 16 one partial vector
at a time, 12-14x slower than over 16 (100k x 8, Zen 4, 1 thread: 12.1 ms forward and 6.4 ms
backward against 0.95 and 0.41 at 100k x 16) — 18 ms of a 90 ms GraphSAGE training step.

    from cpu_opt.gnn import log_softmax
    y = log_softmax.log_softmax_narrow(x)        # float32, last dimension 1..15
    log_softmax.install()                        # torch's own log_softmax / cross_entropy use it
    log_softmax.uninstall()                      # torch's kernels again

:func:`install` registers CPU kernels for the two ATen operators through ``torch.library`` (process
wide; ``gnn.optimize`` installs them unless ``narrow_log_softmax=False``). They take float32,
contiguous, last-dimension inputs of 1 to 15 columns and at least ``MIN_ROWS`` rows; every other call
goes to torch's own kernel through the operators' ``out=`` overloads, which stay torch's, after a
Python call that costs it 8-13 us (64 x 32 on a Zen 4: 2.8 us in torch's kernel alone, 10.8 installed):
small against a wide softmax's own time, and the price of installing it in a process that runs many
small ones. The native rows use Cephes' exp
(within a few ulp of libm's expf); rows with inf or NaN take a scalar loop on libm with IEEE rules,
so NaN and +inf give NaN as torch's do.
"""
from __future__ import annotations

import threading
import warnings
from collections import Counter

import torch

from cpu_opt import native

from ._kernels import _fn, _nthreads  # the variant lookup and thread count the other gnn kernels use

MAX_DIM = 15  # torch's kernel is fast from 16 columns on
# Installed, the kernels take tensors of at least this many rows: below, torch's own kernel plus the
# Python call's overhead is no slower (10 columns, 2 threads, Zen 4: 64 rows 9 us in torch's kernel,
# 17 installed either way; 256 rows 24 against 16; 4096 rows 321 against 52)
MIN_ROWS = 64

counts: Counter = Counter()  # "forward" / "backward": calls the native kernels took; "*_torch": passed on
# (statistics: calls from several threads at once may lose a count)
_lock = threading.Lock()
_library: torch.library.Library | None = None


def _last_dim(x: torch.Tensor, dim: int) -> int | None:
    """``dim`` wrapped, or None where it is out of range (torch's kernel then raises its own error)."""
    nd = max(x.dim(), 1)
    return dim % nd if -nd <= dim < nd else None


def _narrow(x: torch.Tensor, dim: int) -> bool:
    """Whether the native kernel takes ``x`` along ``dim``: float32 CPU, contiguous, the last
    dimension, 1..MAX_DIM columns."""
    return (x.dtype == torch.float32 and x.dim() >= 1 and 1 <= x.shape[-1] <= MAX_DIM and x.is_cpu
            and x.layout == torch.strided and _last_dim(x, dim) == x.dim() - 1 and x.is_contiguous()
            and not x.is_neg() and not x.is_conj())


def _rows(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1]


def _run(name: str, *inputs: torch.Tensor) -> torch.Tensor:
    """The kernel ``name`` on the (checked) ``inputs``, into a new tensor shaped as the first."""
    res = torch.empty_like(inputs[0], memory_format=torch.contiguous_format)
    dim_size = res.shape[-1]
    st = _fn(name)(*(native.ptr(t, "float *") for t in (*inputs, res)), res.numel() // dim_size, dim_size,
                   _nthreads())
    if st:
        raise RuntimeError(f"{name} failed with status {st}")
    return res


def log_softmax_narrow(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``torch.log_softmax(x, dim)`` for a float32 CPU tensor whose ``dim`` is its last dimension,
    of 1 to 15 columns, on the native kernel (no autograd: :func:`install` is the way to train with
    it). Raises ``ValueError`` for anything else."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"log_softmax_narrow: x must be a torch.Tensor, got {type(x).__name__}")
    if _last_dim(x, dim) is None:
        raise IndexError(f"log_softmax_narrow: dim {dim} out of range for a tensor of {x.dim()} dimensions")
    if not _narrow(x, dim):
        raise ValueError("log_softmax_narrow takes a contiguous float32 CPU tensor along its last dimension of "
                         f"1..{MAX_DIM} columns; got {x.dtype} on {x.device}, shape {tuple(x.shape)}, dim {dim}, "
                         f"contiguous {x.is_contiguous()}")
    return _run("log_softmax_narrow_f32", x)


def log_softmax_backward_narrow(grad: torch.Tensor, out: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The input gradient of log_softmax, ``grad - exp(out) * grad.sum(dim, keepdim=True)``, for the
    tensors :func:`log_softmax_narrow` takes. Raises ``ValueError`` for anything else."""
    if not (isinstance(grad, torch.Tensor) and isinstance(out, torch.Tensor)):
        raise TypeError("log_softmax_backward_narrow: grad and out must be torch.Tensor")
    if grad.shape != out.shape or not _narrow(grad, dim) or not _narrow(out, dim):
        raise ValueError("log_softmax_backward_narrow takes grad and out of one shape, contiguous float32 CPU, "
                         f"along the last dimension of 1..{MAX_DIM} columns; got {grad.dtype} {tuple(grad.shape)} "
                         f"and {out.dtype} {tuple(out.shape)}, dim {dim}")
    return _run("log_softmax_backward_narrow_f32", grad, out)


# ------------------------------------------------------------------ the ATen kernels

def _aten_log_softmax(x: torch.Tensor, dim: int, half_to_float: bool) -> torch.Tensor:
    if not half_to_float and _narrow(x, dim) and _rows(x) >= MIN_ROWS:
        counts["forward"] += 1
        return log_softmax_narrow(x, dim)
    counts["forward_torch"] += 1
    out = torch.empty(x.shape, dtype=torch.float32 if half_to_float else x.dtype)
    return torch.ops.aten._log_softmax.out(x, dim, half_to_float, out=out)


def _aten_log_softmax_backward(grad: torch.Tensor, out: torch.Tensor, dim: int, input_dtype: torch.dtype) -> torch.Tensor:
    if input_dtype == torch.float32 and grad.shape == out.shape and _narrow(grad, dim) and _narrow(out, dim) and \
            _rows(grad) >= MIN_ROWS:
        counts["backward"] += 1
        return log_softmax_backward_narrow(grad, out, dim)
    counts["backward_torch"] += 1
    gin = torch.empty(grad.shape, dtype=input_dtype)
    return torch.ops.aten._log_softmax_backward_data.out(grad, out, dim, input_dtype, out=gin)


def install() -> bool:
    """Make torch's CPU ``aten::_log_softmax`` and ``aten::_log_softmax_backward_data`` (under
    ``log_softmax``, ``cross_entropy``, ``nll_loss`` of a ``log_softmax``) run the native kernels
    for the inputs they take, process wide. Idempotent; returns whether this call installed them."""
    global _library
    with _lock:
        if _library is not None:
            return False
        lib = torch.library.Library("aten", "IMPL")
        with warnings.catch_warnings():  # torch warns once that a registered kernel is overridden: the point
            warnings.simplefilter("ignore")
            lib.impl("_log_softmax", _aten_log_softmax, "CPU")
            lib.impl("_log_softmax_backward_data", _aten_log_softmax_backward, "CPU")
        _library = lib
        return True


def uninstall() -> bool:
    """Give ``aten::_log_softmax`` and its backward their torch kernels back. Returns whether they
    were installed. As any change of torch's dispatch table, not while other threads run torch ops
    (install and uninstall are serialised with each other, not with dispatch)."""
    global _library
    with _lock:
        if _library is None:
            return False
        _library._destroy()
        _library = None
        return True


def installed() -> bool:
    return _library is not None
