"""The MLP activations the supported families name in their configs, by the same names.

Written here rather than taken from transformers, whose activations module imports its kernel hub
and costs each worker process well over a second at start-up. Each matches the computation
transformers runs for that name, so greedy tokens stay equal to its `generate`."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F


def gelu_tanh_expanded(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's GELU ("gelu_new"): the tanh approximation written out, as GPT-2 computes it."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_new": gelu_tanh_expanded,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "quick_gelu": quick_gelu,
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"activation {name!r} is not supported (supported: {', '.join(ACTIVATIONS)})") from None
