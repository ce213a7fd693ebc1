"""The OpenAI-compatible HTTP gateway: validate, tokenize, hand over to the scheduler, stream back."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from services.api.detokenizer import IncrementalDetokenizer
from services.api.engine_client import EngineClient
from services.api.errors import ApiError
from services.api.formats import ChatFormat, Chunk, CompletionFormat
from services.api.metrics import ApiMetrics
from services.api.requests import GenerationRequest, parse_chat, parse_completion

log = logging.getLogger(__name__)


class OpenAIServer:
    def __init__(self, client: EngineClient, tokenizer, model_name: str, vocab_size: int):
        self.client = client
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.vocab_size = vocab_size
        self.metrics = ApiMetrics()
        self.created = int(time.time())

    # --- routes --------------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        body = await _json_body(request)
        generation = parse_completion(body)
        self._check_model(generation.model)
        if generation.prompt is not None:
            prompt_ids = self.tokenizer.encode(generation.prompt)
        else:
            prompt_ids = generation.prompt_token_ids
            if any(not 0 <= t < self.vocab_size for t in prompt_ids):
                raise ApiError(f"token ids must be in [0, {self.vocab_size})", param="prompt")
        self._fit_to_context(generation, prompt_ids)
        return await self._respond(request, generation, prompt_ids, CompletionFormat(self.model_name, self.tokenizer, generation))

    async def chat_completions(self, request: Request) -> Response:
        body = await _json_body(request)
        generation = parse_chat(body)
        self._check_model(generation.model)
        try:
            text = self.tokenizer.apply_chat_template(
                generation.messages, add_generation_prompt=True, tokenize=False
            )
        except Exception as exc:  # templates raise whatever their authors chose
            raise ApiError(f"the chat template rejected the messages: {exc}", param="messages") from None
        prompt_ids = self.tokenizer.encode(text, add_special_tokens=False)
        self._fit_to_context(generation, prompt_ids)
        return await self._respond(request, generation, prompt_ids, ChatFormat(self.model_name, self.tokenizer, generation))

    async def models(self, request: Request) -> Response:
        info = self.client.info
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.model_name,
                        "object": "model",
                        "created": self.created,
                        "owned_by": "pagedserve",
                        "max_model_len": info.max_model_len if info else None,
                    }
                ],
            }
        )

    async def health(self, request: Request) -> Response:
        if self.client.info is None:
            return JSONResponse({"status": "starting"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def prometheus(self, request: Request) -> Response:
        stats = await self.client.stats(timeout=1.0) if self.client.info else None
        return Response(self.metrics.render(stats), media_type="text/plain; version=0.0.4")

    # --- generation ----------------------------------------------------------------------

    def _check_model(self, model: str) -> None:
        if model != self.model_name:
            raise ApiError(
                f"the model '{model}' does not exist; this server serves '{self.model_name}'",
                status=404, param="model", code="model_not_found",
            )

    def _fit_to_context(self, generation: GenerationRequest, prompt_ids: list[int]) -> None:
        info = self.client.info
        if info is None:  # the scheduler is (re)starting or its workers are not ready
            raise ApiError("the server is not ready to generate; retry shortly", status=503,
                           type="server_error", code="not_ready")
        context = info.max_model_len
        if not prompt_ids:
            raise ApiError("the prompt is empty", param="prompt")
        if len(prompt_ids) >= context:
            raise ApiError(
                f"this model's maximum context length is {context} tokens; the prompt has "
                f"{len(prompt_ids)} tokens", param="prompt", code="context_length_exceeded",
            )
        room = context - len(prompt_ids)
        max_tokens = generation.max_tokens if generation.max_tokens is not None else room
        if max_tokens > room:
            raise ApiError(
                f"this model's maximum context length is {context} tokens; the prompt has "
                f"{len(prompt_ids)} tokens and max_tokens asks for {max_tokens} more",
                param="max_tokens", code="context_length_exceeded",
            )
        generation.sampling.max_tokens = max_tokens

    async def _respond(self, request, generation, prompt_ids, fmt) -> Response:
        chunks = self._generate(generation, prompt_ids, fmt.endpoint)
        if generation.stream:
            return StreamingResponse(fmt.stream(chunks, len(prompt_ids)), media_type="text/event-stream")
        collect = asyncio.ensure_future(_collect(chunks))
        watch = asyncio.ensure_future(_wait_for_disconnect(request))
        done, _ = await asyncio.wait({collect, watch}, return_when=asyncio.FIRST_COMPLETED)
        if collect not in done:
            collect.cancel()  # the client left: closing the generator aborts the request
            return Response(status_code=499)
        watch.cancel()
        return JSONResponse(fmt.whole(collect.result(), len(prompt_ids)))

    async def _generate(
        self, generation: GenerationRequest, prompt_ids: list[int], endpoint: str
    ) -> AsyncIterator[Chunk]:
        """Chunks of every choice as they come; closing it early aborts the request."""
        request_id = uuid.uuid4().hex
        detokenizers = [
            IncrementalDetokenizer(self.tokenizer, prompt_ids, generation.stop, generation.skip_special_tokens)
            for _ in range(generation.sampling.n)
        ]
        done = [False] * len(detokenizers)
        outputs = self.client.generate(request_id, prompt_ids, generation.sampling, time.time())
        outcome = "abort"
        num_generated = 0
        try:
            async for output in outputs:
                if output.error is not None:
                    outcome = "error"
                    raise _engine_error(output)
                for delta in output.sequences:
                    if done[delta.index]:
                        continue  # a stop string already ended this choice
                    detokenizer = detokenizers[delta.index]
                    detokenizer.add(delta.token_ids)
                    num_generated += len(delta.token_ids)
                    reason = "stop" if detokenizer.stopped else delta.finish_reason
                    done[delta.index] = reason is not None
                    yield Chunk(delta.index, detokenizer.pending(final=reason is not None), delta.token_ids,
                                delta.logprobs, delta.top_logprobs, reason, output.num_cached_tokens)
                if all(done):
                    outcome = "finished"
                    break  # closing `outputs` aborts whatever still runs and frees its blocks
        finally:
            await outputs.aclose()
            self.metrics.requests.labels(endpoint, outcome).inc()
            self.metrics.prompt_tokens.inc(len(prompt_ids))
            self.metrics.generation_tokens.inc(num_generated)


def _engine_error(output) -> ApiError:
    rejected = bool(output.sequences) and output.sequences[0].finish_reason == "rejected"
    if rejected:
        return ApiError(output.error)
    return ApiError(output.error, status=500, type="server_error")


async def _collect(chunks: AsyncIterator[Chunk]) -> list[Chunk]:
    return [chunk async for chunk in chunks]


async def _wait_for_disconnect(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(0.25)


async def _json_body(request: Request) -> object:
    raw = await request.body()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(f"the body is not valid JSON: {exc}", code="invalid_json") from None


def build_app(client: EngineClient, tokenizer, model_name: str, vocab_size: int) -> Starlette:
    server = OpenAIServer(client, tokenizer, model_name, vocab_size)

    @asynccontextmanager
    async def lifespan(app):
        await client.start()
        log.info("scheduler ready; serving %s", model_name)
        yield
        await client.close()

    async def on_api_error(request: Request, exc: ApiError) -> Response:
        return exc.response()

    routes = [
        Route("/v1/completions", server.completions, methods=["POST"]),
        Route("/v1/chat/completions", server.chat_completions, methods=["POST"]),
        Route("/v1/models", server.models, methods=["GET"]),
        Route("/health", server.health, methods=["GET"]),
        Route("/metrics", server.prometheus, methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={ApiError: on_api_error})
    app.state.server = server
    return app
