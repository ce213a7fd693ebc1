"""OpenAI's Responses API (`POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`) over the chat path.

A request is read into the chat body it means (`chat_body_of`): `instructions`, `input` (a string, or items:
messages, `function_call` and `function_call_output`), function `tools`, `tool_choice`, `text.format` (a JSON
schema), `max_output_tokens`, `temperature`, `top_p`, `parallel_tool_calls`, `stream`. With `store` (the
default), the conversation and the answer are kept in a bounded store (`ResponseStore`: by count and bytes,
oldest first out, and in memory only: a restart loses it), so that `previous_response_id` goes on from them;
each API key's tenant sees only its own responses. The answer is a response of `message` and `function_call`
items with its `usage`, or its stream of typed events (`response.created`, `response.output_text.delta`,
`response.function_call_arguments.delta`, `response.completed`, ...). What does not apply here (built-in tools
such as web search, `background`, reasoning settings) is a 400 that names it. With `--reasoning-parser`, a
reasoning model's thinking comes first as a `reasoning` item (`response.reasoning_text.delta` events).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

from services.api.errors import ApiError
from services.api.formats import Chunk, ResponseFormat
from services.api.reasoning import ReasoningStream
from services.api.requests import GenerationRequest
from services.api.response_store import ResponseStore, StoredResponse
from services.api.tools import ToolCall, ToolCallParser, ToolCallStream, whole_message

NOT_SERVED = {
    "background": "background responses",
    "reasoning": "reasoning settings",
    "conversation": "conversations",
    "prompt": "prompt templates",
    "include": "extra output fields",
}


def chat_body_of(body: object, store: ResponseStore, tenant: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The chat-completions body a Responses request means, and its conversation (for the store): the previous
    response's, then this request's input. ApiError where it is not one this server serves."""
    if not isinstance(body, dict):
        raise ApiError("the body must be a JSON object")
    for name, what in NOT_SERVED.items():
        if body.get(name) not in (None, False, [], {}):
            raise ApiError(f"{name}: {what} are not served here", param=name, code="unsupported_parameter")
    conversation: list[dict[str, Any]] = []
    previous = body.get("previous_response_id")
    if previous is not None:
        if not isinstance(previous, str):
            raise ApiError("previous_response_id must be a string", param="previous_response_id")
        conversation = list(store.get(previous, tenant).messages)
    conversation += _input_messages(body.get("input"))
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise ApiError("instructions must be a string", param="instructions")
    chat: dict[str, Any] = {
        "messages": ([{"role": "system", "content": instructions}] if instructions else []) + conversation
    }
    for ours, theirs in (
        ("model", "model"),
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("stream", "stream"),
        ("max_output_tokens", "max_tokens"),
        ("parallel_tool_calls", "parallel_tool_calls"),
        ("user", "user"),
        ("seed", "seed"),
    ):
        if body.get(ours) is not None:
            chat[theirs] = body[ours]
    tools = body.get("tools")
    if tools:
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise ApiError("tools must be a list of tools", param="tools")
        for i, tool in enumerate(tools):
            if tool.get("type") != "function":
                raise ApiError(
                    f"tools[{i}]: built-in tools ({tool.get('type')}) are not served here; function tools are",
                    param=f"tools[{i}]",
                    code="unsupported_parameter",
                )
        chat["tools"] = [
            {
                "type": "function",
                "function": {key: tool[key] for key in ("name", "description", "parameters") if key in tool},
            }
            for tool in tools
        ]
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        if choice.get("type") != "function":
            raise ApiError(
                "tool_choice: auto, none, required or {'type': 'function', 'name': ...}", param="tool_choice"
            )
        chat["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
    elif choice is not None:
        chat["tool_choice"] = choice
    text = body.get("text")
    fmt = text.get("format") if isinstance(text, dict) else None
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        chat["response_format"] = {
            "type": "json_schema",
            "json_schema": {
                "name": fmt.get("name", "output"),
                "schema": fmt.get("schema", {}),
                "strict": fmt.get("strict", False),
            },
        }
    elif isinstance(fmt, dict) and fmt.get("type") in ("json_object", "text"):
        chat["response_format"] = {"type": fmt["type"]}
    elif fmt is not None:
        raise ApiError("text.format: its type is text, json_object or json_schema", param="text.format")
    return chat, conversation


def _input_messages(items: object) -> list[dict[str, Any]]:
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise ApiError("input must be a string or a non-empty list of items", param="input")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message" and isinstance(item, dict):
            role = {"developer": "system"}.get(item.get("role", ""), item.get("role"))
            if role not in ("user", "assistant", "system"):
                raise ApiError(f"{where}: a message's role is user, assistant, system or developer", param=where)
            messages.append({"role": role, "content": _text_of(item.get("content"), where)})
        elif kind == "function_call" and isinstance(item, dict):
            call = {
                "id": item.get("call_id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")},
            }
            if messages and messages[-1]["role"] == "assistant" and not messages[-1]["content"]:
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output" and isinstance(item, dict):
            output = item.get("output", "")
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": item.get("call_id"),
                    "content": output if isinstance(output, str) else json.dumps(output),
                }
            )
        else:
            raise ApiError(
                f"{where}: a {kind!r} item is not served here (messages, function_call and function_call_output are)",
                param=where,
            )
    return messages


def _text_of(content: object, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        kinds = {p.get("type") for p in content}
        if kinds <= {"input_text", "output_text", "text"}:
            return "".join(str(p.get("text", "")) for p in content)
        raise ApiError(f"{where}: only text parts are served here, not {sorted(k for k in kinds if k)}", param=where)
    raise ApiError(f"{where}: content must be a string or a list of text parts", param=where)


class ResponsesFormat(ResponseFormat):
    """A response of `message` and `function_call` items, whole or as its events; kept in the store when asked."""

    endpoint = "responses"
    splits_thinking = True  # into a reasoning item first

    def __init__(
        self,
        model_name: str,
        tokenizer: Any,
        generation: GenerationRequest,
        tool_parser: ToolCallParser | None,
        request: dict[str, Any],
        conversation: list[dict[str, Any]],
        store: ResponseStore | None,
        tenant: str,
    ):
        super().__init__(model_name, tokenizer, generation)
        self.id = f"resp_{uuid.uuid4().hex}"
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.reasoning_id = f"rs_{uuid.uuid4().hex}"
        self.request, self.conversation, self.store, self.tenant = request, conversation, store, tenant
        use = generation.tools
        self.tool_use = use if use is not None and use.choice != "none" else None
        self.tool_parser = tool_parser

    def whole(self, chunks: list[Chunk], num_prompt: int) -> dict[str, Any]:
        text, thought, thinking_tokens = "".join(c.text for c in chunks), "", 0
        if self.reasoning is not None:
            thought, text = self.reasoning.split(text)
            thinking = ReasoningStream(self.reasoning)
            for c in chunks:  # the tokens whose text went to the thinking
                thinking_tokens += len(c.token_ids) if thinking.feed(c.text, c.finish_reason is not None)[0] else 0
        calls: list[ToolCall] = []
        if self.tool_use is not None:
            content, calls = whole_message(self.tool_use, self.tool_parser, text)
            text, calls = content or "", _with_ids(calls)
        finish = chunks[-1].finish_reason if chunks else None
        cached = max((c.num_cached_tokens for c in chunks), default=0)
        generated = sum(len(c.token_ids) for c in chunks)
        return self._finished(text, calls, finish, num_prompt, generated, cached, thought, thinking_tokens)

    async def stream(self, chunks: AsyncIterator[Chunk], num_prompt: int) -> AsyncIterator[str]:
        events = _Events()
        yield events("response.created", response=self._response("in_progress", []))
        yield events("response.in_progress", response=self._response("in_progress", []))
        stream = ToolCallStream(self.tool_use, self.tool_parser) if self.tool_use is not None else None
        thinking = ReasoningStream(self.reasoning) if self.reasoning is not None else None
        text, thought, calls, finish, generated, cached, thinking_tokens = "", "", list[ToolCall](), None, 0, 0, 0
        at = 0  # the message's output index: 1 after a reasoning item
        try:
            async for chunk in chunks:
                generated += len(chunk.token_ids)
                cached = max(cached, chunk.num_cached_tokens)
                final = chunk.finish_reason is not None
                piece, found, more = chunk.text, list[ToolCall](), ""
                if thinking is not None:
                    more, piece = thinking.feed(piece, final)
                if more:
                    thinking_tokens += len(chunk.token_ids)
                    if not thought:
                        item = self._reasoning_item("", "in_progress")
                        yield events("response.output_item.added", output_index=0, item=item)
                    thought += more
                    yield events(
                        "response.reasoning_text.delta",
                        item_id=self.reasoning_id,
                        output_index=0,
                        content_index=0,
                        delta=more,
                    )
                if thought and not at and (piece or final):
                    at = 1
                    for event in self._reasoning_done(events, thought):
                        yield event
                if stream is not None:
                    piece, found = stream.feed(piece, final)
                    found = _with_ids(found)
                if piece:
                    if not text:
                        item = self._message_item("", "in_progress")
                        yield events("response.output_item.added", output_index=at, item=item)
                        yield events(
                            "response.content_part.added",
                            item_id=self.message_id,
                            output_index=at,
                            content_index=0,
                            part=_text_part(""),
                        )
                    text += piece
                    yield events(
                        "response.output_text.delta",
                        item_id=self.message_id,
                        output_index=at,
                        content_index=0,
                        delta=piece,
                        logprobs=[],
                    )
                calls += found
                finish = chunk.finish_reason or finish
        except ApiError as exc:  # once the stream has started its status is sent: an error event
            yield events("error", code=exc.code, message=exc.message, param=exc.param)
            return
        if thought and not at:  # a stream cut short while thinking
            at = 1
            for event in self._reasoning_done(events, thought):
                yield event
        if text:
            yield events(
                "response.output_text.done",
                item_id=self.message_id,
                output_index=at,
                content_index=0,
                text=text,
                logprobs=[],
            )
            yield events(
                "response.content_part.done",
                item_id=self.message_id,
                output_index=at,
                content_index=0,
                part=_text_part(text),
            )
            yield events("response.output_item.done", output_index=at, item=self._message_item(text, "completed"))
        first = at + (1 if text else 0)
        for k, call in enumerate(calls):
            item = self._call_item(call)
            yield events(
                "response.output_item.added",
                output_index=first + k,
                item={**item, "arguments": "", "status": "in_progress"},
            )
            yield events(
                "response.function_call_arguments.delta",
                item_id=item["id"],
                output_index=first + k,
                delta=call.arguments,
            )
            yield events(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=first + k,
                arguments=call.arguments,
            )
            yield events("response.output_item.done", output_index=first + k, item=item)
        response = self._finished(text, calls, finish, num_prompt, generated, cached, thought, thinking_tokens)
        kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
        yield events(kind, response=response)

    def _reasoning_done(self, events: _Events, thought: str) -> Iterator[str]:
        yield events("response.reasoning_text.done", item_id=self.reasoning_id, output_index=0, content_index=0,
                     text=thought)  # fmt: skip
        yield events("response.output_item.done", output_index=0, item=self._reasoning_item(thought, "completed"))

    def _finished(
        self,
        text: str,
        calls: list[ToolCall],
        finish: str | None,
        num_prompt: int,
        generated: int,
        cached: int,
        thought: str = "",
        thinking_tokens: int = 0,
    ) -> dict[str, Any]:
        output = [self._reasoning_item(thought, "completed")] if thought else []
        output += ([self._message_item(text, "completed")] if text else []) + [self._call_item(c) for c in calls]
        status = "incomplete" if finish == "length" and not calls else "completed"
        response = self._response(status, output)
        response["usage"] = {
            "input_tokens": num_prompt,
            "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": generated,
            "output_tokens_details": {"reasoning_tokens": thinking_tokens},
            "total_tokens": num_prompt + generated,
        }
        if status == "incomplete":
            response["incomplete_details"] = {"reason": "max_output_tokens"}
        if self.store is not None and self.request.get("store", True):
            answered: dict[str, Any] = {"role": "assistant", "content": text}
            if calls:
                answered["tool_calls"] = [
                    {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                    for c in calls
                ]
            messages = [*self.conversation, answered]
            size = len(json.dumps(messages)) + len(json.dumps(response))
            self.store.put(self.id, StoredResponse(self.tenant, messages, response, size))
        return response

    def _response(self, status: str, output: list[dict[str, Any]]) -> dict[str, Any]:
        request = self.request
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None,
            "incomplete_details": None,
            "model": self.model_name,
            "output": output,
            "instructions": request.get("instructions"),
            "previous_response_id": request.get("previous_response_id"),
            "tools": request.get("tools") or [],
            "tool_choice": request.get("tool_choice", "auto"),
            "parallel_tool_calls": request.get("parallel_tool_calls", True),
            "temperature": request.get("temperature"),
            "top_p": request.get("top_p"),
            "max_output_tokens": request.get("max_output_tokens"),
            "text": request.get("text"),
            "store": request.get("store", True),
            "metadata": request.get("metadata") or {},
        }

    def _message_item(self, text: str, status: str) -> dict[str, Any]:
        return {
            "type": "message",
            "id": self.message_id,
            "status": status,
            "role": "assistant",
            "content": [_text_part(text)] if status == "completed" or text else [],
        }

    def _reasoning_item(self, thought: str, status: str) -> dict[str, Any]:
        content = [{"type": "reasoning_text", "text": thought}] if thought else []
        return {"type": "reasoning", "id": self.reasoning_id, "status": status, "summary": [], "content": content}

    @staticmethod
    def _call_item(call: ToolCall) -> dict[str, Any]:
        return {
            "type": "function_call",
            "id": f"fc_{call.id.removeprefix('call_')}",
            "call_id": call.id,
            "name": call.name,
            "arguments": call.arguments,
            "status": "completed",
        }


def _with_ids(calls: list[ToolCall]) -> list[ToolCall]:
    """The calls, each with the id the client answers it by (and the stored conversation keeps)."""
    return [c if c.id else ToolCall(c.name, c.arguments, f"call_{uuid.uuid4().hex[:24]}") for c in calls]


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class _Events:
    """SSE events of the Responses API, numbered in order."""

    def __init__(self) -> None:
        self.number = 0

    def __call__(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": self.number, **fields}
        self.number += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"


def deleted(response_id: str) -> dict[str, Any]:
    return {"id": response_id, "object": "response.deleted", "deleted": True, "created_at": int(time.time())}
