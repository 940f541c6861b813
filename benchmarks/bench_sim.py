"""Simulator speed: EP256 x 48 cores x 128 tokens x top-8 in the analytic mode (< 2 s target).

Run: ``python -m benchmarks.bench_sim [--repeats N]``. Reports min/median/max over repeats for
(a) planning every rank with ubep.sched, (b) timing the plans, (c) both, for CANN EP and UBEP,
and the event-driven mode on a small case for scale.
"""

from __future__ import annotations

import argparse
import time

from benchmarks.harness import print_table, time_repeats
from ubep.sched.combine import combine_plans
from ubep.sim.analytic import run_analytic
from ubep.sim.calib import load_fabric, topology_for
from ubep.sim.spec import build_spec
from ubep.sim.workload import CANN_EP, UBEP, Workload, clear_plans, plans_for, run_case


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    fab = load_fabric("cm384")
    topo = topology_for("cm384", 256)
    rows = []
    for system in (CANN_EP, UBEP):
        w = Workload()

        def plan(system=system, w=w):  # type: ignore[no-untyped-def]
            clear_plans()
            return plans_for(w, system, topo, fab)

        plans = plan()

        def sim(plans=plans, system=system, w=w):  # type: ignore[no-untyped-def]
            spec = build_spec(plans, topo, fab, engine=system.engine, sync=system.sync,
                              row_bytes=w.row_bytes)
            return run_analytic(spec, topo, fab)

        def both(system=system, w=w):  # type: ignore[no-untyped-def]
            clear_plans()
            return run_case(w, system, topo, fab)

        for label, fn in (("plan x256", plan), ("simulate", sim), ("plan + simulate", both)):
            st = time_repeats(fn, repeats=args.repeats, warmup=1)
            rows.append((system.name, label, st.min_us / 1e3, st.median_us / 1e3,
                         st.max_us / 1e3))
        cplans = combine_plans(plans, topo, policy=system.policy)
        st = time_repeats(lambda cplans=cplans, system=system: run_analytic(build_spec(
            cplans, topo, fab, engine=system.engine, sync=system.sync, row_bytes=14336,
            op="combine"), topo, fab), repeats=args.repeats, warmup=1)
        rows.append((system.name, "simulate combine", st.min_us / 1e3, st.median_us / 1e3,
                     st.max_us / 1e3))
    small = topology_for("cm384", 16)
    t0 = time.perf_counter()
    run_case(Workload(tokens_per_rank=32), UBEP, small, fab, mode="events")
    rows.append(("UBEP", "events EP16 x 32 tokens", (time.perf_counter() - t0) * 1e3, "", ""))
    print("# EP256 x 48 cores x 128 tokens x top-8, CM384 (times in ms)")
    print_table(("system", "step", "min_ms", "median_ms", "max_ms"), rows)


if __name__ == "__main__":
    main()
