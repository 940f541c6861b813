"""MPI peer worker: ``mpiexec -n N python -m benchmarks.peers.mpi_worker WORKDIR`` (repo root).

Runs in a peer venv (mpi4py + one MPI wheel + numpy) and executes the plan in WORKDIR
(benchmarks/peers/driver.py) over MPI_COMM_WORLD: counts with ``Alltoall``, rows with
``Alltoallv`` on a contiguous row datatype (one element per row, so counts never overflow int).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

from benchmarks.peers.driver import run_plan


class MpiExchange:
    """:class:`benchmarks.peers.kernels.Exchange` over an MPI communicator."""

    def __init__(self, comm: MPI.Intracomm) -> None:
        self.comm = comm
        self.rank = comm.Get_rank()
        self.num_ranks = comm.Get_size()
        self._row_types: dict[int, MPI.Datatype] = {}

    def _row_type(self, row_bytes: int) -> MPI.Datatype:
        dt = self._row_types.get(row_bytes)
        if dt is None:
            dt = MPI.BYTE.Create_contiguous(row_bytes).Commit()
            self._row_types[row_bytes] = dt
        return dt

    def alltoall_counts(self, send: np.ndarray) -> np.ndarray:
        send = np.ascontiguousarray(send, dtype=np.int64)
        recv = np.empty_like(send)
        self.comm.Alltoall(send, recv)
        return recv

    def alltoallv_rows(
        self, send: np.ndarray, send_counts: np.ndarray, recv: np.ndarray, recv_counts: np.ndarray
    ) -> None:
        row = self._row_type(send.shape[1] * send.itemsize)
        sc = np.asarray(send_counts, dtype=np.int64)
        rc = np.asarray(recv_counts, dtype=np.int64)
        sd = np.concatenate(([0], np.cumsum(sc)[:-1]))
        rd = np.concatenate(([0], np.cumsum(rc)[:-1]))
        self.comm.Alltoallv([send, (sc, sd), row], [recv, (rc, rd), row])

    def barrier(self) -> None:
        self.comm.Barrier()

    def max_over_ranks(self, values: np.ndarray) -> np.ndarray:
        out = np.empty_like(values)
        self.comm.Allreduce(values, out, op=MPI.MAX)
        return out

    def free(self) -> None:
        for dt in self._row_types.values():
            dt.Free()
        self._row_types.clear()


def main() -> int:
    workdir = Path(sys.argv[1])
    ex = MpiExchange(MPI.COMM_WORLD)
    try:
        run_plan(ex, workdir, MPI.Get_library_version().strip().splitlines()[0])
    finally:
        ex.free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
