"""Test-only and duplicated library names removed in issue #9 stay removed: one figure writer, one
probe-figure writer, one version collector, no in-memory activations or table-only sweep in the
library (the tests keep their own), no unused out-of-memory predicate."""

from __future__ import annotations

import importlib

import pytest

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("module, name", [
    ("tomlens.probes.sweep", "probe_sweep"),
    ("tomlens.probes.sweep", "activations_from_tensors"),
    ("tomlens.probes.sweep", "_versions"),
    ("tomlens.oom", "is_oom"),
    ("tomlens.report.layers", "write_html"),
    ("tomlens.report.layers", "write_probes_figures"),
    ("tomlens.report.experiment", "_probe_figures"),
])
def test_the_name_is_gone(module, name):
    assert not hasattr(importlib.import_module(module), name)


def test_one_figure_writer():
    from tomlens.report import html, layers, patching

    assert layers.write_figure is patching.write_figure is html.write_figure
