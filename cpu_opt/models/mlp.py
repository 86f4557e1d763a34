"""A plain multilayer perceptron: Linear layers with ReLU, GELU and SiLU between them (one
activation of each kind, so all three fusions get exercised), PyTorch's default Linear init."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ._common import check_size


@dataclass(frozen=True)
class MLPConfig:
    in_features: int = 1024
    hidden: tuple[int, ...] = (4096, 4096, 1024)
    out_features: int = 1000
    activations: tuple[str, ...] = ("relu", "gelu", "silu")


SIZES = {"full": MLPConfig(),
         "small": MLPConfig(in_features=64, hidden=(256, 256, 128), out_features=10)}
_ACTS = {"relu": nn.ReLU, "gelu": nn.GELU, "silu": nn.SiLU}


class MLP(nn.Sequential):
    def __init__(self, cfg: MLPConfig = MLPConfig()):
        if len(cfg.activations) != len(cfg.hidden):
            raise ValueError(f"need one activation per hidden layer: {len(cfg.hidden)} hidden, "
                             f"{len(cfg.activations)} activations")
        layers: list[nn.Module] = []
        dims = (cfg.in_features, *cfg.hidden)
        for i, act in enumerate(cfg.activations):
            layers += [nn.Linear(dims[i], dims[i + 1]), _ACTS[act]()]
        layers.append(nn.Linear(dims[-1], cfg.out_features))
        super().__init__(*layers)
        self.config = cfg


def make(size: str = "full") -> MLP:
    return MLP(SIZES[check_size(size)])


def build(size: str = "full", seed: int = 0) -> MLP:
    torch.manual_seed(seed)
    return make(size).eval()


mlp = build
