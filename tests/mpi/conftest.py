"""The multi-host tests' bed of namespaced hosts (tests/mpi/netns.py), one fixture for all."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.mpi import netns
from tests.mpi.test_mpi import _skip_reason


@pytest.fixture
def make_bed(tmp_path: Path) -> Iterator[Callable[[int], netns.HostBed]]:
    """``make_bed(n)``: a bed of ``n`` hosts, torn down after the test however it ended."""
    reason = _skip_reason() or netns.skip_reason()
    if reason:
        pytest.skip(reason)
    netns.sweep()  # what a killed earlier run left
    beds: list[netns.HostBed] = []

    def make(num_hosts: int) -> netns.HostBed:
        bed = netns.HostBed(num_hosts, tmp_path)
        beds.append(bed)
        return bed

    yield make
    for bed in beds:
        bed.close()
    assert not [n for n in netns.leftovers() if any(n.startswith(b.tag) for b in beds)]
