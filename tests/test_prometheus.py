"""The shipped dashboard's queries on a real Prometheus scraping pagedserve under load.

Two servers, one preempting by swap (with a host cache) and one by recompute (speculating, and serving
half its requests under a LoRA adapter), both
with prefix caching and a KV cache small enough that the load preempts; Prometheus scrapes all six
services (each server's api, scheduler and worker) every second. Every PromQL
expression of the dashboard must parse and return data, and the latency histograms must count
exactly the requests sent. Needs Debian's `prometheus` (.ci/run installs it).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.conftest import ROOT, free_port, serve, wait_until
from tests.test_resilience import healthy
from tests.tiny_models import make_lora_adapter

PROMETHEUS = shutil.which("prometheus")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(PROMETHEUS is None, reason="no prometheus binary (apt-get install prometheus)"),
]

SMALL_KV = ["--block-size", "4", "--num-gpu-blocks-override", "40", "--enable-prefix-caching"]
# Proposals in every step (not only where the switch finds they pay), for the speculation panels.
SPECULATING = (
    '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3, '
    '"adaptive": false}'
)
PREFIX = "def handler(request, response):\n    response.status = 200\n    return response\n"


def dashboard_queries() -> list[str]:
    with open(os.path.join(ROOT, "ops", "grafana", "dashboards", "pagedserve.json")) as f:
        return [target["expr"] for panel in json.load(f)["panels"] for target in panel["targets"]]


@contextlib.contextmanager
def prometheus(targets: list[str], directory: str):
    port = free_port()
    config = os.path.join(directory, "prometheus.yml")
    with open(config, "w") as f:
        f.write(
            "global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: pagedserve\n"
            f"    static_configs:\n      - targets: {json.dumps(targets)}\n"
        )
    with open(os.path.join(directory, "prometheus.log"), "w") as log:
        process = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={config}",
                f"--storage.tsdb.path={directory}/data",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        assert wait_until(lambda: process.poll() is not None or healthy(f"{base}/-/ready"), 60, 0.3)
        assert process.poll() is None, "prometheus did not start"
        yield base
    finally:
        process.terminate()
        process.wait(10)


def query(base: str, expr: str) -> list:
    response = httpx.get(f"{base}/api/v1/query", params={"query": expr}, timeout=10).json()
    assert response["status"] == "success", (expr, response)
    return response["data"]["result"]


def scraped_count(base: str) -> float:
    result = query(base, "sum(pagedserve_e2e_request_latency_seconds_count)")
    return float(result[0]["value"][1]) if result else 0.0


def load(server, count: int, models: tuple[str, ...] = ()) -> None:
    """`count` requests at once, their `model` taken in turn from `models` (the served model by default)."""
    models = models or (server.model,)

    def one(i: int) -> None:
        body = {
            "model": models[i % len(models)],
            "prompt": PREFIX + f"# request {i}\n",
            "max_tokens": 48,
            "ignore_eos": True,
            "temperature": 0,
            "stream": i % 2 == 0,
        }
        with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=120) as response:
            assert response.status_code == 200
            response.read()

    with ThreadPoolExecutor(count) as pool:
        list(pool.map(one, range(count)))


def test_every_dashboard_query_returns_data_and_histograms_count_every_request(llama_dir, tmp_path):
    count = 12
    adapter = make_lora_adapter(llama_dir, str(tmp_path / "adapter"), rank=4, targets=("q_proj", "v_proj"))
    with (
        serve(
            llama_dir, str(tmp_path), *SMALL_KV, "--preemption-mode", "swap", "--kv-offloading-size", "0.001"
        ) as swapping,
        serve(
            llama_dir,
            str(tmp_path),
            *SMALL_KV,
            "--preemption-mode",
            "recompute",
            "--speculative-config",
            SPECULATING,
            "--enable-lora",
            "--lora-modules",
            f"tuned={adapter}",
        ) as recomputing,
    ):
        targets = [
            url.removeprefix("http://").removesuffix("/metrics")
            for server in (swapping, recomputing)
            for url in server.metrics_urls.values()
        ]
        with prometheus(targets, str(tmp_path)) as base:
            assert wait_until(lambda: len(query(base, "up == 1")) == 6, 30, 0.5), "prometheus never scraped all six"
            for server, models in ((swapping, ()), (recomputing, (recomputing.model, "tuned"))):
                load(server, count, models)
                load(server, 2, models)  # the shared prefix is cached by now
            for server, mode in ((swapping, "swap"), (recomputing, "recompute")):
                assert server.metrics()[f'pagedserve_preemptions_total{{mode="{mode}"}}'] > 0
                assert server.metrics()["pagedserve_prefix_cache_hits_total"] > 0
            assert swapping.metrics()['pagedserve_blocks_swapped_total{direction="out"}'] > 0
            assert recomputing.metrics()['pagedserve_lora_requests_total{adapter="tuned"}'] == (count + 2) // 2
            sent = 2 * (count + 2)
            assert wait_until(lambda: scraped_count(base) == sent, 30, 0.5), f"{scraped_count(base)} of {sent} requests"
            loaded = time.time()  # one more scrape of each target, so every rate has two points after the load
            assert wait_until(
                lambda: (
                    len(scrapes := query(base, "timestamp(up)")) == 6
                    and all(float(s["value"][1]) > loaded for s in scrapes)
                ),
                30,
                0.5,
            )
            up = query(base, "up")
            assert len(up) == 6 and all(series["value"][1] == "1" for series in up)
            empty = [expr for expr in dashboard_queries() if not query(base, expr)]
            assert not empty, f"no data for {empty}"
            for histogram in ("time_to_first_token", "e2e_request_latency"):
                [total] = query(base, f"sum(pagedserve_{histogram}_seconds_count)")
                assert float(total["value"][1]) == sent
            [finished] = query(base, 'sum(pagedserve_requests_total{finish_reason="length"})')
            assert float(finished["value"][1]) == sent
            [cached] = query(base, "sum(pagedserve_prefix_cache_hits_total) <= sum(pagedserve_prompt_tokens_total)")
            assert cached
            # vLLM's names on the api's port, as routers and autoscalers read them: the same figures.
            for ours, theirs in (
                ("pagedserve_prompt_tokens_total", "vllm:prompt_tokens_total"),
                ("pagedserve_time_to_first_token_seconds_count", "vllm:time_to_first_token_seconds_count"),
                ('pagedserve_requests_total{finish_reason="length"}', "vllm:request_success_total"),
            ):
                assert query(base, f"sum({theirs}) == sum({ours})"), f"{theirs} is not {ours}"
            for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
                assert len(query(base, gauge)) == 2, gauge  # one engine behind each of the two apis
