"""Tool calls, as OpenAI's chat API has them: `tools`, `tool_choice` and `parallel_tool_calls` in,
`tool_calls` out.

    tool_choice "required"  the output is forced by a grammar to a JSON list of
                            {"name": ..., "parameters": {...}} over the tools' own schemas
    a named function        the output is forced to that function's parameters
    "auto"                  the model decides; its text is parsed by --tool-call-parser
    "none"                  the tools are not shown to the model and nothing is parsed

The parsers of "auto": services/api/tool_parsers.py.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from services.api.errors import ApiError
from services.api.structured import GrammarSpec
from services.api.tool_parsers import TOOL_CALL_PARSERS, ToolCall, ToolCallParser, call_of

__all__ = ["TOOL_CALL_PARSERS", "ToolCall", "ToolCallParser", "ToolCallStream", "ToolUse", "parse_tool_use"]

FUNCTION_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for function names


@dataclass(frozen=True, slots=True)
class ToolUse:
    """What a chat request asks about tools."""

    tools: list[dict[str, Any]]  # as the request gave them, for the chat template
    choice: str  # none | auto | required | named
    name: str = ""  # the function, with choice "named"
    parallel: bool = True

    def schema_of(self, name: str) -> dict[str, Any]:
        function = next(t["function"] for t in self.tools if t["function"]["name"] == name)
        return function.get("parameters") or {"type": "object"}

    def forced(self) -> GrammarSpec | None:
        """The grammar that `required` or a named function puts on the whole output."""
        if self.choice == "named":
            return GrammarSpec("json", json.dumps(self.schema_of(self.name)), "tool_choice")
        if self.choice != "required":
            return None
        calls = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": t["function"]["name"]},
                    "parameters": self.schema_of(t["function"]["name"]),
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for t in self.tools
        ]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not self.parallel:
            schema["maxItems"] = 1
        return GrammarSpec("json", json.dumps(schema), "tools")


def parse_tool_use(body: dict[str, Any]) -> ToolUse | None:
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if tools is None:
        if choice not in (None, "none"):
            raise ApiError("'tool_choice' needs 'tools'", param="tool_choice")
        return None
    if not isinstance(tools, list) or not tools:
        raise ApiError("'tools' must be a non-empty list of functions", param="tools")
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if (
            not isinstance(function, dict)
            or not isinstance(function.get("name"), str)
            or not FUNCTION_NAME.match(function["name"])
        ):
            raise ApiError(
                f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}} with a name of "
                "at most 64 letters, digits, '_' or '-'",
                param=f"tools[{i}]",
            )
        if not isinstance(function.get("parameters", {}), dict):
            raise ApiError(
                f"tools[{i}].function.parameters must be a JSON schema object", param=f"tools[{i}].function.parameters"
            )
    names = [t["function"]["name"] for t in tools]
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise ApiError("'parallel_tool_calls' must be a boolean", param="parallel_tool_calls")
    if choice is None or choice in ("none", "auto", "required"):
        return ToolUse(tools, choice or "auto", parallel=parallel)
    named = (
        choice.get("function", {}).get("name")
        if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict)
        else None
    )
    if named is None:
        raise ApiError(
            "'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}",
            param="tool_choice",
        )
    if named not in names:
        raise ApiError(f"tool_choice names '{named}', which is not among the tools", param="tool_choice")
    return ToolUse(tools, "named", named, parallel)


def calls_from_forced(use: ToolUse, text: str) -> list[ToolCall]:
    """The calls in an output that `required` or a named function's grammar produced."""
    if use.choice == "named":  # its grammar is the function's arguments alone; cut short, they are no call
        call = call_of({"name": use.name, "arguments": text}, ("arguments",))
        return [call] if call is not None else []
    return [c for c in (call_of(item, ("parameters",)) for item in _complete_items(text)) if c is not None]


_SEPARATORS = re.compile(r"[\s,]*")


def _complete_items(text: str) -> list[object]:
    """The items of a JSON array, up to the first one that is not complete: a `required` array cut
    short by max_tokens keeps the calls written before the cut."""
    decoder, items = json.JSONDecoder(), list[object]()
    at = _SEPARATORS.match(text).end()  # type: ignore[union-attr]
    if not text.startswith("[", at):
        return items
    at += 1
    while True:
        at = _SEPARATORS.match(text, at).end()  # type: ignore[union-attr]  # matches the empty string too
        if at >= len(text) or text[at] == "]":
            return items
        try:
            item, at = decoder.raw_decode(text, at)
        except (ValueError, RecursionError):
            return items
        items.append(item)


class ToolCallStream:
    """One choice's text as it streams: content goes out until a call could be starting; calls go
    out whole when the choice ends."""

    def __init__(self, use: ToolUse, parser: ToolCallParser | None):
        self.use, self.parser = use, parser
        self.text = ""
        self.sent = 0

    def feed(self, text: str, final: bool) -> tuple[str, list[ToolCall]]:
        """(content to send now, calls to send now: only when final)."""
        self.text += text
        if not final:
            if self.use.choice in ("required", "named"):
                return "", []
            assert self.parser is not None, "tool_choice auto is refused without a parser"
            safe = min(self.parser.start(self.text), len(self.text))
            content, self.sent = self.text[self.sent : max(safe, self.sent)], max(safe, self.sent)
            return content, []
        whole, calls = whole_message(self.use, self.parser, self.text)
        return (whole or "")[self.sent :], calls


def whole_message(use: ToolUse, parser: ToolCallParser | None, text: str) -> tuple[str | None, list[ToolCall]]:
    """A finished choice's (content, calls). A forced output with no whole call (cut by max_tokens) is content,
    streamed or not."""
    if use.choice in ("required", "named"):
        calls = calls_from_forced(use, text)
        return (None if calls else text or None), calls
    assert parser is not None, "tool_choice auto is refused without a parser"
    content, calls = parser.parse(text, use)
    return (content or None) if calls else text, calls
