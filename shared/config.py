"""Configuration values shared by the launcher and the services."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(slots=True)
class SchedulerConfig:
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # None: the model's context length, at least 2048
    max_model_len: int | None = None  # None: the model's own
    num_gpu_blocks_override: int | None = None
    watermark: float = 0.01  # fraction of GPU blocks kept free when admitting new prompts
    enable_prefix_caching: bool = False
    enable_chunked_prefill: bool = True  # long prompts never wait behind decodes
    preemption_mode: str = "auto"  # swap | recompute | auto
    kv_reservation: str = "paged"  # paged | max | pow2 | oracle: the last three are baselines
    async_scheduling: bool = True  # plan the next step while the workers compute this one
    step_timeout: float = 180.0  # seconds a step may take before its worker counts as lost
    log_stats_interval: float = 10.0  # seconds between the periodic stats lines; 0: none
    api_send_queue: int = 10_000  # messages queued for one api before it counts as not reading


@dataclass(slots=True)
class Endpoints:
    """Where the scheduler listens: for the api's requests and for the workers' connections."""

    scheduler: str
    workers: str

    @staticmethod
    def local(directory: str) -> Endpoints:
        """Unix sockets in `directory`, which should be private to the user (mode 0700)."""
        return Endpoints(
            scheduler=f"ipc://{os.path.join(directory, 'scheduler.sock')}",
            workers=f"ipc://{os.path.join(directory, 'workers.sock')}",
        )


SCHEDULER_METRICS_PORT = 8001  # each service's own /metrics; the api's is on its HTTP port
WORKER_METRICS_PORT = 8002  # rank r: this + r
