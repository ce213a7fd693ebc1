"""Structured outputs: what a request asks its output to match, read from any of the fields
OpenAI and vLLM use for it, and compiled into llguidance grammar text for the worker.

    response_format     {"type": "text" | "json_object" | "json_schema", "json_schema": {"schema": ...}}
    structured_outputs  {"json" | "regex" | "choice" | "grammar" | "json_object": ...}   (vLLM)
    guided_json, guided_regex, guided_choice, guided_grammar                            (vLLM, older)

Compiling checks the grammar against the model's tokenizer, off the event loop, so an invalid
schema or regex is a 400 that names the problem before anything is queued. Grammars past the
bounds llguidance survives are refused first (shared/grammar_guard.py), and compilation runs on
a thread with a deep stack. Compiled grammars are kept by content, up to `GRAMMAR_BYTES`.
"""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, cast

from services.api.errors import ApiError
from shared.grammar_guard import CompileThreads, unbounded_reason

GRAMMAR_BYTES = 64 << 20  # schemas and compiled grammars kept for reuse, counted by their text
# Outputs as json.dumps writes them: one space after ',' and ':', none elsewhere. Free
# whitespace would let a model pad forever inside an object.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    kind: str  # json | regex | choice | grammar
    text: str  # the schema as JSON text, the regex, the choices as a JSON list, or the grammar
    param: str  # the request field it came from, for errors


def parse_structured(body: dict[str, Any]) -> GrammarSpec | None:
    """The one constraint a request body asks for, or None."""
    found = [
        spec
        for spec in (
            _response_format(body.get("response_format")),
            _structured_outputs(body.get("structured_outputs")),
            *(_guided(name, body.get(name)) for name in GUIDED_FIELDS),
        )
        if spec
    ]
    if len(found) > 1:
        raise ApiError(
            f"'{found[0].param}' and '{found[1].param}' both constrain the output; set one", param=found[1].param
        )
    return found[0] if found else None


def _response_format(value: object) -> GrammarSpec | None:
    if value is None:
        return None
    fields: dict[str, object] = value if isinstance(value, dict) else {}
    kind = fields.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json", '{"type": "object"}', "response_format")
    if kind == "json_schema":
        described = fields.get("json_schema")
        if not isinstance(described, dict):
            raise ApiError(
                "response_format.json_schema must be an object with a 'schema'", param="response_format.json_schema"
            )
        schema = described.get("schema", {})
        if not isinstance(schema, (dict, bool)):
            raise ApiError(
                "response_format.json_schema.schema must be a JSON schema object",
                param="response_format.json_schema.schema",
            )
        return GrammarSpec("json", json.dumps(schema), "response_format.json_schema.schema")
    raise ApiError("response_format.type must be 'text', 'json_object' or 'json_schema'", param="response_format.type")


def _structured_outputs(value: object) -> GrammarSpec | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ApiError("'structured_outputs' must be an object", param="structured_outputs")
    asked = [key for key in ("json", "regex", "choice", "grammar") if value.get(key) is not None]
    if value.get("json_object"):
        asked.append("json_object")
    if len(asked) > 1:
        raise ApiError(f"structured_outputs sets {' and '.join(asked)}; set one", param="structured_outputs")
    if not asked:
        return None
    if asked[0] == "json_object":
        return GrammarSpec("json", '{"type": "object"}', "structured_outputs.json_object")
    return _guided(f"structured_outputs.{asked[0]}", value[asked[0]], asked[0])


def _guided(param: str, value: object, kind: str = "") -> GrammarSpec | None:
    if value is None:
        return None
    kind = kind or GUIDED_FIELDS[param]
    if kind == "json":
        if isinstance(value, str):
            return GrammarSpec("json", value, param)
        if isinstance(value, (dict, bool)):
            return GrammarSpec("json", json.dumps(value), param)
        raise ApiError(f"'{param}' must be a JSON schema (an object, or its JSON text)", param=param)
    if kind == "choice":
        if not (isinstance(value, list) and value and all(isinstance(c, str) and c for c in value)):
            raise ApiError(f"'{param}' must be a non-empty list of non-empty strings", param=param)
        return GrammarSpec("choice", json.dumps(value), param)
    if not isinstance(value, str) or not value:
        raise ApiError(f"'{param}' must be a non-empty string", param=param)
    return GrammarSpec(kind, value, param)


class GrammarCompiler:
    """Compiles on the api's behalf, off the event loop, keeping compiled grammars by content;
    its llguidance tokenizer is built on first use."""

    def __init__(self, tokenizer: Any, vocab_size: int):
        self.hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._tokenizer: Any = None  # llguidance's view of the tokenizer, made at the first grammar
        self._compiled: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._compiled_bytes = 0
        self._lock = asyncio.Lock()  # one tokenizer build, however many requests wait for it
        self._threads = CompileThreads(1, "api-grammar")  # one at a time: a 2-core machine has no more to give

    async def compile(self, spec: GrammarSpec) -> str:
        key = (spec.kind, spec.text)
        grammar = self._compiled.get(key)
        if grammar is not None:
            self._compiled.move_to_end(key)
            return grammar
        if self._tokenizer is None:
            async with self._lock:
                if self._tokenizer is None:
                    self._tokenizer = await asyncio.to_thread(grammar_tokenizer, self.hf_tokenizer, self.vocab_size)
        tokenizer = self._tokenizer
        grammar = await asyncio.wrap_future(self._threads.submit(lambda: compile_grammar(spec, tokenizer)))
        if key not in self._compiled:
            self._compiled[key] = grammar
            self._compiled_bytes += len(spec.text) + len(grammar)
        while self._compiled_bytes > GRAMMAR_BYTES and self._compiled:
            (_, text), evicted = self._compiled.popitem(last=False)
            self._compiled_bytes -= len(text) + len(evicted)
        return grammar


def grammar_tokenizer(hf_tokenizer: Any, vocab_size: int) -> Any:
    """The llguidance view of a fast HF tokenizer, over the model's whole vocabulary."""
    import llguidance.hf

    return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size)


def compile_grammar(spec: GrammarSpec, tokenizer: Any) -> str:
    """llguidance grammar text for `spec`, checked against `tokenizer`; `ApiError` if it is invalid."""
    import llguidance

    problem = unbounded_reason(spec.text)
    if problem:
        raise ApiError(f"'{spec.param}' is too large to compile: {problem}", param=spec.param, code="grammar_too_large")
    try:
        if spec.kind == "json":
            grammar = llguidance.LLMatcher.grammar_from_json_schema(spec.text, defaults=cast(Any, JSON_LAYOUT))
        else:
            grammar = llguidance.grammar_from(cast(Any, spec.kind), spec.text)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
        problem = messages[0] if is_error else ""
    except Exception as exc:  # llguidance raises ValueError for text it cannot read at all
        problem = str(exc)
    if problem:
        raise ApiError(
            f"'{spec.param}' is not a valid {_NAMES[spec.kind]}: {problem.strip()}",
            param=spec.param,
            code="invalid_grammar",
        )
    return grammar


_NAMES = {
    "json": "JSON schema",
    "regex": "regular expression",
    "choice": "list of choices",
    "grammar": "grammar (Lark or GBNF)",
}
