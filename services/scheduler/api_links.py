"""The scheduler's links to its apis, which it never waits on: which api owns each request, where each request's
outputs go, and what happens to an api that stops reading (its queue fills): its requests are aborted, and it is
cut off until a notice of those requests reaches it (`know`)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import zmq

from services.scheduler.results import error_output
from shared import sockets
from shared.protocol import RequestOutput, RequestOutputs

log = logging.getLogger("services.scheduler.server")


class ApiLinks:
    def __init__(self, socket: zmq.Socket, abort: Callable[[str], object]):  # type: ignore[type-arg]
        self.socket, self.abort = socket, abort
        self.apis: set[bytes] = set()
        self.owner_of: dict[str, bytes] = {}
        self.cut_off: dict[bytes, list[str]] = {}  # api -> its requests aborted while it did not read

    def know(self, api: bytes) -> None:
        """An api spoke. One that was cut off learns first which of its requests ended meanwhile; until
        that notice goes through it stays cut off, and the notice is tried again at its next message."""
        notices = self.cut_off.pop(api, None)
        if notices:
            ended = RequestOutputs(
                [
                    error_output(r, 0, "aborted: this api stopped reading its results", "abort")
                    for r in dict.fromkeys(notices)
                ]
            )
            if not sockets.try_send(self.socket, ended, to=api):
                self.cut_off[api] = notices
                return
        self.apis.add(api)

    def route(self, outputs: list[RequestOutput]) -> None:
        by_owner: dict[bytes, list[RequestOutput]] = {}
        for output in outputs:
            owner = self.owner_of.get(output.request_id)
            if owner is None:
                continue
            by_owner.setdefault(owner, []).append(output)
            if output.finished and output.kv_handoff is None:  # else its api may still release the blocks held
                del self.owner_of[output.request_id]
        for owner, batch in by_owner.items():
            self.send_outputs(owner, batch)

    def forget(self, request_ids: list[str]) -> None:
        """Requests that ended and whose KV blocks, held for a decode engine, are released (or expired)."""
        for request_id in request_ids:
            self.owner_of.pop(request_id, None)

    def send_outputs(self, owner: bytes, outputs: list[RequestOutput]) -> None:
        self.send(owner, RequestOutputs(outputs), outputs)

    def send(self, api: bytes, message: object, outputs: Sequence[RequestOutput] = ()) -> None:
        if api in self.cut_off or sockets.try_send(self.socket, message, to=api):
            if api in self.cut_off:  # these never reach it, finished or not: each gets the notice
                self.cut_off[api] += [o.request_id for o in outputs]
            return
        # Gone, or its queue is full because it stopped reading: drop it, abort its requests.
        mine = [r for r, owner in self.owner_of.items() if owner == api]
        log.warning("api %r is not reading (%d requests); aborting them", api, len(mine))
        for request_id in mine:
            self.abort(request_id)
            del self.owner_of[request_id]
        self.apis.discard(api)
        self.cut_off[api] = mine + [o.request_id for o in outputs if o.request_id not in mine]
