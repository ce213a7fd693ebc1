"""Anthropic's Messages API, through a real server and Anthropic's own client: a message is what the chat API
answers for the same conversation, its stream is the typed events in order, tools go round trip as tool_use and
tool_result blocks, and errors come in Anthropic's shape."""

from __future__ import annotations

import anthropic
import httpx
import jsonschema
import openai
import pytest

from tests.conftest import serve

pytestmark = pytest.mark.slow  # starts processes: not in `make check`

WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
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
ASK = [{"role": "user", "content": "Write a loop over a list."}]
GREEDY = {"temperature": 0}  # Anthropic's newest client leaves temperature out of create(): sent as is


@pytest.fixture(scope="module")
def clients(shipped_ngram_server):
    base = shipped_ngram_server.base_url
    return anthropic.Anthropic(base_url=base, api_key="unused"), openai.OpenAI(base_url=f"{base}/v1", api_key="unused")


def test_a_message_is_what_the_chat_api_answers_for_the_same_conversation(clients):
    messages_client, chat_client = clients
    message = messages_client.messages.create(
        model="tiny-python", system=SYSTEM, messages=ASK, max_tokens=16, extra_body=GREEDY
    )
    chat = chat_client.chat.completions.create(
        model="tiny-python", messages=[{"role": "system", "content": SYSTEM}, *ASK], max_tokens=16, extra_body=GREEDY
    )
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == chat.choices[0].message.content
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 16
    assert message.usage.input_tokens == chat.usage.prompt_tokens


def test_a_stream_sends_the_typed_events_in_order_and_the_same_text(clients):
    messages_client, _ = clients
    whole = messages_client.messages.create(model="tiny-python", messages=ASK, max_tokens=12, extra_body=GREEDY)
    kinds, text = [], ""
    with messages_client.messages.stream(model="tiny-python", messages=ASK, max_tokens=12, extra_body=GREEDY) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "content_block_delta":
                text += event.delta.text
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[1] == "content_block_start"
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert text == whole.content[0].text == final.content[0].text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 12


def test_a_tool_is_called_with_input_its_schema_takes_and_the_result_goes_back_into_the_conversation(clients):
    messages_client, _ = clients
    ask = [{"role": "user", "content": "What is the weather in Paris for two days?"}]
    called = messages_client.messages.create(
        model="tiny-python",
        messages=ask,
        tools=[WEATHER],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        max_tokens=200,
        extra_body=GREEDY,
    )
    [use] = [block for block in called.content if block.type == "tool_use"]
    assert called.stop_reason == "tool_use" and use.name == "get_weather" and use.id
    jsonschema.validate(use.input, WEATHER["input_schema"])
    answer = messages_client.messages.create(
        model="tiny-python",
        messages=[
            *ask,
            {"role": "assistant", "content": called.content},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 21 C"}]},
        ],
        tools=[WEATHER],
        tool_choice={"type": "none"},
        max_tokens=8,
        extra_body=GREEDY,
    )
    assert answer.content[0].type == "text" and answer.stop_reason in ("max_tokens", "end_turn")
    with messages_client.messages.stream(
        model="tiny-python",
        messages=ask,
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
        max_tokens=200,
        extra_body=GREEDY,
    ) as stream:
        final = stream.get_final_message()
    [streamed] = [block for block in final.content if block.type == "tool_use"]
    jsonschema.validate(streamed.input, WEATHER["input_schema"])


def test_bad_requests_get_anthropics_error_shape(clients, shipped_ngram_server):
    messages_client, _ = clients
    with pytest.raises(anthropic.BadRequestError) as missing:
        messages_client.messages.create(model="tiny-python", messages=ASK, max_tokens=0)
    assert missing.value.body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in missing.value.body["error"]["message"]
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    with pytest.raises(anthropic.BadRequestError, match="image blocks are not served"):
        messages_client.messages.create(
            model="tiny-python", messages=[{"role": "user", "content": [image]}], max_tokens=4
        )
    with pytest.raises(anthropic.NotFoundError):
        messages_client.messages.create(model="no-such-model", messages=ASK, max_tokens=4)
    raw = httpx.post(f"{shipped_ngram_server.base_url}/v1/messages", content=b"{", timeout=10)
    assert raw.status_code == 400 and raw.json()["type"] == "error"


def test_the_anthropic_client_sends_its_key_as_x_api_key_and_a_wrong_one_gets_its_401(tmp_path):
    with serve(None, str(tmp_path), "--api-key", "right-key") as server:
        right = anthropic.Anthropic(base_url=server.base_url, api_key="right-key")
        assert right.messages.create(model=server.model, messages=ASK, max_tokens=2).usage.output_tokens == 2
        with pytest.raises(anthropic.AuthenticationError) as refused:
            anthropic.Anthropic(base_url=server.base_url, api_key="wrong").messages.create(
                model=server.model, messages=ASK, max_tokens=2
            )
        assert refused.value.body["error"]["type"] == "authentication_error"
