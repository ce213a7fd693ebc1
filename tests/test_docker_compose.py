"""`docker-compose up` as an operator runs it: the images build from the local base image, the
CPU stack and Prometheus come up, a streamed completion arrives through the published port, and
Prometheus scrapes the api, the scheduler and the worker. Needs a Docker engine, docker-compose
and the base image (.ci/run provides all three where it runs as root)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time

import httpx
import pytest

from tests.conftest import ROOT, free_port, wait_until

BASE_IMAGE = "pagedserve-base:bookworm"


def engine_problem() -> str | None:
    if shutil.which("docker") is None or shutil.which("docker-compose") is None:
        return "no docker or docker-compose command"
    if subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode != 0:
        return "no Docker engine is running"
    if subprocess.run(["docker", "image", "inspect", BASE_IMAGE], capture_output=True, timeout=30).returncode != 0:
        return f"no {BASE_IMAGE} image (ops/docker/build-base-image.sh builds it)"
    return None


PROBLEM = engine_problem()
pytestmark = pytest.mark.skipif(PROBLEM is not None, reason=f"docker compose test: {PROBLEM}")


def compose(project: str, env: dict[str, str], *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run(["docker-compose", "-p", project, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def scraped_jobs(prometheus: str) -> dict[str, str]:
    try:
        result = httpx.get(f"{prometheus}/api/v1/query", params={"query": "up"}, timeout=5).json()["data"]["result"]
    except (httpx.HTTPError, ValueError, KeyError):
        return {}
    return {series["metric"]["job"]: series["value"][1] for series in result}


def test_docker_compose_up_serves_a_stream_and_prometheus_scrapes_every_service():
    project = f"pagedservetest{os.getpid()}"
    port, prometheus_port = free_port(), free_port()
    env = dict(os.environ, PORT=str(port), PROMETHEUS_PORT=str(prometheus_port), COMPOSE_PROFILES="cpu")
    timings = {}
    started = time.monotonic()
    built = compose(project, env, "build")
    assert built.returncode == 0, built.stdout[-4000:] + built.stderr[-4000:]
    timings["build"] = time.monotonic() - started
    try:
        started = time.monotonic()
        up = compose(project, env, "up", "-d")
        assert up.returncode == 0, up.stdout[-4000:] + up.stderr[-4000:]
        base = f"http://127.0.0.1:{port}"

        def healthy() -> bool:
            try:
                return httpx.get(f"{base}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        assert wait_until(healthy, 300, 1), compose(project, env, "logs", "--tail", "50").stdout
        timings["up to healthy"] = time.monotonic() - started
        body = {"model": "tiny-python", "prompt": "def main():\n", "max_tokens": 16, "stream": True}
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as response:
            assert response.status_code == 200
            events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and len(events) > 2
        assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1] if json.loads(e)["choices"])
        prometheus = f"http://127.0.0.1:{prometheus_port}"
        assert wait_until(lambda: scraped_jobs(prometheus) == {"api": "1", "scheduler": "1", "worker": "1"}, 60, 1), \
            scraped_jobs(prometheus)
    finally:
        started = time.monotonic()
        down = compose(project, env, "down", "-v", "--remove-orphans", timeout=120)
        timings["down"] = time.monotonic() - started
        print("docker compose timings: " + ", ".join(f"{k} {v:.1f} s" for k, v in timings.items()))
    assert down.returncode == 0, down.stderr[-2000:]
    assert timings["down"] < 30, timings
