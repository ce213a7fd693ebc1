"""The rest of the OpenAI and vLLM surface a user reaches for: batched prompts, stop reasons,
usage in every chunk, unknown fields, and the server flags vLLM users pass."""

from __future__ import annotations

import json

import httpx
import pytest

from services.api.formats import Chunk, CompletionFormat
from services.api.requests import parse_completion
from services.launcher import parse_args
from tests.conftest import serve, wait_until

pytestmark = pytest.mark.slow  # starts processes: not in `make check`

CHAT_TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json={"model": server.model, **body}, timeout=60)


def greedy(server, prompt, max_tokens: int = 12, **fields) -> dict:
    response = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **fields})
    assert response.status_code == 200, response.text
    return response.json()


def test_a_list_of_prompts_gets_n_choices_per_prompt_indexed_prompt_by_prompt(llama_server):
    prompts = ["The cat", "Once upon a time", "1, 2, 3,"]
    alone = [greedy(llama_server, p)["choices"][0]["text"] for p in prompts]
    batched = greedy(llama_server, prompts, n=2)
    assert [c["index"] for c in batched["choices"]] == list(range(6))
    assert [c["text"] for c in batched["choices"]] == [text for text in alone for _ in range(2)]
    singles = [greedy(llama_server, p) for p in prompts]
    assert batched["usage"]["prompt_tokens"] == sum(s["usage"]["prompt_tokens"] for s in singles)
    assert batched["usage"]["completion_tokens"] == 2 * sum(s["usage"]["completion_tokens"] for s in singles)
    token_lists = [[5, 6, 7], [9, 10]]
    by_ids = greedy(llama_server, token_lists)
    assert [c["text"] for c in by_ids["choices"]] == [
        greedy(llama_server, t)["choices"][0]["text"] for t in token_lists
    ]


def test_a_streamed_batch_carries_every_choice_under_its_index(llama_server):
    prompts = ["The cat", "1, 2, 3,"]
    texts = {}
    with httpx.stream(
        "POST",
        f"{llama_server.base_url}/v1/completions",
        timeout=60,
        json={"model": llama_server.model, "prompt": prompts, "max_tokens": 8, "temperature": 0, "stream": True},
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert texts == {i: greedy(llama_server, p, 8)["choices"][0]["text"] for i, p in enumerate(prompts)}


def test_the_stop_string_can_be_kept_and_the_stop_reason_names_what_stopped(llama_server):
    full = greedy(llama_server, "Once upon a time", 24)["choices"][0]
    stop = full["text"][6:9]
    cut = greedy(llama_server, "Once upon a time", 24, stop=[stop])["choices"][0]
    kept = greedy(llama_server, "Once upon a time", 24, stop=[stop], include_stop_str_in_output=True)["choices"][0]
    first = full["text"].find(stop)
    assert cut["text"] == full["text"][:first] and cut["stop_reason"] == stop and cut["finish_reason"] == "stop"
    assert kept["text"] == full["text"][: first + len(stop)] and kept["stop_reason"] == stop
    assert full["stop_reason"] is None and full["finish_reason"] == "length"
    token = greedy(llama_server, "Once upon a time", 24, return_token_ids=True)["choices"][0]["token_ids"][4]
    by_token = greedy(llama_server, "Once upon a time", 24, stop_token_ids=[token])["choices"][0]
    assert by_token["finish_reason"] == "stop" and by_token["stop_reason"] == token


def test_continuous_usage_stats_put_the_running_usage_in_every_chunk(llama_server):
    usages = []
    with httpx.stream(
        "POST",
        f"{llama_server.base_url}/v1/completions",
        timeout=60,
        json={
            "model": llama_server.model,
            "prompt": "The cat",
            "max_tokens": 6,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        },
    ) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                usages.append(json.loads(line[6:])["usage"])
    completion = [u["completion_tokens"] for u in usages]
    assert completion == sorted(completion) and completion[-1] == 6 and len(usages) >= 6


CHAT_BODY = {"messages": [{"role": "user", "content": "Hi"}]}


@pytest.mark.parametrize(
    "endpoint, body", [("/v1/completions", {"prompt": "The cat"}), ("/v1/chat/completions", CHAT_BODY)]
)
def test_include_usage_puts_usage_null_in_every_chunk_and_the_whole_usage_in_a_last_one(llama_server, endpoint, body):
    """As OpenAI's stream: with stream_options.include_usage every chunk has "usage": null, and one more chunk
    before [DONE] has no choices and the request's usage; without it no chunk has the field."""
    for include in (True, False):
        with httpx.stream(
            "POST",
            f"{llama_server.base_url}{endpoint}",
            timeout=60,
            json={
                "model": llama_server.model,
                **body,
                "max_tokens": 5,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": include},
            },
        ) as response:
            chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
        if include:
            *streamed, last = chunks
            assert streamed and all("usage" in c and c["usage"] is None for c in streamed)
            assert last["choices"] == [] and last["usage"]["completion_tokens"] == 5
        else:
            assert chunks and not any("usage" in c for c in chunks)


def test_unknown_fields_are_served_and_logged_by_name(llama_server):
    response = post(
        llama_server,
        "/v1/completions",
        {"prompt": "The cat", "max_tokens": 2, "frobnicate_level": 3, "user": "someone"},
    )
    assert response.status_code == 200
    assert wait_until(lambda: "frobnicate_level" in llama_server.log(), 5)
    (line,) = [line for line in llama_server.log().splitlines() if "frobnicate_level" in line]
    assert "ignored" in line and "'user'" not in line  # OpenAI's "user" is known, and changes nothing


@pytest.mark.parametrize(
    "body, param",
    [({"prompt": "x", "suffix": "y"}, "suffix"), ({"prompt": ["x", 5]}, "prompt"), ({"prompt": []}, "prompt")],
)
def test_fields_that_would_change_the_output_and_are_not_served_get_a_400(llama_server, body, param):
    response = post(llama_server, "/v1/completions", body)
    assert response.status_code == 400 and response.json()["error"]["param"] == param


def test_vllms_dtype_names_are_accepted():
    assert parse_args(["up", "--dtype", "half"]).dtype == "float16"
    assert parse_args(["up", "--dtype", "float"]).dtype == "float32"


def test_a_server_with_vllms_flags(llama_dir, tmp_path):
    template = tmp_path / "template.jinja"
    template.write_text(CHAT_TEMPLATE)
    with serve(
        llama_dir,
        str(tmp_path),
        "--chat-template",
        str(template),
        "--max-logprobs",
        "3",
        "--disable-log-requests",
        "--trust-remote-code",
    ) as server:
        chat = post(
            server,
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0},
        )
        assert chat.status_code == 200
        tokenizer_prompt = post(server, "/tokenize", {"prompt": "<user>Hi<assistant>", "add_special_tokens": False})
        assert chat.json()["usage"]["prompt_tokens"] == tokenizer_prompt.json()["count"]
        too_many = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2, "logprobs": 4})
        assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "logprobs"
        assert post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2, "logprobs": 3}).status_code == 200
        log = server.log()
        assert "pagedserve.access" not in log  # --disable-log-requests
        assert "--trust-remote-code" in log and "never runs code" in log


def test_cached_tokens_are_reported_unless_the_server_says_not_to():
    fmt = CompletionFormat("m", None, parse_completion({"prompt": "x"}))
    chunks = [Chunk(0, "a", [1], [0.0], [{}], "stop", num_cached_tokens=32)]
    assert fmt.usage(40, chunks)["prompt_tokens_details"] == {"cached_tokens": 32}
    fmt.report_cached_tokens = False
    assert "prompt_tokens_details" not in fmt.usage(40, chunks)


class _Tokenizer:
    def decode(self, ids: list[int]) -> str:
        return "".join(chr(97 + i % 26) for i in ids)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_logprobs_json_cannot_carry_read_as_vllms_least_value_and_the_body_stays_valid_json(endpoint):
    from services.api.formats import LEAST_LOGPROB, ChatFormat
    from services.api.requests import parse_chat

    if endpoint == "completions":
        fmt = CompletionFormat("m", _Tokenizer(), parse_completion({"prompt": "x", "logprobs": 2}))
    else:
        fmt = ChatFormat(
            "m",
            _Tokenizer(),
            parse_chat({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 2}),
        )
    chunks = [Chunk(0, "ab", [1, 2], [float("-inf"), float("nan")], [{1: float("nan"), 3: -1.5}, {}], "stop")]
    body = json.dumps(fmt.whole(chunks, 1), allow_nan=False)  # what a JSON response holds: no NaN, no infinity
    assert str(LEAST_LOGPROB) in body and "-1.5" in body
