"""Helpers shared by the zoo's model files: deterministic initialisation and BatchNorm
calibration, so that eval-mode BatchNorm carries non-trivial running statistics."""
from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def calibrate_batchnorm(model: nn.Module, example: torch.Tensor, *, perturb: bool = True) -> nn.Module:
    """Give every BatchNorm realistic running statistics: one forward pass in train mode over
    ``example`` (momentum 1: the stats become that batch's mean and variance), then, with
    ``perturb``, shift each running mean by N(0, 0.1) running std, scale each running variance by
    U(0.7, 1.3), scale gamma by U(0.8, 1.2) and shift beta by N(0, 0.05), so folding BN into a
    convolution has to get all four parameters right (a BN after a zero-mean input would otherwise
    keep a running mean of ~0). Leaves the model in eval mode."""
    bns = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    saved = [bn.momentum for bn in bns]
    for bn in bns:
        bn.momentum = 1.0
        bn.reset_running_stats()
    model.train()
    model(example)
    for bn, mom in zip(bns, saved):
        bn.momentum = mom
        if perturb:
            std = bn.running_var.sqrt()
            bn.running_mean.add_(torch.randn_like(bn.running_mean) * 0.1 * std)
            bn.running_var.mul_(torch.empty_like(bn.running_var).uniform_(0.7, 1.3))
        if perturb and bn.affine:
            bn.weight.mul_(torch.empty_like(bn.weight).uniform_(0.8, 1.2))
            bn.bias.add_(torch.randn_like(bn.bias) * 0.05)
    return model.eval()


def check_size(size: str) -> str:
    if size not in ("full", "small"):
        raise ValueError(f"size must be 'full' or 'small', got {size!r}")
    return size
