"""The HTML report is self-contained: tables, figures and provenance, no network needed to open it."""

import pandas as pd
import plotly.graph_objects as go

from tomlens.report.html import Section, write_report
from tomlens.runs.probes_summary import ProbePlanSummary, ProbesSummary
from tomlens.runs.steering_summary import SteeringLayer, SteeringSummary


def _probes_summary() -> ProbesSummary:
    """A stand-in probe run's summary (nothing in it is read by the report)."""
    plan = ProbePlanSummary(stages=(), estimated_seconds=None, budget_seconds=None, calibration="", notes=(),
                            measured_seconds={})
    return ProbesSummary(rows=3, targets=("protagonist_belief",), sites=("resid_post",), position="final",
                         activations="", test_activations=None, directions=False, notes=(), selection={}, plan=plan)


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
    run = ModelRun(ModelSpec("m"), missing, results={"probes": ProbesResult(ProbeSweepResult(_probe_rows()), _probes_summary())},
                   folders={"probes": missing / "probes"}, reused={"probes": False},
                   provenance={"model": "org/model-7b", "revision": "abc"})
    result = ExperimentResult(config, missing, [run], {"argv": ["run", "study.toml"]})
    text = write_experiment_report(result, tmp_path, figures={}).read_text()
    assert "<h1>tomlens study: org/model-7b</h1>" in text
    assert "<h2>Probes: protagonist belief vs world state</h2>" in text and "a probe study" in text
    assert "Behaviour" not in text and "Patching" not in text and "Minimal pairs" not in text
    assert not missing.exists()


def _layer(layer: int, verdict: str, flip: float) -> SteeringLayer:
    return SteeringLayer(layer=layer, alpha=2.0, flip_false_belief=flip, flip_true_belief=0.0, flip_reality=0.05,
                         random_mean=0.02, random_max=0.1, random_p95=0.05, p_random=0.05, n_random=20, shuffled=0.0,
                         verdict=verdict,
                         reason="belief flips enough" if verdict == "found" else "the belief direction flips too few")


def _steering_and_validation(tmp_path, layers: list[SteeringLayer], passed: list[bool]) -> str:
    """A report over a synthetic steering result and validation table (no model, nothing read back)."""
    from tomlens.report.experiment import write_experiment_report
    from tomlens.runs.base import ModelSpec
    from tomlens.runs.experiment import ExperimentConfig, ExperimentResult, ModelRun
    from tomlens.runs.steering import SteeringResult, chosen_layer
    from tomlens.runs.validate import CHECKS, Check, ValidationResult, ValidationSummary, table_of

    config = ExperimentConfig.from_dict({"name": "s", "model": {"name": "m"}, "steering": {}, "validate": {}})
    steer = SteeringResult(dose=pd.DataFrame(), selection=pd.DataFrame(),
                           summary=SteeringSummary(
                               layers=tuple(layers), n_selection_prompts=8, n_evaluation_prompts=8, n_random=20,
                               method="mean_difference", mode="add", positions="final", target="protagonist_belief",
                               alphas=(2.0,), selection_tasks=(), forward_passes=0, norms={},
                               verdict=chosen_layer(layers).verdict, layer=chosen_layer(layers).layer, notes=()))
    checks = [Check(name, 0.9 if ok else 0.1, 0.8, ">=", ok, 0.05, 0.1, "<=", f"detail of {name}")
              for name, ok in zip(CHECKS, passed, strict=True)]
    valid = ValidationResult(None, table_of(checks), ValidationSummary(
        command="validate", model="m", provenance={}, n_tasks=16, n_stories=48, k=1, heads=8, k_above_5_percent=False,
        passed=all(passed), checks=tuple(checks), stages={}, seconds=0.0))
    missing = tmp_path / "none"
    run = ModelRun(ModelSpec("m"), missing, results={"steering": steer, "validate": valid},
                   folders={"steering": missing / "steering", "validate": missing / "validate"},
                   reused={"steering": False, "validate": False}, provenance={"model": "m"})
    return write_experiment_report(ExperimentResult(config, missing, [run], {}), tmp_path, figures={}).read_text()


def test_steering_section_shows_withheld_layers_as_withheld(tmp_path):
    text = _steering_and_validation(tmp_path, [_layer(0, "withheld", 0.9), _layer(1, "withheld", 0.2)],
                                    [False] * 5)
    assert "<h2>Steering along the belief direction</h2>" in text
    assert text.count("<td>withheld</td>") == 2 and "<td>found</td>" not in text
    assert "No layer passed: every layer is withheld" in text and "was found at" not in text
    text = _steering_and_validation(tmp_path, [_layer(0, "withheld", 0.3), _layer(1, "found", 0.9)], [False] * 5)
    assert "The layer chosen on the selection half is layer 1 (0-based) of ?, at alpha 2: found held out" in text
    assert "was found at" not in text and text.count("<td>withheld</td>") == 1


def test_validation_section_counts_the_checks_that_pass(tmp_path):
    text = _steering_and_validation(tmp_path, [_layer(0, "found", 0.9)], [True, True, False, True, False])
    assert "<h2>Validation of the methods</h2>" in text and "3 of 5 checks pass on m (the validation FAILED)" in text
    assert text.count("<td>PASS</td>") == 3 and text.count("<td>FAIL</td>") == 2
    assert "<td>&gt;= 0.8</td>" in text and "<td>&lt;= 0.1</td>" in text and "detail of mean_ablation" in text
    text = _steering_and_validation(tmp_path, [_layer(0, "found", 0.9)], [True] * 5)
    assert "5 of 5 checks pass on m (every check passes)" in text and "<td>FAIL</td>" not in text
