"""OpenAI response bodies and SSE events for completions and chat completions."""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from services.api.errors import ApiError
from services.api.reasoning import ReasoningFormat, ReasoningStream
from services.api.requests import GenerationRequest
from services.api.tools import ToolCallParser, ToolCallStream, whole_message


@dataclass(slots=True)
class Chunk:
    """What one engine output adds to one choice."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, float]]
    finish_reason: str | None
    num_cached_tokens: int = 0
    prompt_logprobs: list[float] | None = None  # from the second prompt token on, with echo
    prompt_top_logprobs: list[dict[int, float]] | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended the choice, as vLLM


def by_choice(chunks: list[Chunk], n: int) -> list[list[Chunk]]:
    choices: list[list[Chunk]] = [[] for _ in range(n)]
    for chunk in chunks:
        choices[chunk.index].append(chunk)
    return choices


class ResponseFormat:
    """Shared by both endpoints: ids, envelopes, usage and the SSE framing."""

    endpoint = ""
    report_cached_tokens = True  # the server's --report-cached-tokens
    splits_thinking = False  # whether the endpoint gives a reasoning model's thinking apart from its answer
    reasoning: ReasoningFormat | None = None  # the server's --reasoning-parser, where the endpoint splits thinking
    object_whole = ""
    object_chunk = ""
    id_prefix = ""

    def __init__(self, model_name: str, tokenizer: Any, generation: GenerationRequest, num_choices: int = 0):
        self.model_name, self.tokenizer, self.generation = model_name, tokenizer, generation
        self.num_choices = num_choices or generation.sampling.n  # n per prompt, for every prompt
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def envelope(
        self, kind: str, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None, usage_field: bool = False
    ) -> dict[str, Any]:
        """A response or chunk; `usage` where given, and `"usage": null` where `usage_field` asks for the field
        without one (a stream with stream_options.include_usage has it in every chunk, as OpenAI's does)."""
        body = {"id": self.id, "object": kind, "created": self.created, "model": self.model_name, "choices": choices}
        if usage is not None or usage_field:
            body["usage"] = usage
        return body

    def whole(self, chunks: list[Chunk], num_prompt: int) -> dict[str, Any]:
        choices = [self.whole_choice(i, c) for i, c in enumerate(by_choice(chunks, self.num_choices))]
        return self.envelope(self.object_whole, choices, self.usage(num_prompt, chunks))

    async def stream(self, chunks: AsyncIterator[Chunk], num_prompt: int) -> AsyncIterator[str]:
        usage_field = self.generation.include_usage
        for opening in self.stream_openings():
            yield event(self.envelope(self.object_chunk, [opening], usage_field=usage_field))
        offsets = [0] * self.num_choices
        generated = cached = 0  # kept as they come: usage in every chunk costs no pass over the earlier ones
        async for chunk in errors_as_events(chunks):
            if isinstance(chunk, str):
                yield chunk
                return
            generated += len(chunk.token_ids)
            cached = max(cached, chunk.num_cached_tokens)
            choice = self.chunk_choice(chunk, offsets[chunk.index])
            offsets[chunk.index] += len(chunk.text)
            usage = self._usage(num_prompt, generated, cached) if self.generation.continuous_usage else None
            yield event(self.envelope(self.object_chunk, [choice], usage, usage_field))
        if usage_field:
            yield event(self.envelope(self.object_chunk, [], self._usage(num_prompt, generated, cached)))
        yield "data: [DONE]\n\n"

    def stream_openings(self) -> list[dict[str, Any]]:
        return []

    def usage(self, num_prompt: int, chunks: list[Chunk]) -> dict[str, object]:
        return self._usage(
            num_prompt, sum(len(c.token_ids) for c in chunks), max((c.num_cached_tokens for c in chunks), default=0)
        )

    def _usage(self, num_prompt: int, completion: int, cached: int) -> dict[str, object]:
        usage: dict[str, object] = {
            "prompt_tokens": num_prompt,
            "completion_tokens": completion,
            "total_tokens": num_prompt + completion,
        }
        if self.report_cached_tokens:
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
        return usage

    def add_token_ids(self, choice: dict[str, Any], chunks: list[Chunk]) -> dict[str, Any]:
        if self.generation.return_token_ids:
            choice["token_ids"] = [t for c in chunks for t in c.token_ids]
        return choice

    def whole_choice(self, index: int, chunks: list[Chunk]) -> dict[str, Any]:
        raise NotImplementedError

    def chunk_choice(self, chunk: Chunk, offset: int) -> dict[str, Any]:
        raise NotImplementedError


class CompletionFormat(ResponseFormat):
    endpoint = "completions"
    object_whole = object_chunk = "text_completion"
    id_prefix = "cmpl"

    def __init__(
        self,
        model_name: str,
        tokenizer: Any,
        generation: GenerationRequest,
        echo: str = "",
        echo_token_ids: Sequence[int] = (),
        num_choices: int = 0,
    ):
        super().__init__(model_name, tokenizer, generation, num_choices)
        self.echo, self.echo_token_ids = echo, echo_token_ids  # the prompt, when the request asks it back
        self.echoed: set[int] = set()  # choices whose stream carried the prompt already

    def whole_choice(self, index: int, chunks: list[Chunk]) -> dict[str, Any]:
        choice = {
            "index": index,
            "text": self.echo + "".join(c.text for c in chunks),
            "logprobs": self._logprobs(chunks, 0, with_prompt=bool(self.echo)),
            "finish_reason": chunks[-1].finish_reason if chunks else None,
            "stop_reason": chunks[-1].stop_reason if chunks else None,
        }
        return self.add_token_ids(choice, chunks)

    def chunk_choice(self, chunk: Chunk, offset: int) -> dict[str, Any]:
        text, first = chunk.text, bool(self.echo) and chunk.index not in self.echoed
        if first:  # a choice's first chunk carries the prompt
            self.echoed.add(chunk.index)
            text = self.echo + text
        logprobs = self._logprobs([chunk], 0 if first else offset + len(self.echo), with_prompt=first)
        choice = {
            "index": chunk.index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": chunk.finish_reason,
            "stop_reason": chunk.stop_reason,
        }
        return self.add_token_ids(choice, [chunk])

    def _logprobs(self, chunks: list[Chunk], offset: int, with_prompt: bool = False) -> dict[str, Any] | None:
        if self.generation.sampling.logprobs is None:
            return None
        entries: list[tuple[int, float | None, dict[int, float] | None]] = []  # (token id, logprob, alternatives)
        prompt = next((c for c in chunks if c.prompt_logprobs is not None), None) if with_prompt else None
        if prompt is not None and prompt.prompt_logprobs is not None:  # echo: the prompt's tokens first, the very
            entries += zip(
                self.echo_token_ids,
                [None, *prompt.prompt_logprobs],  # first without a logprob
                [None, *(prompt.prompt_top_logprobs or [])],
            )
        entries += [entry for chunk in chunks for entry in zip(chunk.token_ids, chunk.logprobs, chunk.top_logprobs)]
        decode = self.tokenizer.decode
        tokens, token_logprobs, tops, offsets = [], [], [], []
        for token_id, logprob, top in entries:
            text = decode([token_id])
            offsets.append(offset)
            offset += len(text)
            tokens.append(text)
            token_logprobs.append(logprob if logprob is None else finite(logprob))
            tops.append({decode([t]): finite(lp) for t, lp in top.items()} if top else None)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


class ChatFormat(ResponseFormat):
    endpoint = "chat"
    object_whole = "chat.completion"
    object_chunk = "chat.completion.chunk"
    id_prefix = "chatcmpl"
    splits_thinking = True

    def __init__(
        self, model_name: str, tokenizer: Any, generation: GenerationRequest, tool_parser: ToolCallParser | None = None
    ):
        super().__init__(model_name, tokenizer, generation)
        use = generation.tools
        self.tool_use = use if use is not None and use.choice != "none" else None
        self.tool_parser = tool_parser  # the model's call format, for tool_choice "auto"
        self.tool_streams: dict[int, ToolCallStream] = {}
        self.reasoning_streams: dict[int, ReasoningStream] = {}

    def stream_openings(self) -> list[dict[str, Any]]:
        return [
            {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            for i in range(self.num_choices)
        ]

    def whole_choice(self, index: int, chunks: list[Chunk]) -> dict[str, Any]:
        text = "".join(c.text for c in chunks)
        finish = chunks[-1].finish_reason if chunks else None
        reasoning = None
        if self.reasoning is not None:
            reasoning, text = self.reasoning.split(text)
        message: dict[str, object] = {"role": "assistant", "content": text}
        if self.tool_use is not None:
            content, calls = whole_message(self.tool_use, self.tool_parser, text)
            if calls:
                message = {"role": "assistant", "content": content, "tool_calls": [c.as_openai() for c in calls]}
                finish = self._finish_with_calls(finish)
        if reasoning is not None:  # as vLLM's: null where there is none
            message["reasoning"] = reasoning or None
            message["content"] = message["content"] or None
        choice = {
            "index": index,
            "message": message,
            "logprobs": self._logprobs(chunks),
            "finish_reason": finish,
            "stop_reason": chunks[-1].stop_reason if chunks else None,
        }
        return self.add_token_ids(choice, chunks)

    def chunk_choice(self, chunk: Chunk, offset: int) -> dict[str, Any]:
        text, finish = chunk.text, chunk.finish_reason
        delta: dict[str, object] = {}
        if self.reasoning is not None:
            thinking = self.reasoning_streams.setdefault(chunk.index, ReasoningStream(self.reasoning))
            reasoning, text = thinking.feed(text, final=finish is not None)
            if reasoning:
                delta["reasoning"] = reasoning
        if self.tool_use is not None:  # content until a call may begin; the calls when the choice ends
            stream = self.tool_streams.setdefault(chunk.index, ToolCallStream(self.tool_use, self.tool_parser))
            text, calls = stream.feed(text, final=finish is not None)
            if calls:
                delta["tool_calls"] = [call.as_openai(k) for k, call in enumerate(calls)]
                finish = self._finish_with_calls(finish)
        if text or (finish is None and not delta):
            delta["content"] = text
        choice = {
            "index": chunk.index,
            "delta": delta,
            "logprobs": self._logprobs([chunk]),
            "finish_reason": finish,
            "stop_reason": chunk.stop_reason,
        }
        return self.add_token_ids(choice, [chunk])

    def _finish_with_calls(self, finish: str | None) -> str | None:
        """OpenAI's finish reason for a choice that made calls: "tool_calls", but "stop" for a named function."""
        named = self.tool_use is not None and self.tool_use.choice == "named"
        return "tool_calls" if finish == "stop" and not named else finish

    def _logprobs(self, chunks: list[Chunk]) -> dict[str, Any] | None:
        if self.generation.sampling.logprobs is None:
            return None
        decode = self.tokenizer.decode

        def entry(token_id: int, logprob: float) -> dict[str, Any]:
            text = decode([token_id])
            return {"token": text, "logprob": finite(logprob), "bytes": list(text.encode())}

        content = []
        for chunk in chunks:
            for token_id, logprob, top in zip(chunk.token_ids, chunk.logprobs, chunk.top_logprobs):
                content.append({**entry(token_id, logprob), "top_logprobs": [entry(t, lp) for t, lp in top.items()]})
        return {"content": content}


LEAST_LOGPROB = -9999.0  # what a log-probability JSON cannot carry (-inf, or NaN from a model's overflow) reads as


def finite(logprob: float) -> float:
    """A log-probability JSON can carry: -inf and NaN read as LEAST_LOGPROB, as vLLM writes -inf."""
    return logprob if math.isfinite(logprob) else LEAST_LOGPROB


# Valid inside JSON text, but line breaks to readers that split lines as str.splitlines() does (httpx
# among them): one would cut an event in two.
_LINE_BREAKS_ESCAPED = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def event(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False).translate(_LINE_BREAKS_ESCAPED)}\n\n"


async def errors_as_events(chunks: AsyncIterator[Chunk]) -> AsyncIterator[Chunk | str]:
    """Once a stream has started its status is sent, so an error becomes a last SSE event."""
    try:
        async for chunk in chunks:
            yield chunk
    except ApiError as exc:
        yield event(exc.body()) + "data: [DONE]\n\n"
