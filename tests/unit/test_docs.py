"""The documentation against the code: the README stays short, every relative link (and its #anchor)
resolves, and every command the README, docs/, the Makefile and the Slurm scripts name exists: each
`tokencl-*` console script in pyproject.toml, each `python -m` module in the repository (or installed),
and each flag written after `pipeline/train.py` or `preprocessing/build_shards.py` in a code block (or
the Makefile) is one that script's parser accepts."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from pipeline.training.config import build_parser as train_parser
from preprocessing.config import build_parser as build_shards_parser

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
PAGES = [README, REPO / "slurm" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# Where commands are written for users: the pages, the Makefile and the Slurm scripts.
COMMAND_FILES = [*PAGES, REPO / "Makefile", *sorted((REPO / "slurm").glob("*.sh"))]

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE_BLOCK = re.compile(r"^```[a-z]*\n(.*?)^```", re.S | re.M)
# A console script where a command starts (not part of a path or a value: tokencl-cache-<run>, ...).
CONSOLE_SCRIPT = re.compile(r"(?<![\w/=.$<-])(tokencl-[a-z][a-z0-9-]*)(?![\w/<-])")
MODULE = re.compile(r"\bpython3? -m\s+([A-Za-z_][\w.<>]*[\w>])")  # pipeline.bench.<name>: a placeholder
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9_]*)(?![\w-])")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = CODE_BLOCK.sub("", page.read_text(encoding="utf-8"))
    return {_slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, re.M)}


def _console_scripts() -> set[str]:
    text = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    section = text.split("[project.scripts]", 1)[1].split("\n[", 1)[0]
    return set(re.findall(r"^([\w-]+)\s*=", section, re.M))


def _commands(path: Path) -> list[str]:
    """The shell commands of a page's code blocks (of the whole Makefile), continuation lines joined,
    trailing comments dropped."""
    text = path.read_text(encoding="utf-8")
    out = []
    for block in CODE_BLOCK.findall(text) if path.suffix == ".md" else [text]:
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #", 1)[0]
            out += [part for part in re.split(r"&&|;|\|", line) if part.strip()]
    return out


def test_readme_reads_in_five_minutes():
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines < 250, f"README.md has {lines} lines: move the reference into docs/"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_point_at_files_and_headings(page):
    broken = []
    for target in LINK.findall(page.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading #{anchor}")
    assert not broken, f"{page.relative_to(REPO)}: " + "; ".join(broken)


def test_every_console_script_named_is_installed():
    scripts = _console_scripts()
    assert {"tokencl-export", "tokencl-analyze", "tokencl-finetune", "tokencl-plot-runs"} <= scripts
    named = {(f.relative_to(REPO), s) for f in COMMAND_FILES for s in CONSOLE_SCRIPT.findall(f.read_text())}
    assert named, "no console script named anywhere: the pattern is broken"
    missing = sorted(f"{f}: {s}" for f, s in named if s not in scripts)
    assert not missing, f"not in pyproject.toml's [project.scripts]: {missing}"


def _module_exists(name: str) -> bool:
    base = REPO.joinpath(*name.split("."))
    if base.with_suffix(".py").is_file() or (base / "__main__.py").is_file():
        return True
    if (REPO / name.split(".")[0]).exists():  # one of ours, but no such module
        return False
    return importlib.util.find_spec(name) is not None


def test_every_python_m_module_named_exists():
    named = {(f.relative_to(REPO), m) for f in COMMAND_FILES for m in MODULE.findall(f.read_text()) if "<" not in m}
    assert any(m == "pipeline.bench.device" for _, m in named)
    missing = sorted(f"{f}: python -m {m}" for f, m in named if not _module_exists(m))
    assert not missing, missing
    # Tools run as modules; the tests' helpers are not user commands.
    assert not [m for _, m in named if m.startswith("tests")], "a test helper is documented as a command"


def _documented_flags(script: str) -> list[tuple[Path, str]]:
    """(page, flag) for every flag written after `script` (or its console script) in a code block."""
    found = []
    for page in [*PAGES, REPO / "Makefile"]:
        for command in _commands(page):
            words = command.split()
            starts = [i for i, w in enumerate(words) if w.endswith(script[0]) or w == script[1]]
            if starts:
                found += [(page.relative_to(REPO), f) for f in FLAG.findall(" ".join(words[starts[0] + 1 :]))]
    return found


@pytest.mark.parametrize(
    "script, parser",
    [
        (("pipeline/train.py", "tokencl-train"), train_parser),
        (("build_shards.py", "tokencl-build-shards"), build_shards_parser),
    ],
    ids=["train", "build_shards"],
)
def test_documented_flags_are_accepted(script, parser):
    accepted = {opt for action in parser()._actions for opt in action.option_strings}
    documented = _documented_flags(script)
    assert documented, f"no {script[0]} command in a code block: the pattern is broken"
    unknown = sorted({f"{page}: {flag}" for page, flag in documented if flag not in accepted})
    assert not unknown, f"{script[0]} has no such flag: {unknown}"
