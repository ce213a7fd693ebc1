"""Load a causal LM from a local HF-format directory into pagedserve's own model code."""

from __future__ import annotations

import json
import logging
import os

import torch
from safetensors.torch import load_file
from transformers import AutoConfig

from services.worker.models import ARCHITECTURES

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class ModelLoadError(RuntimeError):
    pass


def load_config(model_dir: str):
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise ModelLoadError(f"{model_dir} has no config.json")
    return AutoConfig.from_pretrained(model_dir, local_files_only=True)


def resolve_dtype(config, name: str, device: torch.device) -> torch.dtype:
    if name != "auto":
        return DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    declared = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(declared, str):
        declared = DTYPES.get(declared)
    return declared if declared in (torch.float16, torch.bfloat16) else torch.float16


def load_model(model_dir: str, dtype_name: str, device: torch.device):
    config = load_config(model_dir)
    architecture = (getattr(config, "architectures", None) or ["?"])[0]
    model_class = ARCHITECTURES.get(architecture)
    if model_class is None:
        raise ModelLoadError(
            f"architecture {architecture!r} is not supported; supported: {sorted(ARCHITECTURES)}"
        )
    dtype = resolve_dtype(config, dtype_name, device)
    with torch.device("meta"):
        model = model_class(config)
    state = read_weights(model_dir)
    if model.tie_word_embeddings:
        state.pop("lm_head.weight", None)
        if "model.embed_tokens.weight" in state:
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ModelLoadError(
            f"weights in {model_dir} do not match config.json: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}"
        )
    for name, tensor in expected.items():
        if tuple(state[name].shape) != tuple(tensor.shape):
            raise ModelLoadError(
                f"weight {name} has shape {tuple(state[name].shape)}, config.json implies "
                f"{tuple(tensor.shape)}"
            )
    state = {name: t.to(device=device, dtype=dtype) for name, t in state.items()}
    model.load_state_dict(state, strict=True, assign=True)
    model.tie_weights()
    model.eval()
    log.info("loaded %s from %s as %s on %s", architecture, model_dir, dtype, device)
    return model, config


def read_weights(model_dir: str) -> dict[str, torch.Tensor]:
    index_path = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        with open(index_path) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    state: dict[str, torch.Tensor] = {}
    for name in files:
        path = os.path.join(model_dir, name)
        if not os.path.isfile(path):
            raise ModelLoadError(f"weight file {path} is missing")
        try:
            state.update(load_file(path))
        except Exception as exc:  # safetensors reports corruption with several error types
            raise ModelLoadError(f"weight file {path} is unreadable: {exc}") from None
    return {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}


def eos_token_ids(model_dir: str, config) -> list[int]:
    """EOS ids from generation_config.json, falling back to config.json."""
    candidates = [getattr(config, "eos_token_id", None)]
    path = os.path.join(model_dir, "generation_config.json")
    if os.path.isfile(path):
        with open(path) as f:
            candidates.insert(0, json.load(f).get("eos_token_id"))
    for value in candidates:
        if value is not None:
            return list(value) if isinstance(value, list) else [value]
    return []
