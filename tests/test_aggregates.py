"""The papers' aggregate rules on hand-made tables whose answers are known."""

import numpy as np
import pandas as pd
import pytest

from tomlens.behaviour import aggregates


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
    assert fb_belief.n == 5 and fb_belief.accuracy == 0.0
    assert fb_belief.ci_low == pytest.approx(0.0, abs=1e-12) and fb_belief.ci_high < 0.5
    assert acc.accuracy.max() == 1.0


def _goal_table(o_b: dict[str, float], n: int = 30, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    rows = []
    for case, mean in o_b.items():
        for i in range(n):
            p_obj = float(np.clip(mean + rng.normal(0, 0.05), 0.01, 0.99))
            obj_first = i % 2 == 0
            rows.append({"prompt_type": "goal", "test_case": case, "k": 6, "target_type": "pillar",
                         "anim_denotation": False, "object_target": "second",
                         "option_a": "second" if obj_first else "first",
                         "option_b": "first" if obj_first else "second",
                         "p_a": p_obj if obj_first else 1 - p_obj})
    return pd.DataFrame(rows)


def test_object_bias_is_orientation_free():
    df = _goal_table({"animate": 0.8, "inanimate": 0.3, "control": 0.3})
    ob = aggregates.object_bias_table(df)
    got = dict(zip(ob.test_case, ob.o_b))
    assert got["animate"] == pytest.approx(0.8, abs=0.03)
    assert got["inanimate"] == pytest.approx(0.3, abs=0.03)
    row = ob[ob.test_case == "animate"].iloc[0]
    assert row.ci_low < row.o_b < row.ci_high


@pytest.mark.parametrize("means,expected", [
    ({"animate": 0.8, "inanimate": 0.3, "control": 0.3}, True),
    ({"animate": 0.8, "inanimate": 0.3, "control": 0.8}, False),  # control looks like animate
    ({"animate": 0.5, "inanimate": 0.5, "control": 0.5}, False),  # no bias anywhere
    ({"animate": 0.2, "inanimate": 0.6, "control": 0.6}, False),  # animate leans to the location
    ({"animate": 0.46, "inanimate": 0.35, "control": 0.38}, True),  # a small but clear difference
])
def test_selective_encoding_criterion(means, expected):
    sel = aggregates.selective_encoding(_goal_table(means))
    assert len(sel) == 1 and bool(sel.iloc[0].passes) is expected


def test_prefix_curves_track_the_reference_answer():
    rows = []
    for step, p_ref in enumerate([0.5, 0.9, 0.95]):
        rows.append({"family": "unexpected-transfer", "condition": "false_belief", "id": f"x{step}",
                     "prompt_type": "belief", "prefix_index": step, "option_a": "drawer",
                     "option_b": "box", "reference_state": "box", "p_a": 1 - p_ref,
                     "p_answer": p_ref})
    curves = aggregates.prefix_curves(pd.DataFrame(rows))
    assert curves.p_reference.tolist() == pytest.approx([0.5, 0.9, 0.95])
