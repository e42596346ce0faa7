"""The probe sweep: a probe for every layer (and every layer x head) on cached activations.

For each target and site kind, probes are trained on grouped folds (no story on both sides) and
scored on the held-out stories: by default every story is held out once (cross-fitting, C chosen
inside each training split by a nested grouped CV), or on one held-out split, or on a second
stimulus set (`test_acts`). Next to each score sit, trained on the same folds in the same batched
fit: a type-level control task (one random label per template x cue x condition cell, scored on
its own labels with its own chance level `control_chance`; selectivity = score - control, paired
on the test stories; see `controls`) and a condition split (an arbitrary balanced split of the
set's conditions, least correlated with the target, scored on its own labels); the chance level
of a guess with the training class frequencies; and 95% intervals from resampling test stories.
Generalisation across conditions trains on true-belief stories and tests on false-belief stories
of held-out tasks (and the reverse, when the target varies there). An eval set whose test rows hold
one class of the target (a target fixed by the condition) is dropped with a note: accuracy there is
accuracy on one class, and a constant guess ties every baseline at 0 or 1. Where no cell level
recurs across a plan's folds, its control and selectivity are NaN (that control could not fail);
the metadata's `label_variation` says per target and condition whether the label varies.

The result is one tidy table: one row per (features, kind, layer, head, position, target, train_on,
eval_set, metric), head = -1 for whole-layer sites. `features` says what a row probed: "activations"
(at site `kind`), "embeddings" (the same probe on resid_pre layer 0) or a text baseline,
"bag_of_words", "length" or "position" (`kind` is empty there; see `baselines`). Every activation
row carries the baselines' scores on the same split (`baseline_*`), the best of them and
`above_baseline` = score - best_baseline. Every row says how its fits went (`fit_status`, the worst
over the probe, its control, its condition split and every split: "ok", "not_converged",
"solver_failed" or "non_finite_input"); a unit that could not be fitted keeps its rows, with NaN
scores, and the sweep goes on.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, Protocol, overload, runtime_checkable

import numpy as np
import pandas as pd
import torch
from torch import Tensor

from tomlens.devices import default_device
from tomlens.errors import TomlensError
from tomlens.messages import say
from tomlens.probes import stats
from tomlens.probes.base import Probe, encode_labels
from tomlens.probes.baselines import attach_baselines, length_features, position_features
from tomlens.probes.controls import (
    CELL_LEVELS,
    bag_of_words,
    choose_cell_level,
    condition_split,
    seen_share,
    split_labels,
    type_cells,
    type_control_labels,
)
from tomlens.probes.directions import direction_name, save_directions, unit_norm
from tomlens.probes.logistic import (
    C_GRID,
    LogisticProbe,
    ProbeFitWarning,
    cpu_threads_for,
    fit_logistic,
)
from tomlens.probes.mass_mean import MassMeanProbe
from tomlens.probes.newton import FIT_STATUS, NON_FINITE_INPUT, NOT_CONVERGED, OK, SOLVER_FAILED
from tomlens.probes.plan import ProbePlan
from tomlens.probes.resume import ChunkFit, FitCheckpoints, activations_identity, fit_settings, inputs_hash
from tomlens.probes.splits import GROUPINGS, Split, group_codes, group_kfold, holdout, restrict
from tomlens.probes.targets import (
    false_belief_mask,
    get_target,
    label_variation,
    make_target,
    true_belief_mask,
)
from tomlens.provenance import versions
from tomlens.stimuli.records import Stimulus, stimuli_hash
from tomlens.vocabulary import renamed_arguments

PROBES = ("logistic", "mass_mean")
DEFAULT_BUDGET_MINUTES = 60.0  # a Python call's default budget, as `tomlens probe --budget-minutes`
COLUMNS = ["features", "kind", "layer", "head", "position", "target", "probe", "train_on", "eval_set", "test_set",
           "metric", "score", "ci_low", "ci_high", "control", "control_ci_low", "control_ci_high", "control_chance",
           "selectivity", "selectivity_ci_low", "selectivity_ci_high", "condition_split", "condition_split_ci_low",
           "condition_split_ci_high", "chance", "n_train", "n_test", "n_test_groups", "C", "fit_status",
           "baseline_bow", "baseline_length", "baseline_position", "baseline_embeddings", "best_baseline",
           "best_baseline_name", "above_baseline"]
BASELINE_FEATURES = ("bag_of_words", "length", "position", "embeddings")
@runtime_checkable
class ActivationsLike(Protocol):
    """What the sweep needs from `tomlens.activations.ActivationSet`."""

    stimuli: list[Stimulus]
    manifest: dict[str, Any]

    def get(self, kind: str, position: str) -> Tensor: ...

    def layers(self, kind: str) -> list[int]: ...


@dataclass(frozen=True)
class SweepConfig:
    """How probes are trained and scored; every field is recorded in the provenance."""

    c_grid: tuple[float, ...] = C_GRID
    folds: int = 5  # outer grouped folds (held-out stories)
    # grouped folds inside each training split, to choose C: 3 (4 until issue 26 item 7; 3 fits the default
    # probe stage on 384 prompts in 5 minutes on 2 cores, and C is still chosen per unit by grouped CV)
    inner_folds: int = 3
    evaluation: str = "crossfit"  # "crossfit": every story tested once; "holdout": the first fold only
    group_by: str = "task"  # "task", "template" or "cue" (no task and no template / cue phrasing on both sides)
    n_boot: int = 1000
    level: float = 0.95
    controls: bool = True  # type-level control task for every probe
    condition_split: bool = True  # decode an arbitrary split of the conditions too
    bow: bool = True  # bag-of-words baseline
    length: bool = True  # prompt-length baseline
    position: bool = True  # the probed token's position baseline
    embeddings: bool = True  # the probe on resid_pre layer 0, when the activations hold it
    conditions: bool = True  # train on true-belief, test on false-belief (and the reverse)
    directions: bool = True  # fit on all rows and keep the directions
    device: str | None = None
    progress: bool = True
    unit_budget_bytes: float = 2.0**29  # activations per chunk of units
    check_every: int | None = None  # Newton steps between host reads (None: `cadence.check_every`'s default)
    show_plan: bool = True  # print the plan before fitting (with `progress`)
    budget_minutes: float | None = None  # refuse a plan estimated above this, before any fit

    def __post_init__(self) -> None:
        if self.evaluation not in ("crossfit", "holdout"):
            raise TomlensError(f"unknown evaluation {self.evaluation!r}", "use 'crossfit' or 'holdout'")
        if self.group_by not in GROUPINGS:
            raise TomlensError(f"unknown grouping {self.group_by!r}", f"use one of {', '.join(GROUPINGS)}")


@dataclass
class ProbeSweepResult:
    table: pd.DataFrame
    directions: dict[str, Tensor] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class _Plan:
    """Which rows train and which test, per split, for one `train_on` setting."""

    train_on: str
    eval_sets: dict[str, Tensor]  # name -> mask over test-pool rows
    splits: list[Split]


@dataclass
class _Extra:
    """Out-of-split decisions of one extra label vector (the control task, the condition split)."""

    scores: Tensor  # [U, n_test_pool] decision value for label 1
    predicted: Tensor  # [n_test_pool] bool: rows scored by a fit of this label vector
    chance_correct: Tensor  # [n_test_pool] chance of a frequency-matched guess of its labels


@dataclass
class _Outcome:
    """Out-of-split decisions of the probe and its extra label vectors for every test-pool row of one plan."""

    scores: Tensor  # [U, n_test_pool, k]
    predicted: Tensor  # [n_test_pool] bool
    chance_correct: Tensor  # [n_test_pool] chance of a frequency-matched guess
    classes: Tensor
    status: Tensor  # [U] worst fit status over splits, probe and extras (`FIT_STATUS` codes)
    extras: dict[str, _Extra] = field(default_factory=dict)
    n_train: list[int] = field(default_factory=list)
    C: list[Tensor] = field(default_factory=list)  # per split [U]


def _units(acts: ActivationsLike, kind: str, position: str) -> tuple[Tensor, list[int], int]:
    """Activations as `[n, unit, d]` (unit = layer or layer x head), layer ids, heads per layer."""
    X = acts.get(kind, position)
    layers = list(acts.layers(kind))
    if X.ndim == 3:
        return X, layers, 0
    if X.ndim == 4:
        n, nl, nh, d = X.shape
        return X.reshape(n, nl * nh, d), layers, nh
    raise TomlensError(f"activations of kind {kind!r} have shape {tuple(X.shape)}",
                       "expected [n, layer, d] or [n, layer, head, d]")


def _chunks(n_units: int, n: int, d: int, budget: float) -> list[slice]:
    per = max(1, int(budget // max(n * d * 4, 1)))
    return [slice(a, min(a + per, n_units)) for a in range(0, n_units, per)]


def _fit(probe: str, X: Tensor, Y: Tensor, groups: Tensor, cfg: SweepConfig, seed: int
         ) -> tuple[list[Probe], Tensor, Tensor]:
    """Fit the probe for each label vector in Y; returns probes, the chosen C per unit and the
    worst fit status per unit over the label vectors (the solver's warnings become that status)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ProbeFitWarning)
        if probe == "logistic":
            res = fit_logistic(X, Y, groups=groups, c_grid=cfg.c_grid, cv=cfg.inner_folds, seed=seed,
                               device=cfg.device, check_every=cfg.check_every)
            return [LogisticProbe.from_fit(res, i, cv=cfg.inner_folds, seed=seed, device=cfg.device,
                                           check_every=cfg.check_every)
                    for i in range(Y.shape[0])], res.C[0], res.status.amax(0)
        probes: list[Probe] = [MassMeanProbe(device=cfg.device).fit(X, Y[i]) for i in range(Y.shape[0])]
    fitted = torch.stack([torch.isfinite(p.coef_).flatten(1).all(1) & torch.isfinite(p.intercept_).all(1)
                          for p in probes]).all(0)
    status = torch.where(fitted, OK, SOLVER_FAILED)
    status[_non_finite_units(X)] = NON_FINITE_INPUT
    return probes, torch.full((X.shape[0],), float("nan"), dtype=torch.float64), status


def _non_finite_units(X: Tensor) -> Tensor:
    """Per unit of `[unit, n, d]` activations, whether any value is NaN or inf (on the CPU)."""
    return (~torch.isfinite(X).flatten(1).all(1)).cpu()


def _plans(train_st: Sequence[Stimulus], test_st: Sequence[Stimulus] | None, groups: Tensor,
           cfg: SweepConfig, seed: int) -> list[_Plan]:
    n = len(train_st)
    pool = test_st if test_st is not None else train_st
    fb_test, tb_test = false_belief_mask(pool), true_belief_mask(pool)
    fb_train, tb_train = false_belief_mask(train_st), true_belief_mask(train_st)
    if test_st is None:
        if cfg.folds < 2:  # `holdout` would read 1 / folds as a test fraction of 1
            raise TomlensError(f"folds = {cfg.folds}", "use at least 2 folds")
        # holdout: the first of the `folds` grouped folds, about 1 / folds of the stories
        outer = [holdout(groups, 1 / cfg.folds, seed)] if cfg.evaluation == "holdout" \
            else group_kfold(groups, cfg.folds, seed)
    else:
        outer = [Split(train=torch.arange(n), test=torch.arange(len(test_st)))]
    everything = torch.ones(len(pool), dtype=torch.bool)
    plans = [_Plan("all", {"all": everything, "false_belief": fb_test}, outer)]
    if cfg.conditions:
        for train_on, tr_mask, te_mask, name in (("true_belief", tb_train, fb_test, "false_belief"),
                                                 ("false_belief", fb_train, tb_test, "true_belief")):
            if bool(tr_mask.any()) and bool(te_mask.any()):
                splits = [restrict(s, tr_mask, te_mask) for s in outer]
                plans.append(_Plan(train_on, {name: te_mask}, splits))
    return plans


def _drop_one_class_sets(plans: list[_Plan], yte: Tensor, tname: str, notes: list[str]) -> list[_Plan]:
    """The plans without eval sets whose test rows hold one class of the target: accuracy there is
    accuracy on one class (a constant guess scores 0 or 1), so baselines and comparisons mean
    nothing. A plan left with no eval set is dropped (its fits would report nothing)."""
    out = []
    for plan in plans:
        keep = {}
        for name, mask in plan.eval_sets.items():
            if torch.unique(yte[mask]).numel() < 2 and (plan.train_on, name) == ("all", "all"):
                notes.append(f"{tname}: the test rows hold one class of the target (accuracy is on that class)")
                keep[name] = mask  # the main plan's folds are the sweep's folds: kept, with the note
            elif torch.unique(yte[mask]).numel() < 2:
                notes.append(f"{tname}: eval set {name} (train_on={plan.train_on}) dropped: the target has one "
                             "class there (constant within that condition)")
            else:
                keep[name] = mask
        if keep:
            out.append(replace(plan, eval_sets=keep))
    return out


def _chance(y_train: Tensor, y_test: Tensor) -> Tensor:
    """Per test row, the probability that a guess drawn with the training class frequencies is
    right: 0.5 for balanced binary labels, and still meaningful on an eval set of one class."""
    vals, counts = torch.unique(y_train, return_counts=True)
    freq = counts.to(torch.float64) / counts.sum()
    hit = y_test.unsqueeze(1) == vals.unsqueeze(0)
    return (hit.to(torch.float64) * freq).sum(1)


def _run_plan(plan: _Plan, probe: str, Xtr: Tensor, ytr: Tensor, gtr: Tensor, Xte: Tensor, yte: Tensor,
              cfg: SweepConfig, seed: int, tick: Callable[[], None],
              extras: dict[str, tuple[Tensor, Tensor]] | None = None) -> _Outcome | None:
    """Fit on each split's training rows, score its test rows; None when no split can be fitted.

    `extras` maps a name to 0/1 label vectors over the training rows and the test pool (the control
    task, the condition split): each is fitted beside the target, in the same batched fit when the
    target is binary, on every split where its training labels hold both classes."""
    extras = extras or {}
    n_pool = Xte.shape[1]
    out: _Outcome | None = None
    binary_target = torch.equal(torch.unique(ytr), torch.tensor([0, 1]))
    for i, split in enumerate(plan.splits):
        tick()
        tr, te = split.train, split.test
        if tr.numel() == 0 or te.numel() == 0 or torch.unique(ytr[tr]).numel() < 2 \
                or torch.unique(gtr[tr]).numel() < 2:
            continue
        names = [k for k, (lab, _) in extras.items() if torch.unique(lab[tr]).numel() == 2]
        extra_Y = [extras[k][0][tr] for k in names]
        if binary_target:  # one batched fit: the extras share every Gram matrix with the target
            probes, C, status = _fit(probe, Xtr[:, tr], torch.stack([ytr[tr], *extra_Y]), gtr[tr], cfg, seed + i)
            extra_probes = probes[1:]
            probes = probes[:1]
        else:  # the extras are binary, the target is not: one more fit for them
            probes, C, status = _fit(probe, Xtr[:, tr], ytr[tr].unsqueeze(0), gtr[tr], cfg, seed + i)
            extra_probes = []
            if extra_Y:
                extra_probes, _, st = _fit(probe, Xtr[:, tr], torch.stack(extra_Y), gtr[tr], cfg, seed + i)
                status = torch.maximum(status, st)
        Xs = Xte[:, te].to(torch.float64)
        s = probes[0].decision_function(Xs)  # [U, t, k]
        status[_non_finite_units(Xs)] = NON_FINITE_INPUT
        classes = probes[0].classes_
        if out is None:
            out = _Outcome(scores=torch.zeros(s.shape[0], n_pool, s.shape[2], dtype=torch.float64),
                           predicted=torch.zeros(n_pool, dtype=torch.bool),
                           chance_correct=torch.zeros(n_pool, dtype=torch.float64), classes=classes,
                           status=torch.zeros(s.shape[0], dtype=torch.long))
            out.extras = {k: _Extra(scores=torch.zeros(s.shape[0], n_pool, dtype=torch.float64),
                                    predicted=torch.zeros(n_pool, dtype=torch.bool),
                                    chance_correct=torch.zeros(n_pool, dtype=torch.float64)) for k in extras}
        if not torch.equal(out.classes, classes):
            continue  # a split missing a class cannot share the decision columns of the others
        out.status = torch.maximum(out.status, status.cpu())
        out.scores[:, te] = s.cpu()
        out.predicted[te] = True
        out.chance_correct[te] = _chance(ytr[tr], yte[te])
        for name, p in zip(names, extra_probes, strict=True):
            lab_tr, lab_te = extras[name]
            e = out.extras[name]
            e.scores[:, te] = p.decision_function(Xs)[..., 0].cpu()  # binary: one column, > 0 means 1
            e.predicted[te] = True
            e.chance_correct[te] = _chance(lab_tr[tr], lab_te[te])
        out.n_train.append(int(tr.numel()))
        out.C.append(C.cpu())
    return out


def _mode_c(cs: list[Tensor]) -> Tensor:
    """Per unit, the C chosen most often across splits (ties: the smaller); NaN (no C: mass-mean
    probes, failed fits) only where no split chose one."""
    stack = torch.stack(cs)  # [splits, U]
    if torch.isnan(stack).all():
        return stack[0]
    out = []
    for col in stack.T.numpy():
        col = col[~np.isnan(col)]
        if col.size == 0:
            out.append(float("nan"))
            continue
        vals, counts = np.unique(col, return_counts=True)
        out.append(float(vals[counts == counts.max()].min()))
    return torch.tensor(out, dtype=torch.float64)


def _paired_auroc_difference(a: Tensor, ya: Tensor, b: Tensor, yb: Tensor, groups: Tensor, cfg: SweepConfig,
                              seed: int) -> stats.Interval:
    """AUROC(a on labels ya) - AUROC(b on labels yb) on the same resampled test groups: the control
    is scored on its own labels, so `stats.bootstrap_auroc_difference` (one label vector) does not fit."""
    codes, counts = stats.group_draws(groups.cpu(), cfg.n_boot, seed)
    boot = stats.group_auroc(a, ya, codes, counts) - stats.group_auroc(b, yb, codes, counts)
    q = torch.tensor([(1 - cfg.level) / 2, 1 - (1 - cfg.level) / 2], dtype=boot.dtype)
    lo, hi = torch.nanquantile(boot, q, dim=0)
    return stats.Interval(stats.auroc(a, ya)[0] - stats.auroc(b, yb)[0], lo, hi)


def _nan_interval(u: int) -> stats.Interval:
    nan = torch.full((u,), float("nan"), dtype=torch.float64)
    return stats.Interval(nan, nan, nan)


def _extra_scores(outcome: _Outcome, name: str, sel: Tensor, labels: Tensor, correct: Tensor, y: Tensor,
                  metric: str, cfg: SweepConfig, seed: int, gte: Tensor
                  ) -> tuple[stats.Interval, stats.Interval, float] | None:
    """For one extra label vector on the eval rows `sel`: its score on its own labels, the paired
    difference score - extra on the rows both scored, and its chance level; None when not fitted."""
    e = outcome.extras.get(name)
    if e is None:
        return None
    ok = e.predicted[sel]
    if not bool(ok.any()):
        return None
    rows = sel[ok]
    lab = labels[rows]
    g = gte[rows]
    u = outcome.scores.shape[0]
    sc = e.scores[:, rows]
    if metric == "accuracy":
        corr = ((sc > 0).long() == lab).to(torch.float64)  # [U, t]
        est = stats.bootstrap_mean(corr, g, n_boot=cfg.n_boot, seed=seed, level=cfg.level)
        diff = stats.bootstrap_mean(correct[:, ok] - corr, g, n_boot=cfg.n_boot, seed=seed, level=cfg.level)
        return est, diff, float(e.chance_correct[rows].mean())
    if torch.unique(lab).numel() < 2:
        return _nan_interval(u), _nan_interval(u), 0.5
    yb = (y[ok] == outcome.classes[1]).long()
    est = stats.bootstrap_auroc(sc, lab, g, n_boot=cfg.n_boot, seed=seed, level=cfg.level)
    diff = _paired_auroc_difference(outcome.scores[:, rows, 0], yb, sc, lab, g, cfg, seed)
    return est, diff, 0.5


def _rows_for(outcome: _Outcome, plan: _Plan, yte: Tensor, gte: Tensor, cfg: SweepConfig, seed: int,
              unit_keys: list[tuple[int, int]], common: dict[str, Any],
              extra_labels: dict[str, Tensor] | None = None) -> list[dict[str, Any]]:
    classes = outcome.classes
    extra_labels = extra_labels or {}
    rows: list[dict[str, Any]] = []
    C = _mode_c(outcome.C).tolist()
    failed = (outcome.status >= SOLVER_FAILED).tolist()
    status = [FIT_STATUS[c] for c in outcome.status.tolist()]
    n_train = int(round(float(np.mean(outcome.n_train))))
    binary = classes.numel() == 2
    for eval_set, mask in plan.eval_sets.items():
        sel = (mask & outcome.predicted).nonzero().squeeze(1)
        if sel.numel() == 0:
            continue
        y = yte[sel]
        g = gte[sel]
        s = outcome.scores[:, sel]  # [U, t, k]
        pred = classes[(s[..., 0] > 0).long()] if binary else classes[s.argmax(-1)]
        correct = (pred == y).to(torch.float64)  # [U, t]
        acc = stats.bootstrap_mean(correct, g, n_boot=cfg.n_boot, seed=seed, level=cfg.level)
        metrics = [("accuracy", acc)]
        if binary and torch.unique(y).numel() == 2:
            yb = (y == classes[1]).long()
            au = stats.bootstrap_auroc(s[..., 0], yb, g, n_boot=cfg.n_boot, seed=seed, level=cfg.level)
            metrics.append(("auroc", au))
        chance = float(outcome.chance_correct[sel].mean())
        n_groups = len(set(g.tolist()))
        for metric, est in metrics:
            ctrl = _extra_scores(outcome, "control", sel, extra_labels["control"], correct, y, metric, cfg, seed,
                                 gte) if "control" in extra_labels else None
            split = _extra_scores(outcome, "condition_split", sel, extra_labels["condition_split"], correct, y,
                                  metric, cfg, seed, gte) if "condition_split" in extra_labels else None
            # every interval of this metric as host lists in one read, not one float() per unit
            names = ["score", "ci_low", "ci_high"]
            parts = [est]
            if ctrl is not None:
                names += ["control", "control_ci_low", "control_ci_high",
                          "selectivity", "selectivity_ci_low", "selectivity_ci_high"]
                parts += [ctrl[0], ctrl[1]]
            if split is not None:
                names += ["condition_split", "condition_split_ci_low", "condition_split_ci_high"]
                parts.append(split[0])
            values = torch.stack([torch.stack([iv.estimate, iv.low, iv.high]).to(torch.float64)
                                  for iv in parts]).reshape(len(names), -1).T.tolist()  # [U][names]
            for ui, (layer, head) in enumerate(unit_keys):
                row = {**common, "layer": layer, "head": head, "train_on": plan.train_on,
                       "eval_set": eval_set, "metric": metric, **dict(zip(names, values[ui], strict=True)),
                       "chance": chance if metric == "accuracy" else 0.5,
                       "n_train": n_train, "n_test": int(sel.numel()),
                       "n_test_groups": n_groups, "C": C[ui], "fit_status": status[ui]}
                if ctrl is not None:
                    row["control_chance"] = ctrl[2]
                if failed[ui]:  # no number from a probe (or control) that could not be fitted
                    row.update({k: float("nan") for k in _FIT_VALUES})
                rows.append(row)
    return rows


_CONTROL_VALUES = ("control", "control_ci_low", "control_ci_high", "selectivity", "selectivity_ci_low",
                   "selectivity_ci_high")
_FIT_VALUES = ("score", "ci_low", "ci_high", "control", "control_ci_low", "control_ci_high", "selectivity",
               "selectivity_ci_low", "selectivity_ci_high", "condition_split", "condition_split_ci_low",
               "condition_split_ci_high", "C")


def fit_summary(table: pd.DataFrame) -> str | None:
    """One line on the units whose probes failed or did not converge (None when all are "ok").

    A unit is one (features, target, kind, layer, head) of the table; its status is the worst of its rows."""
    if "fit_status" not in table or table.empty:
        return None
    code = table["fit_status"].map({name: i for i, name in enumerate(FIT_STATUS)})
    keys = [c for c in ("features", "target", "kind", "layer", "head") if c in table]
    worst = code.groupby([table[c] for c in keys]).max()
    counts = worst.value_counts()
    failed = {FIT_STATUS[c]: int(k) for c, k in sorted(counts.items()) if c >= SOLVER_FAILED}
    slow = int(counts.get(NOT_CONVERGED, 0))
    parts = []
    if failed:
        why = ", ".join(f"{k} {name}" for name, k in failed.items())
        parts.append(f"{sum(failed.values())} of {len(worst)} probe units could not be fitted ({why}): "
                     "their scores are NaN")
    if slow:
        parts.append(f"{slow} of {len(worst)} did not converge (scores may be slightly off)")
    return "; ".join(parts) + " (column fit_status)" if parts else None


def directions_note(directions: dict[str, Tensor]) -> str | None:
    """One line on direction fits (all rows, no held-out split) that failed or did not converge:
    their status lives only in the directions file, so it is said here too."""
    bad: dict[str, int] = {}
    for name, t in directions.items():
        if name.endswith("fit_status"):
            for code in t.flatten().tolist():
                if code >= NOT_CONVERGED:
                    bad[FIT_STATUS[code]] = bad.get(FIT_STATUS[code], 0) + 1
    if not bad:
        return None
    why = ", ".join(f"{k} {name}" for name, k in sorted(bad.items()))
    return f"{sum(bad.values())} probe directions did not fit cleanly ({why}; fit_status in directions.safetensors)"


def _progress(total: int, enabled: bool, desc: str):  # noqa: ANN202 - tqdm or a stand-in
    if enabled:
        from tqdm.auto import tqdm

        return tqdm(total=total, desc=desc, unit="fit", leave=False)

    class _Null:
        def update(self, k: int = 1) -> None:
            pass

        def close(self) -> None:
            pass

    return _Null()


def twin_sweep_config(cfg: SweepConfig) -> SweepConfig:
    """The sweep settings for a random-init twin: activation rows and the target only (the main
    sweep has the rest; only the twin's score is merged, as `baselines.merge_twin` does, so
    fitting its control task's labels too would double its Newton work for columns nobody reads)."""
    return replace(cfg, bow=False, length=False, position=False, embeddings=False, condition_split=False,
                   directions=False, controls=False)


def _check_test_set(train: Sequence[Stimulus], test: Sequence[Stimulus]) -> None:
    shared = {s.text for s in train} & {s.text for s in test}
    if shared:
        raise TomlensError(
            f"the test stimuli share {len(shared)} prompt text(s) with the training stimuli",
            "use a test set with different stories (or leave --test-stimuli out to cross-validate)",
        )


def _check_same_model(acts: ActivationsLike, test_acts: ActivationsLike) -> None:
    """Probes trained on one model's activations mean nothing on another's."""
    def who(a: ActivationsLike) -> tuple[Any, Any]:
        m = (getattr(a, "manifest", None) or {}).get("model") or {}
        return m.get("model"), m.get("revision")

    if who(acts) != who(test_acts):
        raise TomlensError(
            f"the training activations come from {who(acts)} and the test activations from {who(test_acts)}",
            "cache both stimulus sets with the same model (and revision)",
        )


FeatureChunks = Callable[[], Iterator[tuple[Tensor, Tensor, list[tuple[int, int]]]]]


@dataclass
class FeatureSet:
    """One set of features a target's probes are fitted on: the activations at a site kind or a
    text baseline, its chunks of units (loaded when iterated), and its size for the plan."""

    features: str  # "activations", "embeddings" or a text baseline ("bag_of_words", "length", "position")
    kind: str  # the site kind ("" for text baselines)
    chunks: FeatureChunks
    keep_directions: bool
    units: int
    dim: int
    rank: int  # the most columns a unit's reduced problem can have (d, or about d / heads per head)
    n_chunks: int = 1  # how many chunks `chunks` yields (the unit of a resumed sweep)


@dataclass
class TargetLayout:
    """One target laid out before any fit: its rows, labels, groups, train/test plans, extra label
    vectors (control, condition split) and the feature sets its probes are fitted on."""

    name: str
    ktr: Tensor
    kte: Tensor
    st_tr: list[Stimulus]
    st_te: list[Stimulus]
    ytr: Tensor
    gtr: Tensor
    yte: Tensor
    gte: Tensor
    plans: list[_Plan]
    extras: dict[str, tuple[Tensor, Tensor]]
    blind: set[str]
    feature_sets: list[FeatureSet]
    common: dict[str, Any]

    def fits(self, plan: _Plan) -> list[tuple[int, int]]:
        """(training rows, label vectors fitted together) of every fit `plan` runs on one chunk:
        one per split with two classes and two groups in training (plus, for a target of more than
        two classes, one more fit of the binary extras, as `_run_plan` does)."""
        out = []
        binary = self.ytr.unique().numel() == 2
        for split in plan.splits:
            tr = split.train
            if tr.numel() == 0 or split.test.numel() == 0:
                continue
            ys, gs = set(self.ytr[tr].tolist()), set(self.gtr[tr].tolist())
            if len(ys) < 2 or len(gs) < 2:
                continue
            extra = sum(1 for lab, _ in self.extras.values() if len(set(lab[tr].tolist())) == 2)
            k = 1 if binary else self.ytr.unique().numel()
            out.extend([(int(tr.numel()), k + extra)] if binary else
                       [(int(tr.numel()), k)] + ([(int(tr.numel()), extra)] if extra else []))
        return out


@dataclass
class SweepLayout:
    """Everything a sweep will fit, laid out (and checked) before the first fit."""

    acts: ActivationsLike
    test_acts: ActivationsLike | None
    targets: list[TargetLayout]
    kinds: list[str]
    position: str
    probe: str
    seed: int
    cfg: SweepConfig
    notes: list[str]
    variation: dict[str, pd.DataFrame]
    names: list[str]  # the targets asked for

    @property
    def n_rows(self) -> int:
        return len(self.acts.stimuli)


@renamed_arguments(target="targets")
def lay_out_sweep(
    acts: ActivationsLike,
    targets: str | Sequence[str],
    *,
    sites: Sequence[str] = ("resid_post", "head_out"),
    positions: Sequence[str] = ("final",),
    test_acts: ActivationsLike | None = None,
    probe: str = "logistic",
    seed: int = 0,
    config: SweepConfig | None = None,
    **overrides: Any,
) -> SweepLayout:
    """Check the request and lay out every target's rows, plans, extra labels and feature sets
    (`run_probe_sweep`'s arguments); nothing is fitted, and activations are read only for their
    shapes. `tomlens.probes.sweep_plan` counts and times a layout."""
    cfg = replace(config or SweepConfig(), **overrides)
    kinds, position, names = _check_request(targets, sites, positions, probe)
    train_st = list(acts.stimuli)
    test_st = list(test_acts.stimuli) if test_acts is not None else None
    if test_acts is not None and test_st is not None:
        _check_test_set(train_st, test_st)
        _check_same_model(acts, test_acts)
    notes = _grouping_notes(cfg, train_st, test_st)
    if test_st is None:
        cfg = _folds_that_fit(cfg, train_st, names, notes)
    variation: dict[str, pd.DataFrame] = {}
    shapes = {kind: _unit_shape(acts, kind, position) for kind in kinds}
    laid = [_lay_out_target(tname, acts, test_acts, kinds, shapes, position, probe, seed, cfg, notes, variation)
            for tname in names]
    return SweepLayout(acts, test_acts, laid, kinds, position, probe, seed, cfg, notes, variation, names)


def _folds_that_fit(cfg: SweepConfig, train_st: Sequence[Stimulus], targets: Sequence[str],
                    notes: list[str]) -> SweepConfig:
    """`cfg` with no more outer folds than the fewest groups (stories, or `group_by`'s groups) any
    target's rows have, said in `notes`: a few tasks then run as many folds as they allow, as a
    small study should, where a fixed 5 would stop with an error. Fewer than 2 groups are left to
    the fold split's own error (it says what to do)."""
    if cfg.evaluation == "holdout":  # one split of about 1 / folds of the groups: any count fills it
        return cfg
    fewest = min(int(torch.unique(group_codes([train_st[i] for i in make_target(train_st, t)[1].nonzero()
                                                .squeeze(1).tolist()], cfg.group_by)).numel())
                 for t in targets)
    if not 2 <= fewest < cfg.folds:
        return cfg
    notes.append(f"{fewest} groups ({cfg.group_by}): {fewest} grouped folds instead of {cfg.folds}")
    return replace(cfg, folds=fewest)


def _check_request(targets: str | Sequence[str], sites: Sequence[str], positions: Sequence[str], probe: str
                   ) -> tuple[list[str], str, list[str]]:
    """(site kinds, the one position, target names) of a sweep request, or a clear error."""
    if isinstance(sites, str) or isinstance(positions, str):
        raise TomlensError("sites and positions are sequences of names, not one string",
                           'pass e.g. sites=("resid_post",), positions=("final",)')
    if len(positions) != 1:
        raise TomlensError(f"positions {', '.join(positions) or '(none)'}: the probe sweep uses one position",
                           "give one position (e.g. final), and run the sweep once per position")
    if probe not in PROBES:
        raise TomlensError(f"unknown probe {probe!r}", f"use one of {', '.join(PROBES)}")
    names = [targets] if isinstance(targets, str) else list(targets)
    for t in names:
        get_target(t)
    return list(sites), positions[0], names


def _grouping_notes(cfg: SweepConfig, train_st: Sequence[Stimulus], test_st: Sequence[Stimulus] | None) -> list[str]:
    """What `group_by=cue` means on these stimuli (no note for the other groupings)."""
    if cfg.group_by != "cue":
        return []
    if not any(s.meta.get("cue_id") not in (None, "") for s in [*train_st, *(test_st or [])]):
        return ["no stimulus has a cue_id: group_by=cue is group_by=task here"]
    n_groups = int(torch.unique(group_codes(train_st, "cue")).numel())
    return [f"group_by=cue: {n_groups} cue group(s) (no cue phrasing and no story on both sides)"
            + ("; too few for a selection half of 3 groups" if n_groups < 6 else "")]


def _lay_out_target(tname: str, acts: ActivationsLike, test_acts: ActivationsLike | None, kinds: list[str],
                    shapes: dict[str, tuple[int, int, int]], position: str, probe: str, seed: int,
                    cfg: SweepConfig, notes: list[str], variation: dict[str, pd.DataFrame]) -> TargetLayout:
    """One target's rows (those where it is defined), labels, groups, plans, extra label vectors
    and feature sets; its notes go to `notes`, whether its label varies per condition to `variation`."""
    train_st = list(acts.stimuli)
    test_st = list(test_acts.stimuli) if test_acts is not None else None
    y_all, keep = make_target(train_st, tname)
    ktr = keep.nonzero().squeeze(1)
    st_tr = [train_st[i] for i in ktr.tolist()]
    ytr = y_all[ktr]
    gtr = group_codes(st_tr, cfg.group_by)
    if test_st is not None:
        y_te_all, keep_te = make_target(test_st, tname)
        kte = keep_te.nonzero().squeeze(1)
        st_te = [test_st[i] for i in kte.tolist()]
        yte = y_te_all[kte]
        gte = group_codes(st_te, cfg.group_by)
    else:
        kte, st_te, yte, gte = ktr, st_tr, ytr, gtr
    encode_labels(ytr)  # at least two classes, or a clear error
    separate_test = st_te if test_st is not None else None
    plans = _drop_one_class_sets(_plans(st_tr, separate_test, gtr, cfg, seed), yte, tname, notes)
    if tname not in variation:
        variation[tname] = label_variation(st_tr + (st_te if test_st is not None else []), tname)
        if not bool(variation[tname]["varies"].any()):
            notes.append(f"{tname} is fixed by the condition in every condition here, so a probe for it is a "
                         f"probe for the condition: it reads {tname.replace('_', ' ')} rather than condition "
                         "words only where the words cannot tell the conditions apart (bag-of-words baseline at "
                         "chance, as on order-only and the factorial)")
    test_name = "same" if test_st is None else f"stimuli:{stimuli_hash(test_st)}"
    common = {"position": position, "target": tname, "probe": probe, "test_set": test_name}
    extras, blind = _extras(st_tr, separate_test, ytr, plans, cfg, seed, tname, notes)
    feature_sets = _feature_sets(acts, test_acts, kinds, shapes, position, ktr, kte, st_tr, st_te, cfg, notes)
    return TargetLayout(tname, ktr, kte, st_tr, st_te, ytr, gtr, yte, gte, plans, extras, blind, feature_sets, common)


def _feature_sets(acts: ActivationsLike, test_acts: ActivationsLike | None, kinds: list[str],
                  shapes: dict[str, tuple[int, int, int]], position: str, ktr: Tensor, kte: Tensor, st_tr: list[Stimulus], st_te: list[Stimulus],
                  cfg: SweepConfig, notes: list[str]) -> list[FeatureSet]:
    """The activations at each site kind, then the baselines the settings ask for."""
    out: list[FeatureSet] = []
    for kind in kinds:
        units, dim, rank = shapes[kind]
        out.append(FeatureSet("activations", kind, _activation_chunks(acts, test_acts, kind, position, ktr, kte, cfg),
                              True, units, dim, rank,
                              n_chunks=len(_chunks(units, int(ktr.numel()), dim, cfg.unit_budget_bytes))))
    if cfg.bow:
        vocab = max(len(bag_of_words(st_tr)[1]), 1)
        out.append(FeatureSet("bag_of_words", "", _bow_chunks(st_tr, st_te), False, 1, vocab, vocab))
    if cfg.length:
        out.append(FeatureSet("length", "", _length_chunks(st_tr, st_te), False, 1, 2, 2))
    if cfg.position:
        out.append(FeatureSet("position", "", _position_chunks(st_tr, st_te, position), False, 1, 2, 2))
    if cfg.embeddings:
        if _holds(acts, "resid_pre", 0, position) and (test_acts is None or _holds(test_acts, "resid_pre", 0, position)):
            _, dim, _ = _unit_shape(acts, "resid_pre", position)
            out.append(FeatureSet("embeddings", "resid_pre", _embedding_chunks(acts, test_acts, position, ktr, kte),
                                  False, 1, dim, dim))
        else:
            notes.append("embeddings baseline not run: cache resid_pre:0")
    return out


def _unit_shape(acts: ActivationsLike, kind: str, position: str) -> tuple[int, int, int]:
    """(units, d, rank bound) of a site kind: a layer's units have rank up to d, a head's output up
    to d / heads (its d_head, for models whose heads split the residual width evenly)."""
    X = acts.get(kind, position)
    if X.ndim == 4:
        _, nl, nh, d = X.shape
        return nl * nh, d, max(1, d // nh)
    if X.ndim == 3:
        return X.shape[1], X.shape[2], X.shape[2]
    raise TomlensError(f"activations of kind {kind!r} have shape {tuple(X.shape)}",
                       "expected [n, layer, d] or [n, layer, head, d]")


@overload
def run_probe_sweep(
    acts: ActivationsLike, targets: str | Sequence[str], *,
    sites: Sequence[str] = ..., positions: Sequence[str] = ..., test_acts: ActivationsLike | None = ...,
    probe: str = ..., seed: int = ..., config: SweepConfig | None = ..., resume_in: str | Path | None = ...,
    dry_run: Literal[True], **overrides: Any,
) -> ProbePlan: ...


@overload
def run_probe_sweep(
    acts: ActivationsLike, targets: str | Sequence[str], *,
    sites: Sequence[str] = ..., positions: Sequence[str] = ..., test_acts: ActivationsLike | None = ...,
    probe: str = ..., seed: int = ..., config: SweepConfig | None = ..., resume_in: str | Path | None = ...,
    dry_run: Literal[False] = ..., **overrides: Any,
) -> ProbeSweepResult: ...


@renamed_arguments(target="targets")
def run_probe_sweep(
    acts: ActivationsLike,
    targets: str | Sequence[str],
    *,
    sites: Sequence[str] = ("resid_post", "head_out"),
    positions: Sequence[str] = ("final",),
    test_acts: ActivationsLike | None = None,
    probe: str = "logistic",
    seed: int = 0,
    config: SweepConfig | None = None,
    resume_in: str | Path | None = None,
    dry_run: bool = False,
    **overrides: Any,
) -> ProbeSweepResult | ProbePlan:
    """Probe every layer (and head) of the site kinds `sites` at the one position in `positions`
    (a one-element sequence, as in `tomlens.runs.probes.ProbesConfig`) for one or more `targets`
    (a name or a sequence of names; `ProbesConfig.targets`, `tomlens probe --targets`). The old
    keyword `target=` still works for one release, with a line saying the new one.

    `config` (or keyword overrides of its fields, e.g. `folds=3`) sets the CV, controls and
    intervals. Returns the tidy table, the directions of probes fitted on all rows (for patching
    and steering) and provenance.

    Before fitting, with `progress` and `show_plan` on, it prints its plan (`sweep_plan`: the fits
    of each feature set and the estimated time, from one small timed fit per site kind); with
    `budget_minutes` it refuses a plan whose estimate exceeds that, before any fit (with the plan
    said, and the argument that raises the budget named). Called without `config`, the budget is
    the CLI's (`DEFAULT_BUDGET_MINUTES`, as `tomlens probe --budget-minutes`); `budget_minutes=None`
    lifts it. With fewer groups (stories) than `folds`, it runs as many folds as there are groups
    (a note in the result). `dry_run`: lay out and time the plan, say it, and return it (a
    `tomlens.probes.plan.ProbePlan`) without fitting the sweep.

    `resume_in`: a run folder that keeps each finished chunk of fits (`fit_layout`), so a killed
    sweep started again with the same settings fits only what it had left.
    """
    if config is None:
        overrides.setdefault("budget_minutes", DEFAULT_BUDGET_MINUTES)
    layout = lay_out_sweep(acts, targets, sites=sites, positions=positions, test_acts=test_acts, probe=probe,
                           seed=seed, config=config, **overrides)
    cfg = layout.cfg
    if (cfg.progress and cfg.show_plan) or cfg.budget_minutes is not None or dry_run:
        from tomlens.probes.sweep_plan import sweep_plan, time_fits

        plan = sweep_plan(layout)
        time_fits(plan, layout)
        said = (cfg.progress and cfg.show_plan) or dry_run
        if said:
            say("\n".join(plan.lines()))
        if dry_run:
            say("dry run: nothing fitted")
            return plan
        if config is None:  # a Python call: the error names the argument, not the CLI's flag
            _check_python_budget(plan, said=said)
        plan.check_budget()
    return fit_layout(layout, resume_in)


def _check_python_budget(plan: ProbePlan, *, said: bool) -> None:
    """Refuse a plan estimated over its budget, in the Python API's words: the plan (said unless it
    was already), its totals, and `budget_minutes=` (the CLI's `check_budget` names flags)."""
    total = plan.seconds()
    if plan.budget_seconds is None or total is None or total <= plan.budget_seconds:
        return
    if not said:
        say("\n".join(plan.lines()))
    from tomlens.timing import format_seconds

    fits = sum(st.fits for st in plan.stages)
    raise TomlensError(
        f"the probe plan is {fits:,} fits estimated at {format_seconds(total)}, more than the budget of "
        f"{format_seconds(plan.budget_seconds)} (budget_minutes={plan.budget_seconds / 60:g})",
        "fit fewer units (sites=['resid_post']), fewer C values (c_grid=...), inner_folds=2, folds=3 or fewer "
        f"stimuli; or pass budget_minutes={math.ceil(total / 60)} (None: no budget); dry_run=True returns the "
        "plan without fitting")


def fit_layout(layout: SweepLayout, resume_in: str | Path | None = None) -> ProbeSweepResult:
    """Fit and score everything `layout` lays out (the body of `run_probe_sweep`), a chunk of units
    at a time. With `resume_in` (a run folder), each finished chunk is saved under it as it ends
    and a chunk saved there by an earlier run of the same sweep is read back instead of fitted
    (`tomlens.probes.resume`): a killed run, started again, fits only what it had left."""
    t0 = time.time()
    dev = torch.device(layout.cfg.device) if layout.cfg.device is not None else default_device()
    saved = _open_checkpoints(layout, resume_in)
    rows: list[dict[str, Any]] = []
    directions: dict[tuple[str, str, str], Any] = {}
    notes = list(layout.notes)
    for name, tl, fs, (Xtr, Xte, unit_keys) in _each_chunk(layout):
        fit = _saved_or_fitted(saved, name, layout, tl, fs, Xtr, Xte, unit_keys, dev)
        rows.extend(fit.rows)
        notes.extend(fit.notes)
        if fit.directions:
            _add_directions(directions, (tl.name, fs.kind, layout.position), fit.directions, unit_keys)
    return _sweep_result(layout, rows, directions, notes, t0)


def _each_chunk(layout: SweepLayout) -> Iterator[tuple[str, TargetLayout, FeatureSet,
                                                       tuple[Tensor, Tensor, list[tuple[int, int]]]]]:
    """(checkpoint name, target, feature set, chunk) of every chunk of the sweep, in fitting order."""
    for ti, tl in enumerate(layout.targets):
        for fi, fs in enumerate(tl.feature_sets):
            for ci, chunk in enumerate(fs.chunks()):
                yield _chunk_name(ti, tl, fi, fs, ci), tl, fs, chunk


def _chunk_name(ti: int, tl: TargetLayout, fi: int, fs: FeatureSet, ci: int) -> str:
    return f"{ti}-{tl.name}-{fi}-{fs.features}-{ci}"


def _open_checkpoints(layout: SweepLayout, root: str | Path | None) -> FitCheckpoints | None:
    """The sweep's checkpoint folder under `root` (None: no checkpoints); says how many of its
    chunks an earlier run already finished."""
    if root is None:
        return None
    saved = FitCheckpoints(root, {
        "acts": activations_identity(layout.acts), "test_acts": activations_identity(layout.test_acts),
        "targets": layout.names, "sites": layout.kinds, "position": layout.position, "probe": layout.probe,
        "seed": layout.seed, "config": fit_settings(asdict(layout.cfg))})
    names = [_chunk_name(ti, tl, fi, fs, ci) for ti, tl in enumerate(layout.targets)
             for fi, fs in enumerate(tl.feature_sets) for ci in range(fs.n_chunks)]
    done = saved.finished(names)
    if done:
        say(f"resuming: {done} of {len(names)} probe fits done")
    return saved


def _saved_or_fitted(saved: FitCheckpoints | None, name: str, layout: SweepLayout, tl: TargetLayout,
                     fs: FeatureSet, Xtr: Tensor, Xte: Tensor, unit_keys: list[tuple[int, int]],
                     dev: torch.device) -> ChunkFit:
    """The chunk as an earlier run saved it, when it fitted the same inputs; else fitted (and saved)."""
    if saved is None:
        return _fit_chunk(layout, tl, fs, Xtr, Xte, unit_keys, dev)
    labels = [tl.ytr, tl.gtr, tl.yte, tl.gte, *(t for pair in tl.extras.values() for t in pair)]
    inputs = inputs_hash(Xtr, *([] if Xte is Xtr else [Xte]), *labels)
    fit = saved.load(name, inputs)
    if fit is None:
        fit = _fit_chunk(layout, tl, fs, Xtr, Xte, unit_keys, dev)
        saved.save(name, inputs, fit)
    return fit


def _fit_chunk(layout: SweepLayout, tl: TargetLayout, fs: FeatureSet, Xtr: Tensor, Xte: Tensor,
               unit_keys: list[tuple[int, int]], dev: torch.device) -> ChunkFit:
    """Fit and score one chunk of units of one feature set for one target, on every plan (and,
    where the feature set keeps them, the directions of probes fitted on all rows)."""
    cfg, probe, seed = layout.cfg, layout.probe, layout.seed
    n_fits = sum(len(p.splits) for p in tl.plans) + int(cfg.directions)
    bar = _progress(n_fits, cfg.progress,
                    f"{tl.name} {fs.kind or fs.features} layers {unit_keys[0][0]}-{unit_keys[-1][0]}")
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    directions: dict[str, Tensor] = {}
    with cpu_threads_for(float(Xtr.numel()), dev):
        for plan in tl.plans:
            outcome = _run_plan(plan, probe, Xtr, tl.ytr, tl.gtr, Xte, tl.yte, cfg, seed, bar.update, tl.extras)
            if outcome is None:
                notes.append(f"{tl.name}/{fs.kind or fs.features}: train_on={plan.train_on} skipped "
                             "(no training split with two classes)")
                continue
            rows.extend(_plan_rows(outcome, plan, tl, fs, cfg, seed, unit_keys))
        if cfg.directions and fs.keep_directions:
            bar.update()
            directions = _direction_parts(probe, Xtr, tl.ytr, tl.gtr, cfg, seed)
    bar.close()
    return ChunkFit(rows=tuple(rows), notes=tuple(notes), directions=directions)


def _plan_rows(outcome: _Outcome, plan: _Plan, tl: TargetLayout, fs: FeatureSet, cfg: SweepConfig, seed: int,
               unit_keys: list[tuple[int, int]]) -> list[dict[str, Any]]:
    """The table rows of one plan's outcome; a plan whose control cannot fail gives no control number."""
    extra_te = {k: te for k, (_, te) in tl.extras.items()}
    new = _rows_for(outcome, plan, tl.yte, tl.gte, cfg, seed, unit_keys,
                    {**tl.common, "features": fs.features, "kind": fs.kind}, extra_te)
    if plan.train_on in tl.blind:
        for r in new:
            r.update({k: float("nan") for k in _CONTROL_VALUES})
    return new


def _sweep_result(layout: SweepLayout, rows: list[dict[str, Any]], directions: dict[tuple[str, str, str], Any],
                  notes: list[str], t0: float) -> ProbeSweepResult:
    """The tidy table (baselines attached), the stacked directions and the metadata, with notes
    on fits that failed (`t0`: when the fitting began, for the provenance's seconds)."""
    table = attach_baselines(pd.DataFrame(rows, columns=COLUMNS))[COLUMNS]
    summary = fit_summary(table)
    if summary:
        notes.append(summary)
    stacked = _stack_directions(directions)
    note = directions_note(stacked)
    if note:
        notes.append(note)
    meta = {
        "provenance": _provenance(layout.acts, layout.test_acts, layout.cfg, layout.seed, layout.probe, layout.names,
                                  layout.kinds, layout.position, time.time() - t0),
        "notes": sorted(set(notes)),
        "targets": {t: get_target(t).description for t in layout.names},
        "fit_status_codes": list(FIT_STATUS),  # the codes of the directions' fit_status tensors
        # per target and condition of the training set: whether the label varies there (`targets.label_variation`)
        "label_variation": {t: v.to_dict(orient="records") for t, v in layout.variation.items()},
    }
    return ProbeSweepResult(table=table.reset_index(drop=True), directions=stacked, metadata=meta)


def _activation_chunks(acts: ActivationsLike, test_acts: ActivationsLike | None, kind: str, position: str,
                       ktr: Tensor, kte: Tensor, cfg: SweepConfig):  # noqa: ANN202
    def gen() -> Iterator[tuple[Tensor, Tensor, list[tuple[int, int]]]]:
        Xa, layers, nh = _units(acts, kind, position)
        if test_acts is not None:
            Xb, layers_b, nh_b = _units(test_acts, kind, position)
            if layers_b != layers or nh_b != nh or Xb.shape[2] != Xa.shape[2]:
                raise TomlensError(f"the test activations of {kind!r} do not match the training ones "
                                   f"(layers {layers_b} vs {layers})",
                                   "cache the same sites for both stimulus sets")
        else:
            Xb = Xa
        keys = [(layer, h) for layer in layers for h in range(nh)] if nh else [(layer, -1) for layer in layers]
        for sl in _chunks(len(keys), int(ktr.numel()), Xa.shape[2], cfg.unit_budget_bytes):
            Xtr = Xa[:, sl][ktr].transpose(0, 1).float().contiguous()  # [U, n, d]
            Xte = Xtr if test_acts is None else Xb[:, sl][kte].transpose(0, 1).float().contiguous()
            yield Xtr, Xte, keys[sl]
    return gen


def _holds(acts: ActivationsLike, kind: str, layer: int, position: str) -> bool:
    """Whether the activations hold `kind` at `layer` and `position` (without reading them where
    the cache says so in its manifest)."""
    try:
        if layer not in list(acts.layers(kind)):
            return False
        positions = (getattr(acts, "manifest", None) or {}).get("positions")
        if positions is not None:
            return position in positions
        acts.get(kind, position)
        return True
    except (TomlensError, LookupError, StopIteration):
        return False


def _embedding_chunks(acts: ActivationsLike, test_acts: ActivationsLike | None, position: str,
                      ktr: Tensor, kte: Tensor):  # noqa: ANN202
    """resid_pre layer 0 (token + position embeddings) as one unit, keyed (0, -1)."""
    def gen() -> Iterator[tuple[Tensor, Tensor, list[tuple[int, int]]]]:
        def layer0(a: ActivationsLike, rows: Tensor) -> Tensor:
            X = a.get("resid_pre", position)
            i = list(a.layers("resid_pre")).index(0)
            X = X[:, i]
            return X.reshape(X.shape[0], -1)[rows].float().unsqueeze(0).contiguous()  # [1, n, d]

        Xtr = layer0(acts, ktr)
        Xte = Xtr if test_acts is None else layer0(test_acts, kte)
        yield Xtr, Xte, [(0, -1)]
    return gen


def _length_chunks(st_tr: Sequence[Stimulus], st_te: Sequence[Stimulus]):  # noqa: ANN202
    def gen() -> Iterator[tuple[Tensor, Tensor, list[tuple[int, int]]]]:
        Xtr = length_features(st_tr)
        Xte = Xtr if st_te is st_tr else length_features(st_te, st_tr)
        yield Xtr.unsqueeze(0), Xte.unsqueeze(0), [(-1, -1)]
    return gen


def _position_chunks(st_tr: Sequence[Stimulus], st_te: Sequence[Stimulus], position: str):  # noqa: ANN202
    def gen() -> Iterator[tuple[Tensor, Tensor, list[tuple[int, int]]]]:
        Xtr = position_features(st_tr, position)
        Xte = Xtr if st_te is st_tr else position_features(st_te, position, st_tr)
        yield Xtr.unsqueeze(0), Xte.unsqueeze(0), [(-1, -1)]
    return gen


def _split_rows(plan: _Plan, ytr: Tensor) -> list[tuple[list[int], list[int]]]:
    """A plan's (train, test) row lists, for the splits a probe is fitted on (two training classes)."""
    return [(sp.train.tolist(), sp.test.tolist()) for sp in plan.splits
            if sp.train.numel() and torch.unique(ytr[sp.train]).numel() >= 2]


def _extras(st_tr: list[Stimulus], st_te: list[Stimulus] | None, ytr: Tensor, plans: list[_Plan],
            cfg: SweepConfig, seed: int, tname: str, notes: list[str]
            ) -> tuple[dict[str, tuple[Tensor, Tensor]], set[str]]:
    """The control task's and the condition split's labels over the training rows and the test pool
    (the same rows when `st_te` is None), with notes on what cannot be run or cannot fail, and the
    plans (`train_on`) where the control cannot fail (its values are withheld there)."""
    out: dict[str, tuple[Tensor, Tensor]] = {}
    blind: set[str] = set()
    outer = plans[0].splits
    if cfg.controls:
        level, _ = choose_cell_level(st_tr, st_te, _split_rows(plans[0], ytr))
        if level != "template_cue_condition":
            notes.append(f"{tname}: type-level control cells are {CELL_LEVELS[level]} (the finer cells do not "
                         "recur across folds)")
        cells_tr = type_cells(st_tr, level)
        cells_te = None if st_te is None else type_cells(st_te, level)
        split_rows = [(sp.train.tolist(), sp.test.tolist() if st_te is None else []) for sp in outer]
        labels = type_control_labels(cells_tr, split_rows, seed + 1000, test_cells=cells_te)
        if labels is None:
            notes.append(f"{tname}: type-level control not run (fewer than two {CELL_LEVELS[level]} "
                         "cells, or none that puts both labels in every training split)")
        else:
            lab_tr = labels[0]
            lab_te = lab_tr if st_te is None else labels[1]
            out["control"] = (lab_tr, lab_te)
            cells_te = cells_te if cells_te is not None else cells_tr
            for plan in plans:
                share = seen_share(cells_tr, cells_te, _split_rows(plan, ytr))
                if share < 0.5:
                    blind.add(plan.train_on)
                    notes.append(f"{tname}: train_on={plan.train_on}: {1 - share:.0%} of the test rows' "
                                 f"{CELL_LEVELS[level]} cells never occur in training, so the type-level "
                                 "control is at chance there by construction (it cannot fail): control and "
                                 "selectivity withheld (NaN)")
    if cfg.condition_split:
        conds_tr = [s.condition for s in st_tr]
        found = condition_split(conds_tr, ytr, seed)
        if found is None:
            m = len(set(conds_tr))
            notes.append(f"the set has {m} condition{'s' if m != 1 else ''}: no split other than the label itself"
                         if m == 2 else f"the set has {m} condition{'s' if m != 1 else ''}: no condition split")
        else:
            half, r = found
            lab_tr = split_labels(conds_tr, half)
            lab_te = lab_tr if st_te is None else split_labels([s.condition for s in st_te], half)
            out["condition_split"] = (lab_tr, lab_te)
            notes.append(f"{tname}: condition split {{{', '.join(sorted(half))}}} vs the rest "
                         f"(|r| with the target {r:.2f})")
    return out, blind


def _bow_chunks(st_tr: Sequence[Stimulus], st_te: Sequence[Stimulus]):  # noqa: ANN202
    def gen() -> Iterator[tuple[Tensor, Tensor, list[tuple[int, int]]]]:
        Xtr, vocab = bag_of_words(st_tr)
        Xte = Xtr if st_te is st_tr else bag_of_words(st_te, vocab)[0]
        yield Xtr.unsqueeze(0), Xte.unsqueeze(0), [(-1, -1)]
    return gen


def _direction_parts(probe: str, X: Tensor, y: Tensor, groups: Tensor, cfg: SweepConfig, seed: int
                     ) -> dict[str, Tensor]:
    """The directions of one chunk's units, from probes fitted on all rows: the probe's coef,
    intercept and unit direction, the mass-mean direction, C, the fit status and the classes."""
    probes, C, status = _fit(probe, X, y.unsqueeze(0), groups, cfg, seed)
    p = probes[0]
    mm = p if isinstance(p, MassMeanProbe) else MassMeanProbe(device=cfg.device, calibrate=False).fit(X, y)
    return {"coef": p.coef_, "intercept": p.intercept_, "direction": p.direction, "mass_mean": unit_norm(mm.theta_),
            "C": C, "fit_status": status, "classes": p.classes_}


def _add_directions(store: dict[tuple[str, str, str], Any], key: tuple[str, str, str], parts: dict[str, Tensor],
                    unit_keys: list[tuple[int, int]]) -> None:
    """Append one chunk's direction parts to the (target, kind, position) entry of `store`."""
    entry = store.setdefault(key, {"keys": [], "coef": [], "intercept": [], "direction": [], "mass_mean": [],
                                   "C": [], "fit_status": [], "classes": parts["classes"]})
    entry["keys"].extend(unit_keys)
    for what in ("coef", "intercept", "direction", "mass_mean", "C", "fit_status"):
        entry[what].append(parts[what])


def _stack_directions(store: dict[Any, Any]) -> dict[str, Tensor]:
    out: dict[str, Tensor] = {}
    for (target, kind, position), e in store.items():
        keys = e["keys"]
        layers = sorted({k[0] for k in keys})
        heads = sorted({k[1] for k in keys})
        shape = (len(layers),) if heads == [-1] else (len(layers), len(heads))
        for what in ("coef", "intercept", "direction", "mass_mean", "C", "fit_status"):
            t = torch.cat(e[what])
            t = t if what == "fit_status" else t.to(torch.float32)
            out[direction_name(target, kind, position, what)] = t.reshape(*shape, *t.shape[1:])
        out[direction_name(target, kind, position, "layers")] = torch.tensor(layers)
        out[direction_name(target, kind, position, "classes")] = e["classes"].clone()
    return out


def _provenance(acts: ActivationsLike, test_acts: ActivationsLike | None, cfg: SweepConfig, seed: int,
                probe: str, targets: list[str], kinds: Sequence[str], position: str, seconds: float) -> dict[str, Any]:
    man = acts.manifest or {}
    return {
        "model": man.get("model"),
        "stimuli_hash": stimuli_hash(acts.stimuli),
        "n_stimuli": len(acts.stimuli),
        "test_stimuli_hash": None if test_acts is None else stimuli_hash(test_acts.stimuli),
        "activations": str(getattr(acts, "path", "")) or None,
        "targets": targets, "sites": list(kinds), "positions": [position], "probe": probe, "seed": seed,
        "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(cfg).items()},
        "versions": versions(),
        "seconds": round(seconds, 2),
    }


def write_probe_sweep(result: ProbeSweepResult, out: str | Path, *, table_format: str = "parquet") -> Path:
    """Write `probes.parquet` (or .csv), `directions.safetensors` (+ .json) and, last, `probes.json`
    (provenance, notes) into `out`; returns `out`. `probes.json` marks a finished set: it is removed
    first, so a run killed half-way through rewriting a folder never leaves an old marker beside
    new tables, and directions from an earlier run never stay beside a sweep that has none."""
    from tomlens.io import write_json, write_table

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if table_format not in ("parquet", "csv"):
        raise TomlensError(f"unknown table format {table_format!r}", "use 'parquet' or 'csv'")
    (out / "probes.json").unlink(missing_ok=True)
    if not result.directions:
        for stale in ("directions.safetensors", "directions.json"):
            (out / stale).unlink(missing_ok=True)
    write_table(result.table, out / f"probes.{table_format}")
    if result.directions:
        save_directions(out / "directions.safetensors", result.directions,
                        {**result.metadata, "tensors": {k: list(v.shape) for k, v in result.directions.items()}})
    write_json(result.metadata, out / "probes.json")
    return out


def read_probe_sweep(out: str | Path) -> ProbeSweepResult:
    """Read back what `write_probe_sweep` wrote into `out` (the table as written: floats exact)."""
    from tomlens.io import read_json
    from tomlens.probes.directions import load_directions

    out = Path(out)
    if not (out / "probes.json").is_file():
        raise TomlensError(f"{out} holds no finished probe sweep (no probes.json)",
                           "run `tomlens probe --out` into that folder first")
    if (out / "probes.parquet").is_file():
        table = pd.read_parquet(out / "probes.parquet")
    elif (out / "probes.csv").is_file():
        table = pd.read_csv(out / "probes.csv")  # pandas 3 reads floats back exactly
        table["kind"] = table["kind"].fillna("")  # the baseline's empty site kind, as written
        if "best_baseline_name" in table:  # "" (no baseline) reads back as NaN
            table["best_baseline_name"] = table["best_baseline_name"].fillna("")
    else:
        raise TomlensError(f"{out} has probes.json but no probes.parquet or probes.csv",
                           "run the probe sweep into that folder again")
    metadata = read_json(out / "probes.json")
    directions = load_directions(out / "directions.safetensors")[0] \
        if (out / "directions.safetensors").is_file() else {}
    return ProbeSweepResult(table=table, directions=directions, metadata=metadata)
