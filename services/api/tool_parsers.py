"""The parsers of models' own tool-call formats (`--tool-call-parser`, for tool_choice "auto"), each with the
same two questions: where in a text a call begins, or could begin as more text comes (`start`: content before
it streams out at once), and the content and calls of a finished text (`parse`; the text itself, and no call,
where the calls do not parse). A call's arguments come out as JSON text, as OpenAI sends them.

    hermes        Hermes, Qwen 2.5 and 3        <tool_call>{"name": ..., "arguments": {...}}</tool_call>
    llama3_json   Llama 3.1 and later            {"name": ..., "parameters": {...}}; ...  (after <|python_tag|>)
    mistral       Mistral                        [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...], or from its
                                                 v11 tokenizer on [TOOL_CALLS]name[ARGS]{...}, once per call
    qwen3_coder   Qwen3-Coder                    <tool_call><function=name><parameter=key>value</parameter>...
                                                 </function></tool_call>, each value read by the tool's schema
    pythonic      Llama 3.2 and 4, others        [get_weather(city="Paris", days=3), ...]  (Python literals)
    deepseek_v3   DeepSeek V3 and R1             <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>name
                                                 ```json {...} ```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from services.api.json_body import json_value

if TYPE_CHECKING:
    from services.api.tools import ToolUse


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = ""

    def as_openai(self, index: int | None = None) -> dict[str, Any]:
        call = {
            "id": self.id or f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return call if index is None else {"index": index, **call}


Parsed = tuple[str, list[ToolCall]]


class HermesParser:
    """Each call between <tool_call> and </tool_call>; Hermes's body is JSON, and subclasses read others."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def start(self, text: str) -> int:
        return marker_start(text, self.OPEN)

    def parse(self, text: str, use: ToolUse | None = None) -> Parsed:
        begin = text.find(self.OPEN)
        if begin < 0:
            return text, []
        calls = []
        for part in text[begin:].split(self.OPEN)[1:]:
            call = self.read_call(part.split(self.CLOSE)[0], use)
            if call is None:
                return text, []
            calls.append(call)
        return text[:begin], calls

    def read_call(self, body: str, use: ToolUse | None) -> ToolCall | None:
        return call_of(body.strip(), ("arguments", "parameters"))


class Llama3JsonParser:
    TAG = "<|python_tag|>"

    def start(self, text: str) -> int:
        stripped = text.lstrip()
        if not stripped or stripped.startswith(("{", self.TAG)) or self.TAG.startswith(stripped):
            return 0  # the whole output is the calls
        return len(text)

    def parse(self, text: str, use: ToolUse | None = None) -> Parsed:
        body = text.strip().removeprefix(self.TAG).strip()
        if not body.startswith("{"):
            return text, []
        values = json_values(body, " \t\n;")
        calls = [call_of(value, ("parameters", "arguments")) for value in values or []]
        if not values or None in calls:
            return text, []
        return "", [call for call in calls if call is not None]


class MistralParser:
    TAG, ARGS = "[TOOL_CALLS]", "[ARGS]"

    def start(self, text: str) -> int:
        return marker_start(text, self.TAG)

    def parse(self, text: str, use: ToolUse | None = None) -> Parsed:
        begin = text.find(self.TAG)
        if begin < 0:
            return text, []
        rest = text[begin + len(self.TAG) :].strip()
        calls: list[ToolCall | None]
        if rest.startswith("["):  # one JSON list of calls
            values = json_values(rest, " \t\n")
            items = values[0] if values and len(values) == 1 and isinstance(values[0], list) else None
            calls = [call_of(item, ("arguments", "parameters")) for item in items] if items else [None]
        else:  # name[ARGS]{...}, each after its own tag
            calls = []
            for part in text[begin:].split(self.TAG)[1:]:
                name, sep, arguments = part.strip().partition(self.ARGS)
                if not sep:
                    name, arguments = _split_name(part.strip())
                calls.append(call_of({"name": name.strip(), "arguments": arguments.strip()}, ("arguments",)))
        if not calls or None in calls:
            return text, []
        return text[:begin], [call for call in calls if call is not None]


class Qwen3CoderParser(HermesParser):
    """Hermes's tags around XML-like calls, each parameter typed by the tool's schema."""

    FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.S)
    PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)

    def read_call(self, body: str, use: ToolUse | None) -> ToolCall | None:
        function = self.FUNCTION.search(body)
        if function is None:
            return None
        name = function[1].strip()
        schema = _properties(use, name)
        arguments = {
            key.strip(): _typed(value, schema.get(key.strip())) for key, value in self.PARAMETER.findall(function[2])
        }
        return ToolCall(name, json.dumps(arguments))


class PythonicParser:
    START, END = "<|python_start|>", "<|python_end|>"

    def start(self, text: str) -> int:
        stripped = text.lstrip()
        if not stripped or stripped.startswith(("[", self.START)) or self.START.startswith(stripped):
            return 0  # the whole output is the calls
        return len(text)

    def parse(self, text: str, use: ToolUse | None = None) -> Parsed:
        body = text.strip().removeprefix(self.START).removesuffix(self.END).strip()
        if not body.startswith("["):
            return text, []
        try:
            tree = ast.parse(body, mode="eval").body
        except (SyntaxError, ValueError, RecursionError):
            return text, []
        if not isinstance(tree, ast.List) or not tree.elts:
            return text, []
        calls = []
        for node in tree.elts:
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
                return text, []
            try:
                arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
                calls.append(ToolCall(node.func.id, json.dumps(arguments)))
            except (ValueError, TypeError, SyntaxError, RecursionError):
                return text, []
        return "", calls


class DeepSeekV3Parser:
    BEGIN, END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    CALL = re.compile(
        r"<｜tool▁call▁begin｜>(\w+)<｜tool▁sep｜>([^\n]+)\n```(?:json)?\n(.*?)\n```<｜tool▁call▁end｜>", re.S
    )

    def start(self, text: str) -> int:
        return marker_start(text, self.BEGIN)

    def parse(self, text: str, use: ToolUse | None = None) -> Parsed:
        begin = text.find(self.BEGIN)
        if begin < 0:
            return text, []
        body = text[begin + len(self.BEGIN) :].split(self.END)[0]
        found = self.CALL.findall(body)
        calls = [
            call_of({"name": name.strip(), "arguments": arguments}, ("arguments",))
            for kind, name, arguments in found
            if kind == "function"
        ]
        if not calls or len(calls) != len(found) or None in calls:
            return text, []
        return text[:begin], [call for call in calls if call is not None]


ToolCallParser = HermesParser | Llama3JsonParser | MistralParser | Qwen3CoderParser | PythonicParser | DeepSeekV3Parser
TOOL_CALL_PARSERS: dict[str, type[ToolCallParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
    "qwen3_coder": Qwen3CoderParser,
    "pythonic": PythonicParser,
    "deepseek_v3": DeepSeekV3Parser,
}


def call_of(value: object, argument_keys: tuple[str, ...]) -> ToolCall | None:
    """A call from {"name": ..., one of argument_keys: {...} or its JSON text}, or None for anything else."""
    if isinstance(value, str):
        try:
            value = json_value(value)
        except ValueError:
            return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments: object = next((value[k] for k in argument_keys if k in value), {})
    if isinstance(arguments, str):
        try:
            arguments = json_value(arguments) if arguments.strip() else {}
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], json.dumps(arguments))


def json_values(text: str, separators: str) -> list[Any] | None:
    """Every JSON value of `text`, one after another with `separators` between them; None where one is not whole."""
    decoder, values, at = json.JSONDecoder(), [], 0
    while at < len(text):
        try:
            value, at = decoder.raw_decode(text, at)
        except (ValueError, RecursionError):
            return None
        values.append(value)
        while at < len(text) and text[at] in separators:
            at += 1
    return values


def marker_start(text: str, marker: str) -> int:
    """Where `marker` begins in `text`, or where its start may be cut off at the end; len(text) if neither."""
    found = text.find(marker)
    if found >= 0:
        return found
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-length:]):
            return len(text) - length
    return len(text)


def _split_name(part: str) -> tuple[str, str]:
    """`name{...}`: the name, and the arguments' JSON from the first brace on."""
    brace = part.find("{")
    return (part, "") if brace < 0 else (part[:brace], part[brace:])


def _properties(use: ToolUse | None, name: str) -> dict[str, Any]:
    if use is None or all(t["function"]["name"] != name for t in use.tools):
        return {}
    properties = use.schema_of(name).get("properties")
    return properties if isinstance(properties, dict) else {}


def _typed(value: str, schema: object) -> object:
    """A parameter's text as its schema's type says; a string where the schema says so or does not say."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if kind in (None, "string") or value.strip() == "":
        return value
    try:
        if kind == "integer":
            return int(value.strip())
        if kind == "number":
            return float(value.strip())
        if kind == "boolean":
            return {"true": True, "false": False}.get(value.strip().lower(), value)
        return json.loads(value)  # object, array, null, or a list of types
    except ValueError:
        return value
