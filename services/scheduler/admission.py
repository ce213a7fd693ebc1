"""Whether a request can ever run here, and how many blocks it may hold at once.

Admission refuses a request whose samples could together outgrow the pool, so the earliest
request, alone, always fits (the policy's liveness rests on this).
"""

from __future__ import annotations

from dataclasses import dataclass

from services.scheduler.kv_cache_manager import KVCacheManager
from services.scheduler.policy import SchedulingPolicy
from services.scheduler.reservation import Reservation
from shared.protocol import MAX_CACHE_SALT_CHARS, MAX_TENANT_CHARS, PRIORITY_LIMIT, AddRequest
from shared.sampling import SamplingParams


class ConfigError(ValueError):
    """Budgets with which some admissible request could never run."""


@dataclass(slots=True)
class Budgets:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    chunked_prefill: bool = False

    def check(self) -> None:
        if self.max_num_seqs < 1 or self.max_model_len < 2:
            raise ConfigError("max_num_seqs must be at least 1 and the context at least 2 tokens")
        if self.max_num_batched_tokens < 1:
            raise ConfigError("max_num_batched_tokens must be at least 1")
        if not self.chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ConfigError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) is below the context "
                f"({self.max_model_len}) with chunked prefill off: a long request could never be "
                "recomputed; raise it, lower --max-model-len, or enable chunked prefill"
            )


class Admission:
    def __init__(
        self,
        budgets: Budgets,
        kv_cache: KVCacheManager,
        reservation: Reservation,
        vocab_size: int | None,
        policy: SchedulingPolicy | None = None,
    ):
        self.budgets = budgets
        self.policy = policy or SchedulingPolicy()
        self.kv_cache = kv_cache
        self.reservation = reservation
        self.vocab_size = vocab_size

    def problem(self, message: AddRequest) -> str | None:
        """Why the request can never run here, or None; raises `InvalidParameter` for a bad parameter."""
        message.sampling.validate(self.vocab_size, self.budgets.max_num_seqs)
        if len(message.cache_salt) > MAX_CACHE_SALT_CHARS:
            return f"cache_salt must be at most {MAX_CACHE_SALT_CHARS} characters"
        if len(message.tenant) > MAX_TENANT_CHARS:
            return f"a tenant is at most {MAX_TENANT_CHARS} characters"
        if not -PRIORITY_LIMIT <= message.priority < PRIORITY_LIMIT:
            return f"priority must be in [{-PRIORITY_LIMIT}, {PRIORITY_LIMIT})"
        if message.priority and not self.policy.ranks_by_priority:
            return f"priority is used only with --scheduling-policy priority (this server's is {self.policy.name})"
        if message.kv_send and not self.kv_cache.remote.address:
            return "kv_send: this engine is not a KV producer (--kv-transfer-config)"
        if message.kv_source is not None and not self.kv_cache.remote.consumes:
            return "kv_source: this engine is not a KV consumer (--kv-transfer-config)"
        num_prompt = len(message.prompt_token_ids)
        if num_prompt == 0:
            return "the prompt is empty"
        id_limit = self.vocab_size or 2**63
        if any(not 0 <= t < id_limit for t in message.prompt_token_ids):
            return f"prompt token ids must be in [0, {id_limit})"
        if num_prompt >= self.budgets.max_model_len:
            return f"the prompt has {num_prompt} tokens; this server's context is {self.budgets.max_model_len} tokens"
        if num_prompt > self.budgets.max_num_batched_tokens and not self.budgets.chunked_prefill:
            return (
                f"the prompt has {num_prompt} tokens, more than max_num_batched_tokens "
                f"({self.budgets.max_num_batched_tokens}); enable chunked prefill for longer prompts"
            )
        if message.sampling.num_samples > self.budgets.max_num_seqs:
            return f"best_of/n exceeds max_num_seqs ({self.budgets.max_num_seqs})"
        pages = 0
        if message.lora is not None:
            refused = self.kv_cache.adapter_problem(message.lora)
            if refused is not None:
                return refused
            pages = self.kv_cache.adapter_pages(message.lora)
        if message.sampling.num_samples > 1 and not self.reservation.paged:
            return f"this server reserves KV memory per request ({self.reservation.policy}): one sample only"
        worst = self.worst_case_blocks(num_prompt, message.sampling) + pages  # its adapter's pages too
        usable = self.kv_cache.num_blocks - self.kv_cache.watermark_blocks
        if worst > usable:
            return (
                f"this request could need {worst} KV blocks with all its {message.sampling.num_samples} "
                f"sample(s) at max_tokens; the cache holds {usable}: lower max_tokens, n or best_of"
            )
        return None

    def worst_case_blocks(self, num_prompt: int, sampling: SamplingParams) -> int:
        """Blocks a request may hold at once: its samples share the prompt's full blocks (a
        recompute shares them again when the first sample's prompt fits one step), and each
        may own every later block up to max_tokens. Proposals never count: they take blocks
        only where blocks are free."""
        size = self.kv_cache.block_size
        if not self.reservation.paged:
            return self.reserved_blocks(num_prompt, sampling)
        max_new = min(sampling.max_tokens, self.budgets.max_model_len - num_prompt)
        shared = (num_prompt - 1) // size if num_prompt <= self.budgets.max_num_batched_tokens else 0
        return shared + sampling.num_samples * (-(-(num_prompt + max_new) // size) - shared)

    def reserved_blocks(self, num_prompt: int, sampling: SamplingParams) -> int:
        """Blocks a request holds from its start under a reservation baseline; 0 under paging."""
        tokens = self.reservation.tokens(num_prompt, sampling.max_tokens, self.budgets.max_model_len)
        return -(-tokens // self.kv_cache.block_size)
