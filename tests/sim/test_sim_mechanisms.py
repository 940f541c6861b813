"""The mechanisms of the fitted model, each on a small case computed by hand from its
definition in docs/SIMULATOR.md (section 1.10), and the fit's machinery on closed-form
training points."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tests.sim.test_sim_model import ROW, fabric, plan, speed, two_ranks
from ubep.errors import InvalidArgumentError
from ubep.sim import build_spec, simulate
from ubep.sim.fit import ASSUMED, TrainingPoint, apply_assumed, fit, leave_one_out
from ubep.sim.workload import UBEP, Workload, aux_cores, core_split
from ubep.topology import Topology, cm384


@pytest.mark.parametrize("mode", ["analytic", "events"])
def test_fence_stall_leaves_the_shared_machinery_to_the_other_core(mode: str) -> None:
    # Two cores, one row each to rank 1 (ASP SW: each row is its core's batch, so each core
    # fences after it): both rows share the machinery at speed(2); each core then stalls for
    # its own share of the round trip, which delays nothing of the other core.
    f, topo = fabric(flag_ns=0.0, fence_rtt_fraction=0.5), two_ranks(cores=3)
    plans = [plan(0, [(0, 0, 1, 0), (1, 1, 1, 1)], n_send=2, n_count=1, topo=topo),
             plan(1, [], n_send=2, n_count=1, topo=topo)]
    res = simulate(plans, topo, f, engine="asp", sync="sw", row_bytes=ROW, mode=mode)
    w = 100 + ROW / 10 + 0.5 * 400
    stall = 0.5 * (2 * 400 + ROW / 20)
    end = 1000 + w / speed(f, 2) + stall
    np.testing.assert_allclose(res.unit_end_ns, [end, end], atol=1e-6)
    np.testing.assert_allclose(res.core_send_end_ns[0], [end, end], atol=1e-6)


def test_store_completion_ends_at_the_farthest_acknowledgement() -> None:
    # Program (1): a core is done when its last store is acknowledged. One core sends a local
    # row then a remote one; the other core sends one local row.
    f, topo = fabric(contention_cores=1e6), two_ranks(cores=3)  # speed 1: no contention
    plans = [plan(0, [(0, 0, 0, 0), (0, 1, 1, 0), (1, 2, 0, 1)], n_send=2, n_count=1,
                  topo=topo),
             plan(1, [], n_send=2, n_count=1, topo=topo)]
    res = simulate(plans, topo, f, engine="asp", sync="sp", row_bytes=ROW)
    w_local, w_remote = 100 + ROW / 10 + 0.5 * 50, 100 + ROW / 10 + 0.5 * 400
    remote_end = 1000 + w_local + w_remote
    ack_core0 = remote_end + ROW / 20 + 400 + 400  # serialise, fly, acknowledgement back
    ack_core1 = 1000 + w_local + 50 + 50
    lat = res.send_latency_ns(until="ack")
    np.testing.assert_allclose(lat[0], [ack_core0 - 1000, ack_core1 - 1000], atol=1e-2)
    np.testing.assert_allclose(res.send_latency_ns()[0], [remote_end - 1000, w_local],
                               atol=1e-6)
    with pytest.raises(InvalidArgumentError):
        res.send_latency_ns(until="never")


def test_metadata_rides_with_asp_dispatch_rows_only() -> None:
    f, topo = fabric(metadata_ratio=0.132), two_ranks()
    plans = [plan(0, [(0, 0, 1, 0)], n_send=1, n_count=1), plan(1, [], n_send=1, n_count=1)]
    asp = build_spec(plans, topo, f, engine="asp", sync="sp", row_bytes=ROW)
    bsp = build_spec(plans, topo, f, engine="bsp", sync="sw", row_bytes=ROW)
    assert asp.unit_wire_bytes[0] == pytest.approx(ROW * 1.132)
    assert bsp.unit_wire_bytes[0] == ROW
    # The extra bytes cost the core its copy time: 0.132 * ROW / core rate more work.
    assert asp.unit_work_ns[0] - bsp.unit_work_ns[0] == pytest.approx(0.132 * ROW / 10)


def test_cumsum_hands_each_count_cores_partial_sums_on() -> None:
    f, topo = fabric(cumsum_entry_ns=2.0, cumsum_group_sync_ns=300.0), two_ranks(cores=4)
    for n_count in (1, 2):
        plans = [plan(r, [(0, 0, 1 - r, 0)], n_send=1, n_count=n_count, topo=topo)
                 for r in (0, 1)]
        spec = build_spec(plans, topo, f, engine="asp", sync="sp", row_bytes=ROW)
        # R x L = 2 entries at 2 ns, plus one hand-off per count core.
        assert spec.cumsum_ns == pytest.approx(2 * 2.0 + n_count * 300.0)
        bsp = build_spec([plan(r, [(0, 0, 1 - r, 0)], n_send=1, n_count=n_count, topo=topo)
                          for r in (0, 1)], topo, f, engine="bsp", sync="sw", row_bytes=ROW)
        assert bsp.cumsum_ns == pytest.approx(2 * 2.0)  # every BSP core sums for itself


def test_bsp_chunk_fence_takes_its_share_of_the_round_trip() -> None:
    f, topo = fabric(count_expert_ns=5.0, flag_ns=20.0, fence_rtt_fraction=0.25), two_ranks()
    plans = [plan(r, [(0, 0, 1 - r, 0)], n_send=2, n_count=2) for r in (0, 1)]
    spec = build_spec(plans, topo, f, engine="bsp", sync="sw", row_bytes=ROW)
    # Core c of rank r counts expert c (rank c) and fences to it: 5 + 0.25 * 2 L + 20.
    lat = np.array([[50.0, 400.0], [400.0, 50.0]])
    expect = 5 + 0.25 * 2 * lat + 20
    np.testing.assert_allclose(spec.chunk_offset_ns, expect)


def test_aux_cores_scale_with_ranks_and_leave_the_partition() -> None:
    f = fabric(aux_cores_at_256=12.0, poll_ns=200.0, count_expert_ns=10.0)
    assert [aux_cores(r, f) for r in (16, 64, 128, 256)] == [1, 3, 6, 12]
    assert aux_cores(256, fabric()) == 0
    w = Workload(tokens_per_rank=64)
    n_s, n_c = core_split(w, UBEP, cm384(64), f)
    assert n_s is not None and n_c is not None and n_s + n_c == 48 - 3


@pytest.mark.parametrize(("ranks", "count", "aux", "send"),
                         [(64, 7, 3, 38), (128, 12, 6, 30), (256, 19, 12, 17)])
def test_appendix_a_splits_all_cores_and_routing_takes_from_sending(
        ranks: int, count: int, aux: int, send: int) -> None:
    # Appendix A as written: all n = 48 AIVs are split into n_count counting and n - n_count
    # communicating ones, min over n_c of max(T_count, T_token); the evaluation text's routing
    # and checksum AIVs (12 at 256 ranks, round(12 R / 256)) are then taken from communication.
    # By hand, alpha = 100 ns, beta = 250 ns, b_count = 0, top-8, batch 128 (K B = 1024 units):
    # T_token = 102400 / (48 - n_c), T_count = 250 R / n_c.
    #   R = 64:  n_c = 6: max(2667, 2438) = 2667; 7: max(2286, 2498) = 2498;
    #            8: max(2000, 2560) = 2560 -> 7 count, 48 - 7 - 3 = 38 send.
    #   R = 128: 11: max(2909, 2768); 12: max(2667, 2844) = 2844; 13: max(2462, 2926) -> 12,
    #            48 - 12 - 6 = 30 send.
    #   R = 256: 18: max(3556, 3413); 19: max(3368, 3531) = 3531; 20: max(3200, 3657) -> 19,
    #            48 - 19 - 12 = 17 send.
    from ubep.sim.workload import appendix_a_split

    f = fabric(aux_cores_at_256=12.0)
    assert aux_cores(ranks, f, 48) == aux
    assert appendix_a_split(48, ranks, 8, 128, aux, alpha=100.0, beta=250.0) == (send, count,
                                                                                aux)
    # The routing and checksum AIVs never take the count group's cores nor the last sender.
    assert appendix_a_split(48, ranks, 8, 128, 48, alpha=100.0, beta=250.0) == (1, count,
                                                                               47 - count)


def test_the_fence_share_is_derived_from_table_2() -> None:
    # A fence waits for the part of the store's path inside the NPU: intra-NPU over one-hop
    # access, 218 / 929, of every hop's round trip; no longer a fitted constant.
    from ubep.sim.presets import load_fabric

    f, topo = load_fabric("cm384"), cm384(64)
    assert topo.latency_ns[:2] == (218.0, 929.0)
    assert f.fence_rtt_fraction == pytest.approx(218 / 929)
    assert "fence_rtt_fraction" not in ASSUMED
    # ASP SW, one 10 B message one hop away: the core stalls 218 / 929 x (2 x 929 + 10 / B).
    plans = [plan(0, [(0, 0, 1, 0)], n_send=1, n_count=1, topo=cm384(2)),
             plan(1, [], n_send=1, n_count=1, topo=cm384(2))]
    spec = build_spec(plans, cm384(2), f.with_values(store_window=0.0, sw_meet=0,
                                                     metadata_ratio=0.0),
                      engine="asp", sync="sw", row_bytes=10)
    bw = cm384(2).bandwidth_gbps[1]
    assert spec.unit_stall_ns[0] == pytest.approx(218 / 929 * (2 * 929 + 10 / bw))


def test_fabric_rejects_a_fence_longer_than_the_round_trip() -> None:
    with pytest.raises(InvalidArgumentError) as exc:
        fabric(fence_rtt_fraction=1.5)
    assert exc.value.argument == "fence_rtt_fraction"


def _point(name: str, target: float, key: str) -> TrainingPoint:
    return TrainingPoint(name, "closed form", str(target), target, 0.1,
                         lambda f: float(getattr(f, key)))


def test_fit_recovers_constants_in_log_space_and_reports_bounds() -> None:
    base = fabric()
    # count_pick_ns = 4 / 256 / clock pins the clock, vector_op_ns = (c0 + 1) / clock then
    # the instruction latency; a target beyond its range leaves a constant at its bound,
    # reported as such.
    clock, c0 = 1.2, 40.0
    pts = [_point("vec", (c0 + 1) / clock, "vector_op_ns"),
           _point("pick", 4 / 256 / clock, "count_pick_ns"),
           _point("hot", 0.05, "hot_share")]
    res = fit(base, pts, max_nfev=200, tol=1e-12, baseline=False)
    assert res.values["vector_instr_cycles"] == pytest.approx(c0, rel=1e-3)
    assert res.values["aiv_clock_ghz"] == pytest.approx(clock, rel=1e-3)
    assert res.values["hot_share"] == pytest.approx(ASSUMED["hot_share"]["range"][0])
    assert res.at_bound == {"hot_share": "lower"}
    assert abs(res.residuals["vec"]) < 1e-3
    # log(0.1 / 0.05) / log(1.1): the bound's residual, in tolerances
    assert res.residuals["hot"] == pytest.approx(np.log(2.0) / np.log(1.1), rel=1e-3)
    fab = apply_assumed(base, res.values)
    assert fab.count_expert_ns == pytest.approx(c0 / clock, rel=1e-3)
    # The finite differences' columns on two forked processes: the same fit, to the bit.
    assert fit(base, pts, max_nfev=200, tol=1e-12, baseline=False, workers=2).values == \
        res.values


def test_leave_one_out_predicts_each_point_from_the_others() -> None:
    base = fabric()
    # Two points fix the same constant: without one, the other still predicts it exactly;
    # the third point alone fixes the clock, so without it the clock stays where it was.
    pts = [_point("a", 30.0, "count_expert_ns"), _point("b", 30.0, "count_expert_ns"),
           _point("hot", 0.3, "hot_share")]
    full = fit(base, pts, max_nfev=200, tol=1e-12, baseline=False)
    rows = leave_one_out(base, full, pts, max_nfev=200)
    assert [r["name"] for r in rows] == ["a", "b", "hot"]
    assert rows[0]["predicted"] == pytest.approx(30.0, rel=1e-3)
    assert rows[1]["predicted"] == pytest.approx(30.0, rel=1e-3)
    assert rows[2]["values"]["hot_share"] == pytest.approx(0.3, rel=1e-2)
    # The refits run on two forked processes: the same rows as in this process.
    assert leave_one_out(base, full, pts, max_nfev=200, workers=2) == rows
    with pytest.raises(InvalidArgumentError):
        fit(base, [], baseline=False)


@pytest.mark.parametrize("mode", ["analytic", "events"])
@pytest.mark.parametrize("lanes", [1, 2])
def test_vector_poll_reads_lanes_words_at_once(mode: str, lanes: int) -> None:
    f = fabric(count_expert_ns=5.0, flag_ns=20.0, poll_ns=500.0, poll_lanes=lanes)
    topo = two_ranks(cores=2)
    plans = [plan(r, [(0, 0, 1 - r, 0)], n_send=1, n_count=1, topo=topo) for r in (0, 1)]
    res = simulate(plans, topo, f, engine="asp", sync="sp", row_bytes=ROW, mode=mode)
    # The count core writes its word for rank 0, then for rank 1: done at 1000 + 2 x 25.
    # Rank 0's words: its own (offset 25, lands 50 later), rank 1's (offset 25, lands 400
    # later); the scan starts when the core's own writes are done.
    start, lands = 1000 + 50, (1000 + 25 + 50, 1000 + 25 + 400)
    if lanes == 1:
        expect = max(max(start, lands[0]) + 500, lands[1]) + 500
    else:
        expect = max(start, *lands) + 500
    (span,) = res.timeline.spans(rank=0, core=1, task="verify")
    assert span.end_ns == pytest.approx(expect, abs=1e-6)
    with pytest.raises(InvalidArgumentError):
        fabric(poll_lanes=0)


@pytest.mark.parametrize(("lanes", "expect"), [(1, 3100.0), (4, 1925.0)])
def test_one_poll_a_word_makes_verification_grow_with_the_ranks(lanes: int,
                                                                expect: float) -> None:
    # Four ranks of one node (50 ns on the rank, 400 ns between), one send and one count
    # core each. The count core counts expert d (5 ns) and writes its word to rank d (20 ns)
    # for d = 0..3: the words leave at 1000 + 25 (d + 1) and its own writes end at 1100.
    # Rank 0's words (offset 25) land at 1075 (its own) and 1425 (the three others). One
    # poll a word: 1100 -> max(1100, 1075) + 500 = 1600 -> 2100 -> 2600 -> 3100, i.e. R polls;
    # four words a poll: max(1100, 1425) + 500 = 1925.
    f = fabric(count_expert_ns=5.0, flag_ns=20.0, poll_ns=500.0, poll_lanes=lanes)
    topo = Topology(num_ranks=4, ranks_per_node=4, cores_per_rank=2, latency_ns=(50.0, 400.0),
                    bandwidth_gbps=(20.0, 20.0))
    plans = [plan(r, [(0, 0, (r + 1) % 4, 0)], n_send=1, n_count=1, num_ranks=4, topo=topo)
             for r in range(4)]
    for mode in ("analytic", "events"):
        res = simulate(plans, topo, f, engine="asp", sync="sp", row_bytes=ROW, mode=mode)
        (span,) = res.timeline.spans(rank=0, core=1, task="verify")
        assert (span.start_ns, span.end_ns) == (pytest.approx(1100.0), pytest.approx(expect))


def test_fit_moves_the_baseline_constants_with_the_assumed_ones() -> None:
    base = fabric(init_ns=6000.0)
    # A point on init_ns (a baseline constant) and one on the clock: both are fitted.
    pts = [_point("init", 9000.0, "init_ns"), _point("pick", 4 / 256 / 1.6,
                                                     "count_pick_ns")]
    res = fit(base, pts, max_nfev=200, tol=1e-12)
    assert res.values["init_ns"] == pytest.approx(9000.0, rel=1e-3)
    assert res.values["aiv_clock_ghz"] == pytest.approx(1.6, rel=1e-3)
    fab = apply_assumed(base, res.values)
    assert fab.init_ns == pytest.approx(9000.0, rel=1e-3)
    assert "barrier_ns" not in res.values  # derived from the die (syncall_atomic_ns)
    assert fab.flag_ns == pytest.approx(res.values["issue_ns"])  # tied to issue_ns


def test_variants_use_the_fit_or_the_first_principles() -> None:
    from ubep.sim.assumed import aiv_costs
    from ubep.sim.calib import fabric_variants, load_calibration, use_fit

    fit_entry = load_calibration()["fabrics"]["cm384"]["fit"]
    fitted = fabric_variants("cm384")
    v = fit_entry["values"]
    assert fitted["nominal"].hot_share == pytest.approx(v["hot_share"])
    assert fitted["nominal"].init_ns == pytest.approx(v["init_ns"])
    # The ends are the leave-one-out spread, in each constant's cost direction.
    spread = fit_entry["loo_spread"]
    assert fitted["high"].cumsum_group_sync_ns == pytest.approx(max(spread["cumsum_group_sync_ns"]))
    assert fitted["low"].hot_share == pytest.approx(min(spread["hot_share"]))
    assert fitted["low"].vector_op_ns == pytest.approx(aiv_costs(
        max(spread["aiv_clock_ghz"]), min(spread["vector_instr_cycles"]))["vector_op_ns"])
    use_fit(False)
    try:
        first = fabric_variants("cm384")
    finally:
        use_fit(True)
    assert first["nominal"].hot_share == ASSUMED["hot_share"]["value"]
    assert first["nominal"].vector_op_ns == pytest.approx(aiv_costs(1.4, 24.0)["vector_op_ns"])
    assert first["high"].hot_share == ASSUMED["hot_share"]["range"][1]
    assert first["low"].cumsum_group_sync_ns == ASSUMED["cumsum_group_sync_ns"]["range"][0]


@pytest.mark.parametrize("mode", ["analytic", "events"])
def test_store_window_makes_the_far_core_finish_last(mode: str) -> None:
    # Two cores with the same rows (two each) and different hop mixes: core 0 sends to rank 1
    # (hop 1: L = 400 ns), core 1 to its own rank (hop 0: L = 50 ns). Their work is equal (w =
    # 100 + ROW / 10 = 200 ns, no processor-shared latency), so both reach the end of their
    # work together at speed(2). Each keeps store_window = 2 stores in flight: by Little's law
    # a row costs its core rtt / 2, rtt = 2 L + ROW / B (B = 20 GB/s): 850 / 2 = 425 ns for
    # the far rows, of which the work covers 200 (a 225 ns wait per row); 150 / 2 = 75 ns for
    # the near rows, which the work covers (no wait).
    f = fabric(latency_exposure=0.0, store_window=2.0)
    topo = two_ranks(cores=3)
    plans = [plan(0, [(0, 0, 1, 0), (0, 1, 1, 1), (1, 2, 0, 0), (1, 3, 0, 1)], n_send=2,
                  n_count=1, topo=topo),
             plan(1, [], n_send=2, n_count=1, topo=topo)]
    res = simulate(plans, topo, f, engine="asp", sync="sp", row_bytes=ROW, mode=mode)
    w = 100 + ROW / 10
    first, second = 1000 + w / speed(f, 2), 1000 + 2 * w / speed(f, 2)
    wait_far = (2 * 400 + ROW / 20) / 2 - w
    assert wait_far == 225.0
    # Unit i of a core ends at its processor-sharing time plus its waits so far.
    np.testing.assert_allclose(res.unit_end_ns, [first + wait_far, second + 2 * wait_far,
                                                 first, second], atol=1e-6)
    # The gap between the far and the near core is their waits' difference, whatever the
    # contention: the hop mix of a core, not the rank's load, sets it.
    assert res.core_send_end_ns[0, 0] - res.core_send_end_ns[0, 1] == pytest.approx(450.0)


def test_store_window_is_littles_law() -> None:
    # One store in flight (window 1): a core sends one row per round trip, whatever its work
    # below that; with no window (0) it never waits; a window too deep to bind costs nothing.
    topo = two_ranks()
    hop = np.array([0, 1])
    work = np.array([200.0, 200.0])
    wire = np.array([ROW, ROW])
    rtt = np.array([2 * 50 + ROW / 20, 2 * 400 + ROW / 20])
    one = fabric(store_window=1.0).window_wait_ns(wire, hop, work, topo)
    np.testing.assert_allclose(work + one, np.maximum(rtt, work))
    np.testing.assert_allclose(fabric(store_window=0.0).window_wait_ns(wire, hop, work, topo),
                               0.0)
    np.testing.assert_allclose(fabric(store_window=64.0).window_wait_ns(wire, hop, work, topo),
                               0.0)


def test_fabric_rejects_a_window_under_one_store() -> None:
    with pytest.raises(InvalidArgumentError) as exc:
        fabric(store_window=0.5)
    assert exc.value.argument == "store_window"


def _two_node_runs(topo: Any) -> list[tuple[str, list[Any], Any]]:
    """Real plans of ubep.sched (balanced, then hierarchical) for 8 ranks of 16 tokens top-4
    on ``topo``, 6 send cores, simulated without contention and with one store in flight per
    core (each row costs its core its round trip)."""
    from ubep.routing import uniform_topk
    from ubep.sim import make_plans

    f = fabric(latency_exposure=0.0, store_window=1.0, contention_cores=1e9)
    idx = [uniform_topk(16, 16, 4, seed=r) for r in range(8)]
    runs = []
    for policy in ("balanced", "hierarchical"):
        plans = make_plans(idx, topo, num_experts=16, policy=policy, num_send_cores=6,
                           num_count_cores=2)
        runs.append((policy, plans, simulate(plans, topo, f, engine="asp", sync="sp",
                                             row_bytes=ROW)))
    return runs


def test_hierarchical_mapping_lowers_the_largest_wait_sum() -> None:
    # Real plans of ubep.sched on 8 ranks in 2 nodes of 4 (hops 0/1/2), 6 send cores. Without
    # contention and with equal work per row, a core's send end is closed-form: Init + rows x
    # work + sum of its own waits (window 1: rtt[h] - work per row). The hierarchical mapping
    # caps every core's share of each hop class (ceil(V_h / n)); balanced slices do not, so
    # the core with the most two-hop rows ends later.
    topo = cm384(8, ranks_per_node=4, cores_per_rank=8)
    lat, bw = np.asarray(topo.latency_ns), np.asarray(topo.bandwidth_gbps)
    largest = {}
    for policy, plans, res in _two_node_runs(topo):
        for r, p in enumerate(plans):
            rows = np.bincount(p.send_core, minlength=6)
            wait = np.maximum(0.0, 2 * lat + ROW / bw - (100 + ROW / 10))
            waits = np.bincount(p.send_core, weights=wait[p.send_hop], minlength=6)
            want = np.where(rows > 0, 1000 + rows * (100 + ROW / 10) + waits, 0.0)
            np.testing.assert_allclose(res.core_send_end_ns[r], want, atol=1e-6)
        largest[policy] = float(res.core_send_end_ns.max())
    assert largest["hierarchical"] < largest["balanced"]


def _one_row_per_core(rows: list[tuple[int, int, int, int]]) -> tuple[Any, Any, list[Any]]:
    """Two ranks of 4 cores, no contention: rank 0 issues ``rows`` (one per send core, all at
    once), rank 1 nothing; 3 send cores and 1 count core each."""
    f, topo = fabric(contention_cores=1e9), two_ranks(cores=4)
    return f, topo, [plan(0, rows, n_send=3, n_count=1, topo=topo),
                     plan(1, [], n_send=3, n_count=1, topo=topo)]


@pytest.mark.parametrize("mode", ["analytic", "events"])
def test_program1_adds_the_largest_round_trip_through_the_link(mode: str) -> None:
    # Program (1) of the paper per core: its issue time plus the largest round trip of its
    # rows, a round trip being the row's occupancy of the rank's link (wait behind other
    # cores' rows + its own serialisation) and 2 L[h]; no receiver queueing. Cores 0 and 1
    # each send one row to rank 1 at the same instant (no contention: speed 1); the port
    # serves core 0's row first (lower unit id), so core 1's row waits one serialisation.
    # Core 2 sends one local row: its round trip is 2 L[0].
    f, topo, plans = _one_row_per_core([(0, 0, 1, 0), (1, 1, 1, 1), (2, 2, 0, 0)])
    res = simulate(plans, topo, f, engine="asp", sync="sp", row_bytes=ROW, mode=mode)
    w_far, w_near = 100 + ROW / 10 + 0.5 * 400, 100 + ROW / 10 + 0.5 * 50
    s = ROW / 20  # serialisation at 20 GB/s
    np.testing.assert_allclose(res.core_rtt_ns[0], [s + 800, 2 * s + 800, 100], atol=1e-6)
    np.testing.assert_allclose(res.send_latency_ns(until="rtt")[0],
                               [w_far + s + 800, w_far + 2 * s + 800, w_near + 100], atol=1e-6)
    # The receiver's port is not in it: rank 1 lands both rows one serialisation apart, so
    # core 1's acknowledgement comes no earlier than program (1) says.
    assert res.send_latency_ns(until="ack")[0, 1] >= res.send_latency_ns(until="rtt")[0, 1]
    assert res.send_latency_ns(until="rtt")[1].tolist() == [0.0, 0.0, 0.0]


def test_program1_hierarchical_mapping_beats_balanced_slices() -> None:
    # Real plans on 8 ranks in 2 nodes of 4 (hops 0/1/2), 6 send cores, no contention and a
    # link so fast that no row waits: program (1) per core is closed form, rows x work + the
    # core's own waits (window 1: 2 L[h] - work per row) + 2 L of its farthest row. Balanced
    # slices give some cores only two-hop rows; the hierarchical mapping caps each core's
    # share of every hop class, so the largest value falls.
    topo = Topology(num_ranks=8, ranks_per_node=4, cores_per_rank=8,
                    latency_ns=(218.0, 929.0, 2500.0), bandwidth_gbps=(1e9, 1e9, 1e9))
    lat = np.asarray(topo.latency_ns)
    largest = {}
    for policy, plans, res in _two_node_runs(topo):
        got = res.send_latency_ns(until="rtt")
        for r, p in enumerate(plans):
            rows = np.bincount(p.send_core, minlength=6)
            wait = np.maximum(0.0, 2 * lat + ROW / 1e9 - (100 + ROW / 10))
            waits = np.bincount(p.send_core, weights=wait[p.send_hop], minlength=6)
            far = np.zeros(6)
            np.maximum.at(far, p.send_core, 2 * lat[p.send_hop])
            want = np.where(rows > 0, rows * (100 + ROW / 10) + waits + far, 0.0)
            np.testing.assert_allclose(got[r], want, atol=1e-3)
        largest[policy] = float(got.max())
    assert largest["hierarchical"] < largest["balanced"]


def test_one_vector_step_checks_the_markers_of_check_lanes_blocks() -> None:
    # A 7168 B row is 14 atomic blocks of 512 B (TFF: 15 blocks of 480 B payload). With 8
    # markers per vector step, a check takes ceil(14 / 8) = 2 steps (TFF ceil(15 / 8) = 2);
    # with one block per step, 14 (15).
    from ubep.sim.fabric import sync_costs

    for lanes, steps, tff_steps in ((8, 2, 2), (1, 14, 15), (14, 1, 2)):
        f = fabric(vector_op_ns=10.0, check_lanes=lanes)
        sp, dc, tff = (sync_costs(s, 7168, f) for s in ("sp", "dc", "tff"))
        assert sp.receiver_extra_ns == pytest.approx(steps * 10.0 + 7168 / 10.0)
        assert (dc.sender_extra_ns, dc.receiver_extra_ns) == (steps * 10.0, steps * 10.0)
        assert tff.receiver_extra_ns == tff_steps * 10.0
        assert (sp.blocks, tff.blocks) == (14, 15)
    with pytest.raises(InvalidArgumentError) as exc:
        fabric(check_lanes=0)
    assert exc.value.argument == "check_lanes"


@pytest.mark.parametrize("mode", ["analytic", "events"])
def test_receiver_drain_floors_the_acknowledged_send_time(mode: str) -> None:
    # Receiver port drain: rank 1 takes three remote rows of ROW bytes at 20 GB/s, so its
    # drain is 3 * ROW / 20 ns, rank 0's nothing. Three cores of rank 0 issue one row each at
    # once (no contention): the rows leave and land one serialisation apart, so the last is
    # acknowledged at work + drain + 2 L -- the floor every core mapping meets, because a
    # port is work-conserving.
    from ubep.sim.spec import receiver_drain_ns

    f, topo, plans = _one_row_per_core([(0, 0, 1, 0), (1, 1, 1, 1), (2, 2, 1, 2)])
    spec = build_spec(plans, topo, f, engine="asp", sync="sp", row_bytes=ROW)
    s = ROW / 20
    np.testing.assert_allclose(receiver_drain_ns(spec, topo), [0.0, 3 * s])
    res = simulate(plans, topo, f, engine="asp", sync="sp", row_bytes=ROW, mode=mode)
    w = 100 + ROW / 10 + 0.5 * 400
    np.testing.assert_allclose(res.send_latency_ns(until="ack")[0],
                               [w + s + 800, w + 2 * s + 800, w + 3 * s + 800], atol=1e-2)


def test_unstated_hot_share_comes_from_the_fabric() -> None:
    # A skewed workload that leaves its hot share unstated takes the fabric's (the fitted
    # set-up unknown); a stated one is kept; apply_assumed sets it like the other assumed
    # constants, and a share outside (0, 1) is refused by name.
    from ubep.sim.workload import CANN_EP, hot_ids_for, plans_for

    topo = cm384(16, ranks_per_node=8, cores_per_rank=8)
    w = Workload(tokens_per_rank=32, experts_per_rank=2, routing="hot", hot_experts=2)
    f = apply_assumed(fabric(), {"hot_share": 0.3})
    assert f.hot_share == 0.3
    assert w.resolved(f).hot_share == 0.3
    assert w.with_(hot_share=0.6).resolved(f).hot_share == 0.6
    assert Workload().resolved(f).hot_share is None  # uniform routing: no share
    hot = hot_ids_for(w, 16)
    share_of_hot = []
    for share in (0.3, 0.7):
        g = f.with_values(hot_share=share)
        got = plans_for(w, CANN_EP, topo, g)
        want = plans_for(w.with_(hot_share=share), CANN_EP, topo, g)
        for a, b in zip(got, want, strict=True):
            np.testing.assert_array_equal(a.send_expert, b.send_expert)
        picks = np.concatenate([p.send_expert for p in got])
        share_of_hot.append(float(np.isin(picks, hot).mean()))
    assert share_of_hot[0] < share_of_hot[1]
    for bad in (0.0, 1.0):
        with pytest.raises(InvalidArgumentError) as exc:
            fabric(hot_share=bad)
        assert exc.value.argument == "hot_share"
        with pytest.raises(InvalidArgumentError):
            Workload(routing="hot", hot_share=bad)


def test_a_baseline_row_stays_within_its_bound() -> None:
    # Two closed-form points on the hot share: a training point wants 0.6, a baseline row
    # 0.375, both with a 10 % tolerance. Unbounded least squares in log space meets them at the
    # geometric mean, the row log(1.6) / log(1.1) / 2 = 2.47 tolerances off. As a bound row
    # it is a constraint: the objective beyond its bound rises BOUND_STIFFNESS times faster,
    # which leaves the optimum near the bound (residual 1: 0.375 x 1.1). The slope
    # rises from 1 to BOUND_STIFFNESS over +-STIFF_BAND: the optimum is where the training
    # point's pull, 1 per tolerance, meets the row's: log(0.6 / x) / log(1.1) = stiff * slope.
    from ubep.sim.fit import BOUND_STIFFNESS, STIFF_BAND, stiff, stiff_slope

    base = fabric()
    want = _point("train", 0.6, "hot_share")
    row = _point("row", 0.375, "hot_share")
    free = fit(base, [want, row], max_nfev=200, tol=1e-12, baseline=False)
    assert free.residuals["row"] == pytest.approx(np.log(1.6) / np.log(1.1) / 2, rel=1e-3)
    bound = TrainingPoint(row.name, row.source, row.shown, row.paper, row.tolerance,
                          row.evaluate, bound=True)
    res = fit(base, [want, bound], max_nfev=200, tol=1e-12, baseline=False)
    r = res.residuals["row"]
    assert 1 - STIFF_BAND <= r <= 1 + STIFF_BAND
    # stationarity of (r_train^2 + stiff(r)^2) / 2 along log(share): r_train = r - 2.47 * 2
    r_train = res.residuals["train"]
    assert r_train == pytest.approx(r - np.log(1.6) / np.log(1.1), abs=1e-6)
    assert r_train + stiff(r) * stiff_slope(r) == pytest.approx(0.0, abs=1e-4)
    assert stiff(0.5) == 0.5 and stiff(-2.0) == -(1 + BOUND_STIFFNESS)
    b = STIFF_BAND
    assert stiff(1 - b) == pytest.approx(1 - b) and stiff(1 + b) == pytest.approx(
        1 + BOUND_STIFFNESS * b)
    assert stiff_slope(1 - b) == 1.0 and stiff_slope(1 + b) == BOUND_STIFFNESS


def _curved(name: str, target: float, key: str, offset: float) -> TrainingPoint:
    # ``constant + offset``: not a power of the constant, so not linear in log space.
    return TrainingPoint(name, "closed form", str(target), target, 0.1,
                         lambda f: float(getattr(f, key)) + offset)


def test_leave_one_out_refit_converges_where_the_quick_steps_do_not() -> None:
    # Two points on the hot share, f + 0.05 = 0.65 and f + 0.5 = 0.8: the full fit lies
    # between them. Without the first, the refit fits the second exactly (f = 0.3) and
    # predicts the first as 0.3 + 0.05 = 0.35; without the second, f = 0.6 and the
    # prediction is 0.6 + 0.5 = 1.1. One quick Gauss-Newton evaluation on the full fit's
    # Jacobian cannot get there (it never moves off the full fit).
    base = fabric()
    pts = [_curved("a", 0.65, "hot_share", 0.05),
           _curved("b", 0.8, "hot_share", 0.5)]
    full = fit(base, pts, max_nfev=200, tol=1e-12, baseline=False)
    assert 0.3 < full.values["hot_share"] < 0.6
    rows = leave_one_out(base, full, pts, max_nfev=200, tol=1e-12)
    assert [r["converged"] for r in rows] == [True, True]
    assert rows[0]["values"]["hot_share"] == pytest.approx(0.3, rel=1e-4)
    assert rows[0]["predicted"] == pytest.approx(0.35, rel=1e-4)
    assert rows[1]["values"]["hot_share"] == pytest.approx(0.6, rel=1e-4)
    assert rows[1]["predicted"] == pytest.approx(1.1, rel=1e-4)
    quick = leave_one_out(base, full, pts, refit=False, max_nfev=1)
    assert quick[0]["predicted"] == pytest.approx(full.model["a"], rel=1e-9)
    assert quick[0]["converged"] is False


def test_cold_leave_one_out_does_not_start_from_what_the_point_taught() -> None:
    # "hot" alone sets the hot share (0.3); "vec" sets vector_op_ns. The full fit meets
    # both, so without "hot" the others are stationary wherever the hot share lies: a
    # warm refit keeps the full fit's 0.3 (it predicts the point it never saw exactly), a
    # cold one keeps the first-principles value, 0.5, and predicts 0.5.
    base = fabric()
    pts = [_point("hot", 0.3, "hot_share"), _point("vec", 30.0, "vector_op_ns")]
    full = fit(base, pts, max_nfev=200, tol=1e-12, baseline=False)
    warm = leave_one_out(base, full, pts, max_nfev=200, tol=1e-12)
    cold = leave_one_out(base, full, pts, max_nfev=200, tol=1e-12, cold=True)
    assert warm[0]["predicted"] == pytest.approx(0.3, rel=1e-6)
    first = ASSUMED["hot_share"]["value"]
    assert cold[0]["predicted"] == pytest.approx(first, rel=1e-6)
    assert cold[1]["predicted"] == pytest.approx(apply_assumed(base, {}).vector_op_ns, rel=1e-6)


def test_dissemination_rounds_follow_the_tiers() -> None:
    from ubep.sim.fabric import dissemination_ns

    # CM384: 16 ranks per node, L = (218, 929, 2500) ns. log2(16) = 4 rounds inside a node,
    # then log2(nodes) rounds across the tier-2 switch.
    assert dissemination_ns(cm384(16)) == pytest.approx(4 * 929)
    assert dissemination_ns(cm384(64)) == pytest.approx(4 * 929 + 2 * 2500)
    assert dissemination_ns(cm384(256)) == pytest.approx(4 * 929 + 4 * 2500)
    assert dissemination_ns(cm384(20)) == pytest.approx(4 * 929 + 1 * 2500)  # 2 nodes
    assert dissemination_ns(cm384(8)) == pytest.approx(3 * 929)
    assert dissemination_ns(cm384(2)) == pytest.approx(929)
    with pytest.raises(InvalidArgumentError) as exc:
        fabric(syncall_global=2)
    assert exc.value.argument == "syncall_global"


@pytest.mark.parametrize("mode", ["analytic", "events"])
@pytest.mark.parametrize("scope", [0, 1])
def test_a_global_syncall_waits_for_every_rank(mode: str, scope: int) -> None:
    # Rank 0: core 0 sends a row to rank 1, core 1 one to itself; rank 1 keeps both rows.
    # Per-rank SyncAll: rank 1's first barrier ends after its own local acknowledgements.
    # Global: both ranks wait for rank 0's remote acknowledgement, then barrier_ns and one
    # flag round inside the node (2 ranks: ceil(log2 2) = 1 round of L[1] = 400 ns).
    f = fabric(barrier_ns=300.0, contention_cores=1e6, syncall_global=scope)
    topo = two_ranks()
    plans = [plan(0, [(0, 0, 1, 0), (1, 1, 0, 0)], n_send=2, n_count=2),
             plan(1, [(0, 0, 1, 0), (1, 1, 1, 0)], n_send=2, n_count=2)]
    res = simulate(plans, topo, f, engine="bsp", sync="sw", row_bytes=ROW, mode=mode)
    lat0, lat1 = 50.0, 400.0
    remote_ack = 1000 + 100 + 100 + 0.5 * lat1 + ROW / 20 + 2 * lat1
    local_ack = 1000 + 100 + 100 + 0.5 * lat0 + 2 * lat0
    if scope:
        b1 = {0: remote_ack + 300 + lat1, 1: remote_ack + 300 + lat1}
    else:
        b1 = {0: remote_ack + 300, 1: local_ack + 300}
    for r in (0, 1):
        first = min(b.end_ns for b in res.timeline.spans(rank=r, task="barrier"))
        assert first == pytest.approx(b1[r], abs=1e-2)
    if scope:  # the second SyncAll releases every rank at once
        ends = {max(b.end_ns for b in res.timeline.spans(rank=r, task="barrier")) for r in (0, 1)}
        assert max(ends) - min(ends) < 1e-6


@pytest.mark.parametrize("mode", ["analytic", "events"])
def test_sent_adds_the_mean_wait_at_the_receivers_port(mode: str) -> None:
    # Figure 9's per-AIV send latency: program (1) of the core's own rows plus the mean wait
    # of its rows at their receivers' ports. Ranks 0 and 1 each send one row from core 0 to
    # rank 2 (all one hop, no contention: speed 1). Both rows leave their source ports at
    # e + s and reach rank 2 together; its port passes one, the other waits one
    # serialisation s there. Core 1 of each rank sends nothing.
    f = fabric(contention_cores=1e9)
    topo = Topology(num_ranks=3, ranks_per_node=3, cores_per_rank=3,
                    latency_ns=(50.0, 400.0), bandwidth_gbps=(20.0, 20.0))
    plans = [plan(0, [(0, 0, 2, 0)], n_send=2, n_count=1, num_ranks=3, topo=topo),
             plan(1, [(0, 0, 2, 0)], n_send=2, n_count=1, num_ranks=3, topo=topo),
             plan(2, [], n_send=2, n_count=1, num_ranks=3, topo=topo)]
    res = simulate(plans, topo, f, engine="asp", sync="sp", row_bytes=ROW, mode=mode)
    w, s = 100 + ROW / 10 + 0.5 * 400, ROW / 20
    waits = sorted(res.core_rx_wait_ns[:2, 0].tolist())
    np.testing.assert_allclose(waits, [0.0, s], atol=1e-2)
    assert res.core_rx_wait_ns[:, 1].tolist() == [0.0, 0.0, 0.0]
    sent = res.send_latency_ns(until="sent")
    np.testing.assert_allclose(sorted(sent[:2, 0].tolist()), [w + s + 800, w + 2 * s + 800],
                               atol=1e-2)
    np.testing.assert_allclose(sent[:2, 0] - res.send_latency_ns(until="rtt")[:2, 0],
                               res.core_rx_wait_ns[:2, 0], atol=1e-9)
    assert sent[2].tolist() == [0.0, 0.0]


def test_sent_mean_wait_is_per_core_rows() -> None:
    # The wait is a mean over the core's own rows, hop-0 rows counting 0: a core with one
    # local row and one remote row that waited 300 ns shows 150.
    from ubep.sim.spec import core_rx_wait_ns

    f, topo = fabric(contention_cores=1e9), two_ranks(cores=3)
    plans = [plan(0, [(0, 0, 0, 0), (0, 1, 1, 0)], n_send=2, n_count=1, topo=topo),
             plan(1, [], n_send=2, n_count=1, topo=topo)]
    spec = build_spec(plans, topo, f, engine="asp", sync="sp", row_bytes=ROW)
    depart = np.array([0.0, 1000.0])
    land = np.array([500.0, 1000.0 + 400.0 + 300.0])  # hop 1: flight 400, then 300 waiting
    got = core_rx_wait_ns(spec, topo, land, depart)
    np.testing.assert_allclose(got, [[150.0, 0.0], [0.0, 0.0]])


def _exchange_spec(num_ranks: int, sw_meet: int) -> Any:
    from ubep.sim.calib import load_fabric
    from ubep.sim.experiments import _exchange_plans, topology_for

    topo = topology_for("cm384", num_ranks)
    fab = load_fabric("cm384").with_values(sw_meet=sw_meet)
    spec = build_spec(_exchange_plans(topo, topo.cores_per_rank), topo, fab, engine="asp",
                      sync="sw", row_bytes=10)
    return fab, spec


@pytest.mark.parametrize(("num_ranks", "senders"), [(2, 1), (64, 48)])
def test_stop_and_wait_meeting_grows_with_the_sending_aivs(num_ranks: int,
                                                           senders: int) -> None:
    # Figure 10's exchange: every rank writes one message to each of the other R - 1 ranks,
    # dealt over its 48 AIVs, so P = min(R - 1, 48) AIVs send: 1 at 2 ranks, 48 at 64. Under
    # stop-and-wait they meet at one counter before each per-destination flag; the P adds
    # serialise, flag_ns each: the flag waits P x flag_ns more than without the meeting,
    # every batch of every rank alike (one message per batch here). And every sending AIV
    # vouches for every destination (a static protocol: it cannot know which ranks its peers
    # wrote): R - 1 adds of its own, overlapping the meeting's P, so each core's first batch
    # waits max(P, R - 1) x flag_ns in all: at 2 ranks P = R - 1 = 1 (nothing more); at 64
    # ranks 63 adds against 48, 15 x flag_ns more on the first batch of each core.
    fab, met = _exchange_spec(num_ranks, 1)
    _, plain = _exchange_spec(num_ranks, 0)
    extra = met.unit_stall_ns - plain.unit_stall_ns
    assert met.unit_batch.size == num_ranks * (num_ranks - 1)  # one row per batch
    first = np.zeros(extra.size, dtype=bool)
    n_s = met.num_send_cores
    for r in range(num_ranks):  # a core's first unit is its first batch (one row each)
        for c in range(n_s):
            lo, hi = met.core_ptr[r * n_s + c], met.core_ptr[r * n_s + c + 1]
            if hi > lo:
                first[lo] = True
    assert first.sum() == num_ranks * senders
    beyond = (num_ranks - 1 - senders) * fab.flag_ns  # 0 at 2 ranks, 15 adds at 64
    np.testing.assert_allclose(extra, senders * fab.flag_ns + np.where(first, beyond, 0.0),
                               rtol=1e-12)
    # Data-as-Flag has no meeting: its rows stall the same with and without it.
    from ubep.sim.experiments import exchange_latency_ns, topology_for

    topo = topology_for("cm384", num_ranks)
    assert exchange_latency_ns(topo, fab, "sp", 10) == exchange_latency_ns(
        topo, fab.with_values(sw_meet=0), "sp", 10)
    sw_gain = (exchange_latency_ns(topo, fab, "sw", 10)
               - exchange_latency_ns(topo, fab.with_values(sw_meet=0), "sw", 10))
    # At 2 ranks the one row's flag is the critical path: the latency grows by P x flag_ns.
    # At 64 ranks 63 messages over 48 AIVs give 15 AIVs two batches (two meetings), so the
    # last flag comes between one and two meetings later.
    batches = -(-(num_ranks - 1) // senders)
    vouch = (num_ranks - 1 - senders) * fab.flag_ns
    assert (senders * fab.flag_ns + vouch - 1e-6 <= sw_gain
            <= batches * senders * fab.flag_ns + vouch + 1e-6)
    if batches == 1:
        assert sw_gain == pytest.approx(senders * fab.flag_ns + vouch, rel=1e-9)


def test_calibrate_remembers_each_points_value_per_fabric(monkeypatch: pytest.MonkeyPatch) -> None:
    # While calibrate runs, a point evaluated again at the same fabric (a leave-one-out refit
    # starting where the full fit ended) is not re-simulated; outside it every call simulates.
    from ubep.sim import fit as fit_mod

    calls: list[float] = []

    def evaluate(f: Any) -> float:
        calls.append(f.issue_ns)
        return 2.0 * f.issue_ns

    p = TrainingPoint("memo_probe", "test", "-", 200.0, 0.1, evaluate)
    a, b = fabric(issue_ns=100.0), fabric(issue_ns=110.0)
    assert p.residual(a) == p.residual(a) == pytest.approx(0.0)
    assert len(calls) == 2  # off: every call evaluates
    monkeypatch.setattr(fit_mod, "_MEMO", [True])
    monkeypatch.setattr(fit_mod, "_VALUES", {})
    values = [p.value(a), p.value(b), p.value(a), p.value(b)]
    assert values == [200.0, 220.0, 200.0, 220.0]
    assert calls == [100.0, 100.0, 100.0, 110.0]  # one new evaluation per fabric


@pytest.mark.parametrize("mode", ["analytic", "events"])
def test_consume_wait_names_the_wait_for_a_row(mode: str) -> None:
    # One row from rank 0 to rank 1 (ASP SP). Rank 1's core 0 sends nothing: it is free from
    # Init (1000 ns) and reorders the row once it lands, so it waits land - 1000 and then works
    # one consume; rank 0's cores reorder nothing and wait nothing.
    from tests.sim.test_sim_model import speed as _speed

    f, topo = fabric(), two_ranks()
    plans = [plan(0, [(0, 0, 1, 0)], n_send=1, n_count=1), plan(1, [], n_send=1, n_count=1)]
    res = simulate(plans, topo, f, engine="asp", sync="sp", row_bytes=ROW, mode=mode)
    work = 100 + ROW / 10 + 0.5 * 400
    land = 1000 + work / _speed(f, 1) + ROW / 20 + 400
    wait = res.consume_wait_ns()
    assert wait.shape == (2, 2)
    assert wait[1, 0] == pytest.approx(land - 1000, abs=1e-2)
    assert wait[0].sum() == 0.0 and wait[1, 1] == 0.0
