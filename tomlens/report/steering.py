"""Steering figures: the dose-response of the belief direction against its controls, per layer.

Logit difference (start minus now: positive answers where the object started, the false-belief
answer) against alpha: one line per condition for the belief direction, a shaded band from the
smallest to the largest random direction on false-belief prompts, and a dashed line for the
shuffled-label direction. Flip rate against alpha: the same, with the random band on false-belief
prompts. The chosen alpha is marked. Plotly, written as self-contained HTML."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd

from tomlens.report.html import subtitle, write_figure

if TYPE_CHECKING:
    from tomlens.runs.steering import SteeringResult

COLOURS = {"false_belief": "#d62728", "true_belief": "#1f77b4", "reality": "#7f7f7f"}


def _figure(result: SteeringResult, column: str, title: str, y_title: str) -> Any:
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    dose: pd.DataFrame = result.dose
    layers = sorted(int(x) for x in dose["layer"].unique())
    chosen = {d.layer: d for d in result.summary.layers}
    fig = make_subplots(rows=1, cols=max(1, len(layers)), subplot_titles=[
        f"layer {layer}" + (f" ({chosen[layer].verdict})" if layer in chosen else "") for layer in layers],
        shared_yaxes=True)
    for col, layer in enumerate(layers, start=1):
        d = dose[dose["layer"] == layer]
        rand = d[(d["source"] == "random") & (d["condition"] == "false_belief")]
        if len(rand):
            band = rand.groupby("alpha")[column].agg(["min", "max"]).reset_index()
            fig.add_trace(go.Scatter(x=band["alpha"], y=band["max"], mode="lines", line={"width": 0},
                                     showlegend=False, hoverinfo="skip"), row=1, col=col)
            fig.add_trace(go.Scatter(x=band["alpha"], y=band["min"], mode="lines", line={"width": 0},
                                     fill="tonexty", fillcolor="rgba(150,150,150,0.3)",
                                     name=f"random directions, false belief (min-max of {rand['direction'].nunique()})",
                                     legendgroup="random", showlegend=col == 1), row=1, col=col)
        for cond, colour in COLOURS.items():
            b = d[(d["direction"] == "belief") & (d["condition"] == cond)].sort_values("alpha")
            if len(b):
                err = {"type": "data", "array": 1.96 * b["logit_diff_se"], "visible": True} \
                    if column == "logit_diff" else None
                fig.add_trace(go.Scatter(x=b["alpha"], y=b[column], mode="lines+markers", error_y=err,
                                         line={"color": colour}, name=f"belief direction, {cond.replace('_', ' ')}",
                                         legendgroup=cond, showlegend=col == 1), row=1, col=col)
        s = d[(d["direction"] == "shuffled") & (d["condition"] == "false_belief")].sort_values("alpha")
        if len(s):
            fig.add_trace(go.Scatter(x=s["alpha"], y=s[column], mode="lines", line={"color": "black", "dash": "dash"},
                                     name="shuffled labels, false belief", legendgroup="shuffled",
                                     showlegend=col == 1), row=1, col=col)
        if layer in chosen:
            fig.add_vline(x=chosen[layer].alpha, line={"color": "green", "dash": "dot"}, row=1, col=col)
    n = result.summary.n_evaluation_prompts
    fig.update_layout(title=title + subtitle(f"evaluation half ({n} prompts); green dotted line: alpha chosen on "
                                             "the selection half"), height=460, width=max(600, 380 * len(layers)))
    fig.update_xaxes(title_text="alpha (multiples of the belief direction's norm)")
    fig.update_yaxes(title_text=y_title, row=1, col=1)
    return fig


def dose_figure(result: SteeringResult) -> Any:
    return _figure(result, "logit_diff", "Steering dose-response: logit difference (start minus now)",
                   "logit(start) - logit(now), first tokens")


def flip_figure(result: SteeringResult) -> Any:
    return _figure(result, "flip_rate", "Steering: share of answers flipped against the unsteered run",
                   "flip rate")


def write_steering_figures(result: SteeringResult, out: str | Path) -> list[Path]:
    """steering_dose.html and steering_flips.html in `out`."""
    out = Path(out)
    return [write_figure(dose_figure(result), out / "steering_dose.html"),
            write_figure(flip_figure(result), out / "steering_flips.html")]
