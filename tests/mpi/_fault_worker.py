"""The mpiexec worker of tests/mpi/test_multihost_faults.py (``python -m
tests.mpi._fault_worker OUT_DIR``).

Each rank runs ``UBEP_TEST_CALLS`` dispatch + combine calls on one Buffer
(``UBEP_TEST_POLICY``: ``raise`` or ``mask``) and checks every call it completes, the one in
flight at the fault included, bit for bit against the oracle of the mask it reports after that
call (``mask_status()``; all ranks under ``raise``). At call ``UBEP_TEST_FAULT_CALL``, before
its ``UBEP_TEST_FAULT_AT`` (``dispatch`` or ``combine``), every rank writes ``at.<rank>`` (its
pid in it); the ranks of ``UBEP_TEST_VICTIMS`` then wait for ``go`` while the others enter the
call, so the test's fault (a cut link, SIGKILL, SIGSTOP) strikes with them inside it. A rank
stops at its first exception and writes ``rec.<rank>.json``: its checked calls, the masks they
reported, and what it raised, in which call, how long after the call began.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np


def _write(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")  # renamed: never read half written
    tmp.write_text(json.dumps(data))
    tmp.rename(path)


def _wait(path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.01)


def main(out_dir: str) -> None:
    import ubep.mpi
    from tests._runtime_support import Case, make_inputs
    from tests.buffer.test_elastic import masked_oracle
    from ubep import reference
    from ubep.buffer import Buffer
    from ubep.testing import bits, compare

    out = Path(out_dir)
    env = os.environ
    # the test dumps every rank's threads here (SIGUSR1) when the job stalls
    stacks = open(out / f"stack.{os.getpid()}", "w")  # noqa: SIM115 (open until the exit)
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    faulthandler.enable(file=stacks, all_threads=True)  # a crash leaves its stack there too
    group = ubep.mpi.init()
    R, r = group.num_ranks, group.rank
    policy = env["UBEP_TEST_POLICY"]
    calls, fault_call = int(env["UBEP_TEST_CALLS"]), int(env["UBEP_TEST_FAULT_CALL"])
    fault_at = env["UBEP_TEST_FAULT_AT"]
    victim = r in [int(v) for v in env["UBEP_TEST_VICTIMS"].split(",")]
    case = Case(env["UBEP_TEST_ENGINE"], env["UBEP_TEST_SYNC"], env["UBEP_TEST_LAYOUT"], "bf16",
                R, 64, "uniform")
    quorum = env.get("UBEP_TEST_MIN_LIVE_RANKS")
    cfg = case.config(8, on_peer_loss=policy, timeout_s=float(env["UBEP_TEST_TIMEOUT_S"]),
                      min_live_ranks=None if quorum is None else int(quorum))
    rec: dict[str, Any] = {"rank": r, "host": group.host_of[r], "calls": [], "errors": [],
                           "raised": None, "call_s": []}
    buf = Buffer(group, cfg)

    def mask() -> list[int]:
        if policy != "mask":
            return []
        return [q for q, m in enumerate(buf.mask_status()) if m]

    def at_fault(phase: str, call: int) -> None:
        if call == fault_call and phase == fault_at:
            _write(out / f"at.{r}", {"pid": os.getpid()})
            if victim:
                _wait(out / "go", 60.0)

    phase, start = "", 0.0
    try:
        for call in range(calls):
            xs, idxs, ws = make_inputs(case, cfg.num_experts, [8] * R, 7 * call + 1, "uniform")
            at_fault("dispatch", call)
            phase, start = "dispatch", time.monotonic()
            begun = start
            res = buf.dispatch(xs[r], idxs[r], ws[r])
            mask_d = mask()
            at_fault("combine", call)
            phase, start = "combine", time.monotonic()
            y = buf.combine(res.recv_x, res.handle)
            mask_c = mask()
            ref_d = masked_oracle(xs, idxs, ws, mask_d, cfg.num_experts, cfg.layout)
            ref_c = masked_oracle(xs, idxs, ws, mask_c, cfg.num_experts, cfg.layout)
            rec["errors"] += [f"call {call} dispatch (mask {mask_d}): {e}"
                              for e in compare(res, ref_d[r])]
            want = reference.combine([ref.recv_x for ref in ref_c], ref_c)[r]
            if not np.array_equal(bits(y), bits(want)):
                rec["errors"].append(f"call {call}: combine differs (mask {mask_c})")
            rec["calls"].append({"call": call, "mask_dispatch": mask_d, "mask": mask_c})
            rec["call_s"].append(time.monotonic() - begun)  # how long its dispatch + combine took
    except Exception as exc:  # what it raised is the result
        rec["raised"] = {"type": type(exc).__name__, "message": str(exc), "phase": phase,
                         "call": len(rec["calls"]), "elapsed_s": time.monotonic() - start}
    _write(out / f"rec.{r}.json", rec)
    sys.stdout.flush()
    # the job's communicator may hold a dead or cut-off member: no collective teardown, and
    # MPI_Finalize would wait for it; the launcher's daemons remove this rank's files
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
