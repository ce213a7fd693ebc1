"""The three processes on a CUDA device: the compiled Triton kernels, the device KV cache and
swapping to the worker's host memory give HF transformers' greedy tokens. Skips without CUDA;
run on a GPU machine with `pytest tests/test_gpu.py tests/test_kernels.py`."""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (benchmarks/run_on_gpu.sh runs it on one)", allow_module_level=True)

from tests.conftest import serve, wait_until  # noqa: E402
from tests.test_end_to_end import complete_all, prompts  # noqa: E402
from tests.tiny_models import build_model, hf_greedy  # noqa: E402

pytestmark = pytest.mark.slow  # starts processes: not in `make check`

CUDA_FLAGS = ["--device", "cuda", "--dtype", "float32", "--num-gpu-blocks-override", "256"]


@pytest.mark.parametrize("family", ["llama", "qwen2", "opt", "gpt2", "mistral"])
def test_greedy_on_cuda_equals_hf_generate(family, tmp_path):
    model_dir = build_model(str(tmp_path / family), family)
    prompt_ids = prompts(model_dir)
    with serve(model_dir, str(tmp_path), *CUDA_FLAGS) as server:
        got = complete_all(server, prompt_ids)
        assert wait_until(server.is_idle, 5)
    assert got == [hf_greedy(model_dir, p, 16) for p in prompt_ids]


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_on_cuda_gives_the_same_tokens(llama_dir, mode, tmp_path):
    prompt_ids = prompts(llama_dir)
    flags = [*CUDA_FLAGS, "--num-gpu-blocks-override", "20", "--block-size", "4", "--preemption-mode", mode]
    with serve(llama_dir, str(tmp_path), *flags) as server:
        got = complete_all(server, prompt_ids)
        assert wait_until(server.is_idle, 5)
        assert server.metrics()[f'pagedserve_preemptions_total{{mode="{mode}"}}'] > 0
    assert got == [hf_greedy(llama_dir, p, 16) for p in prompt_ids]


def test_half_precision_dummy_weights_serve_on_cuda(llama_dir, tmp_path):
    flags = ["--device", "cuda", "--dtype", "float16", "--load-format", "dummy", "--num-gpu-blocks-override", "64"]
    with serve(llama_dir, str(tmp_path), *flags) as server:
        got = complete_all(server, prompts(llama_dir), max_tokens=24)
        assert wait_until(server.is_idle, 5)
    assert all(1 <= len(ids) <= 24 for ids in got)


@pytest.mark.parametrize("family", ["llama", "opt"])
def test_decode_steps_replayed_from_cuda_graphs_give_hf_greedy_tokens(family, tmp_path):
    from tests.engine_harness import Engine
    from tests.test_speculative_decoding import PROMPTS, hf_without_eos

    model_dir = build_model(str(tmp_path / family), family)
    engine = Engine(model_dir, depth=2, device="cuda", decode_graphs={"max_batch": 8, "max_context": 256})
    graphs = engine.runner.graphs
    graphs.capture()
    assert sorted(graphs.graphs) == [1, 2, 4, 8]
    got = engine.generate(PROMPTS, max_tokens=24, ignore_eos=True)  # five sequences: graphs of 8, then fewer
    assert got == [hf_without_eos(model_dir, p, 24) for p in PROMPTS]
    assert graphs.replays >= 23


@pytest.mark.parametrize("eager", [False, True])
def test_the_worker_captures_decode_graphs_unless_told_to_stay_eager(llama_dir, eager, tmp_path):
    flags = [*CUDA_FLAGS, *(["--enforce-eager"] if eager else [])]
    with serve(llama_dir, str(tmp_path), *flags) as server:
        got = complete_all(server, prompts(llama_dir))
        log = server.log()
    assert got == [hf_greedy(llama_dir, p, 16) for p in prompts(llama_dir)]
    assert ("decode batch sizes up to 256 sequences" in log) != eager


@pytest.mark.parametrize("fmt", ["ct-w8a8", "ct-w4a16", "ct-fp8", "gptq-act-order", "awq"])
def test_quantized_checkpoints_on_cuda_stay_close_to_their_oracle(quantized, fmt):
    """W8A8's int8 sums by the Triton kernel, 4-bit and FP8 codes by the one that unpacks them as it reads them:
    each layer takes its GPU path, decode steps replay from CUDA graphs, and the greedy tokens keep to HF's by
    vLLM's rule."""
    from services.worker.models.linear import Linear
    from tests.engine_harness import Engine
    from tests.test_quantized_models import MAX_TOKENS, PROMPTS
    from tests.tiny_models import check_logprobs_close

    engine = Engine(
        quantized.get("llama", fmt),
        depth=2,
        device="cuda",
        dtype="float32",
        decode_graphs={"max_batch": 4, "max_context": 64},
    )
    engine.runner.graphs.capture()
    methods = [m.method for m in engine.runner.model.modules() if isinstance(m, Linear) and m.weight is None]
    assert methods and all(getattr(m, "by_triton", False) or getattr(m, "gpu", None) is not None for m in methods), [
        m.describe() for m in methods
    ]
    ours = engine.generate_with_logprobs(PROMPTS, max_tokens=MAX_TOKENS)
    reference = [quantized.greedy_with_logprobs("llama", fmt, p, MAX_TOKENS, torch.float32) for p in PROMPTS]
    check_logprobs_close(ours, reference)
    assert engine.runner.graphs.replays > 0  # decode steps replayed as captured, the quantized products in them
