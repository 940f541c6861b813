"""Tests of ubep.topology: hop classes against a brute-force definition, presets against
docs/CALIBRATION.md (numbers typed in here from the document), validation."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ubep.errors import InvalidArgumentError
from ubep.topology import Topology, cm384, host, nvl72, nvl576


def brute_hop(num_ranks: int, domain_sizes: tuple[int, ...], num_hops: int, a: int, b: int):
    """The definition: class ``h`` cuts the ranks into consecutive groups of
    ``domain_sizes[h]``; two ranks are at the first class with a group holding both, and the
    last class holds everything."""
    for h, size in enumerate(domain_sizes):
        groups = [set(range(s, min(s + size, num_ranks))) for s in range(0, num_ranks, size)]
        if any(a in g and b in g for g in groups):
            return h
    return num_hops - 1


@st.composite
def topologies(draw):
    num_hops = draw(st.integers(1, 4))
    domains: list[int] = []
    if num_hops > 1:
        domains = [1]
        for _ in range(num_hops - 2):
            domains.append(domains[-1] * draw(st.integers(2, 4)))
    num_ranks = draw(st.integers(1, 40))
    return Topology(
        num_ranks=num_ranks,
        ranks_per_node=domains[1] if len(domains) > 1 else num_ranks,
        cores_per_rank=draw(st.integers(1, 8)),
        latency_ns=tuple(float(100 * (h + 1)) for h in range(num_hops)),
        bandwidth_gbps=(10.0,) * num_hops,
        domain_sizes=tuple(domains),
    )


@settings(max_examples=60, deadline=None)
@given(topologies())
def test_hop_and_hop_matrix_match_brute_force(topo):
    matrix = topo.hop_matrix()
    assert matrix.shape == (topo.num_ranks, topo.num_ranks) and matrix.dtype == np.int8
    for a, b in itertools.product(range(topo.num_ranks), repeat=2):
        want = brute_hop(topo.num_ranks, topo.domain_sizes, topo.num_hops, a, b)
        assert topo.hop(a, b) == want
        assert matrix[a, b] == want
    np.testing.assert_array_equal(matrix, matrix.T)
    if topo.num_hops > 1:
        assert (np.diag(matrix) == 0).all()


def test_cm384_hops_and_constants():
    # docs/CALIBRATION.md, Table 2: intra-NPU 218 ns, one hop 929 ns, two hops 2500 ns; ~392 GB/s
    # per NPU, uniform across hops; 48 AIVs per die; 16-NPU nodes.
    topo = cm384(64)
    assert topo.latency_ns == (218.0, 929.0, 2500.0)
    assert topo.bandwidth_gbps == (392.0, 392.0, 392.0)
    assert topo.cores_per_rank == 48 and topo.ranks_per_node == 16 and topo.num_nodes == 4
    assert (topo.hop(0, 0), topo.hop(0, 15), topo.hop(0, 16), topo.hop(17, 63)) == (0, 1, 2, 2)
    assert topo.hop(16, 31) == 1
    assert cm384(8).ranks_per_node == 8 and cm384(8).hop_matrix().max() == 1
    np.testing.assert_array_equal(topo.latency_of_hops(np.array([2, 0, 1])), [2500, 218, 929])


def test_nvl72_nvl576_host_constants():
    # NVL72: 900 GB/s unidirectional per GPU, one NVSwitch tier; NCCL NVLink LL 0.6 us/step.
    topo = nvl72()
    assert topo.num_ranks == 72 and topo.num_hops == 2
    assert topo.latency_ns[1] == 600.0 and topo.bandwidth_gbps == (900.0, 900.0)
    assert topo.hop_matrix()[~np.eye(72, dtype=bool)].min() == 1
    # NVL576 is an extrapolation: NVL72 domains, the second hop scaled by CM384's 2500/929.
    big = nvl576()
    assert big.num_ranks == 576 and big.ranks_per_node == 72
    assert big.latency_ns[2] == pytest.approx(600.0 * 2500.0 / 929.0)
    assert (big.hop(0, 71), big.hop(0, 72)) == (1, 2)
    assert "EXTRAPOLATION" in (nvl576.__doc__ or "")
    # This host: cross-process flag round trip ~0.4 us, so one way ~0.2 us; memcpy ~12.7 GB/s.
    h = host(4, cores_per_rank=1)
    assert h.latency_ns[1] == 200.0 and h.bandwidth_gbps[1] == 12.7
    assert h.latency_ns[0] <= h.latency_ns[1]
    assert h.hop(0, 3) == 1 and h.cores_per_rank == 1
    assert 1 <= host(2).cores_per_rank <= 4


def test_custom_four_tier_fabric():
    topo = Topology(
        num_ranks=32, ranks_per_node=4, cores_per_rank=2,
        latency_ns=(1.0, 2.0, 3.0, 4.0), bandwidth_gbps=(1.0,) * 4, domain_sizes=(1, 4, 16),
    )
    assert (topo.hop(5, 5), topo.hop(4, 7), topo.hop(0, 15), topo.hop(15, 16)) == (0, 1, 2, 3)


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"num_ranks": 0}, "num_ranks"),
        ({"num_ranks": 2.0}, "num_ranks"),
        ({"ranks_per_node": -1}, "ranks_per_node"),
        ({"cores_per_rank": 0}, "cores_per_rank"),
        ({"latency_ns": ()}, "latency_ns"),
        ({"latency_ns": (1.0, -2.0)}, "latency_ns"),
        ({"latency_ns": (1.0, float("nan"))}, "latency_ns"),
        ({"bandwidth_gbps": (1.0,)}, "bandwidth_gbps"),
        ({"bandwidth_gbps": (1.0, 0.0)}, "bandwidth_gbps"),
        ({"domain_sizes": (1, 4)}, "domain_sizes"),
        ({"domain_sizes": (2,)}, "domain_sizes"),
        ({"latency_ns": (1.0,) * 3, "bandwidth_gbps": (1.0,) * 3, "domain_sizes": (1, 1)},
         "domain_sizes"),
        ({"latency_ns": (1.0,) * 4, "bandwidth_gbps": (1.0,) * 4, "domain_sizes": (1, 4, 6)},
         "domain_sizes"),
        ({"latency_ns": (1.0,) * 4, "bandwidth_gbps": (1.0,) * 4}, "domain_sizes"),
    ],
)
def test_topology_validation(kwargs, argument):
    args = {
        "num_ranks": 8, "ranks_per_node": 4, "cores_per_rank": 2,
        "latency_ns": (1.0, 2.0), "bandwidth_gbps": (1.0, 1.0),
    }
    args.update(kwargs)
    with pytest.raises(InvalidArgumentError) as err:
        Topology(**args)
    assert isinstance(err.value, ValueError)
    assert err.value.argument == argument


def test_hop_rejects_ranks_out_of_range_and_presets_validate():
    topo = cm384(16)
    for a, b, argument in [(-1, 0, "src_rank"), (16, 0, "src_rank"), (0, 16, "dst_rank")]:
        with pytest.raises(InvalidArgumentError) as err:
            topo.hop(a, b)
        assert err.value.argument == argument
    with pytest.raises(InvalidArgumentError) as err:
        nvl72(73)
    assert err.value.argument == "num_ranks"
    with pytest.raises(InvalidArgumentError):
        cm384(0)
