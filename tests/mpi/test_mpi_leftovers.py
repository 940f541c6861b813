"""No MPI file outlives a job: Open MPI's ``sm_segment.*`` files in ``/dev/shm``.

Each job runs in a mount namespace of its own with a fresh tmpfs on ``/dev/shm`` (so other
jobs on this machine do not enter the count): the count before is 0, and after the job it must
be 0 again. The jobs:

* ``ubep.launch`` workers that import ``mpi4py.MPI`` (which initialises MPI: each is a singleton
  job with no Open MPI daemon to remove its files); the workers report that MPI was up;
* the DeepEP facade's ``comm=`` path under ``mpiexec`` (``tests/mpi/test_mpi_deep_ep.py``'s
  worker), its results checked by that file's oracle.

This file is also the worker (``python -m tests.mpi.test_mpi_leftovers launch OUT``).
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.mpi.test_mpi import REPO_ROOT, _mpiexec, _skip_reason

pytestmark = pytest.mark.mpi
NUM_RANKS = 2


def _private_shm_reason() -> str | None:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return "a private /dev/shm (unshare --mount) needs root and util-linux"
    return _skip_reason()


def run_with_private_shm(cmd: list[str], listing: Path, env: dict[str, str],
                         timeout_s: float) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` with a fresh tmpfs on /dev/shm; write what /dev/shm holds before and after
    it to ``listing`` (JSON)."""
    script = ('mount --make-rprivate / && mount -t tmpfs tmpfs /dev/shm || exit 97; '
              'before=$(ls -A /dev/shm | wc -l); "$@"; rc=$?; '
              f'printf \'{{"before": %s, "after": "%s"}}\' "$before" '
              f'"$(ls -A /dev/shm | tr "\\n" " ")" > {listing}; exit $rc')
    return subprocess.run(["unshare", "--mount", "/bin/sh", "-c", script, "sh", *cmd],
                          env=env, capture_output=True, text=True, timeout=timeout_s,
                          check=False, cwd=REPO_ROOT)


def _shm_after(listing: Path) -> tuple[int, list[str]]:
    got = json.loads(listing.read_text())
    return int(got["before"]), got["after"].split()


def _env() -> dict[str, str]:
    env = dict(os.environ) | {"OMP_NUM_THREADS": "1"}
    if os.geteuid() == 0:
        env |= {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    return env


def _mpi_worker(group: Any) -> dict[str, Any]:
    from mpi4py import MPI  # initialises MPI: a singleton job

    return {"initialized": bool(MPI.Is_initialized()), "size": MPI.COMM_WORLD.Get_size(),
            "rank": group.rank}


def _launch_job(out: str) -> None:
    import ubep
    from tests.mpi.test_mpi_leftovers import _mpi_worker as worker  # picklable by module name

    got = ubep.launch(worker, NUM_RANKS, timeout_s=120)
    Path(out).write_text(json.dumps(got))


def test_launch_workers_that_import_mpi4py_leave_nothing_in_dev_shm(tmp_path: Path) -> None:
    reason = _private_shm_reason()
    if reason:
        pytest.skip(reason)
    out, listing = tmp_path / "launch.json", tmp_path / "shm.json"
    proc = run_with_private_shm([sys.executable, "-m", "tests.mpi.test_mpi_leftovers", "launch",
                                 str(out)], listing, _env(), timeout_s=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert json.loads(out.read_text()) == [{"initialized": True, "size": 1, "rank": r}
                                           for r in range(NUM_RANKS)]
    assert _shm_after(listing) == (0, [])


def test_deepep_comm_path_under_mpiexec_leaves_nothing_in_dev_shm(tmp_path: Path) -> None:
    reason = _private_shm_reason()
    if reason:
        pytest.skip(reason)
    pytest.importorskip("torch")
    from tests.torch import _deepep_oracle as oracle

    out, listing = tmp_path / "deep_ep", tmp_path / "shm.json"
    cmd = [str(_mpiexec()), "--oversubscribe", "--mca", "osc", "^ucx", "-n", str(NUM_RANKS),
           sys.executable, "-m", "tests.mpi.test_mpi_deep_ep", str(out)]
    proc = run_with_private_shm(cmd, listing, _env(), timeout_s=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res, ys = oracle.normal_reference(NUM_RANKS)
    for rank in range(NUM_RANKS):  # the job really ran the comm= path, bit-exact
        got = pickle.loads(Path(f"{out}.{rank}").read_bytes())
        assert got["group_is_comm"]
        oracle.check_normal(got["internode"], rank, NUM_RANKS, [0] * NUM_RANKS, res, ys)
    assert _shm_after(listing) == (0, [])


if __name__ == "__main__" and sys.argv[1] == "launch":
    _launch_job(sys.argv[2])
