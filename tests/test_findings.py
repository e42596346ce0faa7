"""Findings: one sentence per claim with its number, interval and test, read off the stage results;
a claim that failed its gate is withheld and never phrased as a result; the report opens with them,
then the figures with their reading guides, then the tables, then provenance."""

from __future__ import annotations

import re

import pandas as pd
import plotly.graph_objects as go
from patching_fakes import ablation as fake_ablation
from patching_fakes import patching_summary

from tomlens.patching.gate import FORCED_PREFIX
from tomlens.probes.selection import Estimate, SelectionResult
from tomlens.report.findings import (
    HEAD_NOTE,
    Finding,
    behaviour_findings,
    experiment_findings,
    findings_html,
    holm,
    layer_words,
    patching_findings,
    probe_findings,
    steering_findings,
    validation_findings,
)
from tomlens.runs.probes_summary import ProbePlanSummary, ProbesSummary
from tomlens.runs.steering_summary import SteeringLayer, SteeringSummary

RESULT_WORDS = re.compile(r"\bis linearly decodable from (layer|head)|\brecover\b|\bflips\b|\bresult\b")


def _probes_summary() -> ProbesSummary:
    """A stand-in probe run's summary (nothing in it is read by the report)."""
    plan = ProbePlanSummary(stages=(), estimated_seconds=None, budget_seconds=None, calibration="", notes=(),
                            measured_seconds={})
    return ProbesSummary(rows=3, targets=("protagonist_belief",), sites=("resid_post",), position="final",
                         activations="", test_activations=None, directions=False, notes=(), selection={}, plan=plan)


def _selection(score: float, lo: float, hi: float, verdict: str, *, bow: float = 0.51, twin: float = 0.52,
               reason: str = "") -> SelectionResult:
    return SelectionResult(
        target="protagonist_belief", unit={"kind": "resid_post", "layer": 14, "head": -1, "position": "final"},
        selection_score=0.93, evaluation=Estimate(score, lo, hi, 0.5),
        baselines={"bag_of_words": Estimate(bow, 0.4, 0.6, 0.5), "length": Estimate(0.5, 0.4, 0.6, 0.5),
                   "random_init": Estimate(twin, 0.4, 0.6, 0.5)},
        control=Estimate(0.55, 0.45, 0.65, 0.5), p_max=0.001, n_perm=1000, permutation="within tasks", n_units=30,
        n_selection=96, n_evaluation=96, verdict=verdict, reason=reason)


class _Probes:
    """Stands in for a ProbesResult: the selection, a one-row table and a config with the family."""

    def __init__(self, selection):
        from tomlens.runs.base import StimuliSpec

        self.selection = {"protagonist_belief": selection} if selection else {}
        self.table = pd.DataFrame({"layer": [0, 29]})
        self.config = type("C", (), {"stimuli": StimuliSpec(family="order-only", n=4), "test_stimuli": None})()


def test_a_found_probe_states_its_numbers_from_the_result():
    [f] = probe_findings(_Probes(_selection(0.91, 0.86, 0.95, "found")), "m", n_layers=30)
    assert f.status == "found" and f.stage == "probes"
    assert f.claim == ("protagonist belief is linearly decodable from layer 14 (0-based) of 30 (resid_post) at 0.91 "
                       "[0.86, 0.95] on held-out order-only stories, 0.39 above the best baseline (random init "
                       "0.52)")
    assert "chosen among 30 units on 96 selection stories" in f.test and "permutation p 0.001" in f.test
    # other numbers in, other sentence out: nothing is typed in
    [g] = probe_findings(_Probes(_selection(0.83, 0.8, 0.9, "found", bow=0.6, twin=0.3)), "m", n_layers=30)
    assert "at 0.83 [0.80, 0.90]" in g.claim
    assert "0.23 above the best baseline (bag of words 0.60); the random-init twin scores 0.30" in g.claim
    assert "condition split" not in f.test
    # the condition split (as SelectionResult.line() gives it) goes with a found claim; an unknown
    # layer count reads "of ?", never a count guessed from the table
    split = _selection(0.91, 0.86, 0.95, "found")
    split.condition_split = Estimate(0.71, 0.6, 0.8, 0.5)
    [h] = probe_findings(_Probes(split), "m")
    assert "; condition split 0.71 [0.60, 0.80]" in h.test and "layer 14 (0-based) of ? (resid_post)" in h.claim
    assert "condition split 0.71" in split.line()


def test_a_withheld_probe_is_never_phrased_as_a_result():
    [f] = probe_findings(_Probes(_selection(0.55, 0.45, 0.65, "withheld", reason="its interval includes chance")),
                         "m", n_layers=30)
    assert f.status == "withheld"
    assert f.claim == "whether protagonist belief is linearly decodable from order-only stories"
    assert not RESULT_WORDS.search(f.claim)
    assert "0.55 [0.45, 0.65] held out" in f.test and f.test.endswith("its interval includes chance")
    [g] = probe_findings(_Probes(None), "m")
    assert g.status == "not run" and "selection = false" in g.test


def _behaviour(acc_rows, effect_rows=()):
    cols = ["family", "contrast", "contrast_kind", "n_pairs", "n_tasks", "effect", "ci_low", "ci_high",
            "share_tasks_positive"]
    return type("B", (), {"accuracy": pd.DataFrame(acc_rows),
                          "knowledge_state": pd.DataFrame(effect_rows, columns=cols)})()


def _acc(family, acc, lo, hi, n_tasks=8, condition="false_belief", prompt="belief"):
    return {"family": family, "condition": condition, "prompt_type": prompt, "n": 2 * n_tasks, "n_tasks": n_tasks,
            "accuracy": acc, "ci_low": lo, "ci_high": hi}


def test_behaviour_states_accuracy_against_chance_and_withholds_what_chance_explains():
    res = _behaviour([_acc("unexpected-transfer", 0.81, 0.7, 0.9), _acc("order-only", 0.5, 0.3, 0.7),
                      _acc("unexpected-contents", 0.2, 0.1, 0.3), _acc("factorial", 0.9, 0.8, 1.0, n_tasks=2),
                      _acc("unexpected-transfer", 0.9, 0.8, 1.0, condition="true_belief")],
                     [("order-only", "true_belief", "knowledge", 8, 8, 0.8, 0.2, 1.4, 0.9),
                      ("order-only", "label", "label", 8, 8, 0.8, 0.2, 1.4, 0.9),
                      ("unexpected-transfer", "present", "knowledge", 8, 8, 0.1, -0.2, 0.4, 0.5)])
    found = {f.claim: f for f in behaviour_findings(res, "m")}
    assert len(found) == 6  # four false-belief cells, two knowledge contrasts (the label contrast is no claim)
    above = found["the model answers the belief question of unexpected-transfer false-belief stories right 0.81 "
                  "[0.70, 0.90] (16 prompts, 8 tasks), above chance (0.50)"]
    assert above.status == "found" and "whole tasks" in above.test
    assert found["the model answers the belief question of unexpected-contents false-belief stories right 0.20 "
                 "[0.10, 0.30] (16 prompts, 8 tasks), below chance (0.50)"].status == "found"
    withheld = [f for f in found.values() if f.status == "withheld"]
    assert len(withheld) == 3 and all(f.claim.startswith("whether") and not RESULT_WORDS.search(f.claim)
                                      for f in withheld)
    assert any("fewer than 5 tasks" in f.test for f in withheld) and any("includes chance" in f.test for f in withheld)
    effect = next(f for f in found.values() if "order-only" in f.claim and "log-odds" in f.claim)
    assert effect.status == "found" and "+0.8 [+0.2, +1.4]" in effect.claim


def _patching(summary, topk=None):
    return type("P", (), {"summary": summary, "tables": {} if topk is None else {"topk": pd.DataFrame(topk)},
                          "dry_run": False})()


def _topk(k, effect, p):
    return {"k": k, "heads": "L3H1;L2H0"[: 4 if k == 1 else 9], "top_effect": effect, "top_ci_low": effect - 0.1,
            "top_ci_high": effect + 0.1, "random_mean": 0.1, "random_low": 0.0, "random_high": 0.3,
            "p_random": p, "n_random": 200, "direction": "denoise"}


def test_patching_is_withheld_by_its_gate_with_the_reason_and_found_only_past_random_heads():
    [f] = patching_findings(_patching(patching_summary(withheld="withheld: the gap is not positive for: present")),
                            "m")
    assert f.status == "withheld" and f.test == "the gap is not positive for: present"
    [f] = patching_findings(_patching(patching_summary(forced=True, forced_message=FORCED_PREFIX),
                                      [_topk(1, 0.9, 0.001)]), "m")
    assert f.status == "withheld" and "--force" in f.test
    summary = patching_summary(validated_on="12 held-out evaluation pairs")
    found, withheld = patching_findings(_patching(summary, [_topk(1, 0.62, 0.005), _topk(2, 0.35, 0.2)]), "m")
    assert found.status == "found" and found.claim == (
        "the top 1 heads (L3H1), ranked on 12 selection pairs, recover 0.62 [0.52, 0.72] of the false- minus "
        "true-belief gap on 12 held-out evaluation pairs, against 0.10 [0.00, 0.30] for layer-matched random heads")
    assert withheld.status == "withheld" and withheld.claim.startswith("whether the top 2 heads")
    assert "Holm-corrected p 0.200 is not below 0.05" in withheld.test
    assert "p 0.005 from 200 random head sets, Holm-corrected across 2 k: 0.010" in found.test


def _steering(rows: list[dict], layer: int, n_prompts: int = 20, n_random: int = 50) -> SteeringSummary:
    """A steering summary around per-layer `rows` (dicts of SteeringLayer fields; the 95th
    percentile defaults to the maximum, the mean to 0)."""
    layers = tuple(SteeringLayer(**{"random_mean": 0.0, "random_p95": r["random_max"], "p_random": 0.02,
                                    "n_random": n_random, **r}) for r in rows)
    return SteeringSummary(layers=layers, mode="add", positions="final", method="mean_difference",
                           target="protagonist_belief", alphas=(2.0,), n_random=n_random, n_selection_prompts=n_prompts,
                           n_evaluation_prompts=n_prompts, selection_tasks=(), forward_passes=0, norms={},
                           verdict=next(r.verdict for r in layers if r.layer == layer), layer=layer, notes=())


def test_steering_and_validation_findings_follow_their_verdicts():
    layer = {"layer": 3, "alpha": 4.0, "flip_false_belief": 0.8, "flip_true_belief": 0.1, "flip_reality": 0.05,
             "random_max": 0.2, "shuffled": 0.1, "selection_flip": 0.7, "verdict": "found", "reason": "flips enough"}
    summary = _steering([layer], 3)
    [f] = steering_findings(type("S", (), {"summary": summary})(), "m", n_layers=5)
    assert f.status == "found" and f.claim.startswith("adding the belief direction at layer 3 (0-based) of 5 flips 0.80")
    summary = _steering([{**layer, "verdict": "withheld", "reason": "a random direction flips 0.90"}], 3)
    [f] = steering_findings(type("S", (), {"summary": summary})(), "m", n_layers=5)
    assert f.status == "withheld" and f.claim.startswith("whether") and f.test.endswith("a random direction flips 0.90")

    from tomlens.runs.validate import CHECKS, Check, ValidationResult, ValidationSummary, table_of

    checks = [Check(name, 0.9 if ok else 0.1, 0.8, ">=", ok, 0.05, 0.1, "<=", f"detail of {name}")
              for name, ok in zip(CHECKS, [True, False, True, True, False], strict=True)]
    summary = ValidationSummary(command="validate", model="m", provenance={}, n_tasks=8, n_stories=24, k=1, heads=8,
                                k_above_5_percent=False, passed=False, checks=tuple(checks), stages={}, seconds=0.0)
    out = validation_findings(ValidationResult(None, table_of(checks), summary), "m")
    assert [f.status for f in out] == ["found", "withheld", "found", "found", "withheld"]
    assert out[0].claim.endswith("0.900 (needs >= 0.8), its control 0.050 (needs <= 0.1)")
    assert out[1].claim.startswith("whether") and "fails at 0.100" in out[1].test


def test_findings_html_lists_found_first_and_escapes():
    fs = [Finding("whether <b>x</b>", "withheld", "gate", "m"), Finding("y at 0.9", "found", "test", "m")]
    text = findings_html(fs)
    assert text.index("y at 0.9") < text.index("whether &lt;b&gt;x&lt;/b&gt;") and "<b>x" not in text
    assert "<strong>" not in text  # one model: not named on every line
    assert "<strong>n</strong>" in findings_html(fs + [Finding("z", "found", "t", "n")])
    assert "No stage of this run makes a claim" in findings_html([])


def test_the_experiment_report_opens_with_findings_then_figures_tables_provenance(tmp_path):
    from tomlens.probes.sweep import ProbeSweepResult
    from tomlens.report.experiment import write_experiment_report
    from tomlens.runs.base import ModelSpec
    from tomlens.runs.experiment import ExperimentConfig, ExperimentResult, ModelRun
    from tomlens.runs.probes import ProbesResult

    rows = [{"target": "protagonist_belief", "train_on": "all", "eval_set": "all", "features": "activations",
             "kind": "resid_post", "layer": layer, "head": -1, "metric": "accuracy", "score": 0.6, "ci_low": 0.5,
             "ci_high": 0.7, "control": 0.5, "chance": 0.5} for layer in range(3)]
    config = ExperimentConfig.from_dict({"name": "study", "model": {"name": "m"},
                                         "probes": {"stimuli": {"family": "order-only", "n": 4}}})
    probes = ProbesResult(ProbeSweepResult(pd.DataFrame(rows)), _probes_summary(), config=None,
                          selection={"protagonist_belief": _selection(0.91, 0.86, 0.95, "found")})
    run = ModelRun(ModelSpec("m"), tmp_path, results={"probes": probes}, folders={"probes": tmp_path / "probes"},
                   reused={"probes": False}, provenance={"model": "m", "n_layers": 30})
    result = ExperimentResult(config, tmp_path, [run], {"argv": ["run"]})
    fig = go.Figure(go.Scatter(x=[0, 1, 2], y=[0.6, 0.6, 0.6]))
    text = write_experiment_report(result, tmp_path, figures={(0, "probes"): {"layers_resid_post": fig}}).read_text()
    marks = [text.index("<h2 id='findings'>"), text.index("<h2 id='figures'>"), text.index("<table"),
             text.index("<h2 id='provenance'>")]
    assert marks == sorted(marks)
    assert "is linearly decodable from layer 14 (0-based) of 30 (resid_post) at 0.91 [0.86, 0.95] on held-out stories" in text
    guide = re.search(r"<figcaption class='guide'>([^<]+)</figcaption>", text).group(1)
    assert guide.startswith("Each solid line is a target&#x27;s held-out probe accuracy per layer")
    assert "class='table-wrap'" in text and '"responsive": true' in text
    assert experiment_findings(result)[0].model == "m"


def test_holm_and_layer_words():
    assert holm([0.01, 0.04, 0.03]) == [0.03, 0.06, 0.06]
    assert holm([0.2, float("nan")])[0] == 0.2 and holm([float("nan")])[0] != holm([float("nan")])[0]
    assert layer_words(14, 30) == "layer 14 (0-based) of 30" and layer_words(2, None) == "layer 2 (0-based) of ?"


def test_a_start_answer_bias_cannot_make_false_belief_accuracy_a_finding():
    """A model that always gives the start answer scores 1.0 on false-belief belief prompts and 0 on
    true-belief ones: above chance on false belief alone is withheld, with the TB number."""
    bias = _behaviour([_acc("unexpected-transfer", 1.0, 0.9, 1.0),
                       _acc("unexpected-transfer", 0.05, 0.0, 0.1, condition="true_belief")])
    [f] = behaviour_findings(bias, "m")
    assert f.status == "withheld" and f.claim.startswith("whether") and not RESULT_WORDS.search(f.claim)
    assert "a start-answer bias would score this too (TB 0.05 [0.00, 0.10]" in f.test
    # the reality-gated joint accuracy above chance rules the bias out as well
    bias.reality_gated = pd.DataFrame([{"family": "unexpected-transfer", "condition": "false_belief",
                                        "joint_accuracy": 0.9, "joint_ci_low": 0.8, "joint_ci_high": 1.0}])
    [g] = behaviour_findings(bias, "m")
    assert g.status == "found" and "not a start-answer bias: TB 0.05" in g.test and "joint 0.90" in g.test


def test_behaviour_cells_are_holm_corrected():
    # each interval alone excludes chance (p about 0.03 each); five cells together do not survive Holm
    rows = [_acc(f"family-{i}", 0.6, 0.51, 0.69) for i in range(5)]
    rows += [_acc(f"family-{i}", 0.9, 0.8, 1.0, condition="true_belief") for i in range(5)]
    out = behaviour_findings(_behaviour(rows), "m")
    assert [f.status for f in out] == ["withheld"] * 5
    assert all("Holm-corrected p" in f.test and "across 5 cells is not below 0.05" in f.test for f in out)
    [one] = behaviour_findings(_behaviour(rows[:1] + rows[5:6]), "m")
    assert one.status == "found" and "across 1 cells" in one.test


def test_patching_found_needs_holm_across_ks_and_a_positive_interval():
    summary = patching_summary()
    # p 0.03 for each of three ks: below 0.05 alone, not after Holm (0.09)
    out = patching_findings(_patching(summary, [_topk(k, 0.6, 0.03) for k in (1, 2, 3)]), "m")
    assert [f.status for f in out] == ["withheld"] * 3 and all("Holm-corrected p 0.090" in f.test for f in out)
    # better than random heads and p small, but the recovery interval reaches 0
    low = {**_topk(1, 0.4, 0.001), "top_ci_low": -0.05, "random_mean": -0.2}
    [f] = patching_findings(_patching(summary, [low]), "m")
    assert f.status == "withheld" and "low end -0.05 is not above 0" in f.test


def test_steering_that_also_flips_reality_is_withheld_with_counts():
    layer = {"layer": 3, "alpha": 4.0, "flip_false_belief": 0.8, "flip_true_belief": 0.1, "flip_reality": 0.5,
             "random_max": 0.2, "shuffled": 0.1, "selection_flip": 0.7, "verdict": "found", "reason": "flips enough"}
    summary = _steering([layer], 3)
    dose = pd.DataFrame([{"direction": "belief", "layer": 3, "alpha": 4.0, "condition": c, "n": n}
                         for c, n in (("false_belief", 10), ("true_belief", 10), ("reality", 20))])
    [f] = steering_findings(type("S", (), {"summary": summary, "dose": dose})(), "m", n_layers=5)
    assert f.status == "withheld" and f.claim.startswith("whether")
    assert "it also flips reality answers (0.50 (10 of 20)" in f.test and "0.80 (8 of 10) of false-belief" in f.test
    summary = _steering([{**layer, "flip_reality": 0.15, "random_max": 0.2}], 3)  # within the random directions' p95
    [g] = steering_findings(type("S", (), {"summary": summary, "dose": dose})(), "m", n_layers=5)
    assert g.status == "found" and "reality 0.15 (3 of 20) flipped" in g.test


def test_head_names_are_explained_once():
    fs = [Finding("the top 1 heads (L3H1)", "found", "t", "m"), Finding("the top 2 heads (L3H1, L2H0)", "found", "t")]
    assert findings_html(fs).count(HEAD_NOTE) == 1 and HEAD_NOTE not in findings_html(fs[:0] + [Finding("x", "found", "t")])


class _Patch:
    def __init__(self, summary):
        self.summary, self.sweeps = summary, {"x": 1}
        self.tables = {"topk": pd.DataFrame([_topk(1, 0.6, 0.01)])}


def test_forced_or_withheld_patching_figures_are_flagged_and_ablation_names_its_mode():
    from tomlens.report.experiment import _patching_sections

    figs = {"heads_exact_denoise": go.Figure(go.Heatmap(z=[[1, 2]])), "topk_recovery": go.Figure(go.Scatter(y=[1]))}
    forced = _patching_sections(_Patch(patching_summary(forced=True, forced_message=FORCED_PREFIX,
                                                        ablation=fake_ablation(mode="all"))), figs)
    assert forced[0].heading == "Patching (forced past its gate: not a result)" and len(forced[0].figures) == 2
    assert all(g.startswith("FORCED past a failed gate, not a result: ") for g in forced[0].guides)
    assert HEAD_NOTE in forced[0].text
    held = _patching_sections(_Patch(patching_summary(withheld="withheld: the gap is not positive for: present")),
                              figs)
    assert held[0].heading == "Patching (withheld: the gap is not positive for: present)"
    assert all(g.startswith("WITHHELD (the gap is not positive") for g in held[0].guides)
    res = _Patch(patching_summary(ablation=fake_ablation(mode="all")))
    res.tables["ablation"] = pd.DataFrame({"k": [1]})
    ablation = next(s for s in _patching_sections(res, {}) if s.heading == "Mean ablation of the top heads")
    assert "at every position" in ablation.text and "final token" not in ablation.text
    assert _patching_sections(res, {})[0].heading == "Patching: heads that carry belief"


def test_the_steering_section_states_only_the_chosen_layer():
    from tomlens.report.experiment import _steering_sections

    rows = [{"layer": l, "alpha": 2.0, "flip_false_belief": f, "flip_true_belief": 0.0, "flip_reality": 0.0,
             "random_max": 0.1, "shuffled": 0.1, "selection_flip": sel, "verdict": v, "reason": "r"}
            for l, f, sel, v in ((1, 0.9, 0.2, "found"), (2, 0.9, 0.8, "withheld"))]
    summary = _steering(rows, 2, n_prompts=8, n_random=5)
    [sec] = _steering_sections(type("S", (), {"summary": summary})(), {}, 6)
    assert "layer 2 (0-based) of 6, at alpha 2: withheld held out" in sec.text
    assert "found at" not in sec.text and "not chosen: no claim" in sec.text
