"""Prefill/decode disaggregation at the api (`--prefill-endpoint`): each request's prompt is computed on a
prefill engine, which keeps its KV blocks; a decode engine fetches the blocks it lacks and generates, and the
client's stream is the decode engine's. The api releases the prefill engine's blocks as soon as the decode
engine has started (it fetched them, or gave up and computes the prompt itself), or when the request ends
first; the prefill engine frees them after a while in any case.

Requests a decode engine must see whole (pooling, prompt logprobs) and any request while no prefill engine is
up go to a decode engine alone, which computes the prompt as an ordinary engine.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator

from services.api.engine_client import EngineClient
from services.api.engine_group import EngineGroup
from services.api.routing import Router
from shared.protocol import KVHandoff, LoraRef, RequestOutput
from shared.sampling import SamplingParams

PREFILL_SUFFIX = "-prefill"


class DisaggregatedEngines(EngineGroup):
    """The decode engines as the api's engines (health, metrics, routing), with the prefill engines in front."""

    def __init__(self, prefill: EngineGroup, decode: list[EngineClient], router: Router):
        super().__init__(decode, router)
        self.prefill = prefill
        self.handed_off = 0  # requests whose prompt a prefill engine computed, since start

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
        if not sampling.pooling and sampling.prompt_logprobs is None and self.prefill.engines_up:
            adapter = lora.name if lora is not None else ""
            prefill = self.prefill.clients[self.prefill.choose(prompt_token_ids, cache_salt, adapter)]
            computes_prompt = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
            async for output in prefill.generate(
                prefill_id, prompt_token_ids, computes_prompt, arrival, cache_salt, priority, tenant, lora, kv_send=True
            ):
                if output.finished and output.error is None:
                    source = output.kv_handoff
        index = self.choose(prompt_token_ids, cache_salt, lora.name if lora is not None else "")
        self.routed[index] += 1
        self.handed_off += source is not None
        released = source is None
        try:
            async for output in self.clients[index].generate(
                request_id, prompt_token_ids, sampling, arrival, cache_salt, priority, tenant, lora, kv_source=source
            ):
                if not released and prefill is not None:  # the decode engine runs: it has what it fetched
                    prefill.abort(prefill_id)
                    released = True
                yield output
        finally:
            if not released and prefill is not None:
                prefill.abort(prefill_id)
