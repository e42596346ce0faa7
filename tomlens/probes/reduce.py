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

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from tomlens.devices import to_device


@dataclass(frozen=True)
class BlockSums:
    """Sums and sums of squares of the features over each block of rows (e.g. each CV fold),
    taken around a per-feature reference value so that fp32 sums keep their precision."""

    ref: Float[Tensor, "u d"]
    s1: Float[Tensor, "u blk d"]
    s2: Float[Tensor, "u blk d"]
    count: Float[Tensor, " blk"]

    def subset(self, idx: Int[Tensor, " k"]) -> BlockSums:
        return BlockSums(self.ref[idx], self.s1[idx], self.s2[idx], self.count)

    @classmethod
    def of(cls, X: Float[Tensor, "u n d"], block: Sequence[int], n_blocks: int) -> BlockSums:
        """The sums of `X` over the blocks named by `block` (one block index per row, on the host)."""
        ref = X.mean(1)
        onehot = torch.nn.functional.one_hot(to_device(list(block), X.device), n_blocks).T.to(X.dtype)  # [blk, n]
        oh = onehot.unsqueeze(0).expand(X.shape[0], -1, -1)
        Y = X - ref.unsqueeze(1)
        s1 = torch.bmm(oh, Y)
        Y.mul_(Y)
        s2 = torch.bmm(oh, Y)
        return cls(ref=ref, s1=s1, s2=s2, count=onehot.sum(1))


def _moments(sums: BlockSums, include: Sequence[int]) -> tuple[Tensor, Tensor, Tensor]:
    """Mean, population variance and scikit-learn's "indistinguishable from a constant" flag of
    every feature over the rows of the blocks `include` (indices, on the host; float64, [u, d] each)."""
    inc = to_device(list(include), sums.s1.device)
    n = sums.count.to(sums.s1.device)[inc].sum()
    m1 = sums.s1[:, inc].sum(1).to(torch.float64) / n
    m2 = sums.s2[:, inc].sum(1).to(torch.float64) / n
    var = (m2 - m1 * m1).clamp_min(0)
    mean = sums.ref.to(torch.float64) + m1
    # the error bound of the two-pass variance, float64 eps, as scikit-learn's StandardScaler has it
    eps = torch.finfo(torch.float64).eps
    constant = var <= n * eps * var + (n * mean * eps) ** 2
    return mean, var, constant


def scale_spread(sums: BlockSums, includes: Sequence[Sequence[int]]) -> Float[Tensor, " u"]:
    """Per unit, the smallest ratio of two non-constant features' standard deviations over the given
    block selections (training splits). Standardising multiplies a direction by up to its inverse,
    so a basis of the raw rows that drops directions below a relative size of `spread` misses some."""
    worst = None
    for include in includes:
        _, var, constant = _moments(sums, include)
        sd = var.sqrt()
        hi = torch.where(constant, torch.zeros_like(sd), sd).amax(1)
        lo = torch.where(constant, torch.full_like(sd, torch.inf), sd).amin(1)
        ratio = torch.where(torch.isfinite(lo) & (hi > 0), lo / hi.clamp_min(1e-300), torch.ones_like(hi))
        worst = ratio if worst is None else torch.minimum(worst, ratio)
    assert worst is not None, "no fold's rows were given"
    return worst


@dataclass(frozen=True)
class Standardiser:
    """Per-unit feature means and scales fitted on a training split, as scikit-learn's
    StandardScaler does it (population standard deviation; scale 1 for constant features)."""

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
        return cls.from_blocks(BlockSums.of(X, [0] * X.shape[1], 1), [0])

    @classmethod
    def from_blocks(cls, sums: BlockSums, include: Sequence[int]) -> Standardiser:
        """Fitted on the rows of the blocks `include` (indices, on the host)."""
        mean, var, constant = _moments(sums, include)
        eps = torch.finfo(torch.float64).eps
        scale = var.sqrt()
        scale = torch.where(constant | (scale < 10 * eps), torch.ones_like(scale), scale)
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
    complete: Bool[Tensor, " u"] | None = None  # pivoted Cholesky stopped by max_rank: finished units

    @property
    def rank(self) -> int:
        return self.Z.shape[2]

    def ranks(self, Ztr: Float[Tensor, "u m r"]) -> Int[Tensor, " u"]:
        """Per unit, how many leading columns carry data (later ones are zero for that unit)."""
        if self.pivots is None:
            return torch.full((Ztr.shape[0],), Ztr.shape[2], dtype=torch.long, device=Ztr.device)
        live = Ztr.abs().amax(1) > 0  # [u, r]
        cols = torch.arange(1, live.shape[1] + 1, device=Ztr.device)
        return (live * cols).amax(1).clamp_min(1)

    def weights(self, Xs: Float[Tensor, "u n d"], beta_w: Float[Tensor, "u j r"]) -> Float[Tensor, "u j d"]:
        """Map reduced weights back to (standardised) feature space."""
        if self.pivots is None:
            return beta_w
        assert self.lp is not None  # set together with pivots
        # alpha = L_P^-T beta  (upper-triangular solve), then w = X[pivots]^T alpha
        alpha = torch.linalg.solve_triangular(self.lp.transpose(1, 2), beta_w.transpose(1, 2), upper=True)
        xp = torch.gather(Xs, 1, self.pivots.unsqueeze(2).expand(-1, -1, Xs.shape[2])).to(alpha.dtype)
        return torch.bmm(alpha.transpose(1, 2), xp)  # [u, j, d]


def reduce_rows(Xs: Float[Tensor, "u n d"], train: Int[Tensor, " m"], *,
                rank_tol: float | None = None, every: int = 1) -> Reduced:
    """Reduce standardised rows `Xs`, of which rows `train` (indices, on the host) are the training split.

    Uses the pivoted Cholesky of the Gram matrix when m < d (pivots chosen among training rows
    only), the features themselves otherwise. `rank_tol` (relative to the largest diagonal entry)
    decides when a residual direction counts as empty; by default it sits just above the rounding
    noise of the Gram's dtype. `every`: the solver's cadence (`tomlens.probes.cadence`): 1 reads after each column.
    """
    u, n, d = Xs.shape
    m = train.numel()
    if m >= d:
        return Reduced(Z=Xs.to(torch.float64), pivots=None, lp=None)
    if rank_tol is None:
        rank_tol = 1e-5 if Xs.dtype in (torch.float32, torch.float16, torch.bfloat16) else 1e-9
    if Xs.dtype in (torch.float16, torch.bfloat16):
        Xs = Xs.float()
    K = torch.bmm(Xs, Xs.transpose(1, 2)).to(torch.float64)  # [u, n, n]
    return pivoted_cholesky(K, train, rank_tol, every=every)


def pivoted_cholesky(K: Float[Tensor, "u n n"], train: Int[Tensor, " m"], rank_tol: float,
                     max_rank: int | None = None, every: int = 1) -> Reduced:
    """Batched pivoted (partial) Cholesky of the training block of `K`, extended to all rows.

    Units whose residual falls below `rank_tol` of their largest diagonal entry are finished; when
    half of the working batch is finished the rest goes on as a smaller batch, so a few units of
    high rank do not make every unit pay for their extra columns. With `max_rank` the
    factorisation stops there; `Reduced.complete` says which units had finished by then.

    With `every` = 1 (the CPU's cadence) the host reads after each column which units are still
    live, stops when none is and compacts the batch. Otherwise (a GPU) it reads nothing until the
    end: every column is computed, finished units adding zero columns, and the rank (the columns
    before the first that no unit needed) is read once. The result is the same either way."""
    u, n, _ = K.shape
    dev = K.device
    m = train.numel()
    train = to_device(train, dev)
    diag = K.diagonal(dim1=1, dim2=2)
    cand = torch.full((u, n), -torch.inf, dtype=torch.float64, device=dev)
    cand[:, train] = diag[:, train]
    floor = rank_tol * cand.max(1).values.clamp_min(torch.finfo(torch.float64).tiny)
    Lt = torch.zeros(u, m, n, dtype=torch.float64, device=dev)  # row k = column k of L
    pivots = torch.zeros(u, m, dtype=torch.long, device=dev)
    act = torch.arange(u, device=dev)  # units in the working batch
    n_act = u
    Kw, Lw, Pw, cw, fw = K, Lt, pivots, cand, floor
    steps = m if max_rank is None else min(m, max_rank)
    ask = every == 1
    used = torch.zeros(steps, dtype=torch.bool, device=dev)  # column k: some unit was still live
    k = steps  # columns computed
    for k in range(steps):
        val, p = cw.max(1)
        live = val > fw
        if ask:
            flags = live.tolist()  # the host read of this column (free on the CPU)
            n_live = sum(flags)
            if n_live == 0:
                break
            if n_live <= n_act // 2:  # compact: finished units keep what they have
                if Lw is not Lt:
                    Lt[act], pivots[act] = Lw, Pw
                keep = to_device([i for i, f in enumerate(flags) if f], dev)
                act, Kw, Lw, Pw, cw, fw = act[keep], Kw[keep], Lw[keep], Pw[keep], cw[keep], fw[keep]
                val, p, live = val[keep], p[keep], live[keep]
                n_act = n_live
        used[k] = live.any()
        rows = torch.arange(n_act, device=dev)
        row = Kw[rows, p, :]  # [a, n]
        if k:
            lp_k = Lw[rows, :k, p]  # [a, k]
            row = row - torch.bmm(lp_k.unsqueeze(1), Lw[:, :k, :]).squeeze(1)
        root = torch.where(live, val, torch.ones_like(val)).sqrt()
        lk = torch.where(live.unsqueeze(1), row / root.unsqueeze(1), torch.zeros_like(row))
        Lw[:, k, :] = lk
        Pw[:, k] = p
        cw = cw - lk * lk
        cw[rows, p] = 0.0
    else:
        k = steps
    if Lw is not Lt:
        Lt[act], pivots[act] = Lw, Pw
    # the rank: columns before the first no unit needed (a unit once finished stays finished)
    r_used = k if ask else int(used[:k].sum())  # the one host read without `ask`
    complete = torch.ones(u, dtype=torch.bool, device=dev)
    if r_used == steps and steps < m:
        complete[act] = ~(cw.max(1).values > fw)
    r = max(r_used, 1)
    Lt = Lt[:, :r]
    pivots = pivots[:, :r]
    lp = torch.gather(Lt, 2, pivots.unsqueeze(1).expand(-1, r, -1)).transpose(1, 2)  # L[pivots, :]
    # A direction found empty for a unit has zero coordinates; a unit diagonal keeps L_P solvable.
    dead = Lt[:, :, train].abs().sum(2) == 0  # [u, r]
    eye = torch.eye(r, dtype=torch.bool, device=dev).unsqueeze(0)
    lp = torch.where(dead.unsqueeze(1), eye.to(lp.dtype).expand_as(lp), lp)
    return Reduced(Z=Lt.transpose(1, 2).contiguous(), pivots=pivots, lp=torch.tril(lp), complete=complete)


@dataclass(frozen=True)
class RowBasis:
    """Rows of a chunk as `mean + B a` with B orthonormal `[d, r]`, for units whose centred rows
    span few dimensions (a head's output z_h @ W_O[h] spans at most d_head).

    Found once per chunk, it serves every cross-validation fold: standardising with a fold's mean
    and scale keeps rows in the same span, so a fold's reduced problem is Z = (A - a_f) L_f with
    L_f L_f^T = B^T diag(1/scale^2) B, an r x r matrix, instead of an n x n Gram per fold.
    Columns past a unit's rank are zero.
    """

    mean: Float[Tensor, "u d"]
    B: Float[Tensor, "u d r"]
    A: Float[Tensor, "u n r"]
    ranks: Int[Tensor, " u"]

    @classmethod
    def of(cls, X: Float[Tensor, "u n d"], max_rank: int, rank_tol: float = 1e-12,
           every: int = 1) -> tuple[RowBasis, Tensor]:
        """The basis of each unit's centred rows, and which units have rank <= `max_rank` (the
        others are cut off there and must be reduced per fold instead; a device mask)."""
        X = X.to(torch.float64)
        mean = X.mean(1)
        Xc = X - mean.unsqueeze(1)
        n = X.shape[1]
        red = pivoted_cholesky(torch.bmm(Xc, Xc.transpose(1, 2)), torch.arange(n), rank_tol, max_rank=max_rank,
                               every=every)
        A = red.Z
        ranks = red.ranks(A)
        assert red.pivots is not None and red.lp is not None and red.complete is not None  # a full factorisation
        xp = torch.gather(Xc, 1, red.pivots.unsqueeze(2).expand(-1, -1, Xc.shape[2]))
        Bt = torch.linalg.solve_triangular(red.lp, xp, upper=False)  # L_P^-1 Xc[P] = B^T
        live = torch.arange(A.shape[2], device=X.device).unsqueeze(0) < ranks.unsqueeze(1)
        Bt = Bt * live.unsqueeze(2)
        # B is orthonormal in exact arithmetic; a unit whose pivots were nearly dependent loses that
        # in rounding, and its folds' r x r factorisations could fail: it is reduced per fold instead.
        gram = torch.bmm(Bt, Bt.transpose(1, 2))
        eye = torch.diag_embed(live.to(gram.dtype))
        orthonormal = (gram - eye).abs().amax((1, 2)) <= 1e-6
        return cls(mean=mean, B=Bt.transpose(1, 2), A=A * live.unsqueeze(1), ranks=ranks), red.complete & orthonormal

    def subset(self, idx: Int[Tensor, " k"], width: int) -> RowBasis:
        """The units `idx`, cut to `width` columns (their largest rank, known on the host)."""
        r = max(width, 1)
        return RowBasis(self.mean[idx], self.B[idx, :, :r], self.A[idx, :, :r], self.ranks[idx])

    def standardised(self, std: Standardiser, weights: bool = False
                     ) -> tuple[Float[Tensor, "u n r"], Float[Tensor, "u r d"] | None]:
        """Reduced coordinates of every row under `std`, and (optionally) the map from reduced to
        standardised-feature weights: w_s = beta @ Wt with Wt = L^-1 (diag(1/scale) B)^T."""
        inv = (1 / std.scale.to(torch.float64)).unsqueeze(2)  # [u, d, 1]
        SB = self.B * inv  # diag(1/scale) B
        M = torch.bmm(SB.transpose(1, 2), SB)
        r = M.shape[1]
        dead = torch.arange(r, device=M.device).unsqueeze(0) >= self.ranks.unsqueeze(1)
        M = M + torch.diag_embed(dead.to(M.dtype))
        Lf = torch.linalg.cholesky(M)
        abar = torch.bmm((std.mean.to(torch.float64) - self.mean).unsqueeze(1), self.B)  # [u, 1, r]
        Z = torch.bmm(self.A - abar, Lf)
        Wt = torch.linalg.solve_triangular(Lf, SB.transpose(1, 2), upper=False) if weights else None
        return Z, Wt
