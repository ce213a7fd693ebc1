"""docs/serving/flags.md, generated from the argparse definitions of `pagedserve up` (the flags are
named once, in shared/cli.py and services/launcher.py); tests/test_docs.py fails when the page is stale.

    python ops/docs/flags_page.py > docs/serving/flags.md
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from services.launcher import SHIPPED_MODEL, build_parser  # noqa: E402

SERVICES = ("services.scheduler", "services.worker", "services.api")

HEADER = """# Flags

`pagedserve up` (and `pagedserve serve MODEL`) takes every flag below but the last sections'; each
process also runs alone (`python -m services.scheduler`, `services.worker`, `services.api`, see
[Architecture](../design/architecture.md)) with the flags of its part and those of the last sections,
which the launcher sets for the processes it starts. This page is generated from the flags'
definitions (`python ops/docs/flags_page.py`).
"""


def page() -> str:
    parser = build_parser()
    [commands] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    up = commands.choices["up"]
    lines = [HEADER]
    for group in up._action_groups:
        actions = [a for a in group._group_actions if a.option_strings and a.dest != "help"]
        if not actions:
            continue
        title = {"options": "launcher", "optional arguments": "launcher"}.get(group.title, group.title)
        lines += [f"\n## {title}\n", "| flag | default | meaning |", "| --- | --- | --- |"]
        lines += [row(action) for action in actions]
    on_up = {flag for action in up._actions for flag in action.option_strings}
    for service in SERVICES:
        parser = service_parser(service)
        actions = [
            a for a in parser._actions if a.option_strings and a.dest != "help" and not set(a.option_strings) <= on_up
        ]
        if actions:
            lines += [f"\n## `python -m {service}` alone\n", "| flag | default | meaning |", "| --- | --- | --- |"]
            lines += [row(action) for action in actions]
    return "\n".join(lines) + "\n"


def service_parser(service: str) -> argparse.ArgumentParser:
    """A service's own parser (its __main__ imports torch only once its flags are parsed)."""
    import importlib

    return importlib.import_module(f"{service}.__main__").build_parser()


def row(action: argparse.Action) -> str:
    flags = ", ".join(f"`{flag}`" for flag in action.option_strings)
    if isinstance(action, argparse.BooleanOptionalAction):
        flags = f"`{action.option_strings[0]}`, `{action.option_strings[1]}`"
    default = action.default
    if action.dest == "model":
        default = "the shipped tiny-python"
    elif action.dest == "api_key":
        default = "$PAGEDSERVE_API_KEY"
    elif isinstance(default, bool) or default is None:
        default = {True: "on", False: "off", None: "none"}[default]
    choices = f" ({', '.join(map(str, action.choices))})" if action.choices else ""
    meaning = (action.help or "").replace("|", "\\|").replace("\n", " ")
    return f"| {flags} | {str(default).replace(SHIPPED_MODEL, 'the shipped tiny-python')} | {meaning}{choices} |"


if __name__ == "__main__":
    sys.stdout.write(page())
