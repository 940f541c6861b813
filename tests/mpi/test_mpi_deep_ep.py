"""``deep_ep.Buffer(None, comm=<mpi4py communicator>)`` under mpiexec: DeepEP's normal mode on
ubep's MPI engine, bit-exact against ``ubep.reference``.

Two ranks, once on one host (shared memory: ``dispatch`` returns the intranode handle) and once
as two hosts (``UBEP_MPI_FORCE_RMA=1``: every row over MPI RMA, and ``dispatch``/``combine``
take DeepEP's internode path by themselves, with its internode handle). Each run also calls
``internode_dispatch``/``internode_combine`` explicitly, positionally in DeepEP's order. The
handle is checked field by field against a brute force over both ranks' routing.

This file is also the mpiexec worker (``python -m tests.mpi.test_mpi_deep_ep OUT``): each rank
pickles its results next to ``OUT``.
"""

from __future__ import annotations

import pickle
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.mpi.test_mpi import mpirun

pytestmark = [pytest.mark.mpi, pytest.mark.torch]
NUM_RANKS = 2


def _worker(out: str) -> None:
    from mpi4py import MPI

    from tests.torch import _deepep_oracle as oracle
    from ubep.deep_ep import Buffer

    comm = MPI.COMM_WORLD
    buf = Buffer(None, comm=comm, explicitly_destroy=True, max_tokens_per_rank=8, timeout_s=60.0)
    got: dict[str, Any] = {
        "group_is_comm": buf.group is comm,
        "auto": oracle.normal_flow(buf, buf.rank, internode=False),
        "internode": oracle.normal_flow(buf, buf.rank, internode=True),
    }
    buf.destroy()  # frees the MPI group the facade made from comm (collective)
    Path(f"{out}.{comm.Get_rank()}").write_bytes(pickle.dumps(got))


@pytest.mark.parametrize("hosts", [1, 2])
def test_comm_buffer_runs_deepep_normal_mode_on_the_mpi_engine(tmp_path: Path,
                                                               hosts: int) -> None:
    pytest.importorskip("torch")
    from tests.torch import _deepep_oracle as oracle

    out = tmp_path / "deep_ep"
    env = {"UBEP_MPI_FORCE_RMA": "1"} if hosts == 2 else {}
    mpirun(NUM_RANKS, ["-m", "tests.mpi.test_mpi_deep_ep", str(out)], env=env, timeout_s=240)
    host_of = list(range(NUM_RANKS)) if hosts == 2 else [0] * NUM_RANKS
    res, ys = oracle.normal_reference(NUM_RANKS)
    for rank in range(NUM_RANKS):
        got = pickle.loads(Path(f"{out}.{rank}").read_bytes())
        assert got["group_is_comm"]
        oracle.check_normal(got["internode"], rank, NUM_RANKS, host_of, res, ys)
        # dispatch/combine: DeepEP's internode path when the group spans hosts, else intranode
        oracle.check_normal(got["auto"], rank, NUM_RANKS, host_of if hosts == 2 else None, res,
                            ys)
        assert got["auto"]["type"] == ("InternodeHandle" if hosts == 2 else "NormalHandle")


if __name__ == "__main__":
    _worker(sys.argv[1])
