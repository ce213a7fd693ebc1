"""No request can crash, stall or poison the server: every bad input gets a 4xx OpenAI error
while other requests stream on with their exact greedy tokens, and every process stays up."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from tests.conftest import wait_until

pytestmark = pytest.mark.slow  # starts processes: not in `make check`

NUMERIC_FIELDS = [
    "n",
    "best_of",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "max_tokens",
    "logprobs",
    "length_penalty",
]
EXTREMES = ["9223372036854775808", "18446744073709551616", "-1", "NaN", "Infinity", "1e309"]
# Values in range for their field: they must be served, not refused.
IN_RANGE = {("top_k", "-1"), ("seed", "9223372036854775808"), ("seed", "-1"), ("length_penalty", "-1")}


def _bad_bodies(model: str) -> list[tuple[str, str, bool]]:
    """(what, raw body, may succeed)."""
    base = f'"model": "{model}", "prompt": "import os", "max_tokens": 4'
    bodies = []
    for field in NUMERIC_FIELDS:
        for value in EXTREMES:
            body = (
                f'{{{base}, "{field}": {value}}}'
                if field != "max_tokens"
                else f'{{"model": "{model}", "prompt": "import os", "max_tokens": {value}}}'
            )
            bodies.append((f"{field}={value}", body, (field, value) in IN_RANGE))
    for value in EXTREMES[:2] + ["-1"]:
        bodies.append((f"stop_token_ids=[{value}]", f'{{{base}, "stop_token_ids": [{value}]}}', False))
        bodies.append((f"prompt=[{value}]", f'{{"model": "{model}", "prompt": [{value}], "max_tokens": 2}}', False))
        bodies.append(
            (
                f"top_logprobs={value}",
                json.dumps(
                    {"model": model, "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "max_tokens": 2}
                )[:-1]
                + f', "top_logprobs": {value}}}',
                False,
            )
        )
    bodies += [
        (
            "beam length_penalty 5000",
            f'{{{base}, "use_beam_search": true, "best_of": 2, "temperature": 0, "length_penalty": 5000}}',
            False,
        ),
        (
            "beam length_penalty 100",
            f'{{{base}, "use_beam_search": true, "best_of": 2, "temperature": 0, "length_penalty": 100}}',
            True,
        ),
        ("lone surrogate prompt", f'{{"model": "{model}", "prompt": "\\ud800", "max_tokens": 2}}', False),
        ("lone surrogate model", '{"model": "\\udfff", "prompt": "x"}', False),
        ("lone surrogate stop", f'{{{base}, "stop": ["\\ud800"]}}', False),
        (
            "lone surrogate chat",
            f'{{"model": "{model}", "messages": [{{"role": "user", "content": "\\ud800"}}]}}',
            False,
        ),
        ("deep JSON", "[" * 100_000 + "]" * 100_000, False),
        ("deep JSON in a field", f'{{{base}, "stop": ' + "[" * 50_000 + "]" * 50_000 + "}", False),
        ("a 5,000-digit seed", f'{{{base}, "seed": {"9" * 5000}}}', False),
        (
            "tool-call arguments nested 5,000 deep",
            json.dumps(
                {
                    "model": model,
                    "max_tokens": 2,
                    "messages": [
                        {"role": "user", "content": "hi"},
                        {
                            "role": "assistant",
                            "content": None,
                            "tool_calls": [
                                {
                                    "id": "c",
                                    "type": "function",
                                    "function": {"name": "f", "arguments": '{"a": ' * 5000 + "1" + "}" * 5000},
                                }
                            ],
                        },
                        {"role": "tool", "tool_call_id": "c", "content": "ok"},
                    ],
                }
            ),
            False,
        ),
        ("body over the limit", f'{{{base}, "padding": "' + "x" * (9 << 20) + '"}', False),
    ]
    return bodies


def _stream_text(base_url: str, body: dict) -> str:
    text = []
    with httpx.stream("POST", f"{base_url}/v1/completions", json=dict(body, stream=True), timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[len("data: ") :])
                assert "error" not in event, event
                text.append(event["choices"][0]["text"])
    return "".join(text)


def test_bad_requests_get_4xx_while_other_streams_keep_their_greedy_tokens(llama_server):
    base = llama_server.base_url
    greedy = [
        {"model": llama_server.model, "prompt": prompt, "max_tokens": 48, "temperature": 0, "ignore_eos": True}
        for prompt in ("import os", "def f(x):", "class A:")
    ]
    expected = [
        httpx.post(f"{base}/v1/completions", json=body, timeout=120).json()["choices"][0]["text"] for body in greedy
    ]
    streamed: dict[int, str] = {}
    threads = [
        threading.Thread(target=lambda i=i: streamed.__setitem__(i, _stream_text(base, greedy[i])))
        for i in range(len(greedy))
    ]
    for thread in threads:
        thread.start()

    failures = []
    with httpx.Client(timeout=120) as client:
        for what, body, may_succeed in _bad_bodies(llama_server.model):
            path = "/v1/chat/completions" if '"messages"' in body else "/v1/completions"
            response = client.post(f"{base}{path}", content=body, headers={"content-type": "application/json"})
            ok = response.status_code == 200 and may_succeed
            refused = 400 <= response.status_code < 500 and "message" in response.json().get("error", {})
            if not (ok or refused):
                failures.append(f"{what}: {response.status_code} {response.text[:200]}")
        for path, method in (("/no/such/route", "GET"), ("/v1/completions", "GET"), ("/health", "DELETE")):
            response = client.request(method, f"{base}{path}")
            assert response.status_code in (404, 405) and response.json()["error"]["message"], (path, method)
    for thread in threads:
        thread.join(120)
    assert not failures, "\n".join(failures)
    assert [streamed[i] for i in range(len(greedy))] == expected
    assert llama_server.process.poll() is None
    assert httpx.get(f"{base}/health", timeout=5).status_code == 200
    assert wait_until(llama_server.is_idle, 5)


@pytest.mark.parametrize("temperature", [1e-39, 1e-300, 1e-6])
def test_tiny_temperatures_give_the_greedy_tokens(llama_server, temperature):
    body = {"model": llama_server.model, "prompt": "import os", "max_tokens": 8, "ignore_eos": True}
    greedy = httpx.post(f"{llama_server.base_url}/v1/completions", json=dict(body, temperature=0), timeout=60)
    tiny = httpx.post(f"{llama_server.base_url}/v1/completions", json=dict(body, temperature=temperature), timeout=60)
    assert tiny.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]
