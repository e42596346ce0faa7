"""The probe table's baselines and controls can fail: bag of words, length, position, embeddings,
the type-level control task (scored on its own labels), the condition split and cue-held-out folds."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch
from helpers import TensorActivations

from tomlens.errors import TomlensError
from tomlens.probes import (
    add_best_baseline,
    condition_split,
    group_codes,
    group_kfold,
    leaked_groups,
    type_cells,
    type_control_labels,
)
from tomlens.probes.baselines import length_features, position_features
from tomlens.probes.controls import choose_cell_level
from tomlens.probes.sweep import COLUMNS, run_probe_sweep
from tomlens.stimuli import Span, Stimulus, generate

FAST = dict(folds=3, inner_folds=2, c_grid=(0.1, 1.0), n_boot=200, progress=False, device="cpu")


def cell_acts(stimuli, cells) -> TensorActivations:
    """One layer whose features name each row's type cell (one-hot, scaled, plus a little noise)."""
    codes = {c: i for i, c in enumerate(dict.fromkeys(cells))}
    g = torch.Generator().manual_seed(0)
    X = torch.nn.functional.one_hot(torch.tensor([codes[c] for c in cells]), len(codes)).float() * 3
    X = X + 0.1 * torch.randn(X.shape, generator=g)
    return TensorActivations(list(stimuli), {("resid_post", "final"): X.unsqueeze(1)}, {"model": {"model": "cells"}})


def noise_acts(stimuli, seed=0, d=8, resid_pre=False) -> TensorActivations:
    g = torch.Generator().manual_seed(seed)
    tensors = {("resid_post", "final"): torch.randn(len(stimuli), 2, d, generator=g)}
    if resid_pre:
        tensors[("resid_pre", "final")] = torch.randn(len(stimuli), 2, d, generator=g)
    return TensorActivations(list(stimuli), tensors, {"model": {"model": "noise"}})


def stimulus(i: int, task: int, template: str, condition: str, belief_start: bool, cue: Any = None) -> Stimulus:
    text = f"Story {task} uses template {template} in condition {condition}. Where is the ball? It is in the"
    return Stimulus(id=f"s{i}", text=text, options=("box", "bag"), answer="box", task_id=f"t{task}",
                    template_id=template, condition=condition, world_state="box",
                    protagonist_belief="box" if belief_start else "bag", reference_state="box",
                    spans={"object": Span(text.index("ball"), text.index("ball") + 4)},
                    meta={} if cue is None else {"cue_id": cue})


def cell_stimuli(n_tasks=12):
    """Tasks over 4 templates x 2 conditions (belief = condition), so each type cell recurs in many tasks."""
    out = []
    for t in range(n_tasks):
        for c, cond in enumerate(("false_belief", "true_belief")):
            out.append(stimulus(len(out), t, f"tpl{t % 4}", cond, belief_start=bool(c)))
    return out


def rows(table, **kw):
    for k, v in kw.items():
        table = table[table[k] == v]
    return table


def test_bag_of_words_length_and_position_are_at_chance_on_order_only():
    st = generate("order-only", n=12, seed=0)
    res = run_probe_sweep(noise_acts(st), "protagonist_belief", sites=("resid_post",), **FAST)
    t = res.table
    assert list(t.columns) == COLUMNS
    for features in ("bag_of_words", "length", "position"):
        r = rows(t, features=features, train_on="all", eval_set="all", metric="accuracy").iloc[0]
        assert r["kind"] == "" and r["ci_low"] <= 0.5 <= r["ci_high"], (features, r["score"])
    pos = rows(t, features="position", train_on="all", eval_set="all", metric="accuracy").iloc[0]
    act = rows(t, features="activations", train_on="all", eval_set="all", metric="accuracy")
    assert (act["baseline_position"] == pos["score"]).all()
    best = act[["baseline_bow", "baseline_length", "baseline_position"]].max(axis=1)
    assert np.allclose(act["best_baseline"], best) and np.allclose(act["above_baseline"], act["score"] - best)
    assert act["baseline_embeddings"].isna().all()
    assert "embeddings baseline not run: cache resid_pre:0" in res.metadata["notes"]
    # two conditions: the condition split cannot be anything but the label, so it is NaN with a note
    assert t["condition_split"].isna().all() and t["condition_split_ci_low"].isna().all()
    assert "the set has 2 conditions: no split other than the label itself" in res.metadata["notes"]
    # one template per task, but the leaving sentence's phrasing recurs: the control runs on cue x
    # condition cells, whose test cells occur in training, so it can fail (a number, not NaN)
    assert any("control cells are cue x condition" in n for n in res.metadata["notes"])
    a = rows(t, features="activations", train_on="all", eval_set="all", metric="accuracy")
    assert a["control"].notna().all()
    # the target is fixed by the condition here: the false-belief eval set (one class) is dropped
    assert not ((t["train_on"] == "all") & (t["eval_set"] == "false_belief")).any()
    assert any("eval set false_belief (train_on=all) dropped" in n for n in res.metadata["notes"])
    assert res.metadata["label_variation"]["protagonist_belief"][0]["varies"] is False
    assert any("protagonist_belief is fixed by the condition in every condition here" in n for n in res.metadata["notes"])


def test_bag_of_words_is_high_where_words_give_the_condition_away():
    # the old unexpected-transfer design: each condition has its own words (the text names it), and
    # belief is {false_belief, no_transfer} vs {present, informed}
    conds = {"false_belief": True, "present": False, "informed": False, "no_transfer": True}
    st = [stimulus(4 * t + c, t, f"tpl{t % 4}", cond, belief)
          for t in range(12) for c, (cond, belief) in enumerate(conds.items())]
    res = run_probe_sweep(noise_acts(st), "protagonist_belief", sites=("resid_post",), conditions=False,
                          position=False, **FAST)
    t = res.table
    bow = rows(t, features="bag_of_words", eval_set="all", metric="accuracy").iloc[0]
    assert bow["score"] > 0.9 and bow["condition_split"] > 0.9  # the words decode any split of the conditions
    act = rows(t, features="activations", eval_set="all", metric="accuracy")
    assert (act["best_baseline_name"] == "bow").all() and (act["above_baseline"] < 0).all()
    assert act["condition_split"].notna().all() and act["condition_split"].between(0, 1).all()
    assert any("condition split" in n and "|r| with the target 0.00" in n for n in res.metadata["notes"])


def test_type_level_control_is_scored_on_its_own_labels_and_can_fail():
    st = cell_stimuli()
    acts = cell_acts(st, type_cells(st))
    res = run_probe_sweep(acts, "protagonist_belief", sites=("resid_post",), bow=False, length=False,
                          position=False, conditions=False, **FAST)
    r = rows(res.table, features="activations", eval_set="all", metric="accuracy").iloc[0]
    # held-out tasks share the training tasks' cells, so features that name the cell fit its labels
    assert r["control"] > 0.9 and r["control_ci_low"] > r["control_chance"]
    assert r["control_chance"] == pytest.approx(0.5, abs=0.1)
    assert r["score"] > 0.9 and abs(r["selectivity"]) < 0.15  # the target is one more cell label
    au = rows(res.table, features="activations", eval_set="all", metric="auroc").iloc[0]
    assert au["control"] > 0.9 and au["selectivity_ci_low"] <= au["selectivity"] <= au["selectivity_ci_high"]
    # pure noise cannot fit the cells: the control is near its chance level
    noise = run_probe_sweep(noise_acts(st), "protagonist_belief", sites=("resid_post",), bow=False, length=False,
                            position=False, conditions=False, **FAST).table
    n = rows(noise, features="activations", layer=0, eval_set="all", metric="accuracy").iloc[0]
    assert n["control_ci_low"] <= 0.5 + 0.1 and n["control"] < 0.75


def test_type_control_labels_are_balanced_with_both_classes_in_every_training_split():
    st = cell_stimuli()
    cells = type_cells(st)
    folds = group_kfold(group_codes(st), 3, seed=0)
    split_rows = [(f.train.tolist(), f.test.tolist()) for f in folds]
    lab, extra = type_control_labels(cells, split_rows, seed=3, test_cells=cells[:4] + [("new", "", "x")])
    assert lab.shape == (len(st),) and extra.shape == (5,)
    for c in set(cells):  # one label per cell
        assert len({int(lab[i]) for i, ci in enumerate(cells) if ci == c}) == 1
    for f in folds:
        assert set(lab[f.train].tolist()) == {0, 1}
        assert abs(float(lab[f.train].float().mean()) - 0.5) <= 0.25
    assert torch.equal(extra[:4], lab[:4])
    assert type_control_labels([("a", "", "x")] * 5) is None


def test_condition_split_is_the_balanced_split_least_correlated_with_the_target():
    conds = ["false_belief", "present", "informed", "no_transfer"] * 6
    y = torch.tensor([1, 0, 0, 1] * 6)  # the belief label IS {false_belief, no_transfer}
    half, r = condition_split(conds, y)
    assert len(half) == 2 and r == pytest.approx(0.0)
    assert half not in ({"false_belief", "no_transfer"}, {"present", "informed"})
    assert condition_split(["a", "b"] * 4, torch.tensor([0, 1] * 4)) is None


def test_cue_grouping_never_puts_one_cue_on_both_sides():
    cues = ["away", "asleep", "garden", "back_turned", "away", ["asleep", "garden"], None, None]
    st = [stimulus(i, task=i, template="tpl", condition="false_belief", belief_start=True, cue=c)
          for i, c in enumerate(cues)]
    codes = group_codes(st, "cue")
    assert codes[0] == codes[4]  # "away" twice
    assert codes[1] == codes[5] == codes[2]  # a story with two cues joins both
    assert codes[6] != codes[7] and codes[6] not in codes[:6]  # no cue_id: grouped by task
    for seed in range(5):
        for f in group_kfold(codes, 2, seed=seed):
            assert not leaked_groups(f, codes)
            sides = [{c for i in side.tolist() for c in ([cues[i]] if isinstance(cues[i], str) else cues[i] or [])}
                     for side in (f.train, f.test)]
            assert not sides[0] & sides[1]
    res = run_probe_sweep(noise_acts(cell_stimuli()), "protagonist_belief", sites=("resid_post",),
                          group_by="cue", bow=False, length=False, position=False, conditions=False, **FAST)
    assert res.metadata["provenance"]["config"]["group_by"] == "cue" and not res.table.empty
    with pytest.raises(TomlensError, match="unknown grouping"):
        run_probe_sweep(noise_acts(st), "protagonist_belief", group_by="cues", **FAST)


def test_embeddings_baseline_and_best_baseline():
    st = generate("order-only", n=6, seed=1)
    t = run_probe_sweep(noise_acts(st, resid_pre=True), "protagonist_belief", sites=("resid_post",),
                        conditions=False, **FAST).table
    emb = rows(t, features="embeddings", metric="accuracy", eval_set="all")
    assert len(emb) == 1 and emb.iloc[0]["kind"] == "resid_pre" and emb.iloc[0]["layer"] == 0
    act = rows(t, features="activations", metric="accuracy", eval_set="all")
    assert (act["baseline_embeddings"] == emb.iloc[0]["score"]).all()
    base = t[t["features"] != "activations"]
    assert base[["baseline_bow", "best_baseline"]].isna().all().all()
    table = pd.DataFrame({"score": [0.9, 0.6, 0.7], "baseline_bow": [0.5, np.nan, np.nan],
                          "baseline_length": [0.8, 0.55, np.nan]})
    table["baseline_random_init"] = [0.6, 0.7, np.nan]
    out = add_best_baseline(table)
    assert out["best_baseline"].tolist()[:2] == [0.8, 0.7] and np.isnan(out["best_baseline"].iloc[2])
    assert out["best_baseline_name"].tolist() == ["length", "random_init", ""]
    assert out["above_baseline"].iloc[0] == pytest.approx(0.1) and np.isnan(out["above_baseline"].iloc[2])
    assert "best_baseline" not in table  # a copy


def test_length_and_position_features():
    st = generate("order-only", n=2, seed=0)
    L = length_features(st)
    assert L.shape == (len(st), 2) and torch.allclose(L.mean(0), torch.zeros(2), atol=1e-5)
    final = position_features(st, "final")
    assert final.shape == (len(st), 2)
    # the same sentences in another order: the final token sits at the same place in both versions
    at = {(s.task_id, s.prompt_type, s.condition): final[i].tolist() for i, s in enumerate(st)}
    assert all(v == at[(t, p, "true_belief")] for (t, p, c), v in at.items() if c == "false_belief")
    # a role position moves with the sentence that holds it: the mover's second mention (in the
    # moving sentence) comes later in a false-belief story, where the protagonist leaves first
    raw = position_features(st, "other_agent@2", reference=st[:1] * 2)
    moved = {(s.task_id, s.prompt_type, s.condition): float(raw[i, 0]) for i, s in enumerate(st)}
    pairs = [(v, moved[(t, p, "true_belief")]) for (t, p, c), v in moved.items() if c == "false_belief"]
    assert pairs and all(fb != tb for fb, tb in pairs)


@pytest.mark.parametrize("family,n", [("order-only", 12), ("false-belief-factorial", 24)])
def test_type_control_runs_on_recurring_cells_and_can_fail_where_templates_are_tasks(family, n):
    # one template per task: the template cells never recur, the cue x condition cells do (the
    # factorial has 10 cue phrasings: with 12 tasks most are seen in one fold only)
    st = generate(family, n=n, seed=0)
    level, share = choose_cell_level(st, None, [(f.train.tolist(), f.test.tolist())
                                                for f in group_kfold(group_codes(st), 3, seed=0)])
    assert level == "cue_condition" and share >= 0.5
    acts = cell_acts(st, type_cells(st, level))
    res = run_probe_sweep(acts, "protagonist_belief", sites=("resid_post",), bow=False, length=False,
                          position=False, **FAST)
    r = rows(res.table, features="activations", train_on="all", eval_set="all", metric="accuracy").iloc[0]
    # features naming the cells fit the control on every seen cell (unseen ones are a coin flip)
    assert r["control"] > min(0.9, 0.45 + share / 2) and r["control_ci_low"] > r["control_chance"] + 0.15
    assert any("control cells are cue x condition" in n for n in res.metadata["notes"])
    # true -> false-belief transfer: cells differ in condition, so the control cannot fail: NaN, not 0.5
    tr = rows(res.table, features="activations", train_on="true_belief")
    assert tr.empty or tr[["control", "control_ci_low", "selectivity", "selectivity_ci_high"]].isna().all().all()


def test_controls_without_recurring_cells_are_withheld_and_cue_grouping_without_cues_says_so():
    # every task its own template and no cue_id: no level recurs, so the control is NaN with a note
    st = [stimulus(2 * t + c, t, f"own{t}", cond, belief_start=bool(c))
          for t in range(9) for c, cond in enumerate(("false_belief", "true_belief"))]
    res = run_probe_sweep(noise_acts(st), "protagonist_belief", sites=("resid_post",), group_by="cue",
                          bow=False, length=False, position=False, conditions=False, **FAST)
    act = rows(res.table, features="activations")
    assert act["control"].isna().all() and act["selectivity_ci_low"].isna().all()
    assert any("control and selectivity withheld (NaN)" in n for n in res.metadata["notes"])
    assert "no stimulus has a cue_id: group_by=cue is group_by=task here" in res.metadata["notes"]
