"""Per-layer probe figures from a probe-sweep table: score against layer, and layer x head maps.

Each line is one (target, training set, evaluation set) with its 95% interval as a shaded band;
the control task (scored on its own labels) is the dotted line of the same colour, the best
baseline of each layer's row (bag of words, length, position, embeddings, random-init twin:
whichever scores highest) the dash-dot line, and chance the grey dashed line. The unit chosen on
selection stories (`tomlens.probes.selection`) is marked with a star and its held-out score; its
verdict is written in the title: "withheld: ..." when it failed its gate, so a figure never shows
a withheld unit as a finding. HTML files carry plotly.js inline, so they open on a machine without
network access.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import pandas as pd
import plotly.graph_objects as go
from plotly.colors import qualitative

from tomlens.errors import TomlensError
from tomlens.probes.selection import FOUND, SelectionResult
from tomlens.report.html import subtitle, write_figure

_PALETTE = qualitative.Plotly


def _label(target: str, train_on: str, eval_set: str) -> str:
    evl = eval_set.replace("_", " ")
    if train_on == "all":
        return f"{target} · {evl}"
    return f"{target} · train {train_on.replace('_', ' ')} → test {evl}"


def _rgba(hex_colour: str, alpha: float) -> str:
    h = hex_colour.lstrip("#")
    r, g, b = (int(h[i:i + 2], 16) for i in (0, 2, 4))
    return f"rgba({r},{g},{b},{alpha})"


def _verdicts(selection: Mapping[str, SelectionResult] | None, targets: Sequence[str]) -> str:
    """The selection verdicts of `targets`, for a figure title ("" when none was run)."""
    parts = []
    for t in targets:
        r = (selection or {}).get(t)
        if r is None:
            continue
        if r.verdict == FOUND and r.evaluation is not None:
            parts.append(f"{t}: {r.site} held out {r.evaluation.score:.2f} (found)")
        else:  # the whole reason, wrapped: a subtitle cut at the figure's edge hides why
            parts.append(f"{t}: withheld: {r.reason}")
    return "".join(subtitle(part) for part in parts)


def _selected(selection: Mapping[str, SelectionResult] | None, target: str, kind: str, per_head: bool
              ) -> SelectionResult | None:
    r = (selection or {}).get(target)
    if r is None or r.unit is None or r.unit["kind"] != kind or (r.unit["head"] >= 0) != per_head:
        return None
    return r


def layer_figure(table: pd.DataFrame, *, kind: str = "resid_post", metric: str = "accuracy",
                 targets: Sequence[str] | None = None, title: str | None = None,
                 selection: Mapping[str, SelectionResult] | None = None) -> go.Figure:
    """Score vs layer for whole-layer probes of `kind`, one line per target / train / eval set,
    with the control, the best baseline and chance; `selection` (per target) marks the chosen unit
    and writes its verdict in the title."""
    rows = table[(table["kind"] == kind) & (table["metric"] == metric) & (table["head"] == -1)]
    if targets is not None:
        rows = rows[rows["target"].isin(list(targets))]
    if rows.empty:
        raise TomlensError(f"the probe table has no whole-layer {kind!r} rows for metric {metric!r}",
                           "probe a per-layer kind (e.g. resid_post), or use head_heatmap for heads")
    bow = table[(table["features"] == "bag_of_words") & (table["metric"] == metric)]
    fig = go.Figure()
    chance_seen: set[float] = set()
    keys = rows[["target", "train_on", "eval_set"]].drop_duplicates().itertuples(index=False)
    for i, (target, train_on, eval_set) in enumerate(keys):
        colour = _PALETTE[i % len(_PALETTE)]
        r = rows[(rows["target"] == target) & (rows["train_on"] == train_on)
                 & (rows["eval_set"] == eval_set)].sort_values("layer")
        name = _label(target, train_on, eval_set)
        x = r["layer"].tolist()
        fig.add_trace(go.Scatter(x=x + x[::-1], y=r["ci_high"].tolist() + r["ci_low"].tolist()[::-1],
                                 fill="toself", fillcolor=_rgba(colour, 0.15), line={"width": 0},
                                 hoverinfo="skip", showlegend=False, legendgroup=name))
        fig.add_trace(go.Scatter(x=x, y=r["score"], mode="lines+markers", name=name, legendgroup=name,
                                 line={"color": colour}, customdata=r[["ci_low", "ci_high", "n_test"]],
                                 hovertemplate="layer %{x}: %{y:.3f} [%{customdata[0]:.3f}, "
                                               "%{customdata[1]:.3f}], n=%{customdata[2]}<extra></extra>"))
        if "control" in r and r["control"].notna().any():
            fig.add_trace(go.Scatter(x=x, y=r["control"], mode="lines", name=f"{name} · control task (own labels)",
                                     legendgroup=name, line={"color": colour, "dash": "dot", "width": 1}))
        b = bow[(bow["target"] == target) & (bow["train_on"] == train_on) & (bow["eval_set"] == eval_set)]
        if "best_baseline" in r and r["best_baseline"].notna().any():
            names = r["best_baseline_name"] if "best_baseline_name" in r else pd.Series([""] * len(r), index=r.index)
            fig.add_trace(go.Scatter(x=x, y=r["best_baseline"], mode="lines", name=f"{name} · best baseline",
                                     legendgroup=name, customdata=names.to_numpy()[:, None],
                                     hovertemplate="layer %{x}: best baseline %{customdata[0]} %{y:.3f}<extra></extra>",
                                     line={"color": colour, "dash": "dashdot", "width": 1.5}))
        elif len(b) and x:
            fig.add_trace(go.Scatter(x=[min(x), max(x)], y=[float(b["score"].iloc[0])] * 2, mode="lines",
                                     name=f"{name} · bag of words", legendgroup=name,
                                     line={"color": colour, "dash": "dashdot", "width": 1}))
        sel = _selected(selection, target, kind, per_head=False)
        # the selected unit at its held-out evaluation accuracy (not the cross-fitted full-data score,
        # which the choice biases upwards), with the evaluation interval as its error bar
        if sel is not None and sel.unit is not None and train_on == "all" and eval_set == "all" \
                and sel.evaluation is not None \
                and metric == "accuracy" and math.isfinite(sel.evaluation.score):
            e = sel.evaluation
            fig.add_trace(go.Scatter(
                x=[sel.unit["layer"]], y=[e.score], mode="markers",
                error_y={"type": "data", "symmetric": False, "array": [e.ci_high - e.score],
                         "arrayminus": [e.score - e.ci_low], "color": colour},
                marker={"symbol": "star", "size": 14, "color": colour, "line": {"color": "black", "width": 1}},
                name=f"{target} · selected unit, held-out evaluation {e.score:.2f} [{e.ci_low:.2f}, "
                     f"{e.ci_high:.2f}] ({sel.verdict})", legendgroup=name))
        chance = round(float(r["chance"].mean()), 4) if "chance" in r and r["chance"].notna().any() else None
        if chance is not None and chance not in chance_seen and x:
            chance_seen.add(chance)
            fig.add_trace(go.Scatter(x=[min(x), max(x)], y=[chance, chance], mode="lines",
                                     name=f"chance ({chance:.2f})", line={"color": "grey", "dash": "dash", "width": 1}))
    shown = list(rows["target"].drop_duplicates())
    fig.update_layout(title=(title or f"Linear probes on {kind} ({metric})") + _verdicts(selection, shown),
                      xaxis_title="layer",
                      yaxis_title=metric, yaxis_range=[0, 1.02], template="plotly_white",
                      legend={"font": {"size": 10}})
    return fig


def head_heatmap(table: pd.DataFrame, *, target: str, kind: str = "head_out", metric: str = "accuracy",
                 train_on: str = "all", eval_set: str = "all", value: str = "score",
                 title: str | None = None, selection: Mapping[str, SelectionResult] | None = None) -> go.Figure:
    """Layer x head map of `value` (score, selectivity, ...) for per-head probes; `selection`
    marks the chosen head and writes its verdict in the title."""
    rows = table[(table["kind"] == kind) & (table["metric"] == metric) & (table["head"] >= 0)
                 & (table["target"] == target) & (table["train_on"] == train_on)
                 & (table["eval_set"] == eval_set)]
    if rows.empty:
        raise TomlensError(f"the probe table has no per-head {kind!r} rows for {target!r} "
                           f"(train_on={train_on}, eval_set={eval_set}, metric={metric})",
                           "run the sweep with a per-head kind such as head_out")
    grid = rows.pivot_table(index="layer", columns="head", values=value, aggfunc="first").sort_index()
    fig = go.Figure(go.Heatmap(z=grid.values, x=[str(h) for h in grid.columns], y=[str(v) for v in grid.index],
                               colorscale="Viridis", colorbar={"title": value},
                               hovertemplate="layer %{y}, head %{x}: %{z:.3f}<extra></extra>"))
    sel = _selected(selection, target, kind, per_head=True)
    if sel is not None and sel.unit is not None and sel.evaluation is not None:
        e = sel.evaluation
        fig.add_trace(go.Scatter(x=[str(sel.unit["head"])], y=[str(sel.unit["layer"])], mode="markers",
                                 marker={"symbol": "star", "size": 16, "color": "white",
                                         "line": {"color": "black", "width": 1}},
                                 name=f"selected unit (held out {e.score:.2f} [{e.ci_low:.2f}, {e.ci_high:.2f}], "
                                      f"{sel.verdict})"))
    fig.update_layout(title=(title or f"{target}: {value} per head ({kind}, {_label(target, train_on, eval_set)})")
                      + _verdicts(selection, [target]),
                      xaxis_title="head", yaxis_title="layer", template="plotly_white")
    return fig


def probe_figures(table: pd.DataFrame, selection: Mapping[str, SelectionResult] | None = None
                  ) -> dict[str, go.Figure]:
    """By file stem: `layers_<kind>` for each whole-layer kind, `heads_<kind>_<target>` for per-head kinds."""
    figures: dict[str, go.Figure] = {}
    probed = table[table["features"] == "activations"]
    for kind in probed.loc[probed["head"] == -1, "kind"].unique():
        figures[f"layers_{kind}"] = layer_figure(table, kind=kind, selection=selection)
    heads = probed[probed["head"] >= 0]
    for kind in heads["kind"].unique():
        for target in heads.loc[heads["kind"] == kind, "target"].unique():
            figures[f"heads_{kind}_{target}"] = head_heatmap(table, target=target, kind=kind, selection=selection)
    return figures


def write_probe_figures(table: pd.DataFrame, out: str | Path,
                        selection: Mapping[str, SelectionResult] | None = None) -> dict[str, go.Figure]:
    """Each of `probe_figures(table, selection)` written as `<stem>.html` into `out`; returns them by stem."""
    figures = probe_figures(table, selection)
    for stem, fig in figures.items():
        write_figure(fig, Path(out) / f"{stem}.html")
    return figures
