"""The documentation says what the code does: the flags page is the parser's, and every command and
program of the getting-started page and of each feature page runs as written and prints what the page says
it prints. A page's `bash` and `python` blocks run, in order; a `shell` block is an illustration (a
placeholder path, another machine) and does not."""

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
FEATURE_PAGES = sorted(str(path) for path in Path(ROOT, "docs", "features").glob("*.md"))
FLAGS_PAGE = os.path.join(ROOT, "docs", "serving", "flags.md")
# Blocks that run the tests, which run this one: not run from here.
RUNS_THE_TESTS = ("make check", "make test")


def test_the_flags_page_is_generated_from_the_parser():
    from ops.docs.flags_page import page

    with open(FLAGS_PAGE) as f:
        assert f.read() == page(), "stale: python ops/docs/flags_page.py > docs/serving/flags.md"


def test_the_results_page_is_short_and_its_plots_and_tables_are_drawn_from_the_results_as_they_are():
    from benchmarks.results_page import PAGE, SECTIONS, stale

    text = PAGE.read_text()
    assert len(text.splitlines()) <= 150
    plots = re.findall(r"!\[[^]]*\]\((img/results/[\w-]+\.png)\)", text)
    assert len(plots) >= 3 and {f"img/results/{s.name}.png" for s in SECTIONS if s.draw is not None} == set(plots)
    assert stale() == [], "python benchmarks/results_page.py draws them again"


def test_a_plot_whose_results_changed_since_it_was_drawn_is_stale(tmp_path, monkeypatch):
    import shutil

    from benchmarks import results_page

    section = next(s for s in results_page.SECTIONS if s.name == "paper-memory")
    (tmp_path / "results" / "archive").mkdir(parents=True)
    (tmp_path / "img").mkdir()
    for name in section.inputs:
        shutil.copy(results_page.RESULTS / name, tmp_path / "results" / name)
    shutil.copy(results_page.IMAGES / "paper-memory.png", tmp_path / "img" / "paper-memory.png")
    (tmp_path / "page.md").write_text("<!-- results:paper-memory -->\n<!-- /results:paper-memory -->\n")
    monkeypatch.setattr(results_page, "RESULTS", tmp_path / "results")
    monkeypatch.setattr(results_page, "IMAGES", tmp_path / "img")
    monkeypatch.setattr(results_page, "PAGES_WITH_TABLES", (tmp_path / "page.md",))
    monkeypatch.setattr(results_page, "ROOT", tmp_path)
    monkeypatch.setattr(results_page, "SECTIONS", (section,))
    assert results_page.stale() == ["page.md's tables differ from their inputs"]
    (tmp_path / "page.md").write_text(results_page.tables_in((tmp_path / "page.md").read_text(), (section,)))
    assert results_page.stale() == []
    result = tmp_path / "results" / section.inputs[0]
    result.write_text(result.read_text().replace('"tokens": 9', '"tokens": 8', 1))
    assert results_page.stale() == [
        "img/paper-memory.png was drawn from other inputs",
        "page.md's tables differ from their inputs",
    ]


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


def run_blocks(page: str, tmp_path: Path) -> int:
    """Runs the page's blocks as a user pasting them would, servers left running until the last block has run;
    returns how many ran."""
    servers: list[subprocess.Popen] = []
    checked = 0
    try:
        for kind, body, expected in blocks(page):
            if any(command in body for command in RUNS_THE_TESTS):
                continue
            if kind == "bash" and (base_url := serves(body)) is not None:
                if body.strip() == "make up":  # an earlier test's server may hold its ports for a moment more
                    assert wait_until(lambda: not any(port_problem("127.0.0.1", port) for port in DEFAULT_PORTS), 30)
                log_path = str(tmp_path / f"server-{len(servers)}.log")
                log = open(log_path, "w")  # noqa: SIM115 (the server keeps it)
                servers.append(
                    subprocess.Popen(
                        ["bash", "-c", body],
                        cwd=ROOT,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                        env=as_a_user_runs_it(),
                    )
                )
                wait_serving(base_url, servers[-1], Path(log_path).read_text, 600)
                checked += 1
                continue
            command = (
                ["bash", "-c", body] if kind == "bash" else [os.path.join(ROOT, ".venv", "bin", "python"), "-c", body]
            )
            if kind == "python" and not os.path.exists(command[0]):
                command[0] = sys.executable
            done = subprocess.run(
                command, cwd=ROOT, capture_output=True, text=True, timeout=600, env=as_a_user_runs_it()
            )
            assert done.returncode == 0, f"{body}\n{done.stdout}\n{done.stderr[-3000:]}"
            if expected is not None:
                assert done.stdout == expected, f"{body} printed {done.stdout!r}, the page says {expected!r}"
            checked += 1
    finally:
        for process in servers:
            stop(process)
    return checked


@pytest.mark.slow
@pytest.mark.xdist_group("fixed-ports")  # make up's ports, which some benchmarks' tests use too
def test_every_block_of_the_getting_started_page_runs_as_written_and_prints_what_it_says(tmp_path):
    assert run_blocks(GETTING_STARTED, tmp_path) >= 5


@pytest.mark.slow
@pytest.mark.parametrize("page", FEATURE_PAGES, ids=lambda page: Path(page).stem)
def test_each_feature_page_serves_its_example_as_written_and_it_prints_what_the_page_says(page, tmp_path):
    """Each page starts a server of its own (on ports of its own) and asks it something."""
    kinds = [kind for kind, body, _ in blocks(page) if kind == "python" or serves(body) is None]
    assert any(serves(body) for _, body, _ in blocks(page)), f"{page} starts no server a user could try"
    assert kinds, f"{page} asks its server nothing"
    assert run_blocks(page, tmp_path) >= 2
