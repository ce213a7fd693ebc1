"""Each service's /metrics on a port of its own, served from a thread by prometheus_client."""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, start_http_server

log = logging.getLogger(__name__)


class MetricsPortError(RuntimeError):
    pass


def serve_metrics(registry: CollectorRegistry, host: str, port: int, service: str) -> None:
    """Serve `registry` at http://host:port/metrics; port 0 serves nothing."""
    if port == 0:
        return
    try:
        start_http_server(port, host, registry)
    except OSError as exc:
        raise MetricsPortError(f"cannot serve metrics on {host}:{port}: {exc.strerror or exc}") from None
    log.info("%s metrics at http://%s:%d/metrics", service, host, port)
