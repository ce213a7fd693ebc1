"""The documentation says what the code does: the flags page is the parser's, and every command and
program of the getting-started page runs as written and prints what the page says it prints."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from services.launcher import port_problem
from tests.conftest import ROOT, wait_serving, wait_until

GETTING_STARTED = os.path.join(ROOT, "docs", "getting-started.md")
FLAGS_PAGE = os.path.join(ROOT, "docs", "serving", "flags.md")
# Blocks that run the tests, which run this one: not run from here.
RUNS_THE_TESTS = ("make check", "make test")


def test_the_flags_page_is_generated_from_the_parser():
    from ops.docs.flags_page import page

    with open(FLAGS_PAGE) as f:
        assert f.read() == page(), "stale: python ops/docs/flags_page.py > docs/serving/flags.md"


def blocks(path: str) -> list[tuple[str, str, str | None]]:
    """The page's fenced bash and python blocks in order, each with the text block that follows it (what
    it prints), if one does before the next code block."""
    with open(path) as f:
        text = f.read()
    fenced = re.findall(r"```(\w+)\n(.*?)```", text, re.S)
    found = []
    for i, (kind, body) in enumerate(fenced):
        if kind in ("bash", "python"):
            follows = fenced[i + 1] if i + 1 < len(fenced) else None
            found.append((kind, body, follows[1] if follows and follows[0] == "text" else None))
    return found


DEFAULT_PORTS = (8000, 8001, 8002)  # make up's: the api's, the scheduler's and the worker's metrics


def serves(command: str) -> str | None:
    """The api's base URL where `command` starts a server, else None."""
    if command.strip() == "make up":
        return "http://127.0.0.1:8000"
    port = re.search(r"pagedserve (?:serve|up)\b.*--port (\d+)", command)
    return f"http://127.0.0.1:{port.group(1)}" if port else None


def as_a_user_runs_it() -> dict[str, str]:
    """This environment without what `make test ARGS=...` passes down to a nested make."""
    passed_down = ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "ARGS")
    return {name: value for name, value in os.environ.items() if name not in passed_down}


def stop(process: subprocess.Popen) -> None:
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGINT)
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


@pytest.mark.slow
@pytest.mark.xdist_group("fixed-ports")  # make up's ports, which some benchmarks' tests use too
def test_every_block_of_the_getting_started_page_runs_as_written_and_prints_what_it_says(tmp_path):
    servers: list[subprocess.Popen] = []
    checked = 0
    try:
        for kind, body, expected in blocks(GETTING_STARTED):
            if any(command in body for command in RUNS_THE_TESTS):
                continue
            if kind == "bash" and (base_url := serves(body)) is not None:
                if body.strip() == "make up":  # an earlier test's server may hold its ports for a moment more
                    assert wait_until(lambda: not any(port_problem("127.0.0.1", port) for port in DEFAULT_PORTS), 30)
                log_path = str(tmp_path / f"server-{len(servers)}.log")
                log = open(log_path, "w")  # noqa: SIM115 (the server keeps it)
                servers.append(subprocess.Popen(["bash", "-c", body], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                                start_new_session=True, env=as_a_user_runs_it()))
                wait_serving(base_url, servers[-1], Path(log_path).read_text, 600)
                checked += 1
                continue
            command = ["bash", "-c", body] if kind == "bash" else [os.path.join(ROOT, ".venv", "bin", "python"), "-c",
                                                                   body]
            if kind == "python" and not os.path.exists(command[0]):
                command[0] = sys.executable
            done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600,
                                  env=as_a_user_runs_it())
            assert done.returncode == 0, f"{body}\n{done.stdout}\n{done.stderr[-3000:]}"
            if expected is not None:
                assert done.stdout == expected, f"{body} printed {done.stdout!r}, the page says {expected!r}"
            checked += 1
    finally:
        for process in servers:
            stop(process)
    assert checked >= 5
