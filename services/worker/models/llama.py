"""Llama-style decoders (Llama, Mistral, Qwen2, Qwen3) whose attention uses the paged KV cache.

Module and parameter names follow the HF checkpoints, so a safetensors file loads as it is.
All tokens of a step come in one flattened batch: `[num_tokens]` ids and positions, no padding.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from kernels.batch import PagedBatch
from kernels.cpu_activation import silu_and_mul, silu_and_mul_int8
from kernels.cpu_int8_linear import Int8Rows, Int8RowsFormat
from kernels.cpu_norm import rms_norm, rms_norm_heads, rms_norm_int8
from services.worker.models.activations import activation
from services.worker.models.base import Embedding, PagedCausalLM, fused
from services.worker.models.linear import Linear
from services.worker.models.paged import paged_attention
from services.worker.tensor_parallel import SINGLE, Shard, TensorParallel, row_parallel_linear
from shared.lora import PROJECTION_GROUPS

if TYPE_CHECKING:
    from transformers import PretrainedConfig

QKV, OUT, GATE_UP, DOWN = PROJECTION_GROUPS  # what a LoRA adapter adds to, by the projections' names


class RMSNorm(nn.Module):
    # As `Linear.output_slot`: where the output is spent before the next norm of that name, a large
    # one is written into the step's buffer of that name; None: a fresh tensor.
    output_slot: str | None = None

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None = None,
        bf16_rows: bool = False,
        int8_rows: Int8RowsFormat | None = None,
    ) -> torch.Tensor | Int8Rows:
        """`x` normalized; with `residual`, `residual += x` first (in place) and that is normalized; with
        `bf16_rows`, as bfloat16 rows where the kernel can (for a product that takes them); with `int8_rows`, as
        int8 codes where the kernel can (for a W8A8 product)."""
        if int8_rows is not None and self.output_slot is not None:
            codes = rms_norm_int8(x, self.weight, self.eps, residual, int8_rows, self.output_slot)
            if codes is not None:
                return codes
        return rms_norm(x, self.weight, self.eps, residual, self.output_slot, bf16_rows)

    def each_head(self, x: torch.Tensor) -> torch.Tensor:
        """Every head of `x` [tokens, heads, size] normalized on its own, in place where the kernel can."""
        return rms_norm_heads(x, self.weight, self.eps)


RotaryTables = tuple[torch.Tensor, torch.Tensor]  # cos and sin, [tokens, head_dim]
TABLE_POSITIONS = 1024  # the smallest cos/sin table a CPU keeps


class RotaryEmbedding:
    """cos/sin tables by position, built with transformers' own RoPE variants (llama3, yarn...)."""

    def __init__(self, config: PretrainedConfig, head_dim: int) -> None:
        rope = getattr(config, "rope_parameters", None) or {"rope_type": "default"}
        rope_type = rope.get("rope_type", "default")
        if rope_type == "default":
            theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
            exponents = torch.arange(0, head_dim, 2, dtype=torch.float, device="cpu") / head_dim
            inv_freq = 1.0 / (theta**exponents)
            self.scaling = 1.0
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # only scaled RoPE needs it

            with torch.device("cpu"):  # real numbers even while the model is built on "meta"
                inv_freq, self.scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
        self.inv_freq = inv_freq
        self._tables: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.device.type == "cpu" and positions.numel():
            return self._looked_up(positions, dtype)
        if self.inv_freq.device != positions.device:  # moved once: a copy per step would wait for the device
            self.inv_freq = self.inv_freq.to(positions.device)
        return self._computed(positions, dtype)

    def _computed(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scaling).to(dtype), (emb.sin() * self.scaling).to(dtype)

    def _looked_up(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """On a CPU, rows of a table by position (the same values, computed once): a step's handful of small
        operations was a measurable part of a decode step. The table grows by doubling as positions reach it
        (on a device, where reading the largest position would wait for it, the values are computed)."""
        needed = int(positions.max()) + 1
        table = self._tables.get(dtype)
        if table is None or table[0].shape[0] < needed:
            size = max(TABLE_POSITIONS, 1 << (needed - 1).bit_length())
            table = self._tables[dtype] = self._computed(torch.arange(size), dtype)
        return table[0][positions], table[1][positions]


class Attention(nn.Module):
    """This rank's heads: all of them on one rank."""

    def __init__(
        self,
        config: PretrainedConfig,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm: bool = False,
        tp: TensorParallel = SINGLE,
        index: int = 0,
    ) -> None:
        super().__init__()
        self.index = index  # of its layer: where a LoRA adapter keeps this layer's matrices
        total_heads = config.num_attention_heads
        total_kv_heads = getattr(config, "num_key_value_heads", None) or total_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // total_heads
        self.first_head, self.num_heads = tp.split(total_heads, "the number of attention heads")
        self.first_kv_head, self.num_kv_heads = tp.kv_heads(total_kv_heads)
        self.tp = tp
        self.scale = self.head_dim**-0.5
        self.window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
        hidden = config.hidden_size
        kv_width = self.num_kv_heads * self.head_dim
        self.widths = (self.num_heads * self.head_dim, kv_width, kv_width)
        self.q_proj = Linear(hidden, self.num_heads * self.head_dim, bias=qkv_bias)  # the checkpoint's; fused in fuse()
        self.k_proj = Linear(hidden, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = Linear(hidden, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, hidden, bias=o_bias)
        if qk_norm:  # Qwen3: RMSNorm over each head of q and k, before RoPE
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.qk_norm = qk_norm

    def fuse(self) -> None:
        self.qkv_proj = fused(self.q_proj, self.k_proj, self.v_proj)
        del self.q_proj, self.k_proj, self.v_proj
        # Each output is spent within the layer: q by attention, k and v written to the cache, the
        # o projection's added to the residual stream by the next norm.
        self.qkv_proj.output_slot, self.o_proj.output_slot = "qkv", "o_proj output"

    def forward(
        self,
        hidden: torch.Tensor | Int8Rows,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        batch: PagedBatch,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Every row's keys and values go to the cache; the output is the `keep` rows' (all where None)."""
        tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        if batch.adapters is not None:
            batch.adapters.add(self.index, QKV, hidden, qkv)
        q, k, v = qkv.split(self.widths, dim=-1)  # views of one row per token
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm.each_head(q), self.k_norm.each_head(k)
        out = paged_attention(q, k, v, kv_cache, batch, self.scale, self.window, rope=cos_sin)
        out = out.reshape(tokens, self.num_heads * self.head_dim)
        if keep is not None:
            out = out[keep]
            if not len(keep):  # a step that reads none of its rows: their keys and values are all this layer gives
                return out
        adapters = batch.adapters
        return row_parallel_linear(
            self.o_proj,
            out,
            self.tp,
            None if adapters is None else lambda partial: adapters.add(self.index, OUT, out, partial),
        )

    def shards(self, prefix: str) -> dict[str, Shard]:
        hd = self.head_dim
        q, kv = (
            Shard(0, self.first_head * hd, self.num_heads * hd),
            Shard(0, self.first_kv_head * hd, self.num_kv_heads * hd),
        )
        shards = {
            f"{prefix}.q_proj.weight": q,
            f"{prefix}.k_proj.weight": kv,
            f"{prefix}.v_proj.weight": kv,
            f"{prefix}.o_proj.weight": Shard(1, q.start, q.size),
        }
        if self.q_proj.bias is not None:
            shards |= {f"{prefix}.q_proj.bias": q, f"{prefix}.k_proj.bias": kv, f"{prefix}.v_proj.bias": kv}
        return shards


class MLP(nn.Module):
    def __init__(self, config: PretrainedConfig, tp: TensorParallel = SINGLE, index: int = 0) -> None:
        super().__init__()
        self.index = index
        bias = getattr(config, "mlp_bias", False)
        self.first, width = tp.split(config.intermediate_size, "the MLP's intermediate size")
        self.width = width
        self.gate_proj = Linear(config.hidden_size, width, bias=bias)  # the checkpoint's; fused in fuse()
        self.up_proj = Linear(config.hidden_size, width, bias=bias)
        self.down_proj = Linear(width, config.hidden_size, bias=bias)
        self.tp = tp
        self.act = activation(config.hidden_act)
        self.silu = config.hidden_act == "silu"

    def fuse(self) -> None:
        self.gate_up_proj = fused(self.gate_proj, self.up_proj)
        del self.gate_proj, self.up_proj
        # gate_up is spent on the down projection's input, whose output the next norm adds to the residual stream.
        self.gate_up_proj.output_slot, self.down_proj.output_slot = "gate_up", "mlp output"
        if self.silu:
            self.gate_up_proj.halves = self.width

    def forward(self, x: torch.Tensor | Int8Rows, adapters: Any = None) -> torch.Tensor:
        inner = None if adapters is not None else self.gate_up_proj.gated(x, self.down_proj.takes_bf16_rows)
        if inner is not None:  # the activation applied as the projection stores its sums
            return row_parallel_linear(self.down_proj, inner, self.tp, None)
        gate_up = self.gate_up_proj(x)
        if adapters is not None:
            adapters.add(self.index, GATE_UP, x, gate_up)
        codes = self.down_proj.int8_rows if self.silu and adapters is None else None
        if codes is not None and (quantized := silu_and_mul_int8(gate_up, self.width, codes)) is not None:
            return row_parallel_linear(self.down_proj, quantized, self.tp, None)
        if self.silu:  # one pass, no extra activations-sized tensors per layer
            inner = silu_and_mul(gate_up, self.width, bf16_rows=adapters is None and self.down_proj.takes_bf16_rows)
        else:
            gate, up = gate_up.split(self.width, dim=-1)
            inner = self.act(gate) * up
        return row_parallel_linear(
            self.down_proj,
            inner,
            self.tp,
            None if adapters is None else lambda partial: adapters.add(self.index, DOWN, inner, partial),
        )

    def shards(self, prefix: str) -> dict[str, Shard]:
        inner = Shard(0, self.first, self.width)
        shards = {f"{prefix}.{name}.weight": inner for name in ("gate_proj", "up_proj")}
        if self.up_proj.bias is not None:
            shards |= {f"{prefix}.{name}.bias": inner for name in ("gate_proj", "up_proj")}
        return shards | {f"{prefix}.down_proj.weight": Shard(1, inner.start, inner.size)}


class DecoderLayer(nn.Module):
    def __init__(
        self, config: PretrainedConfig, qkv_bias: bool, o_bias: bool, qk_norm: bool, tp: TensorParallel, index: int = 0
    ) -> None:
        super().__init__()
        self.self_attn = Attention(config, qkv_bias, o_bias, qk_norm, tp, index)
        self.mlp = MLP(config, tp, index)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Each norm's output is spent within its sublayer (the projections and their adapters).
        self.input_layernorm.output_slot = "attention input"
        self.post_attention_layernorm.output_slot = "mlp input"

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        batch: PagedBatch,
        keep: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's output, the residual stream before it), of the `keep` rows (all where None): each
        residual add is done by the next norm, in place, in the same pass."""
        # The norms write the projections' rows as those take them, bfloat16 or a W8A8 product's int8 codes (an
        # adapter takes float32).
        plain = batch.adapters is None
        attention_rows = plain and self.self_attn.qkv_proj.takes_bf16_rows
        mlp_rows = plain and self.mlp.gate_up_proj.takes_bf16_rows
        attention_codes = self.self_attn.qkv_proj.int8_rows if plain else None
        mlp_codes = self.mlp.gate_up_proj.int8_rows if plain else None
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden, None, attention_rows, attention_codes)
        else:
            hidden = self.input_layernorm(hidden, residual, attention_rows, attention_codes)
        hidden = self.self_attn(hidden, cos_sin, kv_cache, batch, keep)
        if keep is not None:
            residual = residual[keep]
            if not len(keep):
                return residual.new_empty(residual.shape), residual
        hidden = self.post_attention_layernorm(hidden, residual, mlp_rows, mlp_codes)
        return self.mlp(hidden, batch.adapters), residual


class DecoderModel(nn.Module):
    def __init__(
        self, config: PretrainedConfig, qkv_bias: bool, o_bias: bool, qk_norm: bool, tp: TensorParallel
    ) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, qkv_bias, o_bias, qk_norm, tp, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(PagedCausalLM):
    """Llama and its close relatives, which differ in where the attention projections have biases."""

    embedding_weight = "model.embed_tokens.weight"
    quantizable = True
    keeps_rows = True

    def __init__(self, config: PretrainedConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        bias = bool(getattr(config, "attention_bias", False))
        self._build(config, tp, qkv_bias=bias, o_bias=bias)

    def _build(
        self, config: PretrainedConfig, tp: TensorParallel, qkv_bias: bool, o_bias: bool, qk_norm: bool = False
    ) -> None:
        self.model = DecoderModel(config, qkv_bias, o_bias, qk_norm, tp)
        attention: Attention = self.model.layers[0].self_attn
        self.init_head(config, config.hidden_size, attention.num_kv_heads, attention.head_dim)
        self.rotary = RotaryEmbedding(config, self.head_dim)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        batch: PagedBatch,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Returns the final hidden states, `[num_tokens, hidden_size]`, or the `keep` rows' alone: the last
        layer's attention output, MLP and norm are computed for those rows only."""
        return self.run_layers(*self.embed(input_ids, positions), kv_caches, batch, keep)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, RotaryTables]:
        """What the layers take of a step's tokens: their embeddings, and cos and sin at their positions."""
        hidden = self.model.embed_tokens(input_ids)
        return hidden, self.rotary.cos_sin(positions, hidden.dtype)

    def run_layers(
        self,
        hidden: torch.Tensor,
        cos_sin: RotaryTables,
        kv_caches: list[torch.Tensor],
        batch: PagedBatch,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The final hidden states from `embed`'s (whose `hidden` serves as the residual stream): each of
        this stretch's computations is a kernel's, so a CPU may replay it (services/worker/decode_graphs.py)."""
        residual = None
        last = len(self.model.layers) - 1
        for index, (layer, kv_cache) in enumerate(zip(self.model.layers, kv_caches)):
            hidden, residual = layer(hidden, residual, cos_sin, kv_cache, batch, keep if index == last else None)
        return self.model.norm(hidden, residual)


class Qwen2ForCausalLM(LlamaForCausalLM):
    def __init__(self, config: PretrainedConfig, tp: TensorParallel = SINGLE) -> None:
        PagedCausalLM.__init__(self)
        self._build(config, tp, qkv_bias=True, o_bias=False)


class Qwen3ForCausalLM(LlamaForCausalLM):
    def __init__(self, config: PretrainedConfig, tp: TensorParallel = SINGLE) -> None:
        PagedCausalLM.__init__(self)
        bias = bool(getattr(config, "attention_bias", False))
        self._build(config, tp, qkv_bias=bias, o_bias=bias, qk_norm=True)
