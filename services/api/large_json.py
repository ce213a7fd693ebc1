"""JSON for bodies of megabytes, encoded in pieces so that the event loop gets the interpreter between them.

`json.dumps` holds the interpreter for the whole of one call: tens of megabytes of logprobs are a second in one
piece, during which no other coroutine runs, even with the call on another thread. Encoded here in pieces of about
`PIECE` values each, on a thread, the loop waits for one piece at most.
"""

from __future__ import annotations

import json
from typing import Any

PIECE = 4096  # values (a number, a short string, a container) per piece: about 100 KB, a millisecond or so
STRING_PIECE = 1 << 16  # characters of one long string per piece

_encode = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode


def encode_in_pieces(content: Any) -> bytes:
    """`content` as compact UTF-8 JSON, the same text Starlette's JSONResponse renders."""
    return "".join(pieces_of(content)).encode("utf-8")


def pieces_of(content: Any) -> list[str]:
    """The JSON text of `content`, each piece encoded by one call."""
    pieces: list[str] = []
    _write(content, pieces)
    return pieces


def _size(value: Any) -> int:
    """About how many values `value` holds, judging a list by its first item (the api's lists are uniform)."""
    if isinstance(value, dict):
        return 1 + sum(_size(item) for item in value.values())
    if isinstance(value, (list, tuple)):
        return 1 + len(value) * _size(value[0]) if value else 1
    if isinstance(value, str):
        return 1 + len(value) // 32
    return 1


def _write(value: Any, pieces: list[str]) -> None:
    if isinstance(value, str) and len(value) > STRING_PIECE:
        pieces.append('"')
        pieces.extend(_encode(value[i : i + STRING_PIECE])[1:-1] for i in range(0, len(value), STRING_PIECE))
        pieces.append('"')
    elif not isinstance(value, (dict, list, tuple)) or _size(value) <= PIECE:
        pieces.append(_encode(value))
    elif isinstance(value, dict):
        pieces.append("{")
        for i, (key, item) in enumerate(value.items()):
            pieces.append(("," if i else "") + _encode(str(key)) + ":")
            _write(item, pieces)
        pieces.append("}")
    else:
        pieces.append("[")
        per_piece = PIECE // _size(value[0])
        if per_piece <= 1:  # items of a piece or more each: each on its own
            for i, item in enumerate(value):
                if i:
                    pieces.append(",")
                _write(item, pieces)
        else:
            for start in range(0, len(value), per_piece):
                pieces.append(("," if start else "") + _encode(list(value[start : start + per_piece]))[1:-1])
        pieces.append("]")
