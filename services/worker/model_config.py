"""A checkpoint's config.json, read without transformers where that is safe.

Importing any transformers config class pulls in its attention integrations and torch's compiler,
about two seconds of every worker's start-up (each rank's, at tensor parallelism). The families
pagedserve implements need a few dozen plain fields, so those are read from the JSON with the
defaults transformers' config classes give them (tests/test_model_config.py holds the two equal).
Anything else, scaled RoPE included, goes through transformers' AutoConfig."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace
from typing import Any


class ModelLoadError(RuntimeError):
    """A checkpoint that cannot be served, and why."""


_LLAMA_LIKE = {
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "rope_theta": 10000.0,
    "initializer_range": 0.02,
}
# Each family's defaults for what its config.json may leave out (transformers' values).
DEFAULTS: dict[str, dict[str, object]] = {
    "llama": {
        **_LLAMA_LIKE,
        "max_position_embeddings": 2048,
        "attention_bias": False,
        "mlp_bias": False,
        "eos_token_id": 2,
    },
    "mistral": {
        **_LLAMA_LIKE,
        "max_position_embeddings": 4096 * 32,
        "num_key_value_heads": 8,
        "sliding_window": 4096,
        "eos_token_id": 2,
    },
    "qwen2": {**_LLAMA_LIKE, "max_position_embeddings": 32768, "num_key_value_heads": 32, "use_sliding_window": False},
    "qwen3": {
        **_LLAMA_LIKE,
        "max_position_embeddings": 32768,
        "num_key_value_heads": 32,
        "head_dim": 128,
        "attention_bias": False,
        "use_sliding_window": False,
    },
    "opt": {
        "max_position_embeddings": 2048,
        "do_layer_norm_before": True,
        "_remove_final_layer_norm": False,
        "enable_bias": True,
        "layer_norm_elementwise_affine": True,
        "activation_function": "relu",
        "init_std": 0.02,
        "tie_word_embeddings": True,
        "eos_token_id": 2,
    },
    "gpt2": {
        "layer_norm_epsilon": 1e-5,
        "activation_function": "gelu_new",
        "n_inner": None,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "initializer_range": 0.02,
        "tie_word_embeddings": True,
        "eos_token_id": 50256,
        "n_positions": 1024,
    },
}
ALIASES = {
    "gpt2": {
        "n_embd": "hidden_size",
        "n_head": "num_attention_heads",
        "n_layer": "num_hidden_layers",
        "n_positions": "max_position_embeddings",
    }
}
REQUIRED = ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size")
REQUIRED_OF = {"opt": ("ffn_dim",), "gpt2": ()}  # llama-like families: intermediate_size


def read_config(model_dir: str) -> Any:
    """config.json as an object with the attributes transformers' config would have for them."""
    with open(os.path.join(model_dir, "config.json")) as f:
        raw = json.load(f)
    light = light_config(raw) if isinstance(raw, dict) else None
    if light is not None:
        return light
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir, local_files_only=True)


def light_config(raw: dict[str, Any]) -> SimpleNamespace | None:
    """None where only transformers knows what the JSON means."""
    family = raw.get("model_type")
    if family not in DEFAULTS or _scaled_rope(raw) or raw.get("rope_scaling"):
        return None
    values = {**DEFAULTS[family], **raw}
    for short, long in ALIASES.get(family, {}).items():
        values[long] = values[short] = values.get(short, values.get(long))
    rope = values.pop("rope_parameters", None)
    if isinstance(rope, dict) and "rope_theta" in rope:
        values["rope_theta"] = rope["rope_theta"]
    if family == "opt" and values.get("word_embed_proj_dim") is None:
        values["word_embed_proj_dim"] = values.get("hidden_size")
    if family in ("llama", "qwen2", "qwen3") and values.get("num_key_value_heads") is None:
        values["num_key_value_heads"] = values.get("num_attention_heads")
    heads = values.get("num_attention_heads")
    if family in ("llama", "mistral") and values.get("head_dim") is None and heads:
        values["head_dim"] = values.get("hidden_size", 0) // heads
    if family in ("qwen2", "qwen3") and not values.get("use_sliding_window"):
        values["sliding_window"] = None
    required = REQUIRED + REQUIRED_OF.get(family, ("intermediate_size",))
    if any(not isinstance(values.get(name), int) for name in required):
        return None  # let transformers say what is wrong
    return SimpleNamespace(**values)


def _scaled_rope(raw: dict[str, Any]) -> bool:
    rope = raw.get("rope_parameters")
    return isinstance(rope, dict) and rope.get("rope_type", "default") != "default"
