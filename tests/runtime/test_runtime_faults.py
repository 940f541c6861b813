"""Faults: bad input on one rank, a rank that never shows up, a rank killed mid-operation.

Bad input must raise ``InvalidArgumentError`` on the offending rank before anything reaches a
peer, ``RemoteError`` on every other rank, and leave the Buffer usable for the next call. A dead
peer must surface as ``PeerLostError`` on every survivor within 5 s and leave no segment behind.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests._runtime_support import Case, bits, compare, kill_self_later, make_inputs
from ubep import reference
from ubep.buffer import Buffer
from ubep.errors import (
    InvalidArgumentError,
    OutOfStepError,
    RankFailedError,
    RemoteError,
    TimeoutError,
)
from ubep.runtime import launch
from ubep.runtime.shm import SHM_DIR, Segment

CASE = Case("asp", "sp", "expert", "bf16", 2, 256, "uniform")


def _outcome(fn: Any) -> tuple[str, Any]:
    try:
        fn()
    except InvalidArgumentError as exc:
        return ("InvalidArgumentError", exc.argument)
    except RemoteError as exc:
        return ("RemoteError", exc.rank)
    return ("ok", None)


def _good_call(buf: Buffer, group: Any, seed: int) -> bool:
    cfg = buf.config
    xs, idxs, ws = make_inputs(CASE, cfg.num_experts, [16, 16], seed, "uniform")
    r = group.rank
    res = buf.dispatch(xs[r], idxs[r], ws[r])
    refs = reference.dispatch(xs, idxs, ws, cfg.num_experts, layout=cfg.layout)
    y = buf.combine(res.recv_x, res.handle)
    y_ref = reference.combine([ref.recv_x for ref in refs], refs)[r]
    return not compare(res, refs[r]) and bool(np.array_equal(bits(y), bits(y_ref)))


def _worker_bad_input(group: Any) -> dict[str, Any]:
    cfg = CASE.config(16)
    r = group.rank
    log: dict[str, Any] = {}
    with Buffer(group, cfg) as buf:
        log["good0"] = _good_call(buf, group, 1)
        xs, idxs, ws = make_inputs(CASE, cfg.num_experts, [16, 16], 2, "uniform")

        def call(x: Any = None, idx: Any = None, w: Any = None) -> None:
            buf.dispatch(xs[r] if x is None else x, idxs[r] if idx is None else idx,
                         ws[r] if w is None else w)

        # 1. rank 1: expert id out of range (found by the native validation)
        bad = idxs[1].copy()
        bad[3, 1] = cfg.num_experts + 5
        sentinel = np.uint16(0x7FA5)
        lay = buf.layout
        # the region the rejected call would land in: no call has used it yet (SP rows land in
        # recv_x itself, one region per dispatch index mod num_regions)
        off = lay.off_land + (buf._num_dispatches % lay.num_land_regions) * lay.land_bytes
        land = buf._memory.segments[r].array[off: off + lay.land_bytes]
        slots = land[: lay.cap_rows * lay.slot_bytes].reshape(lay.cap_rows, lay.slot_bytes)
        log["range"] = _outcome(lambda: call(idx=bad if r == 1 else None))
        # nothing reached this rank's landing slots: every slot still holds only the sentinel
        payload = np.ascontiguousarray(slots[:, : lay.row_bytes]).view(np.uint16)
        log["untouched"] = bool((payload == sentinel).all())
        log["good1"] = _good_call(buf, group, 3)
        # 2. rank 0: wrong dtype (Python-side validation)
        log["dtype"] = _outcome(lambda: call(x=xs[0].astype(np.float32) if r == 0 else None))
        # 3. rank 1: more tokens than max_tokens_per_rank
        big = np.zeros((17, cfg.hidden), np.uint16)
        log["too_many"] = _outcome(lambda: call(
            x=big if r == 1 else None, idx=np.zeros((17, 4), np.int64) - 1 if r == 1 else None,
            w=np.zeros((17, 4), np.float32) if r == 1 else None))
        # 4. rank 0: the SP sentinel in the part of a row the receiver polls (its tail)
        poisoned = xs[0].copy()
        poisoned[5, -1] = sentinel
        log["sentinel"] = _outcome(lambda: call(x=poisoned if r == 0 else None))
        # 5. rank 1: the same expert twice in one row
        dup = idxs[1].copy()
        dup[2, :2] = 3
        log["dup"] = _outcome(lambda: call(idx=dup if r == 1 else None))
        # 6. both ranks bad at once
        log["both"] = _outcome(lambda: call(w=ws[r].astype(np.float64)))
        log["good2"] = _good_call(buf, group, 4)
        # 7. combine: rank 1 passes expert outputs of the wrong shape
        res = buf.dispatch(xs[r], idxs[r], ws[r])
        eo = np.zeros((res.recv_x.shape[0] + 1, cfg.hidden), np.uint16) if r == 1 else res.recv_x
        log["combine"] = _outcome(lambda: buf.combine(eo, res.handle))
        log["good3"] = _good_call(buf, group, 5)
    return log


def test_bad_input_fails_every_rank_and_next_call_works() -> None:
    logs = launch(_worker_bad_input, 2, timeout_s=300)
    expect = {  # step: (offending ranks, argument)
        "range": ({1}, "topk_idx"), "dtype": ({0}, "x"), "too_many": ({1}, "x"),
        "sentinel": ({0}, "x"), "dup": ({1}, "topk_idx"), "both": ({0, 1}, "topk_weights"),
        "combine": ({1}, "expert_out"),
    }
    for step, (offenders, argument) in expect.items():
        for r, log in enumerate(logs):
            if r in offenders:
                assert log[step] == ("InvalidArgumentError", argument), (step, r, log[step])
            else:
                assert log[step] == ("RemoteError", min(offenders)), (step, r, log[step])
    for log in logs:
        assert all(log[f"good{i}"] for i in range(4)), log
        assert log["untouched"], "a rejected call wrote into a peer's receive region"


def _worker_absent(group: Any) -> tuple[str, str, str, bool]:
    cfg = CASE.config(16, timeout_s=1.0)
    with Buffer(group, cfg) as buf:
        xs, idxs, ws = make_inputs(CASE, cfg.num_experts, [16, 16], 7, "uniform")
        r = group.rank
        first = second = ""
        if r == 1:
            time.sleep(2.5)  # miss rank 0's deadline
        try:
            buf.dispatch(xs[r], idxs[r], ws[r])
            first = "ok"
        except (TimeoutError, RemoteError) as exc:
            first = f"{type(exc).__name__}: {exc}"
        # out of step now: refused (no wrong data, no hang) until every rank resyncs
        try:
            buf.dispatch(xs[r], idxs[r], ws[r])
            second = "ok"
        except OutOfStepError:
            second = "OutOfStepError"
        buf.resync(30)
        ok = _good_call(buf, group, 8)
        return first, second, str(r), ok


def test_missing_peer_times_out_naming_rank_and_core_then_recovers() -> None:
    (first0, second0, _, ok0), (first1, second1, _, ok1) = launch(_worker_absent, 2,
                                                                  timeout_s=120)
    assert first0.startswith("TimeoutError") and "rank 0 core 0" in first0 and "rank 1" in first0
    # the late rank finds rank 0's notice for that call instead of hanging
    assert first1.startswith("RemoteError"), first1
    assert second0 == second1 == "OutOfStepError"
    assert ok0 and ok1


def _worker_killed(group: Any, stamp: str) -> tuple[str, float]:
    cfg = Case("asp", "sp", "rank", "bf16", 3, 2048, "uniform").config(64)
    with Buffer(group, cfg) as buf:
        names = [seg.name for seg in buf._memory.segments]  # every rank's segment, as mapped here
        Path(f"{stamp}.names").write_text("\n".join(names))
        xs, idxs, ws = make_inputs(Case("asp", "sp", "rank", "bf16", 3, 2048, "uniform"),
                                   cfg.num_experts, [64, 64, 64], 9, "uniform")
        r = group.rank
        if r == 2:
            kill_self_later(0.5, stamp)
        try:
            for _ in range(1_000_000):
                res = buf.dispatch(xs[r], idxs[r], ws[r])
                buf.combine(res.recv_x, res.handle)
        except Exception as exc:
            return type(exc).__name__, time.monotonic()
    return "no error", time.monotonic()


def test_killed_peer_is_lost_on_every_survivor_within_5s(tmp_path: Path) -> None:
    stamp = tmp_path / "killed_at"
    with pytest.raises(RankFailedError) as info:
        launch(_worker_killed, 3, str(stamp), timeout_s=120)
    err = info.value
    assert err.rank == 2 and err.exitcode == -signal.SIGKILL
    killed_at = float(stamp.read_text())
    assert sorted(err.results) == [0, 1]
    for rank, (kind, seen_at) in err.results.items():
        assert kind == "PeerLostError", (rank, kind)
        assert 0 <= seen_at - killed_at < 5.0, (rank, seen_at - killed_at)
    names = Path(f"{stamp}.names").read_text().split()
    assert len(names) == 3
    assert not [n for n in names if os.path.exists(os.path.join(SHM_DIR, n))]


def _worker_die_before_unlink(group: Any, out: str) -> None:
    if group.rank == 1:
        seg = Segment.create(4096, group_id=group.group_id, owner_rank=1, kind="buffer",
                             marker_dir=group.rendezvous)
        Path(out).write_text(seg.name)
        os.kill(os.getpid(), signal.SIGKILL)
    group.barrier(30)


def test_segments_of_a_rank_killed_during_setup_are_removed(tmp_path: Path) -> None:
    out = tmp_path / "name"
    with pytest.raises(RankFailedError):
        launch(_worker_die_before_unlink, 2, str(out), timeout_s=60)
    assert not os.path.exists(os.path.join(SHM_DIR, out.read_text()))


_ENV_RANK = """
from ubep.runtime import group_from_env
group_from_env(timeout_s=60).close()
"""


def test_env_launch_rank_killed_at_the_rendezvous_leaves_no_segment(tmp_path: Path) -> None:
    """group_from_env: rank 1 is SIGKILLed while it waits at the rendezvous with its group
    segment still named. Rank 0 arriving later sees it dead (PeerLostError, not a 60 s timeout)
    and removes the dead rank's segment as well as its own."""
    import subprocess
    import sys

    rdv = tmp_path / "rdv"
    rdv.mkdir(mode=0o700)

    def start(rank: int) -> subprocess.Popen[str]:
        env = dict(os.environ, UBEP_RANK=str(rank), UBEP_WORLD_SIZE="2", UBEP_RENDEZVOUS=str(rdv))
        return subprocess.Popen([sys.executable, "-c", _ENV_RANK], env=env, text=True,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    victim = start(1)
    deadline = time.monotonic() + 60
    while not (rdv / "hello.1.json").exists():
        assert time.monotonic() < deadline and victim.poll() is None
        time.sleep(0.02)
    victim.kill()
    victim.wait(10)
    # (the victim's own reaper may already have removed the segment; its marker stays)
    names = [e.name.split(".", 1)[1] for e in rdv.glob("segment.*")]
    assert len(names) == 1
    t0 = time.monotonic()
    survivor = start(0)
    _, stderr = survivor.communicate(timeout=90)
    assert survivor.returncode != 0 and "PeerLostError" in stderr, stderr[-2000:]
    assert time.monotonic() - t0 < 20  # seen dead, not waited for until the 60 s deadline
    names += [e.name.split(".", 1)[1] for e in rdv.glob("segment.*")]
    assert not [n for n in names if os.path.exists(os.path.join(SHM_DIR, n))]
    assert not list(rdv.glob("segment.*"))  # the survivor's own marker went with its segment


def _worker_mismatch_rejected_cleanly(group: Any) -> tuple[list[str], list[bool]]:
    cfg = CASE.config(16)
    r = group.rank
    seen: list[str] = []
    with Buffer(group, cfg) as buf:
        xs, idxs, ws = make_inputs(CASE, cfg.num_experts, [16, 16], 11, "uniform")
        for _ in range(2):  # rank 1 combines without a handle while rank 0 dispatches
            seen.append(_outcome(lambda: buf.combine(np.zeros((1, cfg.hidden), np.uint16), None)
                                 if r == 1 else buf.dispatch(xs[r], idxs[r], ws[r]))[0])
        # both were clean rejects: still in step, no resync needed, and the next calls are right
        good = [_good_call(buf, group, seed) for seed in (12, 13)]
    return seen, good


def test_mismatched_calls_rejected_cleanly_leave_the_buffer_in_step() -> None:
    """A dispatch that a peer's cleanly rejected combine failed counts no dispatch: before, the
    ranks' dispatch counters drifted apart (then every later call was OutOfStep, or, after two
    such calls, every combine a 'clean' InvalidArgumentError for good)."""
    (seen0, good0), (seen1, good1) = launch(_worker_mismatch_rejected_cleanly, 2, timeout_s=120)
    assert seen0 == ["RemoteError"] * 2 and seen1 == ["InvalidArgumentError"] * 2
    assert good0 == good1 == [True, True]
