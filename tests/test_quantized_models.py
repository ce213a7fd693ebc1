"""Quantized checkpoints served close to their oracles: compressed-tensors W8A8 int8 (dynamic per token and
static), W4A16 (symmetric by groups, asymmetric, per channel), W8A16 and FP8 (per channel and by blocks), GPTQ
(with and without act order) and AWQ, on two families, greedy, by vLLM's rule (`check_logprobs_close`). The
oracle is HF transformers on the same checkpoint where it loads it (compressed-tensors, with its activations
quantized by compressed-tensors' own functions), else on the dense model the format's packing stands for
(tests/quantized_models.py). And everything else on a quantized base: LoRA adapters (QLoRA), speculation, the
prefix cache and its host tier, int8 and fp8 KV caches, structured outputs."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_int8_linear, cpu_linear
from services.worker.loader import load_model
from services.worker.models.linear import Linear
from shared.config import SpeculativeConfig
from tests.engine_harness import Engine
from tests.quantized_models import FORMATS
from tests.tiny_models import check_logprobs_close

PROMPTS = [[5, 9, 13, 200, 17, 44, 60, 71], [7, 7, 8, 300, 12], [100, 101, 102, 103, 5, 6, 7, 8, 9, 10, 11]]
MAX_TOKENS = 16
CPU = torch.device("cpu")


def needs_kernels():
    if cpu_linear.gemm_build() is None:
        pytest.skip("no C compiler here: quantized layers run in torch (tested by test_a_cpu_without_kernels_...)")


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_each_format_serves_close_to_its_oracle(quantized, family, fmt):
    needs_kernels()
    engine = Engine(quantized.get(family, fmt), dtype="auto", prefix_caching=True)
    methods = {
        m.method.name.split(",")[0] for m in engine.runner.model.modules() if isinstance(m, Linear) and m.weight is None
    }
    assert methods, "no layer was quantized"
    ours = engine.generate_with_logprobs(PROMPTS, max_tokens=MAX_TOKENS)
    reference = [quantized.greedy_with_logprobs(family, fmt, p, MAX_TOKENS, torch.bfloat16) for p in PROMPTS]
    check_logprobs_close(ours, reference)


@pytest.mark.parametrize("fmt", ["ct-w8a8", "ct-w4a16", "gptq-act-order", "ct-fp8"])
def test_in_float32_the_activations_stay_float32_and_stay_close(quantized, fmt):
    needs_kernels()
    engine = Engine(quantized.get("llama", fmt), dtype="float32")
    qkv = engine.runner.model.model.layers[0].self_attn.qkv_proj
    assert not qkv.takes_bf16_rows
    ours = engine.generate_with_logprobs(PROMPTS, max_tokens=MAX_TOKENS)
    reference = [quantized.greedy_with_logprobs("llama", fmt, p, MAX_TOKENS, torch.float32) for p in PROMPTS]
    check_logprobs_close(ours, reference)


@pytest.mark.parametrize("fmt", ["ct-w8a8-static", "ct-w4a16", "gptq-act-order"])
def test_on_the_triton_kernels_each_layer_takes_its_gpu_path_and_stays_close(quantized, fmt, kernels_chosen):
    """What a GPU runs (W8A8's int8 sums and the codes kernel), interpreted here: the same closeness."""
    kernels_chosen(backend="triton")
    engine = Engine(quantized.get("llama", fmt), dtype="float32")
    methods = [m.method for m in engine.runner.model.modules() if isinstance(m, Linear) and m.weight is None]
    assert methods and all(getattr(m, "by_triton", False) or getattr(m, "gpu", None) is not None for m in methods), [
        m.describe() for m in methods
    ]
    # a prompt step and two decode steps: each launch costs the interpreter as much whatever its rows
    ours = engine.generate_with_logprobs(PROMPTS[:2], max_tokens=3)
    reference = [quantized.greedy_with_logprobs("llama", fmt, p, 3, torch.float32) for p in PROMPTS[:2]]
    check_logprobs_close(ours, reference)


def test_the_layers_hold_their_codes_and_the_lm_head_stays_as_the_checkpoint_has_it(quantized):
    needs_kernels()
    model, _ = load_model(quantized.get("llama", "ct-w4a16"), "auto", CPU)
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight is None and qkv.method.packed is not None
    # four bits a weight: an eighth of float32's bytes (plus a scale and an offset a group of 128)
    assert qkv.method.packed.panels.nbytes * 8 <= qkv.in_features * qkv.method.packed.panels.shape[0] * 32 * 4
    assert model.lm_head.weight.dtype is torch.bfloat16 and model.lm_head.weight is not None


@pytest.mark.parametrize("fmt", ["ct-w8a8", "ct-w4a16", "gptq"])
def test_greedy_output_is_the_same_with_speculation_prefix_caching_and_a_host_tier(quantized, fmt):
    """In float32 each quantized product is computed the same way whatever the batch: a row's int8 codes and
    scale are its own, and the codes' sums run in one order whether a step is a prompt's or a decode's."""
    needs_kernels()
    directory = quantized.get("llama", fmt)
    plain = Engine(directory, dtype="float32").generate(PROMPTS, max_tokens=MAX_TOKENS)
    ngram = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}')
    engine = Engine(
        directory,
        dtype="float32",
        speculative=ngram,
        prefix_caching=True,
        num_gpu_blocks=24,
        block_size=4,
        num_host_cache_blocks=64,
    )
    assert engine.generate(PROMPTS, max_tokens=MAX_TOKENS) == plain
    assert engine.generate(PROMPTS, max_tokens=MAX_TOKENS) == plain  # again, from the prefix cache and host tier


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("fmt", ["ct-w8a8", "ct-w8a8-static"])
def test_w8a8_products_take_their_rows_as_codes_from_the_norms_and_the_activation_with_the_same_outputs(
    quantized, family, fmt, monkeypatch
):
    """The norms before q/k/v and gate/up and the SiLU before down write their rows as the int8 codes the products
    take, one pass sooner: the same codes, so the same logits bit for bit, in prompts, eager decode steps and
    replayed ones."""
    needs_kernels()
    from services.worker.models import llama

    written = {"norm": 0, "activation": 0}

    def counted(function, name):
        def call(*args):
            rows = function(*args)
            written[name] += rows is not None
            return rows

        return call

    monkeypatch.setattr(llama, "rms_norm_int8", counted(llama.rms_norm_int8, "norm"))
    monkeypatch.setattr(llama, "silu_and_mul_int8", counted(llama.silu_and_mul_int8, "activation"))
    directory = quantized.get(family, fmt)
    prompts = [*PROMPTS, list(range(30, 70))]
    for graphs in (None, {"max_batch": 4, "max_context": 64}):
        fused = Engine(directory, dtype="bfloat16", decode_graphs=graphs)
        layers = len(fused.runner.model.model.layers)
        ours = fused.generate_with_logprobs(prompts, max_tokens=MAX_TOKENS)
        assert written["norm"] >= 2 * layers and written["activation"] >= layers
        with monkeypatch.context() as floats_only:
            floats_only.setattr(Linear, "int8_rows", property(lambda layer: None))
            apart = Engine(directory, dtype="bfloat16", decode_graphs=graphs)
            assert apart.generate_with_logprobs(prompts, max_tokens=MAX_TOKENS) == ours
        if graphs is None:  # where the kernel would not take the codes, torch sums the same ones exactly
            with monkeypatch.context() as no_kernel:
                no_kernel.setattr(cpu_int8_linear, "int8_linear", lambda *args, **kwargs: None)
                in_torch = Engine(directory, dtype="bfloat16")
                assert in_torch.generate_with_logprobs(prompts, max_tokens=MAX_TOKENS) == ours
        if graphs:  # every decode size was recorded once and replayed after, no step refused
            recorded = fused.runner.graphs.recorded
            assert recorded and all(replay is not None for replay in recorded.values()), recorded


@pytest.fixture(scope="module")
def shipped_w8a8(tmp_path_factory) -> tuple[str, list[list[int]]]:
    """The shipped model (trained, so that its greedy tokens are not near ties) as a W8A8 checkpoint, and prompts."""
    from transformers import AutoTokenizer

    from services.launcher import SHIPPED_MODEL
    from tests.quantized_models import write_compressed_tensors

    tokenizer = AutoTokenizer.from_pretrained(SHIPPED_MODEL)
    prompts = [
        tokenizer.encode(text)
        for text in (
            "def fibonacci(n):",
            "import os\nimport sys\n\ndef main():",
            "class Stack:\n    def __init__(self):",
            "for i in range(10):",
        )
    ]
    return write_compressed_tensors(SHIPPED_MODEL, "W8A8", str(tmp_path_factory.mktemp("shipped-w8a8"))), prompts


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_a_quantized_model_with_a_quantized_kv_cache_moves_its_blocks_intact_and_mostly_agrees(
    shipped_w8a8, kv_cache_dtype
):
    """Quantized weights and a quantized cache together: preempted (swapped or recomputed) requests keep their
    tokens, and the next token after each prefix of the float cache's answer mostly agrees with it. (Teacher-forced:
    free-running answers part at their first differing token, which moves with any rounding of the CPU's.)"""
    needs_kernels()
    directory, prompts = shipped_w8a8
    exact = Engine(directory, dtype="auto").generate(prompts, max_tokens=48)
    quantized = Engine(directory, dtype="auto", kv_cache_dtype=kv_cache_dtype)
    roomy = quantized.generate(prompts, max_tokens=48)
    for mode in ("swap", "recompute"):
        tight = Engine(
            directory, dtype="auto", block_size=4, num_gpu_blocks=40, preemption=mode, kv_cache_dtype=kv_cache_dtype
        )
        assert tight.generate(prompts, max_tokens=48) == roomy
        assert tight.stats().num_preemptions_swap + tight.stats().num_preemptions_recompute > 0
    # a prompt's rows attend over the cache as decode rows do (kernels/cpu_attention.c), so each prefix is read
    # back from the quantized cache; measured on 2026-11-30: int8 0.958, fp8 0.979 of 48
    prefixes = [(prompt + answer[:i], answer[i]) for prompt, answer in zip(prompts, exact) for i in range(0, 48, 4)]
    next_tokens = quantized.generate([prefix for prefix, _ in prefixes], max_tokens=1)
    agreement = sum(got == [want] for got, (_, want) in zip(next_tokens, prefixes)) / len(prefixes)
    assert agreement >= 0.85, agreement


def test_structured_outputs_hold_on_a_quantized_model(quantized):
    needs_kernels()
    from services.api.structured import GrammarSpec
    from tests.test_structured_outputs import compiled, texts

    directory = quantized.get("llama", "awq")
    regex = compiled(directory, GrammarSpec("regex", "[0-9]{3}-[a-z]{2}", "guided_regex"))
    engine = Engine(directory, dtype="auto")
    for text in texts(directory, engine.generate(PROMPTS, grammar=regex, max_tokens=30, temperature=1.0, seed=5)):
        assert len(text) == 6 and text[:3].isdigit() and text[3] == "-" and text[4:].isalpha(), text


@pytest.mark.parametrize("fmt", ["gptq", "awq"])
def test_a_lora_adapter_on_a_quantized_base_stays_close_to_peft_on_its_dense_model(quantized, fmt, tmp_path):
    """QLoRA: an adapter of the base, applied by peft to the dense model the codes stand for."""
    needs_kernels()
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from shared.lora import BaseShape, check_adapter
    from shared.protocol import LoraRef
    from tests.tiny_models import greedy_with_logprobs, make_lora_adapter

    directory, dense = quantized.get("llama", fmt), quantized.oracle_dir("llama", fmt)
    adapter = make_lora_adapter(dense, str(tmp_path / "adapter"), rank=8, seed=1)
    spec = check_adapter("tuned", adapter, BaseShape.of_model_dir(directory), max_rank=16)
    lora = LoraRef(spec.name, spec.path, spec.rank, list(spec.targets), spec.digest)
    engine = Engine(directory, dtype="float32", block_size=4, max_loras=1)
    tuned = engine.generate_with_logprobs(PROMPTS, max_tokens=MAX_TOKENS, lora=lora)
    oracle = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32), adapter)
    check_logprobs_close(tuned, [greedy_with_logprobs(oracle.eval(), p, MAX_TOKENS) for p in PROMPTS])
    assert [t for t, _ in tuned] != engine.generate(PROMPTS, max_tokens=MAX_TOKENS)  # the adapter is applied
