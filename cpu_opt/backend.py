"""``torch.compile(model, backend="cpu_opt")``: dynamo hands us an FX graph of the model; we run
it through the same optimize pipeline (export of that graph, passes, oneDNN Graph lowering) on
the first call's inputs, and compile new shapes as they come."""
from __future__ import annotations


def wants_gradients(gm, args) -> bool:
    import torch

    if not torch.is_grad_enabled():
        return False
    return any(isinstance(a, torch.Tensor) and a.requires_grad for a in args) or \
        any(p.requires_grad for p in gm.parameters())


def cpu_opt_backend(gm, example_inputs, options: dict | None = None, mode: str | None = None, **kwargs):
    """Graphs with graph breaks arrive one by one (each optimized on its own); dynamo's dynamic sizes
    arrive as int inputs, which cpu_opt treats as constants of a capture. Inference only: a call that
    would need gradients raises instead of silently returning outputs without them.

    ``torch.compile(model, backend="cpu_opt", options={"dtype": "fp32"})`` passes ``optimize``'s
    keyword arguments (dtype, validate, autotune ...); torch.compile's ``mode`` has no meaning here."""
    if mode is not None:
        raise ValueError(f"the cpu_opt backend takes no torch.compile mode (got {mode!r}); pass optimize's "
                         "keyword arguments as options={...}")
    options = {**(options or {}), **kwargs}
    state = {}

    def run(*args):
        if wants_gradients(gm, args):
            raise RuntimeError(
                "the cpu_opt backend is for inference: its outputs carry no autograd graph, and this call "
                "would need gradients (grad mode is on and an input or parameter requires grad). Call the "
                "compiled model under torch.no_grad() or torch.inference_mode(), or compile with another "
                "backend for training")
        m = state.get("m")
        if m is None:
            from .compiler.pipeline import optimize

            m = state["m"] = optimize(gm, tuple(args), _dynamo_fallback=False, **options)
        return m(*args)

    run._cpu_opt_state = state
    with _lock:
        _graphs.append(state)
    return run


_graphs: list = []  # the state of every graph dynamo handed this backend, in order
import threading as _threading  # noqa: E402

_lock = _threading.Lock()


def reports() -> list[dict]:
    """The optimize report of every graph dynamo handed the backend so far (one per piece between
    graph breaks, per recompilation), in the order they arrived; a graph not yet called has none.
    ``torch._dynamo.explain(model)(*inputs)`` says where and why dynamo broke the graph."""
    with _lock:
        states = list(_graphs)
    return [dict(st["m"].report(), graph=i) for i, st in enumerate(states) if "m" in st]


def clear_reports() -> None:
    with _lock:
        _graphs.clear()
