"""The papers' aggregate rules on hand-made tables whose answers are known."""

import numpy as np
import pandas as pd
import pytest

from tomlens.behaviour import aggregates
from tomlens.errors import TomlensError


def _fb_table(task_correct: list[list[bool]]) -> pd.DataFrame:
    rows = []
    for t, prompts in enumerate(task_correct):
        for j, ok in enumerate(prompts):
            rows.append({"family": "unexpected-transfer", "task_id": f"t{t}", "id": f"t{t}-{j}",
                         "condition": "false_belief" if j < 2 else "present",
                         "prompt_type": "belief" if j % 2 else "reality", "correct": ok,
                         "p_answer": 0.9 if ok else 0.1})
    return pd.DataFrame(rows)


def test_wilson_interval_edges():
    lo, hi = aggregates.wilson_interval(0, 10)
    assert lo == pytest.approx(0.0, abs=1e-12) and 0.2 < hi < 0.35
    lo, hi = aggregates.wilson_interval(10, 10)
    assert hi == pytest.approx(1.0) and 0.65 < lo < 0.8
    lo, hi = aggregates.wilson_interval(50, 100)
    assert lo < 0.5 < hi and hi - lo == pytest.approx(0.19, abs=0.01)


def test_strict_rule_counts_only_fully_correct_tasks():
    df = _fb_table([[True] * 16, [True] * 15 + [False], [True] * 16, [False] * 16])
    s = aggregates.strict_task_pass(df).iloc[0]
    assert s.tasks == 4 and s.solved == 2 and s.fraction_solved == 0.5
    assert s.prompts_per_task == 16 and s.chance == pytest.approx(1 / 65536)


def test_accuracy_table_groups_and_intervals():
    df = _fb_table([[True, False, True, True]] * 5)
    acc = aggregates.accuracy_table(df)
    fb_belief = acc[(acc.condition == "false_belief") & (acc.prompt_type == "belief")].iloc[0]
    assert fb_belief.n == 5 and fb_belief.n_tasks == 5 and fb_belief.accuracy == 0.0
    assert fb_belief.ci_low == 0.0 and fb_belief.ci_high == 0.0  # every task wrong: no resample differs
    assert acc.accuracy.max() == 1.0


def _one_cell(correct: list[bool], copies: int = 1) -> pd.DataFrame:
    rows = [{"family": "f", "condition": "c", "prompt_type": "belief", "task_id": f"t{t}",
             "id": f"t{t}-{j}", "correct": ok, "p_answer": 0.5}
            for t, ok in enumerate(correct) for j in range(copies)]
    return pd.DataFrame(rows)


def test_task_bootstrap_is_not_narrowed_by_correlated_prompts():
    correct = [bool(x) for x in np.random.default_rng(3).random(20) < 0.6]
    once = aggregates.accuracy_table(_one_cell(correct), n_boot=2000, seed=1).iloc[0]
    # every task's prompt repeated 8 times (perfectly correlated prompts): the same interval
    dup = aggregates.accuracy_table(_one_cell(correct, copies=8), n_boot=2000, seed=1).iloc[0]
    assert dup.n == 160 and dup.n_tasks == 20 and dup.accuracy == once.accuracy
    assert (dup.ci_low, dup.ci_high) == (once.ci_low, once.ci_high)
    width = dup.ci_high - dup.ci_low
    # counting the 160 prompts as independent (Wilson, or 160 separate tasks) would be much narrower
    k = int(sum(correct)) * 8
    lo, hi = aggregates.wilson_interval(k, 160)
    indep = aggregates.accuracy_table(_one_cell(correct * 8), n_boot=2000, seed=1).iloc[0]
    assert hi - lo < 0.6 * width and indep.ci_high - indep.ci_low < 0.6 * width
    assert dup.ci_low < dup.accuracy < dup.ci_high


def test_one_task_has_no_interval_and_missing_task_ids_are_their_own_units():
    one = aggregates.accuracy_table(_one_cell([True]).assign(id="x")).iloc[0]
    assert one.n_tasks == 1 and np.isnan(one.ci_low) and np.isnan(one.ci_high)
    df = _one_cell([True, False, True, True]).assign(task_id="")
    assert aggregates.accuracy_table(df).iloc[0].n_tasks == 4
    with pytest.raises(TomlensError):
        aggregates.task_bootstrap(np.ones(3), np.ones(3), n_boot=0)


def _story_rows(task: str, condition: str, reality_ok: bool | None, belief_ok: bool, *,
                story_id: str | None = None, reversed_: bool = False) -> list[dict]:
    base = {"family": "unexpected-transfer", "task_id": task, "condition": condition,
            "reversed": reversed_, "p_answer": 0.5, "story_id": story_id}
    rows = [{**base, "id": f"{task}-{condition}-{reversed_}-belief", "prompt_type": "belief",
             "correct": belief_ok}]
    if reality_ok is not None:
        rows.append({**base, "id": f"{task}-{condition}-{reversed_}-reality", "prompt_type": "reality",
                     "correct": reality_ok})
    return rows


def test_reality_gating_drops_exactly_the_stories_with_a_wrong_reality_answer():
    rows = (_story_rows("t0", "false_belief", True, True) + _story_rows("t0", "false_belief", False, True,
                                                                         reversed_=True)
            + _story_rows("t1", "false_belief", True, False) + _story_rows("t1", "false_belief", True, True,
                                                                            reversed_=True)
            + _story_rows("t2", "false_belief", False, False) + _story_rows("t2", "false_belief", None, True,
                                                                             reversed_=True)
            + _story_rows("t0", "present", True, True) + _story_rows("t1", "present", False, False))
    df = pd.DataFrame(rows)
    # a sentence-prefix row (belief tracking) is a curve point, never gated
    df = pd.concat([df.assign(prefix_index=np.nan), pd.DataFrame([{
        **rows[0], "id": "prefix", "prefix_index": 2.0, "correct": False}])], ignore_index=True)
    gated = aggregates.reality_gated_accuracy(df, n_boot=200).set_index("condition")
    fb = gated.loc["false_belief"]
    # kept: t0 (right), t1 (wrong), t1-rev (right); dropped: t0-rev, t2; t2-rev has no reality prompt
    assert (fb.n_belief, fb.n_kept, fb.n_dropped, fb.n_unmatched, fb.n_tasks) == (5, 3, 2, 1, 2)
    assert fb.accuracy == pytest.approx(2 / 3)
    assert fb.joint_accuracy == pytest.approx(2 / 5) and fb.ungated_accuracy == pytest.approx(3 / 5)
    pr = gated.loc["present"]
    assert (pr.n_kept, pr.n_dropped, pr.accuracy, pr.joint_accuracy) == (1, 1, 1.0, 0.5)
    assert np.isnan(pr.ci_low)  # one kept task: no interval
    per_task = aggregates.reality_gated_accuracy(df, by=("family", "task_id", "condition"), n_boot=50)
    assert per_task.set_index(["task_id", "condition"]).loc[("t2", "false_belief")].n_kept == 0


def test_reality_gating_matches_stories_by_story_id_when_present():
    # two belief prompts (e.g. implicit and explicit cue) share one story and its reality prompt
    rows = _story_rows("t0", "false_belief", False, True, story_id="s0")
    rows += [{**rows[0], "id": "t0-explicit", "correct": True}]
    rows += _story_rows("t1", "false_belief", True, True, story_id="s1")
    rows += [{**rows[-2], "id": "t1-explicit", "correct": False}]
    g = aggregates.reality_gated_accuracy(pd.DataFrame(rows), n_boot=50).iloc[0]
    assert (g.n_belief, g.n_kept, g.n_dropped, g.accuracy) == (4, 2, 2, 0.5)


def _effect_rows(task: str, condition: str, start: str, other: str, lp_start: float, lp_other: float, *,
                 answer: str, start_first: bool = True, reversed_: bool = False, **meta) -> dict:
    a, b = (start, other) if start_first else (other, start)
    la, lb = (lp_start, lp_other) if start_first else (lp_other, lp_start)
    return {"family": meta.pop("family", "unexpected-transfer"), "task_id": task, "id": f"{task}-{condition}-{reversed_}",
            "condition": condition, "reversed": reversed_, "prompt_type": "belief",
            "option_a": a, "option_b": b, "logp_a": la, "logp_b": lb, "answer": answer, **meta}


def test_knowledge_state_effect_equals_the_hand_computed_paired_difference():
    rows = [
        # task t0, original version: start = drawer; FB log-odds -1 - (-3) = 2; present: -2 - (-1) = -1
        _effect_rows("t0", "false_belief", "drawer", "box", -1.0, -3.0, answer="drawer"),
        _effect_rows("t0", "present", "drawer", "box", -2.0, -1.0, answer="box", start_first=False),
        _effect_rows("t0", "no_transfer", "drawer", "box", -0.5, -4.0, answer="drawer"),  # no contrast
        # t0 reversed: start = box; FB 0.5; present -0.5
        _effect_rows("t0", "false_belief", "box", "drawer", -2.0, -2.5, answer="box", reversed_=True),
        _effect_rows("t0", "present", "box", "drawer", -3.0, -2.5, answer="drawer", reversed_=True),
        # t1: FB -1 (wrong way), present 0 -> difference -1
        _effect_rows("t1", "false_belief", "cup", "jar", -2.0, -1.0, answer="cup", start_first=False),
        _effect_rows("t1", "present", "cup", "jar", -1.5, -1.5, answer="jar"),
        _effect_rows("t1", "present", "cup", "jar", -9.0, -9.0, answer="jar", reversed_=True),  # no FB partner
    ]
    df = pd.DataFrame(rows)
    eff = aggregates.knowledge_state_effect(df, n_boot=500)
    assert list(eff.contrast) == ["present"]  # no_transfer asks for the start answer too: left out
    r = eff.iloc[0]
    # pairs: t0 3, t0-rev 1, t1 -1 -> mean 1; tasks: t0 mean 2 > 0, t1 -1
    assert (r.n_pairs, r.n_tasks) == (3, 2)
    assert r.effect == pytest.approx(1.0) and r.share_tasks_positive == 0.5
    assert r.logodds_false_belief == pytest.approx((2 + 0.5 - 1) / 3)
    assert r.logodds_true_belief == pytest.approx((-1 - 0.5 + 0) / 3)
    assert r.ci_low <= r.effect <= r.ci_high
    # the bootstrap resamples whole tasks: t0 alone (3 + 1) / 2 = 2, t1 alone -1
    assert r.ci_low == pytest.approx(-1.0) and r.ci_high == pytest.approx(2.0)


def test_knowledge_state_effect_pairs_factorial_versions_on_their_factors():
    fam = "false-belief-factorial"
    rows = []
    for first, fb_lo, tb_lo in (("start", 3.0, 1.0), ("end", 1.0, -2.0)):
        meta = {"family": fam, "first_mention": first, "recent_mention": "end", "knowledge_cue": "explicit",
                "knowledge_state": None}
        rows.append(_effect_rows("f0", "false_belief", "shelf", "bin", fb_lo, 0.0, answer="shelf",
                                 **dict(meta, knowledge_state="false_belief")))
        rows.append(_effect_rows("f0", "true_belief", "shelf", "bin", tb_lo, 0.0, answer="bin",
                                 **dict(meta, knowledge_state="true_belief")))
    rows = [{**r, "id": f"{r['id']}-{r['first_mention']}"} for r in rows]
    r = aggregates.knowledge_state_effect(pd.DataFrame(rows), n_boot=50).iloc[0]
    # pairs on first_mention: (3 - 1) and (1 - -2); never 3 - -2 or 1 - 1
    assert (r.family, r.contrast, r.n_pairs, r.n_tasks) == (fam, "true_belief", 2, 1)
    assert r.effect == pytest.approx(2.5) and np.isnan(r.ci_low)


def test_tost_equivalence():
    rng = np.random.default_rng(0)
    a, b = rng.normal(0.5, 0.05, 400), rng.normal(0.5, 0.05, 400)
    eq = aggregates.equivalence_test(a, b, margin=0.05)
    assert eq.equivalent and eq.p < 0.05 and -0.05 < eq.low < eq.diff < eq.high < 0.05
    shifted = aggregates.equivalence_test(a + 0.08, b, margin=0.05)
    assert not shifted.equivalent and shifted.p > 0.5
    few = aggregates.equivalence_test(a[:3], b[:3], margin=0.05)  # same distribution, too few items
    assert not few.equivalent and (few.low < -0.05 or few.high > 0.05)
    # TOST p equals the larger one-sided t-test p-value, and the 90% interval matches p < 0.05
    from scipy import stats
    d = a[:30] - b[:30]
    eq30 = aggregates.equivalence_test(a[:30], b[:30], margin=0.02)
    lower = stats.ttest_1samp(d, -0.02, alternative="greater").pvalue
    upper = stats.ttest_1samp(d, 0.02, alternative="less").pvalue
    assert eq30.p == pytest.approx(max(lower, upper))
    assert eq30.equivalent == (-0.02 < eq30.low and eq30.high < 0.02)
    assert not aggregates.equivalence_test(a[:1], b[:1], margin=0.1).equivalent
    with pytest.raises(TomlensError):
        aggregates.equivalence_test(a, b, margin=0.0)


def _goal_table(o_b: dict[str, float], n: int = 30, seed: int = 0, k: int = 6,
                mass: float | None = None) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    rows = []
    for case, mean in o_b.items():
        for i in range(n):
            p_obj = float(np.clip(mean + rng.normal(0, 0.05), 0.01, 0.99))
            obj_first = i % 2 == 0
            rows.append({"prompt_type": "goal", "test_case": case, "k": k, "target_type": "pillar",
                         "anim_denotation": False, "object_target": "second", "task_id": f"t{i}",
                         "option_a": "second" if obj_first else "first",
                         "option_b": "first" if obj_first else "second",
                         "p_a": p_obj if obj_first else 1 - p_obj,
                         **({} if mass is None else {"option_mass_first": mass, "option_mass": mass * 0.9})})
    return pd.DataFrame(rows)


def test_goal_cells_report_the_unclassified_share_and_flag_little_mass():
    """o_b is normalised over the two targets; the share on neither is reported beside it, and a
    cell whose targets get under `min_mass` of the next word is flagged."""
    means = {"animate": 0.8, "inanimate": 0.3, "control": 0.3}
    ob = aggregates.object_bias_table(_goal_table(means, mass=0.2))
    assert ob["unclassified"].tolist() == pytest.approx([0.8] * 3)
    assert ob["unclassified_whole"].tolist() == pytest.approx([0.82] * 3)
    assert ob["low_option_mass"].all()
    assert not aggregates.object_bias_table(_goal_table(means, mass=0.2), min_mass=0.1)["low_option_mass"].any()
    sel = aggregates.selective_encoding(_goal_table(means, mass=0.7)).iloc[0]
    assert sel.unclassified == pytest.approx(0.3) and not sel.low_option_mass and sel.passes
    # a table scored before option mass was recorded: nan, never a flag
    old = aggregates.object_bias_table(_goal_table(means))
    assert old["unclassified"].isna().all() and not old["low_option_mass"].any()


@pytest.mark.parametrize("o_b,near", [(0.5, True), (0.8, False)])
def test_k0_check_says_whether_unhabituated_object_bias_sits_near_one_half(o_b, near):
    df = _goal_table({"animate": o_b, "control": o_b}, k=0)
    check = aggregates.k0_check(pd.concat([df, _goal_table({"animate": 0.9}, k=3)]))
    assert set(check["test_case"]) == {"animate", "control"}  # only k = 0 rows are checked
    assert check["near_half"].tolist() == [near, near]
    assert (check["low"] <= check["o_b"]).all() and (check["o_b"] <= check["high"]).all()
    assert check["n_items"].tolist() == [30, 30]
    assert aggregates.k0_check(_goal_table({"animate": 0.5}, k=2)).empty


def test_every_table_reports_its_cells_option_mass_and_flags_little_of_it():
    rows = []
    for t in range(4):
        for cond, mass in (("false_belief", 0.9), ("true_belief", 0.1)):
            rows.append({"id": f"{t}{cond}", "family": "f", "condition": cond, "prompt_type": "belief",
                         "task_id": f"t{t}", "correct": True, "p_answer": 0.7,
                         "option_mass_first": mass, "option_mass": mass / 2})
    df = pd.DataFrame(rows)
    acc = aggregates.accuracy_table(df, n_boot=20)
    assert acc["mean_option_mass_first"].tolist() == pytest.approx([0.9, 0.1])
    assert acc["mean_option_mass"].tolist() == pytest.approx([0.45, 0.05])
    assert acc["low_option_mass"].tolist() == [False, True]
    assert aggregates.accuracy_table(df, n_boot=20, min_mass=0.05)["low_option_mass"].tolist() == [False, False]
    strict = aggregates.strict_task_pass(df)
    assert strict["mean_option_mass_first"].iloc[0] == pytest.approx(0.5) and strict["scoring"].iloc[0] == "two-way log-prob"
    with pytest.raises(TomlensError, match="share of probability"):
        aggregates.accuracy_table(df, min_mass=1.5)


def test_strict_rule_fails_a_task_with_an_unanswered_prompt():
    df = pd.DataFrame({"family": ["f"] * 4, "task_id": ["a", "a", "b", "b"],
                       "correct_first_word": [True, True, True, None]})
    strict = aggregates.strict_task_pass(df, "correct_first_word", scoring="first word")
    assert strict["solved"].tolist() == [1] and strict["scoring"].tolist() == ["first word"]


def test_object_bias_is_orientation_free():
    df = _goal_table({"animate": 0.8, "inanimate": 0.3, "control": 0.3})
    ob = aggregates.object_bias_table(df)
    got = dict(zip(ob.test_case, ob.o_b, strict=True))
    assert got["animate"] == pytest.approx(0.8, abs=0.03)
    assert got["inanimate"] == pytest.approx(0.3, abs=0.03)
    row = ob[ob.test_case == "animate"].iloc[0]
    assert row.ci_low < row.o_b < row.ci_high


@pytest.mark.parametrize("means,passes,direction", [
    ({"animate": 0.8, "inanimate": 0.3, "control": 0.3}, True, "object"),
    ({"animate": 0.8, "inanimate": 0.3, "control": 0.8}, False, "none"),  # control looks like animate
    ({"animate": 0.5, "inanimate": 0.5, "control": 0.5}, False, "none"),  # no bias anywhere
    # animate leans to the location: distinct from both, which is the paper's (two-sided) criterion,
    # but not toward the goal object
    ({"animate": 0.2, "inanimate": 0.6, "control": 0.6}, True, "location"),
    ({"animate": 0.46, "inanimate": 0.35, "control": 0.38}, True, "object"),  # a small but clear difference
    ({"animate": 0.8, "inanimate": 0.3, "control": 0.45}, False, "object"),  # inanimate and control differ
])
def test_selective_encoding_criterion_is_two_sided_and_reports_the_direction(means, passes, direction):
    sel = aggregates.selective_encoding(_goal_table(means))
    assert len(sel) == 1
    row = sel.iloc[0]
    assert bool(row.passes) is passes and row.direction == direction
    assert bool(row.animate_distinct) is (direction != "none")
    assert bool(row.passes_object_bias) is (passes and direction == "object")


def test_selective_encoding_needs_equivalence_shown_not_a_point_margin():
    means = {"animate": 0.8, "inanimate": 0.3, "control": 0.3}
    many = aggregates.selective_encoding(_goal_table(means, n=30)).iloc[0]
    assert many.inanimate_equals_control and many.equivalence_p < 0.05 and many.n_items == 30
    assert -0.1 < many.equivalence_low < many.equivalence_high < 0.1
    # three items: the point difference is inside the margin, but equivalence is not shown
    few = aggregates.selective_encoding(_goal_table(means, n=3, seed=4)).iloc[0]
    assert abs(few.o_inanimate - few.o_control) < 0.1
    assert not few.inanimate_equals_control and not few.passes and few.equivalence_p >= 0.05


def test_prefix_curves_track_the_reference_answer():
    rows = []
    for step, p_ref in enumerate([0.5, 0.9, 0.95]):
        rows.append({"family": "unexpected-transfer", "condition": "false_belief", "id": f"x{step}",
                     "prompt_type": "belief", "prefix_index": step, "option_a": "drawer",
                     "option_b": "box", "reference_state": "box", "p_a": 1 - p_ref,
                     "p_answer": p_ref})
    curves = aggregates.prefix_curves(pd.DataFrame(rows))
    assert curves.p_reference.tolist() == pytest.approx([0.5, 0.9, 0.95])


def test_knowledge_state_effect_skips_true_false_statements():
    """A model that always answers "true" on belief statements must not show a knowledge-state
    effect: "true"/"false" is no start answer, and the statements of a task are unrelated."""
    from tomlens.stimuli import generate

    rows = []
    for s in generate("belief-statements", n=8, seed=0):
        a, b = s.options
        rows.append({"family": s.family, "task_id": s.task_id, "id": s.id, "condition": s.condition,
                     "reversed": s.reversed, "prompt_type": s.prompt_type, "option_a": a, "option_b": b,
                     "logp_a": 0.0 if a == "true" else -5.0, "logp_b": 0.0 if b == "true" else -5.0,
                     "answer": s.answer, "protagonist_belief": s.protagonist_belief,
                     "world_state": s.world_state, "reference_state": s.reference_state})
    df = pd.DataFrame(rows)
    assert aggregates.knowledge_state_effect(df, n_boot=50).empty
    # the same rows under a user family name: no reference state among the options, still none
    assert aggregates.knowledge_state_effect(df.assign(family="my-statements"), n_boot=50).empty


def test_knowledge_state_effect_keys_start_on_the_belief_and_marks_label_contrasts():
    def row(task, fam, cond, belief, ref, lp_a, lp_b, options=("drawer", "box")):
        return {"family": fam, "task_id": task, "id": f"{task}-{cond}", "condition": cond, "reversed": False,
                "prompt_type": "belief", "option_a": options[0], "option_b": options[1], "logp_a": lp_a,
                "logp_b": lp_b, "answer": belief, "protagonist_belief": belief, "world_state": None,
                "reference_state": ref}
    tr, co = "unexpected-transfer", "unexpected-contents"
    rows = [
        # transfer t0: FB log-odds of drawer 2, present -1 -> 3; t1: FB 1, present 0.5 -> 0.5
        row("t0", tr, "false_belief", "drawer", "drawer", -1.0, -3.0),
        row("t0", tr, "present", "box", "drawer", -2.0, -1.0),
        row("t1", tr, "false_belief", "drawer", "drawer", -1.0, -2.0),
        row("t1", tr, "present", "box", "drawer", -1.0, -1.5),
        # a statement-like row in the same task with other options is never paired with the FB row
        row("t1", tr, "present", "cup", "cup", -9.0, 0.0, options=("cup", "jar")),
        # contents c0: the label says rocks (FB start); correct label names the contents bolts
        row("c0", co, "false_belief", "rocks", "rocks", -1.0, -2.0, options=("rocks", "bolts")),
        row("c0", co, "correct_label", "bolts", "bolts", -3.0, -1.0, options=("rocks", "bolts")),
        row("c0", co, "open_container", "bolts", "rocks", -2.0, -1.0, options=("rocks", "bolts")),
    ]
    eff = aggregates.knowledge_state_effect(pd.DataFrame(rows), n_boot=200).set_index(["family", "contrast"])
    present = eff.loc[(tr, "present")]
    assert (present.contrast_kind, present.n_pairs, present.n_tasks) == ("knowledge", 2, 2)
    assert present.effect == pytest.approx((3 + 0.5) / 2) and not present.few_tasks
    assert present.ci_low == pytest.approx(0.5) and present.ci_high == pytest.approx(3.0)
    label = eff.loc[(co, "correct_label")]
    assert label.contrast_kind == "label" and label.effect == pytest.approx(1 - (-2))
    opened = eff.loc[(co, "open_container")]
    assert opened.contrast_kind == "knowledge" and opened.effect == pytest.approx(1 - (-1))
    # one task: no interval, marked
    assert label.few_tasks and np.isnan(label.ci_low) and np.isnan(label.ci_high)


def test_describe_never_shows_a_one_task_or_zero_width_effect_as_a_finding():
    from tomlens.runs.behaviour import format_knowledge_state

    eff = pd.DataFrame([
        {"family": "unexpected-transfer", "contrast": "present", "contrast_kind": "knowledge", "n_pairs": 4,
         "n_tasks": 1, "effect": -1.375, "ci_low": float("nan"), "ci_high": float("nan"), "few_tasks": True,
         "share_tasks_positive": 0.0, "logodds_false_belief": 0.0, "logodds_true_belief": 1.0},
        {"family": "order-only", "contrast": "true_belief", "contrast_kind": "knowledge", "n_pairs": 8,
         "n_tasks": 8, "effect": -1.0, "ci_low": -1.0, "ci_high": -1.0, "few_tasks": False,
         "share_tasks_positive": 0.0, "logodds_false_belief": 0.0, "logodds_true_belief": 1.0},
    ])
    text = format_knowledge_state(eff).splitlines()
    assert "n tasks too few" in text[1] and "[" not in text[1]
    assert text[2].rstrip().endswith("of tasks") and "[-1, -1] *" in text[2]
    assert "not evidence of an effect" in text[-1]
