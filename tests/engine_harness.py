"""The real scheduler driving the real model runner in one process, step by step (no sockets).

After every step it checks the block accounting invariants, so any test that generates through
it also checks that no block leaks or is double-counted.
"""

from __future__ import annotations

import itertools
from collections import deque

import torch

from services.scheduler.disk_index import DiskIndex
from services.scheduler.kv_cache_manager import KVCacheManager
from services.scheduler.scheduler import Budgets, PreemptionPolicy, Scheduler
from services.scheduler.speculation import Speculation
from services.worker.decode_graphs import DecodeGraphs
from services.worker.disk_tier import DiskTier, fingerprint
from services.worker.drafter import Drafter
from services.worker.grammar import GrammarEngine
from services.worker.kv_cache import KVCache, bytes_per_block
from services.worker.kv_connectors import attach
from services.worker.loader import eos_token_ids, load_model
from services.worker.lora import LoraAdapters
from services.worker.model_runner import ModelRunner
from services.worker.ngram import NgramProposer
from shared.config import SpeculativeConfig
from shared.kv_transfer_config import KVTransferConfig
from shared.protocol import AddRequest, KVHandoff, LoraRef
from shared.sampling import SamplingParams
from tests.scheduler_harness import check_block_accounting

_ids = itertools.count()


class Engine:
    def __init__(
        self,
        model_dir: str,
        block_size=16,
        num_gpu_blocks=256,
        num_cpu_blocks=256,
        preemption="recompute",
        prefix_caching=False,
        chunked_prefill=False,
        max_num_batched_tokens=512,
        max_num_seqs=64,
        speculative: SpeculativeConfig | None = None,
        kv_cache_dtype: str = "auto",
        threads=None,
        depth: int = 1,
        decode_graphs: dict | None = None,
        device: str = "cpu",
        dtype: str = "float32",
        num_host_cache_blocks: int = 0,
        kv_cache_dir: str | None = None,
        disk_blocks: int = 1024,
        write_through: bool = False,
        max_loras: int = 0,
        max_lora_rank: int = 16,
        kv_transfer: KVTransferConfig | None = None,
    ):
        device = torch.device(device)
        model, config = load_model(model_dir, dtype, device)
        dtype = model.lm_head.weight.dtype  # what `auto` chose: the KV cache's too
        self.cache = KVCache(
            config.num_hidden_layers,
            num_gpu_blocks,
            block_size,
            model.num_kv_heads,
            model.head_dim,
            dtype,
            device,
            num_cpu_blocks + num_host_cache_blocks,
            kv_cache_dtype,
        )
        drafter, ngram = None, None
        if speculative is not None and speculative.method == "ngram":
            ngram = NgramProposer(speculative.prompt_lookup_min, speculative.prompt_lookup_max)
        if speculative is not None and speculative.method == "draft_model":
            draft, draft_config = load_model(speculative.model, str(dtype).removeprefix("torch."), device)
            drafter = Drafter(
                draft,
                KVCache(
                    draft_config.num_hidden_layers,
                    num_gpu_blocks,
                    block_size,
                    draft.num_kv_heads,
                    draft.head_dim,
                    dtype,
                    device,
                    num_cpu_blocks + num_host_cache_blocks,
                ),
                device,
            )
        eos_ids = eos_token_ids(model_dir, config)
        grammars = GrammarEngine.load(model_dir, model.lm_head.weight.shape[0], eos_ids)
        # decode_graphs: the CUDA graphs' static buffers and padding (on a CPU, run eagerly)
        graphs = DecodeGraphs(model, self.cache, device, **decode_graphs) if decode_graphs else None
        self.runner = ModelRunner(
            model,
            self.cache,
            device,
            seed=0,
            eos_token_ids=eos_ids,
            drafter=drafter,
            threads=threads,
            grammars=grammars,
            ngram=ngram,
            graphs=graphs,
        )
        block_bytes = bytes_per_block(
            config.num_hidden_layers, block_size, model.num_kv_heads, model.head_dim, dtype, kv_cache_dtype
        )
        # only `auto` weighs the two costs; a forward of 256 tokens to measure one is slow under Triton's interpreter
        measured = preemption == "auto"
        policy = PreemptionPolicy(
            preemption,
            block_bytes,
            self.cache.measure_swap_bandwidth() if measured else 0.0,
            self.runner.measure_prefill_rate() if measured else 0.0,
        )
        disk = None
        if kv_cache_dir is not None:  # files under a fingerprint of this model's layout, as a worker names them
            print_ = fingerprint({"model": model_dir, "dtype": str(dtype), "block_size": block_size})
            self.cache.disk = DiskTier(kv_cache_dir, print_, 0, 1)
            disk = DiskIndex(kv_cache_dir, print_, 1, disk_blocks)
        manager = KVCacheManager(
            num_gpu_blocks,
            block_size,
            num_cpu_blocks,
            watermark=0.0,
            enable_prefix_caching=prefix_caching,
            num_host_cache_blocks=num_host_cache_blocks,
            disk=disk,
            write_through=write_through,
        )
        context = min(config.max_position_embeddings, num_gpu_blocks * block_size)
        if not chunked_prefill:  # a recomputed request must fit one step
            context = min(context, max_num_batched_tokens)
        budgets = Budgets(max_num_seqs, max_num_batched_tokens, context, chunked_prefill)
        speculation = Speculation(speculative, context) if speculative is not None else None
        if max_loras:  # adapters paged into the KV pool, as a worker and a scheduler started with --enable-lora
            self.runner.adapters = LoraAdapters(self.cache, config, dtype, max_lora_rank, max_loras)
            manager.enable_adapters(
                max_loras,
                self.runner.adapters.half_elements,
                {name: list(dims) for name, dims in self.runner.adapters.dims.items()},
            )
        if kv_transfer is not None:  # a prefill or decode engine, as a worker and a scheduler given the flag
            remote = manager.remote
            remote.address, remote.layout = attach(self.cache, kv_transfer, 1), self.cache.layout
            remote.consumes, remote.hold_seconds = kv_transfer.consumes, kv_transfer.hold_seconds
        self.scheduler = Scheduler(manager, budgets, eos_ids, policy, speculation=speculation)
        self.handoffs: dict[str, KVHandoff | None] = {}  # request id -> where its last output says its KV is held
        self.max_running_seqs = 0
        self.steps = []
        self.depth = depth  # steps planned ahead of the one computing, as the scheduler server does with 2
        self.top_logprobs: dict[str, dict[int, list[dict[int, float]]]] = {}

    def add(
        self,
        prompt: list[int],
        cache_salt: str = "",
        lora: LoraRef | None = None,
        kv_send: bool = False,
        kv_source: KVHandoff | None = None,
        **sampling,
    ) -> str:
        request_id = f"req-{next(_ids)}"
        params = SamplingParams(**{"temperature": 0.0, **sampling})
        message = AddRequest(request_id, list(prompt), params, float(next(_ids)), cache_salt, lora=lora)
        message.kv_send, message.kv_source = kv_send, kv_source
        error = self.scheduler.add(message)
        assert error is None, error.error
        return request_id

    def run(self, max_steps: int = 5000, on_step=None) -> dict[str, dict[int, list[int]]]:
        """Step until idle; returns each request's token ids by choice index (their top
        log-probabilities, where the request asked for them, go to `self.top_logprobs` alike)."""
        tokens: dict[str, dict[int, list[int]]] = {}
        in_flight = deque()
        for _ in range(max_steps):
            while len(in_flight) < self.depth and not (in_flight and self.scheduler.needs_drain):
                step = self.scheduler.schedule()
                if step is None:
                    break
                self.steps.append(step)
                in_flight.append(step)
            if not in_flight:
                assert not self.scheduler.has_work(), "work left that nothing schedules"
                break
            result = self.runner.execute(in_flight.popleft())
            assert result.error is None
            for output in self.scheduler.update(result):
                choices = tokens.setdefault(output.request_id, {})
                tops = self.top_logprobs.setdefault(output.request_id, {})
                if output.finished:
                    self.handoffs[output.request_id] = output.kv_handoff
                for delta in output.sequences:
                    choices.setdefault(delta.index, []).extend(delta.token_ids)
                    tops.setdefault(delta.index, []).extend(delta.top_logprobs)
            self.max_running_seqs = max(self.max_running_seqs, self.stats().num_running)
            check_block_accounting(self.scheduler)
            if on_step is not None:
                on_step(self)
        return tokens

    def generate(self, prompts: list[list[int]], **sampling) -> list[list[int]]:
        """Greedy (by default) outputs of every prompt, all submitted at once."""
        ids = [self.add(p, **sampling) for p in prompts]
        tokens = self.run()
        return [tokens[i][0] for i in ids]

    def generate_with_logprobs(
        self, prompts: list[list[int]], top: int = 5, **sampling
    ) -> list[tuple[list[int], list[dict[int, float]]]]:
        """Greedy outputs of every prompt with each position's `top` log-probabilities by token id."""
        ids = [self.add(p, logprobs=top, **sampling) for p in prompts]
        tokens = self.run()
        return [(tokens[i][0], self.top_logprobs[i][0]) for i in ids]

    def stats(self):
        return self.scheduler.stats()
