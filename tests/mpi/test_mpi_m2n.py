"""M2N over ``ubep.mpi`` under mpiexec: two senders, one expert rank, every rank remote (TCP
RMA, the MPI engine), bit-exact against the oracle given the same roles, in both engines and
layouts; the worker is this file (``python -m tests.mpi.test_mpi_m2n OUT``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.mpi.test_mpi import _TCP, mpirun

pytestmark = pytest.mark.mpi

_MODES = [("asp", "sw", "expert"), ("bsp", "tff", "rank"), ("asp", "dc", "rank"),
          ("bsp", "sw", "expert")]
_EXPERT_RANKS = (2,)


def _worker(out: str) -> None:
    import ubep.mpi
    from ubep import testing
    from ubep.buffer import Buffer, BufferConfig

    group = ubep.mpi.init()
    found: dict[str, object] = {"hosts": group.num_hosts, "errors": [], "rows": []}
    errors: list[str] = found["errors"]  # type: ignore[assignment]
    for i, (engine, sync, layout) in enumerate(_MODES):
        cfg = BufferConfig(max_tokens_per_rank=16, hidden=128, num_topk=2, num_experts=4,
                           dtype="bf16", engine=engine, sync=sync, layout=layout,
                           expert_ranks=_EXPERT_RANKS, timeout_s=60.0)
        with Buffer(group, cfg) as buf:
            tokens = [16, 9, 0]  # the expert rank sends nothing
            xs, idxs, ws = testing.inputs("bf16", 4, 2, 128, tokens, i, "uniform")
            errors += [f"{engine}:{sync}:{layout}: {e}"
                       for e in testing.check_call(buf, xs, idxs, ws, i)]
            res = buf.dispatch(xs[buf.rank], idxs[buf.rank], ws[buf.rank])
            found["rows"].append(int(res.recv_x.shape[0]))  # type: ignore[attr-defined]
            buf.combine(res.recv_x, res.handle)
    every = group.allgather(found)
    if group.rank == 0:
        Path(out).write_text(json.dumps(every))
    group.close()


def test_m2n_over_tcp_rma_every_rank_remote_is_bit_exact(tmp_path: Path) -> None:
    out = tmp_path / "m2n.json"
    mpirun(3, ["-m", "tests.mpi.test_mpi_m2n", str(out)], mca=_TCP,
           env={"UBEP_MPI_FORCE_RMA": "1"}, timeout_s=300)
    every = json.loads(out.read_text())
    assert [e["hosts"] for e in every] == [3, 3, 3]  # every rank remote: the MPI engine
    assert [e["errors"] for e in every] == [[], [], []]
    for rank, e in enumerate(every):
        if rank not in _EXPERT_RANKS:
            assert e["rows"] == [0] * len(_MODES)  # a sender receives nothing
        else:
            assert all(n > 0 for n in e["rows"])


if __name__ == "__main__":
    _worker(sys.argv[1])
