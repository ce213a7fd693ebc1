"""Each service's /metrics and /health on a port of its own, served from a thread; any other path is
404, so that a probe or a scrape aimed at the wrong path fails instead of passing."""

from __future__ import annotations

import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

log = logging.getLogger(__name__)


class MetricsPortError(RuntimeError):
    pass


def _handler(registry: CollectorRegistry) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                encoder, content_type = choose_encoder(self.headers.get("Accept", ""))
                self._reply(200, content_type, encoder(registry))
            elif path == "/health":
                self._reply(200, "text/plain; charset=utf-8", b"ok\n")
            else:
                self._reply(404, "text/plain; charset=utf-8", b"not found: this port serves /metrics and /health\n")

        def _reply(self, status: int, content_type: str, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:  # scrapes every few seconds: not worth a line
            pass

    return Handler


def serve_metrics(registry: CollectorRegistry, host: str, port: int, service: str) -> None:
    """Serve `registry` at http://host:port/metrics and liveness at /health; port 0 serves nothing."""
    if port == 0:
        return
    try:
        server = ThreadingHTTPServer((host, port), _handler(registry))
    except OSError as exc:
        raise MetricsPortError(f"cannot serve metrics on {host}:{port}: {exc.strerror or exc}") from None
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name=f"{service} metrics", daemon=True).start()
    log.info("%s metrics at http://%s:%d/metrics", service, host, port)
