"""The patching metric and its statistics: logit difference, normalised effect, intervals over pairs.

The metric is the logit difference at the belief prompt's last token between the belief-consistent
answer (the clean story's answer) and the world-consistent one, first token of each option with its
leading space. Logit difference rather than probability because it is linear in the residual stream
(Zhang & Nanda 2023), which is also what makes attribution patching a fair first-order estimate.

Effects are normalised so that 0 is the corrupted run and 1 the clean run. By default ("pooled")
every pair's raw change is divided by the MEAN clean-corrupted gap over all pairs, so the mean of the
per-pair values is the ratio of means: stable when a single pair's gap is near zero, which a per-pair
ratio is not. `normalise="per_pair"` divides by each pair's own gap instead.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from jaxtyping import Float, Int
from torch import Tensor

from tomlens.errors import TomlensError

METRIC_NAME = "logit_diff(belief - world), first token of ' ' + option, at the last token"
Normalise = Literal["pooled", "per_pair"]


def logit_diff(
    last_logits: Float[Tensor, "batch vocab"], tokens: Int[Tensor, "batch 2"]
) -> Float[Tensor, " batch"]:
    """logit(tokens[:, 0]) - logit(tokens[:, 1]) per row, in float32."""
    picked = last_logits.gather(-1, tokens.to(last_logits.device)).float()
    return picked[:, 0] - picked[:, 1]


@dataclass(frozen=True)
class Summary:
    """Mean, standard error and percentile-bootstrap interval of normalised effects, per cell."""

    mean: np.ndarray
    se: np.ndarray
    ci_low: np.ndarray
    ci_high: np.ndarray
    n: np.ndarray


def normalised_effects(
    values: Float[Tensor, "*cell pair"],
    clean: Float[Tensor, " pair"],
    corrupted: Float[Tensor, " pair"],
    normalise: Normalise = "pooled",
) -> Float[Tensor, "*cell pair"]:
    """Per-pair effects on the 0 = corrupted, 1 = clean scale (NaN stays NaN: pair not patched)."""
    values, clean, corrupted = values.double(), clean.double(), corrupted.double()
    if normalise == "pooled":
        gap = (clean - corrupted).mean()
        return (values - corrupted) / gap
    if normalise == "per_pair":  # a pair whose gap is zero to rounding has no effect to speak of: left out
        effect = (values - corrupted) / (clean - corrupted)
        return torch.where(zero_gaps(clean, corrupted), torch.full_like(effect, float("nan")), effect)
    raise TomlensError(f"unknown normalisation {normalise!r}", "use 'pooled' or 'per_pair'")


# float32's epsilon times 4: how far a difference of two float32 numbers of size s can be from the
# exact one (each is rounded to within s * eps / 2, and `logit_diff` works in float32).
ZERO_GAP_RTOL = 4 * float(torch.finfo(torch.float32).eps)


# A logit difference is itself the difference of two float32 logits, which are often 10 to 100 in
# size: it is known only to about |logit| * eps (1e-5 at 100), however small the difference is, and
# batch shapes and kernels move it by as much again. Below this, a gap is rounding whatever its scale.
ZERO_GAP_ATOL = 1e-4


def zero_gaps(clean: Float[Tensor, " pair"], corrupted: Float[Tensor, " pair"]) -> Tensor:
    """Pairs whose clean - corrupted gap is zero up to rounding: |gap| <= ZERO_GAP_ATOL, or <=
    ZERO_GAP_RTOL * the larger of |clean| and |corrupted|. Not an exact `== 0`: two float32 logit
    differences of size s are only known to about s * eps, and each is a difference of logits of
    their own size, so a gap of 1e-6 between numbers of size 10 (or between two differences of 1e-5
    of logits near 20) is rounding; dividing by it gives effects of 1e5 or more."""
    clean, corrupted = clean.double(), corrupted.double()
    scale = torch.maximum(clean.abs(), corrupted.abs())
    gap = (clean - corrupted).abs()
    return (gap <= ZERO_GAP_ATOL) | (gap <= ZERO_GAP_RTOL * scale)


class UnstableGapWarning(UserWarning):
    """The clean - corrupted gap that normalises effects is indistinguishable from 0."""


def gap_is_unstable(gap: Float[Tensor, " pair"]) -> bool:
    """Whether the mean clean - corrupted gap is within two standard errors of 0 (or undefined):
    effects normalised by it are then noise over noise. Two-sided and blind to the sign, so it is no
    gate: a significantly negative gap passes it. `tomlens.patching.gate` is the one-sided gate that
    runs before any head ranking."""
    return _gap_check(gap)[1]


def _gap_check(gap: Float[Tensor, " pair"]) -> tuple[float, bool]:
    """(mean gap, `gap_is_unstable`), read in one host transfer whatever the number of pairs."""
    n = gap.numel()
    mean = gap.mean()
    if n < 2:
        unstable = ~(gap.abs().sum() > 0)
    else:
        unstable = ~(mean.abs() > 2 * gap.std() / n**0.5)
    m, u = torch.stack([mean.double(), unstable.double()]).tolist()
    return m, bool(u)


def gap_note(gap: float, gap_se: float, unstable: bool) -> str | None:
    """One sentence for a reader when `PatchingResult.baselines()` says the gap is unstable."""
    if not unstable:
        return None
    return (f"the clean - corrupted gap ({gap:.3f} +/- {gap_se:.3f}) is within two "
            "standard errors of 0, so effects normalised by it are unstable; read the raw logit differences, "
            "or use more pairs or a model that separates the stories")


@contextmanager
def gap_warnings_silenced():  # noqa: ANN201 - a context manager, also usable as a decorator
    """For a caller that reports the gap once itself (`gap_note`) instead of once per summary."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnstableGapWarning)
        yield


def _warn_if_unstable(clean: Float[Tensor, " pair"], corrupted: Float[Tensor, " pair"], normalise: Normalise) -> None:
    gap = clean - corrupted
    if normalise == "per_pair":
        zeros = int(zero_gaps(clean, corrupted).sum())
        if zeros:
            warnings.warn(f"{zeros} pair(s) have clean == corrupted: their per-pair effects are undefined and "
                          "left out; use normalise='pooled' or drop those pairs", UnstableGapWarning, stacklevel=3)
        return
    if normalise != "pooled":
        return
    mean, unstable = _gap_check(gap)
    if unstable:
        warnings.warn(f"the mean clean - corrupted gap ({mean:.3g}) is within two standard errors "
                      "of 0: normalised effects are unstable; read the raw logit differences", UnstableGapWarning,
                      stacklevel=3)


def summarise(
    values: Float[Tensor, "cell pair"],
    clean: Float[Tensor, " pair"],
    corrupted: Float[Tensor, " pair"],
    *,
    normalise: Normalise = "pooled",
    n_boot: int = 1000,
    seed: int = 0,
    alpha: float = 0.05,
) -> Summary:
    """Summarise normalised effects per cell; NaN entries (pair lacks that position) are skipped.

    The bootstrap resamples pairs. Under "pooled" each replicate recomputes the ratio of means
    (numerator over the resampled pairs that have the cell, denominator over all resampled pairs),
    so the interval includes the uncertainty of the gap; SE is the plain standard error of the
    per-pair normalised values.
    """
    v = values.double().cpu()
    c = clean.double().cpu()
    r = corrupted.double().cpu()
    n_cell, n_pair = v.shape
    _warn_if_unstable(c, r, normalise)
    norm = normalised_effects(v, c, r, normalise)
    have = ~torch.isnan(norm)
    n = have.sum(1)
    filled = torch.where(have, norm, torch.zeros((), dtype=norm.dtype))
    mean = filled.sum(1) / n.clamp(min=1)
    var = (torch.where(have, norm - mean[:, None], torch.zeros((), dtype=norm.dtype)) ** 2).sum(1)
    se = (var / (n - 1).clamp(min=1)).sqrt() / n.clamp(min=1).sqrt()
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, n_pair, (n_boot, n_pair), generator=gen)
    counts = torch.zeros(n_boot, n_pair, dtype=torch.float64)
    counts.scatter_add_(1, idx, torch.ones_like(idx, dtype=torch.float64))  # [boot, pair] multiplicity
    haved = have.double()
    if normalise == "pooled":
        top = torch.where(have, v - r, torch.zeros((), dtype=v.dtype))
        den = (counts @ (c - r)) / n_pair  # [boot]: mean gap over the resampled pairs
    else:
        top = filled
        den = None
    lo = torch.full((n_cell,), float("nan"), dtype=torch.float64)
    hi = torch.full((n_cell,), float("nan"), dtype=torch.float64)
    step = max(1, 2_000_000 // max(n_boot, 1))  # bound the [cells, boot] block to ~16 MB
    for a in range(0, n_cell, step):
        weight = haved[a : a + step] @ counts.T  # [cell, boot]: resampled pairs that have the cell
        boot = (top[a : a + step] @ counts.T) / weight.clamp(min=1e-12)
        if den is not None:
            boot = boot / den[None]
        boot = torch.where(weight > 0, boot, torch.full_like(boot, float("nan")))
        ok = ~torch.isnan(boot).all(1)
        if ok.any():
            lo[a : a + step][ok] = torch.nanquantile(boot[ok], alpha / 2, dim=1)
            hi[a : a + step][ok] = torch.nanquantile(boot[ok], 1 - alpha / 2, dim=1)
    none = n == 0
    mean = torch.where(none, torch.full_like(mean, float("nan")), mean)
    se = torch.where(n <= 1, torch.full_like(se, float("nan")), se)
    return Summary(mean.numpy(), se.numpy(), lo.numpy(), hi.numpy(), n.numpy())
