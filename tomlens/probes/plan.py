"""What a probe run will fit, said before it fits: the fits of each stage, their sizes, and the time.

A probe sweep's time is set by its Newton solves. Every fit chooses C by grouped cross-validation
(inner folds x C values solves, then one on all training rows), and each solve is a few batched
Newton steps over the units' reduced problems: at most min(rows, d) columns, the span of a head's
output (about d / heads) for per-head sites, one set per label vector fitted together (the
target, its type-level control, its condition split). So the plan counts, from the sweep's own
splits and before anything is fitted, how many fits of how many units on how many rows each
stage runs, prices each in multiply-adds (`FitShape.work`), times one small real fit per site
kind on this machine (`time_fit`: a few units, the sweep's first split), and scales.

Why a model and not a stopwatch only: a sweep is hundreds of fits of different sizes (per-head
units are cheap, whole-layer units on hundreds of rows are not, a baseline is one unit), so one
timed fit must be carried over to the others by their size. The estimate is good to a factor of
about 1.5 (Newton steps per solve vary with the data: `NEWTON_STEPS` is their typical number);
`budget_minutes` refuses a plan whose estimate exceeds it before any fit, naming what shrinks it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tomlens.errors import TomlensError
from tomlens.timing import format_seconds

NEWTON_STEPS = 4  # steps per warm-started solve (3-5 on SmolLM2 sweeps; the first C of a fold from zero)
SHRINK = ("--sites (e.g. resid_post only: per-head sites have 9x the units)", "--c-grid (fewer C values)",
          "--inner-folds 2", "--folds 3", "--no-random-twin", "--no-conditions", "fewer stimuli")


@dataclass(frozen=True)
class FitShape:
    """`count` probe fits of `units` units on `rows` training rows of dimension `dim`, whose
    reduced problems have at most `rank` columns, fitting `labels` decision columns together, with
    C chosen from `grid` values by `folds` inner folds (0: one C, no cross-validation). `kind` says
    which timed fit prices it; `solver` is "logistic" or "mass_mean"."""

    units: int
    rows: int
    dim: int
    rank: int
    labels: int
    grid: int
    folds: int
    count: int = 1
    kind: str = ""
    solver: str = "logistic"

    @property
    def solves(self) -> int:
        """Newton solves of one fit: one per inner fold and C value, and one on all rows."""
        if self.solver == "mass_mean":
            return 1
        return (self.folds * self.grid if self.folds and self.grid > 1 else 0) + 1

    def work(self) -> float:
        """Multiply-adds of one fit: Newton steps (Hessians and their factorisations), and the
        reductions (Gram matrices, pivoted Cholesky, or one row basis for low-rank units)."""
        if self.units <= 0 or self.rows <= 0:
            return 0.0
        if self.solver == "mass_mean":
            return float(self.units * self.rows * self.dim * max(self.labels, 1))
        low_rank = self.rank < self.dim

        def newton(m: float) -> float:
            r = min(m, self.rank) + 1
            return NEWTON_STEPS * self.units * self.labels * (m * r * r + r ** 3 / 3)

        def reduction(m: float) -> float:
            if low_rank:  # a row basis serves every fold: an r x r system per fold
                return self.units * self.dim * self.rank ** 2
            if self.dim > m:  # a Gram matrix and its pivoted Cholesky per fold
                return self.units * (self.rows ** 2 * self.dim + self.rows * m * m / 2)
            return self.units * self.rows * self.dim  # the standardised features themselves

        total = newton(self.rows) + reduction(self.rows)
        if self.folds and self.grid > 1:
            m = self.rows * (self.folds - 1) / self.folds
            total += self.folds * (self.grid * newton(m) + reduction(m))
        if low_rank:
            total += self.units * self.rows ** 2 * self.dim  # the row basis, once per fit
        return float(total)


def null_work(units: int, rows: int, dim: int, folds: int, labels: int) -> float:
    """Multiply-adds of the max-statistic null's ridge fits: per unit and fold a Gram matrix, one
    LU factorisation and a solve for every permuted label vector (`labels` columns)."""
    if folds < 2:
        return 0.0
    t = rows * (folds - 1) / folds
    te = rows / folds
    return float(units * folds * (t * t * dim + 2 * t ** 3 / 3 + 2 * t * t * labels + te * t * (dim + labels)))


@dataclass
class PlanStage:
    """One stage: `what` it fits, the fits (`shapes`), and work outside them (`extra`, multiply-adds
    priced like `kind`), or a time known beforehand (`seconds`, e.g. caching measured earlier)."""

    name: str
    what: str
    shapes: list[FitShape] = field(default_factory=list)
    extra: float = 0.0
    extra_kind: str = ""
    seconds: float | None = None

    @property
    def fits(self) -> int:
        return sum(s.count for s in self.shapes)


@dataclass
class ProbePlan:
    """Every stage with its fits; seconds per multiply-add of each site kind (`rates`) and seconds
    per Newton solve whatever its size (`per_solve`: the Python and kernel-launch overhead that
    dominates one-unit fits), both from timed fits; `budget_seconds` refuses a larger estimate
    (`check_budget`)."""

    stages: list[PlanStage]
    header: str
    rates: dict[str, float] = field(default_factory=dict)
    per_solve: float = 0.0
    calibration: str = ""
    budget_seconds: float | None = None
    notes: list[str] = field(default_factory=list)

    def rate(self, kind: str) -> float | None:
        """Seconds per multiply-add for `kind` (where `kind` was not timed, e.g. a text baseline of
        one unit, the fastest timed kind: such fits cost their per-solve overhead, not flops)."""
        if kind in self.rates:
            return self.rates[kind]
        return min(self.rates.values()) if self.rates else None

    def seconds(self, stage: PlanStage | None = None) -> float | None:
        """Estimated seconds of one stage, or of all the stages that can be estimated (None before
        any fit was timed, or for a stage with nothing to price, such as caching not timed)."""
        if stage is None:
            known = [t for t in (self.seconds(s) for s in self.stages) if t is not None]
            return sum(known) if known or not self.stages else None
        total = 0.0
        for st in [stage]:
            if st.seconds is not None:
                total += st.seconds
                continue
            if not st.shapes and not st.extra:
                return None
            for s in st.shapes:
                r = self.rate(s.kind)
                if r is None:
                    return None
                total += s.count * (r * s.work() + self.per_solve * s.solves)
            if st.extra:
                r = self.rate(st.extra_kind)
                if r is None:
                    return None
                total += r * st.extra
        return total

    def check_budget(self) -> None:
        """Refuse a plan whose estimate exceeds `budget_seconds`, naming what shrinks it."""
        total = self.seconds()
        if self.budget_seconds is None or total is None or total <= self.budget_seconds:
            return
        biggest = max(self.stages, key=lambda s: self.seconds(s) or 0.0)
        raise TomlensError(
            f"the probe plan is estimated at {format_seconds(total)}, more than the budget of "
            f"{format_seconds(self.budget_seconds)} (largest stage: {biggest.name}, "
            f"{format_seconds(self.seconds(biggest) or 0.0)})",
            f"shrink it with {', '.join(SHRINK)}; or raise --budget-minutes to {math.ceil(total / 60)}",
        )

    def lines(self) -> list[str]:
        width = max([len(s.name) for s in self.stages] + [len("total")])
        out = [self.header]
        for s in self.stages:
            t = self.seconds(s)
            eta = f"; ~{format_seconds(t)}" if t is not None else ""
            out.append(f"  {s.name:<{width}}  {s.what}{eta}")
        total = self.seconds()
        budget = f" (budget {format_seconds(self.budget_seconds)})" if self.budget_seconds is not None else ""
        eta = f"estimated {format_seconds(total)}" if total is not None else "not timed"
        out.append(f"  {'total':<{width}}  {sum(s.fits for s in self.stages):,} fits; {eta}{budget}")
        if self.calibration:
            out.append(f"  {'':<{width}}  {self.calibration}")
        out.extend(f"note: {n}" for n in self.notes)
        return out

    def to_dict(self) -> dict[str, Any]:
        total = self.seconds()
        return {
            "stages": [{"name": s.name, "what": s.what, "fits": s.fits,
                        "estimated_seconds": _rounded(self.seconds(s))} for s in self.stages],
            "estimated_seconds": _rounded(total), "budget_seconds": self.budget_seconds,
            "calibration": self.calibration, "notes": list(self.notes),
        }


def _rounded(s: float | None) -> float | None:
    return None if s is None or not math.isfinite(s) else round(s, 1)


def describe_units(kinds: Sequence[tuple[str, int]]) -> str:
    """'resid_post 30 units + head_out 270 units'."""
    return " + ".join(f"{k} {u:,} unit{'s' if u != 1 else ''}" for k, u in kinds)


__all__ = ["FitShape", "NEWTON_STEPS", "PlanStage", "ProbePlan", "describe_units", "null_work"]
