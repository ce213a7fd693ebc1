"""What a frame may cost before it is decoded: the largest frame an honest peer sends of each
message type, a bound on the arrays and maps one frame may build, and the message type a frame
claims, read from its first bytes without decoding it."""

from __future__ import annotations

from typing import TypeVar


class ProtocolError(ValueError):
    """A frame that is not a valid message of this protocol version."""


T = TypeVar("T")


class ContainerBudget:
    """Stops decoding at the n-th array or map: each costs at least 56 bytes in Python for one
    byte on the wire, so a frame of empty containers would otherwise grow some 60-fold."""

    def __init__(self, limit: int):
        self.left = limit

    def __call__(self, container: T) -> T:
        self.left -= 1
        if self.left < 0:
            raise ProtocolError("more arrays and maps than this socket's messages ever hold")
        return container


# The largest frame an honest peer ever sends of each type, checked before anything is decoded
# (the socket's frame limit bounds the rest: Step, StepResult and RequestOutputs grow with the batch).
MAX_FRAME_BYTES: dict[str, int] = {
    "Hello": 4 << 10,
    "Ping": 256,
    "Pong": 16 << 10,
    "Shutdown": 256,
    "Reset": 256,
    "Unavailable": 64 << 10,
    "SchedulerInfo": 64 << 10,
    "Ready": 1 << 20,
    "Abort": 1 << 20,
    "AddRequest": 16 << 20,  # a prompt of a million tokens, and an 8 MiB request body's grammar
}
# Decoding any frame within these limits costs at most this many times its bytes in memory, and
# 16 KiB more (measured worst cases: empty maps where a peer is trusted with many containers, 36x;
# strings of one character beyond Latin-1, 28x; tests/test_protocol.py).
DECODED_BYTES_PER_FRAME_BYTE = 40


def frame_tag(frame: bytes) -> str | None:
    """The message type a frame claims, read by hand from its first bytes: [version, tag, ...]."""
    if len(frame) < 3:
        return None
    first = frame[0]
    if 0x92 <= first <= 0x9F:  # an array of 2 to 15 items
        at = 1
    elif first == 0xDC and int.from_bytes(frame[1:3], "big") >= 2:  # array 16
        at = 3
    elif first == 0xDD and int.from_bytes(frame[1:5], "big") >= 2:  # array 32
        at = 5
    else:
        return None
    version = frame[at] if at < len(frame) else 0xFF
    at += 1 if version < 0x80 else 2 if version == 0xCC else len(frame)  # a fixint or a uint 8
    if at >= len(frame):
        return None
    marker = frame[at]
    if 0xA0 <= marker <= 0xBF:  # a short string
        size, at = marker - 0xA0, at + 1
    elif marker == 0xD9 and at + 1 < len(frame):  # a string of up to 255 bytes
        size, at = frame[at + 1], at + 2
    else:
        return None
    if size > 32 or at + size > len(frame):  # no message type's name is that long
        return None
    try:
        return frame[at : at + size].decode()
    except UnicodeDecodeError:
        return None
