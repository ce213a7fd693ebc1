"""The OpenAI-compatible HTTP gateway: validate, tokenize, hand over to the scheduler, stream back."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from services.api.adapters import Adapters
from services.api.detokenizer import IncrementalDetokenizer
from services.api.engine_group import EngineGroup
from services.api.errors import ApiError
from services.api.formats import ChatFormat, Chunk, CompletionFormat, ResponseFormat
from services.api.json_body import JsonBodies
from services.api.large_json import encode_in_pieces
from services.api.metrics import ApiMetrics
from services.api.reasoning import REASONING_PARSERS, ThinkTags
from services.api.requests import (
    GenerationRequest,
    parse_chat,
    parse_completion,
    parse_load_lora_adapter,
    parse_unload_lora_adapter,
)
from services.api.response_store import ResponseStore
from services.api.streams import DISCONNECTED, collect_chunks, first_chunk, merged_streams, prepend, unless_disconnected
from services.api.structured import GrammarCompiler
from services.api.tools import TOOL_CALL_PARSERS, ToolCallParser
from services.api.utility import tenant_of_request
from shared.config import ApiConfig, LoraConfig
from shared.lora import LoraError
from shared.protocol import RequestOutput
from shared.sampling import InvalidParameter

LARGE_RESPONSE_ENTRIES = 2048  # tokens and top logprobs: about a millisecond to encode
LARGE_RESPONSE_CHARS = 1 << 20  # characters of text (an echoed prompt, many choices): a millisecond or so
TOKENIZE_OFF_LOOP_CHARS = 4096  # about a millisecond to tokenize; longer texts go to a thread

log = logging.getLogger(__name__)
access_log = logging.getLogger("pagedserve.access")


class OpenAIServer:
    def __init__(
        self,
        client: EngineGroup,
        tokenizer: Any,
        model_name: str,
        vocab_size: int,
        config: ApiConfig,
        adapters: Adapters | None = None,
    ):
        self.client = client
        self.adapters = adapters or Adapters(model_name, "", LoraConfig())
        self.max_prompts = config.max_prompts_per_request
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.vocab_size = vocab_size
        self.bodies = JsonBodies(config.max_request_body_bytes, config.request_body_timeout)
        self.metrics = ApiMetrics(client, model_name)
        self.grammars = GrammarCompiler(tokenizer, vocab_size)
        parser = config.tool_call_parser if config.enable_auto_tool_choice else None
        self.tool_parser = TOOL_CALL_PARSERS[parser]() if parser else None
        self.reasoning = REASONING_PARSERS[config.reasoning_parser] if config.reasoning_parser else None
        self.think_tags = ThinkTags.of(tokenizer) if self.reasoning is not None else ThinkTags()
        self.max_logprobs = config.max_logprobs
        self.report_cached_tokens = config.report_cached_tokens
        self.created = int(time.time())
        self.response_store = ResponseStore()  # Responses API's, kept in memory
        self.longest_token_chars = max(map(len, tokenizer.get_vocab()), default=1)

    # --- routes --------------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        generation = await self.bodies.read(request, parse_completion)
        self._admit(request, generation)
        if 1 + len(generation.more_prompts) > self.max_prompts:
            raise ApiError(
                f"the request holds {1 + len(generation.more_prompts)} prompts; at most {self.max_prompts} "
                "are accepted (--max-prompts-per-request)",
                param="prompt",
                code="too_many_prompts",
            )
        await self._compile_grammar(generation)
        first = generation.prompt if generation.prompt is not None else generation.prompt_token_ids or []
        # OpenAI's batch: a request per prompt, each with its own copy of the sampling parameters.
        batch = [generation] + [
            replace(generation, sampling=replace(generation.sampling), more_prompts=[]) for _ in generation.more_prompts
        ]
        prompts = [await self._prompt_ids(prompt) for prompt in [first, *generation.more_prompts]]
        for each, prompt_ids in zip(batch, prompts):
            self._fit_to_context(each, prompt_ids)
        echo = ""
        if generation.echo:
            echo = generation.prompt if generation.prompt is not None else self.tokenizer.decode(prompts[0])
        fmt = CompletionFormat(
            self._answering(generation),
            self.tokenizer,
            generation,
            echo,
            prompts[0] if echo else [],
            num_choices=len(prompts) * generation.sampling.n,
        )
        fmt.report_cached_tokens = self.report_cached_tokens
        chunks = [self._generate(each, prompt_ids, fmt.endpoint) for each, prompt_ids in zip(batch, prompts)]
        merged = (
            chunks[0]
            if len(chunks) == 1
            else merged_streams(chunks, generation.sampling.n, self._prompts_at_once(generation))
        )
        return await self._respond(request, generation, merged, sum(map(len, prompts)), fmt)

    def _answering(self, generation: GenerationRequest) -> str:
        """The `model` a response names: the adapter the request ran under, as vLLM answers, or the base model."""
        return generation.lora.name if generation.lora is not None else self.model_name

    def _prompts_at_once(self, generation: GenerationRequest) -> int:
        """How many of a batch's prompts are queued at the scheduler at once: what one step can run, so
        a large batch takes turns with other clients' requests instead of queueing ahead of them all."""
        info = self.client.info
        width = info.max_num_seqs if info is not None and info.max_num_seqs else 256
        return max(1, width // generation.sampling.num_samples)

    async def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return await self._tokenize(self.tokenizer.encode, prompt)

        def out_of_range() -> bool:
            return any(not 0 <= t < self.vocab_size for t in prompt)

        # A million ids take a tenth of a second to check: off the event loop.
        if await asyncio.to_thread(out_of_range) if len(prompt) > 65536 else out_of_range():
            raise ApiError(f"token ids must be in [0, {self.vocab_size})", param="prompt")
        return prompt

    async def chat_completions(self, request: Request) -> Response:
        generation = await self.bodies.read(request, parse_chat)
        return await self.chat(request, generation, ChatFormat)

    async def chat(
        self,
        request: Request,
        generation: GenerationRequest,
        format_class: Callable[[str, Any, GenerationRequest, ToolCallParser | None], ResponseFormat],
    ) -> Response:
        self._admit(request, generation)
        tools = generation.tools
        if tools is not None and tools.choice == "auto" and self.tool_parser is None:
            raise ApiError(
                "tool_choice 'auto' needs a server started with --enable-auto-tool-choice and --tool-call-parser",
                param="tool_choice",
            )
        await self._compile_grammar(generation)
        fmt = format_class(self._answering(generation), self.tokenizer, generation, self.tool_parser)
        fmt.report_cached_tokens = self.report_cached_tokens
        if fmt.splits_thinking and self.reasoning is not None:
            fmt.reasoning = self.reasoning
            if generation.sampling.grammar:
                generation.sampling.grammar = self.reasoning.after_thinking(
                    generation.sampling.grammar, self.think_tags
                )
        shown = tools.tools if tools is not None and tools.choice != "none" else None
        try:
            text = await asyncio.to_thread(
                self.tokenizer.apply_chat_template,
                generation.messages,
                tools=shown,
                add_generation_prompt=True,
                tokenize=False,
                **generation.template_kwargs,
            )
        except Exception as exc:  # templates raise whatever their authors chose
            raise ApiError(f"the chat template rejected the messages: {exc}", param="messages") from None
        prompt_ids = await self._tokenize(self.tokenizer.encode, text, add_special_tokens=False)
        self._fit_to_context(generation, prompt_ids)
        return await self._respond(
            request, generation, self._generate(generation, prompt_ids, fmt.endpoint), len(prompt_ids), fmt
        )

    async def models(self, request: Request) -> Response:
        info = self.client.info
        cards = self.adapters.cards(info.max_model_len if info else None, tenant_of_request(request))
        return JSONResponse({"object": "list", "data": [self.model_card(), *cards]})

    async def load_lora_adapter(self, request: Request) -> Response:
        name, path = await self.bodies.read(request, parse_load_lora_adapter)
        try:  # its files are read whole and checked: off the loop
            await asyncio.to_thread(self.adapters.add_at_run_time, name, path, tenant_of_request(request))
        except LoraError as exc:
            raise ApiError(str(exc), param="lora_path") from None
        log.info("LoRA adapter %r added from %s", name, path)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora_adapter(self, request: Request) -> Response:
        name = await self.bodies.read(request, parse_unload_lora_adapter)
        admin = bool(request.scope.get("state", {}).get("admin", False))
        if not self.adapters.remove(name, tenant_of_request(request), admin):
            raise ApiError(
                f"the LoRA adapter '{name}' cannot be found", status=404, param="lora_name", code="model_not_found"
            )
        log.info("LoRA adapter %r removed", name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    def model_card(self) -> dict[str, Any]:
        info = self.client.info
        return {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "pagedserve",
            "root": self.model_name,
            "max_model_len": info.max_model_len if info else None,
        }

    async def health(self, request: Request) -> Response:
        """200 while any engine serves; with several, how many of them do. 503 while none does:
        "starting" until one first serves, "unavailable" after."""
        up, engines, serving = self.client.health()
        count = {"engines_up": up, "engines": engines} if engines > 1 else {}
        if not serving:
            served = any(client.has_served for client in self.client.clients)
            return JSONResponse({"status": "unavailable" if served else "starting", **count}, status_code=503)
        return JSONResponse({"status": "ok" if up == engines else "degraded", **count})

    async def prometheus(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4")

    # --- input ---------------------------------------------------------------------------

    async def _tokenize(self, encode: Callable[..., list[int]], text: str, **kwargs: Any) -> list[int]:
        self.check_could_fit(text)
        if len(text) <= TOKENIZE_OFF_LOOP_CHARS:
            # On the loop, so the request reaches the scheduler before the next one is read: a burst's first
            # request starts at once rather than with those whose threads happen to finish beside it.
            return encode(text, **kwargs)
        # Off the event loop: a long prompt takes seconds, and the tokenizer releases the GIL.
        return await asyncio.to_thread(encode, text, **kwargs)

    def check_could_fit(self, text: str) -> None:
        """A text too long for the context whatever its tokens, refused before it is tokenized:
        tokenizing megabytes takes seconds and, in the tokenizer's buffers, a GB of memory."""
        info = self.client.info
        if info is not None and len(text) > 2 * self.longest_token_chars * info.max_model_len:
            raise ApiError(
                f"this model's maximum context length is {info.max_model_len} tokens; a text of "
                f"{len(text)} characters is longer than any prompt of that many tokens",
                param="prompt",
                code="context_length_exceeded",
            )

    # --- generation ----------------------------------------------------------------------

    def _admit(self, request: Request, generation: GenerationRequest) -> None:
        """What both generation routes check first; and whose request it is (its key's tenant)."""
        generation.tenant = tenant_of_request(request)
        generation.lora = self.adapters.resolve(generation.model, generation.tenant)
        self._check_logprobs(generation)

    def _check_logprobs(self, generation: GenerationRequest) -> None:
        wanted = max(generation.sampling.logprobs or 0, generation.sampling.prompt_logprobs or 0)
        if wanted > self.max_logprobs:
            raise ApiError(f"logprobs must be at most {self.max_logprobs} (--max-logprobs)", param="logprobs")

    async def _compile_grammar(self, generation: GenerationRequest) -> None:
        if generation.structured is not None:
            generation.sampling.grammar = await self.grammars.compile(generation.structured)

    def _fit_to_context(self, generation: GenerationRequest, prompt_ids: list[int]) -> None:
        info = self.client.info
        if info is None:  # the scheduler is (re)starting or its workers are not ready
            raise ApiError(
                "the server is not ready to generate; retry shortly", status=503, type="server_error", code="not_ready"
            )
        if info.pooling is not None:
            raise ApiError(
                "this model pools prompts (--runner pooling): it serves /v1/embeddings and the like, not text"
            )
        context = info.max_model_len
        if not prompt_ids:
            raise ApiError("the prompt is empty", param="prompt")
        if len(prompt_ids) >= context:
            raise ApiError(
                f"this model's maximum context length is {context} tokens; the prompt has {len(prompt_ids)} tokens",
                param="prompt",
                code="context_length_exceeded",
            )
        room = context - len(prompt_ids)
        max_tokens = generation.max_tokens if generation.max_tokens is not None else room
        if max_tokens > room:
            raise ApiError(
                f"this model's maximum context length is {context} tokens; the prompt has "
                f"{len(prompt_ids)} tokens and max_tokens asks for {max_tokens} more",
                param="max_tokens",
                code="context_length_exceeded",
            )
        generation.sampling.max_tokens = max_tokens
        try:
            generation.sampling.validate(self.vocab_size, info.max_num_seqs or 16)
        except InvalidParameter as exc:
            raise ApiError(str(exc), param=exc.param) from None

    async def _respond(
        self,
        request: Request,
        generation: GenerationRequest,
        chunks: AsyncIterator[Chunk],
        num_prompt: int,
        fmt: ResponseFormat,
    ) -> Response:
        if generation.stream:
            # The first chunk comes before the status line, so a request the scheduler rejects
            # gets a 4xx, never a 200 followed by an error event.
            first = await unless_disconnected(request, first_chunk(chunks))
            if first is DISCONNECTED:
                return Response(status_code=499)
            return StreamingResponse(fmt.stream(prepend(first, chunks), num_prompt), media_type="text/event-stream")
        collected = await unless_disconnected(request, collect_chunks(chunks))
        if collected is DISCONNECTED:
            return Response(status_code=499)
        # Logprobs and many choices make bodies of megabytes: built off the loop and encoded in pieces, so that the
        # loop (streams, /health) waits for one piece at most (services/api/large_json.py).
        sampling = generation.sampling
        entries = sum(len(c.token_ids) for c in collected) * (1 + (sampling.logprobs or 0))
        if sampling.prompt_logprobs is not None:
            entries += num_prompt * (1 + sampling.prompt_logprobs)
        text = sum(len(c.text) for c in collected) + len(getattr(fmt, "echo", ""))  # an echoed prompt too
        if entries > LARGE_RESPONSE_ENTRIES or text > LARGE_RESPONSE_CHARS:
            body = await asyncio.to_thread(lambda: encode_in_pieces(fmt.whole(collected, num_prompt)))
            return Response(body, media_type="application/json")
        return JSONResponse(fmt.whole(collected, num_prompt))

    async def _generate(
        self, generation: GenerationRequest, prompt_ids: list[int], endpoint: str
    ) -> AsyncIterator[Chunk]:
        """Chunks of every choice as they come; closing it early aborts the request."""
        request_id = uuid.uuid4().hex
        detokenizers = [
            IncrementalDetokenizer(
                self.tokenizer,
                prompt_ids,
                generation.stop,
                generation.skip_special_tokens,
                generation.sampling.min_tokens,
                generation.include_stop_str_in_output,
            )
            for _ in range(generation.sampling.n)
        ]
        done = [False] * len(detokenizers)
        arrival = last_output = time.monotonic()
        # A tenant's salt comes first, so that no request can name a salt that reaches another's cache.
        salt = "\0".join(filter(None, (generation.tenant, generation.cache_salt)))
        # Whose share it counts against: the key's tenant, which a client cannot claim; with one key or none the
        # deployment is one trust domain, and OpenAI's `user` field names its end users.
        tenant = generation.tenant or (f"user:{generation.user}" if generation.user else "")
        outputs = self.client.generate(
            request_id, prompt_ids, generation.sampling, time.time(), salt, generation.priority, tenant, generation.lora
        )
        outcome, first_reason = "abort", None  # the request's, and its first choice's finish reason
        first_token = None
        num_generated = 0
        try:
            async for output in outputs:
                if output.error is not None:
                    outcome = "error"
                    raise engine_error(output, ready=self.client.info is not None)
                new_tokens = sum(len(delta.token_ids) for delta in output.sequences if not done[delta.index])
                if new_tokens:
                    now = time.monotonic()
                    if num_generated == 0:
                        first_token = now - arrival
                        self.metrics.time_to_first_token.observe(first_token)
                    else:
                        gap = (now - last_output) / new_tokens
                        for _ in range(new_tokens):
                            self.metrics.time_per_output_token.observe(gap)
                    last_output = now
                for delta in output.sequences:
                    if done[delta.index]:
                        continue  # a stop string already ended this choice
                    detokenizer = detokenizers[delta.index]
                    taken = detokenizer.add(delta.token_ids)  # up to a stop string: nothing after it is emitted
                    num_generated += taken
                    reason = "stop" if detokenizer.stopped else delta.finish_reason
                    done[delta.index] = reason is not None
                    if reason is not None and delta.index == 0:
                        first_reason = reason
                    stop_reason: str | int | None = detokenizer.stop_string  # or the stop token id that ended it
                    if (
                        reason == "stop"
                        and stop_reason is None
                        and taken
                        and delta.token_ids[taken - 1] in generation.sampling.stop_token_ids
                    ):
                        stop_reason = delta.token_ids[taken - 1]
                    yield Chunk(
                        delta.index,
                        detokenizer.pending(final=reason is not None),
                        delta.token_ids[:taken],
                        delta.logprobs[:taken],
                        delta.top_logprobs[:taken],
                        reason,
                        output.num_cached_tokens,
                        output.prompt_logprobs,
                        output.prompt_top_logprobs,
                        stop_reason,
                    )
                if all(done):
                    outcome = first_reason if first_reason in ("stop", "length") else "abort"
                    self.metrics.e2e_request_latency.observe(time.monotonic() - arrival)
                    break  # closing `outputs` aborts whatever still runs and frees its blocks
        finally:
            await outputs.aclose()
            self.metrics.requests.labels(endpoint, outcome).inc()
            self.metrics.prompt_tokens.inc(len(prompt_ids))
            self.metrics.generation_tokens.inc(num_generated)
            access_log.info(
                "%s %s: %s; prompt %d tokens, generated %d; first token %s, total %.3f s",
                request_id,
                endpoint,
                outcome,
                len(prompt_ids),
                num_generated,
                "-" if first_token is None else f"{first_token:.3f} s",
                time.monotonic() - arrival,
            )


def engine_error(output: RequestOutput, ready: bool) -> ApiError:
    """The error a request the engine ended with one gets: a 400 where it was rejected, else a 503 or 500."""
    rejected = bool(output.sequences) and output.sequences[0].finish_reason == "rejected"
    message = output.error or "the request failed"
    if rejected:
        return ApiError(message)
    if not ready:
        return ApiError(message, status=503, type="server_error", code="not_ready")
    return ApiError(message, status=500, type="server_error")
