"""GPT-2 small with Hugging Face's structure and names (wte/wpe, pre-LN blocks, fused qkv
``c_attn`` and ``c_proj`` as Conv1D — a linear layer with weight stored (in, out) applied by
``addmm`` — causal self-attention through SDPA, GELU(tanh) MLP, ``ln_f``, ``lm_head`` tied to
``wte``), random weights initialised like HF's (normal std 0.02, residual projections scaled by
1/sqrt(2 n_layer)). Returns logits (B, S, vocab).

Without ``attention_mask`` attention is ``scaled_dot_product_attention(is_causal=True)``. With one
(1 = token, 0 = padding), the causal and padding masks are combined into an additive mask."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ._common import check_size


@dataclass(frozen=True)
class GPT2Config:
    vocab_size: int = 50257
    n_positions: int = 1024
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    layer_norm_epsilon: float = 1e-5
    dropout: float = 0.1
    initializer_range: float = 0.02


SIZES = {
    "full": GPT2Config(),
    "small": GPT2Config(vocab_size=1000, n_positions=64, n_embd=128, n_layer=2, n_head=4),
}


class Conv1D(nn.Module):
    """HF's Conv1D: a linear layer whose weight is (in_features, out_features)."""

    def __init__(self, nf: int, nx: int):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.empty(nx, nf))
        self.bias = nn.Parameter(torch.zeros(nf))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x):
        out_shape = x.shape[:-1] + (self.nf,)
        x = torch.addmm(self.bias, x.view(-1, x.shape[-1]), self.weight)
        return x.view(out_shape)


class GPT2Attention(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.n_head, self.head_dim = cfg.n_head, cfg.n_embd // cfg.n_head
        self.c_attn = Conv1D(3 * cfg.n_embd, cfg.n_embd)
        self.c_proj = Conv1D(cfg.n_embd, cfg.n_embd)
        self.attn_dropout_p = cfg.dropout
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x, mask=None):
        b, s, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (t.view(b, s, self.n_head, self.head_dim).transpose(1, 2) for t in (q, k, v))
        p = self.attn_dropout_p if self.training else 0.0
        if mask is None:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)
        y = y.transpose(1, 2).reshape(b, s, c)
        return self.resid_dropout(self.c_proj(y))


class GPT2MLP(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.c_fc = Conv1D(4 * cfg.n_embd, cfg.n_embd)
        self.c_proj = Conv1D(cfg.n_embd, 4 * cfg.n_embd)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))


class GPT2Block(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.attn = GPT2Attention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.mlp = GPT2MLP(cfg)

    def forward(self, x, mask=None):
        x = x + self.attn(self.ln_1(x), mask)
        return x + self.mlp(self.ln_2(x))


class GPT2LMHeadModel(nn.Module):
    def __init__(self, cfg: GPT2Config = GPT2Config()):
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.n_positions, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.h = nn.ModuleList(GPT2Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.register_buffer("position_ids", torch.arange(cfg.n_positions).unsqueeze(0), persistent=False)
        nn.init.normal_(self.wte.weight, std=cfg.initializer_range)
        nn.init.normal_(self.wpe.weight, std=cfg.initializer_range)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("c_proj.weight"):  # HF: scale residual projections
                    p.normal_(0.0, cfg.initializer_range / math.sqrt(2 * cfg.n_layer))
        self.lm_head.weight = self.wte.weight  # tied

    def causal_padding_mask(self, attention_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """(B, S) 1/0 padding mask -> (B, 1, S, S) additive mask, causal and padding combined.
        A padded query with left padding would have no key left to attend to (softmax of an
        all-masked row is NaN), so every query may always attend to itself."""
        s = attention_mask.shape[1]
        causal = torch.ones(s, s, dtype=torch.bool, device=attention_mask.device).tril()
        allowed = causal[None, None] & attention_mask[:, None, None, :].bool()
        allowed = allowed | torch.eye(s, dtype=torch.bool, device=attention_mask.device)
        zero = torch.zeros((), dtype=dtype, device=attention_mask.device)
        return torch.where(allowed, zero, torch.finfo(dtype).min)

    def forward(self, input_ids, attention_mask=None):
        s = input_ids.shape[1]
        x = self.drop(self.wte(input_ids) + self.wpe(self.position_ids[:, :s]))
        mask = None if attention_mask is None else self.causal_padding_mask(attention_mask, x.dtype)
        for block in self.h:
            x = block(x, mask)
        return self.lm_head(self.ln_f(x))


def make(size: str = "full") -> GPT2LMHeadModel:
    return GPT2LMHeadModel(SIZES[check_size(size)])


def build(size: str = "full", seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    return make(size).eval()


gpt2_small = build
