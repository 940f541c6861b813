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


def test_sim_run_on_the_host_family_runs_with_its_defaults_or_names_the_flag() -> None:
    from ubep.sim.presets import topology_for
    from ubep.sim.spec import ASP_MIN_CORES

    ran = _run(sys.executable, "-m", "ubep", "sim", "run", "--family", "host")
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.startswith(f"dispatch on {topology_for('host', 64).name}")
    if topology_for("host", 64).cores_per_rank < ASP_MIN_CORES:  # a small host: refused by hand
        bad = _run(sys.executable, "-m", "ubep", "sim", "run", "--family", "host", "--cores", "1")
        assert bad.returncode == 2 and "--cores=1" in bad.stderr, bad.stderr


def test_trace_run_predicted_runs_with_the_default_cores(tmp_path: Path) -> None:
    """Its defaults but a small call: the cores a rank gets are the default under test."""
    from ubep.sim.spec import ASP_MIN_CORES
    from ubep.topology import host
    from ubep.trace import load

    measured, predicted = tmp_path / "m.json", tmp_path / "p.json"
    ran = _run(sys.executable, "-m", "ubep", "trace", "run", "--tokens", "16", "--hidden", "256",
               "--predicted", str(predicted), "-o", str(measured))
    assert ran.returncode == 0, ran.stderr
    cores = max(ASP_MIN_CORES, host(4).cores_per_rank)
    for path in (measured, predicted):  # both ran the same cores a rank
        (trace,) = load(path)
        assert trace.ranks() == [0, 1, 2, 3]
        assert {c for _, c in trace.by_core()} <= set(range(cores))
    (pred,) = load(predicted)
    assert {c for _, c in pred.by_core()} == set(range(cores))
