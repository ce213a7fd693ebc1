"""Reading quantized checkpoints: each layout read as its own library reads it (GPTQ as gptqmodel packs and
dequantizes it, AWQ as AutoAWQ does: tests/fixtures), the scheme taken from config.json or --quantization, and
every checkpoint this server cannot serve refused at start with a message that names the format and the field."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.worker.loader import ModelLoadError, load_model
from services.worker.quantization.layouts import read_layer
from services.worker.quantization.schemes import QuantizationError, Scheme, read_quantization
from tests.quantized_models import awq_pack, gptq_pack, write_compressed_tensors
from tests.tiny_models import build_model

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "quantized_layers.safetensors")
GROUP = 128
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def libraries() -> dict[str, torch.Tensor]:
    return load_file(FIXTURE)


def close_to_float16_values(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    """The libraries dequantize in float16 (one rounding of each value), pagedserve in float32."""
    torch.testing.assert_close(ours, theirs.float(), atol=0, rtol=2**-10)


@pytest.mark.parametrize("order", ["plain", "act"])
def test_gptq_codes_are_packed_and_read_as_gptqmodel_packs_and_reads_them(libraries, order):
    weight = libraries["weight"]
    ours, _ = gptq_pack(weight, GROUP, act_order=order == "act", symmetric=True, seed=3)
    assert torch.equal(ours["qweight"], libraries[f"gptqmodel_{order}_qweight"])
    assert torch.equal(ours["g_idx"], libraries[f"gptqmodel_{order}_g_idx"].int())
    # gptqmodel keeps zero points whole in memory (its v2) and writes them less one (v1): both read the same
    v2 = {name: libraries[f"gptqmodel_{order}_{name}"] for name in ("qweight", "qzeros", "scales", "g_idx")}
    read_v2 = read_layer(Scheme("gptq", 4, GROUP, act_order=order == "act"), v2, "layer")
    read_v1 = read_layer(Scheme("gptq", 4, GROUP, act_order=order == "act", zeros_plus_one=True), ours, "layer")
    close_to_float16_values(read_v2.dequantized(), libraries[f"gptqmodel_{order}_dequantized"])
    assert torch.equal(read_v1.dequantized(), read_v2.dequantized())
    assert (read_v2.order is not None) == (order == "act")


def test_awq_codes_are_packed_and_read_as_autoawq_packs_and_reads_them(libraries):
    ours, _ = awq_pack(libraries["weight"], GROUP)
    assert torch.equal(ours["qweight"], libraries["autoawq_qweight"])
    assert torch.equal(ours["qzeros"], libraries["autoawq_qzeros"])
    theirs = {name: libraries[f"autoawq_{name}"] for name in ("qweight", "qzeros", "scales")}
    read = read_layer(Scheme("awq", 4, GROUP, symmetric=False), theirs, "layer")
    close_to_float16_values(read.dequantized(), libraries["autoawq_dequantized"])


def test_the_scheme_comes_from_config_json_or_from_the_flag_which_must_agree():
    declared = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True, "sym": True}
    config = read_quantization(declared, None)
    assert config.method == "gptq" and config.scheme_for("model.layers.0.mlp.down_proj").act_order
    assert config.scheme_for("lm_head") is None  # kept as the checkpoint has it
    assert read_quantization(declared, "gptq_marlin").method == "gptq"  # vLLM's name for the same checkpoints
    assert read_quantization(None, None) is None
    with pytest.raises(QuantizationError, match="--quantization awq does not match .*quant_method 'gptq'"):
        read_quantization(declared, "awq")
    with pytest.raises(
        QuantizationError, match="--quantization gptq: the checkpoint's config.json has no quantization_config"
    ):
        read_quantization(None, "gptq")


@pytest.mark.parametrize(
    "declared, message",
    [
        (
            {"quant_method": "bitsandbytes"},
            r"quantization method 'bitsandbytes' \(config.json "
            r"quantization_config.quant_method\) is not supported",
        ),
        ({"quant_method": "gptq", "bits": 3, "group_size": 128}, r"quantization_config.bits is 3: 4 or 8 bits"),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, r"version is 'gemv'"),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "marlin-24",
                "config_groups": {
                    "g": {
                        "targets": ["Linear"],
                        "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128},
                    }
                },
            },
            r"config_groups.g.format is 'marlin-24'",
        ),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "int-quantized",
                "config_groups": {
                    "g": {
                        "targets": ["Linear"],
                        "weights": {"num_bits": 8, "type": "int", "strategy": "channel"},
                        "input_activations": {
                            "num_bits": 8,
                            "type": "int",
                            "symmetric": False,
                            "dynamic": True,
                            "strategy": "token",
                        },
                    }
                },
            },
            r"input_activations.symmetric is false",
        ),
    ],
)
def test_a_scheme_that_cannot_be_served_is_refused_naming_its_field(declared, message):
    with pytest.raises(QuantizationError, match=message):
        read_quantization(declared, None)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("refusals")
    dense = build_model(
        str(root / "dense"),
        "llama",
        dtype=torch.bfloat16,
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return {
        "dense": dense,
        "w4a16": write_compressed_tensors(dense, "W4A16", str(root / "w4a16")),
        "w3a16": write_compressed_tensors(dense, "W3A16", str(root / "w3a16")),
    }


def edited(source: str, target: str, config=None, tensors=None) -> str:
    """A copy of a checkpoint with its quantization_config or its tensors edited."""
    shutil.copytree(source, target)
    if config is not None:
        path = os.path.join(target, "config.json")
        with open(path) as f:
            data = json.load(f)
        config(data["quantization_config"])
        with open(path, "w") as f:
            json.dump(data, f)
    if tensors is not None:
        path = os.path.join(target, "model.safetensors")
        state = load_file(path)
        tensors(state)
        save_file(state, path)
    return target


def refusal(directory: str, **options) -> str:
    with pytest.raises(ModelLoadError) as error:
        load_model(directory, "auto", CPU, **options)
    return str(error.value)


def test_3_bits_are_refused_at_start(checkpoints):
    assert "num_bits is 3: 4 or 8 bits are supported" in refusal(checkpoints["w3a16"])


def test_a_group_size_that_does_not_divide_the_input_width_is_refused(checkpoints, tmp_path):
    def regroup(config):
        config["config_groups"]["group_0"]["weights"]["group_size"] = 96

    message = refusal(edited(checkpoints["w4a16"], str(tmp_path / "g96"), config=regroup))
    assert "model.layers.0.self_attn.q_proj: the group size 96 does not divide the input width 256" in message


def test_missing_scales_are_refused_naming_the_layer(checkpoints, tmp_path):
    def drop(state):
        del state["model.layers.1.mlp.down_proj.weight_scale"]

    message = refusal(edited(checkpoints["w4a16"], str(tmp_path / "no-scale"), tensors=drop))
    assert "model.layers.1.mlp.down_proj" in message and "lacks ['weight_scale']" in message


@pytest.mark.parametrize("lie", ["weight_shape", "packed", "scales"])
def test_shapes_that_lie_are_refused(checkpoints, tmp_path, lie):
    layer = "model.layers.0.mlp.up_proj"

    def edit(state):
        if lie == "weight_shape":  # says 1024 outputs where config.json implies 512
            state[f"{layer}.weight_shape"] = torch.tensor([1024, 256])
        elif lie == "packed":  # codes for half the inputs
            state[f"{layer}.weight_packed"] = state[f"{layer}.weight_packed"][:, :16].contiguous()
        else:  # scales for three groups of 128 in 256 inputs
            state[f"{layer}.weight_scale"] = torch.cat([state[f"{layer}.weight_scale"]] * 2, 1)[:, :3].contiguous()

    message = refusal(edited(checkpoints["w4a16"], str(tmp_path / lie), tensors=edit))
    assert layer in message, message


def test_a_flag_that_contradicts_the_checkpoint_is_refused(checkpoints):
    assert "--quantization gptq does not match" in refusal(checkpoints["w4a16"], quantization="gptq")
    assert "has no quantization_config" in refusal(checkpoints["dense"], quantization="awq")


def test_a_family_that_is_not_served_quantized_is_refused(checkpoints, tmp_path):
    gpt2 = build_model(str(tmp_path / "gpt2"), "gpt2")
    with open(os.path.join(checkpoints["w4a16"], "config.json")) as f:
        declared = json.load(f)["quantization_config"]
    with open(os.path.join(gpt2, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(gpt2, "config.json"), "w") as f:
        json.dump(config | {"quantization_config": declared}, f)
    assert "GPT2LMHeadModel is not served quantized" in refusal(gpt2)


def test_the_cpu_kernel_builds_a_flag_names_are_the_ones_the_kernels_build():
    from kernels import native
    from shared.config import CPU_KERNEL_BUILDS

    assert set(CPU_KERNEL_BUILDS) == {"auto", *native.VARIANTS, *native.EMULATED}
