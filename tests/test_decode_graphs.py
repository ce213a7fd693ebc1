"""Decode steps on CUDA graphs run on static buffers sized for the largest capture, padded up to a
captured size. On a CPU nothing is captured, but the same buffers, padding and slicing run (the
model is called on them where a GPU would replay), so these tests cover everything but the capture,
which tests/test_gpu.py covers on a GPU."""

import pytest
import torch

from services.worker.decode_graphs import CAPTURE_SIZES, DecodeGraphs
from shared.config import SpeculativeConfig
from tests.engine_harness import Engine
from tests.test_speculative_decoding import PROMPTS, family_dirs, hf_without_eos  # noqa: F401  (a fixture)
from tests.tiny_models import CONFIGS


@pytest.mark.parametrize("family", list(CONFIGS))
def test_greedy_tokens_through_the_graphs_buffers_equal_hf(family, family_dirs):  # noqa: F811
    model_dir = family_dirs[family]
    engine = Engine(model_dir, depth=2, decode_graphs={"max_batch": 8, "max_context": 64})
    assert engine.generate(PROMPTS, max_tokens=12, ignore_eos=True) == [
        hf_without_eos(model_dir, p, 12) for p in PROMPTS
    ]
    # Five sequences decode as a padded batch of 8, every decode step from the graphs' buffers.
    decode_steps = [s for s in engine.steps if s.scheduled and all(e.num_tokens == 1 for e in s.scheduled)]
    assert engine.runner.graphs.replays == len(decode_steps) >= 11


def test_padding_rows_write_no_kv_and_only_the_steps_a_graph_covers_use_one(llama_dir):
    engine = Engine(llama_dir, block_size=4, decode_graphs={"max_batch": 4, "max_context": 16})
    graphs = engine.runner.graphs
    assert graphs.sizes == [1, 2, 4] and graphs.max_context == 16
    assert [graphs.size_for(n) for n in (1, 2, 3, 4)] == [1, 2, 4, 4]
    before = {}
    real_run = graphs.run

    def run(inputs):
        before["cache"] = engine.cache.cache.clone()
        before["slots"] = inputs.batch.slot_mapping.tolist()  # the step's own sequences' slots
        hidden = real_run(inputs)
        changed = (engine.cache.cache != before["cache"]).flatten(4).any(-1)  # [2, layers, blocks, block_size]
        written = sorted(int(b) * 4 + int(o) for b, o in changed.any(0).any(0).nonzero().tolist())
        assert written == sorted(before["slots"])  # the padding rows wrote nothing
        assert hidden.shape[0] == len(before["slots"])
        return hidden

    graphs.run = run
    # Three prompts of 5 tokens: decode steps of 3 (padded to 4) up to a context of 16, then eager.
    outputs = engine.generate([[5, 9, 13, 7, 5], [100, 101, 102, 100, 3], [7] * 5], max_tokens=14, ignore_eos=True)
    eager = Engine(llama_dir, block_size=4).generate(
        [[5, 9, 13, 7, 5], [100, 101, 102, 100, 3], [7] * 5], max_tokens=14, ignore_eos=True
    )
    assert outputs == eager
    # Contexts 6..16 decode from the graphs (11 steps); the two steps past 16 run eagerly.
    assert graphs.replays == 11


def test_steps_with_prompt_chunks_proposals_or_too_many_sequences_run_eagerly(llama_dir):
    graphs = DecodeGraphs(None, Engine(llama_dir).cache, torch.device("cpu"), max_batch=8, max_context=100)
    assert graphs.max_context == 112  # whole blocks of 16
    assert graphs.covers(8, [10] * 8) and graphs.covers(1, [112])
    assert not graphs.covers(9, [10] * 9)  # more sequences than the largest capture
    assert not graphs.covers(5, [10] * 4)  # a prompt chunk or proposals: more tokens than sequences
    assert not graphs.covers(2, [10, 113])  # a context past the graphs' block tables
    assert DecodeGraphs(None, Engine(llama_dir).cache, torch.device("cpu")).sizes == CAPTURE_SIZES
    assert CAPTURE_SIZES[-1] == 512 and CAPTURE_SIZES[:5] == [1, 2, 4, 8, 16]


def test_speculating_steps_run_eagerly_and_plain_decode_steps_from_the_graphs(llama_dir):
    want = [hf_without_eos(llama_dir, p, 24) for p in PROMPTS]
    engine = Engine(
        llama_dir,
        speculative=SpeculativeConfig("ngram", 4, 1, 3, adaptive=False),
        depth=2,
        decode_graphs={"max_batch": 8, "max_context": 128},
    )
    assert engine.generate(PROMPTS, max_tokens=24, ignore_eos=True) == want
    assert engine.runner.graphs.replays > 0  # where no proposal was found, the step is a plain decode
