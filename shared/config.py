"""Configuration values shared by the launcher and the services."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass


@dataclass(slots=True)
class SchedulerConfig:
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # None: the model's context length, at least 2048
    max_model_len: int | None = None  # None: the model's own
    num_gpu_blocks_override: int | None = None
    watermark: float = 0.01  # fraction of GPU blocks kept free when admitting new prompts
    enable_prefix_caching: bool = False
    enable_chunked_prefill: bool = True  # long prompts never wait behind decodes
    preemption_mode: str = "auto"  # swap | recompute | auto
    kv_reservation: str = "paged"  # paged | max | pow2 | oracle: the last three are baselines
    async_scheduling: bool = True  # plan the next step while the workers compute this one
    step_timeout: float = 180.0  # seconds a step may take before its worker counts as lost
    log_stats_interval: float = 10.0  # seconds between the periodic stats lines; 0: none
    api_send_queue: int = 10_000  # messages queued for one api before it counts as not reading
    speculative: SpeculativeConfig | None = None  # --speculative-config; None: no speculation


@dataclass(slots=True)
class Endpoints:
    """Where the scheduler listens: for the api's requests and for the workers' connections."""

    scheduler: str
    workers: str

    @staticmethod
    def local(directory: str, engine: int = 0) -> Endpoints:
        """Unix sockets in `directory`, which should be private to the user (mode 0700); engine i
        of several (data parallelism) has its own pair."""
        suffix = f"-{engine}" if engine else ""
        return Endpoints(
            scheduler=f"ipc://{os.path.join(directory, f'scheduler{suffix}.sock')}",
            workers=f"ipc://{os.path.join(directory, f'workers{suffix}.sock')}",
        )


SCHEDULER_METRICS_PORT = 8001  # each service's own /metrics; the api's is on its HTTP port
WORKER_METRICS_PORT = 8002  # rank r: this + r
ENGINE_PORT_STRIDE = 10  # engine i of several (data parallelism): both ports + 10 * i


SPECULATIVE_METHODS = ("ngram", "draft_model")


@dataclass(slots=True, frozen=True)
class SpeculativeConfig:
    """`--speculative-config`, in vLLM's form: who proposes tokens for the target model to verify.

    `ngram` looks the sequence's last n tokens (n from `prompt_lookup_max` down to
    `prompt_lookup_min`) up in its own prompt and output; `draft_model` runs the smaller model in
    `model` (same tokenizer). Both run in the worker, and propose up to `num_speculative_tokens`
    tokens per sequence and step."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 0
    prompt_lookup_max: int = 0
    model: str | None = None
    adaptive: bool = True  # off: speculate in every step, whatever it costs
    disable_by_batch_size: int = 0  # vLLM's knob: no speculation while more sequences decode (0: none)

    @staticmethod
    def parse(text: str | None) -> SpeculativeConfig | None:
        """The flag's JSON, checked field by field; None or "" for no speculation."""
        if not text:
            return None
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--speculative-config is not JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise ValueError("--speculative-config must be a JSON object")
        unknown = set(raw) - {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model",
                              "adaptive", "disable_by_batch_size"}
        if unknown:
            raise ValueError(f"--speculative-config: unknown field(s) {', '.join(sorted(unknown))}")
        method = raw.get("method", "ngram" if "prompt_lookup_max" in raw or "prompt_lookup_min" in raw else None)
        if method not in SPECULATIVE_METHODS:
            raise ValueError(f"--speculative-config: method must be one of {', '.join(SPECULATIVE_METHODS)}")
        k = raw.get("num_speculative_tokens")
        if type(k) is not int or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"--speculative-config: num_speculative_tokens must be an integer in "
                             f"[1, {MAX_SPECULATIVE_TOKENS}]")
        adaptive = raw.get("adaptive", True)
        if type(adaptive) is not bool:
            raise ValueError("--speculative-config: adaptive must be true or false")
        limit = raw.get("disable_by_batch_size", 0)
        if type(limit) is not int or limit < 0:
            raise ValueError("--speculative-config: disable_by_batch_size must be an integer, 0 or more")
        if method == "draft_model":
            model = raw.get("model")
            if not isinstance(model, str) or not model:
                raise ValueError("--speculative-config: draft_model needs 'model', a local model directory")
            return SpeculativeConfig(method, k, model=model, adaptive=adaptive, disable_by_batch_size=limit)
        low, high = raw.get("prompt_lookup_min"), raw.get("prompt_lookup_max")
        if low is None and high is None:
            low = high = 5  # vLLM's defaults
        low = high if low is None else low
        high = low if high is None else high
        if type(low) is not int or type(high) is not int or not 1 <= low <= high <= MAX_LOOKUP:
            raise ValueError(f"--speculative-config: prompt_lookup_min and prompt_lookup_max must be integers with "
                             f"1 <= min <= max <= {MAX_LOOKUP}")
        return SpeculativeConfig(method, k, low, high, adaptive=adaptive, disable_by_batch_size=limit)

    def to_json(self) -> str:
        """The flag's value that gives this config back (the launcher hands it on to its children)."""
        fields = {"method": self.method, "num_speculative_tokens": self.num_speculative_tokens}
        if self.method == "ngram":
            fields |= {"prompt_lookup_min": self.prompt_lookup_min, "prompt_lookup_max": self.prompt_lookup_max}
        else:
            fields["model"] = self.model
        if not self.adaptive:
            fields["adaptive"] = False
        if self.disable_by_batch_size:
            fields["disable_by_batch_size"] = self.disable_by_batch_size
        return json.dumps(fields)


MAX_SPECULATIVE_TOKENS = 16
MAX_LOOKUP = 32
