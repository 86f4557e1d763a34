"""prepare / calibrate / convert, and the one-call forms (``quantize_dynamic``,
``quantize_weight_only``).

``prepare`` wraps each layer its ``QConfigMapping`` selects in an :class:`ObservedLayer`; the user
calibrates by calling the prepared model; ``convert`` replaces each observed layer with an int8
layer on the kernel family ``cpu_opt.routing`` picks for its shape (the table, this machine's
measured profile, or, with ``autotune=True``, timing the candidates on the calibrated shape).
The model's own Python code is never rewritten, so any model that runs works; the graph-level
form (activations fused into the kernels, int8 chains without dequantize between layers) is
``cpu_opt.optimize(model, x, dtype="int8", calibration_data=...)``.
"""
from __future__ import annotations

import copy
import statistics
import time
import warnings

import torch
import torch.nn as nn

from . import kernels as K
from .modules import (DynamicQuantizedLinear, ObservedLayer, WeightOnlyLinear, _QuantizedBase, _weight_qparams,
                      build_static, layer_kind, linear_weight)
from .qconfig import QConfigMapping, default_qconfig_mapping

__all__ = ["prepare", "convert", "calibrate", "quantize_dynamic", "quantize_weight_only", "report", "choose_family",
           "QuantizationError"]


class QuantizationError(RuntimeError):
    """The model cannot be quantized as asked (the message says which layer and why)."""


def _set_submodule(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, new)


def _selected(model: nn.Module, mapping: QConfigMapping, want=None):
    """(name, module, qconfig) for each layer the mapping quantizes, and (name, why) for the others."""
    chosen, skipped = [], []
    for name, m in model.named_modules():
        if not name or isinstance(m, (ObservedLayer, _QuantizedBase)):
            continue
        if any(name.startswith(c + ".") for c, _, _ in chosen):
            continue
        qc = mapping.qconfig_for(name, m)
        kind = layer_kind(m)
        if kind is None:
            if qc is not None and isinstance(m, (nn.Linear, nn.Conv2d)):
                skipped.append((name, f"{type(m).__name__} with padding_mode={getattr(m, 'padding_mode', '?')!r} / "
                                      f"padding={getattr(m, 'padding', '?')!r}: only zeros padding with explicit sizes"))
            continue
        if qc is None:
            skipped.append((name, "qconfig None: kept in fp32"))
            continue
        if want is not None and kind not in want:
            skipped.append((name, f"{kind}: {want_msg(want)}"))
            continue
        chosen.append((name, m, qc))
    return chosen, skipped


def want_msg(want) -> str:
    return f"this mode takes {', '.join(sorted(want))} layers only"


def prepare(model: nn.Module, qconfig_mapping: QConfigMapping | None = None, example_inputs=None, *,
            inplace: bool = False) -> nn.Module:
    """A copy of ``model`` whose selected layers observe what they see. Calibrate by calling it on
    representative inputs (``calibrate(prepared, data)`` does the loop), then ``convert`` it.

    ``example_inputs`` (a tuple, or a dict of keyword arguments), when given, is run once without
    observing, to check that the model runs."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"prepare takes an nn.Module, got {type(model).__name__}")
    mapping = qconfig_mapping if qconfig_mapping is not None else default_qconfig_mapping()
    if not isinstance(mapping, QConfigMapping):
        raise TypeError(f"qconfig_mapping must be a QConfigMapping, got {type(mapping).__name__}")
    m = model if inplace else copy.deepcopy(model)
    chosen, skipped = _selected(m, mapping)
    for qc_name, layer, qc in chosen:
        if qc.activation is None:
            raise QuantizationError(f"{qc_name}: a qconfig without activation observer is weight-only; use "
                                    "quantize_weight_only(model) for that")
        obs = ObservedLayer(layer, qc)
        if obs.input_observer is not None:
            K.warn_if_saturating(obs.input_observer, f"prepare: {qc_name}")
        _set_submodule(m, qc_name, obs)
    m._cpu_opt_quant = {"stage": "prepared", "skipped": skipped, "mapping": mapping}
    if not chosen:
        warnings.warn("prepare: the qconfig mapping selects no Linear/Conv2d layer of this model; nothing will be "
                      "quantized", RuntimeWarning, stacklevel=2)
    if example_inputs is not None:
        with observing(m, False), torch.no_grad():
            _call(m, example_inputs)
    return m


def _observed(model):
    return [(n, o) for n, o in model.named_modules() if isinstance(o, ObservedLayer)]


class observing:
    """``with observing(prepared, False):`` runs a prepared model without recording statistics."""

    def __init__(self, model, on: bool):
        self.layers = [o for _, o in _observed(model)]
        self.on = on

    def __enter__(self):
        self.old = [o.observing for o in self.layers]
        for o in self.layers:
            o.observing = self.on

    def __exit__(self, *exc):
        for o, v in zip(self.layers, self.old):
            o.observing = v


def _call(model, inputs):
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def calibrate(prepared: nn.Module, data, *, progress: bool | None = None) -> nn.Module:
    """Call ``prepared`` on every item of ``data`` (a tensor, a tuple of positional inputs or a dict
    of keyword inputs), under ``torch.no_grad()``. ``progress``: a bar on stderr (default: when
    stderr is a terminal)."""
    import sys

    from cpu_opt.progress import Progress

    if not _observed(prepared):
        raise QuantizationError("calibrate: the model has no observed layers (call prepare first)")
    items = list(data) if not isinstance(data, (list, tuple)) else data
    if not items:
        raise ValueError("calibration data is empty: give at least one batch")
    bar = Progress(sys.stderr.isatty() if progress is None else bool(progress), len(items), "calibrating")
    with torch.no_grad():
        for i, item in enumerate(items):
            _call(prepared, item)
            bar.step(f"batch {i + 1}")
    bar.done()
    return prepared


def _time(fn, x, repeats=7):
    fn(x)
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(x)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def choose_family(kind: str, rows: int, macs: int, conv=None, in_features: int = 0,
                  post_op: str | None = None) -> tuple[str, str]:
    """The int8 kernel family for a layer: ``cpu_opt.routing`` (table or this machine's measured
    profile) for ``linear``/``conv`` int8 at this row count. ``conv`` (weight shape, groups,
    dilation) keeps depthwise convolutions off FBGEMM where its kernel would saturate; a linear
    layer goes to cpu_opt's AMX kernel only where it takes ``in_features`` and ``post_op``."""
    from cpu_opt.backends.amx_linear import supports as amx_takes
    from cpu_opt.backends.fbgemm import depthwise_saturates
    from cpu_opt.platform import routing

    r = routing.route("linear" if kind == "linear" else "conv", "int8", rows=rows, macs=macs)
    fam, why = r.backend, f"routing ({r.source}): {r.why}"
    if fam == "torch":   # torch's own x86 int8 kernels are FBGEMM's (its reference paths below AVX2)
        fam = "fbgemm"
    if conv is not None and K.CONV_KERNELS.get(fam) is K.FbgemmConv2d and depthwise_saturates(*conv):
        fam, why = "torch_onednn", f"FBGEMM's depthwise kernel saturates with 8-bit activations; {why}"
    if fam == "amx" and (kind != "linear" or not amx_takes(in_features, post_op)):
        fam, why = "onednn", f"cpu_opt's AMX kernel takes no layer of input width {in_features} with " \
                             f"post-op {post_op} here; {why}"
    if fam == "onednn":
        try:
            from cpu_opt.dnnl import probe

            ok, err = probe.accepts("int8"), "it creates no u8 x s8 matmul here"
        except Exception as e:  # noqa: BLE001 - any failure to load means "not here"
            ok, err = False, str(e)
        if not ok:
            fam, why = "torch_onednn", f"cpu_opt's oneDNN unavailable ({err}); {why}"
    return fam, why


def _candidates(kind):
    return list(K.LINEAR_KERNELS if kind == "linear" else K.CONV_KERNELS)


def _sample_input(obs: ObservedLayer):
    shape = getattr(obs, "last_shape", None)
    if shape is None:
        raise QuantizationError("autotune needs the calibrated input shape; the layer saw no input")
    s, z = (float(v.reshape(-1)[0]) for v in obs.input_observer.calculate_qparams()) \
        if obs.input_observer is not None else (0.05, 0)
    g = torch.Generator().manual_seed(0)
    return (torch.rand(shape, generator=g) * 255 - z) * s


def convert(prepared: nn.Module, *, autotune: bool = False, inplace: bool = False,
            families: dict | None = None) -> nn.Module:
    """The int8 model: each observed layer becomes an int8 layer (input quantized with the
    calibrated scale, int8 kernel, fp32 output). ``families`` ({layer name: family}) forces a
    kernel family per layer (``fbgemm``, ``torch_onednn``, ``onednn``)."""
    observed = _observed(prepared)
    if not observed:
        raise QuantizationError("convert: the model has no observed layers (call prepare and calibrate first)")
    m = prepared if inplace else copy.deepcopy(prepared)
    families = dict(families or {})
    done = []
    for name, obs in _observed(m):
        obs_in = obs.input_observer or obs.channel_observer
        if obs_in is not None and not _has_data(obs_in):
            raise QuantizationError(f"convert: layer {name!r} saw no input during calibration (is it used by the "
                                    "calibration data? a qconfig of None keeps it in fp32)")
        rows = max(int(obs.rows), 1)
        w = linear_weight(obs.layer) if obs.kind == "linear" else obs.layer.weight
        shape = getattr(obs, "last_shape", None)
        spatial = shape[2] * shape[3] // (obs.layer.stride[0] * obs.layer.stride[1]) \
            if obs.kind == "conv2d" and shape is not None and len(shape) == 4 else 1
        macs = rows * spatial * w.numel()
        if name in families:
            fam, why = families.pop(name), "chosen by the caller"
            if fam not in _candidates(obs.kind):
                raise ValueError(f"{name}: family must be one of {_candidates(obs.kind)}, got {fam!r}")
        else:
            fam, why = choose_family(obs.kind, rows, macs, conv=(tuple(w.shape), obs.layer.groups, obs.layer.dilation)
                                     if obs.kind == "conv2d" else None, in_features=w.shape[-1])
        if autotune and obs.kind and getattr(obs, "last_shape", None) is not None:
            x = _sample_input(obs)
            t = {}
            for f in dict.fromkeys(c for c in _candidates(obs.kind) if c != "torch"):
                try:
                    t[f] = _time(build_static(obs, name, f, ""), x)
                except Exception:  # noqa: BLE001 - a family that cannot build here is not a candidate
                    continue
            if t:
                fam = min(t, key=t.get)
                why = "measured on the calibrated shape: " + ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in t.items())
        _set_submodule(m, name, build_static(obs, name, fam, why))
        done.append(name)
    if families:
        raise ValueError(f"families names layers that are not observed: {sorted(families)}")
    m._cpu_opt_quant = {**getattr(prepared, "_cpu_opt_quant", {}), "stage": "converted", "mode": "static"}
    return m


def _has_data(obs) -> bool:
    try:
        obs.calculate_qparams()
        return True
    except RuntimeError:
        return False
    except AttributeError:   # observers without qparams (channel ranges)
        return getattr(obs, "min_val", torch.empty(0)).numel() > 0


def quantize_dynamic(model: nn.Module, qconfig_mapping: QConfigMapping | None = None, *, per_token: bool = False,
                     inplace: bool = False) -> nn.Module:
    """int8 weights (per output channel), activations quantized per call: per tensor on FBGEMM, or
    ``per_token=True`` (one scale per row). Linear layers only; no calibration needed."""
    from .qconfig import dynamic_qconfig

    mapping = qconfig_mapping or QConfigMapping().set_global(dynamic_qconfig())
    m = model if inplace else copy.deepcopy(model)
    chosen, skipped = _selected(m, mapping, want={"linear"})
    from cpu_opt.platform import hw

    reduce_range = not hw.has_vnni(hw.detect())
    for name, layer, qc in chosen:
        wq, ws = _weight_qparams(qc, linear_weight(layer))
        _set_submodule(m, name, DynamicQuantizedLinear(wq, ws, layer.bias, name, per_token or qc.per_token,
                                                       reduce_range))
    m._cpu_opt_quant = {"stage": "converted", "mode": "dynamic", "skipped": skipped}
    return m


def quantize_weight_only(model: nn.Module, qconfig_mapping: QConfigMapping | None = None, *,
                         inplace: bool = False) -> nn.Module:
    """int8 weights (per output channel, symmetric), activations stay bf16/fp32: for memory-bound
    work (LLM decode at batch 1), where reading a quarter of the weight bytes is the speedup."""
    from .qconfig import weight_only_qconfig

    mapping = qconfig_mapping or QConfigMapping().set_global(weight_only_qconfig())
    m = model if inplace else copy.deepcopy(model)
    chosen, skipped = _selected(m, mapping, want={"linear"})
    for name, layer, qc in chosen:
        wq, ws = _weight_qparams(qc, linear_weight(layer))
        _set_submodule(m, name, WeightOnlyLinear(wq, ws, layer.bias, name))
    m._cpu_opt_quant = {"stage": "converted", "mode": "weight_only", "skipped": skipped}
    return m


def report(model: nn.Module) -> dict:
    """Which layer went to which int8 kernel and why, and which stayed in fp32 and why."""
    state = getattr(model, "_cpu_opt_quant", None)
    if state is None:
        raise QuantizationError("report: this model was not prepared or converted by cpu_opt.quant")
    layers = [q.info() for _, q in model.named_modules() if isinstance(q, _QuantizedBase)]
    observed = [n for n, _ in _observed(model)]
    by_family: dict[str, int] = {}
    for li in layers:
        by_family[li["family"]] = by_family.get(li["family"], 0) + 1
    return {"stage": state["stage"], "mode": state.get("mode"), "layers": layers, "observed": observed,
            "by_family": by_family,
            "fp32_layers": [{"layer": n, "why": w} for n, w in state.get("skipped", [])]}
