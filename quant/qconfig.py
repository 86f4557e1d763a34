"""Quantization configs: what each layer's activations and weights are quantized with.

``QConfig`` is a frozen dataclass holding observer *factories* (``Observer.with_args(...)``), so
two equal configs compare and hash equal and can key plan caches. ``QConfigMapping`` says which
layer gets which ``QConfig``; ``None`` keeps a layer in fp32.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from cpu_opt import hw

from .observer import (HistogramObserver, MinMaxObserver, Observer, ObserverFactory, PerChannelAbsMaxObserver,
                       PerChannelMinMaxObserver, PlaceholderObserver)

__all__ = ["QConfig", "QConfigMapping", "default_qconfig_mapping", "transformer_qconfig_mapping",
           "dynamic_qconfig", "weight_only_qconfig", "static_qconfig", "default_reduce_range",
           "default_weight_observer", "BACKENDS"]

BACKENDS = ("x86",)


def _observer_class(factory) -> type | None:
    if isinstance(factory, ObserverFactory):
        return factory.observer_class
    if isinstance(factory, type) and issubclass(factory, Observer):
        return factory
    return None


@dataclass(frozen=True)
class QConfig:
    """How one layer is quantized.

    * ``activation``: observer factory for the layer's input, or ``None`` for fp32 activations
      (weight-only int8).
    * ``weight``: observer factory for the weight (required: a layer without int8 weights is a
      layer whose qconfig is ``None``).
    * ``dynamic``: activations quantized on each call from their own range; ``activation`` then
      gives dtype and range (usually a ``PlaceholderObserver``).
    * ``per_token``: with ``dynamic``, one scale per row (token) instead of one per tensor.
    * ``smoothquant_alpha``: migrate activation outliers into the weights per input channel with
      ``s = max|X|^alpha / max|W|^(1-alpha)`` (0 < alpha < 1) before quantizing.
    """

    activation: ObserverFactory | type | None
    weight: ObserverFactory | type
    dynamic: bool = False
    per_token: bool = False
    smoothquant_alpha: float | None = None

    def __post_init__(self):
        for name in ("activation", "weight"):
            value = getattr(self, name)
            if value is None and name == "activation":
                continue
            if isinstance(value, Observer):
                raise TypeError(f"QConfig.{name} must be an observer factory (e.g. MinMaxObserver.with_args(...)), "
                                f"not an observer instance: every layer needs an observer of its own")
            if _observer_class(value) is None:
                raise TypeError(f"QConfig.{name} must be an observer factory (Observer.with_args(...)) or an "
                                f"Observer subclass{' or None' if name == 'activation' else ''}, got {value!r}")
        for name in ("dynamic", "per_token"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"QConfig.{name} must be a bool, got {getattr(self, name)!r}")
        weight_cls = _observer_class(self.weight)
        if issubclass(weight_cls, (PlaceholderObserver, PerChannelAbsMaxObserver)):
            raise ValueError(f"QConfig.weight: {weight_cls.__name__} gives no weight qparams; use a min-max or "
                             f"histogram observer")
        act_cls = _observer_class(self.activation)
        if act_cls is not None and issubclass(act_cls, PerChannelAbsMaxObserver):
            raise ValueError("QConfig.activation: PerChannelAbsMaxObserver gives no qparams (SmoothQuant "
                             "statistics are collected by prepare when smoothquant_alpha is set)")
        if self.dynamic and self.activation is None:
            raise ValueError("QConfig.activation must be given when dynamic=True (it sets the activation dtype "
                             "and range, e.g. PlaceholderObserver.with_args(dtype=torch.quint8))")
        if not self.dynamic and act_cls is not None and issubclass(act_cls, PlaceholderObserver):
            raise ValueError("QConfig.activation: a PlaceholderObserver records nothing, so static quantization "
                             "has no range; set dynamic=True or use a calibrating observer")
        if self.per_token and not self.dynamic:
            raise ValueError("QConfig.per_token=True needs dynamic=True (per-token scales are computed per call)")
        alpha = self.smoothquant_alpha
        if alpha is not None:
            if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
                raise TypeError(f"QConfig.smoothquant_alpha must be a float or None, got {alpha!r}")
            if not 0.0 < alpha < 1.0:
                raise ValueError(f"QConfig.smoothquant_alpha must be in (0, 1), got {alpha!r}")
            if self.activation is None:
                raise ValueError("QConfig.smoothquant_alpha needs quantized activations (activation is None: "
                                 "weight-only)")
            object.__setattr__(self, "smoothquant_alpha", float(alpha))

    @property
    def weight_only(self) -> bool:
        """int8 weights, fp32/bf16 activations."""
        return self.activation is None


_UNSET = object()


def _is_hf_conv1d(m) -> bool:
    """Hugging Face's Conv1D (GPT-2's linear layers: weight (in, out), ``nf`` outputs), or a copy of
    it such as the zoo's ``cpu_opt.models.gpt2.Conv1D``."""
    w = getattr(m, "weight", None)
    return type(m).__name__ == "Conv1D" and hasattr(m, "nf") and isinstance(w, torch.Tensor) and w.dim() == 2 \
        and w.shape[1] == m.nf


class QConfigMapping:
    """Which ``QConfig`` each layer gets (``None``: the layer stays fp32). Precedence, highest
    first: exact module name; the longest parent name set with ``set_module_name`` ("encoder"
    covers "encoder.layer.0.fc"); exact module type; ``isinstance`` in the order the types were
    set; the global config. The setters return the mapping, so calls chain."""

    def __init__(self):
        self.global_qconfig = _UNSET
        self.object_type_qconfigs: dict[type, QConfig | None] = {}
        self.module_name_qconfigs: dict[str, QConfig | None] = {}

    @staticmethod
    def _check_qconfig(qconfig, where: str):
        if qconfig is not None and not isinstance(qconfig, QConfig):
            raise TypeError(f"{where}: qconfig must be a QConfig or None, got {type(qconfig).__name__}")

    def set_global(self, qconfig: QConfig | None) -> "QConfigMapping":
        self._check_qconfig(qconfig, "set_global")
        self.global_qconfig = qconfig
        return self

    def set_object_type(self, object_type: type, qconfig: QConfig | None) -> "QConfigMapping":
        if not isinstance(object_type, type):
            raise TypeError(f"set_object_type: object_type must be a class (e.g. torch.nn.Linear), "
                            f"got {object_type!r}")
        self._check_qconfig(qconfig, "set_object_type")
        self.object_type_qconfigs[object_type] = qconfig
        return self

    def set_module_name(self, name: str, qconfig: QConfig | None) -> "QConfigMapping":
        if not isinstance(name, str) or not name:
            raise ValueError(f"set_module_name: name must be a non-empty module name such as 'encoder.layer.0' "
                             f"(use set_global for the whole model), got {name!r}")
        self._check_qconfig(qconfig, "set_module_name")
        self.module_name_qconfigs[name] = qconfig
        return self

    def qconfig_for(self, name: str, module: torch.nn.Module | None = None) -> QConfig | None:
        """The config for the module called ``name`` (as in ``named_modules()``), or None (fp32)."""
        if name in self.module_name_qconfigs:
            return self.module_name_qconfigs[name]
        parts = name.split(".") if name else []
        for end in range(len(parts) - 1, 0, -1):
            prefix = ".".join(parts[:end])
            if prefix in self.module_name_qconfigs:
                return self.module_name_qconfigs[prefix]
        if module is not None:
            if type(module) in self.object_type_qconfigs:
                return self.object_type_qconfigs[type(module)]
            for object_type, qconfig in self.object_type_qconfigs.items():
                if isinstance(module, object_type):
                    return qconfig
            # Hugging Face's Conv1D (GPT-2's linear layers, weights stored (in, out)) is a linear
            # layer: an entry for nn.Linear covers it unless Conv1D has its own
            if _is_hf_conv1d(module) and torch.nn.Linear in self.object_type_qconfigs:
                return self.object_type_qconfigs[torch.nn.Linear]
        return None if self.global_qconfig is _UNSET else self.global_qconfig

    def __eq__(self, other):
        if not isinstance(other, QConfigMapping):
            return NotImplemented
        return (self.global_qconfig is other.global_qconfig or self.global_qconfig == other.global_qconfig) and \
            list(self.object_type_qconfigs.items()) == list(other.object_type_qconfigs.items()) and \
            self.module_name_qconfigs == other.module_name_qconfigs

    __hash__ = None          # mutable

    def __repr__(self):
        lines = []
        if self.global_qconfig is not _UNSET:
            lines.append(f"  global: {self.global_qconfig!r}")
        for object_type, qconfig in self.object_type_qconfigs.items():
            lines.append(f"  type {object_type.__module__}.{object_type.__qualname__}: {qconfig!r}")
        for name, qconfig in self.module_name_qconfigs.items():
            lines.append(f"  name {name!r}: {qconfig!r}")
        return "QConfigMapping(\n" + "\n".join(lines) + "\n)" if lines else "QConfigMapping()"


# ----------------------------------------------------------------------------------------------
# presets

def default_reduce_range() -> bool:
    """7-bit activations where the CPU lacks VNNI: there the u8 x s8 kernels (vpmaddubsw) add
    pairs of products in int16, which saturates with full-range 8-bit activations."""
    return not hw.has_vnni(hw.detect())


def _resolve_reduce_range(reduce_range) -> bool:
    if reduce_range is None:
        return default_reduce_range()
    if not isinstance(reduce_range, bool):
        raise TypeError(f"reduce_range must be a bool or None, got {reduce_range!r}")
    return reduce_range


def default_weight_observer() -> ObserverFactory:
    """Per-output-channel symmetric int8 (zero points 0, which the x86 kernels require)."""
    return PerChannelMinMaxObserver.with_args(ch_axis=0, dtype=torch.qint8, qscheme=torch.per_channel_symmetric)


def static_qconfig(*, reduce_range: bool | None = None) -> QConfig:
    """Static int8: histogram-calibrated per-tensor affine uint8 activations, per-channel
    symmetric int8 weights."""
    activation = HistogramObserver.with_args(dtype=torch.quint8, qscheme=torch.per_tensor_affine,
                                             reduce_range=_resolve_reduce_range(reduce_range))
    return QConfig(activation=activation, weight=default_weight_observer())


def dynamic_qconfig(*, per_token: bool = False, reduce_range: bool | None = None) -> QConfig:
    """Dynamic int8: uint8 activations quantized per call (per tensor, or per token), per-channel
    symmetric int8 weights."""
    activation = PlaceholderObserver.with_args(dtype=torch.quint8, qscheme=torch.per_tensor_affine,
                                               reduce_range=_resolve_reduce_range(reduce_range), is_dynamic=True)
    return QConfig(activation=activation, weight=default_weight_observer(), dynamic=True, per_token=per_token)


def weight_only_qconfig() -> QConfig:
    """int8 per-channel symmetric weights, activations left in fp32/bf16."""
    return QConfig(activation=None, weight=default_weight_observer())


def default_qconfig_mapping(backend: str = "x86", *, reduce_range: bool | None = None) -> QConfigMapping:
    """Static int8 for ``nn.Linear`` and ``nn.Conv2d`` (everything else stays fp32):
    ``static_qconfig``, with 7-bit activations only where the CPU has no VNNI (``reduce_range``
    None) or as given."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} (\"x86\"), got {backend!r}")
    qconfig = static_qconfig(reduce_range=reduce_range)
    return (QConfigMapping()
            .set_object_type(torch.nn.Linear, qconfig)
            .set_object_type(torch.nn.Conv2d, qconfig))


def transformer_qconfig_mapping(*, smoothquant_alpha: float | None = 0.5, dynamic: bool = False,
                                reduce_range: bool | None = None) -> QConfigMapping:
    """int8 for ``nn.Linear`` layers: static per-tensor uint8 activations (min-max calibrated on
    the SmoothQuant-migrated inputs, as in the paper) or, with ``dynamic=True``, dynamic per-token
    activations; per-channel symmetric int8 weights; SmoothQuant with ``smoothquant_alpha`` (None:
    off)."""
    if not isinstance(dynamic, bool):
        raise TypeError(f"dynamic must be a bool, got {dynamic!r}")
    reduce = _resolve_reduce_range(reduce_range)
    if dynamic:
        activation = PlaceholderObserver.with_args(dtype=torch.quint8, qscheme=torch.per_tensor_affine,
                                                   reduce_range=reduce, is_dynamic=True)
    else:
        activation = MinMaxObserver.with_args(dtype=torch.quint8, qscheme=torch.per_tensor_affine,
                                              reduce_range=reduce)
    qconfig = QConfig(activation=activation, weight=default_weight_observer(), dynamic=dynamic,
                      per_token=dynamic, smoothquant_alpha=smoothquant_alpha)
    return QConfigMapping().set_object_type(torch.nn.Linear, qconfig)
