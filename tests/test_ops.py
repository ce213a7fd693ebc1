"""The monitoring that ships in ops/ refers only to metrics the api really exports."""

import http.server
import json
import os
import re
import socket
import ssl
import subprocess
import sys
import threading

import httpx
import pytest
import yaml

from services.scheduler.metrics import lora_metrics, speculation_metrics
from services.scheduler.speculation import SpeculationStats
from services.scheduler.stats import LoraStats
from tests.conftest import ROOT

pytestmark = pytest.mark.slow  # starts processes: not in `make check`


def test_every_dashboard_query_uses_an_exported_metric(llama_server):
    httpx.post(
        f"{llama_server.base_url}/v1/completions",
        timeout=60,
        json={"model": llama_server.model, "prompt": "x", "max_tokens": 2},
    )
    exported = {name.split("{")[0] for name in llama_server.metrics()}
    # A scheduler that speculates or serves adapters exports these too (llama_server does neither).
    exported |= {
        sample.name
        for family in speculation_metrics(SpeculationStats(accepted_per_position=[0]))
        for sample in family.samples
    }
    exported |= {sample.name for family in lora_metrics(LoraStats(1, 1, 1, 1, {"": 1})) for sample in family.samples}
    with open(os.path.join(ROOT, "ops", "grafana", "dashboards", "pagedserve.json")) as f:
        dashboard = json.load(f)
    used = {
        name
        for panel in dashboard["panels"]
        for target in panel["targets"]
        for name in re.findall(r"pagedserve_\w+", target["expr"])
    }
    assert used and used <= exported, used - exported


def test_the_dashboard_imports_into_any_grafana_through_a_datasource_variable():
    with open(os.path.join(ROOT, "ops", "grafana", "dashboards", "pagedserve.json")) as f:
        dashboard = json.load(f)
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    sources = [panel["datasource"] for panel in dashboard["panels"]]
    sources += [target["datasource"] for panel in dashboard["panels"] for target in panel["targets"]]
    assert sources and all(source == {"type": "prometheus", "uid": "${datasource}"} for source in sources)
    # compose's provisioned datasource is the variable's default
    with open(os.path.join(ROOT, "ops", "grafana", "provisioning", "datasources", "prometheus.yml")) as f:
        provisioned = yaml.safe_load(f)["datasources"][0]["uid"]
    assert variables["datasource"]["current"]["value"] == provisioned


def test_compose_runs_the_three_services_with_the_shipped_model():
    with open(os.path.join(ROOT, "compose.yaml")) as f:
        compose = yaml.safe_load(f)
    services = compose["services"]
    assert {"scheduler", "worker-gpu", "worker-cpu", "api", "prometheus", "grafana"} <= set(services)
    assert "nvidia" in json.dumps(services["worker-gpu"]["deploy"])
    assert "deploy" not in services["worker-cpu"]
    model = compose["x-pagedserve"]["environment"]["MODEL"]
    assert "ops/models/tiny-python" in model
    assert os.path.isfile(os.path.join(ROOT, "ops", "models", "tiny-python", "config.json"))


def test_compose_gives_each_service_only_its_own_wire_keys():
    with open(os.path.join(ROOT, "compose.yaml")) as f:
        services = yaml.safe_load(f)["services"]
    assert services["keys"]["command"].startswith("pagedserve keys /keys")
    for name, role in (("scheduler", "scheduler"), ("api", "api"), ("worker-gpu", "worker"), ("worker-cpu", "worker")):
        service = services[name]
        assert "--keys-dir /keys" in service["command"] and "--insecure-wire" not in service["command"]
        assert service["volumes"] == [f"./ops/keys/{role}:/keys:ro"]
        assert service["depends_on"]["keys"] == {"condition": "service_completed_successfully"}


def test_compose_needs_no_registry_for_the_serving_stack_and_prometheus():
    with open(os.path.join(ROOT, "compose.yaml")) as f:
        services = yaml.safe_load(f)["services"]
    pulled = {
        name
        for name, service in services.items()
        if "build" not in service and not service.get("image", "").startswith("pagedserve")
    }
    assert pulled == {"grafana"} and services["grafana"]["profiles"] == ["grafana"]
    assert "profiles" not in services["prometheus"] and "build" in services["prometheus"]
    for name in ("scheduler", "worker-cpu", "api"):
        assert services[name]["healthcheck"]["test"][0] == "CMD"
    assert scrape_targets("prometheus.yml") == {
        "api": {"api:8000": None},
        "scheduler": {"scheduler:8001": "0"},
        "worker": {"worker:8002": "0"},
    }


def scrape_targets(config: str) -> dict[str, dict[str, str | None]]:
    """Each job's targets, with the engine label each carries."""
    with open(os.path.join(ROOT, "ops", config)) as f:
        jobs = yaml.safe_load(f)["scrape_configs"]
    return {
        job["job_name"]: {
            target: group.get("labels", {}).get("engine")
            for group in job["static_configs"]
            for target in group["targets"]
        }
        for job in jobs
    }


def test_the_two_engine_compose_file_adds_an_engine_like_the_first_that_the_api_and_prometheus_both_find():
    with open(os.path.join(ROOT, "compose.yaml")) as f:
        base = yaml.safe_load(f)["services"]
    with open(os.path.join(ROOT, "compose.two-engines.yaml")) as f:
        extra = yaml.safe_load(f)["services"]
    for first, second in (("scheduler", "scheduler-1"), ("worker-cpu", "worker-1-cpu"), ("worker-gpu", "worker-1-gpu")):
        # the same command but for the scheduler's host name, the same keys
        assert extra[second]["command"].replace("scheduler-1:", "scheduler:") == base[first]["command"]
        assert extra[second]["volumes"] == base[first]["volumes"]
        assert extra[second].get("profiles") == base[first].get("profiles")
    assert "--scheduler-endpoint tcp://scheduler:5555,tcp://scheduler-1:5555" in " ".join(
        extra["api"]["command"].split()
    )
    assert extra["prometheus"]["volumes"] == ["./ops/prometheus.two-engines.yml:/etc/prometheus/prometheus.yml:ro"]
    assert scrape_targets("prometheus.two-engines.yml") == {
        "api": {"api:8000": None},
        "scheduler": {"scheduler:8001": "0", "scheduler-1:8001": "1"},
        "worker": {"worker:8002": "0", "worker-1:8002": "1"},
    }


def test_the_prefill_decode_compose_file_adds_a_prefill_engine_and_makes_the_first_one_decode():
    with open(os.path.join(ROOT, "compose.pd.yaml")) as f:
        pd = yaml.safe_load(f)
    services = pd["services"]

    def flags(service: str) -> str:
        return " ".join(services[service]["command"].split())

    producer = json.loads(pd["x-prefill"]["environment"]["KV_PRODUCER"])
    consumer = json.loads(pd["x-decode"]["environment"]["KV_CONSUMER"])
    assert (producer["kv_role"], consumer["kv_role"]) == ("kv_producer", "kv_consumer")
    assert producer["kv_ip"] == "prefill-worker" and producer["kv_port"] == consumer["kv_port"]
    for service in ("prefill-scheduler", "prefill-worker-cpu", "prefill-worker-gpu"):
        assert '--kv-transfer-config "$$KV_PRODUCER"' in flags(service)
    for service in ("scheduler", "worker-cpu", "worker-gpu"):
        assert '--kv-transfer-config "$$KV_CONSUMER" --enable-prefix-caching' in flags(service)
    for service in ("prefill-worker-cpu", "worker-cpu"):  # both mount the KV secret where the config names it
        assert "./ops/keys/kv:/kv-key:ro" in services[service]["volumes"]
        assert producer["kv_connector_extra_config"]["key_file"].startswith("/kv-key/")
    assert "--scheduler-endpoint tcp://scheduler:5555 --prefill-endpoint tcp://prefill-scheduler:5555" in flags("api")
    assert services["prometheus"]["volumes"] == ["./ops/prometheus.pd.yml:/etc/prometheus/prometheus.yml:ro"]
    assert scrape_targets("prometheus.pd.yml") == {
        "api": {"api:8000": None},
        "scheduler": {"prefill-scheduler:8001": "prefill", "scheduler:8001": "decode"},
        "worker": {"prefill-worker:8002": "prefill", "worker:8002": "decode"},
    }


def test_compose_hands_one_speculative_config_to_the_scheduler_and_every_worker():
    with open(os.path.join(ROOT, "compose.yaml")) as f:
        compose = yaml.safe_load(f)
    assert compose["x-pagedserve"]["environment"]["SPECULATIVE_CONFIG"] == "${SPECULATIVE_CONFIG:-}"
    for name in ("scheduler", "worker-gpu", "worker-cpu"):
        command = compose["services"][name]["command"]
        assert command.startswith("sh -c 'exec python -m services.")  # a shell reads the JSON from the environment
        assert '--speculative-config "$$SPECULATIVE_CONFIG"' in command


def test_an_image_build_whose_pip_meets_an_untrusted_tls_certificate_says_so_in_one_line(tmp_path):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
        ],
        check=True,
        capture_output=True,
    )
    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:  # an index whose certificate no CA in the image vouches for: what a TLS-inspecting proxy shows
        env = dict(
            os.environ,
            PIP_CONFIG_FILE=os.devnull,
            PIP_INDEX_URL=f"https://127.0.0.1:{server.server_port}/simple",
            PIP_CERT="/etc/ssl/certs/ca-certificates.crt",
            PIP_RETRIES="0",
            PIP_DEFAULT_TIMEOUT="5",
            PATH=os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]]),
        )
        done = subprocess.run(
            ["sh", os.path.join(ROOT, "ops", "docker", "pip-install.sh"), "no-such-package-xyz"],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        server.shutdown()
    assert done.returncode != 0
    [line] = [line for line in done.stderr.splitlines() if line.startswith("pip failed because")]
    assert "TLS certificate" in line and "ops/docker/certs/" in line, done.stderr


def _fake_docker_tools(bin_dir, calls):
    """`docker` without the Grafana image and a `docker-compose` that only records how it was called."""
    bin_dir.mkdir()
    for name, body in (
        ("docker", f'echo "docker $*" >> {calls}\n[ "$1 $2" = "image inspect" ] && exit 1\nexit 0\n'),
        ("docker-compose", f'echo "docker-compose $* COMPOSE_PROFILES=$COMPOSE_PROFILES" >> {calls}\n'),
    ):
        tool = bin_dir / name
        tool.write_text("#!/bin/sh\n" + body)
        tool.chmod(0o755)


def _up_with_grafana(bin_dir, registry):
    env = dict(
        os.environ,
        PATH=os.pathsep.join([str(bin_dir), os.environ["PATH"]]),
        GRAFANA_REGISTRY_PROBE=registry,
        COMPOSE_PROFILES="cpu",
    )
    return subprocess.run(
        [os.path.join(ROOT, "ops", "docker", "up-with-grafana.sh"), "--build"],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_grafana_without_its_image_or_a_registry_fails_at_once_in_one_line_naming_what_to_do(tmp_path):
    calls = tmp_path / "calls"
    _fake_docker_tools(tmp_path / "bin", calls)
    with socket.socket() as closed:  # a port nothing listens on: the registry is unreachable
        closed.bind(("127.0.0.1", 0))
        registry = f"http://127.0.0.1:{closed.getsockname()[1]}/v2/"
    done = _up_with_grafana(tmp_path / "bin", registry)
    assert done.returncode == 1
    [line] = done.stderr.splitlines()
    assert "grafana/grafana-oss" in line and "docker load" in line and "ops/grafana/dashboards" in line
    assert "docker-compose" not in calls.read_text()  # nothing was started or pulled
    assert "docker pull" not in calls.read_text()


def test_grafana_with_a_reachable_registry_pulls_its_image_and_starts_the_grafana_profile(tmp_path):
    calls = tmp_path / "calls"
    _fake_docker_tools(tmp_path / "bin", calls)

    class Unauthorized(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # what Docker Hub answers an anonymous probe
            self.send_response(401)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Unauthorized)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        done = _up_with_grafana(tmp_path / "bin", f"http://127.0.0.1:{server.server_port}/v2/")
    finally:
        server.shutdown()
    assert done.returncode == 0, done.stderr
    pulled, started = calls.read_text().splitlines()[1:]
    assert pulled.startswith("docker pull grafana/grafana-oss")
    assert started == "docker-compose up --build COMPOSE_PROFILES=cpu,grafana"
