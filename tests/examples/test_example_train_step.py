"""examples/train_step.py under torchrun (2 ranks) trains, and prints the replica check its
docstring promises on every rank (the check itself is an all_gather of the non-expert weights
compared with torch.equal)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
ROOT = Path(__file__).resolve().parents[2]


# A rank once aborted at exit here ("terminate called without an active exception") when the
# gloo group outlived destroy_process_group (tests/torch/test_torch_teardown.py): the return
# code is checked, and a rank's abort fails this test.
def test_train_step_prints_the_replica_check_on_every_rank() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         str(ROOT / "examples/train_step.py")],
        capture_output=True, text=True, timeout=300, check=False, cwd=ROOT,
        env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    for rank in (0, 1):
        assert f"rank {rank}: replica check passed" in proc.stdout, proc.stdout
        assert f"rank {rank}: loss " in proc.stdout
