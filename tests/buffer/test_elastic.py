"""A masking Buffer (``on_peer_loss="mask"``) loses a rank and keeps serving, bit-exact.

The oracle is ``ubep.reference`` given the mask as DeepEP's shrink mode defines it: a masked
rank sends no tokens, and every top-k slot whose expert lives on a masked rank is dropped (-1)
before dispatch; with an expert map, the picks go to the live replicas (``expected``); experts
are the identity (``expert_out = recv_x``), so combine's oracle is the reference combine of the
masked dispatch. It knows nothing of how the Buffer recovers.
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
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from tests._runtime_support import Case, make_inputs
from tests.buffer.test_expert_map_buffer import replicated_map
from ubep import modes, reference
from ubep.buffer import Buffer
from ubep.errors import InvalidArgumentError, RankMaskedError
from ubep.expert_map import ExpertMap, replica_table, route_topk
from ubep.runtime import LostRank, launch
from ubep.runtime.membership import Roster, agree, publish_once
from ubep.runtime.shm import SHM_DIR
from ubep.testing import FIELDS, bits, compare

NUM_RANKS = 4
VICTIM = 3
TOKENS = 24
CALLS = 10
LOSS_AT = 3  # the victim's fault strikes in this call (0-based)
AFTER = 200  # calls the survivors serve after the loss, then the full group after a rejoin
REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Plan:
    """One run: ``calls`` calls, the fault in call LOSS_AT, a new process admitted as the
    victim before call ``join_at`` (None: never), an expert map replicating the victim's
    experts on the survivors (``replicas``).

    ``timeout_s``: a killed rank is found by its pid at once, whatever the deadline; the
    deadline is what a healthy survivor may take between two calls before the others mask it
    (docs/ELASTIC.md, what the deadline trades). The kill runs keep it far above a descheduled
    rank's stall on a loaded host; the stop runs need it short, since they wait it out."""

    calls: int = CALLS
    join_at: int | None = None
    replicas: bool = False
    timeout_s: float = 10.0  # the Buffer's deadline (config)


def victim_map() -> ExpertMap:
    """Six logical experts per rank (8 slots per rank); the victim's six are replicated on the
    two spare slots of each survivor (tests.buffer.test_expert_map_buffer.replicated_map)."""
    return replicated_map(NUM_RANKS, VICTIM)


def masked_oracle(xs: list[np.ndarray], idxs: list[np.ndarray], ws: list[np.ndarray],
                  masked: list[int], num_experts: int, layout: str) -> list[Any]:
    """The reference dispatch of the unmasked ranks' tokens to the unmasked ranks' experts
    (``idxs`` in physical ids)."""
    L = num_experts // len(xs)
    xs2, idxs2, ws2 = [], [], []
    for r, (x, idx, w) in enumerate(zip(xs, idxs, ws, strict=True)):
        keep = slice(0, 0) if r in masked else slice(None)
        lost = (idx >= 0) & np.isin(idx // L, masked)
        xs2.append(x[keep])
        idxs2.append(np.where(lost, -1, idx)[keep])
        ws2.append(w[keep])
    return reference.dispatch(xs2, idxs2, ws2, num_experts, layout=layout)


def expected(inputs: Any, cfg: Any, masked: list[int], issued: bool, topology: Any) -> list[Any]:
    """The oracle of one call under ``masked``. Without a map, a masked rank's experts' picks
    are dropped. With one, the call that saw the loss (``issued``) keeps the routing it was
    issued with (the replicas chosen with no rank masked) minus the masked ranks; every later
    call routes to the live replicas."""
    xs, idxs, ws = inputs
    E, emap = cfg.num_experts, cfg.expert_map
    if emap is None:
        return masked_oracle(xs, idxs, ws, masked, E, cfg.layout)
    if issued:
        hops = topology.hop_matrix()
        phys = [route_topk(idx, replica_table(emap, hops[r], [], E // NUM_RANKS))
                for r, idx in enumerate(idxs)]
        return masked_oracle(xs, phys, ws, masked, E, cfg.layout)
    mask = np.isin(np.arange(NUM_RANKS), masked)
    return reference.dispatch(xs, idxs, ws, E, layout=cfg.layout, expert_map=emap, mask=mask,
                              topology=topology)


def check_call(res: Any, y: np.ndarray, inputs: Any, masks: tuple[list[int], ...], cfg: Any,
               rank: int, topology: Any) -> list[str]:
    """One dispatch and combine of ``rank``, given the mask before the call, after its dispatch
    and after its combine, against the oracle (experts are the identity: ``expert_out =
    recv_x``). With a map holding a replica of every masked expert, once the call that saw the
    loss is over nothing is dropped: every pick is sent, and (expert layout) ``y`` equals the
    unmasked oracle's."""
    before, mask_d, mask_c = masks
    memo: dict[Any, list[Any]] = {}

    def oracle(masked: list[int]) -> list[Any]:
        issued = masked != before and cfg.expert_map is not None  # no map: the same routing
        key = (tuple(masked), issued)
        if key not in memo:
            memo[key] = expected(inputs, cfg, masked, issued, topology)
        return memo[key]

    def combined(refs: list[Any]) -> np.ndarray:
        return reference.combine([ref.recv_x for ref in refs], refs)[rank]

    errors = compare(res, oracle(mask_d)[rank])
    if not np.array_equal(bits(y), bits(combined(oracle(mask_c)))):
        errors.append("combine differs")
    if cfg.expert_map is not None and before == mask_c and mask_c:
        # nothing dropped: every pick of this rank was sent (to a replica) ...
        if not np.array_equal(res.handle.topk_idx >= 0, inputs[1][rank] >= 0):
            errors.append("a pick was dropped")
        # ... and in the expert layout (y = sum of w * expert(x) over the picks) the combine
        # equals the unmasked oracle's
        if cfg.layout == "expert" and not np.array_equal(bits(y), bits(combined(oracle([])))):
            errors.append("combine differs from the unmasked oracle: a pick was dropped")
    return errors


def call_inputs(case: Case, cfg: Any, call: int) -> Any:
    """Every rank's inputs of call ``call`` (seeded: the same in every process), in logical
    expert ids."""
    num = cfg.num_experts if cfg.expert_map is None else cfg.expert_map.num_logical
    return make_inputs(case, num, [TOKENS] * NUM_RANKS, 7 * call + 1, "uniform")


def config(case: Case, plan: Plan) -> Any:
    return case.config(TOKENS, on_peer_loss="mask", timeout_s=plan.timeout_s,
                       expert_map=victim_map() if plan.replicas else None)


def _start_newcomer(group: Any, case: Case, plan: Plan, out: str) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "tests.buffer._rejoin_worker", group.rendezvous,
            str(VICTIM), json.dumps(dataclasses.asdict(case)), json.dumps(
                dataclasses.asdict(plan)), json.dumps(dataclasses.asdict(group.topology)),
            f"{out}.newcomer"]
    return subprocess.Popen(argv, cwd=REPO_ROOT)


def _masked(buf: Any) -> list[int]:
    return [int(r) for r in np.flatnonzero(buf.mask_status())]


def _snapshot(res: Any) -> Any:
    """What :func:`check_call` reads of a dispatch result, copied out of the receive region
    (which a later call reuses)."""
    fields = {f: np.array(getattr(res, f)) for f in FIELDS}
    handle = SimpleNamespace(topk_idx=np.array(res.handle.topk_idx))
    return SimpleNamespace(**fields, handle=handle)


def _kill_when(progress: list[int], call: int, delay_s: float) -> None:
    """SIGKILL this process ``delay_s`` after it enters call ``call``: inside that call or the
    next, wherever that lands in the task graph."""
    def kill() -> None:
        while progress[0] < call:
            time.sleep(1e-4)
        time.sleep(delay_s)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=kill, daemon=True).start()


def _fault(r: int, i: int, fault: str, where: str) -> None:
    """The victim's fault, if it strikes here: ``where`` is "dispatch" (entering call i's
    dispatch), "combine" (entering its combine: its dispatch done, its rows with the peers) or
    "after" (call i's combine returned)."""
    if r != VICTIM:
        return
    if where == "dispatch" and i == LOSS_AT and fault in ("kill_dispatch", "stop"):
        os.kill(os.getpid(), signal.SIGSTOP if fault == "stop" else signal.SIGKILL)
    if where == "combine" and i == LOSS_AT and fault in ("kill_combine", "stop_combine"):
        os.kill(os.getpid(), signal.SIGSTOP if fault == "stop_combine" else signal.SIGKILL)
    if where == "after" and i == LOSS_AT - 1 and fault == "kill_between":
        os.kill(os.getpid(), signal.SIGKILL)


def _serve(group: Any, case: Case, fault: str, out: str, plan: Plan = Plan()) -> Any:
    """``plan.calls`` dispatch + combine pairs; the victim's ``fault`` strikes in call LOSS_AT
    (:func:`_fault`; a stopped victim is woken by rank 0 once the survivors are past the
    loss), or ``kill_anytime``: SIGKILL from a thread a moment into the calls, wherever the
    victim then is. Survivors return their mismatches and masks."""
    cfg = config(case, plan)
    r = group.rank
    errors: list[str] = []
    masks: list[list[int]] = []
    done: list[tuple[int, Any, np.ndarray, tuple[list[int], ...]]] = []
    names: set[str] = set()
    newcomer = None
    with Buffer(group, cfg) as buf:
        progress = [0]
        if r == VICTIM and fault == "kill_anytime":
            _kill_when(progress, LOSS_AT, 1e-3 * modes.SYNCS.index(case.sync))
        for i in range(plan.calls):
            progress[0] = i
            names.update(seg.name for seg in buf._inner._memory.segments)
            if i == plan.join_at:
                newcomer = _start_newcomer(group, case, plan, out) if r == 0 else None
                assert buf.admit([VICTIM], timeout_s=30.0) == (VICTIM,)
            inputs = call_inputs(case, cfg, i)
            xs, idxs, ws = inputs
            before = _masked(buf)
            try:
                _fault(r, i, fault, "dispatch")
                res = buf.dispatch(xs[r], idxs[r], ws[r])
                mask_d = _masked(buf)
                _fault(r, i, fault, "combine")
                y = buf.combine(np.ascontiguousarray(res.recv_x), res.handle)
                _fault(r, i, fault, "after")
            except RankMaskedError:
                return ("masked", i, _masked(buf))
            masks.append(_masked(buf))
            # checked after the loop: between two calls a survivor does nothing the deadline
            # could mistake for a hang
            done.append((i, _snapshot(res), np.array(y), (before, mask_d, masks[-1])))
            if fault.startswith("stop") and i == LOSS_AT + 2:
                if r == 0:
                    os.kill(group.peers[VICTIM].pid, signal.SIGCONT)
                time.sleep(2.5 * cfg.timeout_s)  # the woken rank runs into the old segments
        names.update(seg.name for seg in buf._inner._memory.segments)
        if r == VICTIM:
            time.sleep(30)  # a victim that outran its killer thread dies here
    if newcomer is not None:
        newcomer.wait(60)
    Path(f"{out}.{r}").write_text("\n".join(sorted(names)))
    for i, res, y, seen in done:
        errors += [f"call {i}: {e}" for e in check_call(
            res, y, call_inputs(case, cfg, i), seen, cfg, r, group.topology)]
    return errors, masks


def _segments_gone(out: str, rebuilds: list[int]) -> None:
    """Every segment a survivor mapped is gone from /dev/shm. ``rebuilds``: the members of each
    Buffer the survivors built, in order; a healthy rank descheduled past the deadline on a
    loaded host makes the survivors agree once more over the same members (new segments, the
    same mask), so a membership may repeat."""
    names = {n for r in range(VICTIM) for n in Path(f"{out}.{r}").read_text().split()}
    assert len(names) >= sum(rebuilds), (len(names), rebuilds)
    assert not [n for n in names if os.path.exists(os.path.join(SHM_DIR, n))]


# a few representative modes for the long runs (every engine, sync and layout at least once
# with the stop test's asp-sp-expert; the fault before a dispatch, with a map, is the stop).
# The default run takes each fault, engine and layout once and the map once; the other two run
# with ``pytest -m matrix``.
LONG_RUNS = [
    ("kill_dispatch", Case("asp", "sw", "expert", "bf16", NUM_RANKS, 256, "uniform"), False),
    ("kill_combine", Case("bsp", "tff", "rank", "bf16", NUM_RANKS, 256, "uniform"), False),
    ("kill_combine", Case("asp", "sw", "expert", "bf16", NUM_RANKS, 256, "uniform"), True),
    ("kill_between", Case("bsp", "dc", "expert", "bf16", NUM_RANKS, 128, "uniform"), True),
    ("kill_between", Case("asp", "dc", "rank", "fp16", NUM_RANKS, 128, "uniform"), False),
]
_LONG_MATRIX = {2, 4}  # indices of LONG_RUNS under the matrix marker


@pytest.mark.parametrize("fault, case, replicas", [
    pytest.param(f, c, m, id=f"{f}-{c.engine}-{c.sync}-{c.layout}{'-map' * m}",
                 marks=(pytest.mark.matrix,) if i in _LONG_MATRIX else ())
    for i, (f, c, m) in enumerate(LONG_RUNS)])
def test_survivors_serve_on_bit_exact_then_a_replacement_rejoins(
        tmp_path: Path, fault: str, case: Case, replicas: bool) -> None:
    """The victim is killed; the survivors serve AFTER calls bit-exact against the oracle with
    the mask (with a map: the unmasked oracle's combine, nothing dropped), every survivor with
    the same mask; then a new process takes the victim's place and AFTER calls over the full
    group are bit-exact; no segment is left."""
    out = str(tmp_path / "segments")
    join_at = LOSS_AT + AFTER
    plan = Plan(calls=join_at + AFTER, join_at=join_at, replicas=replicas)
    results = launch(_serve, NUM_RANKS, case, fault, out, plan, timeout_s=600,
                     keep_survivors=True)
    lost = results[VICTIM]
    assert isinstance(lost, LostRank) and lost.exitcode == -signal.SIGKILL
    for r in range(VICTIM):
        errors, masks = results[r]
        assert errors == [], (r, errors[:3])
        assert masks == [[]] * LOSS_AT + [[VICTIM]] * AFTER + [[]] * AFTER
    newcomer = json.loads(Path(f"{out}.newcomer").read_text())
    assert newcomer["errors"] == [] and newcomer["masks"] == [[]]
    assert newcomer["calls"] == AFTER
    _segments_gone(out, [NUM_RANKS, VICTIM, NUM_RANKS])  # before, masked, rejoined


def _every_mode() -> list[Any]:
    """Every engine x sync x layout. The default run takes each engine x sync once with the
    layouts in turn; the other half runs with ``pytest -m matrix`` (the whole matrix)."""
    out = []
    for i, e in enumerate(modes.ENGINES):
        for j, s in enumerate(modes.SYNCS):
            for k, lay in enumerate(modes.LAYOUTS):
                marks = () if k == (i + j) % 2 else (pytest.mark.matrix,)
                out.append(pytest.param(Case(e, s, lay, "bf16", NUM_RANKS, 256, "uniform"),
                                        marks=marks, id=f"{e}-{s}-{lay}"))
    return out


@pytest.mark.parametrize("case", _every_mode())
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
    _segments_gone(out, [NUM_RANKS, VICTIM])


@pytest.mark.parametrize("replicas", [pytest.param(False, marks=pytest.mark.matrix), True],
                         ids=["plain", "map"])
def test_a_stopped_rank_wakes_masked_and_never_reaches_the_survivors(
        tmp_path: Path, replicas: bool) -> None:
    case = Case("asp", "sp", "expert", "bf16", NUM_RANKS, 256, "uniform")
    plan = Plan(calls=LOSS_AT + AFTER, replicas=replicas, timeout_s=1.0)
    out = str(tmp_path / "s")
    results = launch(_serve, NUM_RANKS, case, "stop", out, plan, timeout_s=600,
                     keep_survivors=True)
    assert results[VICTIM] == ("masked", LOSS_AT, [VICTIM])
    for r in range(VICTIM):
        errors, masks = results[r]
        assert errors == [], (r, errors[:3])
        assert masks == [[]] * LOSS_AT + [[VICTIM]] * AFTER
    _segments_gone(out, [NUM_RANKS, VICTIM])


def _stop_cases() -> list[Any]:
    """Every engine x sync once, the layouts and the two stop points taken in turn. The default
    run takes each sync once (both engines, layouts and stop points twice each); the other
    half runs with ``pytest -m matrix``."""
    out = []
    for n, (e, s) in enumerate((e, s) for e in modes.ENGINES for s in modes.SYNCS):
        fault = ("stop", "stop_combine")[(n // 2) % 2]
        case = Case(e, s, modes.LAYOUTS[n % 2], "bf16", NUM_RANKS, 256, "uniform")
        marks = () if n // len(modes.SYNCS) == (n % len(modes.SYNCS)) % 2 else (pytest.mark.matrix,)
        out.append(pytest.param(fault, case, marks=marks, id=f"{fault}-{e}-{s}-{case.layout}"))
    return out


@pytest.mark.parametrize("fault, case", _stop_cases())
def test_a_stopped_rank_wakes_masked_under_every_engine_and_sync(
        tmp_path: Path, fault: str, case: Case) -> None:
    """SIGSTOP past the deadline before a dispatch, or between a dispatch and its combine (its
    rows already with the peers, its combine still to write), then SIGCONT: the woken rank
    raises RankMaskedError, and the survivors' calls after the loss, bit-exact against the
    masked oracle, show nothing it wrote after waking."""
    plan = Plan(calls=LOSS_AT + 6, timeout_s=1.0)
    out = str(tmp_path / "s")
    results = launch(_serve, NUM_RANKS, case, fault, out, plan, timeout_s=300,
                     keep_survivors=True)
    assert results[VICTIM] == ("masked", LOSS_AT, [VICTIM])
    for r in range(VICTIM):
        errors, masks = results[r]
        assert errors == [], (r, errors[:3])
        assert masks == [[]] * LOSS_AT + [[VICTIM]] * 6
    _segments_gone(out, [NUM_RANKS, VICTIM])


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
