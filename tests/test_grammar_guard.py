"""A hostile schema or grammar costs at most its own request: chains that overflow llguidance's
recursion on an ordinary thread compile on the guard's deep-stack threads, longer ones are refused
with a reason before llguidance sees them, in the api and again in the worker, and the compiled
grammars both keep are bounded by bytes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from shared.grammar_guard import MAX_GRAMMAR_LINKS, CompileThreads, grammar_links, unbounded_reason
from tests.conftest import ROOT

MODEL = os.path.join(ROOT, "ops", "models", "tiny-python")


def ref_chain(links: int) -> dict:
    """An object whose one property is a `$ref` to the next definition, `links` deep."""
    defs = {f"d{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(links)}
    defs[f"d{links}"] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def rule_chain(links: int) -> str:
    return "start: r0\n" + "\n".join(f"r{i}: r{i + 1}" for i in range(links)) + f'\nr{links}: "x"\n'


def run_alone(code: str) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter, so a crash shows as its exit status rather than ending the tests."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, PYTHONPATH=ROOT),
    )


# --- counting ------------------------------------------------------------------------------------


def test_links_count_refs_and_rule_definitions_in_every_form_llguidance_reads():
    assert grammar_links(json.dumps(ref_chain(10))) == 11  # ten links and the root's $ref
    assert grammar_links(rule_chain(10)) == 12  # start, r0..r10
    assert grammar_links('root ::= "a" b\nb ::= "c"') == 2  # GBNF
    wrapped = json.dumps({"grammars": [{"lark_grammar": rule_chain(10)}, {"json_schema": ref_chain(10)}]})
    assert grammar_links(wrapped) == 23
    escaped = json.dumps(ref_chain(10)).replace("$ref", "\\u0024ref")
    assert grammar_links(json.dumps({"grammars": [{"lark_grammar": f"start: %json {escaped}"}]})) >= 11


def test_ordinary_grammars_are_within_bounds_and_chains_past_them_are_refused_with_the_reason():
    assert unbounded_reason(json.dumps(ref_chain(200))) is None
    assert unbounded_reason(rule_chain(1000)) is None
    reason = unbounded_reason(rule_chain(MAX_GRAMMAR_LINKS))
    assert reason is not None and str(MAX_GRAMMAR_LINKS) in reason


def test_compile_threads_return_results_and_hand_back_exceptions():
    threads = CompileThreads(2)
    assert threads.run(lambda: 6 * 7) == 42
    with pytest.raises(ZeroDivisionError):
        threads.run(lambda: 1 / 0)


# --- the api ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_api_compiles_chains_that_overflow_an_ordinary_stack_and_refuses_longer_ones_with_a_400():
    done = run_alone(f"""
        import asyncio, json
        from transformers import AutoTokenizer
        from services.api.errors import ApiError
        from services.api.structured import GrammarCompiler, GrammarSpec
        from tests.test_grammar_guard import ref_chain, rule_chain

        tokenizer = AutoTokenizer.from_pretrained({MODEL!r})
        compiler = GrammarCompiler(tokenizer, len(tokenizer))

        async def main():
            # On an 8 MiB stack llguidance dies on either of these.
            await compiler.compile(GrammarSpec("json", json.dumps(ref_chain(2000)), "response_format"))
            await compiler.compile(GrammarSpec("grammar", rule_chain(4000), "structured_outputs.grammar"))
            for spec in (GrammarSpec("json", json.dumps(ref_chain(6000)), "response_format"),
                         GrammarSpec("grammar", rule_chain(6000), "structured_outputs.grammar")):
                try:
                    await compiler.compile(spec)
                except ApiError as error:
                    print(error.status, error.code, error.param)
        asyncio.run(main())
    """)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == [
        "400 grammar_too_large response_format",
        "400 grammar_too_large structured_outputs.grammar",
    ]


@pytest.mark.slow
def test_an_ordinary_thread_is_what_the_chains_would_crash():
    """The hazard the guard exists for, so this file notices when llguidance stops recursing."""
    done = run_alone(f"""
        import json, threading
        import llguidance, llguidance.hf
        from transformers import AutoTokenizer
        from tests.test_grammar_guard import ref_chain

        tokenizer = llguidance.hf.from_tokenizer(AutoTokenizer.from_pretrained({MODEL!r}))
        threading.stack_size(8 << 20)
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(ref_chain(4000)))
        validate = llguidance.LLMatcher.validate_grammar_with_warnings
        thread = threading.Thread(target=lambda: validate(grammar, tokenizer))
        thread.start()
        thread.join()
    """)
    assert done.returncode != 0, "llguidance no longer overflows its stack: shared/grammar_guard.py's bound may go"


# --- the worker ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_worker_starts_sequences_on_long_chains_and_refuses_what_the_api_would():
    done = run_alone(f"""
        import json
        import llguidance
        from services.worker.grammar import GrammarEngine, GrammarState
        from tests.test_grammar_guard import ref_chain, rule_chain

        engine = GrammarEngine.load({MODEL!r}, 4096, [0])
        fits = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(ref_chain(2000)))
        print(isinstance(engine.start(fits), GrammarState))
        print(isinstance(engine.start(rule_chain(4000)), GrammarState))
        print(engine.start(rule_chain(6000)))
    """)
    assert done.returncode == 0, done.stderr[-2000:]
    fits_schema, fits_rules, refused = done.stdout.splitlines()
    assert fits_schema == fits_rules == "True"
    assert refused.startswith("grammar: it holds") and str(MAX_GRAMMAR_LINKS) in refused


@pytest.mark.slow
def test_compiled_grammars_the_worker_keeps_are_bounded_by_the_heap_they_hold():
    done = run_alone(f"""
        import json
        import llguidance
        import services.worker.grammar as grammar
        from services.worker.grammar import GrammarEngine
        from shared.glibc_heap import heap_in_use

        grammar.TEMPLATE_BYTES = 32 << 20
        engine = GrammarEngine.load({MODEL!r}, 4096, [0])
        for i in range(40):  # a distinct large enum each: the attack that grew a worker by 1.8 GB
            schema = {{"enum": [f"value-{{i}}-{{j}}" for j in range(20000)]}}
            state = engine.start(llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema)))
            del state
        print(heap_in_use() > 0, len(engine.templates), engine.template_bytes,
              sum(size for _, size in engine.templates.values()))
    """)
    assert done.returncode == 0, done.stderr[-2000:]
    measured, kept, held, total = done.stdout.split()
    assert measured == "True"
    assert 1 < int(kept) < 40  # some kept, the oldest let go
    assert int(held) == int(total) <= 32 << 20
