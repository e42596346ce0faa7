"""The HTML report is self-contained: tables, figures and provenance, no network needed to open it."""

import pandas as pd
import plotly.graph_objects as go

from tomlens.report.html import Section, write_report


def test_report_inlines_plotly_and_tables(tmp_path):
    fig = go.Figure(go.Scatter(x=[0, 1, 2], y=[0.5, 0.7, 0.9], name="belief probe"))
    table = pd.DataFrame({"layer": [0, 1], "accuracy": [0.5, 0.875]})
    path = write_report(tmp_path / "report.html", "run <1>",
                        [Section("Probes", "accuracy per layer", [table], [fig])],
                        provenance={"model": "tiny-gpt2", "seed": 0})
    text = path.read_text()
    assert "run &lt;1&gt;" in text and "0.875" in text and "belief probe" in text
    assert "<script src=" not in text and "Plotly" in text and "&quot;model&quot;: &quot;tiny-gpt2&quot;" in text
    assert not list(tmp_path.glob("*.tmp"))
