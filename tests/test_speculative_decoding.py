"""Speculative decoding with real models, in one process: what comes out is what the target model
gives without speculation: HF's greedy tokens, the same seeded samples, and, for unseeded
sampling, the same distribution (a chi-square test against the distribution HF computes)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from shared.config import SpeculativeConfig
from tests.engine_harness import Engine
from tests.tiny_models import CONFIGS, _hf_model, build_model, hf_greedy

NGRAM = SpeculativeConfig("ngram", 4, 1, 3, adaptive=False)
# Prompts whose greedy continuations repeat themselves on the test models, so proposals get accepted.
PROMPTS = [[5, 9, 13, 7, 5, 9], [100, 101, 102, 100, 101, 102, 100], [7] * 12, list(range(20, 60)), [3, 4] * 10]


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    return {family: build_model(str(tmp_path_factory.mktemp(family)), family) for family in CONFIGS}


def hf_without_eos(model_dir: str, prompt: list[int], max_tokens: int) -> list[int]:
    """HF's greedy choice at every position, EOS or not (what ignore_eos asks for)."""
    model, tokens = _hf_model(model_dir), list(prompt)
    with torch.no_grad():
        for _ in range(max_tokens):
            tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt) :]


@pytest.mark.parametrize("family", list(CONFIGS))
def test_greedy_tokens_equal_hf_with_ngram_speculation(family, family_dirs):
    model_dir = family_dirs[family]
    engine = Engine(model_dir, speculative=NGRAM, depth=2)  # steps planned ahead, as the server does
    assert engine.generate(PROMPTS, max_tokens=48, ignore_eos=True) == [
        hf_without_eos(model_dir, p, 48) for p in PROMPTS
    ]
    stats = engine.scheduler.speculation.stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0
    # Steps were planned while proposals were in flight: the worker settled where they start.
    assert any(entry.start_at_end for step in engine.steps for entry in step.scheduled)


@pytest.mark.parametrize("family", ["llama", "opt", "gpt2", "qwen3"])
def test_a_draft_model_gives_hf_greedy_tokens_whether_it_agrees_or_not(family, family_dirs):
    model_dir = family_dirs[family]
    want = [hf_greedy(model_dir, p, 40) for p in PROMPTS]
    agreeing = Engine(model_dir, speculative=SpeculativeConfig("draft_model", 3, model=model_dir, adaptive=False))
    assert agreeing.generate(PROMPTS, max_tokens=40) == want
    stats = agreeing.scheduler.speculation.stats
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0  # the target's own greedy choices
    plain = Engine(model_dir)
    plain.generate(PROMPTS, max_tokens=40)
    assert len(agreeing.steps) < len(plain.steps) / 2
    other = family_dirs["qwen2" if family != "qwen2" else "llama"]  # same tokenizer, other weights
    disagreeing = Engine(
        model_dir, speculative=SpeculativeConfig("draft_model", 3, model=other, adaptive=False), depth=2
    )
    assert disagreeing.generate(PROMPTS, max_tokens=40) == want


SAMPLED = [
    dict(temperature=1.0),
    dict(temperature=0.7, top_k=20, top_p=0.9),
    dict(temperature=1.0, presence_penalty=0.8, frequency_penalty=0.4, repetition_penalty=1.3),
    dict(temperature=0.8, logit_bias={7: 5.0, 11: -100.0}, min_tokens=12),
]


@pytest.mark.parametrize("sampling", SAMPLED, ids=["plain", "top-k-p", "penalties", "bias-min-tokens"])
def test_a_seed_fixes_the_tokens_with_speculation_as_without(sampling, family_dirs):
    model_dir = family_dirs["llama"]
    plain = Engine(model_dir).generate(PROMPTS, max_tokens=32, seed=1234, ignore_eos=True, **sampling)
    for speculative, depth in (
        (NGRAM, 2),
        (NGRAM, 1),
        (SpeculativeConfig("draft_model", 3, model=model_dir, adaptive=False), 2),
    ):
        engine = Engine(model_dir, speculative=speculative, depth=depth)
        assert engine.generate(PROMPTS, max_tokens=32, seed=1234, ignore_eos=True, **sampling) == plain
        assert engine.scheduler.speculation.stats.num_draft_tokens > 0
    # The target's own greedy drafts are often what it samples: kept proposals are tested too.
    assert engine.scheduler.speculation.stats.num_accepted_tokens > 0


@pytest.mark.parametrize("preemption", ["swap", "recompute"])
def test_preemption_in_the_middle_of_a_speculating_batch_keeps_hf_tokens(preemption, family_dirs):
    model_dir = family_dirs["qwen2"]
    engine = Engine(
        model_dir, block_size=4, num_gpu_blocks=40, num_cpu_blocks=64, preemption=preemption, speculative=NGRAM, depth=2
    )
    assert engine.generate(PROMPTS, max_tokens=40, ignore_eos=True) == [
        hf_without_eos(model_dir, p, 40) for p in PROMPTS
    ]
    assert getattr(engine.scheduler.counters, f"preemptions_{preemption}") > 0
    assert engine.scheduler.speculation.stats.num_accepted_tokens > 0


def test_prefix_caching_chunked_prefill_and_n_samples_with_speculation(family_dirs):
    model_dir = family_dirs["llama3"]
    engine = Engine(
        model_dir, block_size=4, prefix_caching=True, chunked_prefill=True, max_num_batched_tokens=16, speculative=NGRAM
    )
    shared = [3, 4] * 10
    ids = [engine.add(shared + tail, max_tokens=30, ignore_eos=True, n=2) for tail in ([9], [9, 9])]
    tokens = engine.run()
    for request_id, tail in zip(ids, ([9], [9, 9])):
        want = hf_without_eos(model_dir, shared + tail, 30)
        assert tokens[request_id] == {0: want, 1: want}  # greedy: both samples are HF's tokens
    stats = engine.stats()
    assert stats.num_prompt_tokens_cached > 0 and engine.scheduler.speculation.stats.num_accepted_tokens > 0


# --- the distribution of speculative sampling ------------------------------------------------

VOCAB = 12
PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]
TEMPERATURE = 0.6  # sharp enough that proposals are often right, flat enough that they are often wrong


def exact_marginals(model_dir: str) -> tuple[list[float], list[float]]:
    """The target's own distributions of the second and third generated token, by enumeration."""
    model = _hf_model(model_dir)

    def next_probs(prefixes: list[list[int]]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor(prefixes)).logits[:, -1].double()
        return torch.softmax(logits / TEMPERATURE, dim=-1)

    first = next_probs([PROMPT])[0]
    second = next_probs([PROMPT + [a] for a in range(VOCAB)])  # [x1, x2]
    third = next_probs([PROMPT + [a, b] for a in range(VOCAB) for b in range(VOCAB)]).view(VOCAB, VOCAB, VOCAB)
    pair = first[:, None] * second
    return pair.sum(0).tolist(), (pair[:, :, None] * third).sum((0, 1)).tolist()


def chi_square_p_value(counts: list[int], probabilities: list[float]) -> float:
    """Pearson's test over the cells expected to hold 5 or more (the rest pooled), with the
    Wilson-Hilferty normal approximation to the chi-square distribution."""
    total = sum(counts)
    cells, pooled_count, pooled_expected = [], 0, 0.0
    for count, p in zip(counts, probabilities):
        if total * p >= 5:
            cells.append((count, total * p))
        else:
            pooled_count, pooled_expected = pooled_count + count, pooled_expected + total * p
    if pooled_expected > 0:
        cells.append((pooled_count, pooled_expected))
    statistic = sum((count - expected) ** 2 / expected for count, expected in cells)
    df = len(cells) - 1
    z = ((statistic / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


@pytest.fixture(scope="module")
def small_vocabulary_model(tmp_path_factory) -> str:
    return build_model(str(tmp_path_factory.mktemp("vocab12")), "llama", seed=3, vocab_size=VOCAB)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_sampling_keeps_the_target_distribution(method, small_vocabulary_model):
    model_dir = small_vocabulary_model
    speculative = (
        SpeculativeConfig("ngram", 3, 1, 3, adaptive=False)
        if method == "ngram"
        else SpeculativeConfig("draft_model", 3, model=model_dir, adaptive=False)
    )
    engine = Engine(model_dir, speculative=speculative, max_num_seqs=256, num_gpu_blocks=1200, depth=2)
    samples = 3000
    ids = [engine.add(PROMPT, max_tokens=4, temperature=TEMPERATURE, ignore_eos=True) for _ in range(samples)]
    tokens = engine.run()
    stats = engine.scheduler.speculation.stats
    accepted, proposed = stats.num_accepted_tokens, stats.num_draft_tokens
    assert 0.2 < accepted / proposed < 0.9  # both ways of a verification are exercised, many times
    second, third = exact_marginals(model_dir)
    for position, exact in ((1, second), (2, third)):
        counts = [0] * VOCAB
        for request_id in ids:
            counts[tokens[request_id][0][position]] += 1
        assert chi_square_p_value(counts, exact) > 1e-4, (position, counts)
    # The same test tells a distribution that is off by as much as half the proposals kept wrongly.
    rng = random.Random(0)
    argmax = max(range(VOCAB), key=lambda t: third[t])
    biased = [0] * VOCAB
    for _ in range(samples):
        biased[argmax if rng.random() < 0.15 else rng.choices(range(VOCAB), third)[0]] += 1
    assert chi_square_p_value(biased, third) < 1e-4
