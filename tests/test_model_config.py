"""The worker reads config.json itself for the families it implements, and every attribute its
models use equals what transformers' own config class gives, defaults included."""

from __future__ import annotations

import glob
import json
import os

import pytest
from transformers import AutoConfig

from services.worker.model_config import DEFAULTS, light_config, read_config
from tests.conftest import ROOT
from tests.tiny_models import CONFIGS, build_model

USED = (
    "hidden_size",
    "num_attention_heads",
    "num_hidden_layers",
    "vocab_size",
    "max_position_embeddings",
    "intermediate_size",
    "ffn_dim",
    "n_inner",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "layer_norm_epsilon",
    "hidden_act",
    "activation_function",
    "attention_bias",
    "mlp_bias",
    "enable_bias",
    "layer_norm_elementwise_affine",
    "word_embed_proj_dim",
    "do_layer_norm_before",
    "_remove_final_layer_norm",
    "scale_attn_weights",
    "scale_attn_by_inverse_layer_idx",
    "tie_word_embeddings",
    "initializer_range",
    "init_std",
    "eos_token_id",
    "architectures",
)
MINIMAL = {
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "vocab_size": 512,
    "intermediate_size": 128,
    "ffn_dim": 128,
}


def rope_theta(config) -> float:
    rope = getattr(config, "rope_parameters", None) or {}
    return rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))


def sliding_window(config):
    return getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None


def assert_same(model_dir: str) -> None:
    ours, theirs = read_config(model_dir), AutoConfig.from_pretrained(model_dir, local_files_only=True)
    for name in USED:
        assert getattr(ours, name, None) == getattr(theirs, name, None), (model_dir, name)
    assert rope_theta(ours) == rope_theta(theirs) and sliding_window(ours) == sliding_window(theirs)


def shipped_and_benchmark_dirs() -> list[str]:
    return [os.path.join(ROOT, "ops", "models", "tiny-python")] + sorted(
        glob.glob(os.path.join(ROOT, "ops", "configs", "*"))
    )


@pytest.mark.parametrize("model_dir", shipped_and_benchmark_dirs(), ids=os.path.basename)
def test_the_shipped_and_benchmark_configs_read_as_transformers_reads_them(model_dir):
    assert_same(model_dir)


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_every_test_family_reads_as_transformers_reads_it(family, tmp_path):
    assert_same(build_model(str(tmp_path), family))


@pytest.mark.parametrize("family", sorted(DEFAULTS))
def test_a_config_that_leaves_out_every_optional_field_gets_transformers_defaults(family, tmp_path):
    raw = dict(MINIMAL, model_type=family, architectures=["X"])
    if family == "gpt2":
        raw = {"model_type": "gpt2", "n_embd": 64, "n_head": 4, "n_layer": 2, "vocab_size": 512, "architectures": ["X"]}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert light_config(raw) is not None
    assert_same(str(tmp_path))


def test_scaled_rope_and_unknown_families_go_through_transformers():
    assert (
        light_config(dict(MINIMAL, model_type="llama", rope_parameters={"rope_type": "llama3", "factor": 8.0})) is None
    )
    assert light_config(dict(MINIMAL, model_type="gemma")) is None
    assert light_config({"model_type": "llama", "num_attention_heads": 4}) is None  # transformers says what is wrong
