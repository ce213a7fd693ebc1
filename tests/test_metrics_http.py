"""The scheduler's and workers' metrics ports: silent, dripping or piled-up connections are cut, so
they cannot hold threads, and a scrape still gets through."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter

from shared import metrics_http
from tests.conftest import free_port, wait_until


@pytest.fixture
def metrics_port(monkeypatch):
    monkeypatch.setattr(metrics_http, "CONNECTION_DEADLINE", 1.0)
    monkeypatch.setattr(metrics_http, "IDLE_TIMEOUT", 0.5)
    registry = CollectorRegistry()
    Counter("attack_test_total", "a metric to scrape", registry=registry).inc()
    port = free_port()
    metrics_http.serve_metrics(registry, "127.0.0.1", port, "test")
    return port


def _scrape(port: int) -> str:
    return httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text


def _closed_by_server(conn: socket.socket) -> bool:
    conn.settimeout(0.05)
    try:
        return conn.recv(1) == b""
    except TimeoutError:
        return False
    except OSError:
        return True


def test_silent_and_dripping_connections_are_cut_at_their_deadline(metrics_port):
    silent = [socket.create_connection(("127.0.0.1", metrics_port)) for _ in range(4)]
    dripping = socket.create_connection(("127.0.0.1", metrics_port))
    started = time.monotonic()
    dripping.sendall(b"GET /metrics HTTP/1.1\r\n")
    while time.monotonic() - started < 3 and not _closed_by_server(dripping):
        try:
            dripping.sendall(b"X-Drip: 1\r\n")  # a header line every 0.3 s: each read comes in time
        except OSError:
            break
        time.sleep(0.3)
    assert time.monotonic() - started < 2.5  # cut at its deadline, not when it chose to stop
    assert wait_until(lambda: all(_closed_by_server(conn) for conn in silent), 5)
    assert "attack_test_total 1.0" in _scrape(metrics_port)


def test_piled_up_connections_are_capped_and_a_scrape_gets_through_once_they_are_cut(metrics_port):
    before = threading.active_count()
    piled = []
    for _ in range(200):
        piled.append(socket.create_connection(("127.0.0.1", metrics_port)))
    time.sleep(0.3)
    # 200 silent connections held 200 threads before the cap.
    assert threading.active_count() - before <= metrics_http.MAX_PER_ADDRESS + 2
    assert wait_until(lambda: threading.active_count() - before <= 1, 5)
    assert "attack_test_total 1.0" in _scrape(metrics_port)
    for conn in piled:
        conn.close()
