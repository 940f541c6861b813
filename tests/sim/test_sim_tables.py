"""The sync-mode table, the fabric presets and the routing and checksum AIVs, each against a
closed form or the table's own definition."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.sim.test_sim_model import ROW, fabric, plan, two_ranks
from ubep.errors import InvalidArgumentError
from ubep.modes import SYNCS
from ubep.sim import simulate, sync_costs
from ubep.sim.preprocess import preprocess_ns, with_preprocess
from ubep.sim.presets import FAMILIES, PRESETS, topology_for
from ubep.sim.syncs import DATA_AS_FLAG, SP, SW, SYNC_MODES, sync_mode

SIM = Path(__file__).resolve().parents[2] / "src" / "ubep" / "sim"


def test_a_sync_mode_name_appears_in_the_table_only() -> None:
    # A mode is a row of sim/syncs.py: no other module of the simulator compares its name.
    pattern = re.compile(r"\"(" + "|".join(SYNCS) + r")\"")
    files = sorted(p.name for p in SIM.glob("*.py") if pattern.search(p.read_text()))
    assert files == ["syncs.py"]


def test_every_mode_has_one_row_and_the_rows_price_the_documented_work() -> None:
    assert tuple(SYNC_MODES) == SYNCS
    assert (SW, SP) == ("sw", "sp") and DATA_AS_FLAG == ("tff", "dc", "sp")
    f = fabric(vector_op_ns=7.0, check_lanes=8)
    row = 7168  # 14 blocks of 512 B: 2 steps of 8; TFF: 15 blocks of 480 B payload, 2 steps
    want = {"sw": (7168, 0.0, 0.0), "tff": (15 * 512, 0.0, 14.0), "dc": (7168, 14.0, 14.0),
            "sp": (7168, 0.0, 14.0 + row / f.core_bandwidth_gbps)}
    for name, (wire, send, recv) in want.items():
        c = sync_costs(name, row, f)
        assert (c.wire_bytes, c.sender_extra_ns) == (wire, send)
        assert c.receiver_extra_ns == pytest.approx(recv)
    assert [m.batch_signal for m in SYNC_MODES.values()] == ["fence", "", "checksum", ""]
    with pytest.raises(InvalidArgumentError) as exc:
        sync_mode("none")
    assert exc.value.argument == "sync"


def test_a_fabric_loads_without_the_executors_or_the_workload() -> None:
    code = ("import json, sys; from ubep.sim.presets import load_fabric, topology_for; "
            "load_fabric('cm384'); topology_for('nvl576', 100); "
            "print(json.dumps(sorted(m for m in sys.modules if m.startswith('ubep.sim.'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    loaded = {m.rsplit(".", 1)[1] for m in json.loads(out)}
    assert not loaded & {"analytic", "events", "workload", "api", "spec", "calib",
                         "experiments"}


def test_presets_table_gives_each_family_its_topology() -> None:
    assert tuple(PRESETS) == FAMILIES
    for family, row in PRESETS.items():
        topo = topology_for(family, min(16, row.max_ranks))
        assert topo.num_ranks == min(16, row.max_ranks)
    assert topology_for("nvl576", 144).num_hops == 3  # two NVSwitch tiers
    with pytest.raises(InvalidArgumentError) as exc:
        topology_for("nvl9000", 8)
    assert exc.value.argument == "family"


def _asp_two_ranks() -> object:
    # Two ranks of 3 cores: one send core, one count core, core 2 left for routing/checksum.
    topo = two_ranks(cores=3)
    plans = [plan(0, [(0, 0, 1, 0), (0, 1, 0, 0)], n_send=1, n_count=1, topo=topo),
             plan(1, [(0, 0, 0, 0)], n_send=1, n_count=1, topo=topo)]
    return topo, plans


@pytest.mark.parametrize(("lanes", "ends"), [(1, (1523.0, 1640.0)), (2, (1523.0, 1540.0))])
def test_routing_and_checksum_aivs_carry_their_work(lanes: int,
                                                    ends: tuple[float, float]) -> None:
    # R = 2 ranks of one node (L = 50 ns on the rank, 400 ns between), L = 1 expert each,
    # picks = 4: routing is R (count_expert + picks count_pick) = 2 (10 + 4 x 1) = 28 ns after
    # Init (1000 ns). The count core counts expert 0 then expert 1 (each 10 + 2 picks x 1 =
    # 12 ns, then a 5 ns word), so the words leave at 1017 (to rank 0) and 1034 (to rank 1)
    # and land: on rank 0 from rank 0 at 1067, from rank 1 at 1417; on rank 1 from rank 0 at
    # 1434, from rank 1 at 1084. The one aux core polls them in source order from 1028, 100 ns
    # a poll of `lanes` words, then sums R L = 2 entries at 3 ns:
    # lanes 1: rank 0 max(1028, 1067) + 100 = 1167, max(1167, 1417) + 100 = 1517, + 6 = 1523;
    #          rank 1 max(1028, 1434) + 100 = 1534, max(1534, 1084) + 100 = 1634, + 6 = 1640;
    # lanes 2: rank 0 max(1028, 1417) + 100 + 6 = 1523; rank 1 max(1028, 1434) + 100 + 6 = 1540.
    f = fabric(count_expert_ns=10.0, count_pick_ns=1.0, flag_ns=5.0, poll_ns=100.0,
               poll_lanes=lanes, cumsum_entry_ns=3.0)
    topo, plans = _asp_two_ranks()
    res = simulate(plans, topo, f, engine="asp", sync="sp", row_bytes=ROW)
    assert preprocess_ns(f, num_ranks=2, num_local_experts=1, picks=4) == (28.0, 6.0)
    out = with_preprocess(res, f, topo, aux_cores=1, first_core=2, num_local_experts=1,
                          picks=4)
    for r in range(2):
        (route,) = out.timeline.spans(rank=r, core=2, task="route")
        (span,) = out.timeline.spans(rank=r, core=2, task="checksum")
        assert (route.start_ns, route.end_ns, span.start_ns) == (1000.0, 1028.0, 1028.0)
        assert span.end_ns == pytest.approx(ends[r])
        # The AIV sum counts the routing/checksum AIV, which the data path left at 0.
        assert res.aiv_end_ns(r)[2] == 0.0
        assert out.aiv_sum_ns(r) == pytest.approx(res.aiv_sum_ns(r) + span.end_ns)
    # Routing is data work; the checksum (and its wait for the counts) is synchronisation.
    a2a0, other0 = res.aiv_split_ns(0)
    a2a1, other1 = out.aiv_split_ns(0)
    assert a2a1 - a2a0 == pytest.approx(1000.0 + 28.0)
    assert other1 - other0 == pytest.approx(
        out.timeline.spans(rank=0, core=2, task="checksum")[0].duration_ns)
    # The data path is untouched.
    np.testing.assert_array_equal(out.unit_land_ns, res.unit_land_ns)
    assert out.latency_ns == res.latency_ns
    with pytest.raises(InvalidArgumentError):
        with_preprocess(simulate(plans, topo, f, engine="bsp", sync="sw", row_bytes=ROW), f,
                        topo, aux_cores=1, first_core=2, num_local_experts=1, picks=4)


def test_run_case_times_the_aux_cores_of_an_asp_dispatch() -> None:
    from ubep.sim.calib import load_fabric
    from ubep.sim.workload import UBEP, Workload, aux_cores, plans_for, run_case

    fab = load_fabric("cm384").with_values(aux_cores_at_256=64.0)  # 4 aux cores at 16 ranks
    topo = topology_for("cm384", 16)
    w = Workload(tokens_per_rank=16)
    p = plans_for(w, UBEP, topo, fab)[0]
    first, aux = p.num_send_cores + p.num_count_cores, aux_cores(16, fab, 48)
    assert aux == 4 and first + aux <= 48
    res = run_case(w, UBEP, topo, fab)
    for r in (0, 15):
        ends = res.aiv_end_ns(r)
        assert (ends[first:first + aux] > fab.init_ns).all()
        assert (ends[first + aux:] == 0).all()
        assert len(res.timeline.spans(rank=r, task="route")) == aux
