"""Pooling models (`--runner pooling`): a prompt becomes one vector instead of tokens.

The same decoder runs the prompt through the paged cache; its final hidden states (after the last norm) are pooled
at the prompt's last token, over all its tokens (mean), or at its first (CLS), and L2-normalized where the model
says so. A sequence-classification checkpoint adds its head (`score`), applied to the pooled state for "classify"
requests. How a model pools comes from its sentence-transformers files (modules.json and its Pooling module's
config.json) where it has them, then from `--pooler-config`, else LAST with normalization for embeddings, as
vLLM does for decoder models.

A prompt computed in chunks (several steps) is pooled as it goes: the running state is the sequence's mirror's.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from services.worker.mirrors import SequenceFault
from services.worker.model_config import ModelLoadError
from services.worker.models.linear import Linear
from shared.protocol import MAX_LABELS, PooledOutput, PoolingSpec, ScheduledSequence

POOLING_TYPES = ("LAST", "MEAN", "CLS")
POOLING_FAMILIES = ("Llama", "Mistral", "Qwen2", "Qwen3")
MAX_LABEL_CHARS = 40  # of each label's name sent to the api
MAX_MATRYOSHKA_SIZES = 64
BARE_EMBEDDING = "embed_tokens.weight"  # a bare decoder's (`...Model`) checkpoint names its tensors without `model.`
_SENTENCE_TRANSFORMERS_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN",
                                "pooling_mode_cls_token": "CLS"}  # fmt: skip


def architecture(config: Any) -> str:
    return str((getattr(config, "architectures", None) or ["?"])[0])


def is_classifier(config: Any) -> bool:
    return architecture(config).endswith("ForSequenceClassification")


def is_headless(config: Any) -> bool:
    """A checkpoint without an LM head: a bare decoder (`...Model`) or a classifier."""
    return is_classifier(config) or architecture(config) in {f"{family}Model" for family in POOLING_FAMILIES}


def runner_of(config: Any, flag: str) -> str:
    """`--runner`'s value, resolved: auto pools for a checkpoint without an LM head and generates otherwise."""
    if flag == "generate" and is_headless(config):
        raise ModelLoadError(f"{architecture(config)} has no LM head to generate with: serve it with --runner pooling")
    if flag == "auto":
        return "pooling" if is_headless(config) else "generate"
    return flag


def pooling_spec(model_dir: str, config: Any, overrides: str | None) -> PoolingSpec:
    """How this model pools: its sentence-transformers files, then `--pooler-config` (JSON with `pooling_type`
    and `normalize`, as vLLM's), then LAST and normalized (a classifier's head reads the state as it is)."""
    pooling_type, normalize = "LAST", not is_classifier(config)
    found = _sentence_transformers(model_dir)
    if found is not None:
        pooling_type, normalize = found
    if overrides:
        try:
            settings = json.loads(overrides)
        except ValueError as exc:
            raise ModelLoadError(f"--pooler-config is not JSON: {exc}") from None
        if not isinstance(settings, dict) or set(settings) - {"pooling_type", "normalize"}:
            raise ModelLoadError('--pooler-config takes {"pooling_type": "LAST|MEAN|CLS", "normalize": true|false}')
        pooling_type = str(settings.get("pooling_type", pooling_type)).upper()
        normalize = settings.get("normalize", normalize)
    if pooling_type not in POOLING_TYPES or type(normalize) is not bool:
        raise ModelLoadError(f"pooling type {pooling_type!r} is not one of {', '.join(POOLING_TYPES)}")
    num_labels = _num_labels(config) if is_classifier(config) else 0
    id2label = getattr(config, "id2label", None) or {}
    labels = [str(id2label.get(i, id2label.get(str(i), f"LABEL_{i}")))[:MAX_LABEL_CHARS] for i in range(num_labels)]
    sizes = getattr(config, "matryoshka_dimensions", None) or []
    if not isinstance(sizes, list) or not all(isinstance(s, int) and 0 < s <= config.hidden_size for s in sizes):
        raise ModelLoadError(f"matryoshka_dimensions {sizes!r} are not sizes up to hidden_size {config.hidden_size}")
    return PoolingSpec(
        pooling_type,
        normalize,
        config.hidden_size,
        num_labels,
        labels[:MAX_LABELS],
        sorted(set(sizes))[:MAX_MATRYOSHKA_SIZES],
        bool(getattr(config, "is_matryoshka", False)) and not sizes,
    )


def _sentence_transformers(model_dir: str) -> tuple[str, bool] | None:
    """(pooling type, normalize) from modules.json and the Pooling module's config.json; None without them."""
    path = os.path.join(model_dir, "modules.json")
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            modules = json.load(f)
        kinds = {m["type"].rpartition(".")[2]: m.get("path", "") for m in modules}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ModelLoadError(f"{path} is not a sentence-transformers module list: {exc}") from None
    if "Dense" in kinds:
        raise ModelLoadError(f"{path}: a Dense module after pooling is not supported")
    if "Pooling" not in kinds:
        return None
    pooling_path = os.path.join(model_dir, kinds["Pooling"], "config.json")
    try:
        with open(pooling_path) as f:
            settings = json.load(f)
        modes = [mode for key, mode in _SENTENCE_TRANSFORMERS_MODES.items() if settings.get(key)]
    except (OSError, ValueError, AttributeError) as exc:
        raise ModelLoadError(f"{pooling_path} is unreadable: {exc}") from None
    if len(modes) != 1:
        raise ModelLoadError(f"{pooling_path}: one of last token, mean or CLS pooling must be on (not max or several)")
    return modes[0], "Normalize" in kinds


def _num_labels(config: Any) -> int:
    """config.json keeps a classifier's labels (id2label), transformers' configs count them (num_labels)."""
    labels = getattr(config, "id2label", None)
    return len(labels) if labels else int(getattr(config, "num_labels", 0) or 0)


def add_head(model: nn.Module, config: Any) -> None:
    """Ready a model built on meta to load a pooling checkpoint: a classifier's `score` head, and an LM head tied to
    the embeddings where the checkpoint has none (nothing reads it; it takes no memory)."""
    if is_classifier(config):
        model.score = Linear(config.hidden_size, _num_labels(config), bias=False)
    if is_headless(config):
        model.tie_word_embeddings = True
        model.tie_weights()


def prompt_done(mirror: Any, entry: ScheduledSequence) -> bool:
    """Whether this chunk ends the sequence's prompt (a pooled sequence is its prompt)."""
    return entry.start + entry.num_tokens == len(mirror.token_ids)


class Pooler:
    def __init__(self, spec: PoolingSpec, head: nn.Module | None):
        self.spec = spec
        self.head = head

    def refusal(self, task: str) -> str | None:
        if not task:
            return "this pooling model does not generate (serve a generating model without --runner pooling)"
        if task == "classify" and self.head is None:
            return "this model has no classifier head: it embeds only"
        return None

    def rows_read(self, mirror: Any, entry: ScheduledSequence, first_row: int) -> range | None:
        """The rows of a step (this chunk's from `first_row`) whose final hidden states `add` reads: the prompt's
        last once it is done (LAST), its first (CLS), or every one (MEAN: None)."""
        if self.spec.pooling_type == "MEAN":
            return None
        if self.spec.pooling_type == "LAST":
            last = first_row + entry.num_tokens - 1
            return range(last, last + 1) if prompt_done(mirror, entry) else range(0)
        return range(first_row, first_row + 1) if entry.start == 0 else range(0)

    def outputs(
        self,
        chunks: list[tuple[ScheduledSequence, int, Any]],
        reads: list[range | None],
        hidden_rows: Callable[[range], torch.Tensor],
    ) -> list[PooledOutput | None]:
        """A step's pooled chunks (entry, first row, mirror), each given the hidden rows it reads (`reads`, None for
        all of its own): each request's vector once its prompt is done. A chunk that cannot be pooled fails its
        sequence alone."""
        outputs: list[PooledOutput | None] = []
        for (entry, first, mirror), read in zip(chunks, reads):
            rows = hidden_rows(range(first, first + entry.num_tokens) if read is None else read)
            try:
                values = self.add(mirror, entry.start, rows, prompt_done(mirror, entry))
            except ValueError as exc:
                raise SequenceFault(str(exc), [entry.seq_id]) from exc
            outputs.append(PooledOutput(entry.seq_id, values) if values is not None else None)
        return outputs

    def add(self, mirror: Any, start: int, rows: torch.Tensor, prompt_done: bool) -> list[float] | None:
        """Take a prompt chunk's hidden rows (positions `start`...); the request's vector once `prompt_done`."""
        kind = self.spec.pooling_type
        if kind != "LAST":
            if start == 0:
                mirror.pooled = None
            elif mirror.pooled is None:  # its earlier rows were never seen here
                raise ValueError("a pooled prompt resumed without its first positions")
            if kind == "MEAN":
                total = rows.float().sum(dim=0)
                mirror.pooled = total if mirror.pooled is None else mirror.pooled + total
            elif start == 0:
                mirror.pooled = rows[0].float()
        if not prompt_done:
            return None
        if kind == "LAST":
            vector = rows[-1].float()
        else:
            vector = mirror.pooled / mirror.num_prompt_tokens if kind == "MEAN" else mirror.pooled
        if mirror.sampling.pooling == "classify":
            assert self.head is not None  # refused otherwise
            logits: list[float] = self.head(vector[None].to(rows.dtype))[0].float().tolist()
            return logits
        values: list[float] = (F.normalize(vector, dim=0) if self.spec.normalize else vector).tolist()
        return values
