"""The model zoo: real architectures in plain ``torch.nn`` with seeded random weights, for tests
(``size="small"``) and benchmarks (``size="full"``). No downloads, no torchvision/transformers.

``ZOO[name]`` is a :class:`ModelSpec`::

    spec = ZOO["bert_base"]
    model = spec.build("small")                  # eval mode, deterministic weights
    inputs = spec.example_inputs(2, "small")     # tuple (call model(*inputs)) or dict (model(**inputs))
    out = spec.call(model, inputs)
    spec.gemm_flops(2, "small")                  # FLOPs of one forward (matmuls, convs, attention)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable

import torch
from torch import nn

from . import bert, gpt2, mlp, mobilenetv3, resnet, vit
from ._common import check_size
from .outputs import BaseModelOutputWithPooling, ModelOutput

Inputs = "tuple[torch.Tensor, ...] | dict[str, torch.Tensor]"


@dataclass(frozen=True)
class ModelSpec:
    """One zoo entry.

    kind: "vision" (image batch, tuple input), "text" (token ids, dict input) or "tabular"
      (feature vectors, tuple input).
    build(size) -> the model in eval mode, weights seeded (same weights on every call).
    example_inputs(batch, size) -> seeded inputs: images 224 (full) / 64 (small); text sequences
      of 128 (full) / 32 (small) tokens, with right padding in rows 1.. when batch > 1.
    gemm_flops(batch, size) -> FLOPs (2 x multiply-adds) of one forward in matmuls, linears,
      convolutions and attention, counted by torch's FlopCounterMode on a meta-device copy.
    gemm_bound: whether the model's time should be dominated by GEMM-like work (so "fraction of
      GEMM peak" means something for it).
    """
    name: str
    kind: str
    build: Callable[..., nn.Module] = field(repr=False)
    example_inputs: Callable[[int, str], object] = field(repr=False)
    make: Callable[[str], nn.Module] = field(repr=False)  # unseeded, uncalibrated; meta-device safe
    gemm_bound: bool = True
    description: str = ""

    def call(self, model: Callable, inputs):
        """Run ``model`` on inputs as returned by :meth:`example_inputs` (tuple or dict)."""
        return model(**inputs) if isinstance(inputs, dict) else model(*inputs)

    def gemm_flops(self, batch: int = 1, size: str = "full") -> float:
        return batch * _flops_per_sample(self.name, size)


@lru_cache(maxsize=None)
def _flops_per_sample(name: str, size: str) -> float:
    from torch.utils.flop_counter import FlopCounterMode

    spec = ZOO[name]
    with torch.device("meta"):
        model = spec.make(size).eval()
    inputs = spec.example_inputs(1, size)
    if isinstance(inputs, dict):
        inputs = {k: v.to("meta") for k, v in inputs.items()}
    else:
        inputs = tuple(v.to("meta") for v in inputs)
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), counter:
        spec.call(model, inputs)
    return float(counter.get_total_flops())


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def image_inputs(image_size: dict[str, int]):
    def example_inputs(batch: int = 1, size: str = "full"):
        s = image_size[check_size(size)]
        return (torch.randn(batch, 3, s, s, generator=_generator(1234)),)
    return example_inputs


SEQ_LEN = {"full": 128, "small": 32}


def token_inputs(vocab: dict[str, int], with_mask: bool = True):
    """input_ids in [1, vocab) (0 is padding); attention_mask 1 for tokens, 0 for padding. Row 0
    is full length; row i of a batch of b loses i * seq // (2 b) tokens at the end."""
    def example_inputs(batch: int = 1, size: str = "full"):
        seq = SEQ_LEN[check_size(size)]
        ids = torch.randint(1, vocab[size], (batch, seq), generator=_generator(1234))
        if not with_mask:
            return {"input_ids": ids}
        lengths = torch.tensor([seq - i * seq // (2 * batch) for i in range(batch)])
        mask = (torch.arange(seq)[None, :] < lengths[:, None]).long()
        return {"input_ids": ids * mask, "attention_mask": mask}
    return example_inputs


def feature_inputs(features: dict[str, int]):
    def example_inputs(batch: int = 1, size: str = "full"):
        return (torch.randn(batch, features[check_size(size)], generator=_generator(1234)),)
    return example_inputs


def _sizes(table, key):
    return {s: (getattr(c, key) if not isinstance(c, dict) else c[key]) for s, c in table.items()}


ZOO: dict[str, ModelSpec] = {
    "resnet18": ModelSpec(
        "resnet18", "vision", build=resnet.resnet18, make=lambda size="full": resnet.make("resnet18", size),
        example_inputs=image_inputs(_sizes(resnet.SIZES, "image")),
        description="torchvision ResNet-18; small: width 16, 64x64"),
    "resnet50": ModelSpec(
        "resnet50", "vision", build=resnet.resnet50, make=lambda size="full": resnet.make("resnet50", size),
        example_inputs=image_inputs(_sizes(resnet.SIZES, "image")),
        description="torchvision ResNet-50; small: width 16, 64x64"),
    "bert_base": ModelSpec(
        "bert_base", "text", build=bert.bert_base, make=bert.make,
        example_inputs=token_inputs(_sizes(bert.SIZES, "vocab_size")),
        description="HF BERT-base encoder + pooler, SDPA attention; small: 2 layers, hidden 128, 4 heads"),
    "vit_b16": ModelSpec(
        "vit_b16", "vision", build=vit.build, make=vit.make,
        example_inputs=image_inputs(_sizes(vit.SIZES, "image_size")),
        description="ViT-B/16 (timm layout); small: 2 layers, hidden 128, 4 heads, 64x64"),
    "gpt2_small": ModelSpec(
        "gpt2_small", "text", build=gpt2.build, make=gpt2.make,
        example_inputs=token_inputs(_sizes(gpt2.SIZES, "vocab_size"), with_mask=False),
        description="HF GPT-2 small LM (causal SDPA, tied lm_head), full sequences without padding; "
                    "small: 2 layers, hidden 128, 4 heads"),
    "mobilenetv3": ModelSpec(
        "mobilenetv3", "vision", build=mobilenetv3.build, make=mobilenetv3.make, gemm_bound=False,
        example_inputs=image_inputs(_sizes(mobilenetv3.SIZES, "image")),
        description="torchvision MobileNetV3-Large; small: width 0.5, 64x64"),
    "mlp": ModelSpec(
        "mlp", "tabular", build=mlp.build, make=mlp.make,
        example_inputs=feature_inputs(_sizes(mlp.SIZES, "in_features")),
        description="1024-4096-4096-1024-1000 MLP with ReLU, GELU, SiLU; small: 64-256-256-128-10"),
}

__all__ = ["ZOO", "ModelSpec", "ModelOutput", "BaseModelOutputWithPooling",
           "bert", "gpt2", "mlp", "mobilenetv3", "resnet", "vit"]
