"""OpenAI's and vLLM's logit controls, through the openai client, each against a reference:
presence and frequency penalties and logit_bias (OpenAI's formulas), repetition_penalty (HF's
`RepetitionPenaltyLogitsProcessor`, and HF's own generate), min_tokens, and echo. Alone and mixed
in one batch, streaming and not."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from tests.tiny_models import _hf_generate, _hf_model

pytestmark = pytest.mark.slow  # starts processes: not in `make check`

PROMPTS = [[5, 9, 13, 200, 17, 44], [7, 7, 8, 300, 12], [100, 101, 102, 103, 5, 6, 7]]
MAX_TOKENS = 14


@pytest.fixture(scope="module")
def client(llama_server):
    return openai.OpenAI(base_url=f"{llama_server.base_url}/v1", api_key="unused")


def reference_greedy(model_dir: str, prompt: list[int], max_tokens: int, process) -> list[int]:
    """Greedy decoding with HF's model, `process(logits, prompt, output)` applied at every step."""
    model = _hf_model(model_dir)
    output: list[int] = []
    with torch.no_grad():
        for _ in range(max_tokens):
            logits = model(torch.tensor([prompt + output])).logits[0, -1].float()
            output.append(int(process(logits, prompt, output).argmax()))
    return output


def openai_penalties(presence: float, frequency: float):
    def process(logits, prompt, output):
        counts = torch.bincount(torch.tensor(output, dtype=torch.int64), minlength=logits.shape[0]).float()
        return logits - frequency * counts - presence * (counts > 0).float()

    return process


def hf_repetition(penalty: float):
    def process(logits, prompt, output):
        return RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([prompt + output]), logits[None])[0]

    return process


def biased(bias: dict[int, float]):
    def process(logits, prompt, output):
        for token, value in bias.items():
            logits[token] += value
        return logits

    return process


CASES = {  # name: (request fields, reference processing)
    "presence_penalty": ({"presence_penalty": 1.5}, openai_penalties(1.5, 0.0)),
    "frequency_penalty": ({"frequency_penalty": 0.8}, openai_penalties(0.0, 0.8)),
    "negative penalties": ({"presence_penalty": -2.0, "frequency_penalty": -1.0}, openai_penalties(-2.0, -1.0)),
    "repetition_penalty": ({"repetition_penalty": 1.8}, hf_repetition(1.8)),
    "repetition_penalty below 1": ({"repetition_penalty": 0.6}, hf_repetition(0.6)),
    "logit_bias": ({"logit_bias": {"11": 6.0, "250": 9.5, "37": -100}}, biased({11: 6.0, 250: 9.5, 37: -100.0})),
}


def complete(client, model: str, prompt: list[int], fields: dict, stream: bool) -> list[int]:
    openai_fields = {k: v for k, v in fields.items() if k in ("presence_penalty", "frequency_penalty", "logit_bias")}
    vllm_fields = {k: v for k, v in fields.items() if k not in openai_fields}
    args = dict(
        model=model,
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        temperature=0,
        **openai_fields,
        extra_body={"ignore_eos": True, "return_token_ids": True, **vllm_fields},
    )
    if not stream:
        return client.completions.create(**args).choices[0].token_ids
    return [t for chunk in client.completions.create(stream=True, **args) for c in chunk.choices for t in c.token_ids]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("case", list(CASES))
def test_each_parameter_alone_equals_its_reference(llama_server, llama_dir, client, case, stream):
    fields, process = CASES[case]
    plain = reference_greedy(llama_dir, PROMPTS[0], MAX_TOKENS, lambda logits, *_: logits)
    expected = reference_greedy(llama_dir, PROMPTS[0], MAX_TOKENS, process)
    assert expected != plain  # the parameter changes the output, so the comparison means something
    assert complete(client, llama_server.model, PROMPTS[0], fields, stream) == expected


def test_repetition_penalty_equals_hf_generate(llama_server, llama_dir, client):
    for prompt in PROMPTS:
        response = client.completions.create(
            model=llama_server.model,
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body={"repetition_penalty": 1.3, "return_token_ids": True},
        )
        assert response.choices[0].token_ids == _hf_generate(llama_dir, prompt, MAX_TOKENS, repetition_penalty=1.3)[0]


def test_mixed_parameters_in_one_batch_each_equal_their_reference(llama_server, llama_dir, client):
    jobs = [(prompt, name, stream) for prompt in PROMPTS for name in CASES for stream in (False, True)]
    with ThreadPoolExecutor(len(jobs)) as pool:  # concurrent: the scheduler batches them
        got = list(pool.map(lambda job: complete(client, llama_server.model, job[0], CASES[job[1]][0], job[2]), jobs))
    for (prompt, name, stream), tokens in zip(jobs, got):
        assert tokens == reference_greedy(llama_dir, prompt, MAX_TOKENS, CASES[name][1]), (prompt, name, stream)


def test_min_tokens_holds_back_eos_until_reached(llama_server, llama_dir, client):
    eos = _hf_model(llama_dir).generation_config.eos_token_id
    expected = reference_greedy(llama_dir, PROMPTS[1], 5, biased({eos: -float("inf")}))
    for stream in (False, True):
        args = dict(
            model=llama_server.model,
            prompt=PROMPTS[1],
            max_tokens=MAX_TOKENS,
            temperature=0,
            logit_bias={str(eos): 100},
            extra_body={"min_tokens": 5, "return_token_ids": True},
        )
        if stream:
            chunks = list(client.completions.create(stream=True, **args))
            tokens = [t for chunk in chunks for c in chunk.choices for t in c.token_ids]
            reason = [c.finish_reason for chunk in chunks for c in chunk.choices if c.finish_reason][-1]
        else:
            choice = client.completions.create(**args).choices[0]
            tokens, reason = choice.token_ids, choice.finish_reason
        # EOS is the likeliest token by far, yet it comes only after the five tokens greedy
        # decoding gives without it.
        assert reason == "stop" and tokens[:5] == expected and tokens[5:] in ([], [eos])


def test_seeded_sampling_with_penalties_is_reproducible(llama_server, client):
    args = dict(
        model=llama_server.model,
        prompt="def f(x):",
        max_tokens=12,
        temperature=1.0,
        seed=77,
        presence_penalty=0.7,
        frequency_penalty=0.4,
        logit_bias={"50": 3},
        extra_body={"repetition_penalty": 1.2, "ignore_eos": True},
    )
    first = client.completions.create(**args).choices[0].text
    assert client.completions.create(**args).choices[0].text == first
    assert "".join(c.choices[0].text for c in client.completions.create(stream=True, **args)) == first


def test_echo_returns_the_prompt_before_the_completion(llama_server, client):
    args = dict(model=llama_server.model, prompt="import os\n", max_tokens=6, temperature=0)
    plain = client.completions.create(**args).choices[0].text
    echoed = client.completions.create(echo=True, n=2, **args).choices
    assert [c.text for c in echoed] == ["import os\n" + plain] * 2
    streamed = ["", ""]
    for chunk in client.completions.create(echo=True, n=2, stream=True, **args):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert streamed == ["import os\n" + plain] * 2


def reference_prompt_logprobs(model_dir: str, prompt: list[int]) -> list[float]:
    with torch.no_grad():
        logprobs = torch.log_softmax(_hf_model(model_dir)(torch.tensor([prompt])).logits[0].float(), dim=-1)
    return [logprobs[p, prompt[p + 1]].item() for p in range(len(prompt) - 1)]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_echo_with_logprobs_gives_the_prompt_tokens_theirs(llama_dir, tmp_path, stream):
    from tests.conftest import serve

    prompt = PROMPTS[2] * 4  # 28 tokens: whole blocks, so a second request could hit the prefix cache
    expected = reference_prompt_logprobs(llama_dir, prompt)
    # Chunked over several steps, and with prefix caching on: prompt log-probabilities are computed, never cached.
    with serve(
        llama_dir, str(tmp_path), "--enable-prefix-caching", "--max-num-batched-tokens", "10", "--block-size", "4"
    ) as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
        for _ in range(2):
            args = dict(model=server.model, prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=2)
            if stream:
                choice = next(c for chunk in client.completions.create(stream=True, **args) for c in chunk.choices)
            else:
                choice = client.completions.create(**args).choices[0]
            logprobs = choice.logprobs
            assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
            assert logprobs.token_logprobs[1 : len(prompt)] == pytest.approx(expected, abs=1e-4)
            # two alternatives each, unless both decode to the same text (OpenAI's format keys them by text)
            assert all(1 <= len(top) <= 2 for top in logprobs.top_logprobs[1 : len(prompt)])
            assert len(logprobs.tokens) == len(prompt) + 3 if not stream else len(logprobs.tokens) > len(prompt)
            assert logprobs.text_offset[:2] == [0, len(logprobs.tokens[0])]


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"frequency_penalty": "high"}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"repetition_penalty": 2.5}, "repetition_penalty"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"99999999": 1}}, "logit_bias"),
        ({"logit_bias": [1, 2]}, "logit_bias"),
    ],
)
def test_out_of_range_values_get_a_400_naming_the_parameter(llama_server, fields, param):
    body = {"model": llama_server.model, "prompt": "x", "max_tokens": 4, **fields}
    response = httpx.post(f"{llama_server.base_url}/v1/completions", json=body, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
