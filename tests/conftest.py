"""Suite-wide checks: no shared-memory segment of ubep outlives the test that made it."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

SHM_DIR = "/dev/shm"


def _ubep_segments() -> set[str]:
    try:
        return {n for n in os.listdir(SHM_DIR) if n.startswith("ubep")}
    except FileNotFoundError:
        return set()


@pytest.fixture(autouse=True, scope="session")
def no_leaked_segments() -> Iterator[None]:
    before = _ubep_segments()
    yield
    leaked = _ubep_segments() - before
    for name in leaked:  # clean up so one failure does not poison later runs, then fail loudly
        os.unlink(os.path.join(SHM_DIR, name))
    assert not leaked, f"shared-memory segments left in {SHM_DIR}: {sorted(leaked)}"
