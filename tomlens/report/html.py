"""One self-contained HTML report per run, in the order a reader needs it: the findings (each claim
with the test it passed or the gate that withheld it), then the figures, each with a one-line
reading guide, then the tables, then provenance.

plotly.js is inlined once at the top (no CDN), so the file opens on an air-gapped workstation.
Figures are responsive and tables scroll sideways inside their own box, so the page reads at a
laptop width (about 1280 px) and down to about 800 px.
"""

from __future__ import annotations

import html
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from tomlens.report.findings import Finding, findings_html


def write_figure(fig: Any, path: str | Path) -> Path:
    """A standalone HTML file of one plotly figure (plotly.js inline, no CDN), written atomically."""
    from tomlens.io import atomic_path

    with atomic_path(path) as tmp:
        fig.write_html(str(tmp), include_plotlyjs=True, full_html=True)
    return Path(path)


@dataclass
class Section:
    """A heading, a paragraph, tables and figures; `guides[i]` is the one-line reading guide of
    `figures[i]` (what each mark means). A figure without one gets a guide read off its axes."""

    heading: str
    text: str = ""
    tables: list[pd.DataFrame] = field(default_factory=list)
    figures: list[Any] = field(default_factory=list)  # plotly.graph_objects.Figure
    guides: list[str] = field(default_factory=list)
    # tables a reader opens on demand: (one-line summary, its tables), each drawn as a closed
    # <details>, so long tables do not push the later sections thousands of pixels down the page
    collapsed: list[tuple[str, list[pd.DataFrame]]] = field(default_factory=list)
    # the text goes inside the first collapsed entry, above its tables: for a section whose text
    # explains only those tables (a reader who does not open them does not need it)
    fold_text: bool = False


_STYLE = """
body{font-family:system-ui,sans-serif;max-width:1360px;margin:2em auto;padding:0 1em;color:#222;line-height:1.4}
h1{font-size:1.6em} h2{font-size:1.25em;border-bottom:1px solid #ddd;padding-bottom:.2em;margin-top:1.5em}
h3{font-size:1.05em;margin-top:1.6em}
nav a{margin-right:1em}
.table-wrap{overflow-x:auto;max-width:100%;margin:.8em 0}
table{border-collapse:collapse;font-size:.85em}
td,th{border:1px solid #ccc;padding:.25em .5em;text-align:right;vertical-align:top} th{background:#f4f4f4}
pre{background:#f8f8f8;padding:.6em;font-size:.8em;overflow-x:auto;white-space:pre-wrap;word-break:break-word}
figure.plot{margin:1em 0 2em 0;min-width:0}
figure.plot figcaption{font-size:.9em;color:#444;margin-bottom:.3em}
.plot-wrap{overflow-x:auto;max-width:100%}
.figure-grid{display:grid;grid-template-columns:repeat(auto-fit,minmax(min(100%,560px),1fr));column-gap:1.2em}
.figure-grid figure.plot{margin:.6em 0 1.2em 0} .figure-grid figure.wide{grid-column:1/-1}
details{margin:.4em 0;border:1px solid #e3e3e3;border-radius:3px;padding:.2em .6em}
details summary{cursor:pointer;font-size:.95em} details[open] summary{margin-bottom:.3em}
ul.findings{list-style:none;padding-left:0}
li.finding{border-left:4px solid #999;padding:.3em .6em;margin:.4em 0;background:#fafafa}
li.finding.found{border-color:#2a8a3a} li.finding.withheld{border-color:#c0392b} li.finding.not-run{border-color:#999}
li.finding .tag{font-weight:600;margin-right:.3em} li.finding.found .tag{color:#2a8a3a}
li.finding.withheld .tag{color:#c0392b} li.finding .stage{color:#666;font-size:.85em;margin-right:.2em}
li.finding .test{color:#555;font-size:.9em}
li.finding .context{display:inline-block;margin-top:.2em;font-size:.9em;color:#333;font-style:italic}
"""


WHOLE_LAYER = "whole layer"
FIGURE_HEIGHT = 380  # px, for a figure that sets none
LONG_TEXT = 40  # characters: a text column this long gets a minimum width instead of a word per line


def shown_table(df: pd.DataFrame) -> pd.DataFrame:
    """A table as a person reads it: a `head` of -1 (the probes' and patching's code for a unit that
    is the whole layer, not one head) written as "whole layer"."""
    if "head" not in df.columns or not (df["head"] == -1).any():
        return df
    out = df.copy()
    out["head"] = [WHOLE_LAYER if h == -1 else h for h in df["head"]]
    return out


def _text_widths(df: pd.DataFrame) -> dict[str, str]:
    """A minimum width for each column of long text (a flag or a reason), so a wide table squeezes
    its numbers, not a sentence into one word per line."""
    widths = {}
    for c in df.columns:
        if len(df) and not pd.api.types.is_numeric_dtype(df[c]):
            longest = max((len(str(v)) for v in df[c]), default=0)
            if longest > LONG_TEXT:
                widths[str(c)] = "22em" if longest > 3 * LONG_TEXT else "14em"
    return widths


def _table_html(df: pd.DataFrame, max_rows: int = 60) -> str:
    shown = shown_table(df.head(max_rows))
    body = shown.to_html(index=False, float_format=lambda x: f"{x:.3f}", border=0, escape=True,
                         col_space=_text_widths(shown) or None)
    body = f"<div class='table-wrap'>{body}</div>"
    if len(df) > max_rows:
        body += f"<p><em>{len(df) - max_rows} more rows in the table files.</em></p>"
    return body


def collapsed_html(summary: str, tables: Sequence[pd.DataFrame], text: str = "") -> str:
    """Tables (and the `text` that explains them) behind a one-line summary that a reader clicks
    to open (closed by default)."""
    return (f"<details><summary>{html.escape(summary)}</summary>"
            + (f"<p>{html.escape(text)}</p>" if text else "")
            + "".join(_table_html(t) for t in tables) + "</details>")


def subtitle(text: str, width: int = 100) -> str:
    """Plain text as plotly subtitle lines ("<br><sup>...</sup>" each) of at most about `width`
    characters: plotly does not wrap a title, so one long line is cut off at the figure's edge."""
    import textwrap

    return "".join(f"<br><sup>{line}</sup>" for line in textwrap.wrap(text, width))


def _plain(text: Any) -> str:
    """Text of a plotly title or label without its HTML tags."""
    return re.sub(r"<[^>]+>", " ", str(text or "")).split("  ")[0].strip()


def figure_guide(fig: Any) -> str:
    """A reading guide read off a figure's axes and traces, for figures given without one."""
    layout = fig.layout
    x, y = _plain(layout.xaxis.title.text), _plain(layout.yaxis.title.text)
    names = [t.name for t in fig.data if getattr(t, "name", None)]
    parts = []
    if x or y:
        parts.append(f"x: {x or 'unlabelled'}; y: {y or 'unlabelled'}")
    if any(t.type == "heatmap" for t in fig.data):
        parts.append("colour: the value of each cell (scale on the right)")
    if names:
        parts.append("lines and marks: " + ", ".join(dict.fromkeys(names)))
    return "; ".join(parts) + ("; hover for the exact values." if parts else "Hover for the exact values.")


def _responsive(fig: Any) -> Any:
    """A copy that fills the page's width (a figure wider than a page keeps its width and scrolls)."""
    import plotly.graph_objects as go

    out = go.Figure(fig)
    width = out.layout.width
    if width is None or width <= 1000:
        out.update_layout(width=None, autosize=True)
    lines = str(out.layout.title.text or "").count("<br>")
    if out.layout.height is None:  # two to a row: shorter than plotly's 450 px, taller per subtitle line
        out.update_layout(height=FIGURE_HEIGHT + 18 * max(0, lines - 1))
    if lines and out.layout.margin.t is None:  # room for every subtitle line above the plot
        out.update_layout(margin={"t": 60 + 18 * lines})
    return out


def _figure_html(fig: Any, guide: str, anchor: str) -> str:
    shown = _responsive(fig)
    div = shown.to_html(full_html=False, include_plotlyjs=False, config={"responsive": True},
                        default_width="100%", div_id=f"plot-{anchor}")
    # figures sit two to a row on a wide window; one wider than a column (a per-token map, a
    # panel per layer) takes the whole row
    wide = " wide" if shown.layout.width is not None else ""
    return (f"<figure class='plot{wide}' id='{anchor}'><figcaption class='guide'>{html.escape(guide)}</figcaption>"
            f"<div class='plot-wrap'>{div}</div></figure>")


def write_report(path: str | Path, title: str, sections: list[Section],
                 provenance: dict[str, Any] | None = None, findings: Sequence[Finding] = ()) -> Path:
    """Write the report atomically and return its path: the findings (when given), every section's
    figures with their reading guides, every section's text and tables, then provenance."""
    import json

    from plotly.offline import get_plotlyjs

    parts = [f"<!doctype html><html lang='en'><head><meta charset='utf-8'>"
             "<meta name='viewport' content='width=device-width, initial-scale=1'>"
             f"<title>{html.escape(title)}</title>",
             f"<style>{_STYLE}</style><script>{get_plotlyjs()}</script></head><body>",
             f"<h1>{html.escape(title)}</h1>"]
    has_figures = any(s.figures for s in sections)
    links = ([("findings", "Findings")] if findings else []) + ([("figures", "Figures")] if has_figures else []) \
        + [("tables", "Tables")] + ([("provenance", "Provenance")] if provenance else [])
    parts.append("<nav>" + "".join(f"<a href='#{a}'>{t}</a>" for a, t in links) + "</nav>")
    if findings:
        parts.append("<h2 id='findings'>Findings</h2><p>One line per claim: the claim with its number and "
                     "interval, then (in brackets) the test it passed, or why it is withheld. A withheld line is "
                     "not a result.</p>")
        parts.append(findings_html(findings))
    anchors: dict[int, list[str]] = {}
    if has_figures:
        parts.append("<h2 id='figures'>Figures</h2>")
        n = 0
        for i, s in enumerate(sections):
            if not s.figures:
                continue
            parts.append(f"<h3>{html.escape(s.heading)}</h3><div class='figure-grid'>")
            for j, fig in enumerate(s.figures):
                n += 1
                anchor = f"figure-{n}"
                anchors.setdefault(i, []).append(anchor)
                guide = s.guides[j] if j < len(s.guides) and s.guides[j] else figure_guide(fig)
                parts.append(_figure_html(fig, guide, anchor))
            parts.append("</div>")
    parts.append("<div id='tables'></div>")
    for i, s in enumerate(sections):
        parts.append(f"<h2>{html.escape(s.heading)}</h2>")
        folded = s.fold_text and bool(s.collapsed)
        if s.text and not folded:
            parts.append(f"<p>{html.escape(s.text)}</p>")
        if i in anchors:
            parts.append("<p class='see'>Figures: " + ", ".join(
                f"<a href='#{a}'>{a.replace('-', ' ')}</a>" for a in anchors[i]) + " (above).</p>")
        for t in s.tables:
            parts.append(_table_html(t))
        for k, (summary, tables) in enumerate(s.collapsed):
            parts.append(collapsed_html(summary, tables, s.text if folded and k == 0 else ""))
    if provenance:
        parts.append("<h2 id='provenance'>Provenance</h2><details><summary>the model, versions, settings and "
                     "command of this run</summary><pre>"
                     + html.escape(json.dumps(provenance, indent=2, default=str)) + "</pre></details>")
    parts.append("</body></html>")
    from tomlens.io import write_atomic

    return write_atomic("\n".join(parts), path)
