"""pagedserve against vLLM on the same machine, model, KV budget, block size, dtype and batch limits.

Each repetition starts each system in turn (A B A B ...), runs every scenario against it with the
same client, and stops it. The client is `vllm bench serve` from `--vllm-venv` when given (vLLM's
own judge), otherwise our `serve_client.py`, which reports the same metrics; without `--vllm-venv`
only pagedserve runs. vLLM is never a dependency: it lives in its own virtual environment.

    python benchmarks/peer_bench.py --vllm-venv /work/vllm-venv --repeats 2
    python benchmarks/peer_bench.py --scenarios throughput,latency --repeats 1   # pagedserve alone
    python benchmarks/peer_bench.py --vllm-venv /work/vllm-venv --sweep 1,2,4,8   # TPOT vs rate plot

A model at real shapes with dummy weights, and vLLM also with both cores given to its worker:

    python benchmarks/peer_bench.py --vllm-venv /work/vllm-venv --interleave --repeats 3 --vllm-all-cores \
        --model ops/configs/llama-12l-768 --load-format dummy --scenarios mid_c16,mid_c1

Speculative decoding: `--speculative-config JSON` runs pagedserve without it, pagedserve with it and
vLLM with the same config (A B C A B C ...), best on the code workload (prompts cut from Python
sources, greedy, 128 tokens), and reports each system's mean acceptance length from its own
counters beside the client's figures:

    python benchmarks/peer_bench.py --vllm-venv /work/vllm-venv --repeats 3 \
        --scenarios code_c1,code_c4,code_c48 --speculative-config \
        '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import zlib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks import serve_client, workloads  # noqa: E402
from benchmarks.peer_report import plot, print_spec_table, print_table, spec_table, table  # noqa: E402
from benchmarks.provenance import commit, cpu_model  # noqa: E402

SERVED_NAME = "bench-model"


@dataclass(frozen=True, slots=True)
class Scenario:
    input_len: int
    output_len: int
    num_prompts: int
    max_concurrency: int | None = None
    request_rate: float = float("inf")
    cpu_load: bool = False  # one busy process per core-to-load runs beside the server
    metrics: tuple[str, ...] = ("output_throughput", "mean_tpot_ms")
    workload: str = "random"  # random token prompts of input_len, or "code" (benchmarks/workloads.py)
    body: str = ""  # more request fields, as JSON (a response_format, say), in every request


SCENARIOS = {
    "throughput": Scenario(128, 128, 200, max_concurrency=64),
    "c48": Scenario(128, 128, 192, max_concurrency=48, metrics=("output_throughput", "mean_tpot_ms", "median_ttft_ms")),
    # End-to-end too: a server that holds the first token back shows a lower TPOT for the same wait.
    "latency": Scenario(32, 64, 20, max_concurrency=1, metrics=("mean_tpot_ms", "mean_ttft_ms", "mean_e2el_ms")),
    # ShareGPT's mean lengths; all at once, so request throughput is the highest sustainable rate.
    "sharegpt_saturation": Scenario(161, 338, 200, metrics=("request_throughput", "output_throughput")),
    "sharegpt_rate2": Scenario(
        161, 338, 60, request_rate=2.0, metrics=("mean_tpot_ms", "mean_ttft_ms", "mean_e2el_ms")
    ),
    "throughput_loaded": Scenario(128, 128, 200, max_concurrency=64, cpu_load=True),
    # Code completion, greedy, for speculative decoding (about 350 prompt tokens, 128 out).
    "code_c1": Scenario(
        0,
        128,
        24,
        max_concurrency=1,
        workload="code",
        metrics=("output_throughput", "mean_tpot_ms", "median_tpot_ms", "mean_ttft_ms"),
    ),
    "code_c4": Scenario(
        0, 128, 48, max_concurrency=4, workload="code", metrics=("output_throughput", "mean_tpot_ms", "mean_ttft_ms")
    ),
    "code_c48": Scenario(
        0, 128, 192, max_concurrency=48, workload="code", metrics=("output_throughput", "mean_tpot_ms")
    ),
    # A model past toy size, where the step is matmuls (ops/configs/llama-12l-768 with dummy weights).
    "mid_c16": Scenario(
        256, 96, 64, max_concurrency=16, metrics=("output_throughput", "mean_tpot_ms", "median_ttft_ms", "mean_ttft_ms")
    ),
    # 16 prompts sent at once to an idle server: first tokens with no earlier requests' waves to wait behind.
    "mid_burst16": Scenario(256, 1, 16, max_concurrency=16, metrics=("median_ttft_ms", "mean_ttft_ms")),
    # Quantized against float on the same shape (--baseline-model): many short prompts decoding long, and long
    # prompts with few tokens out, where the first token is the figure.
    "decode_c32": Scenario(
        64, 256, 96, max_concurrency=32, metrics=("output_throughput", "mean_tpot_ms", "median_ttft_ms")
    ),
    "prefill_1k": Scenario(
        1024, 16, 16, max_concurrency=4, metrics=("median_ttft_ms", "mean_ttft_ms", "output_throughput")
    ),
    # One stream whose context grows long (a chat with its history): the step's attention is a large share.
    "long_c1": Scenario(
        1536, 256, 4, max_concurrency=1, metrics=("output_throughput", "mean_tpot_ms", "median_ttft_ms")
    ),
    "mid_c1": Scenario(
        256,
        96,
        12,
        max_concurrency=1,
        metrics=("output_throughput", "mean_tpot_ms", "median_tpot_ms", "median_ttft_ms"),
    ),
}


class Server:
    def __init__(self, name: str, command: list[str], env: dict[str, str], port: int, log_dir: Path):
        self.name, self.port = name, port
        for taken in (port, port + 1):  # the api, and pagedserve's scheduler metrics: a server left
            with socket.socket() as probe:  # running there would answer for this one
                if probe.connect_ex(("127.0.0.1", taken)) == 0:
                    raise RuntimeError(f"port {taken} is in use: another server is running there")
        with open(log_dir / f"{name}-{port}.log", "w") as log:  # the child keeps its own descriptor
            self.process = subprocess.Popen(
                command, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def wait_ready(self, timeout: float = 600.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode} before it was ready")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1.0)
        raise RuntimeError(f"{self.name} was not ready in {timeout:g} s")

    def stop(self) -> None:
        for sig, wait in ((signal.SIGINT, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.process.pid, sig)
                self.process.wait(wait)
                return
            except subprocess.TimeoutExpired:
                continue
            except ProcessLookupError:
                return


def pagedserve_command(args, port: int, speculative: bool = False) -> tuple[list[str], dict[str, str]]:
    command = [
        sys.executable,
        "-c",
        "from services.launcher import main_entry; main_entry()",
        "up",
        "--model",
        args.model,
        "--port",
        str(port),
        "--served-model-name",
        SERVED_NAME,
        "--device",
        "cpu",
        "--dtype",
        args.dtype,
        "--block-size",
        str(args.block_size),
        "--kv-cache-memory",
        str(args.kv_cache_gib),
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--max-num-batched-tokens",
        str(args.max_num_batched_tokens),
        "--scheduler-metrics-port",
        str(port + 1),
        "--worker-metrics-port",
        "0",
        "--load-format",
        args.load_format,
        "--tokenizer",
        args.tokenizer,
    ] + args.pagedserve_args.split()
    if speculative:
        command += ["--speculative-config", args.speculative_config]
    return command, {}


def vllm_command(args, port: int, speculative: bool = False) -> tuple[list[str], dict[str, str]]:
    command = [
        str(Path(args.vllm_venv) / "bin" / "vllm"),
        "serve",
        args.model,
        "--port",
        str(port),
        "--served-model-name",
        SERVED_NAME,
        "--dtype",
        args.dtype,
        "--block-size",
        str(args.block_size),
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--max-num-batched-tokens",
        str(args.max_num_batched_tokens),
        "--load-format",
        args.load_format,
        "--tokenizer",
        args.tokenizer,
    ]
    if speculative:  # without pagedserve's own key ("adaptive"), which vLLM does not know
        config = {k: v for k, v in json.loads(args.speculative_config).items() if k != "adaptive"}
        command += ["--speculative-config", json.dumps(config)]
    return command, {"VLLM_CPU_KVCACHE_SPACE": f"{args.kv_cache_gib:g}"}


def vllm_all_cores_command(args, port: int, speculative: bool = False) -> tuple[list[str], dict[str, str]]:
    """vLLM with every core bound to its worker's threads, rather than one kept for its frontend."""
    command, env = vllm_command(args, port, speculative)
    return command, env | {"VLLM_CPU_OMP_THREADS_BIND": f"0-{len(os.sched_getaffinity(0)) - 1}"}


def baseline_command(args, port: int, speculative: bool = False) -> tuple[list[str], dict[str, str]]:
    """pagedserve on --baseline-model (the float checkpoint of a quantized model's shape, say)."""
    return pagedserve_command(argparse.Namespace(**{**vars(args), "model": args.baseline_model}), port, speculative)


SYSTEMS = {  # name: (command, whether it speculates)
    "pagedserve": (pagedserve_command, False),
    "pagedserve-baseline": (baseline_command, False),
    "vllm": (vllm_command, False),
    "vllm-all-cores": (vllm_all_cores_command, False),
    "pagedserve+spec": (pagedserve_command, True),
    "vllm+spec": (vllm_command, True),
}


def run_client(args, port: int, scenario: Scenario, seed: int, scratch: Path) -> dict:
    base_url = f"http://127.0.0.1:{port}"
    code = scenario.workload == "code"
    # Prompts of their own for each scenario: none found in a prefix cache (on by default in vLLM)
    # from another scenario or from the warm-up.
    seed = 1000 * seed + (scenario.max_concurrency if code else zlib.crc32(repr(scenario).encode()) % 1000)
    if args.client == "ours":
        if code:
            jobs = workloads.code(scenario.num_prompts, seed=seed, output_len=scenario.output_len)
            return asyncio.run(
                serve_client.run_jobs(
                    base_url, SERVED_NAME, jobs, scenario.request_rate, scenario.max_concurrency, seed
                )
            )
        return asyncio.run(
            serve_client.run(
                base_url,
                SERVED_NAME,
                scenario.input_len,
                scenario.output_len,
                scenario.num_prompts,
                scenario.request_rate,
                scenario.max_concurrency,
                seed,
                params=json.loads(scenario.body) if scenario.body else None,
            )
        )
    result_file = f"result-{time.monotonic_ns()}.json"
    if code:  # the same prompts as our client's, as a custom dataset, sent as they are (no chat template)
        dataset = scratch / f"code-{seed}.jsonl"
        dataset.write_text(
            "".join(
                json.dumps({"prompt": job.prompt}) + "\n" for job in workloads.code(scenario.num_prompts, seed=seed)
            )
        )
        prompts = [
            "--dataset-name",
            "custom",
            "--dataset-path",
            str(dataset),
            "--skip-chat-template",
            "--custom-output-len",
            str(scenario.output_len),
            "--disable-shuffle",
            "--temperature",
            "0",
        ]
    else:
        prompts = [
            "--dataset-name",
            "random",
            "--random-input-len",
            str(scenario.input_len),
            "--random-output-len",
            str(scenario.output_len),
        ]
    command = [
        str(Path(args.vllm_venv) / "bin" / "vllm"),
        "bench",
        "serve",
        "--backend",
        "openai",
        "--base-url",
        base_url,
        "--model",
        SERVED_NAME,
        "--tokenizer",
        args.tokenizer,
        *prompts,
        "--num-prompts",
        str(scenario.num_prompts),
        "--request-rate",
        str(scenario.request_rate),
        "--ignore-eos",
        "--seed",
        str(seed),
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--save-result",
        "--result-dir",
        str(scratch),
        "--result-filename",
        result_file,
    ]
    if scenario.max_concurrency:
        command += ["--max-concurrency", str(scenario.max_concurrency)]
    if scenario.body:
        command += ["--extra-body", scenario.body]
    done = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads((scratch / result_file).read_text())


def worker_seconds(port: int) -> tuple[float, float]:
    """pagedserve's counters of worker time computing and waiting between steps on the scheduler,
    from the scheduler's /metrics (on the api's port + 1)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port + 1}/metrics", timeout=5) as response:
        text = response.read().decode()
    values = {}
    for line in text.splitlines():
        for name in ("busy", "waiting"):
            if line.startswith(f"pagedserve_worker_{name}_seconds_total "):
                values[name] = float(line.split()[1])
    return values.get("busy", 0.0), values.get("waiting", 0.0)


def acceptance_counters(name: str, port: int) -> tuple[float, float]:
    """(accepted tokens, drafts) of a speculating server, from its own /metrics: pagedserve's
    scheduler (on the api's port + 1), vLLM's api."""
    url = f"http://127.0.0.1:{port + 1 if name.startswith('pagedserve') else port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    totals = {"accepted": 0.0, "drafts": 0.0}
    for line in text.splitlines():
        for key, suffix in (
            ("accepted", "spec_decode_num_accepted_tokens_total"),
            ("drafts", "spec_decode_num_drafts_total"),
        ):
            metric = line.split("{")[0].split(" ")[0]
            if metric.endswith(suffix) and metric.split(":")[-1].removeprefix("pagedserve_") == suffix:
                totals[key] += float(line.rsplit(" ", 1)[1])
    return totals["accepted"], totals["drafts"]


def cpu_burners(count: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]


def start_system(args, name: str, port: int, scratch: Path) -> Server:
    build, speculative = SYSTEMS[name]
    command, env = build(args, port, speculative)
    server = Server(name, command, env, port, scratch)
    try:
        server.wait_ready()
        run_client(args, port, Scenario(32, 16, 8, max_concurrency=8), 0, scratch)  # warm-up
    except BaseException:  # not yet in the caller's list: stopped here, or it outlives the bench
        server.stop()
        raise
    return server


def run_scenario(args, name: str, port: int, scenario_name: str, scenario: Scenario, seed: int, scratch: Path) -> dict:
    """One scenario against a running system, with its worker's idle share and its acceptance length."""
    speculative = SYSTEMS[name][1]
    burners = cpu_burners(args.load_cores) if scenario.cpu_load else []
    before = worker_seconds(port) if name.startswith("pagedserve") else None
    counted = acceptance_counters(name, port) if speculative else None
    try:
        result = run_client(args, port, scenario, seed, scratch)
    finally:
        for burner in burners:
            burner.kill()
    if before is not None:
        busy, waiting = (b - a for a, b in zip(before, worker_seconds(port)))
        result["worker_waiting_share"] = waiting / busy if busy else 0.0
    if counted is not None:  # vLLM's convention: the bonus token counts, 1 + accepted / drafts
        accepted, drafts = (b - a for a, b in zip(counted, acceptance_counters(name, port)))
        result["acceptance_length"] = 1 + accepted / drafts if drafts else 1.0
    print(f"  {name} {scenario_name}: " + ", ".join(f"{m} {result[m]:.1f}" for m in scenario.metrics), flush=True)
    return result


def run_interleaved(args, systems: list[str], scenarios: dict[str, Scenario], scratch: Path) -> dict[str, list]:
    """Every system up at once (ports 20 apart), each scenario run on each in turn, repetition after
    repetition: a drift of this machine's speed then falls on all systems alike."""
    ports = {name: args.port + 20 * i for i, name in enumerate(systems)}
    servers = []
    runs: dict[str, list[dict]] = {name: [{} for _ in range(args.repeats)] for name in systems}
    try:
        for name in systems:
            servers.append(start_system(args, name, ports[name], scratch))
        for name in systems:  # again once all are up: a server may still be busy after its health check
            run_client(args, ports[name], Scenario(32, 16, 8, max_concurrency=8), 0, scratch)
        for repeat in range(args.repeats):
            print(f"repetition {repeat + 1}/{args.repeats}", flush=True)
            for scenario_name, scenario in scenarios.items():
                for name in systems:
                    runs[name][repeat][scenario_name] = run_scenario(
                        args, name, ports[name], scenario_name, scenario, repeat, scratch
                    )
    finally:
        for server in servers:
            server.stop()
    return runs


def run_system(
    args, name: str, port: int, scenarios: dict[str, Scenario], seed: int, scratch: Path, rates: list[float]
) -> tuple[dict, dict]:
    results, sweep = {}, {}
    server = None
    try:
        server = start_system(args, name, port, scratch)
        for scenario_name, scenario in scenarios.items():
            results[scenario_name] = run_scenario(args, name, port, scenario_name, scenario, seed, scratch)
        for rate in rates:
            sweep[rate] = run_client(
                args, port, Scenario(161, 338, args.sweep_prompts, request_rate=rate), seed, scratch
            )
            print(f"  {name} rate {rate:g}: mean TPOT {sweep[rate]['mean_tpot_ms']:.1f} ms", flush=True)
    finally:
        if server is not None:
            server.stop()
    return results, sweep


def add_system_args(parser: argparse.ArgumentParser) -> None:
    """What both systems serve and how, and the client that drives them (shared with structured_bench.py)."""
    parser.add_argument("--model", default=str(ROOT / "ops" / "models" / "tiny-python"))
    parser.add_argument("--tokenizer", default=None, help="None: the model's directory (a config alone needs one)")
    parser.add_argument("--load-format", default="auto", help="dummy: random weights from a config alone")
    parser.add_argument("--vllm-venv", default=None, help="a virtual environment with vllm (optional)")
    parser.add_argument("--client", choices=["auto", "vllm", "ours"], default="auto")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--kv-cache-gib", type=float, default=1.0)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--load-cores", type=int, default=1, help="busy processes in the loaded scenario")
    parser.add_argument("--pagedserve-args", default="", help="extra flags for `pagedserve up`")


def settle_system_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.tokenizer is None:
        args.tokenizer = (
            args.model
            if os.path.isfile(os.path.join(args.model, "tokenizer.json"))
            else str(ROOT / "ops" / "models" / "tiny-python")
        )
    if args.client == "auto":
        args.client = "vllm" if args.vllm_venv else "ours"
    if args.client == "vllm" and not args.vllm_venv:
        parser.error("--client vllm needs --vllm-venv")


def provenance_line(record: dict) -> str:
    """What a saved run was: model and dtype, CPU, date and commit (older files lack the last two)."""
    settings = record.get("settings", {})
    return (
        f"{record.get('model') or 'shipped model'} at --dtype {settings.get('dtype', 'auto')}; "
        f"{record.get('cpu', record.get('machine', '?'))}; {record.get('date', '?')}; "
        f"commit {record.get('commit', 'not recorded')}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_system_args(parser)
    parser.add_argument(
        "--vllm-all-cores",
        action="store_true",
        help="also run vLLM with every core bound to its worker (VLLM_CPU_OMP_THREADS_BIND)",
    )
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--sweep", default="", help="request rates for the TPOT-vs-rate plot, e.g. 1,2,4,8")
    parser.add_argument("--sweep-prompts", type=int, default=40)
    parser.add_argument("--num-prompts-scale", type=float, default=1.0, help="shrink every scenario (tests)")
    parser.add_argument("--port", type=int, default=8300)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "peer_bench.json"))
    parser.add_argument("--plot", default=str(ROOT / "docs" / "tpot_vs_rate.png"))
    parser.add_argument("--from-json", default=None, help="print the table and plot again from a saved run")
    parser.add_argument(
        "--interleave",
        action="store_true",
        help="start every system at once and run each scenario on each in turn (no --sweep)",
    )
    parser.add_argument(
        "--baseline-model",
        default=None,
        help="also run pagedserve on this model (a float checkpoint of the same shape) and report --model's "
        "advantage over it",
    )
    parser.add_argument(
        "--speculative-config",
        default=None,
        help="run pagedserve without and with this config, and vLLM with it (JSON, vLLM's form)",
    )
    args = parser.parse_args()
    if args.from_json:
        record = json.loads(Path(args.from_json).read_text())
        print(provenance_line(record))
        if record.get("speculative_config"):
            print_spec_table(record["table"], list(record["runs"]))
            return
        print_table(record["table"])
        if record["sweep"]:
            plot({s: {float(r): v for r, v in sweep.items()} for s, sweep in record["sweep"].items()}, Path(args.plot))
            print(f"wrote {args.plot}")
        return
    if args.interleave and args.sweep:
        parser.error("--sweep runs one system at a time: leave out --interleave")
    settle_system_args(parser, args)
    scenarios = {}
    for name in filter(None, args.scenarios.split(",")):
        base = SCENARIOS[name]
        prompts = max(2, round(base.num_prompts * args.num_prompts_scale))
        scenarios[name] = dataclasses.replace(base, num_prompts=prompts)
    if args.speculative_config:
        systems = ["pagedserve", "pagedserve+spec"] + (["vllm+spec"] if args.vllm_venv else [])
    else:
        systems = ["pagedserve"] + (["vllm"] if args.vllm_venv else [])
        systems += ["vllm-all-cores"] if args.vllm_venv and args.vllm_all_cores else []
        systems += ["pagedserve-baseline"] if args.baseline_model else []
    rates = [float(r) for r in args.sweep.split(",") if r]
    runs: dict[str, list[dict]] = {s: [] for s in systems}
    sweeps: dict[str, dict[float, dict]] = {}
    with tempfile.TemporaryDirectory(prefix="peer-bench-") as scratch:
        if args.interleave:
            runs = run_interleaved(args, systems, scenarios, Path(scratch))
        for repeat in range(0 if args.interleave else args.repeats):
            for system in systems:
                print(f"repetition {repeat + 1}/{args.repeats}: {system}", flush=True)
                results, sweep = run_system(
                    args,
                    system,
                    args.port,
                    scenarios,
                    seed=repeat,
                    scratch=Path(scratch),
                    rates=rates if repeat == 0 else [],
                )
                runs[system].append(results)
                if sweep:
                    sweeps[system] = sweep
    if args.speculative_config:
        rows = spec_table(runs, scenarios)
        print_spec_table(rows, systems)
    else:
        rows = table(runs, scenarios)
        print_table(rows)
    record = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform()}",
        "cpu": cpu_model(),
        "commit": commit(),
        "date": time.strftime("%Y-%m-%d"),
        "client": args.client,
        "model": args.model,
        "settings": {
            k: getattr(args, k)
            for k in (
                "block_size",
                "dtype",
                "kv_cache_gib",
                "max_num_seqs",
                "max_num_batched_tokens",
                "load_cores",
                "pagedserve_args",
                "interleave",
                "load_format",
                "tokenizer",
                "baseline_model",
            )
        },
        "scenarios": {
            name: {
                "input_len": s.input_len,
                "output_len": s.output_len,
                "num_prompts": s.num_prompts,
                "max_concurrency": s.max_concurrency,
                "request_rate": str(s.request_rate),
                "cpu_load": s.cpu_load,
                "workload": s.workload,
            }
            for name, s in scenarios.items()
        },
        "speculative_config": args.speculative_config,
        "table": rows,
        "runs": runs,
        "sweep": {system: {str(rate): result for rate, result in sweep.items()} for system, sweep in sweeps.items()},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}")
    if sweeps:
        plot(sweeps, Path(args.plot))
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
