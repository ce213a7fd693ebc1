"""The api's engines (`--data-parallel-size`): one `EngineClient` each, a `Router` to pick among
those up for each request. An engine that goes away fails only its own requests; the others
serve on, and it takes requests again as soon as it is back."""

from __future__ import annotations

from collections.abc import AsyncGenerator

from services.api.engine_client import EngineClient
from services.api.routing import EngineLoad, Router
from shared.protocol import LoraRef, RequestOutput, SchedulerInfo
from shared.sampling import SamplingParams


class EngineGroup:
    def __init__(self, clients: list[EngineClient], router: Router):
        self.clients = clients
        self.router = router
        self.routed = [0] * len(clients)  # requests sent to each, since start

    @property
    def info(self) -> SchedulerInfo | None:
        """The first ready engine's: every engine serves the same model. None while none is ready."""
        return next((client.info for client in self.clients if client.info is not None), None)

    @property
    def engines_up(self) -> list[int]:
        return [index for index, client in enumerate(self.clients) if client.info is not None]

    def health(self) -> tuple[int, int, bool]:
        """For /health: engines up, engines, and whether requests are served now."""
        up = len(self.engines_up)
        return up, len(self.clients), up > 0

    async def start(self) -> None:
        for client in self.clients:
            await client.start()

    async def close(self) -> None:
        for client in self.clients:
            await client.close()

    def choose(self, prompt_token_ids: list[int], cache_salt: str = "", adapter: str = "") -> int:
        """The engine for a request: among those up, the router's pick; the first if none is up
        (which answers that it is not ready)."""
        up = self.engines_up
        if not up:
            return 0
        loads = [
            EngineLoad(c.endpoint, c.in_flight, c.load.running, c.load.waiting, c.load.kv_usage, c.cached_prefixes)
            for c in (self.clients[i] for i in up)
        ]
        info = self.clients[up[0]].info
        block_size = info.block_size if info is not None else 1
        return up[self.router.choose(loads, prompt_token_ids, block_size, cache_salt, adapter)]

    def generate(
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
        index = self.choose(prompt_token_ids, cache_salt, lora.name if lora is not None else "")
        self.routed[index] += 1
        return self.clients[index].generate(
            request_id, prompt_token_ids, sampling, arrival, cache_salt, priority, tenant, lora
        )
