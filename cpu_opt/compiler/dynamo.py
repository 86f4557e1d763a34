"""Capture through dynamo, for models neither ``torch.export`` nor FX symbolic tracing takes
(data-dependent control flow, Python side effects, calls into numpy ...).

``torch.compile`` with the cpu_opt backend splits such a model at each graph break: every piece
dynamo can trace arrives as an FX graph and is optimized on its own (``optimize`` of that graph:
passes, oneDNN Graph partitions, validation against eager), the code between pieces runs in Python
as it always did. So a model with an untraceable part still gets its traceable parts optimized,
and :meth:`DynamoModule.report` says which capture was used, where the graph broke and why.

Inference only, like the rest of ``optimize``: calls run under ``torch.no_grad()`` and in eval mode.
"""
from __future__ import annotations

import threading
import time

import torch

from ..platform import routing


def _where(reason) -> str | None:
    """``file:line in function`` of the user code a graph ended at (the last frame of the stack)."""
    stack = getattr(reason, "user_stack", None) or []
    if not stack:
        return None
    f = stack[-1]
    return f"{f.filename}:{f.lineno} in {f.name}"


def _why(text: str) -> str:
    """dynamo's break reason, first line, with its internal names said plainly."""
    first = str(text).strip().splitlines()[0] if str(text).strip() else "?"
    if first.startswith("generic_jump"):
        return "data-dependent control flow (a Python branch on a tensor's value)"
    if first.startswith("Failed to trace builtin operator"):
        return str(text).split("Explanation:", 1)[-1].strip().splitlines()[0] if "Explanation:" in str(text) else first
    return first


def make_backend(sink: list, lock: threading.Lock, **options):
    """A dynamo backend that optimizes each graph it is handed with ``options`` (on its first call's
    inputs) and records the graph's state in ``sink``: the optimized module, or the error that made
    it run as dynamo traced it, and why dynamo ended the graph where it did."""
    from ..backend import wants_gradients

    def backend(gm, example_inputs):
        reason = getattr(gm, "compile_subgraph_reason", None)
        state = {"break": None if reason is None or not reason.graph_break else
                 {"reason": _why(reason.reason), "where": _where(reason)},
                 "ops": sum(1 for n in gm.graph.nodes if n.op == "call_function")}

        def run(*args):
            if wants_gradients(gm, args):
                raise RuntimeError("cpu_opt's optimized graphs are for inference: call the model under "
                                   "torch.no_grad() (this call would need gradients)")
            if "m" not in state and "error" not in state:
                from .pipeline import optimize

                try:
                    state["m"] = optimize(gm, tuple(args), _dynamo_fallback=False, **options)
                except Exception as e:  # noqa: BLE001 - this piece runs as dynamo traced it; reported
                    state["error"] = f"{type(e).__name__}: {e}"
            m = state.get("m")
            return m(*args) if m is not None else gm(*args)

        with lock:
            sink.append(state)
        return run

    return backend


class DynamoModule(torch.nn.Module):
    """What ``optimize`` returns for a model only dynamo can capture: the model under
    ``torch.compile(backend=<cpu_opt>)``. Same inputs, same outputs; ``report()`` has the keys of
    :meth:`OptimizedModule.report` (summed over the pieces) plus ``graph_breaks`` and ``graphs``."""

    def __init__(self, model: torch.nn.Module, example_inputs, *, dtype: str, capture_error: Exception,
                 validate: bool = True, max_shapes: int | None = None):
        super().__init__()
        self.model = model
        self.dtype = dtype
        self._capture_error = f"{capture_error}"
        self._graphs: list = []
        self._lock = threading.Lock()
        options = {"dtype": dtype, "validate": validate}
        if max_shapes is not None:
            options["max_shapes"] = max_shapes
        self._options = options
        self._gen_forward = None    # generate(): the model's forward under the same backend, made on first use
        self._gen_lock = threading.Lock()
        # not a submodule: the compiled wrapper holds ``model`` itself, which is registered once above
        object.__setattr__(self, "_compiled", torch.compile(model, backend=make_backend(self._graphs, self._lock,
                                                                                        **options)))
        self._validation = None
        self._use_eager = None  # the reason the whole model runs eagerly, when validation failed
        t0 = time.perf_counter()
        args, kwargs = (example_inputs, {}) if isinstance(example_inputs, tuple) else \
            ((), example_inputs) if isinstance(example_inputs, dict) else ((example_inputs,), {})
        if validate:
            from .pipeline import _compare
            from .plan import copies

            with torch.no_grad():
                ref = self._run_eager(*copies((args, kwargs)))
                out = self(*copies(args), **copies(kwargs))
            res = _compare(out, ref, "fp32" if dtype == "int8" else dtype)
            self._validation = {"example": {k: v for k, v in res.items()}}
            if not res["ok"]:
                self._use_eager = (f"the dynamo-captured model disagrees with eager on the example inputs ({res}); "
                                   "it runs in eager PyTorch")
        else:
            with torch.no_grad():
                self(*args, **kwargs)  # optimize the pieces now, not on the user's first call
        self._seconds = time.perf_counter() - t0

    def _run_eager(self, args, kwargs):
        was = self.model.training
        self.model.eval()
        try:
            return self.model(*args, **kwargs)
        finally:
            self.model.train(was)

    def forward(self, *args, **kwargs):
        if self._use_eager:
            with torch.no_grad():
                return self._run_eager(args, kwargs)
        was = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                return self._compiled(*args, **kwargs)
        finally:
            self.model.train(was)

    def generate(self, *args, **kwargs):
        """The model's own ``generate`` (Hugging Face ``GenerationMixin``) with every forward call it
        makes going through the dynamo-captured, optimized pieces: for the duration of the call the
        model's ``forward`` is a ``torch.compile`` of it with cpu_opt's backend (made on first use,
        its pieces validated against eager as ``optimize``'s are, and listed in :meth:`report`).
        Under ``torch.no_grad()`` and in eval mode; one generate at a time per module."""
        gen = getattr(self.model, "generate", None)
        if not callable(gen):
            raise AttributeError(f"{type(self.model).__name__} has no generate(); call the module itself")
        model = self.model
        with self._gen_lock:
            if self._use_eager:
                fwd = None
            elif self._gen_forward is None:
                fwd = self._gen_forward = torch.compile(model.forward, backend=make_backend(self._graphs, self._lock,
                                                                                            **self._options))
            else:
                fwd = self._gen_forward
            was = model.training
            model.eval()
            if fwd is not None:
                model.forward = fwd          # an instance attribute: found before the class's forward
            try:
                with torch.no_grad():
                    return gen(*args, **kwargs)
            finally:
                if fwd is not None:
                    del model.forward        # the class's forward again
                model.train(was)

    def report(self) -> dict:
        with self._lock:
            states = list(self._graphs)
        graphs, parts, fallbacks, routed, attention, breaks, chains = [], [], [], [], [], [], []
        views = plans = 0
        for i, st in enumerate(states):
            r = st["m"].report() if "m" in st else None
            graphs.append({"graph": i, "ops": st["ops"], "optimized": r is not None,
                           "num_partitions": r["num_partitions"] if r else 0, "error": st.get("error"),
                           "ended_by": st["break"]})
            if st["break"] is not None:
                breaks.append({"after_graph": i, **st["break"]})
            if r is None:
                if "error" in st:
                    fallbacks.append({"node": f"graph {i}", "op": "graph", "reason": st["error"]})
                continue
            parts += [dict(p, graph=i) for p in r["partitions"]]
            fallbacks += [dict(f, graph=i) for f in r["fallbacks"]]
            routed += [dict(x, graph=i) for x in r["routed"]]
            attention += [dict(a, graph=i) for a in r["attention"]]
            chains += [dict(c, graph=i) for c in r.get("primitive_chains", ())]
            views += r["views_in_torch"]
            plans += r.get("plans_compiled", 0)
        capture_notes = [f"torch.export and FX symbolic tracing could not capture the model ({self._capture_error}); "
                         f"captured through dynamo: {len(states)} graph(s), {len(breaks)} graph break(s)"]
        if self._use_eager:
            capture_notes.append(self._use_eager)
        return {
            "capability": "optimize",
            "dtype": self.dtype,
            "notes": capture_notes,
            "counts": {"graphs": len(states), "graph_breaks": len(breaks), "primitive_chains": len(chains),
                       "chained_primitives": sum(c["primitives"] for c in chains)},
            "primitive_chains": chains,
            "capture": "dynamo",
            "capture_notes": capture_notes,
            "passes": [],
            "num_partitions": 0 if self._use_eager else len(parts),
            "partitions": [] if self._use_eager else parts,
            "fallbacks": fallbacks,
            "routed": routed,
            "attention": attention,
            "views_in_torch": views,
            "shapes_compiled": len(states),
            "plans_compiled": plans,
            "shape_validation": [],
            "optimize_seconds": round(self._seconds, 3),
            "weight_refreshes": 0,
            "validation": self._validation,
            "autotune": None,
            "routes": {w: routing.route(w, self.dtype).backend for w in ("gemm", "linear", "conv", "attention")},
            "graph_breaks": breaks,
            "graphs": graphs,
            "buckets": {"disabled": self.bucket_note} if getattr(self, "bucket_note", None) else None,
        }

    def print_report(self) -> None:
        r = self.report()
        print(f"cpu_opt: captured with dynamo, {r['counts']['graphs']} graph(s), {len(r['graph_breaks'])} graph "
              f"break(s), {r['num_partitions']} oneDNN partition(s), dtype {r['dtype']}")
        for note in r["capture_notes"]:
            print(f"  - {note}")
        for b in r["graph_breaks"]:
            print(f"  graph {b['after_graph']} ends at {b['where']}: {b['reason']}")
        for g in r["graphs"]:
            if g["error"]:
                print(f"  graph {g['graph']} runs as traced ({g['error']})")

