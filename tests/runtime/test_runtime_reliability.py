"""Never a wrong answer: after each fault a hostile user could cause, every rank gets
an exception or the reference's answer, a Buffer that lost step refuses until ``resync()``, and
after ``resync()`` calls are bit-exact again.

Each fault has its test here (the SIGKILL / rendezvous leftovers are in test_runtime_launch.py,
the MPI waits in tests/mpi/). Every rank checks its own result
against ``ubep.reference`` on inputs seeded by the call's sequence number (``buf._epoch + 1``),
which the protocol keeps equal on every rank of one collective call.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import numpy as np
import pytest

from tests._runtime_support import Case, bits, compare, make_inputs
from ubep import reference
from ubep.buffer import Buffer, BufferConfig
from ubep.errors import (
    InvalidArgumentError,
    PeerLostError,
    RankFailedError,
    RemoteError,
    UbepError,
)
from ubep.runtime import launch

CASE3 = Case("asp", "sp", "expert", "bf16", 3, 256, "uniform")


def _config(case: Case, timeout_s: float, **extra: Any) -> BufferConfig:
    return case.config(16, timeout_s=timeout_s, **extra)


def _checked_pair(buf: Buffer, case: Case, rank: int) -> str:
    """One dispatch + combine on inputs seeded by the call number: "ok", "WRONG ..." (a call
    returned data that differs from the reference) or the exception's class name."""
    cfg = buf.config
    seed = buf._epoch + 1
    tokens = [16] * buf.num_ranks
    xs, idxs, ws = make_inputs(case, cfg.num_experts, tokens, seed, "uniform")
    refs = reference.dispatch(xs, idxs, ws, cfg.num_experts, layout=cfg.layout)
    try:
        res = buf.dispatch(xs[rank], idxs[rank], ws[rank])
    except UbepError as exc:
        return type(exc).__name__
    bad = compare(res, refs[rank])
    if bad:
        return f"WRONG dispatch {seed}: {bad[:2]}"
    outs = [np.ascontiguousarray(ref.recv_x) for ref in refs]
    try:
        y = buf.combine(res.recv_x, res.handle)
    except UbepError as exc:
        return type(exc).__name__
    y_ref = reference.combine(outs, refs)[rank]
    if not np.array_equal(bits(y), bits(y_ref)):
        return f"WRONG combine {seed + 1}"
    return "ok"


# --- 1. a SIGSTOPped peer: timeouts, lost step, resync --------------------------------------


def _worker_sigstop(group: Any) -> list[str]:
    cfg = _config(CASE3, 1.0)
    log: list[str] = []
    with Buffer(group, cfg) as buf:
        victim = group.peers[2].pid

        def resume_later() -> None:
            time.sleep(3.0)  # three deadlines of the others
            os.kill(victim, signal.SIGCONT)

        stopped = False
        while buf._epoch < 60:
            if group.rank == 0 and not stopped and buf._epoch >= 10:
                # the victim stops between calls or inside one, whatever it is doing: the calls
                # from here on need it, so every rank meets the stop inside the loop
                os.kill(victim, signal.SIGSTOP)
                threading.Thread(target=resume_later, daemon=True).start()
                stopped = True
            outcome = _checked_pair(buf, CASE3, group.rank)
            log.append(outcome)
            if outcome != "ok" and not outcome.startswith("WRONG"):
                buf.resync(30.0)
        log.append("final:" + _settle(buf, CASE3, group.rank))
    return log


def _settle(buf: Buffer, case: Case, rank: int) -> str:
    """Resync until a checked call passes on this rank. Ranks leave a fault loop at different
    calls (one finished a call its peers failed); every failed attempt here ends in a resync
    that pairs with the late ranks' own, so all of them end on the same successful call."""
    outcome = ""
    for _ in range(5):
        buf.resync(30.0)
        outcome = _checked_pair(buf, case, rank)
        if outcome == "ok" or outcome.startswith("WRONG"):
            break
    return outcome


def test_sigstopped_peer_never_yields_wrong_data_and_resync_recovers() -> None:
    logs = launch(_worker_sigstop, 3, timeout_s=120)
    for rank, log in enumerate(logs):
        assert not [o for o in log if "WRONG" in o], (rank, log)
        assert log[-1] == "final:ok", (rank, log[-5:])
    # the survivors of the stop saw it (a timeout or a peer's notice), and so did the victim
    for log in logs:
        assert any(o in ("TimeoutError", "RemoteError", "OutOfStepError") for o in log), log


# --- 2. a second thread: refused, nothing advanced ------------------------------------------


def _worker_second_thread(group: Any) -> dict[str, Any]:
    case = Case("asp", "sw", "rank", "bf16", 2, 256, "uniform")
    cfg = _config(case, 10.0)
    out: dict[str, Any] = {}
    with Buffer(group, cfg) as buf:
        r = group.rank
        xs, idxs, ws = make_inputs(case, cfg.num_experts, [16, 16], buf._epoch + 1, "uniform")
        if r == 0:
            seen: list[str] = []

            def intruder() -> None:
                while not buf._lock.locked():  # the main thread is inside its call
                    time.sleep(1e-4)
                epoch = buf._epoch
                try:
                    buf.dispatch(xs[r], idxs[r], ws[r])
                    seen.append("accepted")
                except UbepError as exc:
                    seen.append(type(exc).__name__ + (": in progress" if "in progress" in
                                                      str(exc) else str(exc)))
                seen.append("epoch unchanged" if buf._epoch == epoch else "epoch moved")

            t = threading.Thread(target=intruder)
            t.start()
        else:
            time.sleep(0.5)  # keep rank 0's call in flight while the intruder tries
        refs = reference.dispatch(xs, idxs, ws, cfg.num_experts, layout=cfg.layout)
        res = buf.dispatch(xs[r], idxs[r], ws[r])
        out["main"] = compare(res, refs[r])
        if r == 0:
            t.join()
            out["intruder"] = seen
        out["next"] = [_checked_pair(buf, case, r) for _ in range(3)]
    return out


def test_second_thread_is_refused_without_advancing_anything() -> None:
    outs = launch(_worker_second_thread, 2, timeout_s=120)
    assert outs[0]["intruder"] == ["UbepError: in progress", "epoch unchanged"], outs[0]
    for out in outs:
        assert out["main"] == [] and out["next"] == ["ok"] * 3, out


# --- 3. stale and foreign handles ------------------------------------------------------------


def _worker_stale_handle(group: Any) -> dict[str, Any]:
    case = Case("asp", "sp", "expert", "bf16", 2, 256, "uniform")
    cfg = _config(case, 10.0)
    r = group.rank
    out: dict[str, Any] = {}
    with Buffer(group, cfg) as buf, Buffer(group, cfg) as other:
        xs, idxs, ws = make_inputs(case, cfg.num_experts, [16, 16], 3, "uniform")
        first = buf.dispatch(xs[r], idxs[r], ws[r])
        xs2, idxs2, ws2 = make_inputs(case, cfg.num_experts, [16, 16], 4, "uniform")
        second = buf.dispatch(xs2[r], idxs2[r], ws2[r])
        # rank 1 passes the previous dispatch's handle: refused on every rank
        h = first.handle if r == 1 else second.handle
        eo = first.recv_x if r == 1 else second.recv_x
        out["stale"] = _outcome(lambda: buf.combine(np.array(eo), h))
        # the right handles afterwards: bit-exact
        refs = reference.dispatch(xs2, idxs2, ws2, cfg.num_experts, layout=cfg.layout)
        y = buf.combine(np.array(second.recv_x), second.handle)
        y_ref = reference.combine([ref.recv_x for ref in refs], refs)[r]
        out["after"] = bool(np.array_equal(bits(y), bits(y_ref)))
        # a handle of another Buffer of the same shape: refused where passed, clean elsewhere
        foreign = other.dispatch(xs2[r], idxs2[r], ws2[r])
        h = foreign.handle if r == 0 else second.handle
        out["foreign"] = _outcome(lambda: buf.combine(np.array(second.recv_x), h))
        # a handle from before a resync
        buf.resync(30)
        out["old"] = _outcome(lambda: buf.combine(np.array(second.recv_x), second.handle))
        out["next"] = _checked_pair(buf, case, r)
        other.combine(np.array(foreign.recv_x), foreign.handle)  # keep `other` in step
    return out


def _outcome(fn: Any) -> tuple[str, Any]:
    try:
        fn()
    except InvalidArgumentError as exc:
        return ("InvalidArgumentError", exc.argument)
    except RemoteError as exc:
        return ("RemoteError", exc.clean)
    except UbepError as exc:
        return (type(exc).__name__, str(exc))
    return ("ok", None)


def test_stale_or_foreign_handle_is_refused_on_every_rank() -> None:
    outs = launch(_worker_stale_handle, 2, timeout_s=120)
    for r, out in enumerate(outs):
        # every rank sees that the ranks name different dispatches
        assert out["stale"] == ("InvalidArgumentError", "handle"), (r, out)
        assert out["after"], (r, out)
        assert out["foreign"] == (("InvalidArgumentError", "handle") if r == 0
                                  else ("RemoteError", True)), (r, out)
        assert out["old"] == ("InvalidArgumentError", "handle"), (r, out)
        assert out["next"] == "ok", (r, out)


# --- 4. a killed peer seen by cores waiting on another rank (the plan path) ------------------


def _worker_killed_plan(group: Any) -> tuple[str, float]:
    case = Case("asp", "sw", "expert", "bf16", 3, 256, "uniform")
    cfg = _config(case, 30.0, num_cores=4, threads=False)
    with Buffer(group, cfg) as buf:
        r = group.rank
        xs, idxs, ws = make_inputs(case, cfg.num_experts, [16] * 3, 5, "uniform")
        killed_at = 0.0
        try:
            for i in range(1_000_000):
                if r == 2 and i == 20:
                    os.kill(os.getpid(), signal.SIGKILL)
                if r == 0 and i == 20:
                    killed_at = time.monotonic()
                res = buf.dispatch(xs[r], idxs[r], ws[r])
                buf.combine(res.recv_x, res.handle)
        except PeerLostError:
            return "PeerLostError", time.monotonic() - killed_at if r == 0 else 0.0
        except UbepError as exc:
            return type(exc).__name__, 0.0
    return "no error", 0.0


def test_killed_peer_is_seen_by_cores_waiting_on_another_rank() -> None:
    with pytest.raises(RankFailedError) as info:
        launch(_worker_killed_plan, 3, timeout_s=120)
    err = info.value
    assert err.rank == 2 and err.exitcode == -signal.SIGKILL
    for rank, (kind, after_s) in err.results.items():
        assert kind == "PeerLostError", (rank, kind)
        assert after_s < 5.0, (rank, after_s)


# --- 6. inputs numpy cannot convert, out-of-range unsigned ids, garbage notices ------------


def _worker_bad_values(group: Any) -> dict[str, Any]:
    case = Case("asp", "sw", "expert", "bf16", 2, 256, "uniform")
    cfg = _config(case, 10.0)
    r = group.rank
    out: dict[str, Any] = {}
    with Buffer(group, cfg) as buf:
        xs, idxs, ws = make_inputs(case, cfg.num_experts, [16, 16], 6, "uniform")

        def call(x: Any = None, idx: Any = None) -> None:
            buf.dispatch(xs[r] if x is None else x, idxs[r] if idx is None else idx, ws[r])

        ragged = [[1, 2, 3], [4, 5]]
        start = time.monotonic()
        out["ragged"] = _outcome(lambda: call(x=ragged if r == 0 else None))
        out["ragged_s"] = time.monotonic() - start  # the peer got a notice, not a timeout
        for name, value in (("u64max", 2**64 - 1), ("u63", 2**63 + 1)):
            bad = idxs[1].astype(np.uint64)
            bad[bad == np.uint64(2**64 - 1)] = 0  # -1 (masked) is not an unsigned value
            bad[2, 1] = np.uint64(value)
            try:
                call(idx=bad if r == 1 else None)
                out[name] = ("ok", None)
            except InvalidArgumentError as exc:
                out[name] = ("InvalidArgumentError", exc.argument)
                out[name + "_value"] = exc.value
            except RemoteError as exc:
                out[name] = ("RemoteError", exc.clean)
        out["next"] = _checked_pair(buf, case, r)
        # garbage where rank 0 will look for rank 1's notice of the next call: its checksum
        # fails, so rank 0 reports corrupt control data instead of decoding it
        group.barrier(30)
        if r == 1:
            lay = buf.layout
            epoch = buf._epoch + 1
            f = buf._memory.segments[1].array[lay.off_fail + (epoch & 1) * 512:]
            msg = b"\xff\xfe invalid utf-8 \xc3\x28 garbage"
            f[16: 16 + len(msg)] = np.frombuffer(msg, np.uint8)
            f[8:16] = np.frombuffer(np.uint64(len(msg) | 4 << 32).tobytes(), np.uint8)
            f[:8] = np.frombuffer(np.uint64(epoch).tobytes(), np.uint8)
        group.barrier(30)
        if r == 0:
            out["garbage"] = _outcome(lambda: call())
    return out


def test_unconvertible_input_and_garbage_notices_are_ubep_errors() -> None:
    outs = launch(_worker_bad_values, 2, timeout_s=120)
    assert outs[0]["ragged"] == ("InvalidArgumentError", "x")
    assert outs[1]["ragged"] == ("RemoteError", True)
    assert outs[1]["ragged_s"] < 5.0
    for name, value in (("u64max", 2**64 - 1), ("u63", 2**63 + 1)):
        assert outs[1][name] == ("InvalidArgumentError", "topk_idx")
        assert outs[1][name + "_value"] == value
        assert outs[0][name] == ("RemoteError", True)
    assert outs[0]["next"] == outs[1]["next"] == "ok"
    kind, text = outs[0]["garbage"]
    assert kind == "OutOfStepError" and "corrupt failure notice of rank 1" in text, text


def test_torch_tensors_are_taken_as_input() -> None:
    pytest.importorskip("torch")
    outs = launch(_worker_torch_input, 2, timeout_s=120)
    assert outs == [[], []]


def _worker_torch_input(group: Any) -> list[str]:
    import torch

    case = Case("asp", "sw", "expert", "bf16", 2, 256, "uniform")
    cfg = _config(case, 10.0)
    r = group.rank
    with Buffer(group, cfg) as buf:
        xs, idxs, ws = make_inputs(case, cfg.num_experts, [16, 16], 7, "uniform")
        x_t = torch.from_numpy(xs[r].view(np.int16)).view(torch.bfloat16)
        res = buf.dispatch(x_t, torch.from_numpy(idxs[r]), torch.from_numpy(ws[r]))
        refs = reference.dispatch(xs, idxs, ws, cfg.num_experts, layout=cfg.layout)
        return compare(res, refs[r])


# --- 7. collective construction --------------------------------------------------------------


def _worker_construction(group: Any) -> tuple[tuple[str, Any], str]:
    case = Case("asp", "sw", "expert", "bf16", 2, 256, "uniform")
    good = _config(case, 10.0)
    bad = BufferConfig(max_tokens_per_rank=16, hidden=256, num_topk=4, num_experts=7,
                       dtype="bf16", timeout_s=10.0)  # 7 experts do not split over 2 ranks
    first = _outcome(lambda: Buffer(group, bad if group.rank == 0 else good).close())
    with Buffer(group, good) as buf:  # pairs with the peers' next Buffer, not a stale one
        return first, _checked_pair(buf, case, group.rank)


def test_a_config_one_rank_rejects_fails_on_every_rank() -> None:
    (first0, next0), (first1, next1) = launch(_worker_construction, 2, timeout_s=120)
    assert first0 == ("InvalidArgumentError", "num_experts")
    assert first1 == ("RemoteError", True)
    assert next0 == next1 == "ok"


# --- 9. random bytes in a live segment's control area ---------------------------------------


def _worker_garbage(group: Any, sync: str) -> list[str]:
    case = Case("asp", sync, "expert", "bf16", 2, 256, "uniform")
    cfg = _config(case, 0.5)
    log: list[str] = []
    with Buffer(group, cfg) as buf:
        lay = buf.layout
        stop = threading.Event()
        if group.rank == 0:
            peer = buf._memory.segments[1].array
            ctrl = peer[lay.off_fail: lay.off_land]  # notices, progress, inboxes, routing
            rng = np.random.default_rng(11)

            def spray() -> None:
                while not stop.is_set():
                    at = int(rng.integers(0, ctrl.size - 64))
                    n = int(rng.integers(8, 64))
                    ctrl[at: at + n] = rng.integers(0, 256, n, dtype=np.uint8)
                    time.sleep(float(rng.uniform(0.0, 0.02)))

            sprayer = threading.Thread(target=spray, daemon=True)
            sprayer.start()
        while buf._epoch < 120:
            outcome = _checked_pair(buf, case, group.rank)
            log.append(outcome)
            if outcome != "ok" and not outcome.startswith("WRONG"):
                buf.resync(30.0)
        stop.set()
        log.append("final:" + _settle(buf, case, group.rank))
    return log


@pytest.mark.parametrize("sync", ["sw", "sp"])
def test_garbage_in_the_control_area_is_an_error_never_data(sync: str) -> None:
    logs = launch(_worker_garbage, 2, sync, timeout_s=300)
    for rank, log in enumerate(logs):
        assert not [o for o in log if "WRONG" in o], (rank, [o for o in log if "WRONG" in o])
        assert log[-1] == "final:ok", (rank, log[-3:])
    assert any(o != "ok" for o in logs[1]), "the garbage never hit anything"


# --- 10b. BSP: a peer that failed a call and already arrived at the next call's barrier -----


def _worker_bsp_race(group: Any) -> list[tuple[str, Any]]:
    case = Case("bsp", "sw", "expert", "bf16", 2, 256, "uniform")
    cfg = _config(case, 10.0)
    r = group.rank
    out = []
    with Buffer(group, cfg) as buf:
        for i in range(4):
            xs, idxs, ws = make_inputs(case, cfg.num_experts, [16, 16], 20 + i, "uniform")
            res = buf.dispatch(xs[r], idxs[r], ws[r])
            eo = np.array(res.recv_x)
            if r == 0:  # wrong expert_out rows, then straight on to the next dispatch
                eo = np.zeros((eo.shape[0] + 1, eo.shape[1]), eo.dtype)
            else:
                time.sleep(0.3)  # rank 0 reaches the next dispatch's first barrier first
            out.append(_outcome(lambda e=eo, h=res.handle: buf.combine(e, h)))
        out.append((_checked_pair(buf, case, r), None))
    return out


def test_bsp_failure_notice_wins_over_a_later_barrier_arrival() -> None:
    outs = launch(_worker_bsp_race, 2, timeout_s=120)
    assert outs[0][:4] == [("InvalidArgumentError", "expert_out")] * 4
    assert outs[1][:4] == [("RemoteError", True)] * 4
    assert outs[0][4] == outs[1][4] == ("ok", None)


# --- any exception before the data plane is a clean reject on every rank ---------------------


class _Exploding:
    """An ``x`` whose conversion raises something that is not a ValueError/TypeError."""

    def __array__(self, *args: Any, **kwargs: Any) -> np.ndarray:
        raise RuntimeError("the caller's array broke")


def _worker_exploding_input(group: Any) -> tuple[tuple[str, Any], list[str]]:
    case = Case("asp", "sp", "expert", "bf16", 2, 256, "uniform")
    cfg = _config(case, 10.0)
    r = group.rank
    with Buffer(group, cfg) as buf:
        xs, idxs, ws = make_inputs(case, cfg.num_experts, [16, 16], 9, "uniform")
        first = _outcome(lambda: buf.dispatch(_Exploding() if r == 0 else xs[r], idxs[r], ws[r]))
        # in step, no resync: dispatch counters and regions agree, the next pairs are exact
        return first, [_checked_pair(buf, case, r) for _ in range(3)]


def test_any_exception_before_the_data_plane_rejects_cleanly_everywhere() -> None:
    (first0, next0), (first1, next1) = launch(_worker_exploding_input, 2, timeout_s=120)
    assert first0[0] == "UbepError" and "the caller's array broke" in first0[1], first0
    assert first1 == ("RemoteError", True), first1
    assert next0 == next1 == ["ok"] * 3
