"""torch.distributed (gloo) peer worker: one process per rank, started by peers/launch.py.

``python -m benchmarks.peers.gloo_worker WORKDIR RANK WORLD_SIZE STORE_FILE`` in the gloo venv
(torch 2.13.0 CPU + numpy). Rendezvous through a FileStore (no TCP port to pick or collide on);
rows move with ``all_to_all_single`` and split sizes, on byte views of the numpy buffers
(``torch.from_numpy`` shares memory, so no copy is added on either side).
"""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from benchmarks.peers.driver import run_plan

RENDEZVOUS_TIMEOUT_S = 120.0


class GlooExchange:
    """:class:`benchmarks.peers.kernels.Exchange` over the default torch.distributed group."""

    def __init__(self) -> None:
        self.rank = dist.get_rank()
        self.num_ranks = dist.get_world_size()

    def alltoall_counts(self, send: np.ndarray) -> np.ndarray:
        src = torch.from_numpy(np.ascontiguousarray(send, dtype=np.int64))
        out = torch.empty_like(src)
        dist.all_to_all_single(out, src)
        return out.numpy()

    def alltoallv_rows(
        self, send: np.ndarray, send_counts: np.ndarray, recv: np.ndarray, recv_counts: np.ndarray
    ) -> None:
        # gloo has no uint16: move rows as bytes (a row split stays a row split).
        src = torch.from_numpy(np.ascontiguousarray(send).view(np.uint8))
        dst = torch.from_numpy(recv.view(np.uint8))
        dist.all_to_all_single(
            dst,
            src,
            output_split_sizes=[int(c) for c in recv_counts],
            input_split_sizes=[int(c) for c in send_counts],
        )

    def barrier(self) -> None:
        dist.barrier()

    def max_over_ranks(self, values: np.ndarray) -> np.ndarray:
        t = torch.from_numpy(values.copy())
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.numpy()


def main() -> int:
    workdir, rank, world, store = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=RENDEZVOUS_TIMEOUT_S),
    )
    try:
        run_plan(GlooExchange(), workdir, f"torch {torch.__version__} gloo")
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
