"""What the paper-figure scripts share: a pagedserve to drive, a sampler of its KV slot metrics, and
one run of a workload at a request rate.

Each server runs with the shipped model (or `--model`), a fixed number of KV blocks, and the
reservation policy under test, so only memory management differs between the systems compared.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from contextlib import contextmanager, nullcontext
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks import serve_client  # noqa: E402
from benchmarks.peer_bench import Server  # noqa: E402
from benchmarks.provenance import cpu_model  # noqa: E402
from benchmarks.workloads import Job  # noqa: E402

SERVED_NAME = "bench-model"
SLOT_STATES = ("tokens", "reserved", "unused", "fragmented")
SLOT = re.compile(r'^pagedserve_kv_slots\{state="(\w+)"\} ([0-9.e+-]+)$', re.M)


def free_ports(count: int) -> list[int]:
    """Ports free now, all different: the sockets stay bound until all are chosen."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def budget_flags(args) -> list[str]:
    """The KV budget every system compared shares (`args.num_blocks` blocks of `args.block_size`,
    context `args.max_model_len`), and recompute preemption."""
    return [
        "--num-gpu-blocks-override",
        str(args.num_blocks),
        "--block-size",
        str(args.block_size),
        "--max-model-len",
        str(args.max_model_len),
        "--preemption-mode",
        "recompute",
    ]


@contextmanager
def pagedserve(*flags: str, model: str | None = None):
    """A running `pagedserve up`, on the CPU unless `flags` say `--device cuda`; yields (api url,
    scheduler /metrics url). Its log goes to $BENCH_LOG_DIR when set, else to a directory that goes
    with it."""
    port, metrics_port = free_ports(2)
    command = [
        sys.executable,
        "-m",
        "services.launcher",
        "up",
        "--port",
        str(port),
        "--served-model-name",
        SERVED_NAME,
        "--device",
        "cpu",
        "--scheduler-metrics-port",
        str(metrics_port),
        "--worker-metrics-port",
        "0",
        "--log-stats-interval",
        "0",
        *(["--model", model] if model else []),
        *flags,
    ]
    kept = os.environ.get("BENCH_LOG_DIR")
    with nullcontext(kept) if kept else tempfile.TemporaryDirectory() as logs:
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
        server = Server("pagedserve", command, {"PYTHONPATH": path}, port, Path(logs))
        try:
            server.wait_ready(300)
            yield f"http://127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}/metrics"
        finally:
            server.stop()


class SlotSampler:
    """Scrapes the scheduler's KV slot gauges every `interval` seconds while a run lasts; the
    breakdown averages the samples taken while some slots were in use."""

    def __init__(self, metrics_url: str, interval: float = 0.05):
        self.url, self.interval = metrics_url, interval
        self.samples: list[dict[str, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> SlotSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                with urllib.request.urlopen(self.url, timeout=5) as response:
                    text = response.read().decode()
            except OSError:
                continue
            slots = {state: float(value) for state, value in SLOT.findall(text)}
            if sum(slots.values()) > 0:
                self.samples.append(slots)

    def breakdown(self) -> dict[str, float]:
        """Shares of the KV slots that are used or stranded between reservations (external
        fragmentation), in percent, averaged over the samples."""
        if not self.samples:
            return {**{state: 0.0 for state in SLOT_STATES}, "samples": 0}
        totals = {state: 0.0 for state in SLOT_STATES}
        for sample in self.samples:
            used = sum(sample.values())
            for state in totals:
                totals[state] += 100.0 * sample.get(state, 0.0) / used
        shares = {state: value / len(self.samples) for state, value in totals.items()}
        return {**shares, "samples": len(self.samples)}


def run_at_rate(api_url: str, metrics_url: str, jobs: list[Job], rate: float, seed: int = 0, warmup: int = 2) -> dict:
    """One run of `jobs` (the first `warmup` sent alone first) at a Poisson `rate`, with the KV slot
    breakdown over it."""
    with SlotSampler(metrics_url) as sampler:
        result = asyncio.run(serve_client.run_jobs(api_url, SERVED_NAME, jobs, rate, seed=seed, warmup=warmup))
    return {**result, "kv_slots_percent": sampler.breakdown()}


def pyplot():
    """matplotlib's pyplot, drawing to files only."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(figure, path: Path) -> None:
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    print(f"wrote {path}")


def machine() -> dict:
    return {
        "machine": platform.machine(),
        "processor": cpu_model(),
        "cores": os.cpu_count(),
        "gpu": gpu_name(),
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def gpu_name() -> str | None:
    try:
        listing = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=30
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return listing.splitlines()[0] if listing else None


def write_json(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")
