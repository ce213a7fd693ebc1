"""OPT, the PagedAttention paper's main family: learned positions (offset by 2), ReLU, LayerNorm."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from kernels.batch import PagedBatch
from services.worker.models.activations import activation
from services.worker.models.base import Embedding, PagedCausalLM, fused
from services.worker.models.linear import Linear
from services.worker.models.paged import paged_attention
from services.worker.tensor_parallel import SINGLE, Shard, TensorParallel, row_parallel_linear

if TYPE_CHECKING:
    from transformers import PretrainedConfig

POSITION_OFFSET = 2  # OPT's position table starts two rows in


class OPTAttention(nn.Module):
    """This rank's heads: all of them on one rank."""

    def __init__(self, config: PretrainedConfig, tp: TensorParallel) -> None:
        super().__init__()
        hidden, bias = config.hidden_size, getattr(config, "enable_bias", True)
        self.head_dim = hidden // config.num_attention_heads
        self.first_head, self.num_heads = tp.split(config.num_attention_heads, "the number of attention heads")
        width = self.num_heads * self.head_dim
        self.width = width
        self.q_proj = Linear(hidden, width, bias=bias)  # the checkpoint's; fused in fuse()
        self.k_proj = Linear(hidden, width, bias=bias)
        self.v_proj = Linear(hidden, width, bias=bias)
        self.out_proj = Linear(width, hidden, bias=bias)
        self.tp = tp

    def fuse(self) -> None:
        self.qkv_proj = fused(self.q_proj, self.k_proj, self.v_proj)
        del self.q_proj, self.k_proj, self.v_proj

    def forward(self, hidden: torch.Tensor, kv_cache: torch.Tensor, batch: PagedBatch) -> torch.Tensor:
        tokens = hidden.shape[0]
        shape = (tokens, self.num_heads, self.head_dim)
        q, k, v = (part.view(shape) for part in self.qkv_proj(hidden).split(self.width, dim=-1))
        out = paged_attention(q, k, v, kv_cache, batch, self.head_dim**-0.5)
        return row_parallel_linear(self.out_proj, out.reshape(tokens, -1), self.tp)

    def shards(self, prefix: str) -> dict[str, Shard]:
        heads = Shard(0, self.first_head * self.head_dim, self.num_heads * self.head_dim)
        shards = {
            f"{prefix}.{name}.{kind}": heads for name in ("q_proj", "k_proj", "v_proj") for kind in ("weight", "bias")
        }
        return shards | {f"{prefix}.out_proj.weight": Shard(1, heads.start, heads.size)}


class OPTDecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, tp: TensorParallel) -> None:
        super().__init__()
        hidden, bias = config.hidden_size, getattr(config, "enable_bias", True)
        affine = getattr(config, "layer_norm_elementwise_affine", True)
        self.self_attn = OPTAttention(config, tp)
        self.self_attn_layer_norm = nn.LayerNorm(hidden, elementwise_affine=affine)
        self.first_inner, inner = tp.split(config.ffn_dim, "the MLP's inner width")
        self.fc1 = Linear(hidden, inner, bias=bias)
        self.fc2 = Linear(inner, hidden, bias=bias)
        self.tp = tp
        self.final_layer_norm = nn.LayerNorm(hidden, elementwise_affine=affine)
        self.activation = activation(config.activation_function)
        self.pre_norm = config.do_layer_norm_before

    def forward(self, hidden: torch.Tensor, kv_cache: torch.Tensor, batch: PagedBatch) -> torch.Tensor:
        residual = hidden
        if self.pre_norm:
            hidden = self.self_attn_layer_norm(hidden)
        hidden = residual + self.self_attn(hidden, kv_cache, batch)
        if not self.pre_norm:
            hidden = self.self_attn_layer_norm(hidden)
        residual = hidden
        if self.pre_norm:
            hidden = self.final_layer_norm(hidden)
        hidden = residual + row_parallel_linear(self.fc2, self.activation(self.fc1(hidden)), self.tp)
        if not self.pre_norm:
            hidden = self.final_layer_norm(hidden)
        return hidden

    def shards(self, prefix: str) -> dict[str, Shard]:
        """The MLP's; the attention's come from `self_attn`."""
        inner = Shard(0, self.first_inner, self.fc1.out_features)
        return {
            f"{prefix}.fc1.weight": inner,
            f"{prefix}.fc1.bias": inner,
            f"{prefix}.fc2.weight": Shard(1, inner.start, inner.size),
        }


class OPTDecoder(nn.Module):
    def __init__(self, config: PretrainedConfig, tp: TensorParallel) -> None:
        super().__init__()
        projected = config.word_embed_proj_dim
        self.embed_tokens = Embedding(config.vocab_size, projected)
        self.embed_positions = Embedding(config.max_position_embeddings + POSITION_OFFSET, config.hidden_size)
        if projected != config.hidden_size:
            self.project_in = Linear(projected, config.hidden_size, bias=False)
            self.project_out = Linear(config.hidden_size, projected, bias=False)
        if config.do_layer_norm_before and not getattr(config, "_remove_final_layer_norm", False):
            affine = getattr(config, "layer_norm_elementwise_affine", True)
            self.final_layer_norm = nn.LayerNorm(config.hidden_size, elementwise_affine=affine)
        self.layers = nn.ModuleList(OPTDecoderLayer(config, tp) for _ in range(config.num_hidden_layers))


class _OPTModel(nn.Module):
    def __init__(self, config: PretrainedConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.decoder = OPTDecoder(config, tp)


class OPTForCausalLM(PagedCausalLM):
    embedding_weight = "model.decoder.embed_tokens.weight"

    def __init__(self, config: PretrainedConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.model = _OPTModel(config, tp)
        attention: OPTAttention = self.model.decoder.layers[0].self_attn
        self.init_head(config, config.word_embed_proj_dim, attention.num_heads, attention.head_dim)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor], batch: PagedBatch
    ) -> torch.Tensor:
        decoder = self.model.decoder
        hidden = decoder.embed_tokens(input_ids)
        if hasattr(decoder, "project_in"):
            hidden = decoder.project_in(hidden)
        hidden = hidden + decoder.embed_positions(positions + POSITION_OFFSET)
        for layer, kv_cache in zip(decoder.layers, kv_caches):
            hidden = layer(hidden, kv_cache, batch)
        if hasattr(decoder, "final_layer_norm"):
            hidden = decoder.final_layer_norm(hidden)
        if hasattr(decoder, "project_out"):
            hidden = decoder.project_out(hidden)
        return hidden
