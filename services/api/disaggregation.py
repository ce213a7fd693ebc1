"""Prefill/decode disaggregation at the api (`--prefill-endpoint`): each request's prompt is computed on a
prefill engine, which samples the first token and keeps the prompt's KV blocks; the client gets that token at
once. A decode engine then fetches the blocks it lacks, takes the same first token (`first_token`: it is not
sampled again, so the client sees it once) and generates the rest. The api releases the prefill engine's
blocks as soon as the decode engine runs the request (it fetched them, or gave up and computes the prompt
itself), or when the request ends first; the prefill engine frees them after a while in any case.

A request of several samples (n > 1, best_of, beams) has its prompt computed on the prefill engine but all its
tokens from the decode engine, which forks them there. Requests a decode engine must see whole (pooling, prompt
logprobs) and any request while no prefill engine is up go to a decode engine alone, which computes the prompt
as an ordinary engine does.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import replace

from services.api.engine_client import EngineClient
from services.api.engine_group import EngineGroup
from services.api.routing import Router
from shared.protocol import KVHandoff, LoraRef, RequestOutput, SequenceDelta
from shared.sampling import SamplingParams

PREFILL_SUFFIX = "-prefill"


class DisaggregatedEngines(EngineGroup):
    """The decode engines as the api's engines (health, metrics, routing), with the prefill engines in front."""

    def __init__(self, prefill: EngineGroup, decode: list[EngineClient], router: Router):
        super().__init__(decode, router)
        self.prefill = prefill
        self.complete = False  # both a prefill and a decode engine have been up

    def health(self) -> tuple[int, int, bool]:
        """Prefill and decode engines counted alike. Serving once both kinds have been up (a decode engine alone
        would compute every prompt itself), and while a decode engine is."""
        decode_up, prefill_up = len(self.engines_up), len(self.prefill.engines_up)
        self.complete = self.complete or bool(decode_up and prefill_up)
        engines = len(self.clients) + len(self.prefill.clients)
        return decode_up + prefill_up, engines, self.complete and decode_up > 0

    async def start(self) -> None:
        await self.prefill.start()
        await super().start()

    async def close(self) -> None:
        await self.prefill.close()
        await super().close()

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        arrival: float,
        cache_salt: str = "",
        priority: int = 0,
        tenant: str = "",
        lora: LoraRef | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        source: KVHandoff | None = None
        prefill: EngineClient | None = None
        prefill_id = request_id + PREFILL_SUFFIX
        first: SequenceDelta | None = None  # the first token, from the prefill engine
        one_sample = sampling.num_samples == 1 and not sampling.use_beam_search
        if not sampling.pooling and sampling.prompt_logprobs is None and self.prefill.engines_up:
            adapter = lora.name if lora is not None else ""
            prefill = self.prefill.clients[self.prefill.choose(prompt_token_ids, cache_salt, adapter)]
            first_only = (
                replace(sampling, max_tokens=1, min_tokens=min(sampling.min_tokens, 1))
                if one_sample
                else SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
            )
            async for output in prefill.generate(
                prefill_id, prompt_token_ids, first_only, arrival, cache_salt, priority, tenant, lora, kv_send=True
            ):
                if output.error is not None or not output.finished:
                    continue
                source = output.kv_handoff
                delta = output.sequences[0] if output.sequences else None
                if one_sample and delta is not None and delta.token_ids:
                    first = delta
                    ends = delta.finish_reason == "stop" or sampling.max_tokens == 1
                    shown = replace(delta, finish_reason=delta.finish_reason if ends else None)
                    yield replace(output, request_id=request_id, finished=ends, kv_handoff=None, sequences=[shown])
                    if ends:
                        prefill.abort(prefill_id)
                        return
        if first is not None:
            sampling = replace(sampling, first_token=first.token_ids[0])
        index = self.choose(prompt_token_ids, cache_salt, lora.name if lora is not None else "")
        self.routed[index] += 1
        released, skip_first = source is None, first is not None
        try:
            async for output in self.clients[index].generate(
                request_id, prompt_token_ids, sampling, arrival, cache_salt, priority, tenant, lora, kv_source=source
            ):
                if not released and prefill is not None:  # the decode engine runs: it has what it fetched
                    prefill.abort(prefill_id)
                    released = True
                if skip_first and output.sequences and output.sequences[0].token_ids:
                    assert first is not None
                    if output.sequences[0].token_ids[0] != first.token_ids[0]:  # never sent: a stream that forks
                        why = "the decode engine did not continue from the prefill engine's first token"
                        yield RequestOutput(
                            request_id, output.num_prompt_tokens, [SequenceDelta(0, [], [], [], "error")], True, why
                        )
                        return
                    output, skip_first = without_first_token(output), False  # the client has that one already
                yield output
        finally:
            if not released and prefill is not None:
                prefill.abort(prefill_id)


def without_first_token(output: RequestOutput) -> RequestOutput:
    """The decode engine's output less the first token, which it took from the prefill engine."""
    delta = output.sequences[0]
    rest = replace(
        delta, token_ids=delta.token_ids[1:], logprobs=delta.logprobs[1:], top_logprobs=delta.top_logprobs[1:]
    )
    return replace(output, sequences=[rest, *output.sequences[1:]])
