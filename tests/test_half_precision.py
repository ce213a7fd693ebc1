"""Half-type checkpoints on a CPU: `--dtype auto` follows the checkpoint where a kernel reads its dtype,
weights and KV cache stay in it (activations in float32), and the output is close to HF transformers
running the same weights in the same dtype by vLLM's rule (`check_logprobs_close`), on every family,
with prefix caching, under preemption, and with speculation. float32 stays HF-exact (tests/test_models.py)."""

import pytest
import torch

from kernels import cpu_linear
from services.worker.loader import activation_dtype, load_config, load_model, resolve_dtype
from shared.config import SpeculativeConfig
from tests.engine_harness import Engine
from tests.tiny_models import CONFIGS, build_model, check_logprobs_close, hf_greedy_with_logprobs

PROMPTS = [[5, 9, 13, 200, 17, 44, 60, 71], [7, 7, 8, 300, 12], [100, 101, 102, 103, 5, 6, 7, 8, 9, 10, 11]]
MAX_TOKENS = 24
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def half_models(tmp_path_factory):
    """Each family saved in bfloat16 (and llama in float16 too), built once for the module."""
    built = {}

    def get(family: str, dtype: torch.dtype = torch.bfloat16) -> str:
        if (family, dtype) not in built:
            directory = str(tmp_path_factory.mktemp(f"{family}-{str(dtype)[6:]}"))
            built[family, dtype] = build_model(directory, family, dtype=dtype)
        return built[family, dtype]

    return get


def needs_kernels():
    if cpu_linear.gemm_build() is None:
        pytest.skip("no C compiler here: auto keeps float32 without a kernel that reads half types")


def test_auto_follows_the_checkpoint_where_a_kernel_reads_its_dtype_and_float32_elsewhere(half_models, monkeypatch):
    needs_kernels()
    for dtype in (torch.bfloat16, torch.float16):
        config = load_config(half_models("llama", dtype))
        assert resolve_dtype(config, "auto", CPU) is dtype
        assert resolve_dtype(config, "float32", CPU) is torch.float32  # the exact path, as before
        assert resolve_dtype(config, "auto", torch.device("cuda")) is dtype
    float32 = load_config(build_model(str(half_models("llama")) + "-f32", "llama"))
    assert resolve_dtype(float32, "auto", CPU) is torch.float32
    assert resolve_dtype(float32, "auto", torch.device("cuda")) is torch.float16  # as vLLM downcasts
    monkeypatch.setattr(cpu_linear, "gemm_build", lambda variant=None: None)  # no compiler, no kernels
    assert resolve_dtype(load_config(half_models("llama")), "auto", CPU) is torch.float32


def test_a_half_model_on_a_cpu_stores_weights_and_tables_in_its_dtype_and_computes_in_float32(half_models, caplog):
    needs_kernels()
    caplog.set_level("INFO", logger="services.worker.loader")
    model, _ = load_model(half_models("llama"), "auto", CPU)
    assert activation_dtype(torch.bfloat16, CPU) is torch.float32
    assert model.lm_head.weight.dtype is torch.bfloat16 and model.lm_head.panels.dtype is torch.bfloat16
    assert model.model.embed_tokens.weight.dtype is torch.bfloat16
    assert model.model.norm.weight.dtype is torch.float32
    assert model.model.embed_tokens(torch.tensor([3])).dtype is torch.float32
    build = cpu_linear.gemm_build()
    assert (
        f"bfloat16 weights and KV cache, float32 activations, on cpu, kernels: {build.variant} ({build.description})"
    ) in caplog.text


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_a_bf16_checkpoint_at_auto_is_close_to_hf_in_bf16(half_models, family):
    needs_kernels()
    directory = half_models(family)
    engine = Engine(directory, dtype="auto", prefix_caching=True)
    assert engine.runner.model.lm_head.weight.dtype is torch.bfloat16
    assert engine.cache.cache.dtype is torch.bfloat16
    ours = engine.generate_with_logprobs(PROMPTS, max_tokens=MAX_TOKENS)
    reference = [hf_greedy_with_logprobs(directory, p, MAX_TOKENS, torch.bfloat16) for p in PROMPTS]
    check_logprobs_close(ours, reference)


def test_a_fp16_checkpoint_at_auto_runs_in_fp16_close_to_hf_in_fp16(half_models):
    needs_kernels()
    directory = half_models("llama", torch.float16)
    engine = Engine(directory, dtype="auto")
    assert engine.cache.cache.dtype is torch.float16
    ours = engine.generate_with_logprobs(PROMPTS, max_tokens=MAX_TOKENS)
    check_logprobs_close(ours, [hf_greedy_with_logprobs(directory, p, MAX_TOKENS, torch.float16) for p in PROMPTS])


@pytest.mark.parametrize("preemption", ["swap", "recompute"])
def test_bf16_stays_close_under_preemption_and_prefix_caching(half_models, preemption):
    needs_kernels()
    directory = half_models("llama")
    # 12 blocks of 4 tokens hold 48 tokens; the prompts reach 96 together, so some are preempted.
    engine = Engine(
        directory, dtype="auto", block_size=4, num_gpu_blocks=12, preemption=preemption, prefix_caching=True
    )
    ours = engine.generate_with_logprobs(PROMPTS + PROMPTS[:1], max_tokens=MAX_TOKENS)
    stats = engine.stats()
    assert stats.num_preemptions_swap + stats.num_preemptions_recompute > 0
    reference = [hf_greedy_with_logprobs(directory, p, MAX_TOKENS, torch.bfloat16) for p in PROMPTS + PROMPTS[:1]]
    check_logprobs_close(ours, reference)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_bf16_with_speculation_gives_the_tokens_of_bf16_without_it(half_models, method):
    """A verified proposal is the target's own choice, so speculation in bf16 keeps bf16's greedy tokens,
    which are close to HF's."""
    needs_kernels()
    directory = half_models("llama")
    config = SpeculativeConfig(
        method=method,
        num_speculative_tokens=3,
        prompt_lookup_min=1,
        prompt_lookup_max=3,
        model=directory if method == "draft_model" else None,
        adaptive=False,
    )
    plain = Engine(directory, dtype="auto").generate(PROMPTS, max_tokens=MAX_TOKENS)
    speculating = Engine(directory, dtype="auto", speculative=config)
    assert speculating.generate(PROMPTS, max_tokens=MAX_TOKENS) == plain
    assert speculating.runner.model.lm_head.weight.dtype is torch.bfloat16


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_bf16_stays_close_with_prompt_products_by_onednn(half_models, family, monkeypatch, kernels_chosen):
    # Where the CPU has AMX tiles a prompt's bf16 products go to oneDNN (cpu_linear.prompt_products): forced
    # here, from 8 rows, so that the test's short prompts take that route.
    needs_kernels()
    kernels_chosen(prompt_products="onednn")
    monkeypatch.setattr(cpu_linear, "PROMPT_ROWS", 8)
    calls = []
    linear = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear", lambda x, w, b=None: calls.append(x.shape[0]) or linear(x, w, b))
    try:
        directory = half_models(family)
        ours = Engine(directory, dtype="auto").generate_with_logprobs(PROMPTS, max_tokens=MAX_TOKENS)
    finally:
        monkeypatch.undo()
    assert calls and min(calls) >= 8  # prompt steps by oneDNN, decode steps (3 rows) packed
    check_logprobs_close(ours, [hf_greedy_with_logprobs(directory, p, MAX_TOKENS, torch.bfloat16) for p in PROMPTS])


def test_bf16_heads_of_80_dimensions_are_close_to_hf(tmp_path):
    # Two and a half vectors of 32 per head: the bf16 attention reads the last half masked, in decode and prompt rows.
    needs_kernels()
    directory = build_model(str(tmp_path), "llama", dtype=torch.bfloat16, head_dim=80)
    ours = Engine(directory, dtype="auto").generate_with_logprobs(PROMPTS, max_tokens=MAX_TOKENS)
    check_logprobs_close(ours, [hf_greedy_with_logprobs(directory, p, MAX_TOKENS, torch.bfloat16) for p in PROMPTS])
