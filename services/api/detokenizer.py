"""Incremental detokenization with stop strings, one instance per generated sequence.

Text is released only once the tokens decode to whole characters, and the last few characters
are held back while they could still be the start of a stop string, so a stop string never
reaches the client, unless it asks for it (`include_stop_str_in_output`).
"""

from __future__ import annotations

from typing import Any

CONTEXT_TOKENS = 5  # prompt tokens decoded with the output so leading spaces come out right


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        stop: list[str],
        skip_special_tokens: bool,
        min_tokens: int = 0,
        include_stop: bool = False,
    ):
        self.tokenizer = tokenizer
        self.min_tokens = min_tokens  # stop strings count from this many generated tokens on
        self.num_generated = 0
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.token_ids = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.text = ""
        self.emitted = 0
        self.stopped = False
        self.include_stop = include_stop
        self.stop_string: str | None = None  # the one that ended the text

    def add(self, token_ids: list[int]) -> int:
        """Take new tokens; sets `stopped` and cuts `text` when a stop string appears. Returns how many
        it took: all, or those up to the one that completed a stop string (a run of several tokens,
        from speculative decoding, may go on past it)."""
        for taken, token_id in enumerate(token_ids):
            if self.stopped:
                return taken
            self.token_ids.append(token_id)
            self.num_generated += 1
            piece = self._next_piece()
            if piece:
                self._append(piece)
        return len(token_ids)

    def pending(self, final: bool) -> str:
        """Text not yet released; all of it when `final`, else all but the held-back tail."""
        if final and not self.stopped:
            self._flush()
        end = len(self.text) if final or self.stopped else max(self.emitted, len(self.text) - self.holdback)
        piece = self.text[self.emitted : end]
        self.emitted = end
        return piece

    def _next_piece(self, allow_partial: bool = False) -> str:
        decode = self.tokenizer.decode
        before = decode(
            self.token_ids[self.prefix_offset : self.read_offset], skip_special_tokens=self.skip_special_tokens
        )
        after = decode(self.token_ids[self.prefix_offset :], skip_special_tokens=self.skip_special_tokens)
        if len(after) <= len(before) or (after.endswith("\ufffd") and not allow_partial):
            return ""  # an incomplete character, or a token that decodes to nothing
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return str(after[len(before) :])

    def _flush(self) -> None:
        """At the end, release tokens still waiting for the rest of a character."""
        if self.read_offset < len(self.token_ids):
            piece = self._next_piece(allow_partial=True)
            if piece:
                self._append(piece)

    def _append(self, piece: str) -> None:
        search_from = max(0, len(self.text) - self.holdback)
        self.text += piece
        if self.num_generated < self.min_tokens:
            return
        hits = [(i, s) for i, s in ((self.text.find(s, search_from), s) for s in self.stop) if i >= 0]
        if hits:
            at, self.stop_string = min(hits, key=lambda hit: hit[0])
            self.text = self.text[: at + (len(self.stop_string) if self.include_stop else 0)]
            self.stopped = True
