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


def _probe_rows() -> pd.DataFrame:
    rows = []
    for target in ("protagonist_belief", "world_state"):
        for layer in range(2):
            rows.append({"target": target, "train_on": "all", "eval_set": "all", "features": "activations", "kind": "resid_post",
                         "layer": layer, "head": -1, "metric": "accuracy", "score": 0.5 + 0.1 * layer,
                         "ci_low": 0.4, "ci_high": 0.8, "control": 0.5, "selectivity": 0.1 * layer, "chance": 0.5})
            for head in range(2):
                rows.append({"target": target, "train_on": "all", "eval_set": "all", "features": "activations", "kind": "head_out",
                             "layer": layer, "head": head, "metric": "accuracy", "score": 0.6, "ci_low": 0.5,
                             "ci_high": 0.7, "control": 0.5, "selectivity": 0.1, "chance": 0.5})
    return pd.DataFrame(rows)


def test_experiment_report_is_built_from_the_results_alone(tmp_path):
    """The page comes from the result objects (their folders need not exist: nothing is read back),
    has a section only for the stages that ran, and its title names the model its provenance records."""
    from tomlens.probes.sweep import ProbeSweepResult
    from tomlens.report.experiment import write_experiment_report
    from tomlens.runs.base import ModelSpec
    from tomlens.runs.experiment import ExperimentConfig, ExperimentResult, ModelRun
    from tomlens.runs.probes import ProbesResult

    config = ExperimentConfig.from_dict({"name": "study", "description": "a probe study", "model": {"name": "m"},
                                         "probes": {"stimuli": {"family": "unexpected-transfer", "n": 2}}})
    missing = tmp_path / "not-written"
    run = ModelRun(ModelSpec("m"), missing, results={"probes": ProbesResult(ProbeSweepResult(_probe_rows()), {})},
                   folders={"probes": missing / "probes"}, reused={"probes": False},
                   provenance={"model": "org/model-7b", "revision": "abc"})
    result = ExperimentResult(config, missing, [run], {"argv": ["run", "study.toml"]})
    text = write_experiment_report(result, tmp_path, figures={}).read_text()
    assert "<h1>tomlens study: org/model-7b</h1>" in text
    assert "<h2>Probes: protagonist belief vs world state</h2>" in text and "a probe study" in text
    assert "Behaviour" not in text and "Patching" not in text and "Minimal pairs" not in text
    assert not missing.exists()
