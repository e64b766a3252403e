"""Command-line conventions every entry point shares.

- One declaration per knob: a dataclass field made with `knob()` carries its default, help text and
  choices; `add_arguments` turns a dataclass into argparse flags, so no flag is written twice.
- Configuration files (`--config FILE`, JSON or YAML) hold the same fields, grouped in sections;
  `merge_sections` applies defaults, then the file, then the flags the user actually typed; an
  unknown key, or a value of the wrong type for its field (`file_value`), is an error that names it.
- The exit-code policy: a `UsageError` (bad flag, file or value) exits 2 with one line; anything else
  is a bug, and Python prints its traceback and exits 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import typing
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Optional

from preprocessing.errors import UsageError

_NOT_SET = dataclasses.MISSING


def knob(
    default: Any = _NOT_SET,
    help: str = "",
    *,
    choices: Optional[tuple] = None,
    flag: Optional[str] = None,
    invert: bool = False,
    required: bool = False,
    math: bool = True,
    hidden: bool = False,
    parse: Optional[Callable[[str], Any]] = None,
    repeat: bool = False,
    default_factory: Any = _NOT_SET,
    metavar: Optional[str] = None,
) -> Any:
    """A dataclass field that is also a command-line flag.

    `flag` (default `--<field name>`); `invert`: a store_false flag for a bool that defaults to True
    (e.g. `--taco_no_detach` for `taco_detach`); `required`: must come from the command line or a
    --config file; `math`: changing it changes what a run computes (a resumed run refuses the change);
    `parse`: the argparse type for values that are not plain int/float/str; `repeat`: the flag may be
    given several times, each adding one element to a list; `choices`: a tuple, or a function returning
    one when the parser is built.
    """
    meta = {
        "help": help,
        "choices": choices,
        "flag": flag,
        "invert": invert,
        "required": required,
        "math": math,
        "hidden": hidden,
        "parse": parse,
        "repeat": repeat,
        "metavar": metavar,
    }
    if default_factory is not _NOT_SET:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def knob_fields(cls: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if "help" in f.metadata]


def flag_of(f: dataclasses.Field) -> str:
    return f.metadata["flag"] or f"--{f.name}"


def _base_type(annotation: Any) -> Any:
    """int for `int` and `Optional[int]`; the element type marker for lists/tuples is handled by `parse`."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is typing.Union and len(args) == 1:
        return args[0]
    return annotation


def add_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type) -> None:
    """One flag per knob of `cls`. Defaults are argparse.SUPPRESS: the namespace then holds exactly the
    flags the user typed, which is what lets a --config file sit between the defaults and the flags."""
    hints = typing.get_type_hints(cls)
    for f in knob_fields(cls):
        m = f.metadata
        kwargs: dict[str, Any] = {
            "dest": f.name,
            "default": argparse.SUPPRESS,
            "help": argparse.SUPPRESS if m["hidden"] else _help(f),
        }
        base = _base_type(hints[f.name])
        if base is bool:
            kwargs["action"] = "store_false" if m["invert"] else "store_true"
        else:
            if m["repeat"]:
                kwargs["action"] = "append"
            kwargs["type"] = m["parse"] or (base if base in (int, float) else str)
            if m["choices"]:
                # A callable gives the choices known when the parser is built (the objectives' registry).
                kwargs["choices"] = m["choices"]() if callable(m["choices"]) else m["choices"]
            if m["metavar"]:
                kwargs["metavar"] = m["metavar"]
        parser.add_argument(flag_of(f), **kwargs)


def _help(f: dataclasses.Field) -> str:
    # argparse %-formats help strings: a literal "10%" would crash --help.
    text = f.metadata["help"].replace("%", "%%")
    if f.metadata["required"]:
        return f"{text} (required)" if text else "(required)"
    default = f.default if f.default is not _NOT_SET else None
    if f.metadata["invert"] or default in (None, False, (), []):
        return text
    default = str(default).replace("%", "%%")
    return f"{text} [{default}]" if text else f"[{default}]"


def set_values(ns: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The knobs of `cls` that the command line set."""
    return {f.name: getattr(ns, f.name) for f in knob_fields(cls) if hasattr(ns, f.name)}


def parse_into(
    parser: argparse.ArgumentParser, cls: type, argv: Optional[Sequence[str]]
) -> tuple[Any, argparse.Namespace]:
    """(an instance of `cls` from the flags typed, over its defaults; the namespace, for other flags).
    A required knob left unset is argparse's usage error (exit 2)."""
    ns = parser.parse_args(argv)
    obj = cls(**set_values(ns, cls))
    missing = missing_required({"": obj})
    if missing:
        parser.error(f"the following arguments are required: {', '.join(missing)}")
    return obj, ns


def load_config_file(path: str) -> dict[str, Any]:
    """A --config file: JSON, or YAML (.yaml/.yml). UsageError naming the file for anything unreadable."""
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"--config {path}: no such file")
    text = p.read_text(encoding="utf-8")
    try:
        if p.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except Exception as e:  # json and yaml raise different types; both mean a malformed file
        raise UsageError(f"--config {path}: cannot parse it ({type(e).__name__}: {e})") from e
    if not isinstance(data, dict):
        raise UsageError(f"--config {path}: expected a mapping of sections, got {type(data).__name__}")
    return data


def merge_sections(
    sections: Mapping[str, type],
    *,
    file_values: Mapping[str, Any],
    cli_values: Mapping[str, dict],
    source: str,
    ignored: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Build one instance per section: field defaults, then `file_values[section][key]`, then
    `cli_values[section][key]`. `ignored`: top-level keys of the file that are not sections (a run's
    record of what it resolved), skipped. UsageError naming `source` and the key for an unknown key."""
    for key, value in file_values.items():
        if key in ignored:
            continue
        if key not in sections:
            raise UsageError(f"{source}: unknown key {key!r}; expected sections {sorted(sections)}")
        if not isinstance(value, dict):
            raise UsageError(f"{source}: section {key!r} must be a mapping, got {type(value).__name__}")
        known = {f.name for f in knob_fields(sections[key])}
        for name in value:
            if name not in known:
                raise UsageError(f"{source}: unknown key {key}.{name}; the keys of {key} are {sorted(known)}")
    out = {}
    for key, cls in sections.items():
        hints, fields = typing.get_type_hints(cls), {f.name: f for f in knob_fields(cls)}
        typed = {
            name: file_value(
                value, hints[name], choices=fields[name].metadata["choices"], where=f"{source}: {key}.{name}"
            )
            for name, value in file_values.get(key, {}).items()
        }
        out[key] = cls(**{**typed, **cli_values.get(key, {})})
    return out


# A number as YAML 1.2 writes it. PyYAML follows YAML 1.1, where `1e-3` (no dot) is a string.
_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def file_value(value: Any, annotation: Any, *, choices: Optional[tuple], where: str) -> Any:
    """A --config file's value as its field holds it, checked against the field's annotation and
    choices: ints where floats go (and a string that is a number, YAML 1.1's `1e-3`), lists for tuples,
    null for Optional. UsageError naming `where` (file and key) and the expected type otherwise."""
    try:
        typed = _typed(value, annotation)
    except TypeError:
        raise UsageError(
            f"{where} is {json.dumps(value, default=str)} ({type(value).__name__}); expected {_expected(annotation)}"
        ) from None
    if callable(choices):
        choices = choices()
    if choices and typed is not None and typed not in choices:
        raise UsageError(f"{where} is {typed!r}; expected one of {', '.join(map(str, choices))}")
    return typed


def _typed(value: Any, annotation: Any) -> Any:
    """`value` as `annotation` holds it; TypeError when it is not one."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Union:
        if value is None and type(None) in args:
            return None
        for arg in (a for a in args if a is not type(None)):
            try:
                return _typed(value, arg)
            except TypeError:
                pass
        raise TypeError
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise TypeError
        items = [_typed(v, args[0]) for v in value] if args else list(value)
        return tuple(items) if origin is tuple else items
    if annotation is float and isinstance(value, str) and _NUMBER.fullmatch(value.strip()):
        return float(value)
    if annotation is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if annotation in (bool, int, float, str) and type(value) is not annotation:  # bool is an int subclass
        raise TypeError
    if annotation is Any or isinstance(value, annotation):
        return value
    if isinstance(value, str):  # Path and the like, from their text
        return annotation(value)
    raise TypeError


def _expected(annotation: Any) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Union:
        return " or ".join(_expected(a) for a in args if a is not type(None)) + (
            " or null" if type(None) in args else ""
        )
    if origin in (list, tuple):
        return f"a list of {_expected(args[0]).removeprefix('an ').removeprefix('a ')}s" if args else "a list"
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    return names.get(annotation, f"a {getattr(annotation, '__name__', annotation)}")


def missing_required(instances: Mapping[str, Any]) -> list[str]:
    """Flags of required knobs that are still unset (None or empty) after merging."""
    missing = []
    for obj in instances.values():
        for f in knob_fields(type(obj)):
            if f.metadata["required"] and getattr(obj, f.name) in (None, "", [], ()):
                missing.append(flag_of(f))
    return missing


def math_changes(saved: Mapping[str, Any], now: Mapping[str, Any], sections: Mapping[str, type]) -> dict[str, tuple]:
    """{"section.key": (saved value, new value)} for every knob marked math=True that differs."""
    changed = {}
    for key, cls in sections.items():
        for f in knob_fields(cls):
            if not f.metadata["math"]:
                continue
            # A knob newer than the saved run: it ran with what is now the knob's default.
            before = saved.get(key, {}).get(f.name, _default(f))
            after = now.get(key, {}).get(f.name, _NOT_SET)
            if _normal(before) != _normal(after):
                changed[f"{key}.{f.name}"] = (before, after)
    return changed


def _default(f: dataclasses.Field) -> Any:
    if f.default is not _NOT_SET:
        return f.default
    if f.default_factory is not _NOT_SET:
        return f.default_factory()
    return _NOT_SET


def operational_changes(
    saved: Mapping[str, Any], now: Mapping[str, Any], sections: Mapping[str, type]
) -> dict[str, tuple]:
    """The same for knobs marked math=False (allowed on resume, and recorded)."""
    changed = {}
    for key, cls in sections.items():
        for f in knob_fields(cls):
            if f.metadata["math"]:
                continue
            before, after = saved.get(key, {}).get(f.name), now.get(key, {}).get(f.name)
            if _normal(before) != _normal(after):
                changed[f"{key}.{f.name}"] = (before, after)
    return changed


def _normal(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def one_line(error: BaseException) -> str:
    """The message of a user error on one line. An error raised in a data-loader worker reaches the
    rank wrapped in the worker's traceback; its last line is the message."""
    text = str(error).strip()
    if "Original Traceback" in text:
        last = text.splitlines()[-1]
        text = last.split(": ", 1)[1] if ": " in last else last
    return " ".join(text.split("\n"))


def run(main: Callable[[], int], *, prog: str) -> int:
    """Call `main`; a UsageError becomes `prog: error: ...` on stderr and exit code 2. Any other
    exception propagates: a bug keeps its traceback (and exits 1)."""
    try:
        return main()
    except UsageError as e:
        print(f"{prog}: error: {one_line(e)}", file=sys.stderr, flush=True)
        return 2
