"""The gate before any head ranking: does the model separate the false-belief story from its control
in the expected direction at all?

Per contrast, the paired gap of the metric (logit of the clean story's belief answer minus logit of
the world answer, at the last token) between the false-belief story (clean) and its true-belief
control (corrupted): gap_i = clean_i - corrupted_i, expected > 0. Pairs of one task (its normal and
reversed versions, several contrasts) share a story and are not independent, so the gaps are first
averaged within each task (the clean story's task id; a pair without one is its own task) per
contrast, and tasks are the unit: the one-sided 95% lower bound is t-based on the task means,
mean - t(0.95, n-1) * SD / sqrt(n) with n = tasks (a bootstrap lower bound with 3 to 10 tasks is too
narrow to trust; the t bound is exact under normality and conservative enough elsewhere). Counting
pairs instead would narrow the bound by repeating a task. The gate passes only when that bound is above 0, so a
gap that is significantly NEGATIVE (the false-belief story leans more to the world answer than its
control) fails, as does one indistinguishable from 0. Heads ranked by effects normalised by a gap
that failed would be ranked on noise or on the wrong sign.

The power line: tasks needed to detect the observed mean with 80% power at one-sided alpha 0.05,
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
from tomlens.probes.splits import fraction_split

__all__ = ["ALPHA", "POWER", "GateResult", "base_logit_diffs", "gate_message", "gate_pairs", "gate_table",
           "MIN_SPLIT_PAIRS", "pairs_needed", "run_gate", "solved_mask", "split_selection", "task_gaps"]

ALPHA = 0.05  # one-sided: the lower bound is at level 1 - ALPHA
POWER = 0.8
METHOD = ("one-sided t lower bound (level 0.95) over tasks on the false-minus-true-belief gaps averaged "
          "within each task")


def pairs_needed(mean: float, sd: float, *, alpha: float = ALPHA, power: float = POWER) -> int | None:
    """Tasks (independent units) needed to detect `mean` with `power` at one-sided `alpha`:
    ((z_{1-a} + z_power) SD / mean)^2, rounded up. None when the mean is <= 0 (no number of tasks makes a wrong-sign gap positive) or
    the spread is undefined."""
    from scipy.stats import norm

    if not math.isfinite(mean) or not math.isfinite(sd) or mean <= 0:
        return None
    return max(2, math.ceil(((norm.ppf(1 - alpha) + norm.ppf(power)) * sd / mean) ** 2))


@dataclass(frozen=True)
class GateResult:
    """One contrast's gate: `n` tasks (the unit; `n_pairs` pairs behind them), mean and SD of the
    per-task mean gaps, the one-sided lower bound, whether it is above 0 (`passed`), the tasks 80%
    power needs (`power_n`, None: no number helps) and a sentence for a reader (`message`)."""

    contrast: str
    n: int
    mean: float
    sd: float
    lower: float
    passed: bool
    power_n: int | None
    message: str
    n_pairs: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def power_line(self) -> str:
        """How many tasks the observed spread needs (or why no number helps)."""
        return _power_line(self.mean, self.sd, self.n, self.power_n)


def _power_line(mean: float, sd: float, n: int, power_n: int | None) -> str:
    if not math.isfinite(mean) or n < 2:
        return "power: too few tasks to estimate the spread"
    if mean <= 0:
        return "power: no number of tasks helps: the gap has the wrong sign"
    if power_n is None:
        return "power: the spread is undefined"
    return (f"power: about {power_n} tasks detect a gap of {mean:.3f} (SD {sd:.3f}) with 80% power at "
            f"one-sided alpha 0.05 (have {n})")


def run_gate(gap: Float[Tensor, "task"] | Sequence[float], contrast: str = "all", *,
             alpha: float = ALPHA, n_pairs: int | None = None) -> GateResult:
    """The gate on one contrast's gaps, one per independent unit (a task's mean clean - corrupted
    metric; `gate_pairs` averages pairs into tasks). `n_pairs`: the pairs behind them (reported)."""
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
    behind = f", {n_pairs} pairs" if n_pairs is not None else ""
    what = (f"contrast {contrast!r}: false-minus-true-belief gap {mean:.3f} (SD {sd:.3f} over tasks, "
            f"n = {n} tasks{behind})")
    if passed:
        verdict = f"one-sided 95% lower bound {lower:.3f} > 0: passes"
    elif n < 2:
        verdict = "one task or none: no interval; fails"
    elif mean <= 0:
        verdict = (f"lower bound {lower:.3f}; the false-belief story does not lean more to the belief answer "
                   "than its control (wrong sign or none): fails")
    else:
        verdict = f"lower bound {lower:.3f} does not exclude 0: fails"
    message = f"{what}; {verdict}. {_power_line(mean, sd, n, power_n)}"
    return GateResult(contrast, n, mean, sd, lower, passed, power_n, message, n if n_pairs is None else n_pairs)


def task_gaps(gap: Float[Tensor, "pair"] | Sequence[float], task_ids: Sequence[str | None] | None
              ) -> Float[Tensor, "task"]:
    """Mean gap per task, tasks in first-seen order (a pair with no task id, or `task_ids=None`, is
    its own task): the independent units of the gate."""
    g = torch.as_tensor(gap).double().cpu().reshape(-1)
    if task_ids is None:
        return g
    if len(task_ids) != len(g):
        raise TomlensError(f"{len(g)} gaps and {len(task_ids)} task ids", "pass one task id per pair (or None)")
    keys = [t if t else f"pair:{i}" for i, t in enumerate(task_ids)]
    order = list(dict.fromkeys(keys))
    return torch.stack([g[[i for i, k in enumerate(keys) if k == key]].mean() for key in order]) if order else g


def gate_pairs(clean: Float[Tensor, "pair"], corrupted: Float[Tensor, "pair"], contrasts: Sequence[str], *,
               task_ids: Sequence[str | None] | None = None, alpha: float = ALPHA) -> dict[str, GateResult]:
    """The gate per contrast (pairs carry `.contrast`), in sorted contrast order, on the pairs' gaps
    averaged within each task (`task_ids`, the clean stories' task ids; None: every pair its own task)."""
    clean, corrupted = torch.as_tensor(clean).double().cpu(), torch.as_tensor(corrupted).double().cpu()
    if not len(clean) == len(corrupted) == len(contrasts):
        raise TomlensError(f"{len(clean)} clean, {len(corrupted)} corrupted values and {len(contrasts)} contrasts",
                           "pass one value of each and one contrast per pair")
    if task_ids is not None and len(task_ids) != len(clean):
        raise TomlensError(f"{len(clean)} pairs and {len(task_ids)} task ids", "pass one task id per pair (or None)")
    gap = clean - corrupted
    out = {}
    for c in sorted(set(contrasts)):
        idx = [i for i, x in enumerate(contrasts) if x == c]
        units = task_gaps(gap[torch.tensor(idx)], None if task_ids is None else [task_ids[i] for i in idx])
        out[c] = run_gate(units, c, alpha=alpha, n_pairs=len(idx))
    return out


def gate_table(results: dict[str, GateResult]) -> pd.DataFrame:
    """One row per contrast: n (tasks), mean, sd, lower, passed, power_n (tasks), message, n_pairs."""
    return pd.DataFrame([r.to_dict() for r in results.values()],
                        columns=["contrast", "n", "mean", "sd", "lower", "passed", "power_n", "message", "n_pairs"])


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
            "use more tasks (see the power line) or a model that separates the stories; "
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
    metrics = [base_pass(model, group, (), reuse_prefix=False).metric for group in prepared.groups]
    if not metrics:
        return torch.full((n,), float("nan"), dtype=torch.float64), torch.full((n,), float("nan"), dtype=torch.float64)
    # every group's metric stays on the device until one move to the host: no wait per group
    flat = torch.cat([m.double() for m in metrics]).cpu()
    clean = torch.full((n,), float("nan"), dtype=torch.float64)
    corrupted = torch.full((n,), float("nan"), dtype=torch.float64)
    start = 0
    for group in prepared.groups:
        idx = torch.tensor(group.index)
        clean[idx], corrupted[idx] = flat[start : start + group.g], flat[start + group.g : start + 2 * group.g]
        start += 2 * group.g
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
    if len(pairs) < MIN_SPLIT_PAIRS or len(set(keys)) < 2:
        return None
    split = fraction_split(keys, fraction, seed)
    return split.train.tolist(), split.test.tolist()
