"""ubep.mpi pieces that need no MPI: host layout rules, discovered topology, env variables,
control-record checks."""

from __future__ import annotations

import itertools
import warnings
from typing import Any

import numpy as np
import pytest

from ubep.env import mpi_ranks_per_host_from_env
from ubep.errors import InvalidArgumentError
from ubep.mpi.engine import record_check
from ubep.mpi.group import _hosts, discovered_topology


def test_hosts_from_leaders_contiguous_and_split() -> None:
    leaders = [0, 0, 0, 0, 4, 4, 4, 4]
    assert _hosts(leaders, None) == (4, [0, 0, 0, 0, 1, 1, 1, 1])
    assert _hosts(leaders, 2) == (2, [0, 0, 1, 1, 2, 2, 3, 3])
    assert _hosts(leaders, 1) == (1, list(range(8)))


@pytest.mark.parametrize("leaders", [[0, 1, 0, 1], [0, 0, 0, 3], [0, 0, 2, 2, 2, 5]])
def test_hosts_reject_interleaved_or_unequal(leaders: list[int]) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        _hosts(leaders, None)
    assert info.value.argument == "comm"
    assert "contiguously" in info.value.problem


@pytest.mark.parametrize("per_host", [3, 0, -1, True])
def test_hosts_reject_bad_split(per_host: int) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        _hosts([0, 0, 0, 0], per_host)
    assert info.value.argument == "ranks_per_host"


@pytest.mark.parametrize(("num_ranks", "per_host"), [(4, 4), (4, 2), (6, 3), (4, 1), (8, 4)])
def test_discovered_topology_hops_match_brute_force(num_ranks: int, per_host: int) -> None:
    topo = discovered_topology(num_ranks, per_host)
    far = 1 if per_host in (1, num_ranks) else 2
    for a, b in itertools.product(range(num_ranks), repeat=2):
        want = 0 if a == b else (1 if a // per_host == b // per_host else far)
        assert topo.hop(a, b) == want, (a, b)
    if far == 2:  # crossing hosts costs more than staying on one
        assert topo.latency_ns[2] > topo.latency_ns[1]


@pytest.mark.parametrize(
    ("env", "want"),
    [({}, None), ({"UBEP_MPI_FORCE_RMA": "1"}, 1), ({"UBEP_MPI_FORCE_RMA": "0"}, None),
     ({"UBEP_MPI_RANKS_PER_HOST": "2"}, 2),
     ({"UBEP_MPI_RANKS_PER_HOST": "1", "UBEP_MPI_FORCE_RMA": "1"}, 1)],
)
def test_env_ranks_per_host(env: dict[str, str], want: int | None) -> None:
    assert mpi_ranks_per_host_from_env(env) == want


def test_env_former_names_still_read_with_a_warning() -> None:
    with pytest.warns(DeprecationWarning, match="UBEP_DIST_RANKS_PER_HOST is deprecated"):
        assert mpi_ranks_per_host_from_env({"UBEP_DIST_RANKS_PER_HOST": "2"}) == 2
    with pytest.warns(DeprecationWarning, match="UBEP_DIST_FORCE_RMA is deprecated"):
        assert mpi_ranks_per_host_from_env({"UBEP_DIST_FORCE_RMA": "1"}) == 1
    # the new name wins, and no warning is given for the old one it shadows
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert mpi_ranks_per_host_from_env({"UBEP_MPI_RANKS_PER_HOST": "4",
                                            "UBEP_DIST_RANKS_PER_HOST": "2"}) == 4


@pytest.mark.parametrize(
    ("env", "name"),
    [({"UBEP_MPI_FORCE_RMA": "yes"}, "UBEP_MPI_FORCE_RMA"),
     ({"UBEP_MPI_RANKS_PER_HOST": "0"}, "UBEP_MPI_RANKS_PER_HOST"),
     ({"UBEP_MPI_RANKS_PER_HOST": "two"}, "UBEP_MPI_RANKS_PER_HOST"),
     ({"UBEP_MPI_RANKS_PER_HOST": "2", "UBEP_MPI_FORCE_RMA": "1"}, "UBEP_MPI_RANKS_PER_HOST")],
)
def test_env_rejects_bad_values(env: dict[str, str], name: str) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        mpi_ranks_per_host_from_env(env)
    assert info.value.argument == name


def _check_oracle(payload: bytes, epoch: int) -> int:
    """docs/FORMATS.md's DC formula with Python integers."""
    raw = payload + b"\0" * (-len(payload) % 8)
    words = [int.from_bytes(raw[i:i + 8], "little") for i in range(0, len(raw), 8)]
    mask = (1 << 64) - 1
    s1 = sum(words) & mask
    s2 = sum((i + 1) * w for i, w in enumerate(words)) & mask
    rot = ((s2 << 29) | (s2 >> 35)) & mask
    value = s1 ^ rot ^ ((epoch * 0x9E3779B97F4A7C15) & mask)
    return value or 1


def test_record_check_is_the_dc_formula_and_catches_torn_records() -> None:
    rng = np.random.default_rng(5)
    for n in (0, 3, 8, 29, 256):
        payload = rng.integers(0, 256, n, dtype=np.uint8)
        for epoch in (1, 2, 2**63 + 5):
            assert record_check(payload, epoch) == _check_oracle(payload.tobytes(), epoch)
    payload = rng.integers(0, 256, 64, dtype=np.uint8)
    good = record_check(payload, 7)
    assert record_check(payload, 9) != good  # a stale epoch never validates
    for i in range(64):  # any single byte still old (a torn put) is caught
        torn = payload.copy()
        torn[i] ^= 0x5A
        assert record_check(torn, 7) != good


def test_runs_sum_is_the_sum_of_each_runs_dc_checksum_and_catches_a_stale_row() -> None:
    """DC over RMA checks a batch run by run where it landed (ubep.mpi.syncs.runs_sum): the
    sum of each run's checksum, as the oracle computes it from the bytes; one run is that run's
    checksum, and a byte still old in any run, or last call's epoch, fails the batch."""
    from types import SimpleNamespace

    from ubep.mpi.syncs import runs_sum

    row_bytes = 64
    e = SimpleNamespace(row_bytes=row_bytes)
    rng = np.random.default_rng(11)
    rows = rng.integers(0, 256, (9, row_bytes), dtype=np.uint8)
    runs = [rows[0:4], rows[4:5], rows[5:9]]
    mask = (1 << 64) - 1
    want = sum(_check_oracle(r.tobytes(), 3) for r in runs) & mask
    assert runs_sum(e, runs, 3) == want
    assert runs_sum(e, [rows], 3) == _check_oracle(rows.tobytes(), 3)
    assert runs_sum(e, runs, 4) != want
    for r, i in itertools.product(range(3), (0, row_bytes - 1)):
        torn = [b.copy() for b in runs]
        torn[r][-1, i] ^= 0x5A
        assert runs_sum(e, torn, 3) != want


@pytest.mark.parametrize("name", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("weighted", [False, True])
def test_reduce_at_is_the_float32_sum_of_the_indexed_rows_in_slot_order(
        name: str, weighted: bool) -> None:
    """The RMA combine reduces rows where they landed (ubep.mpi.combine): per token, the rows
    its slots index (ascending slot, -1 skipped) summed in float32 from +0.0, each product
    rounded before the add, then rounded to the dtype (ubep.reference's arithmetic, here in
    numpy); a token with no row is +0.0, and an index past the rows is refused."""
    from ubep import dtypes
    from ubep.runtime.abi import native_or_none

    native = native_or_none()
    if native is None:
        pytest.skip("native data plane not built")
    dt = dtypes.dtype_of(name)
    rng = np.random.default_rng(5)
    nrows, ntok, k, n = 23, 9, 4, 3 * 64 + 5
    with np.errstate(over="ignore"):
        values = (rng.standard_normal((nrows, n)) * 50).astype(np.float32)
        values.flat[rng.choice(nrows * n, 30, replace=False)] = rng.choice(
            np.array([np.inf, -np.inf, np.nan, -0.0, 1e-39], np.float32), 30)
        rows = dt.from_float32(values)
    at = rng.integers(0, nrows, (ntok, k)).astype(np.int64)
    at[rng.random((ntok, k)) < 0.3] = -1
    at[2] = -1  # a token with no row
    w = rng.standard_normal((ntok, k)).astype(np.float32)
    want = np.empty((ntok, n), rows.dtype)
    with np.errstate(invalid="ignore", over="ignore"):
        for t in range(ntok):
            acc = np.zeros(n, np.float32)
            for j in np.nonzero(at[t] >= 0)[0]:
                term = dt.to_float32(rows[at[t, j]])
                acc = acc + (w[t, j] * term if weighted else term)
            want[t] = dt.from_float32(acc)
    got = np.full_like(want, 0x55)
    native.reduce_at(rows, at, w, got, k, native.DTYPES[name], weighted)
    assert got.tobytes() == want.tobytes()
    at[4, 1] = nrows
    with pytest.raises(ValueError, match="outside rows"):
        native.reduce_at(rows, at, w, got, k, native.DTYPES[name], weighted)


# --- ubep doctor ------------------------------------------------------------------------------


def test_doctor_reports_mpi_pieces_and_verdicts() -> None:
    from ubep.doctor import Check, run_checks, verdicts

    names = {c.name for c in run_checks()}
    assert {"/dev/shm", "cores", "native data plane", "mpi4py", "mpiexec"} <= names
    ok = [Check("/dev/shm", True, ""), Check("native data plane", True, ""),
          Check("mpi4py", True, ""), Check("mpiexec", True, ""), Check("cores", False, "")]
    lines = verdicts(ok)
    assert lines[0].endswith("works")
    assert any("ubep doctor --mpi" in line for line in lines)
    assert any(line.startswith("speed:") for line in lines)
    broken = [Check("/dev/shm", False, ""), Check("native data plane", True, ""),
              Check("mpi4py", False, ""), Check("mpiexec", True, "")]
    lines = verdicts(broken)
    assert "DOES NOT WORK" in lines[0] and "not available" in lines[1]
    probed = [*ok, Check("mpi run: shared memory", True, ""), Check("mpi run: TCP RMA", False, "")]
    assert verdicts(probed)[1:3] == ["ubep.mpi, shared memory: works",
                                     "ubep.mpi, TCP RMA: FAILED (see above)"]


# --- the RMA engine's call protocol, on an in-process transport (tests/_fake_rma.py) ----------

R3 = 3


def _cfg(engine: str = "asp", sync: str = "sw", timeout_s: float = 5.0) -> Any:
    from ubep.buffer import BufferConfig

    return BufferConfig(max_tokens_per_rank=8, hidden=64, num_topk=2, num_experts=2 * R3,
                        dtype="fp32", engine=engine, sync=sync, timeout_s=timeout_s)


def _inputs(seed: int) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
    xs = [np.random.default_rng(seed + q).standard_normal((8, 64)).astype(np.float32)
          for q in range(R3)]
    idxs = [np.stack([np.random.default_rng(seed * 97 + q * 8 + t).permutation(2 * R3)[:2]
                      for t in range(8)]).astype(np.int64) for q in range(R3)]
    ws = [np.random.default_rng(seed + 50 + q).random((8, 2)).astype(np.float32)
          for q in range(R3)]
    return xs, idxs, ws


def _checked_call(buf: Any, r: int, seed: int) -> bool:
    """A dispatch + combine on every rank, bit-exact against ubep.reference."""
    from ubep import reference

    xs, idxs, ws = _inputs(seed)
    res = buf.dispatch(xs[r], idxs[r], ws[r])
    refs = reference.dispatch(xs, idxs, ws, 2 * R3)
    outs = [ref.recv_x * 2 for ref in refs]
    y = buf.combine(outs[r], res.handle)
    y_ref = reference.combine(outs, refs)[r]
    return bool(np.array_equal(res.recv_x, refs[r].recv_x) and np.array_equal(y, y_ref))


def _recording(buf: Any) -> list[Any]:
    """Every value the Buffer's engine returns from dispatch/combine (the error records)."""
    seen: list[Any] = []
    eng = buf._engine
    for name in ("dispatch", "combine"):
        orig = getattr(eng, name)

        def wrapped(*args: Any, _orig: Any = orig) -> Any:
            got = _orig(*args)
            seen.append(got)
            return got

        setattr(eng, name, wrapped)
    return seen


def test_rma_fail_codes_reach_peers_in_the_core_slot() -> None:
    """fail(epoch, code, message): code 6 (lost) on rank 1 is rank 0's remote error with 6 in
    the core slot; rank 2 gets the same; the next call works (bit-exact)."""
    from tests.mpi._fake_rma import FakeWorld, run_ranks
    from ubep.buffer import Buffer
    from ubep.errors import RemoteError

    def body(g: Any) -> tuple[Any, bool]:
        with Buffer(g, _cfg()) as buf:
            seen = _recording(buf)
            xs, idxs, ws = _inputs(1)
            got: Any = None
            if g.rank == 1:
                buf._epoch += 1
                buf._engine.fail(buf._epoch, 6, "rank 1 lost step")
                buf._num_dispatches += 1
            else:
                with pytest.raises(RemoteError, match="rank 1 lost step"):
                    buf.dispatch(xs[g.rank], idxs[g.rank], ws[g.rank])
                got = seen[-1]
            buf.resync()  # a lost step is resynced on every rank, then calls are exact again
            return got, _checked_call(buf, g.rank, 2)

    out = run_ranks(FakeWorld(R3), body)
    records = [out[r][0] for r in (0, 2)]
    for rec in records:
        # rank 1's notice, or the notice of the other rank that saw it first: either way the
        # code of the original failure is passed on (6, lost step)
        assert rec.code == 4 and "rank 1 lost step" in rec.message
        assert rec.core == 6
    assert 1 in {rec.peer for rec in records}  # the first to fail failed on rank 1's notice
    assert all(ok for _, ok in out)


def test_rma_failure_after_completion_turns_the_result_into_an_error() -> None:
    """Rank 0 has everything of the call when rank 1's notice arrives: it returns rank 1's
    error (code 4, remote code 2 in core), not its result."""
    import threading

    from tests.mpi._fake_rma import FakeWorld, run_ranks
    from ubep.buffer import Buffer
    from ubep.errors import RemoteError

    noticed, rank2_returned = threading.Event(), threading.Event()

    def body(g: Any) -> Any:
        with Buffer(g, _cfg()) as buf:
            seen = _recording(buf)
            eng = buf._engine.kernel  # the RMA engine under the host-memory adapter
            xs, idxs, ws = _inputs(3)
            if g.rank == 0:
                finish = eng.proto.finish

                def late_finish(op: Any) -> None:
                    assert noticed.wait(10)
                    finish(op)

                eng.proto.finish = late_finish
                with pytest.raises(RemoteError, match="late failure"):
                    buf.dispatch(xs[0], idxs[0], ws[0])
                return seen[-1]
            buf.dispatch(xs[g.rank], idxs[g.rank], ws[g.rank])
            if g.rank == 2:
                rank2_returned.set()
            else:  # e.g. a timeout on its way out: a notice for a call rank 0 completed
                assert rank2_returned.wait(10)
                eng.fail(buf._epoch, 2, "late failure")
                noticed.set()
            return None

    got = run_ranks(FakeWorld(R3), body)[0]
    assert (got.code, got.peer, got.core) == (4, 1, 2)


def test_rma_liveness_checks_every_peer_still_in_the_call() -> None:
    """Rank 0 waits for rank 1 (alive, slow); rank 2 is dead: PeerLostError names rank 2 at
    once. A peer that finished the call before dying is not lost: then it is a timeout."""
    import time

    from tests.mpi._fake_rma import FakeWorld, run_ranks
    from ubep.buffer import Buffer

    world = FakeWorld(R3)

    def body(g: Any) -> Any:
        with Buffer(g, _cfg(timeout_s=3.0)) as buf:
            eng = buf._engine.kernel  # the RMA engine under the host-memory adapter
            g.barrier()
            if g.rank == 2:  # finished call 1, then died; never enters call 2
                eng.proto.publish_done(1, 0)
                world.dead.add(2)
            g.barrier()
            if g.rank != 0:
                return None
            t0 = time.monotonic()
            after_done = eng.wait_done(1, 0.5)  # rank 1 never finishes call 1: timeout
            lost = eng.wait_done(2, 3.0)  # rank 1 is waited for first; rank 2 is dead
            return after_done, lost, time.monotonic() - t0

    after_done, lost, elapsed = run_ranks(world, body)[0]
    assert after_done.code == 2  # E_TIMEOUT: rank 2 is not lost for call 1
    # E_PEER_LOST naming rank 2, long before 3 s
    assert (lost.code, lost.peer) == (3, 2) and elapsed < 2.0


def test_rma_peer_past_this_call_is_an_error_never_data() -> None:
    """A counts record of call 3 sits in the slot of call 1 (same parity): it is valid for call 3
    and never read as call 1's. Rank 1 has finished call 2 (no notice) while rank 0 enters call
    1: E_LOST (6) naming rank 1 at once, not a wait until the timeout."""
    import time

    from tests.mpi._fake_rma import FakeWorld, run_ranks
    from ubep.buffer import Buffer
    from ubep.errors import UbepError
    from ubep.mpi.engine import _Op

    def body(g: Any) -> Any:
        with Buffer(g, _cfg(timeout_s=3.0)) as buf:
            eng = buf._engine.kernel  # the RMA engine under the host-memory adapter
            xs, idxs, ws = _inputs(4)
            if g.rank == 2:
                units = eng._validate(xs[2], idxs[2], ws[2])
                eng._publish_counts(_Op(0, 3, 10**9), units)
            if g.rank == 1:
                eng.proto.publish_done(2, 0)
            g.barrier()
            if g.rank != 0:
                return None
            stale = (eng._read_counts(2, _Op(0, 1, 10**9)),
                     eng._read_counts(2, _Op(0, 3, 10**9)) is not None)
            seen = _recording(buf)
            t0 = time.monotonic()
            with pytest.raises(UbepError):
                buf.dispatch(xs[0], idxs[0], ws[0])
            return stale, seen[-1], time.monotonic() - t0

    (as_call_1, as_call_3), lost, lost_s = run_ranks(FakeWorld(R3), body)[0]
    assert as_call_1 is None and as_call_3
    assert (lost.code, lost.peer) == (6, 1) and lost_s < 1.0


def test_rma_stopped_peer_gives_timeout_at_the_deadline_and_resync_recovers() -> None:
    """Puts to a stopped rank never complete (emulated RMA): the others raise at timeout_s
    instead of waiting for a flush. After it resumes, every rank resyncs (between two
    exchanges, as Buffer.resync does) and calls are bit-exact again; resync clears the window
    and forgets the combine regions."""
    import time

    from tests.mpi._fake_rma import FakeWorld, run_ranks
    from ubep.buffer import Buffer
    from ubep.errors import RemoteError, TimeoutError

    world = FakeWorld(R3)
    timeout_s = 1.0

    def body(g: Any) -> Any:
        with Buffer(g, _cfg(engine="bsp", sync="tff", timeout_s=timeout_s)) as buf:
            assert _checked_call(buf, g.rank, 5)
            g.barrier()
            if g.rank == 2:
                world.stopped.add(2)
            g.barrier()
            xs, idxs, ws = _inputs(6)
            elapsed, err = 0.0, ""
            if g.rank != 2:
                t0 = time.monotonic()
                try:
                    buf.dispatch(xs[g.rank], idxs[g.rank], ws[g.rank])
                except (TimeoutError, RemoteError) as exc:
                    err = type(exc).__name__
                elapsed = time.monotonic() - t0
            g.barrier()  # "SIGCONT": rank 2 runs again and fails the abandoned call
            if g.rank == 2:
                world.resume(2)
                with pytest.raises((TimeoutError, RemoteError)):
                    buf.dispatch(xs[2], idxs[2], ws[2])
            # look at the window right after the engine's reset, inside Buffer.resync (between
            # its two exchanges, where no peer writes it)
            seen: dict[str, bool] = {}
            engine_resync = buf._engine.resync

            def resync_and_look(base: int) -> None:
                engine_resync(base)
                seen["cleared"] = not buf._engine.kernel.ctrl.local_array.any()
                seen["forgot"] = (buf._engine.kernel.comb_last_epoch(0) ==
                                  buf._engine.kernel.comb_last_epoch(1) == 0)

            buf._engine.resync = resync_and_look
            buf.resync()
            ok = all(_checked_call(buf, g.rank, 7 + i) for i in range(2))
            return err, elapsed, seen["cleared"], seen["forgot"], ok

    out = run_ranks(world, body)
    for r in (0, 1):
        err, elapsed, *_ = out[r]
        assert err in ("TimeoutError", "RemoteError")
        assert timeout_s - 0.1 <= elapsed < timeout_s + 1.0
    assert "TimeoutError" in {out[0][0], out[1][0]}
    assert all(cleared and forgot and ok for _, _, cleared, forgot, ok in out)


def test_rma_call_stuck_inside_mpi_raises_peer_lost_and_the_group_refuses() -> None:
    """A put to a rank that just died never returns (Open MPI's TCP one-sided component can
    spin in MPI_Rput): each survivor's call raises PeerLostError by itself (the watchdog, not
    the stuck put), the next call refuses at once, and the group says it is wedged."""
    from tests.mpi._fake_rma import FakeWorld, run_ranks
    from ubep.buffer import Buffer
    from ubep.errors import PeerLostError

    world = FakeWorld(R3)

    def body(g: Any) -> Any:
        buf = Buffer(g, _cfg(engine="asp", sync="dc", timeout_s=0.5))
        ok = _checked_call(buf, g.rank, 5)
        g.barrier()
        if g.rank == 2:
            return ok, "dead", "", False  # this rank "dies": it never calls again
        world.wedging.add(2)
        world.dead.add(2)
        xs, idxs, ws = _inputs(6)
        outcome = []
        for _ in range(2):
            try:
                buf.dispatch(xs[g.rank], idxs[g.rank], ws[g.rank])
                outcome.append("ok")
            except PeerLostError as exc:
                outcome.append(str(exc))
        return ok, outcome[0], outcome[1], g.runner.wedged

    try:
        out = run_ranks(world, body, timeout_s=30.0)
    finally:
        world.unwedge()
    assert all(ok for ok, *_ in out)
    for first, second, wedged in (o[1:] for o in out[:2]):
        assert "still inside MPI" in first, first
        assert second != "ok" and wedged


def test_rma_completed_operations_are_dropped_without_a_flush() -> None:
    """ASP + DC never flushes: completed puts (and their buffers) are still dropped at the next
    call, so a long run holds one call's worth, not every call's."""
    from tests.mpi._fake_rma import FakeWorld, run_ranks
    from ubep.buffer import Buffer

    def body(g: Any) -> list[int]:
        with Buffer(g, _cfg(sync="dc")) as buf:
            eng = buf._engine.kernel  # the RMA engine under the host-memory adapter
            held = []
            for i in range(6):
                assert _checked_call(buf, g.rank, 20 + i)
                held.append(len(eng.ctrl._waiting) + len(eng.data._waiting))
            eng._reap()  # everything completed (the fake completes at once)
            held.append(len(eng.ctrl._waiting) + len(eng.data._waiting))
            return held

    for held in run_ranks(FakeWorld(R3), body):
        calls, after_reap = held[:-1], held[-1]
        assert 0 < max(calls) < 2 * min(calls)  # one call's operations; 6 calls' if kept
        assert after_reap == 0
