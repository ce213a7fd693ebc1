"""The forward pass's threads on a CPU: every core while other processes leave them nearly idle,
one core left to them otherwise (the api and scheduler streaming many tokens, or anything else);
and the worker's large buffers on huge pages."""

import pytest
import torch

from kernels import native
from services.worker import cpu_threads
from services.worker.cpu_threads import ComputeThreads, cpu_seconds_busy
from tests.conftest import children

pytestmark = pytest.mark.slow  # starts processes: not in `make check`


class Machine:
    """A clock, the cores' busy seconds and the worker's own CPU seconds, advanced by hand."""

    def __init__(self):
        self.now = self.busy = self.own = 0.0

    def run(self, seconds: float, worker_cores: float, others_cores: float) -> None:
        self.now += seconds
        self.own += seconds * worker_cores
        self.busy += seconds * (worker_cores + others_cores)

    def threads(self, cores: int = 2, **kwargs) -> ComputeThreads:
        return ComputeThreads(
            cores=set(range(cores)), busy=lambda: self.busy, own=lambda: self.own, clock=lambda: self.now, **kwargs
        )


def test_every_core_while_the_others_are_nearly_idle():
    machine = Machine()
    threads = machine.threads()
    assert threads.for_step() == 1  # nothing seen yet
    machine.run(1.0, worker_cores=1.0, others_cores=0.15)  # a large model streaming a few tokens
    assert threads.for_step() == 2


def test_one_core_is_left_while_the_api_streams_many_tokens():
    machine = Machine()
    threads = machine.threads()
    machine.run(1.0, worker_cores=1.0, others_cores=0.45)  # the shipped model at 48 streams, a client beside
    assert threads.for_step() == 1


def test_a_busy_neighbour_takes_the_core_back_within_an_interval():
    machine = Machine()
    threads = machine.threads()
    machine.run(1.0, worker_cores=1.0, others_cores=0.0)
    assert threads.for_step() == 2
    machine.run(0.5, worker_cores=2.0, others_cores=1.0)
    assert threads.for_step() == 2  # looked at once an interval
    machine.run(0.5, worker_cores=2.0, others_cores=1.0)
    assert threads.for_step() == 1


def test_between_the_thresholds_the_count_stays_as_it_is():
    machine = Machine()
    taking_all = machine.threads()
    machine.run(1.0, worker_cores=1.0, others_cores=0.1)
    assert taking_all.for_step() == 2
    keeping_one = machine.threads()
    machine.run(1.0, worker_cores=1.0, others_cores=0.3)
    assert taking_all.for_step() == 2  # below the share that gives a core back
    assert keeping_one.for_step() == 1  # above the share that takes it


def test_a_core_given_back_is_held_back_for_a_while():
    machine = Machine()
    threads = machine.threads()
    machine.run(1.0, worker_cores=1.0, others_cores=0.0)
    assert threads.for_step() == 2
    machine.run(1.0, worker_cores=2.0, others_cores=0.6)  # the others grew busy beside two threads
    assert threads.for_step() == 1
    machine.run(1.0, worker_cores=1.0, others_cores=0.0)
    assert threads.for_step() == 1
    machine.run(cpu_threads.HOLD, worker_cores=1.0, others_cores=0.0)
    assert threads.for_step() == 2


def test_the_compiled_kernels_share_every_core_whatever_the_others_do(monkeypatch):
    monkeypatch.setattr(torch, "set_num_threads", lambda count: None)
    monkeypatch.setattr(native, "_threads", 0)  # restored after the test
    machine = Machine()
    busy, fixed, ranks = machine.threads(), machine.threads(requested=1), machine.threads(cores=8, num_ranks=2)
    machine.run(1.0, worker_cores=1.0, others_cores=0.45)
    assert busy.for_step() == 1  # torch's own operations leave a core to the others
    for threads, kernel_threads in ((busy, 2), (fixed, 1), (ranks, 4)):
        threads.use(threads.for_step())
        assert native.threads() == kernel_threads


def test_a_step_of_few_tokens_gives_torch_one_thread_and_a_large_one_every_core_the_others_leave():
    machine = Machine()
    threads = machine.threads()
    machine.run(1.0, worker_cores=1.0, others_cores=0.0)
    assert threads.for_step(tokens=cpu_threads.SMALL_STEP_TOKENS - 1) == 1  # decodes: waking a thread costs more
    assert threads.for_step(tokens=cpu_threads.SMALL_STEP_TOKENS) == 2
    assert threads.for_step() == 2
    assert machine.threads(requested=2).for_step(tokens=1) == 2  # the flag still fixes the count


def test_the_flag_fixes_the_count():
    machine = Machine()
    threads = machine.threads(requested=1)
    machine.run(1.0, worker_cores=1.0, others_cores=0.0)
    assert threads.for_step() == 1


def test_tensor_parallel_ranks_split_the_cores_and_leave_one():
    machine = Machine()
    threads = machine.threads(cores=8, num_ranks=2)
    machine.run(1.0, worker_cores=3.0, others_cores=0.0)
    assert threads.for_step() == 3


def test_one_core_is_all_there_is():
    machine = Machine()
    threads = machine.threads(cores=1)
    machine.run(1.0, worker_cores=1.0, others_cores=0.0)
    assert threads.for_step() == 1


def test_a_step_on_fewer_threads_than_cores_leaves_one_for_the_grammar_masks(monkeypatch):
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    machine = Machine()
    threads = machine.threads()
    threads.use(threads.for_step())
    assert threads.leaves_a_core()
    machine.run(1.0, worker_cores=1.0, others_cores=0.0)
    threads.use(threads.for_step())
    assert not threads.leaves_a_core()
    assert not machine.threads(cores=1).leaves_a_core()


def test_busy_seconds_come_from_this_workers_cores_in_proc_stat(tmp_path, monkeypatch):
    stat = tmp_path / "stat"
    stat.write_text(
        "cpu  900 0 900 9000 90 0 0 0 0 0\n"
        "cpu0 100 0 200 5000 50 0 10 0 0 0\n"
        "cpu1 800 0 700 4000 40 0 0 0 0 0\n"
        "intr 12345\n"
    )
    monkeypatch.setattr(cpu_threads.os, "sysconf", lambda name: 100)
    assert cpu_seconds_busy({0}, str(stat)) == 3.1  # user + system + softirq, not idle or iowait
    assert cpu_seconds_busy({0, 1}, str(stat)) == 18.1
    assert cpu_seconds_busy({0}, str(tmp_path / "missing")) is None


def test_the_worker_asks_for_huge_pages_for_its_large_buffers(llama_server):
    # On huge pages one core streamed the weights of a 12-layer model 1.3x as fast (docs/kernel-measurements.md).
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            mode = f.read()
    except OSError:
        pytest.skip("this kernel has no transparent huge pages")
    if "[never]" in mode:
        pytest.skip("transparent huge pages are turned off on this machine")
    worker = children(llama_server.process.pid)["worker"]
    with open(f"/proc/{worker}/smaps_rollup") as f:
        huge_kib = next(int(line.split()[1]) for line in f if line.startswith("AnonHugePages:"))
    assert huge_kib >= 2048  # the swap space alone spans many 2 MiB pages
