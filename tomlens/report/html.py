"""One self-contained HTML report per run: tables and plotly figures, readable offline.

plotly.js is inlined once at the top (no CDN), so the file opens on an air-gapped workstation.
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd


def write_figure(fig: Any, path: str | Path) -> Path:
    """A standalone HTML file of one plotly figure (plotly.js inline, no CDN), written atomically."""
    from tomlens.io import atomic_path

    with atomic_path(path) as tmp:
        fig.write_html(str(tmp), include_plotlyjs=True, full_html=True)
    return Path(path)


@dataclass
class Section:
    heading: str
    text: str = ""
    tables: list[pd.DataFrame] = field(default_factory=list)
    figures: list[Any] = field(default_factory=list)  # plotly.graph_objects.Figure


_STYLE = """
body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}
h1{font-size:1.6em} h2{font-size:1.25em;border-bottom:1px solid #ddd;padding-bottom:.2em;margin-top:2em}
table{border-collapse:collapse;font-size:.85em;margin:.8em 0}
td,th{border:1px solid #ccc;padding:.25em .5em;text-align:right} th{background:#f4f4f4}
pre{background:#f8f8f8;padding:.6em;font-size:.8em;overflow-x:auto}
"""


def _table_html(df: pd.DataFrame, max_rows: int = 60) -> str:
    shown = df.head(max_rows)
    body = shown.to_html(index=False, float_format=lambda x: f"{x:.3f}", border=0, escape=True)
    if len(df) > max_rows:
        body += f"<p><em>{len(df) - max_rows} more rows in the table files.</em></p>"
    return body


def write_report(path: str | Path, title: str, sections: list[Section],
                 provenance: dict[str, Any] | None = None) -> Path:
    """Write the report atomically and return its path."""
    import json

    from plotly.offline import get_plotlyjs

    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>",
             f"<style>{_STYLE}</style><script>{get_plotlyjs()}</script></head><body>",
             f"<h1>{html.escape(title)}</h1>"]
    for s in sections:
        parts.append(f"<h2>{html.escape(s.heading)}</h2>")
        if s.text:
            parts.append(f"<p>{html.escape(s.text)}</p>")
        for fig in s.figures:
            parts.append(fig.to_html(full_html=False, include_plotlyjs=False))
        for t in s.tables:
            parts.append(_table_html(t))
    if provenance:
        parts.append("<h2>Provenance</h2><pre>"
                     + html.escape(json.dumps(provenance, indent=2, default=str)) + "</pre>")
    parts.append("</body></html>")
    from tomlens.io import write_atomic

    return write_atomic("\n".join(parts), path)
