"""Packaging promises: installing the ``torch`` extra into an environment that already has a
torch in the supported range keeps that torch (a user's CUDA build is never replaced), and the
interpreter range the package claims is the one CI tests."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")
def test_the_torch_extra_keeps_the_installed_torch(tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--no-build-isolation",
         "--disable-pip-version-check", "--report", str(report), "-e", f"{ROOT}[torch]"],
        capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    would_install = {item["metadata"]["name"].lower()
                     for item in json.loads(report.read_text())["install"]}
    assert "torch" not in would_install, would_install
    assert not any(name.startswith("nvidia-") for name in would_install), would_install


def test_requires_python_is_the_tested_range() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    claimed = re.search(r'requires-python = "(.*)"', text)
    assert claimed is not None and claimed.group(1) == ">=3.10, <3.14"
    classifiers = set(re.findall(r'"Programming Language :: Python :: (3\.\d+)"', text))
    smoke = (ROOT / "tests/smoke/run_pythons.sh").read_text()
    smoked = set(re.search(r'UBEP_SMOKE_PYTHONS:-([0-9. ]+)\}', smoke).group(1).split())
    assert classifiers == smoked | {"3.11"}  # 3.11 runs the full suite (.ci/run, the Makefile)
    assert {f"3.{minor}" for minor in range(10, 14)} == classifiers
