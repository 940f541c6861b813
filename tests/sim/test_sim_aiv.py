"""The per-AIV time of Figures 7, 8 and 12 (docs/SIMULATOR.md 1.9): each AIV's time is the end
of its last task from the call's start, summed over the slowest rank's AIVs, and split into
all-to-all work and the rest. Expected numbers are computed by hand from the timelines."""

from __future__ import annotations

import numpy as np
import pytest

from tests.sim.test_sim_model import ROW, fabric, plan, two_ranks
from ubep.sim import simulate
from ubep.sim.timeline import SimResult, TaskTimeline


def _result(parts: list[tuple[str, list[int], list[int], list[float], list[float]]],
            rank_end: list[float], consume_work: list[float], cores: int) -> SimResult:
    tl = TaskTimeline.build([(t, np.array(r), np.array(c), np.array(s), np.array(e))
                             for t, r, c, s, e in parts])
    none = np.zeros(0)
    return SimResult(op="dispatch", engine="asp", sync="sp", mode="analytic",
                     latency_ns=max(rank_end), rank_end_ns=np.array(rank_end), timeline=tl,
                     unit_end_ns=none, unit_land_ns=none, unit_ready_ns=none,
                     core_send_end_ns=np.zeros((2, 2)), core_land_end_ns=np.zeros((2, 2)),
                     item_end_ns=none, consume_work_ns=np.array(consume_work),
                     core_ack_end_ns=np.zeros((2, 2)), core_rtt_ns=np.zeros((2, 2)),
                         core_rx_wait_ns=np.zeros((2, 2)),
                     cores_per_rank=cores)


def test_aiv_time_is_each_cores_last_end_on_the_slowest_rank() -> None:
    # Rank 0, four AIVs: a send core that reorders last (ends 90), a count core that ends with
    # CalCumSum (45), a send core with no rows to reorder (30), a core without a task (0).
    # Rank 1 ends at 70, so rank 0 (90) is the slowest.
    parts = [
        ("init", [0, 0, 0, 1], [0, 1, 2, 0], [0, 0, 0, 0], [10, 10, 10, 10]),
        ("send", [0, 0, 1], [0, 2, 0], [10, 10, 10], [50, 30, 70]),
        ("count", [0], [1], [10], [20]),
        ("verify", [0], [1], [20], [40]),
        ("cumsum", [0], [1], [40], [45]),
        ("consume", [0], [0], [60], [90]),  # 30 us span, 20 of it work, 10 waiting for rows
    ]
    res = _result(parts, rank_end=[90.0, 70.0], consume_work=[20.0, 0.0], cores=4)
    np.testing.assert_allclose(res.aiv_end_ns(), [90, 45, 30, 0])
    assert res.aiv_sum_ns() == pytest.approx(165.0)
    np.testing.assert_allclose(res.aiv_end_ns(rank=1), [70, 0, 0, 0])
    # all-to-all: init 3 x 10 + send 40 + 20 + count 10 + cumsum 5 + reorder work 20 = 125;
    # the rest (verification 20, the reorder's wait 10, the wait before it 10) = 40.
    a2a, other = res.aiv_split_ns()
    assert (a2a, other) == pytest.approx((125.0, 40.0))


@pytest.mark.parametrize("mode", ["analytic", "events"])
def test_bsp_aivs_run_to_the_barrier_asp_aivs_stop_with_their_tasks(mode: str) -> None:
    # Two ranks of four cores, one row each way from core 0. BSP: every core waits at both
    # SyncAlls, so each AIV's time reaches at least the second barrier's release. ASP with two
    # send cores and one count core: the fourth core has no task and counts 0; the second send
    # core has no rows and stops after init and its share of the reordering.
    f, topo = fabric(barrier_ns=500.0), two_ranks(cores=4)
    plans = [plan(r, [(0, 0, 1 - r, 0)], n_send=2, n_count=1, topo=topo) for r in (0, 1)]
    bsp = simulate(plans, topo, f, engine="bsp", sync="sw", row_bytes=ROW, mode=mode)
    r = bsp.slowest_rank
    barrier = bsp.timeline.mask(rank=r, task="barrier")
    release = bsp.timeline.end_ns[barrier].max()
    ends = bsp.aiv_end_ns()
    assert ends.size == 4 and np.all(ends >= release)
    assert bsp.aiv_sum_ns() == pytest.approx(float(ends.sum()))
    asp = simulate(plans, topo, f, engine="asp", sync="sp", row_bytes=ROW, mode=mode)
    ends = asp.aiv_end_ns()
    assert ends.size == 4 and ends[3] == 0.0
    assert asp.aiv_sum_ns() < 3 * asp.latency_ns  # not every AIV runs to the end
    a2a, other = asp.aiv_split_ns()
    assert a2a + other == pytest.approx(asp.aiv_sum_ns())
