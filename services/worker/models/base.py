"""What the loader and the runner need of every model: an LM head, tied or not, and the KV shape."""

from __future__ import annotations

import torch
from torch import nn

from kernels.cpu_linear import Linear

class PagedCausalLM(nn.Module):
    embedding_weight = ""  # the parameter the LM head shares when embeddings are tied

    def init_head(self, config, head_input_size: int, num_kv_heads: int, head_dim: int) -> None:
        self.config = config
        self.lm_head = Linear(head_input_size, config.vocab_size, bias=False)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim

    def tie_weights(self) -> None:
        if self.tie_word_embeddings:
            self.lm_head.weight = self.get_parameter(self.embedding_weight)

    def shards(self) -> dict:
        """The checkpoint tensors a tensor-parallel rank loads only part of, by name (every other
        one it loads whole): what each of its modules with a `shards(prefix)` says."""
        found = {}
        for name, module in self.named_modules():
            if module is not self and hasattr(module, "shards"):
                found |= module.shards(name)
        return found

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
