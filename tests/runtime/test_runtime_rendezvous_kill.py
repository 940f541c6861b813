"""An environment-variable launch whose rank is SIGKILLed at each step of the set-up.

The job is what docs say a job script does: a fresh 0700 rendezvous directory, ``UBEP_RANK``,
``UBEP_WORLD_SIZE`` and ``UBEP_RENDEZVOUS`` per process, and the directory removed once every
process has exited. A victim rank kills itself at one step of the group rendezvous or of a
Buffer's set-up (after creating its segment, before and after publishing its name, after
mapping the peers', after the barrier before unlinking); the survivor must raise a ubep error
(never hang), and no segment any process of the job created may be left in /dev/shm once the
directory is gone. Every segment name is logged by the processes as it is drawn, so the check
covers segments whose marker the victim never got to write or the survivor removed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ubep.runtime.shm import SHM_DIR

# The victim's hooks: each kills this process at one step of the set-up.
_RANK = r"""
import os, signal, sys
from ubep.runtime import group as G, shm as S
from ubep.buffer import Buffer, BufferConfig

point = sys.argv[1]
victim = os.environ["UBEP_RANK"] == sys.argv[2]
log = sys.argv[3]

def die():
    os.kill(os.getpid(), signal.SIGKILL)

draw = S.new_segment_name
def logged_name():
    name = draw()
    with open(log, "a") as f:
        f.write(name + "\n")
    return name
S.new_segment_name = logged_name
if sys.argv[5:] == ["no-reaper"]:  # as if the rank's own reaper had been killed with it
    G._start_own_reaper = lambda: (None, None)

if victim and point in ("group_created", "group_published"):
    write = G._write_json
    def hooked_write(path, obj):
        if os.path.basename(path).startswith("hello.") and point == "group_created":
            die()
        write(path, obj)
        if os.path.basename(path).startswith("hello.") and point == "group_published":
            die()
    G._write_json = hooked_write
if victim and point == "group_mapped":
    map_group = G.Group._map_group_segments
    def hooked_map(self, hello):
        segs = map_group(self, hello)
        die()
    G.Group._map_group_segments = hooked_map
if victim and point == "group_barrier":
    barrier = G.Group.barrier
    def hooked_barrier(self, timeout_s=None):
        barrier(self, timeout_s)
        if self._barriers == 1:
            die()
    G.Group.barrier = hooked_barrier
if victim and point == "buffer_created":
    create = S.Segment.create.__func__
    def hooked_create(cls, size_bytes, **kw):
        seg = create(cls, size_bytes, **kw)
        if kw["kind"] == "buffer":
            die()
        return seg
    S.Segment.create = classmethod(hooked_create)
if victim and point == "buffer_published":
    allgather = G.Group.allgather
    def hooked_allgather(self, value, timeout_s=None):
        out = allgather(self, value, timeout_s)
        if isinstance(value, str) and value.startswith("ubep-"):
            die()
        return out
    G.Group.allgather = hooked_allgather
if victim and point == "buffer_barrier":
    def hooked_unlink(self):
        die()
    G.ShmGlobalMemory.unlink = hooked_unlink

group = G.group_from_env(timeout_s=float(sys.argv[4]))
cfg = BufferConfig(max_tokens_per_rank=4, hidden=64, num_topk=2, num_experts=4, dtype="bf16",
                   timeout_s=float(sys.argv[4]))
with Buffer(group, cfg):
    pass
group.close()
"""

POINTS = ("group_created", "group_published", "group_mapped", "group_barrier",
          "buffer_created", "buffer_published", "buffer_barrier")


@pytest.mark.parametrize("point", POINTS)
def test_a_rank_killed_during_an_env_launch_set_up_leaves_no_segment(
        tmp_path: Path, point: str) -> None:
    rdv = tmp_path / "rdv"
    rdv.mkdir(mode=0o700)
    log = tmp_path / "names"
    log.touch()
    timeout_s = 10.0  # the survivors' deadline: what they wait for a victim that never said hello
    procs = []
    for rank in range(2):
        env = dict(os.environ, UBEP_RANK=str(rank), UBEP_WORLD_SIZE="2",
                   UBEP_RENDEZVOUS=str(rdv))
        procs.append(subprocess.Popen(
            [sys.executable, "-c", _RANK, point, "1", str(log), str(timeout_s)], env=env,
            text=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
    outs = [p.communicate(timeout=120)[1] for p in procs]
    assert procs[1].returncode == -9, outs[1][-2000:]
    # the survivor raised a ubep error, or, if the victim died after every peer had mapped its
    # segments (after the barrier), finished its set-up
    assert procs[0].returncode in (0, 1), outs[0][-2000:]
    if procs[0].returncode:
        assert "PeerLostError" in outs[0] or "TimeoutError" in outs[0], outs[0][-2000:]
    shutil.rmtree(rdv)  # as the job script does once its processes are gone
    names = log.read_text().split()
    assert names  # the victim drew at least its own segment's name
    left = [n for n in names if os.path.exists(os.path.join(SHM_DIR, n))]
    for name in left:  # do not leave them to the next test
        os.unlink(os.path.join(SHM_DIR, name))
    assert not left, f"{len(left)} of {len(names)} segments left at {point}"


def test_the_sweep_removes_what_a_job_whose_ranks_all_died_left(tmp_path: Path) -> None:
    """No survivor and no reaper of its own (killed with the job): the one rank started dies
    right after creating its group segment; the job script's ``python -m ubep.runtime.reaper
    --sweep DIR`` removes it."""
    rdv = tmp_path / "rdv"
    rdv.mkdir(mode=0o700)
    log = tmp_path / "names"
    log.touch()
    env = dict(os.environ, UBEP_RANK="1", UBEP_WORLD_SIZE="2", UBEP_RENDEZVOUS=str(rdv))
    proc = subprocess.run([sys.executable, "-c", _RANK, "group_created", "1", str(log), "10",
                           "no-reaper"], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr[-2000:]
    names = log.read_text().split()
    assert len(names) == 1 and os.path.exists(os.path.join(SHM_DIR, names[0]))
    sweep = subprocess.run([sys.executable, "-m", "ubep.runtime.reaper", "--sweep", str(rdv)],
                           capture_output=True, text=True, timeout=120)
    assert sweep.returncode == 0 and names[0] in sweep.stdout, sweep
    shutil.rmtree(rdv)
    assert not os.path.exists(os.path.join(SHM_DIR, names[0]))


def test_a_lone_rank_killed_at_the_rendezvous_leaves_no_segment(tmp_path: Path) -> None:
    """No peer ever comes: rank 0 waits at the rendezvous for rank 1 with its group segment
    named, is SIGKILLed there, and the job script removes the directory as the docs say, without
    a sweep. The rank's own reaper (a process of its own session, which the kill does not
    reach) removes the segment: nothing of the job is left in /dev/shm."""
    rdv = tmp_path / "rdv"
    rdv.mkdir(mode=0o700)
    log = tmp_path / "names"
    log.touch()
    env = dict(os.environ, UBEP_RANK="0", UBEP_WORLD_SIZE="2", UBEP_RENDEZVOUS=str(rdv))
    rank = subprocess.Popen([sys.executable, "-c", _RANK, "none", "1", str(log), "60"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not (rdv / "hello.0.json").exists():  # its segment is named: it waits for rank 1
        assert time.monotonic() < deadline and rank.poll() is None, rank.stderr
        time.sleep(0.02)
    rank.kill()
    rank.communicate(timeout=30)
    assert rank.returncode == -9
    shutil.rmtree(rdv)  # as the job script does once its processes are gone
    names = log.read_text().split()
    assert len(names) == 1  # the group segment, named when the rank was killed
    path = os.path.join(SHM_DIR, names[0])
    deadline = time.monotonic() + 30  # the reaper's poll is 0.1 s; a loaded host is slower
    while os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = os.path.exists(path)
    if left:  # do not leave it to the next test
        os.unlink(path)
    assert not left, "the killed rank's group segment outlived it"
