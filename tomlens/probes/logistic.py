"""L2-regularised logistic probes for many units at once, C chosen per unit by grouped CV.

Per fold: standardise on the fold's training rows, reduce every unit's problem to at most
min(n_train, d) columns (`reduce`), then walk the C grid from the strongest penalty to the
weakest, each C's Newton solve warm-started from the last (`newton`). Validation accuracy picks C
per unit (ties: lower log-loss, then the smaller C); the final fit uses all rows with that C.

Several label vectors can be fitted on the same features in one pass (`fit_logistic`'s `Y`): the
shuffled-label control shares every Gram matrix and factorisation with the real labels, so it
costs little more than the probe itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from collections.abc import Sequence
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor

from tomlens.errors import TomlensError
from tomlens.probes.base import Probe, encode_labels, one_vs_rest, scores_to_index, scores_to_proba
from tomlens.probes.newton import newton_logistic
from tomlens.probes.reduce import BlockSums, Standardiser, reduce_rows
from tomlens.probes.splits import Split, as_codes, group_kfold

C_GRID: tuple[float, ...] = (0.001, 0.01, 0.1, 1.0, 10.0)


@dataclass(frozen=True)
class LogisticFit:
    """Raw-space probes for each label vector and unit, and how C was chosen."""

    coef: Float[Tensor, "label unit k d"]
    intercept: Float[Tensor, "label unit k"]
    C: Float[Tensor, "label unit"]
    classes: Int[Tensor, " c"]
    cv_accuracy: Float[Tensor, "label unit grid"] | None
    c_grid: tuple[float, ...]
    n_iter: int


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _unit_chunks(u: int, n: int, d: int, j: int, budget_bytes: float) -> list[slice]:
    """Split units so one chunk's working set (features, Gram, reduced problems) fits the budget."""
    r = min(n, d)
    per_unit = 4 * n * d * 3 + 8 * n * n * 2 + 8 * j * (n * (r + 1) * 3 + (r + 1) ** 2 * 3)
    size = max(1, int(budget_bytes // max(per_unit, 1)))
    return [slice(a, min(a + size, u)) for a in range(0, u, size)]


def _fit_reduced(Z: Tensor, T: Tensor, inv_c: Tensor, beta0: Tensor | None,
                 max_iter: int, tol: float) -> tuple[Tensor, int]:
    """Newton on reduced training features `Z` [u, m, r]; `T` [j, m] targets shared by all units."""
    u, j = inv_c.shape
    y = T.to(Z.device, torch.float64).T.unsqueeze(0).expand(u, Z.shape[1], j)
    res = newton_logistic(Z, y, inv_c, beta0=beta0, max_iter=max_iter, tol=tol)
    return res.beta, int(res.n_iter.max())


def _cv_scores(Xc: Tensor, sums: BlockSums | None, index: Tensor, n_classes: int, folds: list[Split],
               c_grid: Sequence[float], max_iter: int, tol: float) -> tuple[Tensor, Tensor, int]:
    """Mean validation accuracy and log-loss per (label, unit, C) over folds.

    `index` [L, n]: class index of each row for each label vector; fold f's validation rows are
    block f of `sums` (None: no standardisation)."""
    u = Xc.shape[0]
    L = index.shape[0]
    kk = 1 if n_classes == 2 else n_classes
    acc = torch.zeros(L, u, len(c_grid), dtype=torch.float64, device=Xc.device)
    nll = torch.zeros_like(acc)
    iters = 0
    order = sorted(range(len(c_grid)), key=lambda i: c_grid[i])
    for f, split in enumerate(folds):
        tr, va = split.train, split.test
        if sums is None:
            Xs = Xc
        else:
            include = torch.ones(len(folds), dtype=torch.bool)
            include[f] = False
            Xs = Standardiser.from_blocks(sums, include)(Xc)
        red = reduce_rows(Xs, tr)
        del Xs
        ztr, zv = red.Z[:, tr.to(Xc.device)], red.Z[:, va.to(Xc.device)]
        T = torch.cat([one_vs_rest(index[l_][tr], n_classes) for l_ in range(L)])  # [L*kk, m]
        yv = index[:, va].to(Xc.device)  # [L, nv]
        beta = None
        for ci in order:
            inv_c = torch.full((u, L * kk), 1.0 / c_grid[ci], dtype=torch.float64, device=Xc.device)
            beta, it = _fit_reduced(ztr, T, inv_c, beta, max_iter, tol)
            iters = max(iters, it)
            s = torch.bmm(zv, beta[..., :-1].transpose(1, 2)) + beta[..., -1].unsqueeze(1)  # [u, nv, L*kk]
            s = s.view(u, -1, L, kk).permute(2, 0, 1, 3)  # [L, u, nv, kk]
            acc[:, :, ci] += (scores_to_index(s) == yv.unsqueeze(1)).to(torch.float64).mean(2)
            proba = scores_to_proba(s).clamp(1e-15, 1 - 1e-15)
            picked = torch.gather(proba, 3, yv.view(L, 1, -1, 1).expand(L, u, -1, 1)).squeeze(3)
            nll[:, :, ci] += -picked.log().mean(2)
    return acc / len(folds), nll / len(folds), iters


def choose_c(acc: Float[Tensor, "... grid"], nll: Float[Tensor, "... grid"],
             c_grid: Sequence[float]) -> Int[Tensor, "..."]:
    """Index of the best C: highest accuracy; ties broken by lower log-loss, then smaller C."""
    cs = torch.tensor(list(c_grid), dtype=torch.float64, device=acc.device)
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
    tol: float = 1e-10,
    memory_budget: float = 2**30,
) -> LogisticFit:
    """Fit probes for every unit and every label vector in `Y` (which share one set of classes).

    With several C values, C is chosen per unit and label vector by grouped cross-validation over
    `groups` (rows without groups are their own group); the final probes are fitted on all rows.
    """
    dev = torch.device(device) if device is not None else default_device()
    if X.ndim != 3:
        raise TomlensError(f"activations must be [unit, n, d], got shape {tuple(X.shape)}",
                           "add a leading unit axis (X[None]) for a single probe")
    Y = torch.as_tensor(Y).long()
    if Y.ndim == 1:
        Y = Y.unsqueeze(0)
    u, n, d = X.shape
    if Y.shape[1] != n:
        raise TomlensError(f"{Y.shape[1]} labels for {n} rows of activations", "pass one label per row")
    classes, idx0 = encode_labels(Y[0])
    index = torch.searchsorted(classes, Y)  # [L, n]
    if not bool((classes[index.clamp_max(classes.numel() - 1)] == Y).all()):
        raise TomlensError("the label vectors do not share one set of classes",
                           "pass label vectors over the same classes (e.g. true and shuffled)")
    c_grid = tuple(float(c) for c in c_grid)
    if not c_grid or any(c <= 0 for c in c_grid):
        raise TomlensError(f"C grid {c_grid} is empty or not positive", "use positive C values")
    n_classes = classes.numel()
    kk = 1 if n_classes == 2 else n_classes
    L = Y.shape[0]
    codes = as_codes(groups, n)
    folds = inner_folds(codes, n, cv, seed) if len(c_grid) > 1 else []

    coef = torch.zeros(L, u, kk, d, dtype=torch.float64)
    intercept = torch.zeros(L, u, kk, dtype=torch.float64)
    chosen = torch.zeros(L, u, dtype=torch.float64)
    cv_acc = torch.zeros(L, u, len(c_grid), dtype=torch.float64) if folds else None
    iters = 0
    for sl in _unit_chunks(u, n, d, L * kk, memory_budget):
        Xc = X[sl].to(dev)
        if not Xc.is_floating_point():
            Xc = Xc.float()
        if Xc.dtype in (torch.float16, torch.bfloat16):
            Xc = Xc.float()
        uc = Xc.shape[0]
        sums = None
        if standardize:
            block = torch.zeros(n, dtype=torch.long)
            for f, split in enumerate(folds):
                block[split.test] = f
            sums = BlockSums.of(Xc, block, max(len(folds), 1))
        if folds:
            acc, nll, it = _cv_scores(Xc, sums, index, n_classes, folds, c_grid, max_iter, tol)
            iters = max(iters, it)
            best = choose_c(acc, nll, c_grid)  # [L, uc]
            cv_acc[:, sl] = acc.cpu()
            c_u = torch.tensor(c_grid, dtype=torch.float64, device=dev)[best]
        else:
            c_u = torch.full((L, uc), c_grid[0], dtype=torch.float64, device=dev)
        std = Standardiser.identity(Xc) if sums is None else \
            Standardiser.from_blocks(sums, torch.ones(sums.count.numel(), dtype=torch.bool))
        Xs = std(Xc) if sums is not None else Xc
        red = reduce_rows(Xs, torch.arange(n))
        T = torch.cat([one_vs_rest(index[l_], n_classes) for l_ in range(L)])  # [L*kk, n]
        inv_c = (1.0 / c_u).T.repeat_interleave(kk, dim=1)  # [uc, L*kk]
        beta, it = _fit_reduced(red.Z, T, inv_c, None, max_iter, tol)
        iters = max(iters, it)
        w_std = red.weights(Xs, beta[..., :-1])  # [uc, L*kk, d]
        w_raw, b_raw = std.to_raw(w_std.to(torch.float64), beta[..., -1])
        coef[:, sl] = w_raw.view(uc, L, kk, d).permute(1, 0, 2, 3).cpu()
        intercept[:, sl] = b_raw.view(uc, L, kk).permute(1, 0, 2).cpu()
        chosen[:, sl] = c_u.cpu()
    return LogisticFit(coef=coef, intercept=intercept, C=chosen, classes=classes,
                       cv_accuracy=cv_acc, c_grid=c_grid, n_iter=iters)


class LogisticProbe(Probe):
    """L2 logistic regression per unit (scikit-learn's objective), standardised features.

    `C` is a grid (chosen per unit by grouped `cv`-fold cross-validation over the `groups` given to
    `fit`) or a single value. Runs on `device` (default: the GPU when there is one).
    """

    def __init__(self, C: float | Sequence[float] = C_GRID, *, cv: int = 4, seed: int = 0,
                 standardize: bool = True, device: str | torch.device | None = None,
                 max_iter: int = 100, tol: float = 1e-10):
        self.C = C
        self.cv = cv
        self.seed = seed
        self.standardize = standardize
        self.device = device
        self.max_iter = max_iter
        self.tol = tol

    @property
    def c_grid(self) -> tuple[float, ...]:
        return tuple(float(c) for c in self.C) if isinstance(self.C, (list, tuple)) else (float(self.C),)

    def fit(self, X: Float[Tensor, "unit n d"], y: Int[Tensor, " n"],
            groups: Sequence[Any] | Tensor | None = None) -> LogisticProbe:
        res = fit_logistic(X, torch.as_tensor(y).unsqueeze(0), groups=groups, c_grid=self.c_grid,
                           cv=self.cv, seed=self.seed, standardize=self.standardize,
                           device=self.device, max_iter=self.max_iter, tol=self.tol)
        return self._set(res, 0)

    def _set(self, res: LogisticFit, label: int) -> LogisticProbe:
        self.coef_ = res.coef[label]
        self.intercept_ = res.intercept[label]
        self.classes_ = res.classes
        self.C_ = res.C[label]
        self.cv_accuracy_ = None if res.cv_accuracy is None else res.cv_accuracy[label]
        self.n_iter_ = res.n_iter
        return self

    @classmethod
    def from_fit(cls, res: LogisticFit, label: int = 0, **kwargs: Any) -> LogisticProbe:
        """A fitted probe for one of the label vectors of `fit_logistic`."""
        return cls(C=res.c_grid, **kwargs)._set(res, label)

    def metadata(self) -> dict[str, Any]:
        return {**super().metadata(), "C": [float(c) for c in self.C_.tolist()],
                "c_grid": list(self.c_grid), "cv": self.cv, "standardize": self.standardize,
                "objective": "sum logloss + ||w||^2/(2C), intercept unpenalised, standardised features"}
