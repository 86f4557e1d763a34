"""cpu_opt.quant — int8 post-training quantization for x86 CPUs.

::

    from cpu_opt import quant
    prepared = quant.prepare(model, quant.default_qconfig_mapping(), example_inputs)
    quant.calibrate(prepared, calibration_batches)      # or call prepared(...) yourself
    int8_model = quant.convert(prepared)
    quant.report(int8_model)                            # which layer runs on which kernel, and why

    # in one call, with activations fused and int8 layers chained through the graph:
    fast = cpu_opt.optimize(model, example_inputs, dtype="int8", calibration_data=calibration_batches)

    quant.quantize_dynamic(model)        # int8 weights, activations quantized per call
    quant.quantize_weight_only(model)    # int8 weights, float activations (LLM decode)

Kernels per layer (``kernels``): FBGEMM, torch's oneDNN 3.12 and cpu_opt's own oneDNN 3.2 binding,
picked by ``cpu_opt.routing`` (table, measured profile) or by timing with ``autotune=True``.
"""
from .api import (QuantizationError, calibrate, choose_family, convert, prepare, quantize_dynamic,
                  quantize_weight_only, report)
from .observer import (HistogramObserver, MinMaxObserver, MovingAverageMinMaxObserver, Observer,
                       PerChannelAbsMaxObserver, PerChannelMinMaxObserver, PlaceholderObserver, dequantize, quantize)
from .qconfig import (QConfig, QConfigMapping, default_qconfig_mapping, dynamic_qconfig, static_qconfig,
                      transformer_qconfig_mapping, weight_only_qconfig)

__all__ = [
    "prepare", "calibrate", "convert", "quantize_dynamic", "quantize_weight_only", "report", "choose_family",
    "QuantizationError", "QConfig", "QConfigMapping", "default_qconfig_mapping", "transformer_qconfig_mapping",
    "static_qconfig", "dynamic_qconfig", "weight_only_qconfig", "Observer", "MinMaxObserver",
    "MovingAverageMinMaxObserver", "PerChannelMinMaxObserver", "HistogramObserver", "PerChannelAbsMaxObserver",
    "PlaceholderObserver", "quantize", "dequantize",
]
