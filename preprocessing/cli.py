"""Command-line conventions every entry point shares: the trainer's (pipeline/), the shard builder's
(preprocessing/) and the benchmarks'. It lives in preprocessing/ because that is the lower layer:
pipeline imports preprocessing (errors, shard_format, this module) and never the reverse, so the
builder can use it without importing the trainer.

- One declaration per knob: a dataclass field made with `knob()` carries its default, help text and
  choices; `add_arguments` turns a dataclass into argparse flags, so no flag is written twice.
- Configuration files (`--config FILE`, JSON or YAML) hold the same fields, grouped in sections;
  `merge_sections` applies defaults, then the file, then the flags the user actually typed; an
  unknown key, or a value of the wrong type for its field (`file_value`), is an error that names it.
- Resuming: `math_changes` lists the changed knobs marked math=True (what a resumed job refuses),
  `operational_changes` the others.
- The exit-code policy: a `UsageError` (bad flag, file or value) exits 2 with one line; anything else
  is a bug, and Python prints its traceback and exits 1.
- Benchmarks: `bench_parser` gives the flags they share (a smoke-run switch, --work_dir, --out) and
  `emit_json` prints their report (and writes it to --out).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import tempfile
import types
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
    group: Optional[str] = None,
) -> Any:
    """A dataclass field that is also a command-line flag.

    `flag` (default `--<field name>`); `invert`: a store_false flag for a bool that defaults to True
    (e.g. `--taco_no_detach` for `taco_detach`); `required`: must come from the command line or a
    --config file; `math`: changing it changes what a run computes (a resumed run refuses the change);
    `parse`: the argparse type for values that are not plain int/float/str; `repeat`: the flag may be
    given several times, each adding one element to a list; `choices`: a tuple, or a function returning
    one when the parser is built; `group`: the heading --help lists the flag under (default: none, or
    the argument group passed to `add_arguments`).
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
        "group": group,
    }
    if default_factory is not _NOT_SET:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def knob_fields(cls: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if "help" in f.metadata]


def flag_of(f: dataclasses.Field) -> str:
    return f.metadata["flag"] or f"--{f.name}"


def _is_union(annotation: Any) -> bool:
    """`Optional[int]`, `Union[a, b]`, and `int | None` alike."""
    return typing.get_origin(annotation) in (typing.Union, types.UnionType)


def _base_type(annotation: Any) -> Any:
    """int for `int`, `Optional[int]` and `int | None`; the element type of lists/tuples is `parse`'s."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if _is_union(annotation) and len(args) == 1:
        return args[0]
    return annotation


def add_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type) -> None:
    """One flag per knob of `cls`. Defaults are argparse.SUPPRESS: the namespace then holds exactly the
    flags the user typed, which is what lets a --config file sit between the defaults and the flags.
    A knob with a `group` is listed under that heading (made once per parser)."""
    hints = typing.get_type_hints(cls)
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f in knob_fields(cls):
        m = f.metadata
        where = parser
        if m["group"]:
            if m["group"] not in groups:
                groups[m["group"]] = parser.add_argument_group(m["group"])
            where = groups[m["group"]]
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
        where.add_argument(flag_of(f), **kwargs)


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
    if _is_union(annotation):
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
    if _is_union(annotation):
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


# ---- benchmarks ----------------------------------------------------------------------------------
def bench_parser(
    description: str,
    *,
    smoke: Optional[str] = None,
    smoke_flag: str = "--quick",
    work_dir: Optional[str] = None,
    out: bool | str = False,
    **parser_kwargs: Any,
) -> argparse.ArgumentParser:
    """A benchmark's parser with the flags benchmarks share, each spelt and explained one way:
    `smoke_flag` (--quick; --tiny for the GPU ones), a switch for a smoke run, `smoke` its help;
    --work_dir, `work_dir` saying what goes there (default: a temporary folder, `bench_work_dir`);
    --out FILE, where `emit_json` also writes the report (`out`: True, or a help text of its own)."""
    p = argparse.ArgumentParser(description=description, **parser_kwargs)
    if smoke is not None:
        p.add_argument(smoke_flag, action="store_true", help=smoke)
    if work_dir is not None:
        p.add_argument("--work_dir", help=f"{work_dir} (default: a temporary folder)")
    if out:
        p.add_argument("--out", help=out if isinstance(out, str) else "also write the JSON here")
    return p


def bench_work_dir(work_dir: Optional[str], *, prefix: str) -> Path:
    """--work_dir, or a new temporary folder named with `prefix`."""
    return Path(work_dir) if work_dir else Path(tempfile.mkdtemp(prefix=prefix))


def emit_json(result: dict[str, Any], out: Optional[str]) -> None:
    """Print a benchmark's report as JSON, and write it to `out` (--out) when given."""
    text = json.dumps(result, indent=2)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text + "\n")
    print(text, flush=True)
