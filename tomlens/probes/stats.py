"""Bootstrap intervals over test stories: resample task groups, not prompts.

Prompts of one story are not independent (they share the story and usually succeed or fail
together), so resampling prompts understates the uncertainty. Every interval here resamples whole
groups with replacement and recomputes the statistic on the rows of the drawn groups, for all
units at once: accuracy is a ratio of group sums, AUROC a weighted rank statistic.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from jaxtyping import Float, Int
from torch import Tensor


@dataclass(frozen=True)
class Interval:
    """Point estimates and percentile bootstrap bounds per unit."""

    estimate: Float[Tensor, " unit"]
    low: Float[Tensor, " unit"]
    high: Float[Tensor, " unit"]


def group_draws(groups: Int[Tensor, " n"], n_boot: int, seed: int) -> tuple[Int[Tensor, " n"], Float[Tensor, "boot g"]]:
    """Each row's group index (0..g-1) and how many times each group is drawn in each bootstrap
    replicate: a row's weight in a replicate is its group's draw count."""
    _, codes = torch.unique(groups, return_inverse=True)
    g = int(codes.max()) + 1 if codes.numel() else 0
    gen = torch.Generator().manual_seed(seed)
    draws = torch.randint(0, max(g, 1), (n_boot, g), generator=gen)
    counts = torch.zeros(n_boot, g, dtype=torch.float64)
    counts.scatter_add_(1, draws, torch.ones_like(draws, dtype=torch.float64))
    return codes, counts


def group_weights(groups: Int[Tensor, " n"], n_boot: int, seed: int) -> Float[Tensor, "boot n"]:
    """How many times each row is drawn in each bootstrap replicate (its group's draw count)."""
    codes, counts = group_draws(groups, n_boot, seed)
    return counts[:, codes]


def _bounds(boot: Tensor, level: float) -> tuple[Tensor, Tensor]:
    a = (1 - level) / 2
    q = torch.tensor([a, 1 - a], dtype=boot.dtype)
    qs = torch.nanquantile(boot, q, dim=0)
    return qs[0], qs[1]


def bootstrap_mean(values: Float[Tensor, "unit n"], groups: Int[Tensor, " n"], *, n_boot: int = 1000,
                   seed: int = 0, level: float = 0.95) -> Interval:
    """Mean of per-row values (e.g. 0/1 correctness, or probe minus control correctness) with a
    group-bootstrap interval. The replicate mean weights rows by their group's draw count."""
    v = values.to(torch.float64).cpu()
    w = group_weights(groups.cpu(), n_boot, seed)  # [B, n]
    boot = (w @ v.T) / w.sum(1, keepdim=True).clamp_min(1e-300)  # [B, unit]
    lo, hi = _bounds(boot, level)
    return Interval(v.mean(1), lo, hi)


def auroc(scores: Float[Tensor, "unit n"], y: Int[Tensor, " n"],
          weights: Float[Tensor, "boot n"] | None = None) -> Float[Tensor, "boot unit"]:
    """Area under the ROC curve per unit (ties count one half), optionally for weighted replicates."""
    s = scores.to(torch.float64).cpu()
    yb = y.cpu().to(torch.float64)
    w = torch.ones(1, s.shape[1], dtype=torch.float64) if weights is None else weights.to(torch.float64)
    srt, order = s.sort(1)  # [u, n]
    lo = torch.searchsorted(srt, srt, right=False)  # first index of each tie block
    hi = torch.searchsorted(srt, srt, right=True)
    out = torch.empty(w.shape[0], s.shape[0], dtype=torch.float64)
    for b0 in range(0, w.shape[0], 64):
        wb = w[b0:b0 + 64]  # [b, n]
        wo = wb[:, order]  # [b, u, n] in score order
        yo = yb[order]  # [u, n]
        neg = wo * (1 - yo)
        pos = wo * yo
        cum = torch.nn.functional.pad(neg.cumsum(-1), (1, 0))  # [b, u, n+1]
        below = torch.gather(cum, 2, lo.unsqueeze(0).expand_as(wo))
        through = torch.gather(cum, 2, hi.unsqueeze(0).expand_as(wo))
        num = (pos * (below + through) / 2).sum(-1)
        den = pos.sum(-1) * neg.sum(-1)
        out[b0:b0 + 64] = torch.where(den > 0, num / den.clamp_min(1e-300), torch.full_like(num, torch.nan))
    return out


def group_auroc(scores: Float[Tensor, "unit n"], y: Int[Tensor, " n"], codes: Int[Tensor, " n"],
                counts: Float[Tensor, "boot g"], *, unit_chunk: int = 64) -> Float[Tensor, "boot unit"]:
    """`auroc(scores, y, counts[:, codes])` for weights that are per-group draw counts (`group_draws`),
    computed through the groups: per unit, A[g, h] = the pairs (positive row of group g, negative
    row of group h) ordered right (ties one half), and a replicate's numerator is c^T A c. That is
    g x g per replicate instead of a sort-ordered pass over every row, and the same number: every
    term is a half-integer count (integer weights), so both sums are exact. A unit with a
    non-finite score gets NaN."""
    s = scores.to(torch.float64).cpu()
    yb = y.cpu().long()
    codes = codes.cpu()
    g = counts.shape[1]
    pos, neg = yb == 1, yb == 0
    pos_rows, neg_rows = pos.nonzero().squeeze(1), neg.nonzero().squeeze(1)
    onehot = torch.nn.functional.one_hot(codes, max(g, 1)).to(torch.float64)[:, :g]  # [n, g]
    e_pos, e_neg = onehot[pos_rows], onehot[neg_rows]  # [p, g], [q, g]
    den = (counts @ e_pos.sum(0)) * (counts @ e_neg.sum(0))  # [B]
    out = torch.empty(counts.shape[0], s.shape[0], dtype=torch.float64)
    for u0 in range(0, s.shape[0], unit_chunk):
        su = s[u0:u0 + unit_chunk]
        sp, sn = su[:, pos_rows].unsqueeze(2), su[:, neg_rows].unsqueeze(1)  # [k, p, 1], [k, 1, q]
        pairs = (sp > sn).to(torch.float64) + 0.5 * (sp == sn).to(torch.float64)  # [k, p, q]
        A = e_pos.T @ pairs @ e_neg  # [k, g, g]
        num = ((counts @ A) * counts.unsqueeze(0)).sum(-1).T  # [B, k]
        auc = torch.where(den.unsqueeze(1) > 0, num / den.clamp_min(1e-300).unsqueeze(1),
                          torch.full_like(num, torch.nan))
        finite = torch.isfinite(su).all(1)
        out[:, u0:u0 + unit_chunk] = torch.where(finite.unsqueeze(0), auc, torch.full_like(auc, torch.nan))
    return out


def bootstrap_auroc(scores: Float[Tensor, "unit n"], y: Int[Tensor, " n"], groups: Int[Tensor, " n"], *,
                    n_boot: int = 1000, seed: int = 0, level: float = 0.95) -> Interval:
    """AUROC per unit with a group-bootstrap interval (binary targets)."""
    est = auroc(scores, y)[0]
    codes, counts = group_draws(groups.cpu(), n_boot, seed)
    boot = group_auroc(scores, y, codes, counts)
    lo, hi = _bounds(boot, level)
    return Interval(est, lo, hi)


def bootstrap_auroc_difference(a: Float[Tensor, "unit n"], b: Float[Tensor, "unit n"], y: Int[Tensor, " n"],
                               groups: Int[Tensor, " n"], *, n_boot: int = 1000, seed: int = 0,
                               level: float = 0.95) -> Interval:
    """AUROC(a) - AUROC(b) on the same resampled groups (paired), e.g. probe minus control."""
    codes, counts = group_draws(groups.cpu(), n_boot, seed)
    boot = group_auroc(a, y, codes, counts) - group_auroc(b, y, codes, counts)
    lo, hi = _bounds(boot, level)
    return Interval(auroc(a, y)[0] - auroc(b, y)[0], lo, hi)
