"""Sampling parameters of one request, shared by the api, the scheduler and the worker.

`validate` is the one range check of every field. The api runs it before anything is queued
and the scheduler runs it again on every `AddRequest`, whoever sent it, so no value the worker
cannot hold (an integer beyond 64 bits, a NaN, a top_k past the vocabulary) ever reaches a step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

GREEDY_BELOW = 1e-5  # temperatures under this are served as greedy, as vLLM does
MAX_SAMPLES = 16
MAX_LOGPROBS = 20
MAX_STOP_TOKEN_IDS = 1024
MAX_LENGTH_PENALTY = 100.0
MAX_TEMPERATURE = 100.0  # OpenAI allows 2; past 100 every distribution here is flat anyway
INT64_MIN, UINT64_MAX = -(2**63), 2**64 - 1
MAX_TOKENS_LIMIT = 2**31 - 1
MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-2, 2], as in OpenAI's API
MAX_REPETITION_PENALTY = 2.0  # (0, 2], as in vLLM
MAX_LOGIT_BIAS = 100.0  # each bias in [-100, 100], as in OpenAI's API
MAX_LOGIT_BIAS_TOKENS = 1024
MAX_GRAMMAR_CHARS = 1 << 20  # a compiled grammar (llguidance's text) of at most 1 MiB
POOLING_TASKS = ("", "embed", "classify")


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
    presence_penalty: float = 0.0  # subtracted once from every token already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence among the generated tokens
    repetition_penalty: float = 1.0  # divides positive, multiplies negative logits of tokens seen (prompt too)
    min_tokens: int = 0  # no EOS or stop token before this many tokens
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    prompt_logprobs: int | None = None  # log-probabilities of the prompt's tokens, with this many alternatives
    grammar: str = ""  # what every output must match, as llguidance grammar text (the api compiles it); "": free
    # A pooling model's request ("embed": the pooled hidden state; "classify": its classifier's logits): the
    # prompt is computed and gives one vector, no token. "": a request that generates.
    pooling: str = ""
    # Prefill/decode disaggregation: the first token, which a prefill engine sampled and the client already has;
    # a decode engine takes it as the sequence's first sample (its log-probability its own). None: sampled here.
    first_token: int | None = None

    @property
    def constrained(self) -> bool:
        return bool(self.grammar)

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.use_beam_search

    @property
    def num_samples(self) -> int:
        """Sequences the request runs: best_of (the beam width for beam search)."""
        return self.best_of if self.best_of is not None else self.n

    def worker_keeps_samples(self, num_generated: int) -> bool:
        """Whether the worker appends what it samples for a sequence to its own copy, so that the
        scheduler need not send it back: yes, unless the scheduler chooses among the samples
        (beam search, or the first samples of a request that forks into n > 1)."""
        return not self.use_beam_search and not (num_generated == 0 and self.num_samples > 1)

    @property
    def can_speculate(self) -> bool:
        """Whether proposed tokens may be verified for it: not for beam search, whose beams the
        scheduler picks from every step's alternatives."""
        return not self.use_beam_search

    @property
    def needs_logprobs(self) -> bool:
        """Whether anyone reads its tokens' log-probabilities: the client, or the ranking of beams
        and of best_of samples."""
        return self.logprobs is not None or self.use_beam_search or self.num_samples > self.n

    @property
    def num_top_logprobs(self) -> int:
        """Alternatives the worker reports per token: beam search needs 2 per beam."""
        wanted = self.logprobs or 0
        return max(wanted, 2 * self.num_samples) if self.use_beam_search else wanted

    def validate(self, vocab_size: int | None = None, max_num_seqs: int = MAX_SAMPLES) -> None:
        """Raise `InvalidParameter` for the first field out of range; serve tiny temperatures as greedy."""
        limit = min(MAX_SAMPLES, max_num_seqs)
        _integer("n", self.n, 1, limit)
        if self.best_of is not None:
            _integer("best_of", self.best_of, self.n, limit, f"best_of must be at least n and at most {limit}")
        if type(self.use_beam_search) is not bool or type(self.ignore_eos) is not bool:
            raise InvalidParameter("use_beam_search", "use_beam_search and ignore_eos must be booleans")
        if self.early_stopping not in (True, False, "never") or type(self.early_stopping) not in (bool, str):
            raise InvalidParameter("early_stopping", 'early_stopping must be true, false or "never"')
        _number("length_penalty", self.length_penalty, -MAX_LENGTH_PENALTY, MAX_LENGTH_PENALTY)
        _number(
            "temperature",
            self.temperature,
            0.0,
            MAX_TEMPERATURE,
            f"temperature must be a number in [0, {MAX_TEMPERATURE:g}]",
        )
        if self.temperature < GREEDY_BELOW:
            self.temperature = 0.0
        _number("top_p", self.top_p, 0.0, 1.0, "top_p must be in (0, 1]")
        if self.top_p == 0.0:
            raise InvalidParameter("top_p", "top_p must be in (0, 1]")
        _number("min_p", self.min_p, 0.0, 1.0, "min_p must be in [0, 1]")
        top_k_limit = vocab_size if vocab_size else UINT64_MAX
        _integer(
            "top_k",
            self.top_k,
            -1,
            top_k_limit,
            f"top_k must be -1 (disabled) or between 1 and the vocabulary size ({top_k_limit})",
        )
        if self.top_k == 0:
            raise InvalidParameter("top_k", "top_k must be -1 (disabled) or at least 1")
        if self.seed is not None:
            _integer("seed", self.seed, INT64_MIN, UINT64_MAX, "seed must fit in 64 bits")
        _integer("max_tokens", self.max_tokens, 1, MAX_TOKENS_LIMIT)
        if self.logprobs is not None:
            _integer("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        if type(self.stop_token_ids) is not list or len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidParameter(
                "stop_token_ids", f"stop_token_ids must be a list of at most {MAX_STOP_TOKEN_IDS} token ids"
            )
        id_limit = (vocab_size - 1) if vocab_size else UINT64_MAX
        for token in self.stop_token_ids:
            _integer("stop_token_ids", token, 0, id_limit, f"stop_token_ids must be in [0, {id_limit}]")
        if self.prompt_logprobs is not None:
            _integer("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS)
        _number("presence_penalty", self.presence_penalty, -MAX_PENALTY, MAX_PENALTY)
        _number("frequency_penalty", self.frequency_penalty, -MAX_PENALTY, MAX_PENALTY)
        _number(
            "repetition_penalty",
            self.repetition_penalty,
            0.0,
            MAX_REPETITION_PENALTY,
            f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}]",
        )
        if self.repetition_penalty == 0.0:
            raise InvalidParameter(
                "repetition_penalty", f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}]"
            )
        _integer("min_tokens", self.min_tokens, 0, self.max_tokens, "min_tokens must be an integer in [0, max_tokens]")
        if type(self.grammar) is not str or len(self.grammar) > MAX_GRAMMAR_CHARS:
            raise InvalidParameter("grammar", f"grammar must be a string of at most {MAX_GRAMMAR_CHARS} characters")
        if self.grammar and self.use_beam_search:
            raise InvalidParameter("use_beam_search", "structured outputs are not supported with beam search")
        if type(self.logit_bias) is not dict or len(self.logit_bias) > MAX_LOGIT_BIAS_TOKENS:
            raise InvalidParameter(
                "logit_bias", f"logit_bias must map at most {MAX_LOGIT_BIAS_TOKENS} token ids to biases"
            )
        for token, bias in self.logit_bias.items():
            _integer("logit_bias", token, 0, id_limit, f"logit_bias keys must be token ids in [0, {id_limit}]")
            _number(
                "logit_bias",
                bias,
                -MAX_LOGIT_BIAS,
                MAX_LOGIT_BIAS,
                f"logit_bias values must be numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]",
            )
        if self.first_token is not None:
            _integer("first_token", self.first_token, 0, id_limit, f"first_token must be a token id in [0, {id_limit}]")
            if self.num_samples != 1 or self.use_beam_search:
                raise InvalidParameter("first_token", "first_token is for one sample, not n > 1 or beam search")
        if self.pooling not in POOLING_TASKS:
            raise InvalidParameter("pooling", f"pooling must be one of {', '.join(map(repr, POOLING_TASKS))}")
        if self.pooling and (
            self.num_samples != 1
            or self.use_beam_search
            or self.grammar
            or self.max_tokens != 1
            or self.needs_logprobs
            or self.prompt_logprobs is not None
        ):
            raise InvalidParameter("pooling", "a pooling request is one sequence of one step, with no sampling options")


def _integer(param: str, value: object, low: int, high: int, message: str = "") -> None:
    if type(value) is not int or not low <= value <= high:
        raise InvalidParameter(param, message or f"{param} must be an integer in [{low}, {high}]")


def _number(param: str, value: object, low: float, high: float, message: str = "") -> None:
    if type(value) not in (int, float) or not math.isfinite(value) or not low <= value <= high:  # type: ignore[arg-type, operator]
        raise InvalidParameter(param, message or f"{param} must be a finite number in [{low}, {high}]")
