"""Steering without a model: directions, controls, the hook arithmetic, dose choice and verdicts."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from tomlens.errors import TomlensError
from tomlens.runs.steering import (
    FOUND,
    WITHHELD,
    RandomFlips,
    SteeringConfig,
    SteeringLayer,
    choose_alpha,
    chosen_layer,
    layer_summary,
    random_quantile,
    selection_scores,
)
from tomlens.steering import (
    Direction,
    balanced_shuffle,
    edit,
    mean_difference,
    random_directions,
    row_hooks,
    shuffled_direction,
    steering_hooks,
)


def _acts(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    y = torch.tensor([0, 1] * 10)
    x = torch.randn(20, 8, generator=gen)
    x[y == 1, 0] += 3.0  # class 1 sits higher on axis 0
    return x, y, torch.arange(20) // 2  # two rows per task


def test_mean_difference_points_from_class_0_to_class_1() -> None:
    x, y, _ = _acts()
    md = mean_difference(x, y)
    assert md[0] > 2.0 and torch.allclose(md, x[y == 1].mean(0) - x[y == 0].mean(0), atol=1e-5)
    assert torch.allclose(mean_difference(x, 1 - y), -md, atol=1e-6)
    with pytest.raises(TomlensError):
        mean_difference(x, torch.zeros(20, dtype=torch.long))


def test_controls_are_norm_matched_and_distinct() -> None:
    x, y, g = _acts()
    belief = Direction("belief", "mean_difference", 3, mean_difference(x, y))
    rand = random_directions(belief, 20, seed=1)
    assert [d.name for d in rand] == [f"random:{i}" for i in range(20)]
    assert all(abs(d.norm - belief.norm) < 1e-4 and d.layer == 3 for d in rand)
    assert len({tuple(d.vector.tolist()) for d in rand}) == 20
    assert random_directions(belief, 3, seed=1)[0].vector.equal(rand[0].vector)  # deterministic
    sh = shuffled_direction(x, y, belief, seed=0)
    assert sh.name == "shuffled" and sh.source == "shuffled_labels" and abs(sh.norm - belief.norm) < 1e-4


def test_shuffled_direction_is_not_the_belief_direction_in_a_paired_design() -> None:
    """One false- and one true-belief row per task, a strong class difference: labels shuffled
    within tasks would give back +-the belief direction; the balanced shuffle gives noise."""
    gen = torch.Generator().manual_seed(0)
    n_tasks, d = 40, 128
    task = torch.randn(n_tasks, d, generator=gen) * 0.5
    signal = torch.zeros(d)
    signal[0] = 5.0
    x = torch.cat([task + signal, task])  # rows 0..39 label 1, rows 40..79 label 0
    y = torch.cat([torch.ones(n_tasks), torch.zeros(n_tasks)]).long()
    belief = Direction("belief", "mean_difference", 0, mean_difference(x, y))
    for seed in range(5):
        sh = shuffled_direction(x, y, belief, seed=seed)
        assert abs(float(sh.unit @ belief.unit)) < 0.35
    swap = torch.rand(n_tasks, generator=gen) < 0.3  # labels shuffled within tasks: some tasks swapped
    within = torch.cat([(~swap).long(), swap.long()])
    assert abs(float(torch.nn.functional.cosine_similarity(mean_difference(x, within), belief.vector, dim=0))) > 0.9


def test_balanced_shuffle_splits_each_class_evenly() -> None:
    y = torch.tensor([0, 1, 1, 0, 0, 1, 1, 1, 0, 0])
    seen = set()
    for seed in range(10):
        s = balanced_shuffle(y, seed)
        assert int(s[y == 0].sum()) == 2 and int(s[y == 1].sum()) == 3  # 5 zeros round down, 5 ones up
        seen.add(tuple(s.tolist()))
    assert len(seen) > 1


def test_add_hook_adds_alpha_v_at_the_final_column_only() -> None:
    act = torch.randn(3, 5, 4)  # left padded: column -1 is every row's last real token
    v = torch.tensor([1.0, -2.0, 0.5, 3.0])
    d = Direction("belief", "mean_difference", 1, v)
    (name, fn), = steering_hooks([d], 2.5, n_rows=3)
    assert name == "blocks.1.hook_resid_post"
    out = fn(act)
    assert torch.equal(out[:, :-1], act[:, :-1])
    assert torch.allclose(out[:, -1] - act[:, -1], 2.5 * v.expand(3, -1), atol=1e-6)
    (_, fn_all), = steering_hooks([d], -1.0, n_rows=3, positions="all")
    assert torch.allclose(fn_all(act) - act, -v.expand(3, 5, -1), atol=1e-6)
    # per-row doses: row i gets its own alpha
    (_, fn_rows), = row_hooks(1, v.expand(3, -1), torch.tensor([0.0, 1.0, -2.0]))
    delta = fn_rows(act)[:, -1] - act[:, -1]
    assert torch.allclose(delta, torch.tensor([0.0, 1.0, -2.0])[:, None] * v, atol=1e-6)


def test_steering_hooks_refuse_a_direction_that_is_not_finite() -> None:
    """Built without `steering` (which checks with the model), a NaN direction would make every
    steered answer NaN with no word said."""
    ok = Direction("belief", "mean_difference", 1, torch.ones(4))
    bad = Direction("broken", "mean_difference", 2, torch.tensor([1.0, float("nan"), 0.0, 0.0]))
    with pytest.raises(TomlensError, match="'broken' \\(layer 2\\) has NaN"):
        steering_hooks([ok, bad], 1.0, n_rows=2)
    assert len(steering_hooks([ok], 1.0, n_rows=2)) == 1


def test_project_out_leaves_no_component_and_patch_swaps_exactly_the_component() -> None:
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(4, 6, generator=gen)
    src = torch.randn(4, 6, generator=gen)
    v = torch.randn(6, generator=gen) * 7
    u = v / v.norm()
    vecs, one = v.expand(4, -1), torch.ones(4)
    gone = edit(h, vecs, one, "project_out")
    assert torch.allclose(gone @ u, torch.zeros(4), atol=1e-5)
    assert torch.allclose(gone - (gone @ u)[:, None] * u, h - (h @ u)[:, None] * u, atol=1e-5)
    assert torch.allclose(edit(h, vecs, 0 * one, "project_out"), h)
    patched = edit(h, vecs, one, "patch", src)
    assert torch.allclose(patched @ u, src @ u, atol=1e-5)  # the component is the source's
    assert torch.allclose(patched - (patched @ u)[:, None] * u, h - (h @ u)[:, None] * u, atol=1e-5)
    with pytest.raises(TomlensError):
        edit(h, vecs, one, "patch")


def _table(fb_belief: float, rand: list[float], shuffled: float) -> pd.DataFrame:
    rows = [{"direction": "belief", "source": "mean_difference", "layer": 2, "alpha": -2.0,
             "condition": c, "flip_rate": f} for c, f in [("false_belief", fb_belief), ("true_belief", 0.1),
                                                         ("reality", 0.0)]]
    rows += [{"direction": f"random:{i}", "source": "random", "layer": 2, "alpha": -2.0,
              "condition": "false_belief", "flip_rate": r} for i, r in enumerate(rand)]
    rows.append({"direction": "shuffled", "source": "shuffled_labels", "layer": 2, "alpha": -2.0,
                 "condition": "false_belief", "flip_rate": shuffled})
    return pd.DataFrame(rows)


def test_verdict_needs_the_threshold_and_to_beat_every_control() -> None:
    ok = layer_summary(_table(0.9, [0.0, 0.05, 0.1], 0.05), 2, -2.0)
    assert ok.verdict == FOUND and ok.random_max == 0.1 and ok.shuffled == 0.05
    assert ok.random_mean == pytest.approx(0.05) and ok.random_p95 == pytest.approx(0.095)
    assert ok.p_random == pytest.approx(1 / 4) and ok.n_random == 3  # none of 3 reaches 0.9: (1 + 0) / 4
    assert (ok.layer, ok.alpha, ok.flip_true_belief, ok.flip_reality) == (2, -2.0, 0.1, 0.0)
    assert ok.selection_flip is None and ok.selection_margin is None  # the run fills the selection half's numbers
    low = layer_summary(_table(0.7, [0.0], 0.0), 2, -2.0)
    assert low.verdict == WITHHELD and "< 0.80" in low.reason
    beaten = layer_summary(_table(0.9, [0.0, 0.95], 0.0), 2, -2.0)  # 95th percentile 0.9025
    assert beaten.verdict == WITHHELD
    assert "95th percentile flips 0.90 >= the belief direction's 0.90" in beaten.reason
    assert layer_summary(_table(0.9, [0.0], 0.9), 2, -2.0).verdict == WITHHELD
    above = layer_summary(_table(0.9, [0.2], 0.0), 2, -2.0, max_random_flip=0.1)
    assert above.verdict == WITHHELD and "flip 0.200 on average (> 0.10)" in above.reason
    assert layer_summary(_table(0.9, [0.1, 0.1], 0.0), 2, -2.0, max_random_flip=0.1).verdict == FOUND  # equal


def test_the_verdict_does_not_depend_on_how_many_random_directions_were_drawn() -> None:
    """One distribution of random directions (1 in 100 flips half the answers, the rest none),
    drawn 50 or 5,000 times: the verdict and the judged numbers (mean, 95th percentile) agree; the
    maximum, which the old rule bounded, is 0.0 in the first draw and 0.5 in the second."""
    def drawn(n: int) -> list[float]:
        return [0.5 if i % 100 == 99 else 0.0 for i in range(n)]

    few, many = (layer_summary(_table(1.0, drawn(n), 0.0), 2, -2.0, max_random_flip=0.1) for n in (50, 5000))
    assert few.verdict == many.verdict == FOUND
    assert few.random_p95 == many.random_p95 == 0.0
    assert few.random_mean == 0.0 and many.random_mean == pytest.approx(0.005)  # both near the true 0.005
    assert few.random_max == 0.0 and many.random_max == 0.5  # the old rule: passes 50 draws, fails 5,000
    assert few.p_random == pytest.approx(1 / 51) and many.p_random == pytest.approx(1 / 5001)
    # the organism at --seed 4242: 20 directions, the most-flipping one at 3 of 24 answers
    seed_4242 = [0.0] * 15 + [1 / 24] * 2 + [2 / 24] * 2 + [3 / 24]
    organism = layer_summary(_table(1.0, seed_4242, 0.0), 2, -2.0, max_random_flip=0.1)
    assert organism.verdict == FOUND and organism.random_max == 0.125
    assert organism.random_p95 == pytest.approx(0.0854, abs=1e-4)
    assert organism.random_mean == pytest.approx(0.01875)


def test_random_flips_summarise_rates_against_the_belief_direction() -> None:
    r = RandomFlips.of([0.0, 0.2, 0.4, 1.0], belief=0.4)
    assert r.n == 4 and r.mean == pytest.approx(0.4) and r.max == 1.0
    assert r.p95 == pytest.approx(random_quantile([0.0, 0.2, 0.4, 1.0])) == pytest.approx(0.91)
    assert r.p_value == pytest.approx(3 / 5)  # 0.4 and 1.0 flip at least as much: (1 + 2) / 5
    empty = RandomFlips.of([], belief=0.4)
    assert empty.n == 0 and all(v != v for v in (empty.mean, empty.p95, empty.max, empty.p_value))


def test_alpha_is_the_largest_false_belief_flip_with_ties_to_the_smallest_dose() -> None:
    sel = pd.DataFrame([{"direction": "belief", "condition": "false_belief", "alpha": a, "flip_rate": f}
                        for a, f in [(-4.0, 0.9), (-2.0, 0.9), (0.0, 0.0), (2.0, 0.9), (4.0, 0.5)]])
    assert choose_alpha(sel) == -2.0


def test_alpha_is_the_smallest_dose_that_reaches_min_flip_else_the_most_flipping() -> None:
    def table(rows: list[tuple[float, float]]) -> pd.DataFrame:
        return pd.DataFrame([{"direction": "belief", "condition": "false_belief", "alpha": a, "flip_rate": f}
                             for a, f in rows])

    sel = table([(-4.0, 1.0), (-2.0, 1.0), (-1.0, 0.9), (0.0, 0.0), (1.0, 0.0), (2.0, 0.85)])
    assert choose_alpha(sel, 0.8) == -1.0  # the least push that flips 80%, not the one that flips 100%
    assert choose_alpha(sel) == -2.0
    assert choose_alpha(sel, 0.95) == -2.0
    short = table([(-4.0, 0.5), (-2.0, 0.6), (-1.0, 0.1), (1.0, 0.0)])
    assert choose_alpha(short, 0.8) == -2.0  # none reaches it: the most flipping


def _with_random(rows: list[tuple[float, float, list[float]]]) -> pd.DataFrame:
    """A selection table: (alpha, belief flip, the random directions' flips) per alpha."""
    out = []
    for a, b, rand in rows:
        out.append({"direction": "belief", "source": "mean_difference", "condition": "false_belief", "alpha": a,
                    "flip_rate": b})
        out += [{"direction": f"random:{i}", "source": "random", "condition": "false_belief", "alpha": a,
                 "flip_rate": f} for i, f in enumerate(rand)]
        out.append({"direction": "belief", "source": "mean_difference", "condition": "reality", "alpha": a,
                    "flip_rate": 1.0})  # side effects do not choose the dose
    return pd.DataFrame(out)


def test_with_random_directions_the_dose_is_the_widest_margin_over_their_95th_percentile() -> None:
    twenty = [0.0] * 19
    sel = _with_random([(-4.0, 1.0, [0.9] * 20), (-2.0, 1.0, [0.3] * 20), (-1.0, 0.85, [*twenty, 0.6]),
                        (0.0, 0.0, [0.0] * 20), (1.0, 0.2, [0.0] * 20)])
    scores = selection_scores(sel)
    assert 0.0 not in scores.index
    assert scores.loc[-2.0, "margin"] == pytest.approx(0.7) and scores.loc[-1.0, "random_max"] == 0.6
    assert scores.loc[-1.0, "random_p95"] == pytest.approx(0.03) and scores.loc[-1.0, "margin"] == pytest.approx(0.82)
    assert scores.loc[-1.0, "random_mean"] == pytest.approx(0.03)
    # one random direction of twenty at 0.6 does not decide: margin 0.82 beats -2's 0.7 (over the
    # maximum it would be 0.25, and the choice would hang on whether that one direction was drawn)
    assert choose_alpha(sel, 0.8) == -1.0
    assert choose_alpha(sel, 0.9) == -2.0  # only -4 and -2 reach 0.9: -2 has the wider margin
    weak = _with_random([(-2.0, 0.6, [0.5] * 20), (-1.0, 0.4, [0.0] * 20), (1.0, 0.1, [0.0] * 20)])
    assert choose_alpha(weak, 0.8) == -1.0  # none reaches it: the widest margin of all, not the most flipping


def test_the_layer_is_the_widest_selection_margin_and_old_summaries_still_choose() -> None:
    def layer(i: int, margin: float | None, flip_max: float, reached: bool = True) -> SteeringLayer:
        return SteeringLayer(layer=i, alpha=1.0, flip_false_belief=0.5, flip_true_belief=0.0, flip_reality=0.0,
                             random_mean=0.0, random_p95=0.0, random_max=0.0, p_random=0.05, n_random=20,
                             shuffled=0.0, verdict=FOUND, reason="", selection_flip_max=flip_max,
                             selection_margin=margin, selection_reached=reached if margin is not None else None)

    assert chosen_layer([layer(2, 0.79, 1.0), layer(3, 0.88, 0.92), layer(4, 0.88, 0.95)]).layer == 3
    # a wider margin that never reached min_flip on the selection half would only fail on the evaluation half
    assert chosen_layer([layer(2, 0.79, 0.79, reached=False), layer(3, 0.75, 0.95)]).layer == 3
    assert chosen_layer([layer(2, 0.5, 0.5, False), layer(3, 0.3, 0.6, False)]).layer == 2  # none reached
    assert chosen_layer([layer(2, None, 1.0), layer(3, None, 0.92)]).layer == 2  # before random ran there


def test_config_rejects_bad_settings() -> None:
    for bad in ({"mode": "nudge"}, {"alphas": (0.0,)}, {"select_fraction": 1.0}, {"n_random": 0},
                {"method": "pca"}, {"positions": "first"}):
        with pytest.raises(TomlensError):
            SteeringConfig(**bad)
