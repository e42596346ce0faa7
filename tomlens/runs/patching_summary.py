"""What a patching run found, as a frozen dataclass tree (`PatchingSummary`): the gate, the pairs and
their split, the baselines, attribution-vs-exact comparisons, top-k recovery, mean ablation, the plan
and the search bounds. Field names are result.json's keys, so a folder written before the summary
was typed reads back unchanged; one that lacks a field gets a single "rerun the stage" error
(`tomlens.runs.files.summary_from_dict`).

Why None and not NaN for a number that could not be computed (a Spearman over tied effects, an
interval over one pair): result.json writes NaN as null, so a NaN held in memory would come back as
None and a loaded summary would not equal the one saved. The builders here turn NaN into None once;
`num` turns it back for arithmetic and printing ("nan", as before).

A field with a default is left out of result.json while it holds that default (`summary_dict`):
the stages that did not run (no ranking, no search, a withheld run) write no key, as before.

No torch here: a report or a comparison reads a saved run without loading a model."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from tomlens.runs.base import config_from_dict
from tomlens.runs.files import summary_to_dict

T = TypeVar("T")

# What the summary says the numbers mean (written into every finished run's summary).
NORMALISATION = ("effect = (patched - corrupted) / mean(clean - corrupted) per pair; 0 = corrupted run, "
                 "1 = clean run")
CORRUPTION = ("minimal pairs: clean = false-belief story, corrupted = matched control differing only in the "
              "contrast span (token-aligned); denoise patches clean into corrupted, noise corrupted into clean")


def num(x: float | None) -> float:
    """A summary number as a float: None (not computed) is NaN, for arithmetic and "nan" in print."""
    return float("nan") if x is None else float(x)


def nan_free(value: Any) -> Any:
    """`value` with every float NaN (at any depth of dicts and lists) as None: what result.json holds."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, Mapping):
        return {k: nan_free(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [nan_free(v) for v in value]
    return value


def build(cls: type[T], data: Mapping[str, Any]) -> T:
    """`cls` from a dict a sweep or table made (NaN as None), through the config codec, so a key the
    type does not know is an error here rather than a silently dropped number."""
    return config_from_dict(cls, nan_free(data), where=cls.__name__)


def records(cls: type[T], rows: list[dict[str, Any]]) -> tuple[T, ...]:
    """A table's rows (`DataFrame.to_dict(orient="records")`) as `cls` rows."""
    return tuple(build(cls, r) for r in rows)


@dataclass(frozen=True, kw_only=True)
class ContrastGate:
    """One contrast's gate (= `tomlens.patching.gate.GateResult`, without torch): tasks `n`, the mean
    and SD of the per-task gaps, the one-sided lower bound and whether it is above 0."""

    contrast: str
    n: int
    mean: float | None
    sd: float | None
    lower: float | None
    passed: bool
    power_n: int | None
    message: str
    n_pairs: int | None


@dataclass(frozen=True, kw_only=True)
class GateSummary:
    """The gate over every aligned pair: per contrast, which passed, the message a reader sees once,
    whether the run was forced, how many pairs it let through and kept, and each half's mean gap."""

    method: str
    contrasts: dict[str, ContrastGate]
    passed: tuple[str, ...]
    dropped_contrasts: tuple[str, ...]
    message: str
    forced: bool
    n_gated: int
    n_passed_pairs: int
    n_patched: int
    half_gaps: dict[str, float]
    power: dict[str, str]


@dataclass(frozen=True, kw_only=True)
class PairHalf:
    """One half of the split: pairs, their hash and tasks (`same_as_selection`: the evaluation half only)."""

    n: int
    hash: str
    tasks: int
    same_as_selection: bool | None = None


@dataclass(frozen=True, kw_only=True)
class PairCounts:
    """The pairs given, token-aligned and kept, their hash, contrasts and dropped pairs (id, reason);
    on a run that patched, the families and the selection / evaluation halves."""

    n_given: int
    n_aligned: int
    n_kept: int
    hash: str
    families: tuple[str, ...] | None = None
    contrasts: tuple[str, ...]
    dropped: tuple[list[str], ...]  # [pair id, reason], as result.json holds them
    selection: PairHalf | None = None
    evaluation: PairHalf | None = None
    select_fraction: float | None = None


@dataclass(frozen=True, kw_only=True)
class Baseline:
    """A sweep's unpatched numbers (`PatchingResult.baselines`): mean clean and corrupted metric, their
    gap (the normaliser) with its standard error, whether it is unstable, and the pairs."""

    clean_logit_diff: float
    corrupted_logit_diff: float
    gap: float
    gap_se: float | None
    gap_unstable: bool
    n_pairs: int


@dataclass(frozen=True, kw_only=True)
class BaseLogitDiffs:
    """A withheld run's mean unpatched numbers over every aligned pair."""

    clean_logit_diff: float
    corrupted_logit_diff: float
    gap: float


@dataclass(frozen=True, kw_only=True)
class Comparison:
    """Attribution against exact patching over one kind and position (`tomlens.patching.compare`)."""

    direction: str
    kind: str
    position: str
    n_cells: int
    spearman: float | None
    pearson: float | None
    spearman_active: float | None
    n_active: int
    active: float
    k: int
    by: str
    topk_overlap: float | None
    exact_top: str | None
    exact_top_rank: int | None
    max_abs_diff: float | None


@dataclass(frozen=True, kw_only=True)
class TopKRow:
    """Top-k recovery at one k on the held-out pairs, against layer-matched random head sets."""

    k: int
    heads: str
    top_effect: float | None
    top_se: float | None
    top_ci_low: float | None
    top_ci_high: float | None
    random_mean: float | None
    random_low: float | None
    random_high: float | None
    random_reach: float | None
    p_random: float | None
    n_random: int
    n_distinct: int
    position: str
    direction: str


@dataclass(frozen=True, kw_only=True)
class AblationRow:
    """Mean ablation of the top-k heads at one k, against layer-matched random head sets."""

    k: int
    heads: str
    fb_accuracy: float | None
    tb_accuracy: float | None
    fb_drop: float | None
    clean_logit_diff: float | None
    random_fb_drop_mean: float | None
    random_fb_drop_low: float | None
    random_fb_drop_high: float | None
    random_tb_accuracy_mean: float | None
    random_reach: float | None
    p_random: float | None
    n_random: int
    n_distinct: int
    mode: str


@dataclass(frozen=True, kw_only=True)
class AblationBaseline:
    """The evaluation pairs unablated: false- and true-belief accuracy and mean logit differences."""

    fb_accuracy: float | None
    tb_accuracy: float | None
    clean_logit_diff: float | None
    corrupted_logit_diff: float | None


@dataclass(frozen=True, kw_only=True)
class AblationSummary:
    """Mean ablation: its mode, what the mean is, the unablated baseline and one row per k."""

    mode: str
    mean: str
    baseline: AblationBaseline
    table: tuple[AblationRow, ...]


@dataclass(frozen=True, kw_only=True)
class FalseNegativeBound:
    """The search's bound on cells its rule left out, for one kind and position."""

    kind: str
    position: str
    k: int
    threshold: float | None
    threshold_from: str
    n_cells: int
    n_verified_rule: int
    n_left_out: int
    n_sampled: int
    hits: int
    max_sampled_importance: float | None
    confidence: float
    fn_count_upper: int
    fn_rate_upper: float
    unresolved_by_budget: int
    meaning: str


@dataclass(frozen=True, kw_only=True)
class SearchReport:
    """What AtP* search did in one direction (`SearchResult.report`): settings, cells verified, bounds."""

    method: str
    direction: str
    k: int
    budget: int
    threshold: float | None
    fn_samples: int
    confidence: float
    qk_fix: bool
    graddrop: bool
    graddrop_blocks: int
    rounds: int
    unresolved_by_budget: int
    seconds_estimates: float
    seconds_samples: float
    seconds: float
    n_cells: int
    n_verified_rule: int
    n_verified_sample: int
    false_negatives: tuple[FalseNegativeBound, ...]


@dataclass(frozen=True, kw_only=True)
class PlanStageSummary:
    """One stage of the plan (= `tomlens.patching.plan.PlanStage`, without torch)."""

    name: str
    what: str
    units: int
    pairs: int
    runs: int
    cost: float
    forward: float
    done: int
    extra: str
    unit: str
    per_pair: int
    peak_bytes: int
    memory: str


@dataclass(frozen=True, kw_only=True)
class PlanSummary:
    """The plan as run (`Plan.to_dict`): stages, patched runs, memory peak, time estimate and notes."""

    stages: tuple[PlanStageSummary, ...]
    total_runs: int
    done_runs: int
    max_runs: int | None
    peak_bytes: int
    estimated_seconds: float | None
    calibration: str
    notes: tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class PatchingSummary:
    """The summary of a patching run (result.json). Every run has the fields without a default; a
    withheld run adds `withheld` and `base`; a run that patched adds what it ran (sweeps' baselines
    and comparisons, the ranking, top-k recovery, ablation, search); a forced one `forced` and
    `forced_message`. `provenance` is the loaded model's record (`tomlens.models.provenance`), kept
    as its plain dict: it is written whole and read whole, never field by field."""

    command: str
    provenance: dict[str, Any]
    seed: int
    withheld: str | None = None
    gate: GateSummary
    notes: tuple[str, ...]
    pairs: PairCounts
    metric: str
    base: BaseLogitDiffs | None = None
    normalisation: str | None = None
    corruption: str | None = None
    sites: tuple[str, ...] | None = None
    positions: dict[str, list[str]] | None = None  # lists: the codec reads a table's values as they are
    methods: tuple[str, ...] | None = None
    directions: tuple[str, ...] | None = None
    attribution_steps: int | None = None
    attribution_path: str | None = None
    baselines: dict[str, Baseline] | None = None
    comparisons: tuple[Comparison, ...] | None = None
    forced: bool = False
    forced_message: str | None = None
    rank_position: str | None = None
    top_heads: tuple[str, ...] | None = None
    ranked_by: str | None = None
    topk: tuple[TopKRow, ...] | None = None
    validated_on: str | None = None
    random_heads: str | None = None
    ablation: AblationSummary | None = None
    topk_skipped: str | None = None
    search: dict[str, SearchReport] | None = None
    dry_run: bool = False
    plan: PlanSummary | None = None
    seconds: float
    files: tuple[str, ...]

    def topk_at(self, k: int) -> TopKRow | None:
        """The top-k recovery row at `k`, or None when recovery did not run at that k."""
        return next((r for r in self.topk or () if r.k == k), None)

    def head_comparisons(self, direction: str | None = None) -> list[Comparison]:
        """Attribution-vs-exact comparisons over heads at the ranking position (of `direction`, if given)."""
        return [c for c in self.comparisons or () if c.kind == "head" and c.position == self.rank_position
                and (direction is None or c.direction == direction)]


def summary_dict(summary: Any) -> dict[str, Any]:
    """A summary as result.json holds it: `summary_to_dict`, less every field that holds its default
    (so a stage that did not run writes no key, as before the summary was typed)."""
    return _drop_defaults(summary, summary_to_dict(summary))


def _drop_defaults(value: Any, data: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _drop_defaults(getattr(value, f.name), data[f.name]) for f in dataclasses.fields(value)
                if f.default is dataclasses.MISSING or getattr(value, f.name) != f.default}
    if isinstance(value, (list, tuple)):
        return [_drop_defaults(v, d) for v, d in zip(value, data, strict=True)]
    if isinstance(value, Mapping):
        return {str(k): _drop_defaults(v, data[str(k)]) for k, v in value.items()}
    return data
