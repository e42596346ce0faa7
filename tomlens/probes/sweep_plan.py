"""A probe sweep's plan: its fits counted from the sweep's own layout, and one small fit per site
kind timed on this machine (`tomlens.probes.plan` prices the rest by size).

Kept apart from `sweep` so the sweep stays the fitting; `run_probe_sweep` and the probes stage
(`tomlens.runs.probes`) both build their plans here.
"""

from __future__ import annotations

import time
import warnings

import torch

from tomlens.probes.logistic import ProbeFitWarning, cpu_threads_for
from tomlens.probes.plan import FitShape, PlanStage, ProbePlan, describe_units
from tomlens.probes.sweep import FeatureSet, SweepLayout, TargetLayout, _fit, _units

CALIBRATION_UNITS = {"layer": 4, "head": 32}  # units of the timed fit: a few layers, a few dozen heads


def rate_key(kind: str) -> str:
    """Which timed fit prices a feature set: its site kind, or "baseline" for text features."""
    return kind if kind else "baseline"


def fit_shapes(layout: SweepLayout, tl: TargetLayout, fs: FeatureSet, *, directions: bool) -> list[FitShape]:
    """The fits `fit_layout` runs for one feature set of one target: one per plan and split, plus
    the directions' fit on all rows."""
    units, dim, rank = fs.units, fs.dim, fs.rank
    cfg = layout.cfg
    solver = "mass_mean" if layout.probe == "mass_mean" else "logistic"
    grid = len(cfg.c_grid)
    n_groups = len(set(tl.gtr.tolist()))
    key = rate_key(fs.kind)
    counts: dict[tuple[int, int, int], int] = {}
    for plan in tl.plans:
        for rows, labels in tl.fits(plan):
            folds = min(cfg.inner_folds, n_groups) if grid > 1 else 0
            counts[(rows, labels, folds)] = counts.get((rows, labels, folds), 0) + 1
    if directions:
        n = int(tl.ytr.numel())
        k = 1 if tl.ytr.unique().numel() == 2 else int(tl.ytr.unique().numel())
        folds = min(cfg.inner_folds, n_groups) if grid > 1 else 0
        counts[(n, k, folds)] = counts.get((n, k, folds), 0) + 1
    return [FitShape(units, rows, dim, rank, labels, grid, folds, count, key, solver)
            for (rows, labels, folds), count in sorted(counts.items())]


def sweep_stages(layout: SweepLayout, *, prefix: str = "", baselines: bool = True) -> list[PlanStage]:
    """One stage for the activations of every site kind (all targets), and one for the text and
    embeddings baselines."""
    cfg = layout.cfg
    acts_shapes: list[FitShape] = []
    base_shapes: list[FitShape] = []
    units: dict[str, int] = {}
    base_names: list[str] = []
    label_names = {"target"}
    for tl in layout.targets:
        label_names.update(tl.extras)
        for fs in tl.feature_sets:
            shapes = fit_shapes(layout, tl, fs, directions=cfg.directions and fs.keep_directions)
            if fs.features == "activations":
                acts_shapes.extend(shapes)
                units[fs.kind] = fs.units
            else:
                base_shapes.extend(shapes)
                if fs.features not in base_names:
                    base_names.append(fs.features)
    n_plans = max((sum(1 for p in tl.plans if tl.fits(p)) for tl in layout.targets), default=0)
    n_splits = max((len(p.splits) for tl in layout.targets for p in tl.plans), default=0)
    labels = ", ".join(n for n in ("target", "control", "condition_split") if n in label_names)
    grid = f"C from {len(cfg.c_grid)} values by {cfg.inner_folds} inner folds" if len(cfg.c_grid) > 1 else \
        f"C = {cfg.c_grid[0]}"
    stages = [PlanStage(
        f"{prefix}sweep",
        f"{describe_units(list(units.items()))} x {len(layout.targets)} target(s) x up to {n_plans} train/test "
        f"plan(s) x {n_splits} fold(s) = {sum(s.count for s in acts_shapes):,} fits ({grid}; label vectors: "
        f"{labels})" + ("; directions on all rows" if cfg.directions else ""),
        acts_shapes)]
    if baselines and base_shapes:
        stages.append(PlanStage(f"{prefix}baselines",
                                f"{', '.join(base_names)}: {sum(s.count for s in base_shapes):,} fits of 1 unit",
                                base_shapes))
    return stages


def sweep_plan(layout: SweepLayout) -> ProbePlan:
    """The plan of one `run_probe_sweep` call (not yet timed: see `time_fits`)."""
    cfg = layout.cfg
    dev = cfg.device or str(_default_device())
    header = (f"probe plan ({layout.n_rows} prompts; target(s) {', '.join(layout.names)} at {layout.position}; "
              f"{cfg.folds} folds, {cfg.evaluation}; device {dev}):")
    budget = None if cfg.budget_minutes is None else 60.0 * cfg.budget_minutes
    return ProbePlan(sweep_stages(layout), header, budget_seconds=budget)


def _default_device() -> torch.device:
    from tomlens.devices import default_device

    return default_device()


def time_fits(plan: ProbePlan, layout: SweepLayout) -> None:
    """Time one fit of a few units for every site kind of the layout's first target (its first
    split, its label vectors), and set the plan's seconds per multiply-add for that kind; text
    baselines are priced by the slowest kind. The timed fits are not kept: they cost a few
    seconds, against minutes of sweep."""
    if not layout.targets:
        return
    tl = layout.targets[0]
    cfg = layout.cfg
    dev = torch.device(cfg.device) if cfg.device is not None else _default_device()
    plan_ = next((p for p in tl.plans if tl.fits(p)), None)
    if plan_ is None:
        return
    split = next(s for s in plan_.splits if s.train.numel() and s.test.numel()
                 and len(set(tl.ytr[s.train].tolist())) >= 2 and len(set(tl.gtr[s.train].tolist())) >= 2)
    tr = split.train
    names = [k for k, (lab, _) in tl.extras.items() if len(set(lab[tr].tolist())) == 2]
    binary = tl.ytr.unique().numel() == 2
    Y = torch.stack([tl.ytr[tr], *(tl.extras[k][0][tr] for k in names)]) if binary else tl.ytr[tr].unsqueeze(0)
    n_groups = len(set(tl.gtr[tr].tolist()))
    folds = min(cfg.inner_folds, n_groups) if len(cfg.c_grid) > 1 else 0
    solver = "mass_mean" if layout.probe == "mass_mean" else "logistic"
    # the overhead of a solve whatever its size: a fit of one unit of two features
    tiny = torch.randn(1, int(tr.numel()), 2, generator=torch.Generator().manual_seed(0))
    seconds = _timed_fit(layout, tiny, Y, tl.gtr[tr], dev)
    plan.per_solve = seconds / FitShape(1, int(tr.numel()), 2, 2, int(Y.shape[0]), len(cfg.c_grid), folds,
                                        solver=solver).solves
    timed = [f"1 unit of 2 features in {seconds:.2f} s"]
    for fs in tl.feature_sets:
        if fs.features != "activations" or fs.kind in plan.rates:
            continue
        X, _, nh = _units(layout.acts, fs.kind, layout.position)
        k = min(fs.units, CALIBRATION_UNITS["head" if nh else "layer"])
        # units spread over every layer: early heads and layers can cost far more than late ones
        pick = [round(i * (fs.units - 1) / max(k - 1, 1)) for i in range(k)]
        Xk = X[:, pick][tl.ktr][tr].transpose(0, 1).float().contiguous()
        seconds = _timed_fit(layout, Xk, Y, tl.gtr[tr], dev)
        shape = FitShape(k, int(tr.numel()), fs.dim, fs.rank, int(Y.shape[0]), len(cfg.c_grid), folds, solver=solver)
        plan.rates[fs.kind] = max(seconds - plan.per_solve * shape.solves, 0.1 * seconds) / max(shape.work(), 1.0)
        timed.append(f"{k} {fs.kind} unit{'s' if k != 1 else ''} in {seconds:.1f} s")
    if timed:
        plan.calibration = "timed: one fit of " + ", ".join(timed) + f" ({int(tr.numel())} rows)"


def _timed_fit(layout: SweepLayout, X: torch.Tensor, Y: torch.Tensor, groups: torch.Tensor, dev: torch.device) -> float:
    """Seconds of one sweep fit (`sweep._fit`) of `X` on this machine, as the sweep would run it."""
    with cpu_threads_for(float(X.numel()), dev), warnings.catch_warnings():
        warnings.simplefilter("ignore", ProbeFitWarning)
        t0 = time.perf_counter()
        _fit(layout.probe, X, Y, groups, layout.cfg, layout.seed)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return time.perf_counter() - t0
