"""Quantized checkpoints of the tiny test models, written by the formats' own code, and their oracles.

compressed-tensors checkpoints are written by ops/quantize.py through the compressed-tensors library itself (what
llmcompressor calls to save: its scales from min and max, as llmcompressor's round-to-nearest modifier gives them
byte for byte), and HF transformers loads them back as the oracle, dequantized, with each quantized layer's input
quantized and dequantized per token by compressed-tensors' own functions where the scheme quantizes activations.

GPTQ and AWQ checkpoints are packed here in the layouts of gptqmodel and AutoAWQ; tests/fixtures holds one layer
packed and dequantized by each library (tests/fixtures/make_quantized_layers.py), which the packing here must
reproduce byte for byte. Their oracle is HF transformers on the dense model those libraries dequantize to.
"""

from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file

from ops.quantize import copy_tokenizer, write_compressed_tensors
from tests.tiny_models import build_model

# Wide enough for groups of 128 inputs; two layers as the other tiny models.
SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def dense_model(directory: str, family: str, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> str:
    return build_model(directory, family, seed=seed, dtype=dtype, **SHAPE)


def hf_compressed_tensors_model(directory: str, dtype: torch.dtype):
    """The oracle of a compressed-tensors checkpoint: HF transformers' model of it, dequantized, each quantized
    layer's input quantized and dequantized as the scheme says by compressed-tensors' own functions."""
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    with open(os.path.join(directory, "config.json")) as f:
        declared = json.load(f)["quantization_config"]
    model = AutoModelForCausalLM.from_pretrained(
        directory, dtype=dtype, quantization_config=CompressedTensorsConfig(dequantize=True)
    )
    group = next(iter(declared["config_groups"].values()))
    inputs = group.get("input_activations")
    if inputs is None or inputs.get("type") != "int":  # weights only (FP8 activations run unquantized here too)
        return model
    from compressed_tensors.quantization import QuantizationArgs

    args = QuantizationArgs(**{k: v for k, v in inputs.items() if v is not None})
    static = load_file(os.path.join(directory, "model.safetensors")) if not args.dynamic else {}
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or name == "lm_head":
            continue

        def quantize_input(module, inputs, name=name):
            x = inputs[0]
            if args.dynamic:
                scale, zero = compute_dynamic_scales_and_zp(x, args, module)
            else:
                scale = static[f"{name}.input_scale"].to(x.dtype)
                zero = torch.zeros_like(scale)
            return (fake_quantize(x, scale.to(x.dtype), zero.to(x.dtype), args),)

        module.register_forward_pre_hook(quantize_input)
    return model


# GPTQ and AWQ, packed as their libraries pack them


def gptq_pack(
    weight: torch.Tensor, group: int, act_order: bool = False, symmetric: bool = True, seed: int = 0
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """A float weight [N, K] quantized to 4 bits by groups of inputs, in gptqmodel's layout (v1: zeros stored less
    one): its tensors, and the dense weight they stand for. With `act_order`, the inputs are grouped in a random
    order (as GPTQ's descending Hessian order puts them) and `g_idx` says each input's group."""
    n, k = weight.shape
    w = weight.float()
    if act_order:
        order = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[order] = (torch.arange(k) // group).to(torch.int32)
    else:
        g_idx = (torch.arange(k) // group).to(torch.int32)
    groups = k // group
    scales, zeros = torch.empty(groups, n), torch.empty(groups, n)
    codes = torch.empty(n, k, dtype=torch.int32)
    for g in range(groups):
        members = (g_idx == g).nonzero().flatten()
        part = w[:, members]
        if symmetric:
            scale = (part.abs().amax(1) / 7.5).clamp(min=1e-8)
            zero = torch.full((n,), 8.0)
        else:
            low, high = part.amin(1).clamp(max=0), part.amax(1).clamp(min=0)
            scale = ((high - low) / 15).clamp(min=1e-8)
            zero = (-low / scale).round().clamp(0, 15)
        scale = scale.half().float()  # the checkpoint stores float16 scales; codes come from the stored ones
        codes[:, members] = (part / scale[:, None] + zero[:, None]).round().clamp(0, 15).to(torch.int32)
        scales[g], zeros[g] = scale, zero
    qweight = _pack_words(codes.T.contiguous(), along=0)  # [K / 8, N]
    qzeros = _pack_words((zeros - 1).to(torch.int32), along=1)  # [G, N / 8], v1: less one
    dense = (codes.float() - zeros[g_idx.long()].T) * scales[g_idx.long()].T
    return {"qweight": qweight, "qzeros": qzeros, "scales": scales.half(), "g_idx": g_idx}, dense


def awq_pack(weight: torch.Tensor, group: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """A float weight [N, K] quantized to 4 bits with zero points by groups of inputs, in AutoAWQ's GEMM layout
    (its outputs interleaved 0, 2, 4, 6, 1, 3, 5, 7 in each word): its tensors, and the dense weight."""
    n, k = weight.shape
    grouped = weight.float().view(n, k // group, group)
    low, high = grouped.amin(2), grouped.amax(2)
    scales = ((high - low).clamp(min=1e-5) / 15).half().float()
    zeros = (-low / scales).round().clamp(0, 15)
    codes = (grouped / scales[:, :, None] + zeros[:, :, None]).round().clamp(0, 15).to(torch.int32).view(n, k)
    interleaved = codes.T.reshape(k, n // 8, 8)[:, :, AWQ_ORDER].reshape(k, n)
    zero_words = zeros.T.to(torch.int32).reshape(k // group, n // 8, 8)[:, :, AWQ_ORDER].reshape(k // group, n)
    dense = (codes.float().view(n, k // group, group) - zeros[:, :, None]) * scales[:, :, None]
    return (
        {
            "qweight": _pack_words(interleaved, along=1),
            "qzeros": _pack_words(zero_words, along=1),
            "scales": scales.T.contiguous().half(),
        },
        dense.view(n, k),
    )


def _pack_words(codes: torch.Tensor, along: int) -> torch.Tensor:
    """4-bit codes as int32 words of eight, along dim `along`, the first in the low bits."""
    shifts = torch.arange(8, dtype=torch.int32) * 4
    if along == 0:
        parts = codes.reshape(-1, 8, codes.shape[1]) << shifts[None, :, None]
        return parts.sum(1, dtype=torch.int32)
    parts = codes.reshape(codes.shape[0], -1, 8) << shifts[None, None, :]
    return parts.sum(2, dtype=torch.int32)


LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
INPUT_OF = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}


def write_gptq_or_awq(
    dense_dir: str, method: str, out_dir: str, act_order: bool = False, symmetric: bool = True, group: int = 128
) -> tuple[str, str]:
    """`dense_dir`'s model with each projection packed by `gptq_pack` or `awq_pack`, saved with its
    quantization_config; and beside it (out_dir + "-dense") the dense model its codes stand for, the oracle's."""
    state = load_file(os.path.join(dense_dir, "model.safetensors"))
    quantized, dense = {}, {}
    for key, tensor in state.items():
        layer, _, kind = key.rpartition(".")
        parent, _, projection = layer.rpartition(".")
        if kind == "weight" and projection in LINEAR_NAMES:
            # GPTQ orders a layer's inputs by its Hessian, which projections of one input share
            seed = sum(map(ord, parent + INPUT_OF.get(projection, projection)))
            tensors, values = (
                gptq_pack(tensor, group, act_order, symmetric, seed) if method == "gptq" else awq_pack(tensor, group)
            )
            quantized.update({f"{layer}.{name}": t for name, t in tensors.items()})
            dense[key] = values.to(tensor.dtype)
        else:
            quantized[key] = dense[key] = tensor
    os.makedirs(out_dir, exist_ok=True)
    dense_out = out_dir + "-dense"
    shutil.copytree(dense_dir, dense_out, dirs_exist_ok=True)
    save_file(dense, os.path.join(dense_out, "model.safetensors"))
    save_file(quantized, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(dense_dir, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = (
        {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": group,
            "desc_act": act_order,
            "sym": symmetric,
            "checkpoint_format": "gptq",
        }
        if method == "gptq"
        else {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}
    )
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f)
    copy_tokenizer(dense_dir, out_dir)
    return out_dir, dense_out


CALIBRATION = [[5, 9, 13, 200, 17, 44, 60, 71], [7, 7, 8, 300, 12, 90, 91], [100, 101, 102, 103, 5, 6, 7, 8, 9]]
# Each format the suite serves, by the name the tests give it: how it is written.
FORMATS = {
    "ct-w8a8": ("compressed-tensors", "W8A8"),
    "ct-w8a8-static": ("compressed-tensors", "W8A8-static"),
    "ct-w4a16": ("compressed-tensors", "W4A16"),
    "ct-w4a16-asym": ("compressed-tensors", "W4A16_ASYM"),
    "ct-w4a16-channel": ("compressed-tensors", "W4A16-channel"),
    "ct-w8a16": ("compressed-tensors", "W8A16"),
    "ct-fp8": ("compressed-tensors", "FP8_DYNAMIC"),
    "ct-fp8-block": ("compressed-tensors", "FP8_BLOCK"),
    "gptq": ("gptq", False),
    "gptq-act-order": ("gptq", True),
    "awq": ("awq", False),
}


class QuantizedCheckpoints:
    """The tiny families' quantized checkpoints, each written once (a session's cache), and their oracles."""

    def __init__(self, root: str):
        self.root = root
        self._dense: dict[str, str] = {}
        self._written: dict[tuple[str, str], tuple[str, str | None]] = {}
        self._models: dict[tuple[str, torch.dtype], object] = {}

    def dense(self, family: str) -> str:
        if family not in self._dense:
            self._dense[family] = dense_model(os.path.join(self.root, family), family)
        return self._dense[family]

    def get(self, family: str, fmt: str) -> str:
        """The checkpoint of `family` in `fmt` (a key of FORMATS)."""
        return self._write(family, fmt)[0]

    def _write(self, family: str, fmt: str) -> tuple[str, str | None]:
        if (family, fmt) not in self._written:
            method, detail = FORMATS[fmt]
            out = os.path.join(self.root, f"{family}-{fmt}")
            if method == "compressed-tensors":
                self._written[family, fmt] = (
                    write_compressed_tensors(self.dense(family), detail, out, CALIBRATION),
                    None,
                )
            else:
                self._written[family, fmt] = write_gptq_or_awq(self.dense(family), method, out, act_order=detail)
        return self._written[family, fmt]

    def oracle_model(self, family: str, fmt: str, dtype: torch.dtype):
        """HF transformers' model that the checkpoint's output is held to: compressed-tensors' own dequantized
        (with its activations quantized where the scheme says), or the dense model of a GPTQ or AWQ one."""
        directory, dense = self._write(family, fmt)
        key = (dense or directory, dtype)
        if key not in self._models:
            if dense is None:
                self._models[key] = hf_compressed_tensors_model(directory, dtype)
            else:
                from transformers import AutoModelForCausalLM

                self._models[key] = AutoModelForCausalLM.from_pretrained(dense, dtype=dtype).eval()
        return self._models[key]

    def oracle_dir(self, family: str, fmt: str) -> str:
        """A directory whose float weights are the oracle's (for peft's adapters): the dense model a GPTQ or AWQ
        checkpoint stands for."""
        directory, dense = self._write(family, fmt)
        assert dense is not None, "compressed-tensors oracles are dequantized by HF transformers in memory"
        return dense

    def greedy_with_logprobs(
        self, family: str, fmt: str, prompt: list[int], max_tokens: int, dtype: torch.dtype, top: int = 5
    ) -> tuple[list[int], list[dict[int, float]]]:
        from tests.tiny_models import greedy_with_logprobs

        return greedy_with_logprobs(self.oracle_model(family, fmt, dtype), prompt, max_tokens, top)
