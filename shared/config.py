"""Configuration values shared by the launcher and the services."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass

from shared.kv_transfer_config import KVTransferConfig
from shared.options import option
from shared.sampling import MAX_LOGPROBS
from shared.sockets import MAX_MESSAGE_BYTES

SCHEDULER_METRICS_PORT = 8001  # each service's own /metrics; the api's is on its HTTP port
WORKER_METRICS_PORT = 8002  # rank r: this + r
ENGINE_PORT_STRIDE = 10  # engine i of several (data parallelism): both ports + 10 * i


def _speculative_config(text: str) -> SpeculativeConfig | None:
    """argparse's type for --speculative-config: a bad value is a usage error naming the problem."""
    try:
        return SpeculativeConfig.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _kv_transfer_config(text: str) -> KVTransferConfig | None:
    try:
        return KVTransferConfig.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _pd_split(text: str) -> str:
    parts = text.split(":")
    if len(parts) != 2 or not all(p.isdigit() and int(p) >= 1 for p in parts):
        raise argparse.ArgumentTypeError("--pd takes P:D, two counts of 1 or more (say 1:1)")
    return text


def _tenant_weights(text: str) -> dict[str, float]:
    """argparse's type for --tenant-weights: NAME=WEIGHT pairs, comma-separated."""
    weights: dict[str, float] = {}
    for pair in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = pair.rpartition("=")
        try:
            weight = float(value)
        except ValueError:
            weight = 0.0
        if not sep or not name or not weight > 0 or weight == float("inf"):
            raise argparse.ArgumentTypeError(f"{pair!r}: expected NAME=WEIGHT with a positive weight")
        weights[name] = weight
    return weights


# kernels/native.py's builds (VARIANTS and the tests' EMULATED), named here without importing the kernels
CPU_KERNEL_BUILDS = ("auto", "x86-64-v4-bf16", "x86-64-v4", "x86-64-v3", "portable", "x86-64-v3-as-v4-bf16")


def _dtype(name: str) -> str:
    """vLLM's dtype names too: half and float."""
    return {"half": "float16", "float": "float32"}.get(name, name)


@dataclass(slots=True)
class SchedulerConfig:
    """The scheduler's policy and budgets; the workers read the block size and limits from it too."""

    block_size: int = option(16, "tokens per KV block")
    max_num_seqs: int = option(256, "sequences per step")
    max_num_batched_tokens: int | None = option(
        None, "tokens per step; None: 2048 with chunked prefill, else max(context, 2048)", parse=int
    )
    max_model_len: int | None = option(None, "context length limit; None: the model's own", parse=int)
    num_gpu_blocks_override: int | None = option(
        None, "KV blocks on the device, instead of what memory allows (for tests and benchmarks)", parse=int
    )
    watermark: float = 0.01  # fraction of GPU blocks kept free when admitting new prompts
    enable_prefix_caching: bool = option(False, "reuse cached prompt blocks")
    kv_cache_dir: str | None = option(
        None,
        "a folder where prefix-cache blocks are kept as files, found again after a restart (with "
        "--enable-prefix-caching; reads are staged in the host cache of --kv-offloading-size, at least 256 blocks)",
    )
    kv_cache_dir_size: float = option(
        10.0, "GiB the files under --kv-cache-dir may take; the least recently used go first"
    )
    kv_offloading_policy: str = option(
        "write-through",
        "when a prefix-cache block is copied to the host cache of --kv-offloading-size: as soon as "
        "it is cached on the device (write-through), or as the device evicts it (write-back)",
        choices=("write-back", "write-through"),
    )
    enable_chunked_prefill: bool = option(True, "split long prompts over steps, mixed with decodes", negatable=True)
    preemption_mode: str = option(
        "auto",
        "what happens to a preempted request: swapped to CPU memory, dropped and recomputed, or whichever "
        "costs less for it",
        choices=("swap", "recompute", "auto"),
    )
    kv_reservation: str = option(
        "paged",
        "KV memory a request holds from its start: blocks on demand (paged), or, as baselines that reserve "
        "contiguous memory would, room for the whole context (max), for the next power of two of max_tokens (pow2) "
        "or for exactly max_tokens (oracle)",
        choices=("paged", "max", "pow2", "oracle"),
    )
    scheduling_policy: str = option(
        "fcfs",
        "the order requests are admitted in and preempted in: by arrival (fcfs), by the request's "
        "`priority` field, lower first, then arrival (priority), or by the tokens each tenant has been served, "
        "weighted by --tenant-weights (fair: virtual token counters; a tenant is an --api-key's, or the `user` "
        "field with one key or none)",
        choices=("fcfs", "priority", "fair"),
    )
    max_queue_delay: float = option(
        120.0,
        "seconds after its arrival from which a request ranks ahead of every later one whatever its "
        "priority or tenant, so that none starves (priority and fair)",
    )
    tenant_weights: dict[str, float] | None = option(
        None,
        "under fair, tenants' shares relative to the default 1: NAME=WEIGHT,... where NAME is a `user` "
        "value, or an --api-key's tenant id (tenant- and the first 16 hex digits of the key's SHA-256)",
        parse=_tenant_weights,
        render=lambda weights: ",".join(f"{name}={w!r}" for name, w in weights.items()),
    )
    async_scheduling: bool = option(True, "plan each step while the workers compute the one before", negatable=True)
    step_timeout: float = option(180.0, "seconds a step may take before its worker counts as lost")
    shutdown_timeout: float = option(
        5.0,
        "on SIGINT or SIGTERM, seconds the requests in flight may take to finish, new ones refused meanwhile; "
        "those left then end with finish_reason abort (0: at once)",
    )
    log_stats_interval: float = option(10.0, "seconds between log lines of throughput, queues and KV use (0: none)")
    api_send_queue: int = 10_000  # messages queued for one api before it counts as not reading
    speculative: SpeculativeConfig | None = option(
        None,
        'speculative decoding, as JSON in vLLM\'s form: \'{"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\' or \'{"method": "draft_model", "model": DIR, '
        '"num_speculative_tokens": 3}\' (default: none)',
        flag="--speculative-config",
        parse=_speculative_config,
        render=lambda config: config.to_json(),
    )
    kv_transfer: KVTransferConfig | None = option(
        None,
        'prefill/decode disaggregation, as JSON in vLLM\'s form: \'{"kv_connector": "PagedserveConnector", '
        '"kv_role": "kv_producer|kv_consumer|kv_both", "kv_ip": "127.0.0.1", "kv_port": 14579, '
        '"kv_connector_extra_config": {"key_file": PATH}}\' (default: none; docs/features/disaggregation.md)',
        flag="--kv-transfer-config",
        parse=_kv_transfer_config,
        render=lambda config: config.to_json(),
    )


@dataclass(slots=True)
class ModelConfig:
    """What the api and the workers both read: where the model and its tokenizer are."""

    model: str = option(None, "local HF-format model directory")
    tokenizer: str | None = option(
        None,
        "directory of the tokenizer (the api's, and the worker's for grammars); None: the model directory (a "
        "dummy-weight config needs one)",
    )


@dataclass(slots=True)
class WorkerConfig:
    """How a worker rank holds the model and its KV cache."""

    device: str = option("auto", "where the model runs; auto: cuda where there is one", choices=("auto", "cpu", "cuda"))
    dtype: str = option(
        "auto",
        "weights and KV cache; auto: the checkpoint's (a half type on a CPU where the compiled kernels read "
        "it, with float32 activations; a float32 checkpoint as float16 on CUDA)",
        choices=("auto", "float32", "float16", "bfloat16"),
        parse=_dtype,
    )
    kv_cache_dtype: str = option(
        "auto",
        "auto: the model's dtype; int8 or fp8 (E4M3): each cached key and value row quantized to one byte a "
        "value with its own scale, 3.8x the tokens of a float32 cache in the same memory (1.9x of float16)",
        choices=("auto", "int8", "fp8"),
    )
    load_format: str = option(
        "auto", "dummy: random weights from config.json alone, for benchmarks", choices=("auto", "dummy")
    )
    quantization: str | None = option(
        None,
        "the checkpoint's quantization method, as vLLM names it: compressed-tensors (W8A8 int8, W4A16, W8A16, "
        "FP8), gptq, awq or fp8 (None: what config.json's quantization_config says; a method that contradicts it "
        "is refused)",
        short="-q",
        choices=("compressed-tensors", "gptq", "awq", "fp8", "gptq_marlin", "awq_marlin"),
    )
    runner: str = option(
        "auto",
        "generate tokens, or pool each prompt into one vector (embeddings, scores, classification: "
        "/v1/embeddings, /pooling, /score, /rerank, /classify); auto: pooling for a checkpoint without an LM head "
        "(a bare ...Model or a ...ForSequenceClassification), generate otherwise",
        choices=("auto", "generate", "pooling"),
    )
    pooler_config: str | None = option(
        None,
        'how a pooling model pools, as JSON: {"pooling_type": "LAST|MEAN|CLS", "normalize": true|false} (None: its '
        "sentence-transformers files, else LAST and normalized)",
    )
    gpu_memory_utilization: float = option(0.9, "share of the GPU's memory for weights, activations and KV cache")
    kv_cache_memory: float = option(1.0, "GiB of KV cache on CPU")
    swap_space: float = option(4.0, "GiB of CPU swap space for KV blocks")
    kv_offloading_size: float = option(
        0.0,
        "GiB of host memory that keeps the prefix-cache blocks the device evicts, keyed as on the device, so "
        "that a later prompt that matches them loads them back instead of computing them again (with "
        "--enable-prefix-caching; 0: none)",
    )
    seed: int = option(0, "seed of the sampler for requests without one")
    tensor_parallel_size: int = option(
        1,
        "worker ranks that split the model's attention heads and MLP among them, one process each (on GPUs: one "
        "GPU each)",
        short="-tp",
    )
    enforce_eager: bool = option(
        False,
        "every step runs its Python eagerly (by default a worker of one rank replays decode steps of up to "
        "--max-num-seqs sequences: a GPU from CUDA graphs captured at start-up, a CPU the kernel calls recorded "
        "from the first step of each size)",
    )
    max_seq_len_to_capture: int = option(
        8192, "the longest context a replayed decode step covers; longer ones run eagerly"
    )
    cpu_threads: int = option(
        0,
        "torch threads of a worker on a CPU device (0: every core while other processes leave them nearly idle, "
        "one fewer otherwise; chosen each second)",
    )
    kernels: str = option(
        "auto",
        "the kernels a worker runs: Triton on CUDA and the compiled kernels on a CPU (auto), the per-sequence "
        "torch references (reference: the oracle, slow), torch alone on a CPU (torch: no compiler needed), or Triton "
        "(triton; on a CPU with TRITON_INTERPRET=1)",
        choices=("auto", "reference", "torch", "triton"),
    )
    cpu_kernels: str = option(
        "auto",
        "the build of the compiled CPU kernels that runs: the best this CPU runs (auto), or a named "
        "instruction set, for comparing them",
        choices=CPU_KERNEL_BUILDS,
    )
    prompt_products: str = option(
        "auto",
        "who multiplies a prompt's rows (64 or more) of bfloat16 weights and of 4-bit or 8-bit codes in a bfloat16 "
        "model on a CPU: for bfloat16 weights oneDNN through torch where the CPU has AMX tiles for bfloat16, for "
        "codes the packed kernel, in those tiles where the CPU has them (auto); or either, forced (onednn unpacks "
        "codes whole each call)",
        choices=("auto", "onednn", "native"),
    )


@dataclass(slots=True)
class LoraConfig:
    """LoRA adapters served on the base model: the api checks and names them, the scheduler pages them into the
    device pool, the workers load and apply them."""

    enable_lora: bool = option(
        False, "serve LoRA adapters (PEFT format) on the base model: a request's `model` names one"
    )
    lora_modules: list[str] | None = option(
        None,
        'adapters served from the start: NAME=PATH, or JSON {"name": ..., "path": ..., '
        '"base_model_name": ...}, several after one flag',
        nargs="*",
    )
    max_loras: int = option(1, "adapters on the device at once (each in pages of the KV pool)")
    max_lora_rank: int = option(16, "the largest rank of an adapter served")
    max_cpu_loras: int | None = option(
        None, "adapters a worker keeps read in host memory (None: --max-loras)", parse=int
    )
    allow_runtime_lora_updating: bool = option(
        False,
        "POST /v1/load_lora_adapter and /v1/unload_lora_adapter add and remove adapters while serving (from "
        "folders under --lora-roots only)",
    )
    lora_roots: list[str] | None = option(
        None, "folders an adapter loaded at run time must be in (none: no path is allowed)", nargs="*"
    )


DEFAULT_MAX_PROMPTS = 2048  # OpenAI's and vLLM's scale for a batch of prompts


@dataclass(slots=True)
class ApiConfig:
    """The HTTP gateway: where it listens, its limits, and what it serves."""

    host: str = option("127.0.0.1", "address the api listens on")
    port: int = option(8000, "port the api listens on")
    served_model_name: str | None = option(None, "the name clients ask for; None: the model directory's name")
    max_request_body_bytes: int = option(8 << 20, "larger request bodies get 413")
    request_header_timeout: float = option(
        10.0, "seconds a connection has to send a request's headers before it is closed"
    )
    request_body_timeout: float = option(60.0, "seconds a request's body has to arrive whole before it gets 408")
    scheduler_timeout: float = option(
        5.0,
        "seconds without a word from the scheduler (it answers a heartbeat twice a second) before the api counts "
        "it as stalled: requests in flight fail, /health answers 503 until it answers again",
    )
    routing: str = option(
        "prefix",
        "with several engines, which serves a request: in turn, the least loaded, or the one its prompt's "
        "first blocks hash to (where they are cached), unless that one is loaded well above the others",
        choices=("round_robin", "least_load", "prefix"),
    )
    chat_template: str | None = option(None, "a Jinja chat template, as a file or inline, in place of the tokenizer's")
    max_prompts_per_request: int = option(
        DEFAULT_MAX_PROMPTS, "the most prompts one completions request may hold (OpenAI's batch); more get a 400"
    )
    max_logprobs: int = option(
        MAX_LOGPROBS, f"the most log-probabilities a request may ask for per token (at most {MAX_LOGPROBS})"
    )
    disable_log_requests: bool = option(False, "no log line per request")
    trust_remote_code: bool = option(
        False, "accepted as vLLM accepts it; pagedserve never runs code from a model directory"
    )
    enable_auto_tool_choice: bool = option(
        False,
        "serve tool_choice 'auto' (the default with tools): the model's calls are parsed from its text by "
        "--tool-call-parser",
    )
    tool_call_parser: str | None = option(
        None,
        "the model's tool-call format: hermes (Hermes, Qwen 2.5/3), llama3_json (Llama 3.1+), mistral, "
        "qwen3_coder, pythonic (Llama 3.2 and 4) or deepseek_v3",
        choices=("hermes", "llama3_json", "mistral", "qwen3_coder", "pythonic", "deepseek_v3"),
    )
    reasoning_parser: str | None = option(
        None,
        "split a reasoning model's thinking into the chat message's 'reasoning' and apply structured outputs after "
        "it: deepseek_r1 (DeepSeek R1, QwQ; the template opens <think>) or qwen3",
        choices=("deepseek_r1", "qwen3"),
    )
    api_key: str | None = option(
        None,
        "every route but /health and /metrics then needs 'Authorization: Bearer KEY'; several keys, "
        "comma-separated, are tenants of their own (default: $PAGEDSERVE_API_KEY; never shown)",
    )
    api_key_file: str | None = option(
        None, "keys as for --api-key, one a line, from a file (keeps them off the command line)"
    )
    admin_api_key_file: str | None = option(
        None,
        "a file holding the admin key: an API key (its own tenant) that may also unload the adapters every "
        "tenant shares (--lora-modules)",
    )
    report_cached_tokens: bool = option(
        True,
        "usage.prompt_tokens_details.cached_tokens in responses (always from the request's own tenant and "
        "cache_salt); --no-report-cached-tokens leaves it out",
        negatable=True,
    )


@dataclass(slots=True)
class LauncherConfig:
    """`pagedserve up`'s own flags: how many engines, and where their metrics listen."""

    data_parallel_size: int = option(
        1,
        "engines, each a scheduler with its own workers (and its own tensor-parallel ranks); the api routes each "
        "request to one of them (--routing). An engine that dies is started again while the others serve",
        short="-dp",
    )
    pd: str | None = option(
        None,
        "prefill/decode disaggregation on this machine, P:D (say 1:1): P prefill engines and D decode engines, "
        "the cores split evenly between them; the api computes each prompt on a prefill engine and decodes on a "
        "decode engine, which fetches the prompt's KV blocks (docs/features/disaggregation.md). "
        "Replaces --data-parallel-size",
        parse=_pd_split,
    )
    ready_timeout: float = option(300.0, "seconds to wait for /health")
    scheduler_metrics_port: int = option(
        SCHEDULER_METRICS_PORT,
        "port of the scheduler's Prometheus /metrics, on --host (0: none); engine i of "
        f"several: this + {ENGINE_PORT_STRIDE} * i",
    )
    worker_metrics_port: int = option(
        WORKER_METRICS_PORT,
        "port of the worker's Prometheus /metrics, on --host (0: none); rank r of engine i: "
        f"this + {ENGINE_PORT_STRIDE} * i + r",
    )


def _endpoint_list(text: str) -> list[str]:
    """argparse's type for --scheduler-endpoint: one endpoint, or several comma-separated (the api's engines)."""
    endpoints = [e.strip() for e in text.split(",") if e.strip()]
    if not endpoints:
        raise argparse.ArgumentTypeError("give at least one endpoint")
    if len(set(endpoints)) < len(endpoints):
        raise argparse.ArgumentTypeError("an endpoint is given twice")
    return endpoints


@dataclass(slots=True)
class LinkConfig:
    """How the processes of an engine find each other when each runs alone (`python -m services.scheduler`,
    `services.worker`, `services.api`); the launcher sets these for the processes it starts."""

    scheduler_endpoint: list[str] | None = option(
        None,
        "where the scheduler listens for the apis, e.g. tcp://0.0.0.0:5555; an api may name several engines' "
        "schedulers, comma-separated (data parallelism: each request goes to one, chosen by --routing)",
        parse=_endpoint_list,
        render=",".join,
    )
    prefill_endpoint: list[str] | None = option(
        None,
        "prefill/decode disaggregation: the schedulers of prefill engines (kv_producer), comma-separated; each "
        "request's prompt is computed on one of them, its KV fetched by the --scheduler-endpoint engine that decodes",
        parse=_endpoint_list,
        render=",".join,
    )
    worker_endpoint: str | None = option(
        None, "where the scheduler listens for its worker ranks, e.g. tcp://0.0.0.0:5556"
    )
    world_size: int = option(1, "worker ranks in the engine's tensor-parallel group (the scheduler waits for them all)")
    rank: int = option(0, "this worker's rank in its group, to start a group's ranks by hand")
    dist_init_method: str = option(
        "tcp://127.0.0.1:29500", "where the ranks of a group started by hand meet (torch.distributed's init_method)"
    )


@dataclass(slots=True)
class MetricsConfig:
    """Where a process serves its own Prometheus /metrics."""

    metrics_host: str = option("127.0.0.1", "address of this service's /metrics")
    metrics_port: int = option(
        0, "port of this service's Prometheus /metrics (0: none); worker rank r serves on this port + r"
    )


@dataclass(slots=True)
class WireConfig:
    """The internal wire's protection and limits."""

    keys_dir: str | None = option(
        None, "this service's CURVE keys for tcp:// endpoints (default: $PAGEDSERVE_KEYS_DIR)"
    )
    insecure_wire: bool = option(False, "no CURVE on tcp:// endpoints: anyone who reaches the ports can use them")
    max_message_bytes: int = option(
        MAX_MESSAGE_BYTES, "larger frames on the internal wire drop their sender's connection"
    )


@dataclass(slots=True)
class Endpoints:
    """Where the scheduler listens: for the api's requests and for the workers' connections."""

    scheduler: str
    workers: str

    @staticmethod
    def local(directory: str, engine: int = 0) -> Endpoints:
        """Unix sockets in `directory`, which should be private to the user (mode 0700); engine i
        of several (data parallelism) has its own pair."""
        suffix = f"-{engine}" if engine else ""
        return Endpoints(
            scheduler=f"ipc://{os.path.join(directory, f'scheduler{suffix}.sock')}",
            workers=f"ipc://{os.path.join(directory, f'workers{suffix}.sock')}",
        )


SPECULATIVE_METHODS = ("ngram", "draft_model")


@dataclass(slots=True, frozen=True)
class SpeculativeConfig:
    """`--speculative-config`, in vLLM's form: who proposes tokens for the target model to verify.

    `ngram` looks the sequence's last n tokens (n from `prompt_lookup_max` down to
    `prompt_lookup_min`) up in its own prompt and output; `draft_model` runs the smaller model in
    `model` (same tokenizer). Both run in the worker, and propose up to `num_speculative_tokens`
    tokens per sequence and step."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 0
    prompt_lookup_max: int = 0
    model: str | None = None
    adaptive: bool = True  # off: speculate in every step, whatever it costs
    disable_by_batch_size: int = 0  # vLLM's knob: no speculation while more sequences decode (0: none)

    @staticmethod
    def parse(text: str | None) -> SpeculativeConfig | None:
        """The flag's JSON, checked field by field; None or "" for no speculation."""
        if not text:
            return None
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--speculative-config is not JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise ValueError("--speculative-config must be a JSON object")
        unknown = set(raw) - {
            "method",
            "num_speculative_tokens",
            "prompt_lookup_min",
            "prompt_lookup_max",
            "model",
            "adaptive",
            "disable_by_batch_size",
        }
        if unknown:
            raise ValueError(f"--speculative-config: unknown field(s) {', '.join(sorted(unknown))}")
        method = raw.get("method", "ngram" if "prompt_lookup_max" in raw or "prompt_lookup_min" in raw else None)
        if method not in SPECULATIVE_METHODS:
            raise ValueError(f"--speculative-config: method must be one of {', '.join(SPECULATIVE_METHODS)}")
        k = raw.get("num_speculative_tokens")
        if type(k) is not int or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"--speculative-config: num_speculative_tokens must be an integer in [1, {MAX_SPECULATIVE_TOKENS}]"
            )
        adaptive = raw.get("adaptive", True)
        if type(adaptive) is not bool:
            raise ValueError("--speculative-config: adaptive must be true or false")
        limit = raw.get("disable_by_batch_size", 0)
        if type(limit) is not int or limit < 0:
            raise ValueError("--speculative-config: disable_by_batch_size must be an integer, 0 or more")
        if method == "draft_model":
            model = raw.get("model")
            if not isinstance(model, str) or not model:
                raise ValueError("--speculative-config: draft_model needs 'model', a local model directory")
            return SpeculativeConfig(method, k, model=model, adaptive=adaptive, disable_by_batch_size=limit)
        low, high = raw.get("prompt_lookup_min"), raw.get("prompt_lookup_max")
        if low is None and high is None:
            low = high = 5  # vLLM's defaults
        low = high if low is None else low
        high = low if high is None else high
        if type(low) is not int or type(high) is not int or not 1 <= low <= high <= MAX_LOOKUP:
            raise ValueError(
                f"--speculative-config: prompt_lookup_min and prompt_lookup_max must be integers with "
                f"1 <= min <= max <= {MAX_LOOKUP}"
            )
        return SpeculativeConfig(method, k, low, high, adaptive=adaptive, disable_by_batch_size=limit)

    def to_json(self) -> str:
        """The flag's value that gives this config back (the launcher hands it on to its children)."""
        fields = {"method": self.method, "num_speculative_tokens": self.num_speculative_tokens}
        if self.method == "ngram":
            fields |= {"prompt_lookup_min": self.prompt_lookup_min, "prompt_lookup_max": self.prompt_lookup_max}
        else:
            fields["model"] = self.model
        if not self.adaptive:
            fields["adaptive"] = False
        if self.disable_by_batch_size:
            fields["disable_by_batch_size"] = self.disable_by_batch_size
        return json.dumps(fields)


MAX_SPECULATIVE_TOKENS = 16
MAX_LOOKUP = 32
