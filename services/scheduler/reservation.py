"""How much KV memory a request holds from the moment it starts.

`paged`, the product, takes a block only when a token needs one. The others are the baselines of
the paper's evaluation, kept so that benchmarks can measure what paging gains with the same model,
kernels and scheduler: like a system with contiguous KV memory, a request reserves at admission
one run of consecutive blocks (first fit) with room for its prompt and for `max` the whole
context, `pow2` the next power of two of its max_tokens, or `oracle` exactly max_tokens (its true
length, when a benchmark sets max_tokens to it and ignores EOS). They share nothing: no prefix
caching, no parallel samples or beams.
"""

from __future__ import annotations

from dataclasses import dataclass

POLICIES = ("paged", "max", "pow2", "oracle")


@dataclass(slots=True, frozen=True)
class Reservation:
    policy: str = "paged"

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown KV reservation policy {self.policy!r}; one of {', '.join(POLICIES)}")

    @property
    def paged(self) -> bool:
        return self.policy == "paged"

    def tokens(self, num_prompt: int, max_tokens: int, max_model_len: int) -> int:
        """Token slots a request reserves when it starts; 0 under paging."""
        if self.policy == "paged":
            return 0
        if self.policy == "max":
            return max_model_len
        output = max_tokens if self.policy == "oracle" else 1 << max(0, max_tokens - 1).bit_length()
        return min(max_model_len, num_prompt + output)
