"""A masking Buffer (``on_peer_loss="mask"``) loses a rank and keeps serving, bit-exact.

The oracle is ``ubep.reference`` given the mask as DeepEP's shrink mode defines it: a masked
rank sends no tokens, and every top-k slot whose expert lives on a masked rank is dropped (-1)
before dispatch; experts are the identity (``expert_out = recv_x``), so combine's oracle is the
reference combine of the masked dispatch. It knows nothing of how the Buffer recovers.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests._runtime_support import Case, make_inputs
from ubep import modes, reference
from ubep.buffer import Buffer
from ubep.errors import InvalidArgumentError, RankMaskedError
from ubep.runtime import LostRank, launch
from ubep.runtime.membership import Roster, agree, publish_once
from ubep.runtime.shm import SHM_DIR
from ubep.testing import bits, compare

NUM_RANKS = 4
VICTIM = 3
TOKENS = 24
CALLS = 10
LOSS_AT = 3  # the victim's fault strikes in this call (0-based)
JOIN_AT = 6  # a new process takes the victim's place before this call
REPO_ROOT = Path(__file__).resolve().parents[2]


def masked_oracle(xs: list[np.ndarray], idxs: list[np.ndarray], ws: list[np.ndarray],
                  masked: list[int], num_experts: int, layout: str) -> list[Any]:
    """The reference dispatch of the unmasked ranks' tokens to the unmasked ranks' experts."""
    L = num_experts // len(xs)
    xs2, idxs2, ws2 = [], [], []
    for r, (x, idx, w) in enumerate(zip(xs, idxs, ws, strict=True)):
        keep = slice(0, 0) if r in masked else slice(None)
        lost = (idx >= 0) & np.isin(idx // L, masked)
        xs2.append(x[keep])
        idxs2.append(np.where(lost, -1, idx)[keep])
        ws2.append(w[keep])
    return reference.dispatch(xs2, idxs2, ws2, num_experts, layout=layout)


def check_pair(res: Any, y: np.ndarray, inputs: Any, masks: tuple[list[int], list[int]],
           cfg: Any, rank: int) -> list[str]:
    xs, idxs, ws = inputs
    mask_d, mask_c = masks
    errors = compare(res, masked_oracle(xs, idxs, ws, mask_d, cfg.num_experts, cfg.layout)[rank])
    refs = masked_oracle(xs, idxs, ws, mask_c, cfg.num_experts, cfg.layout)
    y_ref = reference.combine([ref.recv_x for ref in refs], refs)[rank]
    if not np.array_equal(bits(y), bits(y_ref)):
        errors.append("combine differs")
    return errors


def call_inputs(case: Case, cfg: Any, call: int) -> Any:
    """Every rank's inputs of call ``call`` (seeded: the same in every process)."""
    return make_inputs(case, cfg.num_experts, [TOKENS] * NUM_RANKS, 7 * call + 1, "uniform")


def _start_newcomer(group: Any, case: Case, out: str) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "tests.buffer._rejoin_worker", group.rendezvous,
            str(VICTIM), json.dumps(dataclasses.asdict(case)), str(JOIN_AT), f"{out}.newcomer"]
    return subprocess.Popen(argv, cwd=REPO_ROOT)


def _masked(buf: Any) -> list[int]:
    return [int(r) for r in np.flatnonzero(buf.mask_status())]


def _kill_when(progress: list[int], call: int, delay_s: float) -> None:
    """SIGKILL this process ``delay_s`` after it enters call ``call``: inside that call or the
    next, wherever that lands in the task graph."""
    def kill() -> None:
        while progress[0] < call:
            time.sleep(1e-4)
        time.sleep(delay_s)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=kill, daemon=True).start()


def _serve(group: Any, case: Case, fault: str, out: str) -> Any:
    """CALLS dispatch + combine pairs; the victim's ``fault`` strikes in call LOSS_AT: killed
    before its dispatch, killed before its combine, or stopped before its dispatch (rank 0 wakes
    it once the survivors are past the loss); or ``kill_anytime``: SIGKILL from a thread a
    moment into the calls, wherever the victim then is (inside a dispatch or a combine, between
    them, while survivors are one call apart). Survivors return their mismatches and masks."""
    cfg = case.config(TOKENS, on_peer_loss="mask", timeout_s=1.0)
    r = group.rank
    errors: list[str] = []
    masks: list[list[int]] = []
    names: set[str] = set()
    with Buffer(group, cfg) as buf:
        progress = [0]
        if r == VICTIM and fault == "kill_anytime":
            _kill_when(progress, LOSS_AT, 1e-3 * modes.SYNCS.index(case.sync))
        for i in range(CALLS):
            progress[0] = i
            names.update(seg.name for seg in buf._inner._segments)
            if fault == "rejoin" and i == JOIN_AT:
                newcomer = _start_newcomer(group, case, out) if r == 0 else None
                assert buf.admit([VICTIM], timeout_s=30.0) == (VICTIM,)
            inputs = call_inputs(case, cfg, i)
            xs, idxs, ws = inputs
            if r == VICTIM and i == LOSS_AT and fault in ("kill_dispatch", "stop", "rejoin"):
                os.kill(os.getpid(), signal.SIGSTOP if fault == "stop" else signal.SIGKILL)
            try:
                res = buf.dispatch(xs[r], idxs[r], ws[r])
                mask_d = _masked(buf)
                if r == VICTIM and i == LOSS_AT and fault == "kill_combine":
                    os.kill(os.getpid(), signal.SIGKILL)
                y = buf.combine(np.ascontiguousarray(res.recv_x), res.handle)
            except RankMaskedError:
                return ("masked", i, _masked(buf))
            masks.append(_masked(buf))
            errors += [f"call {i}: {e}" for e in check_pair(res, y, inputs, (mask_d, masks[-1]),
                                                         cfg, r)]
            if fault == "stop" and i == LOSS_AT + 2:
                if r == 0:
                    os.kill(group.peers[VICTIM].pid, signal.SIGCONT)
                time.sleep(2.5 * cfg.timeout_s)  # the woken rank runs into the old segments
        names.update(seg.name for seg in buf._inner._segments)
        if r == VICTIM:
            time.sleep(30)  # a victim that outran its killer thread dies here
    if fault == "rejoin" and r == 0:
        assert newcomer is not None
        newcomer.wait(60)
    Path(f"{out}.{r}").write_text("\n".join(sorted(names)))
    return errors, masks


CASES = [
    Case("asp", "sw", "expert", "bf16", NUM_RANKS, 256, "uniform"),
    Case("bsp", "tff", "rank", "bf16", NUM_RANKS, 256, "uniform"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.engine}-{c.sync}-{c.layout}")
@pytest.mark.parametrize("fault", ["kill_dispatch", "kill_combine"])
def test_survivors_mask_a_killed_rank_and_stay_bit_exact(tmp_path: Path, case: Case,
                                                          fault: str) -> None:
    out = str(tmp_path / "segments")
    results = launch(_serve, NUM_RANKS, case, fault, out, timeout_s=120, keep_survivors=True)
    lost = results[VICTIM]
    assert isinstance(lost, LostRank) and lost.exitcode == -signal.SIGKILL
    for r in range(VICTIM):
        errors, masks = results[r]
        assert errors == [], (r, errors[:3])
        assert masks[:LOSS_AT] == [[]] * LOSS_AT
        assert masks[LOSS_AT:] == [[VICTIM]] * (CALLS - LOSS_AT)
    names = {n for r in range(VICTIM) for n in Path(f"{out}.{r}").read_text().split()}
    assert len(names) == NUM_RANKS + VICTIM  # the first Buffer's segments, then the members'
    assert not [n for n in names if os.path.exists(os.path.join(SHM_DIR, n))]


def _every_mode() -> list[Case]:
    return [Case(e, s, lay, "bf16", NUM_RANKS, 256, "uniform")
            for e in modes.ENGINES for s in modes.SYNCS for lay in modes.LAYOUTS]


@pytest.mark.parametrize("case", _every_mode(), ids=lambda c: f"{c.engine}-{c.sync}-{c.layout}")
def test_a_rank_killed_mid_call_is_masked_under_every_mode(tmp_path: Path, case: Case) -> None:
    out = str(tmp_path / "segments")
    results = launch(_serve, NUM_RANKS, case, "kill_anytime", out, timeout_s=120,
                     keep_survivors=True)
    assert isinstance(results[VICTIM], LostRank)
    seen = []
    for r in range(VICTIM):
        errors, masks = results[r]
        assert errors == [], (r, errors[:3])
        # unmasked until the loss, masked from then on
        lost_from = next((i for i, m in enumerate(masks) if m), len(masks))
        assert masks == [[]] * lost_from + [[VICTIM]] * (CALLS - lost_from), masks
        seen.append(lost_from)
    # a survivor may finish the call the loss struck in (unmasked) while another redoes it
    assert max(seen) - min(seen) <= 1, seen


def test_a_stopped_rank_wakes_masked_and_never_reaches_the_survivors(tmp_path: Path) -> None:
    case = Case("asp", "sp", "expert", "bf16", NUM_RANKS, 256, "uniform")
    results = launch(_serve, NUM_RANKS, case, "stop", str(tmp_path / "s"), timeout_s=120,
                     keep_survivors=True)
    assert results[VICTIM] == ("masked", LOSS_AT, [VICTIM])
    for r in range(VICTIM):
        errors, masks = results[r]
        assert errors == [], (r, errors[:3])
        assert masks[LOSS_AT:] == [[VICTIM]] * (CALLS - LOSS_AT)


def test_a_new_process_rejoins_as_the_lost_rank_and_calls_run_over_all_again(
        tmp_path: Path) -> None:
    case = Case("asp", "tff", "expert", "bf16", NUM_RANKS, 256, "uniform")
    out = str(tmp_path / "segments")
    results = launch(_serve, NUM_RANKS, case, "rejoin", out, timeout_s=120, keep_survivors=True)
    assert isinstance(results[VICTIM], LostRank)
    for r in range(VICTIM):
        errors, masks = results[r]
        assert errors == [], (r, errors[:3])
        assert masks == [[]] * LOSS_AT + [[VICTIM]] * (JOIN_AT - LOSS_AT) + [[]] * (
            CALLS - JOIN_AT)
    newcomer = json.loads(Path(f"{out}.newcomer").read_text())
    assert newcomer["errors"] == [] and newcomer["masks"] == [[]]
    names = {n for r in range(VICTIM) for n in Path(f"{out}.{r}").read_text().split()}
    assert len(names) == NUM_RANKS + VICTIM + NUM_RANKS  # before, masked, rejoined
    assert not [n for n in names if os.path.exists(os.path.join(SHM_DIR, n))]


def _agree_without(group: Any, absent: int) -> Any:
    if group.rank == absent:
        time.sleep(1.5)  # alive but silent past the deadline, then late
    decision = agree(Roster.of(group), "t", {"rank": group.rank}, 0.5)
    return decision.members, decision.masked, decision.states


def test_agreement_is_one_decision_and_a_late_rank_reads_itself_masked() -> None:
    results = launch(_agree_without, 3, 1, timeout_s=60)
    assert results[0] == results[1] == results[2]
    members, masked, states = results[0]
    assert members == (0, 2) and masked == (1,)
    assert states == ({"rank": 0}, {"rank": 2})


def test_the_first_published_decision_wins(tmp_path: Path) -> None:
    path = str(tmp_path / "decision.json")
    publish_once(path, {"members": [0, 1]})
    publish_once(path, {"members": [0]})
    assert Path(path).read_text() == '{"members": [0, 1]}'
    assert sorted(os.listdir(tmp_path)) == ["decision.json"]  # no temporary file left


def _refused_without_a_ubep_group(group: Any) -> str:
    class Foreign:  # any other ProcessGroup (a torch or MPI group in practice)
        rank, num_ranks, topology = group.rank, group.num_ranks, group.topology

    cfg = Case("asp", "sw", "expert", "bf16", 1, 64, "uniform").config(4, on_peer_loss="mask")
    try:
        Buffer(Foreign(), cfg)
    except InvalidArgumentError as exc:
        return exc.argument
    return "built"


def test_masking_needs_a_group_whose_control_plane_outlives_a_process() -> None:
    assert launch(_refused_without_a_ubep_group, 1, timeout_s=60) == ["on_peer_loss"]
