"""The worker's model over a paged cache gives HF transformers' greedy tokens (in process)."""

import copy
import random

import pytest
import torch

from services.worker.kv_cache import KVCache
from services.worker.loader import load_model
from services.worker.mirrors import StepError
from services.worker.model_runner import ModelRunner
from shared.protocol import DEVICE, HOST, BlockTransfer, NewSequence, ScheduledSequence, Step
from shared.sampling import SamplingParams
from tests.tiny_models import hf_greedy

PROMPTS = [[5, 9, 13], [7] * 11, list(range(20, 37)), [400, 3]]


def greedy_through_runner(model_dir, block_size, num_new_tokens, shuffle_seed=0):
    model, config = load_model(model_dir, "float32", torch.device("cpu"))
    cache = KVCache(
        config.num_hidden_layers, 64, block_size, model.num_kv_heads, model.head_dim, torch.float32, torch.device("cpu")
    )
    runner = ModelRunner(model, cache, torch.device("cpu"), seed=0)
    free = list(range(64))
    random.Random(shuffle_seed).shuffle(free)  # block tables far from contiguous
    tokens = {i: list(p) for i, p in enumerate(PROMPTS)}
    computed = {i: 0 for i in tokens}
    blocks = {i: 0 for i in tokens}
    outputs = {i: [] for i in tokens}
    for step_id in range(num_new_tokens):
        news = [NewSequence(i, list(p), len(p), SamplingParams(temperature=0), 0) for i, p in enumerate(PROMPTS)]
        entries = []
        for i in tokens:
            n = len(tokens[i]) - computed[i]
            needed = -(-(computed[i] + n) // block_size) - blocks[i]
            new_blocks = [free.pop() for _ in range(needed)]
            blocks[i] += needed
            # No tokens to send: the runner appends each sequence's sample to its copy itself.
            entries.append(ScheduledSequence(i, computed[i], n, [], blocks[i] - needed, new_blocks))
            computed[i] += n
        result = runner.execute(Step(step_id, [], [], [], news if step_id == 0 else [], entries))
        for sampled in result.sampled:
            tokens[sampled.seq_id] += sampled.token_ids
            outputs[sampled.seq_id] += sampled.token_ids
    return [_through_first_eos(outputs[i], config.eos_token_id) for i in range(len(PROMPTS))]


def _through_first_eos(tokens, eos):
    """HF's generate stops at EOS; the runner alone has no stop rules."""
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_paged_greedy_equals_hf_generate(model_dirs, family, block_size):
    model_dir = model_dirs[family]
    got = greedy_through_runner(model_dir, block_size, num_new_tokens=8, shuffle_seed=block_size)
    expected = [hf_greedy(model_dir, p, 8) for p in PROMPTS]
    assert got == expected


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_greedy_with_the_triton_kernels_equals_hf_generate(model_dirs, family, kernels_chosen):
    kernels_chosen(backend="triton")  # interpreted on a CPU, compiled on a GPU
    model_dir = model_dirs[family]
    got = greedy_through_runner(model_dir, block_size=8, num_new_tokens=6, shuffle_seed=5)
    assert got == [hf_greedy(model_dir, p, 6) for p in PROMPTS]


def test_a_steps_block_transfers_move_whole_blocks_in_every_layer_in_list_order():
    cache = KVCache(3, 8, 4, 2, 16, torch.float32, torch.device("cpu"), num_cpu_blocks=4)
    cache.cache.copy_(torch.randn(cache.cache.shape))
    original = cache.cache.clone()
    cache.transfer(
        [
            BlockTransfer(DEVICE, 1, DEVICE, 5),  # copy-on-write
            BlockTransfer(DEVICE, 2, HOST, 0),
            BlockTransfer(DEVICE, 3, HOST, 3),  # a swap-out...
            BlockTransfer(DEVICE, 4, DEVICE, 2),
        ]
    )  # ...before its device block is written again
    cache.finish_swaps()
    assert torch.equal(cache.cache[:, :, 5], original[:, :, 1])
    assert torch.equal(cache.cache[:, :, 2], original[:, :, 4])
    cache.cache[:, :, 3] = 0
    cache.transfer([BlockTransfer(HOST, 0, DEVICE, 6), BlockTransfer(HOST, 3, DEVICE, 7)])
    assert torch.equal(cache.cache[:, :, 6], original[:, :, 2])
    assert torch.equal(cache.cache[:, :, 7], original[:, :, 3])


@pytest.mark.parametrize(
    "transfer",
    [
        BlockTransfer(HOST, 0, HOST, 1),
        BlockTransfer(DEVICE, 8, HOST, 0),
        BlockTransfer(DEVICE, 0, HOST, 4),
        BlockTransfer(2, 0, DEVICE, 0),
        BlockTransfer(DEVICE, -1, DEVICE, 0),
    ],
    ids=["host-to-host", "device-block-past-the-pool", "host-block-past-the-pool", "unknown-tier", "negative-block"],
)
def test_a_transfer_the_worker_cannot_carry_out_fails_the_step_before_any_block_moves(transfer):
    cache = KVCache(1, 8, 4, 2, 16, torch.float32, torch.device("cpu"), num_cpu_blocks=4)
    cache.cache.copy_(torch.randn(cache.cache.shape))
    before = cache.cache.clone()
    runner = ModelRunner(torch.nn.Module(), cache, torch.device("cpu"), seed=0, vocab_size=16)
    copy_first = BlockTransfer(DEVICE, 1, DEVICE, 2)
    with pytest.raises(StepError, match="transfer"):
        runner.execute(Step(0, [], [], [], [], [], [copy_first, transfer]))
    assert torch.equal(cache.cache, before)


def test_the_worker_refuses_a_bad_sequence_alone_and_serves_the_rest(llama_dir):
    model, config = load_model(llama_dir, "float32", torch.device("cpu"))
    cache = KVCache(
        config.num_hidden_layers, 16, 4, model.num_kv_heads, model.head_dim, torch.float32, torch.device("cpu")
    )
    runner = ModelRunner(model, cache, torch.device("cpu"), seed=0)
    greedy = SamplingParams(temperature=0)
    news = [
        NewSequence(0, [5, 9, 13], 3, greedy, 0),
        NewSequence(1, [5, config.vocab_size], 2, greedy, 0),  # a token id past the vocabulary
        NewSequence(2, [5, 9], 2, greedy, 0),
    ]
    entries = [
        ScheduledSequence(0, 0, 3, [], 0, [0]),
        ScheduledSequence(1, 0, 2, [], 0, [1]),
        ScheduledSequence(2, 0, 2, [], 0, [-1]),
    ]  # a block id that would wrap around
    result = runner.execute(Step(0, [], [], [], news, entries))
    assert result.error is None
    assert set(result.failures) == {1, 2} and "vocabulary" in result.failures[1] and "block" in result.failures[2]
    assert [s.seq_id for s in result.sampled] == [0]
    assert result.sampled[0].token_ids == hf_greedy(llama_dir, [5, 9, 13], 1)


def test_the_worker_follows_the_schedulers_word_on_keeping_samples_and_leaves_its_messages_as_sent(llama_dir):
    """docs/design/checks.md: whether the worker appends what it samples is decided by the scheduler and
    sent; a step the worker received is never edited, even where it resolves an entry's start itself."""
    model, config = load_model(llama_dir, "float32", torch.device("cpu"))
    cache = KVCache(
        config.num_hidden_layers, 16, 4, model.num_kv_heads, model.head_dim, torch.float32, torch.device("cpu")
    )
    runner = ModelRunner(model, cache, torch.device("cpu"), seed=0)
    greedy = SamplingParams(temperature=0)
    news = [NewSequence(0, [5, 9, 13], 3, greedy, 0), NewSequence(1, [5, 9, 13], 3, greedy, 0)]
    first = Step(
        0,
        [],
        [],
        [],
        news,
        [ScheduledSequence(0, 0, 3, [], 0, [0]), ScheduledSequence(1, 0, 3, [], 0, [1], worker_keeps_samples=False)],
    )
    result = runner.execute(first)
    assert [len(runner.mirrors[s].token_ids) for s in (0, 1)] == [4, 3]  # kept where told, not elsewhere
    token = result.sampled[1].token_ids[0]
    # Planned before the scheduler knew where the sequence ends: its start is the worker's to resolve (3).
    entry = ScheduledSequence(1, 2, 1, [token], 1, [], start_at_end=True)
    second = Step(1, [], [], [], [], [entry])
    sent = copy.deepcopy(second)
    assert runner.execute(second).error is None
    assert second == sent and entry.start == 2 and entry.start_at_end


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_prompt_steps_last_layer_computes_only_the_rows_it_samples(model_dirs, family):
    """Every layer writes every prompt token's keys and values, but only the sampled rows' output leaves the last
    one: its MLP takes a row a prompt; greedy tokens are still HF's."""
    from tests.engine_harness import Engine

    engine = Engine(model_dirs[family])
    layers = engine.runner.model.model.layers
    rows_seen: dict[str, list[int]] = {"first": [], "last": []}
    for name, layer in (("first", layers[0]), ("last", layers[-1])):
        layer.mlp.register_forward_hook(lambda module, args, out, name=name: rows_seen[name].append(args[0].shape[0]))
    got = engine.generate(PROMPTS, max_tokens=4)
    assert rows_seen["first"][0] == sum(len(p) for p in PROMPTS) and rows_seen["last"][0] == len(PROMPTS)
    assert rows_seen["first"][1:] == rows_seen["last"][1:]  # decode steps: every row is sampled
    assert got == [hf_greedy(model_dirs[family], p, 4) for p in PROMPTS]


def test_a_prompt_chunk_that_samples_nothing_skips_the_last_layers_output(model_dirs):
    """Chunked prefill: the chunks before a prompt's last leave the last layer once their keys and values are
    written; the tokens are still HF's."""
    from tests.engine_harness import Engine

    engine = Engine(model_dirs["llama"], chunked_prefill=True, max_num_batched_tokens=8)
    layers = engine.runner.model.model.layers
    rows_seen: dict[str, list[int]] = {"first": [], "last": []}
    for name, layer in (("first", layers[0]), ("last", layers[-1])):
        layer.mlp.register_forward_hook(lambda module, args, out, name=name: rows_seen[name].append(args[0].shape[0]))
    prompt = list(range(20, 40))
    got = engine.generate([prompt], max_tokens=3)
    assert rows_seen["first"][:3] == [8, 8, 4] and rows_seen["last"][0] == 1  # the third chunk's last row
    assert got == [hf_greedy(model_dirs["llama"], prompt, 3)]
