"""Belief tracking against the shortcut audit (issue #27): the defect of the generator as it was at
bb6d78d (sample in tests/data/audit/, seed 7, 64 tasks, every row) and the fixed generator on fresh
seeds.

Before: a transfer story names its two places in an order fixed by the plot until its closing
sentence, so prefixes cut before the closing named the start place (the belief answer) last at the
put and the other place after the move, and named the other place more often on the prefix that
stops at "The <other> is empty". Now every belief prompt's lead-in carries the closing, one version
of each task tells the put before the empty sentence, and the reversed version names the places in
the listing and the closing in the other order."""

from __future__ import annotations

import gzip
import json
from collections import Counter
from pathlib import Path

import pytest

from tomlens.audit import audit_stimuli, sample_per_task
from tomlens.audit.evaluate import BAG_CEILING, SHORTCUT, held_out_correct, task_folds
from tomlens.audit.heuristics import first_mentioned, generic_battery, last_mentioned, most_mentioned
from tomlens.stimuli.false_belief import CONTENTS, TRANSFER, make_tasks
from tomlens.stimuli.records import Stimulus
from tomlens.stimuli.tracking import FAMILY, belief_tracking, put_first

pytestmark = pytest.mark.unit
SAMPLE = Path(__file__).parent / "data" / "audit" / "belief-tracking-bb6d78d.jsonl.gz"
CONTRAST = "keyed option position"


def _before() -> list[Stimulus]:
    with gzip.open(SAMPLE, "rt") as f:
        return [Stimulus.from_dict(json.loads(line)) for line in f]


def test_the_audit_finds_the_mention_order_of_the_bb6d78d_prefixes():
    report = audit_stimuli(_before(), seed=0)
    found = {r.heuristic: r.accuracy for r in report.explaining(FAMILY, CONTRAST)}
    assert found.get("last-mentioned option", 0) >= 0.60, report.table()
    assert "most-mentioned option" in found, report.table()


def _belief_rows(n: int, seed: int) -> list[Stimulus]:
    return [s for s in belief_tracking(n, seed=seed) if s.prompt_type == "belief"]


def test_the_last_place_named_before_every_belief_prompt_is_the_closings():
    """The closing names the start place last in the original version of the tasks with
    `last_ref` (half of every block of 8) and in the reversed version of the others, and no prefix
    names a place after it: so at every prefix, each task keys the last-mentioned option in exactly
    one of its two versions."""
    tasks = {t.task_id: t for t in make_tasks(TRANSFER, 16, 11)}
    rows = _belief_rows(16, 11)
    for s in rows:
        named_last = s.options[last_mentioned(s)]
        assert (named_last == s.reference_state) == (tasks[s.task_id].last_ref != s.reversed), s.text
    keyed = Counter((s.task_id, s.meta["prefix_index"]) for s in rows if last_mentioned(s) == s.answer_index)
    stages = Counter((s.task_id, s.meta["prefix_index"]) for s in rows)
    assert set(stages.values()) == {2} and keyed == {stage: 1 for stage in stages}


def test_the_first_place_named_is_keyed_in_one_version_of_each_task():
    rows = _belief_rows(16, 11)
    keyed = Counter((s.task_id, s.meta["prefix_index"]) for s in rows if first_mentioned(s) == s.answer_index)
    assert keyed == {(s.task_id, s.meta["prefix_index"]): 1 for s in rows}


def test_one_place_is_named_more_often_only_at_the_third_prefix_and_it_is_the_start_in_half():
    """The empty sentence names the other place and the put the start: whichever comes first leads
    by one at the third prefix; each task tells one version each way."""
    tasks = {t.task_id: t for t in make_tasks(TRANSFER, 16, 11)}
    for s in _belief_rows(16, 11):
        most = most_mentioned(s)
        if s.meta["prefix_index"] != 3:
            assert most is None, s.text
            continue
        assert most is not None
        assert (s.options[most] == s.reference_state) == put_first(tasks[s.task_id], s.reversed)
    assert all(put_first(t, False) != put_first(t, True) for t in tasks.values())
    assert sum(put_first(t, False) for t in tasks.values()) == 8


@pytest.mark.parametrize("seed", [101, 202, 4242])
def test_fresh_seeds_pass_the_audit(seed):
    """`tomlens audit belief-tracking --seed S --n 64 --per-task 6` (fold seed 0): no shortcut, the
    last-mentioned option's interval covers chance, every n-gram bag at most the ceiling."""
    rows = sample_per_task(belief_tracking(64, seed=seed), 6, seed=0)
    report = audit_stimuli(rows, seed=0)
    mine = [r for r in report.rows if r.family == FAMILY and r.contrast == CONTRAST]
    assert len(mine) >= 12 and not [r for r in mine if r.verdict == SHORTCUT], report.table()
    last = next(r for r in mine if r.heuristic == "last-mentioned option")
    assert last.ci_low <= 0.5 <= last.ci_high, report.table()
    assert all(r.accuracy <= BAG_CEILING for r in mine if "gram bag" in r.heuristic), report.table()


def test_every_row_of_a_fresh_seed_passes_the_audit_and_no_place_is_named_more_often():
    """The whole set, not a sample: before, the prefixes that stop at the empty sentence gave
    "most-mentioned" 0.54 with no spread at every seed."""
    report = audit_stimuli(belief_tracking(64, seed=303), seed=303)
    mine = {r.heuristic: r for r in report.rows if r.family == FAMILY and r.contrast == CONTRAST}
    assert not [r for r in mine.values() if r.verdict == SHORTCUT], report.table()
    assert abs(mine["most-mentioned option"].accuracy - 0.5) < 0.01, report.table()


def test_a_contents_story_cut_after_its_label_names_the_keyed_word_last_in_half_the_tasks():
    """The label names its own word first ("says pins, not sweets") in one version of each task
    and last ("says not sweets but pins") in the other: before, every phrasing named the other word
    last, and "the last-mentioned option" read the answer off every contents prefix that stops
    between the label and the tellings (0.79-0.82 on seeds 101, 202 and 4242)."""
    rows = [s for s in belief_tracking(16, seed=11, family=CONTENTS) if s.prompt_type == "belief"
            and s.meta["sentence_role"] == "label"]
    assert len(rows) == 32  # 16 tasks x 2 versions, the prefix that ends with the label sentence
    keyed_last = Counter(s.task_id for s in rows if last_mentioned(s) == s.answer_index)
    assert keyed_last == {s.task_id: 1 for s in rows}, [s.text for s in rows[:2]]


def test_the_contents_variant_of_a_fresh_seed_passes_the_audit_whole():
    """Every prefix of 64 contents tasks. Seed 202 is the one whose 2-gram bag reads 0.63 by which
    option a content word happens to be listed as (0.69, 0.40 and 0.43 on seeds 101, 4242 and 7): the
    null that renames each task's classes carries that spread; the row-shuffled one confirmed it."""
    report = audit_stimuli(belief_tracking(64, seed=202, family=CONTENTS), seed=0)
    mine = {r.heuristic: r for r in report.rows if r.family == FAMILY and r.contrast == CONTRAST}
    assert len(mine) >= 12 and not [r for r in mine.values() if r.verdict == SHORTCUT], report.table()
    last = mine["last-mentioned option"]
    assert last.ci_low <= 0.5 <= last.ci_high, report.table()


def test_the_contents_variant_s_bags_average_chance_over_fresh_seeds():
    """Over 0.60 on single seeds (0.63 on 101, 0.62 on 202) is the spread of 64 tasks, not a cue:
    the keyed option's position is a coin per task, and a bag can only learn which position a
    content word happened to be listed in. Over 50 seeds, measured as here (seeds 1-20, 1000-1019, 101,
    202, ..., 909 and 4242), the 3-gram bag (story) read 0.514 with a standard deviation of 0.050 (the
    binomial spread of 64 tasks at chance is 0.0625), 3 of them over 0.60. A cue in the generator
    would move the mean, which twelve seeds pin to about +-0.015 (these twelve: 0.513, three over 0.60)."""
    bag = next(h for h in generic_battery() if h.name == "3-gram bag (story)")
    accuracies = []
    for seed in range(7000, 7012):
        rows = [s for s in belief_tracking(64, seed=seed, family=CONTENTS) if s.prompt_type == "belief"]
        labels = [s.answer_index for s in rows]
        correct = held_out_correct(bag.encode(rows), labels, task_folds([s.task_id for s in rows], 0))
        accuracies.append(float(correct.mean()))
    mean = sum(accuracies) / len(accuracies)
    assert abs(mean - 0.5) < 0.05, (mean, accuracies)
    assert max(accuracies) < 0.70, accuracies
