"""ZeroMQ helpers: every process talks through these, so framing and options live in one place."""

from __future__ import annotations

import logging

import zmq

from shared.protocol import ProtocolError, decode, encode

log = logging.getLogger(__name__)


def bind(context: zmq.Context, kind: int, endpoint: str) -> zmq.Socket:
    sock = context.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if kind == zmq.ROUTER:
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.bind(endpoint)
    return sock


def connect(context: zmq.Context, kind: int, endpoint: str, identity: bytes | None = None):
    sock = context.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    sock.connect(endpoint)
    return sock


def send(sock: zmq.Socket, message: object, to: bytes | None = None) -> None:
    """Send one message; `to` is the peer identity on a ROUTER socket."""
    frame = encode(message)
    if to is None:
        sock.send(frame)
    else:
        sock.send_multipart([to, frame])


def try_send(sock: zmq.Socket, message: object, to: bytes | None = None) -> bool:
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


def receive(sock: zmq.Socket, routed: bool = False) -> tuple[bytes | None, object | None]:
    """Receive one message as (sender, message); a malformed frame is logged and gives None."""
    if routed:
        frames = sock.recv_multipart()  # [peer identity, frame]
        sender, frame = frames[0], frames[-1]
    else:
        sender, frame = None, sock.recv()
    return sender, _decode_or_log(frame, sender)


def _decode_or_log(frame: bytes, sender: bytes | None) -> object | None:
    try:
        return decode(frame)
    except ProtocolError as exc:
        log.error("dropped a malformed frame from %r: %s", sender, exc)
        return None
