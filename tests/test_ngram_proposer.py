"""The n-gram proposer proposes what vLLM's would: the tokens after the earliest earlier occurrence
of the longest suffix n-gram (n from prompt_lookup_max down to prompt_lookup_min)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.worker.ngram import NgramProposer
from shared.config import SpeculativeConfig


def reference(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The rule, written as plainly as possible."""
    for n in range(max_n, min_n - 1, -1):
        if len(tokens) < n:
            continue
        suffix = tokens[-n:]
        for start in range(0, len(tokens) - n):  # earlier occurrences only, the earliest first
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


class Growing:
    """A sequence's tokens as the worker holds them, with the proposer's index of them."""

    def __init__(self, tokens: list[int]):
        self.tokens, self.index = list(tokens), None

    def propose(self, proposer: NgramProposer, k: int) -> list[int]:
        if self.index is None:
            self.index = proposer.new_index()
        return proposer.propose(self.tokens, self.index, k)


def sequence(prompt: list[int], output: list[int]) -> Growing:
    return Growing(prompt + output)


def test_it_proposes_what_followed_the_suffix_earlier():
    seq = sequence([1, 2, 3, 4, 9, 9, 1, 2], [])
    assert seq.propose(NgramProposer(2, 4), 3) == [3, 4, 9]


def test_the_longest_match_wins_and_then_the_earliest_occurrence():
    # [7, 1, 2] occurs once (followed by 5); [1, 2] alone occurs earlier too (followed by 4).
    tokens = [1, 2, 4, 7, 1, 2, 5, 0, 7, 1, 2]
    assert sequence(tokens, []).propose(NgramProposer(2, 3), 2) == [5, 0]
    assert sequence(tokens, []).propose(NgramProposer(2, 2), 2) == [4, 7]


def test_no_proposal_for_a_new_suffix_or_a_sequence_shorter_than_min_n():
    assert sequence([1, 2, 3, 4], []).propose(NgramProposer(2, 4), 4) == []
    assert sequence([5, 5], []).propose(NgramProposer(3, 4), 4) == []


def test_a_proposal_may_overlap_the_suffix_and_stops_at_the_last_token():
    assert sequence([6, 6, 6], []).propose(NgramProposer(2, 2), 5) == [6]


def test_the_index_follows_the_sequence_as_it_grows():
    seq = sequence([1, 2, 3], [])
    proposer = NgramProposer(1, 2)
    assert seq.propose(proposer, 2) == []
    seq.tokens += [1, 2]
    assert seq.propose(proposer, 2) == [3, 1]


@settings(max_examples=300, deadline=None)
@given(
    prompt=st.lists(st.integers(0, 4), min_size=1, max_size=40),
    output=st.lists(st.integers(0, 4), max_size=30),
    split=st.integers(0, 30),
    bounds=st.tuples(st.integers(1, 4), st.integers(0, 3)),
    k=st.integers(1, 6),
)
def test_it_agrees_with_the_plain_rule_at_every_length(prompt, output, split, bounds, k):
    min_n, max_n = bounds[0], bounds[0] + bounds[1]
    proposer = NgramProposer(min_n, max_n)
    seq = sequence(prompt, output[:split])
    seq.propose(proposer, k)  # an index built part way, then extended
    seq.tokens += output[split:]
    assert seq.propose(proposer, k) == reference(prompt + output, min_n, max_n, k)


def test_the_speculative_config_takes_vllms_json_and_names_what_is_wrong():
    parsed = SpeculativeConfig.parse(
        '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
    )
    assert (parsed.method, parsed.num_speculative_tokens, parsed.prompt_lookup_min, parsed.prompt_lookup_max) == (
        "ngram",
        4,
        2,
        4,
    )
    assert SpeculativeConfig.parse(parsed.to_json()) == parsed
    assert SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3}').prompt_lookup_min == 5
    assert (
        SpeculativeConfig.parse('{"method": "draft_model", "model": "/m", "num_speculative_tokens": 3}').model == "/m"
    )
    assert SpeculativeConfig.parse(None) is None
    capped = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 8}')
    assert capped.disable_by_batch_size == 8 and SpeculativeConfig.parse(capped.to_json()) == capped
    for bad, named in (
        ('{"method": "eagle", "num_speculative_tokens": 3}', "method"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
        (
            '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2}',
            "prompt_lookup",
        ),
        ('{"method": "draft_model", "num_speculative_tokens": 2}', "model"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": -1}', "disable_by_batch_size"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "typo": 1}', "typo"),
        ("[1]", "object"),
        ("{", "JSON"),
    ):
        with pytest.raises(ValueError, match=named):
            SpeculativeConfig.parse(bad)
