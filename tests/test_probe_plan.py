"""The probe stage says what it costs before it fits (issue 26, item 7): the plan counts exactly the
fits the sweep then runs, prices them from one small timed fit per site kind, prints itself, and a
budget refuses a plan over it before any fit."""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import TensorActivations

import tomlens.probes.sweep as sweep_module
from tomlens.errors import TomlensError
from tomlens.probes.plan import FitShape, PlanStage, ProbePlan
from tomlens.probes.sweep import fit_layout, lay_out_sweep, run_probe_sweep
from tomlens.probes.sweep_plan import sweep_plan, time_fits
from tomlens.runs.base import ModelSpec, StimuliSpec
from tomlens.runs.probes import ProbesConfig, stage_plan
from tomlens.stimuli import generate

pytestmark = pytest.mark.unit

FAST = dict(folds=3, inner_folds=2, c_grid=(0.1, 1.0), n_boot=50, device="cpu")


@pytest.fixture(scope="module")
def acts() -> TensorActivations:
    st = generate("unexpected-transfer", n=8, seed=0)
    g = torch.Generator().manual_seed(0)
    n = len(st)
    b = torch.tensor([2.0 * s.belief_is_reference - 1 for s in st])
    resid = torch.randn(n, 3, 24, generator=g)
    resid[:, 1, 0] += 2.0 * b
    heads = torch.randn(n, 3, 4, 6, generator=g) @ torch.randn(6, 24, generator=g)  # rank 6 = 24 / 4 heads
    pre = torch.randn(n, 1, 24, generator=g)
    return TensorActivations(list(st), {("resid_post", "final"): resid, ("head_out", "final"): heads,
                                        ("resid_pre", "final"): pre}, {"model": {"model": "planted"}})


def test_the_plan_counts_the_fits_the_sweep_runs(acts, monkeypatch):
    layout = lay_out_sweep(acts, ["protagonist_belief", "world_state"], progress=False, **FAST)
    plan = sweep_plan(layout)
    calls = []
    real = sweep_module._fit

    def counting(probe, X, Y, *args, **kwargs):
        calls.append((X.shape[0], X.shape[1], Y.shape[0]))
        return real(probe, X, Y, *args, **kwargs)

    monkeypatch.setattr(sweep_module, "_fit", counting)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fit_layout(layout)
    planned = sorted((s.units, s.rows, s.labels) for st in plan.stages for s in st.shapes for _ in range(s.count))
    assert planned == sorted(calls)
    assert [st.name for st in plan.stages] == ["sweep", "baselines"]
    assert {s.rank for s in plan.stages[0].shapes} == {24, 6}  # layers: d; heads: d / heads


def test_run_probe_sweep_prints_its_plan_with_an_estimate_before_fitting(acts, capsys):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run_probe_sweep(acts, "protagonist_belief", sites=("resid_post", "head_out"), progress=True, **FAST)
    out = capsys.readouterr().out
    head = out[:out.index("total")]
    assert "probe plan (128 prompts" in head
    assert "resid_post 3 units + head_out 12 units" in head and "baselines" in head
    assert "estimated" in out and "timed: one fit of" in out


def test_a_budget_refuses_the_plan_before_any_fit(acts, monkeypatch):
    def no_fit(*args, **kwargs):
        raise AssertionError("a plan over budget must not fit anything")

    monkeypatch.setattr(sweep_module, "fit_layout", no_fit)
    with pytest.raises(TomlensError, match="more than the budget") as err:
        run_probe_sweep(acts, "protagonist_belief", progress=False, budget_minutes=1e-6, **FAST)
    assert "budget_minutes=" in err.value.fix and "--" not in err.value.fix  # a Python call: no CLI flag


def test_the_estimate_scales_with_what_is_fitted():
    layer = FitShape(units=30, rows=300, dim=576, rank=576, labels=3, grid=5, folds=4)
    assert FitShape(60, 300, 576, 576, 3, 5, 4).work() == pytest.approx(2 * layer.work(), rel=1e-9)
    assert FitShape(30, 300, 576, 576, 1, 5, 4).work() < layer.work()  # fewer label vectors
    assert FitShape(30, 300, 576, 576, 3, 3, 3).work() < layer.work()  # fewer C values and folds
    assert FitShape(30, 300, 576, 64, 3, 5, 4).work() < layer.work() / 4  # per-head units: rank 64
    assert layer.solves == 4 * 5 + 1 and FitShape(1, 10, 2, 2, 1, 1, 0).solves == 1
    plan = ProbePlan([PlanStage("a", "", [layer]), PlanStage("b", "cache", seconds=12.0),
                      PlanStage("c", "not timed")], "plan:", rates={"": 1e-9}, per_solve=0.01)
    assert plan.seconds(plan.stages[0]) == pytest.approx(1e-9 * layer.work() + 0.01 * layer.solves)
    assert plan.seconds(plan.stages[2]) is None  # nothing to price: said, not guessed
    assert plan.seconds() == pytest.approx(plan.seconds(plan.stages[0]) + 12.0)
    assert "~" not in plan.lines()[3] and "estimated" in plan.lines()[-1]


def test_the_stage_plan_covers_the_twin_and_the_selection(acts):
    config = ProbesConfig(model=ModelSpec(name="tiny-llama"), stimuli=StimuliSpec(family="unexpected-transfer", n=8),
                          folds=3, inner_folds=2, c_grid=(0.1, 1.0), n_boot=50, n_permutations=100,
                          budget_minutes=30)
    from tomlens.runs.probes import sweep_config

    layout = lay_out_sweep(acts, list(config.targets), sites=list(config.sites), positions=config.positions,
                           config=sweep_config(config, progress=False))
    plan = stage_plan(config, layout, cache_seconds=5.0)
    names = [s.name for s in plan.stages]
    assert names == ["sweep", "baselines", "twin caching", "random twin", "selection (protagonist_belief)"]
    twin, sweep_ = plan.stages[3], plan.stages[0]
    assert {s.labels for s in twin.shapes} == {1}  # the twin fits the target only: its score is all it gives
    assert twin.fits == sweep_.fits - 2  # ... on the same units, plans and folds (no directions: 1 per kind)
    assert plan.stages[2].seconds == 5.0 and "random:tiny-llama" in plan.stages[2].what
    assert plan.stages[4].extra > 0 and "1,000" not in plan.stages[4].what and "100 permutations" in plan.stages[4].what
    time_fits(plan, layout)
    assert set(plan.rates) == {"resid_post", "head_out"} and plan.per_solve > 0
    assert plan.budget_seconds == 1800 and plan.seconds() is not None
