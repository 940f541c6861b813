"""tests/mpi/netns.py's sweep: it removes the beds whose maker is gone and keeps a live maker's
(a run beside another, in CI or on a shared host, must not lose its hosts mid-test)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable

from tests.mpi import netns


def test_a_sweep_keeps_a_live_makers_bed_and_removes_a_dead_makers(
        make_bed: Callable[..., netns.HostBed]) -> None:
    live, orphan = make_bed(1), make_bed(1)
    # the orphan's maker: a process that has exited (its pid, its start time, as _claim writes)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.2)"])
    started = netns._start_time(child.pid)
    child.wait()
    (netns.OWNERS / orphan.tag).write_text(f"{child.pid} {started}\n")
    gone = netns.sweep()
    assert gone and all(n.startswith(orphan.tag) for n in gone)
    left = netns.leftovers()
    assert any(n.startswith(live.tag) for n in left)
    assert not any(n.startswith(orphan.tag) for n in left)
    assert not (netns.OWNERS / orphan.tag).exists() and (netns.OWNERS / live.tag).exists()
