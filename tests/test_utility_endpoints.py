"""The endpoints beside generation, in vLLM's request and response shapes, and their errors."""

from importlib import metadata

import httpx
import openai
import pytest
from transformers import AutoTokenizer

pytestmark = pytest.mark.slow  # starts processes: not in `make check`


@pytest.fixture(scope="module")
def tokenizer(llama_dir):
    return AutoTokenizer.from_pretrained(llama_dir)


def post(server, path, body):
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=30)


def test_tokenize_a_prompt_and_chat_messages_as_the_model_tokenizer_does(llama_server, tokenizer):
    answer = post(
        llama_server, "/tokenize", {"model": llama_server.model, "prompt": "def main():", "return_token_strs": True}
    ).json()
    assert answer["tokens"] == tokenizer.encode("def main():") and answer["count"] == len(answer["tokens"])
    assert answer["max_model_len"] > 0 and answer["token_strs"] == tokenizer.convert_ids_to_tokens(answer["tokens"])
    messages = [{"role": "user", "content": "hello"}]
    chat = post(llama_server, "/tokenize", {"messages": messages}).json()
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat["tokens"] == tokenizer.encode(text, add_special_tokens=False)


def test_detokenize_gives_the_text_back(llama_server, tokenizer):
    ids = tokenizer.encode("for i in range(3):")
    assert post(llama_server, "/detokenize", {"tokens": ids}).json() == {"prompt": tokenizer.decode(ids)}


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens"),
        ("/tokenize", {"prompt": "x", "model": "other"}, "model"),
        ("/detokenize", {"tokens": [1, -2]}, "tokens"),
        ("/detokenize", {"tokens": [10**9]}, "tokens"),
        ("/detokenize", {"tokens": "1 2"}, "tokens"),
    ],
)
def test_bad_tokenizer_requests_get_openai_style_errors(llama_server, path, body, param):
    response = post(llama_server, path, body)
    assert response.status_code in (400, 404) and response.json()["error"]["param"] == param


def test_version_ping_and_one_model(llama_server):
    base = llama_server.base_url
    assert httpx.get(f"{base}/version").json() == {"version": metadata.version("pagedserve")}
    assert httpx.get(f"{base}/ping").status_code == 200 and httpx.post(f"{base}/ping").status_code == 200
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused")
    card = client.models.retrieve(llama_server.model)
    assert card.id == llama_server.model and card.owned_by == "pagedserve"
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("no-such-model")
    assert missing.value.body["code"] == "model_not_found"


def test_unknown_routes_and_methods_answer_json_errors(llama_server):
    missing = httpx.get(f"{llama_server.base_url}/v1/nothing-here")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    wrong = httpx.get(f"{llama_server.base_url}/tokenize")
    assert wrong.status_code == 405 and wrong.json()["error"]["code"] == "method_not_allowed"
