"""What the loader and the runner need of every model: an LM head, tied or not, and the KV shape."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from services.worker.models.linear import Linear
from services.worker.quantization.methods import FloatMethod, joined
from services.worker.tensor_parallel import Shard

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class Embedding(nn.Embedding):
    """`nn.Embedding` whose rows come out in `out_dtype`: a table stored in a half type serves a
    float32 forward pass without a float32 copy of it."""

    out_dtype: torch.dtype | None = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = super().forward(ids)
        return rows if self.out_dtype is None else rows.to(self.out_dtype)


def fused(*projections: Linear) -> Linear:
    """One projection of the same input whose output is `projections`' outputs side by side: one
    matmul where there were several. It takes over their weights (concatenated) as they are loaded,
    float or quantized alike."""
    has_bias = projections[0].bias is not None
    with torch.device("meta"):
        combined = Linear(projections[0].in_features, sum(p.out_features for p in projections), bias=has_bias)
    if all(isinstance(p.method, FloatMethod) for p in projections):
        combined.weight = nn.Parameter(torch.cat([p.weight for p in projections]), requires_grad=False)
    else:
        combined.use(joined([p.method for p in projections]))
    if has_bias:
        combined.bias = nn.Parameter(torch.cat([p.bias for p in projections]), requires_grad=False)
    return combined


class PagedCausalLM(nn.Module):
    embedding_weight = ""  # the parameter the LM head shares when embeddings are tied
    quantizable = False  # whether a quantized checkpoint of this family is served
    # Whether forward takes `keep`, the rows whose final hidden states the step wants, and computes the last
    # layer's output for those rows alone (its keys and values are still every row's, for the cache).
    keeps_rows = False

    def init_head(self, config: PretrainedConfig, head_input_size: int, num_kv_heads: int, head_dim: int) -> None:
        self.config = config
        self.lm_head = Linear(head_input_size, config.vocab_size, bias=False)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim

    def tie_weights(self) -> None:
        if self.tie_word_embeddings:
            self.lm_head.weight = self.get_parameter(self.embedding_weight)

    def fuse_projections(self) -> None:
        """Once the checkpoint is loaded (under its own names, whole or sharded): every module's
        projections of one input become one (q, k and v; gate and up)."""
        for module in list(self.modules()):
            fuse = getattr(module, "fuse", None)
            if module is not self and callable(fuse):
                fuse()

    def shards(self) -> dict[str, Shard]:
        """The checkpoint tensors a tensor-parallel rank loads only part of, by name (every other
        one it loads whole): what each of its modules with a `shards(prefix)` says."""
        found: dict[str, Shard] = {}
        for name, module in self.named_modules():
            if module is not self and hasattr(module, "shards"):
                found |= module.shards(name)
        return found

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
