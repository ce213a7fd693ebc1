"""The Kubernetes manifests (ops/k8s/), checked without a cluster: they are what ops/k8s/render.py
makes, every core object is valid against the Kubernetes OpenAPI schema, and the images, ports,
probes, labels, selectors, keys and flags agree with each other and with the services."""

import argparse
import base64
import os
import re
import subprocess
import sys

import kubernetes_validate
import pytest
import yaml

from services.api.__main__ import build_parser as api_parser
from services.scheduler.__main__ import build_parser as scheduler_parser
from services.worker.__main__ import build_parser as worker_parser
from shared.wire_security import load_keys
from tests.conftest import ROOT

pytestmark = pytest.mark.slow  # starts processes: not in `make check`

RENDER = os.path.join(ROOT, "ops", "k8s", "render.py")
VARIANTS = {"pagedserve.yaml": [], "pagedserve-gpu.yaml": ["--gpu"]}
KUBERNETES_VERSION = "1.30"
PARSERS = {"services.api": api_parser, "services.scheduler": scheduler_parser, "services.worker": worker_parser}
METRICS_PATHS = {"/health", "/metrics"}  # all that shared.metrics_http serves


def render(*flags: str) -> str:
    done = subprocess.run([sys.executable, RENDER, *flags], capture_output=True, text=True, check=True)
    return done.stdout


def objects(text: str) -> list[dict]:
    return [o for o in yaml.safe_load_all(text) if o]


def by_kind(items: list[dict], kind: str) -> list[dict]:
    return [o for o in items if o["kind"] == kind]


def containers(items: list[dict]) -> list[tuple[dict, dict]]:
    return [
        (workload, c)
        for workload in items
        if workload["kind"] in ("Deployment", "StatefulSet")
        for c in workload["spec"]["template"]["spec"]["containers"]
    ]


def parsed(container: dict) -> argparse.Namespace:
    assert container["command"][:2] == ["python", "-m"]
    return PARSERS[container["command"][2]]().parse_args(container["args"])


@pytest.fixture(params=sorted(VARIANTS))
def manifest(request) -> tuple[str, list[dict]]:
    with open(os.path.join(ROOT, "ops", "k8s", request.param)) as f:
        return request.param, objects(f.read())


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_the_committed_manifests_are_what_the_renderer_makes(name):
    with open(os.path.join(ROOT, "ops", "k8s", name)) as f:
        assert f.read() == render(*VARIANTS[name]), f"run python ops/k8s/render.py {' '.join(VARIANTS[name])}"


def test_every_core_object_is_valid_against_the_kubernetes_schema(manifest, tmp_path):
    subprocess.run([sys.executable, "-m", "services.launcher", "keys", str(tmp_path)], check=True, capture_output=True)
    items = manifest[1] + objects(render("--keys-dir", str(tmp_path)))[:3]  # and the Secrets made from keys
    for item in items:
        if item["kind"] == "ServiceMonitor":  # the Prometheus operator's own resource: no core schema
            assert item["apiVersion"] == "monitoring.coreos.com/v1"
            continue
        kubernetes_validate.validate(item, KUBERNETES_VERSION, strict=True)


def test_services_select_the_pods_and_name_their_ports(manifest):
    items = manifest[1]
    pods = {w["metadata"]["name"]: w["spec"]["template"] for w in items if w["kind"] in ("Deployment", "StatefulSet")}
    for workload in items:
        if workload["kind"] in ("Deployment", "StatefulSet"):
            template_labels = workload["spec"]["template"]["metadata"]["labels"]
            assert workload["spec"]["selector"]["matchLabels"].items() <= template_labels.items()
    for service in by_kind(items, "Service"):
        selected = [t for t in pods.values() if service["spec"]["selector"].items() <= t["metadata"]["labels"].items()]
        assert len(selected) == 1, service["metadata"]["name"]
        ports = {p["name"]: p["containerPort"] for c in selected[0]["spec"]["containers"] for p in c["ports"]}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in ports
            assert re.fullmatch(r"[a-z0-9]([a-z0-9-]{0,13}[a-z0-9])?", port["name"])  # an IANA service name
    for _, container in containers(items):
        for port in container["ports"]:
            assert len(port["name"]) <= 15


def test_probes_use_each_services_real_endpoints(manifest):
    api_routes = {"/health", "/metrics", "/ping", "/version", "/v1/models"}  # routes of services.api.app
    for _, container in containers(manifest[1]):
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        args = parsed(container)
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = container.get(kind)
            if probe is None:
                continue
            port = ports[probe["httpGet"]["port"]]
            if container["name"] == "api":
                assert port == args.port and probe["httpGet"]["path"] in api_routes
            else:
                assert port == args.metrics_port and probe["httpGet"]["path"] in METRICS_PATHS
        assert "readinessProbe" in container and "livenessProbe" in container
    [api] = [c for _, c in containers(manifest[1]) if c["name"] == "api"]
    assert api["livenessProbe"]["httpGet"]["path"] != "/health"  # lost engines must not restart the api


def test_the_api_routes_among_every_engine_of_the_statefulset_by_its_stable_names(manifest):
    items = manifest[1]
    [engines] = by_kind(items, "StatefulSet")
    headless = next(s for s in by_kind(items, "Service") if s["metadata"]["name"] == engines["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    scheduler = next(c for _, c in containers(items) if c["name"] == "scheduler")
    [listen] = parsed(scheduler).scheduler_endpoint
    port = int(listen.rsplit(":", 1)[1])
    assert port in [p["port"] for p in headless["spec"]["ports"]]
    name, service = engines["metadata"]["name"], engines["spec"]["serviceName"]
    api = next(c for _, c in containers(items) if c["name"] == "api")
    assert parsed(api).scheduler_endpoint == [
        f"tcp://{name}-{i}.{service}:{port}" for i in range(engines["spec"]["replicas"])
    ]


def test_each_engine_pod_links_its_scheduler_and_worker_over_its_own_loopback(manifest):
    pod = by_kind(manifest[1], "StatefulSet")[0]["spec"]["template"]["spec"]
    scheduler, worker = ({c["name"]: c for c in pod["containers"]}[n] for n in ("scheduler", "worker"))
    assert parsed(scheduler).worker_endpoint == parsed(worker).worker_endpoint
    assert parsed(worker).worker_endpoint.startswith("tcp://127.0.0.1:")
    assert parsed(scheduler).world_size == parsed(worker).tensor_parallel_size


def test_metrics_ports_are_container_ports_and_prometheus_scrapes_each(manifest):
    items = manifest[1]
    service_ports = {p["name"] for s in by_kind(items, "Service") for p in s["spec"]["ports"]}
    [monitor] = by_kind(items, "ServiceMonitor")
    scraped = {e["port"] for e in monitor["spec"]["endpoints"]}
    for _, container in containers(items):
        args = parsed(container)
        wanted = args.port if container["name"] == "api" else args.metrics_port
        [name] = [p["name"] for p in container["ports"] if p["containerPort"] == wanted]
        assert name in service_ports and name in scraped
    engine_scrapes = [e for e in monitor["spec"]["endpoints"] if e["port"] != "http"]
    assert all(e["relabelings"][0]["targetLabel"] == "engine" for e in engine_scrapes)
    api = by_kind(items, "Deployment")[0]["spec"]["template"]["metadata"]["annotations"]
    assert api["prometheus.io/port"] == str(parsed(next(c for _, c in containers(items) if c["name"] == "api")).port)


def test_keys_come_from_secrets_that_hold_what_each_role_loads(manifest, tmp_path):
    subprocess.run(
        [sys.executable, "-m", "services.launcher", "keys", str(tmp_path / "made")], check=True, capture_output=True
    )
    secrets = {
        s["metadata"]["name"]: s for s in by_kind(objects(render("--keys-dir", str(tmp_path / "made"))), "Secret")
    }
    loaded = {}
    for workload, container in containers(manifest[1]):
        role = container["command"][2].split(".")[1]
        keys_dir = parsed(container).keys_dir
        [mount] = [m for m in container["volumeMounts"] if m["mountPath"] == keys_dir]
        [volume] = [v for v in workload["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]]
        secret = secrets[volume["secret"]["secretName"]]
        folder = tmp_path / "mounted" / role
        folder.mkdir(parents=True, exist_ok=True)
        for file, data in secret["data"].items():
            (folder / file).write_bytes(base64.b64decode(data))
        loaded[role] = load_keys(folder, role)
    assert set(loaded) == {"api", "scheduler", "worker"}
    assert loaded["api"].scheduler_public == loaded["worker"].scheduler_public == loaded["scheduler"].public


def test_one_image_everywhere_and_the_one_compose_builds(manifest):
    with open(os.path.join(ROOT, "compose.yaml")) as f:
        compose_image = yaml.safe_load(f)["x-pagedserve"]["image"]
    assert {c["image"] for _, c in containers(manifest[1])} == {compose_image}


def test_the_gpu_variant_asks_for_a_gpu_per_rank_and_the_cpu_one_for_none(manifest):
    name, items = manifest
    worker = next(c for _, c in containers(items) if c["name"] == "worker")
    args = parsed(worker)
    gpus = worker["resources"].get("limits", {}).get("nvidia.com/gpu")
    if name == "pagedserve-gpu.yaml":
        assert args.device == "cuda" and gpus == str(args.tensor_parallel_size)
    else:
        assert args.device == "cpu" and gpus is None


def test_the_prefill_decode_manifest_wires_a_prefill_pool_to_a_decode_pool_through_the_api(tmp_path):
    """ops/k8s/pagedserve-pd.yaml (`render.py --pd 1:2`): current, valid, the api computes prompts on the prefill
    pool and decodes on the decode pool, and every prefill worker answers fetches under its stable name, over
    CURVE with the secret both pools' workers mount."""
    with open(os.path.join(ROOT, "ops", "k8s", "pagedserve-pd.yaml")) as f:
        text = f.read()
    assert text == render("--pd", "1:2")
    items = objects(text)
    for item in items:
        if not item["apiVersion"].startswith("monitoring."):
            kubernetes_validate.validate(item, KUBERNETES_VERSION, strict=True)
    pools = {s["metadata"]["name"]: s for s in by_kind(items, "StatefulSet")}
    assert {name: s["spec"]["replicas"] for name, s in pools.items()} == {
        "pagedserve-prefill": 1,
        "pagedserve-decode": 2,
    }
    api = parsed(next(c for _, c in containers(items) if c["name"] == "api"))
    for endpoints, pool in (
        (api.prefill_endpoint, "pagedserve-prefill"),
        (api.scheduler_endpoint, "pagedserve-decode"),
    ):
        assert endpoints == [f"tcp://{pool}-{i}.{pool}:5555" for i in range(pools[pool]["spec"]["replicas"])]
    for name, pool in pools.items():
        spec = pool["spec"]["template"]["spec"]
        worker = next(c for c in spec["containers"] if c["name"] == "worker")
        config = parsed(worker).kv_transfer
        assert config.produces == (name == "pagedserve-prefill") and config.ip == f"$(POD_NAME).{name}"
        [mount] = [m for m in worker["volumeMounts"] if config.key_file.startswith(m["mountPath"] + "/")]
        [volume] = [v for v in spec["volumes"] if v["name"] == mount["name"]]
        assert volume["secret"]["secretName"] == "pagedserve-kv-key"
        if config.produces:
            assert {"name": "kv", "containerPort": config.port} in worker["ports"]
            headless = next(s for s in by_kind(items, "Service") if s["metadata"]["name"] == name)
            assert {"name": "kv", "port": config.port, "targetPort": "kv"} in headless["spec"]["ports"]
        else:
            assert parsed(next(c for c in spec["containers"] if c["name"] == "scheduler")).enable_prefix_caching
