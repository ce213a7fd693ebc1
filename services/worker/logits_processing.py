"""What a request asks of its logits before sampling, batched over the rows that ask it:
`logit_bias`, `min_tokens`, then the repetition, frequency and presence penalties, in that order
(the order vLLM applies them in; the repetition penalty as HF's `RepetitionPenaltyLogitsProcessor`).

Log-probabilities are reported from the processed logits, as HF's processed scores are.
"""

from __future__ import annotations

import torch


def process_logits(logits: torch.Tensor, rows: list, stop_ids: frozenset[int]) -> torch.Tensor:
    """`logits` holds one row per entry of `rows` (each a `SampleRow`); changed in place."""
    _add_logit_bias(logits, rows)
    _hold_back_stops(logits, rows, stop_ids)
    _apply_penalties(logits, rows)
    return logits


def _add_logit_bias(logits: torch.Tensor, rows: list) -> None:
    owners, tokens, biases = [], [], []
    for i, row in enumerate(rows):
        for token, bias in row.params.logit_bias.items():
            owners.append(i)
            tokens.append(token)
            biases.append(bias)
    if owners:
        device = logits.device
        logits.index_put_((torch.tensor(owners, device=device), torch.tensor(tokens, device=device)),
                          torch.tensor(biases, dtype=logits.dtype, device=device), accumulate=True)


def _hold_back_stops(logits: torch.Tensor, rows: list, stop_ids: frozenset[int]) -> None:
    """No EOS or stop token id before `min_tokens` tokens."""
    owners, tokens = [], []
    for i, row in enumerate(rows):
        if row.num_generated < row.params.min_tokens:
            held = set(row.params.stop_token_ids) | (set() if row.params.ignore_eos else stop_ids)
            owners += [i] * len(held)
            tokens += sorted(held)
    if owners:
        device = logits.device
        logits[torch.tensor(owners, device=device), torch.tensor(tokens, device=device)] = float("-inf")


def _apply_penalties(logits: torch.Tensor, rows: list) -> None:
    which = [i for i, row in enumerate(rows) if row.params.penalized]
    if not which:
        return
    device, vocab = logits.device, logits.shape[-1]
    outputs = [rows[i].token_ids[rows[i].num_prompt_tokens:] for i in which]
    prompts = [rows[i].token_ids[:rows[i].num_prompt_tokens] for i in which]
    counts = _token_counts(outputs, vocab, device, logits.dtype)
    in_prompt = _token_counts(prompts, vocab, device, logits.dtype) > 0
    params = [rows[i].params for i in which]
    repetition = torch.tensor([p.repetition_penalty for p in params], dtype=logits.dtype, device=device)[:, None]
    frequency = torch.tensor([p.frequency_penalty for p in params], dtype=logits.dtype, device=device)[:, None]
    presence = torch.tensor([p.presence_penalty for p in params], dtype=logits.dtype, device=device)[:, None]
    index = torch.tensor(which, device=device)
    picked = logits[index]
    generated = counts > 0
    seen = generated | in_prompt
    penalized = torch.where(picked > 0, picked / repetition, picked * repetition)
    picked = torch.where(seen, penalized, picked)
    picked -= frequency * counts + presence * generated
    logits[index] = picked


def _token_counts(sequences: list[list[int]], vocab: int, device, dtype) -> torch.Tensor:
    """How often each token id occurs in each sequence: [len(sequences), vocab]."""
    width = max((len(s) for s in sequences), default=0)
    padded = torch.full((len(sequences), width), vocab, dtype=torch.int64)
    for i, tokens in enumerate(sequences):
        padded[i, :len(tokens)] = torch.tensor(tokens, dtype=torch.int64)
    counts = torch.zeros(len(sequences), vocab + 1, dtype=dtype, device=device)
    counts.scatter_add_(1, padded.to(device), torch.ones(padded.shape, dtype=dtype, device=device))
    return counts[:, :vocab]
