"""The validation stage: the method checks, each with its number, its threshold and pass/fail.

Why: a probe or a head ranking is only as trustworthy as the evidence that the method finds belief
where belief is known to be (a model trained to track it, `tom-organism`) and does not find it
where it is not (its random twin). One run of three stages on order-only stories (the words are the
same in both conditions, so a bag of words is at chance by construction) answers five questions:

1. probe: the unit chosen on the selection half (`runs.probes`, resid_post every layer, the belief
   question's final token) scores >= `min_probe` on held-out stories, its verdict is "found", and the bag-of-words
   baseline on the same split stays at chance (<= `max_bow`);
2. top-k recovery: the k heads ranked on selection pairs (`runs.patching`, exact, heads at
   `head_position`) recover >= `min_recovery` of the false-minus-true-belief gap on held-out pairs,
   while k layer-matched random heads recover <= `max_random_recovery` (mean over draws);
3. attribution vs exact: Spearman >= `min_spearman` over the heads that move the metric by 1% of
   the gap in either method (selection pairs, same position; over all heads it is carried by the
   many that do nothing in both, and passed while the head that matters was ranked ninth),
   attribution's top-k heads hold at least `min_topk_overlap` of exact patching's, and the head
   exact patching ranks first is among them (half the top 2 passed a ranking that put it third);
4. mean ablation: top-k heads ablated leave false-belief accuracy <= `max_ablated_accuracy`,
   k random heads (mean over draws) >= `min_random_ablated_accuracy`;
5. steering (`runs.steering`): the belief direction flips >= `min_flip` of false-belief answers at
   the layer and alpha chosen on the selection half (against random directions of its own), more
   than the norm-matched random directions' 95th percentile and the shuffled-label direction, and
   the random directions flip <= `max_random_flip` on average.

Every control is summarised by a number that does not grow with how many random draws were made:
the mean over random head sets (checks 2 and 4), the mean and 95th percentile of the random
directions (check 5). A maximum over draws does grow: the steering check once needed the
most-flipping of its random directions at <= 0.10, and `--seed 4242` failed it on the organism
(that direction flipped 0.125; their 95th percentile 0.085, their mean 0.019) although the belief
direction flipped every held-out answer: with more directions drawn it would fail any model.

A value equal to its threshold passes. A check whose stage is withheld (the patching gate failed,
too few story groups, the stage refused its input, a forced run) FAILS with the reason in `detail`:
it never passes and never crashes the run. k defaults to floor(5% of all heads), at least 1; a
larger k is allowed and said in the detail of the checks that use it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd

from tomlens.errors import TomlensError
from tomlens.messages import say
from tomlens.models.protocol import Model
from tomlens.runs.base import ModelSpec, StimuliSpec
from tomlens.runs.files import check_store_writable, summary_from_dict, summary_to_dict
from tomlens.runs.patching import (
    ATTRIBUTION_PATHS,
    DEFAULT_ATTRIBUTION_PATH,
    DEFAULT_ATTRIBUTION_STEPS,
    check_patching_words,
)
from tomlens.vocabulary import one_of

if TYPE_CHECKING:
    from tomlens.runs.patching_summary import Comparison, PatchingSummary
    from tomlens.runs.steering_summary import SteeringSummary

__all__ = ["CHECKS", "Check", "Thresholds", "ValidateConfig", "ValidationResult", "ValidationSummary", "check_ablation",
           "check_attribution", "check_probe", "check_recovery", "check_steering", "default_k", "exit_code",
           "fast_config", "run", "steering_layers", "table_of"]

FAMILY = "order-only"
TARGET = "protagonist_belief"
CHECKS: tuple[str, ...] = ("probe", "topk_recovery", "attribution", "mean_ablation", "steering")
TOLERANCE = 1e-9  # a value equal to its threshold passes, whatever the float rounding of 19/20 or 4/5
K_SHARE = 0.05  # the "k at most 5% of all heads"
COLUMNS = ["check", "value", "threshold", "comparison", "passed", "null", "null_threshold", "null_comparison",
           "detail"]


@dataclass(frozen=True)
class Thresholds:
    """The issue's defaults; every one can be changed (a TOML table, or the CLI's flags)."""

    min_probe: float = 0.95
    max_bow: float = 0.6
    min_recovery: float = 0.8
    max_random_recovery: float = 0.2
    min_spearman: float = 0.8
    min_topk_overlap: float = 0.5  # and attribution's top k must hold at least this share of exact's
    max_ablated_accuracy: float = 0.6
    min_random_ablated_accuracy: float = 0.9
    min_flip: float = 0.8
    max_random_flip: float = 0.1  # the random directions' MEAN flip rate (their maximum grows with the draws)

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "min_spearman":
                if not -1.0 <= v <= 1.0:
                    raise TomlensError(f"threshold min_spearman = {v} is not a correlation",
                                       "use a number between -1 and 1")
            elif not 0.0 <= v <= 1.0:
                raise TomlensError(f"threshold {f.name} = {v} is not a share between 0 and 1",
                                   f"use a number between 0 and 1 for {f.name}")


@dataclass(frozen=True)
class ValidateConfig:
    """One validation: the model, the order-only tasks (`n_tasks`; each gives false- and true-belief
    stories and one minimal pair), the thresholds, k (None: floor(5% of heads), at least 1) and the
    sizes of the nulls. `store`: the activation store of the probe stage."""

    model: ModelSpec = field(default_factory=ModelSpec)
    n_tasks: int = 48
    thresholds: Thresholds = field(default_factory=Thresholds)
    k: int | None = None
    seed: int = 0
    select_fraction: float = 0.5
    n_permutations: int = 1000  # the probe's max-statistic null (cheap: one solve serves all)
    n_random_heads: int = 200  # layer-matched random head sets per k (all of them where there are fewer)
    n_random_directions: int = 20  # norm-matched random steering directions
    attribution_steps: int = DEFAULT_ATTRIBUTION_STEPS  # integrated gradients (1: plain attribution patching)
    attribution_path: str = DEFAULT_ATTRIBUTION_PATH  # what they move: each layer's heads in turn, or the embeddings
    head_position: str = "final"  # where heads are patched, ranked and compared
    ablation: str = "final"  # mean ablation at the final token, or at every position ("all")
    steering_layers: tuple[int, ...] | None = None  # None: the steering stage's default
    # or relative depths in [0, 1] (0: the first layer, 1: the last), the same places in models of
    # different depth: each becomes round(depth * (n_layers - 1)) once the model is loaded
    steering_depths: tuple[float, ...] | None = None
    alphas: tuple[float, ...] | None = None  # None: the steering stage's default grid
    store: str | None = None
    batch_size: int | None = None
    format: str = "csv"

    def __post_init__(self) -> None:
        if not isinstance(self.thresholds, Thresholds):
            raise TomlensError("thresholds must be a Thresholds table", "e.g. thresholds = {min_probe = 0.9}")
        if self.n_tasks < 4:
            raise TomlensError(f"n_tasks = {self.n_tasks} is too few to split into selection and held-out halves",
                               "use at least 4 order-only tasks (the organism's checks use 48)")
        if self.k is not None and self.k < 1:
            raise TomlensError(f"k = {self.k} must be at least 1", "leave k out (5% of heads) or pass 1 or more")
        if not 0 < float(self.select_fraction) < 1:
            raise TomlensError(f"select_fraction = {self.select_fraction}", "use a fraction strictly between 0 and 1")
        if int(self.attribution_steps) < 1:
            raise TomlensError(f"attribution_steps = {self.attribution_steps}",
                               "use 1 (plain attribution patching) or more (integrated gradients, e.g. 8)")
        one_of("attribution_path", self.attribution_path, ATTRIBUTION_PATHS)
        check_patching_words(("heads",), (self.head_position,))
        for name in ("n_permutations", "n_random_heads", "n_random_directions"):
            if getattr(self, name) < 1:
                raise TomlensError(f"{name} = {getattr(self, name)}: a check without its null cannot fail",
                                   f"use {name} of 1 or more")
        one_of("ablation", self.ablation, ("final", "all"))
        one_of("format", self.format, ("csv", "parquet"))
        if self.steering_layers is not None and self.steering_depths is not None:
            raise TomlensError("both steering_layers and steering_depths are given (--layers and --depths)",
                               "give layers (absolute) or depths (fractions of the model's depth), not both")
        if self.steering_depths is not None and any(not 0.0 <= float(d) <= 1.0 for d in self.steering_depths):
            raise TomlensError(f"steering_depths {list(self.steering_depths)} are not all between 0 and 1",
                               "give fractions of the depth, e.g. 0.25,0.5,0.75")
        for name in ("steering_layers", "steering_depths", "alphas"):
            v = getattr(self, name)
            if v is not None:
                object.__setattr__(self, name, tuple(v))
                if not v:
                    raise TomlensError(f"{name} is empty", f"leave {name} out for the default, or give some")

    def stimuli(self) -> StimuliSpec:
        return StimuliSpec(family=FAMILY, n=self.n_tasks, seed=self.seed)

    def belief_questions(self) -> StimuliSpec:
        """The same tasks' belief questions only: where a belief probe is read (at a reality question's
        final token the protagonist's belief plays no part in the answer)."""
        return StimuliSpec(family=FAMILY, n=self.n_tasks, seed=self.seed, options={"prompt_types": ["belief"]})


def fast_config(model: str, **overrides: Any) -> ValidateConfig:
    """Small settings for the test suite (a model that passes at these sizes passes at the defaults
    only more surely): 16 tasks, 200 permutations, 50 random head sets, 20 random directions."""
    settings: dict[str, Any] = {"n_tasks": 16, "n_permutations": 200, "n_random_heads": 50,
                                "n_random_directions": 20}
    settings.update(overrides)
    return ValidateConfig(model=ModelSpec(name=model), **settings)


def default_k(n_heads_total: int) -> int:
    """floor(5% of all heads), at least 1."""
    return max(1, math.floor(K_SHARE * n_heads_total))


# --------------------------------------------------------------------------------------------
# The checks: plain functions of each stage's result, so they can be tested on synthetic results.


@dataclass(frozen=True)
class Check:
    """One row of the table: the method's number against its threshold and its control (`null`)
    against the control's threshold; `passed` only when both hold and the stage was not withheld."""

    check: str
    value: float
    threshold: float
    comparison: str  # ">=" or "<="
    passed: bool
    null: float
    null_threshold: float
    null_comparison: str
    detail: str

    def line(self) -> str:
        verdict = "PASS" if self.passed else "FAIL"
        null = "no null" if self.null_comparison == "-" else \
            f"null {_num(self.null)} (needs {self.null_comparison} {self.null_threshold:g})"
        return (f"{verdict}  {self.check:<14} {_num(self.value)} (needs {self.comparison} {self.threshold:g}); "
                f"{null}: {self.detail}")


def _num(v: float) -> str:
    return "nan" if not math.isfinite(v) else f"{v:.3f}"


def meets(value: float, threshold: float, comparison: str) -> bool:
    """`value` against `threshold` ("<=" or ">="), equal passing; NaN never passes."""
    if not math.isfinite(value):
        return False
    if comparison == ">=":
        return value >= threshold - TOLERANCE
    if comparison == "<=":
        return value <= threshold + TOLERANCE
    raise ValueError(f"comparison {comparison!r}")


def _float(v: Any) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return float("nan")


def _judge(name: str, value: float, threshold: float, comparison: str, null: float, null_threshold: float,
           null_comparison: str, *, withheld: str = "", described: str = "") -> Check:
    """A row: passes only when the stage was not withheld and both numbers meet their thresholds."""
    reasons = [withheld] if withheld else []
    if not withheld:
        if not meets(value, threshold, comparison):
            reasons.append(f"value {_num(value)} is not {comparison} {threshold:g}")
        if not meets(null, null_threshold, null_comparison):
            reasons.append(f"null {_num(null)} is not {null_comparison} {null_threshold:g}")
    passed = not reasons
    detail = "; ".join(x for x in [described, *reasons] if x)
    return Check(name, value, threshold, comparison, passed, null, null_threshold, null_comparison, detail)


def _withheld_check(name: str, t: Thresholds, reason: str) -> Check:
    spec = {"probe": (t.min_probe, ">=", t.max_bow, "<="),
            "topk_recovery": (t.min_recovery, ">=", t.max_random_recovery, "<="),
            "attribution": (t.min_spearman, ">=", float("nan"), "-"),
            "mean_ablation": (t.max_ablated_accuracy, "<=", t.min_random_ablated_accuracy, ">="),
            "steering": (t.min_flip, ">=", t.max_random_flip, "<=")}[name]
    nan = float("nan")
    return Check(name, nan, spec[0], spec[1], False, nan, spec[2], spec[3], f"withheld: {reason}")


def check_probe(selection: Any, t: Thresholds, *, withheld: str = "") -> Check:
    """Check 1 from a `tomlens.probes.selection.SelectionResult` (None: the stage did not run)."""
    if withheld or selection is None:
        return _withheld_check("probe", t, withheld or "the probe stage chose no unit")
    e = selection.evaluation
    value = _float(e.score) if e is not None else float("nan")
    bow = selection.baselines.get("bag_of_words")
    null = _float(bow.score) if bow is not None else float("nan")
    stage = "" if selection.verdict == "found" else f"the probe stage withheld its unit: {selection.reason}"
    desc = (f"{selection.site} chosen on {selection.n_selection} selection rows, held-out evaluation on "
            f"{selection.n_evaluation}" + (f" [{e.ci_low:.2f}, {e.ci_high:.2f}]" if e is not None else "")
            + f", p_max {_num(_float(selection.p_max))} ({selection.n_perm} permutations); null = bag of words"
            + ("" if bow is not None else " (not run)"))
    return _judge("probe", value, t.min_probe, ">=", null, t.max_bow, "<=", withheld=stage, described=desc)


def _patching_withheld(summary: PatchingSummary) -> str:
    if summary.withheld:
        return "the patching stage was withheld: " + summary.withheld.removeprefix("withheld: ")
    if summary.forced:
        return "the patching stage was forced past its gate or split (a forced run never passes)"
    return ""


def _k_note(k: int, n_heads_total: int) -> str:
    limit = K_SHARE * n_heads_total
    return f"k = {k} of {n_heads_total} heads" + (f" (above 5% = {limit:g}: recorded, not refused)"
                                                   if k > max(1, limit) else "")


def check_recovery(summary: PatchingSummary, k: int, t: Thresholds, *, n_heads_total: int) -> Check:
    """Check 2 from a patching summary (`PatchingRunResult.summary`): top-k recovery at k on held-out
    pairs against the mean of the layer-matched random sets."""
    why = _patching_withheld(summary)
    r = summary.topk_at(k)
    if r is None:
        return _withheld_check("topk_recovery", t, why or f"no top-k recovery at k = {k} in the patching run")
    desc = (f"{_k_note(k, n_heads_total)}: {r.heads} on {summary.validated_on or 'held-out pairs'}, "
            f"ranked {summary.ranked_by or ''}; null = mean of {r.n_random} layer-matched random sets "
            f"(of {r.n_distinct}), p_random {_num(_float(r.p_random))}")
    return _judge("topk_recovery", _float(r.top_effect), t.min_recovery, ">=", _float(r.random_mean),
                  t.max_random_recovery, "<=", withheld=why, described=desc)


def check_attribution(summary: PatchingSummary, t: Thresholds, *, direction: str = "denoise",
                      ranking: Check | None = None) -> Check:
    """Check 3: Spearman of attribution against exact patching over heads at the ranking position.

    Agreement is evidence only about a ranking that carries belief: on a random model both methods
    are near-linear and agree closely about noise (tiny-llama: Spearman 0.98). So with `ranking`
    (check 2) given, the check fails unless that check passed; the Spearman is still reported."""
    why = _patching_withheld(summary)
    if not why and ranking is not None and not ranking.passed:
        why = ("the exact ranking it is compared with carries no belief (top-k recovery failed), so agreement "
               "with it is agreement about noise")
    rows = summary.head_comparisons(direction)
    if not rows:
        return _withheld_check("attribution", t, why or "no attribution-vs-exact comparison over heads in the "
                                                        "patching run")
    c = rows[0]
    steps, along = summary.attribution_steps, summary.attribution_path
    how = ("plain attribution" if steps == 1 else f"integrated gradients, {steps} steps"
           + (f" along the {along}" if along else "")) if steps else "attribution"
    overlap = _float(c.topk_overlap)
    value, over, sparse = _attribution_value(c)
    top, rank = c.exact_top, c.exact_top_rank
    where = f", exact patching's top head {top} is attribution's #{rank} (needs to be in its top {c.k})" \
        if top is not None and rank is not None else ""
    desc = (f"{how}, Spearman {over}, heads at {summary.rank_position} on the selection pairs, top-{c.k} overlap "
            f"{_num(overlap)} (needs >= {t.min_topk_overlap:g}){where}; no null (unrelated rankings give a "
            "Spearman near 0)")
    reasons = [why] if why else [
        *([] if sparse or meets(value, t.min_spearman, ">=") else
          [f"value {_num(value)} is not >= {t.min_spearman:g}"]),
        *([] if meets(overlap, t.min_topk_overlap, ">=") else
          [f"attribution's top {c.k} hold {_num(overlap)} of exact patching's (not >= "
           f"{t.min_topk_overlap:g}): it misses heads exact patching finds"]),
        *([] if rank is None or int(rank) <= int(c.k or 0) else
          [f"it misses the head exact patching ranks first ({top}, its #{rank})"])]
    nan = float("nan")
    return Check("attribution", value, t.min_spearman, ">=", not reasons, nan, nan, "-",
                 "; ".join([desc, *reasons]))


def _attribution_value(c: Comparison) -> tuple[float, str, bool]:
    """(the Spearman judged, over what, whether too few heads matter to rank): over the heads that
    move the metric in either method; where fewer than 3 do, the Spearman over all heads is shown,
    not judged, and the top-k overlap alone judges."""
    if c.n_active < 3:
        return (_float(c.spearman), f"over all {c.n_cells} heads, shown, not judged: {c.n_active} heads move the "
                f"metric by >= {c.active:g} of the gap, too few to rank, so the top-k overlap alone judges", True)
    return (_float(c.spearman_active), f"over the {c.n_active} of {c.n_cells} heads moving the metric by >= "
            f"{c.active:g} of the gap in either method (over all heads {_num(_float(c.spearman))})", False)


def check_ablation(summary: PatchingSummary, k: int, t: Thresholds, *, n_heads_total: int) -> Check:
    """Check 4: false-belief accuracy with the top-k heads mean-ablated, and with k random heads
    (the unablated accuracy minus the mean drop over the layer-matched draws)."""
    why = _patching_withheld(summary)
    ab = summary.ablation
    rows = [r for r in (ab.table if ab is not None else ()) if r.k == k]
    if ab is None or not rows:
        return _withheld_check("mean_ablation", t, why or f"no mean ablation at k = {k} in the patching run")
    r = rows[0]
    base = _float(ab.baseline.fb_accuracy)
    random_acc = base - _float(r.random_fb_drop_mean)
    desc = (f"{_k_note(k, n_heads_total)}: {r.heads} ablated ({ab.mode}); unablated false-belief "
            f"accuracy {_num(base)}; null = mean over {r.n_random} layer-matched random sets, p_random "
            f"{_num(_float(r.p_random))}")
    return _judge("mean_ablation", _float(r.fb_accuracy), t.max_ablated_accuracy, "<=", random_acc,
                  t.min_random_ablated_accuracy, ">=", withheld=why, described=desc)


def check_steering(summary: SteeringSummary | None, t: Thresholds, *, withheld: str = "") -> Check:
    """Check 5 from a steering summary (`SteeringResult.summary`, its `layers`; None when the stage
    did not run, with `withheld` saying why). The layer and
    dose are those whose belief direction beat the selection half's own random directions by the
    widest margin (`runs.steering.chosen_layer`: never chosen on held-out numbers); on the
    evaluation half its belief direction must flip >= min_flip of false-belief answers at that dose,
    more than the random directions' 95th percentile and than the shuffled-label direction, and the
    random directions' mean flip (the null) must stay <= max_random_flip.

    Why the mean and the 95th percentile, not the most-flipping random direction: the maximum of n
    random draws grows with n, so a check on it fails any model once enough directions are drawn
    (see `runs.steering`); the mean and the quantile estimate the same numbers at 20 draws or 200.
    The maximum and the empirical p-value are in the detail, not judged."""
    from tomlens.runs.steering import chosen_layer

    layers = list(summary.layers) if summary is not None else []
    if withheld or not layers:
        return _withheld_check("steering", t, withheld or "the steering stage reported no layer")
    best = chosen_layer(layers)
    fb, shuffled = _float(best.flip_false_belief), _float(best.shuffled)
    mean, p95 = _float(best.random_mean), _float(best.random_p95)
    desc = (f"layer {best.layer} (of {len(layers)} steered) and alpha {best.alpha}, both chosen on the "
            f"selection half; held-out flips: true belief {_num(_float(best.flip_true_belief))}, reality "
            f"{_num(_float(best.flip_reality))}; null = the mean flip of {best.n_random} norm-matched random directions "
            f"(95th percentile {_num(p95)}, which the belief direction must exceed; their maximum "
            f"{_num(_float(best.random_max))} and p_random {_num(_float(best.p_random))} are shown, not "
            "judged: a maximum grows with the number of directions drawn, a mean and a quantile do not), "
            f"shuffled-label direction {_num(shuffled)}; stage verdict {best.verdict}"
            + (f" ({best.reason})" if best.reason else ""))
    check = _judge("steering", fb, t.min_flip, ">=", mean, t.max_random_flip, "<=", described=desc)
    beaten = [f"the {name} flips {_num(other)} >= the belief direction's {_num(fb)}"
              for name, other in (("random directions' 95th percentile", p95), ("shuffled-label direction", shuffled))
              if math.isfinite(fb) and not (math.isfinite(other) and fb > other)]
    if beaten:
        check = Check(check.check, check.value, check.threshold, check.comparison, False, check.null,
                      check.null_threshold, check.null_comparison, "; ".join([check.detail, *beaten]))
    return check


def table_of(checks: Sequence[Check]) -> pd.DataFrame:
    """The checks as a table (one row each, `COLUMNS`)."""
    return pd.DataFrame([c.__dict__ for c in checks], columns=COLUMNS)


def exit_code(passed: bool) -> int:
    """0 when every check passes, 1 when one fails (2, bad input, is the CLI's TomlensError)."""
    return 0 if passed else 1


# --------------------------------------------------------------------------------------------
# The result

CHECK_NUMBERS = ("value", "threshold", "null", "null_threshold")  # a check's float columns (NaN when not measured)


@dataclass(frozen=True, kw_only=True)
class ValidationSummary:
    """What a validation run says about itself (result.json): the model and its provenance, the
    sizes and k it ran with, each check (the rows of checks.json) and whether all passed, where each
    stage's folder is (None: the stage refused) and how long it took."""

    command: str
    model: str
    provenance: dict[str, Any]
    n_tasks: int
    n_stories: int
    k: int
    heads: int
    k_above_5_percent: bool
    passed: bool
    checks: tuple[Check, ...]
    stages: dict[str, str | None]
    seconds: float


@dataclass
class ValidationResult:
    """The table of checks, the summary (result.json), and the stage results of this run (None after
    `load`: their folders are out/probes, out/patching, out/steering)."""

    config: ValidateConfig | None
    table: pd.DataFrame
    summary: ValidationSummary
    manifest: dict[str, Any] = field(default_factory=dict)
    stages: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def passed(self) -> bool:
        return bool(len(self.table)) and bool(self.table["passed"].astype(bool).all())

    @property
    def exit_code(self) -> int:
        return exit_code(self.passed)

    def describe(self) -> str:
        """One line per check (PASS/FAIL, number, threshold, null, why), then the verdict."""
        rows = [Check(**{c: r[c] for c in COLUMNS}) for r in self.table.to_dict(orient="records")]
        n = sum(bool(c.passed) for c in rows)
        head = f"validation of {self.summary.model} ({self.summary.n_tasks} order-only tasks, k = " \
               f"{self.summary.k}):"
        verdict = f"{n} of {len(rows)} checks pass: " + ("PASSED" if self.passed else "FAILED")
        return "\n".join([head, *(f"  {c.line()}" for c in rows), verdict])

    def save(self, out: str | Path) -> Path:
        """The stages' folders (probes/, patching/, steering/), then checks.<csv|parquet>, checks.json,
        config.json, manifest.json and, last, result.json."""
        from tomlens.io import write_json, write_table
        from tomlens.runs.files import begin_save, finish_save

        out = begin_save(out)
        for name, result in self.stages.items():
            if result is not None:
                result.save(out / name)
        fmt = self.config.format if self.config is not None else "csv"
        write_table(self.table, out / f"checks.{fmt}")
        write_json(self.table.to_dict(orient="records"), out / "checks.json")
        return finish_save(out, self.config, self.manifest, summary_to_dict(self.summary))

    @classmethod
    def load(cls, out: str | Path) -> ValidationResult:
        from tomlens.io import read_json
        from tomlens.runs.files import read_finished

        out, config, manifest, data = read_finished(out, ValidateConfig)
        summary = summary_from_dict(ValidationSummary, data, folder=out, stage="validate")
        rows = read_json(out / "checks.json")
        table = pd.DataFrame(rows, columns=COLUMNS)
        for c in CHECK_NUMBERS:
            table[c] = table[c].astype(float)
        table["passed"] = table["passed"].astype(bool)
        return cls(config, table, summary, manifest)


# --------------------------------------------------------------------------------------------
# The run


def _heads_total(model: Model) -> int:
    return int(model.cfg.n_layers) * int(model.cfg.n_heads)


def _plan(config: ValidateConfig, model: Model, k: int, n_stories: int, seconds_per_prompt: float) -> list[str]:
    """Rough forward-pass counts per stage and the time they take at the measured speed."""
    n_pairs = config.n_tasks  # one order-only pair per task
    sel = max(1, round(n_pairs * config.select_fraction))
    ev = max(1, n_pairs - sel)
    heads = _heads_total(model)
    probe = n_stories
    runs = config.attribution_steps if config.attribution_path == "embeddings" or config.attribution_steps == 1 \
        else 1 + (config.attribution_steps - 1) * (int(model.cfg.n_layers) + 1) / 2  # per layer, from its block on
    patch = 2 * n_pairs + heads * sel + round((1 + 3 * runs) * sel) + \
        (1 + config.n_random_heads) * ev * (1 + 2)
    n_alpha = len(config.alphas) if config.alphas else _default_alphas()
    chosen = steering_layers(config, int(model.cfg.n_layers))
    n_layers = len(chosen or range(int(model.cfg.n_layers)))
    where = (f"at layers {', '.join(map(str, chosen))}" if chosen else "at every layer") + (
        f" (depths {', '.join(map(str, config.steering_depths))} of {int(model.cfg.n_layers)} layers)"
        if config.steering_depths else "")
    steer = (config.n_random_directions + 2) * n_alpha * n_layers * n_stories
    total = probe + patch + 2 * n_stories * n_layers  # steering: one unsteered full pass per story and layer
    return [f"validate {config.model.name}: {n_stories} order-only stories ({config.n_tasks} tasks), "
            f"{heads} heads, k = {k}; three stages, each prints its own plan:",
            f"  probes   ~{probe:,} prompt forwards + probe fits and {config.n_permutations} permutations",
            f"  patching ~{patch:,} (exact and attribution on the selection pairs, top-k and ablation with "
            f"{config.n_random_heads} random sets on the held-out pairs)",
            f"  steering {where}: ~{steer:,} one-token passes (directions x alphas x layers x stories; each reuses its "
            "prompt's keys and values, so far cheaper than a forward)",
            f"  roughly {total:,} full prompt forwards at {1000 * seconds_per_prompt:.1f} ms each: about "
            f"{total * seconds_per_prompt / 60:.1f} min (an upper bound: the stages batch; probe fitting and the "
            "steering passes come on top)"]


def _default_alphas() -> int:
    """How many alphas the steering stage tries by default."""
    from tomlens.runs import steering

    return len(steering.SteeringConfig().alphas)


def _time_forward(model: Any, stimuli: Sequence[Any]) -> float:
    """Seconds per prompt of one plain batched forward (a rough speed for the plan). `model` is any
    callable forward (typed `Any`: the timing test passes a stand-in that only runs)."""
    from tomlens.timing import time_call

    texts = [s.text for s in stimuli[:64]]  # a large batch: per-call overhead would dominate a small one
    return time_call(lambda: model(texts)) / max(1, len(texts))


def _stage(name: str, fn: Callable[[], Any]) -> tuple[Any, str]:
    """Run a stage; a TomlensError (the stage refused: too few groups, no aligned pair ...) becomes the
    reason its checks fail, not a crash of the whole validation."""
    try:
        return fn(), ""
    except TomlensError as e:
        return None, f"the {name} stage refused: {e.problem}" + (f" ({e.fix})" if e.fix else "")


def steering_layers(config: ValidateConfig, n_layers: int) -> tuple[int, ...] | None:
    """The layers steering runs at: `steering_layers`, or `steering_depths` placed in this model's
    depth (d x (n_layers - 1) rounded half up, duplicates merged), or None for the steering stage's
    default (every layer)."""
    if config.steering_depths is not None:
        return tuple(sorted({int(float(d) * (n_layers - 1) + 0.5) for d in config.steering_depths}))  # half up
    return config.steering_layers


def _steering_config(config: ValidateConfig, n_layers: int) -> Any:
    """The steering stage's config (`tomlens.runs.steering.SteeringConfig`), with this run's sizes and
    its verdict thresholds."""
    from tomlens.runs import steering

    t = config.thresholds
    wanted: dict[str, Any] = {"model": config.model, "stimuli": config.stimuli(), "seed": config.seed,
                              "n_random": config.n_random_directions, "select_fraction": config.select_fraction,
                              "target": TARGET, "format": config.format,
                              "min_flip": t.min_flip, "max_random_flip": t.max_random_flip, "store": config.store}
    if config.batch_size is not None:
        wanted["batch_size"] = config.batch_size
    layers = steering_layers(config, n_layers)
    if layers is not None:
        wanted["layers"] = layers
    if config.alphas is not None:
        wanted["alphas"] = config.alphas
    return steering.SteeringConfig(**wanted)


def run(config: ValidateConfig, *, model: Model | None = None, progress: bool = True) -> ValidationResult:
    """Run the probe, patching and steering stages on `config.model` and judge the five checks."""
    from tomlens.models import provenance
    from tomlens.provenance import run_manifest
    from tomlens.runs import patching, probes
    from tomlens.runs.pairs import PairsConfig
    from tomlens.stimuli.records import stimuli_hash

    started = time.time()
    stimuli = config.stimuli().load()
    check_store_writable(config)  # a read-only store: one clear error before the model loads
    if model is None:
        model = config.model.load()
    heads = _heads_total(model)
    k = config.k if config.k is not None else default_k(heads)
    if k > heads:
        raise TomlensError(f"k = {k} is more than the model's {heads} heads", f"pass k of 1 to {heads}")
    # every stage's settings are checked before any stage runs: bad input is exit 2 with nothing spent
    from tomlens.runs import steering

    n_layers = int(model.cfg.n_layers)
    scfg = _steering_config(config, n_layers)
    if scfg.layers is not None and max(scfg.layers) >= n_layers:
        raise TomlensError(f"steering layer {max(scfg.layers)} does not exist (the model has {n_layers} layers)",
                           f"pass --layers from 0 to {n_layers - 1}")
    pairs = PairsConfig(model=config.model, family=FAMILY, n=config.n_tasks, seed=config.seed)
    xcfg = patching.PatchingConfig(model=config.model, pairs=pairs, method="both", sites=("heads",),
                                   positions=(config.head_position,), direction="denoise", top_k=k, ks=(k,),
                                   n_random=config.n_random_heads, select_fraction=config.select_fraction,
                                   ablation=config.ablation, seed=config.seed, max_runs=None, format=config.format,
                                   attribution_steps=config.attribution_steps,
                                   attribution_path=config.attribution_path)
    pcfg = probes.ProbesConfig(model=config.model, stimuli=config.belief_questions(), targets=(TARGET,),
                               sites=("resid_post",), positions=("final",), store=config.store, seed=config.seed,
                               selection=True, select_fraction=config.select_fraction,
                               n_permutations=config.n_permutations, random_twin=False, format=config.format,
                               batch_size=config.batch_size)
    say("\n".join(_plan(config, model, k, len(stimuli), _time_forward(model, stimuli))))
    t = config.thresholds
    stages: dict[str, Any] = {}

    say("validate: stage 1 of 3, probes")
    stages["probes"], why = _stage("probes", lambda: probes.run(pcfg, model=model, progress=progress))
    selection = stages["probes"].selection.get(TARGET) if stages["probes"] is not None else None
    probe = check_probe(selection, t, withheld=why)

    say("validate: stage 2 of 3, patching")
    stages["patching"], why = _stage("patching", lambda: patching.run(xcfg, model=model, progress=progress))
    if stages["patching"] is None:
        rest = [_withheld_check(n, t, why) for n in ("topk_recovery", "attribution", "mean_ablation")]
    else:
        s = stages["patching"].summary
        recovery = check_recovery(s, k, t, n_heads_total=heads)
        rest = [recovery, check_attribution(s, t, ranking=recovery), check_ablation(s, k, t, n_heads_total=heads)]

    say("validate: stage 3 of 3, steering")
    stages["steering"], why = _stage("steering", lambda: steering.run(scfg, model=model, progress=progress))
    steer = check_steering(stages["steering"].summary if stages["steering"] is not None else None, t, withheld=why)

    checks = [probe, *rest, steer]
    table = table_of(checks)
    summary = ValidationSummary(
        command="validate", model=config.model.name, provenance=provenance(model), n_tasks=config.n_tasks,
        n_stories=len(stimuli), k=k, heads=heads, k_above_5_percent=k > default_k(heads),
        passed=bool(table["passed"].all()), checks=tuple(checks),
        stages={n: (f"{n}/" if r is not None else None) for n, r in stages.items()},
        seconds=round(time.time() - started, 2))
    manifest = run_manifest(model, config, stimuli_hash=stimuli_hash(stimuli))
    return ValidationResult(config, table, summary, manifest, stages)
