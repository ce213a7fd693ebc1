"""Bodies of megabytes are encoded in pieces, each a small share of the whole, into the text Starlette renders."""

import math
import random

import pytest
from starlette.responses import JSONResponse

from services.api.large_json import encode_in_pieces, pieces_of


def completion_with_logprobs(choices: int, tokens: int) -> dict:
    """A completions body as the api builds it with logprobs=20: the shape that makes tens of megabytes."""
    rng = random.Random(0)

    def logprobs() -> dict:
        return {
            "tokens": [f"t{i}" for i in range(tokens)],
            "token_logprobs": [-rng.random() * 5 for _ in range(tokens)],
            "top_logprobs": [{f"alt{j}é": -rng.random() * 9 for j in range(20)} for _ in range(tokens)],
            "text_offset": list(range(tokens)),
        }

    return {
        "id": "cmpl-1",
        "object": "text_completion",
        "choices": [
            {"index": i, "text": 'é\n"x"' * tokens, "logprobs": logprobs(), "finish_reason": "length"}
            for i in range(choices)
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": choices * tokens, "total_tokens": 3 + choices * tokens},
    }


def test_a_35_mb_body_is_the_text_starlette_renders_in_pieces_of_a_few_hundred_kilobytes_at_most():
    body = completion_with_logprobs(choices=128, tokens=480)
    whole = JSONResponse(body).body
    assert len(whole) > 35e6
    assert encode_in_pieces(body) == whole
    pieces = pieces_of(body)
    assert max(len(piece) for piece in pieces) < 200_000  # a millisecond or two of json.dumps each
    assert len(pieces) > len(whole) / 200_000


@pytest.mark.parametrize(
    "value",
    [[], {}, [[]], {"a": [1] * 10_000}, [{"k": list(range(7000))}] * 3, ("t", 1), None, "é", 1.5, 'é"\n' * 100_000],
)
def test_any_layout_encodes_as_starlette_does(value):
    assert encode_in_pieces(value) == JSONResponse(value).body


def test_a_value_json_cannot_carry_is_refused_as_starlette_refuses_it():
    with pytest.raises(ValueError):
        encode_in_pieces({"choices": [{"logprob": -math.inf}]})
