"""Memory facts about tensors that kernels writing through raw pointers must respect."""
from __future__ import annotations

import torch


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Do the byte ranges two tensors can touch intersect? Conservative (compares spans, not the
    elements a strided view really uses), which is what an ``out=`` check wants."""
    if a.numel() == 0 or b.numel() == 0:
        return False
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False

    def span(t):
        lo = t.data_ptr()
        return lo, lo + (sum((n - 1) * st for n, st in zip(t.shape, t.stride())) + 1) * t.element_size()

    (alo, ahi), (blo, bhi) = span(a), span(b)
    return alo < bhi and blo < ahi


def holds_its_values(t: torch.Tensor) -> bool:
    """False for lazily negated or conjugated views, whose memory holds the values before the
    negation/conjugation: a kernel reading ``data_ptr()`` would see the wrong numbers. While dynamo
    traces (where the question cannot be asked) True: the kernels' own wrappers ask again at run time."""
    if torch.compiler.is_compiling():
        return True
    return not (t.is_neg() or t.is_conj())
