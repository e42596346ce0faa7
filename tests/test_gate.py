"""The gate before any head ranking (one-sided paired lower bound per contrast, power line), the
selection / evaluation split by task, and layer-matched random head sets: pure numbers, no model."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from scipy.stats import t as student_t

from tomlens.errors import TomlensError
from tomlens.patching.gate import (
    gate_message,
    gate_pairs,
    gate_table,
    pairs_needed,
    run_gate,
    solved_mask,
    split_selection,
)
from tomlens.patching.heads import layer_matched_draw, layer_matched_sets, n_layer_matched, topk_settings
from tomlens.patching.metric import gap_is_unstable


def _gaps(mean: float, n: int = 20, seed: int = 0) -> torch.Tensor:
    """n gaps with exactly `mean` and SD 1."""
    g = torch.from_numpy(np.random.default_rng(seed).normal(size=n))
    return (g - g.mean()) / g.std() + mean


def test_positive_gap_passes_with_the_t_lower_bound_by_hand():
    g = _gaps(1.0)
    r = run_gate(g, "present")
    lower = 1.0 - student_t.ppf(0.95, 19) * 1.0 / math.sqrt(20)
    assert r.passed and r.n == 20 and r.mean == pytest.approx(1.0) and r.sd == pytest.approx(1.0)
    assert r.lower == pytest.approx(lower) and r.lower > 0
    assert "passes" in r.message and "power" in r.message


def test_zero_mean_and_negative_gaps_fail_even_when_the_old_check_lets_them_through():
    assert not run_gate(_gaps(0.0)).passed
    assert not run_gate(_gaps(0.3, n=10)).passed  # positive but lower bound below 0
    neg = _gaps(-1.0)
    assert not gap_is_unstable(neg)  # significantly negative: the old two-SE check passes it
    r = run_gate(neg, "present")
    assert not r.passed and r.lower < 0 and r.power_n is None
    assert "wrong sign" in r.message and "no number of tasks helps" in r.message
    assert not run_gate([0.5]).passed and "one task" in run_gate([0.5]).message
    with pytest.raises(TomlensError, match="not finite"):
        run_gate([1.0, float("nan")])


def test_power_line_by_hand():
    # (z_0.95 + z_0.80) = 1.6449 + 0.8416 = 2.4865; (2.4865 * 1 / 0.5)^2 = 24.73 -> 25 pairs
    assert pairs_needed(0.5, 1.0) == 25
    # (2.4865 * 2 / 0.25)^2 = 395.7 -> 396
    assert pairs_needed(0.25, 2.0) == 396
    assert pairs_needed(0.0, 1.0) is None and pairs_needed(-0.2, 1.0) is None
    r = run_gate(_gaps(0.5, n=10))
    assert r.power_n == 25 and "about 25 tasks" in r.power_line and "have 10" in r.power_line


def test_gate_runs_per_contrast():
    pos, neg = _gaps(1.0, n=8, seed=1), _gaps(-1.0, n=8, seed=2)
    clean = torch.cat([pos, neg]) + 3.0
    corrupted = torch.full((16,), 3.0, dtype=torch.float64)
    contrasts = ["present"] * 8 + ["informed"] * 8
    gates = gate_pairs(clean, corrupted, contrasts)
    assert list(gates) == ["informed", "present"] and gates["present"].n_pairs == 8
    assert gates["present"].passed and not gates["informed"].passed
    assert gates["present"].n == gates["informed"].n == 8
    table = gate_table(gates)
    assert table.passed.tolist() == [False, True] and list(table.columns[:7]) == [
        "contrast", "n", "mean", "sd", "lower", "passed", "power_n"]
    msg = gate_message(gates)
    assert "informed" in msg and "dropped" in msg and "present only" in msg
    failed = {"informed": gates["informed"]}
    assert gate_message(failed).startswith("withheld:") and "--force" in gate_message(failed)
    assert "--solved-only" not in gate_message(failed)  # solved pairs have a positive gap by construction
    assert gate_message(failed, forced=True).startswith("FORCED (gate failed): ")
    with pytest.raises(TomlensError, match="one contrast per pair"):
        gate_pairs(clean, corrupted, contrasts[:3])


def test_pairs_of_one_task_are_averaged_and_duplicating_pairs_does_not_narrow_the_bound():
    gap = _gaps(0.4, n=6, seed=3)
    tasks = [f"t{i}" for i in range(6)]
    one = gate_pairs(gap, torch.zeros(6), ["present"] * 6, task_ids=tasks)["present"]
    # every pair twice (a normal and a reversed version of each task): the same tasks, the same bound
    twice = gate_pairs(torch.cat([gap, gap]), torch.zeros(12), ["present"] * 12, task_ids=tasks + tasks)["present"]
    assert twice.n == one.n == 6 and twice.n_pairs == 12
    assert twice.lower == pytest.approx(one.lower) and twice.mean == pytest.approx(one.mean)
    naive = gate_pairs(torch.cat([gap, gap]), torch.zeros(12), ["present"] * 12)["present"]  # pairs as units
    assert naive.n == 12 and naive.lower > one.lower  # what counting pairs would have claimed
    # two pairs of a task are one unit at their mean; a pair without a task id is its own task
    g = gate_pairs(torch.tensor([1.0, 3.0, 2.0, 5.0]), torch.zeros(4), ["c"] * 4, task_ids=["a", "a", None, ""])["c"]
    assert g.n == 3 and g.n_pairs == 4 and g.mean == pytest.approx((2.0 + 2.0 + 5.0) / 3)
    assert "n = 3 tasks, 4 pairs" in g.message
    table = gate_table({"c": g})
    assert table.n.tolist() == [3] and table.n_pairs.tolist() == [4]
    with pytest.raises(TomlensError, match="task id"):
        gate_pairs(torch.ones(4), torch.zeros(4), ["c"] * 4, task_ids=["a"])


def test_solved_mask():
    clean = torch.tensor([1.0, -1.0, 2.0, 0.5])
    corrupted = torch.tensor([-1.0, -1.0, 1.0, -0.1])
    assert solved_mask(clean, corrupted).tolist() == [True, False, False, True]


def _pair(i: int, task: str):
    return SimpleNamespace(id=f"p{i}", clean=SimpleNamespace(task_id=task))


def test_selection_and_evaluation_pairs_never_share_a_task():
    pairs = [_pair(i, f"t{i // 4}") for i in range(40)]  # 10 tasks x 4 pairs
    for seed in range(5):
        sel, ev = split_selection(pairs, 0.5, seed)
        assert sorted(sel + ev) == list(range(40))
        assert not {pairs[i].clean.task_id for i in sel} & {pairs[i].clean.task_id for i in ev}
        assert len(sel) == len(ev) == 20
    assert split_selection(pairs, 0.5, 0) == split_selection(pairs, 0.5, 0)  # seeded
    assert split_selection(pairs, 0.5, 0) != split_selection(pairs, 0.5, 1)
    sel, ev = split_selection(pairs, 0.3, 0)
    assert len(sel) == 12  # 3 of 10 tasks
    assert split_selection(pairs[:3], 0.5, 0) is None  # too few pairs
    assert split_selection(pairs[:4], 0.5, 0) is None  # one task only
    no_task = [_pair(i, "") for i in range(4)]  # a pair without a task id is its own group
    sel, ev = split_selection(no_task, 0.5, 0)
    assert len(sel) == len(ev) == 2
    with pytest.raises(TomlensError, match="between 0 and 1"):
        split_selection(pairs, 1.0, 0)


MODEL = SimpleNamespace(cfg=SimpleNamespace(n_layers=4, n_heads=3))


def test_random_head_sets_have_exactly_the_top_sets_layers():
    gen = np.random.default_rng(0)
    top = [(2, 1), (0, 0), (3, 2), (1, 1)]
    for _ in range(50):
        draw = layer_matched_draw(MODEL, top, gen)
        assert sorted(l for l, _ in draw) == sorted(l for l, _ in top)
        assert len(set(draw)) == len(draw)
        assert not set(draw) & set(top)  # every layer here has enough other heads
    full = [(1, 0), (1, 1), (1, 2)]  # layer 1 has no other heads: the draw is the same set
    assert sorted(layer_matched_draw(MODEL, full, gen)) == full
    two = [(1, 0), (1, 1)]  # one other head in layer 1: it, then one of the top heads
    for _ in range(20):
        d = layer_matched_draw(MODEL, two, gen)
        assert (1, 2) in d and len(set(d)) == 2 and {l for l, _ in d} == {1}
    ranking = [(3, 0), (0, 1), (3, 2), (1, 1), (2, 2)]
    settings = topk_settings(MODEL, ranking, [1, 3, 5], 200, seed=4)
    tops = {k: h for sel, k, _, h in settings if sel == "top"}
    randoms = [(k, h) for sel, k, _, h in settings if sel == "random"]
    # 3 heads a layer: k = 1 has 2 other heads in layer 3; k = 3: layer 0 has 2 others, layer 3 (two top
    # heads) its one other head plus one of the two = 2 x 2 = 4; k = 5: layers 1 and 2 add 2 each = 16.
    # All of them, each once: an exact null
    assert [n_layer_matched(MODEL, tops[k]) for k in (1, 3, 5)] == [2, 4, 16]
    assert [sum(1 for k2, _ in randoms if k2 == k) for k in (1, 3, 5)] == [2, 4, 16]
    for k in (1, 3, 5):
        assert len({frozenset(h) for k2, h in randoms if k2 == k}) == n_layer_matched(MODEL, tops[k])
    for k, heads in randoms:
        assert sorted(l for l, _ in heads) == sorted(l for l, _ in tops[k])


def test_few_layer_matched_sets_are_enumerated_and_many_drawn_without_replacement():
    """9 heads a layer, k = 1: 8 other heads, so 8 distinct sets, each patched once; the p of a top head
    that beats them all is then 1/9 (not 1/201 from 200 draws with replacement)."""
    nine = SimpleNamespace(cfg=SimpleNamespace(n_layers=2, n_heads=9))
    gen = np.random.default_rng(0)
    sets = layer_matched_sets(nine, [(1, 4)], 200, gen)
    assert sorted(sets) == [[(1, h)] for h in range(9) if h != 4]
    hits = 0  # the top set beats every one: (1 + 0) / (1 + 8)
    assert (1 + hits) / (1 + len(sets)) == pytest.approx(1 / 9)
    big = [(0, 0), (0, 1), (1, 0), (1, 1)]  # C(7,2)^2 = 441 sets: 50 drawn, all distinct
    assert n_layer_matched(nine, big) == 441
    drawn = layer_matched_sets(nine, big, 50, gen)
    assert len(drawn) == 50 and len({frozenset(d) for d in drawn}) == 50
    assert all(sorted(l for l, _ in d) == [0, 0, 1, 1] and not set(d) & set(big) for d in drawn)
    middle = layer_matched_sets(nine, big, 200, gen)  # 441 <= 4 x 200: picked from the enumeration
    assert len(middle) == 200 and len({frozenset(d) for d in middle}) == 200
