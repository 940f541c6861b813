"""Suite-wide checks: no shared-memory segment of ubep outlives the processes that made it.

Other jobs on the machine may be creating ubep segments at the same time: a segment counts as
leaked only if it appeared during this pytest session and its owner is this process or dead
(``tests._shm``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import pytest

from tests._shm import leaked_since, ubep_segments
from ubep.runtime.shm import SHM_DIR


@pytest.fixture(autouse=True, scope="session")
def no_leaked_segments() -> Iterator[None]:
    before = ubep_segments()
    yield
    leaked = leaked_since(before)
    for name in leaked:  # clean up so one failure does not poison later runs, then fail loudly
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(SHM_DIR, name))
    assert not leaked, f"shared-memory segments left in {SHM_DIR}: {leaked}"
