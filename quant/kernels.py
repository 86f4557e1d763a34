"""The int8 kernel families the x86 backend chooses from per layer (names are the routing table's
backends), and the kernel interface they share (:mod:`cpu_opt.backends.int8`, re-exported here):

``fbgemm``        torch's FBGEMM ops (``quantized::linear*``, ``quantized::conv2d*``): :mod:`cpu_opt.backends.fbgemm`
``torch_onednn``  torch's oneDNN 3.12 (``onednn::qlinear_pointwise``, ``onednn::qconv2d_pointwise``):
                  :mod:`cpu_opt.backends.torch_onednn`
``onednn``        cpu_opt's own oneDNN 3.2 binding (``cpu_opt.dnnl.primitives.Matmul`` / ``Conv2d``):
                  :mod:`cpu_opt.backends.onednn_primitives`
``amx``           cpu_opt's own int8 GEMM on AMX tiles (linear only, CPUs with AMX-INT8):
                  :mod:`cpu_opt.backends.amx_linear`
``torch``         a layer kept in torch: FBGEMM's kernel class stands in (it is the reference path)
"""
from __future__ import annotations

from cpu_opt.backends.amx_linear import AmxLinear
from cpu_opt.backends.fbgemm import FbgemmConv2d, FbgemmLinear
from cpu_opt.backends.int8 import (FAMILIES, POST_OPS, Conv2dKernel, LinearKernel, activation_qmax, as_u8,  # noqa: F401
                                   chain_u8, from_u8, full_range, input_u8, quantize_input, warn_if_saturating)
from cpu_opt.backends.onednn_primitives import DnnlConv2d, DnnlLinear
from cpu_opt.backends.torch_onednn import TorchOnednnConv2d, TorchOnednnLinear

__all__ = ["AmxLinear", "CONV_KERNELS", "FAMILIES", "LINEAR_KERNELS", "POST_OPS", "Conv2dKernel", "DnnlConv2d", "DnnlLinear", "FbgemmConv2d",
           "FbgemmLinear", "LinearKernel", "TorchOnednnConv2d", "TorchOnednnLinear", "activation_qmax", "as_u8",
           "chain_u8", "from_u8", "full_range", "input_u8", "quantize_input", "warn_if_saturating"]

LINEAR_KERNELS = {"fbgemm": FbgemmLinear, "torch_onednn": TorchOnednnLinear, "onednn": DnnlLinear,
                  "amx": AmxLinear, "torch": FbgemmLinear}
CONV_KERNELS = {"fbgemm": FbgemmConv2d, "torch_onednn": TorchOnednnConv2d, "onednn": DnnlConv2d,
                "torch": FbgemmConv2d}
