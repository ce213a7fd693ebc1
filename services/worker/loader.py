"""Load a causal LM from a local HF-format directory into pagedserve's own model code."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open
from torch import nn

from kernels.cpu_linear import describe_products, gemm_build, packs
from services.worker.model_config import ModelLoadError as ModelLoadError  # raised by load_model, named here
from services.worker.model_config import read_config
from services.worker.models import ARCHITECTURES
from services.worker.models.base import Embedding, PagedCausalLM
from services.worker.models.linear import Linear, prepare_layers
from services.worker.pooling import BARE_EMBEDDING, add_head
from services.worker.quantization.loading import load_quantized, quantized_layers
from services.worker.quantization.schemes import QuantizationConfig, QuantizationError, read_quantization
from services.worker.tensor_parallel import SINGLE, Shard, TensorParallel

if TYPE_CHECKING:
    from transformers import PretrainedConfig

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def load_config(model_dir: str) -> PretrainedConfig:
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise ModelLoadError(f"{model_dir} has no config.json")
    try:
        return read_config(model_dir)
    except (ValueError, KeyError, OSError) as exc:
        raise ModelLoadError(f"{model_dir}/config.json is not a usable model config: {exc}") from None


def resolve_dtype(config: PretrainedConfig, name: str, device: torch.device) -> torch.dtype:
    """The dtype of the weights and the KV cache. `auto` follows the checkpoint's declared dtype: on a
    GPU its half type (float16 for a float32 checkpoint, as vLLM downcasts it); on a CPU its half type
    where a compiled kernel reads it (`cpu_linear.packs`), else, and for a float32 checkpoint, float32."""
    if name != "auto":
        return DTYPES[name]
    declared = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(declared, str):
        declared = DTYPES.get(declared)
    half = declared if declared in (torch.float16, torch.bfloat16) else None
    if device.type == "cpu":
        return half if half is not None and packs(half) else torch.float32
    return half or torch.float16


def activation_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """What the forward pass computes in: on a CPU always float32, the half types only stored (weights
    and KV cache, widened in registers as the kernels read them: no rounding between operations, and
    elementwise kernels in one dtype); on a GPU the weights' dtype."""
    return torch.float32 if device.type == "cpu" else dtype


def store_half_only_where_read(model: nn.Module, compute: torch.dtype) -> None:
    """Every parameter and buffer in `compute`, except what the kernels read in its stored dtype: the
    projections' weights and the embedding tables (whose rows are widened as they are looked up)."""
    for module in model.modules():
        kept = {"weight"} if isinstance(module, (Linear, Embedding)) else set()
        for name, tensor in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            if name not in kept and tensor.is_floating_point() and tensor.dtype != compute:
                tensor.data = tensor.data.to(compute)
        if isinstance(module, Embedding):
            module.out_dtype = compute


def model_class_for(config: PretrainedConfig) -> type[PagedCausalLM]:
    architecture = (getattr(config, "architectures", None) or ["?"])[0]
    model_class = ARCHITECTURES.get(architecture)
    if model_class is None:
        raise ModelLoadError(f"architecture {architecture!r} is not supported; supported: {sorted(ARCHITECTURES)}")
    return model_class


@contextlib.contextmanager
def _no_parameter_init() -> Iterator[None]:
    """Modules built on "meta" skip their random initialisation: there is no memory to fill, and
    on meta it imports torch's compiler, over a second of every worker's start-up."""
    saved = {name: getattr(nn.init, name) for name in _INIT_FUNCTIONS}
    for name in _INIT_FUNCTIONS:
        setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, function in saved.items():
            setattr(nn.init, name, function)


_INIT_FUNCTIONS = (
    "uniform_",
    "normal_",
    "trunc_normal_",
    "constant_",
    "ones_",
    "zeros_",
    "kaiming_uniform_",
    "kaiming_normal_",
    "xavier_uniform_",
    "xavier_normal_",
)


def build_on_meta(config: PretrainedConfig, tp: TensorParallel = SINGLE) -> PagedCausalLM:
    """The model's structure (this rank's share of it) without memory: enough to count or describe it."""
    model_class = model_class_for(config)
    try:
        with torch.device("meta"), _no_parameter_init():
            model = model_class(config, tp)
    except ValueError as exc:  # heads or widths that do not divide among the ranks
        raise ModelLoadError(str(exc)) from None
    model.tie_weights()
    return model


def count_parameters(model_dir: str) -> int:
    return sum(p.numel() for p in build_on_meta(load_config(model_dir)).parameters())


def load_model(
    model_dir: str,
    dtype_name: str,
    device: torch.device,
    load_format: str = "auto",
    seed: int = 0,
    tp: TensorParallel = SINGLE,
    quantization: str | None = None,
    pooling: bool = False,
) -> tuple[PagedCausalLM, PretrainedConfig]:
    """The model of `model_dir` on `device`, this rank's share of it, and its config. A quantized checkpoint's
    linear layers (config.json's quantization_config, or `quantization`, vLLM's --quantization) get its methods.
    `pooling`: for --runner pooling (a classifier's head; no LM head needed)."""
    started = time.monotonic()
    config = load_config(model_dir)
    quant = quantization_of(config, quantization)
    dtype = resolve_dtype(config, dtype_name, device)
    model = build_on_meta(config, tp)
    if pooling:
        with torch.device("meta"):
            add_head(model, config)
    if quant is not None and not model.quantizable:
        raise ModelLoadError(f"{type(model).__name__} is not served quantized (Llama, Mistral, Qwen2 and Qwen3 are)")
    try:
        quantized = quantized_layers(model, quant) if quant is not None else {}
    except QuantizationError as exc:
        raise ModelLoadError(f"{model_dir}: {exc}") from None
    log.info(
        "loading %s (%.1fM parameters, %s weights%s) from %s",
        type(model).__name__,
        sum(p.numel() for p in model.parameters()) / 1e6,
        load_format,
        f", quantized: {quant.describe()}" if quant is not None else "",
        model_dir,
    )
    if load_format == "dummy":
        if quantized:
            raise ModelLoadError("--load-format dummy makes float weights; a quantized checkpoint needs its own")
        state = random_weights(model, config, seed, device, dtype)
    else:
        shards = model.shards() if tp.world_size > 1 else {}
        # A quantized layer is read whole and split once it is read: its tensors split along other lines
        whole = {f"{name}.weight" for name in quantized}
        weights = read_weights(
            model_dir,
            getattr(model, "ignored_weights", ()),
            {key: shard for key, shard in shards.items() if key not in whole},
        )
        try:
            load_quantized(quantized, quant, weights, shards)  # type: ignore[arg-type]
        except QuantizationError as exc:
            raise ModelLoadError(f"{model_dir}: {exc}") from None
        state = checked_weights(model, weights, model_dir)
        state = {name: t.to(device=device, dtype=dtype) for name, t in state.items()}
        for layer in quantized.values():
            layer.method.to(device)
    model.load_state_dict(state, strict=True, assign=True)
    model.tie_weights()
    del state  # the fused projections below then replace the loaded ones rather than add to them
    try:
        model.fuse_projections()
    except QuantizationError as exc:
        raise ModelLoadError(f"{model_dir}: {exc}") from None
    compute = activation_dtype(dtype, device)
    if compute != dtype:
        store_half_only_where_read(model, compute)
    prepare_layers(model, dtype)
    model.eval()
    log.info("loaded %s in %.1f s: %s", type(model).__name__, time.monotonic() - started, numerics(model, device))
    return model, config


def quantization_of(config: PretrainedConfig, flag: str | None) -> QuantizationConfig | None:
    """The checkpoint's quantization, as its config.json declares it and --quantization names it."""
    try:
        return read_quantization(getattr(config, "quantization_config", None), flag)
    except QuantizationError as exc:
        raise ModelLoadError(str(exc)) from None


@dataclass(frozen=True, slots=True)
class Numerics:
    """How a loaded model computes: what the log says at start-up and the info metric exports."""

    device: str
    weights: str  # the weights' and the KV cache's dtype
    activations: str
    kernels: str  # on a CPU the compiled kernels' build, or "torch" without one
    quantization: str = "none"  # the quantized layers' methods and their kernels

    def __str__(self) -> str:
        quantized = f"; quantized layers: {self.quantization}" if self.quantization != "none" else ""
        if self.weights == self.activations:
            return f"{self.weights} on {self.device}, kernels: {self.kernels}{quantized}"
        return (
            f"{self.weights} weights and KV cache, {self.activations} activations, on {self.device}, "
            f"kernels: {self.kernels}{quantized}"
        )


def numerics(model: PagedCausalLM, device: torch.device) -> Numerics:
    weights = model.lm_head.weight.dtype
    build = gemm_build() if device.type == "cpu" else None
    kernels = "triton" if device.type == "cuda" else f"{build.variant} ({build.description})" if build else "torch"
    if build is not None:
        kernels += describe_products(weights)
    methods = sorted(
        {module.method.describe() for module in model.modules() if isinstance(module, Linear) and module.weight is None}
    )
    return Numerics(
        device.type,
        str(weights).removeprefix("torch."),
        str(activation_dtype(weights, device)).removeprefix("torch."),
        kernels,
        "; ".join(methods) or "none",
    )


def checked_weights(model: PagedCausalLM, state: dict[str, torch.Tensor], model_dir: str) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors, once every name and shape matches what config.json implies."""
    expected = model.state_dict()
    if model.tie_word_embeddings:
        embedding = model.embedding_weight
        state.pop("lm_head.weight", None)
        if embedding in state:
            state["lm_head.weight"] = state[embedding]
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ModelLoadError(
            f"weights in {model_dir} do not match config.json: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    for name, tensor in expected.items():
        if tuple(state[name].shape) != tuple(tensor.shape):
            raise ModelLoadError(
                f"weight {name} has shape {tuple(state[name].shape)}, config.json implies {tuple(tensor.shape)}"
            )
    return state


def random_weights(
    model: PagedCausalLM, config: PretrainedConfig, seed: int, device: torch.device, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """`--load-format dummy`: weights of the right shapes from a seeded normal distribution, drawn
    on the device in the serving dtype (a 13B model never passes through host memory)."""
    generator = torch.Generator(device=device).manual_seed(seed)
    std = getattr(config, "initializer_range", getattr(config, "init_std", 0.02))
    norms = {name for name, module in model.named_modules() if "norm" in type(module).__name__.lower()}
    state = {}
    for name, tensor in model.state_dict().items():
        owner, _, kind = name.rpartition(".")
        if owner in norms:
            fill = torch.ones if kind == "weight" else torch.zeros
            state[name] = fill(tensor.shape, device=device, dtype=dtype)
        elif kind == "bias":
            state[name] = torch.zeros(tensor.shape, device=device, dtype=dtype)
        else:
            state[name] = torch.randn(tensor.shape, generator=generator, device=device, dtype=dtype).mul_(std)
    if model.tie_word_embeddings:
        state["lm_head.weight"] = state[model.embedding_weight]
    return state


def read_weights(
    model_dir: str, ignored: tuple[str, ...] = (), shards: dict[str, Shard] | None = None
) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, or of `shards` only this rank's part, read as such."""
    index_path = os.path.join(model_dir, "model.safetensors.index.json")
    names: list[str] | None = None
    if os.path.isfile(index_path):
        with open(index_path) as f:
            weight_map = json.load(f)["weight_map"]
        files, names = sorted(set(weight_map.values())), list(weight_map)
    else:
        files = ["model.safetensors"]
    state: dict[str, torch.Tensor] = {}
    ignored = ignored + ("rotary_emb.inv_freq",)
    for i, name in enumerate(files):
        path = os.path.join(model_dir, name)
        if not os.path.isfile(path):
            raise ModelLoadError(f"weight file {path} is missing")
        log.info(
            "reading weights: file %d of %d, %s (%.0f MiB)", i + 1, len(files), name, os.path.getsize(path) / 2**20
        )
        try:
            with safe_open(path, "pt") as f:
                # A bare decoder (a pooling model's `...Model`) names its tensors as the causal model's `model.`
                prefix = "model." if BARE_EMBEDDING in (names if names is not None else f.keys()) else ""
                for key in f.keys():  # noqa: SIM118 (a safetensors file, not a dict)
                    if not key.endswith(ignored):
                        shard = (shards or {}).get(prefix + key)
                        state[prefix + key] = shard.take(f.get_slice(key)) if shard else f.get_tensor(key)
        except Exception as exc:  # safetensors reports corruption with several error types
            raise ModelLoadError(f"weight file {path} is unreadable: {exc}") from None
    return state


def eos_token_ids(model_dir: str, config: PretrainedConfig) -> list[int]:
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
