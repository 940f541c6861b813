"""A new process that rejoins a masking Buffer as a lost rank and serves the remaining calls
(``python -m tests.buffer._rejoin_worker RENDEZVOUS RANK CASE_JSON PLAN_JSON TOPOLOGY_JSON
OUT``); it writes its mismatches against the oracle as JSON to OUT."""

from __future__ import annotations

import json
import sys
from typing import Any

import numpy as np

from tests._runtime_support import Case
from tests.buffer.test_elastic import NUM_RANKS, Plan, call_inputs, check_call, config
from ubep.buffer import Buffer
from ubep.topology import Topology


def main(rendezvous: str, rank: int, case: Case, plan: Plan, topology: Topology,
         out: str) -> None:
    cfg = config(case, plan)
    errors: list[str] = []
    assert plan.join_at is not None
    with Buffer.rejoin(rendezvous, rank, cfg, timeout_s=30.0) as buf:
        masks = [[int(r) for r in np.flatnonzero(buf.mask_status())]]
        for i in range(plan.join_at, plan.calls):
            inputs = call_inputs(case, cfg, i)
            xs, idxs, ws = inputs
            res = buf.dispatch(xs[rank], idxs[rank], ws[rank])
            y = buf.combine(np.ascontiguousarray(res.recv_x), res.handle)
            errors += [f"call {i}: {e}"
                       for e in check_call(res, y, inputs, ([], [], []), cfg, rank, topology)]
    with open(out, "w") as f:
        json.dump({"errors": errors, "masks": masks, "ranks": NUM_RANKS,
                   "calls": plan.calls - plan.join_at}, f)


def _topology(fields: dict[str, Any]) -> Topology:
    return Topology(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), Case(**json.loads(sys.argv[3])),
         Plan(**json.loads(sys.argv[4])), _topology(json.loads(sys.argv[5])), sys.argv[6])
