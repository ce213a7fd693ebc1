"""Reasoning models' thinking, split from their answer. `--reasoning-parser` names the model's format; a chat
response then carries the thinking in `reasoning` (vLLM's field) and the answer in `content`, streamed or not.

    deepseek_r1   the chat template opens <think> in the prompt: the output starts in the thinking (a leading
                  <think> is dropped) and the answer follows </think>; without </think> all is thinking
    qwen3         the output thinks only when it starts with <think>; otherwise all is answer

A structured output or a forced tool call applies to the answer: `after_thinking` puts the thinking before the
request's grammar, free text up to </think>.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from services.api.tool_parsers import marker_start

THINK_START, THINK_END = "<think>", "</think>"


@dataclass(frozen=True, slots=True)
class ReasoningFormat:
    name: str
    starts_thinking: bool  # the prompt opened the thinking: the output begins inside it

    def split(self, text: str) -> tuple[str, str]:
        """(reasoning, content) of a whole output."""
        return ReasoningStream(self).feed(text, final=True)

    def after_thinking(self, grammar: str, tags: ThinkTags) -> str:
        """`grammar` (llguidance grammar text, as the api compiles it) preceded by the model's thinking."""
        top = json.loads(grammar) if grammar.lstrip().startswith("{") else {"grammars": [{"lark_grammar": grammar}]}
        answer = dict(top["grammars"][0])
        name = answer.setdefault("name", "answer")
        if tags.end is not None:
            thinking = f"thinking: /(?s:.*)/ <[{tags.end}]>\n"
        else:
            thinking = f'thinking[suffix="{THINK_END}"]: /(?s:.*)/\n'
        opening = f"<[{tags.start}]>" if tags.start is not None else json.dumps(THINK_START)
        if self.starts_thinking:
            head = f"start: {opening}? thinking @{name}\n{thinking}"
        else:
            head = f"start: opened? @{name}\nopened: {opening} thinking\n{thinking}"
        return json.dumps({**top, "grammars": [{"lark_grammar": head}, answer, *top["grammars"][1:]]})


@dataclass(frozen=True, slots=True)
class ThinkTags:
    """The ids of <think> and </think> where the tokenizer adds them as tokens of their own (reasoning models'
    do): a grammar names such a token by its id, as llguidance never reads it as its text; None where the tag is
    plain text."""

    start: int | None = None
    end: int | None = None

    @classmethod
    def of(cls, tokenizer: Any) -> ThinkTags:
        added = tokenizer.get_added_vocab()
        return cls(added.get(THINK_START), added.get(THINK_END))


REASONING_PARSERS = {
    "deepseek_r1": ReasoningFormat("deepseek_r1", starts_thinking=True),
    "qwen3": ReasoningFormat("qwen3", starts_thinking=False),
}


class ReasoningStream:
    """Splits one choice's text as it comes; a piece that may begin a tag is held until the next one tells."""

    def __init__(self, format: ReasoningFormat):
        self.format = format
        self.state = "start"  # start | thinking | answer
        self.held = ""

    def feed(self, text: str, final: bool) -> tuple[str, str]:
        text, self.held = self.held + text, ""
        if self.state == "start":
            if THINK_START.startswith(text) and text != THINK_START and not final:
                self.held = text  # "<thi": a tag, or not
                return "", ""
            opened = text.startswith(THINK_START)
            text = text.removeprefix(THINK_START)
            self.state = "thinking" if opened or self.format.starts_thinking else "answer"
        if self.state == "answer":
            return "", text
        end = text.find(THINK_END)
        if end >= 0:
            self.state = "answer"
            return text[:end], text[end + len(THINK_END) :]
        if not final:
            self.held = text[marker_start(text, THINK_END) :]  # "...</thi": held until the next piece tells
        return text[: len(text) - len(self.held)], ""
