"""benchmarks/bench_growth.py: the fit against closed forms, the byte formula against the
Buffer's own row count, and the output structure of the quick path (no timing assertions)."""

from __future__ import annotations

import json
import math
from itertools import combinations
from pathlib import Path

import numpy as np
import pytest

# benchmarks/ is a top-level folder, not an installed package (see test_peers.py)
from benchmarks import bench_growth as growth


def test_fit_recovers_an_exact_line() -> None:
    x = [16384.0 * 4**i for i in range(6)]
    y = [7.5 + 0.0004 * b for b in x]  # 7.5 us fixed, 0.4 ns/B = 409.6 ns/KB = 2.5 GB/s
    fit = growth.fit_line(x, y)
    assert fit.intercept_us == pytest.approx(7.5, rel=1e-9)
    assert fit.slope_us_per_byte == pytest.approx(0.0004, rel=1e-12)
    assert fit.ns_per_kb == pytest.approx(409.6, rel=1e-9)
    assert fit.gbps == pytest.approx(2.5, rel=1e-9)


def test_fit_ignores_one_outlier() -> None:
    # Theil-Sen: with 6 points, one wild one leaves the median pairwise slope on the line
    x = np.array([1e4, 4e4, 1.6e5, 6.4e5, 2.56e6, 1.024e7])
    y = 20.0 + 1e-4 * x
    y[2] *= 10.0
    fit = growth.fit_line(x.tolist(), y.tolist())
    assert fit.slope_us_per_byte == pytest.approx(1e-4, rel=1e-9)
    assert fit.intercept_us == pytest.approx(20.0, rel=1e-9)


def test_fit_rejects_degenerate_input() -> None:
    with pytest.raises(ValueError, match="need >= 2"):
        growth.fit_line([1.0], [2.0])
    with pytest.raises(ValueError, match="same bytes"):
        growth.fit_line([4.0, 4.0], [1.0, 2.0])


def test_rows_per_token_is_the_closed_form() -> None:
    # rank layout: E[distinct destination ranks] of 8 distinct experts out of 64; brute force
    # over every 8-subset is too big, so check against a hypergeometric sum per rank
    for ranks in (2, 4, 8):
        local = 64 // ranks
        p_hit = 1.0 - math.comb(64 - local, 8) / math.comb(64, 8)
        assert growth.rows_per_token("rank", ranks) == pytest.approx(ranks * p_hit)
    assert growth.rows_per_token("expert", 4) == 8.0
    # small world brute force: 4 experts, 2 ranks, top-2 -> every pair's distinct ranks
    pairs = list(combinations(range(4), 2))
    assert np.mean([len({e // 2 for e in p}) for p in pairs]) == pytest.approx(
        2 * (1 - math.comb(2, 2) / math.comb(4, 2)))


def test_large_expert_shapes_send_their_target_and_label_their_series() -> None:
    # 2048 experts top-32 over 2 ranks, rank layout: a token reaches both ranks unless all 32
    # picks fall in one half (probability 2 * C(1024, 32) / C(2048, 32), about 1e-9)
    shape = (2048, 32)
    assert growth.rows_per_token("rank", 2, *shape) == pytest.approx(
        2 * (1 - math.comb(1024, 32) / math.comb(2048, 32)))
    cases = growth.cases_for([1 << 20], 2, growth.MAIN_MODES, shape)
    assert {c.mode for c in cases} == {f"{e}+{s} e2048k32" for e, s in growth.MAIN_MODES}
    for c in cases:
        sent = np.mean([growth.rows_sent(c, r, 2) for r in range(2)]) * c.hidden * 2
        # tokens were rounded to whole rows: within one token's rows of the target
        per_token = growth.rows_per_token(c.layout, 2, *shape) * c.hidden * 2
        assert abs(sent - (1 << 20)) <= per_token
        assert growth._config(c).num_experts == 2048 and growth._config(c).num_topk == 32


def test_the_phases_are_the_slowest_ranks_per_op() -> None:
    per_rank = [{"dispatch": {"a": 5.0, "b": 1.0}, "combine": {"a": 1.0, "b": 1.0}},
                {"dispatch": {"a": 2.0, "b": 3.0}, "combine": {"a": 0.5, "b": 2.0}},
                {"dispatch": {"a": 1.0, "b": 1.0}, "combine": {"a": 2.0, "b": 0.0}}]
    phases, rank = growth._slowest_phases(per_rank)
    assert rank == {"dispatch": 0, "combine": 1}  # sums 6 / 5 / 2 and 2 / 2.5 / 2
    assert phases == {"dispatch": per_rank[0]["dispatch"], "combine": per_rank[1]["combine"]}


def test_limits_name_the_measured_part_when_the_phases_are_there() -> None:
    # one 1 MB case 2x its 100 us floor (target 1.25x); the slowest rank's phases say where: its
    # own copy at 0.6x the floor with 60 us of validation and metadata beside it (the most of
    # any part); or the copy alone at 1.5x; or a rank done in 121 us, the ranks' skew adding 79
    floor = {"min_us": 100.0, "median_us": 100.0, "max_us": 100.0}
    stats = {"min_us": 200.0, "median_us": 200.0, "max_us": 200.0}
    comb = {"py_in": 1.0, "args": 1.0, "wait_prev": 1.0, "copy": 10.0, "publish": 1.0, "peers": 1.0,
            "reduce": 140.0, "py_out": 2.0}

    def row(disp: dict[str, float]) -> dict[str, object]:
        return {"ranks": 2, "layout": "rank", "mode": "asp+sw", "bytes_per_rank": 2.0**20,
                "dispatch": stats, "combine": stats, "floor": floor,
                "phases": {"dispatch": disp, "combine": comb}}

    local = {"py_in": 3.0, "args": 2.0, "wait_prev": 1.0, "validate": 20.0, "publish": 10.0,
             "send": 60.0, "counts_in": 1.0, "metadata": 30.0, "data_wait": 20.0, "py_out": 4.0}
    moving = local | {"send": 150.0, "data_wait": 0.0, "validate": 1.0, "metadata": 0.0,
                      "publish": 10.0}
    late = local | {"validate": 1.0, "publish": 1.0, "metadata": 1.0, "data_wait": 49.0}
    cases = ((local, "per-token bookkeeping"), (moving, "moving the rows"),
             (late, "the slowest rank"))
    for disp, want in cases:  # (limits reads the phases of whichever rank they are)
        assert sum(disp.values()) <= 200.0
        got = {x["op"]: x for x in growth.limits({"rows": [row(disp)]})}
        d = got["dispatch"]
        assert d["limit"] == want
        assert d["entry_us"] == pytest.approx(disp["py_in"] + disp["args"] + disp["py_out"])
        assert d["local_us"] == pytest.approx(disp["validate"] + disp["publish"]
                                              + disp["metadata"])
        assert d["wait_us"] == pytest.approx(disp["wait_prev"] + disp["counts_in"]
                                             + disp["data_wait"])
        assert d["rest_us"] == pytest.approx(200.0 - sum(disp.values()))
        assert d["copy_x_floor"] == pytest.approx(disp["send"] / 100.0)
        # the combine's copy and reduce (150 us) are over 1.25 x 100 us on their own
        assert got["combine"]["limit"] == "moving the rows"
        assert got["combine"]["copy_us"] == pytest.approx(150.0)


def test_quick_path_structure(tmp_path: Path) -> None:
    sizes = [16384, 65536]
    argv = ["--quick", "--no-scale", "--sizes", ",".join(map(str, sizes)), "--repeats", "2",
            "--rounds", "2", "--warmup", "1", "--out", str(tmp_path)]
    assert growth.main(argv) == 0
    text = (tmp_path / "growth.txt").read_text()
    assert "rows = (token, expert)" in text and "Fits" in text
    data = json.loads((tmp_path / "growth.json").read_text())
    assert (tmp_path / "growth.png").stat().st_size > 0
    rows = data["rows"]
    modes = {f"{e}+{s}" for e, s in growth.MAIN_MODES}
    assert {(r["layout"], r["mode"], r["target_bytes"]) for r in rows} == {
        (lay, m, s) for lay in ("rank", "expert") for m in modes for s in sizes}
    for r in rows:
        assert r["ranks"] == 2
        # the byte formula, recomputed from the routing (the ranks checked it against the
        # Buffer's handle before timing)
        expect = np.mean([growth.rows_sent(growth.Case(
            r["target_bytes"], r["tokens"], r["hidden"], r["layout"], r["engine"], r["sync"]),
            rank, 2) for rank in range(2)]) * r["hidden"] * 2
        assert r["bytes_per_rank"] == pytest.approx(expect)
        for op in ("dispatch", "combine", "floor"):
            s = r[op]
            assert s["repeats"] == 2 and 0 < s["min_us"] <= s["median_us"] <= s["max_us"]
        # the traced phases of ASP cases: every phase of each op, each a duration
        assert ("phases" in r) == (r["engine"] == "asp")
        for op, phases in r.get("phases", {}).items():
            assert r["phases_rank"][op] in (0, 1)
            assert set(phases) == set(growth.PHASES[op]) and min(phases.values()) >= 0
    # one fit per (layout, mode, op) plus the floor per layout, each over both sizes; both
    # sizes are in the <=4MB regime, so no per-regime fit repeats the "all" one
    assert {f["regime"] for f in data["fits"]} == {"all"}
    keys = {(f["layout"], f["mode"], f["op"]) for f in data["fits"]}
    assert keys == {(lay, m, op) for lay in ("rank", "expert") for m in modes
                    for op in ("dispatch", "combine")} | {
        ("rank", "memcpy", "floor"), ("expert", "memcpy", "floor")}
    assert all(f["points"] == 2 for f in data["fits"])
    assert data["skipped"] == []
    # --replot re-fits the JSON alone: the same fits, the same table
    again = tmp_path / "again"
    assert growth.main(["--replot", str(tmp_path / "growth.json"), "--out", str(again)]) == 0
    assert json.loads((again / "growth.json").read_text())["fits"] == data["fits"]
    assert (again / "growth.txt").read_text() == text


def test_regime_fits_split_at_the_cache_cliff() -> None:
    # a series with two lines: 1 us + 0.01 us/KB below 4 MB, 0.05 us/KB above
    def t(b: float) -> float:
        return 1.0 + b / 1024 * (0.01 if b <= 4.5e6 else 0.05)

    sizes = [16384.0 * 4**i for i in range(7)]
    rows = [{"ranks": 2, "layout": "rank", "mode": "asp+sw", "bytes_per_rank": b,
             "dispatch": {"median_us": t(b)}, "combine": {"median_us": t(b)},
             "floor": {"median_us": t(b)}} for b in sizes]
    fits = {(f["regime"], f["op"]): f for f in growth.series_fits({"rows": rows})}
    low, high = fits[("<=4MB", "dispatch")], fits[(">=4MB", "dispatch")]
    assert low["points"] == 5 and high["points"] == 3  # 4 MB sits in both
    assert low["intercept_us"] == pytest.approx(1.0) and low["ns_per_kb"] == pytest.approx(10.0)
    assert high["points"] == 3 and fits[("all", "floor")]["points"] == 7


def test_oversize_cases_are_skipped_and_said() -> None:
    result = growth.run([2], [16384], [("asp", "sw")], warmup=0, repeats=1, rounds=1,
                        mem_bytes=0, keep_bytes=0)
    assert result["rows"] == [] and len(result["skipped"]) == 2
    assert "SKIPPED (memory)" in growth.header(result, [2])


def test_limits_name_the_fixed_or_the_per_byte_cost() -> None:
    # floor = 1 us + 1 ns/B; series A = 201 us + 1 ns/B (a fixed cost), B = 1 us + 2 ns/B (the
    # bytes), both exact lines: closed-form ratios at each size
    sizes = [2.0**18, 2.0**20, 2.0**22]

    def row(mode: str, fixed: float, slope: float, b: float) -> dict[str, object]:
        t = fixed + slope * b / 1e3
        stats = {"min_us": t, "median_us": t, "max_us": t}
        return {"ranks": 2, "layout": "rank", "mode": mode, "bytes_per_rank": b,
                "dispatch": stats, "combine": stats,
                "floor": {"min_us": 1 + b / 1e3, "median_us": 1 + b / 1e3,
                          "max_us": 1 + b / 1e3},
                "floor_two_destinations": {"median_us": 2 * (1 + b / 1e3)}}

    rows = [row("asp+sw", 201.0, 1.0, b) for b in sizes] + [
        row("asp+sp", 1.0, 2.0, b) for b in sizes] + [row("bsp+sw", 1.0, 9.0, b) for b in sizes]
    got = growth.limits({"rows": rows})
    assert {x["mode"] for x in got} == {"asp+sw", "asp+sp"}  # BSP is the baseline
    for x in got:
        floor = 1 + x["bytes"] / 1e3
        assert x["x_floor_two_dst"] == pytest.approx(x["x_floor"] / 2)
        if x["mode"] == "asp+sw":  # over the target while 200 us weigh: the fixed cost
            assert x["limit"] == "fixed cost"
            assert x["fixed_us"] == pytest.approx(200.0, rel=1e-6)
            assert x["x_floor"] == pytest.approx((201 + x["bytes"] / 1e3) / floor)
        else:  # twice the floor's per-byte cost at every size
            assert x["limit"] == "size-proportional"
            assert x["x_floor_per_byte"] == pytest.approx((1 + 2 * x["bytes"] / 1e3) / floor)
    sw_sizes = sorted(x["bytes"] for x in got if x["mode"] == "asp+sw" and x["op"] == "dispatch")
    # 201 + b/1e3 <= 1.25 (1 + b/1e3)  <=>  b >= 799 KB: only 256 KB is over
    assert sw_sizes == [2**18]
