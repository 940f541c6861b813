"""benchmarks/bench_host_tasks.py: how a call's spans become busy, send and wait time, and how
passes over the grid combine (computed by hand; nothing timed)."""

from __future__ import annotations

from typing import Any

import pytest

# benchmarks/ is a top-level folder, not an installed package (see test_peers.py)
from benchmarks.bench_host_tasks import (
    categories,
    grid_cases,
    grid_summary,
    merge_passes,
    modelled,
    rank_scale,
)


def test_categories_split_a_call_by_hand() -> None:
    spans = [(0, "init", 0.0, 10.0), (0, "send", 10.0, 110.0), (0, "wait", 110.0, 150.0),
             (0, "reorder", 150.0, 200.0), (0, "cumsum", 200.0, 205.0),
             (1, "init", 0.0, 30.0), (1, "send", 30.0, 90.0), (1, "barrier", 90.0, 190.0),
             (1, "reorder", 190.0, 210.0)]
    # ASP: the receive ("reorder") is a wait. rank 0: busy 100 + 5, send 100, wait 40 + 50;
    # rank 1: busy 60, send 60, wait 100 + 20; the median of two ranks is their mean
    assert categories(spans, "asp", 2) == {"busy": pytest.approx(82.5), "send": 80.0,
                                           "wait": 105.0}
    # BSP: the reorder is work. rank 0: busy 155, wait 40; rank 1: busy 80, wait 100
    assert categories(spans, "bsp", 2) == {"busy": 117.5, "send": 80.0, "wait": 70.0}


def test_merge_passes_takes_each_cases_median() -> None:
    def row(m: float, p: float, avail: float, cpus: int) -> dict:
        return {"ranks": 2, "cpus_available": avail, "cpus": cpus, "fixed_us": 1.0,
                "flag_oneway_ns": 2.0, "row_meta_ns": 3.0,
                "measured_us": {"busy": m, "send": m, "wait": m},
                "predicted_us": {"busy": p, "send": p, "wait": p}}
    got = merge_passes([[row(1.0, 5.0, 1.0, 1)], [row(3.0, 4.0, 2.0, 2)],
                        [row(2.0, 9.0, 1.5, 2)]])
    assert len(got) == 1
    assert got[0]["measured_us"]["send"] == 2.0 and got[0]["predicted_us"]["wait"] == 5.0
    assert got[0]["cpus_available"] == 1.5 and got[0]["cpus"] == "1,2,2"


def test_grid_is_the_issues_grid() -> None:
    cases = grid_cases([2, 4])
    # 2 rank counts x 2 routings x (ASP/TFF, BSP/SW) x 2 layouts
    assert len(cases) == 16
    assert {(c.engine, c.sync) for _, c in cases} == {("asp", "tff"), ("bsp", "sw")}
    assert {c.routing for _, c in cases} == {"uniform", "hot"}
    assert {c.layout for _, c in cases} == {"expert", "rank"}


def test_host_micro_checks_its_positions(tmp_path) -> None:
    import subprocess

    import numpy as np

    from benchmarks.host_micro import build

    binary = build(str(tmp_path))

    def run(slots: int, dst: list[int], src: list[int]) -> subprocess.CompletedProcess:
        path = tmp_path / "wpos.bin"
        with open(path, "wb") as f:
            np.asarray([slots, *dst, *src], dtype=np.int64).tofile(f)
        return subprocess.run([str(binary), "copy", "-", "256", "2", "1", "5", "1", "1", "0",
                               "-", str(32 << 20), str(path)], capture_output=True, text=True,
                              timeout=60)

    bad = run(4, [1, 4], [0, 1])  # slot 4 of a 4-slot region
    assert bad.returncode == 2 and "WPOS slot or source out of range" in bad.stderr
    bad = run(4, [1, 3], [0, 2])  # source row 2 of a 2-row pass
    assert bad.returncode == 2 and "out of range" in bad.stderr
    ok = run(4, [3, 0], [1, 1])
    assert ok.returncode == 0, ok.stderr
    # one line per process: the writer's own time (6th number) is a positive time
    assert int(ok.stdout.split()[5]) > 0


@pytest.mark.parametrize(("engine", "sync", "regions"), [("asp", "tff", 2), ("bsp", "sw", 1)])
def test_grid_timer_prices_sends_a_slot_apart_as_the_runtime(engine: str, sync: str,
                                                            regions: int) -> None:
    from benchmarks import bench_dispatch as bd
    from benchmarks import host_model as hm
    from benchmarks.bench_host_tasks import _grid_timer

    asked: list[dict] = []

    class Recorder:
        def per_row_ns(self, procs: int, row_bytes: int, rows: int, writer: str, reader: str,
                       terms: int, **kw: object) -> tuple[float, float]:
            asked.append({"writer": writer, "rows": rows, **kw})
            return 1.0, 2.0

    case = bd.Case(128, 2048, "bf16", "expert", engine, sync, "uniform")
    idxs = hm.routing_of(case, 2)
    timer = _grid_timer(Recorder(), case, 2, idxs, turns=True, call_us=150.4)
    assert timer("copy", "-", 1) == (1.0, 2.0)
    timer("rowmeta", "-", 1)
    send, other = asked
    # a send pass: into as many regions as the runtime alternates, each pass that many calls
    # (150.4 us each) after the last, at the runtime's positions
    assert send["copies"] == regions and send["gap_us"] == round(regions * 150.4)
    assert send["positions"] is not None and send["turns"] is True and send["cold"] is False
    # any other pass: no positions, no gap
    assert "gap_us" not in other and "positions" not in other


def _host_micro(tmp_path: Any, args: list[str], **env: str) -> Any:
    """host_micro (built into ``tmp_path``) run with ``args`` and ``env`` added."""
    import os
    import subprocess

    from benchmarks.host_micro import build

    return subprocess.run([str(build(str(tmp_path))), *args], capture_output=True, text=True,
                          timeout=60, env={**os.environ, **env})


def test_host_micro_refuses_an_unknown_destination_state(tmp_path) -> None:
    args = ["copy", "-", "256", "4", "1", "5", "1", "1", "0"]
    bad = _host_micro(tmp_path, args, HOST_MICRO_DST="lukewarm")
    assert bad.returncode == 2 and "HOST_MICRO_DST" in bad.stderr
    ok = _host_micro(tmp_path, args, HOST_MICRO_DST="evict")
    assert ok.returncode == 0, ok.stderr
    assert int(ok.stdout.split()[5]) > 0  # the writer's own time


class _FreeRows:
    """Row passes that cost nothing (the host model's microbenchmarks, stubbed)."""

    def per_row_ns(self, *args: object, **kw: object) -> tuple[float, float]:
        return 0.0, 0.0


#: a small call measured at 300 us (what fixed_cost solves the set-up from)
_TINY = {"ranks": 2, "tokens": 128, "hidden": 64, "dtype": "bf16", "layout": "expert",
         "engine": "asp", "sync": "tff", "routing": "uniform", "dispatch": {"median_us": 300.0}}


@pytest.mark.parametrize(("cpus", "share"), [(1, 0.5), (2, 1.0)])
def test_fixed_cost_is_a_ranks_own_set_up(cpus: int, share: float) -> None:
    # Row passes that cost nothing: the model's 64-element call is its ranks' set-ups alone.
    # On one CPU rank 0's call runs from its set-up through rank 1's (it waits for rank 1's
    # readiness), so the call measured both set-ups in line and a rank's own is half of it;
    # on a CPU each, the call is one set-up.
    from benchmarks.host_model import fixed_cost

    got = fixed_cost(_FreeRows(), {2: 1_000.0}, _TINY, "dispatch", cpus)
    assert got["tiny_model_ns"] == pytest.approx(0.0)
    assert got["fixed_ns"] == pytest.approx(300_000.0 * share)


def test_host_micro_receive_metadata_is_per_token_of_a_source(tmp_path) -> None:
    args = ["route", "recvmeta", "256", "16", "2", "5", "8", "1", "0"]
    bad = _host_micro(tmp_path, args, HOST_MICRO_LOCAL="65")
    assert bad.returncode == 2 and "HOST_MICRO_LOCAL" in bad.stderr
    for kernel in ("recvmeta", "recvmeta_rank"):
        ok = _host_micro(tmp_path, [args[0], kernel, *args[2:]], HOST_MICRO_LOCAL="16")
        assert ok.returncode == 0, ok.stderr
        line = ok.stdout.split("\n")[0].split()
        # the reader's own time (7th number) over the source's 16 tokens (8th)
        assert int(line[6]) > 0 and int(line[7]) == 16


def test_fixed_cost_leaves_out_the_receive_metadata() -> None:
    # Free row passes, a CPU a rank, the receive's metadata at 10 ns a source token: each
    # rank reads both sources' 128 tokens (2560 ns) after its set-up, so the small call's
    # 300 us hold a set-up of 300 - 2.56 us
    from benchmarks.host_model import fixed_cost

    got = fixed_cost(_FreeRows(), {2: 1_000.0}, _TINY, "dispatch", 2, recv_meta_ns=10.0)
    assert got["tiny_model_ns"] == pytest.approx(2_560.0)
    assert got["fixed_ns"] == pytest.approx(300_000.0 - 2_560.0)


def test_fixed_cost_prices_the_small_call_with_the_full_calls_terms() -> None:
    # Free row passes, a CPU a rank, ASP's per-row bookkeeping at 10 ns a row: each rank sends
    # its 128 tokens x top-8 = 1024 rows (10240 ns), the peer's rows to it first in the
    # peer's order, so no rank waits after its sends; the small call's 300 us hold a set-up
    # of 300 - 10.24 us. Doorbells whose yield window no wait reaches change nothing.
    from benchmarks.host_model import fixed_cost
    from ubep.sim.host_sched import Doorbells

    bells = Doorbells(yield_ns=50_000.0, wake_ns=20_000.0, ring_sleep_ns=8_000.0,
                      ring_armed_ns=500.0)
    got = fixed_cost(_FreeRows(), {2: 1_000.0}, _TINY, "dispatch", 2, row_meta_ns=10.0,
                     doorbells=bells)
    assert got["tiny_model_ns"] == pytest.approx(10_240.0)
    assert got["fixed_ns"] == pytest.approx(300_000.0 - 10_240.0)


def test_host_wake_prints_the_ring_the_wake_up_and_the_idle_ring(tmp_path) -> None:
    # two processes, a few ms: the waker's ring with its peer asleep, the sleeper's wake-up
    # and the ring of a registered peer that is awake, each a median over rounds (ns); bad
    # arguments are refused by name
    import subprocess

    from benchmarks.host_micro import build

    wake = str(build(str(tmp_path)).parent / "host_wake")
    bad = subprocess.run([wake, "0"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "MILLIS" in bad.stderr
    got = subprocess.run([wake, "20", "100"], capture_output=True, text=True, timeout=60)
    assert got.returncode == 0, got.stderr
    lines = [line.split() for line in got.stdout.strip().split("\n")]
    assert len(lines) == 1 and len(lines[0]) == 3
    ring_sleep, wake_ns, ring_armed = (int(v) for v in lines[0])
    assert ring_sleep > 0 and wake_ns > 0 and ring_armed > 0


def test_summary_over_the_modelled_cases_leaves_out_4_rank_bsp() -> None:
    def row(ranks: int, engine: str, meas: float, pred: float) -> dict:
        return {"ranks": ranks, "engine": engine,
                "measured_us": {"busy": meas, "send": meas, "wait": meas},
                "predicted_us": {"busy": pred, "send": pred, "wait": pred}}
    rows = [row(2, "asp", 100.0, 90.0), row(2, "bsp", 100.0, 120.0), row(4, "asp", 100.0, 130.0),
            row(4, "bsp", 100.0, 20.0)]
    assert [modelled(r) for r in rows] == [True, True, True, False]
    # errors -10, +20, +30 (and -80 for 4-rank BSP), the same for each task time
    rest = grid_summary([r for r in rows if modelled(r)])
    assert rest["send"] == {"n": 3, "median_abs_error_pct": pytest.approx(20.0),
                            "worst_abs_error_pct": pytest.approx(30.0)}
    assert rest["all"]["n"] == 9
    every = grid_summary(rows)
    assert every["busy"]["median_abs_error_pct"] == pytest.approx(25.0)
    assert every["busy"]["worst_abs_error_pct"] == pytest.approx(80.0)


def test_rank_scale_gives_each_rank_a_process_ratio() -> None:
    # the send pass's processes over their median, slowest first: rank r takes the r-th
    assert rank_scale((1.04, 0.96), 2) == (1.04, 0.96)
    assert rank_scale((1.04, 0.96), 4) == (1.04, 0.96, 1.04, 0.96)
    assert rank_scale((1.2, 1.0, 0.9, 0.8), 4) == (1.2, 1.0, 0.9, 0.8)
    assert rank_scale((), 2) == (1.0, 1.0)


def test_spread_is_each_process_over_the_median_slowest_first() -> None:
    from benchmarks.host_micro import _spread

    assert _spread([90.0, 110.0]) == pytest.approx((1.1, 0.9))
    assert _spread([4.0, 1.0, 2.0, 3.0]) == pytest.approx((1.6, 1.2, 0.8, 0.4))


def test_paired_summary_takes_each_passes_own_error() -> None:
    # one case, three passes: measured 100 / 1000 / 1000, predicted 1000 / 1000 / 100 (the
    # host's speed moved between the calls and the microbenchmarks of passes 1 and 3): the
    # medians of each side (1000 / 1000) agree, the passes' own errors are +900, 0, -90 %
    def side(v: float) -> dict:
        return {"busy": v, "send": v, "wait": v}
    passes = [{"measured_us": side(m), "predicted_us": side(p)}
              for m, p in ((100.0, 1000.0), (1000.0, 1000.0), (1000.0, 100.0))]
    row = {"ranks": 2, "engine": "bsp", "measured_us": side(1000.0),
           "predicted_us": side(1000.0), "passes": passes}
    assert grid_summary([row])["send"]["median_abs_error_pct"] == pytest.approx(0.0)
    # the median over passes of +900, 0, -90 is 0; with pass 2 at 500 measured, +100
    assert grid_summary([row], paired=True)["send"]["median_abs_error_pct"] == pytest.approx(0.0)
    passes[1]["measured_us"] = side(500.0)
    got = grid_summary([row], paired=True)["wait"]
    assert got["median_abs_error_pct"] == pytest.approx(100.0) and got["n"] == 1
