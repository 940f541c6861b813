"""The simulator's model against closed forms and hand-computed timelines on tiny cases.

Every expected number here is computed in the test from the model's equations
(docs/SIMULATOR.md), not copied from the simulator's output.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from ubep.errors import InvalidArgumentError
from ubep.sched.plan import Plan
from ubep.sim import FabricModel, build_spec, simulate
from ubep.topology import Topology

ROW = 1000  # bytes per row


def fabric(**over: float) -> FabricModel:
    base = dict(init_ns=1000.0, issue_ns=100.0, core_bandwidth_gbps=10.0, latency_exposure=0.5,
                contention_cores=4.0, contention_sharpness=2.0, barrier_ns=0.0, flag_ns=0.0,
                poll_ns=0.0, count_expert_ns=0.0, cumsum_entry_ns=0.0, vector_op_ns=0.0)
    base.update(over)
    return FabricModel(name="test", **base)  # type: ignore[arg-type]


def two_ranks(cores: int = 2) -> Topology:
    return Topology(num_ranks=2, ranks_per_node=2, cores_per_rank=cores, latency_ns=(50.0, 400.0),
                    bandwidth_gbps=(20.0, 20.0))


def plan(rank: int, units: list[tuple[int, int, int, int]], *, n_send: int, n_count: int,
         num_ranks: int = 2, topo: Topology | None = None) -> Plan:
    """A hand-made plan; ``units`` = (core, token, expert, slot) in issue order per core."""
    topo = topo or two_ranks()
    units = sorted(units, key=lambda u: u[0])  # stable: keeps the issue order inside a core
    core = np.array([u[0] for u in units], dtype=np.int32)
    expert = np.array([u[2] for u in units], dtype=np.int64)
    dst = expert // (num_ranks // num_ranks)  # one expert per rank
    hop = np.array([topo.hop(rank, int(d)) for d in dst], dtype=np.int64)
    ptr = np.zeros(n_send + 1, dtype=np.int64)
    np.cumsum(np.bincount(core, minlength=n_send), out=ptr[1:])
    return Plan(rank=rank, num_ranks=num_ranks, num_experts=num_ranks, layout="expert",
                policy="balanced", num_send_cores=n_send, num_count_cores=n_count,
                send_token=np.array([u[1] for u in units], dtype=np.int64),
                send_k=np.zeros(len(units), dtype=np.int64), send_expert=expert,
                send_dst_rank=dst.astype(np.int64), send_hop=hop,
                send_slot=np.array([u[3] for u in units], dtype=np.int64), send_core=core,
                core_ptr=ptr,
                count_expert_ptr=(np.arange(n_count + 1, dtype=np.int64) * num_ranks) // n_count)


def speed(f: FabricModel, k: int) -> float:
    return (1 + (k / f.contention_cores) ** f.contention_sharpness) ** (-1 / f.contention_sharpness)


@pytest.mark.parametrize("mode", ["analytic", "events"])
def test_one_unit_one_core_closed_form(mode: str) -> None:
    f, topo = fabric(), two_ranks()
    plans = [plan(0, [(0, 0, 1, 0)], n_send=1, n_count=1), plan(1, [], n_send=1, n_count=1)]
    res = simulate(plans, topo, f, engine="asp", sync="sp", row_bytes=ROW, mode=mode)
    work = 100 + ROW / 10 + 0.5 * 400  # issue + bytes / core rate + exposed latency
    end = 1000 + work / speed(f, 1)
    land = end + ROW / 20 + 400  # source port serialisation, then the flight
    assert res.unit_end_ns[0] == pytest.approx(end, abs=1e-6)
    assert res.unit_land_ns[0] == pytest.approx(land, abs=1e-2)
    # Rank 1 reorders the row on core 0 (free since Init): a local copy of the row plus SP's
    # sentinel reset; counts cost nothing here, so the prefix sums are ready on time.
    consume = 100 + ROW / 10 + 0.5 * 50 + ROW / 10
    assert res.item_end_ns[0] == pytest.approx(land + consume, abs=1e-2)
    assert res.latency_ns == pytest.approx(land + consume, abs=1e-2)
    spans = res.timeline.spans(rank=0, core=0, task="send")
    assert len(spans) == 1 and spans[0].start_ns == 1000.0
    assert spans[0].end_ns == pytest.approx(end, abs=1e-6)


@pytest.mark.parametrize("mode", ["analytic", "events"])
def test_two_cores_contend_for_one_rank(mode: str) -> None:
    f, topo = fabric(), two_ranks(cores=3)
    # Core 0 sends one row, core 1 two rows, all to rank 1.
    units = [(0, 0, 1, 0), (1, 1, 1, 1), (1, 2, 1, 2)]
    plans = [plan(0, units, n_send=2, n_count=1, topo=topo),
             plan(1, [], n_send=2, n_count=1, topo=topo)]
    res = simulate(plans, topo, f, engine="asp", sync="tff", row_bytes=ROW, mode=mode)
    wire = math.ceil(ROW / 480) * 512  # TFF blocks
    w = 100 + wire / 10 + 0.5 * 400
    # Processor sharing: both cores at speed(2) until core 0 is done, then core 1 alone.
    t1 = 1000 + w / speed(f, 2)
    t2 = t1 + w / speed(f, 1)
    np.testing.assert_allclose(res.unit_end_ns, [t1, t1, t2], atol=1e-6)
    # The source port serialises the two rows that leave at t1 (uid order), then the third.
    s = wire / 20
    np.testing.assert_allclose(res.unit_land_ns, [t1 + s + 400, t1 + 2 * s + 400,
                                                  max(t2, t1 + 2 * s) + s + 400], atol=1e-2)


def test_bsp_two_ranks_two_cores_hand_timeline() -> None:
    f = fabric(barrier_ns=300.0, flag_ns=20.0, poll_ns=10.0, count_expert_ns=5.0,
               cumsum_entry_ns=1.0, contention_cores=1e6)  # no contention: speed 1
    topo = two_ranks()
    # Each rank: core 0 sends one row to the other rank, core 1 one row to itself.
    plans = [plan(0, [(0, 0, 1, 0), (1, 1, 0, 0)], n_send=2, n_count=2),
             plan(1, [(0, 0, 0, 0), (1, 1, 1, 0)], n_send=2, n_count=2)]
    res = simulate(plans, topo, f, engine="bsp", sync="sw", row_bytes=ROW)
    ev = simulate(plans, topo, f, engine="bsp", sync="sw", row_bytes=ROW, mode="events")
    lat0, lat1 = 50.0, 400.0
    remote_end = 1000 + 100 + 100 + 0.5 * lat1
    local_end = 1000 + 100 + 100 + 0.5 * lat0
    remote_ack = remote_end + ROW / 20 + lat1 + lat1  # land, then the acknowledgement
    local_ack = local_end + 2 * lat0
    b1 = max(remote_end, local_end, remote_ack, local_ack) + 300
    # Flag phase: core c counts expert c (owned by rank c), fences one round trip to rank c,
    # writes the word. Rank r's word for rank d lands one latency later.
    fence = {0: {0: 2 * lat0, 1: 2 * lat1}, 1: {0: 2 * lat1, 1: 2 * lat0}}
    flag_end = {(r, c): b1 + 5 + fence[r][c] + 20 for r in (0, 1) for c in (0, 1)}
    lat = {(0, 0): lat0, (0, 1): lat1, (1, 0): lat1, (1, 1): lat0}
    # Receiver d polls the word from source 0 on core 0 and from source 1 on core 1.
    verify = {(d, c): max(flag_end[(d, c)], flag_end[(c, d)] + lat[(c, d)]) + 10
              for d in (0, 1) for c in (0, 1)}
    b2 = {d: max(verify[(d, 0)], verify[(d, 1)]) + 300 for d in (0, 1)}
    cum = {d: b2[d] + 1.0 * 2 * 1 for d in (0, 1)}
    row = 100 + ROW / 10 + 0.5 * lat0  # reorder = a local copy
    # Two rows per receiver, one per core: both start when the prefix sums are done.
    end = {d: cum[d] + row for d in (0, 1)}
    for r in (0, 1):
        assert res.rank_end_ns[r] == pytest.approx(end[r], abs=1e-6)
        assert ev.rank_end_ns[r] == pytest.approx(end[r], abs=1e-2)
        barriers = res.timeline.spans(rank=r, task="barrier")
        assert sorted({round(b.end_ns, 6) for b in barriers}) == [round(b1, 6), round(b2[r], 6)]
        for c in (0, 1):
            (fl,) = res.timeline.spans(rank=r, core=c, task="flag")
            assert (fl.start_ns, fl.end_ns) == pytest.approx((b1, flag_end[(r, c)]))
            (ve,) = res.timeline.spans(rank=r, core=c, task="verify")
            assert ve.end_ns == pytest.approx(verify[(r, c)])


def test_dc_waits_for_the_batch_checksum() -> None:
    f, topo = fabric(flag_ns=30.0, vector_op_ns=7.0), two_ranks()
    # Rank 0 core 0 sends two rows to rank 1: one DC batch; its checksum follows the second.
    plans = [plan(0, [(0, 0, 1, 0), (0, 1, 1, 1)], n_send=1, n_count=1),
             plan(1, [], n_send=1, n_count=1)]
    res = simulate(plans, topo, f, engine="asp", sync="dc", row_bytes=ROW)
    blocks = math.ceil(ROW / 512)
    w = 100 + ROW / 10 + 0.5 * 400 + blocks * 7.0
    e1 = 1000 + w / speed(f, 1)
    e2 = e1 + (w + 30.0) / speed(f, 1)  # the last row of the batch also sends the checksum
    np.testing.assert_allclose(res.unit_end_ns, [e1, e2], atol=1e-6)
    land2 = e2 + ROW / 20 + 400
    ready = max(e2 + 400, land2)
    np.testing.assert_allclose(res.unit_ready_ns, [ready, ready], atol=1e-6)


@pytest.mark.parametrize("mode", ["analytic", "events"])
@pytest.mark.parametrize("fraction", [1.0, 0.25])
def test_asp_sw_fences_each_batch_then_flags(mode: str, fraction: float) -> None:
    f, topo = fabric(flag_ns=30.0, fence_rtt_fraction=fraction), two_ranks()
    plans = [plan(0, [(0, 0, 1, 0), (0, 1, 1, 1)], n_send=1, n_count=1),
             plan(1, [], n_send=1, n_count=1)]
    res = simulate(plans, topo, f, engine="asp", sync="sw", row_bytes=ROW, mode=mode)
    w = 100 + ROW / 10 + 0.5 * 400
    e1 = 1000 + w / speed(f, 1)
    # The batch's last row also writes the flag (shared work); the fence is the core's own
    # stall for a share of that store's round trip, outside the shared send machinery.
    fence = fraction * (2 * 400 + ROW / 20)
    e2 = e1 + (w + 30.0) / speed(f, 1) + fence
    np.testing.assert_allclose(res.unit_end_ns, [e1, e2], atol=1e-6)
    land2 = e2 + ROW / 20 + 400
    ready = max(e2 + 400, land2)
    np.testing.assert_allclose(res.unit_ready_ns, [ready, ready], atol=1e-2)


def test_bsp_requires_sw_and_plans_must_match() -> None:
    f, topo = fabric(), two_ranks()
    plans = [plan(0, [(0, 0, 1, 0)], n_send=1, n_count=1), plan(1, [], n_send=1, n_count=1)]
    with pytest.raises(InvalidArgumentError) as exc:
        build_spec(plans, topo, f, engine="bsp", sync="tff", row_bytes=ROW)
    assert exc.value.argument == "sync"
    with pytest.raises(InvalidArgumentError) as exc:
        build_spec(plans[:1], topo, f, engine="asp", sync="sp", row_bytes=ROW)
    assert exc.value.argument == "plans"
    with pytest.raises(InvalidArgumentError) as exc:
        build_spec(plans[::-1], topo, f, engine="asp", sync="sp", row_bytes=ROW)
    assert exc.value.argument == "plans"
    with pytest.raises(InvalidArgumentError) as exc:
        simulate(plans, topo, f, engine="asp", sync="sp", row_bytes=ROW, mode="fast")
    assert exc.value.argument == "mode"
    with pytest.raises(InvalidArgumentError) as exc:
        fabric(latency_exposure=1.5)
    assert exc.value.argument == "latency_exposure"


def test_contention_curve_matches_its_formula() -> None:
    f = fabric(contention_cores=13.0, contention_sharpness=2.5)
    for k in (1, 8, 16, 48):
        assert float(f.speed(k)) == pytest.approx(speed(f, k))
        assert float(f.efficiency(k)) == pytest.approx(speed(f, k) / speed(f, 8))
    # Aggregate throughput k * speed(k) never falls as cores are added; per-core speed does.
    ks = np.arange(1, 200)
    agg = ks * f.speed(ks)
    assert np.all(np.diff(agg) > 0) and np.all(np.diff(f.speed(ks)) < 0)
