"""Dataclass fields as `rlserve serve` flags. A field with `flag(...)` metadata is a flag:
its name (vLLM's: --max-model-len for max_model_len), type and default come from the
field, its help and --help section from the metadata, so each is written once.
EngineConfig (config.py) and ServeOptions (server/options.py) are built this way; the
parser is assembled in cli.py.

Also here: the parsers of values as a command line writes them (sizes, ports, JSON).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from collections.abc import Callable
from typing import Any


def flag(help: str, **argparse_options: Any) -> dict[str, Any]:
    """A field's `rlserve serve` flag, as field metadata. The options add `group` (its --help
    section), and where needed `name` (another flag name), `aliases`, `type` (a parser of
    the text), and argparse's choices, metavar, nargs."""
    return {"help": help, **argparse_options}


def no_flag(why: str) -> dict[str, Any]:
    """Field metadata: not a `rlserve serve` flag, and why."""
    return {"no_flag": why}


def flag_name(f: dataclasses.Field) -> str:
    return f.metadata.get("name", "--" + f.name.replace("_", "-"))


def add_flags(cls: type, groups: dict[str, argparse._ArgumentGroup]) -> None:
    """A flag per field of the dataclass `cls` with flag(...) metadata, in field order: the
    field's default, a bool as --flag / --no-flag (vLLM's form)."""
    for f in dataclasses.fields(cls):
        if "help" not in f.metadata:
            continue
        options = dict(f.metadata)
        options.pop("name", None)
        group = groups[options.pop("group")]
        names = [flag_name(f), *options.pop("aliases", ())]
        kind = options.pop("type", None) or _field_type(f.type)
        if kind is bool:
            options["action"] = argparse.BooleanOptionalAction
        else:
            options["type"] = kind if kind in (int, float, str) else _arg_type(kind)
        default = None if f.default is dataclasses.MISSING else f.default
        group.add_argument(*names, dest=f.name, default=default, **options)


def flag_values(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """The fields of `cls` the flags set (those left unset keep the field's default)."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
            if "help" in f.metadata and getattr(args, f.name) is not None}


def _field_type(annotation: object) -> type:
    """The command-line type of a field annotated `annotation` (a string: the modules have
    postponed annotations): the first of bool, int, float, str it names."""
    if not isinstance(annotation, str):
        raise TypeError(f"flag fields need postponed annotations (a string), not {annotation!r}")
    names = {part.strip() for part in annotation.split("|")}
    return next(t for t in (bool, int, float, str) if t.__name__ in names)


def _arg_type(parse: Callable[[str], Any]):
    """An argparse type from a parser that raises ValueError: its message in the usage error."""
    def convert(value: str):
        try:
            return parse(value)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    convert.__name__ = parse.__name__  # argparse names it in "invalid <name> value"
    convert.parse = parse  # type: ignore[attr-defined]  # the help shows sizes as sizes
    return convert


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except the unset ones (None says nothing useful) and those the help
    already states; byte sizes as sizes (64M, not 67108864)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or "(default" in (action.help or ""):
            return action.help
        if getattr(action.type, "parse", None) is byte_size and isinstance(action.default, int):
            return f"{action.help} (default: {size_text(action.default)})"
        return super()._get_help_string(action)


# -- values as a command line writes them: each parser raises ValueError naming the problem

def positive_int(value: str) -> int:
    n = int(value)
    if n < 1:
        raise ValueError(f"must be at least 1, got {n}")
    return n


def port_number(value: str) -> int:
    if not value.strip().isdigit():
        raise ValueError(f"not a port number: {value!r}")
    n = int(value)
    if not 0 <= n <= 65535:
        raise ValueError(f"must be in 0..65535, got {n}")
    return n


_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def byte_size(value: str) -> int:
    """`1073741824`, `1G`, `1GiB`, `512M`: powers of two, as memory is counted."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)(?:i?[bB])?\s*", value)
    if not m:
        raise ValueError(f"not a byte size: {value!r} (try 2G or 2147483648)")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


def size_text(n: int) -> str:
    """`n` bytes as byte_size reads them back: the largest unit that divides it."""
    unit = next((u for u, size in reversed(_SIZE_UNITS.items()) if n and n % size == 0), "")
    return f"{n // _SIZE_UNITS[unit]}{unit.upper()}"


def json_object(value: str) -> dict[str, Any]:
    try:
        data = json.loads(value)
    except ValueError as e:
        raise ValueError(f"not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError("must be a JSON object")
    return data
