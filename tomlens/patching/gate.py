"""The gate before any head ranking: does the model separate the false-belief story from its control
in the expected direction at all?

Per contrast, the paired gap of the metric (logit of the clean story's belief answer minus logit of
the world answer, at the last token) between the false-belief story (clean) and its true-belief
control (corrupted): gap_i = clean_i - corrupted_i, expected > 0. The one-sided 95% lower bound is
t-based on the paired differences, mean - t(0.95, n-1) * SD / sqrt(n) (pairs are the unit; a
bootstrap lower bound with 3 to 10 pairs is too narrow to trust, the t bound is exact under
normality and conservative enough elsewhere). The gate passes only when that bound is above 0, so a
gap that is significantly NEGATIVE (the false-belief story leans more to the world answer than its
control) fails, as does one indistinguishable from 0. Heads ranked by effects normalised by a gap
that failed would be ranked on noise or on the wrong sign.

The power line: pairs needed to detect the observed mean with 80% power at one-sided alpha 0.05,
n ~ ((z_0.95 + z_0.8) * SD / mean)^2 (normal approximation).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Sequence

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float
from torch import Tensor

from tomlens.errors import TomlensError

__all__ = ["ALPHA", "POWER", "GateResult", "base_logit_diffs", "gate_message", "gate_pairs", "gate_table",
           "MIN_SPLIT_PAIRS", "pairs_needed", "run_gate", "solved_mask", "split_selection"]

ALPHA = 0.05  # one-sided: the lower bound is at level 1 - ALPHA
POWER = 0.8
METHOD = "one-sided t lower bound on the paired false-minus-true-belief gaps (level 0.95)"


def pairs_needed(mean: float, sd: float, *, alpha: float = ALPHA, power: float = POWER) -> int | None:
    """Pairs needed to detect `mean` with `power` at one-sided `alpha`: ((z_{1-a} + z_power) SD / mean)^2,
    rounded up. None when the mean is <= 0 (no number of pairs makes a wrong-sign gap positive) or
    the spread is undefined."""
    from scipy.stats import norm

    if not math.isfinite(mean) or not math.isfinite(sd) or mean <= 0:
        return None
    return max(2, math.ceil(((norm.ppf(1 - alpha) + norm.ppf(power)) * sd / mean) ** 2))


@dataclass(frozen=True)
class GateResult:
    """One contrast's gate: `n` pairs, mean and SD of the paired gaps, the one-sided lower bound,
    whether it is above 0 (`passed`), the pairs 80% power needs (`power_n`, None: no number helps)
    and a sentence for a reader (`message`)."""

    contrast: str
    n: int
    mean: float
    sd: float
    lower: float
    passed: bool
    power_n: int | None
    message: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def power_line(self) -> str:
        """How many pairs the observed spread needs (or why no number helps)."""
        return _power_line(self.mean, self.sd, self.n, self.power_n)


def _power_line(mean: float, sd: float, n: int, power_n: int | None) -> str:
    if not math.isfinite(mean) or n < 2:
        return "power: too few pairs to estimate the spread"
    if mean <= 0:
        return "power: no number of pairs helps: the gap has the wrong sign"
    if power_n is None:
        return "power: the spread is undefined"
    return (f"power: about {power_n} pairs detect a gap of {mean:.3f} (SD {sd:.3f}) with 80% power at "
            f"one-sided alpha 0.05 (have {n})")


def run_gate(gap: Float[Tensor, "pair"] | Sequence[float], contrast: str = "all", *,
             alpha: float = ALPHA) -> GateResult:
    """The gate on one contrast's paired gaps (clean - corrupted metric per pair)."""
    from scipy.stats import t as student_t

    g = np.asarray(gap.double().cpu().numpy() if isinstance(gap, Tensor) else gap, dtype=np.float64).reshape(-1)
    if not np.isfinite(g).all():
        raise TomlensError(f"contrast {contrast!r}: a logit difference is not finite",
                           "check the model's dtype (float32 or bfloat16) and the answer tokens")
    n = len(g)
    mean = float(g.mean()) if n else float("nan")
    sd = float(g.std(ddof=1)) if n > 1 else float("nan")
    if n < 2:
        lower = float("nan")
    elif sd == 0:
        lower = mean
    else:
        lower = mean - float(student_t.ppf(1 - alpha, n - 1)) * sd / math.sqrt(n)
    passed = bool(n >= 2 and lower > 0)
    power_n = pairs_needed(mean, sd, alpha=alpha)
    what = f"contrast {contrast!r}: false-minus-true-belief gap {mean:.3f} (SD {sd:.3f}, n = {n})"
    if passed:
        verdict = f"one-sided 95% lower bound {lower:.3f} > 0: passes"
    elif n < 2:
        verdict = "one pair or none: no interval; fails"
    elif mean <= 0:
        verdict = (f"lower bound {lower:.3f}; the false-belief story does not lean more to the belief answer "
                   "than its control (wrong sign or none): fails")
    else:
        verdict = f"lower bound {lower:.3f} does not exclude 0: fails"
    message = f"{what}; {verdict}. {_power_line(mean, sd, n, power_n)}"
    return GateResult(contrast, n, mean, sd, lower, passed, power_n, message)


def gate_pairs(clean: Float[Tensor, "pair"], corrupted: Float[Tensor, "pair"], contrasts: Sequence[str], *,
               alpha: float = ALPHA) -> dict[str, GateResult]:
    """The gate per contrast (pairs carry `.contrast`), in sorted contrast order."""
    clean, corrupted = torch.as_tensor(clean).double().cpu(), torch.as_tensor(corrupted).double().cpu()
    if not len(clean) == len(corrupted) == len(contrasts):
        raise TomlensError(f"{len(clean)} clean, {len(corrupted)} corrupted values and {len(contrasts)} contrasts",
                           "pass one value of each and one contrast per pair")
    gap = clean - corrupted
    out = {}
    for c in sorted(set(contrasts)):
        idx = torch.tensor([i for i, x in enumerate(contrasts) if x == c])
        out[c] = run_gate(gap[idx], c, alpha=alpha)
    return out


def gate_table(results: dict[str, GateResult]) -> pd.DataFrame:
    """One row per contrast: n, mean, sd, lower, passed, power_n, message."""
    return pd.DataFrame([r.to_dict() for r in results.values()],
                        columns=["contrast", "n", "mean", "sd", "lower", "passed", "power_n", "message"])


def gate_message(results: dict[str, GateResult], *, forced: bool = False) -> str:
    """What was withheld (or run anyway) and why, in words a researcher reads once."""
    passed = [c for c, r in results.items() if r.passed]
    failed = [c for c, r in results.items() if not r.passed]
    if not failed:
        return f"gate passed for every contrast ({', '.join(passed)}): heads ranked and validated on their pairs"
    why = ("the false-belief stories are not shown to lean more to the belief answer than their true-belief "
           "controls (the one-sided 95% lower bound of the paired gap is not above 0) for: " + ", ".join(failed))
    if forced:
        return ("FORCED (gate failed): " + why + ". Everything below was run anyway (--force) and is flagged; "
                "ranked heads and normalised effects divide by a gap that is noise or has the wrong sign")
    if passed:
        return (why + f". Their pairs are dropped; heads are ranked and validated on the pairs of "
                f"{', '.join(passed)} only")
    return ("withheld: head ranking, top-k recovery, mean ablation and the cell sweeps (their effects are "
            "normalised by this gap). Reason: " + why + ". The raw per-pair logit differences are kept; "
            "use more pairs (see the power line), --solved-only, or a model that separates the stories; "
            "--force runs everything anyway, flagged")


def solved_mask(clean: Float[Tensor, "pair"], corrupted: Float[Tensor, "pair"]) -> Tensor:
    """Pairs the model answers right both ways: the clean story prefers its belief answer (metric > 0)
    and the corrupted one its own, world answer (metric < 0)."""
    return (torch.as_tensor(clean) > 0) & (torch.as_tensor(corrupted) < 0)


def base_logit_diffs(model: Any, prepared: Any) -> tuple[Float[Tensor, "pair"], Float[Tensor, "pair"]]:
    """The unpatched metric of every clean and corrupted story (one plain forward per story, batched
    by the prepared groups), in pair order."""
    from tomlens.patching.engine import base_pass

    n = len(prepared.pairs)
    clean = torch.full((n,), float("nan"), dtype=torch.float64)
    corrupted = torch.full((n,), float("nan"), dtype=torch.float64)
    for group in prepared.groups:
        metric = base_pass(model, group, (), reuse_prefix=False).metric.double().cpu()
        idx = torch.tensor(group.index)
        clean[idx], corrupted[idx] = metric[: group.g], metric[group.g :]
    return clean, corrupted


MIN_SPLIT_PAIRS = 4


def split_selection(pairs: Sequence[Any], fraction: float = 0.5, seed: int = 0) -> tuple[list[int], list[int]] | None:
    """Indices of selection and held-out evaluation pairs, grouped by the clean story's task id (a pair
    without one is its own group) so the two sets never share a task; `fraction` of the groups (at least
    one each side) select, drawn with `seed`. None when there are fewer than `MIN_SPLIT_PAIRS` pairs or
    fewer than two groups: no split is possible."""
    if not 0 < fraction < 1:
        raise TomlensError(f"select_fraction {fraction} is not between 0 and 1", "pass e.g. 0.5")
    keys = [p.clean.task_id or f"pair:{p.id}" for p in pairs]
    groups = sorted(set(keys))
    if len(pairs) < MIN_SPLIT_PAIRS or len(groups) < 2:
        return None
    n_select = min(len(groups) - 1, max(1, round(fraction * len(groups))))
    chosen = {groups[i] for i in np.random.default_rng(seed).permutation(len(groups))[:n_select]}
    select = [i for i, k in enumerate(keys) if k in chosen]
    held = [i for i, k in enumerate(keys) if k not in chosen]
    return select, held
