"""CANN EP's fixed costs from its structure (docs/SIMULATOR.md 1.6), computed by hand at 16 and
256 ranks: what the BSP kernel pays per SyncAll, per flag phase (stop-and-wait per
destination) and per verification, from Table 2's latencies and the die's 48 AIVs."""

from __future__ import annotations

import numpy as np
import pytest

from ubep.sim import build_spec
from ubep.sim.calib import load_fabric
from ubep.sim.experiments import topology_for
from ubep.sim.fabric import syncall_atomic_ns
from ubep.sim.workload import CANN_EP, Workload, plans_for, run_case

L0, L1, L2 = 218.0, 929.0, 2500.0  # Table 2: intra-NPU, one hop, two hops


def test_syncall_is_the_dies_atomic_arrivals() -> None:
    # 48 AIVs' adds on one HBM word, one intra-NPU access apart, and the releasing read.
    assert syncall_atomic_ns(48, L0) == 49 * 218.0 == 10682.0
    assert syncall_atomic_ns(1, 100.0) == 200.0
    fab = load_fabric("cm384")
    assert fab.barrier_ns == pytest.approx(10682.0)
    # A per-rank SyncAll: the same at every rank count.
    for ranks in (16, 256):
        assert fab.syncall_ns(topology_for("cm384", ranks)) == pytest.approx(10682.0)


@pytest.mark.parametrize("ranks", [16, 256])
def test_bsp_fixed_costs_by_hand(ranks: int) -> None:
    fab = load_fabric("cm384")
    topo = topology_for("cm384", ranks)
    w = Workload(tokens_per_rank=8)
    plans = plans_for(w, CANN_EP, topo, fab)
    spec = build_spec(plans, topo, fab, engine="bsp", sync="sw", row_bytes=w.row_bytes)
    picks = max(int(p.num_units) for p in plans)
    per_expert = fab.count_expert_ns + picks * fab.count_pick_ns
    fence = fab.fence_rtt_fraction * 2  # of a hop's one-way latency: its round trip's share

    # Flag phase (stop-and-wait per destination): the R experts (one a rank) are split over
    # the 48 AIVs as ptr[c] = c R // 48; per destination the AIV counts the expert, fences
    # (0.2347 of the round trip to it) and writes the flag.
    if ranks == 16:
        # 16 experts: AIV 2 holds expert 0 (ptr = 0, 1), so rank 0's AIV 2 flags itself (hop
        # 0) and rank 1's AIV 2 flags rank 0 one hop away (same 16-die node).
        expect_r0 = per_expert + fence * L0 + fab.flag_ns
        expect_r1 = per_expert + fence * L1 + fab.flag_ns
        chunk = int(np.flatnonzero(spec.chunk_core == 2)[0])
    else:
        # 256 experts: AIV 0 holds experts 0-4 (ptr = 0, 5): rank 0 flags itself and ranks
        # 1-4 of its node, 5 words back to back; rank 16 (the next node) flags ranks 0-4 two
        # hops away.
        expect_r0 = 5 * (per_expert + fab.flag_ns) + fence * (L0 + 4 * L1)
        expect_r1 = 5 * (per_expert + fab.flag_ns) + fence * 5 * L2
        chunk = int(np.flatnonzero(spec.chunk_core == 0)[-1])
    other = 1 if ranks == 16 else 16
    assert spec.chunk_offset_ns[0, chunk] == pytest.approx(expect_r0, rel=1e-12)
    assert spec.chunk_offset_ns[other, chunk] == pytest.approx(expect_r1, rel=1e-12)

    # Both SyncAlls: 49 x 218 ns after the last of the rank's cores arrives.
    res = run_case(w, CANN_EP, topo, fab)
    first, second = res.timeline.spans(rank=0, core=0, task="barrier")
    # The first SyncAll ends where the flag phase starts; the second 10682 ns after the last
    # of the rank's AIVs has verified its words.
    flag_start = res.timeline.spans(rank=0, core=0, task="flag")[0].start_ns
    verify_end = max(s.end_ns for c in range(48)
                     for s in res.timeline.spans(rank=0, core=c, task="verify"))
    assert first.end_ns == pytest.approx(flag_start)
    assert second.end_ns - verify_end == pytest.approx(10682.0, abs=1e-6)
    # Verification: the R words a rank receives (one expert a rank), word e polled by AIV
    # e mod 48, one 218 ns local read each once landed: ceil(R / 48) polls on AIV 0.
    polls = -(-ranks // 48)
    (ver,) = res.timeline.spans(rank=0, core=0, task="verify")
    assert ver.end_ns - ver.start_ns >= polls * L0 - 1e-6
