"""examples/v2_elastic.py runs as written and checks itself (each token back as its row times
the ranks it visited, bit for bit)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from examples import v2_elastic as example
from ubep.runtime import launch

EXAMPLE = Path(example.__file__)


def test_v2_example_matches_the_closed_form() -> None:
    assert launch(example.run, example.RANKS, timeout_s=120) == [True] * example.RANKS


def test_v2_example_runs_as_a_script(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(EXAMPLE)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=240, check=False, env=dict(os.environ, PYTHONPATH=""))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "[True, True]"


def test_the_program_is_about_ten_lines() -> None:
    body = EXAMPLE.read_text().split("def run(", 1)[1].split("\n\n\n", 1)[0]
    assert len(body.strip().splitlines()) <= 12
