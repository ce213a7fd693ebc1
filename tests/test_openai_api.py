"""The OpenAI-compatible surface, exercised with the official client and raw HTTP."""

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from services.api.formats import event
from tests.conftest import device_blocks_used, wait_until

pytestmark = pytest.mark.slow  # starts processes: not in `make check`


@pytest.fixture(scope="module")
def client(llama_server):
    return openai.OpenAI(base_url=f"{llama_server.base_url}/v1", api_key="unused")


def test_models_and_health(llama_server, client):
    assert [m.id for m in client.models.list().data] == [llama_server.model]
    assert httpx.get(f"{llama_server.base_url}/health").json() == {"status": "ok"}


def test_a_request_without_model_is_served_by_the_one_model(llama_server):
    for path, body in (
        ("completions", {"prompt": "import os"}),
        ("chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ):
        response = httpx.post(f"{llama_server.base_url}/v1/{path}", json={**body, "max_tokens": 3}, timeout=60)
        assert response.status_code == 200, response.text
        assert response.json()["model"] == llama_server.model
    wrong = httpx.post(f"{llama_server.base_url}/v1/completions", json={"model": "other", "prompt": "x"}, timeout=60)
    assert wrong.status_code == 404 and wrong.json()["error"]["param"] == "model"


def test_streamed_completion_equals_the_whole_one(llama_server, client):
    args = dict(model=llama_server.model, prompt="def add(a, b):", max_tokens=20, temperature=0.9, seed=1234)
    whole = client.completions.create(**args)
    chunks = list(client.completions.create(stream=True, **args))
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == whole.choices[0].text
    assert whole.usage.completion_tokens == 20
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason == "length"


def test_streamed_chat_equals_the_whole_one(llama_server, client):
    args = dict(
        model=llama_server.model,
        messages=[{"role": "user", "content": "Write a loop."}],
        max_tokens=12,
        temperature=0.7,
        seed=99,
    )
    whole = client.chat.completions.create(**args)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **args))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_a_seeded_request_is_the_same_alone_and_in_a_busy_batch(llama_server, client):
    def seeded():
        return (
            client.completions.create(
                model=llama_server.model,
                prompt="import sys\n",
                max_tokens=24,
                temperature=1.0,
                seed=7,
                extra_body={"return_token_ids": True},
            )
            .choices[0]
            .token_ids
        )

    def noise(i):
        return client.completions.create(
            model=llama_server.model, prompt="x = " * (i + 1), max_tokens=30, temperature=1.0
        )

    alone = seeded()
    with ThreadPoolExecutor(8) as pool:
        others = [pool.submit(noise, i) for i in range(6)]
        busy = pool.submit(seeded)
        in_batch = busy.result()
        [f.result() for f in others]
    assert in_batch == alone
    another_seed = (
        client.completions.create(
            model=llama_server.model,
            prompt="import sys\n",
            max_tokens=24,
            temperature=1.0,
            seed=8,
            extra_body={"return_token_ids": True},
        )
        .choices[0]
        .token_ids
    )
    assert another_seed != alone


def test_stop_strings_end_the_text_before_the_stop(llama_server, client):
    args = dict(model=llama_server.model, prompt="class A:", max_tokens=24, temperature=0)
    full = client.completions.create(**args).choices[0].text
    stop = full[8:11]
    cut = client.completions.create(stop=[stop], **args).choices[0]
    assert cut.text == full[: full.index(stop)]
    assert cut.finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(stop=[stop], stream=True, **args))
    assert streamed == cut.text


def test_a_client_that_disconnects_mid_stream_frees_its_blocks(llama_server):
    before = llama_server.metrics()
    body = {
        "model": llama_server.model,
        "prompt": "import os",
        "max_tokens": 480,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", f"{llama_server.base_url}/v1/completions", json=body, timeout=60) as response:
        events = response.iter_lines()
        received = [line for line, _ in zip(events, range(6)) if line.startswith("data:")]
        assert received
        assert wait_until(lambda: device_blocks_used(llama_server.metrics("scheduler")) > 0, 5)
    assert wait_until(llama_server.is_idle, 10, 0.05)
    aborted = 'pagedserve_requests_total{endpoint="completions",finish_reason="abort"}'
    assert wait_until(lambda: llama_server.metrics("api").get(aborted) == before.get(aborted, 0) + 1, 5)
    metrics = llama_server.metrics()
    generated = metrics["pagedserve_generation_tokens_total"] - before["pagedserve_generation_tokens_total"]
    assert generated < 480


BAD_REQUESTS = [
    ("malformed JSON", "/v1/completions", b'{"model": ', 400, None),
    ("unknown model", "/v1/completions", {"model": "nope", "prompt": "hi"}, 404, "model"),
    ("zero max_tokens", "/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("negative max_tokens", "/v1/completions", {"prompt": "hi", "max_tokens": -3}, 400, "max_tokens"),
    ("negative temperature", "/v1/completions", {"prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    ("top_p above 1", "/v1/completions", {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("top_p of 0", "/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("top_k below -1", "/v1/completions", {"prompt": "hi", "top_k": -2}, 400, "top_k"),
    ("prompt too long", "/v1/completions", {"prompt": [5] * 600}, 400, "prompt"),
    ("prompt plus max_tokens too long", "/v1/completions", {"prompt": [5] * 500, "max_tokens": 100}, 400, "max_tokens"),
    ("empty prompt", "/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("empty token list", "/v1/completions", {"prompt": []}, 400, "prompt"),
    ("token id out of vocabulary", "/v1/completions", {"prompt": [1, 10**9]}, 400, "prompt"),
    ("prompt of wrong type", "/v1/completions", {"prompt": 12}, 400, "prompt"),
    ("max_tokens of wrong type", "/v1/completions", {"prompt": "hi", "max_tokens": "5"}, 400, "max_tokens"),
    ("temperature of wrong type", "/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("stream of wrong type", "/v1/completions", {"prompt": "hi", "stream": "yes"}, 400, "stream"),
    ("body not an object", "/v1/completions", [1, 2], 400, None),
    ("no messages", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("message of wrong type", "/v1/chat/completions", {"messages": ["hi"]}, 400, "messages[0]"),
    (
        "empty chat prompt budget",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0},
        400,
        "max_tokens",
    ),
]


@pytest.mark.parametrize("case, path, body, status, param", BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS])
def test_bad_input_gets_an_openai_error_and_the_server_keeps_serving(llama_server, case, path, body, status, param):
    if isinstance(body, (dict, list)):
        if isinstance(body, dict):
            body = {"model": llama_server.model, **body}
        content = json.dumps(body).encode()
    else:
        content = body
    response = httpx.post(
        f"{llama_server.base_url}{path}", content=content, headers={"content-type": "application/json"}, timeout=30
    )
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param
    good = httpx.post(
        f"{llama_server.base_url}/v1/completions",
        timeout=30,
        json={"model": llama_server.model, "prompt": "ok", "max_tokens": 2},
    )
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] >= 1


def test_latency_histograms_count_every_request_and_requests_are_counted_by_finish_reason(llama_server):
    before = llama_server.metrics()
    base = {"model": llama_server.model, "prompt": "import os", "temperature": 0}
    for stream in (False, True, False):
        body = {**base, "max_tokens": 6, "ignore_eos": True, "stream": stream}
        with httpx.stream("POST", f"{llama_server.base_url}/v1/completions", json=body, timeout=60) as response:
            assert response.status_code == 200
            response.read()
    full = httpx.post(
        f"{llama_server.base_url}/v1/completions", timeout=60, json={**base, "max_tokens": 12, "ignore_eos": True}
    ).json()["choices"][0]["text"]
    stopped = httpx.post(
        f"{llama_server.base_url}/v1/completions",
        timeout=60,
        json={**base, "max_tokens": 12, "ignore_eos": True, "stop": [full[4:7]]},
    ).json()
    assert stopped["choices"][0]["finish_reason"] == "stop"
    after = llama_server.metrics()

    def grew(name: str) -> float:
        return after.get(name, 0) - before.get(name, 0)

    label = 'pagedserve_requests_total{endpoint="completions",finish_reason="%s"}'
    assert grew(label % "length") == 4 and grew(label % "stop") == 1
    for histogram in ("time_to_first_token", "e2e_request_latency"):
        assert grew(f"pagedserve_{histogram}_seconds_count") == 5
    # every token after a request's first is one gap: 5 + 5 + 5 + 11 + (at most 11)
    assert 26 <= grew("pagedserve_time_per_output_token_seconds_count") <= 37
    assert grew("pagedserve_time_to_first_token_seconds_sum") > 0


def test_the_log_has_a_line_per_request_and_a_periodic_line_while_serving(llama_server):
    def lines(kind: str, text: str = "") -> list[str]:
        return [line for line in llama_server.log().splitlines() if kind in line and text in line]

    assert wait_until(llama_server.is_idle, 30)
    periodic_before = len(lines("pagedserve.stats"))
    access_before = lines("pagedserve.access", "generated 37")  # another test's aborted stream may have said so
    body = {"model": llama_server.model, "prompt": "import os", "max_tokens": 37, "ignore_eos": True, "temperature": 0}
    assert httpx.post(f"{llama_server.base_url}/v1/completions", json=body, timeout=60).status_code == 200
    assert wait_until(lambda: len(lines("pagedserve.access", "generated 37")) > len(access_before), 10)
    access = lines("pagedserve.access", "generated 37")[len(access_before) :]
    assert len(access) == 1 and "completions: length; prompt" in access[0]
    assert wait_until(lambda: len(lines("pagedserve.stats")) > periodic_before, 10)
    periodic = lines("pagedserve.stats")[periodic_before:]
    assert "generation" in periodic[0] and "KV blocks" in periodic[0]
    time.sleep(1.5)  # three intervals, idle
    assert len(lines("pagedserve.stats")) <= periodic_before + 3  # nothing is written while idle


def test_a_streamed_event_is_one_line_to_any_line_reader_whatever_its_text_holds():
    body = {"choices": [{"text": "a\u2028b\u2029c\x85d\ne\x1cf é"}]}
    lines = event(body).splitlines()  # breaks at every character httpx's aiter_lines breaks at
    assert len(lines) == 2 and lines[0].startswith("data: ") and lines[1] == ""
    assert json.loads(lines[0].removeprefix("data: ")) == body
