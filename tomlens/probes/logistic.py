"""L2-regularised logistic probes for many units at once, C chosen per unit by grouped CV.

Per fold: standardise on the fold's training rows, reduce every unit's problem exactly to at most
min(n_train, d) columns (`reduce`: a pivoted Cholesky of the fold's Gram matrix, or, for units
whose rows span few dimensions such as per-head outputs, one row basis shared by all folds), then
walk the C grid from the strongest penalty to the weakest, each C's Newton solve warm-started from
the last (`newton`), units batched by rank. Validation accuracy picks C per unit (ties: lower
log-loss, then the smaller C); the final fit uses all rows with that C.

Several label vectors can be fitted on the same features in one pass (`fit_logistic`'s `Y`): the
type-level control's labels and a condition split share every Gram matrix and factorisation with
the real labels, so they cost little more than the probe itself.

A unit that cannot be fitted does not stop the others: its fit status (`FIT_STATUS`, the worst
over its cross-validation and final fits) says why, and its coefficients and C are NaN when it
failed ("solver_failed", "non_finite_input"). Units with NaN or inf activations never enter the
arithmetic shared with other units.

Everything runs on the fit's device, and the host reads back nothing per unit, fold or C value:
the solver looks at its batch every few Newton steps (`cadence`), each fold's reduction reads its
units' ranks once (to batch them by width), and the results come back in one copy per call.
"""

from __future__ import annotations

import math
import typing
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor

from tomlens.devices import resolve_device, to_device
from tomlens.errors import TomlensError
from tomlens.probes.base import Probe, encode_labels, one_vs_rest, scores_to_index, scores_to_proba
from tomlens.probes.cadence import check_every as check_every_steps
from tomlens.probes.newton import FIT_STATUS, NON_FINITE_INPUT, NOT_CONVERGED, SOLVER_FAILED, Workspace, newton_logistic
from tomlens.probes.reduce import BlockSums, RowBasis, Standardiser, reduce_rows, scale_spread
from tomlens.probes.splits import Split, as_codes, group_kfold

C_GRID: tuple[float, ...] = (0.001, 0.01, 0.1, 1.0, 10.0)
SMALL_WORK = 4e6  # unit x row x feature elements below which a fit runs on one CPU thread


class ProbeFitWarning(UserWarning):
    """Some probes did not converge or could not be fitted (see `LogisticFit.status`)."""


@dataclass(frozen=True)
class LogisticFit:
    """Raw-space probes for each label vector and unit, and how C was chosen.

    `status` indexes `FIT_STATUS`; where it is "solver_failed" or "non_finite_input" the unit's
    coef, intercept and C are NaN. `cv_accuracy` is NaN for a C whose fit failed on some fold."""

    coef: Float[Tensor, "label unit k d"]
    intercept: Float[Tensor, "label unit k"]
    C: Float[Tensor, "label unit"]
    classes: Int[Tensor, " c"]
    cv_accuracy: Float[Tensor, "label unit grid"] | None
    c_grid: tuple[float, ...]
    n_iter: int
    status: Int[Tensor, "label unit"]


@contextmanager
def cpu_threads_for(work: float, device: torch.device) -> Iterator[None]:
    """One CPU thread for small problems, the configured number otherwise.

    A probe fit is thousands of small tensor operations; splitting each across threads gains
    nothing when the tensors are small, and on a busy machine every split waits for a time slice
    for the second thread, which can make a small sweep thirty times slower.
    """
    if device.type != "cpu" or work >= SMALL_WORK or torch.get_num_threads() == 1:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _unit_chunks(u: int, n: int, d: int, j: int, budget_bytes: float) -> list[slice]:
    """Split units so one chunk's working set (features, Gram, reduced problems) fits the budget."""
    r = min(n, d)
    per_unit = 8 * n * d * 3 + 8 * n * n * 2 + 8 * j * (n * (r + 1) * 3 + (r + 1) ** 2 * 3)
    size = max(1, int(budget_bytes // max(per_unit, 1)))
    return [slice(a, min(a + size, u)) for a in range(0, u, size)]


def rank_buckets(ranks: Sequence[int], ratio: float = 1.25, slack: int = 8) -> list[tuple[list[int], int]]:
    """Group units of similar rank (known on the host), so each Newton batch is only as wide as
    its widest member: (unit indices, width) per group.

    One dead head (constant output, whose standardised rounding noise has nearly full rank) would
    otherwise make every head's problem as wide as its own."""
    order = sorted(range(len(ranks)), key=lambda i: ranks[i])  # stable, as argsort(stable=True)
    r = [int(ranks[i]) for i in order]
    out: list[tuple[list[int], int]] = []
    start = 0
    for i in range(1, len(r) + 1):
        if i == len(r) or r[i] > max(r[start] * ratio, r[start] + slack):
            out.append((order[start:i], max(r[i - 1], 1)))
            start = i
    return out


def _solve_dtype(device: torch.device) -> torch.dtype:
    """float64 Hessian solves on the CPU (exact and cheap there); float32 on accelerators, whose
    float64 can be 30-60x slower (still safe: a failed factorisation is damped, see newton.py)."""
    return torch.float64 if device.type == "cpu" else torch.float32


def _fit_reduced(Z: Tensor, T: Tensor, inv_c: Tensor, beta0: Tensor | None, max_iter: int, tol: float,
                 buckets: list[tuple[Tensor, int]], every: int, ws: Workspace) -> tuple[Tensor, Tensor, Tensor]:
    """Newton on reduced training features `Z` [u, m, r]; `T` [m, j] targets (on Z's device)
    shared by all units.

    Units are solved in `buckets` of similar rank (device indices, and the leading columns that
    carry data); the returned `beta` [u, j, r+1] has zeros in each unit's unused columns and the
    intercept last; with it the most Newton steps any problem took (a device scalar) and the
    status [u, j] of every fit. Nothing is read back here but the solver's own checks."""
    u, j = inv_c.shape
    m, r = Z.shape[1], Z.shape[2]
    y = T.unsqueeze(0)
    beta = torch.zeros(u, j, r + 1, dtype=torch.float64, device=Z.device) if beta0 is None else beta0.clone()
    status = torch.zeros(u, j, dtype=torch.long, device=Z.device)
    iters = torch.zeros((), dtype=torch.long, device=Z.device)
    for idx, rb in buckets:
        b0 = torch.cat([beta[idx, :, :rb], beta[idx, :, r:]], 2)
        res = newton_logistic(Z[idx, :, :rb], y.expand(idx.numel(), m, j), inv_c[idx], beta0=b0,
                              max_iter=max_iter, tol=tol, solve_dtype=_solve_dtype(Z.device),
                              check_every=every, validate=False, workspace=ws)
        beta[idx, :, :rb] = res.beta[..., :rb]
        beta[idx, :, r] = res.beta[..., rb]
        status[idx] = res.status
        iters = torch.maximum(iters, res.n_iter.max())
    return beta, iters, status


def _per_label(status: Tensor, L: int) -> Tensor:
    """Fit status [u, L*kk] (one-vs-rest columns per label vector) -> worst per label, [L, u]."""
    return status.view(status.shape[0], L, -1).amax(2).T


@dataclass
class _Problem:
    """One fold's reduced problem for a set of units: coordinates of all rows, the Newton batches
    (units of similar rank), and the map from reduced solutions back to raw-space weights."""

    Z: Tensor  # [u, n, r], rows in the chunk's order
    buckets: list[tuple[Tensor, int]]  # (device unit indices, width) per Newton batch
    to_raw: Callable[[Tensor], tuple[Tensor, Tensor]]  # beta [u, j, r+1] -> (coef [u, j, d], intercept [u, j])


def _device_buckets(ranks: Sequence[int], device: torch.device) -> list[tuple[Tensor, int]]:
    return [(to_device(idx, device), width) for idx, width in rank_buckets(ranks)]


def _problem(Xc: Tensor, sums: BlockSums | None, basis: RowBasis | None, basis_ranks: Sequence[int] | None,
             include: Sequence[int] | None, train: Tensor, weights: bool, every: int) -> _Problem:
    """Standardise on the blocks `include` (None: no standardisation) and reduce. With a row basis
    the ranks are known on the host (`basis_ranks`); a per-fold reduction's ranks are read back
    once here."""
    if sums is None:
        std = Standardiser.identity(Xc)
    else:
        assert include is not None  # block sums come with the blocks to standardise on
        std = Standardiser.from_blocks(sums, include)
    if basis is not None:
        assert basis_ranks is not None  # a row basis comes with its ranks
        Z, Wt = basis.standardised(std, weights)

        def to_raw(beta: Tensor) -> tuple[Tensor, Tensor]:
            assert Wt is not None, "raw weights need the map asked for (weights=True)"
            return std.to_raw(torch.bmm(beta[..., :-1], Wt), beta[..., -1])

        return _Problem(Z, _device_buckets(basis_ranks, Xc.device), to_raw)
    Xs = Xc if sums is None else std(Xc)
    red = reduce_rows(Xs, train, every=every)

    def to_raw_k(beta: Tensor) -> tuple[Tensor, Tensor]:
        return std.to_raw(red.weights(Xs, beta[..., :-1]), beta[..., -1])

    if red.pivots is None:  # the features themselves: every unit has all columns
        ranks = [red.rank] * Xc.shape[0]
    else:
        ranks = red.ranks(red.Z[:, to_device(train, Xc.device)]).tolist()  # the one host read of this fold
    return _Problem(red.Z, _device_buckets(ranks, Xc.device), to_raw_k if weights else _no_weights)


def _no_weights(beta: Tensor) -> tuple[Tensor, Tensor]:
    raise RuntimeError("weights were not requested for this fold")


def _cv_scores(Xc: Tensor, sums: BlockSums | None, basis: RowBasis | None, basis_ranks: Sequence[int] | None,
               index: Tensor, n_classes: int, folds: list[Split], c_grid: Sequence[float], max_iter: int,
               tol: float, every: int, ws: Workspace) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Mean validation accuracy and log-loss over the folds, [L, u, grid] each, per label vector
    (rows of `index`), the most Newton steps (a device scalar), and the worst fit status
    [L, u, grid] of each C over the folds. A C that fails on some fold gets NaN accuracy and
    log-loss, so it is never chosen over one that fitted everywhere."""
    u, n, d = Xc.shape
    L = index.shape[0]
    kk = 1 if n_classes == 2 else n_classes
    dev = Xc.device
    acc = torch.zeros(L, u, len(c_grid), dtype=torch.float64, device=dev)
    nll = torch.zeros_like(acc)
    status = torch.zeros(L, u, len(c_grid), dtype=torch.long, device=dev)  # worst over folds, per C
    iters = torch.zeros((), dtype=torch.long, device=dev)
    order = sorted(range(len(c_grid)), key=lambda i: c_grid[i])
    for f, split in enumerate(folds):
        tr, va = split.train, split.test
        include = [b for b in range(len(folds)) if b != f]
        prob = _problem(Xc, sums, basis, basis_ranks, include, tr, weights=False, every=every)
        ztr, zv = prob.Z[:, to_device(tr, dev)], prob.Z[:, to_device(va, dev)]
        T = to_device(torch.cat([one_vs_rest(index[l_][tr], n_classes) for l_ in range(L)]).T.contiguous(), dev)
        yv = to_device(index[:, va], dev)  # [L, nv]
        beta = None
        for ci in order:
            inv_c = torch.full((u, L * kk), 1.0 / c_grid[ci], dtype=torch.float64, device=dev)
            beta, it, st = _fit_reduced(ztr, T, inv_c, beta, max_iter, tol, prob.buckets, every, ws)
            iters = torch.maximum(iters, it)
            st = _per_label(st, L)
            status[:, :, ci] = torch.maximum(status[:, :, ci], st)
            nan = torch.where(st >= SOLVER_FAILED, torch.nan, 0.0)  # [L, u]: NaN poisons this C
            s = torch.bmm(zv, beta[..., :-1].transpose(1, 2)) + beta[..., -1].unsqueeze(1)  # [u, nv, L*kk]
            s = s.view(u, -1, L, kk).permute(2, 0, 1, 3)  # [L, u, nv, kk]
            acc[:, :, ci] += (scores_to_index(s) == yv.unsqueeze(1)).to(torch.float64).mean(2) + nan
            proba = scores_to_proba(s).clamp(1e-15, 1 - 1e-15)
            picked = torch.gather(proba, 3, yv.view(L, 1, -1, 1).expand(L, u, -1, 1)).squeeze(3)
            nll[:, :, ci] += -picked.log().mean(2) + nan
    return acc / len(folds), nll / len(folds), iters, status


@dataclass
class _UnitsFit:
    """One set of units' fits, on the device: coef [L, u, k, d], intercept [L, u, k], C [L, u],
    CV accuracy [L, u, grid] (None without CV), the most Newton steps (a scalar) and the worst fit
    status [L, u] of the chosen C's cross-validation fits and the final fit."""

    coef: Tensor
    intercept: Tensor
    C: Tensor
    cv_accuracy: Tensor | None
    iters: Tensor
    status: Tensor


def _fit_units(Xc: Tensor, sums: BlockSums | None, basis: RowBasis | None, basis_ranks: Sequence[int] | None,
               index: Tensor, n_classes: int, folds: list[Split], c_grid: tuple[float, ...], max_iter: int,
               tol: float, every: int, ws: Workspace) -> _UnitsFit:
    """CV over the C grid, then the final fit on all rows (a C that failed but was not chosen
    does not mark the unit)."""
    u, n, d = Xc.shape
    L = index.shape[0]
    kk = 1 if n_classes == 2 else n_classes
    dev = Xc.device
    acc = None
    iters = torch.zeros((), dtype=torch.long, device=dev)
    status = torch.zeros(L, u, dtype=torch.long, device=dev)
    if folds:
        acc, nll, iters, per_c = _cv_scores(Xc, sums, basis, basis_ranks, index, n_classes, folds, c_grid,
                                            max_iter, tol, every, ws)
        pick = choose_c(acc, nll, c_grid)  # [L, u]
        c_u = to_device(torch.tensor(c_grid, dtype=torch.float64), dev)[pick]
        status = torch.gather(per_c, 2, pick.unsqueeze(2)).squeeze(2)
    else:
        c_u = torch.full((L, u), c_grid[0], dtype=torch.float64, device=dev)
    include = None if sums is None else list(range(sums.count.numel()))
    prob = _problem(Xc, sums, basis, basis_ranks, include, torch.arange(n), weights=True, every=every)
    T = to_device(torch.cat([one_vs_rest(index[l_], n_classes) for l_ in range(L)]).T.contiguous(), dev)  # [n, L*kk]
    inv_c = (1.0 / c_u).T.repeat_interleave(kk, dim=1)  # [u, L*kk]
    beta, it, st = _fit_reduced(prob.Z, T, inv_c, None, max_iter, tol, prob.buckets, every, ws)
    w_raw, b_raw = prob.to_raw(beta)
    coef = w_raw.view(u, L, kk, d).permute(1, 0, 2, 3)
    intercept = b_raw.view(u, L, kk).permute(1, 0, 2)
    return _UnitsFit(coef, intercept, c_u, acc, torch.maximum(iters, it), torch.maximum(status, _per_label(st, L)))


def choose_c(acc: Float[Tensor, "... grid"], nll: Float[Tensor, "... grid"],
             c_grid: Sequence[float]) -> Int[Tensor, " ..."]:
    """Index of the best C: highest accuracy; ties broken by lower log-loss, then smaller C.
    A C with NaN accuracy (its fit failed) is chosen only when every C failed."""
    cs = to_device(torch.tensor(list(c_grid), dtype=torch.float64), acc.device)
    failed = acc.isnan() | nll.isnan()
    acc = torch.where(failed, -math.inf, acc)
    nll = torch.where(failed, math.inf, nll)
    best = acc.max(-1, keepdim=True).values
    tied = acc >= best - 1e-9
    nll_t = torch.where(tied, nll, torch.full_like(nll, math.inf))
    best_nll = nll_t.min(-1, keepdim=True).values
    tied &= nll_t <= best_nll + 1e-12 * (1 + best_nll.abs())
    key = torch.where(tied, cs.expand_as(acc), torch.full_like(acc, math.inf))
    return key.argmin(-1)


def inner_folds(groups: Tensor, n_rows: int, cv: int, seed: int) -> list[Split]:
    """Grouped folds for choosing C; fewer folds when there are fewer groups than `cv`."""
    n_groups = int(torch.unique(groups).numel())
    if n_groups < 2:
        raise TomlensError(
            f"choosing C by cross-validation needs at least two groups (stories); got {n_groups}",
            "pass a single C value, or more stories",
        )
    return group_kfold(groups, min(cv, n_groups), seed)


def fit_logistic(
    X: Float[Tensor, "unit n d"],
    Y: Int[Tensor, "label n"],
    *,
    groups: Sequence[Any] | Tensor | None = None,
    c_grid: Sequence[float] = C_GRID,
    cv: int = 4,
    seed: int = 0,
    standardize: bool = True,
    device: str | torch.device | None = None,
    max_iter: int = 100,
    tol: float = 1e-6,
    dtype: torch.dtype = torch.float64,
    low_rank: bool = True,
    memory_budget: float = 2**31,
    check_every: int | None = None,
) -> LogisticFit:
    """Fit probes for every unit and every label vector in `Y` (which share one set of classes).

    With several C values, C is chosen per unit and label vector by grouped cross-validation over
    `groups` (rows without groups are their own group); the final probes are fitted on all rows.
    `dtype` is the precision of standardisation and Gram matrices: float64 reproduces
    scikit-learn's optimum; weakly regularised probes (large C) on data with d > n are
    ill-conditioned enough that float32 rounding moves their decision values visibly.
    `low_rank` lets units whose rows span no more dimensions than a fold has rows (per-head outputs) use
    one basis for every fold instead of one Gram matrix per fold (same solution, less work).

    Never raises for numerical reasons: a unit that cannot be fitted gets NaN coefficients and
    its reason in `LogisticFit.status`, and one `ProbeFitWarning` sums up the units that failed or
    did not converge.

    Runs on `device` (the activations move there a chunk of units at a time) and reads back
    nothing per unit, fold, C or Newton step: the solver looks every `check_every` steps
    (`tomlens.probes.cadence`), each chunk's reduction reads its units' ranks once
    (`_chunk_parts`), and the results come to the host in one copy at the end.
    """
    dev = resolve_device(device)
    Y, classes, index, c_grid = _checked_labels(X, Y, c_grid)
    u, n, d = X.shape
    every = check_every_steps(dev, check_every)
    n_classes = classes.numel()
    kk = 1 if n_classes == 2 else n_classes
    L = Y.shape[0]
    codes = as_codes(groups, n)
    folds = inner_folds(codes, n, cv, seed) if len(c_grid) > 1 else []
    block = _row_blocks(folds, n)
    # a unit with NaN or inf activations is fitted as zeros (cheap and harmless) and reported
    mag = X.abs().flatten(1).amax(1).to(torch.float64)  # [u]; NaN where a NaN is
    non_finite = to_device(~torch.isfinite(mag), dev)
    rescale = to_device(_safe_scale(torch.where(torch.isfinite(mag), mag, 0.0), n, dtype), dev) if standardize \
        else torch.ones(u, dtype=torch.float64, device=dev)

    with cpu_threads_for(float(u) * n * d, dev):
        coef = torch.zeros(L, u, kk, d, dtype=torch.float64, device=dev)
        intercept = torch.zeros(L, u, kk, dtype=torch.float64, device=dev)
        chosen = torch.zeros(L, u, dtype=torch.float64, device=dev)
        cv_acc = torch.zeros(L, u, len(c_grid), dtype=torch.float64, device=dev)
        status = torch.zeros(L, u, dtype=torch.long, device=dev)
        iters = torch.zeros((), dtype=torch.long, device=dev)
        ws = Workspace()  # Newton's scratch memory, reused by every solve of this call
        m_min = min((f.train.numel() for f in folds), default=n)
        for sl in _unit_chunks(u, n, d, L * kk, memory_budget):
            Xc = to_device(X[sl], dev).to(dtype, copy=True)  # our own copy: scaled in place below
            # rescaled (x 1 is exact), and zero where a unit is not finite: no host branch
            Xc.mul_(rescale[sl].to(dtype).view(-1, 1, 1)).masked_fill_(non_finite[sl].view(-1, 1, 1), 0.0)
            sums = BlockSums.of(Xc, block, max(len(folds), 1)) if standardize else None
            for idx_host, part_basis, part_ranks in _chunk_parts(Xc, sums, len(folds), low_rank, m_min, every):
                idx = to_device(idx_host, dev)
                sub = None if sums is None else sums.subset(idx)
                fit = _fit_units(Xc[idx], sub, part_basis, part_ranks, index, n_classes, folds, c_grid, max_iter,
                                 tol, every, ws)
                where = to_device([sl.start + i for i in idx_host], dev)
                coef[:, where] = fit.coef
                intercept[:, where] = fit.intercept
                chosen[:, where] = fit.C
                status[:, where] = fit.status
                if fit.cv_accuracy is not None:
                    cv_acc[:, where] = fit.cv_accuracy
                iters = torch.maximum(iters, fit.iters)
        # the results come to the host once per call
        coef, intercept, chosen, status, cv_acc, iters, rescale, non_finite = _to_host(
            coef, intercept, chosen, status, cv_acc, iters, rescale, non_finite)
    coef, intercept, chosen, status = _raw_weights(coef, intercept, chosen, status, rescale, non_finite)
    _warn_status(status, max_iter, tol)
    return LogisticFit(coef=coef, intercept=intercept, C=chosen, classes=classes,
                       cv_accuracy=cv_acc if folds else None, c_grid=c_grid, n_iter=int(iters), status=status)


def _checked_labels(X: Tensor, Y: Tensor, c_grid: Sequence[float]
                    ) -> tuple[Tensor, Tensor, Tensor, tuple[float, ...]]:
    """(labels as [L, n], their classes, each label's class index, the C grid as floats), or a
    clear error for activations that are not [unit, n, d], labels that do not match them or do not
    share one set of classes, and a C grid that is empty or not positive."""
    if X.ndim != 3:
        raise TomlensError(f"activations must be [unit, n, d], got shape {tuple(X.shape)}",
                           "add a leading unit axis (X[None]) for a single probe")
    Y = torch.as_tensor(Y).long()
    if Y.ndim == 1:
        Y = Y.unsqueeze(0)
    n = X.shape[1]
    if Y.shape[1] != n:
        raise TomlensError(f"{Y.shape[1]} labels for {n} rows of activations", "pass one label per row")
    classes, _ = encode_labels(Y[0])
    index = torch.searchsorted(classes, Y)  # [L, n]
    if not bool((classes[index.clamp_max(classes.numel() - 1)] == Y).all()):
        raise TomlensError("the label vectors do not share one set of classes",
                           "pass label vectors over the same classes (e.g. the target and a control task)")
    grid = tuple(float(c) for c in c_grid)
    if not grid or any(c <= 0 for c in grid):
        raise TomlensError(f"C grid {grid} is empty or not positive", "use positive C values")
    return Y, classes, index, grid


def _row_blocks(folds: Sequence[Split], n: int) -> list[int]:
    """Each row's inner fold (0 for every row when there are no folds), on the host."""
    block = [0] * n
    for f, split in enumerate(folds):
        for i in split.test.tolist():
            block[i] = f
    return block


def _chunk_parts(Xc: Tensor, sums: BlockSums | None, n_folds: int, low_rank: bool, m_min: int, every: int
                 ) -> list[tuple[list[int], RowBasis | None, list[int] | None]]:
    """The units of a chunk in the groups fitted together: (unit indices, a shared row basis and
    their ranks) for units whose rows span no more dimensions than a fold has rows, then (the
    others, None, None); one group of all units when nothing is reduced. One host read per chunk."""
    uc, d = Xc.shape[0], Xc.shape[2]
    parts: list[tuple[list[int], RowBasis | None, list[int] | None]] = [(list(range(uc)), None, None)]
    if sums is None or not (low_rank and m_min < d):
        return parts
    basis, small = RowBasis.of(Xc, max_rank=m_min, every=every)
    # the basis keeps raw directions down to ~1e-6 of the largest: units whose
    # standardisation blows up far smaller ones are reduced per fold instead
    n_blk = sums.count.numel()
    includes = [[b for b in range(n_blk) if b != f] for f in range(n_folds)]
    small &= scale_spread(sums, includes + [list(range(n_blk))]) >= 1e-4
    flags, ranks = torch.stack([small.long(), basis.ranks]).tolist()  # one host read per chunk
    lo = [i for i, f in enumerate(flags) if f]
    hi = [i for i, f in enumerate(flags) if not f]
    if not lo:
        return parts
    lo_ranks = [ranks[i] for i in lo]
    out: list[tuple[list[int], RowBasis | None, list[int] | None]] = [
        (lo, basis.subset(to_device(lo, Xc.device), max(lo_ranks)), lo_ranks)]
    return out + ([(hi, None, None)] if hi else [])


def _raw_weights(coef: Tensor, intercept: Tensor, chosen: Tensor, status: Tensor, rescale: Tensor,
                 non_finite: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """On the host: weights on the raw features (not the rescaled ones), non-finite units marked,
    and NaN weights and C wherever a fit failed."""
    L, u = status.shape
    coef = coef * rescale.view(1, u, 1, 1)  # weights on the rescaled features -> on the raw ones
    status = torch.where(non_finite.view(1, u), NON_FINITE_INPUT, status)
    failed = status >= SOLVER_FAILED
    nan = torch.tensor(torch.nan, dtype=torch.float64)
    coef = torch.where(failed.view(L, u, 1, 1), nan, coef)
    intercept = torch.where(failed.view(L, u, 1), nan, intercept)
    chosen = torch.where(failed, nan, chosen)
    return coef, intercept, chosen, status


def _to_host(*tensors: Tensor) -> list[Tensor]:
    """The tensors on the host, in one copy (one wait on an accelerator, not one per tensor):
    flattened into one float64 buffer (exact for the booleans, small integers and float64 here)."""
    flat = torch.cat([t.reshape(-1).to(torch.float64) for t in tensors])
    host = flat.cpu()
    out, at = [], 0
    for t in tensors:
        out.append(host[at:at + t.numel()].view(t.shape).to(t.dtype, copy=True))  # no shared storage
        at += t.numel()
    return out


def _safe_scale(mag: Float[Tensor, " u"], n: int, dtype: torch.dtype) -> Float[Tensor, " u"]:
    """Per unit, a power of two that brings max |x| = `mag` near 1 where sums of n squares would
    overflow or underflow `dtype` (float32 from |x| ~ 1e17), 1 elsewhere. Standardisation cannot
    see a unit's scale, and a power of two keeps every value exact."""
    fi = torch.finfo(dtype)
    safe = ((mag < (fi.max / n) ** 0.5 / 16) & (mag > fi.tiny ** 0.5 * 16)) | (mag == 0)
    return torch.where(safe, 1.0, torch.ldexp(torch.ones_like(mag), -torch.frexp(mag).exponent))


def _status_counts(status: Int[Tensor, " ..."]) -> dict[str, int]:
    """How many entries of a fit-status tensor have each reason other than "ok"."""
    counts = torch.bincount(status.flatten(), minlength=len(FIT_STATUS)).tolist()
    return {FIT_STATUS[i]: c for i, c in enumerate(counts) if i and c}


def _warn_status(status: Tensor, max_iter: int, tol: float) -> None:
    counts = _status_counts(status)
    if not counts:
        return
    parts = []
    slow = counts.pop(FIT_STATUS[NOT_CONVERGED], 0)
    if slow:
        parts.append(f"{slow} stopped at max_iter={max_iter} before "
                     f"reaching tol={tol} (fit_status 'not_converged': scores may be slightly off; raise max_iter)")
    if counts:
        why = ", ".join(f"{c} {name}" for name, c in counts.items())
        parts.append(f"{sum(counts.values())} could not be fitted ({why}: coefficients NaN)")
    warnings.warn(f"of {status.numel()} logistic probes, " + "; ".join(parts), ProbeFitWarning, stacklevel=3)


class LogisticProbe(Probe):
    """L2 logistic regression per unit (scikit-learn's objective), standardised features.

    `C` is a grid (chosen per unit by grouped `cv`-fold cross-validation over the `groups` given to
    `fit`) or a single value. Runs on `device` (default: the GPU when there is one).
    """

    def __init__(self, C: float | Sequence[float] = C_GRID, *, cv: int = 4, seed: int = 0,
                 standardize: bool = True, device: str | torch.device | None = None,
                 max_iter: int = 100, tol: float = 1e-6, dtype: torch.dtype = torch.float64,
                 check_every: int | None = None):
        self.C = C
        self.check_every = check_every
        self.dtype = dtype
        self.cv = cv
        self.seed = seed
        self.standardize = standardize
        self.device = device
        self.max_iter = max_iter
        self.tol = tol

    @property
    def c_grid(self) -> tuple[float, ...]:
        c = self.C
        return tuple(float(x) for x in c) if isinstance(c, (list, tuple)) else (float(typing.cast(float, c)),)

    def fit(self, X: Float[Tensor, "unit n d"], y: Int[Tensor, " n"],
            groups: Sequence[Any] | Tensor | None = None) -> LogisticProbe:
        res = fit_logistic(X, torch.as_tensor(y).unsqueeze(0), groups=groups, c_grid=self.c_grid,
                           cv=self.cv, seed=self.seed, standardize=self.standardize,
                           device=self.device, max_iter=self.max_iter, tol=self.tol, dtype=self.dtype,
                           check_every=self.check_every)
        return self._set(res, 0)

    def _set(self, res: LogisticFit, label: int) -> LogisticProbe:
        self.coef_ = res.coef[label]
        self.intercept_ = res.intercept[label]
        self.classes_ = res.classes
        self.C_ = res.C[label]
        self.cv_accuracy_ = None if res.cv_accuracy is None else res.cv_accuracy[label]
        self.n_iter_ = res.n_iter
        self.fit_status_ = res.status[label]
        return self

    @classmethod
    def from_fit(cls, res: LogisticFit, label: int = 0, **kwargs: Any) -> LogisticProbe:
        """A fitted probe for one of the label vectors of `fit_logistic`."""
        return cls(C=res.c_grid, **kwargs)._set(res, label)

    def metadata(self) -> dict[str, Any]:
        return {**super().metadata(), "C": [float(c) for c in self.C_.tolist()],
                "c_grid": list(self.c_grid), "cv": self.cv, "standardize": self.standardize,
                "objective": "sum logloss + ||w||^2/(2C), intercept unpenalised, standardised features"}
