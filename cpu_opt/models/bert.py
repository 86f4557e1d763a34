"""A BERT-base encoder with Hugging Face's structure and parameter names (embeddings: word +
position + token type, LayerNorm, dropout; 12 layers of self-attention and GELU(erf) MLP, post-LN;
a tanh pooler), random weights initialised like HF's (normal std 0.02, LayerNorm 1/0).

The padding ``attention_mask`` (1 = token, 0 = padding) becomes an additive mask
``(1 - mask) * finfo.min`` broadcast over heads and query positions, as HF does.
``attn_impl="sdpa"`` (default) calls ``F.scaled_dot_product_attention``; ``"explicit"`` spells out
matmul, scale, add mask, softmax, dropout, matmul."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ._common import check_size
from .outputs import BaseModelOutputWithPooling


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int = 30522
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    layer_norm_eps: float = 1e-12
    initializer_range: float = 0.02
    attn_impl: str = "sdpa"


SIZES = {
    "full": BertConfig(),
    "small": BertConfig(vocab_size=1000, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=512, max_position_embeddings=64),
}
ATTN_IMPLS = ("sdpa", "explicit")


class BertEmbeddings(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size, padding_idx=0)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.hidden_dropout_prob)
        self.register_buffer("position_ids", torch.arange(cfg.max_position_embeddings).unsqueeze(0),
                             persistent=False)

    def forward(self, input_ids, token_type_ids=None):
        seq = input_ids.shape[1]
        position_ids = self.position_ids[:, :seq]
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        x = (self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
             + self.position_embeddings(position_ids))
        return self.dropout(self.LayerNorm(x))


class BertSelfAttention(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        if cfg.hidden_size % cfg.num_attention_heads:
            raise ValueError(f"hidden_size {cfg.hidden_size} is not a multiple of "
                             f"num_attention_heads {cfg.num_attention_heads}")
        if cfg.attn_impl not in ATTN_IMPLS:
            raise ValueError(f"attn_impl must be one of {ATTN_IMPLS}, got {cfg.attn_impl!r}")
        self.num_heads = cfg.num_attention_heads
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.query = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.key = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.value = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.dropout_p = cfg.attention_probs_dropout_prob
        self.dropout = nn.Dropout(cfg.attention_probs_dropout_prob)
        self.attn_impl = cfg.attn_impl

    def _heads(self, x):  # (B, S, H*D) -> (B, H, S, D)
        b, s, _ = x.shape
        return x.view(b, s, self.num_heads, self.head_dim).transpose(1, 2)

    def forward(self, hidden, mask):
        q, k, v = self._heads(self.query(hidden)), self._heads(self.key(hidden)), self._heads(self.value(hidden))
        if self.attn_impl == "sdpa":
            ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                 dropout_p=self.dropout_p if self.training else 0.0)
        else:
            scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.head_dim)
            if mask is not None:
                scores = scores + mask
            probs = self.dropout(torch.softmax(scores, dim=-1))
            ctx = torch.matmul(probs, v)
        b, h, s, d = ctx.shape
        return ctx.transpose(1, 2).reshape(b, s, h * d)


class BertSelfOutput(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.hidden_dropout_prob)

    def forward(self, hidden, residual):
        return self.LayerNorm(self.dropout(self.dense(hidden)) + residual)


class BertAttention(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.self = BertSelfAttention(cfg)
        self.output = BertSelfOutput(cfg)

    def forward(self, hidden, mask):
        return self.output(self.self(hidden, mask), hidden)


class BertIntermediate(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, hidden):
        return F.gelu(self.dense(hidden))  # erf GELU, HF's "gelu"


class BertOutput(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.hidden_dropout_prob)

    def forward(self, hidden, residual):
        return self.LayerNorm(self.dropout(self.dense(hidden)) + residual)


class BertLayer(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.attention = BertAttention(cfg)
        self.intermediate = BertIntermediate(cfg)
        self.output = BertOutput(cfg)

    def forward(self, hidden, mask):
        attn = self.attention(hidden, mask)
        return self.output(self.intermediate(attn), attn)


class BertEncoder(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.num_hidden_layers))

    def forward(self, hidden, mask):
        for layer in self.layer:
            hidden = layer(hidden, mask)
        return hidden


class BertPooler(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.activation = nn.Tanh()

    def forward(self, hidden):
        return self.activation(self.dense(hidden[:, 0]))


class BertModel(nn.Module):
    def __init__(self, cfg: BertConfig = BertConfig()):
        super().__init__()
        self.config = cfg
        self.embeddings = BertEmbeddings(cfg)
        self.encoder = BertEncoder(cfg)
        self.pooler = BertPooler(cfg)
        self.apply(self._init_weights)

    def _init_weights(self, m: nn.Module) -> None:  # HF's BertPreTrainedModel._init_weights
        std = self.config.initializer_range
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, 0.0, std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, 0.0, std)
            if m.padding_idx is not None:
                with torch.no_grad():
                    m.weight[m.padding_idx].zero_()
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)

    def extended_attention_mask(self, attention_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """(B, S) 1/0 padding mask -> (B, 1, 1, S) additive mask: 0 where attended, finfo.min where not."""
        ext = attention_mask[:, None, None, :].to(dtype)
        return (1.0 - ext) * torch.finfo(dtype).min

    def forward(self, input_ids, attention_mask=None, token_type_ids=None) -> BaseModelOutputWithPooling:
        hidden = self.embeddings(input_ids, token_type_ids)
        mask = None
        if attention_mask is not None:
            mask = self.extended_attention_mask(attention_mask, hidden.dtype)
        hidden = self.encoder(hidden, mask)
        return BaseModelOutputWithPooling(last_hidden_state=hidden, pooler_output=self.pooler(hidden))


def make(size: str = "full", attn_impl: str = "sdpa", **overrides) -> BertModel:
    from dataclasses import replace

    return BertModel(replace(SIZES[check_size(size)], attn_impl=attn_impl, **overrides))


def build(size: str = "full", attn_impl: str = "sdpa", seed: int = 0, **overrides) -> BertModel:
    torch.manual_seed(seed)
    return make(size, attn_impl, **overrides).eval()


def bert_base(size: str = "full", attn_impl: str = "sdpa", seed: int = 0) -> BertModel:
    return build(size, attn_impl, seed)
