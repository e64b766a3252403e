"""The layering rules of the code, stated once here and checked by reading every module's imports.

Packages, from the bottom up (a package imports only those below it):

    preprocessing                         the shard builder, and the command-line conventions every
                                          entry point shares (preprocessing/cli.py); never imports pipeline
    pipeline.distributed, .hardware       ranks and collectives, the machine
    pipeline.data, .losses, .modeling     pure tensor and data code; never the trainer
    pipeline.objectives                   what each objective is (its loss terms over losses/modeling)
    pipeline.training + the entry points  the trainer: pipeline/train.py, export.py, plot_runs.py
    pipeline.evaluation                   representation analysis, fine-tuning (analyze.py, finetune.py)
    pipeline.bench                        the benchmarks
    pipeline.experiments                  experiments built on the product; nothing imports them

"The core" is everything up to the trainer: it never imports evaluation, benchmarks or experiments.
Only pipeline/distributed/ uses torch.distributed; other modules may name its ProcessGroup type.
Imports inside functions count the same as module-level ones.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# (package prefix, level). A module may import modules of its own level or below.
LEVELS = [
    ("preprocessing", 0),
    ("pipeline.distributed", 1),
    ("pipeline.hardware", 1),
    ("pipeline.data", 2),
    ("pipeline.losses", 2),
    ("pipeline.modeling", 2),
    ("pipeline.objectives", 3),
    ("pipeline.training", 4),
    ("pipeline.train", 4),
    ("pipeline.export", 4),
    ("pipeline.plot_runs", 4),
    ("pipeline.demo_summary", 4),
    ("pipeline.evaluation", 5),
    ("pipeline.analyze", 5),
    ("pipeline.finetune", 5),
    ("pipeline.bench", 6),
    ("pipeline.experiments", 7),
    ("pipeline", 1),  # pipeline/__init__.py
]


def level_of(module: str) -> int | None:
    for prefix, level in LEVELS:
        if module == prefix or module.startswith(prefix + "."):
            return level
    return None


def modules() -> list[tuple[str, Path]]:
    out = []
    for root in ("pipeline", "preprocessing"):
        for path in sorted((REPO / root).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out.append((name, path))
    return out


def imports(path: Path, module: str) -> list[tuple[str, int]]:
    """(imported module, line) for every import of the file, relative ones resolved."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.append((base, node.lineno))
            found += [(f"{base}.{alias.name}", node.lineno) for alias in node.names]
    return found


def test_every_module_has_a_level():
    assert [m for m, _ in modules() if level_of(m) is None] == []


def test_imports_go_down_the_layers_only():
    bad = []
    for module, path in modules():
        mine = level_of(module)
        for target, line in imports(path, module):
            theirs = level_of(target)
            if theirs is not None and theirs > mine:
                where = f"{path.relative_to(REPO)}:{line} ({module}, level {mine})"
                bad.append(f"{where} imports {target} (level {theirs})")
    assert bad == [], "\n".join(bad)


def test_only_distributed_uses_torch_distributed():
    bad = []
    for module, path in modules():
        if module == "pipeline.distributed" or module.startswith("pipeline.distributed."):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        aliases = {
            a.asname or a.name
            for node in ast.walk(tree)
            if isinstance(node, ast.Import)
            for a in node.names
            if a.name == "torch.distributed"
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch.distributed"):
                bad.append(f"{path.relative_to(REPO)}:{node.lineno} imports from {node.module}")
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and node.attr != "ProcessGroup"
            ):
                bad.append(f"{path.relative_to(REPO)}:{node.lineno} uses torch.distributed.{node.attr}")
    assert bad == [], "\n".join(bad)


@pytest.mark.parametrize(
    "module, target, allowed",
    [
        ("pipeline.losses.taco", "pipeline.training.step", False),
        ("pipeline.training.trainer", "pipeline.bench.gpu", False),
        ("pipeline.bench.gpu", "pipeline.training.step", True),
        ("preprocessing.builder", "pipeline.training.config", False),
    ],
)
def test_the_rule_itself(module, target, allowed):
    assert (level_of(target) <= level_of(module)) is allowed
