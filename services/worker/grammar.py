"""Grammar-constrained decoding in the worker: each constrained sequence holds an llguidance
matcher that follows its output tokens and says which tokens may come next.

The matcher lives beside the sequence's tokens, here, because the worker knows each sampled
token first: the mask for the next step is ready the moment a step ends, whatever the scheduler
has already planned. A matcher follows the tokens lazily, at the next mask, so every way tokens
reach a sequence (sampled here, sent by the scheduler for forked samples, replayed after a
recompute) moves it the same way. Proposals to verify are walked through and rolled back, by
llguidance's executor, which computes a whole step's masks in its own threads.

Grammars arrive compiled and validated by the api, and are checked again here against the same
bounds (shared/grammar_guard.py), because a grammar llguidance cannot take ends the process. A
matcher per grammar text is kept as a template and copied for each sequence, so a grammar compiles
once per worker however many requests use it; templates are kept up to `TEMPLATE_BYTES` of heap.
"""

from __future__ import annotations

import json
import logging
import os
from collections import OrderedDict
from typing import Any

import torch

from shared.glibc_heap import heap_in_use
from shared.grammar_guard import CompileThreads, unbounded_reason

log = logging.getLogger(__name__)

TEMPLATE_BYTES = 256 << 20  # heap held by compiled grammars kept for reuse (a 20,000-value enum: 7 MB)


def grammar_tokenizer(tokenizer_dir: str, vocab_size: int, eos_token: int | None) -> Any:
    """llguidance's view of the model's tokenizer, read from tokenizer.json with the `tokenizers`
    library. transformers (seconds of import at every worker start) is needed only where
    tokenizer_config.json adds tokens that tokenizer.json lacks."""
    import llguidance

    path = os.path.join(tokenizer_dir, "tokenizer.json")
    if os.path.isfile(path):
        import tokenizers

        backend = tokenizers.Tokenizer.from_file(path)
        if not _tokens_added_elsewhere(tokenizer_dir, backend):
            backend.no_padding()
            backend.no_truncation()
            return llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab_size, eos_token=eos_token)
    import llguidance.hf
    from transformers import AutoTokenizer

    hf_tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=eos_token)


def _tokens_added_elsewhere(tokenizer_dir: str, backend: Any) -> bool:
    config_path = os.path.join(tokenizer_dir, "tokenizer_config.json")
    if not os.path.isfile(config_path):
        return False
    with open(config_path) as f:
        declared = json.load(f).get("added_tokens_decoder") or {}
    present = backend.get_added_tokens_decoder()
    return any(int(token_id) not in present for token_id in declared)


class GrammarState:
    """One sequence's matcher, and how many of its output tokens the matcher has taken."""

    __slots__ = ("matcher", "consumed")

    def __init__(self, matcher: Any, consumed: int = 0) -> None:
        self.matcher = matcher
        self.consumed = consumed

    def copy(self) -> GrammarState:
        return GrammarState(self.matcher.deep_copy(), self.consumed)

    def catch_up(self, token_ids: list[int], num_prompt_tokens: int) -> bool:
        """Follow the output tokens it has not seen; False once a token broke the grammar (the
        matcher then allows only EOS)."""
        seen = num_prompt_tokens + self.consumed
        if len(token_ids) > seen:
            self.matcher.consume_tokens(token_ids[seen:])
            self.consumed = len(token_ids) - num_prompt_tokens
        return not self.matcher.is_error()


class GrammarEngine:
    """The worker's llguidance tokenizer and its cache of compiled grammars."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int], threads: int = 0) -> None:
        import llguidance

        self.tokenizer = tokenizer  # an llguidance LLTokenizer
        self.templates: OrderedDict[str, tuple[Any, int]] = OrderedDict()  # grammar: (llguidance matcher, bytes)
        self.template_bytes = 0
        self.compile_thread = CompileThreads(1, "grammar-template")
        # Computes a step's masks in its own threads, outside the GIL; 0: one per core.
        self.executor = llguidance.LLExecutor(threads or max(1, len(os.sched_getaffinity(0))))
        words = [0] * ((vocab_size + 31) // 32)
        for token in eos_token_ids:
            if 0 <= token < vocab_size:
                words[token // 32] |= 1 << token % 32
        self.eos_mask = torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)

    @classmethod
    def load(
        cls, tokenizer_dir: str, vocab_size: int, eos_token_ids: list[int], threads: int = 0
    ) -> GrammarEngine | None:
        """None where the directory has no tokenizer that llguidance can read (constrained requests are
        then refused with a reason)."""
        try:
            tokenizer = grammar_tokenizer(tokenizer_dir, vocab_size, eos_token_ids[0] if eos_token_ids else None)
        except Exception as exc:  # no tokenizer, a slow-only tokenizer, no llguidance
            log.warning("structured outputs are off: no tokenizer for grammars in %s (%s)", tokenizer_dir, exc)
            return None
        return cls(tokenizer, vocab_size, eos_token_ids, threads)

    def start(self, grammar: str) -> GrammarState | str:
        """A fresh state for `grammar`, or why it cannot be served."""
        kept = self.templates.get(grammar)
        if kept is not None:
            self.templates.move_to_end(grammar)
            return GrammarState(kept[0].deep_copy())
        problem = unbounded_reason(grammar)
        if problem:
            return f"grammar: {problem}"
        template, size = self.compile_thread.run(lambda: _compiled(self.tokenizer, grammar))
        if template.is_error():
            return f"grammar: {template.get_error()}"
        self.templates[grammar] = (template, size)
        self.template_bytes += size
        while self.template_bytes > TEMPLATE_BYTES and len(self.templates) > 1:
            _, (_, evicted) = self.templates.popitem(last=False)
            self.template_bytes -= evicted
        return GrammarState(template.deep_copy())

    def masks(self, sequences: list[tuple[GrammarState, list[int], int, list[int]]]) -> torch.Tensor:
        """For each (state, token ids, prompt length, proposals): a bitmask row of the tokens its grammar
        allows after its output, then one after each proposal in turn. Rows after a proposal the
        grammar refuses are never read: that proposal cannot be sampled, so its run ends there."""
        rows = torch.full((sum(len(p) + 1 for *_, p in sequences), self.eos_mask.shape[0]), -1, dtype=torch.int32)
        plain, verifying, first = [], [], 0
        for state, token_ids, num_prompt_tokens, proposals in sequences:
            if not state.catch_up(token_ids, num_prompt_tokens):
                rows[first : first + len(proposals) + 1] = self.eos_mask
            elif proposals:
                verifying.append((state.matcher, first, proposals))
            else:
                plain.append((state.matcher, first))
            first += len(proposals) + 1
        where = (rows.data_ptr(), rows.shape[1] * 4, len(rows))
        if plain:
            self.executor.unsafe_compute_mask_ptr(plain, *where)
        if verifying:
            self.executor.unsafe_compute_mask_ptr_with_draft_token(verifying, *where)
        return rows


def _compiled(tokenizer: Any, grammar: str) -> tuple[Any, int]:
    """llguidance's matcher for `grammar`, and the heap it took (the grammar text where that cannot be measured)."""
    import llguidance

    before = heap_in_use()
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    grown = heap_in_use() - before
    return matcher, (max(grown, len(grammar)) if before else len(grammar))
