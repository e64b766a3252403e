"""`--help` of every command a user runs prints its usage and exits 0 (argparse %-formats help text, so
a literal "10%" in one knob's help used to crash train.py --help)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiproc  # every test here starts a process (the slow tier)

REPO = Path(__file__).resolve().parents[2]
ENTRY_POINTS = [
    "pipeline/train.py",
    "pipeline/finetune.py",
    "pipeline/analyze.py",
    "pipeline/export.py",
    "pipeline/plot_runs.py",
    "preprocessing/build_shards.py",
]


@pytest.mark.parametrize("script", ENTRY_POINTS)
def test_help_prints_usage_and_exits_0(script):
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    proc = subprocess.run(
        [sys.executable, str(REPO / script), "--help"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "usage:" in proc.stdout and "--" in proc.stdout
