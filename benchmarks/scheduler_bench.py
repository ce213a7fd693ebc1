"""Scheduler overhead: schedule() plus step encoding, and the scheduler->worker->scheduler round trip,
over ipc:// (as `pagedserve up` runs) and over tcp:// with and without CURVE (as compose runs).

Prints a table and writes benchmarks/results/scheduler_bench.json. No torch: the worker here
decodes each step and answers it without running a model ("empty forward").
"""

from __future__ import annotations

import json
import multiprocessing
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import zmq  # noqa: E402

from services.scheduler.kv_cache_manager import KVCacheManager  # noqa: E402
from services.scheduler.scheduler import Budgets, Scheduler  # noqa: E402
from shared import sockets  # noqa: E402
from shared.protocol import AddRequest, SampledTokens, Shutdown, Step, StepResult, encode  # noqa: E402
from shared.sampling import SamplingParams  # noqa: E402
from shared.wire_security import load_keys, make_keys, start_authenticator  # noqa: E402

NUM_SEQS = 256
PROMPT_LEN = 128
ITERATIONS = int(os.environ.get("PAGEDSERVE_BENCH_ITERATIONS", "2000"))


def decoding_scheduler() -> Scheduler:
    """A scheduler with NUM_SEQS sequences past their prompts, all decoding."""
    scheduler = Scheduler(
        KVCacheManager(num_gpu_blocks=40_000, block_size=16, watermark=0.01),
        Budgets(max_num_seqs=NUM_SEQS, max_num_batched_tokens=NUM_SEQS * PROMPT_LEN, max_model_len=8192),
        eos_token_ids=[0],
    )
    for i in range(NUM_SEQS):
        params = SamplingParams(max_tokens=100_000, temperature=0.0)
        scheduler.add(AddRequest(f"r{i}", list(range(1, PROMPT_LEN + 1)), params, float(i)))
    scheduler.update(answer(scheduler.schedule()))
    return scheduler


def answer(step: Step) -> StepResult:
    """What a worker returns: one token for every sequence that finished its tokens."""
    sampled = [SampledTokens(e.seq_id, [7], [-0.5], [], []) for e in step.scheduled]
    return StepResult(step.step_id, sampled, 0.0, 0.0)


def bench_schedule() -> dict:
    scheduler = decoding_scheduler()
    schedule_ms, update_ms, sizes = [], [], []
    for _ in range(ITERATIONS):
        t0 = time.perf_counter()
        step = scheduler.schedule()
        frame = encode(step)
        t1 = time.perf_counter()
        scheduler.update(answer(step))
        t2 = time.perf_counter()
        assert len(step.scheduled) == NUM_SEQS
        schedule_ms.append((t1 - t0) * 1e3)
        update_ms.append((t2 - t1) * 1e3)
        sizes.append(len(frame))
    return {
        "schedule_plus_encode_ms_median": statistics.median(schedule_ms),
        "schedule_plus_encode_ms_p99": _p99(schedule_ms),
        "update_ms_median": statistics.median(update_ms),
        "step_frame_bytes_median": statistics.median(sizes),
    }


def empty_worker(endpoint: str, keys_dir: str | None) -> None:
    context = zmq.Context()
    keys = load_keys(os.path.join(keys_dir, "worker"), "worker") if keys_dir else None
    sock = sockets.connect(context, zmq.DEALER, endpoint, identity=b"worker-0", keys=keys)
    sock.send(b"ready")
    while True:
        _, step = sockets.receive(sock)
        if not isinstance(step, Step):
            break
        sockets.send(sock, answer(step))


def bench_round_trip(num_seqs: int, transport: str = "ipc") -> dict:
    """transport: ipc (what `pagedserve up` uses), tcp, or tcp+curve (what compose uses)."""
    directory = tempfile.mkdtemp(prefix="pagedserve-bench-")
    endpoint = f"ipc://{directory}/workers.sock" if transport == "ipc" else "tcp://127.0.0.1:*"
    keys_dir = os.path.join(directory, "keys") if transport == "tcp+curve" else None
    keys = None
    if keys_dir:
        make_keys(keys_dir)
        keys = load_keys(os.path.join(keys_dir, "scheduler"), "scheduler")
    context = zmq.Context()
    authenticator = start_authenticator(context, keys)
    router = sockets.bind(context, zmq.ROUTER, endpoint, keys, "worker")
    endpoint = router.getsockopt(zmq.LAST_ENDPOINT).decode()
    worker = multiprocessing.get_context("spawn").Process(target=empty_worker, args=(endpoint, keys_dir), daemon=True)
    worker.start()
    identity, _ = router.recv_multipart()
    scheduler = decoding_scheduler() if num_seqs else None
    times = []
    for i in range(ITERATIONS):
        step = scheduler.schedule() if scheduler else Step(i, [], [], [], [], [])
        if num_seqs and len(step.scheduled) > num_seqs:
            step.scheduled = step.scheduled[:num_seqs]
        t0 = time.perf_counter()
        sockets.send(router, step, to=identity)
        _, result = sockets.receive(router, routed=True)
        times.append((time.perf_counter() - t0) * 1e3)
        if scheduler:
            scheduler.update(result)
    sockets.send(router, Shutdown(), to=identity)
    worker.join(5)
    if authenticator is not None:
        authenticator.stop()
    context.destroy(linger=0)
    shutil.rmtree(directory, ignore_errors=True)
    return {"median_ms": statistics.median(times), "p99_ms": _p99(times)}


def _p99(values: list[float]) -> float:
    return sorted(values)[int(len(values) * 0.99)]


def main() -> None:
    results = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}",
        "date": time.strftime("%Y-%m-%d"),
        "schedule": bench_schedule(),
        "round_trip_empty_step": bench_round_trip(0),
        "round_trip_256_decodes": bench_round_trip(NUM_SEQS),
        "round_trip_empty_step_tcp": bench_round_trip(0, "tcp"),
        "round_trip_empty_step_tcp_curve": bench_round_trip(0, "tcp+curve"),
        "round_trip_256_decodes_tcp": bench_round_trip(NUM_SEQS, "tcp"),
        "round_trip_256_decodes_tcp_curve": bench_round_trip(NUM_SEQS, "tcp+curve"),
    }
    # The empty step isolates the wire: the 256-decode round trip adds milliseconds of decoding
    # and bookkeeping whose noise hides a difference this small.
    results["curve_cost_per_step_ms"] = (
        results["round_trip_empty_step_tcp_curve"]["median_ms"] - results["round_trip_empty_step_tcp"]["median_ms"]
    )
    print(f"{'measure':<48}{'median':>10}{'p99':>10}")
    s = results["schedule"]
    print(
        f"{'schedule()+encode, 256 decoding seqs (ms)':<48}{s['schedule_plus_encode_ms_median']:>10.3f}"
        f"{s['schedule_plus_encode_ms_p99']:>10.3f}"
    )
    print(f"{'update() with 256 sampled tokens (ms)':<48}{s['update_ms_median']:>10.3f}{'':>10}")
    print(f"{'step frame for 256 decodes (bytes)':<48}{s['step_frame_bytes_median']:>10.0f}{'':>10}")
    for key, label in [
        ("round_trip_empty_step", "round trip, empty step (ms)"),
        ("round_trip_empty_step_tcp", "  the same over tcp:// (ms)"),
        ("round_trip_empty_step_tcp_curve", "  the same over tcp:// with CURVE (ms)"),
        ("round_trip_256_decodes", "round trip, 256 decodes, no forward (ms)"),
        ("round_trip_256_decodes_tcp", "  the same over tcp:// (ms)"),
        ("round_trip_256_decodes_tcp_curve", "  the same over tcp:// with CURVE (ms)"),
    ]:
        r = results[key]
        print(f"{label:<48}{r['median_ms']:>10.3f}{r['p99_ms']:>10.3f}")
    print(f"{'CURVE cost per step, empty step (ms)':<48}{results['curve_cost_per_step_ms']:>10.3f}")
    out = os.environ.get("PAGEDSERVE_BENCH_OUT") or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "scheduler_bench.json"), "w") as f:
        json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
