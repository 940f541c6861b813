"""A masking Buffer's split-phase calls and masking on request, against the masked oracle.

Split-phase calls (``return_recv_hook=True``) are not replayed after a loss: every survivor
raises ``CallLostError`` for the call the loss struck, the mask is the same on every survivor,
and the next calls are bit-exact over the members. ``mask_ranks`` masks a rank the application
names, through the same agreement; the masked process can rejoin.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import numpy as np
import pytest

from tests._runtime_support import Case
from tests.buffer.test_elastic import (
    LOSS_AT,
    NUM_RANKS,
    VICTIM,
    Plan,
    call_inputs,
    check_call,
    config,
)
from ubep.buffer import Buffer
from ubep.errors import CallLostError, InvalidArgumentError, RankMaskedError
from ubep.runtime import LostRank, launch

AFTER_SPLIT = 40  # split-phase calls the survivors serve after the loss


def _masked(buf: Any) -> list[int]:
    return [int(r) for r in np.flatnonzero(buf.mask_status())]


def _split_calls(group: Any, case: Case, fault: str, replicas: bool) -> Any:
    """Dispatch and combine with hooks; the victim is killed entering call LOSS_AT's dispatch
    or combine. Survivors return the calls that raised CallLostError, their masks and their
    mismatches."""
    plan = Plan(calls=LOSS_AT + 1 + AFTER_SPLIT, replicas=replicas)
    cfg = config(case, plan)
    r = group.rank
    errors: list[str] = []
    lost: list[int] = []
    masks: list[list[int]] = []
    with Buffer(group, cfg) as buf:
        for i in range(plan.calls):
            inputs = call_inputs(case, cfg, i)
            xs, idxs, ws = inputs
            before = _masked(buf)
            try:
                if r == VICTIM and i == LOSS_AT and fault == "dispatch":
                    os.kill(os.getpid(), signal.SIGKILL)
                res = buf.dispatch(xs[r], idxs[r], ws[r], return_recv_hook=True).hook()
                mask_d = _masked(buf)
                if r == VICTIM and i == LOSS_AT and fault == "combine":
                    os.kill(os.getpid(), signal.SIGKILL)
                pending = buf.combine(np.ascontiguousarray(res.recv_x), res.handle,
                                      return_recv_hook=True)
                y = pending.hook()
            except CallLostError:
                lost.append(i)
                masks.append(_masked(buf))
                continue
            masks.append(_masked(buf))
            errors += [f"call {i}: {e}" for e in check_call(
                res, y, inputs, (before, mask_d, masks[-1]), cfg, r, group.topology)]
    return lost, masks, errors


@pytest.mark.parametrize("fault, case, replicas", [
    ("dispatch", Case("asp", "tff", "expert", "bf16", NUM_RANKS, 256, "uniform"), False),
    ("combine", Case("bsp", "sw", "rank", "bf16", NUM_RANKS, 256, "uniform"), True),
], ids=["dispatch-asp-tff-expert", "combine-bsp-sw-rank-map"])
def test_a_loss_in_an_open_split_phase_call_raises_on_every_survivor_then_serves_on(
        fault: str, case: Case, replicas: bool) -> None:
    results = launch(_split_calls, NUM_RANKS, case, fault, replicas, timeout_s=300,
                     keep_survivors=True)
    assert isinstance(results[VICTIM], LostRank)
    for r in range(VICTIM):
        lost, masks, errors = results[r]
        assert lost == [LOSS_AT], (r, lost)
        assert masks == [[]] * LOSS_AT + [[VICTIM]] * (1 + AFTER_SPLIT)
        assert errors == [], (r, errors[:3])


MASK_AT = 2  # the application masks rank MASKED before this call
MASKED = 1
REJOIN_AT = 6  # ... and lets it back in before this one
CALLS = 9


def _mask_on_request(group: Any, case: Case) -> Any:
    cfg = config(case, Plan())
    r = group.rank
    errors: list[str] = []
    masks: list[list[int]] = []
    buf = Buffer(group, cfg)
    i = 0
    while i < CALLS:
        if i == MASK_AT:
            try:
                buf.mask_ranks("1")  # refused on every rank alike: not a sequence of ranks
            except InvalidArgumentError as exc:
                assert exc.argument == "ranks"
            # only rank 0 names the bad rank: the union is masked on every member
            status = buf.mask_ranks([MASKED] if r == 0 else [])
            masks.append([int(q) for q in np.flatnonzero(status)])
        if i == REJOIN_AT and r != MASKED:
            assert buf.admit([MASKED], timeout_s=30.0) == (MASKED,)
        inputs = call_inputs(case, cfg, i)
        xs, idxs, ws = inputs
        before = _masked(buf)
        try:
            res = buf.dispatch(xs[r], idxs[r], ws[r])
            mask_d = _masked(buf)
            y = buf.combine(np.ascontiguousarray(res.recv_x), res.handle)
        except RankMaskedError:
            assert r == MASKED and i == MASK_AT
            buf.close()
            # the same process comes back as a newcomer (DeepEP: clean the mask buffer)
            assert buf.rendezvous == group.rendezvous
            buf = Buffer.rejoin(buf.rendezvous, MASKED, cfg, timeout_s=60.0)
            i = REJOIN_AT
            masks.append(_masked(buf))
            continue
        masks.append(_masked(buf))
        errors += [f"call {i}: {e}" for e in check_call(
            res, y, inputs, (before, mask_d, masks[-1]), cfg, r, group.topology)]
        i += 1
    buf.close()
    return masks, errors


def test_mask_ranks_masks_a_rank_on_request_on_every_member_and_it_can_rejoin() -> None:
    case = Case("asp", "sw", "expert", "bf16", NUM_RANKS, 256, "uniform")
    results = launch(_mask_on_request, NUM_RANKS, case, timeout_s=300)
    for r in range(NUM_RANKS):
        masks, errors = results[r]
        assert errors == [], (r, errors[:3])
        if r == MASKED:  # told it is masked, then a member again after rejoining
            assert masks == [[]] * MASK_AT + [[MASKED], []] + [[]] * (CALLS - REJOIN_AT)
        else:
            assert masks == ([[]] * MASK_AT + [[MASKED]] * (1 + REJOIN_AT - MASK_AT)
                             + [[]] * (CALLS - REJOIN_AT))
