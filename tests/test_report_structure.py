"""The report a person reads, checked on its HTML without a browser: findings first, then figures,
then tables; long tables (every behaviour table, each battery) closed behind one summary line;
`head = -1` written as "whole layer"; a long flag column given room; captions true to the figure
(no star promised where none is drawn); subtitles wrapped, never cut; two entries of one model
named apart; a probe's "found" line beside the behaviour verdict it does or does not imply; and
the page a single command writes built by the same sections."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import plotly.graph_objects as go
import pytest

from tomlens.report.findings import Finding

pytestmark = pytest.mark.unit


def _behaviour() -> SimpleNamespace:
    """A behaviour result with one accuracy cell at chance and two batteries (one flagged row)."""
    accuracy = pd.DataFrame([{"family": "order-only", "condition": "false_belief", "prompt_type": "belief",
                              "accuracy": 0.5, "ci_low": 0.3, "ci_high": 0.7, "n": 16, "n_tasks": 8}])
    motomqa = pd.DataFrame({"cell": ["order 2", "order 3"], "value": [0.5, 0.6],
                            "flag": ["", "answers 'true' to 96% of statements, so the share of true answers says "
                                         "little about the statements' order"]})
    kosoy = pd.DataFrame({"cell": ["false belief"], "value": [0.4], "flag": [""]})
    return SimpleNamespace(accuracy=accuracy, strict=pd.DataFrame(), object_bias=pd.DataFrame(),
                           selective=pd.DataFrame(), batteries={"motomqa": motomqa, "kosoy": kosoy})


def _probe_table() -> pd.DataFrame:
    rows = []
    for layer in range(2):
        rows.append({"target": "protagonist_belief", "train_on": "all", "eval_set": "all", "features": "activations",
                     "kind": "resid_post", "layer": layer, "head": -1, "metric": "accuracy", "score": 0.6 + 0.1 * layer,
                     "ci_low": 0.5, "ci_high": 0.8, "control": 0.5, "chance": 0.5, "n_test": 8})
        for head in range(2):
            rows.append({"target": "protagonist_belief", "train_on": "all", "eval_set": "all",
                         "features": "activations", "kind": "head_out", "layer": layer, "head": head,
                         "metric": "accuracy", "score": 0.55, "ci_low": 0.5, "ci_high": 0.6, "control": 0.5,
                         "chance": 0.5, "n_test": 8})
    return pd.DataFrame(rows)


def _experiment(tmp_path: Path, specs: list[object], results: list[dict[str, object]]) -> str:
    from tomlens.report.experiment import write_experiment_report
    from tomlens.runs.experiment import ExperimentConfig, ExperimentResult, ModelRun

    config = ExperimentConfig.from_dict({"name": "study", "description": "d", "model": {"name": "m"},
                                         "behaviour": {"stimuli": [{"family": "order-only", "n": 2}]}})
    missing = tmp_path / "not-written"
    runs = [ModelRun(spec, missing, results=r, folders={k: missing / k for k in r}, reused=dict.fromkeys(r, False),
                     provenance={"model": spec.name})  # type: ignore[attr-defined]
            for spec, r in zip(specs, results, strict=True)]
    fig = go.Figure(go.Scatter(x=[0, 1], y=[0.5, 0.6], name="line"))
    figures = {(0, "probes"): {"layers_resid_post": fig}} if "probes" in results[0] else {}
    return write_experiment_report(ExperimentResult(config, missing, runs, {}), tmp_path,
                                   figures=figures).read_text()  # type: ignore[arg-type]


def _probes() -> object:
    from tomlens.probes.sweep import ProbeSweepResult
    from tomlens.runs.probes import ProbesResult
    from tomlens.runs.probes_summary import ProbePlanSummary, ProbesSummary

    plan = ProbePlanSummary(stages=(), estimated_seconds=None, budget_seconds=None, calibration="", notes=(),
                            measured_seconds={})
    summary = ProbesSummary(rows=6, targets=("protagonist_belief",), sites=("resid_post",), position="final",
                            activations="", test_activations=None, directions=False, notes=(), selection={},
                            plan=plan)
    return ProbesResult(ProbeSweepResult(_probe_table()), summary)


def test_findings_come_first_and_behaviour_tables_are_collapsed(tmp_path):
    from tomlens.runs.base import ModelSpec

    text = _experiment(tmp_path, [ModelSpec("m")], [{"behaviour": _behaviour(), "probes": _probes()}])
    body = text[text.index("<body>"):]
    marks = [body.index("<h2 id='findings'>"), body.index("<h2 id='figures'>"), body.index("<table"),
             body.index("<h2>Behaviour</h2>")]
    assert marks == sorted(marks)
    # every behaviour table is behind a closed <details>; each battery is one summary line of its own
    behaviour = body[body.index("<h2>Behaviour</h2>"):body.index("<h2>Probes")]
    assert "<table" not in re.sub(r"<details>.*?</details>", "", behaviour, flags=re.S)
    summaries = re.findall(r"<details><summary>([^<]+)</summary>", behaviour)
    assert any(s.startswith("motomqa (Street et al.") and s.endswith("(2 rows), 1 flagged") for s in summaries)
    assert any(s.startswith("kosoy (Kosoy et al.") and "flagged" not in s for s in summaries)
    assert any(s.startswith("accuracy per family, condition and prompt type (1 row)") for s in summaries)
    assert "<details open" not in body
    # MoToMQA's long flag gets a column of its own width, not a word per line
    assert re.search(r"<th style=\"min-width: \d+em;\">flag</th>", behaviour)


def test_whole_layer_units_read_as_such_in_tables():
    from tomlens.report.html import WHOLE_LAYER, _table_html, shown_table

    table = pd.DataFrame({"layer": [3, 3], "head": [-1, 2], "score": [0.9, 0.6]})
    assert list(shown_table(table)["head"]) == [WHOLE_LAYER, 2] and list(table["head"]) == [-1, 2]
    html = _table_html(table)
    assert "<td>whole layer</td>" in html and "<td>-1</td>" not in html
    assert shown_table(table.drop(columns="head")).equals(table.drop(columns="head"))


def test_a_caption_promises_a_star_only_where_one_is_drawn():
    from tomlens.report.experiment import _PROBE_HEADS, guide_for, has_star, true_guide

    plain = go.Figure(go.Heatmap(z=[[0.5, 0.6]]))
    starred = go.Figure([go.Heatmap(z=[[0.5, 0.6]]), go.Scatter(x=["0"], y=["0"], marker={"symbol": "star"})])
    assert not has_star(plain) and has_star(starred)
    assert true_guide(_PROBE_HEADS, starred) == _PROBE_HEADS
    assert "star marks" not in true_guide(_PROBE_HEADS, plain) and "no star" in true_guide(_PROBE_HEADS, plain)
    layers = guide_for("layers_resid_post", "probes")
    assert "the star is" in layers and "the star is" not in true_guide(layers, plain)


def test_the_probe_head_map_draws_the_star_its_caption_promises():
    """The chosen head is drawn on the map: the caption's star is on the figure."""
    from tomlens.probes.selection import SelectionResult
    from tomlens.report.experiment import has_star
    from tomlens.report.layers import head_heatmap

    evaluation = SimpleNamespace(score=0.7, ci_low=0.6, ci_high=0.8, chance=0.5)
    chosen = SimpleNamespace(unit={"layer": 1, "head": 0, "kind": "head_out"}, evaluation=evaluation, verdict="found",
                             reason="", site="L1H0")
    fig = head_heatmap(_probe_table(), target="protagonist_belief",
                       selection={"protagonist_belief": chosen})  # type: ignore[dict-item]
    assert has_star(fig) and SelectionResult  # the stand-in has the fields the figure reads


def test_a_long_withheld_reason_is_wrapped_in_the_subtitle_not_cut():
    from tomlens.report.html import subtitle
    from tomlens.report.layers import layer_figure

    reason = ("the held-out interval [0.41, 0.77] includes chance (0.50), and the best baseline, the bag of words, "
              "scores 0.62 on the same stories, so nothing here says the unit reads belief rather than the words; "
              "the max-statistic permutation p is 0.31")
    chosen = SimpleNamespace(verdict="withheld", reason=reason, evaluation=None, unit=None, site="")
    fig = layer_figure(_probe_table(), selection={"protagonist_belief": chosen})  # type: ignore[dict-item]
    title = fig.layout.title.text
    lines = re.findall(r"<sup>(.*?)</sup>", title)
    assert len(lines) >= 3 and all(len(line) <= 100 for line in lines) and "..." not in title
    assert " ".join(lines) == f"protagonist_belief: withheld: {reason}"
    assert subtitle("") == ""


def test_two_entries_of_one_model_are_named_apart(tmp_path):
    from tomlens.report.findings import variant_names
    from tomlens.runs.base import ModelSpec

    bos, no_bos = ModelSpec("smollm2-135m", prepend_bos=True), ModelSpec("smollm2-135m", prepend_bos=False)
    assert variant_names(["smollm2-135m"] * 2, [bos, no_bos]) == ["smollm2-135m (bos)", "smollm2-135m (no bos)"]
    assert variant_names(["a", "b"], [ModelSpec("a"), ModelSpec("b", prepend_bos=False)]) == ["a", "b"]
    assert variant_names(["a", "a"], [ModelSpec("a"), ModelSpec("a")]) == ["a (default settings) #1",
                                                                          "a (default settings) #2"]
    assert variant_names(["a", "a"], [ModelSpec("a"), ModelSpec("a", seed=3)]) == ["a (default settings)",
                                                                                 "a (seed 3)"]
    text = _experiment(tmp_path, [bos, no_bos], [{"behaviour": _behaviour()}, {"behaviour": _behaviour()}])
    assert "<h1>tomlens study: smollm2-135m (bos), smollm2-135m (no bos)</h1>" in text
    assert "<strong>smollm2-135m (no bos)</strong>: " in text and "<h2>smollm2-135m (bos): Behaviour</h2>" in text


def test_a_found_probe_sits_beside_the_behaviour_verdict():
    from tomlens.report.findings import findings_html, with_behaviour_context

    probe = Finding("protagonist belief is linearly decodable from layer 16 (0-based) of 30 (resid_post) at 0.91 "
                    "[0.86, 0.95] on held-out order-only stories", "found", "p 0.001", "m", "probes")
    at_chance = Finding("whether the model answers the belief question of order-only false-belief stories better or "
                        "worse than chance", "withheld", "0.50 [0.40, 0.60]: includes chance", "m", "behaviour")
    above = Finding("the model answers the belief question of order-only false-belief stories right 0.90 "
                    "[0.80, 0.95] (16 prompts, 8 tasks), above chance (0.50)", "found", "...", "m", "behaviour")
    unused = with_behaviour_context(probe, [at_chance], ran=True)
    assert unused.context.startswith("protagonist belief is linearly decodable from layer 16 (0-based) of 30 "
                                     "(resid_post), but the model's answers are not above chance")
    assert unused.context.endswith("decodable, not shown to be used")
    used = with_behaviour_context(probe, [at_chance, above], ran=True)
    assert "and the model's answers track belief too" in used.context and above.claim in used.context
    assert "no behaviour stage ran" in with_behaviour_context(probe, [], ran=False).context
    withheld = Finding("whether x is decodable", "withheld", "chance", "m", "probes")
    assert with_behaviour_context(withheld, [at_chance], ran=True) is withheld
    html = findings_html([unused, at_chance])
    line = re.search(r"<li class='finding found'>.*?</li>", html).group(0)  # type: ignore[union-attr]
    assert "<span class='context'>" in line and "not shown to be used" in line


def test_a_probe_with_its_own_test_set_names_it():
    from tomlens.report.experiment import _probe_sections
    from tomlens.report.findings import _stories
    from tomlens.runs.base import StimuliSpec

    config = SimpleNamespace(stimuli=StimuliSpec(path="data/train.jsonl"), test_stimuli=StimuliSpec(path="x/bigtom.csv"))
    assert _stories(config) == "held-out stories of the test set bigtom.csv"
    res = _probes()
    res.config = config  # type: ignore[attr-defined]
    [lead, _] = _probe_sections(res, {})
    assert lead.heading.endswith("(tested on bigtom.csv)")
    assert lead.text.startswith("Probes trained on train.jsonl and scored on the test set bigtom.csv.")


def test_a_single_command_writes_the_same_sections_with_its_findings(tmp_path):
    """`tomlens probe`'s page: the stage's own findings first, its figures drawn from the result, the
    same sections an experiment shows for the stage, titled with the model and its settings."""
    from tomlens.report.experiment import _probe_sections, stage_model_name, write_stage_report
    from tomlens.runs.base import ModelSpec

    res = _probes()
    res.config = SimpleNamespace(model=ModelSpec("smollm2-135m", prepend_bos=False), stimuli=None,  # type: ignore[attr-defined]
                                 test_stimuli=None)
    res.manifest = {"model": {"model": "smollm2-135m", "n_layers": 30}}  # type: ignore[attr-defined]
    assert stage_model_name(res) == "smollm2-135m (no bos)"
    text = write_stage_report("probes", res, tmp_path).read_text()
    assert "<h1>tomlens probe: smollm2-135m (no bos)</h1>" in text
    assert text.index("<h2 id='findings'>") < text.index("<h2 id='figures'>") < text.index("<h2>Probes")
    assert "not run" in text and "selection = false" in text  # no held-out selection: no claim
    for section in _probe_sections(res, {}):
        assert f"<h2>{section.heading}</h2>" in text
    assert "class=\"plotly-graph-div\"" in text and "<h2 id='provenance'>" in text


def test_many_withheld_claims_of_a_stage_fold_behind_one_line_and_found_ones_stay_open():
    from tomlens.report.findings import MAX_OPEN_WITHHELD, findings_html

    withheld = [Finding(f"whether cell {i} is above chance", "withheld", "includes chance", "m", "behaviour")
                for i in range(MAX_OPEN_WITHHELD + 2)]
    found = Finding("belief is decodable", "found", "p 0.001", "m", "probes")
    few = Finding("whether heads carry it", "withheld", "gate failed", "m", "patching")
    html = findings_html([*withheld, found, few])
    assert html.index("belief is decodable") < html.index("<details>")
    [summary] = re.findall(r"<summary>([^<]+)</summary>", html)
    assert summary == f"{MAX_OPEN_WITHHELD + 2} behaviour claims withheld (click for each, with why)"
    folded = html[html.index("<details>"):html.index("</details>")]
    assert all(f.claim in folded for f in withheld) and "whether heads carry it" not in folded
    assert "<details>" not in findings_html(withheld[:MAX_OPEN_WITHHELD])
