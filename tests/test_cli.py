"""``python -m ubep`` is the ``ubep`` console script: same parser, same output, same exit codes."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from ubep.cli import build_parser

CONSOLE_SCRIPT = Path(sys.executable).with_name("ubep")


def _run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)


def _commands() -> list[str]:
    """The subcommands ubep.cli.main parses (the oracle)."""
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sorted(sub.choices)


def test_python_dash_m_ubep_runs_the_same_cli_as_the_console_script() -> None:
    module = _run(sys.executable, "-m", "ubep", "--help")
    assert module.returncode == 0, module.stderr
    assert module.stdout.startswith("usage: ubep ")
    listed = module.stdout.split("COMMAND\n", 1)[1].split("\n\n", 1)[0]  # "  name  help" rows
    assert sorted(row.split()[0] for row in listed.splitlines()) == _commands()
    if CONSOLE_SCRIPT.exists():  # the installed entry point (make venv / pip install)
        script = _run(str(CONSOLE_SCRIPT), "--help")
        assert (script.returncode, script.stdout) == (0, module.stdout)
    bad = _run(sys.executable, "-m", "ubep", "no-such-command")
    assert bad.returncode == 2 and "invalid choice: 'no-such-command'" in bad.stderr


def test_doctor_says_how_to_get_torch_where_it_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from ubep import doctor

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "torch" else real(name, *a))
    torch_check = next(c for c in doctor.run_checks() if c.name == "torch")
    assert not torch_check.ok
    assert "make venv" in torch_check.consequence and "'.[torch]'" in torch_check.consequence


def test_doctor_has_a_triton_line_that_says_where_the_engine_runs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from ubep import doctor

    line = next(c for c in doctor.run_checks() if c.name == "triton")
    installed = all(importlib.util.find_spec(m) is not None for m in ("triton", "torch"))
    assert line.ok is installed
    if installed:
        import torch

        assert line.detail.startswith("GPU" if torch.cuda.is_available() else "interpreter")
        assert line.detail.endswith(doctor.TRITON_BUFFER_PATH)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "triton" else real(name, *a))
    gone = doctor._triton()
    assert not gone.ok and gone.detail.startswith("missing (triton")
    assert "'.[triton]'" in gone.consequence
