"""ZeroMQ helpers: every process talks through these, so framing and options live in one place.

Every socket has a frame size limit (`zmq.MAXMSGSIZE`: ZeroMQ drops the connection of a peer that
sends more), and every receive a bound on the arrays and maps a frame may decode to, so no frame
costs more than a small multiple of its bytes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

import zmq

from shared.frame_limits import ProtocolError
from shared.log_limits import RateLimit
from shared.protocol import decode, encode
from shared.wire_security import WireKeys, connect_securely, serve_securely

Socket = zmq.Socket[bytes]
Context = zmq.Context[Socket]
AnySocket = TypeVar("AnySocket", bound="zmq.Socket[Any]")  # a blocking socket, or an asyncio one

log = logging.getLogger(__name__)
peer_log = logging.getLogger("pagedserve.peers")  # lines a misbehaving peer causes: rate-limited
peer_log.addFilter(RateLimit())

MAX_MESSAGE_BYTES = 64 << 20  # a Step resuming hundreds of long sequences carries all their tokens
# A peer that has not finished its CURVE handshake by then is dropped, with whatever it sent (ZeroMQ's
# default is 30 s); an honest handshake takes milliseconds.
HANDSHAKE_MS = 2000


def trusted_peer_containers(frame: bytes) -> int:
    """The container bound for what the scheduler sends: its densest messages spend a few bytes
    per array, so this caps any frame at a few dozen times its size in memory."""
    return len(frame) // 2 + 64


def new_socket(context: zmq.Context[AnySocket], kind: int, max_bytes: int = MAX_MESSAGE_BYTES) -> AnySocket:
    """A socket with the limits every process's sockets share: no linger, a frame size limit and a
    short handshake interval."""
    sock = context.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)
    sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_MS)
    return sock


def bind(
    context: Context,
    kind: int,
    endpoint: str,
    keys: WireKeys | None = None,
    domain: str = "",
    max_bytes: int = MAX_MESSAGE_BYTES,
) -> Socket:
    sock = new_socket(context, kind, max_bytes)
    if kind == zmq.ROUTER:
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    serve_securely(sock, keys, domain)
    sock.bind(endpoint)
    return sock


def connect(
    context: zmq.Context[AnySocket],
    kind: int,
    endpoint: str,
    identity: bytes | None = None,
    keys: WireKeys | None = None,
    max_bytes: int = MAX_MESSAGE_BYTES,
) -> AnySocket:
    sock = new_socket(context, kind, max_bytes)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    connect_securely(sock, keys)
    sock.connect(endpoint)
    return sock


def send(sock: Socket, message: object, to: bytes | None = None) -> None:
    """Send one message; `to` is the peer identity on a ROUTER socket."""
    frame = encode(message)
    if to is None:
        sock.send(frame)
    else:
        sock.send_multipart([to, frame])


def try_send(sock: Socket, message: object, to: bytes | None = None) -> bool:
    """Send without blocking; False if the peer is gone or its queue is full."""
    frame = encode(message)
    try:
        if to is None:
            sock.send(frame, zmq.NOBLOCK)
        else:
            sock.send_multipart([to, frame], zmq.NOBLOCK)
    except zmq.ZMQError as exc:  # Again (queue full) or EHOSTUNREACH (ROUTER_MANDATORY, peer gone)
        log.debug("send to %r failed: %s", to, exc)
        return False
    return True


def receive(
    sock: Socket, routed: bool = False, max_containers: int | None = None
) -> tuple[bytes | None, object | None]:
    """Receive one message as (sender, message); a malformed frame is logged and gives None.
    Without `max_containers`, the frame gets the bound of what the scheduler sends."""
    if routed:
        frames = sock.recv_multipart()  # [peer identity, frame]
        sender, frame = frames[0], frames[-1]
    else:
        sender, frame = None, sock.recv()
    return sender, _decode_or_log(frame, sender, max_containers)


def receive_with_connection(
    sock: Socket, max_containers: int, admit: Callable[[bytes, int], bool] | None = None
) -> tuple[bytes, int, object | None]:
    """On a ROUTER: (sender, the file descriptor of its connection, message). The descriptor is
    what the socket monitor names when that connection closes. `admit(sender, size)`, where given,
    decides before decoding: a frame it refuses is dropped unread (message None)."""
    frames = sock.recv_multipart(copy=False)
    sender, fd, size = frames[0].bytes, frames[-1].get(zmq.SRCFD), len(frames[-1])
    if admit is not None and not admit(sender, size):
        peer_log.warning("dropped a frame of %d bytes from %r unread: it sends nothing that large", size, sender)
        return sender, fd, None
    return sender, fd, _decode_or_log(frames[-1].bytes, sender, max_containers)


def _decode_or_log(frame: bytes, sender: bytes | None, max_containers: int | None) -> object | None:
    try:
        return decode(frame, trusted_peer_containers(frame) if max_containers is None else max_containers)
    except ProtocolError as exc:
        peer_log.error("dropped a malformed frame of %d bytes from %r: %s", len(frame), sender, exc)
        return None


def stop_monitors(monitored: list[Socket], monitors: list[Socket]) -> None:
    """Stops the monitors of `monitored`, then closes the monitors' own sockets, in that order: a socket sends its
    monitor an event from ZeroMQ's I/O thread, holding the monitor's lock, and a send to a monitor whose socket
    is closed waits for ever, so a connection that handshakes between a monitor's close and its stop would hold
    every later use of that lock, the stop included."""
    for sock in monitored:
        sock.disable_monitor()
    for monitor in monitors:
        monitor.close()
