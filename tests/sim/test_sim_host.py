"""The host model (ubep.sim.host) and the derived AIV costs with their intervals.

Expected values are computed here from the model's equations (docs/SIMULATOR.md 3.1, 3.2, 6)
or by brute force from ``topk_idx``, not copied from the simulator.
"""

from __future__ import annotations

import numpy as np
import pytest

from ubep.errors import InvalidArgumentError
from ubep.routing import uniform_topk
from ubep.sim.calib import (
    AIV_ASSUMPTIONS,
    aiv_costs,
    fabric_variants,
    load_calibration,
    load_fabric,
    use_fit,
)
from ubep.sim.experiments import exchange_latency_ns
from ubep.sim.host import HostCase, canonical_plans, combine_row_map, predict_host
from ubep.sim.workload import UBEP, Workload, run_case
from ubep.topology import cm384


@pytest.mark.parametrize("layout", ["expert", "rank"])
def test_canonical_plans_follow_the_engines_send_order(layout: str) -> None:
    R, E = 4, 16
    idxs = [uniform_topk(9, E, 3, seed=r) for r in range(R)]
    for r, plan in enumerate(canonical_plans(idxs, E, layout)):
        # Brute force: destinations r+1, r+2, ..., r; inside one, tokens then k in order.
        want = []
        slots: dict[int, int] = {}
        rows = []
        for t in range(9):
            seen = set()
            for k in range(3):
                e = int(idxs[r][t, k])
                d = e // (E // R)
                if layout == "rank" and d in seen:
                    continue
                seen.add(d)
                rows.append((t, k, e, d))
        rows.sort(key=lambda u: ((u[3] - r - 1) % R, u[0], u[1]))
        for t, k, e, d in rows:
            key = e if layout == "expert" else d
            want.append((t, k, e, d, slots.get(key, 0)))
            slots[key] = slots.get(key, 0) + 1
        got = list(zip(plan.send_token.tolist(), plan.send_k.tolist(), plan.send_expert.tolist(),
                       plan.send_dst_rank.tolist(), plan.send_slot.tolist(), strict=True))
        assert got == want
        assert plan.num_send_cores == 1 and plan.num_count_cores == 0
        np.testing.assert_array_equal(plan.send_hop, (plan.send_dst_rank != r).astype(int))


@pytest.mark.parametrize("cpus", [1, 2])
@pytest.mark.parametrize(("sync", "writer", "reader"), [("sw", "copy", "-"),
                                                         ("sp", "spw", "sptail")])
def test_predict_host_two_ranks_closed_form(sync: str, writer: str, reader: str,
                                            cpus: int) -> None:
    # Each rank's one token picks an expert of the peer (k=0) and one of its own (k=1).
    idxs = [np.array([[2, 0]]), np.array([[0, 2]])]
    a, b, c, fixed, lat = 300.0, 500.0, 70.0, 10_000.0, 400.0
    # (writer, reader) -> (writer ns, reader ns) per row; own rows are a plain copy, nobody
    # reads them (SW's peer rows are the same pass: b = a there, and SW reads nothing)
    if sync == "sw":
        b, c = a, 0.0
    costs = {("copy", "-"): (a, 0.0), (writer, reader): (b, c), ("tail", "-"): (0.0, 0.0)}

    def timer(writer: str, rd: str, terms: int) -> tuple[float, float]:
        return costs[(writer, rd)]

    case = HostCase(ranks=2, tokens=1, hidden=64, itemsize=2, layout="expert", engine="asp",
                    sync=sync, op="dispatch", num_experts=4, num_topk=2)
    got = predict_host(case, idxs, fixed_ns=fixed, flag_oneway_ns=lat, timer=timer, cpus=cpus)
    # Two CPUs, side by side: set-up, the peer row (b), the own row (a); the peer's row to me
    # was written by then, so the reorder (c) follows at once. One CPU: rank 0's set-up, then
    # it waits for rank 1's readiness: rank 1's set-up and both its rows, then it waits for
    # rank 0's row; rank 0 sends both rows and reorders; its call, from its start, is the
    # slowest (rank 1's starts one set-up later and ends one reorder after rank 0's).
    want = fixed + b + a + c if cpus == 2 else 2 * fixed + 2 * a + 2 * b + c
    assert got == pytest.approx(want, abs=1e-3)


def test_predict_host_bsp_waits_for_both_barriers() -> None:
    # BSP, a CPU per rank: set-up, both rows staged (w each), the first barrier (one flag
    # latency after the last arrival), the flags (none here), the second barrier, then both
    # received rows copied out (r each)
    idxs = [np.array([[2, 0]]), np.array([[0, 2]])]
    w, r, fixed, lat = 300.0, 120.0, 10_000.0, 400.0

    def timer(writer: str, rd: str, terms: int) -> tuple[float, float]:
        assert writer == "copy"
        return w, r

    case = HostCase(ranks=2, tokens=1, hidden=64, itemsize=2, layout="expert", engine="bsp",
                    sync="sw", op="dispatch", num_experts=4, num_topk=2)
    got = predict_host(case, idxs, fixed_ns=fixed, flag_oneway_ns=lat, timer=timer, cpus=2)
    assert got == pytest.approx(fixed + 2 * w + 2 * lat + 2 * r, abs=1e-3)


def test_host_case_rejects_bad_input() -> None:
    with pytest.raises(InvalidArgumentError) as exc:
        HostCase(2, 1, 64, 2, "expert", "asp", "sw", "reduce")
    assert exc.value.argument == "op"


def test_aiv_costs_formulas_and_stored_constants() -> None:
    got = aiv_costs(2.0, 10.0)
    assert got["vector_op_ns"] == pytest.approx(11.0 / 2.0)
    assert got["count_expert_ns"] == pytest.approx(5.0)
    assert got["count_pick_ns"] == pytest.approx(4.0 / 256 / 2.0)
    assert got["cumsum_entry_ns"] == pytest.approx(6 * 10.0 / 64 / 2.0)
    # calib.json's derived constants are the formulas at the fitted assumptions, and at the
    # first-principles ones without the fit
    fitted = load_calibration()["fabrics"]["cm384"]["fit"]["values"]
    fab = load_fabric("cm384")
    for name, value in aiv_costs(fitted["aiv_clock_ghz"], fitted["vector_instr_cycles"]).items():
        assert getattr(fab, name) == pytest.approx(value)
    nominal = aiv_costs(AIV_ASSUMPTIONS["aiv_clock_ghz"]["value"],
                        AIV_ASSUMPTIONS["vector_instr_cycles"]["value"])
    use_fit(False)
    try:
        first = load_fabric("cm384")
    finally:
        use_fit(True)
    for name, value in nominal.items():
        assert getattr(first, name) == pytest.approx(value)
    for a in AIV_ASSUMPTIONS.values():
        lo, hi = a["range"]
        assert lo <= a["value"] <= hi and a["kind"] == "assumed" and a["source"]


def test_corners_bound_the_prediction() -> None:
    var = fabric_variants("cm384")
    topo = cm384(16, ranks_per_node=4, cores_per_rank=8)
    w = Workload(tokens_per_rank=32, num_topk=4)
    system = UBEP.with_(num_send_cores=6, num_count_cores=2)  # fixed split: monotone
    lat = {k: run_case(w, system, topo, f).latency_ns for k, f in var.items()}
    for key, value in lat.items():
        assert lat["low"] - 1e-6 <= value <= lat["high"] + 1e-6, key
    assert lat["low"] < lat["high"]


def test_exchange_microbenchmark_sw_pays_a_round_trip() -> None:
    topo = cm384(16)
    fab = load_fabric("cm384")
    sw, sp = (exchange_latency_ns(topo, fab, s, 100) for s in ("sw", "sp"))
    # SW: its share of a round trip as a fence, then the flag, whose flight follows; SP: the
    # store's flight, then one sentinel check and the reset of the 100 B row.
    one_hop = topo.latency_ns[1]
    sp_extra = fab.vector_op_ns + 100 / fab.core_bandwidth_gbps
    assert sw - sp >= fab.fence_rtt_fraction * 2 * one_hop + fab.flag_ns - sp_extra - 1e-6
    full = fab.with_values(fence_rtt_fraction=1.0)
    sw_full = exchange_latency_ns(topo, full, "sw", 100)
    assert sw_full - sw == pytest.approx((1 - fab.fence_rtt_fraction)
                                         * (2 * one_hop + 100 / topo.bandwidth_gbps[1]))


@pytest.mark.parametrize(("ranks", "layout"), [(2, "expert"), (2, "rank"), (4, "rank")])
def test_combine_row_map_is_where_the_runtime_puts_the_rows(ranks: int, layout: str) -> None:
    E, T, K = 8, 6, 3
    idxs = [uniform_topk(T, E, K, seed=10 + r) for r in range(ranks)]
    epr = E // ranks
    # Brute force from the receive order (docs/PORTING.md): rank d's rows by local expert,
    # then source rank, then token (layout "expert"); by source rank, then token ("rank").
    recv: dict[int, list[tuple[int, int, int]]] = {d: [] for d in range(ranks)}
    for d in range(ranks):
        if layout == "expert":
            for e in range(d * epr, (d + 1) * epr):
                recv[d] += [(src, t, e) for src in range(ranks) for t in range(T)
                            if e in idxs[src][t].tolist()]
        else:
            recv[d] += [(src, t, -1) for src in range(ranks) for t in range(T)
                        if any(int(e) // epr == d for e in idxs[src][t])]
    got = combine_row_map(idxs, E, layout)
    for r in range(ranks):
        for t in range(T):
            if layout == "expert":
                want = [(int(e) // epr, recv[int(e) // epr].index((r, t, int(e))))
                        for e in idxs[r][t]]
            else:
                dests = sorted({int(e) // epr for e in idxs[r][t]})
                want = [(d, recv[d].index((r, t, -1))) if d in dests else (-1, -1)
                        for d in range(ranks)]
            assert [tuple(v) for v in got[r, t].tolist()] == want


def test_predict_host_combine_is_the_busiest_ranks_reduction() -> None:
    # ASP combine, one core per rank, no latency: the call is the fixed cost plus the rank
    # with the most rows reducing them one after the other, at the timer's cost per row.
    # experts 0-1 live on rank 0, 2-3 on rank 1; rows per rank: expert layout 4 and 4 (one
    # per pick), rank layout 2 (rank 0: each token to one rank) and 3 (rank 1: 1 + 2)
    idxs = [np.array([[0, 1], [2, 3]]), np.array([[0, 1], [0, 2]])]
    per_row, fixed = 250.0, 1_000.0

    def timer(writer: str, rd: str, terms: int) -> tuple[float, float]:
        assert rd in ("reduce", "reduce_rank")
        return 0.0, per_row

    # on one CPU the ranks run one after the other, but each rank's call is its own set-up
    # and reduction: a zero-copy combine waits for nobody's rows
    for layout, rows in (("expert", 4), ("rank", 3)):
        case = HostCase(ranks=2, tokens=2, hidden=64, itemsize=2, layout=layout, engine="asp",
                        sync="sw", op="combine", num_experts=4, num_topk=2)
        for cpus in (1, 2):
            got = predict_host(case, idxs, fixed_ns=fixed, flag_oneway_ns=0.0, timer=timer,
                               cpus=cpus)
            assert got == pytest.approx(fixed + rows * per_row, abs=1e-3)
