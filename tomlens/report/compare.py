"""The comparison report: findings first (only what passed its gate is stated as a result), then
figures on relative depth (layer / (n_layers - 1)) with a one-line reading guide each, then the
tables, then provenance. Offline: plotly.js is inlined once (`tomlens.report.html.write_report`).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from pathlib import Path
from typing import Any

import pandas as pd
import plotly.graph_objects as go
from plotly.colors import qualitative

from tomlens.errors import TomlensError
from tomlens.io import write_table
from tomlens.report.findings import Finding
from tomlens.report.html import Section, write_figure, write_report
from tomlens.runs.compare import FOUND, NORMALISED, NOT_RUN, WITHHELD, CompareResult

_PALETTE = qualitative.Plotly
_LAYOUT = dict(template="plotly_white", autosize=True, height=420, margin=dict(l=60, r=20, t=60, b=60),
               legend=dict(orientation="h", yanchor="top", y=-0.18))


def _colour(i: int) -> str:
    return _PALETTE[i % len(_PALETTE)]


def _num(x: Any) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{float(x):.2f}"


def _finite(x: Any) -> bool:
    return x is not None and isinstance(x, (int, float)) and math.isfinite(float(x))


# ----------------------------------------------------------------------------------------------
# Findings


def compare_findings(result: CompareResult) -> list[Finding]:
    """One sentence per claim and model. Only a claim that passed its gate is stated as a result
    (with its number, interval and the test it passed); one that failed is listed as withheld with
    the gate's reason, and a stage a model did not run as not run. Where one target's probe was
    found in two or more models, one more sentence sets their relative depths side by side."""
    t = result.tables
    out: list[Finding] = []
    n_layers = dict(zip(t["models"]["model"], t["models"]["n_layers"], strict=True)) if len(t["models"]) else {}
    best = t.get("probe_best", pd.DataFrame())
    for _, b in best.iterrows():
        model, target = b["model"], b["target"]
        if b["gate"] == FOUND:
            above = b["held_out_score"] - b["best_baseline"] if _finite(b.get("best_baseline")) else float("nan")
            out.append(Finding(
                f"{target} is linearly decodable at relative depth {b['selected_relative_depth']:.2f} "
                f"({b['selected_unit']}, layer {int(b['selected_layer'])} (0-based) of {int(b['n_layers'])}) at "
                f"{b['held_out_score']:.2f} [{b['held_out_ci_low']:.2f}, {b['held_out_ci_high']:.2f}] on held-out "
                f"stories, {_num(above)} above the best baseline ({b['best_baseline_name']} {_num(b['best_baseline'])})",
                FOUND, str(b["reason"]), model, "probes"))
        else:
            out.append(Finding(f"whether {target} is linearly decodable: not shown", WITHHELD, str(b["reason"]), model))
    found = best[best["gate"] == FOUND] if len(best) else best
    for target, g in (found.groupby("target") if len(found) else []):
        if len(g) >= 2:
            parts = [f"{r['selected_relative_depth']:.2f} in {r['model']} (layer {int(r['selected_layer'])} "
                     f"(0-based) of {int(r['n_layers'])})" for _, r in g.iterrows()]
            out.append(Finding(f"{target} is decodable at relative depth " + ", ".join(parts[:-1]) + " and "
                               + parts[-1], FOUND, "each model's probe passed its own gate (held-out, baselines, "
                               "permutation null)"))
    heads = t.get("patching", pd.DataFrame())
    gates = t.get("gates", pd.DataFrame())
    for _, g in gates.iterrows():
        model, claim = g["model"], g["claim"]
        if claim.startswith("probe"):
            if g["status"] == NOT_RUN:
                out.append(Finding("whether belief is linearly decodable", NOT_RUN, str(g["reason"]), model))
            continue
        if claim == "head ranking":
            if g["status"] == FOUND:  # the heads of the recovery row the gate judged, not the top of the ranking
                mine = heads[(heads["model"] == model) & heads["in_gate_set"].astype(bool)].sort_values("rank")
                k = int(mine["gate_k"].iloc[0]) if len(mine) else 0
                top = ", ".join(f"L{int(r['layer'])}H{int(r['head'])} (relative depth {r['relative_depth']:.2f}, "
                                f"effect {r['effect']:+.2f} of the gap)" for _, r in mine.iterrows())
                out.append(Finding(f"the top-{k} heads that carry belief: {top}", FOUND, str(g["reason"]), model,
                                   "patching"))
            else:
                out.append(Finding("which heads carry belief" + (": not shown" if g["status"] == WITHHELD else ""),
                                   g["status"], str(g["reason"]), model))
            continue
        if claim.startswith("steering"):
            layer = claim[claim.find("layer"):].rstrip(")") if "layer" in claim else ""
            depth = ""
            if layer and model in n_layers:
                try:
                    depth = f" (relative depth {int(layer.split()[1]) / max(1, n_layers[model] - 1):.2f})"
                except (ValueError, IndexError):
                    depth = ""
            text = f"steering along the belief direction at {layer}{depth} flips false-belief answers" \
                if g["status"] == FOUND else "whether steering along the belief direction flips false-belief answers"
            out.append(Finding(text + ("" if g["status"] == FOUND else ": not shown"), g["status"], str(g["reason"]),
                               model))
            continue
        name = claim.removeprefix("validation: ")
        if g["status"] == FOUND:
            out.append(Finding(f"validation check {name} passes", FOUND, str(g["reason"]), model))
        else:
            out.append(Finding(f"validation check {name}" + (": not shown" if g["status"] == WITHHELD else ""),
                               g["status"], str(g["reason"]), model))
    for _, m in t.get("missing", pd.DataFrame()).iterrows():
        what = "the whole run" if m["stage"] == "all" else f"the {m['stage']} stage"
        out.append(Finding(f"{what}: asked for and absent, so nothing is claimed from it", NOT_RUN,
                           str(m["reason"]), str(m["model"])))
    return out


# ----------------------------------------------------------------------------------------------
# Figures


def probe_depth_figure(probes: pd.DataFrame, probe_best: pd.DataFrame, *, target: str,
                       kind: str = "resid_post") -> go.Figure:
    """Probe accuracy against relative depth, one solid line per model with its interval as error
    bars; that model's best baseline dashed and its random-init twin dotted, in the same colour; the
    unit chosen on selection stories starred. The gate is in the legend entry: withheld models say so."""
    fig = go.Figure()
    rows = probes[(probes["target"] == target) & (probes["kind"] == kind) & (probes["head"] < 0)]
    for i, (model, g) in enumerate(rows.groupby("model", sort=False)):
        g = g.sort_values("relative_depth")
        colour = _colour(i)
        gate = g["gate"].iloc[0]
        # the gate judges one unit (the starred one), not the curve: the legend says so
        fig.add_trace(go.Scatter(
            x=g["relative_depth"], y=g["score"], mode="lines+markers",
            name=f"{model}" + ("" if gate == FOUND else " (no unit passed its gate: withheld)"),
            line=dict(color=colour), legendgroup=model,
            error_y=dict(type="data", symmetric=False, array=g["ci_high"] - g["score"],
                         arrayminus=g["score"] - g["ci_low"], thickness=1),
            customdata=g[["layer", "n_layers"]].to_numpy(),
            hovertemplate="layer %{customdata[0]} (0-based) of %{customdata[1]}<br>relative depth %{x:.2f}<br>"
                          "accuracy %{y:.3f}"))
        if g["best_baseline"].notna().any():
            fig.add_trace(go.Scatter(x=g["relative_depth"], y=g["best_baseline"], mode="lines",
                                     name=f"{model}: best baseline", legendgroup=model,
                                     line=dict(color=colour, dash="dash", width=1)))
        if g["baseline_random_init"].notna().any():
            fig.add_trace(go.Scatter(x=g["relative_depth"], y=g["baseline_random_init"], mode="lines",
                                     name=f"{model}: random-init twin", legendgroup=model,
                                     line=dict(color=colour, dash="dot", width=1)))
        sel = g[g["selected"].astype(bool)]
        if len(sel):
            fig.add_trace(go.Scatter(x=sel["relative_depth"], y=sel["score"], mode="markers",
                                     name=f"{model}: selected unit ({gate})",
                                     marker=dict(symbol="star", size=14, color=colour), legendgroup=model,
                                     hovertemplate="selected unit (" + gate + ")"))
    if len(rows):
        chance = float(rows["chance"].median())
        fig.add_hline(y=chance, line=dict(color="grey", dash="dash", width=1), annotation_text="chance")
    fig.update_layout(title=f"{target}: probe accuracy ({kind}) against relative depth", **_LAYOUT)
    fig.update_xaxes(title="relative depth = layer / (n_layers - 1)", range=[-0.05, 1.05])
    fig.update_yaxes(title="cross-fitted accuracy")
    return fig


def patching_depth_figure(patching: pd.DataFrame) -> go.Figure:
    """Per-head patching effects against relative depth, each a fraction of its own model's gap
    (not stretched to its largest: a withheld model's noise stays small); each model's peak |effect|
    in its legend, effect / peak in the hover; filled markers where the ranking passed its gate,
    open ones where it was withheld."""
    fig = go.Figure()
    for i, (model, g) in enumerate(patching.groupby("model", sort=False)):
        found = bool(g["found"].iloc[0])
        peak = float(g["effect"].abs().max())
        fig.add_trace(go.Scatter(
            x=g["relative_depth"], y=g["effect"], mode="markers",
            name=f"{model} ({'ranking found' if found else 'ranking withheld'}; peak |effect| {peak:.2f})",
            marker=dict(color=_colour(i), size=9, symbol="circle" if found else "circle-open"),
            customdata=g[["layer", "head", NORMALISED]].to_numpy(),
            hovertemplate="L%{customdata[0]}H%{customdata[1]} (0-based)<br>relative depth %{x:.2f}<br>"
                          "effect %{y:.3f} of the gap (%{customdata[2]:.2f} of the model's largest)"))
    fig.add_hline(y=0, line=dict(color="grey", width=1))
    fig.update_layout(title="patching effect per head against relative depth (fraction of each model's own gap)",
                      **_LAYOUT)
    fig.update_xaxes(title="relative depth = layer / (n_layers - 1)", range=[-0.05, 1.05])
    fig.update_yaxes(title="effect (0 = corrupted run, 1 = clean run)")
    return fig


def behaviour_figure(behaviour: pd.DataFrame, measure: str = "accuracy") -> go.Figure:
    """Bars of `measure` per family / condition / prompt, one colour per model, with intervals."""
    fig = go.Figure()
    rows = behaviour[behaviour["measure"] == measure]
    for i, (model, g) in enumerate(rows.groupby("model", sort=False)):
        x = g["family"].astype(str) + " · " + g["condition"].astype(str) + " · " + g["prompt_type"].astype(str)
        fig.add_trace(go.Bar(x=x, y=g["value"], name=model, marker_color=_colour(i),
                             error_y=dict(type="data", symmetric=False, array=g["ci_high"] - g["value"],
                                          arrayminus=g["value"] - g["ci_low"])))
    if len(rows):
        fig.add_hline(y=float(rows["chance"].median()), line=dict(color="grey", dash="dash", width=1),
                      annotation_text="chance")
    fig.update_layout(title=f"behaviour: {measure} with 95% intervals (whole tasks resampled)", barmode="group",
                      **{**_LAYOUT, "height": 520,
                         "legend": dict(orientation="h", yanchor="bottom", y=1.02, x=1, xanchor="right")})
    fig.update_xaxes(tickangle=-35, automargin=True)
    fig.update_yaxes(title=measure)
    return fig


def validation_grid(validation: pd.DataFrame) -> go.Figure:
    """Checks x models: green where the check passed, red where it failed, the value in each cell."""
    checks = list(dict.fromkeys(validation["check"]))
    models = list(dict.fromkeys(validation["model"]))
    z: list[list[float | None]] = []  # None: a gap in the heatmap (the check did not run)
    text: list[list[str]] = []
    for c in checks:
        zr: list[float | None] = []
        tr: list[str] = []
        for m in models:
            r = validation[(validation["check"] == c) & (validation["model"] == m)]
            if len(r):
                zr.append(1.0 if bool(r["passed"].iloc[0]) else 0.0)
                tr.append(f"{_num(r['value'].iloc[0])} vs {_num(r['threshold'].iloc[0])}"
                          f"{' PASS' if bool(r['passed'].iloc[0]) else ' FAIL'}")
            else:
                zr.append(None)
                tr.append("not run")
        z.append(zr)
        text.append(tr)
    fig = go.Figure(go.Heatmap(z=z, x=models, y=checks, text=text, texttemplate="%{text}", zmin=0, zmax=1,
                               colorscale=[[0, "#e57373"], [1, "#81c784"]], showscale=False))
    fig.update_layout(title="validation checks (value vs threshold)", **{**_LAYOUT, "height": 120 + 60 * len(checks)})
    return fig


# ----------------------------------------------------------------------------------------------
# The report


def _figure_section(heading: str, guide: str, figures: list[Any], tables: list[pd.DataFrame] | None = None) -> Section:
    """A section whose figures carry `guide` as their one-line reading guide (as the section text
    where `Section` has no `guides`)."""
    if "guides" in {f.name for f in dataclasses.fields(Section)}:
        return Section(heading, figures=figures, tables=tables or [], guides=[guide] * len(figures))
    return Section(heading, guide, figures=figures, tables=tables or [])


def _write_tables(result: CompareResult, out: Path) -> None:
    result.save(out)  # parquet + result.json
    for name, df in result.tables.items():
        write_table(df, out / f"{name}.csv")


FIGURE_FILES = ("patching", "behaviour", "validation")  # besides probes_<target>_<kind>.html


def check_out(result: CompareResult, out: Path) -> None:
    """Refuse an output folder that is, or lies inside, a compared run or model folder: the report's
    tables and figures would be written among (and could be mistaken for) a run's results."""
    here = out.resolve()
    folders = {r.folder for r in result.summary.runs}
    folders |= {f for m in result.summary.models for f in (m.folder, m.run) if f}
    for f in sorted(folders):
        there = Path(f).resolve()
        if here == there or there in here.parents:
            raise TomlensError(f"--out {out} is inside the compared run folder {f}",
                               "write the comparison to a folder outside every run, e.g. --out compare/")


def write_compare_report(result: CompareResult, out: str | Path) -> Path:
    """Write `out/report.html` (findings, figures with a reading guide each, tables, provenance),
    the tables as csv and parquet, each figure as its own HTML file, and `result.json`; returns
    the report's path."""
    out = Path(out)
    check_out(result, out)
    out.mkdir(parents=True, exist_ok=True)
    for old in [*out.glob("probes_*.html"), *(out / f"{n}.html" for n in FIGURE_FILES)]:
        old.unlink(missing_ok=True)  # a figure of an earlier comparison must not sit beside this report
    _write_tables(result, out)
    t = result.tables
    findings = compare_findings(result)
    sections: list[Section] = []
    figures: dict[str, go.Figure] = {}
    probes, best = t.get("probes", pd.DataFrame()), t.get("probe_best", pd.DataFrame())
    if len(probes):
        for target in dict.fromkeys(probes["target"]):
            for kind in [k for k in dict.fromkeys(probes["kind"]) if k != "resid_pre"
                         and (probes[(probes["kind"] == k) & (probes["target"] == target)]["head"] < 0).any()]:
                fig = probe_depth_figure(probes, best, target=target, kind=kind)
                figures[f"probes_{target}_{kind}"] = fig
                sections.append(_figure_section(
                    f"Probes on relative depth: {target} ({kind})",
                    "Each solid line is one model's cross-fitted probe accuracy per layer (bars: 95% intervals), "
                    "at relative depth layer / (n_layers - 1) so models of different depths line up; the dashed "
                    "line of the same colour is that model's best baseline, the dotted one its random-init twin; "
                    "a star marks the unit chosen on selection stories, and the legend gives its gate.",
                    [fig]))
        sections.append(Section("Probe per model: the selected unit (held out) and the best layer (selection-biased)",
                                "held_out_* is the selected unit scored on evaluation stories; best_layer_* is the "
                                "sweep's maximum, biased upwards by the choice.", tables=[best]))
    if len(t.get("patching", pd.DataFrame())):
        fig = patching_depth_figure(t["patching"])
        figures["patching"] = fig
        sections.append(_figure_section(
            "Patching per head on relative depth",
            "Each point is one head's patching effect as a fraction of its own model's clean - corrupted gap "
            "(1 = the head alone restores the clean answer); the legend gives each model's peak |effect| and the "
            "hover effect / that peak; open markers: the model's ranking was withheld by its gate, so its heads are "
            "not a finding.", [fig]))
    beh = t.get("behaviour", pd.DataFrame())
    if len(beh):
        fig = behaviour_figure(beh)
        figures["behaviour"] = fig
        sections.append(_figure_section(
            "Behaviour side by side",
            "Each bar is one model's accuracy on one family, condition and prompt type (error bars: 95% intervals "
            "from a bootstrap over tasks); the dashed line is chance. The table adds the papers' aggregates.",
            [fig], [beh[beh["measure"] != "accuracy"]] if (beh["measure"] != "accuracy").any() else []))
    if len(t.get("validation", pd.DataFrame())):
        fig = validation_grid(t["validation"])
        figures["validation"] = fig
        sections.append(_figure_section("Validation checks side by side",
                                "Each cell is one check of `tomlens validate` on one model: green passed, red "
                                "failed, with the value against its threshold.",
                                [fig], [t["validation"]]))
    sections.append(Section("Gates: which claims passed", "found: passed its gate; withheld: failed it (the reason "
                            "is given); not run: the stage was not asked for or did not finish.", tables=[t["gates"]]))
    if len(t.get("missing", pd.DataFrame())):
        sections.append(Section("Missing: asked for and absent", tables=[t["missing"]]))
    sections.append(Section("Models compared", tables=[t["models"]]))
    for name, fig in figures.items():
        write_figure(fig, out / f"{name}.html")
    title = "tomlens compare: " + ", ".join(result.models)
    s = result.summary
    provenance: dict[str, Any] = {"axis": s.axis, "normalisation": s.normalisation, "versions": s.versions,
                                  "time": s.time, "missing": list(s.missing)}
    provenance["models"] = [{"label": m.label, "folder": m.folder, "provenance": m.provenance} for m in s.models]
    if "findings" in inspect.signature(write_report).parameters:
        return write_report(out / "report.html", title, sections, provenance, findings=findings)
    # write_report without `findings` (an older tomlens.report.html): the findings lead as plain text
    text = " ".join(f"[{f.status}] {f.model + ': ' if f.model else ''}{f.claim} ({f.test})." for f in findings)
    return write_report(out / "report.html", title, [Section("Findings", text), *sections], provenance)


__all__ = ["behaviour_figure", "compare_findings", "patching_depth_figure", "probe_depth_figure",
           "validation_grid", "write_compare_report"]
