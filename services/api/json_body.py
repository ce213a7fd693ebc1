"""Request bodies as JSON, read within limits: a size, a deadline for the body to arrive, a bound
on the arrays and objects it opens, and valid Unicode in every string. A violation is an
`ApiError` (413 too large, 408 too slow, 400 otherwise) before anything is queued."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import TypeVar, overload

from starlette.requests import Request

from services.api.errors import ApiError

T = TypeVar("T")

# Arrays and objects a body may open: a request needs a handful (messages, tools, token ids), and
# parsing millions of them holds the event loop for seconds (a 7 MiB body of empty lists: 1.6 s).
MAX_BODY_CONTAINERS = 16_384
PARSE_OFF_LOOP_BYTES = 64 << 10  # parses in about a millisecond; larger ones go to a thread


class JsonBodies:
    def __init__(self, max_body_bytes: int, body_timeout: float):
        self.max_body_bytes = max_body_bytes
        self.body_timeout = body_timeout

    @overload
    async def read(self, request: Request) -> object: ...

    @overload
    async def read(self, request: Request, parse: Callable[[object], T]) -> T: ...

    async def read(self, request: Request, parse: Callable[[object], object] | None = None) -> object:
        """The body as JSON (then through `parse`, where given), at most `max_body_bytes`, arrived
        within `body_timeout`, every string valid Unicode. Bodies past PARSE_OFF_LOOP_BYTES are
        parsed and checked in a thread, so streams keep flowing meanwhile."""
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            raise _too_large(self.max_body_bytes)
        try:
            raw = await asyncio.wait_for(self._read_body(request), self.body_timeout)
        except asyncio.TimeoutError:
            raise ApiError(
                f"the request body did not arrive within {self.body_timeout:g} s", status=408, code="body_timeout"
            ) from None
        # An upper bound (brackets inside strings count too), counted in milliseconds before parsing.
        if raw.count(b"[") + raw.count(b"{") > max(MAX_BODY_CONTAINERS, len(raw) // 64):
            raise ApiError("the body holds more arrays and objects than any request needs", code="too_many_containers")
        if len(raw) > PARSE_OFF_LOOP_BYTES:
            return await asyncio.to_thread(_parse_json, raw, parse)
        return _parse_json(raw, parse)

    async def _read_body(self, request: Request) -> bytes:
        parts, size = [], 0
        async for part in request.stream():
            size += len(part)
            if size > self.max_body_bytes:
                raise _too_large(self.max_body_bytes)
            parts.append(part)
        return b"".join(parts)


def _parse_json(raw: bytes, parse: Callable[[object], object] | None = None) -> object:
    try:
        body = json.loads(raw)
    except RecursionError:
        raise ApiError("the JSON body is nested too deeply", code="invalid_json") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, and integers of more than 4,300 digits
        raise ApiError(f"the body is not valid JSON: {exc}", code="invalid_json") from None
    _check_unicode(body)
    return body if parse is None else parse(body)


def json_value(text: str) -> object:
    """JSON text a client sent inside a field (tool-call arguments) or a model wrote; ValueError for
    anything Python's parser refuses, nesting past its recursion limit included."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def _too_large(limit: int) -> ApiError:
    return ApiError(f"the request body is larger than {limit} bytes", status=413, code="body_too_large")


def _check_unicode(body: object) -> None:
    """Reject strings with lone surrogates (JSON allows them; UTF-8 and the tokenizer do not)."""
    stack = [body]
    while stack:
        value = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise ApiError(
                    "a string in the body is not valid Unicode (a lone surrogate)", code="invalid_unicode"
                ) from None
        elif isinstance(value, dict):
            stack.extend(value.keys())
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
