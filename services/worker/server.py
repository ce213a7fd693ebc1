"""The worker process: loads the model and the KV cache, reports Ready, then executes steps."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import zmq

from kernels import choice
from kernels.choice import KernelChoice
from services.worker.cpu_threads import ComputeThreads
from services.worker.decode_graphs import DecodeGraphs
from services.worker.disk_tier import DISK_STAGING_BLOCKS, DiskTier, fingerprint, weight_files
from services.worker.drafter import Drafter
from services.worker.grammar import GrammarEngine
from services.worker.kv_cache import GIB, KVCache, bytes_per_block, num_blocks_that_fit
from services.worker.kv_connectors import attach
from services.worker.loader import DTYPES, ModelLoadError, eos_token_ids, load_config, load_model, numerics
from services.worker.lora import LoraAdapters, tensor_parallel_shards
from services.worker.metrics import WorkerMetrics
from services.worker.mirrors import SequenceFault
from services.worker.model_runner import ModelRunner
from services.worker.ngram import NgramProposer
from services.worker.pooling import Pooler, pooling_spec, runner_of
from services.worker.tensor_parallel import TensorParallel
from shared import sockets
from shared.cli import EXIT_AT_FAULT, drain_wakeups, stops_deferred, take_the_stop
from shared.config import LoraConfig, ModelConfig, SchedulerConfig, WorkerConfig
from shared.kv_folder import KVFolderError
from shared.lora import LoraError
from shared.protocol import Ready, Reset, Shutdown, Step, StepResult
from shared.sockets import MAX_MESSAGE_BYTES
from shared.wire_security import WireKeys, connect_securely

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from services.worker.models.base import PagedCausalLM

log = logging.getLogger(__name__)
STEPS_STOPPED_SECONDS = 2.0  # after a stop signal, no step for this long: the scheduler has stopped sending


def pick_device(name: str, rank: int = 0) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device(name)


def join_rank_group(rank: int, world_size: int, init_method: str, device: torch.device) -> TensorParallel:
    """The process group of the tensor-parallel ranks: NCCL among GPUs, gloo on CPUs."""
    if world_size == 1:
        return TensorParallel()
    backend = "nccl" if device.type == "cuda" else "gloo"
    log.info("rank %d of %d joining the %s group at %s", rank, world_size, backend, init_method)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
    return TensorParallel(rank, world_size)


def load_draft_model(
    model_dir: str,
    target: PagedCausalLM,
    dtype: torch.dtype,
    device: torch.device,
    worker: WorkerConfig,
    tp: TensorParallel,
) -> tuple[PagedCausalLM, PretrainedConfig]:
    """The draft model of `--speculative-config`, in the target's dtype and tensor-parallel split."""
    dtype_name = next(name for name, value in DTYPES.items() if value == dtype)
    draft, config = load_model(model_dir, dtype_name, device, worker.load_format, worker.seed, tp)
    if draft.lm_head.weight.shape[0] != target.lm_head.weight.shape[0]:
        raise ModelLoadError(
            f"the draft model {model_dir} has a vocabulary of {draft.lm_head.weight.shape[0]} "
            f"tokens, the target {target.lm_head.weight.shape[0]}: they must share the tokenizer"
        )
    return draft, config


def capture_decode_graphs(
    model: PagedCausalLM,
    cache: KVCache,
    device: torch.device,
    setup: WorkerSetup,
    config: PretrainedConfig,
    world_size: int,
) -> DecodeGraphs | None:
    """CUDA graphs of decode steps up to --max-num-seqs sequences (on a CPU, their kernel calls recorded
    as steps come), or None where steps stay eager."""
    if world_size > 1:
        log.info("decode graphs: off for tensor-parallel ranks, which run every step eagerly")
        return None
    max_model_len = setup.scheduler.max_model_len or config.max_position_embeddings
    context = min(setup.worker.max_seq_len_to_capture, max_model_len)
    graphs = DecodeGraphs(model, cache, device, setup.scheduler.max_num_seqs, context)
    if device.type == "cpu":
        log.info(
            "decode steps up to %d sequences and contexts up to %d replay their kernel calls "
            "(--enforce-eager runs each step's Python)",
            graphs.sizes[-1],
            graphs.max_context,
        )
        return graphs
    started = time.perf_counter()
    try:
        graphs.capture()
    except torch.cuda.OutOfMemoryError:
        log.warning(
            "CUDA graphs: no memory left to capture them; every step runs eagerly "
            "(lower --gpu-memory-utilization to leave some)"
        )
        return None
    except Exception:  # serving eagerly beats not serving; the log says why
        log.exception("CUDA graphs: capture failed; every step runs eagerly (--enforce-eager skips the capture)")
        return None
    log.info(
        "CUDA graphs: %d decode batch sizes up to %d sequences, contexts up to %d, captured in %.1f s",
        len(graphs.sizes),
        graphs.sizes[-1],
        graphs.max_context,
        time.perf_counter() - started,
    )
    return graphs


@dataclass(slots=True)
class WorkerSetup:
    """Everything a worker rank is started with: its configs, built once from the flags, and where it
    connects."""

    model: ModelConfig
    worker: WorkerConfig
    scheduler: SchedulerConfig  # the block size and the limits the cache and the graphs are sized by
    endpoint: str  # the scheduler's worker endpoint
    dist_init_method: str = "tcp://127.0.0.1:29500"
    max_message_bytes: int = MAX_MESSAGE_BYTES
    lora: LoraConfig = field(default_factory=LoraConfig)


class WorkerServer:
    def __init__(
        self,
        setup: WorkerSetup,
        rank: int = 0,
        world_size: int = 1,
        keys: WireKeys | None = None,
        metrics: WorkerMetrics | None = None,
    ):
        worker, scheduler, model_dir = setup.worker, setup.scheduler, setup.model.model
        self.rank, self.world_size = rank, world_size
        self.shutdown_timeout = scheduler.shutdown_timeout
        choice.choose(
            KernelChoice(
                worker.kernels, None if worker.cpu_kernels == "auto" else worker.cpu_kernels, worker.prompt_products
            )
        )
        device = pick_device(worker.device, rank)
        threads = ComputeThreads(worker.cpu_threads, world_size) if device.type == "cpu" else None
        if threads is not None:
            threads.use(threads.for_step())
        tp = join_rank_group(rank, world_size, setup.dist_init_method, device)
        torch.manual_seed(worker.seed)  # the same on every rank: they sample the same tokens
        runner_kind = runner_of(load_config(model_dir), worker.runner)
        model, config = load_model(
            model_dir, worker.dtype, device, worker.load_format, worker.seed, tp, worker.quantization,
            pooling=runner_kind == "pooling",
        )  # fmt: skip
        spec = pooling_spec(model_dir, config, worker.pooler_config) if runner_kind == "pooling" else None
        dtype = model.lm_head.weight.dtype
        models = [(model, config)]
        speculative = scheduler.speculative
        if speculative is not None and speculative.method == "draft_model" and speculative.model is not None:
            models.append(load_draft_model(speculative.model, model, dtype, device, worker, tp))
        # The draft's cache lives under the same block ids, so a block costs both models' bytes.
        kv_dtype = worker.kv_cache_dtype
        layer_bytes = [
            bytes_per_block(c.num_hidden_layers, scheduler.block_size, m.num_kv_heads, m.head_dim, dtype, kv_dtype)
            for m, c in models
        ]
        block_bytes = sum(layer_bytes)
        num_blocks = scheduler.num_gpu_blocks_override or num_blocks_that_fit(
            device, block_bytes, worker.gpu_memory_utilization, worker.kv_cache_memory
        )
        if num_blocks < 1:
            raise RuntimeError("no memory left for a single KV block; lower the model or raise the limit")
        num_cpu_blocks = int(worker.swap_space * GIB // block_bytes)
        num_host_cache_blocks = int(worker.kv_offloading_size * GIB // block_bytes)
        if scheduler.kv_cache_dir:  # blocks read from disk are staged in the host cache
            num_host_cache_blocks = max(num_host_cache_blocks, DISK_STAGING_BLOCKS)
        cache, *draft_cache = [
            KVCache(
                c.num_hidden_layers,
                num_blocks,
                scheduler.block_size,
                m.num_kv_heads,
                m.head_dim,
                dtype,
                device,
                num_cpu_blocks + num_host_cache_blocks,  # host ids: the swap space's, then the host cache's
                kv_dtype,
            )
            for m, c in models
        ]
        log.info(
            "KV cache: %d blocks of %d tokens (%.1f MiB%s%s); swap space: %d blocks; host cache: %d blocks",
            num_blocks,
            scheduler.block_size,
            num_blocks * block_bytes / 2**20,
            f", {kv_dtype}" if kv_dtype != "auto" else "",
            f", of which the draft model's {num_blocks * layer_bytes[1] / 2**20:.1f}" if draft_cache else "",
            num_cpu_blocks,
            num_host_cache_blocks,
        )
        drafter = Drafter(models[1][0], draft_cache[0], device) if draft_cache else None
        ngram = (
            NgramProposer(speculative.prompt_lookup_min, speculative.prompt_lookup_max)
            if speculative is not None and speculative.method == "ngram"
            else None
        )
        eos_ids = eos_token_ids(model_dir, config)
        vocab_size = model.lm_head.weight.shape[0]
        # On a CPU the masks run beside a forward that leaves them a core, or before one that took them all.
        mask_threads = 0 if device.type == "cuda" else max(1, len(os.sched_getaffinity(0)) - 1)
        grammars = GrammarEngine.load(setup.model.tokenizer or model_dir, vocab_size, eos_ids, mask_threads)
        self.runner = ModelRunner(
            model,
            cache,
            device,
            worker.seed,
            eos_token_ids=eos_ids,
            drafter=drafter,
            threads=threads,
            grammars=grammars,
            ngram=ngram,
            pooler=Pooler(spec, getattr(model, "score", None)) if spec is not None else None,
        )
        # Only --preemption-mode auto weighs a swap against a recompute: the others send zeros, never read.
        measured = scheduler.preemption_mode == "auto"
        swap_rate = cache.measure_swap_bandwidth() if measured else 0.0
        prefill_rate = self.runner.measure_prefill_rate() if measured else 0.0
        if device.type in ("cuda", "cpu") and not worker.enforce_eager and spec is None:  # pooling never decodes
            self.runner.graphs = capture_decode_graphs(model, cache, device, setup, config, world_size)
        log.info(
            "%s%s",
            f"measured: swap {swap_rate / 1e9:.2f} GB/s, prefill {prefill_rate:.0f} tokens/s"
            if measured
            else f"swap and prefill rates not measured (--preemption-mode {scheduler.preemption_mode})",
            f"; compute threads: {threads.describe()}, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}"
            if threads is not None
            else "",
        )
        self.ready = Ready(
            rank,
            world_size,
            num_blocks,
            num_cpu_blocks,
            scheduler.block_size,
            config.max_position_embeddings,
            eos_ids,
            block_bytes,
            swap_rate,
            prefill_rate,
            self.runner.vocab_size,
            device.type,
            speculative.method if speculative is not None else "",
            num_host_cache_blocks,
            pooling=spec,
        )
        if setup.lora.enable_lora:
            self._enable_adapters(setup.lora, cache, model, config, dtype)
        if scheduler.kv_cache_dir:
            if draft_cache:
                raise ModelLoadError(
                    "--kv-cache-dir keeps the target model's blocks only: it does not work with a "
                    "draft model yet (n-gram speculation works)"
                )
            print_ = fingerprint(
                {
                    "model": os.path.realpath(model_dir),
                    "files": weight_files(model_dir),
                    "load_format": worker.load_format,
                    "seed": worker.seed if worker.load_format == "dummy" else None,
                    "dtype": str(dtype),
                    "kv_cache_dtype": kv_dtype,
                    "block_size": scheduler.block_size,
                    "world_size": world_size,
                    "block_bytes": block_bytes,
                }
            )
            try:
                cache.disk = DiskTier(scheduler.kv_cache_dir, print_, rank, world_size)
            except KVFolderError as exc:
                raise ModelLoadError(str(exc)) from None
            self.ready.disk_fingerprint = print_
            log.info("KV blocks on disk: %s", cache.disk.folder)
        if scheduler.kv_transfer is not None:
            self.ready.kv_address, self.ready.kv_layout = attach(cache, scheduler.kv_transfer, world_size), cache.layout
        self.metrics = metrics or WorkerMetrics(rank)
        self.metrics.describe_compute(numerics(model, device))
        self.context = zmq.Context()
        self.socket = sockets.new_socket(self.context, zmq.DEALER, setup.max_message_bytes)
        # No fixed identity: the scheduler's socket names each connection, so no one who
        # connects first under a rank's name can keep the rank's worker out.
        connect_securely(self.socket, keys)
        # Watch before connecting, so the first connection's event is seen too.
        self.connection_events = self.socket.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self.socket.connect(setup.endpoint)
        self.running = True
        self.exit_code = 0
        self.last_sent = time.perf_counter()
        self.handlers: dict[type, Callable[[Any], None]] = {
            Step: self.on_step,
            Reset: self.on_reset,
            Shutdown: self.on_shutdown,
        }

    def _enable_adapters(
        self, lora: LoraConfig, cache: KVCache, model: PagedCausalLM, config: PretrainedConfig, dtype: torch.dtype
    ) -> None:
        try:
            adapters = LoraAdapters(
                cache,
                config,
                dtype,
                lora.max_lora_rank,
                lora.max_cpu_loras or lora.max_loras,
                tensor_parallel_shards(model) if self.world_size > 1 else None,
            )
        except LoraError as exc:
            raise ModelLoadError(f"--enable-lora: {exc}") from None
        self.runner.adapters = adapters
        self.ready.lora_half_elements = adapters.half_elements
        self.ready.lora_dims = {name: list(dims) for name, dims in adapters.dims.items()}
        log.info(
            "LoRA adapters: %d values of %s per half page and layer, up to rank %d",
            adapters.half_elements,
            dtype,
            lora.max_lora_rank,
        )

    def run(self, signals: socket.socket | None = None) -> int:
        """Serve steps until stopped, and return the exit status; `signals`: the socket a signal taken by another
        thread wakes (`shared.cli.stop_on_signals`). However it stops, the block files being written land first,
        for the next start to find."""
        try:
            self._serve(signals)
        finally:
            self.runner.cache.close()
        return self.exit_code

    def _serve(self, signals: socket.socket | None) -> None:
        # Each (re)connection to a scheduler is answered with Ready: a restarted scheduler
        # learns this rank again, and knows none of the sequences the old one had.
        events = self.connection_events
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        poller.register(events, zmq.POLLIN)
        wakeup = None
        if signals is not None:
            poller.register(signals, zmq.POLLIN)
            wakeup = signals.fileno()  # what the poller hands back for a plain socket
        try:
            with stops_deferred():  # a stop comes from `drain_wakeups`, between messages
                try:
                    while self.running:
                        self._handle(poller.poll(), wakeup, events)
                except KeyboardInterrupt:
                    self._serve_the_stop(poller, wakeup, events)
                    raise
        finally:
            self.socket.disable_monitor()
            self.context.destroy(linger=0)

    def _handle(self, ready: list[tuple[Any, int]], wakeup: int | None, events: zmq.Socket) -> None:  # type: ignore[type-arg]
        # A step already sent is carried out before a stop takes effect (its block files land).
        for sock, _ in sorted(ready, key=lambda each: each[0] == wakeup):
            if sock == wakeup:
                drain_wakeups()
                continue
            if sock is events:
                events.recv_multipart()
                self.runner.reset()
                sockets.send(self.socket, self.ready)
                continue
            _, message = sockets.receive(self.socket)
            handler = self.handlers.get(type(message))
            if handler is not None:
                handler(message)
            elif message is not None:
                log.error("no handler for %s", type(message).__name__)

    def _serve_the_stop(self, poller: zmq.Poller, wakeup: int | None, events: zmq.Socket) -> None:  # type: ignore[type-arg]
        """A signal while steps come (the scheduler, stopped by the same signal, lets its requests finish within
        --shutdown-timeout): serve them until the scheduler says Shutdown, no step comes for a while, or the
        timeout and a margin pass. Idle, stop at once."""
        timeout = self.shutdown_timeout
        if timeout <= 0 or time.perf_counter() - self.last_sent > STEPS_STOPPED_SECONDS:
            return
        take_the_stop()
        deadline = time.perf_counter() + timeout + STEPS_STOPPED_SECONDS
        with contextlib.suppress(KeyboardInterrupt):
            while self.running and time.perf_counter() < deadline:
                self._handle(poller.poll(100), wakeup, events)
                if time.perf_counter() - self.last_sent > STEPS_STOPPED_SECONDS:
                    break

    def on_step(self, step: Step) -> None:
        idle_ms = (time.perf_counter() - self.last_sent) * 1e3
        try:
            with stops_deferred():  # a stop waits for the step: its transfers, block files included, complete
                result = self.runner.execute(step)
        except SequenceFault as exc:  # some requests' inputs: the scheduler fails them and recomputes the rest
            log.warning("step %d failed on sequences %s: %s", step.step_id, exc.seq_ids, exc)
            self.runner.reset()
            result = StepResult(step.step_id, [], 0.0, 0.0, error=str(exc), culprits=exc.seq_ids)
        except Exception as exc:  # report it; the scheduler looks for the request that causes it
            log.error("step %d failed:\n%s", step.step_id, traceback.format_exc())
            self.runner.reset()
            result = StepResult(step.step_id, [], 0.0, 0.0, error=f"{type(exc).__name__}: {exc}")
        result.idle_ms = idle_ms
        if self.rank == 0:
            sockets.send(self.socket, result)
        self.last_sent = time.perf_counter()
        self.metrics.observe(result, self.runner.cache.remote)  # after the send: the scheduler waits for the result

    def on_reset(self, message: Reset) -> None:
        log.warning("the scheduler reset this rank; reporting ready again")
        self.runner.reset()
        sockets.send(self.socket, self.ready)

    def on_shutdown(self, message: Shutdown) -> None:
        self.running = False
        if message.restart:
            log.error(
                "the scheduler found this rank at fault (steps failed on no request's inputs); exiting to restart"
            )
            self.exit_code = EXIT_AT_FAULT
