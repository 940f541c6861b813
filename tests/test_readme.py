"""README.md runs as written: every fenced block is tagged, and each is run or checked here.

* ``python`` blocks are complete programs: a block whose first line names ``torchrun`` runs
  under ``torch.distributed.run`` with the ranks it names, any other under this interpreter, each
  from a temporary directory (nothing of the repository on ``sys.path`` but the installed ubep);
* ``bash`` blocks are ``make`` commands: each target exists and ``make -n`` resolves it;
* ``text`` blocks are listings: the ``ubep sim`` synopsis names only experiments the CLI has.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
_TORCHRUN = re.compile(r"torchrun --nproc-per-node (\d+)")


def _blocks(tag: str | None = None) -> list[tuple[str, str]]:
    found = [(m.group(1), m.group(2)) for m in _FENCE.finditer((ROOT / "README.md").read_text())]
    return [(t, body) for t, body in found if tag is None or t == tag]


def test_every_block_is_tagged_with_what_checks_it() -> None:
    tags = [tag for tag, _ in _blocks()]
    assert tags and set(tags) <= {"python", "bash", "text"}, tags


@pytest.mark.parametrize("index", range(len(_blocks("python"))))
def test_python_block_runs_as_written(index: int, tmp_path: Path) -> None:
    body = _blocks("python")[index][1]
    program = tmp_path / "block.py"
    program.write_text(body)
    ranks = _TORCHRUN.search(body.splitlines()[0])
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH="")
    if ranks:
        if importlib.util.find_spec("torch") is None:
            pytest.skip("torch is not installed")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={ranks.group(1)}", str(program)]
    else:
        cmd = [sys.executable, str(program)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, f"README block {index}:\n{body}\n{proc.stderr[-4000:]}"


def test_bash_blocks_are_make_targets_that_resolve() -> None:
    commands = [line.split("#")[0].split() for _, body in _blocks("bash")
                for line in body.splitlines() if line.strip()]
    assert commands
    for cmd in commands:
        assert cmd[0] == "make" and len(cmd) == 2, cmd
        proc = subprocess.run(["make", "-n", cmd[1]], cwd=ROOT, capture_output=True, text=True,
                              timeout=60, check=False)
        assert proc.returncode == 0, proc.stderr


def test_the_sim_synopsis_names_only_experiments_the_cli_has() -> None:
    synopsis = next(body for _, body in _blocks("text") if body.startswith("ubep sim"))
    names = re.match(r"ubep sim (\S+)", synopsis).group(1).split("|")
    helptext = subprocess.run([sys.executable, "-m", "ubep", "sim", "--help"],
                              capture_output=True, text=True, timeout=120, check=True).stdout
    for name in [*names, "all", "calibrate", "report"]:
        assert re.search(rf"\b{name}\b", helptext), name
