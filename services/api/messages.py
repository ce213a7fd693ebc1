"""Anthropic's Messages API (`POST /v1/messages`), as its SDK and Claude Code speak it, over the chat path.

A request is read into the chat body it means (`chat_body_of`): `system`, `messages` of text, `tool_use` and
`tool_result` blocks, `tools` with their `input_schema`, `tool_choice` (auto, any, tool, none), `max_tokens`,
`stop_sequences`, sampling fields, `stream`. The answer is a message of text and `tool_use` blocks with its
`stop_reason` and `usage`, or its stream of typed events (`message_start`, `content_block_start`,
`content_block_delta`, `content_block_stop`, `message_delta`, `message_stop`), and errors come in Anthropic's
shape. What the chat path does not serve (images, documents) is a 400 that says so.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.responses import JSONResponse

from services.api.errors import ApiError
from services.api.formats import Chunk, ResponseFormat
from services.api.reasoning import ReasoningStream
from services.api.requests import GenerationRequest
from services.api.tools import ToolCall, ToolCallParser, ToolCallStream, whole_message

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "abort": "end_turn"}
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "stream")


def error_body(exc: ApiError) -> dict[str, Any]:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(exc.status, "api_error"), "message": exc.message}}


def error_response(exc: ApiError) -> JSONResponse:
    return JSONResponse(error_body(exc), status_code=exc.status)


def chat_body_of(body: object) -> dict[str, Any]:
    """The chat-completions body an Anthropic Messages request means; ApiError where it is not one."""
    if not isinstance(body, dict):
        raise ApiError("the body must be a JSON object")
    max_tokens = body.get("max_tokens")
    if type(max_tokens) is not int or max_tokens < 1:
        raise ApiError("max_tokens: a positive integer is required", param="max_tokens")
    messages: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        messages.append({"role": "system", "content": _text_of(system, "system")})
    turns = body.get("messages")
    if not isinstance(turns, list) or not turns:
        raise ApiError("messages: a non-empty list of messages is required", param="messages")
    for i, turn in enumerate(turns):
        messages += _chat_messages(turn, f"messages[{i}]")
    chat: dict[str, Any] = {"messages": messages, "max_tokens": max_tokens}
    if "model" in body:
        chat["model"] = body["model"]
    for name in SAMPLING_FIELDS:
        if name in body:
            chat[name] = body[name]
    if "stop_sequences" in body:
        chat["stop"] = body["stop_sequences"]
    metadata = body.get("metadata")
    if isinstance(metadata, dict) and isinstance(metadata.get("user_id"), str):
        chat["user"] = metadata["user_id"]
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise ApiError("tools: a list of tools is required", param="tools")
        for i, tool in enumerate(tools):
            if tool.get("type") not in (None, "custom"):
                raise ApiError(f"tools[{i}]: server tools ({tool.get('type')}) are not served", param=f"tools[{i}]")
        chat["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": tool.get("name"),
                    "description": tool.get("description", ""),
                    "parameters": tool.get("input_schema", {"type": "object"}),
                },
            }
            for tool in tools
        ]
    choice = body.get("tool_choice")
    if choice is not None:
        kind = choice.get("type") if isinstance(choice, dict) else None
        if kind == "tool":
            chat["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
        elif kind in ("auto", "any", "none"):
            chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[kind]
        else:
            raise ApiError("tool_choice: its type is auto, any, tool or none", param="tool_choice")
        if isinstance(choice, dict) and choice.get("disable_parallel_tool_use"):
            chat["parallel_tool_calls"] = False
    return chat


def _text_of(value: object, where: str) -> str:
    """A string, or the text of a list of text blocks."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(b, dict) and b.get("type") == "text" for b in value):
        return "".join(str(b.get("text", "")) for b in value)
    raise ApiError(f"{where}: a string or a list of text blocks is required", param=where)


def _chat_messages(turn: object, where: str) -> list[dict[str, Any]]:
    if not isinstance(turn, dict) or turn.get("role") not in ("user", "assistant"):
        raise ApiError(f"{where}: a message with role user or assistant is required", param=where)
    role, content = turn["role"], turn.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise ApiError(f"{where}.content: a string or a list of content blocks is required", param=f"{where}.content")
    text, calls, results = [], [], []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        here = f"{where}.content[{j}]"
        if kind == "text":
            text.append(str(block.get("text", "")))
        elif kind == "tool_use" and role == "assistant":
            arguments = json.dumps(block.get("input", {}))
            calls.append(
                {
                    "id": block.get("id"),
                    "type": "function",
                    "function": {"name": block.get("name"), "arguments": arguments},
                }
            )
        elif kind == "tool_result" and role == "user":
            result = block.get("content", "")
            results.append(
                {
                    "role": "tool",
                    "tool_call_id": block.get("tool_use_id"),
                    "content": _text_of(result, f"{here}.content") if result else "",
                }
            )
        elif kind in ("image", "document"):
            raise ApiError(f"{here}: {kind} blocks are not served (this model reads text)", param=here)
        else:
            raise ApiError(f"{here}: a {kind!r} block is not one a {role} message takes", param=here)
    messages: list[dict[str, Any]] = list(results)
    if text or calls or not results:
        message: dict[str, Any] = {"role": role, "content": "".join(text)}
        if calls:
            message["tool_calls"] = calls
        messages.append(message)
    return messages


class MessagesFormat(ResponseFormat):
    """A Messages answer: one choice, as text and tool_use blocks."""

    endpoint = "messages"
    id_prefix = "msg"
    splits_thinking = True  # into a thinking block first

    def __init__(
        self, model_name: str, tokenizer: Any, generation: GenerationRequest, tool_parser: ToolCallParser | None = None
    ):
        super().__init__(model_name, tokenizer, generation)
        self.id = f"msg_{uuid.uuid4().hex[:24]}"
        use = generation.tools
        self.tool_use = use if use is not None and use.choice != "none" else None
        self.tool_parser = tool_parser

    def whole(self, chunks: list[Chunk], num_prompt: int) -> dict[str, Any]:
        text = "".join(c.text for c in chunks)
        finish = chunks[-1].finish_reason if chunks else None
        blocks: list[dict[str, Any]] = []
        calls: list[ToolCall] = []
        if self.reasoning is not None:
            thinking, text = self.reasoning.split(text)
            if thinking:
                blocks.append({"type": "thinking", "thinking": thinking, "signature": ""})
        if self.tool_use is not None:
            content, calls = whole_message(self.tool_use, self.tool_parser, text)
            text = content or ""
        if text:
            blocks.append({"type": "text", "text": text})
        blocks += [self._tool_block(call) for call in calls]
        return {
            **self._message(blocks, num_prompt, sum(len(c.token_ids) for c in chunks)),
            **self._stop(finish, chunks[-1].stop_reason if chunks else None, bool(calls)),
        }

    async def stream(self, chunks: AsyncIterator[Chunk], num_prompt: int) -> AsyncIterator[str]:
        yield _event("message_start", {"type": "message_start", "message": self._message([], num_prompt, 0)})
        index, text_open, generated = 0, False, 0
        stream = ToolCallStream(self.tool_use, self.tool_parser) if self.tool_use is not None else None
        thinking = ReasoningStream(self.reasoning) if self.reasoning is not None else None
        thinking_open = False
        finish, stop_reason, called = None, None, False
        async for chunk in _until_an_error(chunks):
            if isinstance(chunk, ApiError):  # once the stream has started its status is sent: an error event
                yield _event("error", error_body(chunk))
                return
            generated += len(chunk.token_ids)
            text, calls = chunk.text, list[ToolCall]()
            if thinking is not None:
                thought, text = thinking.feed(text, final=chunk.finish_reason is not None)
                if thought:
                    if not thinking_open:
                        block = {"type": "thinking", "thinking": "", "signature": ""}
                        yield _event(
                            "content_block_start",
                            {"type": "content_block_start", "index": index, "content_block": block},
                        )
                        thinking_open = True
                    delta = {"type": "thinking_delta", "thinking": thought}
                    yield _event("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta})
                if thinking_open and thinking.state == "answer":
                    yield _event("content_block_stop", {"type": "content_block_stop", "index": index})
                    index, thinking_open = index + 1, False
            if stream is not None:
                text, calls = stream.feed(text, final=chunk.finish_reason is not None)
            if text:
                if not text_open:
                    yield _event(
                        "content_block_start",
                        {"type": "content_block_start", "index": index, "content_block": {"type": "text", "text": ""}},
                    )
                    text_open = True
                yield _event(
                    "content_block_delta",
                    {"type": "content_block_delta", "index": index, "delta": {"type": "text_delta", "text": text}},
                )
            for call in calls:
                if text_open:
                    yield _event("content_block_stop", {"type": "content_block_stop", "index": index})
                    index, text_open = index + 1, False
                block = self._tool_block(call)
                yield _event(
                    "content_block_start",
                    {"type": "content_block_start", "index": index, "content_block": {**block, "input": {}}},
                )
                yield _event(
                    "content_block_delta",
                    {
                        "type": "content_block_delta",
                        "index": index,
                        "delta": {"type": "input_json_delta", "partial_json": call.arguments},
                    },
                )
                yield _event("content_block_stop", {"type": "content_block_stop", "index": index})
                index, called = index + 1, True
            if chunk.finish_reason is not None:
                finish, stop_reason = chunk.finish_reason, chunk.stop_reason
        if text_open or thinking_open:
            yield _event("content_block_stop", {"type": "content_block_stop", "index": index})
        yield _event(
            "message_delta",
            {
                "type": "message_delta",
                "delta": self._stop(finish, stop_reason, called),
                "usage": {"output_tokens": generated},
            },
        )
        yield _event("message_stop", {"type": "message_stop"})

    def _message(self, content: list[dict[str, Any]], num_prompt: int, generated: int) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model_name,
            "content": content,
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": num_prompt, "output_tokens": generated},
        }

    @staticmethod
    def _tool_block(call: ToolCall) -> dict[str, Any]:
        return {
            "type": "tool_use",
            "id": call.id or f"toolu_{uuid.uuid4().hex[:24]}",
            "name": call.name,
            "input": json.loads(call.arguments),
        }

    @staticmethod
    def _stop(finish: str | None, stop_reason: str | int | None, called: bool) -> dict[str, Any]:
        if called and finish == "stop":
            return {"stop_reason": "tool_use", "stop_sequence": None}
        if finish == "stop" and isinstance(stop_reason, str):
            return {"stop_reason": "stop_sequence", "stop_sequence": stop_reason}
        return {"stop_reason": STOP_REASONS.get(finish or "stop", "end_turn"), "stop_sequence": None}


async def _until_an_error(chunks: AsyncIterator[Chunk]) -> AsyncIterator[Chunk | ApiError]:
    try:
        async for chunk in chunks:
            yield chunk
    except ApiError as exc:
        yield exc


def _event(kind: str, body: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"
