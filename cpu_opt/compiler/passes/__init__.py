"""Graph passes on the captured ATen-level FX graph, before lowering.

Each pass takes a GraphModule, rewrites it in place and returns a short log of what it did:

* :func:`drop_dropout` — dropout is the identity in inference
* :func:`remove_noops` — same-shape views/reshapes, ``clone``/``contiguous``/``alias``/``to`` that
  change nothing, export's tensor-metadata asserts and guards
* :func:`fold_batchnorm` — inference BatchNorm after a convolution or linear layer becomes part
  of its weights and bias
* :func:`fold_constants` — nodes computed only from parameters/buffers are computed once
* :func:`fold_linear_scale` — a constant per-output-channel scale after a linear layer (layer
  scale) becomes part of its weight and bias
* :func:`tanh_gelu` — the tanh GELU written out op by op (GPT-2) becomes one ``aten.gelu``
* :func:`residual_add_after_view` — a residual add after a GEMM's view moves before the view
* :func:`cast_params` — floating parameters and buffers converted once (bf16)
* :func:`match_operand_dtypes` — float32 operands meeting bf16 ones in a GEMM, attention or in-place
  write cast as autocast would (what a model computes in float32 on purpose: RMSNorm, RoPE)
* :func:`merge_parallel_linears` — linear layers reading one input (query, key, value) as one GEMM
  whose output they slice (float graphs; the int8 pass merges its own)
* :func:`route_linears` — GEMMs on constant weights whose route is ``torch_onednn`` become calls to
  torch's own oneDNN (``torch.ops.mkldnn._linear_pointwise``); with ``measure=True`` each weight
  shape is timed on both backends and the faster wins
* :func:`route_convs` — 3x3 stride-1 convolutions whose ``conv3x3`` route is ``native_winograd``
  become calls to cpu_opt's Winograd kernel, their ReLU or residual add and ReLU fused
* :func:`route_attention` — attention ops to the kernel the attention route names
* :func:`shared_masks` — a boolean mask several attention ops read made additive once per call
* :func:`route_gelu` — the exact GELU after a linear layer outside oneDNN Graph to cpu_opt's
  vectorized kernel

Files, one per pass family: ``cleanup.py``, ``canonical.py``, ``fold.py``, ``linear.py``, ``conv.py``, ``attention.py``,
``eltwise.py``; ``fx.py``
holds the FX helpers they share (constants of the graph, aliasing).
"""
from __future__ import annotations

import torch.fx

from .attention import route_attention, shared_masks
from .canonical import residual_add_after_view, tanh_gelu
from .cleanup import drop_dropout, remove_noops
from .conv import route_convs
from .eltwise import route_gelu
from .fold import cast_params, fold_batchnorm, fold_constants, fold_linear_scale, match_operand_dtypes
from .fx import mutated_state, storage_root, writes_in_place
from .linear import linear_operands, measure_linear, merge_parallel_linears, route_linears

__all__ = ["DEFAULT_PASSES", "cast_params", "match_operand_dtypes", "drop_dropout", "fold_batchnorm", "fold_constants", "fold_linear_scale",
           "linear_operands",
           "measure_linear", "merge_parallel_linears", "mutated_state", "remove_noops", "route_attention", "route_convs", "route_gelu", "route_linears", "run_passes", "shared_masks",
           "residual_add_after_view", "storage_root", "tanh_gelu", "writes_in_place"]

DEFAULT_PASSES = (drop_dropout, remove_noops, fold_batchnorm, fold_constants, fold_linear_scale, tanh_gelu,
                  residual_add_after_view)


def run_passes(gm: torch.fx.GraphModule, passes=DEFAULT_PASSES) -> list[str]:
    log = []
    for p in passes:
        log += p(gm)
        gm.graph.lint()
    gm.recompile()
    return log
