"""The best probe unit chosen on selection stories and reported on held-out evaluation stories: the
split never shares a task, the max-statistic permutation p means what it says, "found" needs a
held-out gain over chance and every baseline, and on random-init models the verdict is at its null."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from tomlens.probes.selection import (
    FOUND,
    WITHHELD,
    SelectionResult,
    max_statistic_null,
    select_and_evaluate,
    selection_split,
)
from tomlens.probes.splits import group_codes
from tomlens.probes.sweep import SweepConfig
from tomlens.probes.targets import make_target
from tomlens.stimuli import generate

FAST = SweepConfig(folds=3, inner_folds=2, c_grid=(0.1, 1.0), n_boot=200, progress=False)


class Planted:
    """An ActivationsLike with `[n, layer, d]` activations of one site kind."""

    def __init__(self, stimuli, X):
        self.stimuli, self.manifest, self.X = list(stimuli), {"model": {"model": "planted"}}, X

    def get(self, kind, position):
        return self.X

    def layers(self, kind):
        return list(range(self.X.shape[1]))


def _order_only(n=16, seed=0, spans=True):
    st = generate("order-only", n=n, seed=seed)
    return st if spans else [dataclasses.replace(s, spans={}, mentions={}) for s in st]


def _planted(stimuli, carrier: int | None, *, units=4, d=8, strength=3.0, seed=0):
    y, keep = make_target(stimuli, "protagonist_belief")
    assert bool(keep.all())
    X = torch.randn(len(stimuli), units, d, generator=torch.Generator().manual_seed(seed))
    if carrier is not None:
        X[:, carrier, 0] += strength * (y.float() - 0.5)
    return X, y


@pytest.mark.unit
def test_selection_and_evaluation_stories_never_share_a_task():
    st = _order_only()
    split = selection_split(st, 0.5, seed=3)
    sel = {st[i].task_id for i in split.train.tolist()}
    ev = {st[i].task_id for i in split.test.tolist()}
    assert sel and ev and not sel & ev and len(sel) == len(ev) == 8
    assert sorted(split.train.tolist() + split.test.tolist()) == list(range(len(st)))
    assert {st[i].task_id for i in selection_split(st, 0.25, seed=3).train.tolist()}.__len__() == 4
    assert selection_split(st, 0.5, seed=4).train.tolist() != split.train.tolist()  # seeded
    X, _ = _planted(st, None)
    r = select_and_evaluate(Planted(st, X), "protagonist_belief", sites=("resid_post",), position="final",
                            n_permutations=0, config=FAST)
    assert r.n_selection + r.n_evaluation == len(st) and r.n_selection == 32
    assert r.verdict == WITHHELD and "no permutation null" in r.reason


@pytest.mark.unit
def test_max_statistic_p_is_small_when_one_unit_carries_the_label_and_uniformish_when_none_does():
    st = _order_only()
    groups = group_codes(st)
    n_perm = 19
    X, y = _planted(st, carrier=2)
    observed, perm_max, how = max_statistic_null([X.transpose(0, 1).contiguous()], y, groups, folds=3,
                                                  n_permutations=n_perm, seed=0)
    assert how == "within tasks"  # order-only tasks hold both conditions
    p = (1 + int((perm_max >= observed).sum())) / (1 + n_perm)
    assert observed > 0.9 and p == 1 / (1 + n_perm)
    ps = []
    for seed in range(6):  # no unit carries the label: p spreads over (0, 1]
        X, y = _planted(st, carrier=None, seed=seed)
        observed, perm_max, _ = max_statistic_null([X.transpose(0, 1).contiguous()], y, groups, folds=3,
                                                   n_permutations=n_perm, seed=seed)
        ps.append((1 + int((perm_max >= observed).sum())) / (1 + n_perm))
    assert min(ps) > 1 / (1 + n_perm) and 0.2 < sum(ps) / len(ps) < 0.8, ps
    _, _, across = max_statistic_null([X.transpose(0, 1).contiguous()], y, torch.arange(len(st)),
                                      folds=3, n_permutations=2, seed=0)
    assert across == "across rows"  # one row per group: no pairing to keep


@pytest.mark.unit
def test_found_needs_a_held_out_gain_over_chance_baselines_and_the_null(tmp_path):
    st = _order_only(spans=False)  # words and the final token's place match across conditions by design
    X, _ = _planted(st, carrier=2, strength=4.0)
    r = select_and_evaluate(Planted(st, X), "protagonist_belief", sites=("resid_post",), position="final",
                            n_permutations=39, config=FAST)
    assert r.unit == {"kind": "resid_post", "layer": 2, "head": -1, "position": "final"}
    assert r.verdict == FOUND, r.reason
    assert r.evaluation.ci_low > max(v.score for v in r.baselines.values())
    assert {"bag_of_words", "length", "position"} <= set(r.baselines)
    assert r.baselines["bag_of_words"].ci_low <= 0.5 <= r.baselines["position"].ci_high
    assert r.p_max == 1 / 40 and r.n_units == 4 and r.control is not None
    back = SelectionResult.from_dict(json.loads(json.dumps(r.to_dict())))
    assert back == r and back.line() == r.line() and "-> found" in r.line()
    X, _ = _planted(st, carrier=None)
    null = select_and_evaluate(Planted(st, X), "protagonist_belief", sites=("resid_post",), position="final",
                               n_permutations=19, config=FAST)
    assert null.verdict == WITHHELD and "p_max" in null.reason and "withheld: " in null.line()


@pytest.mark.integration
@pytest.mark.parametrize("name", ["tiny-llama", "random:tiny-llama"])
def test_on_a_random_init_model_the_selected_unit_is_at_its_null(name, tmp_path, load_tiny):
    from tomlens.report.layers import write_probe_figures
    from tomlens.runs import probes
    from tomlens.runs.base import ModelSpec, StimuliSpec

    config = probes.ProbesConfig(
        model=ModelSpec(name=name, dtype="float32", seed=1), stimuli=StimuliSpec(family="order-only", n=12, seed=2),
        sites=("resid_post",), store=str(tmp_path / "store"), folds=3, inner_folds=2, c_grid=(0.1, 1.0), n_boot=200,
        conditions=False, n_permutations=19, random_twin=name.startswith("random:"))
    result = probes.run(config, model=load_tiny(name, seed=1), progress=False)
    r = result.selection["protagonist_belief"]
    e = r.evaluation
    assert r.verdict == WITHHELD or e.ci_low <= 0.5 <= e.ci_high, r.line()
    assert result.describe().startswith("selected unit, scored on held-out evaluation stories:")
    assert "selection-biased" in result.describe()
    assert "embeddings" in r.baselines  # resid_pre:0 is cached for it
    if config.random_twin:
        acts = result.table[result.table["features"] == "activations"]
        assert acts["baseline_random_init"].notna().all()
        assert "random_init" in r.baselines and "random:tiny-llama" in " ".join(result.metadata["notes"])
    out = result.save(tmp_path / "out")
    back = probes.ProbesResult.load(out)
    assert back.selection == result.selection and back.describe() == result.describe()
    figures = write_probe_figures(result.table, out, selection=result.selection)
    title = figures["layers_resid_post"].layout.title.text
    assert ("withheld" in title) == (r.verdict == WITHHELD)


@pytest.mark.unit
def test_selection_needs_three_tasks_and_gates_on_a_control_that_can_fail():
    st = _order_only(n=4)
    X, _ = _planted(st, carrier=2)
    few = select_and_evaluate(Planted(st, X), "protagonist_belief", sites=("resid_post",), position="final",
                              n_permutations=0, config=FAST)
    assert few.verdict == WITHHELD and "need >= 3 task groups in the selection half" in few.reason
    assert "need >= 3 task groups" in few.line()
    # features that name the cue x condition cells decode the target (fixed by condition) and the
    # control alike: the control can fail here, and it does, so the unit is withheld
    st = _order_only(spans=False)
    from tomlens.probes.controls import type_cells

    cells = type_cells(st, "cue_condition")
    codes = {c: i for i, c in enumerate(dict.fromkeys(cells))}
    X = torch.nn.functional.one_hot(torch.tensor([codes[c] for c in cells]), len(codes)).float() * 3
    X = (X + 0.1 * torch.randn(X.shape, generator=torch.Generator().manual_seed(0))).unsqueeze(1).repeat(1, 2, 1)
    r = select_and_evaluate(Planted(st, X), "protagonist_belief", sites=("resid_post",), position="final",
                            n_permutations=19, config=FAST)
    assert r.control is not None and r.control.score > 0.8 and r.control_reason == ""
    assert r.verdict == WITHHELD and "type-level control" in r.reason
    # without a cue id and with a template per task no evaluation cell recurs: the control is withheld
    bare = [dataclasses.replace(s, meta={k: v for k, v in s.meta.items() if k != "cue_id"}) for s in st]
    r = select_and_evaluate(Planted(bare, X), "protagonist_belief", sites=("resid_post",), position="final",
                            n_permutations=0, config=FAST)
    assert r.control is None and "cannot fail" in r.control_reason and "control withheld" in r.line()
    assert r.condition_split is None  # two conditions: no split other than the label


@pytest.mark.unit
def test_selection_reports_a_condition_split_where_the_set_has_three_or_more_conditions():
    st = generate("unexpected-transfer", n=8, seed=0)
    y, _ = make_target(st, "protagonist_belief")
    X = torch.randn(len(st), 2, 8, generator=torch.Generator().manual_seed(0))
    r = select_and_evaluate(Planted(st, X), "protagonist_belief", sites=("resid_post",), position="final",
                            n_permutations=0, config=FAST)
    assert r.condition_split is not None and 0 <= r.condition_split.score <= 1
    assert "condition split" in r.line()
    back = SelectionResult.from_dict(json.loads(json.dumps(r.to_dict())))
    assert back.condition_split == r.condition_split


@pytest.mark.unit
def test_too_few_permutations_say_that_no_unit_can_be_found():
    st = _order_only(n=8)
    X, _ = _planted(st, carrier=2, strength=4.0)
    r = select_and_evaluate(Planted(st, X), "protagonist_belief", sites=("resid_post",), position="final",
                            n_permutations=19, config=FAST)
    assert any("no unit can be found: use at least 20 permutations" in n for n in r.notes)
    assert r.verdict == WITHHELD and r.p_max >= 0.05
    import argparse

    from tomlens.cli.probe import register

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    register(sub)
    text = " ".join(sub.choices["probe"].format_help().split())
    assert "(default 1000;" in text and "one ridge fit per unit and fold whatever N is" in text
    assert "with N <= 19 it can never be below 0.05" in text and "--no-random-twin" in text


@pytest.mark.unit
def test_layer_figure_draws_the_selected_unit_at_its_held_out_score():
    from tomlens.probes.selection import Estimate
    from tomlens.probes.sweep import run_probe_sweep
    from tomlens.report.layers import layer_figure

    st = _order_only(n=8)
    X, _ = _planted(st, carrier=1, units=3, strength=4.0)
    table = run_probe_sweep(Planted(st, X), "protagonist_belief", sites=("resid_post",), config=FAST,
                            bow=False, length=False, position=False, conditions=False, directions=False).table
    full = float(table[(table["layer"] == 1) & (table["metric"] == "accuracy")]["score"].iloc[0])
    held = Estimate(0.61, 0.52, 0.70, 0.5)
    assert abs(full - held.score) > 0.05  # the two places differ, so the test can tell them apart
    sel = SelectionResult(target="protagonist_belief", unit={"kind": "resid_post", "layer": 1, "head": -1,
                                                             "position": "final"},
                          selection_score=full, evaluation=held)
    fig = layer_figure(table, selection={"protagonist_belief": sel})
    star = [tr for tr in fig.data if "selected unit" in (tr.name or "")]
    assert len(star) == 1 and list(star[0].y) == [0.61] and "held-out evaluation 0.61 [0.52, 0.70]" in star[0].name
    assert star[0].error_y.array[0] == pytest.approx(0.09) and star[0].error_y.arrayminus[0] == pytest.approx(0.09)
    assert not [tr for tr in layer_figure(table, metric="auroc", selection={"protagonist_belief": sel}).data
                if "selected unit" in (tr.name or "")]  # an accuracy estimate is not drawn on an AUROC axis
