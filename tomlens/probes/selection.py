"""The best probe unit, chosen on one half of the stories and reported on the other.

The per-unit sweep reports the maximum of a few hundred held-out scores: that maximum is biased
upwards by the choice itself, and its interval ignores the choice. Here the stories are split
(whole tasks, or whole templates with `group_by="template"`) into a selection half and an
evaluation half:

1. on the selection half the sweep (cross-fitted, C by nested CV) scores every unit and the best
   one (accuracy, trained and tested on all conditions) is chosen;
2. that unit's probe is fitted on the whole selection half and scored once on the evaluation
   half, with a bootstrap interval over evaluation stories, next to baselines fitted and scored
   the same way (bag of words, length, the embeddings, the random-init twin where given) and a
   type-level control (one random label per template x condition cell, scored on its own labels);
3. a max-statistic permutation null asks whether "the best unit" beats what the best of all units
   reaches on permuted labels: per permutation every unit is cross-fitted on the selection half
   and the maximum kept. The statistic is a ridge classifier's cross-fitted accuracy (closed form:
   every permutation shares one solve per unit and fold), for the observed labels and for every
   permutation alike, so the two are comparable.

A unit is "found" only when its evaluation interval lies above chance, above the best baseline
and above the type-level control (where that control can fail) and the permutation p is below
`alpha`; otherwise the result is "withheld", with the reason in words. The selection half needs at
least 3 groups (tasks): cross-fitting chooses C inside each training split.

Cost: one [n, n] solve per unit and fold serves all permutations, so the null costs about one
ridge fit per unit and fold whatever `n_permutations` is (the smallest p is 1 / (1 + n)). The
time each run took is in the result's notes.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor

from tomlens.devices import resolve_device, to_device
from tomlens.errors import TomlensError
from tomlens.probes import stats
from tomlens.probes.base import Probe
from tomlens.probes.baselines import length_features, position_features
from tomlens.probes.controls import (
    CELL_LEVELS,
    bag_of_words,
    choose_cell_level,
    condition_split,
    split_labels,
    type_cells,
    type_control_labels,
)
from tomlens.probes.logistic import LogisticProbe, cpu_threads_for
from tomlens.probes.mass_mean import MassMeanProbe
from tomlens.probes.plan import PlanStage
from tomlens.probes.splits import Split, fraction_split, group_codes, group_kfold
from tomlens.probes.sweep import PROBES, ActivationsLike, SweepConfig, run_probe_sweep
from tomlens.probes.targets import make_target
from tomlens.stimuli.records import Stimulus
from tomlens.vocabulary import renamed_arguments

FOUND, WITHHELD = "found", "withheld"
DEFAULT_PERMUTATIONS = 1000
EMBEDDINGS_KIND = "resid_pre"  # layer 0 of resid_pre: the token embeddings (plus positions where learnt)


@dataclass(frozen=True)
class Estimate:
    """One score on the evaluation stories with its group-bootstrap interval and chance level."""

    score: float
    ci_low: float
    ci_high: float
    chance: float


@dataclass
class SelectionResult:
    """The unit chosen on the selection stories and how it does on the evaluation stories."""

    target: str
    unit: dict[str, Any] | None  # kind, layer, head, position; None when no unit could be fitted
    selection_score: float  # the sweep's cross-fitted accuracy of the chosen unit (selection half)
    evaluation: Estimate | None
    baselines: dict[str, Estimate] = field(default_factory=dict)  # same split, same fitting
    control: Estimate | None = None  # type-level control, scored against its own labels
    control_reason: str = ""  # why `control` is None (not run, or it could not fail)
    condition_split: Estimate | None = None  # a balanced split of >= 3 conditions, on its own labels
    p_max: float = float("nan")
    n_perm: int = 0
    observed_max: float = float("nan")  # max over units of the cross-fitted ridge-classifier accuracy
    permutation: str = ""  # "within tasks" or "across rows"
    n_units: int = 0
    n_selection: int = 0
    n_evaluation: int = 0
    verdict: str = WITHHELD
    reason: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def best_baseline(self) -> tuple[str, Estimate] | None:
        finite = [(k, v) for k, v in self.baselines.items() if math.isfinite(v.score)]
        return max(finite, key=lambda kv: kv[1].score) if finite else None

    @property
    def site(self) -> str:
        if self.unit is None:
            return "-"
        u = self.unit
        return f"{u['kind']}:{u['layer']}" + ("" if u["head"] < 0 else f".h{u['head']}")

    def line(self) -> str:
        """One line: the held-out evaluation score of the selected unit, then its verdict."""
        if self.evaluation is None:
            return f"{self.target}: no unit selected: {self.verdict}: {self.reason}"
        e = self.evaluation
        best = self.best_baseline
        base = f"best baseline {best[0]} {best[1].score:.2f}" if best else "no baseline run"
        ctrl = f", type-level control withheld ({self.control_reason})" if self.control is None else \
            f", type-level control {self.control.score:.2f} (chance {self.control.chance:.2f})"
        if self.condition_split is not None:
            ctrl += f", condition split {self.condition_split.score:.2f}"
        verdict = FOUND if self.verdict == FOUND else f"{WITHHELD}: {self.reason}"
        return (f"{self.target}: selected {self.site} (selection {self.selection_score:.2f} of {self.n_units} "
                f"units), held-out evaluation {e.score:.2f} [{e.ci_low:.2f}, {e.ci_high:.2f}], chance "
                f"{e.chance:.2f}, {base}{ctrl}, p_max {self.p_max:.3f} ({self.n_perm} permutations) -> {verdict}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SelectionResult:
        """Back from `to_dict` as JSON wrote it (NaN was written as null)."""
        nan = lambda v: float("nan") if v is None else float(v)  # noqa: E731
        est = lambda v: None if v is None else Estimate(**{k: nan(x) for k, x in v.items()})  # noqa: E731
        d = dict(data)
        d["evaluation"] = est(d.get("evaluation"))
        d["control"] = est(d.get("control"))
        d["condition_split"] = est(d.get("condition_split"))
        d["baselines"] = {k: est(v) for k, v in (d.get("baselines") or {}).items()}
        for k in ("selection_score", "p_max", "observed_max"):
            d[k] = nan(d.get(k))
        return cls(**d)


class _Rows:
    """Some rows of an ActivationsLike (a selection or evaluation half), itself ActivationsLike."""

    def __init__(self, acts: ActivationsLike, rows: Int[Tensor, " n"]) -> None:
        self._acts, self._rows = acts, rows
        self.stimuli = [acts.stimuli[i] for i in rows.tolist()]
        self.manifest = acts.manifest

    def get(self, kind: str, position: str) -> Tensor:
        return self._acts.get(kind, position)[self._rows]

    def layers(self, kind: str) -> list[int]:
        return list(self._acts.layers(kind))


def selection_split(stimuli: Sequence[Stimulus], fraction: float = 0.5, seed: int = 0,
                    group_by: str = "task") -> Split:
    """Rows of the selection half (`train`) and the evaluation half (`test`): whole groups (tasks,
    or templates) on one side, about `fraction` of the groups for selection, seeded."""
    if not 0 < fraction < 1:
        raise TomlensError(f"select_fraction = {fraction}", "use a fraction strictly between 0 and 1")
    codes = group_codes(stimuli, group_by)
    uniq = torch.unique(codes)
    if uniq.numel() < 2:
        raise TomlensError(f"{uniq.numel()} story group(s) cannot be split into selection and evaluation",
                           "use more tasks (or turn selection off)")
    return fraction_split(codes, fraction, seed)


def _unit_matrix(acts: ActivationsLike, kind: str, position: str) -> tuple[Float[Tensor, "n unit d"], list[tuple[int, int]]]:
    X = acts.get(kind, position)
    layers = list(acts.layers(kind))
    if X.ndim == 3:
        return X, [(layer, -1) for layer in layers]
    if X.ndim == 4:
        n, nl, nh, d = X.shape
        return X.reshape(n, nl * nh, d), [(layer, h) for layer in layers for h in range(nh)]
    raise TomlensError(f"activations of kind {kind!r} have shape {tuple(X.shape)}",
                       "expected [n, layer, d] or [n, layer, head, d]")


def _one_unit(acts: ActivationsLike, unit: dict[str, Any], rows: Tensor) -> Float[Tensor, "1 n d"]:
    X, keys = _unit_matrix(acts, unit["kind"], unit["position"])
    i = keys.index((int(unit["layer"]), int(unit["head"])))
    return X[rows, i].float().unsqueeze(0).contiguous()


def _chance(y_train: Tensor, y_test: Tensor) -> float:
    vals, counts = torch.unique(y_train, return_counts=True)
    freq = counts.to(torch.float64) / counts.sum()
    hit = y_test.unsqueeze(1) == vals.unsqueeze(0)
    return float((hit.to(torch.float64) * freq).sum(1).mean())


def _new_probe(probe: str, cfg: SweepConfig, seed: int) -> Probe:
    if probe == "logistic":
        return LogisticProbe(cfg.c_grid, cv=cfg.inner_folds, seed=seed, device=cfg.device, check_every=cfg.check_every)
    return MassMeanProbe(device=cfg.device)


def _fit_and_score(probe: str, Xs: Tensor, ys: Tensor, gs: Tensor, Xe: Tensor, ye: Tensor, ge: Tensor,
                   cfg: SweepConfig, seed: int) -> Estimate:
    """Fit on every selection row (C by grouped CV there), score every evaluation row once."""
    if torch.unique(ys).numel() < 2 or ye.numel() == 0:
        return Estimate(float("nan"), float("nan"), float("nan"), float("nan"))
    import warnings

    from tomlens.probes.logistic import ProbeFitWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ProbeFitWarning)
        p = _new_probe(probe, cfg, seed).fit(Xs, ys, groups=gs)
    correct = (p.predict(Xe.to(torch.float64)).cpu() == ye.unsqueeze(0)).to(torch.float64)  # [1, n]
    iv = stats.bootstrap_mean(correct, ge, n_boot=cfg.n_boot, seed=seed, level=cfg.level)
    return Estimate(float(iv.estimate[0]), float(iv.low[0]), float(iv.high[0]), _chance(ys, ye))


@renamed_arguments(n_perm="n_permutations")
def permute_labels(y: Int[Tensor, " n"], groups: Int[Tensor, " n"], n_permutations: int, seed: int,
                   within: bool) -> Int[Tensor, "perm n"]:
    """`n_permutations` permutations of `y`: within each group (design pairs conditions in a task) or
    across rows."""
    gen = torch.Generator().manual_seed(seed + 104729)
    out = y.unsqueeze(0).repeat(n_permutations, 1)
    if within:  # each group's rows, in the order of the sorted group values (found on the host)
        codes = groups.tolist()
        rows_of: dict[int, list[int]] = {}
        for i, c in enumerate(codes):
            rows_of.setdefault(c, []).append(i)
        blocks = [torch.tensor(rows_of[c], dtype=torch.long) for c in sorted(rows_of)]
    else:
        blocks = [torch.arange(y.numel())]
    for p in range(n_permutations):
        for rows in blocks:
            out[p, rows] = y[rows[torch.randperm(rows.numel(), generator=gen)]]
    return out


def pairs_conditions_within_groups(y: Tensor, groups: Tensor) -> bool:
    """Whether every group holds more than one label (then labels are permuted within groups)."""
    labels: dict[int, set[int]] = {}
    for label, group in zip(y.tolist(), groups.tolist(), strict=True):
        labels.setdefault(group, set()).add(label)
    return all(len(v) > 1 for v in labels.values())


def _ridge_fold_correct(X: Float[Tensor, "u n d"], Y: Int[Tensor, "l n"], train: Tensor, test: Tensor,
                        classes: Tensor, ridge: float) -> Float[Tensor, "l u"]:
    """Right answers on `test` of a one-vs-rest ridge classifier per unit and label vector, fitted on
    `train` in closed form (dual: an [n_train, n_train] solve per unit serves every label vector).
    Everything on X's device (`Y`, `train`, `test` and `classes` there too); nothing is read back.

    Binary labels need one column: the two one-vs-rest targets are each other's negatives, so are
    their scores (exactly: the solve is linear and negation rounds symmetrically), and the argmax
    of (-s, s) is class 1 exactly where s > 0."""
    Xtr, Xte = X[:, train].to(torch.float64), X[:, test].to(torch.float64)
    mean = Xtr.mean(1, keepdim=True)
    Xtr, Xte = Xtr - mean, Xte - mean
    K = Xtr @ Xtr.transpose(1, 2)  # [u, t, t]
    lam = ridge * K.diagonal(dim1=1, dim2=2).mean(1).clamp_min(1e-12)  # scale-free penalty per unit
    K = K + lam[:, None, None] * torch.eye(K.shape[1], dtype=K.dtype, device=K.device)
    binary = classes.numel() == 2
    cols = classes[1:] if binary else classes
    T = (Y[:, train].unsqueeze(-1) == cols).to(torch.float64) * 2 - 1  # [l, t, c] one-vs-rest +-1
    T = T - T.mean(1, keepdim=True)
    L, t, c = T.shape
    rhs = T.permute(1, 0, 2).reshape(t, L * c)  # [t, l*c]
    # one CPU thread for the LU: torch runs a batch of them in parallel and MKL's getrf starts its own
    # threads inside each; once the process has changed its thread count (`cpu_threads_for` does),
    # that nesting stalls on 2 threads (a 7 s null ran for over 8 minutes). Cheap alone: 0.4 s here.
    with cpu_threads_for(0.0, K.device):
        alpha = torch.linalg.solve_ex(K, rhs.expand(K.shape[0], t, L * c))[0]  # [u, t, l*c]; no host check
    scores = (Xte @ Xtr.transpose(1, 2)) @ alpha  # [u, te, l*c]
    scores = scores.reshape(K.shape[0], -1, L, c).permute(2, 0, 1, 3)  # [l, u, te, c]
    pred = classes[(scores[..., 0] > 0).long()] if binary else classes[scores.argmax(-1)]
    return (pred == Y[:, test].unsqueeze(1)).to(torch.float64).sum(2)


@renamed_arguments(n_perm="n_permutations")
def max_statistic_null(units: Sequence[Float[Tensor, "_unit n d"]], y: Int[Tensor, " n"], groups: Int[Tensor, " n"],
                       *, folds: int, n_permutations: int, seed: int = 0, within: bool | None = None, ridge: float = 1.0,
                       unit_budget_bytes: float = 2.0**29, device: str | torch.device | None = None
                       ) -> tuple[float, Float[Tensor, " perm"], str]:
    """(observed max, permuted maxima, how labels were permuted): the best cross-fitted accuracy over
    all units (every row tested once on grouped folds) for the true labels and for each of
    `n_permutations` permutations. p = (1 + #{perm max >= observed}) / (1 + n_permutations). (`n_perm=`,
    the old keyword, still works for one release.)

    The statistic is a ridge classifier's accuracy (penalty `ridge` x the mean squared norm of the
    centred training rows), not the logistic probe's: its closed form fits every permutation with
    one solve per unit and fold, so a thousand permutations cost about what one does. The test asks
    whether any unit decodes the label better than the best of all units does by chance.

    Runs on `device` (default: the GPU when there is one), a chunk of units at a time; the maxima
    come back to the host once, at the end."""
    dev = resolve_device(device)
    within = pairs_conditions_within_groups(y, groups) if within is None else within
    Y = torch.cat([y.unsqueeze(0), permute_labels(y, groups, n_permutations, seed, within)])  # [1 + P, n]
    classes = torch.unique(y)
    labels = y.tolist()
    splits = [sp for sp in group_kfold(groups, folds, seed)
              if len({labels[i] for i in sp.train.tolist()}) >= 2 and sp.test.numel()]
    tested = sum(int(sp.test.numel()) for sp in splits)
    on_dev = [(to_device(sp.train, dev), to_device(sp.test, dev)) for sp in splits]
    Yd, classes_d = to_device(Y, dev), to_device(classes, dev)
    best = torch.full((Y.shape[0],), -math.inf, dtype=torch.float64, device=dev)
    for X in units:
        u, n, d = X.shape
        per = max(1, int(unit_budget_bytes // max(n * max(d, n) * 8, 1)))
        for a in range(0, u, per):
            Xc = to_device(X[a:a + per], dev)
            correct = torch.zeros(Y.shape[0], Xc.shape[0], dtype=torch.float64, device=dev)
            for tr, te in on_dev:
                correct += _ridge_fold_correct(Xc, Yd, tr, te, classes_d, ridge)
            if tested:
                best = torch.maximum(best, (correct / tested).amax(1))
    best = best.cpu()
    return float(best[0]), best[1:], "within tasks" if within else "across rows"


@dataclass
class _Halves:
    """The selection and evaluation stories of one target (rows with the target only), and the
    selection sweep's settings; `withheld` says why no unit can be chosen ("" when one can)."""

    sel: ActivationsLike
    ev: ActivationsLike
    tw_sel: ActivationsLike | None
    tw_ev: ActivationsLike | None
    rs: Tensor
    re: Tensor
    st_s: list[Stimulus]
    st_e: list[Stimulus]
    ys: Tensor
    ye: Tensor
    gs: Tensor
    ge: Tensor
    n_groups: int
    folds: int
    sweep_config: SweepConfig
    withheld: str


def _halves(acts: ActivationsLike, target: str, cfg: SweepConfig, seed: int, select_fraction: float,
            test_acts: ActivationsLike | None, twin_acts: ActivationsLike | None,
            twin_test_acts: ActivationsLike | None) -> _Halves:
    sel: ActivationsLike
    ev: ActivationsLike
    tw_sel: ActivationsLike | None
    tw_ev: ActivationsLike | None
    if test_acts is None:
        split = selection_split(acts.stimuli, select_fraction, seed, cfg.group_by)
        sel, ev = _Rows(acts, split.train), _Rows(acts, split.test)
        tw_sel = None if twin_acts is None else _Rows(twin_acts, split.train)
        tw_ev = None if twin_acts is None else _Rows(twin_acts, split.test)
    else:
        sel, ev, tw_sel, tw_ev = acts, test_acts, twin_acts, twin_test_acts
    ys_all, ks = make_target(sel.stimuli, target)
    ye_all, ke = make_target(ev.stimuli, target)
    rs, re_ = ks.nonzero().squeeze(1), ke.nonzero().squeeze(1)
    st_s, st_e = [sel.stimuli[i] for i in rs.tolist()], [ev.stimuli[i] for i in re_.tolist()]
    ys, ye = ys_all[rs], ye_all[re_]
    gs, ge = group_codes(st_s, cfg.group_by), group_codes(st_e, cfg.group_by)
    n_groups = int(torch.unique(gs).numel())
    folds = min(cfg.folds, n_groups)
    scfg = replace(_selection_sweep_config(cfg), folds=folds, inner_folds=min(cfg.inner_folds, max(2, folds - 1)))
    withheld = ""
    if torch.unique(ys).numel() < 2 or torch.unique(ye).numel() < 2:
        withheld = "the selection or evaluation stories hold one class of the target only"
    elif n_groups < 3:  # cross-fitting with C chosen inside each training split needs 3 groups
        # withheld, not an error: the sweep's table is already computed and stays valid
        withheld = (f"the selection half holds {n_groups} {cfg.group_by} group(s) with the target: "
                    f"need >= 3 {cfg.group_by} groups in the selection half (give more stimuli, or a larger "
                    "select_fraction)")
    return _Halves(sel, ev, tw_sel, tw_ev, rs, re_, st_s, st_e, ys, ye, gs, ge, n_groups, folds, scfg, withheld)


def selection_stage(acts: ActivationsLike, target: str, *, sites: Sequence[str], position: str, seed: int = 0,
                    select_fraction: float = 0.5, n_permutations: int = DEFAULT_PERMUTATIONS,
                    config: SweepConfig | None = None, probe: str = "logistic",
                    test_acts: ActivationsLike | None = None, twin: bool = False) -> PlanStage:
    """What `select_and_evaluate` (same arguments) will fit, for the plan: the sweep of every unit
    on the selection stories, the chosen unit and its baselines refitted on them, and the null."""
    from tomlens.probes.plan import FitShape, null_work
    from tomlens.probes.sweep import lay_out_sweep
    from tomlens.probes.sweep_plan import sweep_stages

    cfg = config or SweepConfig()
    h = _halves(acts, target, cfg, seed, select_fraction, test_acts, None, None)
    name = f"selection ({target})"
    if h.withheld:
        return PlanStage(name, f"nothing fitted: {h.withheld}")
    layout = lay_out_sweep(h.sel, target, sites=list(sites), positions=(position,), probe=probe, seed=seed,
                           config=h.sweep_config)
    shapes = [s for st in sweep_stages(layout) for s in st.shapes]
    units = sum(fs.units for fs in layout.targets[0].feature_sets if fs.features == "activations")
    dim = max((fs.dim for fs in layout.targets[0].feature_sets), default=1)
    refits = 6 + int(twin)  # the unit, bag of words, length, position, embeddings, control (+ random init)
    grid = len(cfg.c_grid)
    folds = min(cfg.inner_folds, h.n_groups) if grid > 1 else 0
    shapes.append(FitShape(1, len(h.st_s), dim, dim, 1, grid, folds, count=refits, kind="baseline",
                           solver="mass_mean" if probe == "mass_mean" else "logistic"))
    n_classes = int(torch.unique(h.ys).numel())
    labels = (n_permutations + 1) * (1 if n_classes == 2 else n_classes)
    extra = null_work(units, len(h.st_s), dim, h.folds, labels) if n_permutations else 0.0
    kind = next((fs.kind for fs in layout.targets[0].feature_sets if fs.features == "activations"), "")
    return PlanStage(name, f"{units:,} units on {len(h.st_s)} selection prompts x {h.folds} folds "
                     f"({sum(s.count for s in shapes[:-1]):,} fits), the chosen unit and its baselines refitted "
                     f"({refits} fits of 1 unit), max-statistic null of {n_permutations:,} permutations "
                     "(ridge: one solve per unit and fold serves them all)", shapes, extra, kind)


def _selection_sweep_config(cfg: SweepConfig) -> SweepConfig:
    """The sweep on the selection half: activation rows only (the baselines and the control are
    refitted on the selection / evaluation split itself)."""
    return replace(cfg, bow=False, conditions=False, directions=False, controls=False, progress=False, length=False,
                   position=False, embeddings=False, condition_split=False)


@dataclass(frozen=True)
class Verdict:
    """Whether the selected unit counts as a finding ("found") or not ("withheld", with why)."""

    verdict: str
    reason: str


def judge(result: SelectionResult, alpha: float = 0.05) -> Verdict:
    """The rule that makes a finding, read off a finished selection: the chosen unit's evaluation
    interval (on stories kept apart from its choice) lies above chance, above the best baseline and
    above the type-level control (where that control can fail), and the max-statistic permutation
    p is below `alpha`. Anything short of that is withheld, every failed condition said in words."""
    reasons = []
    e = result.evaluation
    if e is None or not math.isfinite(e.score):
        reasons.append("the selected unit could not be scored on the evaluation stories")
    else:
        if not e.ci_low > e.chance:
            reasons.append(f"its evaluation interval [{e.ci_low:.2f}, {e.ci_high:.2f}] does not exclude chance "
                           f"({e.chance:.2f})")
        bb = result.best_baseline
        if bb is not None and not e.ci_low > bb[1].score:
            reasons.append(f"its evaluation interval low {e.ci_low:.2f} is not above the best baseline "
                           f"({bb[0]} {bb[1].score:.2f})")
        c = result.control
        if c is not None and math.isfinite(c.score) and not e.ci_low > c.score:
            reasons.append(f"its evaluation interval low {e.ci_low:.2f} is not above the type-level control "
                           f"({c.score:.2f}): the features may name the template, cue and condition cells")
    if result.n_perm == 0:
        reasons.append("no permutation null was run")
    elif not result.p_max < alpha:
        reasons.append(f"p_max {result.p_max:.3f} >= {alpha} (the best of {result.n_units} units is not "
                       "better than the best unit on permuted labels)")
    return Verdict(WITHHELD, "; ".join(reasons)) if reasons else Verdict(FOUND, "")


def select_and_evaluate(
    acts: ActivationsLike,
    target: str,
    *,
    sites: Sequence[str],
    position: str,
    seed: int = 0,
    select_fraction: float = 0.5,
    n_permutations: int = DEFAULT_PERMUTATIONS,
    config: SweepConfig | None = None,
    probe: str = "logistic",
    test_acts: ActivationsLike | None = None,
    twin_acts: ActivationsLike | None = None,
    twin_test_acts: ActivationsLike | None = None,
    alpha: float = 0.05,
) -> SelectionResult:
    """Choose the best unit on a selection half of the stories and report it on the other half.

    With `test_acts` the whole of `acts` is the selection set and `test_acts` the evaluation set.
    `twin_acts` (and `twin_test_acts`): the same stimuli cached on a random-init model of the
    same architecture; the chosen unit on them is one more baseline ("random_init"). Steps:
    choose the unit (`_choose_unit`), score it and its baselines and controls on the evaluation
    half (`_evaluate_unit`), run the null (`_run_null`), then `judge`.
    """
    cfg = config or SweepConfig()
    if probe not in PROBES:
        raise TomlensError(f"unknown probe {probe!r}", f"use one of {', '.join(PROBES)}")
    if n_permutations < 0:
        raise TomlensError(f"n_permutations = {n_permutations}", "use 0 (no null) or more")
    t0 = time.time()
    notes: list[str] = []
    if 0 < n_permutations and 1 / (1 + n_permutations) >= alpha:
        notes.append(f"{n_permutations} permutations: the smallest possible p_max is 1 / {n_permutations + 1} = "
                     f"{1 / (1 + n_permutations):.3f}, not below alpha {alpha}, so no unit can be found: use at "
                     f"least {math.floor(1 / alpha)} permutations")
    h = _halves(acts, target, cfg, seed, select_fraction, test_acts, twin_acts, twin_test_acts)
    result = SelectionResult(target=target, unit=None, selection_score=float("nan"), evaluation=None,
                             n_selection=len(h.st_s), n_evaluation=len(h.st_e))
    if h.withheld:
        return _withhold(result, h.withheld, notes)
    if h.folds < cfg.folds:
        notes.append(f"selection half has {h.n_groups} groups: {h.folds} folds instead of {cfg.folds}")
    unchosen = _choose_unit(result, h, target, sites, position, probe, seed)
    if unchosen:
        return _withhold(result, unchosen, notes)
    _evaluate_unit(result, h, position, probe, cfg, seed, notes)
    if n_permutations > 0:
        _run_null(result, h, sites, position, n_permutations, cfg, seed, notes)
    notes.append(f"selection and evaluation took {time.time() - t0:.1f} s")
    verdict = judge(result, alpha)
    result.notes = notes
    if verdict.verdict == WITHHELD:
        return _withhold(result, verdict.reason, notes)
    result.verdict, result.reason = FOUND, ""
    return result


def _withhold(result: SelectionResult, reason: str, notes: list[str]) -> SelectionResult:
    result.verdict, result.reason, result.notes = WITHHELD, reason, notes
    return result


def _choose_unit(result: SelectionResult, h: _Halves, target: str, sites: Sequence[str], position: str,
                 probe: str, seed: int) -> str:
    """Sweep every unit on the selection stories (cross-fitted, C by nested CV) and set the best one
    (accuracy, trained and tested on all conditions) on `result`; returns why none can be chosen
    ("" when one was)."""
    sweep = run_probe_sweep(h.sel, target, sites=list(sites), positions=(position,), probe=probe, seed=seed,
                            config=h.sweep_config)
    t = sweep.table
    rows = t[(t["features"] == "activations") & (t["train_on"] == "all") & (t["eval_set"] == "all")
             & (t["metric"] == "accuracy")]
    result.n_units = int(len(rows))
    if rows.empty:
        return "the selection sweep scored no unit (no training split held both classes of the target)"
    rows = rows[rows["score"].notna()]
    if rows.empty:
        return (f"none of the {result.n_units} units could be fitted on the selection stories "
                "(fit_status in the selection sweep)")
    best = rows.loc[rows["score"].idxmax()]
    result.unit = {"kind": str(best["kind"]), "layer": int(best["layer"]), "head": int(best["head"]),
                   "position": position}
    result.selection_score = float(best["score"])
    return ""


def _evaluate_unit(result: SelectionResult, h: _Halves, position: str, probe: str, cfg: SweepConfig, seed: int,
                   notes: list[str]) -> None:
    """The chosen unit fitted on the selection half and scored once on the evaluation half, beside
    baselines, the type-level control and the condition split fitted and scored the same way."""
    assert result.unit is not None
    Xs, Xe = _one_unit(h.sel, result.unit, h.rs), _one_unit(h.ev, result.unit, h.re)
    result.evaluation = _fit_and_score(probe, Xs, h.ys, h.gs, Xe, h.ye, h.ge, cfg, seed)
    result.baselines.update(_baselines(result.unit, h, position, probe, cfg, seed, notes))
    result.control, result.control_reason = _type_control(Xs, Xe, h, probe, cfg, seed, notes)
    result.condition_split = _condition_split(Xs, Xe, h, probe, cfg, seed)


def _baselines(unit: dict[str, Any], h: _Halves, position: str, probe: str, cfg: SweepConfig, seed: int,
               notes: list[str]) -> dict[str, Estimate]:
    """Bag of words, length, position, the embeddings and (with a twin) the random-init model's
    same unit, each fitted on the selection half and scored on the evaluation half."""
    def score(Xs: Tensor, Xe: Tensor) -> Estimate:
        return _fit_and_score(probe, Xs, h.ys, h.gs, Xe, h.ye, h.ge, cfg, seed)

    out: dict[str, Estimate] = {}
    bs, vocab = bag_of_words(h.st_s)
    out["bag_of_words"] = score(bs.unsqueeze(0), bag_of_words(h.st_e, vocab)[0].unsqueeze(0))
    out["length"] = score(length_features(h.st_s).unsqueeze(0), length_features(h.st_e, h.st_s).unsqueeze(0))
    out["position"] = score(position_features(h.st_s, position).unsqueeze(0),
                            position_features(h.st_e, position, h.st_s).unsqueeze(0))
    emb = {"kind": EMBEDDINGS_KIND, "layer": 0, "head": -1, "position": position}
    try:
        has_emb = 0 in list(h.sel.layers(EMBEDDINGS_KIND)) and 0 in list(h.ev.layers(EMBEDDINGS_KIND))
    except Exception:  # noqa: BLE001 - an activation set without the kind says so in its own way
        has_emb = False
    if has_emb:
        out["embeddings"] = score(_one_unit(h.sel, emb, h.rs), _one_unit(h.ev, emb, h.re))
    else:
        notes.append("embeddings baseline not run (resid_pre:0 was not cached)")
    if h.tw_sel is not None and h.tw_ev is not None:
        out["random_init"] = score(_one_unit(h.tw_sel, unit, h.rs), _one_unit(h.tw_ev, unit, h.re))
    return out


def _type_control(Xs: Tensor, Xe: Tensor, h: _Halves, probe: str, cfg: SweepConfig, seed: int,
                  notes: list[str]) -> tuple[Estimate | None, str]:
    """(the type-level control, why it is withheld): the chosen unit's probe on one random label per
    type cell, at the level the sweep would choose (`controls.choose_cell_level`), scored on the
    evaluation stories against its own labels; withheld where most evaluation cells never occur in
    selection (it could not fail)."""
    level, share = choose_cell_level(h.st_s, h.st_e)
    labels = type_control_labels(type_cells(h.st_s, level), seed=seed, test_cells=type_cells(h.st_e, level))
    control, reason = None, ""
    if share < 0.5:
        reason = (f"{1 - share:.0%} of the evaluation stories' {CELL_LEVELS[level]} cells never "
                  "occur in selection, so the control is at chance by construction (it cannot fail)")
    elif labels is None or torch.unique(labels[0]).numel() < 2 or torch.unique(labels[1]).numel() < 2:
        reason = f"not run (fewer than two {CELL_LEVELS[level]} cells, or one label on a side)"
    else:
        control = _fit_and_score(probe, Xs, labels[0], h.gs, Xe, labels[1], h.ge, cfg, seed)
        if level != "template_cue_condition":
            notes.append(f"type-level control cells are {CELL_LEVELS[level]} (the finer cells do not recur)")
    if reason:
        notes.append(f"type-level control withheld: {reason}")
    return control, reason


def _condition_split(Xs: Tensor, Xe: Tensor, h: _Halves, probe: str, cfg: SweepConfig, seed: int
                     ) -> Estimate | None:
    """With >= 3 conditions: the chosen unit on a balanced split of the conditions least correlated
    with the target (a unit that decodes it as well as the target may be reading the condition)."""
    found = condition_split([s.condition for s in h.st_s], h.ys, seed)
    if found is None:
        return None
    half = found[0]
    cs, ce = split_labels([s.condition for s in h.st_s], half), split_labels([s.condition for s in h.st_e], half)
    if torch.unique(cs).numel() == 2 and torch.unique(ce).numel() == 2:
        return _fit_and_score(probe, Xs, cs, h.gs, Xe, ce, h.ge, cfg, seed)
    return None


def _run_null(result: SelectionResult, h: _Halves, sites: Sequence[str], position: str, n_permutations: int,
              cfg: SweepConfig, seed: int, notes: list[str]) -> None:
    """The max-statistic permutation null over every unit, on the selection half: sets p_max."""
    t1 = time.time()
    units = [_unit_matrix(h.sel, kind, position)[0][h.rs].transpose(0, 1).float().contiguous() for kind in sites]
    observed, perm_max, how = max_statistic_null(units, h.ys, h.gs, folds=h.folds, n_permutations=n_permutations,
                                                 seed=seed, unit_budget_bytes=cfg.unit_budget_bytes, device=cfg.device)
    result.observed_max, result.permutation, result.n_perm = observed, how, n_permutations
    result.p_max = float((1 + int((perm_max >= observed - 1e-12).sum())) / (1 + n_permutations))
    notes.append(f"permutation null: {n_permutations} permutations ({how}) of {result.n_units} units, ridge "
                 f"classifier statistic, took {time.time() - t1:.1f} s")
