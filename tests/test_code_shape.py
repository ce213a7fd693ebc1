"""The code's shape, as the design says it is (docs/design/architecture.md): small modules, a scheduler of parts
that asks its KV cache manager rather than reaching into its pools, and one writer of each in-flight count."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SERVICES = ROOT / "services"
LONG_ALLOWED = {ROOT / "shared" / "protocol.py"}  # a list of message types


def lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def test_the_scheduler_is_short_and_no_service_module_is_long():
    assert lines(SERVICES / "scheduler" / "scheduler.py") <= 350
    long = {
        str(path.relative_to(ROOT)): lines(path)
        for path in SERVICES.rglob("*.py")
        if path not in LONG_ALLOWED and lines(path) > 450
    }
    assert not long, long


def test_the_scheduler_reaches_into_no_pool_of_the_kv_cache_manager():
    scheduler = (SERVICES / "scheduler" / "scheduler.py").read_text()
    reaching = re.findall(r"kv_cache\.(device_pool|swap_pool|host_cache|tiers|disk|moved|adapters)\b", scheduler)
    assert not reaching, reaching


def test_each_in_flight_count_is_written_in_one_module():
    counts = (
        "pending|drafts|speculative|known_to_worker|computing|num_pending|num_drafts|num_speculative|"
        "num_tokens_known_to_worker"
    )
    written = re.compile(rf"(?<!stats)\.({counts})\s*(\+|-)?=[^=]")
    writers = {str(path.relative_to(ROOT)) for path in SERVICES.rglob("*.py") if written.search(path.read_text())}
    assert writers == {"services/scheduler/in_flight.py"}, writers


# Where a test may sleep: helpers that poll with a deadline, and timing tests whose sleep is the thing measured.
SLEEPS_ALLOWED = {
    ("conftest.py", "time.sleep(interval)"): "wait_until's polling, with its deadline",
    ("conftest.py", "await asyncio.sleep(interval)"): "wait_until_async's polling, with its deadline",
    ("conftest.py", "time.sleep(0.3)"): "wait_serving's polling of /health, with its deadline",
    (
        "test_liveness_e2e.py",
        "server.api_handlers[Hello] = lambda sender, message: time.sleep(2.5)",
    ): "a handler that stalls the scheduler's loop on purpose: the stall is what is tested",
    (
        "test_metrics_http.py",
        "time.sleep(0.3)",
    ): "a client that drips a header every 0.3 s, and 200 idle connections given time to take threads they must "
    "not: the pace is what is tested",
    ("test_openai_api.py", "time.sleep(1.5)"): "nothing is logged while idle: an absence, waited out",
    ("test_signals.py", "time.sleep(0.05)"): "a service loop's work a signal must not cut: the work, not a wait",
    ("test_signals.py", "time.sleep(0.01)"): "a step inside that loop: the work, not a wait",
}


def test_no_test_sleeps_to_wait_for_something_it_could_wait_for():
    found = set()
    for path in (ROOT / "tests").rglob("*.py"):
        if path == Path(__file__).resolve():
            continue
        for line in path.read_text().splitlines():
            if re.search(r"\b(time|asyncio)\.sleep\(", line):
                found.add((path.name, line.split("#")[0].strip()))
    unexplained = sorted(found - set(SLEEPS_ALLOWED))
    assert not unexplained, f"sleeps that should be waits (wait_until, an event) or an entry here: {unexplained}"


# The environment variables the code reads, each documented: the API key and the keys folder, the launcher's
# word to its children, and other tools' own (the C compiler, the cache folder, Triton's interpreter).
ENVIRONMENT_READ = {
    "PAGEDSERVE_API_KEY",
    "PAGEDSERVE_KEYS_DIR",
    "PAGEDSERVE_ENGINE",
    "PAGEDSERVE_RUNTIME_DIR",
    "CC",
    "XDG_CACHE_HOME",
    "TRITON_INTERPRET",
    "OMP_WAIT_POLICY",
}


def test_no_environment_variable_acts_as_config_but_the_documented_ones():
    texts = [path.read_text() for folder in ("services", "shared", "kernels") for path in (ROOT / folder).rglob("*.py")]
    constants = {name: value for text in texts for name, value in re.findall(r'^(\w+_ENV) = "(\w+)"', text, re.M)}
    read = set()
    for text in texts:
        read |= set(re.findall(r'(?:environ\.get|getenv|environ\[)\(?\s*"(\w+)"', text))
        read |= {constants.get(name, name) for name in re.findall(r"(?:environ\.get|getenv)\((\w+_ENV)\b", text)}
    assert read <= ENVIRONMENT_READ, read - ENVIRONMENT_READ
    docs = "".join(path.read_text() for path in (ROOT / "docs").rglob("*.md"))
    undocumented = {name for name in ENVIRONMENT_READ if name.startswith("PAGEDSERVE_") and name not in docs}
    assert not undocumented, undocumented
