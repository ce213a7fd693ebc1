"""Prompt lookup: propose the tokens that followed an earlier occurrence of the sequence's last n tokens.

The same rule as vLLM's n-gram proposer: the longest n from `max_n` down to `min_n` whose last
n tokens occur earlier in the sequence (prompt and output), at their earliest occurrence, and
up to k of the tokens after it. Each sequence keeps an index of its n-grams' first occurrences,
extended by the tokens it gained since the last call, so a step costs a few dictionary look-ups
per sequence instead of a scan of its whole context.
"""

from __future__ import annotations

from services.scheduler.request import Sequence


class NgramIndex:
    """A sequence's tokens so far and, per n, each n-gram's first occurrence (the index of its last token)."""

    __slots__ = ("tokens", "first_end")

    def __init__(self, min_n: int, max_n: int):
        self.tokens: list[int] = []
        self.first_end: list[dict[tuple[int, ...], int]] = [{} for _ in range(min_n, max_n + 1)]

    def extend(self, new_tokens: list[int], min_n: int) -> None:
        tokens = self.tokens
        if not tokens:  # a whole prompt: each table built in one call, the earliest occurrence kept
            tokens.extend(new_tokens)
            for i, table in enumerate(self.first_end):
                n = min_n + i
                grams = list(zip(*(tokens[j:len(tokens) - n + 1 + j] for j in range(n))))
                table.update(zip(reversed(grams), range(len(tokens) - 1, n - 2, -1)))
            return
        for token in new_tokens:  # the few tokens of a step
            tokens.append(token)
            end = len(tokens) - 1
            for i, table in enumerate(self.first_end):
                n = min_n + i
                if n > end + 1:
                    break
                table.setdefault(tuple(tokens[end - n + 1:]), end)


class NgramProposer:
    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n

    def propose(self, seq: Sequence, k: int) -> list[int]:
        """Up to `k` tokens to verify after the sequence's last; [] when its last n-gram is new."""
        index = seq.lookup
        if index is None:
            index = seq.lookup = NgramIndex(self.min_n, self.max_n)
        self._catch_up(seq, index)
        tokens = index.tokens
        length = len(tokens)
        if k <= 0:
            return []
        for n in range(min(self.max_n, length), self.min_n - 1, -1):
            end = index.first_end[n - self.min_n].get(tuple(tokens[length - n:]))
            if end is not None and end < length - 1:  # an earlier occurrence than the suffix itself
                return tokens[end + 1:end + 1 + k]
        return []

    def _catch_up(self, seq: Sequence, index: NgramIndex) -> None:
        """Index the tokens the sequence gained since the last call (a fork starts from its own copy)."""
        done, num_prompt = len(index.tokens), seq.num_prompt_tokens
        if done < num_prompt:
            index.extend(seq.request.prompt_token_ids[done:], self.min_n)
            done = num_prompt
        index.extend(seq.output_token_ids[done - num_prompt:], self.min_n)
