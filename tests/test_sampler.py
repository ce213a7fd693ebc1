import math

import torch

from services.worker.sampler import SampleRow, Sampler, filtered_probs
from shared.sampling import SamplingParams

LOGITS = torch.log(torch.tensor([[0.5, 0.25, 0.125, 0.0625, 0.0625]]))


def surviving(params: SamplingParams) -> list[int]:
    probs = filtered_probs(LOGITS, [params])[0]
    return [i for i, p in enumerate(probs.tolist()) if p > 0]


def test_top_k_keeps_the_k_most_likely_tokens():
    assert surviving(SamplingParams(top_k=2)) == [0, 1]


def test_top_p_keeps_the_smallest_set_reaching_p():
    assert surviving(SamplingParams(top_p=0.5)) == [0]
    assert surviving(SamplingParams(top_p=0.7)) == [0, 1]
    assert surviving(SamplingParams(top_p=1.0)) == [0, 1, 2, 3, 4]


def test_min_p_drops_tokens_below_a_share_of_the_best():
    assert surviving(SamplingParams(min_p=0.3)) == [0, 1]


def test_temperature_sharpens_the_distribution():
    cold = filtered_probs(LOGITS, [SamplingParams(temperature=0.5)])[0]
    assert math.isclose(cold[0].item() / cold[1].item(), 4.0, rel_tol=1e-5)


def test_greedy_takes_the_argmax_and_reports_its_logprob():
    samples = Sampler(seed=0)(LOGITS, [SampleRow(SamplingParams(temperature=0.0), 0)])
    assert samples.token_ids == [0]
    assert math.isclose(samples.logprobs[0], math.log(0.5), rel_tol=1e-5)


def test_top_logprobs_are_returned_when_asked():
    samples = Sampler(seed=0)(LOGITS, [SampleRow(SamplingParams(temperature=0.0, logprobs=2), 0)])
    assert samples.top_ids == [[0, 1]]


def test_a_seeded_row_draws_the_same_token_whatever_else_is_in_the_batch():
    vocab = 1000
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(1))
    seeded = SampleRow(SamplingParams(seed=42), num_generated=5)
    others = [SampleRow(SamplingParams(), 0), SampleRow(SamplingParams(top_k=3), 2)]
    alone = Sampler(seed=0)(logits[:1], [seeded]).token_ids[0]
    sampler = Sampler(seed=123)
    in_batch = sampler(logits[[1, 0, 2]], [others[0], seeded, others[1]]).token_ids[1]
    assert in_batch == alone
    draws = {Sampler(seed=0)(logits[:1], [SampleRow(SamplingParams(seed=42), n)]).token_ids[0] for n in range(20)}
    assert len(draws) > 1  # each position draws anew
