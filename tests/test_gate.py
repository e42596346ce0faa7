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
    gate_message, gate_pairs, gate_table, pairs_needed, run_gate, solved_mask, split_selection,
)
from tomlens.patching.heads import layer_matched_draw, topk_settings
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
    assert "wrong sign" in r.message and "no number of pairs helps" in r.message
    assert not run_gate([0.5]).passed and "one pair" in run_gate([0.5]).message
    with pytest.raises(TomlensError, match="not finite"):
        run_gate([1.0, float("nan")])


def test_power_line_by_hand():
    # (z_0.95 + z_0.80) = 1.6449 + 0.8416 = 2.4865; (2.4865 * 1 / 0.5)^2 = 24.73 -> 25 pairs
    assert pairs_needed(0.5, 1.0) == 25
    # (2.4865 * 2 / 0.25)^2 = 395.7 -> 396
    assert pairs_needed(0.25, 2.0) == 396
    assert pairs_needed(0.0, 1.0) is None and pairs_needed(-0.2, 1.0) is None
    r = run_gate(_gaps(0.5, n=10))
    assert r.power_n == 25 and "about 25 pairs" in r.power_line and "have 10" in r.power_line


def test_gate_runs_per_contrast():
    pos, neg = _gaps(1.0, n=8, seed=1), _gaps(-1.0, n=8, seed=2)
    clean = torch.cat([pos, neg]) + 3.0
    corrupted = torch.full((16,), 3.0, dtype=torch.float64)
    contrasts = ["present"] * 8 + ["informed"] * 8
    gates = gate_pairs(clean, corrupted, contrasts)
    assert list(gates) == ["informed", "present"]
    assert gates["present"].passed and not gates["informed"].passed
    assert gates["present"].n == gates["informed"].n == 8
    table = gate_table(gates)
    assert table.passed.tolist() == [False, True] and list(table.columns[:7]) == [
        "contrast", "n", "mean", "sd", "lower", "passed", "power_n"]
    msg = gate_message(gates)
    assert "informed" in msg and "dropped" in msg and "present only" in msg
    failed = {"informed": gates["informed"]}
    assert gate_message(failed).startswith("withheld:") and "--force" in gate_message(failed)
    assert gate_message(failed, forced=True).startswith("FORCED (gate failed): ")
    with pytest.raises(TomlensError, match="one contrast per pair"):
        gate_pairs(clean, corrupted, contrasts[:3])


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
    assert len(randoms) == 3 * 200
    for k, heads in randoms:
        assert sorted(l for l, _ in heads) == sorted(l for l, _ in tops[k])
