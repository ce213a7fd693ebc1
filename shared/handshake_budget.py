"""A budget of connections that have not finished their CURVE handshake, on a listening socket.

libzmq reads a peer's frames before it has authenticated, up to the socket's frame size limit,
for as long as the handshake interval allows: each keyless connection can make the process hold
that much, and nothing in libzmq bounds how many there are. The socket's monitor names each
accepted connection by file descriptor; past the budget (per peer address, and in all) a new
one is shut down at once, before it can send much. Honest peers authenticate in milliseconds, and
one cut by bad luck reconnects by itself."""

from __future__ import annotations

import os
import socket

import zmq

from shared.sockets import peer_log

HANDSHAKE_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED


class HandshakeBudget:
    def __init__(self, role: str, per_address: int = 2, total: int = 8):
        self.role, self.per_address, self.total = role, per_address, total
        self.pending: dict[int, str] = {}  # file descriptor -> peer address

    def on_event(self, event: int, descriptor: int) -> None:
        if event == zmq.EVENT_ACCEPTED:
            self._accepted(descriptor)
        else:  # authenticated, or gone
            self.pending.pop(descriptor, None)

    def _accepted(self, descriptor: int) -> None:
        try:
            peer = socket.socket(fileno=os.dup(descriptor))
        except OSError:  # already closed by libzmq
            return
        try:
            address = peer.getpeername()[0]
            from_address = sum(1 for a in self.pending.values() if a == address)
            if from_address >= self.per_address or len(self.pending) >= self.total:
                peer_log.warning("cut a connection from %s to the %s socket: %d connections from it and %d in all "
                                 "are still in their handshake", address, self.role, from_address, len(self.pending))
                peer.shutdown(socket.SHUT_RDWR)  # libzmq sees the end of the stream and drops it
            else:
                self.pending[descriptor] = address
        except OSError:
            pass
        finally:
            peer.close()  # the duplicate only; libzmq keeps its own descriptor
