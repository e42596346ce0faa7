"""The shortcut audit: its statistics, its verdicts, and that it finds the defects of the generators
as they were at 6bc1cca (samples in tests/data/audit/, seed 7, 64 tasks)."""

from __future__ import annotations

import gzip
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from tomlens.audit import AuditReport, Contrast, Rule, audit_stimuli, register_contrast, register_rule, sample_per_task
from tomlens.audit import contrasts as contrasts_module
from tomlens.audit.contrasts import family_contrasts, family_rules
from tomlens.audit.evaluate import (
    AT_CHANCE,
    BELOW,
    OVER_CEILING,
    SHORTCUT,
    TOO_FEW,
    Score,
    class_weights,
    cluster_interval,
    confirmed,
    held_out_correct,
    shuffled_labels,
    task_folds,
    verdict,
)
from tomlens.audit.heuristics import first_mentioned, last_cue_polarity, last_mentioned, most_mentioned, story_of
from tomlens.cli import main
from tomlens.errors import TomlensError
from tomlens.stimuli.records import Span, Stimulus, write_jsonl

pytestmark = pytest.mark.unit
DATA = Path(__file__).parent / "data" / "audit"


def before(family: str) -> list[Stimulus]:
    with gzip.open(DATA / f"{family}-6bc1cca.jsonl.gz", "rt") as f:
        return [Stimulus.from_dict(json.loads(line)) for line in f]


def as_user(stimuli: list[Stimulus], conditions: tuple[str, ...]) -> list[Stimulus]:
    """The rows of two conditions, as a user's file would carry them (no family rules, so the
    generic battery alone and the `condition` contrast)."""
    return [s.with_(family="user") for s in stimuli if s.condition in conditions]


def story(i: int, condition: str, text: str, *, reversed_: bool = False) -> Stimulus:
    options = ("the basket", "the box")
    return Stimulus(id=f"{i}-{condition}", text=text + " Where will Sally look? In", options=options,
                    answer=options[1] if reversed_ else options[0], family="user", task_id=f"t{i}",
                    condition=condition, reversed=reversed_)


# --- statistics ---------------------------------------------------------------------------------

def test_folds_keep_every_task_whole_and_depend_on_the_seed():
    tasks = [f"t{i // 3}" for i in range(60)]
    folds = task_folds(tasks, seed=1)
    for t in set(tasks):
        assert len({folds[i] for i, x in enumerate(tasks) if x == t}) == 1
    assert len(set(folds)) == 5
    assert not np.array_equal(folds, task_folds(tasks, seed=2))


def test_a_cue_mapping_is_learned_on_training_tasks_not_assumed():
    # the cue points the "wrong" way (value "a" goes with class 1): a learned mapping still gets it
    values = ["a", "b"] * 20
    labels = [1, 0] * 20
    folds = task_folds([f"t{i // 2}" for i in range(40)], seed=0)
    assert held_out_correct(values, labels, folds).all()
    # an uninformative cue: every value carries both classes equally -> the majority guess
    noise = held_out_correct(["a"] * 40, labels, folds)
    assert 0.3 <= noise.mean() <= 0.7


def test_cluster_interval_treats_tasks_as_the_unit():
    # 10 tasks of 10 rows: 5 tasks all right, 5 all wrong -> accuracy 0.5, se from 10 units, not 100
    correct = np.repeat([True, False] * 5, 10)
    tasks = [f"t{i // 10}" for i in range(100)]
    s = cluster_interval(correct, tasks, level=0.95)
    assert s.accuracy == pytest.approx(0.5) and s.n_tasks == 10
    se = np.sqrt(10 / 9 * (10 * 5**2)) / 100  # residuals +-5 per task
    assert s.ci_high - s.ci_low == pytest.approx(2 * 1.959964 * se, rel=1e-4)


def test_labels_are_shuffled_within_tasks_or_across_them_as_the_design_allows():
    rng = np.random.default_rng(0)
    paired = shuffled_labels(["a", "b"] * 20, [f"t{i // 2}" for i in range(40)], rng)
    assert all(sorted(paired[i:i + 2]) == ["a", "b"] for i in range(0, 40, 2))  # each task keeps one of each
    per_task = shuffled_labels(["a", "a", "b", "b"] * 10, [f"t{i // 2}" for i in range(40)], rng)
    assert all(per_task[i] == per_task[i + 1] for i in range(0, 40, 2))  # whole tasks move
    assert per_task.count("a") == 20 and per_task != ["a", "a", "b", "b"] * 10


def test_a_task_keeps_which_rows_share_a_label_when_its_classes_are_renamed():
    # the prefixes of one story version all key the same option: the null redraws which option
    # that is, per task, and never splits a version's rows between the two
    labels = ([0] * 5 + [1] * 5) * 30
    tasks = [f"t{i // 10}" for i in range(300)]
    out = shuffled_labels(labels, tasks, np.random.default_rng(2))
    for t in range(30):
        rows = out[10 * t:10 * t + 10]
        assert len(set(rows[:5])) == 1 and len(set(rows[5:])) == 1 and rows[0] != rows[5]
    flipped = sum(out[10 * t] == 1 for t in range(30))
    assert 5 < flipped < 25  # about half the tasks renamed


def test_single_class_tasks_are_shuffled_among_themselves_when_others_hold_both_classes():
    # 63 tasks of one class each and one task of both: a within-task shuffle alone would keep the
    # 63 tasks' true labels, and a real cue would meet a null equal to itself (the reviewer's case)
    labels = [i % 2 for i in range(63)] + [0, 1]
    tasks = [f"t{i}" for i in range(63)] + ["mixed", "mixed"]
    out = shuffled_labels(labels, tasks, np.random.default_rng(1))
    assert sorted(out[:63]) == sorted(labels[:63]) and out[:63] != labels[:63]
    assert sorted(out[63:]) == [0, 1]


def test_rows_without_task_ids_are_held_out_by_story_and_said_so():
    rows = [s.with_(task_id="") for s in _same_words(20)]
    report = audit_stimuli(rows)
    assert any("no task_id" in s for s in report.skipped)
    assert max(r.n_tasks for r in report.rows) == 40  # each story text its own unit (twins differ in order)


def test_a_shortcut_must_clear_the_wider_of_the_null_and_the_task_spread():
    score = Score(0.61, 0.50, 0.72, 337, 64, se=0.035)
    assert confirmed(score, 0.50, 0.01, level=0.95) == SHORTCUT  # 3.1 task-level SEs
    assert confirmed(score, 0.50, 0.07, level=0.95) == AT_CHANCE  # the null spreads wider
    assert confirmed(Score(1.0, 1.0, 1.0, 40, 40, se=0.0), 0.5, 0.0, level=0.99) == SHORTCUT


def test_balanced_weights_give_each_class_the_same_total():
    w = class_weights(["x", "x", "x", "y"], balanced=True)
    assert w[:3].sum() == pytest.approx(0.5) and w[3] == pytest.approx(0.5)
    assert class_weights(["x", "y"], balanced=False).tolist() == [0.5, 0.5]


@pytest.mark.parametrize("score,bag,expected", [
    (Score(0.90, 0.80, 0.97, 200, 64), False, SHORTCUT),
    (Score(0.52, 0.44, 0.60, 200, 64), False, AT_CHANCE),
    # a bag over 0.60 is shown as such, but a shortcut only when its interval clears chance: a bag's
    # accuracy swings more between fresh sets than any within-set spread says
    (Score(0.62, 0.45, 0.79, 200, 64), True, OVER_CEILING),
    (Score(0.62, 0.45, 0.79, 200, 64), False, AT_CHANCE),
    (Score(0.62, 0.45, 0.79, 60, 16), True, AT_CHANCE),
    (Score(0.30, 0.20, 0.40, 200, 64), False, BELOW),
    (Score(0.50, 0.50, 0.50, 200, 64), False, AT_CHANCE),  # exact chance is not "above" by rounding
    (Score(1.00, 1.00, 1.00, 20, 4), False, TOO_FEW),
])
def test_verdicts(score, bag, expected):
    assert verdict(score, 0.5, ngram_bag=bag) == expected


# --- heuristics ---------------------------------------------------------------------------------

def test_story_stops_at_the_question_and_option_mentions_are_found():
    s = story(0, "x", "Sally puts the ball in the basket. Anne moves it to the box. Anne looks in the box.")
    assert story_of(s).endswith("Anne looks in the box. ")
    assert first_mentioned(s) == 0 and last_mentioned(s) == 1 and most_mentioned(s) == 1
    with_span = s.with_(spans={"query": Span(s.text.index("Where"), len(s.text))})
    assert "Where" not in story_of(with_span)


def test_last_cue_polarity_reads_the_last_presence_or_absence_word():
    assert last_cue_polarity(story(0, "x", "Sally leaves. Anne moves the ball.")) == "absent"
    assert last_cue_polarity(story(0, "x", "Sally leaves. Later Sally comes back.")) == "present"
    assert last_cue_polarity(story(0, "x", "Anne moves the ball.")) is None


# --- the battery on sets built to have, or not have, a shortcut ---------------------------------

def _worded_by_condition(n: int) -> list[Stimulus]:
    out = []
    for i in range(n):
        out.append(story(i, "false_belief", f"Sally{i} leaves the room. Anne moves the ball.", reversed_=i % 2 == 0))
        out.append(story(i, "control", f"Sally{i} stays and watches. Anne moves the ball.", reversed_=i % 2 == 1))
    return out


def _same_words(n: int) -> list[Stimulus]:
    """Both conditions hold the same words; only the order of two sentences differs, and which
    order goes with which condition is mixed across tasks (so no order cue decides either)."""
    out = []
    for i in range(n):
        a, b = f"Sally{i} leaves the room.", "Anne moves the ball."
        first, second = (a + " " + b, b + " " + a) if i % 2 else (b + " " + a, a + " " + b)
        flip = (i // 2) % 2 == 0  # not tied to the order: an earlier draft tied them, and the audit said so
        out.append(story(i, "false_belief", first, reversed_=flip))
        out.append(story(i, "control", second, reversed_=not flip))
    return out


def test_a_condition_worded_apart_is_a_shortcut_and_the_report_names_it():
    report = audit_stimuli(_worded_by_condition(40))
    named = {(r.contrast, r.heuristic) for r in report.explaining("user", "condition")}
    assert ("condition", "1-gram bag (story)") in named
    assert ("condition", "last presence/absence cue") in named
    assert report.verdict().startswith("SHORTCUTS")
    assert any(r.sentence().startswith("1-gram bag (story) tells condition apart at 1.00") for r in report.shortcuts)


def test_a_set_with_the_same_words_in_both_conditions_passes():
    report = audit_stimuli(_same_words(40))
    assert not report.shortcuts, report.table()
    assert report.verdict().startswith("no shortcut found")
    assert 0 < 1 - report.level < 0.05 / 10  # Bonferroni over the rows


def test_answers_kept_in_one_place_are_a_position_shortcut():
    stimuli = [s.with_(reversed=False, answer=s.options[0]) for s in _same_words(40)]
    rows = audit_stimuli(stimuli).explaining("user", "keyed option position")
    assert any(r.heuristic == "option order" and r.accuracy == 1.0 for r in rows)


def test_too_few_tasks_is_said_not_judged():
    report = audit_stimuli(_worded_by_condition(4))
    assert not report.shortcuts
    assert all(r.verdict == TOO_FEW for r in report.rows)
    assert any("at least 8 are needed" in s for s in report.skipped)


def test_a_registered_rule_joins_the_battery_for_its_family_and_reads_what_it_can():
    stimuli = [s.with_(family="audit-test-family", meta={"cue": s.condition} if i % 3 else {})
               for i, s in enumerate(_same_words(40))]
    register_rule("audit-test-family", Rule("cue field", lambda s: s.meta["cue"], "the meta field a generator leaked"))
    try:
        report = audit_stimuli(stimuli)
    finally:
        contrasts_module._EXTRA_RULES.pop("audit-test-family")
    rows = [r for r in report.shortcuts if r.heuristic == "rule: cue field"]
    assert rows and rows[0].source == "family rule"


def test_registering_a_rule_or_contrast_again_replaces_it_rather_than_adding_rows():
    """A script or notebook cell run twice registers the same names twice: the audit must show one
    row per (contrast, heuristic), as the features are keyed by name."""
    stimuli = [s.with_(family="audit-test-family", meta={"cue": s.condition}) for s in _same_words(40)]
    try:
        for _ in range(2):
            register_rule("audit-test-family", Rule("cue field", lambda s: s.meta["cue"], "a leaked field"))
            register_contrast("audit-test-family", Contrast("cue contrast", lambda s: s.meta["cue"], "the cue"))
        register_contrast("audit-test-family", Contrast(  # the generic contrast, on the control rows only
            "keyed option position", lambda s: s.answer_index if s.condition == "control" else None,
            "the generic contrast, as this family keys it", chance=0.5))
        report = audit_stimuli(stimuli)
    finally:
        contrasts_module._EXTRA_RULES.pop("audit-test-family")
        contrasts_module._EXTRA_CONTRASTS.pop("audit-test-family")
    keys = Counter((r.contrast, r.heuristic) for r in report.rows)
    assert keys and set(keys.values()) == {1}, keys
    assert Counter(r.contrast for r in report.rows if r.heuristic == "rule: cue field") == {
        "keyed option position": 1, "cue contrast": 1}
    position = [r for r in report.rows if r.contrast == "keyed option position" and r.heuristic == "length"]
    assert len(position) == 1 and position[0].n_rows == sum(s.condition == "control" for s in stimuli)


def test_a_registered_rule_or_contrast_of_a_declared_name_takes_the_declared_one_s_place():
    """A built-in family's rule or contrast registered again under its name is replaced, not doubled."""
    family = "false-belief-factorial"
    declared_rule, declared_contrast = family_rules(family)[0], family_contrasts(family)[0]
    mine_rule = Rule(declared_rule.name, lambda s: None, "mine")
    mine_contrast = Contrast(declared_contrast.name, lambda s: None, "mine")
    try:
        for _ in range(2):
            register_rule(family, mine_rule)
            register_contrast(family, mine_contrast)
        rules, contrasts = family_rules(family), family_contrasts(family)
    finally:
        contrasts_module._EXTRA_RULES.pop(family)
        contrasts_module._EXTRA_CONTRASTS.pop(family)
    assert [r.name for r in rules].count(declared_rule.name) == 1 and mine_rule in rules
    assert declared_rule not in rules and len(rules) == len(family_rules(family))
    assert [c.name for c in contrasts].count(declared_contrast.name) == 1 and mine_contrast in contrasts
    assert declared_contrast not in contrasts


def test_a_contrast_a_family_states_openly_is_left_out_with_its_reason():
    from tomlens.stimuli import generate

    report = audit_stimuli(generate("scalar-implicature", n=8, seed=3))
    assert not any(r.contrast == "false vs true belief" for r in report.rows)
    assert any("not audited by design" in s and "states their access" in s for s in report.skipped)


def test_report_round_trips_through_json(tmp_path):
    report = audit_stimuli(_worded_by_condition(12))
    again = AuditReport.read(report.write(tmp_path / "audit.json"))
    pd.testing.assert_frame_equal(again.frame(), report.frame())  # NaN where no null ran
    assert again.verdict() == report.verdict()


def test_sample_per_task_keeps_at_most_k_rows_of_each_task_spread_over_its_cells():
    stimuli = _same_words(10)
    kept = sample_per_task(stimuli, 1)
    assert len(kept) == 10 and len({s.task_id for s in kept}) == 10
    both = sample_per_task(stimuli + [s.with_(id=s.id + "-again") for s in stimuli], 2)
    assert all(sorted(s.condition for s in both if s.task_id == t) == ["control", "false_belief"]
               for t in {s.task_id for s in stimuli})
    with pytest.raises(TomlensError, match="at least 1"):
        sample_per_task(stimuli, 0)


def test_no_stimuli_is_one_clear_error():
    with pytest.raises(TomlensError, match="no stimuli"):
        audit_stimuli([])


# --- the generators as they were (6bc1cca): the defects issue 27 names --------------------------

def test_unexpected_contents_frames_word_false_belief_and_open_container_apart():
    report = audit_stimuli(as_user(before("unexpected-contents"), ("false_belief", "open_container")))
    bags = {r.heuristic: r.accuracy for r in report.explaining("user", "condition")}
    assert bags.get("2-gram bag (story)", 0) >= 0.95, report.table()


def test_unexpected_transfer_bigrams_over_the_ceiling_are_shown_but_not_confirmed():
    # "watching afterwards" reads 0.62: over the bags' ceiling and named in the verdict line, but not
    # confirmed as a shortcut against a null that renames each task's classes (the design's own
    # randomisation; on this set its spread is 0.04, so 0.62 is some 2.8 spreads out, not the
    # battery's 3.2)
    report = audit_stimuli(as_user(before("unexpected-transfer"), ("false_belief", "present")))
    bags = [r for r in report.rows if r.contrast == "condition" and r.heuristic.startswith(("2-gram", "3-gram"))]
    assert bags and all(r.verdict == OVER_CEILING and r.accuracy > 0.6 for r in bags), report.table()
    assert all(r.null_sd > 0.02 for r in bags)  # the row-shuffled null was 0.02: too narrow for shared words
    assert "2-gram bag (story)" in report.verdict()


def test_cli_audits_a_user_file_and_check_exits_1_on_a_shortcut(tmp_path, capsys):
    path = write_jsonl(_worded_by_condition(40), tmp_path / "mine.jsonl")
    assert main(["audit", str(path)]) == 0
    out = capsys.readouterr().out
    assert "1-gram bag (story)" in out and "SHORTCUTS" in out
    assert main(["audit", str(path), "--check", "--out", str(tmp_path / "a.json")]) == 1
    assert json.loads((tmp_path / "a.json").read_text())["verdict"].startswith("SHORTCUTS")
    clean = write_jsonl(_same_words(20), tmp_path / "clean.jsonl")
    assert main(["audit", str(clean), "--check"]) == 0


def test_cli_names_a_source_it_cannot_read(tmp_path, capsys):
    assert main(["audit", str(tmp_path / "nope.jsonl")]) == 2
    assert "neither a stimulus family nor a file" in capsys.readouterr().err
