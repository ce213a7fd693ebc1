"""Each service's /metrics and /health on a port of its own, served from a thread; any other path is
404, so that a probe or a scrape aimed at the wrong path fails instead of passing.

A scrape takes milliseconds, so a connection gets `IDLE_TIMEOUT` seconds per read and
`CONNECTION_DEADLINE` in all, and at most `MAX_CONNECTIONS` are open at once (`MAX_PER_ADDRESS`
from one address): silent or dripping clients cannot pile up threads."""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

log = logging.getLogger(__name__)

IDLE_TIMEOUT = 2.0
CONNECTION_DEADLINE = 5.0
MAX_CONNECTIONS = 32
MAX_PER_ADDRESS = 8


class MetricsPortError(RuntimeError):
    pass


def _handler(registry: CollectorRegistry) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        timeout = IDLE_TIMEOUT  # per read and write on the connection

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


class BoundedHTTPServer(ThreadingHTTPServer):
    """A thread per connection, as many as the caps allow; connections past their deadline are shut."""

    daemon_threads = True
    request_queue_size = 128  # a pile of connections waits to be accepted and cut, not in SYN retries

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler]):
        super().__init__(address, handler)
        self._deadlines: dict[socket.socket, tuple[float, str]] = {}
        self._lock = threading.Lock()
        threading.Thread(target=self._reap, name="metrics deadlines", daemon=True).start()

    def process_request(self, request, client_address) -> None:  # type: ignore[no-untyped-def]
        address = client_address[0] if isinstance(client_address, tuple) else str(client_address)
        with self._lock:
            from_address = sum(1 for _, peer in self._deadlines.values() if peer == address)
            refused = len(self._deadlines) >= MAX_CONNECTIONS or from_address >= MAX_PER_ADDRESS
            if not refused:
                self._deadlines[request] = (time.monotonic() + CONNECTION_DEADLINE, address)
        if refused:
            super().shutdown_request(request)
            return
        super().process_request(request, client_address)

    def shutdown_request(self, request) -> None:  # type: ignore[no-untyped-def]
        with self._lock:
            self._deadlines.pop(request, None)
        super().shutdown_request(request)

    def _reap(self) -> None:
        while True:
            time.sleep(0.5)
            now = time.monotonic()
            with self._lock:
                late = [conn for conn, (deadline, _) in self._deadlines.items() if deadline < now]
            for conn in late:  # shutting it wakes the connection's thread, which then closes it
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)


def serve_metrics(registry: CollectorRegistry, host: str, port: int, service: str) -> None:
    """Serve `registry` at http://host:port/metrics and liveness at /health; port 0 serves nothing."""
    if port == 0:
        return
    try:
        server = BoundedHTTPServer((host, port), _handler(registry))
    except OSError as exc:
        raise MetricsPortError(f"cannot serve metrics on {host}:{port}: {exc.strerror or exc}") from None
    threading.Thread(target=server.serve_forever, name=f"{service} metrics", daemon=True).start()
    log.info("%s metrics at http://%s:%d/metrics", service, host, port)
