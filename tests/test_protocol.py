import contextlib
import tracemalloc

import msgpack
import pytest

from services.scheduler.server import API_MESSAGE_CONTAINERS
from shared import protocol
from shared.frame_limits import DECODED_BYTES_PER_FRAME_BYTE, MAX_FRAME_BYTES
from shared.protocol import (
    DEVICE,
    HOST,
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    Abort,
    AddRequest,
    BlockTransfer,
    Fork,
    NewSequence,
    ProtocolError,
    RequestOutput,
    RequestOutputs,
    ScheduledSequence,
    SequenceDelta,
    Step,
    decode,
    encode,
)
from shared.sampling import SamplingParams
from shared.sockets import trusted_peer_containers


def test_every_field_survives_a_round_trip():
    step = Step(
        7,
        forks=[Fork(8, 3, 1)],
        finished_seq_ids=[1],
        preempted_seq_ids=[2],
        new_sequences=[NewSequence(3, [1, 2, 3], 3, SamplingParams(temperature=0.5, seed=11, stop_token_ids=[9]), 0)],
        scheduled=[ScheduledSequence(3, 0, 3, [], 0, [4, 5])],
        transfers=[
            BlockTransfer(DEVICE, 1, HOST, 2),
            BlockTransfer(HOST, 3, DEVICE, 4),
            BlockTransfer(DEVICE, 4, DEVICE, 6),
        ],
    )
    assert decode(encode(step)) == step
    outputs = RequestOutputs(
        [RequestOutput("r", 3, [SequenceDelta(0, [5], [-0.25], [{5: -0.25, 6: -2.0}], "stop")], True)]
    )
    assert decode(encode(outputs)) == outputs


def test_request_carries_sampling_params():
    sampling = SamplingParams(top_k=5, top_p=0.5, max_tokens=3, use_beam_search=True, early_stopping="never")
    request = AddRequest("id", [1, 2], sampling, 1.5)
    assert decode(encode(request)).sampling == sampling


@pytest.mark.parametrize(
    "frame, complaint",
    [
        (b"\xc1garbage", "a frame is a list"),
        (msgpack.packb([PROTOCOL_VERSION, "Abort", ["x"]])[:-1], "not msgpack"),
        (msgpack.packb({"a": 1}), "a frame is a list"),
        (msgpack.packb([PROTOCOL_VERSION + 1, "Abort", ["x"]]), "protocol version"),
        (msgpack.packb([PROTOCOL_VERSION, "Pickle", []]), "unknown message type"),
        (msgpack.packb([PROTOCOL_VERSION, "Abort"]), "fields"),
        (msgpack.packb([PROTOCOL_VERSION, "Abort", [1]]), "Abort.request_ids: expected a list of str"),
        (msgpack.packb([PROTOCOL_VERSION, "Abort", "x"]), "expected a list"),
        (msgpack.packb([PROTOCOL_VERSION, "Hello", "a", 2]), "fields"),
        (
            msgpack.packb([PROTOCOL_VERSION, "AddRequest", "r", [1, True], [], 0.0]),
            "prompt_token_ids: expected a list of int",
        ),
    ],
)
def test_malformed_frames_are_rejected_with_a_reason(frame, complaint):
    with pytest.raises(ProtocolError, match=complaint):
        decode(frame)


def test_only_protocol_messages_encode():
    with pytest.raises(TypeError):
        encode({"not": "a message"})


def test_abort_of_several_requests():
    assert decode(encode(Abort(["a", "b"]))).request_ids == ["a", "b"]


def test_a_bad_field_deep_inside_a_step_is_named():
    step = encode(Step(1, [], [], [], [], [ScheduledSequence(3, 0, 1, [], 0, [4])]))
    raw = msgpack.unpackb(step)
    raw[7][0][1] = "zero"  # ScheduledSequence.start
    with pytest.raises(ProtocolError, match=r"Step.scheduled: ScheduledSequence.start: expected int"):
        decode(msgpack.packb(raw))


def test_an_optional_field_takes_none_or_its_type_and_refuses_anything_else():
    output = RequestOutput("r", 3, [SequenceDelta(0, [1], [0.0], [{}], None)], False)
    decoded = decode(encode(RequestOutputs([output])))
    assert decoded.outputs[0].error is None and decoded.outputs[0].sequences[0].finish_reason is None
    assert decoded.outputs[0].sequences[0].top_logprobs == [{}]
    raw = msgpack.unpackb(encode(RequestOutputs([output])))
    raw[2][0][4] = "why"  # RequestOutput.error
    assert decode(msgpack.packb(raw)).outputs[0].error == "why"
    raw[2][0][4] = 5
    with pytest.raises(ProtocolError, match=r"RequestOutput.error: 5 is none of"):
        decode(msgpack.packb(raw))
    raw[2][0][4] = None
    raw[2][0][2][0][3] = [{"one": 0.5}]  # SequenceDelta.top_logprobs: token ids are ints
    with pytest.raises(ProtocolError, match=r"SequenceDelta.top_logprobs: expected int"):
        decode(msgpack.packb(raw))


# --- what a frame may cost before anything reads it -------------------------------------------


def _never_unpacked(monkeypatch) -> None:
    def unpackb(*args, **kwargs):
        raise AssertionError("the frame was decoded")

    monkeypatch.setattr(protocol.msgpack, "unpackb", unpackb)


@pytest.mark.parametrize("tag", sorted(MAX_FRAME_BYTES))
def test_a_frame_larger_than_its_type_ever_is_refused_before_decoding(tag, monkeypatch):
    frame = msgpack.packb([PROTOCOL_VERSION, tag, "x" * MAX_FRAME_BYTES[tag]])
    _never_unpacked(monkeypatch)
    with pytest.raises(ProtocolError, match=f"a {tag} frame of {len(frame)} bytes"):
        decode(frame)


def test_a_frame_with_no_message_type_in_its_first_bytes_is_refused_before_decoding(monkeypatch):
    _never_unpacked(monkeypatch)
    for frame in (
        msgpack.packb([PROTOCOL_VERSION, "A" * 100, [[]] * 1000]),
        msgpack.packb([[[]] * 1000, "Abort"]),
        b"\xc1garbage",
    ):
        with pytest.raises(ProtocolError, match="a frame is a list"):
            decode(frame)


# Payloads that cost the most memory per byte on the wire, within one frame.
COSTLY = {
    "one-character strings beyond Latin-1": lambda n: ["\u0101"] * n,
    "two-character strings": lambda n: ["ab"] * n,
    "integers past the cached ones": lambda n: [300 + i % 60_000 for i in range(n)],
    "empty arrays": lambda n: [[]] * n,
    "empty maps": lambda n: [{}] * n,
    "nils": lambda n: [None] * n,
}


@pytest.mark.parametrize("tag", [cls.__name__ for cls in MESSAGE_TYPES])
@pytest.mark.parametrize("payload", sorted(COSTLY))
def test_decoding_any_frame_of_any_type_costs_at_most_the_stated_factor_of_its_bytes(tag, payload):
    size = min(MAX_FRAME_BYTES.get(tag, 1 << 18), 1 << 18) - 64
    frame = msgpack.packb([PROTOCOL_VERSION, tag, COSTLY[payload](size // 3)])
    assert len(frame) <= size + 64
    for budget in (API_MESSAGE_CONTAINERS, trusted_peer_containers(frame)):  # the scheduler's api socket; the rest
        tracemalloc.start()
        with contextlib.suppress(ProtocolError):
            decode(frame, budget)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak <= DECODED_BYTES_PER_FRAME_BYTE * len(frame) + (16 << 10), (payload, budget, peak / len(frame))


def test_the_api_refuses_a_request_the_scheduler_would_drop_for_its_size(tmp_path):
    import asyncio

    from services.api.engine_client import EngineClient
    from shared.protocol import SchedulerInfo

    async def first_output():
        client = EngineClient(f"ipc://{tmp_path}/nobody.sock")
        client.info = SchedulerInfo(16, 1000, 1 << 30, 1 << 30, [0])
        huge = [40_000] * (MAX_FRAME_BYTES["AddRequest"] // 3 + 1)  # 3 bytes each on the wire
        try:
            return await anext(client.generate("r", huge, SamplingParams(), 0.0))
        finally:
            client.context.destroy(linger=0)

    output = asyncio.run(first_output())
    assert output.finished and output.sequences[0].finish_reason == "rejected"
    assert "over the scheduler's limit" in output.error
