"""``cpu_opt.optimize(model, example_inputs)``: capture, passes, oneDNN Graph lowering, runtime.

See shared DESIGN.md "How data flows through optimize". The returned :class:`OptimizedModule`
takes the same inputs as the model and returns the same structure; ``.report()`` says what was
fused, what fell back to torch and why, the route of each partition, and the dtype.
"""
from __future__ import annotations

import contextlib
import copy
import numbers
from collections import OrderedDict
import threading
import time
import warnings

import torch
import torch.fx
import torch.utils._pytree as pytree

from ..progress import Progress
from ..platform import hw, routing
from .capture import Captured, CaptureError, _is_constant, _register_library_pytrees, capture, flatten_inputs, tensor_leaves
from ..errors import CpuOptError
from .plan import KeptState, Plan, build_plan, copies

aten = torch.ops.aten
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _shapes(sig) -> list:
    return [a for a, _ in sig if not isinstance(a, type)]


def _partition_errors(plan: Plan, flat_in, dtype: str) -> list[dict]:
    """Which partitions of ``plan`` disagree with torch. The graph the plan was lowered from is run
    in torch (an FX interpreter recording every value); then each partition is fed torch's values of
    its inputs and its outputs compared with torch's values of the same nodes — so each is judged
    alone, not through the errors of the partitions before it."""
    low = plan.lowered
    if low is None or not plan.steps:
        return []
    ctx = low.ctx
    env: dict = {}

    class _Record(torch.fx.Interpreter):
        def run_node(self, n):
            v = super().run_node(n)
            env[n] = v
            return v

    with torch.no_grad(), KeptState(ctx.gm):
        _Record(ctx.gm).run(*copies(list(flat_in)))
    bad = []
    for step in plan.steps:
        p, nodes = low.partitions[step.index]
        keys = [ctx.key(lt.id) for lt in p.inputs]
        if any(k is not None and not isinstance(k, torch.fx.Node) for k in keys):
            continue  # fed by a value inside another partition (a decomposed op): not judged alone
        args = [env[k] for k in keys if k is not None]
        if not all(isinstance(a, torch.Tensor) for a in args):
            continue
        with torch.no_grad():
            outs = step(*[a.clone() for a in args])
        worst = 0.0
        for lt, o in zip(p.outputs, outs):
            k = ctx.key(lt.id)
            ref = env.get(k) if isinstance(k, torch.fx.Node) else None
            if not isinstance(ref, torch.Tensor) or not ref.is_floating_point():
                continue
            r = _compare(o, ref, dtype)
            worst = max(worst, r["max_rel_err"] if dtype == "fp32" else 1 - r["min_cosine"])
            if not r["ok"]:
                bad.append({"partition": step.index, "ops": step.op_kinds, "nodes": [n.name for n in nodes],
                            **{k2: v for k2, v in r.items() if k2 != "ok"}})
                break
    return bad


def _partition_route(op_kinds, dtype: str) -> dict:
    """The route of a partition's main work (convolution, matmul, else the fused ops around them):
    a partition always runs on cpu_opt's oneDNN; this says which rule (or measurement) sent it there."""
    work = "conv" if "Convolution" in op_kinds else "gemm" if "MatMul" in op_kinds else None
    if work is None:
        return {"route": "onednn", "why": "ops oneDNN Graph fused; no routed work (no convolution or matmul) in it"}
    r = routing.route(work, dtype)
    return {"route": r.backend, "why": f"{work} {dtype}: {r.why}", "route_source": r.source}


def _out_dtypes(cap: Captured, options: dict) -> list:
    """The dtypes of a capture's outputs: the recorded ones when the structure is the example's."""
    n = cap.out_spec.num_leaves
    have = options["out_dtypes"]
    if len(have) == n:
        return have
    outs = [n_ for n_ in cap.gm.graph.nodes if n_.op == "output"][0].args[0]
    return [a.meta["val"].dtype if isinstance(a, torch.fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)
            else None for a in outs]


def _resolve_dtype(dtype: str) -> str:
    if dtype == "auto":
        return routing.auto_dtype()
    if dtype == "int8":
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be 'auto', 'fp32', 'bf16' or 'int8', got {dtype!r}")
    return dtype


def _op_name(target) -> str:
    """``aten.add.Tensor`` for an ATen op, ``cpu_opt.backends.native_eltwise.gelu_`` for a function."""
    if hasattr(target, "_schema") or not hasattr(target, "__qualname__"):
        return str(target)
    return f"{target.__module__}.{target.__qualname__}"


def _signature(flat) -> tuple:
    return tuple((tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else (type(t), t) for t in flat)


@contextlib.contextmanager
def _eval_mode(model: torch.nn.Module):
    """``model`` in eval mode for the block, put back in train mode after it if it was."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        if was_training:
            model.train()


class OptimizedModule(torch.nn.Module):
    """What :func:`optimize` returns: call it like the original model."""

    def __init__(self, model, captured: Captured, plan: Plan, dtype: str, leaves, options: dict):
        super().__init__()
        self._model = [model]  # not a submodule: its parameters are not ours
        self._captured = captured
        self._base_sig = _signature(leaves)  # every input leaf: tensors by shape and dtype, constants by value
        self._plans: OrderedDict = OrderedDict({self._base_sig: plan})  # LRU; the example's plan stays
        self._base_plan = plan
        self._shape_checks: dict = {}  # signature -> validation of the plan made for a new shape
        self.dtype = dtype
        self._options = options
        self._validation = None
        self._autotune = None
        self._bucketing = None  # buckets.Bucketing when optimize was given buckets=
        self._plans_built = 1  # plans compiled over the module's life (evicted ones included)
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ weights changed in place
    def _watch_weights(self, reoptimize) -> None:
        """Remember the version of every parameter: the plans hold what optimize derived from them
        (BatchNorm folded into weights, transposed and prepacked copies, oneDNN's own constant cache
        of packed weights), so an in-place update — ``load_state_dict``, an optimizer step, ``mul_`` —
        would otherwise go unseen. A call that finds one changed optimizes the model again first.
        Updates through ``.data`` or numpy bump no version and are not seen."""
        params = list(self._model[0].parameters())
        self._weights = [(t, t._version) for t in params]
        self._reoptimize = reoptimize
        self._refreshes = getattr(self, "_refreshes", 0)

    def _weights_changed(self) -> bool:
        ws = getattr(self, "_weights", None)
        return bool(ws) and any(t._version != v for t, v in ws)

    def _refresh(self) -> None:
        with self._lock:
            if not self._weights_changed():
                return
            fresh = self._reoptimize()
            refreshes = self._refreshes + 1
            keep = {k: v for k, v in fresh.__dict__.items() if k not in ("_lock",)}
            self.__dict__.update(keep)
            self._refreshes = refreshes

    # ------------------------------------------------------------------ calling
    def _fast_path(self):
        """(positional tensor count, single-tensor output?) for the common call ``model(t1, ..., tn)``
        -> a tensor, computed once: that call skips the pytree round trip (about 40 us)."""
        fp = getattr(self, "_fast", None)
        if fp is None:
            n = self._captured.in_spec.num_leaves
            plain_in = self._captured.in_spec == pytree.tree_structure((tuple(range(n)), {})) \
                and not self._captured.constants
            fp = self._fast = (n if plain_in else -1, self._captured.out_spec == pytree.tree_structure(0))
        return fp

    def forward(self, *args, **kwargs):
        if self._weights_changed():
            self._refresh()
        b = self._bucketing
        if b is not None:
            if b.active:
                return self._bucketed(b, args, kwargs)
            b.count(unbucketed="disabled")  # off (report()["buckets"]["disabled"] says why): counted
        n_fast, leaf_out = self._fast_path()
        if not kwargs and len(args) == n_fast and all(type(a) is torch.Tensor for a in args):
            sig = tuple((tuple(a.shape), a.dtype) for a in args)
            plan = self._plans.get(sig)
            if plan is not None and plan.out_spec is None and len(self._plans) == 1:
                with torch.no_grad():
                    out = plan.program(*args)
                return out[0] if leaf_out else pytree.tree_unflatten(list(out), self._captured.out_spec)
        flat = self._flat_inputs(args, kwargs)
        out, plan = self._run(args, kwargs, flat, _signature(flat))
        return self._unflatten(out, plan)

    def _flat_inputs(self, args, kwargs) -> list:
        flat, spec = pytree.tree_flatten((args, kwargs))
        if spec != self._captured.in_spec:
            raise TypeError(f"inputs have structure {spec}, but the model was optimized for "
                            f"{self._captured.in_spec}; pass the same arguments as the example inputs")
        for i, t in enumerate(flat):
            if not isinstance(t, torch.Tensor) and not _is_constant(t):
                raise TypeError(f"input {i} is a {type(t).__name__}; expected a tensor or a plain constant "
                                "(bool, int, float, str, None)")
        return flat

    def _run(self, args, kwargs, flat, sig, on_build=None):
        """The flat outputs of the plan for ``sig`` (planned on first use), and the plan."""
        plan = self._plans.get(sig)
        if plan is None:
            plan = self._new_shape(args, kwargs, flat, sig, on_build)
        elif len(self._plans) > 1:
            with self._lock:
                if sig in self._plans:
                    self._plans.move_to_end(sig)
        with torch.no_grad():
            out = plan.program(*tensor_leaves(flat))
        return out, plan

    def _unflatten(self, out, plan):
        """The flat outputs of ``plan`` in the structure the caller gets."""
        return pytree.tree_unflatten(list(out), plan.out_spec or self._captured.out_spec)

    def _bucketed(self, b, args, kwargs):
        """A call with buckets on: pad to the bucket, run its plan, slice the outputs back; the first
        call of each bucket plan is compared with eager at the true length (a mismatch switches
        bucketing off for the model and answers this call unpadded)."""
        flat = self._flat_inputs(args, kwargs)
        sig = _signature(flat)

        def plain():
            out, plan = self._run(args, kwargs, flat, sig)
            return self._unflatten(out, plan)

        def unpadded(why):
            b.count(unbucketed=why)
            return plain()

        if any(isinstance(x, type) or len(x) != len(o) or d != od
               for (x, d), (o, od) in zip(sig, self._base_sig) if not isinstance(o, type)):
            return plain()  # another rank or dtype than the example's: _new_shape raises, naming the input
        length = b.length(flat)
        if length is None:
            return unpadded("lengths_differ")
        bucket = b.spec.bucket_for(length)
        if bucket is None:
            return unpadded("above_largest")
        if bucket != length and sig in self._plans:  # the example's shape: its plan is there already
            return unpadded("existing_plan")
        if bucket == length:  # nothing to pad: the bucket's own plan
            b.count(bucket)
            out, plan = self._run(args, kwargs, flat, sig, on_build=b.plan_built)
            return self._unflatten(out, plan)
        pflat = b.pad(flat, bucket)
        pargs, pkwargs = pytree.tree_unflatten(pflat, self._captured.in_spec)
        psig = _signature(pflat)
        out, plan = self._run(pargs, pkwargs, pflat, psig, on_build=b.plan_built)
        out = b.unpad(out, length, bucket)
        spec = plan.out_spec or self._captured.out_spec
        if out is None:
            b.disabled = (f"the bucket {bucket} plan's outputs do not have the padded length where the capture "
                          "says they do; each length gets a plan")
            return unpadded("disabled")
        result = pytree.tree_unflatten(out, spec)
        if psig not in b.validated and b.validate:
            with self._lock:  # one eager run per bucket plan, not one per thread that got there first
                res = b.validated.get(psig)
                if res is None:
                    res = b.validated[psig] = self._check_bucket(result, args, kwargs, length, bucket)
            if not res["ok"]:
                b.disabled = (f"padding changed the answer: length {length} padded to {bucket} disagreed with eager at "
                              f"length {length} ({res['why']}); the model does not mask the padded positions, so "
                              "bucketing is off and each length gets a plan of its own")
                return unpadded("disabled")
        b.count(bucket)
        return result

    def _check_bucket(self, result, args, kwargs, length: int, bucket: int) -> dict:
        """Bucketed (sliced) outputs against the model run eagerly at the true, unpadded shape."""
        model = self._model[0]
        with _eval_mode(model), KeptState(model), torch.no_grad():
            a, k = copies((args, kwargs))
            ref = model(*a, **k)
        res = {"bucket": bucket, "length": length,
               "shapes": [list(t.shape) for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]}
        got = pytree.tree_leaves(result)
        want = pytree.tree_leaves(ref)
        if len(got) != len(want):
            return dict(res, ok=False, why=f"{len(got)} output leaves, eager has {len(want)}")
        for i, (x, y) in enumerate(zip(got, want)):
            if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
                return dict(res, ok=False, why=f"output {i} is {type(x).__name__}, eager's {type(y).__name__}")
            if isinstance(x, torch.Tensor):
                if x.shape != y.shape:
                    return dict(res, ok=False, why=f"output {i} has shape {list(x.shape)}, eager's {list(y.shape)}")
                if not x.is_floating_point() and not torch.equal(x, y):
                    return dict(res, ok=False, why=f"output {i} ({x.dtype}) differs from eager's")
        # int8: the guard only; the bucket's own plan was held to min_cosine on its first call (_validated),
        # this asks whether padding changed the answer
        cmp = _compare(result, ref, self.dtype)
        res.update(cmp)
        if not cmp["ok"]:
            res["why"] = (f"max rel err {cmp.get('max_rel_err', float('nan')):.3g}, "
                          f"cosine {cmp.get('min_cosine', float('nan')):.6f}")
        return res

    def _new_shape(self, args, kwargs, flat, sig, on_build=None) -> Plan:
        old = self._base_sig
        for i, ((a, b), (oa, ob)) in enumerate(zip(sig, old)):
            if isinstance(a, type) or isinstance(oa, type):  # a constant here or there
                if isinstance(a, type) != isinstance(oa, type):
                    raise TypeError(f"input {i} is {'a ' + a.__name__ if isinstance(a, type) else 'a tensor'}; "
                                    f"the model was optimized with {'a ' + oa.__name__ if isinstance(oa, type) else 'a tensor'} there")
                continue
            shape, dt, oshape, odt = a, b, oa, ob
            if len(shape) != len(oshape):
                raise ValueError(f"input {i} has rank {len(shape)} (shape {shape}); the model was optimized for "
                                 f"rank {len(oshape)} (shape {oshape})")
            if dt != odt:
                raise TypeError(f"input {i} has dtype {dt}; the model was optimized for {odt}")
        with self._lock:
            if sig in self._plans:
                return self._plans[sig]
            model = self._model[0]
            # a model optimized in train mode is still planned (and compared) in eval mode; planning's
            # own runs leave the model's buffers as they were
            with _eval_mode(model), KeptState(model):
                plan = self._plan_for(model, args, kwargs, flat, sig)
                if self._options.get("validate", True):
                    plan = self._validated(model, plan, args, kwargs, flat, sig)
            plan.first_output = None
            self._plans[sig] = plan
            self._plans_built += 1
            if on_build is not None:
                on_build()
            limit = self._options.get("max_shapes") or 0
            while limit and len(self._plans) > limit:  # least recently used first; never the example's
                old_sig = next(s for s in self._plans if s != self._base_sig)
                del self._plans[old_sig]
                self._shape_checks.pop(old_sig, None)
            return plan

    def _plan_for(self, model, args, kwargs, flat, sig) -> Plan:
        tin = tensor_leaves(flat)
        if self._options.get("pristine") is not None:
            gm = copy.deepcopy(self._options["pristine"])
            try:
                return build_plan(gm, tin, self.dtype, self._options["out_dtypes"], False,
                                   Progress(False, 4, ""), use_onednn=self._options["use_onednn"],
                                   shapes_known=False, measure=self._options.get("autotune", False),
                                   exclude=self._options.get("exclude"), int8=self._options.get("int8"))
            except Exception as e:  # noqa: BLE001
                raise CpuOptError(f"new input shapes {_shapes(sig)}: re-planning the dynamic "
                                  f"graph failed: {e}") from e
        try:
            # example inputs are either positional or keyword (flatten_inputs), never both
            cap = capture(model, kwargs if kwargs else args)
        except CaptureError as e:
            raise CpuOptError(f"new input shapes {_shapes(sig)}: re-capture failed: {e}") from e
        plan = build_plan(cap.gm, tin, self.dtype, _out_dtypes(cap, self._options), False, Progress(False, 4, ""),
                           use_onednn=self._options["use_onednn"], measure=self._options.get("autotune", False),
                           exclude=self._options.get("exclude"), int8=self._options.get("int8"))
        plan.out_spec = cap.out_spec  # other constants can give another output structure
        return plan

    def _validated(self, model, plan: Plan, args, kwargs, flat, sig) -> Plan:
        """Compare a new shape's plan with eager on the call that asked for it (one eager run per new
        shape); on a mismatch that shape runs in torch, and the report says so."""
        int8 = self._options.get("int8")
        if plan.first_output is None or not (plan.steps or int8):  # int8 kernels run outside partitions too
            return plan
        with torch.no_grad():
            a, k = copies((args, kwargs))
            ref = model(*a, **k)
        res = _compare(pytree.tree_unflatten(list(plan.first_output), plan.out_spec or self._captured.out_spec),
                       ref, self.dtype, _min_cosine(self._options))
        if not res["ok"]:
            cap = capture(model, kwargs if kwargs else args, eager_output=ref)
            plan = build_plan(cap.gm, tensor_leaves(flat), "fp32" if int8 else self.dtype,
                               _out_dtypes(cap, self._options), False, Progress(False, 4, ""), use_onednn=False)
            plan.out_spec = cap.out_spec
            res["fell_back"] = ("int8 outputs below the cosine bar at this shape; it runs in fp32, in torch" if int8
                                else "outputs differed from eager at this shape; it runs in torch")
        self._shape_checks[sig] = res
        return plan

    # ------------------------------------------------------------------ generation
    def generate(self, *args, **kwargs):
        """For a Hugging Face causal LM: its ``generate()`` with every forward call optimized (one
        plan per call structure: prefill, decode; a static KV cache by default, so the decode shapes
        never change). Same tokens as eager's ``generate`` with the same arguments; in bf16, those of
        the model cast to bf16 (``model.to(torch.bfloat16)``), which is what generates here: HF's KV
        cache then holds bf16 like every other tensor of the plans."""
        from .generate import StructureDispatch, bf16_copy, generate

        with self._lock:
            d = getattr(self, "_generation", None)
            if d is None:
                self._generation_model = bf16_copy(self._model[0]) if self.dtype == "bf16" else self._model[0]
                opts = {"dtype": self.dtype, "validate": self._options.get("validate", True),
                        "max_shapes": self._options.get("max_shapes", MAX_SHAPES)}
                if self.dtype == "int8":  # every call structure reuses this model's calibration
                    opts["_int8_state"] = self._options["int8"][1]
                d = self._generation = StructureDispatch(self._generation_model, opts)
        return generate(self._generation_model, *args, dispatch=d, **kwargs)

    # ------------------------------------------------------------------ reporting
    def report(self) -> dict:
        plan = self._base_plan
        low = plan.lowered
        parts, fallbacks, attention, views, routed = [], [], [], 0, []
        if low is not None:
            for step in plan.steps:
                p, nodes = low.partitions[step.index]
                parts.append({"id": step.index, "ops": step.op_kinds,
                              "aten": [str(n.target) for n in nodes], **_partition_route(step.op_kinds, self.dtype),
                              "impl": "oneDNN Graph compiled partition (cpu_opt's oneDNN binding)"})
            for n, why in low.fallbacks.items():
                fallbacks.append({"node": n.name, "op": str(n.target), "reason": why})
            attention = [{"node": n.name, "route": r.backend, "why": r.why} for n, r in low.attention]
            views = len(low.views)
            routed = [{"node": n.name, "op": _op_name(n.target), "route": b, "why": why} for n, (b, why) in low.routed]
        chains = _chains_report(plan.program)
        return {
            "capability": "optimize",
            "dtype": self.dtype,
            "notes": list(self._captured.notes) + list(plan.log),
            "counts": {"primitive_chains": len(chains), "chained_primitives": sum(c["primitives"] for c in chains)},
            "primitive_chains": chains,
            "capture": self._captured.method,
            "capture_notes": list(self._captured.notes),
            "passes": list(plan.log),
            "num_partitions": len(parts),
            "partitions": parts,
            "fallbacks": fallbacks,
            "routed": routed,
            "attention": attention,
            "views_in_torch": views,
            "shapes_compiled": len(self._plans),
            "plans_compiled": self._plans_built,
            "buckets": self._bucketing.report() if self._bucketing is not None else None,
            "shape_validation": [{"shapes": [list(a) for a, _ in sig if not isinstance(a, type)],
                                  "constants": [v for a, v in sig if isinstance(a, type)], **res}
                                 for sig, res in self._shape_checks.items()],
            "optimize_seconds": round(plan.seconds, 3),
            "weight_refreshes": getattr(self, "_refreshes", 0),
            "validation": self._validation,
            "autotune": self._autotune,
            "routes": {w: routing.route(w, self.dtype if self.dtype != "int8" or w != "attention" else "fp32").backend
                       for w in ("gemm", "linear", "conv", "attention")},
            **(self._int8_report() if self.dtype == "int8" else {}),
        }

    def _int8_report(self) -> dict:
        st = self._options["int8"][1]
        return {"int8": list(st.layers_report),
                "int8_fp32_layers": [{"node": n, "why": w} for n, w in st.skipped]}

    def print_report(self) -> None:
        r = self.report()
        print(f"cpu_opt: {r['num_partitions']} oneDNN partition(s), dtype {r['dtype']}, captured with {r['capture']}, "
              f"optimized in {r['optimize_seconds']} s")
        for note in r["capture_notes"] + r["passes"]:
            print(f"  - {note}")
        for p in r["partitions"]:
            print(f"  partition {p['id']}: {' + '.join(p['ops'])}")
        for a in r["attention"]:
            print(f"  attention {a['node']}: {a['route']}")
        by_route: dict = {}
        for x in r["routed"]:
            by_route.setdefault(x["route"], []).append(x["node"])
        for b, names in by_route.items():
            print(f"  {len(names)} op(s) routed to {b}: {', '.join(names[:6])}{' ...' if len(names) > 6 else ''}")
        if r["fallbacks"]:
            print(f"  {len(r['fallbacks'])} op(s) ran in torch:")
            for f in r["fallbacks"]:
                print(f"    {f['node']} ({f['op']}): {f['reason']}")
        if r["validation"]:
            print(f"  validation against eager: {r['validation']}")
        bk = r["buckets"]
        if bk is not None:
            print(f"  buckets {bk['sizes']} along dim {bk['dim']}: " + (f"off ({bk['disabled']})" if bk["disabled"] else
                  f"padding {', '.join(p['input'] for p in bk['padded_inputs'])}; calls per bucket "
                  f"{bk['calls_per_bucket']}, {bk['plans_compiled']} bucket plan(s)"))


def _narrow_int8(model, example_inputs, ref, flat_in, out_dtypes, leaves, options, state, res):
    """int8 outputs too far from fp32 (below ``min_cosine``, else ``INT8_MIN_COSINE``): keep in fp32 the layers whose own
    int8 error is largest (:func:`cpu_opt.quant.graph.layer_sensitivity` on the example), 1, 2, 4 ...
    of them, worst first, until the model passes; ``(module, result)``, or ``None`` when even all but
    one layer in fp32 does not pass (the caller then runs the whole model in fp32)."""
    from ..quant.graph import layer_sensitivity
    from .passes import run_passes

    st = options["int8"][1]
    before = dict(st.fp32_keys), list(st.layers_report)  # shared with other plans (generate's structures)
    cap = capture(model, example_inputs, eager_output=ref)
    state.restore()
    run_passes(cap.gm)  # the fp32 graph quantize_graph sees (BatchNorm folded)
    sens = layer_sensitivity(cap.gm, options["int8"][0], st, flat_in)
    state.restore()
    k = 1
    while k < len(sens):
        st.fp32_keys = {r["key"]: (f"{r['layer']}: kept in fp32 by validation (its own int8 error, "
                                   f"{r['sqnr_db']:.1f} dB SQNR on the example, is among the {k} largest; all in "
                                   f"int8 the outputs' cosine to fp32 was {res['min_cosine']:.3f})") for r in sens[:k]}
        st.layers_report = []
        cap2 = capture(model, example_inputs, eager_output=ref)
        state.restore()
        plan2 = build_plan(cap2.gm, flat_in, "int8", out_dtypes, False, Progress(False, 4, ""),
                           exclude=options.get("exclude"), int8=options["int8"])
        state.restore()
        res2 = _compare(pytree.tree_unflatten(list(plan2.first_output), cap2.out_spec), ref, "int8", st.min_cosine)
        if res2["ok"]:
            kept = [{"layer": r["layer"], "node": r["node"], "sqnr_db": r["sqnr_db"]} for r in sens[:k]]
            return (OptimizedModule(model, cap2, plan2, "int8", leaves, options),
                    dict(res2, int8_layers_in_fp32=kept, first_try=res))
        k *= 2
    st.fp32_keys, st.layers_report = before
    return None


def _compare(out, ref, dtype: str, min_cosine: float | None = None) -> dict:
    """Floating outputs against the reference: fp32 within 1e-3 relative, bf16 cosine 0.99, int8
    cosine ``min_cosine`` (None: :data:`INT8_MIN_COSINE`)."""
    a = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    b = [t for t in pytree.tree_leaves(ref) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if len(a) != len(b) or not a:
        return {"ok": len(a) == len(b), "outputs": len(a)}
    def exact(t):  # float64 for ordinary outputs; large ones (an LM head's logits at batch 16 are
        # 100M values) compare in float32, which is plenty for these thresholds and takes no copy
        return t.double() if t.numel() <= (1 << 22) else t.float()

    rel = max(((exact(x) - exact(y)).abs().max() / exact(y).abs().max().clamp_min(1e-12)).item()
              for x, y in zip(a, b))
    cos = min(torch.nn.functional.cosine_similarity(exact(x).flatten(), exact(y).flatten(), dim=0).item()
              for x, y in zip(a, b))
    # int8: the quantization error is the user's choice (reported as SQNR); this guards the kernels
    ok = rel <= 1e-3 if dtype == "fp32" else cos >= (_int8_bar(min_cosine) if dtype == "int8" else 0.99)
    res = {"ok": ok, "max_rel_err": rel, "min_cosine": cos}
    if dtype == "int8":
        res["min_sqnr_db"] = min(_sqnr(x, y) for x, y in zip(a, b))
    return res


INT8_MIN_COSINE = 0.97  # below it, an int8 plan is treated as broken (narrowed, then run in torch)


def _int8_bar(min_cosine: float | None) -> float:
    """The cosine an int8 plan's outputs must reach: the user's ``min_cosine`` (optimize refuses one
    below the guard), else the guard."""
    return INT8_MIN_COSINE if min_cosine is None else min_cosine


def _min_cosine(options) -> float | None:
    int8 = options.get("int8")
    return int8[1].min_cosine if int8 else None


def _sqnr(x, y) -> float:
    """Signal-to-quantization-noise ratio of ``x`` against the reference ``y``, in dB."""
    import math

    noise = (x.double() - y.double()).pow(2).sum().item()
    sig = y.double().pow(2).sum().item()
    return float("inf") if noise == 0 else 10 * math.log10(max(sig, 1e-300) / noise)


def _dynamic_shapes(example_inputs, dynamic):
    """``dynamic=True``: every dimension of every input tensor is dynamic (torch.export's AUTO)."""
    if not dynamic:
        return None
    if dynamic is not True:
        return dynamic  # the user's own torch.export dynamic_shapes spec
    auto = torch.export.Dim.AUTO

    def spec(t):
        return {i: auto for i in range(t.dim())} if isinstance(t, torch.Tensor) else None

    args, kwargs = flatten_inputs(example_inputs)
    if kwargs:
        return {k: spec(v) for k, v in kwargs.items()}
    return tuple(spec(a) for a in args)


def _median_seconds(fn, repeats: int = 5) -> float:
    ts = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return sorted(ts[1:])[len(ts[1:]) // 2]


def _autotune(model, example_inputs, opt, flat_in, dt, out_dtypes, options, ref=None) -> OptimizedModule:
    """Measure the oneDNN plan against the same captured graph run entirely in torch, on the
    example inputs, and keep the faster one (the report says which, with both times). With ``ref``
    (validation on), the torch plan is held to the same bar first: it is another plan (int8: its
    layers' kernels measured again), so it is chosen only if its own outputs pass."""
    cap2 = capture(model, example_inputs)
    opts2 = dict(options, use_onednn=False)
    plan2 = build_plan(cap2.gm, flat_in, dt, out_dtypes, False, Progress(False, 4, ""), use_onednn=False,
                        int8=options.get("int8"))
    if ref is not None:
        res = _compare(pytree.tree_unflatten(list(plan2.first_output), cap2.out_spec), ref, dt, _min_cosine(options))
        if not res["ok"]:
            opt._autotune = {"chosen": "onednn", "torch_plan_rejected": res}
            return opt
    alt = OptimizedModule(model, cap2, plan2, dt, pytree.tree_leaves(flatten_inputs(example_inputs)), opts2)
    args, kwargs = flatten_inputs(example_inputs)
    t_onednn = _median_seconds(lambda: opt(*args, **kwargs))
    t_torch = _median_seconds(lambda: alt(*args, **kwargs))
    chosen = opt if t_onednn <= t_torch else alt
    chosen._validation = opt._validation if chosen is opt or ref is None else \
        dict(opt._validation, **{k: v for k, v in res.items() if k != "ok"}, chose_torch_plan=True)
    chosen._autotune = {"onednn_ms": round(t_onednn * 1e3, 3), "torch_ms": round(t_torch * 1e3, 3),
                        "chosen": "onednn" if chosen is opt else "torch"}
    return chosen


MAX_SHAPES = 32  # plans kept per optimized model (LRU; the example's plan is never evicted)


def optimize(model: torch.nn.Module, example_inputs, *, dtype: str = "auto", dynamic=None, buckets=None,
             autotune: bool = False, verbose: bool = False, validate: bool = True, max_shapes: int = MAX_SHAPES,
             calibration_data=None, qconfig_mapping=None, min_cosine: float | None = None, _int8_state=None,
             _dynamo_fallback: bool = True) -> OptimizedModule:
    """Optimize ``model`` for this CPU.

    ``example_inputs``: a tensor, a tuple of positional inputs, or a dict of keyword inputs.
    ``dtype``: ``"auto"`` (bf16 where the CPU has native bf16 math, else fp32), ``"fp32"``,
    ``"bf16"``. ``dynamic``: ``True`` captures once with every input dimension dynamic (give
    example sizes > 1: torch.export specializes sizes 0 and 1), so a
    new shape only re-plans (no new ``torch.export``); otherwise a new shape is re-captured on
    its first call. Either way each new shape compiles its partitions once (cached after).
    ``autotune``: ``False`` takes routes from the routing table; ``True`` also times the oneDNN
    plan against the same graph run in torch on the example inputs and keeps the faster.
    ``verbose``: print progress and the report. ``validate``: compare
    with eager on the example inputs and fall back to torch for the whole graph if the result
    differs (fp32: 1e-3 relative; bf16: cosine 0.99) — never silently wrong; each new shape is
    compared once too, on its first call. ``max_shapes``: how many input shapes keep a compiled
    plan (least recently used evicted first, the example's kept; 0 = no bound).

    ``buckets``: for serving many lengths with ``dynamic=True`` (which it implies when ``dynamic``
    is not given; ``dynamic=False`` with buckets raises): a :class:`cpu_opt.Buckets` (``sizes``,
    ``dim=1``, ``pad_values={input name: value}``, default 0) or just a sequence of sizes. The
    inputs whose size along ``dim`` is the same symbolic dimension of the capture are right-padded
    to the smallest bucket size at least that long, the bucket's plan runs, and each output
    dimension whose symbolic size is that dimension is sliced back to the true length (outputs
    keep their types) — one plan per bucket instead of one per length. Lengths above the largest
    bucket run unpadded, each on its own plan (bounded by ``max_shapes``). Padding is right only
    where the model masks the padded positions, so the first call of each bucket plan is also run
    eagerly at the true shape and compared (the tolerances above); a mismatch switches bucketing
    off for the model (each length gets its own plan again), and that call too is answered
    unpadded. ``report()["buckets"]``: calls per bucket, plans compiled, the validations, and why
    bucketing is off when it is. A spec that cannot fit the model (an unknown input name, an
    input without ``dim``, a size outside the range torch.export allows) raises ``ValueError``.

    ``dtype="int8"``: post-training static int8 in one call. ``calibration_data`` (an iterable of
    inputs shaped like ``example_inputs``: tensors, tuples or dicts) is run through the captured
    graph with observers on the input and output of each Linear/Conv2d layer that
    ``qconfig_mapping`` selects (default: ``cpu_opt.quant.default_qconfig_mapping()``); each becomes
    an int8 kernel on the family routing picks (FBGEMM, torch's oneDNN, cpu_opt's oneDNN), with the
    following ReLU/GELU/SiLU fused and consecutive int8 layers chained in uint8; the rest of the
    graph is optimized as in fp32. ``.report()["int8"]`` lists each layer's kernel and why;
    validation reports the cosine and SQNR against the fp32 model. ``min_cosine`` (default: None, only
    the guard against broken kernels, cosine ``INT8_MIN_COSINE`` = 0.97; a bar from 0.97 to 1, with
    ``validate=True``) is the accuracy to hold the int8 model to, as the outputs' cosine to fp32 on the
    example inputs (and on each new shape's first call; a shape that misses it runs in fp32): below
    it, the layers whose own int8 error is largest stay in fp32 (1, 2, 4 ... of them, worst first)
    until it holds, reported in ``report()["validation"]["int8_layers_in_fp32"]``; if only
    all-but-one in fp32 would do, the whole model runs as cpu_opt's fp32 plan (NNCF's accuracy
    control, in one call).

    A model neither ``torch.export`` nor FX symbolic tracing takes (data-dependent control flow,
    Python side effects) is captured through dynamo instead: a :class:`~cpu_opt.compiler.dynamo.DynamoModule`
    whose traceable pieces are each optimized, the rest run in Python; its report says where the
    graph broke and why (``dtype="int8"`` needs one captured graph and raises ``CaptureError``).
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(max_shapes, int) or isinstance(max_shapes, bool) or max_shapes < 0:
        raise ValueError(f"max_shapes must be an int >= 0, got {max_shapes!r}")
    dt = _resolve_dtype(dtype)
    dynamic_given = dynamic
    bucket_spec, implied = None, False
    if buckets is not None:
        from .buckets import Buckets

        bucket_spec = Buckets.coerce(buckets)
        if dynamic is None:
            dynamic, implied = True, True
        elif not dynamic:
            raise ValueError(f"buckets need a dynamic capture: pass dynamic=True (or leave dynamic unset, buckets "
                             f"imply it), got dynamic={dynamic!r}")
    info = hw.detect()
    if dt == "int8" and info.arch == "aarch64":
        raise NotImplementedError("dtype='int8' runs on x86-64 only for now (FBGEMM / oneDNN int8 kernels); on "
                                  "aarch64 use dtype='bf16' or 'auto'")
    given = [n for n, v in (("calibration_data", calibration_data), ("qconfig_mapping", qconfig_mapping),
                            ("min_cosine", min_cosine)) if v is not None]
    if dt != "int8" and given:
        raise ValueError(f"{', '.join(given)}: for dtype='int8' only (calibration_data, qconfig_mapping and "
                         f"min_cosine are for dtype='int8'; got dtype={dtype!r})")
    if min_cosine is not None:
        if isinstance(min_cosine, bool) or not isinstance(min_cosine, numbers.Real) \
                or not INT8_MIN_COSINE <= float(min_cosine) <= 1.0:
            raise ValueError(f"min_cosine must be a number from {INT8_MIN_COSINE} to 1 (below {INT8_MIN_COSINE} an int8 "
                             f"plan is taken for broken kernels, not quantization noise), got {min_cosine!r}")
        if not validate:
            raise ValueError("min_cosine needs validate=True: it is checked by comparing the int8 outputs with fp32")
        min_cosine = float(min_cosine)
    if info.arch == "aarch64" and bucket_spec is not None:
        raise NotImplementedError("buckets= runs on x86-64 only for now (the aarch64 path plans each shape)")
    if info.arch == "aarch64":
        # aarch64: ACL through torch's own oneDNN; cpu_opt's binding and native kernels are not
        # used there (no oneDNN wheel for aarch64).
        from ..graviton import optimize_for_arm

        arm = optimize_for_arm(model, example_inputs, dtype={"auto": "auto", "fp32": "float32",
                                                             "bf16": "bfloat16"}[dtype])
        if verbose:
            print(arm.report_text())
        return arm
    args, kwargs = flatten_inputs(example_inputs)
    _register_library_pytrees(model)  # model libraries' input objects (HF caches) flatten to tensors
    odd = [type(t).__name__ for t in pytree.tree_leaves((args, kwargs))
           if not isinstance(t, torch.Tensor) and not _is_constant(t)]
    if odd:
        raise TypeError(f"example inputs must be tensors or plain constants (bool, int, float, str, None) in "
                        f"tuples/lists/dicts; got {odd}")
    chosen = None
    if bucket_spec is not None:
        from .buckets import check_spec

        chosen = check_spec(bucket_spec, model, args, kwargs)  # bad names / dims raise before any work
    int8 = None
    if dt == "int8":
        int8 = (model, _int8_state or _int8_setup(args, kwargs, calibration_data, qconfig_mapping, autotune,
                                                  min_cosine))
    progress = Progress(verbose, 5, f"cpu_opt.optimize({type(model).__name__})")
    t0 = time.perf_counter()
    with _eval_mode(model):
        try:
            with KeptState(model) as state:
                opt = _optimize(model, example_inputs, args, kwargs, dt, dynamic, autotune, verbose, validate,
                                max_shapes, progress, state, int8)
        except CaptureError as e:
            if not _dynamo_fallback or dt == "int8":  # int8 calibrates one captured graph; a dynamo piece is its own
                raise
            progress.done()
            from .dynamo import DynamoModule

            opt = DynamoModule(model, example_inputs, dtype=dt, capture_error=e, validate=validate,
                               max_shapes=max_shapes)
            if bucket_spec is not None:
                opt.bucket_note = ("buckets are not used: the model is captured through dynamo (graph breaks), whose "
                                   "pieces each plan their own shapes")
            if verbose:
                opt.print_report()
            return opt
    progress.done()
    if bucket_spec is not None:
        from .buckets import Bucketing

        opt._bucketing = Bucketing(bucket_spec, implied, validate).setup(
            model, args, kwargs, opt._captured, chosen, dynamic_capture=opt._options.get("pristine") is not None)
    opt._base_plan.seconds = time.perf_counter() - t0
    for p in opt._plans.values():
        p.first_output = None  # do not keep the example's outputs alive
    opt._watch_weights(lambda: optimize(model, copies(example_inputs), dtype=dtype, dynamic=dynamic_given,
                                        buckets=buckets, autotune=autotune, verbose=False, validate=validate,
                                        max_shapes=max_shapes, _int8_state=int8[1] if int8 else None))
    if verbose:
        opt.print_report()
    return opt


def _int8_setup(args, kwargs, calibration_data, qconfig_mapping, autotune=False, min_cosine=None):
    """The int8 state for optimize: the mapping, and each calibration item flattened like the
    example inputs (same structure and constants; only tensors may differ)."""
    from ..quant.graph import Int8State
    from ..quant.qconfig import QConfigMapping, default_qconfig_mapping

    if calibration_data is None:
        raise ValueError("dtype='int8' needs calibration_data: an iterable of inputs like example_inputs (a few "
                         "dozen representative batches; the example inputs alone give a poor range)")
    mapping = qconfig_mapping if qconfig_mapping is not None else default_qconfig_mapping()
    if not isinstance(mapping, QConfigMapping):
        raise TypeError(f"qconfig_mapping must be a cpu_opt.quant.QConfigMapping, got {type(mapping).__name__}")
    leaves, spec = pytree.tree_flatten((args, kwargs))
    flats = []
    for i, item in enumerate(calibration_data):
        a, k = flatten_inputs(item)
        il, ispec = pytree.tree_flatten((a, k))
        if ispec != spec:
            raise ValueError(f"calibration item {i} is structured differently from example_inputs ({ispec} vs {spec})")
        for j, (x, e) in enumerate(zip(il, leaves)):
            if isinstance(e, torch.Tensor) != isinstance(x, torch.Tensor) or \
                    (not isinstance(e, torch.Tensor) and x != e):
                raise ValueError(f"calibration item {i}, input leaf {j}: {x!r} where example_inputs has {e!r} "
                                 "(non-tensor inputs are constants of the capture and must match)")
            if isinstance(e, torch.Tensor) and (x.dim() != e.dim() or x.dtype != e.dtype):
                raise ValueError(f"calibration item {i}, input leaf {j}: {x.dtype} rank {x.dim()}; example_inputs "
                                 f"has {e.dtype} rank {e.dim()}")
        flats.append(tensor_leaves(il))
    if not flats:
        raise ValueError("calibration_data is empty")
    return Int8State(mapping, flats, autotune=bool(autotune), min_cosine=min_cosine)


def _optimize(model, example_inputs, args, kwargs, dt, dynamic, autotune, verbose, validate, max_shapes, progress,
              state: KeptState, int8=None) -> OptimizedModule:
    with torch.no_grad():
        a, k = copies((args, kwargs))  # the reference must not write into the user's example inputs
        ref = model(*a, **k)
    state.restore()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        captured = capture(model, example_inputs, dynamic_shapes=_dynamic_shapes(example_inputs, dynamic),
                           eager_output=ref)
    state.restore()
    progress.step("capture")
    leaves = pytree.tree_leaves((args, kwargs))
    flat_in = tensor_leaves(leaves)
    out_dtypes = [t.dtype if isinstance(t, torch.Tensor) else None for t in pytree.tree_leaves(ref)]
    options = {"out_dtypes": out_dtypes, "use_onednn": True, "dynamic": bool(dynamic), "autotune": bool(autotune),
               "pristine": copy.deepcopy(captured.gm) if dynamic and not captured.constants else None,
               "validate": bool(validate),
               "max_shapes": max_shapes, "int8": int8}
    plan = build_plan(captured.gm, flat_in, dt, out_dtypes, verbose, progress, measure=bool(autotune),
                       int8=options.get("int8"))
    state.restore()
    opt = OptimizedModule(model, captured, plan, dt, leaves, options)
    if validate:
        out = pytree.tree_unflatten(list(plan.first_output), captured.out_spec)
        res = _compare(out, ref, dt, _min_cosine(options))
        del out
        if not res["ok"] and plan.steps:
            # narrow it down: the partitions that disagree with torch run in torch, the rest stays
            # partitions are fp32 work also in an int8 graph (its int8 layers run outside them)
            bad = _partition_errors(plan, flat_in, "fp32" if dt == "int8" else dt)
            state.restore()
            if bad:
                exclude = {name: f"its oneDNN partition {b['partition']} ({'+'.join(b['ops'])}) disagreed with "
                                 f"torch on the example (max rel err {b.get('max_rel_err', 0):.2g}): runs in torch"
                           for b in bad for name in b["nodes"]}
                cap2 = capture(model, example_inputs, eager_output=ref)
                state.restore()
                plan2 = build_plan(cap2.gm, flat_in, dt, out_dtypes, False, Progress(False, 4, ""),
                                    exclude=exclude, int8=options.get("int8"))
                state.restore()
                out2 = pytree.tree_unflatten(list(plan2.first_output), cap2.out_spec)
                if _compare(out2, ref, dt)["ok"]:  # the wrong partitions stay out (int8: then held to min_cosine)
                    opt = OptimizedModule(model, cap2, plan2, dt, leaves, options)
                    res = dict(_compare(out2, ref, dt, _min_cosine(options)), narrowed=bad, first_try=res)
                    options["exclude"] = exclude
                del out2
        if not res["ok"] and dt == "int8":
            narrowed = _narrow_int8(model, example_inputs, ref, flat_in, out_dtypes, leaves, options, state, res)
            if narrowed is not None:
                opt, res = narrowed
        if not res["ok"]:
            # never silently wrong: rebuild and say so. int8 that only missed the user's min_cosine
            # (above the INT8_MIN_COSINE guard: quantization noise) runs as cpu_opt's fp32 plan when
            # that plan passes; anything else (below the guard: not int8 noise) runs in fp32, in torch
            was_int8, bar = dt == "int8", _int8_bar(_min_cosine(options))
            noise = was_int8 and res.get("min_cosine", 0.0) >= INT8_MIN_COSINE
            if was_int8:
                dt, options["int8"] = "fp32", None
            fp32 = None
            if noise:
                cap2 = capture(model, example_inputs, eager_output=ref)
                state.restore()
                plan2 = build_plan(cap2.gm, flat_in, "fp32", out_dtypes, False, Progress(False, 4, ""),
                                    exclude=options.get("exclude"))
                state.restore()
                if _compare(pytree.tree_unflatten(list(plan2.first_output), cap2.out_spec), ref, "fp32")["ok"]:
                    fp32 = OptimizedModule(model, cap2, plan2, dt, leaves, options)
            if fp32 is not None:
                opt = fp32
            else:
                cap2 = capture(model, example_inputs, eager_output=ref)
                options["use_onednn"] = False
                plan2 = build_plan(cap2.gm, flat_in, dt, out_dtypes, False, Progress(False, 4, ""), use_onednn=False)
                state.restore()
                opt = OptimizedModule(model, cap2, plan2, dt, leaves, options)
            where = "cpu_opt's fp32 plan" if fp32 is not None else "fp32, in torch"
            res["fell_back"] = (f"int8 outputs too far from fp32 (cosine below {bar}): the model runs in {where}"
                                if was_int8 else "outputs differed from eager; the whole graph now runs in torch")
        opt._validation = res
    if autotune and opt._base_plan.steps:
        opt = _autotune(model, example_inputs, opt, flat_in, dt, out_dtypes, options, ref if validate else None)
    return opt


def _chains_report(program) -> list[dict]:
    """The runtime's primitive chains (:class:`cpu_opt.backends.onednn_primitives.PrimitiveChain`):
    how many primitives each runs, and the input signatures it could not bind (then it ran layer by
    layer), with the reason."""
    from ..backends.onednn_primitives import PrimitiveChain

    out = []
    for n in getattr(getattr(program, "graph", None), "nodes", ()):
        if n.op == "call_function" and isinstance(n.target, PrimitiveChain):
            c = n.target
            out.append({"node": n.name, "primitives": len(c.members), "outputs": len(c.exports),
                        "unbound": [{"signature": str(k), "why": v} for k, v in c.unbound.items()]})
    return out
