"""Plans before long work (issue 29 part 3): the Python API's long calls return their plan with
`dry_run=True` and run nothing, stop a job over their default budget with the plan's totals and the
argument that raises it, a probe sweep on few tasks runs as many folds as it has tasks, and
`tomlens patch --dry-run` says the gate's verdict with its reason beside the plan."""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import TensorActivations

import tomlens.patching.engine as engine
import tomlens.probes.sweep as sweep_module
from tomlens.cli import main
from tomlens.errors import TomlensError
from tomlens.patching import exact_patching
from tomlens.patching.plan import DEFAULT_MAX_RUNS, Plan
from tomlens.probes.plan import ProbePlan
from tomlens.probes.sweep import run_probe_sweep
from tomlens.stimuli import generate
from tomlens.stimuli.pairs import make_pairs, write_pairs

pytestmark = pytest.mark.integration  # tiny models

FAST = dict(inner_folds=2, c_grid=(0.1, 1.0), n_boot=50, device="cpu", progress=False)



@pytest.fixture
def no_patched_runs(monkeypatch):
    """Patched forwards, counted (a dry run or a refused plan must make none)."""
    runs: list[int] = []
    real = engine.run_patched

    def counting(model, group, batch, *args, **kwargs):
        runs.append(len(batch))
        return real(model, group, batch, *args, **kwargs)

    monkeypatch.setattr(engine, "run_patched", counting)
    return runs


def test_exact_patching_dry_run_returns_the_plan_and_runs_nothing(gpt2_pairs, no_patched_runs, capsys):
    model, pairs = gpt2_pairs
    plan = exact_patching(model, pairs, sites=["heads", "resid"], positions=["final"], dry_run=True, progress=False)
    assert isinstance(plan, Plan) and plan.total_runs > 0 and plan.n_pairs == 4
    assert plan.max_runs == DEFAULT_MAX_RUNS
    assert no_patched_runs == []
    printed = capsys.readouterr().out
    assert f"{plan.total_runs:,} patched runs" in printed and "dry run: nothing run" in printed
    exact_patching(model, pairs, sites=["heads", "resid"], positions=["final"], progress=False)
    assert sum(no_patched_runs) == plan.total_runs  # the plan counts the runs the call then makes


def test_exact_patching_over_its_budget_stops_with_the_plan(gpt2_pairs, no_patched_runs, capsys):
    model, pairs = gpt2_pairs
    planned = exact_patching(model, pairs, sites=["heads"], positions=["final"], dry_run=True)
    capsys.readouterr()
    with pytest.raises(TomlensError) as err:
        exact_patching(model, pairs, sites=["heads"], positions=["final"], max_runs=5, progress=False)
    assert no_patched_runs == []
    assert f"{planned.total_runs:,} patched runs" in err.value.problem and "max_runs=5" in err.value.problem
    assert f"max_runs={planned.total_runs}" in err.value.fix and "dry_run=True" in err.value.fix
    assert "--" not in err.value.fix  # a Python call is told Python arguments, not CLI flags
    assert "plan (4 pairs" in capsys.readouterr().out  # the plan is said before the refusal
    ran = exact_patching(model, pairs, sites=["heads"], positions=["final"], max_runs=None, progress=False)
    assert sum(no_patched_runs) == planned.total_runs and ran.values.shape[1] == 4


def planted(n_tasks: int) -> TensorActivations:
    st = generate("unexpected-transfer", n=n_tasks, seed=0)
    g = torch.Generator().manual_seed(0)
    belief = torch.tensor([2.0 * s.belief_is_reference - 1 for s in st])
    resid = torch.randn(len(st), 2, 8, generator=g)
    resid[:, 1, 0] += 2.0 * belief
    return TensorActivations(list(st), {("resid_post", "final"): resid}, {"model": {"model": "planted"}})


def test_run_probe_sweep_dry_run_returns_the_plan_and_fits_nothing(monkeypatch, capsys):
    def no_fit(*args, **kwargs):
        raise AssertionError("a dry run fits nothing")

    monkeypatch.setattr(sweep_module, "fit_layout", no_fit)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = run_probe_sweep(planted(4), "protagonist_belief", sites=("resid_post",), folds=3, dry_run=True, **FAST)
    assert isinstance(plan, ProbePlan) and sum(s.fits for s in plan.stages) > 0
    assert plan.seconds() is not None and plan.budget_seconds == 60 * sweep_module.DEFAULT_BUDGET_MINUTES
    printed = capsys.readouterr().out
    assert "total" in printed and "estimated" in printed and "dry run: nothing fitted" in printed


def test_run_probe_sweep_over_its_default_budget_stops_with_the_plan(monkeypatch, capsys):
    def no_fit(*args, **kwargs):
        raise AssertionError("a plan over budget fits nothing")

    monkeypatch.setattr(sweep_module, "fit_layout", no_fit)
    monkeypatch.setattr(sweep_module, "DEFAULT_BUDGET_MINUTES", 1e-6)  # any real plan is over it
    with warnings.catch_warnings(), pytest.raises(TomlensError) as err:
        warnings.simplefilter("ignore")
        run_probe_sweep(planted(4), "protagonist_belief", sites=("resid_post",), folds=3, **FAST)
    assert "fits estimated at" in err.value.problem and "budget_minutes=1e-06" in err.value.problem
    assert "budget_minutes=" in err.value.fix and "dry_run=True" in err.value.fix and "--" not in err.value.fix
    assert "total" in capsys.readouterr().out  # the plan was said first


def test_run_probe_sweep_on_three_tasks_runs_three_folds_itself():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = run_probe_sweep(planted(3), "protagonist_belief", sites=("resid_post",), budget_minutes=None, **FAST)
    assert "3 groups (task): 3 grouped folds instead of 5" in result.metadata["notes"]
    assert len(result.table) > 0


def test_patch_dry_run_says_the_gate_verdict_its_reason_and_the_plan(load_tiny, tmp_path, capsys):
    """tiny-llama is random: the gate withholds; the dry run says so, why, and what --force would run."""
    model = load_tiny("tiny-llama")
    pairs, _ = make_pairs("unexpected-transfer", n=3, seed=0, tokenizer=model.tokenizer, contrasts=("present",))
    path = write_pairs(pairs, tmp_path / "pairs.jsonl")
    out = tmp_path / "out"
    code = main(["patch", "--model", "tiny-llama", "--pairs", str(path), "--out", str(out), "--dry-run",
                 "--sites", "heads", "--no-progress"])
    printed = capsys.readouterr().out
    assert code == 0 and not out.exists()
    assert "gate: withheld: " in printed and "Reason: " in printed  # the verdict with its reason
    assert "the plan with --force" in printed and "exact denoise" in printed and "total" in printed
    assert printed.rstrip().endswith("dry run: nothing else run, nothing written")


SMALL = """
name = "small"
[model]
name = "tiny-llama"
[[behaviour.stimuli]]
family = "unexpected-transfer"
n = 1
[probes]
stimuli = {{family = "unexpected-transfer", n = 4, seed = 1}}
sites = ["head_out"]
folds = 4
store = "{store}"
[pairs]
n = 3
contrasts = ["present"]
[patching]
sites = ["heads"]
top_k = 1
n_random = 1
probe_table = "probes"
[steering]
stimuli = {{family = "unexpected-transfer", n = 1}}
"""


def test_run_dry_run_prints_every_stage_and_a_total_and_writes_nothing(tmp_path, monkeypatch, capsys):
    path = tmp_path / "small.toml"
    path.write_text(SMALL.format(store=tmp_path / "store"))
    import tomlens.runs.experiment as experiment

    def no_stage(*args, **kwargs):
        raise AssertionError("a dry run runs no stage")

    monkeypatch.setattr(experiment, "run_experiment", no_stage)
    out = tmp_path / "out"
    assert main(["run", str(path), "--out", str(out), "--dry-run", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert not out.exists() and not (tmp_path / "store").exists()
    plan_part = printed[printed.index("experiment plan"):]
    for stage in ("behaviour", "probes", "pairs", "patching", "steering"):
        assert f"\n  {stage}" in plan_part, stage
    assert "gate: withheld: " in printed  # the patching stage's own dry run: the gate's verdict, why
    assert "16 prompts; 16 forwards" in plan_part  # behaviour: 1 task of 16 prompts, one forward each
    assert "64 prompts; 128 forwards" in plan_part  # probes: 4 tasks cached, and the random twin's
    assert "timed: one forward of 4 prompts on tiny-llama" in plan_part
    assert "estimated total: ~" in plan_part
    assert "not estimated: probe fits (tiny-llama), steering (tiny-llama)" in plan_part  # counted, not timed
    assert printed.rstrip().endswith("dry run: nothing else run, nothing written")


PAIRS_ONLY = """
name = "pairs-only"
[model]
name = "tiny-llama"
[pairs]
n = 3
contrasts = ["present"]
[patching]
sites = ["heads"]
top_k = 1
n_random = 1
"""


def test_run_dry_run_with_a_patching_stage_says_its_closing_line_once(tmp_path, capsys):
    """The patching stage's own dry run is part of the experiment's plan, which goes on after it."""
    from tomlens.runs.experiment_plan import DRY_RUN_END

    path = tmp_path / "pairs.toml"
    path.write_text(PAIRS_ONLY)
    assert main(["run", str(path), "--out", str(tmp_path / "out"), "--dry-run", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "its own dry run" in printed and "gate: " in printed  # the stage's own dry run was said
    assert printed.count(DRY_RUN_END) == 1 and printed.rstrip().endswith(DRY_RUN_END)


BEHAVIOUR_ONLY = """
name = "behaviour-only"
[model]
name = "tiny-llama"
[[behaviour.stimuli]]
family = "unexpected-transfer"
n = 1
[pairs]
n = 2
contrasts = ["present"]
"""


def test_run_says_the_time_left_once_the_model_loads_before_the_first_stage(tmp_path, monkeypatch, capsys):
    """One timed forward of the model the first weighted stage loads anyway: no second load."""
    import re

    from tomlens.runs.base import ModelSpec

    loads: list[str] = []
    real = ModelSpec.load
    monkeypatch.setattr(ModelSpec, "load", lambda self, *a, **k: loads.append(self.name) or real(self, *a, **k))
    path = tmp_path / "small.toml"
    path.write_text(BEHAVIOUR_ONLY)
    assert main(["run", str(path), "--out", str(tmp_path / "out"), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert loads == ["tiny-llama"]
    line = re.search(r"timed: one forward of 4 prompts on tiny-llama: \d+ ms per prompt; "
                     r"estimated time left: ~\d+(\.\d)? (s|min|h)\b", printed)
    assert line is not None, printed[:2000]
    assert printed.index("plan: behaviour 16 prompts") < printed.index("loading tiny-llama") < line.start()
    assert line.start() < printed.index("Kosinski's strict rule")  # before the behaviour stage's output
    assert printed.count("estimated time left") == 1  # pairs needs no weights: nothing timed again


def test_the_time_left_prices_the_loaded_model_and_names_those_still_to_load():
    from tomlens.runs.experiment_plan import ExperimentPlan, StageEstimate

    plan = ExperimentPlan((
        StageEstimate("behaviour", "a", "scored", 10, 10, entry=0),
        StageEstimate("probes", "a", "cached", 20, 20, untimed_part="probe fits", entry=0),
        StageEstimate("steering", "a", "counted", 5, entry=0),
        StageEstimate("behaviour", "b", "scored", 10, 10, entry=1)), {})
    priced = plan.priced(0, "a", rate=2.0)
    assert [s.seconds for s in priced.stages] == [20.0, 40.0, None, None] and priced.seconds_per_prompt == {"a": 2.0}
    assert priced.time_left_line(0, "behaviour") == (
        "estimated time left: ~60 s plus what is not estimated: probe fits (a), steering (a), "
        "the stages of b (timed when it loads)")
    assert priced.time_left_line(0, "probes").startswith("estimated time left: ~40 s")  # behaviour was reused
    last = priced.priced(1, "b", rate=6.0)
    assert last.time_left_line(1, "behaviour") == "estimated time left: ~60 s"
