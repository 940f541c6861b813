"""``ubep trace run``: a quick look at one measured call on this host. Every rank makes a
Buffer, warms it up untraced, then runs ``iters`` dispatches (each followed by its combine)
inside :func:`ubep.trace.record`; rank 0 merges the ranks' spans into one trace file."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .. import routing

__all__ = ["RunCase", "predict", "run_traced"]

ROUTINGS = ("uniform", "zipf", "hot")


@dataclass(frozen=True)
class RunCase:
    """What ``ubep trace run`` measures (one BufferConfig's worth, and the routing)."""

    num_ranks: int = 4
    num_tokens: int = 128
    hidden: int = 7168
    num_experts: int = 64
    num_topk: int = 8
    routing: str = "zipf"
    engine: str = "asp"
    sync: str = "tff"
    layout: str = "expert"
    num_cores: int | None = None
    iters: int = 1
    warmup: int = 2
    combine: bool = True
    seed: int = 0


def topk_of(case: RunCase, rank: int) -> np.ndarray:
    """Rank ``rank``'s ``topk_idx`` (seeded: the same on every run)."""
    seed = case.seed * 1000 + rank
    if case.routing == "zipf":
        return routing.zipf_topk(case.num_tokens, case.num_experts, case.num_topk, seed=seed)
    if case.routing == "hot":
        return routing.hot_experts_topk(case.num_tokens, case.num_experts, case.num_topk,
                                        hot_experts=2, hot_share=0.7, seed=seed)
    return routing.uniform_topk(case.num_tokens, case.num_experts, case.num_topk, seed=seed)


def config_of(case: RunCase) -> Any:
    from ..buffer import BufferConfig

    choices: dict[str, Any] = {"layout": case.layout, "engine": case.engine, "sync": case.sync}
    return BufferConfig(max_tokens_per_rank=case.num_tokens, hidden=case.hidden,
                        num_topk=case.num_topk, num_experts=case.num_experts, dtype="bf16",
                        num_cores=case.num_cores, **choices)


def _rank_main(group: Any, case: RunCase, out: str) -> int:
    from ..buffer import Buffer
    from ..testing import payload
    from ..trace.recorder import record

    rng = np.random.default_rng([case.seed, group.rank])
    x = payload(rng, "bf16", case.num_tokens, case.hidden)
    idx = topk_of(case, group.rank)
    w = rng.random((case.num_tokens, case.num_topk), dtype=np.float32)
    with Buffer(group, config_of(case)) as buf:
        for _ in range(case.warmup):
            _call(buf, case, x, idx, w)
        with record(out):
            for _ in range(case.iters):
                _call(buf, case, x, idx, w)
        return buf.num_cores


def _call(buf: Any, case: RunCase, x: np.ndarray, idx: np.ndarray, w: np.ndarray) -> None:
    res = buf.dispatch(x, idx, w)
    if case.combine:
        buf.combine(np.ascontiguousarray(res.recv_x), res.handle)


def predict(case: RunCase, fabric: str = "cm384") -> Any:
    """The simulator's trace of the same call: every rank's Plan from ``ubep.sched`` with the
    core split the Buffer uses, timed on ``fabric`` (a calibrated preset)."""
    import dataclasses

    from ..sched import core_split, schedule
    from ..sim import simulate
    from ..sim.calib import load_fabric
    from ..topology import host
    from ..trace.spans import from_sim

    cores = case.num_cores or host(case.num_ranks).cores_per_rank
    topo = dataclasses.replace(host(case.num_ranks), cores_per_rank=cores)
    split = core_split(cores, case.num_experts, case.num_topk, case.num_tokens)
    plans = [schedule(topk_of(case, r), topo, rank=r, num_experts=case.num_experts,
                      layout=case.layout, num_send_cores=split.num_send_cores,
                      num_count_cores=split.num_count_cores) for r in range(case.num_ranks)]
    res = simulate(plans, topo, load_fabric(fabric), engine=case.engine, sync=case.sync,
                   row_bytes=case.hidden * 2)
    return from_sim(res, f"{case.engine}/{case.sync} on {fabric}")


def run_traced(case: RunCase, out: str | Path, timeout_s: float = 300.0) -> Path:
    """Run ``case`` on ``case.num_ranks`` new processes of this host; the merged trace file."""
    from ..runtime import launch

    launch(_rank_main, case.num_ranks, case, str(out), timeout_s=timeout_s)
    return Path(out)
