"""Kubernetes manifests for pagedserve: `python ops/k8s/render.py [--gpu] > pagedserve.yaml`.

- Engines: a StatefulSet behind a headless Service, so engine i has the stable name
  pagedserve-engine-i.pagedserve-engine. Each pod runs a scheduler and its worker, which talk
  over the pod's loopback; the scheduler listens for apis on port 5555.
- The api: a Deployment of replicas behind a Service, each replica given every engine's address
  (`--scheduler-endpoint`); they route alike without talking to each other.
- CURVE keys: one Secret per role, made from `pagedserve keys DIR` (`--keys-dir DIR` puts them in
  the output; otherwise create them as docs/deploy.md says). Every engine shares the
  scheduler's identity.
- Probes on each service's real endpoints; a ServiceMonitor (the Prometheus operator's) scrapes
  the api, every scheduler and every worker, labelling the engines' series by engine, and the api
  pods carry the plain prometheus.io annotations too.

ops/k8s/pagedserve.yaml (CPU) and ops/k8s/pagedserve-gpu.yaml are this script's output with
the defaults; tests/test_k8s.py checks that they are current and consistent.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import sys

import yaml

NAME = "pagedserve"
ENGINE = f"{NAME}-engine"
API = f"{NAME}-api"
SCHEDULER_PORT, WORKER_LINK_PORT = 5555, 5556
API_PORT, SCHEDULER_METRICS_PORT, WORKER_METRICS_PORT = 8000, 8001, 8002
KEY_FILES = {  # what each role's --keys-dir holds (`pagedserve keys`)
    "api": ["api.key_secret", "scheduler.key"],
    "scheduler": ["scheduler.key_secret", "api.key", "worker.key"],
    "worker": ["worker.key_secret", "scheduler.key"],
}
KEYS_MOUNT = "/keys"
PREFILL, DECODE = f"{NAME}-prefill", f"{NAME}-decode"  # with --pd: the two engine pools
KV_PORT, KV_KEY_MOUNT = 14579, "/kv-key"  # a prefill worker's KV server; the secret both pools' workers share


def labels(component: str) -> dict:
    return {"app.kubernetes.io/name": NAME, "app.kubernetes.io/component": component}


def secret_name(role: str) -> str:
    return f"{NAME}-{role}-keys"


def http_probe(path: str, port: str, period: int = 10, failures: int = 3) -> dict:
    return {
        "httpGet": {"path": path, "port": port},
        "periodSeconds": period,
        "timeoutSeconds": 3,
        "failureThreshold": failures,
    }


def keys_volume(role: str) -> dict:
    return {"name": f"{role}-keys", "secret": {"secretName": secret_name(role), "defaultMode": 0o400}}


def keys_mount(role: str) -> dict:
    return {"name": f"{role}-keys", "mountPath": KEYS_MOUNT, "readOnly": True}


def container(name: str, args: list[str], image: str, ports: dict[str, int], role: str) -> dict:
    return {
        "name": name,
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["python", "-m", f"services.{role}"],
        "args": args,
        "ports": [{"name": port_name, "containerPort": port} for port_name, port in ports.items()],
        "volumeMounts": [keys_mount(role)],
    }


def engine_objects(args, name: str = ENGINE, replicas: int | None = None, role: str = "") -> list[dict]:
    """An engine StatefulSet and its headless Service; with `role` (kv_producer or kv_consumer), a prefill or
    decode pool of prefill/decode disaggregation, whose workers share the KV key and the producers answer fetches
    on KV_PORT under their pod's stable name."""
    scheduler = container(
        "scheduler",
        [
            "--scheduler-endpoint",
            f"tcp://0.0.0.0:{SCHEDULER_PORT}",
            "--worker-endpoint",
            f"tcp://127.0.0.1:{WORKER_LINK_PORT}",  # the pod's own worker, over loopback
            "--keys-dir",
            KEYS_MOUNT,
            "--world-size",
            str(args.tensor_parallel_size),
            "--block-size",
            "16",
            "--metrics-host",
            "0.0.0.0",
            "--metrics-port",
            str(SCHEDULER_METRICS_PORT),
        ],
        args.image,
        {"scheduler": SCHEDULER_PORT, "sched-metrics": SCHEDULER_METRICS_PORT},
        "scheduler",
    )
    component = {"kv_producer": "prefill", "kv_consumer": "decode"}.get(role, "engine")
    scheduler["readinessProbe"] = http_probe("/health", "sched-metrics", 5)
    scheduler["livenessProbe"] = http_probe("/health", "sched-metrics")
    scheduler["resources"] = {"requests": {"cpu": "500m", "memory": "512Mi"}}
    worker = container(
        "worker",
        [
            "--model",
            args.model,
            "--worker-endpoint",
            f"tcp://127.0.0.1:{WORKER_LINK_PORT}",
            "--keys-dir",
            KEYS_MOUNT,
            "--device",
            "cuda" if args.gpu else "cpu",
            "--tensor-parallel-size",
            str(args.tensor_parallel_size),
            "--block-size",
            "16",
            "--metrics-host",
            "0.0.0.0",
            "--metrics-port",
            str(WORKER_METRICS_PORT),
        ],
        args.image,
        {"worker-metrics": WORKER_METRICS_PORT} | ({"kv": KV_PORT} if role == "kv_producer" else {}),
        "worker",
    )
    if role:
        kv = {
            "kv_connector": "PagedserveConnector",
            "kv_role": role,
            "kv_ip": f"$(POD_NAME).{name}",
            "kv_port": KV_PORT,
        }
        kv["kv_connector_extra_config"] = {"key_file": f"{KV_KEY_MOUNT}/kv.key"}
        flags = ["--kv-transfer-config", json.dumps(kv)] + (
            ["--enable-prefix-caching"] if role == "kv_consumer" else []
        )
        scheduler["args"] += flags
        worker["args"] += flags
        worker["env"] = [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}]
        worker["volumeMounts"].append({"name": "kv-key", "mountPath": KV_KEY_MOUNT, "readOnly": True})
    # Loading a large model takes minutes: liveness waits for the start-up probe.
    worker["startupProbe"] = http_probe("/health", "worker-metrics", 5, 120)
    worker["readinessProbe"] = http_probe("/health", "worker-metrics", 5)
    worker["livenessProbe"] = http_probe("/health", "worker-metrics")
    volumes = [keys_volume("scheduler"), keys_volume("worker")]
    if role:
        volumes.append({"name": "kv-key", "secret": {"secretName": f"{NAME}-kv-key", "defaultMode": 0o400}})
    if args.gpu:
        worker["resources"] = {"limits": {"nvidia.com/gpu": str(args.tensor_parallel_size)}}
        worker["volumeMounts"].append({"name": "shm", "mountPath": "/dev/shm"})  # NCCL's buffers between ranks
        volumes.append({"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}})
    else:
        worker["resources"] = {"requests": {"cpu": "2", "memory": "4Gi"}}
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "labels": labels(component)},
        "spec": {
            "clusterIP": "None",  # headless: a DNS name per engine, for the api to find each
            "publishNotReadyAddresses": True,  # the api connects as soon as a pod has an address
            "selector": labels(component),
            "ports": [
                {"name": "scheduler", "port": SCHEDULER_PORT, "targetPort": "scheduler"},
                {"name": "sched-metrics", "port": SCHEDULER_METRICS_PORT, "targetPort": "sched-metrics"},
                {"name": "worker-metrics", "port": WORKER_METRICS_PORT, "targetPort": "worker-metrics"},
            ]
            + ([{"name": "kv", "port": KV_PORT, "targetPort": "kv"}] if role == "kv_producer" else []),
        },
    }
    statefulset = {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": name, "labels": labels(component)},
        "spec": {
            "serviceName": name,
            "replicas": args.engines if replicas is None else replicas,
            "podManagementPolicy": "Parallel",  # engines are independent: start them all at once
            "selector": {"matchLabels": labels(component)},
            "template": {
                "metadata": {"labels": labels(component)},
                "spec": {"containers": [scheduler, worker], "volumes": volumes, "terminationGracePeriodSeconds": 10},
            },
        },
    }
    return [service, statefulset]


def engine_endpoints(engines: int, name: str = ENGINE) -> str:
    return ",".join(f"tcp://{name}-{i}.{name}:{SCHEDULER_PORT}" for i in range(engines))


def api_objects(args) -> list[dict]:
    api = container(
        "api",
        [
            "--model",
            args.model,
            "--scheduler-endpoint",
            engine_endpoints(args.decode, DECODE) if args.pd else engine_endpoints(args.engines),
            *(["--prefill-endpoint", engine_endpoints(args.prefill, PREFILL)] if args.pd else []),
            "--routing",
            "prefix",
            "--keys-dir",
            KEYS_MOUNT,
            "--host",
            "0.0.0.0",
            "--port",
            str(API_PORT),
        ],
        args.image,
        {"http": API_PORT},
        "api",
    )
    api["readinessProbe"] = http_probe("/health", "http", 5)  # 200 while any engine serves
    api["livenessProbe"] = http_probe("/metrics", "http")  # answers while the api itself runs, engines or not
    api["resources"] = {"requests": {"cpu": "500m", "memory": "512Mi"}}
    api["env"] = [
        {
            "name": "PAGEDSERVE_API_KEY",
            "valueFrom": {"secretKeyRef": {"name": f"{NAME}-api-key", "key": "api-key", "optional": True}},
        }
    ]
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": API, "labels": labels("api")},
        "spec": {
            "replicas": args.api_replicas,
            "selector": {"matchLabels": labels("api")},
            "template": {
                "metadata": {
                    "labels": labels("api"),
                    "annotations": {
                        "prometheus.io/scrape": "true",
                        "prometheus.io/port": str(API_PORT),
                        "prometheus.io/path": "/metrics",
                    },
                },
                "spec": {"containers": [api], "volumes": [keys_volume("api")], "terminationGracePeriodSeconds": 5},
            },
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": API, "labels": labels("api")},
        "spec": {"selector": labels("api"), "ports": [{"name": "http", "port": 80, "targetPort": "http"}]},
    }
    return [deployment, service]


def monitor_objects() -> list[dict]:
    engine_label = {
        "sourceLabels": ["__meta_kubernetes_pod_label_apps_kubernetes_io_pod_index"],
        "targetLabel": "engine",
    }
    return [
        {
            "apiVersion": "monitoring.coreos.com/v1",
            "kind": "ServiceMonitor",
            "metadata": {"name": NAME, "labels": labels("monitoring")},
            "spec": {
                "selector": {"matchLabels": {"app.kubernetes.io/name": NAME}},
                "endpoints": [
                    {"port": "http", "path": "/metrics", "interval": "5s"},
                    {"port": "sched-metrics", "path": "/metrics", "interval": "5s", "relabelings": [engine_label]},
                    {"port": "worker-metrics", "path": "/metrics", "interval": "5s", "relabelings": [engine_label]},
                ],
            },
        }
    ]


def secret_objects(keys_dir: str) -> list[dict]:
    secrets = []
    for role, files in KEY_FILES.items():
        data = {}
        for file in files:
            with open(os.path.join(keys_dir, role, file), "rb") as f:
                data[file] = base64.b64encode(f.read()).decode()
        secrets.append(
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "type": "Opaque",
                "metadata": {"name": secret_name(role), "labels": labels(role)},
                "data": data,
            }
        )
    return secrets


def render(args) -> str:
    objects = (
        (secret_objects(args.keys_dir) if args.keys_dir else [])
        + (
            engine_objects(args, PREFILL, args.prefill, "kv_producer")
            + engine_objects(args, DECODE, args.decode, "kv_consumer")
            if args.pd
            else engine_objects(args)
        )
        + api_objects(args)
        + monitor_objects()
    )
    variant = f"GPU, {args.tensor_parallel_size} per engine" if args.gpu else "CPU"
    engines = f"{args.prefill} prefill and {args.decode} decode engines" if args.pd else f"{args.engines} engines"
    header = (
        f"# pagedserve on Kubernetes ({variant}): {engines}, {args.api_replicas} api replicas.\n"
        f"# Rendered by ops/k8s/render.py; edit that, not this. See docs/deploy.md.\n"
    )
    return header + yaml.safe_dump_all(objects, sort_keys=False, default_flow_style=False)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", type=int, default=2, help="engine pods (--data-parallel-size)")
    parser.add_argument("--api-replicas", type=int, default=2)
    parser.add_argument("--gpu", action="store_true", help="workers on NVIDIA GPUs (the device plugin's resource)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs (ranks) per engine")
    parser.add_argument("--image", default="pagedserve:latest", help="the image compose builds (ops/docker/Dockerfile)")
    parser.add_argument("--model", default="/app/ops/models/tiny-python", help="model directory inside the image")
    parser.add_argument("--keys-dir", default=None, help="a `pagedserve keys` directory: its keys become Secrets")
    parser.add_argument("--pd", default=None, help="P:D, prefill/decode disaggregation: a prefill and a decode pool")
    return parser


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    args.prefill, args.decode = (int(n) for n in args.pd.split(":")) if args.pd else (0, 0)
    return args


def main() -> None:
    sys.stdout.write(render(parse()))


if __name__ == "__main__":
    main()
