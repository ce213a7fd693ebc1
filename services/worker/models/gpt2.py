"""GPT-2: learned positions, pre-LayerNorm, GELU, fused QKV stored as Conv1D ([in, out]) weights."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from kernels.batch import PagedBatch
from services.worker.models.activations import activation
from services.worker.models.base import Embedding, PagedCausalLM
from services.worker.models.paged import paged_attention
from services.worker.tensor_parallel import SINGLE, Shard, TensorParallel, row_parallel

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class Conv1D(nn.Module):
    """A linear layer whose weight is stored transposed, as GPT-2 checkpoints have it."""

    def __init__(self, inputs: int, outputs: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(inputs, outputs))
        self.bias = nn.Parameter(torch.zeros(outputs))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.bias, x, self.weight)

    def row_parallel(self, x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
        """With the input split over the ranks (rows of the weight)."""
        return self(x) if tp.world_size == 1 else row_parallel(x, self.weight, self.bias, tp, transposed=True)


class GPT2Attention(nn.Module):
    """This rank's heads: all of them on one rank."""

    def __init__(self, config: PretrainedConfig, layer_index: int, tp: TensorParallel) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.head_dim = hidden // config.num_attention_heads
        self.first_head, self.num_heads = tp.split(config.num_attention_heads, "the number of attention heads")
        width = self.num_heads * self.head_dim
        self.c_attn = Conv1D(hidden, 3 * width)
        self.c_proj = Conv1D(width, hidden)
        self.tp, self.hidden = tp, hidden
        self.scale = self.head_dim**-0.5 if config.scale_attn_weights else 1.0
        if getattr(config, "scale_attn_by_inverse_layer_idx", False):
            self.scale /= layer_index + 1

    def forward(self, hidden: torch.Tensor, kv_cache: torch.Tensor, batch: PagedBatch) -> torch.Tensor:
        tokens = hidden.shape[0]
        q, k, v = self.c_attn(hidden).view(tokens, 3, self.num_heads, self.head_dim).unbind(1)
        out = paged_attention(q, k, v, kv_cache, batch, self.scale)
        return self.c_proj.row_parallel(out.reshape(tokens, -1), self.tp)

    def shards(self, prefix: str) -> dict[str, Shard]:
        width = self.num_heads * self.head_dim
        start = self.first_head * self.head_dim
        return {
            f"{prefix}.c_attn.weight": Shard(1, start, width, parts=3, stride=self.hidden),
            f"{prefix}.c_attn.bias": Shard(0, start, width, parts=3, stride=self.hidden),
            f"{prefix}.c_proj.weight": Shard(0, start, width),
        }


class GPT2MLP(nn.Module):
    def __init__(self, config: PretrainedConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.first, inner = tp.split(config.n_inner or 4 * config.hidden_size, "the MLP's inner width")
        self.c_fc = Conv1D(config.hidden_size, inner)
        self.c_proj = Conv1D(inner, config.hidden_size)
        self.act = activation(config.activation_function)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj.row_parallel(self.act(self.c_fc(x)), self.tp)

    def shards(self, prefix: str) -> dict[str, Shard]:
        inner = self.c_proj.weight.shape[0]
        return {
            f"{prefix}.c_fc.weight": Shard(1, self.first, inner),
            f"{prefix}.c_fc.bias": Shard(0, self.first, inner),
            f"{prefix}.c_proj.weight": Shard(0, self.first, inner),
        }


class GPT2Block(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_index: int, tp: TensorParallel) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.attn = GPT2Attention(config, layer_index, tp)
        self.ln_2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.mlp = GPT2MLP(config, tp)

    def forward(self, hidden: torch.Tensor, kv_cache: torch.Tensor, batch: PagedBatch) -> torch.Tensor:
        hidden = hidden + self.attn(self.ln_1(hidden), kv_cache, batch)
        return hidden + self.mlp(self.ln_2(hidden))


class _GPT2Model(nn.Module):
    def __init__(self, config: PretrainedConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.wte = Embedding(config.vocab_size, config.hidden_size)
        self.wpe = Embedding(config.max_position_embeddings, config.hidden_size)
        self.h = nn.ModuleList(GPT2Block(config, i, tp) for i in range(config.num_hidden_layers))
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)


class GPT2LMHeadModel(PagedCausalLM):
    embedding_weight = "transformer.wte.weight"
    # Older checkpoints carry the causal mask as buffers; they are not weights.
    ignored_weights = (".attn.bias", ".attn.masked_bias")

    def __init__(self, config: PretrainedConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.transformer = _GPT2Model(config, tp)
        attention: GPT2Attention = self.transformer.h[0].attn
        self.init_head(config, config.hidden_size, attention.num_heads, attention.head_dim)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor], batch: PagedBatch
    ) -> torch.Tensor:
        hidden = self.transformer.wte(input_ids) + self.transformer.wpe(positions)
        for block, kv_cache in zip(self.transformer.h, kv_caches):
            hidden = block(hidden, kv_cache, batch)
        return self.transformer.ln_f(hidden)
