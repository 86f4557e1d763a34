"""Observers: modules that watch tensors during calibration and turn what they saw into int8
quantization parameters (scale, zero point).

Pure torch, no ``torch.ao.quantization``. The qparams formulas are torch.ao's
(``UniformQuantizationObserverBase._calculate_qparams``), so a model calibrated here and one
calibrated with torch.ao agree; the histogram observer's range search is our own (an exact
minimisation of the modelled L2 error over bin-aligned clipping ranges, see ``HistogramObserver``).

Statistics live in registered buffers: a prepared model's ``state_dict()`` carries them and
``load_state_dict`` resumes calibration where it stopped. Configs hold observer *factories*
(``MinMaxObserver.with_args(...)``), never instances, so each layer gets its own observer and
frozen config dataclasses stay hashable.

Observers refuse NaN and Inf (``ValueError``): a calibration batch that produces them would give
an infinite or undefined range, and clamping it silently would hide a broken model or input.
"""
from __future__ import annotations

import math

import torch

__all__ = [
    "Observer", "ObserverFactory", "MinMaxObserver", "MovingAverageMinMaxObserver",
    "PerChannelMinMaxObserver", "HistogramObserver", "PerChannelAbsMaxObserver",
    "PlaceholderObserver", "quant_range", "choose_qparams", "quantize", "dequantize",
]

PER_TENSOR_SCHEMES = (torch.per_tensor_affine, torch.per_tensor_symmetric)
PER_CHANNEL_SCHEMES = (torch.per_channel_affine, torch.per_channel_symmetric)
SYMMETRIC_SCHEMES = (torch.per_tensor_symmetric, torch.per_channel_symmetric)
# quantized dtype -> (plain storage dtype, full range)
QUANT_DTYPES = {
    torch.quint8: (torch.uint8, 0, 255),
    torch.qint8: (torch.int8, -128, 127),
}
_PLAIN_TO_QUANT = {torch.uint8: torch.quint8, torch.int8: torch.qint8}
_FLOAT32_EPS = torch.finfo(torch.float32).eps


# ----------------------------------------------------------------------------------------------
# qparams and quantize / dequantize (shared by observers, convert, lowering and tests)

def _quant_dtype(dtype, argument: str = "dtype") -> torch.dtype:
    dtype = _PLAIN_TO_QUANT.get(dtype, dtype)
    if dtype not in QUANT_DTYPES:
        raise ValueError(f"{argument} must be torch.quint8 or torch.qint8 (or torch.uint8 / torch.int8), "
                         f"got {dtype!r}")
    return dtype


def quant_range(dtype, reduce_range: bool = False) -> tuple[int, int]:
    """(quant_min, quant_max) for ``dtype``: 0..255 / -128..127, or with ``reduce_range`` the
    7-bit 0..127 / -64..63 (torch's convention)."""
    _, qmin, qmax = QUANT_DTYPES[_quant_dtype(dtype)]
    if reduce_range:
        return qmin // 2, qmax // 2
    return qmin, qmax


def choose_qparams(min_val: torch.Tensor, max_val: torch.Tensor, *, dtype=torch.quint8,
                   qscheme=torch.per_tensor_affine, quant_min: int | None = None,
                   quant_max: int | None = None, reduce_range: bool = False,
                   eps: float = _FLOAT32_EPS) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale float32, zero_point int64) for the observed range ``[min_val, max_val]`` (any shape,
    elementwise: 0-dim for per-tensor, [C] for per-channel), with torch.ao's formulas. The range
    is widened to include 0 so that 0 is exactly representable."""
    dtype = _quant_dtype(dtype)
    if quant_min is None or quant_max is None:
        quant_min, quant_max = quant_range(dtype, reduce_range)
    min_val = torch.as_tensor(min_val, dtype=torch.float32)
    max_val = torch.as_tensor(max_val, dtype=torch.float32)
    min_neg = torch.clamp(min_val, max=0.0)
    max_pos = torch.clamp(max_val, min=0.0)
    if qscheme in SYMMETRIC_SCHEMES:
        bound = torch.maximum(-min_neg, max_pos)
        scale = torch.clamp(bound / (float(quant_max - quant_min) / 2), min=eps)
        # 0 for qint8; for quint8 the midpoint: 128 for the full range as in torch. torch also
        # answers 128 for the reduced 0..127, a zero point outside the range; we take 64 there.
        mid = 0 if dtype == torch.qint8 else (quant_min + quant_max + 1) // 2
        zero_point = torch.full(scale.shape, mid, dtype=torch.int64)
    elif qscheme in (torch.per_tensor_affine, torch.per_channel_affine):
        scale = torch.clamp((max_pos - min_neg) / float(quant_max - quant_min), min=eps)
        zero_point = quant_min - torch.round(min_neg / scale).to(torch.int64)
        zero_point = torch.clamp(zero_point, quant_min, quant_max)
    else:
        raise ValueError(f"qscheme must be one of {PER_TENSOR_SCHEMES + PER_CHANNEL_SCHEMES}, got {qscheme!r}")
    return scale.to(torch.float32), zero_point.to(torch.int64)


def _broadcast_qparam(value, x: torch.Tensor, axis: int | None, dtype: torch.dtype, name: str) -> torch.Tensor:
    value = torch.as_tensor(value, dtype=dtype, device=x.device)
    if axis is None:
        if value.numel() != 1:
            raise ValueError(f"{name} must hold one value without axis, got shape {tuple(value.shape)}")
        return value.reshape(())
    if value.dim() != 1 or value.numel() != x.shape[axis]:
        raise ValueError(f"{name} must be 1-D with x.shape[{axis}] = {x.shape[axis]} values, "
                         f"got shape {tuple(value.shape)}")
    shape = [1] * x.dim()
    shape[axis] = -1
    return value.reshape(shape)


def _normalize_axis(axis: int | None, x: torch.Tensor) -> int | None:
    if axis is None:
        return None
    if not -x.dim() <= axis < x.dim():
        raise ValueError(f"axis {axis} is out of range for a tensor of {x.dim()} dimensions")
    return axis % x.dim()


def quantize(x: torch.Tensor, scale, zero_point, dtype, axis: int | None = None,
             quant_min: int | None = None, quant_max: int | None = None) -> torch.Tensor:
    """``clamp(round_half_even(x / scale) + zero_point)`` as a plain torch.uint8 (quint8) or
    torch.int8 (qint8) tensor, equal to ``torch.quantize_per_tensor(...).int_repr()`` (``axis``
    None) or ``torch.quantize_per_channel(..., axis, ...).int_repr()``. ``scale`` / ``zero_point``
    are scalars, or 1-D along ``axis``. ``quant_min``/``quant_max`` narrow the clamp (default: the
    dtype's full range)."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"x must be a floating-point tensor, got "
                        f"{x.dtype if isinstance(x, torch.Tensor) else type(x).__name__}")
    qdtype = _quant_dtype(dtype)
    plain, full_min, full_max = QUANT_DTYPES[qdtype]
    qmin = full_min if quant_min is None else int(quant_min)
    qmax = full_max if quant_max is None else int(quant_max)
    if not full_min <= qmin < qmax <= full_max:
        raise ValueError(f"quant_min/quant_max must satisfy {full_min} <= quant_min < quant_max <= {full_max} "
                         f"for {qdtype}, got {qmin}, {qmax}")
    axis = _normalize_axis(axis, x)
    scale_t = _broadcast_qparam(scale, x, axis, torch.float32, "scale")
    zp_t = _broadcast_qparam(zero_point, x, axis, torch.int64, "zero_point")
    if not bool((scale_t > 0).all()):
        raise ValueError("scale must be positive")
    inv_scale = 1.0 / scale_t
    x = x.detach().to(torch.float32)
    if axis is None:
        # torch's vectorised per-tensor kernel computes fma(x, 1/scale, zero_point) in float32 and
        # rounds that; the product of two floats is exact in float64, so this is the fused result.
        value = (x.double() * inv_scale.double() + zp_t.double()).float()
    else:
        # the per-channel kernel multiplies and adds in float32, unfused
        value = x * inv_scale + zp_t.to(torch.float32)
    return torch.round(value).clamp_(qmin, qmax).to(plain)


def dequantize(q: torch.Tensor, scale, zero_point, axis: int | None = None) -> torch.Tensor:
    """``(q - zero_point) * scale`` in float32 (``axis``: the channel dimension of 1-D qparams)."""
    if not isinstance(q, torch.Tensor) or q.dtype not in (torch.uint8, torch.int8, torch.int16, torch.int32):
        raise TypeError(f"q must be an integer tensor (uint8/int8/int16/int32), got "
                        f"{q.dtype if isinstance(q, torch.Tensor) else type(q).__name__}")
    axis = _normalize_axis(axis, q)
    scale_t = _broadcast_qparam(scale, q, axis, torch.float32, "scale")
    zp_t = _broadcast_qparam(zero_point, q, axis, torch.int64, "zero_point")
    return (q.to(torch.int32) - zp_t.to(torch.int32)).to(torch.float32) * scale_t


# ----------------------------------------------------------------------------------------------
# factories

class ObserverFactory:
    """What ``Observer.with_args(**kwargs)`` returns: calling it builds a fresh observer.
    Picklable, compared and hashed by (class, kwargs), so frozen configs holding one compare
    equal and can key caches."""

    __slots__ = ("observer_class", "_kwargs")

    def __init__(self, observer_class: type, kwargs: dict):
        object.__setattr__(self, "observer_class", observer_class)
        object.__setattr__(self, "_kwargs", tuple(sorted(kwargs.items())))

    def __setattr__(self, name, value):
        raise AttributeError("ObserverFactory is immutable")

    @property
    def kwargs(self) -> dict:
        """The keyword arguments the observer is built with (a copy)."""
        return dict(self._kwargs)

    def __call__(self, **overrides) -> "Observer":
        return self.observer_class(**{**dict(self._kwargs), **overrides})

    def __eq__(self, other):
        if not isinstance(other, ObserverFactory):
            return NotImplemented
        return self.observer_class is other.observer_class and self._kwargs == other._kwargs

    def __hash__(self):
        try:
            return hash((self.observer_class, self._kwargs))
        except TypeError:            # an unhashable argument value: fall back on its repr
            return hash((self.observer_class, repr(self._kwargs)))

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in self._kwargs)
        return f"{self.observer_class.__name__}.with_args({args})"

    def __reduce__(self):
        return (ObserverFactory, (self.observer_class, dict(self._kwargs)))


# ----------------------------------------------------------------------------------------------
# observers

class Observer(torch.nn.Module):
    """Base of all observers: validates dtype / qscheme / range, checks inputs, keeps statistics
    in buffers. Subclasses implement ``_observe(x)`` (x detached, non-empty, floating) and
    ``calculate_qparams()``."""

    _version = 1
    is_dynamic = False
    _allowed_qschemes = PER_TENSOR_SCHEMES

    def __init__(self, dtype=torch.quint8, qscheme=torch.per_tensor_affine, reduce_range=False,
                 quant_min=None, quant_max=None, eps=_FLOAT32_EPS):
        super().__init__()
        if dtype not in QUANT_DTYPES:
            raise ValueError(f"dtype must be torch.quint8 or torch.qint8, got {dtype!r}")
        if qscheme not in self._allowed_qschemes:
            raise ValueError(f"qscheme must be one of {', '.join(map(str, self._allowed_qschemes))} "
                             f"for {type(self).__name__}, got {qscheme!r}")
        if not isinstance(reduce_range, bool):
            raise TypeError(f"reduce_range must be a bool, got {type(reduce_range).__name__}")
        if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps > 0:
            raise ValueError(f"eps must be a positive float, got {eps!r}")
        self.dtype = dtype
        self.qscheme = qscheme
        self.reduce_range = reduce_range
        self.eps = float(eps)
        self.has_customized_qrange = quant_min is not None or quant_max is not None
        self.quant_min, self.quant_max = self._resolve_range(quant_min, quant_max)

    def _resolve_range(self, quant_min, quant_max) -> tuple[int, int]:
        if quant_min is None and quant_max is None:
            return quant_range(self.dtype, self.reduce_range)
        if quant_min is None or quant_max is None:
            raise ValueError("quant_min and quant_max must be given together")
        if self.reduce_range:
            raise ValueError("give either reduce_range=True or quant_min/quant_max, not both")
        for name, value in (("quant_min", quant_min), ("quant_max", quant_max)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        _, full_min, full_max = QUANT_DTYPES[self.dtype]
        if not full_min <= quant_min < quant_max <= full_max:
            raise ValueError(f"quant_min/quant_max must satisfy {full_min} <= quant_min < quant_max <= "
                             f"{full_max} for {self.dtype}, got {quant_min}, {quant_max}")
        if self.dtype == torch.qint8 and self.qscheme in SYMMETRIC_SCHEMES and not quant_min <= 0 <= quant_max:
            raise ValueError(f"quant_min/quant_max must contain 0 for symmetric qint8, got {quant_min}, {quant_max}")
        return quant_min, quant_max

    @property
    def qmin(self) -> int:
        return self.quant_min

    @property
    def qmax(self) -> int:
        return self.quant_max

    @classmethod
    def with_args(cls, **kwargs) -> ObserverFactory:
        """A factory building ``cls(**kwargs)``; the arguments are checked now (by building one)."""
        cls(**kwargs)
        return ObserverFactory(cls, kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{type(self).__name__} observes tensors, got {type(x).__name__}")
        if not x.is_floating_point():
            raise TypeError(f"{type(self).__name__} observes floating-point tensors, got {x.dtype}")
        if x.numel() == 0:
            return x
        with torch.no_grad():
            self._observe(x.detach())
        return x

    def _observe(self, x: torch.Tensor) -> None:
        raise NotImplementedError

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def _qparams(self, min_val: torch.Tensor, max_val: torch.Tensor):
        return choose_qparams(min_val, max_val, dtype=self.dtype, qscheme=self.qscheme,
                              quant_min=self.quant_min, quant_max=self.quant_max, eps=self.eps)

    def _no_data(self) -> RuntimeError:
        return RuntimeError(f"{type(self).__name__} has observed no data: run calibration batches through "
                            f"the prepared model before computing quantization parameters")

    @staticmethod
    def _check_finite(*stats: torch.Tensor) -> None:
        for s in stats:
            if not bool(torch.isfinite(s).all()):
                raise ValueError("observed a tensor containing NaN or Inf; quantization ranges must be finite "
                                 "(check the model and the calibration data)")

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        # buffers whose shape depends on the data (per-channel, or not yet initialised) take the
        # saved shape, so a fresh observer can resume a saved calibration
        for name, buf in self._buffers.items():
            key = prefix + name
            if buf is not None and key in state_dict and state_dict[key].shape != buf.shape:
                self._buffers[name] = torch.empty(state_dict[key].shape, dtype=buf.dtype, device=buf.device)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)

    def extra_repr(self) -> str:
        return f"dtype={self.dtype}, qscheme={self.qscheme}, quant_min={self.quant_min}, quant_max={self.quant_max}"


class MinMaxObserver(Observer):
    """Running minimum and maximum of everything seen (per tensor)."""

    def __init__(self, dtype=torch.quint8, qscheme=torch.per_tensor_affine, reduce_range=False,
                 quant_min=None, quant_max=None, eps=_FLOAT32_EPS):
        super().__init__(dtype, qscheme, reduce_range, quant_min, quant_max, eps)
        self.register_buffer("min_val", torch.tensor(float("inf")))
        self.register_buffer("max_val", torch.tensor(float("-inf")))

    @property
    def observed(self) -> bool:
        return bool(self.min_val.numel() > 0 and torch.isfinite(self.min_val).all())

    def _batch_min_max(self, x: torch.Tensor):
        lo, hi = torch.aminmax(x)
        lo, hi = lo.to(torch.float32), hi.to(torch.float32)
        self._check_finite(lo, hi)
        return lo, hi

    def _observe(self, x):
        lo, hi = self._batch_min_max(x)
        self.min_val.copy_(torch.minimum(self.min_val, lo))
        self.max_val.copy_(torch.maximum(self.max_val, hi))

    def calculate_qparams(self):
        if not self.observed:
            raise self._no_data()
        return self._qparams(self.min_val, self.max_val)

    def extra_repr(self):
        return super().extra_repr() + f", min_val={self.min_val.tolist()}, max_val={self.max_val.tolist()}"


class MovingAverageMinMaxObserver(MinMaxObserver):
    """The first batch sets min/max; each later batch moves them by ``averaging_constant`` towards
    its own min/max (an exponential moving average)."""

    def __init__(self, averaging_constant=0.01, dtype=torch.quint8, qscheme=torch.per_tensor_affine,
                 reduce_range=False, quant_min=None, quant_max=None, eps=_FLOAT32_EPS):
        if isinstance(averaging_constant, bool) or not isinstance(averaging_constant, (int, float)) \
                or not 0 < averaging_constant <= 1:
            raise ValueError(f"averaging_constant must be in (0, 1], got {averaging_constant!r}")
        super().__init__(dtype, qscheme, reduce_range, quant_min, quant_max, eps)
        self.averaging_constant = float(averaging_constant)

    def _observe(self, x):
        lo, hi = self._batch_min_max(x)
        if not self.observed:
            self.min_val.copy_(lo)
            self.max_val.copy_(hi)
        else:
            c = self.averaging_constant
            self.min_val.copy_(self.min_val + c * (lo - self.min_val))
            self.max_val.copy_(self.max_val + c * (hi - self.max_val))

    def extra_repr(self):
        return f"averaging_constant={self.averaging_constant}, " + super().extra_repr()


class PerChannelMinMaxObserver(Observer):
    """Running min/max per slice along ``ch_axis`` (weights: the output channels, axis 0)."""

    _allowed_qschemes = PER_CHANNEL_SCHEMES

    def __init__(self, ch_axis=0, dtype=torch.quint8, qscheme=torch.per_channel_affine, reduce_range=False,
                 quant_min=None, quant_max=None, eps=_FLOAT32_EPS):
        if isinstance(ch_axis, bool) or not isinstance(ch_axis, int):
            raise TypeError(f"ch_axis must be an int, got {type(ch_axis).__name__}")
        super().__init__(dtype, qscheme, reduce_range, quant_min, quant_max, eps)
        self.ch_axis = ch_axis
        self.register_buffer("min_val", torch.empty(0))
        self.register_buffer("max_val", torch.empty(0))

    @property
    def observed(self) -> bool:
        return self.min_val.numel() > 0

    def _observe(self, x):
        flat = _channels_first(x, self.ch_axis)
        lo, hi = torch.aminmax(flat, dim=1)
        lo, hi = lo.to(torch.float32), hi.to(torch.float32)
        self._check_finite(lo, hi)
        if not self.observed:
            self.min_val = lo
            self.max_val = hi
            return
        if lo.numel() != self.min_val.numel():
            raise ValueError(f"{type(self).__name__} saw {self.min_val.numel()} channels along axis "
                             f"{self.ch_axis} before and {lo.numel()} now")
        self.min_val.copy_(torch.minimum(self.min_val, lo))
        self.max_val.copy_(torch.maximum(self.max_val, hi))

    def calculate_qparams(self):
        if not self.observed:
            raise self._no_data()
        return self._qparams(self.min_val, self.max_val)

    def extra_repr(self):
        return f"ch_axis={self.ch_axis}, " + super().extra_repr()


def _channels_first(x: torch.Tensor, ch_axis: int) -> torch.Tensor:
    """x as [C, everything else] for channel axis ``ch_axis``."""
    if x.dim() == 0 or not -x.dim() <= ch_axis < x.dim():
        raise ValueError(f"ch_axis {ch_axis} is out of range for a tensor of {x.dim()} dimensions")
    return x.movedim(ch_axis, 0).reshape(x.shape[ch_axis], -1)


class PerChannelAbsMaxObserver(Observer):
    """Per-channel max |x| along ``ch_axis`` over every other dimension: the activation statistics
    SmoothQuant migrates (``abs_max()``). Gives no qparams of its own."""

    def __init__(self, ch_axis=-1):
        if isinstance(ch_axis, bool) or not isinstance(ch_axis, int):
            raise TypeError(f"ch_axis must be an int, got {type(ch_axis).__name__}")
        super().__init__()
        self.ch_axis = ch_axis
        self.register_buffer("abs_max_val", torch.empty(0))

    @property
    def observed(self) -> bool:
        return self.abs_max_val.numel() > 0

    def _observe(self, x):
        amax = _channels_first(x, self.ch_axis).abs().amax(dim=1).to(torch.float32)
        self._check_finite(amax)
        if not self.observed:
            self.abs_max_val = amax
            return
        if amax.numel() != self.abs_max_val.numel():
            raise ValueError(f"{type(self).__name__} saw {self.abs_max_val.numel()} channels along axis "
                             f"{self.ch_axis} before and {amax.numel()} now")
        self.abs_max_val.copy_(torch.maximum(self.abs_max_val, amax))

    def abs_max(self) -> torch.Tensor:
        """max |x| per channel, float32 [C] (a copy)."""
        if not self.observed:
            raise self._no_data()
        return self.abs_max_val.clone()

    def calculate_qparams(self):
        raise NotImplementedError("PerChannelAbsMaxObserver records SmoothQuant statistics only: use abs_max()")

    def extra_repr(self):
        return f"ch_axis={self.ch_axis}"


class PlaceholderObserver(Observer):
    """Records nothing: marks an activation quantized at run time (dynamic), with the dtype and
    range given here and qparams computed per call."""

    def __init__(self, dtype=torch.quint8, qscheme=torch.per_tensor_affine, reduce_range=False,
                 quant_min=None, quant_max=None, eps=_FLOAT32_EPS, is_dynamic=True):
        super().__init__(dtype, qscheme, reduce_range, quant_min, quant_max, eps)
        if not isinstance(is_dynamic, bool):
            raise TypeError(f"is_dynamic must be a bool, got {type(is_dynamic).__name__}")
        self.is_dynamic = is_dynamic

    def _observe(self, x):
        pass

    def calculate_qparams(self):
        raise RuntimeError("PlaceholderObserver records no statistics: its activations are quantized per call "
                           "(choose_qparams on each input's own min/max)")

    def extra_repr(self):
        return super().extra_repr() + f", is_dynamic={self.is_dynamic}"


class HistogramObserver(Observer):
    """A histogram of everything seen, over a range that grows with the data; the clipping range is
    chosen from it when qparams are asked for.

    * Growth: when a batch falls outside the current range, the old histogram is re-binned into
      the new [min, max] by linear interpolation of its cumulative counts (counts spread uniformly
      inside each old bin), then the batch's own histogram over the new range is added.
    * ``method="l2"``: the range [lo, hi] minimising the expected squared quantization error
      ``sum_{x<lo} (x-lo)^2 + sum_{x>hi} (x-hi)^2 + n_inside * step^2 / 12`` with
      ``step = (hi - lo) / (quant_max - quant_min)``, over all bin-aligned ranges (both widened to
      include 0, as the qparams are; a single threshold for symmetric schemes). Exact over the
      candidates, unlike torch's greedy ``_non_linear_param_search``, and it counts the levels
      ``reduce_range`` leaves.
    * ``method="percentile"``: lo / hi are the (100 - percentile)-th and percentile-th percentiles
      of the histogram's distribution (linear inside a bin).
    """

    _METHODS = ("l2", "percentile")

    def __init__(self, bins=2048, method="l2", percentile=99.99, dtype=torch.quint8,
                 qscheme=torch.per_tensor_affine, reduce_range=False, quant_min=None, quant_max=None,
                 eps=_FLOAT32_EPS):
        if isinstance(bins, bool) or not isinstance(bins, int) or bins < 2:
            raise ValueError(f"bins must be an int >= 2, got {bins!r}")
        if method not in self._METHODS:
            raise ValueError(f"method must be one of {self._METHODS}, got {method!r}")
        if isinstance(percentile, bool) or not isinstance(percentile, (int, float)) or not 50 < percentile <= 100:
            raise ValueError(f"percentile must be in (50, 100], got {percentile!r}")
        super().__init__(dtype, qscheme, reduce_range, quant_min, quant_max, eps)
        self.bins = bins
        self.method = method
        self.percentile = float(percentile)
        self.register_buffer("histogram", torch.zeros(bins, dtype=torch.float64))
        self.register_buffer("min_val", torch.tensor(float("inf")))
        self.register_buffer("max_val", torch.tensor(float("-inf")))

    @property
    def observed(self) -> bool:
        return bool(torch.isfinite(self.min_val).all())

    def _observe(self, x):
        x = x.to(torch.float32)
        lo, hi = torch.aminmax(x)
        self._check_finite(lo, hi)
        if self.observed:
            new_lo, new_hi = torch.minimum(lo, self.min_val), torch.maximum(hi, self.max_val)
            if new_lo != self.min_val or new_hi != self.max_val:
                self.histogram.copy_(self._rebin(float(new_lo), float(new_hi)))
        else:
            new_lo, new_hi = lo, hi
        self.min_val.copy_(new_lo)
        self.max_val.copy_(new_hi)
        self.histogram.add_(self._histogram_of(x).to(torch.float64))

    def _histogram_of(self, x: torch.Tensor) -> torch.Tensor:
        lo, hi = float(self.min_val), float(self.max_val)
        if lo == hi:                 # a single value so far: all counts in bin 0
            counts = torch.zeros(self.bins, dtype=torch.float64)
            counts[0] = x.numel()
            return counts
        return torch.histc(x, self.bins, min=lo, max=hi)

    def _edges(self, lo: float, hi: float) -> torch.Tensor:
        return torch.linspace(lo, hi, self.bins + 1, dtype=torch.float64)

    def _rebin(self, new_lo: float, new_hi: float) -> torch.Tensor:
        """The current histogram expressed over bins of [new_lo, new_hi] (which contains the old range)."""
        old_lo, old_hi = float(self.min_val), float(self.max_val)
        new_edges = self._edges(new_lo, new_hi)
        if old_lo == old_hi:         # a point mass
            index = min(int((old_lo - new_lo) / (new_hi - new_lo) * self.bins), self.bins - 1)
            out = torch.zeros(self.bins, dtype=torch.float64)
            out[index] = self.histogram.sum()
            return out
        cum = torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum(self.histogram, 0)])
        pos = ((new_edges - old_lo) / (old_hi - old_lo) * self.bins).clamp(0, self.bins)
        left = pos.floor().long().clamp(max=self.bins - 1)
        frac = pos - left
        cum_new = cum[left] + frac * (cum[left + 1] - cum[left])
        return torch.diff(cum_new).clamp_(min=0)

    def calculate_qparams(self):
        if not self.observed:
            raise self._no_data()
        if float(self.min_val) == float(self.max_val):
            return self._qparams(self.min_val, self.max_val)
        lo, hi = self._percentile_range() if self.method == "percentile" else self._l2_range()
        return self._qparams(torch.tensor(lo), torch.tensor(hi))

    def clipping_range(self) -> tuple[float, float]:
        """The [lo, hi] the chosen method clips to (before widening to include 0)."""
        if not self.observed:
            raise self._no_data()
        if float(self.min_val) == float(self.max_val):
            return float(self.min_val), float(self.max_val)
        return self._percentile_range() if self.method == "percentile" else self._l2_range()

    def _percentile_range(self) -> tuple[float, float]:
        lo_edge, hi_edge = float(self.min_val), float(self.max_val)
        cum = torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum(self.histogram, 0)])
        total = float(cum[-1])
        width = (hi_edge - lo_edge) / self.bins

        def at(q: float) -> float:
            target = torch.tensor(q / 100.0 * total, dtype=torch.float64)
            i = int(torch.searchsorted(cum, target, right=False).clamp(1, self.bins)) - 1  # bin i holds it
            count = float(cum[i + 1] - cum[i])
            frac = 0.0 if count == 0 else (float(target) - float(cum[i])) / count
            return lo_edge + (i + min(max(frac, 0.0), 1.0)) * width

        return at(100.0 - self.percentile), at(self.percentile)

    def _l2_range(self) -> tuple[float, float]:
        h = self.histogram
        lo_edge, hi_edge = float(self.min_val), float(self.max_val)
        width = (hi_edge - lo_edge) / self.bins
        edges = self._edges(lo_edge, hi_edge)
        centers = (edges[:-1] + edges[1:]) / 2
        levels = float(self.quant_max - self.quant_min)
        if self.qscheme in SYMMETRIC_SCHEMES:
            return self._l2_symmetric(h, centers, width, levels)
        # prefix sums of count, count*c, count*c^2 (index k: bins [0, k)); a bin's spread about its
        # centre adds width^2/12 per value clipped
        zero = torch.zeros(1, dtype=torch.float64)
        s0 = torch.cat([zero, torch.cumsum(h, 0)])
        s1 = torch.cat([zero, torch.cumsum(h * centers, 0)])
        s2 = torch.cat([zero, torch.cumsum(h * (centers * centers + width * width / 12), 0)])
        total0, total1, total2 = s0[-1], s1[-1], s2[-1]
        # candidate lo: edge k clips bins [0, k); candidate hi: edge k clips bins [k, bins)
        cand = torch.arange(self.bins + 1)
        lo_vals = torch.clamp(edges, max=0.0)
        hi_vals = torch.clamp(edges, min=0.0)
        below = s2 - 2 * lo_vals * s1 + lo_vals * lo_vals * s0                       # error of clipping [0, k) to lo
        above = (total2 - s2) - 2 * hi_vals * (total1 - s1) + hi_vals * hi_vals * (total0 - s0)
        # lo beyond the first edge >= 0 (or hi before the last edge <= 0) only repeats lo = 0 (hi = 0)
        # with a worse error, so the candidates stop there
        k0 = min(int(torch.searchsorted(edges, torch.tensor(0.0, dtype=torch.float64))), self.bins)
        k1 = max(int(torch.searchsorted(edges, torch.tensor(0.0, dtype=torch.float64), right=True)) - 1, 0)
        j = cand[None, k1:]
        best = (math.inf, 0, self.bins)
        chunk = max(1, (1 << 20) // (self.bins + 1 - k1))
        for start in range(0, k0 + 1, chunk):
            stop = min(start + chunk, k0 + 1)
            i = cand[start:stop, None]
            span = hi_vals[None, k1:] - lo_vals[start:stop, None]
            inside = (s0[None, k1:] - s0[start:stop, None]).clamp(min=0)
            err = below[start:stop, None] + above[None, k1:] + inside * (span / levels) ** 2 / 12
            err = torch.where((j > i) & (span > 0), err, torch.full_like(err, math.inf))
            k = int(torch.argmin(err))
            value = float(err.reshape(-1)[k])
            if value < best[0]:
                best = (value, start + k // err.shape[1], k1 + k % err.shape[1])
        _, i, j = best
        return float(edges[i]), float(edges[j])

    def _l2_symmetric(self, h, centers, width, levels) -> tuple[float, float]:
        """A single threshold T, range [-T, T]; candidates are the |edges|."""
        mags = centers.abs()
        order = torch.argsort(mags)
        m_sorted, h_sorted = mags[order], h[order]
        zero = torch.zeros(1, dtype=torch.float64)
        s0 = torch.cat([zero, torch.cumsum(h_sorted, 0)])
        s1 = torch.cat([zero, torch.cumsum(h_sorted * m_sorted, 0)])
        s2 = torch.cat([zero, torch.cumsum(h_sorted * (m_sorted * m_sorted + width * width / 12), 0)])
        edges = self._edges(float(self.min_val), float(self.max_val))
        thresholds = torch.unique(torch.cat([edges.abs(), m_sorted[-1:] + width / 2]))
        thresholds = thresholds[thresholds > 0]
        k = torch.searchsorted(m_sorted.contiguous(), thresholds, right=True)      # bins with |c| <= T inside
        inside = s0[k]
        clipped = (s2[-1] - s2[k]) - 2 * thresholds * (s1[-1] - s1[k]) + thresholds ** 2 * (s0[-1] - s0[k])
        err = clipped + inside * (2 * thresholds / levels) ** 2 / 12
        t = float(thresholds[int(torch.argmin(err))])
        return -t, t

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        key = prefix + "histogram"
        if key in state_dict and state_dict[key].shape != self.histogram.shape:
            error_msgs.append(f"{key}: saved with {state_dict[key].numel()} bins, this HistogramObserver has "
                              f"{self.bins}")
            return
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)

    def extra_repr(self):
        return (f"bins={self.bins}, method={self.method!r}, percentile={self.percentile}, " + super().extra_repr()
                + f", min_val={self.min_val.item()}, max_val={self.max_val.item()}")
