"""Padding to buckets for dynamic serving: ``optimize(model, example, dynamic=True, buckets=...)``.

A dynamic capture (``dynamic=True``) builds one plan per concrete input shape; a server that sees
every sequence length from 1 to 512 would compile 512 plans. With :class:`Buckets`, the inputs whose
size along ``dim`` is the same symbolic dimension of the capture are right-padded (with their pad
value) to the smallest bucket size at least that long, the bucket's plan runs, and every output
dimension whose symbolic size is that same dimension is sliced back to the true length. So at most
one plan per bucket (and per size of the other dimensions) is compiled.

Padding is only right where the model masks the padded positions (an attention mask padded with
0). So the first call in each bucket plan is also run eagerly at its true, unpadded shape and the
two compared (the tolerances of the rest of ``optimize``); if they disagree, bucketing is switched
off for the model (every length gets a plan of its own again, as without buckets), the call is
answered that way, and ``report()["buckets"]["disabled"]`` says why. Lengths above the largest
bucket run unpadded, each on a plan of its own (the plan LRU bounds them, ``max_shapes``).

This module holds the spec, its checks against the model and the capture, and the padding and
slicing; :mod:`.pipeline` decides when they run.
"""
from __future__ import annotations

import inspect
import threading
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree

from .capture import SymDim


@dataclass(frozen=True)
class Buckets:
    """Which lengths to pad to, along which dimension, with what.

    ``sizes``: the bucket lengths, positive ints in ascending order (e.g. ``(32, 64, 128, 256, 512)``).
    ``dim``: the padded dimension of the inputs (default 1, the sequence dimension of ``[batch, seq]``
    token inputs; negative counts from the end).
    ``pad_values``: ``{input name: value}`` — the value to pad each input with (default 0; input
    names are keyword-argument names, or for positional inputs the parameter name in ``forward`` or
    the position). Naming inputs here also chooses the padded dimension: the symbolic size of these
    inputs along ``dim``. With no names, every top-level tensor input with a symbolic size along
    ``dim`` is padded. Either way every input dimension that is the same symbol is padded (an input
    ``[batch, seq, seq]`` along both), each with its input's pad value.

    Frozen and hashable; ``pad_values`` may be given as a dict and is stored as sorted pairs."""

    sizes: tuple
    dim: int = 1
    pad_values: tuple = ()

    def __post_init__(self):
        sizes = self.sizes
        if isinstance(sizes, (str, bytes, Mapping)) or not hasattr(sizes, "__iter__"):
            raise TypeError(f"Buckets.sizes must be a sequence of ints (e.g. (32, 64, 128)), got {sizes!r}")
        sizes = tuple(sizes)
        if not sizes:
            raise ValueError("Buckets.sizes is empty; give the bucket lengths, e.g. (32, 64, 128)")
        bad = [s for s in sizes if not isinstance(s, int) or isinstance(s, bool) or s <= 0]
        if bad:
            raise ValueError(f"Buckets.sizes must be positive ints, got {bad} in {sizes}")
        if any(a >= b for a, b in zip(sizes, sizes[1:])):
            raise ValueError(f"Buckets.sizes must be sorted ascending without repeats, got {sizes}")
        if not isinstance(self.dim, int) or isinstance(self.dim, bool):
            raise TypeError(f"Buckets.dim must be an int, got {self.dim!r}")
        pv = self.pad_values
        if isinstance(pv, Mapping):
            items = list(pv.items())
        elif isinstance(pv, (tuple, list)) and all(isinstance(p, tuple) and len(p) == 2 for p in pv):
            items = list(pv)
        else:
            raise TypeError(f"Buckets.pad_values must be a dict {{input name: pad value}}, got {pv!r}")
        for name, value in items:
            if not isinstance(name, (str, int)) or isinstance(name, bool):
                raise TypeError(f"Buckets.pad_values: input names are str (or int positions), got {name!r}")
            if not isinstance(value, (bool, int, float)):
                raise TypeError(f"Buckets.pad_values[{name!r}] must be a number, got {value!r}")
        if len({name for name, _ in items}) != len(items):
            raise ValueError(f"Buckets.pad_values names an input twice: {items}")
        object.__setattr__(self, "sizes", sizes)
        object.__setattr__(self, "pad_values", tuple(sorted(items, key=lambda kv: str(kv[0]))))

    def bucket_for(self, length: int) -> int | None:
        """The smallest size >= ``length``; ``None`` above the largest."""
        return next((s for s in self.sizes if s >= length), None)

    @classmethod
    def coerce(cls, buckets) -> "Buckets":
        """``optimize``'s ``buckets=``: a :class:`Buckets`, or a sequence of sizes (dim 1, pad 0)."""
        if isinstance(buckets, cls):
            return buckets
        if isinstance(buckets, (tuple, list)):
            return cls(sizes=tuple(buckets))
        raise TypeError(f"buckets must be a cpu_opt.Buckets(sizes=..., dim=..., pad_values=...) or a sequence of "
                        f"bucket sizes, got {type(buckets).__name__}")


def _leaf_names(model, args, kwargs) -> list:
    """Per flat input leaf (of ``(args, kwargs)``): ``(names it answers to, display name, top-level?)``.
    A keyword input is its keyword; a positional one its position and its parameter name in ``forward``."""
    try:
        params = [p.name for p in inspect.signature(model.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    out = []
    for path, _ in pytree.tree_flatten_with_path((args, kwargs))[0]:
        top = path[1]
        if path[0].idx == 1:  # keyword
            names, shown = {top.key}, str(top.key)
        else:
            i = top.idx
            names = {i} | ({params[i]} if i < len(params) else set())
            shown = params[i] if i < len(params) else f"args[{i}]"
        if len(path) > 2:
            shown += pytree.keystr(path[2:])
        out.append((names, shown, len(path) == 2))
    return out


def _output_names(out_spec, n: int) -> list:
    """A name per flat output (``last_hidden_state``, ``[0]``), from the output structure."""
    try:
        paths = [p for p, _ in pytree.tree_flatten_with_path(pytree.tree_unflatten(list(range(n)), out_spec))[0]]
        names = [".".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in p) or str(i)
                 for i, p in enumerate(paths)]
    except Exception:  # noqa: BLE001 - a structure without key paths: positions
        names = []
    return names if len(names) == n else [str(i) for i in range(n)]


def check_spec(spec: Buckets, model, args, kwargs) -> list:
    """The spec against the example inputs, before any capture: every named input exists, is a tensor
    and has ``dim``. Returns the chosen leaves as ``(flat index, normalized dim, named?)``."""
    leaves = pytree.tree_leaves((args, kwargs))
    names = _leaf_names(model, args, kwargs)
    known = [shown for _, shown, top in names if top]
    chosen = []
    for name, _ in spec.pad_values:
        hits = [i for i, (ns, _, top) in enumerate(names) if top and name in ns]
        if not hits:
            raise ValueError(f"Buckets.pad_values names input {name!r}, which the example inputs do not have; "
                             f"the inputs are {known}")
        i = hits[0]
        t = leaves[i]
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"Buckets.pad_values names input {name!r}, which is a {type(t).__name__}, not a tensor")
        if not -t.dim() <= spec.dim < t.dim():
            raise ValueError(f"Buckets.dim={spec.dim} does not exist on input {name!r} (shape {tuple(t.shape)})")
        if t.shape[spec.dim] < 2:
            raise ValueError(f"Buckets: input {name!r} has size {t.shape[spec.dim]} along dim {spec.dim} in the example; "
                             f"torch.export specializes sizes 0 and 1, so that length could not vary: give an example "
                             "longer than 1 there")
        chosen.append((i, spec.dim % t.dim(), True))
    if not chosen:
        candidates = [(i, t) for i, (t, (_, _, top)) in enumerate(zip(leaves, names))
                      if top and isinstance(t, torch.Tensor) and -t.dim() <= spec.dim < t.dim()]
        if not candidates:
            raise ValueError(f"Buckets.dim={spec.dim}: no tensor input has that dimension (inputs {known})")
        chosen = [(i, spec.dim % t.dim(), False) for i, t in candidates if t.shape[spec.dim] > 1]
        if not chosen:
            raise ValueError(f"Buckets.dim={spec.dim}: every input has size 0 or 1 there in the example, which "
                             "torch.export specializes: give an example longer than 1 along that dimension")
    return chosen


class Bucketing:
    """The bucketing state of one optimized model: what is padded and sliced, the counts, the
    validations, and why it is off (``disabled``) when it is."""

    def __init__(self, spec: Buckets, implied_dynamic: bool, validate: bool = True):
        self.spec = spec
        self.implied_dynamic = implied_dynamic
        self.validate = validate
        self.symbols: set = set()
        self.pads: list = []      # (flat leaf index, dims, pad value, display name)
        self.slices: list = []    # (flat output index, dims)
        self.out_names: list = []
        self.disabled: str | None = None
        self.calls: dict = {}     # bucket size -> calls answered by that bucket's plan
        self.unbucketed = {"above_largest": 0, "lengths_differ": 0, "existing_plan": 0, "disabled": 0}
        self.plans_compiled = 0
        self.validated: dict = {}  # padded signature -> comparison with eager at the true length
        self.lock = threading.Lock()

    @property
    def active(self) -> bool:
        return self.disabled is None

    def setup(self, model, args, kwargs, captured, chosen, dynamic_capture: bool) -> "Bucketing":
        """Find the padded symbol(s) in the capture, the input dimensions to pad and the output
        dimensions to slice back; switch off (with the reason) where the capture does not allow it;
        raise ``ValueError`` where the spec cannot fit this model."""
        spec = self.spec
        sym = captured.symbolic
        if captured.constants:
            return self._off("the model has non-tensor inputs, which are constants of the capture: each new shape is "
                             "captured on its own, so there is no symbolic dimension to pad")
        if sym is None or not dynamic_capture:
            how = ("captured with " + captured.method if captured.method != "torch.export" else
                   "the graph that runs was captured again at the example's shapes, by validation's fallback "
                   "or autotune's torch plan")
            return self._off(f"the model has no symbolic input dimensions to pad ({how}); each length gets a plan")
        names = _leaf_names(model, args, kwargs)
        for i, d, named in chosen:
            size = sym.inputs[i][d]
            if isinstance(size, SymDim):
                self.symbols.add(size.expr)
            elif named:
                raise ValueError(f"Buckets: input {names[i][1]!r} has a static size {size} along dim {d} in the capture "
                                 "(torch.export specializes example sizes 0 and 1, and sizes the model requires): "
                                 "give an example longer than 1 along that dimension")
        if not self.symbols:
            raise ValueError(f"Buckets.dim={spec.dim}: no input has a symbolic size along that dimension in the capture "
                             "(torch.export specializes example sizes 0 and 1): give an example longer than 1 there")
        for s in sorted(self.symbols):
            lo, hi = sym.ranges.get(s, (None, None))
            if hi is not None and spec.sizes[-1] > hi:
                raise ValueError(f"Buckets.sizes {spec.sizes}: the model allows at most {hi} along that dimension "
                                 f"(torch.export's range for {s}); drop the larger sizes")
            if lo is not None and spec.sizes[0] < lo:
                raise ValueError(f"Buckets.sizes {spec.sizes}: the model needs at least {lo} along that dimension "
                                 f"(torch.export's range for {s})")
        for i, dims in enumerate(sym.inputs):
            pad_dims = tuple(j for j, d in enumerate(dims or ()) if isinstance(d, SymDim) and d.expr in self.symbols)
            if pad_dims:
                ns, shown, _ = names[i]
                value = next((v for n, v in spec.pad_values if n in ns), 0)
                self.pads.append((i, pad_dims, value, shown))
        self.out_names = _output_names(captured.out_spec, len(sym.outputs))
        for k, dims in enumerate(sym.outputs):
            cut = []
            for j, d in enumerate(dims or ()):
                if not isinstance(d, SymDim) or not d.symbols & self.symbols:
                    continue
                if d.expr not in self.symbols:
                    return self._off(f"output {self.out_names[k]} has size {d.expr} along dim {j}: it depends on the padded length "
                                     f"({', '.join(sorted(self.symbols))}) but is not that length, so it cannot be "
                                     "sliced back")
                cut.append(j)
            if cut:
                self.slices.append((k, tuple(cut)))
        return self

    def _off(self, why: str) -> "Bucketing":
        self.disabled = why
        return self

    # ------------------------------------------------------------------ per call
    def length(self, flat) -> int | None:
        """The call's length along the padded dimension; ``None`` when the padded inputs disagree
        (or are missing the dimension): that call runs unpadded."""
        n = None
        for i, dims, _, _ in self.pads:
            t = flat[i]
            if not isinstance(t, torch.Tensor) or t.dim() <= max(dims):
                return None
            for d in dims:
                if n is None:
                    n = t.shape[d]
                elif t.shape[d] != n:
                    return None
        return n

    @torch.no_grad()
    def pad(self, flat, size: int) -> list:
        """The flat inputs with every padded dimension right-padded to ``size`` (new tensors)."""
        out = list(flat)
        for i, dims, value, _ in self.pads:
            t = flat[i]
            shape = list(t.shape)
            for d in dims:
                shape[d] = size
            p = t.new_full(shape, value)
            p[tuple(slice(0, t.shape[d]) if d in dims else slice(None) for d in range(t.dim()))].copy_(t)
            out[i] = p
        return out

    @torch.no_grad()
    def unpad(self, outs, length: int, size: int) -> list | None:
        """The flat outputs with every sliced dimension cut back to ``length``; ``None`` when an output
        does not have ``size`` there (the plan's outputs are not what the capture said)."""
        outs = list(outs)
        for k, dims in self.slices:
            t = outs[k]
            if not isinstance(t, torch.Tensor):
                continue
            if any(t.dim() <= d or t.shape[d] != size for d in dims):
                return None
            outs[k] = t[tuple(slice(0, length) if d in dims else slice(None) for d in range(t.dim()))].contiguous()
        return outs

    def plan_built(self) -> None:
        with self.lock:
            self.plans_compiled += 1

    def count(self, bucket: int | None = None, unbucketed: str | None = None) -> None:
        with self.lock:
            if bucket is not None:
                self.calls[bucket] = self.calls.get(bucket, 0) + 1
            else:
                self.unbucketed[unbucketed] += 1

    def report(self) -> dict:
        with self.lock:
            return {
                "sizes": list(self.spec.sizes),
                "dim": self.spec.dim,
                "symbols": sorted(self.symbols),
                "dynamic_implied": self.implied_dynamic,
                "padded_inputs": [{"input": shown, "dims": list(dims), "pad_value": v} for _, dims, v, shown in self.pads],
                "sliced_outputs": [{"output": self.out_names[k], "dims": list(dims)} for k, dims in self.slices],
                "calls_per_bucket": dict(sorted(self.calls.items())),
                "calls_unbucketed": dict(self.unbucketed),
                "plans_compiled": self.plans_compiled,
                "validated": list(self.validated.values()),
                "validation": ("the first call of each bucket plan, against eager at its true length" if self.validate
                               else "off (optimize(validate=False)): padding is trusted to be masked"),
                "disabled": self.disabled,
            }
