"""The routes of the other APIs clients speak, over the chat path of services/api/app.py: Anthropic's Messages
API (services/api/messages.py) and OpenAI's Responses API (services/api/responses.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from services.api.errors import ApiError
from services.api.messages import MessagesFormat, chat_body_of
from services.api.messages import error_response as anthropic_error
from services.api.requests import GenerationRequest, parse_chat
from services.api.responses import ResponsesFormat, deleted
from services.api.responses import chat_body_of as responses_chat_body
from services.api.tools import ToolCallParser
from services.api.utility import tenant_of_request

if TYPE_CHECKING:
    from services.api.app import OpenAIServer


def other_api_routes(server: OpenAIServer) -> list[Route]:
    async def messages(request: Request) -> Response:
        """Anthropic's Messages API, its errors in its shape."""
        try:
            generation = await server.bodies.read(request, lambda body: parse_chat(chat_body_of(body)))
            return await server.chat(request, generation, MessagesFormat)
        except ApiError as exc:
            return anthropic_error(exc)

    async def responses(request: Request) -> Response:
        body = await server.bodies.read(request)
        tenant = tenant_of_request(request)
        chat, conversation = responses_chat_body(body, server.response_store, tenant)
        generation = parse_chat(chat)
        assert isinstance(body, dict)  # responses_chat_body refused anything else

        def make_format(name: str, tokenizer: Any, gen: GenerationRequest, parser: ToolCallParser | None) -> Any:
            return ResponsesFormat(name, tokenizer, gen, parser, body, conversation, server.response_store, tenant)

        return await server.chat(request, generation, make_format)

    async def stored_response(request: Request) -> Response:
        response_id, tenant = request.path_params["response_id"], tenant_of_request(request)
        if request.method == "DELETE":
            server.response_store.delete(response_id, tenant)
            return JSONResponse(deleted(response_id))
        return JSONResponse(server.response_store.get(response_id, tenant).body)

    return [
        Route("/v1/messages", messages, methods=["POST"]),
        Route("/v1/responses", responses, methods=["POST"]),
        Route("/v1/responses/{response_id}", stored_response, methods=["GET", "DELETE"]),
    ]
