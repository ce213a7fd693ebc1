"""GPT-2: learned positions, pre-LayerNorm, GELU, fused QKV stored as Conv1D ([in, out]) weights."""

from __future__ import annotations

import torch
from torch import nn
from transformers.activations import ACT2FN

from kernels.batch import PagedBatch
from services.worker.models.base import PagedCausalLM
from services.worker.models.paged import paged_attention


class Conv1D(nn.Module):
    """A linear layer whose weight is stored transposed, as GPT-2 checkpoints have it."""

    def __init__(self, inputs: int, outputs: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(inputs, outputs))
        self.bias = nn.Parameter(torch.zeros(outputs))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.bias, x, self.weight)


class GPT2Attention(nn.Module):
    def __init__(self, config, layer_index: int):
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = hidden // self.num_heads
        self.c_attn = Conv1D(hidden, 3 * hidden)
        self.c_proj = Conv1D(hidden, hidden)
        self.scale = self.head_dim**-0.5 if config.scale_attn_weights else 1.0
        if getattr(config, "scale_attn_by_inverse_layer_idx", False):
            self.scale /= layer_index + 1

    def forward(self, hidden, kv_cache, batch: PagedBatch):
        tokens = hidden.shape[0]
        q, k, v = self.c_attn(hidden).view(tokens, 3, self.num_heads, self.head_dim).unbind(1)
        out = paged_attention(q, k, v, kv_cache, batch, self.scale)
        return self.c_proj(out.reshape(tokens, -1))


class GPT2MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        inner = config.n_inner or 4 * config.hidden_size
        self.c_fc = Conv1D(config.hidden_size, inner)
        self.c_proj = Conv1D(inner, config.hidden_size)
        self.act = ACT2FN[config.activation_function]

    def forward(self, x):
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(nn.Module):
    def __init__(self, config, layer_index: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.attn = GPT2Attention(config, layer_index)
        self.ln_2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.mlp = GPT2MLP(config)

    def forward(self, hidden, kv_cache, batch):
        hidden = hidden + self.attn(self.ln_1(hidden), kv_cache, batch)
        return hidden + self.mlp(self.ln_2(hidden))


class _GPT2Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size)
        self.wpe = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.h = nn.ModuleList(GPT2Block(config, i) for i in range(config.num_hidden_layers))
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)


class GPT2LMHeadModel(PagedCausalLM):
    embedding_weight = "transformer.wte.weight"
    # Older checkpoints carry the causal mask as buffers; they are not weights.
    ignored_weights = (".attn.bias", ".attn.masked_bias")

    def __init__(self, config):
        super().__init__()
        self.transformer = _GPT2Model(config)
        heads = config.num_attention_heads
        self.init_head(config, config.hidden_size, heads, config.hidden_size // heads)

    def forward(self, input_ids, positions, kv_caches: list[torch.Tensor], batch: PagedBatch):
        hidden = self.transformer.wte(input_ids) + self.transformer.wpe(positions)
        for block, kv_cache in zip(self.transformer.h, kv_caches):
            hidden = block(hidden, kv_cache, batch)
        return self.transformer.ln_f(hidden)
