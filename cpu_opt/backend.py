"""``torch.compile(model, backend="cpu_opt")``: dynamo hands us an FX graph of the model; we run
it through the same optimize pipeline (export of that graph, passes, oneDNN Graph lowering) on
the first call's inputs, and compile new shapes as they come."""
from __future__ import annotations


def cpu_opt_backend(gm, example_inputs, **options):
    state = {}

    def run(*args):
        m = state.get("m")
        if m is None:
            from .pipeline import optimize

            m = state["m"] = optimize(gm, tuple(args), **options)
        return m(*args)

    run._cpu_opt_state = state
    return run
