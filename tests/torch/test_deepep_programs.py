"""DeepEP programs run on ubep by changing their import.

tests/deepep_programs/ holds programs written as DeepEP users write them (ours, not DeepEP's
files): ``normal_mode.py``, ``low_latency_mode.py`` and ``shrink_mode.py`` (DeepEP's
``--shrink-test``: ranks fail at their first dispatch, combine and clean; the others mask
them). Between them they make every ``deep_ep`` call DeepEP's own intranode and low-latency
tests make, with ``from ubep import deep_ep`` in place of ``import deep_ep``, and check every
result against references they compute from all ranks' inputs (their docstrings list the calls
and the checks).

Each runs as such a program runs: ``python normal_mode.py --num-processes N`` spawns N
processes (``torch.multiprocessing.spawn``) that join a gloo process group over a file://
rendezvous and hand a ``dist.new_group`` group to ``deep_ep.Buffer``. A failed check fails its
rank, the spawn, and so the script's exit code; every rank reports how many cases it checked.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests._shm import leaked_since, ubep_segments

pytest.importorskip("torch")
pytestmark = pytest.mark.torch

PROGRAMS = Path(__file__).parent / "deepep_programs"
# Cases each rank checks: normal mode, 2 layouts + 2 payloads x 2 top-k x 3 event modes;
# low latency, 2 waits x 4 FP8 modes + the round repeated after clean_low_latency_buffer.
CASES = {"normal_mode.py": 14, "low_latency_mode.py": 9}
TIMEOUT_S = 240.0


def _run(program: str, num_ranks: int, rendezvous: Path, *more: str,
         env: dict[str, str] | None = None) -> str:
    cmd = [
        sys.executable, program, "--num-processes", str(num_ranks),
        "--init-method", f"file://{rendezvous}", *more,
    ]
    # Own session: on a timeout the spawned ranks go down with the program.
    proc = subprocess.Popen(
        cmd, cwd=PROGRAMS, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True, env=None if env is None else {**os.environ, **env},
    )
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{program} on {num_ranks} ranks ran past {TIMEOUT_S} s:\n{out[-4000:]}")
    assert proc.returncode == 0, f"{program} on {num_ranks} ranks failed:\n{out[-6000:]}"
    return out


# 4 ranks (oversubscribed on a 2-core CI machine) under ``pytest -m matrix``; the shrink program
# below runs 5
@pytest.mark.parametrize("num_ranks", [2, pytest.param(4, marks=pytest.mark.matrix)])
@pytest.mark.parametrize("program", sorted(CASES))
def test_deepep_program_runs_on_ubep(program: str, num_ranks: int, tmp_path: Path) -> None:
    out = _run(program, num_ranks, tmp_path / "rendezvous")
    name = program.removesuffix(".py")
    for rank in range(num_ranks):
        line = f"{name}: rank {rank} of {num_ranks}: {CASES[program]} cases passed"
        assert line in out, f"rank {rank} did not check every case:\n{out[-4000:]}"


# DeepEP's --shrink-test fails ranks 1, 3 and 5 of 8; here 1, 3 and 4 of 5 (two survivors).
# A failed rank stops calling, so each failure costs the survivors about two deadlines (the
# call's, then the agreement's wait for the silent rank); 3 s keeps a healthy rank far inside.
SHRINK_RANKS, SHRINK_FAILED, SHRINK_DEADLINE_S = 5, (1, 3, 4), "3"
# per survivor: 8 rounds (2 waits x 4 FP8 modes), each a mask check after dispatch, after
# each of its 2 combines and after clean
SHRINK_CHECKS = 8 * 4


def test_deepep_shrink_program_masks_the_failed_ranks(tmp_path: Path) -> None:
    before = ubep_segments()
    out = _run("shrink_mode.py", SHRINK_RANKS, tmp_path / "rendezvous",
               "--fail-ranks", ",".join(map(str, SHRINK_FAILED)), "--num-experts", "20",
               env={"UBEP_TIMEOUT_S": SHRINK_DEADLINE_S})
    for rank in range(SHRINK_RANKS):
        if rank in SHRINK_FAILED:
            line = f"shrink_mode: rank {rank} of {SHRINK_RANKS}: failed as planned"
        else:
            line = f"shrink_mode: rank {rank} of {SHRINK_RANKS}: {SHRINK_CHECKS} cases passed"
        assert line in out, f"rank {rank}:\n{out[-4000:]}"
    assert leaked_since(before) == []
