"""ubep.launch, groups (spawned and env-var launched) and shared-memory segments."""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from ubep import topology
from ubep.errors import RankFailedError, TimeoutError, UbepError
from ubep.runtime import launch
from ubep.runtime.shm import SHM_DIR, Segment


def _worker_identity(group: Any, scale: int) -> tuple[int, int, int, list[Any], str]:
    group.barrier()
    values = group.allgather(group.rank * scale)
    group.barrier()
    return group.rank, group.num_ranks, os.getpid(), values, group.topology.name


def test_results_come_back_in_rank_order() -> None:
    out = launch(_worker_identity, 3, 7, timeout_s=120)
    assert [o[0] for o in out] == [0, 1, 2]
    assert all(o[1] == 3 and o[3] == [0, 7, 14] for o in out)
    assert len({o[2] for o in out}) == 3 and os.getpid() not in {o[2] for o in out}
    assert out[0][4] == topology.host(3).name


def test_topology_is_passed_to_the_group() -> None:
    topo = topology.nvl72(2, cores_per_rank=4)
    out = launch(_worker_identity, 2, 1, timeout_s=120, topology=topo)
    assert out[1][4] == topo.name


def _worker_threads(group: Any) -> tuple[str | None, ...]:
    return tuple(os.environ.get(v) for v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                                            "MKL_NUM_THREADS"))


def test_ranks_get_one_compute_thread_unless_the_caller_chose(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "3")
    assert launch(_worker_threads, 2) == [("1", "3", "1")] * 2
    # the parent's own environment is as it was
    assert "OMP_NUM_THREADS" not in os.environ and os.environ["OPENBLAS_NUM_THREADS"] == "3"


def _worker_raise(group: Any) -> None:
    if group.rank == 1:
        raise KeyError("boom on rank one")
    group.barrier(60)


def test_a_rank_exception_is_reraised_with_rank_and_traceback() -> None:
    with pytest.raises(RankFailedError) as info:
        launch(_worker_raise, 2, timeout_s=120)
    err = info.value
    assert err.rank == 1 and err.remote_type == "KeyError"
    assert "_worker_raise" in err.remote_traceback and "boom on rank one" in str(err)
    assert isinstance(err.__cause__, KeyError)
    # rank 0 was waiting in a barrier for rank 1: it reports the lost peer, not a hang
    assert "PeerLostError" in err.failures[0]


def _worker_hang(group: Any) -> None:
    time.sleep(600)


def test_hanging_ranks_are_killed_after_timeout() -> None:
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"rank\(s\) \[0, 1\] did not finish"):
        launch(_worker_hang, 2, timeout_s=5)
    assert time.monotonic() - start < 60


def _worker_sigkill(group: Any) -> None:
    if group.rank == 0:
        os.kill(os.getpid(), signal.SIGKILL)


def test_a_killed_rank_is_reported_with_its_signal() -> None:
    with pytest.raises(RankFailedError) as info:
        launch(_worker_sigkill, 2, timeout_s=60)
    assert info.value.rank == 0 and info.value.exitcode == -signal.SIGKILL
    assert info.value.results == {1: None}


def test_bad_launch_arguments() -> None:
    with pytest.raises(ValueError, match="num_ranks"):
        launch(_worker_identity, 0)
    with pytest.raises(ValueError, match="timeout_s"):
        launch(_worker_identity, 1, 1, timeout_s=0)


_ENV_CHILD = """
import json, sys
from ubep.runtime import group_from_env
g = group_from_env(timeout_s=60)
g.barrier()
print(json.dumps({"rank": g.rank, "n": g.num_ranks, "all": g.allgather(g.rank + 10),
                  "gid": g.group_id.hex()}))
g.close()
"""


def test_env_var_launch() -> None:
    with tempfile.TemporaryDirectory(prefix="ubep-test-") as rdv:
        os.chmod(rdv, 0o700)
        procs = []
        for rank in range(2):
            env = dict(os.environ, UBEP_RANK=str(rank), UBEP_WORLD_SIZE="2", UBEP_RENDEZVOUS=rdv)
            procs.append(subprocess.Popen([sys.executable, "-c", _ENV_CHILD], env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          text=True))
        outs = []
        for p in procs:
            stdout, stderr = p.communicate(timeout=120)
            assert p.returncode == 0, stderr
            outs.append(json.loads(stdout.strip().splitlines()[-1]))
    assert [o["rank"] for o in outs] == [0, 1]
    assert all(o["all"] == [10, 11] and o["n"] == 2 for o in outs)
    assert outs[0]["gid"] == outs[1]["gid"]


def test_env_var_launch_rejects_a_shared_directory() -> None:
    with tempfile.TemporaryDirectory(prefix="ubep-test-") as rdv:
        os.chmod(rdv, 0o755)
        env = dict(os.environ, UBEP_RANK="0", UBEP_WORLD_SIZE="1", UBEP_RENDEZVOUS=rdv)
        p = subprocess.run([sys.executable, "-c", _ENV_CHILD], env=env, capture_output=True,
                           text=True, timeout=60)
        assert p.returncode != 0 and "mode 0700" in p.stderr


# --- segments -------------------------------------------------------------------------------


def test_segment_is_private_unguessable_and_prefaulted() -> None:
    seg = Segment.create(3 * 4096 + 1, group_id=b"g" * 16, owner_rank=0, kind="buffer")
    try:
        path = os.path.join(SHM_DIR, seg.name)
        st = os.stat(path)
        assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.getuid()
        assert re.fullmatch(r"ubep-[0-9a-f]{32}", seg.name)
        assert st.st_size == 4 * 4096 == seg.size  # rounded up to pages
        # pre-faulted: every page is resident before anything touches it
        with open(f"/proc/{os.getpid()}/smaps") as f:
            smaps = f.read()
        block = smaps[smaps.index(seg.name):].split("VmFlags")[0]
        rss_kb = int(re.search(r"\nRss:\s+(\d+) kB", block).group(1))  # type: ignore[union-attr]
        assert rss_kb == seg.size // 1024
        peer = Segment.open_peer(seg.name, size_bytes=seg.size, group_id=b"g" * 16,
                                 owner_rank=0, kind="buffer")
        peer.array[300] = 42
        assert seg.array[300] == 42  # the same memory
        peer.close()
    finally:
        seg.close()
    assert not os.path.exists(path)


@pytest.mark.parametrize("problem", ["mode", "size", "group", "owner", "name"])
def test_peer_segment_checks(problem: str) -> None:
    seg = Segment.create(4096, group_id=b"g" * 16, owner_rank=1, kind="buffer")
    try:
        kwargs: dict[str, Any] = dict(size_bytes=4096, group_id=b"g" * 16, owner_rank=1,
                                      kind="buffer")
        name = seg.name
        if problem == "mode":
            os.chmod(os.path.join(SHM_DIR, seg.name), 0o644)
        elif problem == "size":
            kwargs["size_bytes"] = 8192
        elif problem == "group":
            kwargs["group_id"] = b"h" * 16
        elif problem == "owner":
            kwargs["owner_rank"] = 0
        else:
            name = "../" + seg.name
        with pytest.raises(UbepError):
            Segment.open_peer(name, **kwargs)
    finally:
        seg.close()


def _worker_names(group: Any) -> list[str]:
    return [seg.name for seg in group._segments]


def test_no_segment_survives_a_launch() -> None:
    names = launch(_worker_names, 2, timeout_s=120)
    assert names[0] == names[1] and len(names[0]) == 2
    # unlinked as soon as every rank had mapped them, i.e. already while the ranks ran
    assert not [n for n in names[0] if os.path.exists(os.path.join(SHM_DIR, n))]


# --- nothing outlives a SIGKILL --------------------------------------------------------------

REPO_ROOT = Path(__file__).resolve().parents[2]
# The launching parent is this module run as ``python -m tests.runtime.test_runtime_launch``
# from the repository root; its ranks import _worker_linger from the package, not __main__.
_LAUNCHER = ["-m", "tests.runtime.test_runtime_launch"]


def _worker_linger(group: Any) -> None:
    """Hold a segment that is still named (recorded in the rendezvous directory), then stay."""
    Segment.create(4096, group_id=group.group_id, owner_rank=group.rank, kind="buffer",
                   marker_dir=group.rendezvous)
    time.sleep(300)


def _wait_for(cond: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in (b"Z", b"X")


def _group_alive(pgid: int) -> list[int]:
    """Processes of process group ``pgid`` still running (not zombies)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] not in (b"Z", b"X"):
                out.append(int(entry))
    return out


def _job_files(rdv: Any) -> tuple[list[str], list[int]]:
    """Segment names recorded in the rendezvous directory, and the pids of the hellos."""
    names = [e.split(".", 1)[1] for e in os.listdir(rdv) if e.startswith("segment.")]
    pids = []
    for e in os.listdir(rdv):
        if re.fullmatch(r"hello\.\d+\.json", e):
            with open(os.path.join(rdv, e)) as f:
                pids.append(json.load(f)["pid"])
    return names, pids


@pytest.mark.parametrize("kill", ["launcher", "whole-job-at-rendezvous"])
def test_nothing_survives_sigkill_of_the_launcher_or_the_whole_job(tmp_path: Any,
                                                                   kill: str) -> None:
    """SIGKILL of the launching parent: the ranks die with it (not at their timeout_s) and the
    reaper removes their named segments and the rendezvous directory. SIGKILL of the parent and
    every rank as soon as the first rank has created its group segment (the others have not
    reached the rendezvous yet): the reaper, in its own session, removes all the same."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = dict(os.environ, TMPDIR=str(tmp))
    parent = subprocess.Popen([sys.executable, *_LAUNCHER], env=env, start_new_session=True,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO_ROOT)
    try:
        _wait_for(lambda: any(tmp.glob("ubep-rdv-*")), 60, "the rendezvous directory")
        rdv = next(tmp.glob("ubep-rdv-*"))
        if kill == "launcher":  # both ranks hold a named segment of their own, then linger
            _wait_for(lambda: len(_job_files(rdv)[0]) == 2 and len(_job_files(rdv)[1]) == 2
                      and all(".json" not in e and "tmp" not in e for e in os.listdir(rdv)
                              if e.startswith("segment.")), 60, "both ranks' segments")
            time.sleep(0.5)  # the group segments are unlinked; only the lingering ones stay
            names, pids = _job_files(rdv)
            os.kill(parent.pid, signal.SIGKILL)
        else:  # the whole process group, at the first segment of a rank at the rendezvous
            _wait_for(lambda: len(_job_files(rdv)[0]) >= 1, 60, "a rank's group segment")
            os.killpg(parent.pid, signal.SIGKILL)
            names, pids = _job_files(rdv)
        parent.wait(10)
        _wait_for(lambda: not any(map(_alive, pids)), 5, "the ranks to die with the launcher")
        _wait_for(lambda: not rdv.exists(), 20, "the reaper to remove the rendezvous directory")
    finally:
        _wait_for(lambda: not _group_alive(parent.pid), 5, "every process of the job to exit")
    assert names, "the job had created no segment: the test did not exercise the window"
    assert not [n for n in names if os.path.exists(os.path.join(SHM_DIR, n))]
    assert not list(tmp.iterdir())


def _launch_lingering_job() -> None:
    from tests.runtime.test_runtime_launch import _worker_linger as linger

    launch(linger, 2, timeout_s=300)


if __name__ == "__main__":
    _launch_lingering_job()
