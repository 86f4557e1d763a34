"""Strategies shared by the fuzz tests (imported by name: conftest.py puts this folder on sys.path)."""
import torch
from hypothesis import strategies as st

# What a bad input may raise: a clear Python exception naming the problem. Anything else (or a
# crash) fails the test.
CLEAR_ERRORS = (TypeError, ValueError, IndexError, MemoryError)


@st.composite
def layouts(draw, t: torch.Tensor):
    """``t`` as one of the memory layouts a caller may hand over: contiguous, transposed (when 2-D+),
    a strided slice of a bigger buffer, a negated-bit view, or a zero-stride expand of one row."""
    kind = draw(st.sampled_from(["contiguous", "transposed", "sliced", "neg", "expanded"]))
    if kind == "transposed" and t.dim() >= 2:
        return t.transpose(0, 1).contiguous().transpose(0, 1), kind
    if kind == "sliced" and t.dim() >= 1:
        big = torch.zeros((t.shape[0] * 2,) + tuple(t.shape[1:]), dtype=t.dtype)
        big[::2] = t
        return big[::2], kind
    if kind == "neg" and t.is_floating_point():
        return torch._neg_view(-t), kind
    if kind == "expanded" and t.dim() >= 1 and t.shape[0] >= 1:
        row = t[:1]
        return row.expand(t.shape), "expanded"
    return t.contiguous(), "contiguous"
