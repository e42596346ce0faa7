"""Plotly figures (standalone HTML, plotly.js inline) and the per-run HTML report."""

from tomlens.report.html import Section, write_figure, write_report
from tomlens.report.layers import head_heatmap as probe_head_heatmap
from tomlens.report.layers import layer_figure, write_probe_figures
from tomlens.report.patching import attribution_scatter, head_heatmap, recovery_curve, resid_heatmap

__all__ = ["Section", "attribution_scatter", "head_heatmap", "layer_figure", "probe_head_heatmap",
           "recovery_curve", "resid_heatmap", "write_figure", "write_probe_figures", "write_report"]
