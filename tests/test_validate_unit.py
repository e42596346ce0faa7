"""`tomlens validate`'s pass/fail logic on synthetic stage results (no model): each check, a
withheld stage, values equal to their thresholds, thresholds from the config, exit codes."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from patching_fakes import ablation, comparison, topk_row
from patching_fakes import patching_summary as fake_patching_summary

from tomlens.cli import main
from tomlens.errors import TomlensError
from tomlens.probes.selection import Estimate, SelectionResult
from tomlens.runs.base import config_from_dict, config_to_dict
from tomlens.runs.files import summary_from_dict, summary_to_dict
from tomlens.runs.patching_summary import PatchingSummary
from tomlens.runs.steering_summary import SteeringLayer, SteeringSummary
from tomlens.runs.validate import (
    CHECKS,
    Check,
    Thresholds,
    ValidateConfig,
    ValidationResult,
    ValidationSummary,
    check_ablation,
    check_attribution,
    check_probe,
    check_recovery,
    check_steering,
    default_k,
    exit_code,
    meets,
    table_of,
)

T = Thresholds()


def selection(score: float = 0.97, bow: float = 0.5, verdict: str = "found", reason: str = "") -> SelectionResult:
    return SelectionResult(
        target="protagonist_belief", unit={"kind": "resid_post", "layer": 2, "head": -1, "position": "final"},
        selection_score=0.98, evaluation=Estimate(score, score - 0.02, min(1.0, score + 0.02), 0.5),
        baselines={"bag_of_words": Estimate(bow, bow - 0.1, bow + 0.1, 0.5)}, p_max=0.001, n_perm=1000,
        n_selection=96, n_evaluation=96, verdict=verdict, reason=reason)


def patching_summary(top: float = 0.9, random_mean: float = 0.05, spearman: float = 0.9, fb: float = 0.4,
                     random_drop: float = 0.02, base_fb: float = 1.0, k: int = 1, **extra) -> PatchingSummary:
    return fake_patching_summary(
        rank_position="final", validated_on="24 held-out evaluation pairs", ranked_by="exact denoise",
        topk=(topk_row(k, top_effect=top, random_mean=random_mean),),
        comparisons=(comparison(spearman=spearman), comparison("query_object", spearman=-1.0)),
        ablation=ablation(k, fb=fb, random_drop=random_drop, base_fb=base_fb), **extra)


def with_comparison(s: PatchingSummary, **fields) -> PatchingSummary:
    """`s` with its first comparison's `fields` changed."""
    first, *rest = s.comparisons
    return replace(s, comparisons=(replace(first, **fields), *rest))


def steering_summary(*layers: tuple[float, ...]) -> SteeringSummary:
    """Per layer (evaluation flip, random mean[, selection flip[, shuffled[, random p95[, random
    max]]]]); the selection flip defaults to the evaluation one, the 95th percentile to the mean, the
    maximum to the 95th percentile."""
    rows = []
    for i, (f, r, *rest) in enumerate(layers):
        sel = rest[0] if rest else f
        shuffled = rest[1] if len(rest) > 1 else 0.0
        p95 = rest[2] if len(rest) > 2 else r
        top = rest[3] if len(rest) > 3 else p95
        rows.append(SteeringLayer(layer=i, alpha=2.0, flip_false_belief=f, flip_true_belief=0.1, flip_reality=0.0,
                                  random_mean=r, random_p95=p95, random_max=top, p_random=1 / 21, n_random=20,
                                  shuffled=shuffled, selection_flip=sel, verdict="found", reason=""))
    return SteeringSummary(layers=tuple(rows), mode="add", positions="final", method="mean_difference",
                           target="protagonist_belief", alphas=(2.0,), n_random=20, n_selection_prompts=8,
                           n_evaluation_prompts=8, selection_tasks=(), forward_passes=0, norms={},
                           verdict="found", layer=0, notes=())


def validation_summary(checks: list[Check]) -> ValidationSummary:
    """A validation run's summary around `checks` (model "m", 8 tasks, k = 1)."""
    return ValidationSummary(command="validate", model="m", provenance={}, n_tasks=8, n_stories=24, k=1, heads=64,
                             k_above_5_percent=False, passed=all(c.passed for c in checks), checks=tuple(checks),
                             stages={}, seconds=0.0)


def test_meets_passes_at_the_threshold_and_never_on_nan() -> None:
    assert meets(0.8, 0.8, ">=") and meets(4 / 5, 0.8, ">=") and meets(19 / 20, 0.95, ">=")
    assert meets(0.6, 0.6, "<=") and not meets(0.61, 0.6, "<=") and not meets(0.79, 0.8, ">=")
    assert not meets(math.nan, 0.8, ">=") and not meets(math.nan, 0.8, "<=")


def test_probe_check() -> None:
    c = check_probe(selection(), T)
    assert c.passed and c.value == pytest.approx(0.97) and c.null == pytest.approx(0.5)
    assert check_probe(selection(score=0.95, bow=0.6), T).passed  # both exactly at their thresholds
    low = check_probe(selection(score=0.94), T)
    assert not low.passed and "not >= 0.95" in low.detail
    bow = check_probe(selection(bow=0.75), T)
    assert not bow.passed and "null 0.750 is not <= 0.6" in bow.detail
    withheld = check_probe(selection(verdict="withheld", reason="p_max 0.2 >= 0.05"), T)
    assert not withheld.passed and "p_max 0.2 >= 0.05" in withheld.detail
    refused = check_probe(None, T, withheld="the probes stage refused: too few groups")
    assert not refused.passed and "too few groups" in refused.detail and math.isnan(refused.value)


def test_recovery_attribution_and_ablation_checks() -> None:
    s = patching_summary()
    rec = check_recovery(s, 1, T, n_heads_total=64)
    assert rec.passed and rec.value == 0.9 and rec.null == 0.05
    att = check_attribution(s, T, ranking=rec)
    assert att.passed and att.value == 0.9  # the comparison at the ranking position, not the other
    ab = check_ablation(s, 1, T, n_heads_total=64)
    assert ab.passed and ab.value == 0.4 and ab.null == pytest.approx(0.98)  # 1.0 - mean drop 0.02
    edge = patching_summary(top=0.8, random_mean=0.2, spearman=0.8, fb=0.6, random_drop=0.1)
    assert all(c.passed for c in (check_recovery(edge, 1, T, n_heads_total=64), check_attribution(edge, T),
                                  check_ablation(edge, 1, T, n_heads_total=64)))
    assert not check_recovery(patching_summary(random_mean=0.25), 1, T, n_heads_total=64).passed
    assert not check_ablation(patching_summary(random_drop=0.2), 1, T, n_heads_total=64).passed  # random 0.8
    assert not check_ablation(patching_summary(fb=0.7), 1, T, n_heads_total=64).passed
    missing = check_recovery(s, 2, T, n_heads_total=64)
    assert not missing.passed and "k = 2" in missing.detail
    bad_rank = check_recovery(patching_summary(top=0.3), 1, T, n_heads_total=64)
    noise = check_attribution(s, T, ranking=bad_rank)
    assert not noise.passed and noise.value == 0.9 and "agreement about noise" in noise.detail
    big_k = check_recovery(patching_summary(k=5), 5, T, n_heads_total=64)
    assert "above 5%" in big_k.detail


def test_attribution_fails_when_its_top_k_misses_exact_patchings_heads_whatever_its_spearman() -> None:
    """A Spearman over all heads is carried by the many that do nothing in both methods: the
    organism's plain attribution scored 0.99 while ranking the planted head ninth."""
    s = with_comparison(patching_summary(spearman=0.99, attribution_steps=1), topk_overlap=0.0)
    missed = check_attribution(s, T)
    assert not missed.passed and missed.value == 0.99 and "misses heads exact patching finds" in missed.detail
    assert "plain attribution" in missed.detail
    s = with_comparison(s, topk_overlap=0.5)  # at the threshold
    assert check_attribution(s, T).passed
    assert not check_attribution(s, Thresholds(min_topk_overlap=0.6)).passed
    assert "integrated gradients, 8 steps" in check_attribution(patching_summary(attribution_steps=8), T).detail
    along = check_attribution(patching_summary(attribution_steps=8, attribution_path="sites"), T).detail
    assert "integrated gradients, 8 steps along the sites" in along


def test_attribution_fails_when_it_leaves_exact_patchings_top_head_out_of_its_top_k() -> None:
    """Half of the top 2 passed a ranking that put the head carrying belief third (its two readers
    first): the head exact patching ranks first must be in attribution's top k."""
    s = patching_summary(spearman=0.9)
    s = with_comparison(s, k=2, topk_overlap=0.5, exact_top="L2H0", exact_top_rank=3)
    third = check_attribution(s, T)
    assert not third.passed and "misses the head exact patching ranks first (L2H0, its #3)" in third.detail
    s = with_comparison(s, exact_top_rank=2)  # in the top 2, not first: passes
    second = check_attribution(s, T)
    assert second.passed and "top head L2H0 is attribution's #2" in second.detail
    s = with_comparison(s, exact_top_rank=None)  # none recorded (no ranking to read it from): not judged on it
    assert check_attribution(s, T).passed


def test_attribution_is_judged_on_the_heads_that_matter_and_on_overlap_alone_when_too_few_do() -> None:
    s = patching_summary(spearman=0.99)
    s = with_comparison(s, spearman_active=0.6, n_active=11, active=0.01)
    low = check_attribution(s, T)
    assert not low.passed and low.value == 0.6 and "over the 11 of 32 heads" in low.detail
    s = with_comparison(s, spearman_active=0.95)
    assert check_attribution(s, T).passed
    s = with_comparison(s, spearman_active=None, n_active=2, spearman=0.1)  # a sparse circuit
    sparse = check_attribution(s, T)
    assert sparse.passed and "too few to rank" in sparse.detail  # overlap 0.7 judges alone
    s = with_comparison(s, topk_overlap=0.0)
    assert not check_attribution(s, T).passed
    with pytest.raises(TomlensError, match="attribution_steps"):
        ValidateConfig(attribution_steps=0)
    with pytest.raises(TomlensError, match="attribution_path"):
        ValidateConfig(attribution_path="heads")


def test_the_runs_layer_names_the_same_attribution_paths_as_the_patching_code() -> None:
    """The runs layer keeps its own copy (a config is read without torch): it must not drift."""
    from tomlens.patching.attribution import IG_PATHS
    from tomlens.runs.patching import ATTRIBUTION_PATHS, DEFAULT_ATTRIBUTION_PATH, PatchingConfig

    assert ATTRIBUTION_PATHS == IG_PATHS and DEFAULT_ATTRIBUTION_PATH == "sites"
    assert ValidateConfig().attribution_path == PatchingConfig().attribution_path == DEFAULT_ATTRIBUTION_PATH
    with pytest.raises(TomlensError, match="attribution_path"):
        PatchingConfig(attribution_path="heads")


def test_a_withheld_or_forced_patching_stage_fails_every_patching_check_with_its_reason() -> None:
    withheld = fake_patching_summary(withheld="withheld: gap not above 0")
    for c in (check_recovery(withheld, 1, T, n_heads_total=8), check_attribution(withheld, T),
              check_ablation(withheld, 1, T, n_heads_total=8)):
        assert not c.passed and "gap not above 0" in c.detail
    forced = patching_summary(forced=True)
    for c in (check_recovery(forced, 1, T, n_heads_total=8), check_attribution(forced, T),
              check_ablation(forced, 1, T, n_heads_total=8)):
        assert not c.passed and "forced" in c.detail and math.isfinite(c.value)


def test_steering_check() -> None:
    assert check_steering(steering_summary((0.8, 0.1)), T).passed  # at both thresholds
    # the layer is the selection half's best, never the evaluation half's
    picked = check_steering(steering_summary((0.95, 0.3, 0.7), (0.85, 0.05, 0.9)), T)
    assert picked.passed and picked.value == 0.85 and "layer 1" in picked.detail
    fails = check_steering(steering_summary((0.95, 0.3, 0.9), (0.85, 0.05, 0.7)), T)
    assert not fails.passed and fails.value == 0.95 and "null 0.300 is not <= 0.1" in fails.detail
    shuffled = check_steering(steering_summary((0.9, 0.0, 0.9, 0.9)), T)
    assert not shuffled.passed and "shuffled-label direction flips 0.900" in shuffled.detail
    empty = check_steering(None, T, withheld="the steering stage is not available")
    assert not empty.passed and "not available" in empty.detail


def test_steering_is_judged_on_the_random_directions_mean_and_95th_percentile_never_their_maximum() -> None:
    """The organism at --seed 4242: the belief direction flips every held-out false-belief answer;
    of its 20 random directions the most-flipping one flips 0.125, their 95th percentile 0.085,
    their mean 0.019. A bound on the maximum failed it, and would fail any model once enough
    directions are drawn (the maximum of more draws is larger); the mean and the quantile do not
    grow with the draws."""
    seed_4242 = check_steering(steering_summary((1.0, 0.019, 1.0, 0.0, 0.085, 0.125)), T)
    assert seed_4242.passed and seed_4242.null == pytest.approx(0.019) and seed_4242.null_threshold == 0.1
    assert "95th percentile 0.085" in seed_4242.detail and "maximum 0.125" in seed_4242.detail
    assert "a maximum grows with the number of directions drawn" in seed_4242.detail
    heavy = check_steering(steering_summary((1.0, 0.05, 1.0, 0.0, 1.0, 1.0)), T)  # a tail above 5% flips all
    assert not heavy.passed and "95th percentile flips 1.000 >= the belief direction's 1.000" in heavy.detail
    on_average = check_steering(steering_summary((1.0, 0.15, 1.0, 0.0, 0.3)), T)
    assert not on_average.passed and "null 0.150 is not <= 0.1" in on_average.detail
    old = summary_to_dict(steering_summary((1.0, 0.0)))  # a result.json from before the mean was recorded
    del old["layers"][0]["random_mean"]
    with pytest.raises(TomlensError, match="rerun the steering stage"):
        summary_from_dict(SteeringSummary, old, folder="old", stage="steering")


def test_thresholds_come_from_the_config() -> None:
    loose = Thresholds(min_probe=0.9, max_random_flip=0.35)
    assert check_probe(selection(score=0.92), loose).passed and not check_probe(selection(score=0.92), T).passed
    assert check_steering(steering_summary((0.95, 0.3)), loose).passed
    cfg = config_from_dict(ValidateConfig, {"model": {"name": "tiny-llama"}, "n_tasks": 8,
                                            "thresholds": {"min_probe": 0.9}})
    assert cfg.thresholds.min_probe == 0.9 and cfg.thresholds.max_bow == 0.6
    assert config_from_dict(ValidateConfig, config_to_dict(cfg)) == cfg
    with pytest.raises(TomlensError, match="min_prob"):
        config_from_dict(ValidateConfig, {"thresholds": {"min_prob": 0.9}})
    with pytest.raises(TomlensError, match="between 0 and 1"):
        Thresholds(max_bow=1.2)
    with pytest.raises(TomlensError):
        ValidateConfig(n_tasks=2)
    with pytest.raises(TomlensError):
        ValidateConfig(n_random_heads=0)


def test_default_k_is_five_percent_of_heads_at_least_one() -> None:
    assert default_k(8) == 1 and default_k(16) == 1 and default_k(40) == 2 and default_k(144) == 7


def test_result_passes_only_when_every_check_does_and_round_trips(tmp_path) -> None:
    good = [check_probe(selection(), T), *(check(patching_summary()) for check in (
        lambda s: check_recovery(s, 1, T, n_heads_total=64), lambda s: check_attribution(s, T),
        lambda s: check_ablation(s, 1, T, n_heads_total=64))), check_steering(steering_summary((0.9, 0.0)), T)]
    assert [c.check for c in good] == list(CHECKS)
    cfg = ValidateConfig(n_tasks=8)
    ok = ValidationResult(cfg, table_of(good), validation_summary(good))
    assert ok.passed and ok.exit_code == 0 and "5 of 5 checks pass: PASSED" in ok.describe()
    worse = [*good[:4], check_steering(None, T, withheld="no stage")]
    bad = ValidationResult(cfg, table_of(worse), validation_summary(worse))
    assert not bad.passed and bad.exit_code == 1 and "FAIL  steering" in bad.describe()
    back = ValidationResult.load(bad.save(tmp_path / "v"))
    assert back.config == cfg and list(back.table["passed"]) == [True] * 4 + [False]
    assert back.describe() == bad.describe() and (tmp_path / "v" / "checks.csv").is_file()
    assert repr(back.summary) == repr(bad.summary)  # repr: a NaN (the withheld check's value) equals no NaN
    assert exit_code(True) == 0 and exit_code(False) == 1


def test_cli_bad_input_exits_2_before_any_model_loads(capsys) -> None:
    assert main(["validate", "--model", "tiny-llama", "--min-flip", "1.5", "--out", "unused"]) == 2
    assert "min_flip" in capsys.readouterr().err
    assert main(["validate", "--model", "tiny-llama", "--n-tasks", "1", "--out", "unused"]) == 2


def test_steering_depths_place_the_same_relative_layers_in_models_of_any_depth(capsys) -> None:
    from tomlens.runs.validate import ValidateConfig, steering_layers

    config = ValidateConfig(steering_depths=(0.25, 0.5, 0.75))
    assert steering_layers(config, 30) == (7, 15, 22)  # 14.5 rounds up, as 2.5 and 8.5 do
    assert steering_layers(config, 18) == (4, 9, 13)
    assert steering_layers(config, 5) == (1, 2, 3)
    assert steering_layers(ValidateConfig(steering_depths=(0.0, 0.1, 1.0)), 2) == (0, 1)  # merged, ends kept
    assert steering_layers(ValidateConfig(steering_layers=(2,)), 30) == (2,)
    assert steering_layers(ValidateConfig(), 30) is None  # the stage's default: every layer
    assert config_from_dict(ValidateConfig, config_to_dict(config)).steering_depths == (0.25, 0.5, 0.75)
    with pytest.raises(TomlensError, match="not both"):
        ValidateConfig(steering_layers=(1,), steering_depths=(0.5,))
    with pytest.raises(TomlensError, match="between 0 and 1"):
        ValidateConfig(steering_depths=(0.5, 2.0))
    assert main(["validate", "--model", "tiny-llama", "--depths=0.5,1.5", "--out", "unused"]) == 2
    assert "between 0 and 1" in capsys.readouterr().err
