"""The loader's side of quantization: which linear layers of a model are quantized, and their checkpoint tensors
read into their methods (split for this tensor-parallel rank) in place of a float `weight`."""

from __future__ import annotations

import torch
from torch import nn

from services.worker.models.linear import Linear
from services.worker.quantization.layouts import read_layer
from services.worker.quantization.methods import quantized_method
from services.worker.quantization.schemes import QuantizationConfig, QuantizationError
from services.worker.tensor_parallel import Shard


def quantized_layers(model: nn.Module, config: QuantizationConfig) -> dict[str, Linear]:
    """The model's linear layers that `config` quantizes, by name (the checkpoint's, before any fusing)."""
    found = {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, Linear) and config.scheme_for(name) is not None
    }
    if not found:
        raise QuantizationError(
            f"the quantization_config ({config.describe()}) names none of the model's linear layers"
        )
    return found


def load_quantized(
    layers: dict[str, Linear], config: QuantizationConfig, state: dict[str, torch.Tensor], shards: dict[str, Shard]
) -> None:
    """Each quantized layer's tensors taken out of `state` (every one under its name but its float bias) and read
    into its method, this rank's part of it where `shards` splits the layer's weight."""
    for name, layer in layers.items():
        prefix = f"{name}."
        tensors = {
            key[len(prefix) :]: state.pop(key)
            for key in list(state)
            if key.startswith(prefix) and key != f"{name}.bias" and "." not in key[len(prefix) :]
        }
        scheme = config.scheme_for(name)
        assert scheme is not None
        weight = read_layer(scheme, tensors, name)
        shard = shards.get(f"{name}.weight")
        if shard is not None:
            weight = weight.sharded(shard, name)
        expected = (layer.out_features, layer.in_features)
        if weight.shape != expected:
            raise QuantizationError(
                f"{name}: its quantized weight holds {weight.shape[0]} x {weight.shape[1]} "
                f"values, config.json implies {expected[0]} x {expected[1]}"
            )
        layer.use(quantized_method(weight))
