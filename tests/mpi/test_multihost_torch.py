"""A torch program across namespaced hosts (tests/mpi/netns.py): launched by ``mpiexec`` as 2
hosts x 2 ranks, ``torch.distributed`` (gloo) initialised from the launcher's environment, and
ubep's Buffers built on ``dist.group.WORLD`` with nothing else said: the group is found to span
hosts and ubep's MPI data plane (``ubep.mpi.torch_group``) carries the rows.

The worker (tests/mpi/_torch_worker.py) checks ``ubep.Buffer`` against ``ubep.reference`` in
both layouts, ``ubep.deep_ep.Buffer``'s normal and low-latency calls against closed forms, and
writes the V2 buffers' (``ElasticBuffer``, ``EPBuffer``) results, compared here bit for bit with
the single-process oracle of tests/torch/_deepep_v2_oracle.py. Without an MPI launcher the
same kind of group raises an error that names ``mpiexec``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from tests.mpi.multihost import MakeBed, no_shm_left, run_job

pytestmark = [pytest.mark.mpi, pytest.mark.torch]


def test_torch_program_spans_hosts_on_the_mpi_data_plane(make_bed: MakeBed,
                                                         tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from tests.torch import _deepep_v2_oracle as oracle
    from tests.torch import _torchrun_v2_worker as v2

    bed = make_bed(2)
    env = {"UBEP_TEST_MASTER_ADDR": bed.addresses[0],
           "UBEP_TEST_MASTER_PORT": str(random.randint(20000, 40000)),
           "GLOO_SOCKET_IFNAME": "eth0"}
    code, output = run_job(bed, 2, ["-m", "tests.mpi._torch_worker", str(tmp_path)], env=env,
                           mca=("-x", "GLOO_SOCKET_IFNAME"), timeout_s=400)
    assert code == 0, output[-4000:]
    shape = oracle.Shape(num_ranks=4)
    for rank in range(4):
        found = json.loads((tmp_path / f"torch.{rank}.json").read_text())
        assert found["group"] == "MpiGroup" and found["hosts"] == 2, found
        for layout in ("expert", "rank"):
            assert found[f"buffer.{layout}.group"] == "MpiGroup", found
            assert found[f"buffer.{layout}.errors"] == [], (rank, layout, found)
        for key in ("normal.recv", "normal.combine", "ll.recv", "ll.combine"):
            assert found[key] is True, (rank, key, found)
        checks = json.loads((tmp_path / f"v2.{rank}.json").read_text())
        assert checks and all(checks.values()), (rank, checks)
        saved = np.load(tmp_path / f"v2.{rank}.npz")
        inp = oracle.inputs(shape, v2.CASE, rank)
        want = oracle.bits(oracle.combine(shape, inp, rank, reduce_in_local=True))
        for name in ("elastic", "ep"):
            np.testing.assert_array_equal(saved[f"{name}.combined"], want)
            np.testing.assert_array_equal(saved[f"{name}.e_combined"], want)
    no_shm_left(bed)


def test_hosts_without_an_mpi_launcher_are_told_how_to_launch() -> None:
    from ubep.errors import UbepError
    from ubep.mpi.torch_group import across_hosts

    hellos = [{"mpi_rank": None}, {"mpi_rank": None}]
    with pytest.raises(UbepError, match=r"a \(boot 1\): ranks \[0\].*not started by an MPI "
                                        r"launcher.*mpiexec"):
        across_hosts(hellos, 0, "a (boot 1): ranks [0]; b (boot 2): ranks [1]")
