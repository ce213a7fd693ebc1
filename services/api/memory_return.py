"""Memory a large request body took goes back to the system once the request is over.

Parsing an 8 MB body builds hundreds of MB of Python objects; freed, glibc keeps most of them in
the heap for reuse (its threshold for returning memory rises after every large free), so the api
would stay that size after a single refused request. `malloc_trim` hands the free pages back."""

from __future__ import annotations

import asyncio

from starlette.types import ASGIApp, Receive, Scope, Send

from shared import glibc_heap

LARGE_BODY_BYTES = 1 << 20


class ReturnMemoryAfterLargeBodies:
    """ASGI middleware: after a request whose declared body is over LARGE_BODY_BYTES, trim the heap
    (in a thread: it takes milliseconds)."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not _declares_large_body(scope):
            await self.app(scope, receive, send)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            await asyncio.to_thread(glibc_heap.trim)


def _declares_large_body(scope: Scope) -> bool:
    for name, value in scope["headers"]:
        if name == b"content-length":
            return value.isdigit() and int(value) > LARGE_BODY_BYTES
        if name == b"transfer-encoding":  # chunked: size unknown until read
            return True
    return False
