"""A step's small tensors come from persistent buffers, one copy per user, never from a tensor made
from a Python list: on CUDA each such tensor is a copy from pageable memory that waits for the
device. On a CPU the buffer path is the same code, so these tests cover it."""

import torch

from services.worker.step_inputs import StepInputs
from shared.config import SpeculativeConfig
from tests.engine_harness import Engine


def test_fields_come_back_side_by_side_from_one_buffer_kept_between_loads():
    inputs = StepInputs(torch.device("cpu"), capacity=8)
    ids, positions = inputs.load([5, 6, 7], [0, 1, 2])
    assert ids.tolist() == [5, 6, 7] and positions.tolist() == [0, 1, 2] and ids.dtype == torch.int64
    assert positions.data_ptr() == ids.data_ptr() + 3 * 8  # one buffer, side by side
    [again] = inputs.load([9])
    assert again.data_ptr() == ids.data_ptr() and again.tolist() == [9]  # kept: no allocation per step
    grown, empty = inputs.load(list(range(20)), [])
    assert grown.tolist() == list(range(20)) and empty.numel() == 0  # past its capacity, it grows

    values = StepInputs(torch.device("cpu"), torch.float32)
    temperature, uniform = values.load([0.5, 1.0], torch.tensor([0.25, 0.75]))
    assert temperature.tolist() == [0.5, 1.0] and uniform.tolist() == [0.25, 0.75]


def test_a_step_makes_no_device_tensor_from_a_list(llama_dir, monkeypatch):
    engine = Engine(
        llama_dir, block_size=4, speculative=SpeculativeConfig("ngram", 3, prompt_lookup_min=1, prompt_lookup_max=2)
    )
    made, executing = [], [False]
    real_tensor, real_execute = torch.tensor, engine.runner.execute

    def counting_tensor(*args, **kwargs):
        if executing[0] and "device" in kwargs:  # for the device; the CPU kernels' own host tensors aside
            made.append(args[0] if args else kwargs)
        return real_tensor(*args, **kwargs)

    def execute(step):
        executing[0] = True
        try:
            return real_execute(step)
        finally:
            executing[0] = False

    monkeypatch.setattr(torch, "tensor", counting_tensor)
    engine.runner.execute = execute
    engine.add([5, 9, 13, 5, 9, 13, 5, 9], max_tokens=12)  # greedy, with proposals to verify
    engine.add([7, 8, 7, 8, 7, 8], max_tokens=12, temperature=0.8, seed=3)  # sampled, seeded
    engine.add([1, 2, 3], max_tokens=12, temperature=1.0, top_k=5, top_p=0.9)  # sampled, filtered
    outputs = engine.run()
    assert all(len(choices[0]) == 12 for choices in outputs.values())
    assert len(engine.steps) > 3
    assert made == []
