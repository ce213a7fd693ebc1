"""Every message the processes exchange, and the msgpack codec that carries them.

A frame is ``[PROTOCOL_VERSION, tag, field_1, field_2, ...]``. Nested messages travel as
lists of their fields in declaration order. Decoding checks the version, the tag, the number
of fields and the type of every field, so a malformed frame raises `ProtocolError` and never
reaches a handler half-built. Nothing here is ever pickled.

    api ──AddRequest/Abort/Hello/Ping──▶ scheduler ──Step/Reset/Shutdown──▶ worker ranks
        ◀──RequestOutputs/SchedulerInfo/Unavailable/Pong── ◀──Ready/StepResult──
"""

from __future__ import annotations

import types
import typing
from dataclasses import MISSING, dataclass, field, fields, is_dataclass

import msgpack

from shared.frame_limits import MAX_FRAME_BYTES, ContainerBudget, ProtocolError, frame_tag
from shared.sampling import SamplingParams

# 2: a step verifies proposed tokens, a result lists the tokens each sequence keeps; 3: grammars;
# 4: the worker makes every proposal, and may settle where an entry starts; 5: the scheduler says
# whether the worker keeps a sequence's samples; 6: a request's priority and tenant; 7: a step's block
# moves are one list of transfers between tiers; 8: a disk tier; 9: a result times its transfers; 10: a failed
# step's result names the sequences whose inputs failed it, and an adapter is known by its files' digest;
# 11: a Shutdown may ask for a restart, and reads from disk run off the step; 12: pooling models; 13: prefill/decode
# disaggregation: a request's KV handed from a prefill engine to a decode engine
PROTOCOL_VERSION = 13


# --- api <-> scheduler -------------------------------------------------------------------


@dataclass(slots=True)
class Hello:
    """The api introduces itself; the scheduler answers with `SchedulerInfo` once workers are up."""

    api_id: str


MAX_LABELS = 1024  # a classifier's labels that are named to the api


@dataclass(slots=True)
class PoolingSpec:
    """What a pooling model (`--runner pooling`) gives for a prompt: the hidden state at its last token, the
    mean over its tokens, or at its first (`pooling_type` LAST, MEAN, CLS), L2-normalized or not; a
    classifier's head applied to that for "classify" requests."""

    pooling_type: str
    normalize: bool
    hidden_size: int
    num_labels: int = 0  # 0: no classifier head
    labels: list[str] = field(default_factory=list)  # each label's name, in order (config.json's id2label)
    matryoshka_dimensions: list[int] = field(default_factory=list)  # sizes it may be cut to; [] with `any_dimensions`
    any_dimensions: bool = False  # config.json's is_matryoshka without a list: any size up to hidden_size

    @property
    def needs_every_token(self) -> bool:
        """Whether every prompt position must be computed (none taken from the prefix cache)."""
        return self.pooling_type != "LAST"


@dataclass(slots=True)
class SchedulerInfo:
    """Sent when the workers are ready: the api serves from then on."""

    block_size: int
    num_gpu_blocks: int
    max_model_len: int
    max_num_batched_tokens: int
    eos_token_ids: list[int]
    max_num_seqs: int = 0
    pooling: PoolingSpec | None = None  # None: the model generates


@dataclass(slots=True)
class Ping:
    """The api's heartbeat: a scheduler whose loop runs answers at once with `Pong`."""

    sent: float


@dataclass(slots=True)
class Pong:
    """Also the engine's load, for an api that routes among several engines."""

    sent: float  # the Ping's
    running: int = 0  # requests running or swapped out
    waiting: int = 0  # requests waiting for their first step
    kv_usage: float = 0.0  # share of the device's KV blocks in use
    cached_prefixes: list[bytes] = field(default_factory=list)  # routing keys its prefix cache holds, cut short


@dataclass(slots=True)
class Unavailable:
    """The workers were lost (gone, hung, or failed), or the scheduler is stopping: the api answers 503
    until the next `SchedulerInfo`."""

    reason: str
    stopping: bool = False  # the scheduler itself stops (a signal): its going away is no failure


MAX_CACHE_SALT_CHARS = 1024
MAX_TENANT_CHARS = 300  # "user:" and OpenAI's `user` field, whose length the api bounds lower
PRIORITY_LIMIT = 2**31  # a request's priority is in [-PRIORITY_LIMIT, PRIORITY_LIMIT)


@dataclass(slots=True)
class LoraRef:
    """The LoRA adapter a request runs under, as the api checked it (shared/lora.py): its name (what clients call
    it), its directory, what sizes its pages, and the digest of its files. The digest is its identity: the
    worker's copy, its pages and the prefix cache's salt are keyed by it, so that a name loaded again with other
    files is another adapter, sharing nothing with the first."""

    name: str
    path: str
    rank: int
    targets: list[str]  # projections it changes, in shared.lora.PROJECTIONS order
    digest: str = ""

    @property
    def key(self) -> str:
        return self.digest or self.name


@dataclass(slots=True)
class KVHandoff:
    """Where a decode engine fetches a prompt's KV blocks computed by a prefill engine: the prefill worker's KV
    server, the one-time token that names this request's blocks there, and those blocks, one per `block_size`
    prompt tokens in order. `layout` names the cache's shape and dtype: a fetch across layouts is refused."""

    address: str
    token: bytes
    block_ids: list[int]
    block_size: int
    layout: str


@dataclass(slots=True)
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_time: float
    cache_salt: str = ""  # the root of its prefix-cache keys: only requests with the same salt share blocks
    priority: int = 0  # under --scheduling-policy priority: lower runs first
    tenant: str = ""  # whose share it counts against under --scheduling-policy fair (services/scheduler/policy.py)
    lora: LoraRef | None = None  # None: the base model
    # Prefill/decode disaggregation: `kv_send` (to a prefill engine) keeps the prompt's blocks once the request
    # ends, for a decode engine to fetch, and its last output says where (`RequestOutput.kv_handoff`); `kv_source`
    # (to a decode engine) fetches the blocks it lacks from there before it computes the rest.
    kv_send: bool = False
    kv_source: KVHandoff | None = None


@dataclass(slots=True)
class Abort:
    request_ids: list[str]


@dataclass(slots=True)
class SequenceDelta:
    """What one sequence of a request produced since the last output."""

    index: int
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, float]]
    finish_reason: str | None  # stop | length | abort | rejected | error; None while running


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    num_prompt_tokens: int
    sequences: list[SequenceDelta]
    finished: bool
    error: str | None = None
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache
    # With SamplingParams.prompt_logprobs, once: each prompt token's log-probability from the
    # second on, and its alternatives.
    prompt_logprobs: list[float] | None = None
    prompt_top_logprobs: list[dict[int, float]] | None = None
    pooled: list[float] | None = None  # a pooling request's vector (SamplingParams.pooling)
    kv_handoff: KVHandoff | None = None  # with AddRequest.kv_send, once it ended: where its blocks are held


@dataclass(slots=True)
class RequestOutputs:
    outputs: list[RequestOutput]


# --- scheduler <-> worker ----------------------------------------------------------------


@dataclass(slots=True)
class Ready:
    """A worker rank is loaded and reports what the scheduler must know about it."""

    rank: int
    world_size: int
    num_gpu_blocks: int
    num_cpu_blocks: int
    block_size: int
    max_model_len: int
    eos_token_ids: list[int]
    block_bytes: int
    swap_bytes_per_second: float  # measured host<->device copy rate
    prefill_tokens_per_second: float  # measured at start-up on a dummy prompt
    vocab_size: int = 0
    device: str = "cpu"  # the device type its KV cache lives on: cpu or cuda
    drafts: str = ""  # how it proposes tokens to verify: its --speculative-config's method, or "" for none
    num_host_cache_blocks: int = 0  # host memory for offloaded prefix blocks, after the swap space's
    disk_fingerprint: str = ""  # with --kv-cache-dir: the folder its files are under (model, dtype, layout)
    # With --enable-lora: values of the model's dtype one layer's keys (or values) in one KV block take, the
    # room a page of an adapter has per layer and half; and this rank's (in, out) of each projection an adapter
    # may change. 0 and {} where this model serves no adapters.
    lora_half_elements: int = 0
    lora_dims: dict[str, list[int]] = field(default_factory=dict)
    pooling: PoolingSpec | None = None  # with --runner pooling
    kv_address: str = ""  # with --kv-transfer-config as a producer: where its KV server answers fetches
    kv_layout: str = ""  # the KV cache's layers, block shape and dtype, which a fetch must match


@dataclass(slots=True)
class NewSequence:
    """Sent once when a sequence is first scheduled (again after a recompute preemption)."""

    seq_id: int
    token_ids: list[int]  # prompt, plus outputs so far when it is recomputed
    num_prompt_tokens: int
    sampling: SamplingParams
    index: int  # which sample of its request (seeds its draws)
    lora: str = ""  # the key of the adapter it runs under (loaded by a LoraLoad of this or an earlier step); "": none


@dataclass(slots=True)
class LoraLoad:
    """Read an adapter from its directory into these device blocks (its pages), in their order; the files must
    still be those of `key` (LoraRef.key)."""

    name: str
    path: str
    pages: list[int]
    key: str = ""


@dataclass(slots=True)
class Fork:
    """A new sequence that starts as a copy of another: its tokens and its block table."""

    seq_id: int
    parent_seq_id: int
    index: int


@dataclass(slots=True)
class ScheduledSequence:
    """One sequence's share of a step: compute `num_tokens` positions starting at `start`.

    The last `num_draft_tokens` of them are proposals to verify, which follow the sequence's last
    token and which the worker makes itself (prompt lookup or a draft model); it may find fewer
    and then computes fewer positions. The result lists the proposals the target model agrees
    with, and one token after them. An entry planned while a step that verifies proposals was in
    flight cannot know how many that step keeps: with `start_at_end`, the worker starts it at
    its own copy's last token (`num_tokens` still counts that token and the drafts)."""

    seq_id: int
    start: int
    num_tokens: int
    # Tokens the worker lacks. The worker appends what it samples to its own copy where
    # `worker_keeps_samples` says so (a plain decode then sends none); beams and forked samples
    # get theirs here.
    appended_token_ids: list[int]
    table_start: int  # the worker's block table keeps entries before this index...
    block_ids: list[int]  # ...and these replace the rest
    num_draft_tokens: int = 0
    start_at_end: bool = False
    # The scheduler's decision (`SamplingParams.worker_keeps_samples`), sent so the two never differ.
    worker_keeps_samples: bool = True


DEVICE, HOST, DISK = 0, 1, 2  # the tiers a KV block lives in: the device's pool, host memory, files


@dataclass(slots=True)
class BlockTransfer:
    """Copy one KV block, every layer's keys and values, from one tier's block to another's (or within
    the device: a copy-on-write). On disk a block is a file named by its prefix-cache key (its block
    number is unused): written from the device, read into host memory."""

    src_tier: int
    src_block: int
    dst_tier: int
    dst_block: int
    key: bytes = b""


@dataclass(slots=True)
class KVExport:
    """Blocks a prefill worker's KV server hands out to whoever presents `token` (until the export ends)."""

    token: bytes
    block_ids: list[int]


@dataclass(slots=True)
class RemoteLoad:
    """Fetch blocks `src_blocks` of a prefill engine's export (`source`) into this worker's `dst_blocks`, off the
    step; a later result reports it loaded or failed."""

    load_id: int
    source: KVHandoff
    src_blocks: list[int]
    dst_blocks: list[int]


@dataclass(slots=True)
class Step:
    """Applied in field order: forks, drops, new sequences, block transfers (in list order), adapter loads,
    then the forward."""

    step_id: int
    forks: list[Fork]
    finished_seq_ids: list[int]  # the worker drops its state for these
    preempted_seq_ids: list[int]
    new_sequences: list[NewSequence]
    scheduled: list[ScheduledSequence]
    transfers: list[BlockTransfer] = field(default_factory=list)
    lora_loads: list[LoraLoad] = field(default_factory=list)
    # Prefill/decode disaggregation, applied before the forward: exports ended (their blocks may be reused from
    # this step on), exports begun, and fetches to start.
    kv_export_ends: list[bytes] = field(default_factory=list)
    kv_exports: list[KVExport] = field(default_factory=list)
    remote_loads: list[RemoteLoad] = field(default_factory=list)


@dataclass(slots=True)
class SampledTokens:
    """The tokens a step gives a sequence, in order: its next token, or the proposals the target
    model accepted and the token it samples after them. A request that forks (n > 1) gets one
    entry of one token per sample."""

    seq_id: int
    token_ids: list[int]
    logprobs: list[float]  # each 0.0 where the request reads none (`SamplingParams.needs_logprobs`)
    top_ids: list[list[int]]  # per token its alternatives; [] where none are asked for
    top_logprobs: list[list[float]]
    num_proposed: int = 0  # proposals the step verified for it (those it kept are all but the last token)


@dataclass(slots=True)
class PromptLogprobs:
    """Log-probabilities of prompt tokens `start`, `start` + 1, ... of a sequence, computed in a step."""

    seq_id: int
    start: int
    logprobs: list[float]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


@dataclass(slots=True)
class PooledOutput:
    """A pooling sequence's vector, once the step computed its prompt's last token."""

    seq_id: int
    values: list[float]


@dataclass(slots=True)
class StepResult:
    step_id: int
    sampled: list[SampledTokens]
    forward_ms: float
    sample_ms: float
    error: str | None = None  # the whole step failed; the worker forgot every sequence
    failures: dict[int, str] = field(default_factory=dict)  # seq_id -> why the worker refused it
    idle_ms: float = 0.0  # the worker's wait between sending its previous result and getting this step
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)
    # Keys of reads from disk done since the last result (started by this step or an earlier one: they run off
    # the step), whole, and failed (a missing, torn or foreign file: those blocks are computed again). With tensor
    # parallelism rank 0 checks every rank's file.
    reads: list[bytes] = field(default_factory=list)
    failed_reads: list[bytes] = field(default_factory=list)
    transfer_ms: float = 0.0  # of forward_ms (or alone, in a step that computes nothing): the block transfers
    culprits: list[int] = field(default_factory=list)  # with `error`: the sequences whose inputs failed the step
    pooled: list[PooledOutput] = field(default_factory=list)
    loaded: list[int] = field(default_factory=list)  # RemoteLoad.load_id of fetches done since the last result
    failed_loads: list[int] = field(default_factory=list)  # and of those that failed (their blocks are computed)


@dataclass(slots=True)
class Reset:
    """The scheduler gave up on this rank's state (a step timed out): forget it and report Ready."""


@dataclass(slots=True)
class Shutdown:
    """Stop. `restart`: the scheduler found this rank at fault (it failed step after step on no request's
    inputs), so it exits non-zero and whatever supervises it (the launcher, compose) starts it afresh."""

    restart: bool = False


MESSAGE_TYPES: tuple[type, ...] = (
    Hello,
    SchedulerInfo,
    AddRequest,
    Abort,
    RequestOutputs,
    Ready,
    Step,
    StepResult,
    Shutdown,
    Unavailable,
    Reset,
    Ping,
    Pong,
)
_TAG_OF = {cls: cls.__name__ for cls in MESSAGE_TYPES}
_CLASS_OF = {name: cls for cls, name in _TAG_OF.items()}

Message = typing.Union[MESSAGE_TYPES]  # type: ignore[valid-type]  # noqa: UP007 (a tuple of types has no | form)


def encode(message: object) -> bytes:
    tag = _TAG_OF.get(type(message))
    if tag is None:
        raise TypeError(f"not a protocol message: {type(message).__name__}")
    frame: bytes = msgpack.packb([PROTOCOL_VERSION, tag, *_field_values(message)], default=_field_values)
    return frame


def decode(frame: bytes, max_containers: int | None = None) -> object:
    """`max_containers` bounds the arrays and maps of the frame (None: no bound). A frame larger
    than its type ever is, or with no type in its first bytes, is refused before decoding."""
    tag = frame_tag(frame)
    if tag is None:
        raise ProtocolError("a frame is a list [version, message type, fields...]")
    limit = MAX_FRAME_BYTES.get(tag)
    if limit is not None and len(frame) > limit:
        raise ProtocolError(f"a {tag} frame of {len(frame)} bytes, where no {tag} is over {limit}")
    hooks: dict[str, typing.Callable[..., object]] = {}
    if max_containers is not None:
        budget = ContainerBudget(max_containers)

        def pairs_to_map(pairs: list[tuple[object, object]]) -> dict[object, object]:
            return dict(budget(pairs))

        hooks = {"list_hook": budget, "object_pairs_hook": pairs_to_map}
    try:
        raw = msgpack.unpackb(frame, raw=False, strict_map_key=False, **hooks)
    except ProtocolError:
        raise
    except Exception as exc:  # msgpack raises several unrelated types for bad bytes
        raise ProtocolError(f"not msgpack: {exc}") from None
    if not isinstance(raw, list) or len(raw) < 2:
        raise ProtocolError("a frame is a list [version, tag, fields...]")
    version, tag, *values = raw
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {version!r}, expected {PROTOCOL_VERSION}")
    cls = _CLASS_OF.get(tag) if isinstance(tag, str) else None
    if cls is None:
        raise ProtocolError(f"unknown message type {tag!r}")
    return _checker(cls)(values)


def _field_values(obj: object) -> list[object]:
    """A message as the list of its fields; msgpack calls this for every nested message too."""
    names = _FIELD_NAMES.get(type(obj))
    if names is None:
        if not is_dataclass(obj):
            raise TypeError(f"cannot encode {type(obj).__name__}")
        names = _FIELD_NAMES[type(obj)] = tuple(f.name for f in fields(obj))
    return [getattr(obj, name) for name in names]


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}

# --- decoding: one validating function per type, built once -------------------------------

Checker = typing.Callable[[object], object]
_CHECKERS: dict[object, Checker] = {}


def _checker(hint: object) -> Checker:
    checker = _CHECKERS.get(hint)
    if checker is None:
        checker = _CHECKERS[hint] = _make_checker(hint)
    return checker


def _make_checker(hint: object) -> Checker:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return _union_checker([_checker(option) for option in typing.get_args(hint)], hint)
    if origin is list:
        return _list_checker(typing.get_args(hint)[0])
    if origin is tuple:
        return _tuple_checker([_checker(t) for t in typing.get_args(hint)])
    if origin is dict:
        key, value = (_checker(t) for t in typing.get_args(hint))

        def check_map(v: object) -> object:
            if type(v) is not dict:
                raise ProtocolError("expected a map")
            return {key(k): value(x) for k, x in v.items()} if v else v

        return check_map
    if isinstance(hint, type) and is_dataclass(hint):
        return _message_checker(hint)
    if hint is float:

        def check_float(v: object) -> object:
            if type(v) is float:
                return v
            if type(v) is int:
                return float(v)
            raise ProtocolError("expected a number")

        return check_float
    if isinstance(hint, type) and hint in (int, str, bool, bytes, type(None)):
        name = "null" if hint is type(None) else hint.__name__

        def check_exact(v: object) -> object:
            if type(v) is not hint:
                raise ProtocolError(f"expected {name}")
            return v

        return check_exact
    raise TypeError(f"no wire rule for {hint}")


def _union_checker(options: list[Checker], hint: object) -> Checker:
    # An optional field's None is the common case: met first, without the other options' refusals (exceptions).
    allows_none = type(None) in typing.get_args(hint)

    def check_union(v: object) -> object:
        if v is None and allows_none:
            return None
        for option in options:
            try:
                return option(v)
            except ProtocolError:
                continue
        raise ProtocolError(f"{v!r} is none of {hint}")

    return check_union


def _list_checker(item: object) -> Checker:
    if item is int or item is str or item is float:
        expected: tuple[type, ...] = {int: (int,), str: (str,), float: (float, int)}[item]
        kind = item.__name__

        def check_plain_list(v: object) -> object:
            if type(v) is not list or not all(type(x) in expected for x in v):
                raise ProtocolError(f"expected a list of {kind}")
            return [float(x) for x in v] if item is float else v

        return check_plain_list
    check_item = _checker(item)

    def check_list(v: object) -> object:
        if type(v) is not list:
            raise ProtocolError("expected a list")
        return [check_item(x) for x in v]

    return check_list


def _tuple_checker(items: list[Checker]) -> Checker:
    def check_tuple(v: object) -> object:
        if type(v) is not list or len(v) != len(items):
            raise ProtocolError(f"expected {len(items)} items")
        return tuple(check(x) for check, x in zip(items, v))

    return check_tuple


def _message_checker(cls: type) -> Checker:
    hints = typing.get_type_hints(cls)
    declared = fields(cls)
    names = [f.name for f in declared]
    required = sum(1 for f in declared if f.default is MISSING and f.default_factory is MISSING)
    name = cls.__name__

    def build(values: object) -> object:
        if type(values) is not list:
            raise ProtocolError(f"{name}: expected a list of fields")
        if not required <= len(values) <= len(names):
            raise ProtocolError(f"{name}: {len(values)} fields, expected {required}..{len(names)}")
        try:
            return cls(*[check(v) for check, v in zip(checks, values)])
        except ProtocolError as exc:
            bad = next(n for n, c, v in zip(names, checks, values) if not _passes(c, v))
            raise ProtocolError(f"{name}.{bad}: {exc}") from None

    _CHECKERS[cls] = build  # before the fields, so a message may nest its own type
    checks = [_checker(hints[n]) for n in names]
    return build


def _passes(check: Checker, value: object) -> bool:
    try:
        check(value)
        return True
    except ProtocolError:
        return False
