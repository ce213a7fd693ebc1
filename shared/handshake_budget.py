"""A budget of connections that have not finished their CURVE handshake, on a listening socket.

libzmq reads a peer's frames before it has authenticated, up to the socket's frame size limit,
for as long as the handshake interval allows: each keyless connection can make the process hold
that much, and nothing in libzmq bounds how many there are. The socket's monitor names each
accepted connection by file descriptor; past the budget of its source address (an IPv6 /64) a
new one is shut down at once, before it can send much.

There is no budget for all addresses together: a slot anyone could fill would be a door an
attacker holds shut against honest peers. A peer that the kernel shows runs as this process's own
user is not counted at all: it can read this service's keys, so a budget would not stop it, and
an attacker sharing an honest peer's address (another user on the same machine) cannot lock that
peer out.

A connection counts for its handshake interval from the moment it is accepted: libzmq reports that
a handshake succeeded without saying whose (the event's value is 0, not the descriptor), so the
budget cannot tell which connection finished early; by the interval's end libzmq has either
authenticated a connection or dropped it."""

from __future__ import annotations

import ipaddress
import os
import socket
import time
from collections.abc import Callable

import zmq

from shared.peer_uid import peer_uid
from shared.sockets import HANDSHAKE_MS, peer_log

HANDSHAKE_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
PER_ADDRESS = 2


class HandshakeBudget:
    def __init__(
        self,
        role: str,
        per_address: int = PER_ADDRESS,
        own_uid: int | None = None,
        interval: float = HANDSHAKE_MS / 1000,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.role, self.per_address, self.interval, self.clock = role, per_address, interval, clock
        self.own_uid = os.getuid() if own_uid is None else own_uid
        # file descriptor -> its source, and when it stops counting; in the order accepted, so deadlines ascend
        self.pending: dict[int, tuple[str, float]] = {}
        self.from_source: dict[str, int] = {}

    def on_event(self, event: int, descriptor: int) -> None:
        if event == zmq.EVENT_ACCEPTED:
            self._accepted(descriptor)
        elif event == zmq.EVENT_DISCONNECTED:
            self._forget(descriptor)

    def _accepted(self, descriptor: int) -> None:
        self._expire()
        self._forget(descriptor)  # a descriptor number reused before its close was reported
        try:
            peer = socket.socket(fileno=os.dup(descriptor))
        except OSError:  # already closed by libzmq
            return
        try:
            if peer_uid(peer) == self.own_uid:
                return
            source = source_of(peer.getpeername()[0])
            held = self.from_source.get(source, 0)
            if held >= self.per_address:
                peer_log.warning(
                    "cut a connection from %s to the %s socket: %d connections from it are still in their handshake",
                    source,
                    self.role,
                    held,
                )
                peer.shutdown(socket.SHUT_RDWR)  # libzmq sees the end of the stream and drops it
            else:
                self.pending[descriptor] = (source, self.clock() + self.interval)
                self.from_source[source] = held + 1
        except OSError:
            pass
        finally:
            peer.close()  # the duplicate only; libzmq keeps its own descriptor

    def _expire(self) -> None:
        """Stop counting the connections whose handshake interval has ended (authenticated or dropped by now)."""
        now = self.clock()
        while self.pending:
            descriptor, (_, deadline) = next(iter(self.pending.items()))
            if deadline > now:
                break
            self._forget(descriptor)

    def _forget(self, descriptor: int) -> None:
        entry = self.pending.pop(descriptor, None)
        if entry is not None:
            left = self.from_source.pop(entry[0]) - 1
            if left:
                self.from_source[entry[0]] = left


def source_of(address: str) -> str:
    """What a budget counts against: the address, or for IPv6 its /64, which one host usually owns."""
    parsed = ipaddress.ip_address(address.split("%")[0])
    if isinstance(parsed, ipaddress.IPv6Address):
        if parsed.ipv4_mapped is not None:
            return str(parsed.ipv4_mapped)
        return str(ipaddress.ip_network(f"{parsed}/64", strict=False))
    return str(parsed)
