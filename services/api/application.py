"""The api's Starlette application: the OpenAI routes of `services/api/app.py`, the utility routes, the adapters'
routes where run-time updating is on, the error handlers, and the API-key middleware."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from services.api.adapters import Adapters
from services.api.app import OpenAIServer
from services.api.auth import RequireApiKey
from services.api.engine_client import EngineClient
from services.api.engine_group import EngineGroup
from services.api.errors import ApiError
from services.api.memory_return import ReturnMemoryAfterLargeBodies
from services.api.other_apis import other_api_routes
from services.api.pooling import pooling_routes
from services.api.routing import Router
from services.api.utility import utility_routes
from shared.config import ApiConfig

log = logging.getLogger("services.api.app")


def build_app(
    client: EngineGroup | EngineClient,
    tokenizer: Any,
    model_name: str,
    vocab_size: int,
    config: ApiConfig | None = None,
    api_keys: Sequence[str] = (),
    adapters: Adapters | None = None,
    runtime_lora_updating: bool = False,
    admin_key: str | None = None,
) -> Starlette:
    """The api's Starlette app, configured by `config` (the api's flags; their defaults where None)."""
    if isinstance(client, EngineClient):
        client = EngineGroup([client], Router("round_robin"))
    server = OpenAIServer(client, tokenizer, model_name, vocab_size, config or ApiConfig(), adapters)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await client.start()  # /health answers 503 until the scheduler's workers are ready
        log.info("serving %s once the scheduler is ready", model_name)
        yield
        await client.close()

    async def on_api_error(request: Request, exc: ApiError) -> Response:
        return exc.response()

    async def on_http_error(request: Request, exc: HTTPException) -> Response:
        kind = "not_found" if exc.status_code == 404 else "method_not_allowed" if exc.status_code == 405 else None
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return ApiError(message, status=exc.status_code, code=kind).response()

    async def on_unexpected(request: Request, exc: Exception) -> Response:
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        return ApiError(f"internal error: {type(exc).__name__}", status=500, type="server_error").response()

    routes = [
        Route("/v1/completions", server.completions, methods=["POST"]),
        Route("/v1/chat/completions", server.chat_completions, methods=["POST"]),
        *other_api_routes(server),
        *pooling_routes(server),
        Route("/v1/models", server.models, methods=["GET"]),
        Route("/health", server.health, methods=["GET"]),
        Route("/metrics", server.prometheus, methods=["GET"]),
        *utility_routes(server),
    ]
    if runtime_lora_updating:  # behind the api key, as every route but /health and /metrics
        routes += [
            Route("/v1/load_lora_adapter", server.load_lora_adapter, methods=["POST"]),
            Route("/v1/unload_lora_adapter", server.unload_lora_adapter, methods=["POST"]),
        ]
    handlers: dict[Any, Any] = {ApiError: on_api_error, HTTPException: on_http_error, Exception: on_unexpected}
    middleware = [Middleware(ReturnMemoryAfterLargeBodies)]
    if api_keys or admin_key:
        middleware.append(Middleware(RequireApiKey, api_keys=list(api_keys), admin_key=admin_key))
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers=handlers, middleware=middleware)
    app.state.server = server
    return app
