"""Command-line flags as the fields of typed configs: each flag is named once, as a dataclass field
with `option(...)` (shared/config.py), and the parsers, the objects the services receive and the
command lines the launcher hands each service are all made from those fields."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from typing import Any, TypeVar

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Option:
    help: str
    flag: str | None = None  # where it is not --<field-name>
    short: str | None = None  # a second name, as vLLM's -tp
    choices: tuple[str, ...] | None = None
    parse: Callable[[str], Any] | None = None  # argparse's type; None: the default's type
    negatable: bool = False  # a boolean with --no-<flag> too
    render: Callable[[Any], str] = str  # the value back as a flag's text, for the launcher's children
    nargs: str | None = None  # "*": a list of values after one flag, as vLLM's --lora-modules


def option(default: Any, help: str, **details: Any) -> Any:
    """A config field that is a flag, `--<field-name>` with dashes."""
    return field(default=default, metadata={"option": Option(help, **details)})


def flag_of(name: str, spec: Option | None = None) -> str:
    return spec.flag if spec is not None and spec.flag else "--" + name.replace("_", "-")


def _options(config_class: type) -> Iterable[tuple[str, Any, Option]]:
    for f in fields(config_class):
        spec = f.metadata.get("option")
        if spec is not None:
            yield f.name, f.default if f.default is not MISSING else None, spec


def add_options(
    parser: argparse.ArgumentParser,
    config_class: type,
    title: str,
    defaults: dict[str, Any] | None = None,
    exclude: Iterable[str] = (),
) -> None:
    """`config_class`'s flags as one argument group of `parser`; `defaults` replaces some of theirs."""
    group = parser.add_argument_group(title)
    for name, default, spec in _options(config_class):
        if name in exclude:
            continue
        default = (defaults or {}).get(name, default)
        names = [flag_of(name, spec), *([spec.short] if spec.short else [])]
        if isinstance(default, bool) or (default is None and spec.negatable):
            action: Any = argparse.BooleanOptionalAction if spec.negatable else "store_true"
            group.add_argument(*names, dest=name, action=action, default=default, help=spec.help)
            continue
        kind = spec.parse or (type(default) if default is not None else str)
        group.add_argument(
            *names,
            dest=name,
            type=kind,
            default=default,
            help=spec.help,
            nargs=spec.nargs,
            choices=list(spec.choices) if spec.choices else None,
            metavar=names[0][2:].replace("-", "_").upper() if not spec.choices else None,
        )


def from_namespace(config_class: type[T], namespace: argparse.Namespace, **values: Any) -> T:
    """`config_class` from parsed flags (those the namespace has), and `values` besides."""
    found = {name: getattr(namespace, name) for name, _, _ in _options(config_class) if hasattr(namespace, name)}
    return config_class(**(found | values))


def to_flags(config: object) -> list[str]:
    """`config`'s flag fields as a command line that parses back to the same values (None is left out:
    a flag's default None stands for it)."""
    assert is_dataclass(config) and not isinstance(config, type)
    flags: list[str] = []
    for name, _, spec in _options(type(config)):
        value = getattr(config, name)
        if value is None:
            continue
        if isinstance(value, bool):
            if spec.negatable:
                flags.append(flag_of(name, spec) if value else f"--no-{flag_of(name, spec)[2:]}")
            elif value:
                flags.append(flag_of(name, spec))
            continue
        if spec.nargs:
            flags += [flag_of(name, spec), *map(spec.render, value)] if value else []
            continue
        flags += [flag_of(name, spec), spec.render(value)]
    return flags
