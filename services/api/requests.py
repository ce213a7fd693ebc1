"""Parse and validate OpenAI request bodies into what the engine needs, or raise `ApiError`."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from services.api.errors import ApiError
from services.api.json_body import json_value
from services.api.structured import GrammarSpec, parse_structured
from services.api.tools import ToolUse, parse_tool_use
from shared.protocol import MAX_CACHE_SALT_CHARS, PRIORITY_LIMIT, LoraRef
from shared.sampling import MAX_TOKENS_LIMIT, InvalidParameter, SamplingParams

log = logging.getLogger(__name__)

_NUMBER = (int, float)
# Fields that would change the output and are not served: a 400, never silently ignored.
_UNSUPPORTED_IF_SET = {
    "suffix": None,
    "functions": None,  # OpenAI's older form of tools
    "function_call": None,
    "audio": None,
    "modalities": ["text"],
}
# Fields read elsewhere, or accepted as OpenAI and vLLM accept them without effect on the output.
MAX_STOP_STRINGS = 256  # OpenAI takes 4
MAX_STOP_STRING_CHARS = 256
MAX_USER_CHARS = 256
_KNOWN = {
    "model",
    "prompt",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "n",
    "best_of",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "stream",
    "stream_options",
    "logprobs",
    "top_logprobs",
    "echo",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "logit_bias",
    "ignore_eos",
    "skip_special_tokens",
    "return_token_ids",
    "use_beam_search",
    "length_penalty",
    "early_stopping",
    "include_stop_str_in_output",
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    *_UNSUPPORTED_IF_SET,
    "user",
    "store",
    "metadata",
    "service_tier",
    "guided_decoding_backend",
    "spaces_between_special_tokens",
    "add_generation_prompt",
    "chat_template_kwargs",
    "prompt_logprobs",
    "priority",
    "request_id",
    "cache_salt",
}


@dataclass(slots=True)
class GenerationRequest:
    model: str | None
    sampling: SamplingParams
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    more_prompts: list[str | list[int]] = field(default_factory=list)  # completions: OpenAI's batch, after the first
    messages: list[dict[str, Any]] | None = None
    max_tokens: int | None = None  # None: whatever context is left after the prompt
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage in every chunk
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    return_token_ids: bool = False  # extension: each choice also lists its token ids
    echo: bool = False  # completions: each choice's text starts with the prompt
    structured: GrammarSpec | None = None  # what the output must match; compiled into sampling.grammar
    tools: ToolUse | None = None  # chat: the functions the model may call, and how
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # chat: chat_template_kwargs, for the template
    cache_salt: str = ""  # vLLM's: only requests with the same salt (and tenant) share prefix-cache blocks
    tenant: str = ""  # set by the api from the request's key, when --api-key names several
    user: str = ""  # OpenAI's end-user id: the tenant under --scheduling-policy fair when the key names none
    priority: int = 0  # vLLM's: under --scheduling-policy priority, lower runs first
    lora: LoraRef | None = None  # the adapter `model` names, resolved by the api; None: the base model


class _Body:
    """Typed access to a JSON object's fields, each failure naming its field."""

    def __init__(self, body: object):
        if not isinstance(body, dict):
            raise ApiError("the request body must be a JSON object")
        self.body = body

    def get(self, name: str, types: type | tuple[type, ...], default: Any = None, what: str = "") -> Any:
        value = self.body.get(name, default)
        if value is None:
            return default
        if isinstance(value, bool) and bool not in _as_tuple(types):
            raise _type_error(name, what or _describe(types))
        if not isinstance(value, types):
            raise _type_error(name, what or _describe(types))
        return value

    def number(self, name: str, default: float) -> float:
        value = self.get(name, _NUMBER, default, what="a number")
        try:
            return float(value)
        except OverflowError:  # an integer too large for a float
            raise ApiError(f"'{name}' is out of range", param=name) from None


def parse_completion(body: object) -> GenerationRequest:
    fields = _Body(body)
    if fields.body.get("tools") is not None:
        raise ApiError("'tools' is for /v1/chat/completions", param="tools", code="unsupported_parameter")
    request = _common(fields, default_max_tokens=16)
    prompts = _prompts(fields.body.get("prompt"))
    first, request.more_prompts = prompts[0], prompts[1:]
    if isinstance(first, str):
        request.prompt = first
    else:
        request.prompt_token_ids = first
    logprobs = fields.get("logprobs", int, what="an integer")
    request.sampling.logprobs = logprobs
    request.echo = fields.get("echo", bool, False, what="a boolean")
    if request.echo and request.more_prompts:
        raise ApiError("echo is served for one prompt at a time", param="echo", code="unsupported_parameter")
    if request.echo and logprobs is not None:
        request.sampling.prompt_logprobs = logprobs  # the prompt's tokens come back with theirs
    _validate(request)
    return request


def _prompts(prompt: object) -> list[str | list[int]]:
    """OpenAI's prompt: a string, token ids, or a non-empty list of either (one request each)."""
    if prompt is None:
        raise ApiError("'prompt' is required", param="prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt)):
        prompts = [prompt]
    elif (
        isinstance(prompt, list)
        and prompt
        and (
            all(isinstance(p, str) for p in prompt)
            or all(isinstance(p, list) and all(_is_int(t) for t in p) for p in prompt)
        )
    ):
        prompts = prompt
    elif isinstance(prompt, list) and not prompt:
        raise ApiError("the prompt is empty", param="prompt")
    else:
        raise _type_error("prompt", "a string, a list of token ids, or a list of strings or of token id lists")
    if any(len(p) == 0 for p in prompts):
        raise ApiError("the prompt is empty", param="prompt")
    return prompts


def parse_load_lora_adapter(body: object) -> tuple[str, str]:
    """`/v1/load_lora_adapter`'s body, as vLLM's: the adapter's name and directory."""
    fields = _Body(body)
    return _required_string(fields, "lora_name"), _required_string(fields, "lora_path")


def parse_unload_lora_adapter(body: object) -> str:
    return _required_string(_Body(body), "lora_name")


def _required_string(fields: _Body, name: str) -> str:
    value: str = fields.get(name, str, what="a string")
    if not value:
        raise ApiError(f"'{name}' is required", param=name)
    return value


def parse_chat(body: object) -> GenerationRequest:
    fields = _Body(body)
    messages = fields.get("messages", list, what="a list of messages")
    if not messages:
        raise ApiError("'messages' must be a non-empty list", param="messages")
    request = _common(fields, default_max_tokens=None, max_tokens_alias="max_completion_tokens")
    request.messages = [_message(m, i) for i, m in enumerate(messages)]
    request.tools = parse_tool_use(fields.body)
    request.template_kwargs = _template_kwargs(fields)
    forced = request.tools.forced() if request.tools is not None else None
    if forced is not None and request.tools is not None:
        if request.structured is not None:
            raise ApiError(
                f"tool_choice '{request.tools.choice}' and '{request.structured.param}' both constrain "
                "the output; set one",
                param=request.structured.param,
            )
        request.structured = forced
    if fields.get("logprobs", bool, False, what="a boolean"):
        request.sampling.logprobs = fields.get("top_logprobs", int, 0, what="an integer")
    _validate(request)
    return request


# What the api itself passes to the template, or what would change how it renders rather than what it reads.
_TEMPLATE_OWN_ARGUMENTS = {
    "conversation",
    "messages",
    "tools",
    "documents",
    "chat_template",
    "tokenize",
    "add_generation_prompt",
    "continue_final_message",
    "return_dict",
    "return_assistant_tokens_mask",
    "tokenizer_kwargs",
}


def _template_kwargs(fields: _Body) -> dict[str, Any]:
    """vLLM's chat_template_kwargs: variables for the chat template (Qwen3's enable_thinking, say)."""
    kwargs = fields.get("chat_template_kwargs", dict, {}, what="an object")
    taken = sorted(name for name in kwargs if name in _TEMPLATE_OWN_ARGUMENTS)
    if taken:
        raise ApiError(
            f"chat_template_kwargs may not set {', '.join(taken)}: the server sets it", param="chat_template_kwargs"
        )
    return dict(kwargs)


def _common(fields: _Body, default_max_tokens: int | None, max_tokens_alias: str = "") -> GenerationRequest:
    model = fields.get("model", str, what="a string")  # None: the one model this server serves, as vLLM
    for name, neutral in _UNSUPPORTED_IF_SET.items():
        value = fields.body.get(name)
        if value is not None and value != neutral:
            raise ApiError(f"'{name}' is not supported", param=name, code="unsupported_parameter")
    ignored = sorted(name for name in fields.body if name not in _KNOWN)
    if ignored:  # as vLLM: served, and the log names what had no effect
        log.warning("request fields ignored: %s", ", ".join(repr(name[:64]) for name in ignored[:20]))
    max_tokens = fields.get("max_tokens", int, what="an integer")
    if max_tokens is None and max_tokens_alias:
        max_tokens = fields.get(max_tokens_alias, int, what="an integer")
    if max_tokens is None:
        max_tokens = default_max_tokens
    stop = fields.body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    elif stop is None:
        stop = []
    elif not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise _type_error("stop", "a string or a list of strings")
    if any(not s for s in stop):
        raise ApiError("stop strings must not be empty", param="stop")
    # Each new token is searched for every stop string, in the last longest-stop-string characters.
    if len(stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_STRING_CHARS for s in stop):
        raise ApiError(
            f"at most {MAX_STOP_STRINGS} stop strings of at most {MAX_STOP_STRING_CHARS} characters each are accepted",
            param="stop",
        )
    stream_options = fields.get("stream_options", dict, {}, what="an object")
    stop_token_ids = fields.get("stop_token_ids", list, [], what="a list of token ids")
    if not all(_is_int(t) for t in stop_token_ids):
        raise _type_error("stop_token_ids", "a list of token ids")
    sampling = SamplingParams(
        n=fields.get("n", int, 1, what="an integer"),
        temperature=fields.number("temperature", 1.0),
        top_p=fields.number("top_p", 1.0),
        top_k=fields.get("top_k", int, -1, what="an integer"),
        min_p=fields.number("min_p", 0.0),
        seed=fields.get("seed", int, what="an integer"),
        max_tokens=max_tokens or MAX_TOKENS_LIMIT,  # the real value is set once the prompt is tokenized
        presence_penalty=fields.number("presence_penalty", 0.0),
        frequency_penalty=fields.number("frequency_penalty", 0.0),
        repetition_penalty=fields.number("repetition_penalty", 1.0),
        min_tokens=fields.get("min_tokens", int, 0, what="an integer"),
        logit_bias=_logit_bias(fields),
        stop_token_ids=stop_token_ids,
        ignore_eos=fields.get("ignore_eos", bool, False, what="a boolean"),
        best_of=fields.get("best_of", int, what="an integer"),
        use_beam_search=fields.get("use_beam_search", bool, False, what="a boolean"),
        length_penalty=fields.number("length_penalty", 1.0),
        early_stopping=fields.get("early_stopping", (bool, str), False, what='a boolean or "never"'),
    )
    return GenerationRequest(
        model=model,
        sampling=sampling,
        max_tokens=max_tokens,
        stop=stop,
        stream=fields.get("stream", bool, False, what="a boolean"),
        include_usage=bool(stream_options.get("include_usage", False)),
        continuous_usage=bool(stream_options.get("continuous_usage_stats", False)),
        include_stop_str_in_output=fields.get("include_stop_str_in_output", bool, False, what="a boolean"),
        skip_special_tokens=fields.get("skip_special_tokens", bool, True, what="a boolean"),
        return_token_ids=fields.get("return_token_ids", bool, False, what="a boolean"),
        structured=parse_structured(fields.body),
        cache_salt=_cache_salt(fields),
        user=_user(fields),
        priority=_priority(fields),
    )


def _cache_salt(fields: _Body) -> str:
    salt: str = fields.get("cache_salt", str, "", what="a string")
    if "cache_salt" in fields.body and not salt:
        raise ApiError("cache_salt must be a non-empty string", param="cache_salt")
    if len(salt) > MAX_CACHE_SALT_CHARS // 2:
        raise ApiError(f"cache_salt must be at most {MAX_CACHE_SALT_CHARS // 2} characters", param="cache_salt")
    return salt


def _user(fields: _Body) -> str:
    user: str = fields.get("user", str, "", what="a string")
    if len(user) > MAX_USER_CHARS:
        raise ApiError(f"user must be at most {MAX_USER_CHARS} characters", param="user")
    return user


def _priority(fields: _Body) -> int:
    priority: int = fields.get("priority", int, 0, what="an integer")
    if not -PRIORITY_LIMIT <= priority < PRIORITY_LIMIT:
        raise ApiError(f"priority must be an integer in [{-PRIORITY_LIMIT}, {PRIORITY_LIMIT})", param="priority")
    return priority


def _logit_bias(fields: _Body) -> dict[int, float]:
    """OpenAI's logit_bias: token ids as JSON object keys (strings), biases as numbers."""
    raw = fields.get("logit_bias", dict, {}, what="an object mapping token ids to biases")
    bias = {}
    for key, value in raw.items():
        try:
            token = int(key)
        except ValueError:
            raise ApiError(f"logit_bias keys must be token ids, not {key[:40]!r}", param="logit_bias") from None
        if isinstance(value, bool) or not isinstance(value, _NUMBER):
            raise _type_error("logit_bias", "an object mapping token ids to numbers")
        try:
            bias[token] = float(value)
        except OverflowError:
            raise ApiError("logit_bias values must be numbers in [-100, 100]", param="logit_bias") from None
    return bias


def _validate(request: GenerationRequest) -> None:
    if request.max_tokens is not None and request.max_tokens < 1:
        raise ApiError("max_tokens must be at least 1", param="max_tokens")
    try:
        request.sampling.validate()
    except InvalidParameter as exc:
        raise ApiError(str(exc), param=exc.param) from None
    if request.structured is not None and request.sampling.use_beam_search:
        raise ApiError("structured outputs are not supported with beam search", param=request.structured.param)


def _message(message: object, index: int) -> dict[str, Any]:
    where = f"messages[{index}]"
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise _type_error(where, "an object with a 'role' string")
    content = message.get("content")
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(f"{where}.content: only text parts are supported", param=f"{where}.content")
            parts.append(part["text"])
        content = "".join(parts)
    if content is None:
        content = ""
    if not isinstance(content, str):
        raise _type_error(f"{where}.content", "a string or a list of text parts")
    kept = {"role": message["role"], "content": content}
    if isinstance(message.get("tool_call_id"), str):
        kept["tool_call_id"] = message["tool_call_id"]
    if isinstance(message.get("name"), str):
        kept["name"] = message["name"]
    if message.get("tool_calls") is not None:
        kept["tool_calls"] = _tool_calls(message["tool_calls"], where)
    return kept


def _tool_calls(calls: object, where: str) -> list[dict[str, Any]]:
    """An assistant message's earlier calls, their arguments as objects: chat templates index into them."""
    if not isinstance(calls, list):
        raise _type_error(f"{where}.tool_calls", "a list of tool calls")
    kept = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise _type_error(
                f"{where}.tool_calls", "a list of {'type': 'function', 'function': {'name', 'arguments'}}"
            )
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json_value(arguments)
            except ValueError:
                raise ApiError(f"{where}.tool_calls: arguments must be JSON", param=f"{where}.tool_calls") from None
        kept.append(
            {
                "id": call.get("id", ""),
                "type": "function",
                "function": {"name": function["name"], "arguments": arguments},
            }
        )
    return kept


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _as_tuple(types: type | tuple[type, ...]) -> tuple[type, ...]:
    return types if isinstance(types, tuple) else (types,)


def _describe(types: type | tuple[type, ...]) -> str:
    return " or ".join(t.__name__ for t in _as_tuple(types))


def _type_error(name: str, what: str) -> ApiError:
    return ApiError(f"'{name}' must be {what}", param=name, code="invalid_type")
