"""Experiments and the ``ubep sim`` command line: outputs exist and have the promised shape."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ubep.cli import main
from ubep.errors import InvalidArgumentError
from ubep.sim.experiments import run_experiment


def test_table4_cli_writes_json_and_png(tmp_path: Path) -> None:
    out_json, out_png = tmp_path / "t4.json", tmp_path / "t4.png"
    assert main(["sim", "table4", "--family", "nvl72", "--json", str(out_json),
                 "--plot", str(out_png)]) == 0
    data = json.loads(out_json.read_text())
    rows = data["rows"]
    assert [r["ep"] for r in rows] == [16, 32, 64]  # NVL72 holds at most 72 GPUs
    for r in rows:
        for key in ("cann_latency_us", "ubep_latency_us", "cann_bandwidth_gbps",
                    "ubep_bandwidth_gbps"):
            assert r[key] > 0
        # Bandwidth is the Table 4 formula: 128 x 8 x 7168 B over the latency.
        assert r["cann_bandwidth_gbps"] == pytest.approx(7_340_032 / (r["cann_latency_us"] * 1e3),
                                                         rel=1e-3)
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_fig9_keys_and_ordering() -> None:
    res = run_experiment("fig9")
    maxima = res.to_json()["max_core_latency_us"]
    assert set(maxima) == {"cann_ep", "balanced", "hierarchical"}
    # Hot experts pile onto the few cores that own them under expert_contiguous.
    assert maxima["cann_ep"] > maxima["hierarchical"]
    # Program (1) (no receiver queueing): the hierarchical mapping evens out the two-hop rows
    # per core, so its largest issue-plus-round-trip time is below the balanced slices'.
    reads = res.to_json()["max_core_readings_us"]
    assert reads["cann_ep"]["program1"] > reads["balanced"]["program1"] \
        > reads["hierarchical"]["program1"]
    # The per-AIV send latency adds the receivers' mean wait; the order stays.
    assert maxima["cann_ep"] > maxima["balanced"] > maxima["hierarchical"]
    # The plot's profile is the table's statistic: its first point is the median maximum.
    for key, profile in res.to_json()["slowest_rank_core_profile_us"].items():
        assert profile == sorted(profile, reverse=True)
        assert profile[0] == pytest.approx(maxima[key], abs=0.01)


def test_subcommand_help_is_the_whole_first_paragraph() -> None:
    from ubep.sim.cli import summary
    from ubep.sim.experiments import EXPERIMENTS
    from ubep.sim.whatif import WHATIFS

    for name, fn in {**EXPERIMENTS, **WHATIFS}.items():
        first = (fn.__doc__ or "").strip().split("\n\n", 1)[0]
        assert summary(fn.__doc__) == " ".join(first.split()), name
        assert summary(fn.__doc__).endswith("."), name  # a sentence, not a cut line


def test_run_command_and_bad_experiment(tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    assert main(["sim", "run", "--ranks", "4", "--cores", "4", "--tokens", "8", "--topk", "2",
                 "--mode", "events", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["latency_us"] > 0
    assert {s["task"] for s in data["spans"]} >= {"init", "send", "consume"}
    with pytest.raises(InvalidArgumentError):
        run_experiment("fig99")


def test_report_shows_the_stored_fit(tmp_path: Path) -> None:
    from ubep.sim.calib import load_calibration
    from ubep.sim.fit import training_set

    assert main(["sim", "report", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "fit.md").read_text()
    fit = load_calibration()["fabrics"]["cm384"]["fit"]
    # One row per training point, with its residual and leave-one-out error as stored.
    for point, row in zip(training_set(), fit["training"], strict=True):
        assert row["name"] == point.name
        line = next(ln for ln in text.splitlines() if ln.startswith(f"| {point.name} |"))
        assert f"{row['residual']:+.2f}" in line
        assert (abs(row["residual"]) <= 1) == ("| yes /" in line)
    for name, c in fit["constants"].items():
        assert f"| {name} | {c['kind']} |" in text
    assert (tmp_path / "fit_training.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
