"""The two grammar engines a server could use, side by side on the same tokenizer and schemas:
llguidance (what pagedserve uses) and xgrammar (vLLM's and SGLang's default), where importable.

For each schema: the time to compile it for the tokenizer, and the time to compute one token mask,
over the tokens of a valid document (median and the slowest, the first mask included).

    python benchmarks/grammar_engines.py
    PYTHONPATH=/tmp/xgrammar-target python benchmarks/grammar_engines.py   # xgrammar installed apart
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.structured_bench import RECORDS, new_schema  # noqa: E402

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


def documents() -> list[tuple[str, dict, str]]:
    import random

    wide = new_schema(random.Random(0))
    wide_doc = {name: _example(spec) for name, spec in wide["properties"].items()}
    return [
        ("person", PERSON, json.dumps({"name": "Ada Lovelace", "age": 36, "tags": ["math", "engines"]})),
        ("records", RECORDS, json.dumps([{"id": i, "name": f"item {i}", "tags": ["a", "b"]} for i in range(64)])),
        ("40 properties", wide, json.dumps(wide_doc)),
    ]


def _example(spec: dict):
    if "enum" in spec:
        return spec["enum"][0]
    return {"integer": 7, "string": "ab-123", "boolean": True, "array": [1.5], "object": {"x": 1, "y": "z"}}[
        spec["type"]
    ]


def llguidance_engine(tokenizer, vocab: int):
    import llguidance
    import llguidance.hf

    lltokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
    layout = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

    def compile_(schema: dict):
        return llguidance.LLMatcher(
            lltokenizer, llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=layout)
        )

    def mask(matcher, row: torch.Tensor) -> None:
        matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)

    def accept(matcher, token: int) -> bool:
        return matcher.consume_token(token)

    return compile_, mask, accept


def xgrammar_engine(tokenizer, vocab: int):
    import xgrammar

    compiler = xgrammar.GrammarCompiler(
        xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab), cache_enabled=False
    )

    def compile_(schema: dict):
        return xgrammar.GrammarMatcher(
            compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(", ", ": "))
        )

    def mask(matcher, row: torch.Tensor) -> None:
        matcher.fill_next_token_bitmask(row[None, :])

    def accept(matcher, token: int) -> bool:
        return matcher.accept_token(token)

    return compile_, mask, accept


def measure(engine, tokenizer, vocab: int, repeats: int) -> dict:
    compile_, mask, accept = engine
    row = torch.empty((vocab + 31) // 32, dtype=torch.int32)
    figures = {}
    for name, schema, text in documents():
        tokens = tokenizer.encode(text, add_special_tokens=False)
        compiles, masks = [], []
        for _ in range(repeats):
            started = time.perf_counter()
            matcher = compile_(schema)
            compiles.append(time.perf_counter() - started)
            for token in tokens:
                started = time.perf_counter()
                mask(matcher, row)
                masks.append(time.perf_counter() - started)
                if not accept(matcher, token):
                    raise RuntimeError(f"{name}: the document's token {token} was refused")
        figures[name] = {
            "compile_ms": statistics.median(compiles) * 1e3,
            "mask_us_median": statistics.median(masks) * 1e6,
            "mask_us_max": max(masks) * 1e6,
            "tokens": len(tokens),
        }
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", default=str(ROOT / "ops" / "models" / "tiny-python"))
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    vocab = len(tokenizer)
    engines = {"llguidance": llguidance_engine}
    try:
        import xgrammar  # noqa: F401

        engines["xgrammar"] = xgrammar_engine
    except ImportError:
        print("xgrammar is not importable here: llguidance alone")
    print(f"{'engine':12} {'schema':14} {'compile ms':>10} {'mask us (median)':>17} {'mask us (max)':>14}")
    for name, build in engines.items():
        for schema, figure in measure(build(tokenizer, vocab), tokenizer, vocab, args.repeats).items():
            print(
                f"{name:12} {schema:14} {figure['compile_ms']:10.2f} {figure['mask_us_median']:17.1f} "
                f"{figure['mask_us_max']:14.1f}"
            )


if __name__ == "__main__":
    main()
