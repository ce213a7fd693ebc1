"""n, best_of, beam search, prefix caching and swapping, through the three processes."""

import httpx
import pytest

from tests.conftest import serve, wait_until
from tests.test_end_to_end import MAX_TOKENS, prompts
from tests.tiny_models import hf_beam_search, hf_greedy

pytestmark = pytest.mark.slow  # starts processes: not in `make check`

FLAGS = [
    "--block-size",
    "4",
    "--num-gpu-blocks-override",
    "24",
    "--preemption-mode",
    "swap",
    "--enable-prefix-caching",
    "--enable-chunked-prefill",
    "--max-num-batched-tokens",
    "32",
]


@pytest.fixture(scope="module")
def server(llama_dir, tmp_path_factory):
    with serve(llama_dir, str(tmp_path_factory.mktemp("sharing")), *FLAGS) as server:
        yield server


def complete(server, **body):
    response = httpx.post(
        f"{server.base_url}/v1/completions", timeout=120, json={"model": server.model, "return_token_ids": True, **body}
    )
    assert response.status_code == 200, response.text
    return response.json()


def test_swapped_chunked_cached_greedy_output_equals_hf(server, llama_dir):
    prompt_ids = prompts(llama_dir)
    # One batch request: every prompt arrives at once, so the cache must swap whatever the timing.
    choices = complete(server, prompt=prompt_ids, max_tokens=MAX_TOKENS, temperature=0)["choices"]
    got = [c["token_ids"] for c in sorted(choices, key=lambda c: c["index"])]
    assert got == [hf_greedy(llama_dir, p, MAX_TOKENS) for p in prompt_ids]
    assert wait_until(server.is_idle, 5)
    assert server.metrics()['pagedserve_preemptions_total{mode="swap"}'] > 0


def test_n_choices_stream_and_whole_agree(server):
    body = dict(prompt="def f(x):", max_tokens=8, temperature=1.0, seed=11, n=3)
    whole = complete(server, **body)
    assert [c["index"] for c in whole["choices"]] == [0, 1, 2]
    assert len({tuple(c["token_ids"]) for c in whole["choices"]}) > 1
    texts = ["", "", ""]
    with httpx.stream(
        "POST", f"{server.base_url}/v1/completions", timeout=60, json={"model": server.model, "stream": True, **body}
    ) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                import json

                for choice in json.loads(line[6:])["choices"]:
                    texts[choice["index"]] += choice["text"]
    assert texts == [c["text"] for c in whole["choices"]]
    assert whole["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in whole["choices"])


def test_beam_search_through_the_api_equals_hf(server, llama_dir):
    prompt = [5, 9, 13, 200, 17]
    body = complete(server, prompt=prompt, max_tokens=8, use_beam_search=True, best_of=3, n=3, temperature=0)
    assert [c["token_ids"] for c in body["choices"]] == hf_beam_search(llama_dir, prompt, 3, 8)


def test_a_repeated_prefix_is_reported_as_cached(server):
    prefix = list(range(30, 70))
    first = complete(server, prompt=prefix + [1], max_tokens=2, temperature=0)
    second = complete(server, prompt=prefix + [2, 3], max_tokens=2, temperature=0)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] < 40
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 40
