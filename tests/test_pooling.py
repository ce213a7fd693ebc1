"""Pooling models (`--runner pooling`) through real servers and OpenAI's client: embeddings are HF's hidden states
pooled and normalized the same way (last token, or the mean from a sentence-transformers config), over batches,
token ids, prompts computed in several steps and the prefix cache; scores and reranking order documents as HF's
classifier head does; each pooling request leaves no block behind; and bad inputs get a 400 that says why."""

from __future__ import annotations

import base64
import json
import os
import struct

import httpx
import openai
import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from transformers import AutoModel, AutoModelForSequenceClassification, AutoTokenizer

from tests.conftest import serve, wait_until
from tests.tiny_models import build_model

pytestmark = pytest.mark.slow  # starts processes: not in `make check`

TEXTS = ["def add(a, b):\n    return a + b", "import os", "for line in open(path):\n    print(line.rstrip())"]
LONG = "\n".join(f"value_{i} = compute(value_{i - 1}, step={i})" for i in range(1, 9))  # several steps' worth
TOLERANCE = 1e-4  # float32, the same operations in another order
QUERY = "read a file line by line"
DOCUMENTS = ["with open(path) as f:\n    for line in f: ...", "import math", "x = [i * i for i in range(9)]", "pass"]


def sentence_transformers_mean(directory: str) -> None:
    """The files a sentence-transformers model carries: mean pooling, then normalization."""
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    with open(os.path.join(directory, "modules.json"), "w") as f:
        json.dump(modules, f)
    os.makedirs(os.path.join(directory, "1_Pooling"))
    with open(os.path.join(directory, "1_Pooling", "config.json"), "w") as f:
        json.dump({"word_embedding_dimension": 64, "pooling_mode_mean_tokens": True}, f)


def bare_decoder(directory: str, family: str, seed: int) -> str:
    """An embedding model's checkpoint: the decoder alone (`LlamaModel`), its tensors without `model.`."""
    build_model(directory, family, seed=seed)
    AutoModel.from_pretrained(directory).save_pretrained(directory)  # config.json now names the bare class
    os.remove(os.path.join(directory, "generation_config.json"))
    return directory


def classifier(directory: str, family: str, num_labels: int, seed: int) -> str:
    build_model(directory, family, seed=seed)
    labels = {i: name for i, name in enumerate(["python", "shell", "prose"][:num_labels])}
    model = AutoModelForSequenceClassification.from_pretrained(directory, num_labels=num_labels, id2label=labels)
    torch.manual_seed(seed)
    torch.nn.init.normal_(model.score.weight, std=0.5)
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("pooling")
    mean = bare_decoder(str(root / "llama-mean"), "llama", seed=1)
    sentence_transformers_mean(mean)
    last = build_model(str(root / "qwen3-last"), "qwen3", seed=2, matryoshka_dimensions=[16, 32])
    return {
        "llama-mean": mean,
        "qwen3-last": last,
        "qwen2-scorer": classifier(str(root / "qwen2-scorer"), "qwen2", 1, seed=3),
        "llama-labels": classifier(str(root / "llama-labels"), "llama", 3, seed=4),
    }


@pytest.fixture(scope="module")
def servers(models, tmp_path_factory):
    logs = str(tmp_path_factory.mktemp("pooling-logs"))
    # Steps of at most 32 tokens: a long prompt is pooled over several; prefix caching on, as by default.
    flags = ("--dtype", "float32", "--max-num-batched-tokens", "32", "--enable-prefix-caching")
    with (
        serve(models["llama-mean"], logs, *flags) as mean,
        serve(models["qwen3-last"], logs, *flags, "--runner", "pooling") as last,
        serve(models["qwen2-scorer"], logs, *flags) as scorer,
        serve(models["llama-labels"], logs, *flags) as labels,
    ):
        yield {"llama-mean": mean, "qwen3-last": last, "qwen2-scorer": scorer, "llama-labels": labels}


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")


def hf_embedding(directory: str, text: str, pooling: str) -> torch.Tensor:
    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = AutoModel.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = model(**tokenizer(text, return_tensors="pt")).last_hidden_state[0]
    return F.normalize(hidden.mean(0) if pooling == "mean" else hidden[-1], dim=0)


def hf_scores(directory: str, pairs: list[tuple[str, str]]) -> list[list[float]]:
    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForSequenceClassification.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(**tokenizer(a, b, return_tensors="pt")).logits[0].tolist() for a, b in pairs]


def tokens(directory: str, text: str) -> list[int]:
    return AutoTokenizer.from_pretrained(directory)(text)["input_ids"]


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=60)


@pytest.mark.parametrize("name, pooling", [("llama-mean", "mean"), ("qwen3-last", "last")])
def test_embeddings_are_hfs_hidden_states_pooled_the_same_way_over_a_batch(servers, models, name, pooling):
    result = client(servers[name]).embeddings.create(model=name, input=[*TEXTS, LONG])
    assert [item.index for item in result.data] == [0, 1, 2, 3]
    for text, item in zip([*TEXTS, LONG], result.data):
        expected = hf_embedding(models[name], text, pooling)
        assert torch.allclose(torch.tensor(item.embedding), expected, atol=TOLERANCE, rtol=0)
    assert len(tokens(models[name], LONG)) > 3 * 32  # pooled over several steps
    assert result.usage.prompt_tokens == sum(len(tokens(models[name], t)) for t in [*TEXTS, LONG])


@pytest.mark.parametrize("name", ["llama-mean", "qwen3-last"])
def test_token_ids_base64_a_cached_prefix_and_the_pooling_route_give_the_same_vectors(servers, models, name):
    embeddings = client(servers[name]).embeddings
    first = embeddings.create(model=name, input=LONG).data[0].embedding
    again = embeddings.create(model=name, input=LONG).data[0].embedding  # its blocks are in the prefix cache now
    by_ids = embeddings.create(model=name, input=[tokens(models[name], t) for t in (LONG, TEXTS[0])])
    raw = post(servers[name], "/v1/embeddings", {"input": LONG, "encoding_format": "base64"}).json()
    packed = base64.b64decode(raw["data"][0]["embedding"])
    decoded = list(struct.unpack(f"<{len(packed) // 4}f", packed))
    pooled = post(servers[name], "/pooling", {"input": [LONG]}).json()["data"][0]
    assert pooled["object"] == "pooling"
    for other in (again, by_ids.data[0].embedding, decoded, pooled["data"]):
        assert torch.allclose(torch.tensor(other), torch.tensor(first), atol=TOLERANCE, rtol=0)
    assert len(by_ids.data) == 2


def test_a_matryoshka_model_cuts_its_vectors_to_the_sizes_it_declares_and_refuses_others(servers):
    embeddings = client(servers["qwen3-last"]).embeddings
    whole = torch.tensor(embeddings.create(model="qwen3-last", input=TEXTS[0]).data[0].embedding)
    cut = torch.tensor(embeddings.create(model="qwen3-last", input=TEXTS[0], dimensions=16).data[0].embedding)
    assert cut.shape == (16,) and torch.allclose(cut, F.normalize(whole[:16], dim=0), atol=TOLERANCE)
    with pytest.raises(openai.BadRequestError, match="dimensions=20"):
        embeddings.create(model="qwen3-last", input=TEXTS[0], dimensions=20)
    with pytest.raises(openai.BadRequestError, match="Matryoshka"):
        client(servers["llama-mean"]).embeddings.create(model="llama-mean", input=TEXTS[0], dimensions=16)


def test_score_and_rerank_order_documents_as_hfs_classifier_head_does(servers, models):
    scorer = servers["qwen2-scorer"]
    expected = [torch.sigmoid(torch.tensor(row[0])).item() for row in hf_scores(models["qwen2-scorer"],
                [(QUERY, d) for d in DOCUMENTS])]  # fmt: skip
    scores = post(scorer, "/score", {"text_1": QUERY, "text_2": DOCUMENTS}).json()["data"]
    assert [s["score"] for s in scores] == pytest.approx(expected, abs=TOLERANCE)
    reranked = post(scorer, "/v1/rerank", {"query": QUERY, "documents": DOCUMENTS, "top_n": 3}).json()
    order = sorted(range(len(DOCUMENTS)), key=lambda i: -expected[i])[:3]
    assert [r["index"] for r in reranked["results"]] == order
    assert [r["document"]["text"] for r in reranked["results"]] == [DOCUMENTS[i] for i in order]
    assert len(set(expected)) == len(expected)  # an ordering worth checking


def test_classify_gives_hfs_probabilities_under_the_labels_names(servers, models):
    texts = TEXTS[:2]
    answer = post(servers["llama-labels"], "/classify", {"input": texts}).json()
    for text, item in zip(texts, answer["data"]):
        (logits,) = hf_scores(models["llama-labels"], [(text, None)])  # type: ignore[list-item]
        probs = torch.softmax(torch.tensor(logits), dim=0)
        assert item["probs"] == pytest.approx(probs.tolist(), abs=TOLERANCE)
        assert item["label"] == ["python", "shell", "prose"][int(probs.argmax())] and item["num_classes"] == 3


def test_an_embedding_model_scores_a_pair_by_the_cosine_of_its_embeddings(servers):
    server = servers["llama-mean"]
    vectors = client(server).embeddings.create(model="llama-mean", input=[QUERY, DOCUMENTS[0]]).data
    cosine = F.cosine_similarity(torch.tensor(vectors[0].embedding), torch.tensor(vectors[1].embedding), dim=0)
    score = post(server, "/v1/score", {"text_1": QUERY, "text_2": DOCUMENTS[0]}).json()["data"][0]["score"]
    assert score == pytest.approx(cosine.item(), abs=TOLERANCE)


def test_pooling_requests_hold_no_blocks_once_answered(servers):
    for server in servers.values():
        assert wait_until(server.is_idle, 10), server.metrics("scheduler")


@pytest.mark.parametrize(
    "name, path, body, says",
    [
        ("llama-mean", "/v1/embeddings", {"input": []}, "input must be"),
        ("llama-mean", "/v1/embeddings", {"input": [[1, 2], "text"]}, "input must be"),
        ("llama-mean", "/v1/embeddings", {"input": "x", "encoding_format": "int8"}, "encoding_format"),
        ("llama-mean", "/v1/embeddings", {"input": [[10**9]]}, "token ids must be in"),
        ("llama-mean", "/v1/embeddings", {"input": [list(range(100)) * 6]}, "maximum context length"),
        ("llama-mean", "/v1/embeddings", {"input": "x", "model": "another"}, "does not exist"),
        ("llama-mean", "/classify", {"input": "x"}, "classifier head"),
        ("llama-mean", "/v1/completions", {"prompt": "x", "max_tokens": 2}, "pools prompts"),
        ("llama-labels", "/score", {"text_1": "a", "text_2": ["b"]}, "one label"),
        ("qwen2-scorer", "/rerank", {"query": "a", "documents": []}, "documents must be"),
        ("qwen2-scorer", "/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "as many texts"),
    ],
)
def test_each_bad_request_gets_an_openai_error_that_says_why(servers, name, path, body, says):
    response = post(servers[name], path, body)
    assert response.status_code in (400, 404), response.text
    assert says in response.json()["error"]["message"]
    assert client(servers[name]).embeddings.create(model=name, input="still serving").data  # nothing else disturbed


def test_a_generating_model_refuses_embeddings_with_the_flag_to_use(llama_server):
    with pytest.raises(openai.BadRequestError, match="--runner pooling"):
        client(llama_server).embeddings.create(model=llama_server.model, input="x")
