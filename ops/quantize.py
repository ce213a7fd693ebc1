"""Quantize a local HF checkpoint offline into a compressed-tensors checkpoint that pagedserve (and vLLM) serve:
the weights rounded to nearest by the scheme's groups with compressed-tensors' own scales, and saved compressed by
compressed-tensors itself, which gives the bytes llmcompressor's QuantizationModifier writes for these schemes (a
minute on a CPU, no calibration data but for the static one). lm_head stays as it is.

    pip install compressed-tensors
    python ops/quantize.py ops/models/tiny-python W8A8 /tmp/tiny-python-w8a8
    pagedserve serve /tmp/tiny-python-w8a8

Schemes: W8A8 (int8 weights per channel, int8 activations per token), W8A8-static (one calibrated scale per
layer's input), W8A16, W4A16 and W4A16_ASYM (4-bit by groups of 128; --group-size for widths 128 does not divide),
W4A16-channel, FP8_DYNAMIC (FP8 per channel; served as FP8 weights with bfloat16 inputs), FP8_BLOCK (FP8 in blocks
of 128 x 128). For GPTQ's and AWQ's error-correcting quantization, use gptqmodel or autoawq
(docs/features/quantization.md).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

import torch

SCHEMES = ("W8A8", "W8A8-static", "W8A16", "W4A16", "W4A16_ASYM", "W4A16-channel", "FP8_DYNAMIC", "FP8_BLOCK", "W3A16")


def _scheme(preset: str, group_size: int | None = None):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme, preset_name_to_scheme

    if preset == "W8A8-static":  # int8 weights per channel, int8 activations by one calibrated scale per layer
        return QuantizationScheme(
            targets=["Linear"],
            weights=QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel"),
            input_activations=QuantizationArgs(
                num_bits=8, type="int", symmetric=True, strategy="tensor", dynamic=False
            ),
        )
    if preset == "W4A16-channel":
        return QuantizationScheme(
            targets=["Linear"], weights=QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="channel")
        )
    scheme = preset_name_to_scheme(preset, ["Linear"])
    if group_size is not None and scheme.weights.strategy == "group":
        scheme.weights.group_size = group_size
    return scheme


def write_compressed_tensors(
    dense_dir: str, preset: str, out_dir: str, calibration: list[list[int]] = (), group_size: int | None = None
) -> str:
    """`dense_dir`'s model quantized by a compressed-tensors preset (W8A8, W4A16, W4A16_ASYM, W8A16, FP8_DYNAMIC,
    FP8_BLOCK, W3A16, or W8A8-static and W4A16-channel) and saved compressed, lm_head left as it is. A static
    scheme's input scales come from running `calibration` prompts."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.bfloat16)
    tops = _calibrated_inputs(model, calibration) if preset == "W8A8-static" else {}  # before quantization hooks
    apply_quantization_config(
        model, QuantizationConfig(config_groups={"group_0": _scheme(preset, group_size)}, ignore=["lm_head"])
    )
    for name, module in model.named_modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is None:
            continue
        args, weight = scheme.weights, module.weight.float()
        if args.strategy == "group":
            grouped = weight.unflatten(1, (-1, args.group_size))
            low, high = grouped.amin(2), grouped.amax(2)
        elif args.strategy == "block":
            rows, columns = args.block_structure
            blocks = weight.unflatten(0, (-1, rows)).unflatten(2, (-1, columns))
            low, high = blocks.amin((1, 3)), blocks.amax((1, 3))
        elif args.strategy == "tensor":
            low, high = weight.amin().reshape(1), weight.amax().reshape(1)
        else:
            low, high = weight.amin(1, keepdim=True), weight.amax(1, keepdim=True)
        scale, zero = calculate_qparams(low, high, args)
        module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data.copy_(zero.reshape(module.weight_zero_point.shape))
        if name in tops:
            top = tops[name].reshape(1)
            scale, _ = calculate_qparams(-top, top, scheme.input_activations)
            module.input_scale.data.copy_(scale.reshape(module.input_scale.shape))
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(out_dir)
    compressor.update_config(out_dir)
    copy_tokenizer(dense_dir, out_dir)
    return out_dir


def _calibrated_inputs(model, prompts: list[list[int]]) -> dict[str, torch.Tensor]:
    """Each linear layer's largest input magnitude over `prompts` (a static scheme's calibration)."""
    tops: dict[str, torch.Tensor] = {}
    hooks = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":

            def observe(_, inputs, name=name):
                top = inputs[0].detach().abs().amax().float()
                tops[name] = torch.maximum(tops.get(name, top), top)

            hooks.append(module.register_forward_pre_hook(observe))
    with torch.no_grad():
        for prompt in prompts:
            model(torch.tensor([prompt]))
    for hook in hooks:
        hook.remove()
    return tops


def copy_tokenizer(source: str, target: str) -> None:
    for name in (
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        "special_tokens_map.json",
        "chat_template.jinja",
    ):
        if os.path.exists(os.path.join(source, name)):
            shutil.copy(os.path.join(source, name), target)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="a local HF-format model directory")
    parser.add_argument("scheme", choices=SCHEMES)
    parser.add_argument("out", help="where the quantized checkpoint goes")
    parser.add_argument("--group-size", type=int, default=None, help="inputs per group of the W4A16 schemes")
    parser.add_argument(
        "--calibration",
        default=None,
        help="W8A8-static: a text file whose lines are the prompts that calibrate the input scales",
    )
    args = parser.parse_args()
    prompts: list[list[int]] = []
    if args.scheme == "W8A8-static":
        if not args.calibration:
            parser.error("W8A8-static needs --calibration")
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.model)
        with open(args.calibration) as f:
            prompts = [tokenizer.encode(line) for line in f if line.strip()]
    try:
        write_compressed_tensors(args.model, args.scheme, args.out, prompts, args.group_size)
    except ImportError as exc:
        sys.exit(f"{exc}: pip install compressed-tensors")
    print(args.out)


if __name__ == "__main__":
    main()
