"""The gate / withhold / force decision (`tomlens.patching.gate.decide`) as a pure function: stand-in
pairs and logit differences, no model."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tomlens.patching.gate import FORCED_PREFIX, GateDecision, decide, gate_pairs

pytestmark = pytest.mark.unit


def _pairs(n_tasks: int, per_task: int = 2) -> list[SimpleNamespace]:
    """`per_task` pairs of contrast "present" for each of `n_tasks` tasks."""
    return [SimpleNamespace(id=f"t{t}p{i}", contrast="present", clean=SimpleNamespace(task_id=f"t{t}"))
            for t in range(n_tasks) for i in range(per_task)]


def _decide(pairs, clean, corrupted, **kw) -> GateDecision:
    clean, corrupted = torch.tensor(clean, dtype=torch.float64), torch.tensor(corrupted, dtype=torch.float64)
    gates = gate_pairs(clean, corrupted, [p.contrast for p in pairs], task_ids=[p.clean.task_id for p in pairs])
    return decide(gates, clean, corrupted, pairs, **kw)


def test_a_clear_gap_passes_and_splits_by_task():
    pairs = _pairs(6)
    clean = [2.0 + 0.1 * i for i in range(12)]
    d = _decide(pairs, clean, [-1.0] * 12)
    assert d.verdict == "passed" and not d.forced and d.reason is None and d.forced_message is None
    assert d.passed == ("present",) and d.gated == d.kept == tuple(range(12)) and d.split is not None
    selection, evaluation = d.split
    tasks = [{pairs[i].clean.task_id for i in half} for half in d.split]
    assert selection and evaluation and not tasks[0] & tasks[1]  # no task on both sides
    assert d.half_gaps["selection"] > 0 and d.half_gaps["evaluation"] > 0


def test_a_failed_gate_is_withheld_unless_forced():
    pairs = _pairs(6)
    clean, corrupted = [0.0] * 12, [1.0] * 12  # the wrong sign everywhere
    d = _decide(pairs, clean, corrupted)
    assert d.verdict == "withheld" and d.withheld and d.reason == d.message and d.reason.startswith("withheld: ")
    assert d.gated == () and d.split is None
    forced = _decide(pairs, clean, corrupted, force=True)
    assert forced.verdict == "forced" and forced.forced and forced.gate_failed and forced.reason is None
    assert forced.forced_message == forced.message and forced.message.startswith(FORCED_PREFIX)
    assert forced.gated == tuple(range(12))


def test_too_few_pairs_to_split_are_withheld_or_forced_onto_the_same_pairs():
    pairs = _pairs(1, per_task=2)  # one task: no split
    clean, corrupted = torch.tensor([3.0, 3.5], dtype=torch.float64), torch.tensor([-1.0, -1.0], dtype=torch.float64)
    gates = {"present": gate_pairs(clean, corrupted, ["present", "present"])["present"]}  # 2 units: can pass
    d = decide(gates, clean, corrupted, pairs)
    assert d.verdict == "withheld" and "cannot be split" in d.reason and "use more pairs" in d.reason
    f = decide(gates, clean, corrupted, pairs, force=True)
    assert f.verdict == "forced" and not f.gate_failed and f.split == ((0, 1), (0, 1))
    assert f.forced_message == f.notes[-1] and f.notes[-1].startswith("FORCED: ") and "SAME pairs" in f.notes[-1]


def test_solved_only_filters_after_the_gate_and_withholds_when_nothing_is_left():
    pairs = _pairs(6)
    clean = [1.0] * 12
    corrupted = [-1.0 if i % 2 == 0 else 0.5 for i in range(12)]  # every odd pair unsolved (corrupted > 0)
    d = _decide(pairs, clean, corrupted, solved_only=True)
    assert d.verdict == "passed" and d.gated == tuple(range(12)) and d.kept == tuple(range(0, 12, 2))
    assert all(i % 2 == 0 for half in d.split for i in half)
    assert "kept 6 the model answers right both ways" in d.notes[0]
    none = _decide(pairs, [1.0] * 12, [0.5] * 12, solved_only=True)  # gap 0.5 passes, no pair solved
    assert none.verdict == "withheld" and "none is answered right both ways" in none.reason
