"""OpenAI's Responses API, through a real server and OpenAI's own client: a response is what the chat API answers
for the same conversation, its events come in order, a function call goes round trip with previous_response_id,
a JSON-schema output validates, stored responses are their tenant's alone, and what is not served is a 400."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.conftest import serve

pytestmark = pytest.mark.slow  # starts processes: not in `make check`

WEATHER = {
    "type": "function",
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
}
SYSTEM = "You write Python."


@pytest.fixture(scope="module")
def client(shipped_ngram_server):
    return openai.OpenAI(base_url=f"{shipped_ngram_server.base_url}/v1", api_key="unused")


def test_a_response_is_what_the_chat_api_answers_and_is_stored_until_deleted(client):
    response = client.responses.create(
        model="tiny-python", instructions=SYSTEM, input="Write a loop.", max_output_tokens=16, temperature=0
    )
    chat = client.chat.completions.create(
        model="tiny-python",
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Write a loop."}],
        max_tokens=16,
        temperature=0,
    )
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.output_text == chat.choices[0].message.content
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 16 and response.usage.input_tokens == chat.usage.prompt_tokens
    assert client.responses.retrieve(response.id).output_text == response.output_text
    client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)


def test_a_stream_sends_the_typed_events_in_order(client):
    events = list(
        client.responses.create(
            model="tiny-python", input="Write a loop.", max_output_tokens=12, temperature=0, stream=True
        )
    )
    kinds = [event.type for event in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert text == events[-1].response.output_text and text


def test_a_function_call_goes_round_trip_with_previous_response_id_and_the_continuation_finds_its_prefix(client):
    called = client.responses.create(
        model="tiny-python",
        input="What is the weather in Paris?",
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=200,
        temperature=0,
    )
    [call] = [item for item in called.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    answer = client.responses.create(
        model="tiny-python",
        previous_response_id=called.id,
        tools=[WEATHER],
        tool_choice="none",
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}],
        max_output_tokens=8,
        temperature=0,
    )
    assert answer.previous_response_id == called.id and answer.output[0].type == "message"
    assert answer.usage.input_tokens > called.usage.input_tokens  # the whole conversation, from the store
    streamed = client.responses.create(
        model="tiny-python",
        input="What is the weather in Oslo?",
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=200,
        temperature=0,
        stream=True,
    )
    events = list(streamed)
    assert any(e.type == "response.function_call_arguments.delta" for e in events)
    [done] = [e.item for e in events if e.type == "response.output_item.done"]
    jsonschema.validate(json.loads(done.arguments), WEATHER["parameters"])


def test_a_json_schema_output_validates(client):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}},
        "required": ["name"],
        "additionalProperties": False,
    }
    response = client.responses.create(
        model="tiny-python",
        input="Name a function.",
        max_output_tokens=60,
        temperature=0,
        text={"format": {"type": "json_schema", "name": "function", "schema": schema}},
    )
    jsonschema.validate(json.loads(response.output_text), schema)


def test_what_is_not_served_is_a_400_that_names_it(client):
    with pytest.raises(openai.BadRequestError, match="built-in tools"):
        client.responses.create(model="tiny-python", input="hi", tools=[{"type": "web_search_preview"}])
    with pytest.raises(openai.BadRequestError, match="background"):
        client.responses.create(model="tiny-python", input="hi", background=True)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="tiny-python", input="hi", previous_response_id="resp_nobody")


def test_a_tenant_reads_and_continues_only_its_own_responses(tmp_path):
    with serve(None, str(tmp_path), "--api-key", "key-a,key-b") as server:
        a = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="key-a")
        b = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="key-b")
        mine = a.responses.create(model=server.model, input="Write a loop.", max_output_tokens=4)
        assert a.responses.retrieve(mine.id).id == mine.id
        with pytest.raises(openai.NotFoundError):
            b.responses.retrieve(mine.id)
        with pytest.raises(openai.NotFoundError):
            b.responses.create(model=server.model, input="and?", previous_response_id=mine.id, max_output_tokens=4)
        with pytest.raises(openai.NotFoundError):
            b.responses.delete(mine.id)
        assert (
            a.responses.create(
                model=server.model, input="and?", previous_response_id=mine.id, max_output_tokens=4
            ).previous_response_id
            == mine.id
        )
