"""Structured outputs through the OpenAI API on the shipped model, as a client of OpenAI's SDK
sends them (with n-gram speculation and async scheduling on): schema-valid JSON at temperature
0 and 1, streamed or whole, and a 400 for a constraint that cannot be compiled."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.conftest import metric_total, wait_until

pytestmark = pytest.mark.slow  # starts processes: not in `make check`

FUNCTION = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z_]{1,12}$"},
        "arguments": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "returns": {"enum": ["int", "str", "None"]},
    },
    "required": ["name", "arguments", "returns"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "function", "schema": FUNCTION, "strict": True}}
MESSAGES = [{"role": "user", "content": "Describe a Python function that parses a file."}]


@pytest.fixture(scope="module")
def client(shipped_ngram_server):
    return openai.OpenAI(base_url=f"{shipped_ngram_server.base_url}/v1", api_key="unused")


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_chat_answers_are_valid_json_of_the_schema(client, temperature):
    response = client.chat.completions.create(
        model="tiny-python",
        messages=MESSAGES,
        response_format=RESPONSE_FORMAT,
        temperature=temperature,
        n=3,
        seed=7,
        max_tokens=200,
    )
    for choice in response.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), FUNCTION)


def test_a_streamed_answer_is_valid_json_of_the_schema(client):
    stream = client.chat.completions.create(
        model="tiny-python",
        messages=MESSAGES,
        response_format=RESPONSE_FORMAT,
        temperature=1.0,
        max_tokens=200,
        stream=True,
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    jsonschema.validate(json.loads(text), FUNCTION)


def test_json_object_and_vllms_fields_through_extra_body(client):
    whole = client.chat.completions.create(
        model="tiny-python", messages=MESSAGES, max_tokens=60, temperature=0, response_format={"type": "json_object"}
    )
    answer = whole.choices[0]  # any object: the model may still be inside a string at max_tokens
    assert answer.message.content.startswith("{")
    assert answer.finish_reason == "length" or isinstance(json.loads(answer.message.content), dict)
    choice = client.completions.create(
        model="tiny-python",
        prompt="def parse(",
        max_tokens=10,
        temperature=1.0,
        n=4,
        extra_body={"structured_outputs": {"choice": ["path", "text", "data"]}},
    )
    assert {c.text for c in choice.choices} <= {"path", "text", "data"}
    regex = client.completions.create(
        model="tiny-python", prompt="x = ", max_tokens=12, temperature=1.0, extra_body={"guided_regex": "[0-9]{2,4}"}
    )
    assert regex.choices[0].text.isdigit() and 2 <= len(regex.choices[0].text) <= 4


def test_a_schema_that_cannot_compile_is_a_400_and_nothing_is_queued(shipped_ngram_server, client):
    before = shipped_ngram_server.metrics("scheduler")
    response = httpx.post(
        f"{shipped_ngram_server.base_url}/v1/chat/completions",
        timeout=30,
        json={
            "messages": MESSAGES,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}},
        },
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "response_format.json_schema.schema" and "nope" in error["message"]
    queued = "pagedserve_request_queue_time_seconds_count"  # one per request the scheduler took
    assert metric_total(shipped_ngram_server.metrics("scheduler"), queued) == metric_total(before, queued)
    ok = client.completions.create(model="tiny-python", prompt="def f(", max_tokens=4, temperature=0)
    assert ok.choices[0].text
    assert wait_until(shipped_ngram_server.is_idle, 5)
