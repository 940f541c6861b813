"""A new process that rejoins a masking Buffer as a lost rank and serves the remaining calls
(``python -m tests.buffer._rejoin_worker RENDEZVOUS RANK CASE_JSON FIRST_CALL OUT``); it writes
its mismatches against the oracle as JSON to OUT."""

from __future__ import annotations

import json
import sys

import numpy as np

from tests._runtime_support import Case
from tests.buffer.test_elastic import CALLS, NUM_RANKS, TOKENS, call_inputs, check_pair
from ubep.buffer import Buffer


def main(rendezvous: str, rank: int, case: Case, first_call: int, out: str) -> None:
    cfg = case.config(TOKENS, on_peer_loss="mask", timeout_s=1.0)
    errors: list[str] = []
    with Buffer.rejoin(rendezvous, rank, cfg, timeout_s=30.0) as buf:
        masks = [[int(r) for r in np.flatnonzero(buf.mask_status())]]
        for i in range(first_call, CALLS):
            inputs = call_inputs(case, cfg, i)
            xs, idxs, ws = inputs
            res = buf.dispatch(xs[rank], idxs[rank], ws[rank])
            y = buf.combine(np.ascontiguousarray(res.recv_x), res.handle)
            errors += [f"call {i}: {e}" for e in check_pair(res, y, inputs, ([], []), cfg, rank)]
    with open(out, "w") as f:
        json.dump({"errors": errors, "masks": masks, "ranks": NUM_RANKS}, f)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), Case(**json.loads(sys.argv[3])), int(sys.argv[4]),
         sys.argv[5])
