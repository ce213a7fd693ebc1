"""Deadlines for a request's headers: a client that sends them a byte at a time (slowloris) is cut
off, where uvicorn's keep-alive timer restarts with every byte and would hold it forever.

The body has its own deadline (`services.api.json_body`), where its size limit is checked too."""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


def with_header_deadline(seconds: float) -> type[H11Protocol]:
    class HeaderDeadlineProtocol(H11Protocol):
        """Each request's headers must be complete within `seconds` of the connection opening or
        of the previous response ending."""

        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(seconds, self._expire)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expire(self) -> None:
            self._deadline = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()  # headers still incomplete: nothing to answer yet

    return HeaderDeadlineProtocol
