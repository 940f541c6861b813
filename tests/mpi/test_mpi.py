"""ubep.mpi under mpiexec on this machine: bit-exact against ubep.reference.

Three transports, each in one mpiexec launch that runs every engine x sync x layout (dtypes
rotated, see ``ubep.modes.enumerate_modes``) plus a rejected call per mode:

* shared memory: all ranks on one host, the native engine on ``MPI_Win_allocate_shared`` memory;
* TCP, every rank its own host (``UBEP_MPI_FORCE_RMA=1``, ``--mca btl self,tcp``): every row
  and flag through ``MPI_Put``/``MPI_Get`` of Open MPI's ``osc/rdma`` over TCP;
* two virtual hosts of two ranks (``UBEP_MPI_RANKS_PER_HOST=2``): loads/stores inside a host,
  RMA over TCP between hosts.

The same file is the mpiexec worker for the smaller checks (``python -m tests.mpi.test_mpi NAME
OUT``, from the repository root): results travel as JSON files, never through stdout.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.mpi

REPO_ROOT = Path(__file__).resolve().parents[2]
_WORKER = ["-m", "tests.mpi.test_mpi"]  # this file as a module, run from REPO_ROOT
_TCP = ("--mca", "btl", "self,tcp", "--mca", "osc", "sm,rdma")
_QUIET = ("--mca", "osc", "^ucx")  # the wheel's osc/ucx prints an error when it has no device


def _mpiexec() -> str | None:
    local = Path(sys.executable).parent / "mpiexec"
    return str(local) if local.exists() else shutil.which("mpiexec")


def _skip_reason() -> str | None:
    if importlib.util.find_spec("mpi4py") is None:
        return "mpi4py is not installed (pip install -e '.[mpi]')"
    if _mpiexec() is None:
        return "no mpiexec next to the interpreter or on PATH"
    return None


def mpirun(num_ranks: int, argv: list[str], *, mca: tuple[str, ...] = _QUIET,
           env: dict[str, str] | None = None, timeout_s: float = 180.0) -> None:
    """Run ``python argv...`` on ``num_ranks`` ranks from the repository root (so ``-m tests.*``
    resolves); fail with the output on a non-zero exit."""
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    full_env = dict(os.environ) | (env or {})
    if os.geteuid() == 0:  # Open MPI refuses root without these
        full_env |= {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    full_env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [str(_mpiexec()), "--oversubscribe", *mca, "-n", str(num_ranks), sys.executable, *argv]
    try:
        proc = subprocess.run(cmd, env=full_env, capture_output=True, text=True,
                              timeout=timeout_s, check=False, cwd=REPO_ROOT)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"mpiexec timed out after {timeout_s} s: {' '.join(cmd)}\n{exc.stdout!r}\n"
                    f"{exc.stderr!r}")
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}"
                    f"\n--- stderr\n{proc.stderr[-4000:]}")


def _selftest(tmp_path: Path, num_ranks: int, mca: tuple[str, ...], env: dict[str, str],
              hosts: int) -> None:
    out = tmp_path / "selftest.json"
    mpirun(num_ranks, ["-m", "ubep.tools.mpi_selftest", "--faults", "--json", str(out)], mca=mca,
           env=env)
    every = json.loads(out.read_text())
    assert len(every) == num_ranks
    expect_modes = 16 if hosts == 1 else 12  # SP is refused across hosts
    for rank, findings in enumerate(every):
        assert findings["hosts"] == hosts, findings
        assert len(findings["modes"]) == expect_modes
        assert findings["errors"] == [], (rank, findings["errors"])
    engines_syncs = {tuple(m.split(":")[:3]) for m in every[0]["modes"]}
    assert len(engines_syncs) == expect_modes  # every engine x sync x layout ran


def test_shared_memory_all_modes_bit_exact(tmp_path: Path) -> None:
    _selftest(tmp_path, 3, _QUIET, {}, hosts=1)


def test_tcp_rma_every_rank_remote_all_modes_bit_exact(tmp_path: Path) -> None:
    _selftest(tmp_path, 3, _TCP, {"UBEP_MPI_FORCE_RMA": "1"}, hosts=3)


def test_two_hosts_of_two_shared_inside_rma_between(tmp_path: Path) -> None:
    _selftest(tmp_path, 4, _TCP, {"UBEP_MPI_RANKS_PER_HOST": "2"}, hosts=2)


# --- smaller checks: this file as the mpiexec worker -------------------------------------------


def _worker_topology(group: Any) -> dict[str, Any]:
    return {
        "hosts": group.num_hosts,
        "host_of": group.host_of,
        "hops": group.topology.hop_matrix().tolist(),
        "same_host": [group.same_host(q) for q in range(group.num_ranks)],
    }


def _worker_sp_refused(group: Any) -> dict[str, Any]:
    from ubep.buffer import Buffer, BufferConfig
    from ubep.errors import InvalidArgumentError

    cfg = BufferConfig(max_tokens_per_rank=8, hidden=64, num_topk=2,
                       num_experts=2 * group.num_ranks, dtype="bf16", sync="sp")
    try:
        Buffer(group, cfg).close()
        outcome = "built"
    except InvalidArgumentError as exc:
        outcome = f"{exc.argument}: {exc.problem}"
    # the group is still usable: a DC buffer works right after
    cfg_dc = BufferConfig(max_tokens_per_rank=8, hidden=64, num_topk=2,
                          num_experts=2 * group.num_ranks, dtype="bf16", sync="dc")
    with Buffer(group, cfg_dc) as buf:
        x = np.full((4, 64), group.rank + 1, np.uint16)
        idx = np.tile(np.arange(2, dtype=np.int64), (4, 1))
        res = buf.dispatch(x, idx, np.ones((4, 2), np.float32))
        rows = int(res.recv_x.shape[0])
    return {"outcome": outcome, "rows": rows}


_STOP_TIMEOUT_S = 4.0
_STOP_MARGIN_S = 2.0  # MPI progress and a loaded 2-core host; a wait sitting in MPI took 15-30 s


def _worker_sigstop(group: Any, out: str) -> dict[str, Any]:
    """The last rank stops itself (SIGSTOP) before a call; the others must raise at their
    deadline, not sit in MPI while it is stopped. The parent sends SIGCONT once they have."""
    import signal
    import time

    from ubep import reference
    from ubep.buffer import Buffer, BufferConfig
    from ubep.errors import RemoteError, TimeoutError

    R, r = group.num_ranks, group.rank
    victim = R - 1
    outcome: dict[str, Any] = {}
    modes = (("asp", "sw"), ("bsp", "tff"))  # flushes before flags: the waits that hung
    for i, (engine, sync) in enumerate(modes):
        cfg = BufferConfig(max_tokens_per_rank=8, hidden=64, num_topk=2, num_experts=2 * R,
                           dtype="bf16", engine=engine, sync=sync, timeout_s=_STOP_TIMEOUT_S)
        x = np.full((8, 64), r + 1, np.uint16)
        idx = np.tile(np.arange(0, 2 * R, R, dtype=np.int64), (8, 1))  # one expert per 2 ranks
        w = np.ones((8, 2), np.float32)
        with Buffer(group, cfg) as buf:
            buf.dispatch(x, idx, w)  # warm: every window touched once
            if r == victim:
                Path(out, f"victim.{i}.pid").write_text(str(os.getpid()))
                os.kill(os.getpid(), signal.SIGSTOP)
            t0 = time.monotonic()
            try:
                buf.dispatch(x, idx, w)
                got = "ok"
            except (TimeoutError, RemoteError) as exc:
                got = type(exc).__name__
            elapsed = time.monotonic() - t0
            if r != victim:
                Path(out, f"survivor.{i}.{r}").write_text(got)
            outcome[f"{engine}:{sync}"] = {"error": got, "elapsed_s": elapsed}
        group.barrier(60)  # the victim is back; close() of the windows is collective later
    # the group still works: a new Buffer, bit-exact against the reference
    cfg = BufferConfig(max_tokens_per_rank=8, hidden=64, num_topk=2, num_experts=2 * R,
                       dtype="bf16", sync="dc", timeout_s=30)
    xs = [np.full((8, 64), q + 1, np.uint16) for q in range(R)]
    idxs = [np.tile(np.array([q % (2 * R), (q + 1) % (2 * R)], np.int64), (8, 1))
            for q in range(R)]
    ws = [np.ones((8, 2), np.float32) for _ in range(R)]
    with Buffer(group, cfg) as buf:
        res = buf.dispatch(xs[r], idxs[r], ws[r])
        ref = reference.dispatch(xs, idxs, ws, cfg.num_experts, layout=cfg.layout)[r]
        outcome["after"] = bool(np.array_equal(res.recv_x, ref.recv_x))
    return outcome


_KILL_TIMEOUT_S = 3.0


def _worker_kill(group: Any, out: str) -> None:
    """With ``on_peer_loss="raise"`` the last rank SIGKILLs itself before a call and every
    survivor must raise within the deadline. Each survivor writes its
    outcome to ``out/kill.<rank>.json`` and leaves at once (the job cannot finish collectively
    without the dead rank)."""
    import signal
    import time

    from ubep.buffer import Buffer, BufferConfig
    from ubep.errors import UbepError

    R, r = group.num_ranks, group.rank
    base = dict(max_tokens_per_rank=8, hidden=64, num_topk=2, num_experts=2 * R, dtype="bf16",
                timeout_s=_KILL_TIMEOUT_S)
    x = np.full((8, 64), r + 1, np.uint16)
    idx = np.tile(np.arange(0, 2 * R, R, dtype=np.int64), (8, 1))  # every rank gets rows
    w = np.ones((8, 2), np.float32)
    with Buffer(group, BufferConfig(**base)) as buf:  # type: ignore[arg-type]
        buf.dispatch(x, idx, w)  # warm: every window touched once
        group.barrier(60)
        if r == R - 1:
            # Only once every survivor has left the barrier: a rank that finished it may still
            # owe a peer the barrier's last message, and its death would fail the barrier there.
            for peer in range(R - 1):
                _wait_for_file(Path(out, f"barrier.{peer}"))
            os.kill(os.getpid(), signal.SIGKILL)
        Path(out, f"barrier.{r}").touch()
        t0 = time.monotonic()
        try:
            buf.dispatch(x, idx, w)
            got, message = "ok", ""
        except UbepError as exc:
            got, message = type(exc).__name__, str(exc)
        elapsed = time.monotonic() - t0
        Path(out, f"kill.{r}.json").write_text(json.dumps(
            {"error": got, "message": message, "elapsed_s": elapsed}))
    os._exit(0)  # no collective teardown with a dead rank


def _worker_barrier_loss(group: Any, out: str) -> None:
    """The last rank SIGKILLs itself before a barrier; each survivor's barrier must raise
    ``PeerLostError`` (MPI's process-failure error, or the liveness check) before its
    deadline, and writes what it raised to ``out/barrier_loss.<rank>.json``."""
    import signal
    import time

    from ubep.errors import UbepError

    r = group.rank
    if r == group.num_ranks - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    try:
        group.barrier(timeout_s=_BARRIER_LOSS_TIMEOUT_S)
        got = "ok"
    except UbepError as exc:
        got = type(exc).__name__
    Path(out, f"barrier_loss.{r}.json").write_text(json.dumps(
        {"error": got, "elapsed_s": time.monotonic() - t0}))
    os._exit(0)


_BARRIER_LOSS_TIMEOUT_S = 30.0
_MASK_CALLS = 24  # calls after the loss, each checked against the oracle


def _wait_for_file(path: Path, timeout_s: float = 90.0) -> None:
    import time

    end = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < end, f"{path} did not appear"
        time.sleep(0.05)


def _stop_then_raise(buf: Any, x: Any, idx: Any, w: Any, out: str, r: int) -> None:
    """SIGSTOP this rank (its pid in ``stopped.json``); once the test continues it, its call
    must raise: write what it raised and leave."""
    import signal

    tmp = Path(out, "stopped.json.tmp")  # renamed: the test never reads it half written
    tmp.write_text(json.dumps({"pid": os.getpid()}))
    tmp.rename(Path(out, "stopped.json"))
    os.kill(os.getpid(), signal.SIGSTOP)
    try:
        buf.dispatch(x, idx, w)
        woke = "returned"
    except Exception as exc:  # what it raised is the result
        woke = f"{type(exc).__name__}: {exc}"
    Path(out, f"mask.{r}.json").write_text(json.dumps({"woke": woke}))
    os._exit(0)


def _worker_mask(group: Any, out: str) -> None:
    """A masking Buffer over MPI (ULFM): the last rank SIGKILLs itself at ``UBEP_TEST_KILL_AT``
    (its second dispatch, its second combine, or between the second and third calls); every
    survivor checks each call, the one that saw the loss included, against the oracle of the
    mask it reports after that dispatch and that combine, and writes ``mask.<rank>.json``."""
    import signal

    from tests._runtime_support import Case, make_inputs
    from tests.buffer.test_elastic import masked_oracle
    from ubep import reference
    from ubep.buffer import Buffer
    from ubep.errors import UbepError
    from ubep.testing import bits, compare

    R, r = group.num_ranks, group.rank
    kill_at = os.environ["UBEP_TEST_KILL_AT"]
    case = Case(os.environ["UBEP_TEST_ENGINE"], os.environ["UBEP_TEST_SYNC"],
                os.environ["UBEP_TEST_LAYOUT"], "bf16", R, 64, "uniform")
    timeout_s = float(os.environ.get("UBEP_TEST_TIMEOUT_S", _KILL_TIMEOUT_S))
    cfg = case.config(8, on_peer_loss="mask", timeout_s=timeout_s)
    errors: list[str] = []
    masks: list[list[int]] = []

    def masked_now() -> list[int]:
        return [q for q, m in enumerate(buf.mask_status()) if m]

    with Buffer(group, cfg) as buf:
        for call in range(2 + _MASK_CALLS):
            xs, idxs, ws = make_inputs(case, cfg.num_experts, [8] * R, 7 * call + 1, "uniform")
            if r == R - 1 and call == 1 and kill_at == "dispatch":
                os.kill(os.getpid(), signal.SIGKILL)
            if r == R - 1 and call == 1 and kill_at == "stop":
                _stop_then_raise(buf, xs[r], idxs[r], ws[r], out, r)
            if kill_at == "stop" and call == 2:
                Path(out, f"past.{r}").write_text("")
            if kill_at == "stop" and call == 2 + _MASK_CALLS // 2:
                _wait_for_file(Path(out, "continued"))  # the rest overlaps the woken rank
            res = buf.dispatch(xs[r], idxs[r], ws[r])
            mask_d = masked_now()
            if r == R - 1 and call == 1 and kill_at == "combine":
                os.kill(os.getpid(), signal.SIGKILL)
            y = buf.combine(res.recv_x, res.handle)
            mask_c = masked_now()
            if r == R - 1 and call == 1 and kill_at == "between":
                os.kill(os.getpid(), signal.SIGKILL)
            ref_d = masked_oracle(xs, idxs, ws, mask_d, cfg.num_experts, cfg.layout)
            ref_c = masked_oracle(xs, idxs, ws, mask_c, cfg.num_experts, cfg.layout)
            errors += [f"call {call}: {e}" for e in compare(res, ref_d[r])]
            want = reference.combine([ref.recv_x for ref in ref_c], ref_c)[r]
            if not np.array_equal(bits(y), bits(want)):
                errors.append(f"call {call}: combine differs")
            masks.append(mask_c)
        for refused in (lambda: buf.mask_ranks([]), lambda: buf.admit()):
            try:
                refused()
                errors.append("mask_ranks/admit served over MPI")
            except UbepError as exc:
                if "one-host group" not in str(exc):
                    errors.append(f"refused for another reason: {exc}")
    Path(out, f"mask.{r}.json").write_text(json.dumps({"errors": errors, "masks": masks}))
    os._exit(0)  # the job's communicator has a dead member: no collective teardown


CLOCK_SHIFT_NS = 7_000_000_000  # rank 1's clock runs 7 s ahead of rank 0's in _worker_clock


def _worker_clock(group: Any) -> dict[str, Any]:
    """``clock_offset`` with rank 1's clock shifted: measurement 1 both ranks take; rank 0 skips
    measurement 2 (rank 1 gives up at its deadline, its ping left unread); measurement 3 both
    take again (that stale ping dropped); the group's own, all ranks on one machine, sends
    nothing and reads 0."""
    from ubep.mpi.clock import clock_offset

    shift = CLOCK_SHIFT_NS if group.rank == 1 else 0

    def clock() -> int:
        return time.monotonic_ns() + shift

    def measure(seq: int, timeout_s: float) -> list[int] | None:
        got = clock_offset(group, seq, timeout_s=timeout_s, measured=[1], clock=clock)
        return None if got is None else [got.offset_ns, got.error_ns]

    first = measure(1, 30.0)
    skipped = measure(2, 0.5) if group.rank == 1 else None
    group.barrier(timeout_s=30)  # rank 1 gave up on measurement 2
    third = measure(3, 30.0)
    own = group.clock_offset(timeout_s=30)
    return {"first": first, "skipped": skipped, "third": third,
            "own": None if own is None else [own.offset_ns, own.error_ns]}


def _worker_main(name: str, out: str) -> None:
    import ubep.mpi

    group = ubep.mpi.init()
    if name == "_worker_kill":
        _worker_kill(group, str(Path(out).parent))
    if name == "_worker_barrier_loss":
        _worker_barrier_loss(group, str(Path(out).parent))
    if name == "_worker_mask":
        _worker_mask(group, str(Path(out).parent))
    if name == "_worker_sigstop":
        result = _worker_sigstop(group, str(Path(out).parent))
    else:
        result = {"_worker_topology": _worker_topology,
                  "_worker_sp_refused": _worker_sp_refused,
                  "_worker_clock": _worker_clock}[name](group)
    every = group.allgather(result)
    if group.rank == 0:
        Path(out).write_text(json.dumps(every))
    group.close()


def _run_worker(tmp_path: Path, name: str, num_ranks: int, mca: tuple[str, ...],
                env: dict[str, str]) -> list[Any]:
    out = tmp_path / f"{name}.json"
    mpirun(num_ranks, [*_WORKER, name, str(out)], mca=mca, env=env, timeout_s=120)
    result: list[Any] = json.loads(out.read_text())
    return result


@pytest.mark.parametrize("per_host", [None, 2, 1])
def test_topology_discovery_matches_host_blocks(tmp_path: Path, per_host: int | None) -> None:
    env = {} if per_host is None else {"UBEP_MPI_RANKS_PER_HOST": str(per_host)}
    every = _run_worker(tmp_path, "_worker_topology", 4, _QUIET if per_host is None else _TCP,
                        env)
    size = 4 if per_host is None else per_host
    host_of = [r // size for r in range(4)]
    # oracle: hop 0 self, then 1 on the same host, 2 on another (1 when no host has two ranks)
    far = 1 if size == 1 else 2
    hops = [[0 if a == b else (1 if host_of[a] == host_of[b] else far) for b in range(4)]
            for a in range(4)]
    for rank, got in enumerate(every):
        assert got["hosts"] == 4 // size
        assert got["host_of"] == host_of
        assert got["hops"] == hops
        assert got["same_host"] == [host_of[q] == host_of[rank] for q in range(4)]


def test_clock_offset_finds_a_shifted_clock_within_its_error_and_survives_a_missing_rank(
        tmp_path: Path) -> None:
    every = _run_worker(tmp_path, "_worker_clock", 2, _TCP, {})
    zero, one = every
    assert zero["first"] == zero["third"] == [0, 0] and zero["skipped"] is None
    for offset_ns, error_ns in (one["first"], one["third"]):
        # rank 0 read its clock between rank 1's send and receive: the error bounds the miss
        assert abs(offset_ns + CLOCK_SHIFT_NS) <= error_ns < 1_000_000_000, (offset_ns, error_ns)
    assert one["skipped"] is None  # rank 0 never answered measurement 2
    assert zero["own"] == one["own"] == [0, 0]  # one machine: one clock


def test_sp_is_refused_across_hosts_naming_sync(tmp_path: Path) -> None:
    every = _run_worker(tmp_path, "_worker_sp_refused", 2, _TCP, {"UBEP_MPI_FORCE_RMA": "1"})
    for got in every:
        assert got["outcome"].startswith("sync: SP cannot run across hosts"), got
    # experts 0 and 1 live on rank 0: it gets 4 tokens x 2 experts from each of the 2 ranks
    assert [got["rows"] for got in every] == [16, 0]



def test_sigstopped_rank_gives_timeout_at_the_deadline_over_tcp_rma(tmp_path: Path) -> None:
    """With one rank stopped, survivors raise at ``timeout_s`` (not
    after the stop, from inside ``MPI_Win_flush``) in a flushing ASP and BSP mode; after SIGCONT
    the stopped rank fails the call too and the group builds a working Buffer."""
    import signal
    import time

    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    out = tmp_path / "sigstop.json"
    env = dict(os.environ) | {"UBEP_MPI_FORCE_RMA": "1", "OMP_NUM_THREADS": "1"}
    if os.geteuid() == 0:
        env |= {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    cmd = [str(_mpiexec()), "--oversubscribe", *_TCP, "-n", "3", sys.executable, *_WORKER,
           "_worker_sigstop", str(out)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True, cwd=REPO_ROOT)
    try:
        for i in range(2):
            deadline = time.monotonic() + 60
            pid_file = tmp_path / f"victim.{i}.pid"
            survivors = [tmp_path / f"survivor.{i}.{r}" for r in range(2)]
            while not all(f.exists() for f in survivors) and time.monotonic() < deadline:
                assert proc.poll() is None, proc.communicate()[0][-4000:]
                time.sleep(0.05)
            assert all(f.exists() for f in survivors), f"round {i}: survivors still waiting"
            os.kill(int(pid_file.read_text()), signal.SIGCONT)
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:  # a failed check: nothing of the job may stay stopped
            for pid_file in tmp_path.glob("victim.*.pid"):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid_file.read_text()), signal.SIGKILL)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 0, output[-4000:]
    every = json.loads(out.read_text())
    for mode in ("asp:sw", "bsp:tff"):
        for r in (0, 1):
            got = every[r][mode]
            # a survivor times out, or sees the other survivor's timeout notice first
            assert got["error"] in ("TimeoutError", "RemoteError"), (r, mode, got)
            assert _STOP_TIMEOUT_S - 0.5 <= got["elapsed_s"] <= _STOP_TIMEOUT_S + _STOP_MARGIN_S, (
                r, mode, got)
        assert "TimeoutError" in {every[r][mode]["error"] for r in (0, 1)}, every
        assert every[2][mode]["error"] in ("TimeoutError", "RemoteError"), every[2]
    assert all(e["after"] for e in every)


def detector(timeout_s: float, period_s: float) -> tuple[str, ...]:
    """Open MPI's heartbeat detector, on its own thread (a rank busy in Python still beats): a
    rank that sent no beat for ``timeout_s`` counts as failed to ULFM's shrink."""
    return ("--mca", "mpi_ft_detector", "true", "--mca", "mpi_ft_detector_thread", "true",
            "--mca", "mpi_ft_detector_period", str(period_s), "--mca", "mpi_ft_detector_timeout",
            str(timeout_s))


# A rank silent this long is declared failed: well above any stall of a loaded 2-core host (a
# rank declared failed while the Buffers make their windows crashes every rank: Open MPI's
# window creation is not failure-safe, docs/MULTIHOST.md), and the Buffers' deadline twice it,
# so a stopped rank is masked, not timed out.
DETECTOR_TIMEOUT_S = 4.0
DETECTOR = detector(DETECTOR_TIMEOUT_S, 1.0)


def _run_ft_job(tmp_path: Path, worker: str, transport: str, env: dict[str, str],
                mca: tuple[str, ...] = (), while_running: Any = None) -> str:
    """3 ranks of ``worker`` under ``mpiexec --with-ft ulfm`` (which keeps mpiexec from ending
    the survivors when a rank dies, docs/MULTIHOST.md), with ``mca`` added; the job's output.
    ``while_running()`` runs once the job started."""
    env = dict(os.environ) | {"OMP_NUM_THREADS": "1"} | env
    mca = (*_QUIET, *mca)
    if transport == "tcp":
        env["UBEP_MPI_FORCE_RMA"] = "1"
        mca = (*_TCP, *mca[len(_QUIET):])
    if os.geteuid() == 0:
        env |= {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    cmd = [str(_mpiexec()), "--oversubscribe", "--with-ft", "ulfm", *mca, "-n", "3",
           sys.executable, *_WORKER, worker, str(tmp_path / f"{worker}.json")]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True, cwd=REPO_ROOT)
    try:
        if while_running is not None:
            while_running()
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
    return output.replace("\x00", "")


@pytest.mark.parametrize("transport", ["shared", "tcp"])
def test_a_killed_rank_makes_every_survivor_raise_within_the_deadline(
        tmp_path: Path, transport: str) -> None:
    """3 ranks, ``on_peer_loss="raise"``: one rank is SIGKILLed before a call and both
    survivors raise within the deadline (a survivor whose put MPI never returns from too:
    ubep.mpi.watchdog)."""
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    output = _run_ft_job(tmp_path, "_worker_kill", transport, {})
    for r in (0, 1):
        path = tmp_path / f"kill.{r}.json"
        assert path.exists(), (r, output[-4000:])
        got = json.loads(path.read_text())
        assert got["error"] in ("PeerLostError", "TimeoutError", "RemoteError"), got
        assert got["elapsed_s"] <= _KILL_TIMEOUT_S + _STOP_MARGIN_S, got


@pytest.mark.parametrize("transport", ["shared", "tcp"])
def test_a_rank_killed_before_a_barrier_makes_the_survivors_raise_peer_lost(
        tmp_path: Path, transport: str) -> None:
    """A group collective that MPI fails (the dead rank's process-failure error under
    ``--with-ft ulfm``) raises ``PeerLostError`` on every survivor, well before its
    deadline, instead of MPI's own exception."""
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    output = _run_ft_job(tmp_path, "_worker_barrier_loss", transport, {})
    for r in (0, 1):
        path = tmp_path / f"barrier_loss.{r}.json"
        assert path.exists(), (r, output[-4000:])
        got = json.loads(path.read_text())
        assert got["error"] == "PeerLostError", got
        assert got["elapsed_s"] < _BARRIER_LOSS_TIMEOUT_S / 2, got


def _kill_if_ours(record: Path) -> None:
    """SIGKILL the process named in ``record`` if it is still a worker of this file (the job's
    process group does not hold the ranks mpiexec's daemon started)."""
    if not record.exists():
        return
    pid = json.loads(record.read_text())["pid"]
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return  # gone
    if b"tests.mpi.test_mpi" in cmdline:
        os.kill(pid, signal.SIGKILL)


def _survivors_checked(tmp_path: Path, output: str) -> list[Any]:
    """Both survivors' records of a ``_worker_mask`` job, each with no oracle mismatch."""
    got = []
    for r in (0, 1):
        path = tmp_path / f"mask.{r}.json"
        assert path.exists(), (r, output[-4000:])
        got.append(json.loads(path.read_text()))
        assert got[-1]["errors"] == [], got[-1]["errors"][:5]
    return got


@pytest.mark.parametrize(("transport", "kill_at", "engine", "sync", "layout"), [
    ("tcp", "dispatch", "asp", "dc", "expert"),
    ("tcp", "combine", "bsp", "tff", "rank"),
    ("tcp", "between", "asp", "sw", "rank"),
    ("shared", "combine", "asp", "sp", "expert"),
])
def test_a_killed_rank_is_masked_over_mpi_and_the_survivors_stay_bit_exact(
        tmp_path: Path, transport: str, kill_at: str, engine: str, sync: str,
        layout: str) -> None:
    """3 ranks, ``on_peer_loss="mask"`` over MPI (ULFM's shrink is the agreement): the last
    rank dies at its second dispatch, its second combine or between calls; both survivors
    end with the same mask, and every call of theirs, the one that saw the loss included, is
    bit-exact against the oracle of the mask it reports."""
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    output = _run_ft_job(tmp_path, "_worker_mask", transport, {
        "UBEP_TEST_KILL_AT": kill_at, "UBEP_TEST_ENGINE": engine, "UBEP_TEST_SYNC": sync,
        "UBEP_TEST_LAYOUT": layout})
    got = _survivors_checked(tmp_path, output)
    assert got[0]["masks"] == got[1]["masks"]
    masks = got[0]["masks"]
    assert masks[0] == [] and masks[-1] == [2]  # served over all three, then over 0 and 1


def test_a_stopped_rank_is_masked_over_mpi_with_the_failure_detector(tmp_path: Path) -> None:
    """3 ranks, ``on_peer_loss="mask"``, Open MPI's heartbeat detector on (its timeout below
    the Buffer's): the last rank SIGSTOPs itself before its second dispatch; the survivors
    mask it and serve on; it is continued while they still serve, and every survivor call,
    before and after it woke, stays bit-exact (nothing it does reaches them: their windows
    are new). The woken rank does not serve again: its call raises, or Open MPI ends the
    process it declared failed (docs/MULTIHOST.md)."""
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    env = {"UBEP_TEST_KILL_AT": "stop", "UBEP_TEST_ENGINE": "asp", "UBEP_TEST_SYNC": "dc",
           "UBEP_TEST_LAYOUT": "expert", "UBEP_TEST_TIMEOUT_S": str(2 * DETECTOR_TIMEOUT_S)}

    def continue_victim() -> None:
        _wait_for_file(tmp_path / "stopped.json")
        victim = json.loads((tmp_path / "stopped.json").read_text())["pid"]
        for r in (0, 1):  # both survivors past the loss, serving without it
            _wait_for_file(tmp_path / f"past.{r}")
        os.kill(victim, signal.SIGCONT)
        (tmp_path / "continued").write_text("")

    try:
        output = _run_ft_job(tmp_path, "_worker_mask", "tcp", env, mca=DETECTOR,
                             while_running=continue_victim)
    finally:
        _kill_if_ours(tmp_path / "stopped.json")  # a stopped victim must not outlive the test
    got = _survivors_checked(tmp_path, output)
    assert got[0]["masks"] == got[1]["masks"] == [[]] + [[2]] * (1 + _MASK_CALLS)
    woke = tmp_path / "mask.2.json"
    if woke.exists():
        assert json.loads(woke.read_text())["woke"] != "returned"


def test_doctor_mpi_probe_runs_both_transports() -> None:
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    from ubep.doctor import mpi_probe

    checks = mpi_probe()
    assert [c.name for c in checks] == ["mpi run: shared memory",
                                        "mpi run: TCP RMA across (virtual) hosts"]
    assert all(c.ok for c in checks), checks
    assert "2 host(s) x 1" in checks[1].detail  # the RMA run really had every rank remote


if __name__ == "__main__":
    _worker_main(sys.argv[1], sys.argv[2])
