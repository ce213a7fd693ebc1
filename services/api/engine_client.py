"""The api's side of the scheduler link: one DEALER socket, one receive loop, a queue per request,
and a heartbeat: a scheduler that answers nothing for `stall_timeout` seconds counts as gone."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from shared import sockets
from shared.frame_limits import MAX_FRAME_BYTES, ProtocolError
from shared.protocol import (
    Abort,
    AddRequest,
    Hello,
    KVHandoff,
    LoraRef,
    Ping,
    Pong,
    RequestOutput,
    RequestOutputs,
    SchedulerInfo,
    SequenceDelta,
    Unavailable,
    decode,
    encode,
)
from shared.sampling import SamplingParams
from shared.sockets import MAX_MESSAGE_BYTES, trusted_peer_containers
from shared.wire_security import WireKeys

log = logging.getLogger(__name__)

PING_INTERVAL = 0.5  # seconds between heartbeats
ABORTS_PER_MESSAGE = 8192  # request ids of 32 characters: well under an Abort frame's limit
STALL_TIMEOUT = 5.0  # seconds without a frame from the scheduler before it counts as stalled


class EngineClient:
    def __init__(
        self,
        endpoint: str,
        keys: WireKeys | None = None,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        stall_timeout: float = STALL_TIMEOUT,
    ):
        self.endpoint = endpoint
        self.context = zmq.asyncio.Context()
        self.identity = f"api-{uuid.uuid4().hex[:8]}"
        self.socket = sockets.connect(
            self.context, zmq.DEALER, endpoint, self.identity.encode(), keys, max_message_bytes
        )
        self.info: SchedulerInfo | None = None
        self.has_served = False  # ready at least once: a later loss is an outage, not a start
        self._queues: dict[str, asyncio.Queue[RequestOutput]] = {}
        self._receiver: asyncio.Task[None] | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._heart: asyncio.Task[None] | None = None
        self._aborter: asyncio.Task[None] | None = None
        self._to_abort: dict[str, None] = {}  # request ids waiting to be sent in an Abort, in order
        self._abort_ready = asyncio.Event()
        self.stall_timeout = stall_timeout
        self.last_heard = time.monotonic()  # the last frame from the scheduler
        self.stalled = False
        self.scheduler_stopped = False  # it said so; cleared when it reports ready again
        self.load = Pong(0.0)  # the scheduler's last report of its load
        self.cached_prefixes: frozenset[bytes] = frozenset()  # and of the prefixes its cache holds
        self.handlers: dict[type, Callable[[Any], None]] = {
            RequestOutputs: self._on_outputs,
            SchedulerInfo: self._on_info,
            Unavailable: self._on_unavailable,
            Pong: self._on_pong,
        }

    async def start(self) -> None:
        """Introduce this api to the scheduler; `info` is set when its workers are ready."""
        self._receiver = asyncio.create_task(self._receive_loop())
        self._watcher = asyncio.create_task(self._watch_connection())
        self._heart = asyncio.create_task(self._heartbeat())
        self._aborter = asyncio.create_task(self._send_aborts())
        await self._send(Hello(self.identity))

    async def close(self) -> None:
        for task in (self._receiver, self._watcher, self._heart, self._aborter):
            if task is not None:
                task.cancel()
        self.socket.disable_monitor()  # before its socket closes with the rest (sockets.stop_monitors says why)
        self.context.destroy(linger=0)

    async def _watch_connection(self) -> None:
        """If the scheduler goes away, its requests are lost: end them with an error now, and
        introduce this api again when a scheduler is back."""
        events = self.socket.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECTED)
        while True:
            event = parse_monitor_message(await events.recv_multipart())
            if event["event"] == zmq.EVENT_DISCONNECTED:
                if self._queues and self.scheduler_stopped:  # it ended its requests as it stopped
                    log.info("the scheduler at %s stopped; ending %d request(s)", self.endpoint, len(self._queues))
                elif self._queues:  # with nothing in flight (a clean stop, a restart) nothing failed
                    log.error("lost the scheduler at %s; failing %d request(s)", self.endpoint, len(self._queues))
                elif not self.scheduler_stopped:  # it said it stops: the line was written then
                    log.info("the scheduler at %s went away; waiting for it", self.endpoint)
                self._fail_all("the scheduler went away")
            elif self.info is None:
                await self._send(Hello(self.identity))

    async def _heartbeat(self) -> None:
        """Ping the scheduler; if nothing at all comes back for `stall_timeout` seconds (its loop is
        stopped or stuck), fail what is in flight and answer 503 until it speaks again."""
        while True:
            await asyncio.sleep(PING_INTERVAL)
            silent, stranded = time.monotonic() - self.last_heard, []
            if not self.stalled and silent > self.stall_timeout:
                self.stalled = True
                if self.info is not None or self._queues:
                    log.error(
                        "the scheduler has not answered for %.1f s; failing %d request(s)", silent, len(self._queues)
                    )
                else:
                    log.info("waiting for the scheduler to answer")
                stranded = list(self._queues)
                self._fail_all(f"the scheduler stopped answering for {silent:.0f} s")
            try:
                if stranded:  # so that a scheduler that wakes frees their blocks
                    self.abort(*stranded)
                self.socket.send(encode(Ping(time.time())), zmq.NOBLOCK)
            except zmq.Again:  # the link's queue is full: the scheduler is not reading
                pass

    def _fail_all(self, reason: str) -> None:
        self.info = None
        for request_id, queue in self._queues.items():
            queue.put_nowait(RequestOutput(request_id, 0, [], True, reason))

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        arrival: float,
        cache_salt: str = "",
        priority: int = 0,
        tenant: str = "",
        lora: LoraRef | None = None,
        kv_send: bool = False,
        kv_source: KVHandoff | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Yield the request's outputs until it finishes; aborts it if the caller stops early."""
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._queues[request_id] = queue
        finished = False
        try:
            if self.info is None:  # the scheduler went away after the caller checked
                queue.put_nowait(RequestOutput(request_id, 0, [], True, "the scheduler is not ready"))
            else:
                message = AddRequest(
                    request_id,
                    prompt_token_ids,
                    sampling,
                    arrival,
                    cache_salt,
                    priority,
                    tenant,
                    lora,
                    kv_send,
                    kv_source,
                )
                frame = encode(message)
                if len(frame) > MAX_FRAME_BYTES["AddRequest"]:  # the scheduler would drop it unread
                    queue.put_nowait(
                        RequestOutput(
                            request_id,
                            len(prompt_token_ids),
                            [SequenceDelta(0, [], [], [], "rejected")],
                            True,
                            f"the request takes {len(frame)} bytes on the wire, over the scheduler's limit of "
                            f"{MAX_FRAME_BYTES['AddRequest']}",
                        )
                    )
                else:
                    await self.socket.send(frame)
            while not finished:
                output = await queue.get()
                finished = output.finished
                yield output
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, *request_ids: str) -> None:
        """Abort these requests at the scheduler. Not awaited (it runs in cleanup paths, where the task
        may be cancelled already): the ids wait in an outbox that a task sends as the link takes them,
        so none is lost to a full queue."""
        self._to_abort.update(dict.fromkeys(request_ids))
        self._abort_ready.set()

    async def _send_aborts(self) -> None:
        while True:
            await self._abort_ready.wait()
            self._abort_ready.clear()
            while self._to_abort:
                batch = list(itertools.islice(self._to_abort, ABORTS_PER_MESSAGE))
                for request_id in batch:
                    del self._to_abort[request_id]
                await self._send(Abort(batch))

    async def _send(self, message: object) -> None:
        await self.socket.send(encode(message))

    async def _receive_loop(self) -> None:
        while True:
            frame = await self.socket.recv()
            self.last_heard = time.monotonic()
            if self.stalled:
                self.stalled = False
                log.info("the scheduler answers again")
                await self._send(Hello(self.identity))
            try:
                message = decode(frame, trusted_peer_containers(frame))
            except ProtocolError as exc:
                log.error("dropped a malformed frame from the scheduler: %s", exc)
                continue
            handler = self.handlers.get(type(message))
            if handler is None:
                log.error("no handler for %s", type(message).__name__)
                continue
            handler(message)

    def _on_outputs(self, message: RequestOutputs) -> None:
        for output in message.outputs:
            queue = self._queues.get(output.request_id)
            if queue is not None:
                queue.put_nowait(output)

    def _on_info(self, message: SchedulerInfo) -> None:
        if self.info is None:
            log.info("the scheduler at %s is ready: serving", self.endpoint)
        self.info = message
        self.has_served = True
        self.scheduler_stopped = False

    def _on_pong(self, message: Pong) -> None:
        self.load = message  # its arrival is news too: `last_heard` moved
        self.cached_prefixes = frozenset(message.cached_prefixes)

    @property
    def in_flight(self) -> int:
        return len(self._queues)

    def _on_unavailable(self, message: Unavailable) -> None:
        """An error only where requests fail by it: an orderly stop (the workers, or the scheduler
        itself) is no failure."""
        self.scheduler_stopped = message.stopping
        if message.stopping:
            log.info("the scheduler at %s is stopping", self.endpoint)
        elif self._queues:
            log.error(
                "the scheduler at %s lost its workers: %s; failing %d request(s)",
                self.endpoint,
                message.reason,
                len(self._queues),
            )
        else:
            log.info("the scheduler at %s has no workers now: %s", self.endpoint, message.reason)
        self.info = None
