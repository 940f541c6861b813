"""The simulator at scale: the folded-key sort equals ``np.lexsort`` and changes no result
(EP 16 / 64 against the lexsort path), and the EP 1024 extrapolation runs with sane shapes."""

from __future__ import annotations

import numpy as np
import pytest

import ubep.sim.analytic as analytic
import ubep.sim.spec as spec_mod
from ubep.sim.calib import load_fabric, topology_for
from ubep.sim.order import lex_order
from ubep.sim.workload import CANN_EP, UBEP, Workload, aux_cores, clear_plans, run_case


def test_lex_order_is_lexsort() -> None:
    rng = np.random.default_rng(1)
    n = 5000
    keys = (np.arange(n), np.round(rng.random(n) * 1e6), rng.integers(0, 17, n))
    np.testing.assert_array_equal(lex_order(keys), np.lexsort(keys))
    keys2 = (rng.integers(-5, 5, n), rng.integers(0, 3, n), rng.integers(0, 40, n))
    np.testing.assert_array_equal(lex_order(keys2), np.lexsort(keys2))
    frac = (rng.random(n), rng.integers(0, 3, n))  # not integral: lexsort itself
    np.testing.assert_array_equal(lex_order(frac), np.lexsort(frac))
    assert lex_order((np.zeros(0), np.zeros(0))).size == 0


@pytest.mark.parametrize("ranks", [16, 64])
@pytest.mark.parametrize("op", ["dispatch", "combine"])
def test_results_unchanged_against_the_lexsort_path(ranks: int, op: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    fab, topo = load_fabric("cm384"), topology_for("cm384", ranks)
    w = Workload(routing="hot", tokens_per_rank=64, experts_per_rank=2)
    systems = (CANN_EP, UBEP)
    new = [run_case(w, s, topo, fab, op=op) for s in systems]
    monkeypatch.setattr(analytic, "lex_order", np.lexsort)
    monkeypatch.setattr(spec_mod, "lex_order", np.lexsort)
    clear_plans()
    old = [run_case(w, s, topo, fab, op=op) for s in systems]
    for a, b in zip(new, old, strict=True):
        assert a.latency_ns == b.latency_ns
        for name in ("rank_end_ns", "unit_end_ns", "unit_land_ns", "unit_ready_ns",
                     "item_end_ns", "core_ack_end_ns"):
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name))


def test_ep1024_runs_with_the_right_shapes() -> None:
    # One configuration of `ubep sim ep1024` (no timing here: that is the docs' table).
    fab, topo = load_fabric("nvl576"), topology_for("nvl576", 1024)
    assert topo.num_ranks == 1024 and topo.cores_per_rank == 48 and topo.num_hops == 3
    assert aux_cores(1024, fab, 48) == min(round(fab.aux_cores_at_256 * 4), 36)
    w = Workload()  # 128 tokens, top-8, one expert per rank
    res = run_case(w, UBEP, topo, fab)
    units = 1024 * 128 * 8  # every pick is a row (one expert per rank: no two picks share one)
    assert res.unit_end_ns.shape == (units,) and res.rank_end_ns.shape == (1024,)
    assert np.all(res.unit_land_ns >= res.unit_end_ns)
    assert np.all(res.unit_ready_ns >= res.unit_land_ns)
    assert res.latency_ns == res.rank_end_ns.max()
    # More ranks move more rows per rank's receive side only through the count phase: EP 1024
    # is no faster than EP 256 on the same fabric.
    assert res.latency_ns >= run_case(w, UBEP, topology_for("nvl576", 256), fab).latency_ns
