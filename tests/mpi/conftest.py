"""The multi-host tests' bed of namespaced hosts (tests/mpi/netns.py), one fixture for all."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.mpi import netns
from tests.mpi.test_mpi import _skip_reason


@pytest.fixture
def make_bed(tmp_path: Path) -> Iterator[Callable[..., netns.HostBed]]:
    """``make_bed(n)``: a bed of ``n`` hosts, torn down after the test however it ended;
    ``make_bed(n, monotonic_offsets_s=[...])`` gives each host its own monotonic clock."""
    reason = _skip_reason() or netns.skip_reason()
    if reason:
        pytest.skip(reason)
    netns.sweep()  # what a killed earlier run left
    beds: list[netns.HostBed] = []

    def make(num_hosts: int, monotonic_offsets_s: list[int] | None = None) -> netns.HostBed:
        bed = netns.HostBed(num_hosts, tmp_path, monotonic_offsets_s)
        beds.append(bed)
        return bed

    yield make
    for bed in beds:
        bed.close()
    assert not [n for n in netns.leftovers() if any(n.startswith(b.tag) for b in beds)]
