"""``ubep sim all``: run every experiment, write tables, JSON, PNGs and a markdown report."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .calib import load_calibration
from .experiments import EXPERIMENTS, ExperimentResult, run_experiment

__all__ = ["calibration_markdown", "fit_markdown", "plot_training", "run_all"]


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


def fit_markdown(path: Path | None = None) -> str:
    """The fit of the assumed constants (``ubep sim calibrate``) as markdown: each training
    point's residual and leave-one-out error, and which constants moved and by how much."""
    entry = load_calibration(Path(path) if path else None)["fabrics"]["cm384"]
    fit = entry.get("fit")
    if not fit:
        return "No fit in calib.json: run `ubep sim calibrate`.\n"
    quick = any("loo_quick_predicted" in t for t in fit["training"])
    lines = ["## Fit of UBEP's assumed constants to the training set", "",
             fit["about"], "",
             "Leave-one-out: " + str(fit.get("loo_method", _QUICK_LOO))
             + ("; beside it, the quick estimate (Gauss-Newton steps on the full fit's "
                "Jacobian)." if quick else "."), "",
             "| training point | paper | model | error | residual | leave-one-out prediction "
             "| leave-one-out error | within tolerance (fit / LOO) |"
             + (" quick LOO error | LOO refit converged |" if quick else ""),
             "|---|---|---|---|---|---|---|---|" + ("---|---|" if quick else "")]
    for t in fit["training"]:
        row = (f"| {t['name']} | {t['paper']} | {_shown(t, t['model_value'])} | "
               f"{_err(t, t['model_value'])} | {t['residual']:+.2f} | "
               f"{_shown(t, t['loo_predicted'])} | {_err(t, t['loo_predicted'])} | "
               f"{_ok(t['residual'])} / {_ok(t['loo_residual'])} |")
        if quick:
            conv = t.get("loo_converged")
            row += (f" {_err(t, t.get('loo_quick_predicted'))} | "
                    f"{'-' if conv is None else ('yes' if conv else 'no')} "
                    f"({t.get('loo_nfev', '-')} evaluations) |")
        lines.append(row)
    lines += ["", "Latencies are in us; an improvement is shown as a percentage "
              "(1 - UBEP / CANN EP) and its error in percentage points.", "",
              "| baseline row | paper | model | error | residual |", "|---|---|---|---|---|"]
    for t in fit.get("baseline", []):
        lines.append(f"| {t['name']} | {t['paper']} | {t['model_value']:.4g} | "
                     f"{t['model_value'] / t['paper_value'] - 1:+.1%} | {t['residual']:+.2f} |")
    lines += ["", "Constants moved by the fit (assumed: from the first-principles value; fitted: "
              "CANN EP's, from the stored constants the fit started from):", "",
              "| constant | kind | before | range | fitted | moved | at a bound |",
              "|---|---|---|---|---|---|---|"]
    for name, c in fit["constants"].items():
        moved = c["value"] / c["first_principles"] - 1
        lines.append(f"| {name} | {c['kind']} | {c['first_principles']:.4g} | {c['range']} | "
                     f"{c['value']:.4g} | {moved:+.0%} | {c['at_bound'] or '-'} |")
    spread = fit.get("loo_spread", {})
    lines += ["", "Leave-one-out spread of each constant (the interval of every prediction): "
              + "; ".join(f"{k} {min(v):.4g}-{max(v):.4g}" for k, v in spread.items())]
    return "\n".join(lines) + "\n"


_QUICK_LOO = "Gauss-Newton steps on the full fit's Jacobian"


def _is_gain(t: dict[str, Any]) -> bool:
    return str(t["paper"]).endswith("%")


def _shown(t: dict[str, Any], value: float | None) -> str:
    if value is None:
        return "-"
    return f"{100 * (1 - value):.1f} %" if _is_gain(t) else f"{value:.1f}"


def _err(t: dict[str, Any], value: float | None) -> str:
    if value is None:
        return "-"
    if _is_gain(t):
        return f"{100 * (t['paper_value'] - value):+.1f} pp"
    return f"{value / t['paper_value'] - 1:+.1%}"


def _ok(residual: float | None) -> str:
    return "-" if residual is None else ("yes" if abs(residual) <= 1 else "no")


def plot_training(path: Path) -> Path:
    """Predicted against paper value of every training point (fit and leave-one-out)."""
    from .plots import _pyplot, save

    fit = load_calibration()["fabrics"]["cm384"].get("fit") or {"training": []}
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 5))
    for t in fit["training"]:
        scale = (lambda v: 100 * (1 - v)) if _is_gain(t) else (lambda v: v)
        paper = scale(t["paper_value"])
        ax.plot(paper, scale(t["model_value"]), "o", color="#2ca02c")
        if t["loo_predicted"] is not None:
            ax.plot(paper, scale(t["loo_predicted"]), "x", color="#d62728")
        ax.annotate(t["name"], (paper, scale(t["model_value"])), fontsize=6)
    top = max(1.0, ax.get_xlim()[1], ax.get_ylim()[1])
    ax.plot([0, top], [0, top], "--", color="#999999", lw=0.8)
    ax.plot([0, top], [0, 1.1 * top], ":", color="#bbbbbb", lw=0.8)
    ax.plot([0, top], [0, 0.9 * top], ":", color="#bbbbbb", lw=0.8)
    ax.set_xlabel("paper (us, or improvement %)")
    ax.set_ylabel("model (o: fit, x: leave-one-out)")
    ax.set_title("UBEP training set: predicted against paper", fontsize=9)
    fig.tight_layout()
    return save(plt, fig, path, dpi=90)


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
            "Baseline rows are the calibrated model; UBEP's assumed constants are fitted to "
            "the training set of docs/CALIBRATION.md (section Fit below) and every other UBEP "
            "number is a prediction, given with the interval the leave-one-out fits span "
            "(lo/hi columns). Each experiment lists what is calibrated, derived and "
            "assumed. Model: docs/SIMULATOR.md.", "",
            "## Calibration", "", calibration_markdown(family), "",
            fit_markdown() if family == "cm384" else "", ""]
    report = out / "report.md"
    report.write_text("\n".join(head + sections), encoding="utf-8")
    return report
