"""The rule that makes a probe finding (`selection.judge`), on hand-made selection results: no model."""

from __future__ import annotations

import pytest

from tomlens.probes.selection import FOUND, WITHHELD, Estimate, SelectionResult, judge

pytestmark = pytest.mark.unit


def result(score=0.9, low=0.8, chance=0.5, baselines=None, control=None, p_max=0.001, n_perm=1000):
    return SelectionResult(target="protagonist_belief", unit={"kind": "resid_post", "layer": 1, "head": -1,
                                                              "position": "final"},
                           selection_score=0.95, evaluation=Estimate(score, low, 0.99, chance),
                           baselines=baselines or {"bag_of_words": Estimate(0.6, 0.5, 0.7, 0.5)},
                           control=control, p_max=p_max, n_perm=n_perm, n_units=12)


def test_a_unit_above_chance_baselines_control_and_null_is_found():
    v = judge(result(control=Estimate(0.55, 0.45, 0.65, 0.5)))
    assert (v.verdict, v.reason) == (FOUND, "")


@pytest.mark.parametrize("kw, words", [
    (dict(low=0.45), "does not exclude chance"),
    (dict(baselines={"length": Estimate(0.85, 0.8, 0.9, 0.5)}), "not above the best baseline (length 0.85)"),
    (dict(control=Estimate(0.82, 0.7, 0.9, 0.5)), "not above the type-level control (0.82)"),
    (dict(p_max=0.2), "p_max 0.200 >= 0.05"),
    (dict(n_perm=0), "no permutation null was run"),
    (dict(score=float("nan")), "could not be scored on the evaluation stories"),
])
def test_each_failed_condition_withholds_the_unit_and_says_why(kw, words):
    v = judge(result(**kw))
    assert v.verdict == WITHHELD and words in v.reason


def test_a_control_that_could_not_be_scored_does_not_withhold():
    assert judge(result(control=Estimate(float("nan"), float("nan"), float("nan"), 0.5))).verdict == FOUND


def test_every_failed_condition_is_said():
    v = judge(result(low=0.4, p_max=0.5))
    assert v.reason.count("; ") == 2  # chance, best baseline (0.6 > 0.4) and the null
