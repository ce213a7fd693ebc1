"""When a sequence ends: one pure function of the token just appended and the sequence's lengths.

Stop strings are the api's: they need text, and the api cuts the stream where one appears.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.sampling import SamplingParams


@dataclass(slots=True, frozen=True)
class StopRule:
    """The server's part of the rule: its EOS ids and its context length."""

    eos_token_ids: frozenset[int]
    max_model_len: int

    def reason(self, sampling: SamplingParams, token_id: int, num_generated: int, num_tokens: int) -> str | None:
        """Why a sequence ends at `token_id`, its `num_generated`-th output token (`num_tokens` in all,
        prompt included): "stop" for EOS or a stop id (none before `min_tokens`), "length" at
        `max_tokens` or the context's end, None while it goes on."""
        if num_generated > sampling.min_tokens and (
            token_id in sampling.stop_token_ids or (token_id in self.eos_token_ids and not sampling.ignore_eos)
        ):
            return "stop"
        if num_generated >= sampling.max_tokens or num_tokens >= self.max_model_len:
            return "length"
        return None
