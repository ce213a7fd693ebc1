"""Every --tool-call-parser reads its model's own format: golden texts give their content and calls, whole and
streamed in pieces of random length (the same either way), and text that is not a call stays content."""

from __future__ import annotations

import json
import random

import pytest

from services.api.tool_parsers import TOOL_CALL_PARSERS
from services.api.tools import ToolCallStream, ToolUse, whole_message

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "metric": {"type": "boolean"},
                "hours": {"type": "array"},
            },
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
USE = ToolUse([WEATHER, TIME], "auto")
OSLO = ("get_weather", {"city": "Oslo", "days": 2})
UTC = ("get_time", {"zone": "UTC"})
CALLS = (
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁sep｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁calls▁end｜>",
)

GOLDEN = {  # parser: [(text, content, calls)]
    "hermes": [
        (
            'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>'
            '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>',
            "Sure.\n",
            [OSLO, UTC],
        ),
    ],
    "llama3_json": [
        (
            '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo", "days": 2}}; '
            '{"name": "get_time", "parameters": {"zone": "UTC"}}',
            "",
            [OSLO, UTC],
        ),
    ],
    "mistral": [
        (
            'Checking.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}, '
            '{"name": "get_time", "arguments": {"zone": "UTC"}}]',
            "Checking.",
            [OSLO, UTC],
        ),
        (
            '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo", "days": 2}[TOOL_CALLS]get_time[ARGS]{"zone": "UTC"}',
            "",
            [OSLO, UTC],
        ),
    ],
    "qwen3_coder": [
        (
            "Let me see.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
            "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n"
            "<parameter=zone>\nUTC\n</parameter>\n</function>\n</tool_call>",
            "Let me see.\n",
            [OSLO, UTC],
        ),
        (
            "<tool_call>\n<function=get_weather>\n<parameter=metric>\ntrue\n</parameter>\n<parameter=hours>\n[1, 2]\n"
            "</parameter>\n</function>\n</tool_call>",
            "",
            [("get_weather", {"metric": True, "hours": [1, 2]})],
        ),
    ],
    "pythonic": [
        ('[get_weather(city="Oslo", days=2), get_time(zone="UTC")]', "", [OSLO, UTC]),
        ("<|python_start|>[get_time(zone='UTC')]<|python_end|>", "", [UTC]),
    ],
    "deepseek_v3": [
        (
            f"Looking it up.{CALLS[0]}{CALLS[1]}function{CALLS[2]}get_weather\n```json\n"
            f'{{"city": "Oslo", "days": 2}}\n```{CALLS[3]}{CALLS[1]}function{CALLS[2]}get_time\n```json\n'
            f'{{"zone": "UTC"}}\n```{CALLS[3]}{CALLS[4]}',
            "Looking it up.",
            [OSLO, UTC],
        ),
    ],
}
NOT_CALLS = [
    "It is sunny in Oslo.",
    "<tool_call>{broken",
    '[TOOL_CALLS][{"name": ',
    "[get_weather(city=)]",
    "[1, 2, 3]",
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo",
]
CASES = [(name, *case) for name, cases in GOLDEN.items() for case in cases]


@pytest.mark.parametrize("name, text, content, calls", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_a_golden_text_gives_its_content_and_calls_whole_and_streamed_in_random_pieces(name, text, content, calls):
    parser = TOOL_CALL_PARSERS[name]()
    whole, parsed = whole_message(USE, parser, text)
    assert (whole or "") == content
    assert [(c.name, json.loads(c.arguments)) for c in parsed] == calls
    generator = random.Random(len(text))
    for _ in range(20):
        stream, at, sent, streamed_calls = ToolCallStream(USE, parser), 0, "", []
        while at < len(text):
            piece = text[at : at + generator.randint(1, 12)]
            at += len(piece)
            more, found = stream.feed(piece, final=at >= len(text))
            sent += more
            streamed_calls += found
        assert sent == content and [(c.name, json.loads(c.arguments)) for c in streamed_calls] == calls


@pytest.mark.parametrize("name", sorted(TOOL_CALL_PARSERS))
@pytest.mark.parametrize("text", NOT_CALLS)
def test_text_that_is_no_whole_call_stays_content_whole_and_streamed(name, text):
    parser = TOOL_CALL_PARSERS[name]()
    assert whole_message(USE, parser, text) == (text, [])
    stream = ToolCallStream(USE, parser)
    sent = "".join(stream.feed(text[i : i + 3], final=i + 3 >= len(text))[0] for i in range(0, len(text), 3))
    assert sent == text


def test_a_forced_answer_cut_short_reads_the_same_streamed_and_not():
    use = ToolUse([WEATHER, TIME], "required")
    cut = '[{"name": "get_weather", "parameters": {"ci'
    assert whole_message(use, None, cut) == (cut, [])
    stream = ToolCallStream(use, None)
    assert stream.feed(cut[:10], final=False) == ("", [])
    assert stream.feed(cut[10:], final=True) == (cut, [])
