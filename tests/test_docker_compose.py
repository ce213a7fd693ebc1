"""The Docker page (docs/deployment/docker.md), typed as written: the engine is prepared, `docker-compose up`
builds the images from the local base image, the CPU stack and Prometheus come up, a streamed
completion arrives through the published port, Prometheus scrapes the api, the scheduler and the
worker, the worker's image has no compiler and runs the wheel's prebuilt kernels, and Ctrl-C
stops it all. Needs a Docker engine, docker-compose
and the base image (.ci/run provides all three where it runs as root)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import threading
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
pytestmark = [pytest.mark.slow, pytest.mark.skipif(PROBLEM is not None, reason=f"docker compose test: {PROBLEM}")]


def compose(project: str, env: dict[str, str], *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["docker-compose", "-p", project, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def scraped_jobs(prometheus: str) -> dict[str, str]:
    try:
        result = httpx.get(f"{prometheus}/api/v1/query", params={"query": "up"}, timeout=5).json()["data"]["result"]
    except (httpx.HTTPError, ValueError, KeyError):
        return {}
    return {series["metric"]["job"]: series["value"][1] for series in result}


def readme_docker_commands() -> list[str]:
    """The commands of the Docker page's first block, as a reader would type them."""
    with open(os.path.join(ROOT, "docs", "deployment", "docker.md")) as f:
        section = f.read()
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    return [line.split("#", 1)[0].strip() for line in block.splitlines() if line.split("#", 1)[0].strip()]


def kernels_in_the_running_worker(project: str, env: dict[str, str]) -> tuple[list[str], str]:
    """The C compilers the worker's image has (none, as it runs), and the library its packed linear
    kernel loads: the installed package's prebuilt one."""
    [container] = compose(project, env, "ps", "-q", "worker-cpu").stdout.split()
    script = (
        "import glob, shutil; from kernels import native; "
        "print([c for c in ('cc', 'gcc', 'clang') if shutil.which(c)] + glob.glob('/usr/bin/*-gcc-*')); "
        "print(native.load('cpu_gemm')._name)"
    )
    done = subprocess.run(
        ["docker", "exec", container, "python", "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    compilers, kernel = done.stdout.strip().splitlines()[-2:]
    return json.loads(compilers.replace("'", '"')), kernel


def test_the_readme_docker_commands_as_written_serve_a_stream_prometheus_scrapes_and_ctrl_c_stops():
    prepare, up_command = readme_docker_commands()
    project = f"pagedservetest{os.getpid()}"
    port, prometheus_port = free_port(), free_port()
    env = dict(os.environ, COMPOSE_PROJECT_NAME=project, PORT=str(port), PROMETHEUS_PORT=str(prometheus_port))
    env.pop("COMPOSE_PROFILES", None)  # .env chooses the CPU profile, as for a reader
    timings = {}
    started = time.monotonic()
    prepared = subprocess.run(["bash", "-c", prepare], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert prepared.returncode == 0, prepared.stdout[-3000:] + prepared.stderr[-3000:]
    timings["prepare"] = time.monotonic() - started
    started = time.monotonic()
    up = subprocess.Popen(
        ["bash", "-c", f"exec {up_command}"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.extend(up.stdout), daemon=True)
    reader.start()
    try:
        base = f"http://127.0.0.1:{port}"

        def healthy() -> bool:
            try:
                return httpx.get(f"{base}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        assert wait_until(lambda: healthy() or up.poll() is not None, 900, 1) and up.poll() is None, "".join(
            output[-60:]
        )
        timings["up to healthy (with build)"] = time.monotonic() - started
        body = {"model": "tiny-python", "prompt": "def main():\n", "max_tokens": 16, "stream": True}
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as response:
            assert response.status_code == 200
            events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and len(events) > 2
        assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1] if json.loads(e)["choices"])
        prometheus = f"http://127.0.0.1:{prometheus_port}"
        assert wait_until(lambda: scraped_jobs(prometheus) == {"api": "1", "scheduler": "1", "worker": "1"}, 60, 1), (
            scraped_jobs(prometheus)
        )
        compilers, kernel = kernels_in_the_running_worker(project, env)
        assert compilers == [], compilers
        assert "/site-packages/kernels/prebuilt/cpu_gemm-" in kernel, kernel
        started = time.monotonic()
        up.send_signal(signal.SIGINT)  # Ctrl-C
        up.wait(timeout=60)
        timings["ctrl-c"] = time.monotonic() - started
        stopped = compose(project, env, "ps", "-q")
        running = [
            c
            for c in stopped.stdout.split()
            if subprocess.run(
                ["docker", "inspect", "-f", "{{.State.Running}}", c], capture_output=True, text=True
            ).stdout.strip()
            == "true"
        ]
        assert not running, "".join(output[-40:])
    finally:
        if up.poll() is None:
            up.kill()
        down = compose(project, env, "down", "-v", "--remove-orphans", timeout=120)
        print("docker compose timings: " + ", ".join(f"{k} {v:.1f} s" for k, v in timings.items()))
    assert down.returncode == 0, down.stderr[-2000:]
    assert timings["ctrl-c"] < 30, timings


def scraped_engines(prometheus: str) -> dict[tuple[str, str], str]:
    try:
        result = httpx.get(f"{prometheus}/api/v1/query", params={"query": "up"}, timeout=5).json()["data"]["result"]
    except (httpx.HTTPError, ValueError, KeyError):
        return {}
    return {(series["metric"]["job"], series["metric"].get("engine", "")): series["value"][1] for series in result}


@contextlib.contextmanager
def stack(name: str, override: str):
    """compose.yaml with an override file, up until the block exits: yields (its api's base URL, Prometheus's
    URL, a function that reads the api's /health) once /health says ok."""
    project = f"{name}{os.getpid()}"
    port, prometheus_port = free_port(), free_port()
    env = dict(os.environ, COMPOSE_PROJECT_NAME=project, PORT=str(port), PROMETHEUS_PORT=str(prometheus_port))
    env.pop("COMPOSE_PROFILES", None)
    files = ["-f", "compose.yaml", "-f", override]
    prepared = subprocess.run(
        ["bash", "ops/docker/prepare-engine.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
    )
    assert prepared.returncode == 0, prepared.stdout[-3000:] + prepared.stderr[-3000:]
    try:
        up = compose(project, env, *files, "up", "-d", "--build")
        assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
        base = f"http://127.0.0.1:{port}"

        def health() -> dict:
            try:
                return httpx.get(f"{base}/health", timeout=2).json()
            except (httpx.HTTPError, ValueError):
                return {}

        assert wait_until(lambda: health().get("status") == "ok", 300, 1), health()
        yield base, f"http://127.0.0.1:{prometheus_port}", health
    finally:
        down = compose(project, env, *files, "down", "-v", "--remove-orphans", timeout=120)
    assert down.returncode == 0, down.stderr[-2000:]


def test_two_engines_under_compose_answer_and_prometheus_scrapes_each():
    """compose.two-engines.yaml over compose.yaml: the api routes to both engines (after the test
    above, the images are built and only start)."""
    with stack("pagedservedp", "compose.two-engines.yaml") as (base, prometheus, health):
        assert health() == {"status": "ok", "engines_up": 2, "engines": 2}
        prompts = [f"def handler_{i}(request):\n" * 20 for i in range(8)]  # distinct first blocks: both engines
        body = {"model": "tiny-python", "prompt": prompts, "max_tokens": 8}
        response = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
        assert response.status_code == 200 and len(response.json()["choices"]) == 8
        routed = {
            line.split()[0]: float(line.split()[1])
            for line in httpx.get(f"{base}/metrics").text.splitlines()
            if line.startswith("pagedserve_engine_routed_requests_total")
        }
        assert len(routed) == 2 and all(count >= 1 for count in routed.values()), routed
        wanted = {
            ("api", ""): "1",
            ("scheduler", "0"): "1",
            ("scheduler", "1"): "1",
            ("worker", "0"): "1",
            ("worker", "1"): "1",
        }
        assert wait_until(lambda: scraped_engines(prometheus) == wanted, 60, 1), scraped_engines(prometheus)


def test_prefill_and_decode_engines_under_compose_serve_through_a_kv_transfer():
    """compose.pd.yaml over compose.yaml: a completion is computed on the prefill engine, its blocks fetched by
    the decode engine over CURVE, and Prometheus scrapes both engines."""
    with stack("pagedservepd", "compose.pd.yaml") as (base, prometheus, _):
        prompt = "def handler(request):\n    return request.json()\n" * 8  # several full blocks to fetch
        response = httpx.post(
            f"{base}/v1/completions", json={"model": "tiny-python", "prompt": prompt, "max_tokens": 8}, timeout=120
        )
        assert response.status_code == 200 and response.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        wanted = {
            ("api", ""): "1",
            ("scheduler", "prefill"): "1",
            ("scheduler", "decode"): "1",
            ("worker", "prefill"): "1",
            ("worker", "decode"): "1",
        }
        assert wait_until(lambda: scraped_engines(prometheus) == wanted, 60, 1), scraped_engines(prometheus)

        def received() -> float:
            query = 'sum(pagedserve_kv_transfer_bytes_total{direction="received",engine="decode"})'
            try:
                result = httpx.get(f"{prometheus}/api/v1/query", params={"query": query}, timeout=5).json()
                return float(result["data"]["result"][0]["value"][1])
            except (httpx.HTTPError, ValueError, KeyError, IndexError):
                return 0.0

        assert wait_until(lambda: received() > 0, 60, 1)
