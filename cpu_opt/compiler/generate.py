"""``generate()`` on an optimized causal language model: Hugging Face's own generation loop, with
the model's forward replaced, for the duration of the call, by a dispatcher that optimizes each
distinct call structure once (the prompt's prefill, then the one-token decode step) and runs every
later call of that structure on its plan.

With a static KV cache (``cache_implementation="static"``, the default here) every decode step has
the same shapes, so a 32-token generation captures twice in all: prefill and decode. The cache's
in-place writes into its own tensors keep eager's semantics (they stay in torch: see
``lowering._inplace_hazard``), so the cache object HF passes in is the one that fills up.
"""
from __future__ import annotations

import threading

import torch
import torch.utils._pytree as pytree


class _OriginalForward(torch.nn.Module):
    """The model's own ``forward`` (its class's), whatever its instance attribute says: what the
    dispatcher captures while generate has the instance attribute pointing at the dispatcher."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.wrapped = model

    def forward(self, *args, **kwargs):
        return type(self.wrapped).forward(self.wrapped, *args, **kwargs)


class StructureDispatch:
    """Calls of one model, optimized per input structure (pytree spec and constants) on first sight."""

    def __init__(self, model: torch.nn.Module, options: dict):
        self.model = model
        self.options = dict(options)
        self._plans: list = []  # (spec, OptimizedModule)
        self._lock = threading.Lock()
        self.calls = 0

    def _for(self, args, kwargs):
        from .pipeline import optimize

        _, spec = pytree.tree_flatten((args, kwargs))
        for s, opt in self._plans:
            if s == spec:
                return opt
        with self._lock:
            for s, opt in self._plans:
                if s == spec:
                    return opt
            example = kwargs if not args else (args if not kwargs else None)
            if example is None:
                raise TypeError("generate's forward calls mix positional and keyword inputs; cpu_opt needs one or the other")
            opt = optimize(_OriginalForward(self.model), example, **self.options)
            self._plans.append((spec, opt))
            return opt

    def __call__(self, *args, **kwargs):
        self.calls += 1
        opt = self._for(args, kwargs)
        return opt(**kwargs) if kwargs else opt(*args)

    def reports(self) -> list[dict]:
        return [opt.report() for _, opt in self._plans]


def bf16_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` with its floating parameters and buffers in bf16 (``model.to(torch.bfloat16)``
    without touching ``model`` and without a float32 copy first): what a bf16 ``generate`` runs, so the
    KV cache Hugging Face allocates for it, and the cache tensors its forward creates, are bf16 like
    the plan's activations (a float32 cache cannot take the bf16 keys and values written into it)."""
    import copy

    memo = {}
    for p in model.parameters():
        if p.is_floating_point() and id(p) not in memo:
            memo[id(p)] = torch.nn.Parameter(p.detach().to(torch.bfloat16), requires_grad=False)
    for b in model.buffers():
        if b.is_floating_point() and id(b) not in memo:
            memo[id(b)] = b.detach().to(torch.bfloat16)
    m = copy.deepcopy(model, memo)
    if hasattr(m, "config") and hasattr(m.config, "dtype"):
        m.config.dtype = torch.bfloat16
    return m


def generate(model: torch.nn.Module, *args, dispatch: StructureDispatch | None = None, **kwargs):
    """``model.generate(*args, **kwargs)`` with its forward calls optimized (see the module docstring).
    ``dispatch`` keeps the plans between calls (``OptimizedModule.generate`` passes its own)."""
    if not callable(getattr(model, "generate", None)):
        raise TypeError(f"{type(model).__name__} has no generate(): cpu_opt's generate runs a Hugging Face "
                        "generation loop (a transformers GenerationMixin model)")
    kwargs.setdefault("cache_implementation", "static")
    dispatch = dispatch or StructureDispatch(model, {"dtype": "fp32"})
    if "forward" in model.__dict__:
        raise RuntimeError("the model's forward is already replaced (a generate() in another thread?)")
    model.forward = dispatch
    try:
        with torch.no_grad():
            return model.generate(*args, **kwargs)
    finally:
        del model.forward
