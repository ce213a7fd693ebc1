import msgpack
import pytest

from shared.protocol import (
    PROTOCOL_VERSION,
    Abort,
    AddRequest,
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


def test_every_field_survives_a_round_trip():
    step = Step(
        7,
        forks=[Fork(8, 3, 1)],
        finished_seq_ids=[1],
        preempted_seq_ids=[2],
        new_sequences=[NewSequence(3, [1, 2, 3], 3, SamplingParams(temperature=0.5, seed=11, stop_token_ids=[9]), 0)],
        scheduled=[ScheduledSequence(3, 0, 3, [], 0, [4, 5])],
        swap_out=[(1, 2)],
        swap_in=[(3, 4)],
        copies=[(4, 6)],
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
        (b"\xc1garbage", "not msgpack"),
        (msgpack.packb({"a": 1}), "a frame is a list"),
        (msgpack.packb([PROTOCOL_VERSION + 1, "Abort", ["x"]]), "protocol version"),
        (msgpack.packb([PROTOCOL_VERSION, "Pickle", []]), "unknown message type"),
        (msgpack.packb([PROTOCOL_VERSION, "Abort"]), "fields"),
        (msgpack.packb([PROTOCOL_VERSION, "Abort", [1]]), "Abort.request_ids: expected a list of str"),
        (msgpack.packb([PROTOCOL_VERSION, "Abort", "x"]), "expected a list"),
        (msgpack.packb([PROTOCOL_VERSION, "Hello", "a", 2]), "fields"),
        (msgpack.packb([PROTOCOL_VERSION, "AddRequest", "r", [1, True], [], 0.0]), "prompt_token_ids: expected a list of int"),
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
