"""The host model task by task: ranks that share CPUs and run until they must wait
(ubep.sim.host_sched), each rank's own work (ubep.sim.host.rank_works) and where the runtime
writes a sent row (ubep.sim.host.send_positions). Expected values are computed here by hand or
by brute force from ``topk_idx``, not copied from the model."""

from __future__ import annotations

import numpy as np
import pytest

from ubep.errors import InvalidArgumentError
from ubep.routing import uniform_topk
from ubep.sim.host import (
    HostCase,
    call_latency_ns,
    predict_host_tasks,
    rank_works,
    send_positions,
    send_regions,
    writer_positions,
)
from ubep.sim.host_sched import (
    Doorbells,
    RankWork,
    SchedSpan,
    back_to_back,
    cpu_share,
    cpus_for,
    serialize,
)
from ubep.sim.spec import RowCosts

# rank 0: init 10, 100 to rank 1, 50 to itself, 5 to place its received rows;
# rank 1: init 20, 200 to rank 0, 60 to itself, 7 to place
WORKS = [RankWork(10.0, (1, 0), (100.0, 50.0), 5.0), RankWork(20.0, (0, 1), (200.0, 60.0), 7.0)]


def _by(spans: list, rank: int, task: str) -> list[tuple[float, float]]:
    return [(s.start_ns, s.end_ns) for s in spans if s.rank == rank and s.task == task]


def test_one_cpu_runs_each_rank_until_it_waits() -> None:
    spans = serialize(WORKS, "asp", cpus=1)
    # Rank 0 runs first: init 0-10; rank 1 is not ready, so rank 0 waits and rank 1 takes the
    # CPU: init 10-30, sends 30-230 (to 0) and 230-290 (own); it then waits for rank 0's rows
    # and rank 0 runs: its wait for rank 1 was 10-290 (rank 1's whole work); sends 290-390,
    # 390-440; rank 1's rows are in, so it places them 440-445; then rank 1 (wait 290-445)
    # places its own 445-452.
    assert _by(spans, 0, "init") == [(0.0, 10.0)]
    assert _by(spans, 1, "init") == [(10.0, 30.0)]
    assert _by(spans, 1, "send") == [(30.0, 230.0), (230.0, 290.0)]
    assert _by(spans, 0, "wait") == [(10.0, 290.0)]
    assert _by(spans, 0, "send") == [(290.0, 390.0), (390.0, 440.0)]
    assert _by(spans, 0, "reorder") == [(440.0, 445.0)]
    assert _by(spans, 1, "wait") == [(290.0, 445.0)]
    assert _by(spans, 1, "reorder") == [(445.0, 452.0)]


def test_a_cpu_per_rank_waits_only_for_the_peers_work() -> None:
    spans = serialize(WORKS, "asp", cpus=2)
    # side by side: rank 0 waits for rank 1's readiness (10-20), sends 20-170, then waits for
    # rank 1's rows to it (sent 20-220): 170-220, places 220-225; rank 1 never waits
    assert _by(spans, 0, "wait") == [(10.0, 20.0), (170.0, 220.0)]
    assert _by(spans, 0, "reorder") == [(220.0, 225.0)]
    assert _by(spans, 1, "send") == [(20.0, 220.0), (220.0, 280.0)]
    assert _by(spans, 1, "wait") == []
    assert _by(spans, 1, "reorder") == [(280.0, 287.0)]


def test_asp_receive_metadata_follows_the_sends_once_every_peer_is_set_up() -> None:
    # WORKS with the receive's metadata (rank 0: 4, rank 1: 6), a CPU each: rank 0 waits for
    # rank 1's readiness (10-20), sends 20-170, its metadata 170-174, then waits for rank 1's
    # rows to it (sent 20-220): 174-220, places them 220-225; rank 1 sends 20-280, its
    # metadata 280-286, places 286-293
    works = [RankWork(10.0, (1, 0), (100.0, 50.0), 5.0, cumsum_ns=4.0),
             RankWork(20.0, (0, 1), (200.0, 60.0), 7.0, cumsum_ns=6.0)]
    spans = serialize(works, "asp", cpus=2)
    assert _by(spans, 0, "cumsum") == [(170.0, 174.0)]
    assert _by(spans, 0, "wait") == [(10.0, 20.0), (174.0, 220.0)]
    assert _by(spans, 0, "reorder") == [(220.0, 225.0)]
    assert _by(spans, 1, "cumsum") == [(280.0, 286.0)]
    assert _by(spans, 1, "reorder") == [(286.0, 293.0)]
    # the metadata needs every source's counts, published in its set-up, and so does a send,
    # even of a rank's own rows (their places in recv_x follow every source's counts): rank 0
    # sends only to itself, after its set-up (0-10) and rank 1's (0-100): waits 10-100, sends
    # 100-150, its metadata 150-154; nobody sends it rows, so it places at once (154-159)
    works = [RankWork(10.0, (0,), (50.0,), 5.0, cumsum_ns=4.0),
             RankWork(100.0, (1,), (60.0,), 5.0, cumsum_ns=3.0)]
    spans = serialize(works, "asp", cpus=2)
    assert _by(spans, 0, "wait") == [(10.0, 100.0)]
    assert _by(spans, 0, "cumsum") == [(150.0, 154.0)]
    assert _by(spans, 0, "reorder") == [(154.0, 159.0)]
    assert _by(spans, 1, "cumsum") == [(160.0, 163.0)]
    # BSP has no such task (its metadata is in its reorder)
    assert _by(serialize(works, "bsp", cpus=2), 0, "cumsum") == []


def test_the_loop_between_calls_runs_before_each_rank_s_set_up() -> None:
    # WORKS with 5 of the caller's own work before each call. One CPU: rank 0 runs it and its
    # set-up 0-15, waits; rank 1 runs its 5 and its set-up 15-40, sends 40-240 and 240-300,
    # then waits for rank 0's rows: rank 0's wait (15-300) holds rank 1's loop too
    one = back_to_back(WORKS, "asp", cpus=1, calls=1, loop_gap_ns=5.0)
    assert _by(one, 0, "init") == [(0.0, 15.0)]
    assert _by(one, 1, "init") == [(15.0, 40.0)]
    assert _by(one, 0, "wait")[0] == (15.0, 300.0)
    # a CPU each: both set-ups 5 longer, the ranks' skew as without it (62, test above):
    # the second call's rank 1 enters at 62, set up at 87
    two = back_to_back(WORKS, "asp", cpus=2, calls=2, loop_gap_ns=5.0)
    assert _by(two, 1, "init") == [(62.0, 87.0)]
    assert _by(two, 0, "wait")[0] == (15.0, 87.0)
    with pytest.raises(InvalidArgumentError, match="loop_gap_ns"):
        back_to_back(WORKS, "asp", cpus=2, loop_gap_ns=-1.0)


def test_asp_sends_nothing_before_every_ranks_set_up() -> None:
    # 3 ranks, a CPU each: set-ups 10, 10 and 50, then 10 to each destination (r+1, r+2, r).
    # ASP places a row in d from every source's counts to d, published in each set-up: rank
    # 0 sends to rank 1 only once rank 2 is set up too (waits 10-50), then 50-60, 60-70,
    # 70-80, as does rank 1; every rank's rows to the others are in by 80. BSP needs only the
    # destination's readiness: rank 0 sends to rank 1 at 10-20, waits for rank 2 20-50.
    works = [RankWork(10.0, (1, 2, 0), (10.0, 10.0, 10.0), 0.0),
             RankWork(10.0, (2, 0, 1), (10.0, 10.0, 10.0), 0.0),
             RankWork(50.0, (0, 1, 2), (10.0, 10.0, 10.0), 0.0)]
    asp = serialize(works, "asp", cpus=3)
    for r in (0, 1):
        assert _by(asp, r, "wait") == [(10.0, 50.0)]
        assert _by(asp, r, "send") == [(50.0, 60.0), (60.0, 70.0), (70.0, 80.0)]
    assert _by(asp, 2, "send") == [(50.0, 60.0), (60.0, 70.0), (70.0, 80.0)]
    assert [s for s in asp if s.task == "wait" and s.rank == 2] == []
    bsp = serialize(works, "bsp", cpus=3)
    assert _by(bsp, 0, "send")[0] == (10.0, 20.0)
    assert [w for w in _by(bsp, 0, "wait") if w[1] > w[0]] == [(20.0, 50.0)]


def test_bsp_barrier_releases_a_flag_latency_after_the_last_arrival() -> None:
    spans = serialize(WORKS, "bsp", cpus=2, barrier_ns=3.0)
    # sends end at 170 (rank 0) and 280 (rank 1): the first barrier releases at 283; flags
    # take no time here, so both reach the second at 283, released at 286; then each places
    # its rows
    assert _by(spans, 0, "barrier")[0] == (170.0, 283.0)
    assert _by(spans, 1, "barrier")[0][1] == 283.0
    assert _by(spans, 0, "reorder") == [(286.0, 291.0)]
    assert _by(spans, 1, "reorder") == [(286.0, 293.0)]


# a wait sleeps after 30 ns of spinning and yielding, wakes 4 after its publication; a ring
# costs its publisher 2 per peer asleep, 1 per peer registered but awake
BELLS = Doorbells(yield_ns=30.0, wake_ns=4.0, ring_sleep_ns=2.0, ring_armed_ns=1.0)


def test_a_wait_past_its_yield_window_sleeps_and_its_waker_pays_the_ring() -> None:
    # WORKS, a CPU each (test above without doorbells: rank 0 waits 10-20 and 170-220).
    # Rank 0's wait for rank 1's readiness lasts 10 (< 30): no sleep, rank 1's set-up ring at
    # 20 is free. Rank 0's wait for rank 1's rows, from 170, is 50 old when rank 1's send to
    # it ends at 220: rank 0 sleeps, rank 1's ring costs 2 (its send span 220-222) and rank
    # 0 runs again at 224 (wait 170-224), places 224-229. Rank 1 sends to itself 222-282 (no
    # ring), places 282-289.
    spans = serialize(WORKS, "asp", cpus=2, doorbells=BELLS)
    assert _by(spans, 0, "wait") == [(10.0, 20.0), (170.0, 224.0)]
    assert _by(spans, 0, "reorder") == [(224.0, 229.0)]
    assert _by(spans, 1, "send") == [(20.0, 220.0), (220.0, 222.0), (222.0, 282.0)]
    assert _by(spans, 1, "reorder") == [(282.0, 289.0)]
    assert _by(spans, 1, "wait") == []


def test_a_rank_that_slept_stays_registered_and_every_later_ring_to_it_costs() -> None:
    # rank 0: set-up 10, 100 to rank 1, 50 to itself, 5 to place; rank 1: set-up 60, 20 to
    # rank 0, 60 to itself, 7 to place; a CPU each. Rank 0 waits for rank 1's readiness from
    # 10; at 60 it is 50 old: asleep, rank 1's set-up ring costs 2 (60-62), rank 0 runs at 64
    # (wait 10-64) and sends 64-164, 164-214, places 214-219. Rank 1 sends to 0 62-82: rank 0
    # is awake but registered, the ring costs 1 (82-83); to itself 83-143; waits for rank 0's
    # rows (sent at 164; 21 old, awake: no wake-up) 143-164 and places 164-171.
    works = [RankWork(10.0, (1, 0), (100.0, 50.0), 5.0), RankWork(60.0, (0, 1), (20.0, 60.0), 7.0)]
    spans = serialize(works, "asp", cpus=2, doorbells=BELLS)
    assert _by(spans, 0, "wait") == [(10.0, 64.0)]
    assert _by(spans, 0, "send") == [(64.0, 164.0), (164.0, 214.0)]
    assert _by(spans, 0, "reorder") == [(214.0, 219.0)]
    assert _by(spans, 1, "init") == [(0.0, 60.0), (60.0, 62.0)]
    assert _by(spans, 1, "send") == [(62.0, 82.0), (82.0, 83.0), (83.0, 143.0)]
    assert _by(spans, 1, "wait") == [(143.0, 164.0)]
    assert _by(spans, 1, "reorder") == [(164.0, 171.0)]
    # no doorbells: the same waits end as their condition holds, rings are free
    plain = serialize(works, "asp", cpus=2)
    assert _by(plain, 0, "wait") == [(10.0, 60.0)]
    assert _by(plain, 1, "send") == [(60.0, 80.0), (80.0, 140.0)]


def test_a_barrier_sleeper_wakes_after_the_release_and_the_last_arrival_rings() -> None:
    # WORKS on BSP, a CPU each, barrier 3: rank 0 reaches the first barrier at 170 (test
    # above). Rank 1's send to it ends at 220, rank 0 50 old there: asleep, the ring costs 2
    # (220-222; the sleeper wakes, finds the barrier closed and sleeps again); rank 1 sends
    # to itself 222-282, arrives at 282 and rings rank 0 again (2: 282-284), then waits for
    # the release at 285; rank 0 runs a wake-up after it, at 289.
    spans = serialize(WORKS, "bsp", cpus=2, barrier_ns=3.0, doorbells=BELLS)
    assert _by(spans, 1, "send") == [(20.0, 220.0), (220.0, 222.0), (222.0, 282.0)]
    assert _by(spans, 0, "barrier")[0] == (170.0, 289.0)
    assert _by(spans, 1, "barrier")[:2] == [(282.0, 284.0), (284.0, 285.0)]
    with pytest.raises(InvalidArgumentError, match="wake_ns"):
        Doorbells(yield_ns=1.0, wake_ns=-1.0, ring_sleep_ns=0.0, ring_armed_ns=0.0)


def test_a_cpu_share_stretches_every_task_not_the_barrier() -> None:
    # a CPU each, half of each CPU left to the ranks: every task takes twice its own time.
    # rank 0: init 0-20, waits for rank 1's readiness (its init 0-40), sends 40-240 and
    # 240-340, waits for rank 1's rows to it (sent 40-440): 340-440, places 440-450;
    # rank 1: sends 40-440, 440-560, its rows from rank 0 are in (240): places 560-574
    spans = serialize(WORKS, "asp", cpus=2, share=0.5)
    assert _by(spans, 0, "wait") == [(20.0, 40.0), (340.0, 440.0)]
    assert _by(spans, 0, "send") == [(40.0, 240.0), (240.0, 340.0)]
    assert _by(spans, 0, "reorder") == [(440.0, 450.0)]
    assert _by(spans, 1, "send") == [(40.0, 440.0), (440.0, 560.0)]
    assert _by(spans, 1, "reorder") == [(560.0, 574.0)]
    # BSP: the sends end at 340 and 560; the barrier's flag latency (measured as the ranks
    # run) is not stretched: released at 563, the second at 566
    bsp = serialize(WORKS, "bsp", cpus=2, barrier_ns=3.0, share=0.5)
    assert _by(bsp, 0, "barrier") == [(340.0, 563.0), (563.0, 566.0)]
    assert _by(bsp, 0, "reorder") == [(566.0, 576.0)]


def test_back_to_back_calls_start_where_each_rank_ended() -> None:
    # a CPU each. The first call (all start at 0, test above) ends rank 0 at 225 and rank 1
    # at 287: rank 1 enters the next call 62 later. Second call: rank 0 init 0-10, waits for
    # rank 1's readiness (its init 62-82): 10-82, sends 82-182 and 182-232, waits for rank
    # 1's rows (82-282): 232-282, places 282-287; rank 1 sends 82-282, 282-342 (rank 0's rows
    # to it are in at 182), places 342-349. Ends 287 and 349: the skew is again 62, so the
    # third call repeats the second
    for calls in (2, 3):
        spans = back_to_back(WORKS, "asp", cpus=2, calls=calls)
        assert _by(spans, 0, "wait") == [(10.0, 82.0), (232.0, 282.0)]
        assert _by(spans, 0, "send") == [(82.0, 182.0), (182.0, 232.0)]
        assert _by(spans, 0, "reorder") == [(282.0, 287.0)]
        assert _by(spans, 1, "init") == [(62.0, 82.0)]
        assert _by(spans, 1, "send") == [(82.0, 282.0), (282.0, 342.0)]
        assert _by(spans, 1, "reorder") == [(342.0, 349.0)]
    assert back_to_back(WORKS, "asp", cpus=2, calls=1) == serialize(WORKS, "asp", cpus=2)
    # a rank that starts later on one CPU runs after the ranks already runnable
    late = serialize(WORKS, "asp", cpus=1, start_ns=[0.0, 5.0])
    assert _by(late, 1, "init") == [(10.0, 30.0)]
    with pytest.raises(InvalidArgumentError, match="calls"):
        back_to_back(WORKS, "asp", cpus=2, calls=0)
    with pytest.raises(InvalidArgumentError, match="start_ns"):
        serialize(WORKS, "asp", cpus=2, start_ns=[0.0])


def test_cpu_share_is_the_measured_cpus_over_the_whole_ones() -> None:
    # 1.5 CPUs measured for 2 ranks run on 2 whole CPUs: each gives them 3/4 of its time;
    # 1.2 CPUs for 2 ranks rounded to 1: that one CPU whole (a share is at most 1)
    assert cpu_share(1.5, 2) == 0.75
    assert cpu_share(1.2, 1) == 1.0
    assert cpu_share(2.0, cpus_for(2.0, 4)) == 1.0
    with pytest.raises(InvalidArgumentError, match="available"):
        cpu_share(0.0, 1)
    with pytest.raises(InvalidArgumentError, match="cpus"):
        cpu_share(1.0, 0)
    with pytest.raises(InvalidArgumentError, match="share"):
        serialize(WORKS, "asp", cpus=1, share=0.0)


def test_serialize_and_cpus_for_reject_bad_input() -> None:
    with pytest.raises(InvalidArgumentError, match="engine"):
        serialize(WORKS, "xsp", cpus=1)
    with pytest.raises(InvalidArgumentError, match="cpus"):
        serialize(WORKS, "asp", cpus=0)
    with pytest.raises(InvalidArgumentError, match="available"):
        cpus_for(0.0, 2)
    assert [cpus_for(a, 2) for a in (1.0, 1.4, 1.6, 2.0, 3.0)] == [1, 1, 2, 2, 2]


def test_rank_works_are_each_ranks_own_rows() -> None:
    # 2 ranks, 4 experts (2 a rank), top-2: rank 0's tokens go to experts (0, 2), (2, 3), (1, 0);
    # rank 1's to (3, 1)
    idxs = [np.array([[0, 2], [2, 3], [1, 0]]), np.array([[3, 1]])]
    case = HostCase(ranks=2, tokens=3, hidden=64, itemsize=2, layout="expert", engine="asp",
                    sync="tff", op="dispatch", num_experts=4, num_topk=2)
    costs = RowCosts(send_ns=(2.0, 10.0), consume_ns=(0.5, 3.0))
    works = rank_works(case, idxs, costs, init_ns=100.0, row_meta_ns=1.0)
    # rank 0: 3 rows to rank 1 (experts 2, 2, 3) at 10 + 1, then 3 own rows at 2 + 1;
    # receives 3 own rows (0.5) and 1 from rank 1 (3.0)
    assert works[0] == RankWork(100.0, (1, 0), (33.0, 9.0), 3 * 0.5 + 3.0)
    # rank 1: 1 row to rank 0 (expert 1) then 1 own (expert 3); receives 1 own, 3 from rank 0
    assert works[1] == RankWork(100.0, (0, 1), (11.0, 3.0), 0.5 + 3 * 3.0)
    bsp = rank_works(HostCase(**{**case.__dict__, "engine": "bsp", "sync": "sw"}), idxs, costs,
                     init_ns=0.0, row_meta_ns=1.0)
    assert bsp[0].send_ns == (30.0, 6.0)  # no per-row bookkeeping outside ASP's send loop
    # the receive's metadata: every rank reads every source's routing, 3 + 1 tokens at 2 ns:
    # ASP's own task, BSP's part of the reorder
    meta = rank_works(case, idxs, costs, init_ns=100.0, recv_meta_ns=2.0)
    assert [w.cumsum_ns for w in meta] == [8.0, 8.0]
    assert meta[0].reorder_ns == works[0].reorder_ns
    bsp_meta = rank_works(HostCase(**{**case.__dict__, "engine": "bsp", "sync": "sw"}), idxs,
                          costs, init_ns=0.0, recv_meta_ns=2.0)
    assert [w.cumsum_ns for w in bsp_meta] == [0.0, 0.0]
    assert [w.reorder_ns for w in bsp_meta] == [b.reorder_ns + 8.0 for b in bsp]
    # a rank whose process runs the passes 1.5x slower, its peer 0.5x: every row cost of the
    # rank scales (sends, receive, metadata), its set-up does not
    scaled = rank_works(case, idxs, costs, init_ns=100.0, row_meta_ns=1.0, recv_meta_ns=2.0,
                        rank_scale=(1.5, 0.5))
    assert scaled[0] == RankWork(100.0, (1, 0), (49.5, 13.5), 1.5 * (3 * 0.5 + 3.0),
                                 cumsum_ns=12.0)
    assert scaled[1] == RankWork(100.0, (0, 1), (5.5, 1.5), 0.5 * (0.5 + 3 * 3.0),
                                 cumsum_ns=4.0)
    for bad in ((1.0,), (1.0, 0.0)):
        with pytest.raises(InvalidArgumentError, match="rank_scale"):
            rank_works(case, idxs, costs, init_ns=0.0, rank_scale=bad)


def test_the_faster_rank_waits_for_the_slower_at_the_next_entry() -> None:
    # ASP, a CPU each, rank 1 at half rank 0's row costs (rank_works' rank_scale 1 and 0.5).
    # Call 1 from 0: rank 0 sends 10-110 (to 1), 110-160, places 160-165; rank 1 sends 10-60,
    # 60-85, waits for rank 0's rows 85-110, places 110-112.5. Call 2 starts where each ended
    # (rank 1 at 0, rank 0 52.5 later): rank 1 waits for rank 0's readiness 10-62.5 (the
    # skew), sends 62.5-137.5, waits for rank 0's rows (sent 62.5-162.5) until 162.5
    works = [RankWork(10.0, (1, 0), (100.0, 50.0), 5.0), RankWork(10.0, (0, 1), (50.0, 25.0), 2.5)]
    spans = back_to_back(works, "asp", cpus=2, calls=2)
    assert _by(spans, 0, "init") == [(52.5, 62.5)]
    assert _by(spans, 1, "wait") == [(10.0, 62.5), (137.5, 162.5)]
    assert _by(spans, 0, "wait") == []


@pytest.mark.parametrize(("ranks", "layout"), [(2, "expert"), (2, "rank"), (4, "expert")])
def test_send_positions_asp_are_the_rows_final_places(ranks: int, layout: str) -> None:
    E, T, K = 8, 6, 3
    epr = E // ranks
    idxs = [uniform_topk(T, E, K, seed=30 + r) for r in range(ranks)]
    # brute force: rank d's received rows by local expert, source, token (or source, token)
    recv: dict[int, list[tuple[int, int, int]]] = {}
    for d in range(ranks):
        if layout == "expert":
            recv[d] = [(src, t, e) for e in range(d * epr, (d + 1) * epr)
                       for src in range(ranks) for t in range(T) if e in idxs[src][t].tolist()]
        else:
            recv[d] = [(src, t, -1) for src in range(ranks) for t in range(T)
                       if any(int(e) // epr == d for e in idxs[src][t])]
    for r, (dst, pos) in enumerate(send_positions(idxs, E, layout, "asp")):
        # the canonical order: destinations r+1, ..., r; tokens, then k, in order
        want = []
        for i in range(ranks):
            d = (r + 1 + i) % ranks
            for t in range(T):
                es = [int(e) for e in idxs[r][t] if int(e) // epr == d]
                if layout == "rank":
                    es = es[:1]
                want += [(d, recv[d].index((r, t, e if layout == "expert" else -1)))
                         for e in es]
        assert list(zip(dst.tolist(), pos.tolist(), strict=True)) == want


def test_send_positions_bsp_are_staging_slots_by_expert() -> None:
    # 2 ranks, 4 experts, top-2, layout "expert": cap_src_rows = T * min(K, 2) = 2 * 2 = 4
    idxs = [np.array([[3, 0], [2, 1]]), np.array([[1, 2], [0, 3]])]
    (d0, p0), (d1, p1) = send_positions(idxs, 4, "expert", "bsp")
    # rank 0 sends to rank 1 first: (t0, e3), (t1, e2); by expert: e2 is slot 0, e3 slot 1;
    # then its own: (t0, e0), (t1, e1): slots 0, 1; its region starts at 0 * 4
    assert d0.tolist() == [1, 1, 0, 0] and p0.tolist() == [1, 0, 0, 1]
    # rank 1 to rank 0: (t0, e1), (t1, e0) -> e0 first: slots 1, 0; own (t0, e2), (t1, e3);
    # rank 1's region starts at 1 * 4
    assert d1.tolist() == [0, 0, 1, 1] and p1.tolist() == [5, 4, 4, 5]
    slots, flat, src = writer_positions(idxs, 4, "expert", "bsp", rows=6)
    # rank 0's rows, region i for destination r+1+i, each region 6 slots (largest slot 5, + 1),
    # read from its tokens 0, 1 (to rank 1), 0, 1 (own), repeated to 6 rows
    assert slots == 12 and flat.tolist() == [1, 0, 6, 7, 1, 0]
    assert src.tolist() == [0, 1, 0, 1, 0, 1]


@pytest.mark.parametrize(("engine", "sync"), [("asp", "tff"), ("asp", "sp"), ("bsp", "sw")])
def test_send_regions_follow_the_segment_layout(engine: str, sync: str) -> None:
    from ubep.plane.layout import compute_layout

    lay = compute_layout(num_ranks=2, num_cores=1, num_experts=8, num_topk=2, max_tokens=4,
                         hidden=64, itemsize=2, combine_itemsize=2, layout="expert",
                         engine=engine, sync=sync, tff_block_bytes=512, tff_flag_bytes=32)
    # ASP writes the rows' final places, in the receive regions that alternate; BSP its
    # staging region, the same one every call
    want = lay.num_regions if engine == "asp" else lay.num_land_regions
    assert send_regions(engine) == want
    with pytest.raises(InvalidArgumentError, match="engine"):
        send_regions("xsp")


def test_call_latency_is_the_slowest_ranks_own_call() -> None:
    # rank 0 runs 0-10 and 40-100 (its call: 100); rank 1 starts at 10 and ends at 95 (85)
    spans = [SchedSpan(0, "init", 0.0, 10.0), SchedSpan(0, "wait", 10.0, 40.0),
             SchedSpan(0, "send", 40.0, 100.0), SchedSpan(1, "init", 10.0, 30.0),
             SchedSpan(1, "reorder", 30.0, 95.0)]
    assert call_latency_ns(spans) == 100.0
    assert call_latency_ns(spans[3:]) == 85.0
    assert call_latency_ns([]) == 0.0


def test_predict_host_tasks_combine_ranks_take_turns_on_one_cpu() -> None:
    # combine, 2 ranks on one CPU: rank 0's set-up (1000) and reduction of its rows (40 each),
    # then rank 1's: nobody waits for a peer, only for the CPU
    idxs = [np.array([[0, 2], [2, 3], [1, 0]]), np.array([[3, 1], [-1, -1], [-1, -1]])]
    case = HostCase(ranks=2, tokens=3, hidden=64, itemsize=2, layout="rank", engine="asp",
                    sync="sw", op="combine", num_experts=4, num_topk=2)

    def timer(writer: str, reader: str, terms: int) -> tuple[float, float]:
        assert reader == "reduce_rank"
        return 0.0, 40.0

    spans = predict_host_tasks(case, idxs, fixed_ns=1000.0, flag_oneway_ns=0.0, timer=timer,
                               cpus=1)
    # rank layout: rank 0's tokens reach ranks {0, 1}, {1}, {0}: 4 rows; rank 1's {1, 0}: 2
    assert _by(spans, 0, "init") == [(0.0, 1000.0)]
    assert _by(spans, 0, "reorder") == [(1000.0, 1160.0)]
    assert _by(spans, 1, "init") == [(1160.0, 2160.0)]
    assert _by(spans, 1, "reorder") == [(2160.0, 2240.0)]
    assert [s for s in spans if s.task == "wait"] == []
    # one call is the ranks starting together (the spans above); fewer is refused
    assert predict_host_tasks(case, idxs, fixed_ns=1000.0, flag_oneway_ns=0.0, timer=timer,
                              cpus=1, calls=1) == spans
    with pytest.raises(InvalidArgumentError, match="calls"):
        predict_host_tasks(case, idxs, fixed_ns=1000.0, flag_oneway_ns=0.0, timer=timer,
                           cpus=1, calls=0)
