"""Standardise features on a training split and rewrite an L2 probe problem in at most m columns.

With an L2 penalty the best weight vector lies in the span of the (standardised) training rows:
any component outside it adds to the penalty and changes no logit. So a problem with m training
rows in d > m dimensions is exactly a problem in r <= m dimensions, with features Z such that
Z Z^T equals the Gram matrix K = X X^T of the training rows. A pivoted Cholesky factorisation of
K gives such a Z and finds the rank r on the way: per-head outputs (z_h @ W_O[h]) live in a
d_head-dimensional subspace, so their problems shrink from d_model to d_head columns. Rows outside
the training split (validation or test rows) get their coordinates in the same basis from the
same factorisation, and weights map back to feature space as w = X[pivots]^T L_P^-T beta.

When m >= d the standardised features themselves are already the small side.

Standardisation statistics come from per-block sums computed once (`BlockSums`), so the training
split of every cross-validation fold gets its mean and scale without another pass over the data.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor


@dataclass(frozen=True)
class BlockSums:
    """Sums and sums of squares of the features over each block of rows (e.g. each CV fold),
    taken around a per-feature reference value so that fp32 sums keep their precision."""

    ref: Float[Tensor, "u d"]
    s1: Float[Tensor, "u blk d"]
    s2: Float[Tensor, "u blk d"]
    count: Float[Tensor, " blk"]

    @classmethod
    def of(cls, X: Float[Tensor, "u n d"], block: Int[Tensor, " n"], n_blocks: int) -> BlockSums:
        ref = X.mean(1)
        onehot = torch.nn.functional.one_hot(block.to(X.device), n_blocks).T.to(X.dtype)  # [blk, n]
        oh = onehot.unsqueeze(0).expand(X.shape[0], -1, -1)
        Y = X - ref.unsqueeze(1)
        s1 = torch.bmm(oh, Y)
        Y.mul_(Y)
        s2 = torch.bmm(oh, Y)
        return cls(ref=ref, s1=s1, s2=s2, count=onehot.sum(1))


@dataclass(frozen=True)
class Standardiser:
    """Per-unit feature means and scales fitted on a training split (scikit-learn's StandardScaler:
    population standard deviation, scale 1 for constant features)."""

    mean: Float[Tensor, "u d"]
    scale: Float[Tensor, "u d"]

    @classmethod
    def identity(cls, X: Float[Tensor, "u n d"]) -> Standardiser:
        u, _, d = X.shape
        return cls(torch.zeros(u, d, dtype=X.dtype, device=X.device),
                   torch.ones(u, d, dtype=X.dtype, device=X.device))

    @classmethod
    def fit(cls, X: Float[Tensor, "u m d"], enabled: bool = True) -> Standardiser:
        if not enabled:
            return cls.identity(X)
        block = torch.zeros(X.shape[1], dtype=torch.long)
        return cls.from_blocks(BlockSums.of(X, block, 1), torch.ones(1, dtype=torch.bool))

    @classmethod
    def from_blocks(cls, sums: BlockSums, include: Bool[Tensor, " blk"]) -> Standardiser:
        inc = include.to(sums.s1.device)
        n = sums.count.to(sums.s1.device)[inc].sum()
        m1 = sums.s1[:, inc].sum(1).to(torch.float64) / n
        m2 = sums.s2[:, inc].sum(1).to(torch.float64) / n
        var = (m2 - m1 * m1).clamp_min(0)
        mean = sums.ref.to(torch.float64) + m1
        scale = var.sqrt()
        tiny = scale <= 1e-6 * mean.abs().clamp_min(1.0)
        scale = torch.where(tiny, torch.ones_like(scale), scale)
        dt = sums.s1.dtype
        return cls(mean.to(dt), scale.to(dt))

    def __call__(self, X: Float[Tensor, "u n d"]) -> Float[Tensor, "u n d"]:
        inv = (1 / self.scale).unsqueeze(1)
        return torch.addcmul(-(self.mean.unsqueeze(1) * inv), X.to(inv.dtype), inv)

    def to_raw(self, w: Float[Tensor, "u j d"], b: Float[Tensor, "u j"]) -> tuple[Tensor, Tensor]:
        """Weights on standardised features -> weights and intercepts on raw features."""
        w_raw = w / self.scale.unsqueeze(1).to(w.dtype)
        b_raw = b - (w_raw * self.mean.unsqueeze(1).to(w.dtype)).sum(-1)
        return w_raw, b_raw


@dataclass(frozen=True)
class Reduced:
    """Coordinates of every row in an r-column basis of the training rows' span.

    `pivots` and `lp` are None in the primal case (Z are the standardised features themselves).
    """

    Z: Float[Tensor, "u n r"]
    pivots: Int[Tensor, "u r"] | None
    lp: Float[Tensor, "u r r"] | None

    @property
    def rank(self) -> int:
        return self.Z.shape[2]

    def weights(self, Xs: Float[Tensor, "u n d"], beta_w: Float[Tensor, "u j r"]) -> Float[Tensor, "u j d"]:
        """Map reduced weights back to (standardised) feature space."""
        if self.pivots is None:
            return beta_w
        # alpha = L_P^-T beta  (upper-triangular solve), then w = X[pivots]^T alpha
        alpha = torch.linalg.solve_triangular(self.lp.transpose(1, 2), beta_w.transpose(1, 2), upper=True)
        xp = torch.gather(Xs, 1, self.pivots.unsqueeze(2).expand(-1, -1, Xs.shape[2])).to(alpha.dtype)
        return torch.bmm(alpha.transpose(1, 2), xp)  # [u, j, d]


def reduce_rows(Xs: Float[Tensor, "u n d"], train: Int[Tensor, " m"], *,
                rank_tol: float | None = None) -> Reduced:
    """Reduce standardised rows `Xs`, of which rows `train` are the training split.

    Uses the pivoted Cholesky of the Gram matrix when m < d (pivots chosen among training rows
    only), the features themselves otherwise. `rank_tol` (relative to the largest diagonal entry)
    decides when a residual direction counts as empty; by default it sits just above the rounding
    noise of the Gram's dtype.
    """
    u, n, d = Xs.shape
    m = train.numel()
    if m >= d:
        return Reduced(Z=Xs.to(torch.float64), pivots=None, lp=None)
    if rank_tol is None:
        rank_tol = 1e-5 if Xs.dtype in (torch.float32, torch.float16, torch.bfloat16) else 1e-11
    if Xs.dtype in (torch.float16, torch.bfloat16):
        Xs = Xs.float()
    K = torch.bmm(Xs, Xs.transpose(1, 2)).to(torch.float64)  # [u, n, n]
    return pivoted_cholesky(K, train, rank_tol)


def pivoted_cholesky(K: Float[Tensor, "u n n"], train: Int[Tensor, " m"], rank_tol: float) -> Reduced:
    """Batched pivoted (partial) Cholesky of the training block of `K`, extended to all rows."""
    u, n, _ = K.shape
    dev = K.device
    m = train.numel()
    train = train.to(dev)
    diag = K.diagonal(dim1=1, dim2=2)
    cand = torch.full((u, n), -torch.inf, dtype=torch.float64, device=dev)
    cand[:, train] = diag[:, train]
    floor = rank_tol * cand.max(1).values.clamp_min(torch.finfo(torch.float64).tiny)
    Lt = torch.zeros(u, m, n, dtype=torch.float64, device=dev)  # row k = column k of L
    pivots = torch.zeros(u, m, dtype=torch.long, device=dev)
    rows = torch.arange(u, device=dev)
    k = 0
    for k in range(m):
        val, p = cand.max(1)
        live = val > floor
        if not bool(live.any()):
            break
        row = K[rows, p, :]  # [u, n]
        if k:
            lp_k = Lt[rows, :k, p]  # [u, k]
            row = row - torch.bmm(lp_k.unsqueeze(1), Lt[:, :k, :]).squeeze(1)
        root = torch.where(live, val, torch.ones_like(val)).sqrt()
        lk = torch.where(live.unsqueeze(1), row / root.unsqueeze(1), torch.zeros_like(row))
        Lt[:, k, :] = lk
        pivots[:, k] = p
        cand = cand - lk * lk
        cand[rows, p] = 0.0
    else:
        k = m
    r = max(k, 1)
    Lt = Lt[:, :r]
    pivots = pivots[:, :r]
    lp = torch.gather(Lt, 2, pivots.unsqueeze(1).expand(-1, r, -1)).transpose(1, 2)  # L[pivots, :]
    # A direction found empty for a unit has zero coordinates; a unit diagonal keeps L_P solvable.
    dead = Lt[:, :, train].abs().sum(2) == 0  # [u, r]
    eye = torch.eye(r, dtype=torch.bool, device=dev).unsqueeze(0)
    lp = torch.where(dead.unsqueeze(1), eye.to(lp.dtype).expand_as(lp), lp)
    return Reduced(Z=Lt.transpose(1, 2).contiguous(), pivots=pivots, lp=torch.tril(lp))
