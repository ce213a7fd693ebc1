"""The benchmark scripts still run (at a tiny scale): they print figures, they are not timed here."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from kernels.cpu_linear import gemm_build
from tests.conftest import ROOT

# Starts processes (not in `make check`); some benchmarks listen on their fixed default ports, as
# does the getting-started page's server: under `pytest -n` they take turns in one worker.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("fixed-ports")]


def load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "benchmarks", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_bench(name: str, out_dir, **settings: str) -> subprocess.CompletedProcess:
    """`benchmarks/<name>.py` in a process of its own, writing into `out_dir`, with its
    PAGEDSERVE_BENCH_<SETTING> variables (ITERATIONS, REPEATS...) set to shrink it."""
    env = dict(
        os.environ,
        PAGEDSERVE_BENCH_OUT=str(out_dir),
        **{f"PAGEDSERVE_BENCH_{key.upper()}": value for key, value in settings.items()},
    )
    script = os.path.join(ROOT, "benchmarks", f"{name}.py")
    return subprocess.run([sys.executable, script], env=env, capture_output=True, text=True, timeout=120)


def test_scheduler_bench_runs(tmp_path):
    done = run_bench("scheduler_bench", tmp_path, iterations="5")
    assert done.returncode == 0, done.stderr
    assert "schedule()+encode" in done.stdout and "round trip" in done.stdout


@pytest.mark.parametrize("mode, width", [("parallel", 2), ("beam", 2)])
def test_sharing_bench_finds_savings(monkeypatch, mode, width):
    bench = load("sharing_bench")
    monkeypatch.setattr(bench, "NUM_REQUESTS", 20)
    assert 0 < bench.run(mode, width)["saving_percent"] < 100


def test_cpu_attention_bench_runs(tmp_path):
    done = run_bench("cpu_attention_bench", tmp_path, repeats="1", contexts="64")
    if "no C compiler" in done.stderr:
        pytest.skip("no C compiler here: the compiled CPU attention kernel cannot be built")
    assert done.returncode == 0, done.stderr
    result = json.loads((tmp_path / "cpu_attention_bench.json").read_text())
    rows = result["rows"]
    assert len(rows) == 5 and all(
        row["torch_ms"] > 0 and row["compiled_ms"] > 0 and row["compiled_int8_ms"] > 0 for row in rows
    )
    lone = result["lone_row_two_threads"]
    assert [(row["cache"], row["context"]) for row in lone] == [("bfloat16", 64), ("int8", 64)]
    assert all(row["whole_ms"] > 0 and row["sliced_ms"] > 0 for row in lone)


def test_prompt_attention_bench_compares_the_vector_kernel_and_the_tiles(tmp_path):
    done = run_bench("prompt_attention_bench", tmp_path, repeats="1")
    if "no C compiler" in done.stderr or "no AMX tiles" in done.stderr:
        pytest.skip(done.stderr.strip().splitlines()[-1])
    assert done.returncode == 0, done.stderr
    rows = json.loads((tmp_path / "prompt_attention_bench.json").read_text())["rows"]
    assert len(rows) == 6 and all(row["vector_ms"] > 0 and row["tiles_ms"] > 0 for row in rows)
    assert all(row["max_difference"] < 2e-3 for row in rows)  # one bfloat16 rounding of a weight, no more


def test_codes_tiles_bench_compares_the_dot_product_and_the_tiles(tmp_path):
    done = run_bench("codes_tiles_bench", tmp_path, repeats="1", rows="16")
    if "no C compiler" in done.stderr or "no AMX tiles" in done.stderr:
        pytest.skip(done.stderr.strip().splitlines()[-1])
    assert done.returncode == 0, done.stderr
    rows = json.loads((tmp_path / "codes_tiles_bench.json").read_text())["rows"]
    assert len(rows) == 5 and all(row["dot_ms"] > 0 and row["tiles_ms"] > 0 for row in rows)


def test_cpu_linear_bench_runs(tmp_path):
    done = run_bench("cpu_linear_bench", tmp_path, repeats="1", rows="2,9", step_rows="3", threads="1")
    if "cannot be built" in done.stderr:
        pytest.skip("no C compiler here: the packed linear kernels cannot be built")
    assert done.returncode == 0, done.stderr
    result = json.loads((tmp_path / "cpu_linear_bench.json").read_text())
    peak = result["peak"]
    # every probe ran and gave a rate; how the rates compare is the benchmark's to report (a test that times
    # them fails on a machine whose speed moves between two probes)
    assert peak["f32_gflops"] > 0 and peak["bf16_gflops"] > 0 and peak["read_gb_s"] > 0
    assert peak["read_all_cores_gb_s"] > 0
    if peak["amx_int8_gops"] is None:  # no AMX tiles here: no tile probe ran
        assert peak["amx_int8_all_cores_gops"] is None and peak["amx_int8_tile_loop_gops"] is None
    else:
        assert peak["amx_int8_gops"] > 0 and peak["amx_int8_all_cores_gops"] > 0
        assert set(peak["amx_int8_tile_loop_gops"]) == {"1 MiB", "4 MiB"}
        assert all(rate > 0 for rate in peak["amx_int8_tile_loop_gops"].values())
    rows = result["rows"]
    assert len(rows) == 14 and all(
        row["torch_f32"] > 0 and row[layout] > 0 and row[f"{layout}_of_peak"] > 0
        for row in rows
        for layout in ("f32", "bf16", "f16")
    )
    [step] = result["whole_step"]
    assert step["rows"] == 3 and step["threads"] == 1 and step["torch_f32_ms"] > 0
    assert step["bf16_gb_s"] > 0 and step["f32_ms"] > 0 and step["f16_ms"] > 0
    assert result["kernels"].startswith(gemm_build().variant)


def test_beam_memory_bench_runs(tmp_path):
    done = run_bench("beam_memory_bench", tmp_path, lengths="40,80")
    assert done.returncode == 0, done.stderr
    assert "MiB per 1k tokens" in done.stdout and (tmp_path / "beam_memory_bench.json").exists()


def test_peer_bench_runs_pagedserve_alone_with_our_client_and_reports_worker_idle_time(tmp_path):
    out = tmp_path / "peer.json"
    script = os.path.join(ROOT, "benchmarks", "peer_bench.py")
    done = subprocess.run(
        [
            sys.executable,
            script,
            "--scenarios",
            "throughput,throughput_loaded",
            "--repeats",
            "1",
            "--num-prompts-scale",
            "0.04",
            "--kv-cache-gib",
            "0.05",
            "--port",
            "8391",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    record = json.loads(out.read_text())
    [run] = record["runs"]["pagedserve"]
    assert run["throughput"]["completed"] == 8 and run["throughput"]["failed"] == 0
    assert run["throughput"]["output_throughput"] > 0
    assert "| throughput | output_throughput |" in done.stdout
    assert 0 <= run["throughput"]["worker_waiting_share"] < 1


def test_tp_memory_bench_reports_each_rank_and_the_ratio(tmp_path):
    out = tmp_path / "tp.json"
    done = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "benchmarks", "tp_memory_bench.py"),
            "--hidden",
            "128",
            "--layers",
            "2",
            "--heads",
            "4",
            "--vocab",
            "512",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    results = json.loads(out.read_text())
    assert len(results["rss_mib"]["1"]) == 1 and len(results["rss_mib"]["2"]) == 2
    assert all(value > 0 for values in results["rss_mib"].values() for value in values)
    assert "TP 2 / TP 1, per rank" in done.stdout


def test_peer_bench_interleaves_pagedserve_with_and_without_speculation_on_the_code_workload(tmp_path):
    out = tmp_path / "spec.json"
    script = os.path.join(ROOT, "benchmarks", "peer_bench.py")
    config = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 2}'
    done = subprocess.run(
        [
            sys.executable,
            script,
            "--scenarios",
            "code_c1",
            "--repeats",
            "1",
            "--interleave",
            "--num-prompts-scale",
            "0.08",
            "--kv-cache-gib",
            "0.05",
            "--port",
            "8431",
            "--speculative-config",
            config,
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    record = json.loads(out.read_text())
    assert set(record["runs"]) == {"pagedserve", "pagedserve+spec"} and record["settings"]["interleave"]
    [plain], [speculating] = record["runs"]["pagedserve"], record["runs"]["pagedserve+spec"]
    assert plain["code_c1"]["completed"] == speculating["code_c1"]["completed"] == 2
    assert speculating["code_c1"]["acceptance_length"] >= 1.0 and "acceptance_length" not in plain["code_c1"]
    assert "| code_c1 | output_throughput |" in done.stdout and "pagedserve+spec / pagedserve" in done.stdout


def test_dp_bench_compares_routing_policies_on_two_engines(tmp_path):
    out = tmp_path / "dp.json"
    done = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "benchmarks", "dp_bench.py"),
            "--repeats",
            "1",
            "--num-prompts",
            "16",
            "--prefixes",
            "4",
            "--policies",
            "round_robin,prefix",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    record = json.loads(out.read_text())
    for policy in ("round_robin", "prefix"):
        [run] = record["runs"][policy]
        assert run["completed"] == 16 and run["failed"] == 0
        assert 0 < run["prefix_cache_hit_rate"] < 1 and sum(run["requests_by_engine"]) == 16
    assert len(record["prefix_over_round_robin"]["hit_rate"]) == 1
    assert "prefix / round_robin, per repeat" in done.stdout


def test_fairness_bench_reports_the_steady_tenants_ttft_under_each_policy(tmp_path):
    out = tmp_path / "fairness.json"
    done = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "benchmarks", "fairness_bench.py"),
            "--repeats",
            "1",
            "--flood",
            "8",
            "--a-input",
            "64",
            "--a-output",
            "24",
            "--b-input",
            "16",
            "--b-output",
            "4",
            "--max-num-seqs",
            "4",
            "--alone",
            "2",
            "--duration",
            "4",
            "--settle",
            "1",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    record = json.loads(out.read_text())
    for policy in ("fcfs", "fair"):
        [run] = record["runs"][policy]
        assert run["b_requests"] >= 1 and run["a_requests_started"] >= 8 and run["output_throughput"] > 0
        assert run["b_ttft_median_ms"] > 0 and run["b_alone_ttft_median_ms"] > 0
    assert record["summary"]["fair"]["throughput_over_fcfs"][0] > 0
    assert "B TTFT / alone" in done.stdout


def test_multiturn_bench_loads_histories_back_from_the_host_cache(tmp_path):
    out = tmp_path / "multiturn.json"
    done = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "benchmarks", "multiturn_bench.py"),
            "--repeats",
            "1",
            "--users",
            "3",
            "--turns",
            "3",
            "--document",
            "96",
            "--question",
            "32",
            "--answer",
            "32",
            "--max-tokens",
            "4",
            "--think",
            "0.1",
            "--offload-gib",
            "0.05",
            "--device-blocks",
            "12",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    record = json.loads(out.read_text())
    runs = record["runs"]
    [tiered], [through], [plain] = runs["pagedserve+host"], runs["pagedserve+host-write-through"], runs["pagedserve"]
    assert tiered["turns"] == through["turns"] == plain["turns"] == 9 and tiered["output_throughput"] > 0
    for loaded in (tiered, through):
        assert loaded["counters"]['pagedserve_blocks_offloaded_total{direction="in"}'] > 0
        assert loaded["counters"]['pagedserve_step_phase_seconds_sum{phase="transfer",rank="0"}'] > 0
    assert plain["counters"]['pagedserve_blocks_offloaded_total{direction="in"}'] == 0
    assert "pagedserve+host / pagedserve: TTFT" in done.stdout
    assert "pagedserve+host-write-through / pagedserve+host: TTFT" in done.stdout


def test_lora_bench_spreads_requests_over_adapters_and_compares_with_the_base_model(tmp_path):
    out = tmp_path / "lora.json"
    done = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "benchmarks", "lora_bench.py"),
            "--model",
            os.path.join(ROOT, "ops", "configs", "tiny-python-4k"),
            "--repeats",
            "1",
            "--adapter-counts",
            "2,3",
            "--requests",
            "6",
            "--concurrency",
            "3",
            "--input-len",
            "16",
            "--output-len",
            "4",
            "--systems",
            "pagedserve-base,pagedserve",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    runs = json.loads(out.read_text())["runs"]
    assert set(runs) == {"pagedserve-base", "pagedserve/2", "pagedserve/3"}
    assert all(run["requests"] == 6 and run["output_throughput"] > 0 for results in runs.values() for run in results)
    assert "3 adapters / the base model alone (pagedserve): throughput" in done.stdout


def test_lora_kernel_bench_checks_its_kernel_against_the_loop_with_more_adapters_than_rows():
    """Each case it times on a GPU, checked here under Triton's interpreter (without the timing), on a narrower
    group of projections than the GPU's 8B one, as the interpreter is slow."""
    bench = load("lora_kernel_bench")
    narrow = {"q_proj": (256, 256), "k_proj": (256, 64), "v_proj": (256, 64)}
    assert bench.case(16, 4, device="cpu", timing=False, group=narrow) == {}
