"""``ubep sim all``: run every experiment, write tables, JSON, PNGs and a markdown report."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .calib import load_calibration
from .experiments import EXPERIMENTS, ExperimentResult, run_experiment

__all__ = ["calibration_markdown", "run_all"]


def calibration_markdown(family: str = "cm384") -> str:
    """The stored constants and residuals of ``family`` as markdown tables."""
    entry = load_calibration()["fabrics"][family]
    if "same_as" in entry:
        return f"`{family}`: {entry['note']}\n"
    lines = [f"Constants of `{family}` (src/ubep/sim/calib.json):", "",
             "| constant | value | kind | source |", "|---|---|---|---|"]
    for name, c in entry["constants"].items():
        value = c["value"]
        shown = f"{value:.4g}" if isinstance(value, float) else str(value)
        lines.append(f"| {name} | {shown} | {c['kind']} | {c['source']} |")
    lines += ["", "| target | measured | model | rel. error | used in fit |",
              "|---|---|---|---|---|"]
    for r in entry["residuals"]:
        lines.append(f"| {r['name']} | {r['measured']} | {r['model']} | {r['rel_error']:+.1%} | "
                     f"{'yes' if r['fitted'] else 'validation'} |")
    return "\n".join(lines) + "\n"


def _provenance_md(result: ExperimentResult, family: str) -> list[str]:
    """What the experiment's numbers rest on: calibrated / derived / assumed, and the
    sensitivity of its UBEP predictions to the assumed constants."""
    from .experiments import provenance

    prov = result.data.get("provenance") or provenance(family)
    lines = ["What it rests on:", ""]
    for kind in ("calibrated", "derived", "assumed"):
        lines.append(f"* {kind}: " + (", ".join(prov.get(kind, [])) or "-"))
    sens = result.data.get("sensitivity") or {}
    for point, rows in sens.items():
        lines += ["", f"Sensitivity of the UBEP prediction at {point} (one constant at a time):",
                  "", "| constant | range | nominal us | cheap end us | costly end us | swing % |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {s['constant']} | {s['range']} | {s['nominal_us']} | "
                  f"{s['at_cheap_end_us']} | {s['at_costly_end_us']} | {s['swing_pct']} |"
                  for s in rows]
    return [*lines, ""]


def write_outputs(result: ExperimentResult, out_dir: Path, *,
                  plot: bool = True) -> dict[str, Any]:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{result.name}.json").write_text(json.dumps(result.to_json(), indent=1) + "\n",
                                                 encoding="utf-8")
    (out_dir / f"{result.name}.txt").write_text(result.table() + "\n", encoding="utf-8")
    files: dict[str, Any] = {"json": f"{result.name}.json", "table": f"{result.name}.txt"}
    if plot:
        from .plots import plot as draw

        draw(result, out_dir / f"{result.name}.png")
        files["png"] = f"{result.name}.png"
    return files


def run_all(out_dir: str | Path, *, family: str = "cm384", names: list[str] | None = None,
            plot: bool = True, progress: bool = True) -> Path:
    """Run ``names`` (default: every experiment) and write ``out_dir/report.md``."""
    out = Path(out_dir)
    todo = list(names or EXPERIMENTS)
    iterator: Any = todo
    if progress:
        try:
            from tqdm import tqdm
        except ModuleNotFoundError:  # the [plot] extra is optional: run without a bar
            progress = False
        else:
            iterator = tqdm(todo, desc="ubep sim", unit="exp")
    sections = []
    for name in iterator:
        if progress:
            iterator.set_postfix_str(name)
        result = run_experiment(name, family)
        files = write_outputs(result, out, plot=plot)
        body = [f"## {result.title}", ""]
        if "png" in files:
            body += [f"![{name}]({files['png']})", ""]
        body += ["```", result.table(), "```", ""]
        body += _provenance_md(result, family)
        sections.append("\n".join(body))
    head = [f"# ubep superpod simulator report ({family})", "",
            "Baseline rows are the calibrated model; every UBEP number is a prediction "
            "(nothing about UBEP was fitted), given with the interval its assumed constants "
            "span (lo/hi columns). Each experiment lists what is calibrated, derived and "
            "assumed. Model: docs/SIMULATOR.md.", "",
            "## Calibration", "", calibration_markdown(family), ""]
    report = out / "report.md"
    report.write_text("\n".join(head + sections), encoding="utf-8")
    return report
