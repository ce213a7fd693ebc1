"""How a waiting request starts, as the KV cache manager plans it (`KVCacheManager.plan_start`): its first sequence
from its prefix-cache hits (on the device, in the host cache, or on disk to be read first), the others (a request
recomputed after forking) sharing the full blocks they have in common with it, within the step's token budget,
the free blocks above the watermark, its reservation under a baseline, and its adapter's pages."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from services.scheduler.kv_records import PrefixMatch

if TYPE_CHECKING:
    from services.scheduler.request import Request, Sequence


class StartQuestions(Protocol):
    """What planning a start asks of the KV cache manager."""

    block_size: int
    watermark_blocks: int

    @property
    def num_free_blocks(self) -> int: ...

    def match_prefix(self, seq: Sequence, disk: bool = True) -> PrefixMatch: ...

    def revives(self, match: PrefixMatch) -> int: ...

    def can_reserve(self, num_blocks: int) -> bool: ...

    def adapter_can_start(self, request: Request) -> bool: ...

    def adapter_blocks_to_start(self, request: Request) -> int: ...


@dataclass(slots=True)
class StartPlan:
    """The leader's prefix hits and positions to compute now, and each follower's."""

    leader: Sequence
    hits: PrefixMatch  # the leader's blocks found in the prefix cache
    num_tokens: int  # the leader's positions to compute now
    shared_blocks: int
    followers: list[tuple[Sequence, int]]


def fit(num_tokens: int, budget: int, chunked_prefill: bool) -> int:
    """Tokens of a prompt to run now: all, a chunk, or none if it must wait for a later step."""
    if num_tokens <= budget:
        return num_tokens
    return budget if chunked_prefill else 0


def plan_start(
    manager: StartQuestions,
    request: Request,
    budget: int,
    chunked_prefill: bool,
    reserved: int,
    watermark: bool,
    disk: bool = True,
) -> StartPlan | None:
    """How `request` starts, or None if it does not fit now (`reserved`: blocks a reservation baseline holds for
    it; `watermark`: whether the watermark's blocks stay free, as they do for paged requests that grow into them).

    The others than the first share the full blocks of the prefix they have in common with the first, as far
    as the first computes it in this very step: the worker writes a step's keys and values before any attention
    reads them."""
    size = manager.block_size
    leader, *others = request.seqs
    # Prompt log-probabilities come from computing the prompt: no cached blocks until they are out.
    wants_prompt = request.whole_prompt or (request.prompt_logprobs is not None and not request.prompt_logprobs_sent)
    hits = PrefixMatch() if wants_prompt else manager.match_prefix(leader, disk)
    num_hit = hits.num_blocks
    n = fit(leader.num_tokens - num_hit * size, budget, chunked_prefill)
    budget -= n
    needed = -(-(num_hit * size + n) // size) - num_hit + hits.num_loads  # a block loaded from host takes one
    shared_blocks = min(common_prefix(request.seqs) - 1, num_hit * size + n) // size if others else 0
    followers: list[tuple[Sequence, int]] = []
    for seq in others:
        n_seq = fit(seq.num_tokens - shared_blocks * size, budget, chunked_prefill)
        budget -= n_seq
        needed += -(-(shared_blocks * size + n_seq) // size) - shared_blocks
        followers.append((seq, n_seq))
    if n == 0 and not any(n_seq for _, n_seq in followers):
        return None
    if not manager.adapter_can_start(request):
        return None  # every adapter slot is held by running requests: wait for one to end
    needed += manager.adapter_blocks_to_start(request)
    if reserved and not manager.can_reserve(reserved):
        return None
    needed = max(needed, reserved)
    left = manager.num_free_blocks - manager.revives(hits) - needed
    if left < (manager.watermark_blocks if watermark else 0):
        return None
    return StartPlan(leader, hits, n, shared_blocks, followers)


def common_prefix(seqs: list[Sequence]) -> int:
    """Tokens at the start that all the sequences have in common."""
    first = seqs[0].token_ids()
    length = len(first)
    for seq in seqs[1:]:
        other = seq.token_ids()
        length = min(length, len(other))
        for i in range(seq.request.num_prompt_tokens, length):
            if other[i] != first[i]:
                length = i
                break
    return length
