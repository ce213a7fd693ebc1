"""--reasoning-parser: a reasoning model's thinking comes in the chat message's `reasoning`, its answer in
`content`, the same streamed in pieces of any length as whole; a structured output applies after the thinking."""

from __future__ import annotations

import json
import random

import anthropic
import httpx
import jsonschema
import llguidance
import openai
import pytest

from services.api.errors import ApiError
from services.api.reasoning import REASONING_PARSERS, ReasoningStream, ThinkTags
from services.api.requests import parse_chat
from services.api.structured import GrammarSpec, compile_grammar, grammar_tokenizer
from tests.conftest import serve
from tests.tiny_models import CHAT_TEMPLATE, build_model, build_tokenizer

R1, QWEN3 = REASONING_PARSERS["deepseek_r1"], REASONING_PARSERS["qwen3"]
SCHEMA = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer"}},
    "required": ["city", "days"],
    "additionalProperties": False,
}

# (format, output, reasoning, content)
GOLDEN = [
    (R1, "the sum is 4</think>\n\n4", "the sum is 4", "\n\n4"),
    (R1, "<think>weighing it</think>yes", "weighing it", "yes"),
    (R1, "still thinking when cut", "still thinking when cut", ""),
    (R1, "</think>only an answer", "", "only an answer"),
    (R1, "a < b, and </thin is no tag</think>so: a</think>", "a < b, and </thin is no tag", "so: a</think>"),
    (QWEN3, "<think>\nhmm\n</think>\n\nParis", "\nhmm\n", "\n\nParis"),
    (QWEN3, "Paris, no thinking", "", "Paris, no thinking"),
    (QWEN3, "<thin>not a tag", "", "<thin>not a tag"),
    (QWEN3, "<think>cut while thinking", "cut while thinking", ""),
    (QWEN3, "", "", ""),
]


@pytest.mark.parametrize("fmt, output, reasoning, content", GOLDEN)
def test_each_format_splits_its_golden_outputs_whole_and_streamed_in_pieces_of_any_length(
    fmt, output, reasoning, content
):
    assert fmt.split(output) == (reasoning, content)
    for seed in range(20):
        pieces, rng, at = [], random.Random(seed), 0
        while at < len(output):
            size = rng.randint(1, 6)
            pieces.append(output[at : at + size])
            at += size
        stream, streamed = ReasoningStream(fmt), ("", "")
        for k, piece in enumerate(pieces or [""]):
            got = stream.feed(piece, final=k == len(pieces or [""]) - 1)
            streamed = (streamed[0] + got[0], streamed[1] + got[1])
        assert streamed == (reasoning, content), pieces


@pytest.fixture(scope="module", params=["tags-as-text", "tags-as-tokens"])
def grammar_tokens(request):
    """A tokenizer that spells <think> and </think> in pieces, and one that adds them as tokens of their own."""
    tokenizer = build_tokenizer()
    if request.param == "tags-as-tokens":
        tokenizer.add_tokens(["<think>", "</think>"])
    return tokenizer, grammar_tokenizer(tokenizer, len(tokenizer)), ThinkTags.of(tokenizer)


@pytest.mark.parametrize(
    "spec, answers, refused",
    [
        (GrammarSpec("json", json.dumps(SCHEMA), "response_format"), ['{"city": "Oslo", "days": 3}'], ['{"city": 3}']),
        (GrammarSpec("regex", r"[0-9]{3}", "structured_outputs.regex"), ["123"], ["12a"]),
        (GrammarSpec("choice", '["yes", "no"]', "structured_outputs.choice"), ["no"], ["maybe"]),
        (GrammarSpec("grammar", 'start: "go" | "stop"', "structured_outputs.grammar"), ["stop"], ["went"]),
    ],
    ids=["json", "regex", "choice", "lark"],
)
def test_a_structured_output_applies_after_the_thinking_which_is_free(grammar_tokens, spec, answers, refused):
    tokenizer, tokens, tags = grammar_tokens
    body = compile_grammar(spec, tokens)
    r1, qwen3 = R1.after_thinking(body, tags), QWEN3.after_thinking(body, tags)

    def accepts(grammar: str, text: str) -> bool:
        matcher = llguidance.LLMatcher(tokens, grammar)
        return matcher.consume_tokens(tokenizer.encode(text)) and matcher.is_accepting()

    thinking = 'first {"city": 3} then 12a, maybe went; so'
    for answer in answers:
        assert accepts(r1, f"{thinking}</think>{answer}") and accepts(r1, f"<think>{thinking}</think>{answer}")
        assert accepts(qwen3, f"<think>{thinking}</think>{answer}")
        assert accepts(qwen3, answer)  # qwen3 may answer without thinking
        assert not accepts(r1, answer)  # deepseek_r1 thinks first, always
    for answer in refused:
        assert not accepts(r1, f"{thinking}</think>{answer}")
        assert not accepts(qwen3, f"<think>{thinking}</think>{answer}")


# --- through a server and the openai client ---------------------------------------------------


@pytest.fixture(scope="module")  # the tests that take it start processes: marked slow, not in `make check`
def thinking_server(tmp_path_factory):
    """A tiny Llama whose chat template opens <think> (as DeepSeek R1's does; closed at once with
    enable_thinking false, as Qwen3's), with <think> and </think> as tokens of its own, served with
    --reasoning-parser deepseek_r1."""
    directory = str(tmp_path_factory.mktemp("thinking"))
    tokenizer = build_tokenizer()
    tokenizer.add_tokens(["<think>", "</think>"])
    opens = "assistant\n<think>\n{% if enable_thinking is defined and not enable_thinking %}</think>\n\n{% endif %}"
    tokenizer.chat_template = CHAT_TEMPLATE.replace("assistant\n{% endif %}", opens + "{% endif %}")
    build_model(directory, "llama", vocab_size=len(tokenizer))
    tokenizer.save_pretrained(directory)
    with serve(directory, directory, "--dtype", "float32", "--reasoning-parser", "deepseek_r1") as server:
        yield server, tokenizer


MESSAGES = [{"role": "user", "content": "Where and for how long?"}]


def _streamed(client: openai.OpenAI, model: str, **options) -> tuple[str, str]:
    reasoning = content = ""
    for chunk in client.chat.completions.create(model=model, messages=MESSAGES, stream=True, **options):
        for choice in chunk.choices:
            reasoning += getattr(choice.delta, "reasoning", None) or ""
            content += choice.delta.content or ""
    return reasoning, content


@pytest.mark.slow
def test_the_thinking_comes_in_reasoning_the_same_streamed_and_whole_and_as_the_model_wrote_it(thinking_server):
    server, tokenizer = thinking_server
    assert "<think>" in tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none")
    options = {"max_tokens": 12, "temperature": 0}
    whole = client.chat.completions.create(model=server.model, messages=MESSAGES, **options).choices[0].message
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    raw = httpx.post(
        f"{server.base_url}/v1/completions", json={"model": server.model, "prompt": prompt, **options}, timeout=60
    ).json()["choices"][0]["text"]
    assert raw and (whole.reasoning, whole.content or "") == R1.split(raw)
    assert _streamed(client, server.model, **options) == (whole.reasoning or "", whole.content or "")


@pytest.mark.slow
def test_a_schema_applies_to_the_answer_after_the_thinking_ends(thinking_server):
    server, tokenizer = thinking_server
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none")
    end = tokenizer.convert_tokens_to_ids("</think>")
    options = {
        "max_tokens": 40,
        "temperature": 0,
        "logit_bias": {str(end): 100},  # the thinking ends at once; the schema then masks </think>
        "response_format": {"type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA}},
    }
    message = client.chat.completions.create(model=server.model, messages=MESSAGES, **options).choices[0].message
    assert not message.reasoning
    jsonschema.validate(json.loads(message.content), SCHEMA)
    assert _streamed(client, server.model, **options) == ("", message.content)


def _chat_message(server):
    """The chat API's answer to MESSAGES, greedy, 12 tokens: what the other APIs' answers are held to."""
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none")
    return (
        client.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=12, temperature=0)
        .choices[0]
        .message
    )


@pytest.mark.slow
def test_the_messages_api_gives_the_thinking_as_a_thinking_block_first_streamed_or_not(thinking_server):
    server, _ = thinking_server
    reasoning = _chat_message(server).reasoning
    client = anthropic.Anthropic(base_url=server.base_url, api_key="none")
    # Anthropic's newest client leaves temperature out of create(): sent as is
    options = {"model": server.model, "max_tokens": 12, "messages": MESSAGES, "extra_body": {"temperature": 0}}
    message = client.messages.create(**options)
    assert reasoning and message.content[0].type == "thinking" and message.content[0].thinking == reasoning
    with client.messages.stream(**options) as stream:
        streamed = stream.get_final_message()
    assert [block.model_dump() for block in streamed.content] == [block.model_dump() for block in message.content]


@pytest.mark.slow
def test_the_responses_api_gives_the_thinking_as_a_reasoning_item_first_streamed_or_not(thinking_server):
    server, _ = thinking_server
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none")
    message = _chat_message(server)
    options = {"model": server.model, "input": MESSAGES, "max_output_tokens": 12, "temperature": 0, "store": False}
    response = client.responses.create(**options)
    item = response.output[0]
    assert message.reasoning and item.type == "reasoning" and item.content[0].text == message.reasoning
    assert response.output_text == (message.content or "")
    assert 0 < response.usage.output_tokens_details.reasoning_tokens <= 12
    kinds, thought, streamed = [], "", None
    for event in client.responses.create(**options, stream=True):  # cut by max_output_tokens: response.incomplete
        kinds.append(event.type)
        thought += event.delta if event.type == "response.reasoning_text.delta" else ""
        streamed = event.response if event.type in ("response.completed", "response.incomplete") else streamed
    assert (
        streamed is not None
        and thought == message.reasoning
        and kinds.index("response.reasoning_text.done") < len(kinds) - 1
    )
    assert [i.model_dump(exclude={"id"}) for i in streamed.output] == [
        i.model_dump(exclude={"id"}) for i in response.output
    ]


def test_chat_template_kwargs_reach_the_template_but_may_not_set_what_the_server_sets():
    chat = {"messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": False}}
    assert parse_chat(chat).template_kwargs == {"enable_thinking": False}
    for kwargs in ({"tokenize": True}, {"chat_template": "{{ 1 }}"}, ["enable_thinking"]):
        with pytest.raises(ApiError) as refused:
            parse_chat({"messages": MESSAGES, "chat_template_kwargs": kwargs})
        assert refused.value.param == "chat_template_kwargs"


@pytest.mark.slow
def test_chat_template_kwargs_turn_the_templates_thinking_off(thinking_server):
    server, tokenizer = thinking_server
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none")
    closed, opened = (
        tokenizer.encode(
            tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False, **kwargs),
            add_special_tokens=False,
        )
        for kwargs in ({"enable_thinking": False}, {})
    )
    assert len(closed) > len(opened)
    for kwargs, prompt in ((None, opened), ({"enable_thinking": False}, closed)):
        usage = client.chat.completions.create(
            model=server.model, messages=MESSAGES, max_tokens=1, extra_body={"chat_template_kwargs": kwargs}
        ).usage
        assert usage.prompt_tokens == len(prompt)
