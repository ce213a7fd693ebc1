"""Prompt lookup: propose the tokens that followed an earlier occurrence of the sequence's last n tokens.

The same rule as vLLM's n-gram proposer: the longest n from `max_n` down to `min_n` whose last
n tokens occur earlier in the sequence (prompt and output), at their earliest occurrence, and
up to k of the tokens after it. Each sequence keeps an index of its n-grams' first occurrences,
extended by the tokens it gained since the last call, so a step costs a few dictionary look-ups
per sequence instead of a scan of its whole context.

It runs in the worker, which holds every sequence's tokens as soon as a step has sampled them: so
a step that verifies proposals can be planned before the result of the step ahead of it is in,
and the worker never waits for the scheduler. Pure Python over token ids; no torch.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from shared.protocol import ScheduledSequence

if TYPE_CHECKING:
    from services.worker.mirrors import SequenceMirror


class NgramIndex:
    """Per n, each n-gram's first occurrence (the index of its last token) in a sequence's first
    `num_indexed` tokens."""

    __slots__ = ("num_indexed", "first_end")

    def __init__(self, min_n: int, max_n: int):
        self.num_indexed = 0
        self.first_end: list[dict[tuple[int, ...], int]] = [{} for _ in range(min_n, max_n + 1)]

    def extend(self, tokens: list[int], min_n: int) -> None:
        """Index `tokens[num_indexed:]`."""
        done, length = self.num_indexed, len(tokens)
        if done == length:
            return
        self.num_indexed = length
        if done == 0:  # a whole prompt: each table built in one call, the earliest occurrence kept
            for i, table in enumerate(self.first_end):
                n = min_n + i
                grams = list(zip(*(tokens[j : length - n + 1 + j] for j in range(n))))
                table.update(zip(reversed(grams), range(length - 1, n - 2, -1)))
            return
        for end in range(done, length):  # the few tokens of a step
            for i, table in enumerate(self.first_end):
                n = min_n + i
                if n > end + 1:
                    break
                table.setdefault(tuple(tokens[end - n + 1 : end + 1]), end)


class NgramProposer:
    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n

    def new_index(self) -> NgramIndex:
        return NgramIndex(self.min_n, self.max_n)

    def propose(self, tokens: list[int], index: NgramIndex, k: int) -> list[int]:
        """Up to `k` tokens to verify after `tokens`, whose index `index` is (and which only ever
        grow); [] when the last n-gram is new."""
        index.extend(tokens, self.min_n)
        length = len(tokens)
        if k <= 0:
            return []
        for n in range(min(self.max_n, length), self.min_n - 1, -1):
            end = index.first_end[n - self.min_n].get(tuple(tokens[length - n :]))
            if end is not None and end < length - 1:  # an earlier occurrence than the suffix itself
                return tokens[end + 1 : end + 1 + k]
        return []


def look_up_proposals(
    scheduled: list[ScheduledSequence], mirrors: dict[int, SequenceMirror], ngram: NgramProposer
) -> dict[int, list[int]]:
    """Each entry's draft tokens by prompt lookup; an entry computes only the proposals found (its
    place in `scheduled`, the step's own list, takes a copy that says so)."""
    proposals = {}
    for i, entry in enumerate(scheduled):
        if entry.num_draft_tokens:
            mirror = mirrors[entry.seq_id]
            if mirror.lookup is None:
                mirror.lookup = ngram.new_index()
            found = ngram.propose(mirror.token_ids, mirror.lookup, entry.num_draft_tokens)
            scheduled[i] = dataclasses.replace(
                entry,
                num_tokens=entry.num_tokens - entry.num_draft_tokens + len(found),
                num_draft_tokens=len(found),
            )
            proposals[entry.seq_id] = found
    return proposals
