"""The api's streams of chunks: several requests' merged into one response, a first chunk looked at before the
rest is streamed, and a client's departure noticed while a response is awaited."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from enum import Enum
from typing import Any, Literal, TypeVar

from starlette.requests import Request

from services.api.formats import Chunk


async def merged_streams(streams: list[AsyncIterator[Chunk]], n: int, at_once: int) -> AsyncIterator[Chunk]:
    """The chunks of several requests as they come, request i's choice j renumbered i * n + j, with at
    most `at_once` of them started and unfinished. Closing it early, or a failure of any, aborts them all."""
    queue: asyncio.Queue[Any] = asyncio.Queue()
    turns = asyncio.Semaphore(at_once)

    async def pump(i: int, stream: AsyncIterator[Chunk]) -> None:
        try:
            async with turns:
                async for chunk in stream:
                    chunk.index += i * n
                    await queue.put(chunk)
            await queue.put(None)
        except Exception as exc:
            await queue.put(exc)

    tasks = [asyncio.create_task(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        for _ in range(len(tasks)):
            while (item := await queue.get()) is not None:
                if isinstance(item, Exception):
                    raise item
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def collect_chunks(chunks: AsyncIterator[Chunk]) -> list[Chunk]:
    return [chunk async for chunk in chunks]


async def first_chunk(chunks: AsyncIterator[Chunk]) -> Chunk | None:
    try:
        return await chunks.__anext__()
    except StopAsyncIteration:
        return None


async def prepend(first: Chunk | None, rest: AsyncIterator[Chunk]) -> AsyncIterator[Chunk]:
    if first is not None:
        yield first
    async for chunk in rest:
        yield chunk


class Disconnected(Enum):
    """What a response awaited became when its client left first."""

    CLIENT_LEFT = 0


DISCONNECTED: Literal[Disconnected.CLIENT_LEFT] = Disconnected.CLIENT_LEFT
T = TypeVar("T")


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T | Literal[Disconnected.CLIENT_LEFT]:
    """`work`'s result, or DISCONNECTED (with `work` cancelled) if the client leaves first."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if not task.done():
        task.cancel()  # the client left: closing the generator aborts the request
        return DISCONNECTED
    return task.result()


async def wait_for_disconnect(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(0.25)
