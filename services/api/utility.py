"""The endpoints beside generation that vLLM users reach for, in vLLM's shapes: `/tokenize`,
`/detokenize`, `/version`, `/ping`, and `/v1/models/{model}`."""

from __future__ import annotations

import asyncio
from importlib import metadata
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from services.api.errors import ApiError

if TYPE_CHECKING:
    from services.api.app import OpenAIServer


def tenant_of_request(request: Request) -> str:
    """The tenant of the request's API key ("" with one key or none: every client is the same tenant)."""
    return str(request.scope.get("state", {}).get("tenant", ""))


def utility_routes(server: OpenAIServer) -> list[Route]:
    """`server` is the api's OpenAIServer: its tokenizer, model name and scheduler link."""

    async def tokenize(request: Request) -> Response:
        body = await _object(server, request)
        return await asyncio.to_thread(_tokenized, server, body, tenant_of_request(request))  # a long text: seconds

    async def detokenize(request: Request) -> Response:
        body = await _object(server, request)
        return await asyncio.to_thread(_detokenized, server, body, tenant_of_request(request))

    async def version(request: Request) -> Response:
        return JSONResponse({"version": metadata.version("pagedserve")})

    async def ping(request: Request) -> Response:
        return Response(status_code=200 if server.client.info is not None else 503)

    async def model(request: Request) -> Response:
        name = request.path_params["model"]
        tenant = tenant_of_request(request)
        server.adapters.resolve(name, tenant)  # a 404 for a name served neither as the base model nor as an adapter
        info = server.client.info
        cards = [server.model_card(), *server.adapters.cards(info.max_model_len if info else None, tenant)]
        return JSONResponse(next(card for card in cards if card["id"] == name))

    return [
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/version", version, methods=["GET"]),
        Route("/ping", ping, methods=["GET", "POST"]),
        Route("/v1/models/{model:path}", model, methods=["GET"]),
    ]


def _tokenized(server: OpenAIServer, body: dict[str, Any], tenant: str) -> Response:
    if "model" in body:
        server.adapters.resolve(body["model"], tenant)
    special = _flag(body, "add_special_tokens", True)
    if "messages" in body:
        if not isinstance(body["messages"], list):
            raise ApiError("messages must be a list of messages", param="messages")
        try:
            text = server.tokenizer.apply_chat_template(
                body["messages"], tokenize=False, add_generation_prompt=_flag(body, "add_generation_prompt", True)
            )
        except Exception as exc:  # templates raise whatever their authors chose
            raise ApiError(f"the chat template rejected the messages: {exc}", param="messages") from None
        special = _flag(body, "add_special_tokens", False)
    elif isinstance(body.get("prompt"), str):
        text = body["prompt"]
    else:
        raise ApiError("give a prompt (a string) or messages", param="prompt")
    server.check_could_fit(text)
    tokens = server.tokenizer.encode(text, add_special_tokens=special)
    info = server.client.info
    answer = {"count": len(tokens), "max_model_len": info.max_model_len if info else None, "tokens": tokens}
    if _flag(body, "return_token_strs", False):
        answer["token_strs"] = server.tokenizer.convert_ids_to_tokens(tokens)
    return JSONResponse(answer)


def _detokenized(server: OpenAIServer, body: dict[str, Any], tenant: str) -> Response:
    if "model" in body:
        server.adapters.resolve(body["model"], tenant)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(type(t) is int and 0 <= t < server.vocab_size for t in tokens):
        raise ApiError(f"tokens must be a list of token ids in [0, {server.vocab_size})", param="tokens")
    info = server.client.info
    if info is not None and len(tokens) > 2 * info.max_model_len:  # decoding millions holds the GIL for long
        raise ApiError(
            f"{len(tokens)} tokens are more than twice this model's context ({info.max_model_len})", param="tokens"
        )
    return JSONResponse({"prompt": server.tokenizer.decode(tokens)})


async def _object(server: OpenAIServer, request: Request) -> dict[str, Any]:
    body = await server.bodies.read(request)
    if not isinstance(body, dict):
        raise ApiError("the body must be a JSON object")
    return body


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if type(value) is not bool:
        raise ApiError(f"{name} must be true or false", param=name)
    return value
