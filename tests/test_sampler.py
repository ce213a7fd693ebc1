import math

import torch

from services.worker.sampler import Sampler, SampleRow, filter_settings, filtered_probs
from shared.sampling import SamplingParams

LOGITS = torch.log(torch.tensor([[0.5, 0.25, 0.125, 0.0625, 0.0625]]))


def filtered(params: SamplingParams) -> torch.Tensor:
    return filtered_probs(
        LOGITS, *(torch.tensor(values, dtype=torch.float32) for values in filter_settings([params], LOGITS.shape[-1]))
    )[0]


def surviving(params: SamplingParams) -> list[int]:
    probs = filtered(params)
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
    cold = filtered(SamplingParams(temperature=0.5))
    assert math.isclose(cold[0].item() / cold[1].item(), 4.0, rel_tol=1e-5)


def test_greedy_takes_the_argmax_and_reports_its_logprob_when_asked():
    [[sample]] = Sampler(seed=0)(LOGITS, [SampleRow(SamplingParams(temperature=0.0, logprobs=0), 0)])
    assert sample.token_id == 0
    assert math.isclose(sample.logprob, math.log(0.5), rel_tol=1e-5)


def test_log_probabilities_are_computed_only_where_someone_reads_them():
    unread, read = SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, n=1, best_of=2)
    assert not unread.needs_logprobs and read.needs_logprobs  # best_of ranks by them
    [[alone]] = Sampler(seed=0)(LOGITS, [SampleRow(unread, 0)])
    assert alone.token_id == 0 and alone.logprob == 0.0
    [[mixed], [ranked]] = Sampler(seed=0)(LOGITS.repeat(2, 1), [SampleRow(unread, 1), SampleRow(read, 1)])
    assert math.isclose(ranked.logprob, math.log(0.5), rel_tol=1e-5)


def test_top_logprobs_are_returned_when_asked():
    [[sample]] = Sampler(seed=0)(LOGITS, [SampleRow(SamplingParams(temperature=0.0, logprobs=2), 0)])
    assert sample.top_ids == [0, 1]


def test_a_seeded_row_draws_the_same_token_whatever_else_is_in_the_batch():
    vocab = 1000
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(1))
    seeded = SampleRow(SamplingParams(seed=42), num_generated=5)
    others = [SampleRow(SamplingParams(), 0), SampleRow(SamplingParams(top_k=3), 2)]
    alone = Sampler(seed=0)(logits[:1], [seeded])[0][0].token_id
    sampler = Sampler(seed=123)
    in_batch = sampler(logits[[1, 0, 2]], [others[0], seeded, others[1]])[1][0].token_id
    assert in_batch == alone
    draws = {Sampler(seed=0)(logits[:1], [SampleRow(SamplingParams(seed=42), n)])[0][0].token_id for n in range(20)}
    assert len(draws) > 1  # each position draws anew


def test_a_finished_prompt_draws_one_token_per_sample_and_each_matches_its_forked_sequence():
    logits = torch.randn(1, 1000, generator=torch.Generator().manual_seed(2))
    params = SamplingParams(n=3, seed=5)
    first = Sampler(seed=0)(logits, [SampleRow(params, 0, index=0, num_samples=3)])[0]
    assert len(first) == 3 and len({s.token_id for s in first}) > 1
    # Each forked sequence j would have drawn the same token alone with its own index.
    alone = [Sampler(seed=0)(logits, [SampleRow(params, 0, index=j)])[0][0].token_id for j in range(3)]
    assert [s.token_id for s in first] == alone


def test_sampled_tokens_follow_the_filtered_distribution_and_never_a_dropped_token():
    logits = LOGITS.repeat(4000, 1)
    plain = [SampleRow(SamplingParams(), 0)] * 4000
    counts = torch.bincount(torch.tensor([s.token_id for [s] in Sampler(seed=3)(logits, plain)]), minlength=5)
    expected = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.0625]) * 4000
    assert ((counts - expected).abs() < 5 * expected.sqrt()).all(), counts  # five standard deviations
    top_two = [SampleRow(SamplingParams(top_k=2), 0)] * 4000
    counts = torch.bincount(torch.tensor([s.token_id for [s] in Sampler(seed=3)(logits, top_two)]), minlength=5)
    assert counts[2:].sum() == 0 and abs(counts[0] - 4000 * 2 / 3) < 5 * math.sqrt(4000 * 2 / 9), counts


def test_a_first_token_sampled_elsewhere_is_taken_with_its_logprob_here_and_only_as_the_first():
    """A decode engine takes the prefill engine's first token (prefill/decode disaggregation), whatever it would
    have drawn, and reports that token's log-probability under its own logits; later tokens are its own."""
    given = SamplingParams(temperature=1.0, seed=3, logprobs=1, first_token=3)
    [[first], [later]] = Sampler(seed=0)(LOGITS.repeat(2, 1), [SampleRow(given, 0), SampleRow(given, 1)])
    assert first.token_id == 3 and math.isclose(first.logprob, math.log(0.0625), rel_tol=1e-5)
    unforced = SamplingParams(temperature=1.0, seed=3, logprobs=1)
    [[drawn]] = Sampler(seed=0)(LOGITS, [SampleRow(unforced, 1)])
    assert later.token_id == drawn.token_id  # the seeded draw at position 1, as if the first were its own
