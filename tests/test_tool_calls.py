"""Tool calls: what `tools` and `tool_choice` ask, the grammar that forces a call, the parsers of
the models' own call formats, whole and streamed, and the OpenAI chat API around them."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from services.api.errors import ApiError
from services.api.tool_parsers import HermesParser, Llama3JsonParser
from services.api.tools import (
    ToolCallStream,
    ToolUse,
    calls_from_forced,
    parse_tool_use,
    whole_message,
)

pytestmark = pytest.mark.slow  # starts processes: not in `make check`

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Oslo", "Lima"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


# --- what a request asks ----------------------------------------------------------------------


def test_tools_default_to_auto_and_a_named_choice_must_be_one_of_them():
    assert parse_tool_use({"tools": [WEATHER]}).choice == "auto"
    assert parse_tool_use({"tools": [WEATHER], "tool_choice": "required"}).choice == "required"
    named = parse_tool_use(
        {"tools": [WEATHER, TIME], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}
    )
    assert (named.choice, named.name) == ("named", "get_time")
    assert parse_tool_use({}) is None and parse_tool_use({"tool_choice": "none"}) is None


@pytest.mark.parametrize(
    "body, param",
    [
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"tools": []}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0]"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
        ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ],
)
def test_malformed_tools_get_a_400_naming_the_field(body, param):
    with pytest.raises(ApiError) as caught:
        parse_tool_use(body)
    assert caught.value.param == param and caught.value.status == 400


def test_required_forces_a_list_of_calls_to_the_tools_one_when_not_parallel():
    schema = json.loads(ToolUse([WEATHER, TIME], "required", parallel=False).forced().text)
    jsonschema.validate([{"name": "get_time", "parameters": {"zone": "UTC"}}], schema)
    for wrong in (
        [],
        [{"name": "get_time", "parameters": {"zone": "PST"}}],
        [{"name": "get_time", "parameters": {"zone": "UTC"}}] * 2,
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, schema)
    named = ToolUse([WEATHER, TIME], "named", "get_weather").forced()
    assert json.loads(named.text) == WEATHER["function"]["parameters"]


# --- parsing the model's text -----------------------------------------------------------------


def test_hermes_calls_are_parsed_with_the_content_before_them():
    text = (
        'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n'
        '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>'
    )
    content, calls = HermesParser().parse(text)
    assert content == "Let me look.\n"
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo", "days": 2}),
        ("get_time", {"zone": "CET"}),
    ]
    assert HermesParser().parse("no calls here") == ("no calls here", [])
    assert HermesParser().parse("<tool_call>{broken") == ("<tool_call>{broken", [])


def test_llama3_json_calls_are_parsed_and_plain_text_is_left_alone():
    text = '<|python_tag|>{"name": "get_time", "parameters": {"zone": "UTC"}}; {"name": "get_time", "parameters": {}}'
    content, calls = Llama3JsonParser().parse(text)
    assert content == "" and [c.name for c in calls] == ["get_time", "get_time"]
    assert json.loads(calls[0].arguments) == {"zone": "UTC"}
    assert Llama3JsonParser().parse("It is sunny.") == ("It is sunny.", [])


def test_a_stream_sends_content_until_a_call_may_begin_and_the_calls_at_the_end():
    use = ToolUse([WEATHER], "auto")
    stream = ToolCallStream(use, HermesParser())
    pieces = [
        "Sure",
        ", one moment.<tool",
        '_call>{"name": "get_weather", ',
        '"arguments": {"city": "Lima"}}',
        "</tool_call>",
    ]
    sent = [stream.feed(piece, final=False) for piece in pieces[:-1]]
    assert "".join(content for content, _ in sent) == "Sure, one moment."
    assert all(calls == [] for _, calls in sent)
    content, calls = stream.feed(pieces[-1], final=True)
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Lima"})]
    plain = ToolCallStream(use, HermesParser())
    assert plain.feed("a <tool", final=False) == ("a ", [])
    assert plain.feed("box", final=True) == ("<toolbox", [])  # not a call after all: sent at the end


def test_forced_outputs_become_calls_and_a_cut_array_keeps_the_calls_written_before_the_cut():
    use = ToolUse([WEATHER, TIME], "required")
    calls = calls_from_forced(use, '[{"name": "get_time", "parameters": {"zone": "UTC"}}]')
    assert [(c.name, c.arguments) for c in calls] == [("get_time", '{"zone": "UTC"}')]
    assert calls_from_forced(use, '[{"name": "get_ti') == []
    cut = '[{"name": "get_time", "parameters": {"zone": "UTC"}}, {"name": "get_weather", "parameters": {"ci'
    assert [(c.name, c.arguments) for c in calls_from_forced(use, cut)] == [("get_time", '{"zone": "UTC"}')]
    assert calls_from_forced(use, "[" + "[" * 5000) == []  # too deep to be a call: none, and no error
    assert (
        whole_message(ToolUse([WEATHER], "named", "get_weather"), None, '{"city": "Oslo", "days": 1}')[1][0].name
        == "get_weather"
    )


# --- through the api, on the shipped model -------------------------------------------------------


@pytest.fixture(scope="module")
def client(shipped_ngram_server):
    return openai.OpenAI(base_url=f"{shipped_ngram_server.base_url}/v1", api_key="unused")


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_required_answers_with_a_call_whose_arguments_match_its_function(client, temperature):
    response = client.chat.completions.create(
        model="tiny-python",
        messages=MESSAGES,
        tools=[WEATHER, TIME],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=temperature,
        max_tokens=200,
    )
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    assert len(choice.message.tool_calls) == 1
    for call in choice.message.tool_calls:
        assert call.id.startswith("call_") and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_a_named_function_is_called_and_streams_as_openai_deltas(client):
    stream = client.chat.completions.create(
        model="tiny-python",
        messages=MESSAGES,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=1.0,
        max_tokens=200,
        stream=True,
    )
    calls, finish = {}, None
    for chunk in stream:
        for delta in chunk.choices[0].delta.tool_calls or []:
            entry = calls.setdefault(delta.index, {"name": "", "arguments": ""})
            entry["name"] += delta.function.name or ""
            entry["arguments"] += delta.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "stop"  # OpenAI's for a named function
    assert [c["name"] for c in calls.values()] == ["get_weather"]
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER["function"]["parameters"])


def test_auto_parses_the_models_own_call_format_and_a_conversation_with_results_goes_on(client):
    forced = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
    response = client.chat.completions.create(
        model="tiny-python",
        messages=MESSAGES,
        tools=[WEATHER],
        tool_choice="auto",
        max_tokens=60,
        temperature=0,
        extra_body={"guided_regex": forced.replace("{", "\\{").replace("}", "\\}")},
    )  # the model "decides" to call
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris", "days": 3}
    follow_up = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"celsius": 18}'},
    ]
    answer = client.chat.completions.create(
        model="tiny-python", messages=follow_up, tools=[WEATHER], max_tokens=8, temperature=0
    )
    assert answer.choices[0].message.content


def test_auto_without_a_call_is_plain_content(client):
    response = client.chat.completions.create(
        model="tiny-python", messages=MESSAGES, tools=[WEATHER], max_tokens=12, temperature=0, stream=True
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in response if chunk.choices)
    plain = client.chat.completions.create(
        model="tiny-python", messages=MESSAGES, tools=[WEATHER], max_tokens=12, temperature=0
    )
    assert text == plain.choices[0].message.content and plain.choices[0].finish_reason == "length"


def test_auto_on_a_server_without_a_parser_is_a_400_that_names_the_flags(llama_server):
    response = httpx.post(
        f"{llama_server.base_url}/v1/chat/completions",
        timeout=30,
        json={"messages": MESSAGES, "tools": [WEATHER], "max_tokens": 4},
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "tool_choice" and "--enable-auto-tool-choice" in error["message"]


def test_none_leaves_the_tools_out_and_parses_nothing(client):
    forced = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 1}}\n</tool_call>'
    response = client.chat.completions.create(
        model="tiny-python",
        messages=MESSAGES,
        tools=[WEATHER],
        tool_choice="none",
        max_tokens=60,
        temperature=0,
        extra_body={"guided_regex": forced.replace("{", "\\{").replace("}", "\\}")},
    )
    choice = response.choices[0]
    assert choice.message.tool_calls is None and choice.message.content == forced and choice.finish_reason == "stop"
