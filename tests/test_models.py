"""Every supported family against HF transformers, the loader's formats, and its clear errors."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from kernels import workspace
from services.worker.loader import ModelLoadError, count_parameters, load_model
from services.worker.models import ARCHITECTURES
from tests.conftest import ROOT
from tests.engine_harness import Engine
from tests.tiny_models import CONFIGS, build_model, hf_greedy

pytestmark = pytest.mark.slow  # starts processes: not in `make check`

PROMPTS = [[5, 9, 13, 200, 17], [7] * 23, list(range(20, 57)), [400, 3]]
CONFIG_DIR = os.path.join(ROOT, "ops", "configs")


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    return {family: build_model(str(tmp_path_factory.mktemp(family)), family) for family in CONFIGS}


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_each_family_gives_hf_greedy_tokens(family_dirs, family):
    model_dir = family_dirs[family]
    got = Engine(model_dir, block_size=4).generate(PROMPTS, max_tokens=10)
    assert got == [hf_greedy(model_dir, p, 10) for p in PROMPTS]


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_hf_greedy_tokens_hold_with_every_named_scratch_buffer_reused(family_dirs, family, monkeypatch):
    """A scratch buffer's name promises that its use ends before the next of that name is taken. Steps
    large enough reuse them (kernels/workspace.py); here every size does, as a replay's recording does."""
    monkeypatch.setattr(workspace, "REUSE_BYTES", 0)
    model_dir = family_dirs[family]
    got = Engine(model_dir, block_size=4).generate(PROMPTS, max_tokens=10)
    assert got == [hf_greedy(model_dir, p, 10) for p in PROMPTS]


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "opt"])
def test_projections_of_one_input_are_loaded_as_one_matmul(family_dirs, family):
    model, _ = load_model(family_dirs[family], "float32", torch.device("cpu"))
    checkpoint = load_file(os.path.join(family_dirs[family], "model.safetensors"))
    names = {name.rpartition(".")[2] for name, _ in model.named_modules()}
    assert not names & {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"}
    layer = "model.decoder.layers.0" if family == "opt" else "model.layers.0"
    qkv = [checkpoint[f"{layer}.self_attn.{p}_proj.weight"] for p in "qkv"]
    assert torch.equal(model.get_parameter(f"{layer}.self_attn.qkv_proj.weight"), torch.cat(qkv))
    if f"{layer}.self_attn.q_proj.bias" in checkpoint:
        biases = [checkpoint[f"{layer}.self_attn.{p}_proj.bias"] for p in "qkv"]
        assert torch.equal(model.get_parameter(f"{layer}.self_attn.qkv_proj.bias"), torch.cat(biases))
    if family != "opt":
        gate_up = [checkpoint[f"{layer}.mlp.{p}_proj.weight"] for p in ("gate", "up")]
        assert torch.equal(model.get_parameter(f"{layer}.mlp.gate_up_proj.weight"), torch.cat(gate_up))


def test_sharded_safetensors_with_an_index_load_the_same_weights(family_dirs, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(family_dirs["llama"])
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    shutil.copy(os.path.join(family_dirs["llama"], "tokenizer.json"), tmp_path)
    assert os.path.isfile(tmp_path / "model.safetensors.index.json")
    assert len([f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]) > 1
    sharded, _ = load_model(str(tmp_path), "float32", torch.device("cpu"))
    whole, _ = load_model(family_dirs["llama"], "float32", torch.device("cpu"))
    for (name, a), (_, b) in zip(sharded.state_dict().items(), whole.state_dict().items()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_dtype_flag_sets_the_weights_dtype(family_dirs, dtype):
    """On a CPU a half type is what the projections and the embedding table are stored in; norms and
    biases, which the float32 activations meet directly, are float32."""
    model, _ = load_model(family_dirs["qwen2"], dtype, torch.device("cpu"))
    stored = {name: p.dtype for name, p in model.named_parameters()}
    half = {name for name in stored if name.endswith(("proj.weight", "lm_head.weight", "embed_tokens.weight"))}
    assert {stored[name] for name in half} == {getattr(torch, dtype)} and len(half) > 3
    assert {dtype for name, dtype in stored.items() if name not in half} == {torch.float32}


@pytest.fixture(scope="module")
def counted_in_a_fresh_process() -> dict[str, tuple[int, float]]:
    """Each shipped config's parameter count, and how far the count raised the peak resident size
    (MiB), in a process of their own: this one's peak has been raised by earlier tests."""
    probe = (
        "import json, os, resource, sys; from services.worker.loader import count_parameters\n"
        "counted = {}\n"
        "for name in sorted(os.listdir(sys.argv[1])):\n"
        "    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "    count = count_parameters(os.path.join(sys.argv[1], name))\n"
        "    counted[name] = (count, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024)\n"
        "print(json.dumps(counted))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe, CONFIG_DIR], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return {name: tuple(value) for name, value in json.loads(done.stdout).items()}


@pytest.mark.parametrize("name", sorted(os.listdir(CONFIG_DIR)))
def test_shipped_configs_count_parameters_without_allocating_them(name, counted_in_a_fresh_process):
    ours, grown_mib = counted_in_a_fresh_process[name]
    with torch.device("meta"):
        config = AutoConfig.from_pretrained(os.path.join(CONFIG_DIR, name))
        theirs = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    assert ours == theirs
    assert grown_mib < 200  # billions of parameters, counted on the meta device


def test_llama_3_1_8b_has_its_published_parameter_count():
    assert count_parameters(os.path.join(CONFIG_DIR, "llama-3.1-8b")) == 8_030_261_248


def test_dummy_weights_need_only_a_config(family_dirs, tmp_path):
    shutil.copy(os.path.join(family_dirs["opt"], "config.json"), tmp_path)
    model, _ = load_model(str(tmp_path), "float32", torch.device("cpu"), load_format="dummy", seed=1)
    again, _ = load_model(str(tmp_path), "float32", torch.device("cpu"), load_format="dummy", seed=1)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))
    norms = [p for n, p in model.named_parameters() if "layer_norm" in n and n.endswith("weight")]
    assert norms and all(torch.all(p == 1) for p in norms)


# --- bad model directories fail fast, naming the problem ------------------------------------


def _copy(model_dir, tmp_path):
    target = tmp_path / "model"
    shutil.copytree(model_dir, target)
    return target


def test_an_unsupported_architecture_lists_the_supported_ones(family_dirs, tmp_path):
    target = _copy(family_dirs["llama"], tmp_path)
    config = json.loads((target / "config.json").read_text())
    config["architectures"] = ["FalconForCausalLM"]
    (target / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError) as error:
        load_model(str(target), "auto", torch.device("cpu"))
    assert "FalconForCausalLM" in str(error.value)
    assert all(name in str(error.value) for name in ARCHITECTURES)


def test_a_missing_weight_file_is_named(family_dirs, tmp_path):
    target = _copy(family_dirs["llama"], tmp_path)
    os.remove(target / "model.safetensors")
    with pytest.raises(ModelLoadError, match="model.safetensors is missing"):
        load_model(str(target), "auto", torch.device("cpu"))


def test_a_corrupt_weight_file_is_named(family_dirs, tmp_path):
    target = _copy(family_dirs["llama"], tmp_path)
    data = (target / "model.safetensors").read_bytes()
    (target / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="unreadable"):
        load_model(str(target), "auto", torch.device("cpu"))


def test_weights_that_do_not_match_the_config_are_named(family_dirs, tmp_path):
    target = _copy(family_dirs["llama"], tmp_path)
    config = json.loads((target / "config.json").read_text())
    config["intermediate_size"] = 96
    (target / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"mlp\.\w+_proj\.weight has shape"):
        load_model(str(target), "auto", torch.device("cpu"))
    weights = load_file(target / "model.safetensors")
    del weights["model.norm.weight"]
    save_file(weights, target / "model.safetensors")
    config["intermediate_size"] = 128
    (target / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="missing.*model.norm.weight"):
        load_model(str(target), "auto", torch.device("cpu"))


def test_a_directory_without_a_config_is_named(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(str(tmp_path), "auto", torch.device("cpu"))
