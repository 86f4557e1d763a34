"""Linear and Conv2d replacements that run on ACL through torch's oneDNN ops, weights prepared once.

``PackedLinear`` has two ways to run, chosen by :func:`cpu_opt.graviton.optimize_for_arm`:

* ``"packed"``: the weight is reordered once, at construction, into the layout oneDNN's ACL
  inner product wants (``torch.ops.mkldnn._reorder_linear_weight``), and every call runs
  ``torch.ops.mkldnn._linear_pointwise`` on it, bias fused: no per-call weight reorder. Used for
  fp32, and for bf16 fast-math when the process default fpmath is bf16 (then the packed layout
  itself is bf16). torch's run-time fast-math switch does not reach this op: packed in fp32
  layout it stays fp32.
* ``"matmul"``: ``x @ W.T`` (+ bias), which torch's run-time switch sends to oneDNN's ACL matmul
  with ``attr-fpmath:bf16``. oneDNN converts the weight to its bf16 layout on every call:
  the price of fast-math without the process-wide default.

``PackedConv2d`` reorders the weight once (``torch.ops.mkldnn._reorder_convolution_weight``) for
the example input's shape and runs ``torch.ops.mkldnn._convolution_pointwise``; the run-time
switch (``conv.fp32_precision``) gives it ``attr-fpmath:bf16``.

Both are inference-only (no autograd through the packed ops) and fall back to the plain torch op,
counted in ``fallback_calls``, for inputs the packed op does not take (not fp32, not CPU).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

LINEAR_MODES = ("packed", "matmul")


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear, mode: str = "packed", batch_hint: int | None = None):
        super().__init__()
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"linear must be an nn.Linear, got {type(linear).__name__}")
        if mode not in LINEAR_MODES:
            raise ValueError(f"mode={mode!r}: expected one of {LINEAR_MODES}")
        if linear.weight.dtype != torch.float32:
            raise TypeError(f"PackedLinear takes fp32 weights, got {linear.weight.dtype}")
        self.in_features, self.out_features, self.mode = linear.in_features, linear.out_features, mode
        # The dense parameters stay (state_dict, fallback); the packed copy is not a buffer:
        # an opaque oneDNN tensor is neither picklable nor meaningful outside this process.
        self.weight = linear.weight
        self.bias = linear.bias
        self.fallback_calls = 0
        self._packed = None
        if mode == "packed":
            with torch.no_grad():
                w = linear.weight.detach().contiguous()
                self._packed = (torch.ops.mkldnn._reorder_linear_weight(w, batch_hint) if batch_hint
                                else torch.ops.mkldnn._reorder_linear_weight(w))
            self._bias = None if linear.bias is None else linear.bias.detach().contiguous()

    def _takes(self, x: torch.Tensor) -> bool:
        return x.dtype == torch.float32 and x.device.type == "cpu" and x.layout == torch.strided and x.dim() >= 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self._takes(x):
            self.fallback_calls += 1
            return F.linear(x, self.weight, self.bias)
        if self.mode == "packed":
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self._packed, self._bias, "none", [], "")
        y = torch.matmul(x, self.weight.t())
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, mode={self.mode}"


class PackedConv2d(nn.Module):
    def __init__(self, conv: nn.Conv2d, input_size):
        super().__init__()
        if not isinstance(conv, nn.Conv2d):
            raise TypeError(f"conv must be an nn.Conv2d, got {type(conv).__name__}")
        if conv.padding_mode != "zeros" or isinstance(conv.padding, str):
            raise ValueError(f"PackedConv2d needs numeric zero padding, got padding={conv.padding!r}, "
                             f"padding_mode={conv.padding_mode!r}")
        if conv.weight.dtype != torch.float32:
            raise TypeError(f"PackedConv2d takes fp32 weights, got {conv.weight.dtype}")
        input_size = [int(s) for s in input_size]
        if len(input_size) != 4:
            raise ValueError(f"input_size must be N,C,H,W, got {input_size}")
        self.padding, self.stride = list(conv.padding), list(conv.stride)
        self.dilation, self.groups = list(conv.dilation), conv.groups
        self.weight, self.bias = conv.weight, conv.bias
        self.in_channels, self.out_channels, self.kernel_size = conv.in_channels, conv.out_channels, conv.kernel_size
        self.fallback_calls = 0
        with torch.no_grad():
            self._packed = torch.ops.mkldnn._reorder_convolution_weight(
                conv.weight.detach().contiguous(), self.padding, self.stride, self.dilation, self.groups, input_size)
        self._bias = None if conv.bias is None else conv.bias.detach().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() == 4 and x.layout == torch.strided):
            self.fallback_calls += 1
            return F.conv2d(x, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups)
        return torch.ops.mkldnn._convolution_pointwise(
            x, self._packed, self._bias, self.padding, self.stride, self.dilation, self.groups, "none", [], "")

    def extra_repr(self) -> str:
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={tuple(self.kernel_size)}, "
                f"stride={tuple(self.stride)}, padding={tuple(self.padding)}")
