"""cpu_opt's own elementwise kernels (``native/kernels/eltwise.c``) as FX call targets.

:func:`gelu` / :func:`gelu_` compute torch's exact GELU (``approximate="none"``) with a vectorized
rational erf: 2.3-2.6x faster than ``torch.nn.functional.gelu`` on 150k-1.2M floats at 2 threads
(Zen 3, AVX2), within 1.1e-6 absolute of float64 GELU over [-12, 12] (torch's own: 3.8e-7).
``passes.route_gelu`` sends a GELU here when the linear layer feeding it runs outside oneDNN
Graph (where oneDNN would have taken it as a partition of its own, not as a fused post-op).

:func:`gelu_tanh` / :func:`gelu_tanh_` compute torch's ``approximate="tanh"`` GELU (GPT-2's) as
``x / (1 + exp(-2u))``: 0.15 ms for 128 x 3072 floats at 2 threads against torch's 0.72-0.75 ms,
within 5.2e-7 absolute of float64 over [-30, 30] (torch's own: 4.3e-7), Zen 3. oneDNN Graph 3.2
has no tanh GELU, so every fp32 one comes here where the vector kernels run."""
from __future__ import annotations

import torch

from .. import native

def available() -> bool:
    """Is a vectorized variant of the kernel the one this CPU runs? (The base variant calls libm's
    erff per element: slower than torch's.)"""
    return native.vectorized()


def _run(x: torch.Tensor, out: torch.Tensor, kernel: str = "gelu_erf_f32") -> torch.Tensor:
    if x.dtype != torch.float32 or not x.is_contiguous() or x.device.type != "cpu":
        raise TypeError(f"cpu_opt's GELU takes a contiguous float32 CPU tensor; got {x.dtype}, "
                        f"strides {tuple(x.stride())} on {x.device}")
    native.check(native.kernel(kernel)(native.ptr(x, "float *"), native.ptr(out, "float *"), x.numel(),
                                       torch.get_num_threads()), kernel)
    return out


def gelu(x: torch.Tensor) -> torch.Tensor:
    """``torch.nn.functional.gelu(x)`` (erf form) for a contiguous float32 tensor; others go to torch."""
    if x.dtype != torch.float32 or not x.is_contiguous():
        return torch.nn.functional.gelu(x)
    return _run(x, torch.empty_like(x))


def gelu_(x: torch.Tensor) -> torch.Tensor:
    """:func:`gelu` written into ``x`` (the graph proved nothing else reads it); returns ``x``."""
    if x.dtype != torch.float32 or not x.is_contiguous():
        return torch.nn.functional.gelu(x)
    return _run(x, x)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """``torch.nn.functional.gelu(x, approximate="tanh")`` for a contiguous float32 tensor; others go to torch."""
    if x.dtype != torch.float32 or not x.is_contiguous():
        return torch.nn.functional.gelu(x, approximate="tanh")
    return _run(x, torch.empty_like(x), "gelu_tanh_f32")


def gelu_tanh_(x: torch.Tensor) -> torch.Tensor:
    """:func:`gelu_tanh` written into ``x`` (the graph proved nothing else reads it); returns ``x``."""
    if x.dtype != torch.float32 or not x.is_contiguous():
        return torch.nn.functional.gelu(x, approximate="tanh")
    return _run(x, x, "gelu_tanh_f32")
