"""The routes of a pooling model (`--runner pooling`): OpenAI's `/v1/embeddings`, and vLLM's `/pooling`,
`/classify`, `/score` and `/rerank` (Jina's and Cohere's shape).

Each input is one request of one prompt step (SamplingParams.pooling) through the same scheduler, paged cache
and prefix cache as generation; a request's inputs are queued together, so they share steps. What a model pools
and whether it normalizes is its own (services/worker/pooling.py); the api cuts Matryoshka sizes, encodes, and
scores:
- a classifier (a `...ForSequenceClassification` checkpoint) scores a pair by its head on the pair's tokens, as
  the tokenizer joins two texts: the sigmoid of its one logit (/score, /rerank), or the softmax of its logits
  over its labels (/classify);
- an embedding model scores a pair by the cosine similarity of the two texts' embeddings.
"""

from __future__ import annotations

import asyncio
import base64
import math
import struct
import time
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from services.api.app import LARGE_RESPONSE_ENTRIES, engine_error
from services.api.errors import ApiError
from services.api.large_json import encode_in_pieces
from services.api.utility import tenant_of_request
from shared.protocol import PoolingSpec
from shared.sampling import SamplingParams

if TYPE_CHECKING:
    from services.api.app import OpenAIServer

Prompt = str | list[int]


def pooling_routes(server: OpenAIServer) -> list[Route]:
    pooler = Pooling(server)
    routes = [
        ("/v1/embeddings", pooler.embeddings),
        ("/pooling", pooler.pooling),
        ("/classify", pooler.classify),
        ("/score", pooler.score),
        ("/v1/score", pooler.score),
        ("/rerank", pooler.rerank),
        ("/v1/rerank", pooler.rerank),
        ("/v2/rerank", pooler.rerank),
    ]
    return [Route(path, endpoint, methods=["POST"]) for path, endpoint in routes]


class Pooling:
    def __init__(self, server: OpenAIServer):
        self.server = server

    # --- routes --------------------------------------------------------------------------

    async def embeddings(self, request: Request) -> Response:
        body = await self._body(request)
        spec = self._spec()
        encoding = body.get("encoding_format", "float")
        if encoding not in ("float", "base64"):
            raise ApiError('encoding_format must be "float" or "base64"', param="encoding_format")
        dimensions = body.get("dimensions")
        if dimensions is not None:
            _check_dimensions(spec, dimensions)
        prompts = _inputs(body.get("input"), "input")
        vectors, tokens = await self._pool(request, prompts, "embed")
        if dimensions is not None:
            vectors = [_cut(vector, dimensions, spec.normalize) for vector in vectors]
        data = [
            {"object": "embedding", "index": i, "embedding": _base64(v) if encoding == "base64" else v}
            for i, v in enumerate(vectors)
        ]
        return await self._answer(
            {"object": "list", "data": data, "model": self._model(body), "usage": _usage(tokens)}, vectors
        )

    async def pooling(self, request: Request) -> Response:
        body = await self._body(request)
        self._spec()
        vectors, tokens = await self._pool(request, _inputs(body.get("input"), "input"), "embed")
        data = [{"object": "pooling", "index": i, "data": v} for i, v in enumerate(vectors)]
        return await self._answer(self._listing("pool", body, data, tokens), vectors)

    async def classify(self, request: Request) -> Response:
        body = await self._body(request)
        spec = self._classifier("/classify")
        logits, tokens = await self._pool(request, _inputs(body.get("input"), "input"), "classify")
        data = []
        for i, row in enumerate(logits):
            probs = _probabilities(row)
            best = max(range(len(probs)), key=probs.__getitem__)
            data.append({"index": i, "label": spec.labels[best], "probs": probs, "num_classes": len(probs)})
        return await self._answer(self._listing("classify", body, data, tokens), logits)

    async def score(self, request: Request) -> Response:
        body = await self._body(request)
        first, second = body.get("text_1", body.get("queries")), body.get("text_2", body.get("documents"))
        lefts = [first] if isinstance(first, str) else _texts(first, "text_1")
        rights = [second] if isinstance(second, str) else _texts(second, "text_2")
        if len(lefts) == 1:
            lefts = lefts * len(rights)
        if len(lefts) != len(rights):
            raise ApiError("text_1 must be one text, or as many texts as text_2", param="text_1")
        scores, tokens = await self._scores(request, lefts, rights)
        data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
        return JSONResponse(self._listing("score", body, data, tokens))

    async def rerank(self, request: Request) -> Response:
        body = await self._body(request)
        query = body.get("query")
        if not isinstance(query, str) or not query:
            raise ApiError("query must be a non-empty string", param="query")
        documents = _texts(body.get("documents"), "documents")
        top_n = body.get("top_n", len(documents))
        if type(top_n) is not int or top_n < 1:
            raise ApiError("top_n must be a positive integer", param="top_n")
        scores, tokens = await self._scores(request, [query] * len(documents), documents)
        ranked = sorted(range(len(documents)), key=lambda i: -scores[i])[:top_n]
        results = [{"index": i, "document": {"text": documents[i]}, "relevance_score": scores[i]} for i in ranked]
        answer = {"id": f"rerank-{uuid.uuid4().hex}", "model": self._model(body), "results": results}
        return JSONResponse(answer | {"usage": {"total_tokens": tokens}})

    # --- shared --------------------------------------------------------------------------

    async def _body(self, request: Request) -> dict[str, Any]:
        body = await self.server.bodies.read(request)
        if not isinstance(body, dict):
            raise ApiError("the request body must be a JSON object")
        if self.server.adapters.resolve(body.get("model"), tenant_of_request(request)) is not None:  # unknown: 404
            raise ApiError("LoRA adapters do not apply to pooling requests: name the base model", param="model")
        return body

    def _spec(self) -> PoolingSpec:
        info = self.server.client.info
        if info is None:
            raise ApiError("the server is not ready; retry shortly", status=503, type="server_error", code="not_ready")
        if info.pooling is None:
            raise ApiError(
                "this model generates: embeddings, scores and classification need a pooling model, served with "
                "--runner pooling",
                code="wrong_runner",
            )
        return info.pooling

    def _classifier(self, route: str) -> PoolingSpec:
        spec = self._spec()
        if not spec.num_labels:
            raise ApiError(f"{route} needs a model with a classifier head (a ...ForSequenceClassification checkpoint)")
        return spec

    async def _scores(self, request: Request, lefts: list[str], rights: list[str]) -> tuple[list[float], int]:
        spec = self._spec()
        if spec.num_labels:
            if spec.num_labels != 1:
                raise ApiError(f"scores come from a classifier of one label; this one has {spec.num_labels}")
            encode = self.server.tokenizer.encode
            pairs = [await self.server._tokenize(encode, left, text_pair=right) for left, right in zip(lefts, rights)]
            logits, tokens = await self._pool(request, pairs, "classify")
            return [_sigmoid(row[0]) for row in logits], tokens
        unique = list(dict.fromkeys(lefts + rights))
        vectors, tokens = await self._pool(request, unique, "embed")
        embedded = dict(zip(unique, vectors))
        return [_cosine(embedded[left], embedded[right]) for left, right in zip(lefts, rights)], tokens

    async def _pool(self, request: Request, prompts: Sequence[Prompt], task: str) -> tuple[list[list[float]], int]:
        """Each prompt's vector, and the prompt tokens they took; all queued at once, so they share steps."""
        server = self.server
        if len(prompts) > server.max_prompts:
            raise ApiError(
                f"the request holds {len(prompts)} inputs; at most {server.max_prompts} are accepted "
                "(--max-prompts-per-request)",
                param="input",
                code="too_many_prompts",
            )
        ids = [await server._prompt_ids(prompt) for prompt in prompts]
        info = server.client.info
        assert info is not None  # _spec checked it
        for prompt_ids in ids:
            if not prompt_ids:
                raise ApiError("an input is empty", param="input")
            if len(prompt_ids) > info.max_model_len:
                raise ApiError(
                    f"this model's maximum context length is {info.max_model_len} tokens; an input has "
                    f"{len(prompt_ids)}",
                    param="input",
                    code="context_length_exceeded",
                )
        tenant = tenant_of_request(request)
        vectors = await asyncio.gather(*(self._one(prompt_ids, task, tenant) for prompt_ids in ids))
        server.metrics.prompt_tokens.inc(sum(map(len, ids)))
        return list(vectors), sum(map(len, ids))

    async def _one(self, prompt_ids: list[int], task: str, tenant: str) -> list[float]:
        sampling = SamplingParams(temperature=0.0, max_tokens=1, pooling=task)
        outputs = self.server.client.generate(uuid.uuid4().hex, prompt_ids, sampling, time.time(), tenant, 0, tenant)
        outcome = "abort"
        try:
            async for output in outputs:
                if output.error is not None:
                    outcome = "error"
                    raise engine_error(output, ready=self.server.client.info is not None)
                if output.finished and output.pooled is not None:
                    outcome = "stop"
                    return output.pooled
            raise ApiError("the request ended without a result", status=500, type="server_error")
        finally:
            await outputs.aclose()
            self.server.metrics.requests.labels("pooling", outcome).inc()

    def _model(self, body: dict[str, Any]) -> str:
        model = body.get("model")
        return model if isinstance(model, str) else self.server.model_name

    def _listing(self, kind: str, body: dict[str, Any], data: list[Any], tokens: int) -> dict[str, Any]:
        created = int(time.time())
        return {"id": f"{kind}-{uuid.uuid4().hex}", "object": "list", "created": created, "model": self._model(body),
                "data": data, "usage": _usage(tokens)}  # fmt: skip

    async def _answer(self, content: dict[str, Any], vectors: list[list[float]]) -> Response:
        """As the app answers a large completion: encoded in pieces off the event loop past so many values."""
        if sum(map(len, vectors)) <= LARGE_RESPONSE_ENTRIES:
            return JSONResponse(content)
        return Response(await asyncio.to_thread(encode_in_pieces, content), media_type="application/json")


def _inputs(value: Any, param: str) -> list[Prompt]:
    """OpenAI's `input`: a text, a list of texts, a list of token ids, or a list of lists of them."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        if all(type(item) is int for item in value):
            return [value]
        if all(isinstance(item, str) for item in value):
            return list(value)
        if all(isinstance(item, list) and item and all(type(t) is int for t in item) for item in value):
            return list(value)
    raise ApiError(f"{param} must be a text, a list of texts, or token ids (a list, or a list of lists)", param=param)


def _texts(value: Any, param: str) -> list[str]:
    if not isinstance(value, list) or not value or not all(isinstance(item, str) for item in value):
        raise ApiError(f"{param} must be a non-empty list of texts", param=param)
    return value


def _check_dimensions(spec: PoolingSpec, dimensions: Any) -> None:
    if type(dimensions) is not int or dimensions < 1:
        raise ApiError("dimensions must be a positive integer", param="dimensions")
    if spec.any_dimensions and dimensions <= spec.hidden_size:
        return
    if dimensions in spec.matryoshka_dimensions:
        return
    sizes = f"; it supports {spec.matryoshka_dimensions}" if spec.matryoshka_dimensions else ""
    raise ApiError(
        f"this model does not support dimensions={dimensions} (Matryoshka representation){sizes}",
        param="dimensions",
    )


def _cut(vector: list[float], size: int, normalize: bool) -> list[float]:
    kept = vector[:size]
    if not normalize:
        return kept
    norm = math.sqrt(sum(x * x for x in kept)) or 1.0
    return [x / norm for x in kept]


def _base64(vector: list[float]) -> str:
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


def _probabilities(logits: list[float]) -> list[float]:
    if len(logits) == 1:
        return [_sigmoid(logits[0])]
    top = max(logits)
    weights = [math.exp(x - top) for x in logits]
    total = sum(weights)
    return [w / total for w in weights]


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


def _cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    norms = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return dot / norms if norms else 0.0


def _usage(tokens: int) -> dict[str, int]:
    return {"prompt_tokens": tokens, "total_tokens": tokens}
