"""ubep.dist pieces that need no MPI: host layout rules, discovered topology, env variables,
control-record checks."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from ubep.dist.engine import record_check
from ubep.dist.group import _hosts, discovered_topology
from ubep.env import dist_ranks_per_host_from_env
from ubep.errors import InvalidArgumentError


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
    [({}, None), ({"UBEP_DIST_FORCE_RMA": "1"}, 1), ({"UBEP_DIST_FORCE_RMA": "0"}, None),
     ({"UBEP_DIST_RANKS_PER_HOST": "2"}, 2),
     ({"UBEP_DIST_RANKS_PER_HOST": "1", "UBEP_DIST_FORCE_RMA": "1"}, 1)],
)
def test_env_ranks_per_host(env: dict[str, str], want: int | None) -> None:
    assert dist_ranks_per_host_from_env(env) == want


@pytest.mark.parametrize(
    ("env", "name"),
    [({"UBEP_DIST_FORCE_RMA": "yes"}, "UBEP_DIST_FORCE_RMA"),
     ({"UBEP_DIST_RANKS_PER_HOST": "0"}, "UBEP_DIST_RANKS_PER_HOST"),
     ({"UBEP_DIST_RANKS_PER_HOST": "two"}, "UBEP_DIST_RANKS_PER_HOST"),
     ({"UBEP_DIST_RANKS_PER_HOST": "2", "UBEP_DIST_FORCE_RMA": "1"}, "UBEP_DIST_RANKS_PER_HOST")],
)
def test_env_rejects_bad_values(env: dict[str, str], name: str) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        dist_ranks_per_host_from_env(env)
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
    assert verdicts(probed)[1:3] == ["ubep.dist, shared memory: works",
                                     "ubep.dist, TCP RMA: FAILED (see above)"]
