"""What the scheduler does with a step's sampled tokens: append them, fork new samples,
advance beam searches, apply the stop rules, and report each request's progress."""

from __future__ import annotations

from typing import TYPE_CHECKING

from services.scheduler.beam_search import BeamInput, BeamSearch
from services.scheduler.request import Request, RequestStatus, Sequence
from shared.protocol import Fork, PromptLogprobs, RequestOutput, SampledToken, SequenceDelta, StepResult

if TYPE_CHECKING:
    from services.scheduler.scheduler import Scheduler


def error_output(request_id: str, num_prompt_tokens: int, message: str, reason: str) -> RequestOutput:
    """`reason` is "rejected" for a request that can never run, "error" for a failure."""
    return RequestOutput(request_id, num_prompt_tokens, [SequenceDelta(0, [], [], [], reason)], True, message)


class ResultProcessor:
    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler

    def apply(self, result: StepResult, scheduled: list[Sequence]) -> list[RequestOutput]:
        outputs = self._fail_refused(result.failures)
        manager = self.scheduler.block_manager
        if manager.gpu.enable_caching:
            for seq in scheduled:
                if not seq.finished and seq.request.status is RequestStatus.RUNNING:
                    manager.cache_full_blocks(seq)
        for computed in result.prompt_logprobs:
            self._record_prompt_logprobs(computed)
        by_request: dict[str, list[tuple[Sequence, SampledToken]]] = {}
        for sampled in result.sampled:
            seq = self.scheduler.sequences.get(sampled.seq_id)
            if seq is None or seq.request.status is not RequestStatus.RUNNING:
                continue  # aborted or preempted while the step ran
            by_request.setdefault(seq.request.request_id, []).append((seq, sampled))
        for items in by_request.values():
            request = items[0][0].request
            if request.sampling.use_beam_search:
                output = self._advance_beams(request, items)
            else:
                output = self._append_samples(request, items)
            if output is not None:
                outputs.append(output)
        return outputs

    def _fail_refused(self, failures: dict[int, str]) -> list[RequestOutput]:
        """Requests with a sequence the worker refused end with an error; nobody else notices."""
        outputs = []
        for seq_id, reason in failures.items():
            seq = self.scheduler.sequences.get(seq_id)
            if seq is None:
                continue
            request = seq.request
            self.scheduler.finish_request(request)
            outputs.append(error_output(request.request_id, request.num_prompt_tokens,
                                        f"the worker refused this request: {reason}", "error"))
        return outputs

    # --- sampling (n, best_of) -----------------------------------------------------------

    def _append_samples(self, request: Request, items) -> RequestOutput | None:
        sampling = request.sampling
        first = request.seqs[0]
        if len(items) > 1 and len(request.seqs) == 1 and not first.output_token_ids:
            # The prompt is done and came back with best_of samples: fork one sequence each.
            items = [(first, items[0][1])] + [
                (self._fork(first, index=j), sampled) for j, (_, sampled) in enumerate(items[1:], 1)
            ]
        else:  # one sample per sequence: the worker appended it to its copy itself
            for seq, _ in items:
                if seq.num_tokens_known_to_worker:
                    seq.num_tokens_known_to_worker += 1
        deltas = []
        for seq, sampled in items:
            top = dict(zip(sampled.top_ids, sampled.top_logprobs)) if sampled.top_ids else {}
            _append(seq, sampled.token_id, sampled.logprob, top)
            reason = self._stop_reason(seq, sampled.token_id)
            if reason is not None:
                self.scheduler.finish_sequence(seq, reason)
            deltas.append(SequenceDelta(seq.index, [sampled.token_id], [sampled.logprob], [top], reason))
        finished = not request.seqs
        if finished:
            self.scheduler.finish_request(request)
        if sampling.num_samples == sampling.n:
            return self._output(request, deltas, finished)
        if not finished:
            return None  # best_of > n: only the chosen samples are reported, at the end
        best = sorted(request.finished_seqs, key=lambda s: s.cumulative_logprob, reverse=True)[: sampling.n]
        return self._output(request, [_whole(i, seq) for i, seq in enumerate(best)], True)

    # --- beam search ---------------------------------------------------------------------

    def _advance_beams(self, request: Request, items) -> RequestOutput | None:
        sampling = request.sampling
        if request.beam is None:
            request.beam = BeamSearch(sampling.num_samples, sampling.length_penalty,
                                      sampling.early_stopping, sampling.max_tokens)
        pending = request.beam_pending
        for seq, sampled in items:
            pending[seq.seq_id] = sampled
        if any(seq.seq_id not in pending for seq in request.seqs):
            return None  # a beam is still being recomputed; decide when all have reported
        beams = list(request.seqs)
        inputs = [
            BeamInput(seq.output_token_ids, seq.output_logprobs, seq.cumulative_logprob,
                      pending[seq.seq_id].top_ids, pending[seq.seq_id].top_logprobs)
            for seq in beams
        ]
        request.beam_pending = {}
        chosen = request.beam.step(inputs, lambda token, length: self._ends_beam(request, token, length))
        if request.beam.done:
            self.scheduler.finish_request(request)
            hypotheses = request.beam.best(sampling.n)
            deltas = [
                SequenceDelta(i, h.token_ids, h.logprobs, [{} for _ in h.token_ids],
                              "stop" if self._ends_beam(request, h.token_ids[-1], 0) else "length")
                for i, h in enumerate(hypotheses)
            ]
            return self._output(request, deltas, True)
        used: set[int] = set()
        assignments = []
        for candidate in chosen:
            parent = beams[candidate.beam]
            if candidate.beam in used:
                assignments.append((self._fork(parent, index=len(assignments)), candidate))
            else:
                used.add(candidate.beam)
                assignments.append((parent, candidate))
        for i, seq in enumerate(beams):
            if i not in used:
                self.scheduler.finish_sequence(seq, "pruned")
        for seq, candidate in assignments:
            _append(seq, candidate.token_id, candidate.logprob, {})
            seq.cumulative_logprob = candidate.cumulative_logprob
        request.seqs = [seq for seq, _ in assignments]
        return None

    def _ends_beam(self, request: Request, token_id: int, new_length: int) -> bool:
        sampling = request.sampling
        if token_id in self.scheduler.eos_token_ids and not sampling.ignore_eos:
            return True
        if token_id in sampling.stop_token_ids:
            return True
        if new_length >= sampling.max_tokens:
            return True
        return request.num_prompt_tokens + new_length >= self.scheduler.budgets.max_model_len

    # --- shared --------------------------------------------------------------------------

    def _fork(self, parent: Sequence, index: int) -> Sequence:
        scheduler = self.scheduler
        parent.request.forked = True
        child = scheduler.new_sequence(parent.request, index, list(parent.output_token_ids))
        child.output_logprobs = list(parent.output_logprobs)
        child.output_top_logprobs = list(parent.output_top_logprobs)
        child.cumulative_logprob = parent.cumulative_logprob
        scheduler.block_manager.fork(parent, child)
        child.num_tokens_known_to_worker = parent.num_tokens_known_to_worker
        child.first_unsynced_block = parent.first_unsynced_block
        if parent.num_tokens_known_to_worker:
            scheduler.pending_forks.append(Fork(child.seq_id, parent.seq_id, index))
        return child

    def _stop_reason(self, seq: Sequence, token_id: int) -> str | None:
        sampling = seq.request.sampling
        if token_id in self.scheduler.eos_token_ids and not sampling.ignore_eos:
            return "stop"
        if token_id in sampling.stop_token_ids:
            return "stop"
        if len(seq.output_token_ids) >= sampling.max_tokens:
            return "length"
        if seq.num_tokens >= self.scheduler.budgets.max_model_len:
            return "length"
        return None

    def _record_prompt_logprobs(self, computed: PromptLogprobs) -> None:
        seq = self.scheduler.sequences.get(computed.seq_id)
        request = seq.request if seq is not None else None
        if request is None or request.prompt_logprobs is None or request.prompt_logprobs_sent:
            return
        for k, logprob in enumerate(computed.logprobs):
            position = computed.start + k - 1  # the lists start at prompt position 1
            request.prompt_logprobs[position] = logprob
            request.prompt_top_logprobs[position] = dict(zip(computed.top_ids[k], computed.top_logprobs[k]))

    def _output(self, request: Request, deltas: list[SequenceDelta], finished: bool) -> RequestOutput:
        output = RequestOutput(request.request_id, request.num_prompt_tokens, deltas, finished,
                               num_cached_tokens=request.num_cached_prompt_tokens)
        if request.prompt_logprobs is not None and not request.prompt_logprobs_sent:
            request.prompt_logprobs_sent = True  # the prompt is done once anything is sampled
            output.prompt_logprobs = request.prompt_logprobs
            output.prompt_top_logprobs = request.prompt_top_logprobs
        return output


def _append(seq: Sequence, token_id: int, logprob: float, top: dict[int, float]) -> None:
    seq.output_token_ids.append(token_id)
    seq.output_logprobs.append(logprob)
    seq.output_top_logprobs.append(top)
    seq.cumulative_logprob += logprob


def _whole(index: int, seq: Sequence) -> SequenceDelta:
    return SequenceDelta(index, list(seq.output_token_ids), list(seq.output_logprobs),
                         list(seq.output_top_logprobs), seq.finish_reason)
