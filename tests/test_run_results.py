"""Every typed stage summary survives result.json: written through `summary_to_dict` and read back
through `summary_from_dict` it equals what was written (NaN included, where JSON writes null), and a
result.json that lacks a field is one TomlensError saying to rerun the stage; each result class saves
and loads back the same summary (no model: unit tier)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import pytest

from tomlens.errors import TomlensError
from tomlens.io import read_json, write_json
from tomlens.runs.base import ModelSpec, StimuliSpec
from tomlens.runs.behaviour import BehaviourConfig, BehaviourResult, BehaviourSummary, json_rows
from tomlens.runs.cache import CacheSummary
from tomlens.runs.compare import CompareResult
from tomlens.runs.compare_summary import ComparedModel, ComparedRun, CompareSummary
from tomlens.runs.files import RunResult, summary_from_dict, summary_to_dict
from tomlens.runs.freetext import FreeTextConfig, FreeTextResult, FreeTextSummary, select_items, summarise_answers
from tomlens.runs.pairs import BosRule, PairsConfig, PairsResult, PairsSummary
from tomlens.runs.probes_summary import PlannedStage, ProbePlanSummary, ProbesSummary, SelectedUnit
from tomlens.runs.steering import SteeringResult
from tomlens.runs.steering_summary import SteeringLayer, SteeringSummary
from tomlens.runs.validate import Check, ValidationSummary

pytestmark = pytest.mark.unit


def steering() -> SteeringSummary:
    row = SteeringLayer(layer=1, alpha=-2.0, flip_false_belief=0.9, flip_true_belief=math.nan, flip_reality=0.0,
                        random_mean=0.02, random_p95=0.05, random_max=0.1, p_random=1 / 21, n_random=20, shuffled=0.1,
                        verdict="found", reason="flips enough", selection_flip=0.85, selection_random_p95=0.05,
                        selection_random_max=0.1, selection_margin=0.8, selection_flip_max=0.9, selection_reached=True)
    return SteeringSummary(layers=(row,), mode="add", positions="final", method="mean_difference",
                           target="protagonist_belief", alphas=(-2.0, 0.0, 2.0), n_random=20, n_selection_prompts=8,
                           n_evaluation_prompts=8, selection_tasks=("t0", "t1"), forward_passes=120,
                           norms={"1": 3.5}, random_quantile=0.95, verdict="found", layer=1, notes=("a note",))


def validation() -> ValidationSummary:
    checks = (Check("probe", 0.97, 0.95, ">=", True, 0.5, 0.6, "<=", "held out"),
              Check("steering", math.nan, 0.8, ">=", False, math.nan, 0.1, "<=", "withheld: no stage"))
    return ValidationSummary(command="validate", model="tiny-llama", provenance={"model": "tiny-llama", "n_layers": 2},
                             n_tasks=8, n_stories=24, k=1, heads=8, k_above_5_percent=False, passed=False,
                             checks=checks, stages={"probes": "probes/", "steering": None}, seconds=1.5)


def probes() -> ProbesSummary:
    plan = ProbePlanSummary(stages=(PlannedStage(name="sweep", what="every unit", fits=40, estimated_seconds=2.5),
                                    PlannedStage(name="twin caching", what="caching", fits=0, estimated_seconds=None)),
                            estimated_seconds=2.5, budget_seconds=3600.0, calibration="timed here", notes=(),
                            measured_seconds={"sweep + baselines": 2.1})
    return ProbesSummary(rows=120, targets=("protagonist_belief",), sites=("resid_post",), position="final",
                         activations="/store/a", test_activations=None, directions=True, notes=("n",),
                         selection={"protagonist_belief": SelectedUnit(unit="resid_post:1", verdict="withheld",
                                                                       reason="below the twin", found=False)},
                         plan=plan)


def cache() -> CacheSummary:
    return CacheSummary(store="/store/a", key="abc", reused=False, n=24, stimuli_hash="h", sites=("resid_post:0",),
                        positions=("final",), layers={"resid_post": [0, 1]}, dtype="float32")


def compare() -> CompareSummary:
    model = ComparedModel(label="m", folder="runs/a/m", run="runs/a", n_layers=2, n_heads=4, asked=("probes",),
                          finished=("probes",), provenance={"model": "tiny-llama", "n_layers": 2})
    return CompareSummary(command="compare", axis="relative depth", normalisation="own gap", layers="0-based",
                          models=(model,), missing=("x",), runs=(ComparedRun(folder="runs/a", manifest=None),),
                          versions={"tomlens": "0"}, time="2025-01-01T00:00:00", tables=("models",))


ACCURACY = pd.DataFrame({"family": ["unexpected-transfer"] * 2, "condition": ["false_belief", "true_belief"],
                         "prompt_type": ["belief", "belief"], "n": [8, 8], "n_tasks": [4, 4],
                         "accuracy": [0.75, 0.5], "ci_low": [0.5, math.nan], "ci_high": [1.0, math.nan]})
SELECTIVE = pd.DataFrame({"target_type": ["object"], "k": [1], "animate_vs_control": [(0.1, 0.4)]})


def behaviour() -> BehaviourSummary:
    """A summary as `run_behaviour` builds it: its row lists as JSON holds them (NaN as None)."""
    none = json_rows(pd.DataFrame())
    return BehaviourSummary(provenance={"model": "tiny-llama", "n_layers": 2, "stimuli_hash": "h", "seconds": 0.5},
                            accuracy=json_rows(ACCURACY), first_word=none, reality_gated=none,
                            knowledge_state_effect=none, strict_task_pass=none, object_bias=none,
                            selective_encoding=json_rows(SELECTIVE), k0_check=none, batteries=("kosoy",))


def pairs_summary(**changes: object) -> PairsSummary:
    fields = dict(family="unexpected-transfer", total=3, aligned=2, dropped=1, checked_with="tiny-llama",
                  dropped_pairs=(["ut-0-absent", "token_count: 12 vs 13"],), model="tiny-llama", seed=0, n=1,
                  bos=BosRule(prepend=True, source="tokenizer", token="<s>"), options={"contrasts": ["present"]},
                  stimuli_hash="h")
    return PairsSummary(**{**fields, **changes})  # type: ignore[arg-type]


def freetext() -> FreeTextSummary:
    return FreeTextSummary(n_items=2, n_cut_off=1, stop_reasons={"eos": 1, "max_new_tokens": 1}, seconds=None,
                           files=("answers.csv", "coding.csv", "config.json", "manifest.json"))


def loaders() -> dict[str, tuple[object, object]]:
    """Per stage: a summary and the function that reads its result.json dict back."""
    def through(cls: type, stage: str) -> object:
        return lambda d, f: summary_from_dict(cls, d, folder=f, stage=stage)

    return {
        "steering": (steering(), through(SteeringSummary, "steering")),
        "validate": (validation(), through(ValidationSummary, "validate")),
        "probes": (probes(), lambda d, f: ProbesSummary.from_json(d, folder=f)),
        "cache": (cache(), through(CacheSummary, "cache")),
        "compare": (compare(), lambda d, f: CompareSummary.from_json(d, folder=f)),
        "behaviour": (behaviour(), through(BehaviourSummary, "behaviour")),
        "pairs": (pairs_summary(), through(PairsSummary, "pairs")),
        "free-text": (freetext(), through(FreeTextSummary, "free-text")),
    }


STAGES = ["steering", "validate", "probes", "cache", "compare", "behaviour", "pairs", "free-text"]


def _same(a: object, b: object) -> bool:
    """Equal as written: NaN equals NaN (JSON keeps no NaN, and NaN != NaN)."""
    return json.dumps(summary_to_dict(a)) == json.dumps(summary_to_dict(b)) and type(a) is type(b)


@pytest.mark.parametrize("stage", STAGES)
def test_each_summary_round_trips_through_result_json(tmp_path: Path, stage: str) -> None:
    summary, load = loaders()[stage]
    path = write_json(summary_to_dict(summary), tmp_path / "result.json")
    back = load(read_json(path), tmp_path)
    assert _same(back, summary)
    assert back == summary or stage in ("steering", "validate")  # those two hold a NaN


@pytest.mark.parametrize("stage, field", [("steering", "mode"), ("validate", "k"), ("probes", "plan"),
                                          ("cache", "store"), ("compare", "models"), ("behaviour", "k0_check"),
                                          ("pairs", "bos"), ("free-text", "stop_reasons")])
def test_a_result_json_missing_a_field_says_to_rerun_the_stage(tmp_path: Path, stage: str, field: str) -> None:
    summary, load = loaders()[stage]
    data = summary_to_dict(summary)
    del data[field]
    with pytest.raises(TomlensError, match=f"rerun the {stage} stage"):
        load(data, tmp_path)


def test_a_steering_row_missing_a_measured_number_says_to_rerun() -> None:
    data = summary_to_dict(steering())
    del data["layers"][0]["random_p95"]
    with pytest.raises(TomlensError, match="rerun the steering stage"):
        summary_from_dict(SteeringSummary, data, folder="old", stage="steering")


def test_a_steering_row_from_before_the_selection_half_ran_random_directions_still_loads() -> None:
    data = summary_to_dict(steering())
    for key in [k for k in data["layers"][0] if k.startswith("selection_")]:
        del data["layers"][0][key]
    row = summary_from_dict(SteeringSummary, data, folder="old", stage="steering").layers[0]
    assert row.selection_margin is None and row.selection_reached is None and math.isnan(row.flip_true_belief)


def test_steering_and_compare_results_save_and_load_equal(tmp_path: Path) -> None:
    dose = pd.DataFrame({"layer": [1], "alpha": [-2.0], "flip_rate": [0.9]})
    result = SteeringResult(dose=dose, selection=dose, summary=steering())
    back = SteeringResult.load(result.save(tmp_path / "steering"))
    assert _same(back.summary, result.summary) and back.describe() == result.describe()
    comparison = CompareResult({"models": pd.DataFrame({"model": ["m"]})}, compare())
    again = CompareResult.load(comparison.save(tmp_path / "compare"))
    assert again.summary == comparison.summary and again.describe() == comparison.describe()
    assert list(again.tables) == ["models"]


def test_a_behaviour_result_saves_and_loads_its_summary_and_tables(tmp_path: Path) -> None:
    config = BehaviourConfig(model=ModelSpec(name="tiny-llama"), stimuli=(StimuliSpec(path="s.jsonl"),), n_boot=10)
    battery = pd.DataFrame({"cell": ["a"], "accuracy": [0.5]})
    result = BehaviourResult(pd.DataFrame({"id": ["t0"], "correct": [True]}), ACCURACY, pd.DataFrame(), pd.DataFrame(),
                             pd.DataFrame(), pd.DataFrame(), behaviour(), config=config, manifest={"tomlens": "0"},
                             batteries={"kosoy": battery})
    out = result.save(tmp_path / "behaviour")
    assert read_json(out / "summary.json") == read_json(out / "result.json") == summary_to_dict(behaviour())
    back = BehaviourResult.load(out)
    assert back.summary == result.summary and back.config == config and list(back.batteries) == ["kosoy"]
    assert isinstance(back, RunResult)
    pd.testing.assert_frame_equal(back.accuracy, ACCURACY)
    assert back.describe() == result.describe()
    data = read_json(out / "result.json")
    del data["batteries"]  # a folder from before the batteries were listed
    write_json(data, out / "result.json")
    with pytest.raises(TomlensError, match="rerun the behaviour stage"):
        BehaviourResult.load(out)


def test_a_pairs_result_saves_and_loads_in_a_folder_and_as_a_file(tmp_path: Path) -> None:
    from tomlens.stimuli.pairs import make_pairs

    config = PairsConfig(model=ModelSpec(name="tiny-llama"), n=1, contrasts=("present",))
    pairs, report = make_pairs(config.family, 1, 0, tokenizer=None, contrasts=("present",))
    summary = pairs_summary(total=report.total, aligned=report.aligned, dropped=report.dropped,
                            checked_with=report.checked_with, dropped_pairs=tuple(list(x) for x in report.dropped_pairs))
    result = PairsResult(config, pairs, report, summary)
    folder = result.save(tmp_path / "pairs")
    written = read_json(folder / "result.json")
    assert "path" not in written and "max_pairs" not in written  # not given: not written, as before
    back = PairsResult.load(folder)
    assert back.summary == summary and back.config == config and back.describe() == result.describe() and isinstance(back, RunResult)
    single = PairsResult.load(result.write_file(tmp_path / "p.jsonl"))
    assert single.summary == summary and single.config.contrasts == ("present",) and single.config.n == 1
    capped = pairs_summary(max_pairs=1)
    assert summary_from_dict(PairsSummary, capped.to_json(), folder="f", stage="pairs") == capped
    data = read_json(tmp_path / "p.report.json")
    del data["stimuli_hash"]
    write_json(data, tmp_path / "p.report.json")
    with pytest.raises(TomlensError, match="rerun the pairs stage"):
        PairsResult.load(tmp_path / "p.jsonl")


def test_a_free_text_result_saves_and_loads_its_summary(tmp_path: Path) -> None:
    items = select_items("short-story", ("1", "2"))
    answers = pd.DataFrame([{"id": it.id, "family": it.family, "story_id": it.story_id, "kind": "",
                             "question_type": it.question_type, "question": it.question, "answer": "because",
                             "n_new_tokens": 3, "stop_reason": reason, "cut_off": reason == "max_new_tokens",
                             "cut_by_context": False, "rubric": it.rubric_text(), "max_score": it.max_score,
                             "allowed": "0,1,2", "decoding": "greedy", "max_new_tokens": 8, "seed": 0}
                            for it, reason in zip(items, ("eos", "max_new_tokens"), strict=True)])
    answers.attrs["seconds"] = 1.25
    config = FreeTextConfig(model=ModelSpec(name="tiny-llama"), items=("1", "2"), max_new_tokens=8)
    result = FreeTextResult(answers, config=config, manifest={"tomlens": "0"}, summary=summarise_answers(answers))
    assert result.summary == FreeTextSummary(n_items=2, n_cut_off=1, stop_reasons={"eos": 1, "max_new_tokens": 1},
                                             seconds=1.25, files=("answers.csv", "coding.csv", "config.json",
                                                                  "manifest.json"))
    back = FreeTextResult.load(result.save(tmp_path / "answers"))
    assert back.summary == result.summary and back.config == config
    assert back.describe(tmp_path) == result.describe(tmp_path) and isinstance(back, RunResult)
    data = read_json(tmp_path / "answers" / "result.json")
    del data["n_items"]
    write_json(data, tmp_path / "answers" / "result.json")
    with pytest.raises(TomlensError, match="rerun the free-text stage"):
        FreeTextResult.load(tmp_path / "answers")


def test_an_experiment_reruns_a_steering_folder_of_an_older_rule_or_an_older_summary(tmp_path: Path) -> None:
    from tomlens.runs.experiment import _older_steering_rule

    data = summary_to_dict(steering())
    write_json(data, tmp_path / "result.json")
    assert _older_steering_rule(tmp_path) is None
    del data["random_quantile"]
    write_json(data, tmp_path / "result.json")
    assert "the random directions' maximum" in (_older_steering_rule(tmp_path) or "")
    for key in [k for k in data["layers"][0] if k.startswith("selection_")]:
        del data["layers"][0][key]
    write_json(data, tmp_path / "result.json")
    assert "without the selection half's random directions" in (_older_steering_rule(tmp_path) or "")
    del data["mode"]
    write_json(data, tmp_path / "result.json")
    assert "does not fit" in (_older_steering_rule(tmp_path) or "")
