"""The draft model: a smaller model with the target's tokenizer that proposes tokens to verify.

It keeps a paged KV cache of its own under the target's block ids, so the scheduler's block
tables, copies and swaps serve both. Every position the target computes, the draft computes
too, in the same step and before it; so its cache is whole wherever the target's is, prefix
cache hits and swaps included. A sequence that asks for k drafts then gets k more passes of
one token each, each taking the draft's most likely token: single-token proposals, which is
what the runner's verification keeps the target's distribution for.

The one position it may lack is that of the last of k drafts when the target accepts all k (no
later pass needed its keys); the next step computes it first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from services.worker.block_tables import BlockTables
from services.worker.kv_cache import KVCache
from services.worker.step_inputs import StepInputs
from shared.protocol import ScheduledSequence

if TYPE_CHECKING:
    from services.worker.mirrors import SequenceMirror
    from services.worker.models.base import PagedCausalLM


class Drafter:
    def __init__(self, model: PagedCausalLM, cache: KVCache, device: torch.device) -> None:
        self.model = model
        self.cache = cache
        self.device = device
        self.inputs = StepInputs(device)

    def draft(
        self, scheduled: list[ScheduledSequence], mirrors: dict[int, SequenceMirror], tables: BlockTables
    ) -> dict[int, list[int]]:
        """Compute the step's known positions in the draft's cache and propose each entry's drafts."""
        tokens: list[int] = []
        positions: list[int] = []
        starts, context_lens, rows = [0], [], []
        drafting = []  # (entry index, seq_id, position of its last known token)
        for i, entry in enumerate(scheduled):
            mirror = mirrors[entry.seq_id]
            known_end = entry.start + entry.num_tokens - entry.num_draft_tokens
            begin = entry.start if mirror.num_drafted_positions < 0 else min(mirror.num_drafted_positions, entry.start)
            tokens.extend(mirror.token_ids[begin:known_end])
            positions.extend(range(begin, known_end))
            starts.append(starts[-1] + known_end - begin)
            context_lens.append(known_end)
            rows.append(mirror.row)
            mirror.num_drafted_positions = known_end
            if entry.num_draft_tokens:
                drafting.append((i, entry.seq_id, known_end - 1))
        last_rows = [starts[i + 1] - 1 for i, _, _ in drafting]
        proposed = self._forward(tokens, positions, starts, context_lens, rows, tables, last_rows)
        drafts = {seq_id: [token] for (_, seq_id, _), token in zip(drafting, proposed)}
        for j in range(1, max((scheduled[i].num_draft_tokens for i, _, _ in drafting), default=0)):
            more = [(i, seq_id, last) for i, seq_id, last in drafting if scheduled[i].num_draft_tokens > j]
            tokens = [drafts[seq_id][-1] for _, seq_id, _ in more]
            positions = [last + j for _, _, last in more]
            rows = [mirrors[seq_id].row for _, seq_id, _ in more]
            proposed = self._forward(
                tokens,
                positions,
                list(range(len(more) + 1)),
                [p + 1 for p in positions],
                rows,
                tables,
                list(range(len(more))),
            )
            for (_, seq_id, last), token in zip(more, proposed):
                drafts[seq_id].append(token)
                mirrors[seq_id].num_drafted_positions = last + j + 1
        return drafts

    def settle(self, mirror: SequenceMirror, num_known: int, num_accepted: int) -> None:
        """After verification: of the drafted positions past the `num_known` tokens the step started
        from, only those the target accepted hold the sequence's tokens."""
        mirror.num_drafted_positions = min(mirror.num_drafted_positions, num_known + num_accepted)

    def _forward(
        self,
        tokens: list[int],
        positions: list[int],
        starts: list[int],
        context_lens: list[int],
        rows: list[int],
        tables: BlockTables,
        logit_rows: list[int],
    ) -> list[int]:
        """One pass of the draft model; the most likely next token at each of `logit_rows`."""
        inputs = tables.step(
            self.inputs, tokens, positions, rows, starts, context_lens, logit_rows, self.cache.block_size
        )
        hidden = self.model(inputs.input_ids, inputs.positions, self.cache.layers, inputs.batch)
        if not logit_rows:
            return []
        drafts: list[int] = self.model.logits(hidden[inputs.logit_rows]).argmax(dim=-1).tolist()
        return drafts  # for the next pass
