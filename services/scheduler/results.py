"""What the scheduler does with a step's result: settle its proposals, register the blocks it
filled, append the tokens it gave (stopping where a stop rule says), fork new samples, advance
beam searches, and report each request's progress.

It works through the sequence registry and the KV cache manager it is given; the requests it ends
are returned for the policy to take off its queues.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.scheduler.beam_search import BeamInput, BeamSearch, Candidate
from services.scheduler.kv_cache_manager import KVCacheManager
from services.scheduler.request import Request, RequestStatus, Sequence
from services.scheduler.sequences import SequenceRegistry
from shared.protocol import PooledOutput, PromptLogprobs, RequestOutput, SampledTokens, SequenceDelta, StepResult


def error_output(request_id: str, num_prompt_tokens: int, message: str, reason: str) -> RequestOutput:
    """`reason` is "rejected" for a request that can never run, "error" for a failure."""
    return RequestOutput(request_id, num_prompt_tokens, [SequenceDelta(0, [], [], [], reason)], True, message)


@dataclass(slots=True)
class Applied:
    outputs: list[RequestOutput] = field(default_factory=list)
    ended: list[Request] = field(default_factory=list)  # released; still on the policy's queues
    verified: list[tuple[int, int]] = field(default_factory=list)  # (proposals, accepted) per sequence
    num_tokens: int = 0  # tokens the step gave, before any stop cut a run short


class ResultProcessor:
    def __init__(self, registry: SequenceRegistry, kv_cache: KVCacheManager):
        self.registry = registry
        self.kv_cache = kv_cache

    def apply(self, result: StepResult, scheduled: list[Sequence], drafts: dict[int, int]) -> Applied:
        """`drafts`: seq_id -> the proposals the step asked the worker for, counted as computed."""
        applied = Applied()
        self._fail_refused(result.failures, applied)
        by_request: dict[str, list[tuple[Sequence, SampledTokens]]] = {}
        for sampled in result.sampled:
            seq = self.registry.sequences.get(sampled.seq_id)
            if seq is None or seq.request.status is not RequestStatus.RUNNING:
                continue  # aborted or preempted while the step ran
            by_request.setdefault(seq.request.request_id, []).append((seq, sampled))
            applied.num_tokens += len(sampled.token_ids)
            asked = drafts.pop(seq.seq_id, 0)  # a prompt that forks reports once per sample
            if asked:
                accepted = len(sampled.token_ids) - 1
                if sampled.num_proposed:
                    applied.verified.append((sampled.num_proposed, accepted))
                self.registry.settle_proposals(seq, asked, accepted)
        if self.kv_cache.caching:
            for seq in scheduled:
                if not seq.finished and seq.request.status is RequestStatus.RUNNING:
                    self.kv_cache.cache_full_blocks(seq)
        for computed in result.prompt_logprobs:
            self._record_prompt_logprobs(computed)
        for pooled in result.pooled:
            self._finish_pooled(pooled, applied)
        for items in by_request.values():
            request = items[0][0].request
            if request.sampling.use_beam_search:
                output = self._advance_beams(request, items, applied)
            else:
                output = self._append_samples(request, items, applied)
            if output is not None:
                applied.outputs.append(output)
        return applied

    def _fail_refused(self, failures: dict[int, str], applied: Applied) -> None:
        """Requests with a sequence the worker refused end with an error; nobody else notices."""
        for seq_id, reason in failures.items():
            seq = self.registry.sequences.get(seq_id)
            if seq is None:
                continue
            request = seq.request
            self._end(request, applied)
            applied.outputs.append(
                error_output(
                    request.request_id, request.num_prompt_tokens, f"the worker refused this request: {reason}", "error"
                )
            )

    def _finish_pooled(self, pooled: PooledOutput, applied: Applied) -> None:
        """A pooling request ends with its prompt: its vector is its output, and its blocks go."""
        seq = self.registry.sequences.get(pooled.seq_id)
        if seq is None or seq.request.status is not RequestStatus.RUNNING:
            return  # aborted or preempted while the step ran
        request = seq.request
        self.registry.finish_sequence(seq, "stop")
        self._end(request, applied)
        output = self._output(request, [SequenceDelta(0, [], [], [], "stop")], True)
        output.pooled = pooled.values
        applied.outputs.append(output)

    def _end(self, request: Request, applied: Applied) -> None:
        self.registry.release(request)
        applied.ended.append(request)

    # --- sampling (n, best_of) -----------------------------------------------------------

    def _append_samples(
        self, request: Request, items: list[tuple[Sequence, SampledTokens]], applied: Applied
    ) -> RequestOutput | None:
        sampling = request.sampling
        first = request.seqs[0]
        if len(items) > 1 and len(request.seqs) == 1 and not first.output_token_ids:
            # The prompt is done and came back with best_of samples: fork one sequence each.
            items = [(first, items[0][1])] + [
                (self.registry.fork(first, index=j), sampled) for j, (_, sampled) in enumerate(items[1:], 1)
            ]
        deltas = []
        for seq, sampled in items:
            tops = [dict(zip(ids, values)) for ids, values in zip(sampled.top_ids, sampled.top_logprobs)]
            tops += [{}] * (len(sampled.token_ids) - len(tops))
            kept, reason = self.registry.append(seq, sampled.token_ids, sampled.logprobs, tops)
            if reason is not None:
                self.registry.finish_sequence(seq, reason)
            deltas.append(
                SequenceDelta(seq.index, sampled.token_ids[:kept], sampled.logprobs[:kept], tops[:kept], reason)
            )
        finished = not request.seqs
        if finished:
            self._end(request, applied)
        if sampling.num_samples == sampling.n:
            return self._output(request, deltas, finished)
        if not finished:
            return None  # best_of > n: only the chosen samples are reported, at the end
        best = sorted(request.finished_seqs, key=lambda s: s.cumulative_logprob, reverse=True)[: sampling.n]
        return self._output(request, [_whole(i, seq) for i, seq in enumerate(best)], True)

    # --- beam search ---------------------------------------------------------------------

    def _advance_beams(
        self, request: Request, items: list[tuple[Sequence, SampledTokens]], applied: Applied
    ) -> RequestOutput | None:
        sampling = request.sampling
        if request.beam is None:
            request.beam = BeamSearch(
                sampling.num_samples, sampling.length_penalty, sampling.early_stopping, sampling.max_tokens
            )
        beam = request.beam
        pending = request.beam_pending
        for seq, sampled in items:
            pending[seq.seq_id] = sampled
        if any(seq.seq_id not in pending for seq in request.seqs):
            return None  # a beam is still being recomputed; decide when all have reported
        beams = list(request.seqs)
        inputs = [
            BeamInput(
                seq.output_token_ids,
                seq.output_logprobs,
                seq.cumulative_logprob,
                pending[seq.seq_id].top_ids[0],
                pending[seq.seq_id].top_logprobs[0],
            )
            for seq in beams
        ]
        request.beam_pending = {}
        num_prompt = request.num_prompt_tokens
        stop = self.registry.stop

        def ends(token_id: int, length: int) -> bool:
            return stop.reason(sampling, token_id, length, num_prompt + length) is not None

        chosen = beam.step(inputs, ends)
        if beam.done:
            self._end(request, applied)
            deltas = [
                SequenceDelta(
                    i,
                    h.token_ids,
                    h.logprobs,
                    [{} for _ in h.token_ids],
                    stop.reason(sampling, h.token_ids[-1], len(h.token_ids), num_prompt + len(h.token_ids)) or "length",
                )
                for i, h in enumerate(beam.best(sampling.n))
            ]
            return self._output(request, deltas, True)
        used: set[int] = set()
        assignments: list[tuple[Sequence, Candidate]] = []
        for candidate in chosen:
            parent = beams[candidate.beam]
            if candidate.beam in used:
                assignments.append((self.registry.fork(parent, index=len(assignments)), candidate))
            else:
                used.add(candidate.beam)
                assignments.append((parent, candidate))
        for i, seq in enumerate(beams):
            if i not in used:
                self.registry.finish_sequence(seq, "pruned")
        for seq, candidate in assignments:
            self.registry.append(seq, [candidate.token_id], [candidate.logprob], [{}])
            seq.cumulative_logprob = candidate.cumulative_logprob
        request.seqs = [seq for seq, _ in assignments]
        return None

    # --- shared --------------------------------------------------------------------------

    def _record_prompt_logprobs(self, computed: PromptLogprobs) -> None:
        seq = self.registry.sequences.get(computed.seq_id)
        request = seq.request if seq is not None else None
        if request is None or request.prompt_logprobs is None or request.prompt_logprobs_sent:
            return
        for k, logprob in enumerate(computed.logprobs):
            position = computed.start + k - 1  # the lists start at prompt position 1
            request.prompt_logprobs[position] = logprob
            request.prompt_top_logprobs[position] = dict(zip(computed.top_ids[k], computed.top_logprobs[k]))

    def _output(self, request: Request, deltas: list[SequenceDelta], finished: bool) -> RequestOutput:
        output = RequestOutput(
            request.request_id,
            request.num_prompt_tokens,
            deltas,
            finished,
            num_cached_tokens=request.num_cached_prompt_tokens,
        )
        if request.prompt_logprobs is not None and not request.prompt_logprobs_sent:
            request.prompt_logprobs_sent = True  # the prompt is done once anything is sampled
            # every position is computed by now: none is left None
            output.prompt_logprobs = [lp for lp in request.prompt_logprobs if lp is not None]
            output.prompt_top_logprobs = request.prompt_top_logprobs
        return output


def _whole(index: int, seq: Sequence) -> SequenceDelta:
    return SequenceDelta(
        index, list(seq.output_token_ids), list(seq.output_logprobs), list(seq.output_top_logprobs), seq.finish_reason
    )
