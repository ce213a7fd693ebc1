"""What an untrusted grammar may ask of llguidance before llguidance sees it, in the api and the worker.

llguidance follows `$ref` chains and chains of grammar rules by recursion on the calling thread's
stack, and a long enough chain overflows it: the process dies (docs/security.md has the repro).
Nesting without links is already refused by llguidance itself. So every grammar is

- refused when it holds more links (`$ref`s and rule definitions, counted conservatively, after
  undoing JSON escapes) than `MAX_GRAMMAR_LINKS`, and
- compiled on a `CompileThreads` thread whose stack holds several times the deepest chain that
  bound allows, whatever the process's own stack limit is.
"""

from __future__ import annotations

import queue
import re
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")

# A chain of 5,000 links needs well under 64 MiB of stack in llguidance 1.x; the threads get four times that.
MAX_GRAMMAR_LINKS = 5_000
COMPILE_STACK_BYTES = 256 << 20

_ESCAPED_CHAR = re.compile(r"\\u([0-9a-fA-F]{4})")
# A Lark or GBNF rule or terminal definition at the start of a line or a JSON string: `name:`, `?name.2:`,
# `name ::=`.
_RULE = re.compile(r"(?m)(?:^|\")[ \t]*[?!]?[A-Za-z_][A-Za-z0-9_]*(?:\.-?\d+)?[ \t]*:")


def grammar_links(text: str) -> int:
    """An upper bound on the `$ref`s and rule definitions in `text`: a schema, a grammar, or
    llguidance's JSON wrapping of either (JSON inside JSON strings included)."""
    for _ in range(4):  # each round undoes one level of JSON string escaping
        unescaped = _ESCAPED_CHAR.sub(lambda m: chr(int(m.group(1), 16)), text)
        unescaped = unescaped.replace("\\n", "\n").replace('\\"', '"')
        if unescaped == text:
            break
        text = unescaped
    return text.count("$ref") + len(_RULE.findall(text))


def unbounded_reason(text: str) -> str | None:
    """Why llguidance must not see `text`, or None."""
    links = grammar_links(text)
    if links > MAX_GRAMMAR_LINKS:
        return (
            f"it holds {links} references and rule definitions; at most {MAX_GRAMMAR_LINKS} are accepted "
            "(the compiler follows them by recursion)"
        )
    return None


class CompileThreads:
    """Threads with `COMPILE_STACK_BYTES` of stack that run grammar compilations, one at a time per thread."""

    def __init__(self, count: int = 1, name: str = "grammar-compile"):
        self._jobs: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]]] = queue.SimpleQueue()
        with _STACK_SIZE_LOCK:  # the size applies to threads started while it is set
            previous = threading.stack_size(COMPILE_STACK_BYTES)
            try:
                for index in range(count):
                    threading.Thread(target=self._serve, name=f"{name}-{index}", daemon=True).start()
            finally:
                threading.stack_size(previous)

    def submit(self, job: Callable[[], T]) -> Future[T]:
        future: Future[T] = Future()
        self._jobs.put((future, job))
        return future

    def run(self, job: Callable[[], T]) -> T:
        return self.submit(job).result()

    def _serve(self) -> None:
        while True:
            future, job = self._jobs.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(job())
            except BaseException as exc:  # handed to the caller, who decides
                future.set_exception(exc)


_STACK_SIZE_LOCK = threading.Lock()
