"""The rank program of a traced MPI job (tests/mpi/test_multihost.py), under ``mpiexec``:

    python -m tests.mpi._trace_worker OUT_DIR

Every rank makes a Buffer over ``ubep.mpi``, warms it up untraced, then runs two dispatches and
combines inside ``ubep.trace.record(OUT_DIR/step.json)``, each checked bit for bit against
``ubep.reference``. Rank 0 writes every rank's mismatches and its monotonic clock at the end
(``OUT_DIR/ranks.json``): the test reads how far apart the hosts' clocks are.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import ubep.mpi
import ubep.trace
from ubep import testing
from ubep.buffer import Buffer, BufferConfig

HIDDEN, TOPK, EXPERTS_PER_RANK, TOKENS = 256, 4, 2, 16


def main(out: str) -> None:
    group = ubep.mpi.init()
    experts = EXPERTS_PER_RANK * group.num_ranks
    cfg = BufferConfig(max_tokens_per_rank=TOKENS, hidden=HIDDEN, num_topk=TOPK,
                       num_experts=experts, dtype="bf16", engine="asp", sync="tff")
    xs, idxs, ws = testing.inputs("bf16", experts, TOPK, HIDDEN, [TOKENS] * group.num_ranks, 1,
                                  "uniform")
    errors: list[str] = []
    with Buffer(group, cfg) as buf:
        errors += testing.check_call(buf, xs, idxs, ws, 0)  # warm-up, untraced
        with ubep.trace.record(Path(out) / "step.json"):
            for seed in (1, 2):
                errors += testing.check_call(buf, xs, idxs, ws, seed)
    every = group.allgather({"errors": errors, "monotonic_ns": time.monotonic_ns()})
    if group.rank == 0:
        (Path(out) / "ranks.json").write_text(json.dumps(every))
    group.close()


if __name__ == "__main__":
    main(sys.argv[1])
