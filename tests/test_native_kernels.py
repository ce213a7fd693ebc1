"""The C kernels' ctypes declarations are checked against the signatures the C files state, so a
declaration that drifts from its function leaves the kernel to torch instead of corrupting memory,
and torch's profiler sees every call by name."""

import functools
import logging
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kernels import cpu_activation, cpu_attention, cpu_linear, cpu_norm, native, rotary

pytestmark = pytest.mark.skipif(native.load("cpu_norm") is None, reason="no C compiler here")


@pytest.mark.parametrize(
    "getter",
    [
        *(functools.partial(cpu_attention.native_kernel, symbol) for symbol in cpu_attention.SYMBOLS.values()),
        *(functools.partial(rotary.native_kernel, symbol) for symbol in rotary.SYMBOLS.values()),
        cpu_linear.gemm_build,
        *(functools.partial(cpu_norm.native_kernel, symbol) for symbol in ("rms_norm_f32", "rms_norm_f32_bf16")),
        *(functools.partial(cpu_activation.native_kernel, symbol) for symbol in ("silu_mul_f32", "silu_mul_f32_bf16")),
    ],
)
def test_every_kernel_loads_with_the_signature_its_c_file_states(getter):
    assert getter() is not None


def test_a_declaration_that_differs_from_the_c_signature_is_refused(caplog):
    p, i = native.POINTER, native.INT64
    with caplog.at_level(logging.ERROR, logger="pagedserve.kernels"):
        kernel = native.function("cpu_norm", "rms_norm_f32", [p, p, p, i, p, i, i, i, i, p, i], i)  # eps as an int64
    assert kernel is None
    assert "rms_norm_f32 takes pppfpiiiipi:i, where its caller passes pppipiiiipi:i" in caplog.text


def test_torch_profiler_sees_each_kernel_call_by_name_and_a_call_split_over_threads_as_one_range(monkeypatch):
    import torch
    from torch.profiler import ProfilerActivity, profile

    x, weight = torch.randn(32, 256), torch.randn(512, 256)  # past SPLIT_MACS: two threads share the call
    panels = cpu_linear.pack(weight)
    monkeypatch.setattr(native, "_threads", 2)
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as recorded:
        cpu_norm.rms_norm(x, torch.ones(256), 1e-5)
        out = cpu_linear.gemm(x, panels, 512, None)
    assert out is not None and torch.allclose(out, x @ weight.T, atol=1e-3)
    counts = {event.key: event.count for event in recorded.key_averages()}
    assert counts.get("pagedserve::cpu_norm.rms_norm_f32") == 1, sorted(counts)
    assert counts.get("pagedserve::cpu_gemm.gemm_f32 on 2 threads") == 1, sorted(counts)


@pytest.fixture
def blocked_helper():
    """Two threads share each call, but the helper is held up until the test lets it go (as when the
    api keeps its core busy); yields the event that lets it go."""
    held, drained = threading.Event(), threading.Event()
    native._helper_queue(1).put(held.wait)
    pool = native.helper_pool()
    if pool is not None:  # and the C helpers join no call
        pool.hold(1)
    native.set_threads(2)
    try:
        yield held
    finally:
        native.set_threads(0)
        if pool is not None:
            pool.hold(0)
        held.set()
        native._helper_queue(1).put(drained.set)
        assert drained.wait(10), "the helper never came back"


def test_a_call_shared_with_a_helper_that_never_starts_is_finished_by_the_caller(blocked_helper):
    import torch

    from tests.test_kernels import make_batch

    x, weight = torch.randn(32, 256), torch.randn(512, 256)  # past SPLIT_MACS: shared by two threads
    panels = cpu_linear.pack(weight)
    query, key_cache, value_cache, batch = make_batch([(1, 40), (3, 30), (1, 9), (1, 70)], 4, 2, 64, 8, torch.float32)
    with torch.no_grad():
        shared_linear = cpu_linear.gemm(x, panels, 512, None)
        shared_attention = cpu_attention.paged_attention_native(query, key_cache, value_cache, batch, 0.125)
        gate_up = torch.randn(64, 2 * 1024)  # past SPLIT_VALUES
        shared_activation = cpu_activation.silu_and_mul(gate_up, 1024)
    assert not blocked_helper.is_set()  # the calls returned while the helper had not started any
    native.set_threads(1)
    batch.derived.clear()
    with torch.no_grad():
        assert torch.equal(shared_linear, cpu_linear.gemm(x, panels, 512, None))
        assert torch.equal(
            shared_attention, cpu_attention.paged_attention_native(query, key_cache, value_cache, batch, 0.125)
        )
        assert torch.equal(shared_activation, cpu_activation.silu_and_mul(gate_up, 1024))


def test_the_c_helpers_join_shared_calls_and_every_call_gets_the_answer_one_thread_gets():
    import time

    import torch

    from tests.test_kernels import make_batch

    pool = native.helper_pool()
    assert pool is not None
    x, weight = torch.randn(32, 256), torch.randn(512, 256)
    panels = cpu_linear.pack(weight.to(torch.bfloat16))
    query, key_cache, value_cache, batch = make_batch([(1, 40), (3, 30), (1, 9), (1, 70)], 4, 2, 64, 8, torch.float32)
    with torch.no_grad():
        native.set_threads(1)
        alone = cpu_linear.gemm(x, panels, 512, None)
        attention_alone = cpu_attention.paged_attention_native(query, key_cache, value_cache, batch, 0.125)
        native.set_threads(2)
        joins, deadline = pool.joins(), time.monotonic() + 20
        calls = 0
        while calls < 50 or (pool.joins() == joins and time.monotonic() < deadline):
            assert torch.equal(cpu_linear.gemm(x, panels, 512, None), alone)
            batch.derived.clear()
            assert torch.equal(
                cpu_attention.paged_attention_native(query, key_cache, value_cache, batch, 0.125), attention_alone
            )
            calls += 1
    assert pool.joins() > joins  # a helper took part (the answers equal whoever took which chunks)


def test_calls_from_two_threads_at_once_each_get_their_own_answer():
    import torch

    x = [torch.randn(48, 256) for _ in range(2)]
    weight = torch.randn(512, 256)
    panels = cpu_linear.pack(weight)
    native.set_threads(2)
    with torch.no_grad():
        expected = [cpu_linear.gemm(rows, panels, 512, None) for rows in x]
    wrong = []

    def call_often(index: int) -> None:
        with torch.no_grad():
            for _ in range(200):
                if not torch.equal(cpu_linear.gemm(x[index], panels, 512, None), expected[index]):
                    wrong.append(index)

    threads = [threading.Thread(target=call_often, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert wrong == []


def test_native_loads_with_the_standard_library_alone_as_setup_py_loads_it():
    """setup.py builds the wheel's prebuilt kernels from kernels/native.py, loaded as a file of its own
    without torch or the package (so does the Docker image's build stage)."""
    probe = (
        "import importlib.util, sys; spec = importlib.util.spec_from_file_location('native', sys.argv[1]); "
        "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'kernels')))"
    )
    done = subprocess.run(
        [sys.executable, "-I", "-c", probe, str(Path(native.__file__))],
        capture_output=True,
        text=True,
        cwd="/",
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
