"""Small seeded models for the aarch64 tests: an MLP, a CNN and a transformer block.

Each entry gives the model, an example input, and how many GEMM primitives (matmul, inner
product, convolution) one forward runs through oneDNN: ``gemms_fast_math`` with bf16 fast-math
(attention matmuls routed to oneDNN too), ``gemms_layers`` for the Linear/Conv2d layers alone
(with fast-math off torch sends the attention matmuls to OpenBLAS). ``gemms_fast_math`` is a
lower bound: oneDNN may run a batched matmul as one primitive per batch element.
"""
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(64, 128)
        self.fc2 = nn.Linear(128, 128, bias=False)
        self.fc3 = nn.Linear(128, 10)

    def forward(self, x):
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, stride=2, padding=1, bias=False)
        self.head = nn.Linear(32, 128)   # 2x32x128: above torch's minimum size for oneDNN matmul

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        return self.head(x.mean(dim=(2, 3)))


class TransformerBlock(nn.Module):
    """Pre-norm block with explicit attention (q @ k^T, softmax, @ v), so every GEMM is visible."""

    def __init__(self, dim=64, heads=2, ff=128):
        super().__init__()
        self.heads, self.dh = heads, dim // heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.o = nn.Linear(dim, dim)
        self.ff1, self.ff2 = nn.Linear(dim, ff), nn.Linear(ff, dim)

    def forward(self, x):
        b, s, d = x.shape
        h = self.ln1(x)
        q, k, v = (t(h).view(b, s, self.heads, self.dh).transpose(1, 2) for t in (self.q, self.k, self.v))
        att = torch.softmax(torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.dh), dim=-1)
        y = torch.matmul(att, v).transpose(1, 2).reshape(b, s, d)
        x = x + self.o(y)
        return x + self.ff2(F.gelu(self.ff1(self.ln2(x))))


@dataclass
class Case:
    name: str
    model: nn.Module
    example: torch.Tensor
    gemms_layers: int
    gemms_fast_math: int


def make(name: str) -> Case:
    torch.manual_seed({"mlp": 1, "cnn": 2, "transformer": 3}[name])
    if name == "mlp":
        return Case(name, MLP().eval(), torch.randn(16, 64), 3, 3)
    if name == "cnn":
        return Case(name, SmallCNN().eval(), torch.randn(2, 3, 16, 16), 3, 3)
    if name == "transformer":
        return Case(name, TransformerBlock().eval(), torch.randn(2, 16, 64), 6, 8)
    raise KeyError(name)


NAMES = ("mlp", "cnn", "transformer")
