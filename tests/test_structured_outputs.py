"""Structured outputs: every output matches the schema, regex, choices or grammar its request
asks for, whatever the model, the temperature, the samples, preemption or speculation do; an
invalid constraint is a 400 naming it, before anything is queued."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from transformers import AutoTokenizer

from services.api.errors import ApiError
from services.api.structured import GrammarSpec, compile_grammar, grammar_tokenizer, parse_structured
from services.worker.cpu_threads import ComputeThreads
from services.worker.logits_processing import GrammarMask
from services.worker.sampler import SampleRow
from shared.config import SpeculativeConfig
from shared.sampling import SamplingParams
from tests.engine_harness import Engine
from tests.tiny_models import CONFIGS, build_model

pytestmark = pytest.mark.slow  # starts processes: not in `make check`

# Every string, number and list is bounded, so a valid document always fits in max_tokens.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
    },
    "required": ["name", "age", "role", "tags"],
    "additionalProperties": False,
}
PROMPTS = [[5, 9, 13, 7, 5, 9], [100, 101, 102, 100, 101, 102, 100], [7] * 12, list(range(20, 40))]


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    return {family: build_model(str(tmp_path_factory.mktemp(family)), family) for family in CONFIGS}


def compiled(model_dir: str, spec: GrammarSpec) -> str:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return compile_grammar(spec, grammar_tokenizer(tokenizer, len(tokenizer)))


def texts(model_dir: str, outputs: list[list[int]]) -> list[str]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return [tokenizer.decode(tokens, skip_special_tokens=True) for tokens in outputs]


def schema_grammar(model_dir: str, schema: dict = PERSON) -> str:
    return compiled(model_dir, GrammarSpec("json", json.dumps(schema), "response_format"))


# --- which field asks for what ---------------------------------------------------------------


@pytest.mark.parametrize(
    "body, kind, text",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "integer"}}}},
            "json",
            '{"type": "integer"}',
        ),
        ({"response_format": {"type": "json_object"}}, "json", '{"type": "object"}'),
        ({"structured_outputs": {"json": {"type": "integer"}}}, "json", '{"type": "integer"}'),
        ({"structured_outputs": {"regex": "[ab]+"}}, "regex", "[ab]+"),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, "choice", '["yes", "no"]'),
        ({"structured_outputs": {"grammar": 'start: "x"'}}, "grammar", 'start: "x"'),
        ({"guided_json": '{"type": "integer"}'}, "json", '{"type": "integer"}'),
        ({"guided_regex": "[ab]+"}, "regex", "[ab]+"),
        ({"guided_choice": ["yes", "no"]}, "choice", '["yes", "no"]'),
        ({"guided_grammar": 'start: "x"'}, "grammar", 'start: "x"'),
    ],
)
def test_each_field_of_openai_and_vllm_asks_for_its_constraint(body, kind, text):
    spec = parse_structured(body)
    assert (spec.kind, spec.text) == (kind, text)


def test_a_text_response_format_or_none_asks_for_nothing():
    assert parse_structured({"response_format": {"type": "text"}}) is None
    assert parse_structured({}) is None


@pytest.mark.parametrize(
    "body, param",
    [
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}},
            "response_format.json_schema.schema",
        ),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_regex": 5}, "guided_regex"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
    ],
)
def test_a_malformed_or_doubled_constraint_names_its_field(body, param):
    with pytest.raises(ApiError) as caught:
        parse_structured(body)
    assert caught.value.param == param and caught.value.status == 400


@pytest.mark.parametrize(
    "spec, problem",
    [
        (GrammarSpec("regex", "a(b", "guided_regex"), "unclosed group"),
        (GrammarSpec("json", '{"type": "nope"}', "guided_json"), "nope"),
        (GrammarSpec("json", "{not json", "guided_json"), ""),
        (GrammarSpec("grammar", "start: undefined_rule", "guided_grammar"), "undefined_rule"),
    ],
)
def test_an_invalid_constraint_is_a_400_that_says_what_is_wrong(llama_dir, spec, problem):
    with pytest.raises(ApiError) as caught:
        compiled(llama_dir, spec)
    assert caught.value.status == 400 and caught.value.param == spec.param
    assert problem in str(caught.value)


# --- the mask ---------------------------------------------------------------------------------


def bitmask(allowed: list[int], vocab: int) -> torch.Tensor:
    words = [0] * ((vocab + 31) // 32)
    for token in allowed:
        words[token // 32] |= 1 << token % 32
    return torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)


def test_the_mask_leaves_only_the_allowed_tokens_and_rows_without_a_grammar_alone():
    logits = torch.randn(3, 70)
    before = logits.clone()
    rows = [
        SampleRow(SamplingParams(), 0, allowed=bitmask([3, 31, 32, 63, 69], 70)),
        SampleRow(SamplingParams(), 0),
        SampleRow(SamplingParams(), 0, allowed=bitmask([0], 70)),
    ]
    GrammarMask().apply(logits, rows, [0, 2])
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [3, 31, 32, 63, 69]
    assert torch.equal(logits[0, [3, 31, 32, 63, 69]], before[0, [3, 31, 32, 63, 69]])
    assert torch.equal(logits[1], before[1])
    assert torch.isfinite(logits[2]).nonzero().flatten().tolist() == [0]


def test_when_min_tokens_removed_every_token_the_grammar_allows_the_grammar_wins():
    logits = torch.randn(1, 40)
    logits[0, 7] = float("-inf")  # as min_tokens holds back an EOS the grammar requires
    GrammarMask().apply(logits, [SampleRow(SamplingParams(), 0, allowed=bitmask([7], 40))], [0])
    assert logits[0].argmax().item() == 7


# --- outputs that match, on every family ------------------------------------------------------


@pytest.mark.parametrize("family", list(CONFIGS))
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_output_is_valid_json_of_its_schema_on_every_family(family, temperature, family_dirs):
    model_dir = family_dirs[family]
    engine = Engine(model_dir)
    outputs = engine.generate(
        PROMPTS, grammar=schema_grammar(model_dir), max_tokens=120, temperature=temperature, seed=1
    )
    for tokens, text in zip(outputs, texts(model_dir, outputs)):
        assert len(tokens) < 120  # ended by the grammar's EOS, not by the length
        jsonschema.validate(json.loads(text), PERSON)


def test_regex_choice_and_grammar_outputs_match(llama_dir):
    engine = Engine(llama_dir)
    regex = compiled(llama_dir, GrammarSpec("regex", "[0-9]{3}-[a-z]{2}", "guided_regex"))
    choice = compiled(llama_dir, GrammarSpec("choice", '["red", "green", "blue"]', "guided_choice"))
    lark = compiled(llama_dir, GrammarSpec("grammar", 'start: "(" ("x" | "y")+ ")"', "guided_grammar"))
    digits = engine.generate(PROMPTS, grammar=regex, max_tokens=30, temperature=1.0)
    colours = engine.generate(PROMPTS, grammar=choice, max_tokens=30, temperature=1.0)
    brackets = engine.generate(PROMPTS[:1], grammar=lark, max_tokens=30, temperature=0.0)
    assert all(len(t) == 6 and t[:3].isdigit() and t[3] == "-" and t[4:].isalpha() for t in texts(llama_dir, digits))
    assert set(texts(llama_dir, colours)) <= {"red", "green", "blue"}
    (text,) = texts(llama_dir, brackets)
    assert text[0] == "(" and set(text[1:-1]) <= {"x", "y"} and (text[-1] == ")" or len(brackets[0]) == 30)


def test_each_of_n_samples_follows_its_own_path_through_the_grammar(llama_dir):
    engine = Engine(llama_dir)
    request = engine.add(PROMPTS[0], grammar=schema_grammar(llama_dir), n=4, temperature=1.0, seed=3, max_tokens=120)
    samples = engine.run()[request]
    documents = [json.loads(text) for text in texts(llama_dir, [samples[i] for i in range(4)])]
    for document in documents:
        jsonschema.validate(document, PERSON)
    assert len({json.dumps(d) for d in documents}) > 1  # the samples differ, each valid


def test_masks_computed_beside_a_forward_that_leaves_a_core_are_the_same_masks(llama_dir, monkeypatch):
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # the suite's own thread count stays
    grammar = schema_grammar(llama_dir)
    before = Engine(llama_dir).generate(PROMPTS * 2, grammar=grammar, max_tokens=120, temperature=1.0, seed=7)
    one_of_two_cores = ComputeThreads(requested=1, cores={0, 1})
    engine = Engine(llama_dir, threads=one_of_two_cores)
    beside = engine.generate(PROMPTS * 2, grammar=grammar, max_tokens=120, temperature=1.0, seed=7)
    assert one_of_two_cores.leaves_a_core() and engine.runner.mask_thread is not None
    assert beside == before


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_keeps_each_output_where_it_stood_in_its_grammar(llama_dir, mode):
    grammar = schema_grammar(llama_dir)
    alone = Engine(llama_dir).generate(PROMPTS * 2, grammar=grammar, max_tokens=120, temperature=1.0, seed=5)
    engine = Engine(llama_dir, block_size=4, num_gpu_blocks=30, num_cpu_blocks=64, preemption=mode)
    squeezed = engine.generate(PROMPTS * 2, grammar=grammar, max_tokens=120, temperature=1.0, seed=5)
    stats = engine.stats()
    assert stats.num_preemptions_swap + stats.num_preemptions_recompute > 0
    assert squeezed == alone  # seeded: the same tokens, preempted or not


def test_speculation_verifies_proposals_under_the_grammar_and_rolls_back_the_rejected(llama_dir):
    grammar = schema_grammar(llama_dir)
    plain = Engine(llama_dir).generate(PROMPTS, grammar=grammar, max_tokens=120)
    engine = Engine(llama_dir, speculative=SpeculativeConfig("ngram", 4, 1, 3, adaptive=False))
    assert engine.generate(PROMPTS, grammar=grammar, max_tokens=120) == plain
    stats = engine.scheduler.speculation.stats
    assert stats.num_accepted_tokens > 0 and stats.num_draft_tokens > stats.num_accepted_tokens
    for text in texts(llama_dir, plain):
        jsonschema.validate(json.loads(text), PERSON)


def test_a_worker_without_a_tokenizer_refuses_a_constrained_request_alone(llama_dir):
    engine = Engine(llama_dir)
    engine.runner.grammars = None
    free = engine.add(PROMPTS[0], max_tokens=4)
    constrained = engine.add(PROMPTS[1], grammar=schema_grammar(llama_dir), max_tokens=4)
    outputs = engine.run()
    assert len(outputs[free][0]) == 4
    assert outputs.get(constrained, {0: []})[0] == []


@pytest.mark.parametrize("which", ["test model", "shipped model"])
def test_the_worker_reads_the_tokenizer_for_grammars_without_transformers_and_sees_what_the_api_sees(llama_dir, which):
    from services.launcher import SHIPPED_MODEL
    from services.worker.grammar import grammar_tokenizer as worker_view

    directory = llama_dir if which == "test model" else SHIPPED_MODEL
    hf = AutoTokenizer.from_pretrained(directory)
    with open(f"{directory}/config.json") as config:
        vocab = json.load(config)["vocab_size"]
    ours, api = worker_view(directory, vocab, hf.eos_token_id), grammar_tokenizer(hf, vocab)
    assert all(ours.decode_bytes([i]) == api.decode_bytes([i]) for i in range(vocab))
    assert all(ours.is_special_token(i) == api.is_special_token(i) for i in range(vocab))
    text = "def main():\n    return {'a': [1, 2]}\n"
    assert ours.tokenize_str(text) == api.tokenize_str(text) == hf.encode(text, add_special_tokens=False)
