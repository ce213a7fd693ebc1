"""On a CPU a decode step replays the kernel calls that the first step of its size made (kernels/replay.py,
services/worker/decode_graphs.py): the same calls on the same addresses, with only the step's inputs
rewritten, so its tokens and log-probabilities are those of running each step's Python, bit for bit. What
cannot be replayed (a computation in torch, a kernel called some other way) is refused and runs eagerly."""

import subprocess
import sys

import pytest
import torch

from kernels import cpu_linear, native
from kernels.cpu_norm import rms_norm
from kernels.replay import record
from services.worker.cpu_threads import ComputeThreads
from tests.conftest import ROOT
from tests.engine_harness import Engine
from tests.tiny_models import build_model

pytestmark = pytest.mark.skipif(
    native.helper_pool() is None or cpu_linear.gemm_build() is None,
    reason="no C compiler here: every step runs its Python",
)
PROMPTS = [
    [5, 9, 13, 200, 17, 44, 60, 71],
    [7, 7, 8, 300, 12],
    [100, 101, 102, 103, 5, 6, 7, 8, 9, 10, 11],
    [3] * 40,
    [250, 3, 250, 3, 9],
]
LENGTHS = [30, 9, 21, 14, 26]  # sequences leave at different steps: batches of 5, 4, 3, 2, 1 (padded to 8, 4, 2, 1)


def norm_then_project(x, weight, panels, out_features, scale):
    y = cpu_linear.gemm(rms_norm(x, weight, 1e-5), panels, out_features, None)
    return y.mul_(scale)  # in place: done again on replay


@torch.inference_mode()
def test_a_replay_makes_its_recordings_kernel_calls_on_the_inputs_written_since():
    torch.manual_seed(0)
    x, weight, w = torch.randn(6, 64), torch.rand(64) + 0.5, torch.randn(40, 64)
    panels, scale = cpu_linear.pack(w), torch.tensor(3.0)
    recorded, replay, refusal = record(norm_then_project, x, weight, panels, 40, scale)
    assert refusal is None and replay.calls == 2
    torch.testing.assert_close(recorded, 3 * torch.rms_norm(x, (64,), weight, 1e-5) @ w.T, rtol=1e-4, atol=1e-4)
    for _ in range(3):
        x.copy_(torch.randn(6, 64))
        scale.fill_(float(torch.rand(())) + 0.5)
        replay()
        assert torch.equal(recorded, norm_then_project(x, weight, panels, 40, scale))


@pytest.mark.parametrize(
    "computation, refused_for",
    [
        (lambda x: x @ x.T, "aten.mm"),  # new values computed by torch
        (lambda x: x[: int(x.sum() > 0) + 1], "aten.sum"),  # a value read back decides what follows
    ],
)
def test_a_stretch_that_torch_computes_is_refused_and_its_result_still_returned(computation, refused_for):
    x = torch.randn(4, 4)
    result, replay, refusal = record(computation, x)
    assert replay is None and refused_for in refusal
    assert torch.equal(result, computation(x))


def test_the_first_recording_leaves_torchs_compiler_unloaded():
    """Importing torch's compiler took a worker a second or more at start; a recording never needs it."""
    script = (
        "import sys, torch; from kernels.replay import record; "
        "record(torch.ones, 3); print('torch._dynamo' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False"]


@torch.inference_mode()
def test_a_kernel_called_outside_share_task_is_refused():
    x, weight, out = torch.randn(2, 16), torch.ones(16), torch.empty(2, 16)
    kernel = native.function(
        "cpu_norm",
        "rms_norm_f32",
        [
            native.POINTER,
            native.POINTER,
            native.POINTER,
            native.FLOAT,
            native.POINTER,
            native.INT64,
            native.INT64,
            native.INT64,
            native.INT64,
            native.POINTER,
            native.INT64,
        ],
        native.INT64,
    )

    def direct():
        kernel(x.data_ptr(), 0, weight.data_ptr(), 1e-5, out.data_ptr(), 2, 16, 16, 2, native.new_counters(), 1)
        return out

    _, replay, refusal = record(direct)
    assert replay is None and "outside share_task" in refusal


@pytest.fixture(scope="module")
def llama_dirs(tmp_path_factory):
    return {
        dtype: build_model(str(tmp_path_factory.mktemp(f"llama-{dtype}")), "llama", dtype=getattr(torch, dtype))
        for dtype in ("float32", "bfloat16")
    }


def generate(model_dir, threads, replay, arrive_late=()):
    """Tokens and top log-probabilities of PROMPTS (each to its LENGTHS), with `arrive_late` prompts added
    after the fourth step, through decode graphs' buffers where `replay`."""
    engine = Engine(
        model_dir,
        dtype="auto",
        threads=ComputeThreads(threads),
        block_size=4,
        chunked_prefill=True,
        decode_graphs={"max_batch": 8, "max_context": 128} if replay else None,
    )
    ids = [engine.add(p, logprobs=3, max_tokens=n, ignore_eos=True) for p, n in zip(PROMPTS, LENGTHS)]

    def add_late(engine):
        if len(engine.steps) == 4:
            ids.extend(engine.add(p, logprobs=3, max_tokens=12, ignore_eos=True) for p in arrive_late)

    tokens = engine.run(on_step=add_late)
    return [(tokens[i][0], engine.top_logprobs[i][0]) for i in ids], engine.runner.graphs


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("threads", [1, 2])
def test_replayed_decode_steps_give_the_tokens_and_logprobs_of_eager_ones(llama_dirs, dtype, threads):
    # A long prompt arriving late is prefilled between replays, into larger scratch buffers than theirs.
    late = [[11 + i % 50 for i in range(90)]]
    replayed, graphs = generate(llama_dirs[dtype], threads, True, late)
    eager, _ = generate(llama_dirs[dtype], threads, False, late)
    assert replayed == eager
    assert graphs.recorded and all(r is not None for r in graphs.recorded.values())  # none refused
    assert {size for size, _ in graphs.recorded} >= {8, 4, 2, 1}
    assert graphs.replays > 2 * len(graphs.recorded)  # most steps replayed, not recorded


def test_layers_computed_in_torch_run_each_step_eagerly(llama_dirs, kernels_chosen):
    kernels_chosen(backend="torch")
    replayed, graphs = generate(llama_dirs["float32"], 1, True)
    eager, _ = generate(llama_dirs["float32"], 1, False)
    assert replayed == eager
    assert graphs.recorded and all(r is None for r in graphs.recorded.values())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_qwen3s_norm_of_each_head_runs_in_a_kernel_so_its_decode_steps_replay(tmp_path, dtype):
    model_dir = build_model(str(tmp_path), "qwen3", dtype=getattr(torch, dtype))
    replayed, graphs = generate(model_dir, 2, True)
    eager, _ = generate(model_dir, 2, False)
    assert replayed == eager
    assert graphs.recorded and all(r is not None for r in graphs.recorded.values())  # none refused
