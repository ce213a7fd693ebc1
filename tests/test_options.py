"""Flags are named once, as fields of the typed configs: the parsers are made from them, and the command
line the launcher hands each service parses back, in that service's own parser, to the launcher's configs."""

from __future__ import annotations

import argparse

import pytest

from services.launcher import build_parser, commands
from shared.config import ApiConfig, ModelConfig, SchedulerConfig, SpeculativeConfig, WorkerConfig
from shared.options import add_options, from_namespace, to_flags

SPEC = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}')


@pytest.mark.parametrize(
    "config",
    [
        SchedulerConfig(),
        SchedulerConfig(
            block_size=4,
            max_model_len=300,
            enable_prefix_caching=True,
            enable_chunked_prefill=False,
            async_scheduling=False,
            speculative=SPEC,
            preemption_mode="swap",
        ),
        WorkerConfig(),
        WorkerConfig(
            device="cpu",
            dtype="bfloat16",
            kv_cache_dtype="int8",
            tensor_parallel_size=2,
            enforce_eager=True,
            kv_cache_memory=0.25,
        ),
        ApiConfig(),
        ApiConfig(
            port=9000,
            tool_call_parser="hermes",
            enable_auto_tool_choice=True,
            report_cached_tokens=False,
            served_model_name="m",
        ),
    ],
    ids=lambda c: type(c).__name__,
)
def test_a_config_written_as_flags_parses_back_to_itself(config):
    parser = argparse.ArgumentParser()
    add_options(parser, type(config), "all")
    assert from_namespace(type(config), parser.parse_args(to_flags(config))) == config


def test_vllms_dtype_names_are_taken():
    parser = argparse.ArgumentParser()
    add_options(parser, WorkerConfig, "worker")
    assert from_namespace(WorkerConfig, parser.parse_args(["--dtype", "half"])).dtype == "float16"


def test_each_service_gets_from_the_launcher_the_configs_the_launcher_parsed(tmp_path):
    from services.api.__main__ import build_parser as api_parser
    from services.scheduler.__main__ import build_parser as scheduler_parser
    from services.worker.__main__ import build_parser as worker_parser

    args = build_parser().parse_args(
        [
            "serve",
            "/models/m",
            "--tokenizer",
            "/tok",
            "--block-size",
            "8",
            "--no-async-scheduling",
            "-tp",
            "2",
            "--dtype",
            "bfloat16",
            "--port",
            "9001",
            "--speculative-config",
            '{"method": "draft_model", "model": "/d", "num_speculative_tokens": 2}',
            "--no-report-cached-tokens",
            "--api-key",
            "secret",
            "--enable-prefix-caching",
        ]
    )
    lines = commands(args, str(tmp_path))
    parsed = {
        name: parser().parse_args(lines[name][3:])
        for name, parser in (("scheduler", scheduler_parser), ("worker", worker_parser), ("api", api_parser))
    }
    for name, classes in (
        ("scheduler", [SchedulerConfig]),
        ("worker", [ModelConfig, WorkerConfig, SchedulerConfig]),
        ("api", [ModelConfig]),
    ):
        for config_class in classes:
            expected = from_namespace(config_class, args)
            assert from_namespace(config_class, parsed[name]) == expected, (name, config_class)
    api = from_namespace(ApiConfig, parsed["api"], api_key=None)
    assert api == from_namespace(ApiConfig, args, api_key=None) and "secret" not in " ".join(lines["api"])


def every_parser() -> dict[str, argparse.ArgumentParser]:
    """`pagedserve up` and each service's own parser."""
    import importlib

    [subcommands] = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    parsers = {"pagedserve up": subcommands.choices["up"]}
    for service in ("services.scheduler", "services.worker", "services.api"):
        parsers[service] = importlib.import_module(f"{service}.__main__").build_parser()
    return parsers


def test_every_flag_of_every_process_is_a_config_field_named_once_and_on_the_flags_page():
    import dataclasses

    from ops.docs.flags_page import page
    from shared import config

    fields: dict[str, str] = {}
    for name in dir(config):
        cls = getattr(config, name)
        if isinstance(cls, type) and dataclasses.is_dataclass(cls):
            for field in dataclasses.fields(cls):
                if "option" in field.metadata:
                    assert field.name not in fields, f"{field.name} is a flag of {fields[field.name]} and {name}"
                    fields[field.name] = name
    launcher_only = {"help", "version", "model"}  # argparse's, and the launcher's own (`serve MODEL`, --version)
    on_page = page()
    for process, parser in every_parser().items():
        for action in parser._actions:
            if not action.option_strings or action.dest in launcher_only:
                continue
            assert action.dest in fields, f"{process}: {action.option_strings} is not a config field"
            assert f"`{action.option_strings[0]}`" in on_page, f"{process}: {action.option_strings} is not on the page"
