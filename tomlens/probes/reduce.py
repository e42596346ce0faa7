"""Standardise features on a training split and rewrite an L2 probe problem in at most m columns.

With an L2 penalty the best weight vector lies in the span of the (standardised) training rows:
any component outside it adds to the penalty and changes no logit. So a problem with m training
rows in d > m dimensions is exactly a problem in r <= m dimensions, with features Z such that
Z Z^T equals the Gram matrix K = X X^T. A pivoted Cholesky factorisation of K gives such a Z and
finds the rank r on the way: per-head outputs (z_h @ W_O[h]) live in a d_head-dimensional
subspace, so their problems shrink from d_model to d_head columns. Rows outside the training
split (validation or test rows) get their coordinates in the same basis from the same
factorisation, and weights map back to feature space as w = X[pivots]^T L_P^-T beta.

When m >= d the features themselves are already the small side and are used as they are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from jaxtyping import Float, Int
from torch import Tensor


@dataclass(frozen=True)
class Standardiser:
    """Per-unit feature means and scales fitted on a training split (scikit-learn's StandardScaler:
    population standard deviation, scale 1 for constant features)."""

    mean: Float[Tensor, "u d"]
    scale: Float[Tensor, "u d"]

    @classmethod
    def fit(cls, X: Float[Tensor, "u m d"], enabled: bool = True) -> Standardiser:
        if not enabled:
            u, _, d = X.shape
            return cls(torch.zeros(u, d, dtype=X.dtype, device=X.device),
                       torch.ones(u, d, dtype=X.dtype, device=X.device))
        Xf = X if X.dtype in (torch.float32, torch.float64) else X.float()
        var, mean = torch.var_mean(Xf, dim=1, correction=0)
        scale = var.sqrt()
        tiny = scale <= 1e-6 * mean.abs().clamp_min(1.0)
        scale = torch.where(tiny, torch.ones_like(scale), scale)
        return cls(mean, scale)

    def __call__(self, X: Float[Tensor, "u n d"]) -> Float[Tensor, "u n d"]:
        return (X - self.mean.unsqueeze(1)).mul_(1 / self.scale.unsqueeze(1))

    def to_raw(self, w: Float[Tensor, "u j d"], b: Float[Tensor, "u j"]) -> tuple[Tensor, Tensor]:
        """Weights on standardised features -> weights and intercepts on raw features."""
        w_raw = w / self.scale.unsqueeze(1).to(w.dtype)
        b_raw = b - (w_raw * self.mean.unsqueeze(1).to(w.dtype)).sum(-1)
        return w_raw, b_raw


@dataclass(frozen=True)
class Reduced:
    """Coordinates of every row (training rows first) in an r-column basis of the training span.

    `pivots` and `lp` are None in the primal case (Z are the standardised features themselves).
    """

    Z: Float[Tensor, "u n r"]
    m: int
    pivots: Int[Tensor, "u r"] | None
    lp: Float[Tensor, "u r r"] | None

    @property
    def rank(self) -> int:
        return self.Z.shape[2]

    def weights(self, Xtr: Float[Tensor, "u m d"], beta_w: Float[Tensor, "u j r"]) -> Float[Tensor, "u j d"]:
        """Map reduced weights back to (standardised) feature space."""
        if self.pivots is None:
            return beta_w
        # alpha = L_P^-T beta  (upper-triangular solve), then w = X[pivots]^T alpha
        alpha = torch.linalg.solve_triangular(self.lp.transpose(1, 2), beta_w.transpose(1, 2), upper=True)
        xp = torch.gather(Xtr, 1, self.pivots.unsqueeze(2).expand(-1, -1, Xtr.shape[2])).to(alpha.dtype)
        return torch.bmm(alpha.transpose(1, 2), xp)  # [u, j, d]


def reduce_rows(Xs: Float[Tensor, "u n d"], m: int, *, rank_tol: float | None = None) -> Reduced:
    """Reduce standardised rows `Xs` whose first `m` rows are the training split.

    Uses the pivoted Cholesky of the Gram matrix when m < d (pivots chosen among training rows
    only), the features themselves otherwise. `rank_tol` (relative to the largest diagonal entry)
    decides when a residual direction counts as empty; by default it sits just above the rounding
    noise of the Gram's dtype.
    """
    u, n, d = Xs.shape
    if m >= d:
        return Reduced(Z=Xs.to(torch.float64), m=m, pivots=None, lp=None)
    if rank_tol is None:
        rank_tol = 1e-5 if Xs.dtype in (torch.float32, torch.float16, torch.bfloat16) else 1e-11
    if Xs.dtype in (torch.float16, torch.bfloat16):
        Xs = Xs.float()
    K = torch.bmm(Xs, Xs.transpose(1, 2)).to(torch.float64)  # [u, n, n]
    return _pivoted_cholesky(K, m, rank_tol)


def _pivoted_cholesky(K: Tensor, m: int, rank_tol: float) -> Reduced:
    u, n, _ = K.shape
    dev = K.device
    resid = K.diagonal(dim1=1, dim2=2)[:, :m].clone()
    floor = rank_tol * resid.max(1).values.clamp_min(torch.finfo(torch.float64).tiny)
    L = torch.zeros(u, n, m, dtype=torch.float64, device=dev)
    pivots = torch.zeros(u, m, dtype=torch.long, device=dev)
    pivot_diag = torch.ones(u, m, dtype=torch.float64, device=dev)
    rows = torch.arange(u, device=dev)
    k = 0
    for k in range(m):
        val, p = resid.max(1)
        live = val > floor
        if not bool(live.any()):
            break
        col = K[rows, :, p]  # [u, n]
        if k:
            col = col - torch.bmm(L[:, :, :k], L[rows, p, :k].unsqueeze(2)).squeeze(2)
        root = torch.where(live, val, torch.ones_like(val)).sqrt()
        lk = torch.where(live.unsqueeze(1), col / root.unsqueeze(1), torch.zeros_like(col))
        L[:, :, k] = lk
        pivots[:, k] = p
        pivot_diag[:, k] = root
        resid = (resid - lk[:, :m] ** 2).clamp_min(0)
        resid[rows, p] = 0
    else:
        k = m
    r = max(k, 1)
    L = L[:, :, :r]
    pivots = pivots[:, :r]
    lp = torch.gather(L, 1, pivots.unsqueeze(2).expand(-1, -1, r))  # rows of L at the pivots
    # Directions found empty for a unit carry zero coordinates; a unit diagonal keeps L_P solvable.
    eye = torch.eye(r, dtype=torch.bool, device=dev).unsqueeze(0)
    dead = (L[:, :m].abs().sum(1) == 0)  # [u, r]
    lp = torch.where(eye & dead.unsqueeze(1), torch.ones_like(lp), lp)
    lp = torch.where(~eye & dead.unsqueeze(1), torch.zeros_like(lp), lp)
    return Reduced(Z=L, m=m, pivots=pivots, lp=torch.tril(lp))
