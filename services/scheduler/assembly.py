"""The scheduler an engine runs, made once every worker rank has reported Ready: its KV pools sized by the ranks'
memory (the smallest of them), its budgets, preemption costs, speculation and policy from the config."""

from __future__ import annotations

import logging

from services.scheduler.disk_index import DiskIndex
from services.scheduler.kv_cache_manager import KVCacheManager
from services.scheduler.policy import make_policy
from services.scheduler.reservation import Reservation
from services.scheduler.scheduler import Budgets, ConfigError, PreemptionPolicy, Scheduler
from services.scheduler.speculation import Speculation
from shared.config import LoraConfig, SchedulerConfig
from shared.kv_folder import KVFolderError
from shared.protocol import Ready, SchedulerInfo

log = logging.getLogger("services.scheduler.server")


def build_scheduler(
    config: SchedulerConfig, lora: LoraConfig, ready: list[Ready], world_size: int
) -> tuple[Scheduler, SchedulerInfo]:
    """The scheduler of what every rank reported (`ready`, one Ready each), and what the apis are told of it."""
    first = ready[0]
    if first.block_size != config.block_size:
        raise ConfigError(f"worker block size {first.block_size} != scheduler's {config.block_size}")
    num_blocks = config.num_gpu_blocks_override or min(r.num_gpu_blocks for r in ready)
    num_cpu_blocks = min(r.num_cpu_blocks for r in ready)
    num_host_cache_blocks = min(r.num_host_cache_blocks for r in ready)
    if num_host_cache_blocks and not config.enable_prefix_caching:
        log.warning(
            "the workers keep a host cache (--kv-offloading-size), which holds prefix-cache blocks: "
            "without --enable-prefix-caching it stays empty"
        )
    disk = None
    if config.kv_cache_dir and first.disk_fingerprint:
        if not config.enable_prefix_caching:
            log.warning("--kv-cache-dir keeps prefix-cache blocks: without --enable-prefix-caching it stays unused")
        try:
            disk = DiskIndex(
                config.kv_cache_dir,
                first.disk_fingerprint,
                world_size,
                int(config.kv_cache_dir_size * 2**30 // max(first.block_bytes, 1)),
            )
        except KVFolderError as exc:
            raise ConfigError(str(exc)) from None
        log.info(
            "KV blocks on disk: %d found under %s, room for %d more (%d in all)",
            len(disk),
            config.kv_cache_dir,
            max(0, disk.capacity - len(disk)),
            disk.capacity,
        )
    kv_cache = KVCacheManager(
        num_blocks,
        config.block_size,
        num_cpu_blocks,
        config.watermark,
        config.enable_prefix_caching,
        num_host_cache_blocks,
        disk,
        write_through=config.kv_offloading_policy == "write-through",
    )
    transfer = config.kv_transfer
    if transfer is not None:
        if transfer.consumes and not config.enable_prefix_caching:
            raise ConfigError(
                "--kv-transfer-config as a consumer needs --enable-prefix-caching: fetched blocks join the prefix cache"
            )
        if transfer.produces and not first.kv_address:
            raise ConfigError(
                "--kv-transfer-config as a producer: the worker runs no KV server (start it with the flag)"
            )
        remote = kv_cache.remote
        remote.address, remote.layout, remote.hold_seconds = first.kv_address, first.kv_layout, transfer.hold_seconds
        remote.consumes = transfer.consumes
    if lora.enable_lora:
        if not first.lora_half_elements:
            raise ConfigError("--enable-lora: the workers serve no adapters (start them with --enable-lora)")
        kv_cache.enable_adapters(
            lora.max_loras, first.lora_half_elements, first.lora_dims, lora.max_cpu_loras or lora.max_loras
        )
    usable_tokens = (num_blocks - kv_cache.watermark_blocks) * config.block_size
    max_model_len = min(config.max_model_len or first.max_model_len, usable_tokens)
    default_batched = 2048 if config.enable_chunked_prefill else max(max_model_len, 2048)
    max_batched = config.max_num_batched_tokens or default_batched
    budgets = Budgets(config.max_num_seqs, max_batched, max_model_len, config.enable_chunked_prefill)
    preemption = PreemptionPolicy(
        config.preemption_mode, first.block_bytes, first.swap_bytes_per_second, first.prefill_tokens_per_second
    )
    speculative = config.speculative
    if speculative is not None and any(r.drafts != speculative.method for r in ready):
        raise ConfigError(
            f"--speculative-config asks for {speculative.method} proposals, which the workers make, "
            "but a worker rank makes none or others (start the workers with the same "
            "--speculative-config)"
        )
    speculation = Speculation(speculative, max_model_len) if speculative is not None else None
    scheduler = Scheduler(
        kv_cache,
        budgets,
        first.eos_token_ids,
        preemption,
        first.vocab_size,
        Reservation(config.kv_reservation),
        speculation,
        make_policy(config.scheduling_policy, config.max_queue_delay, config.tenant_weights),
    )
    scheduler.pooling = first.pooling
    info = SchedulerInfo(
        config.block_size, num_blocks, max_model_len, max_batched, first.eos_token_ids, config.max_num_seqs,
        first.pooling,
    )  # fmt: skip
    log.info("scheduling with %d device KV blocks, context %d tokens", num_blocks, max_model_len)
    return scheduler, info
