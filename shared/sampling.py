"""Sampling parameters of one request, shared by the api, the scheduler and the worker."""

from __future__ import annotations

from dataclasses import dataclass, field


class InvalidParameter(ValueError):
    """A sampling parameter is out of range; `param` names it for the api's error JSON."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    best_of: int | None = None  # sample this many, return the best n; None: n
    use_beam_search: bool = False  # beam width: best_of
    length_penalty: float = 1.0
    early_stopping: bool | str = False  # True, False or "never", as in HF transformers
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.use_beam_search

    @property
    def num_samples(self) -> int:
        """Sequences the request runs: best_of (the beam width for beam search)."""
        return self.best_of if self.best_of is not None else self.n

    @property
    def num_top_logprobs(self) -> int:
        """Alternatives the worker reports per token: beam search needs 2 per beam."""
        wanted = self.logprobs or 0
        return max(wanted, 2 * self.num_samples) if self.use_beam_search else wanted

    def validate(self) -> None:
        if not 1 <= self.n <= 16:
            raise InvalidParameter("n", "n must be between 1 and 16")
        if self.best_of is not None and not self.n <= self.best_of <= 16:
            raise InvalidParameter("best_of", "best_of must be at least n and at most 16")
        if self.early_stopping not in (True, False, "never"):
            raise InvalidParameter("early_stopping", 'early_stopping must be true, false or "never"')
        if self.temperature < 0:
            raise InvalidParameter("temperature", "temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise InvalidParameter("top_p", "top_p must be in (0, 1]")
        if self.top_k < -1 or self.top_k == 0:
            raise InvalidParameter("top_k", "top_k must be -1 (disabled) or at least 1")
        if not 0 <= self.min_p <= 1:
            raise InvalidParameter("min_p", "min_p must be in [0, 1]")
        if self.max_tokens < 1:
            raise InvalidParameter("max_tokens", "max_tokens must be at least 1")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise InvalidParameter("logprobs", "logprobs must be in [0, 20]")
        if any(t < 0 for t in self.stop_token_ids):
            raise InvalidParameter("stop_token_ids", "stop_token_ids must be non-negative")
