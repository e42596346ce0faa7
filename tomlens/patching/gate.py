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
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float
from torch import Tensor

from tomlens.errors import TomlensError
from tomlens.probes.splits import fraction_split

__all__ = ["ALPHA", "FORCED_PREFIX", "POWER", "GateDecision", "GateResult", "base_logit_diffs", "decide",
           "gate_message", "gate_pairs", "gate_table", "MIN_SPLIT_PAIRS", "pairs_needed", "run_gate", "solved_mask",
           "split_selection", "task_gaps", "withheld_sentence"]

ALPHA = 0.05  # one-sided: the lower bound is at level 1 - ALPHA
POWER = 0.8
# How a forced run's message starts (the one place this is written: readers strip it with this constant).
FORCED_PREFIX = "FORCED (gate failed): "
WITHHELD_PREFIX = "withheld: "
WITHHELD_STAGES = "head ranking, top-k recovery, mean ablation and the cell sweeps"
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


def run_gate(gap: Float[Tensor, " task"] | Sequence[float], contrast: str = "all", *,
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


def task_gaps(gap: Float[Tensor, " pair"] | Sequence[float], task_ids: Sequence[str | None] | None
              ) -> Float[Tensor, " task"]:
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


def gate_pairs(clean: Float[Tensor, " pair"], corrupted: Float[Tensor, " pair"], contrasts: Sequence[str], *,
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
        return (FORCED_PREFIX + why + ". Everything below was run anyway (--force) and is flagged; "
                "ranked heads and normalised effects divide by a gap that is noise or has the wrong sign")
    if passed:
        return (why + f". Their pairs are dropped; heads are ranked and validated on the pairs of "
                f"{', '.join(passed)} only")
    return withheld_sentence(why + ". The raw per-pair logit differences are kept; use more tasks (see the power "
                             "line) or a model that separates the stories; --force runs everything anyway, flagged",
                             aside=" (their effects are normalised by this gap)")


def withheld_sentence(reason: str, *, aside: str = "") -> str:
    """What a withheld run says: the stages withheld (`aside` qualifies them), then `reason` (with
    what to do about it). Written here once, so every refusal reads the same way."""
    return f"{WITHHELD_PREFIX}{WITHHELD_STAGES}{aside}. Reason: {reason}"


def solved_mask(clean: Float[Tensor, " pair"], corrupted: Float[Tensor, " pair"]) -> Tensor:
    """Pairs the model answers right both ways: the clean story prefers its belief answer (metric > 0)
    and the corrupted one its own, world answer (metric < 0)."""
    return (torch.as_tensor(clean) > 0) & (torch.as_tensor(corrupted) < 0)


def base_logit_diffs(model: Any, prepared: Any) -> tuple[Float[Tensor, " pair"], Float[Tensor, " pair"]]:
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


@dataclass(frozen=True)
class GateDecision:
    """What the gate and the split decide before any sweep (`decide`). `verdict`: "passed" (every
    sweep runs on the pairs let through), "forced" (run anyway past a failed gate or split, every
    output flagged) or "withheld" (nothing is swept: `reason` says why). `message` is the gate's
    sentence; `notes` what the split or --solved-only did; `gated` the indices of the pairs the gate
    let through, `kept` those patched, `split` (selection, evaluation) indices into the pairs of
    those patched per half (None: no split), `half_gaps` each half's mean gap over its gated pairs."""

    verdict: str
    reason: str | None
    forced: bool
    message: str
    notes: tuple[str, ...]
    passed: tuple[str, ...]
    dropped_contrasts: tuple[str, ...]
    gate_failed: bool
    gated: tuple[int, ...]
    kept: tuple[int, ...]
    split: tuple[tuple[int, ...], tuple[int, ...]] | None
    half_gaps: dict[str, float]

    @property
    def withheld(self) -> bool:
        return self.verdict == "withheld"

    @property
    def forced_message(self) -> str | None:
        """Why a forced run is flagged: the gate's FORCED message, or the split's FORCED note."""
        if not self.forced:
            return None
        return self.message if self.gate_failed else self.notes[-1]


def decide(gates: dict[str, GateResult], clean: Float[Tensor, " pair"] | Sequence[float],
           corrupted: Float[Tensor, " pair"] | Sequence[float], pairs: Sequence[Any], *, force: bool = False,
           solved_only: bool = False, select_fraction: float = 0.5, seed: int = 0) -> GateDecision:
    """The gate / withhold / force decision (the module docstring's rules), from the gate per
    contrast, every aligned pair's unpatched clean and corrupted metric and the pairs (`.contrast`,
    `.id`, `.clean.task_id`). Pure: no model, nothing printed.

    The gate sees EVERY aligned pair: filtering to solved pairs first (clean > 0, corrupted < 0)
    would make every gap positive by construction; `solved_only` only picks, after it, which pairs
    are patched. Likewise the split is drawn over every gated pair and each half's gap read over all
    of its gated pairs; only then does `solved_only` pick within each half."""
    clean = torch.as_tensor(clean, dtype=torch.float64)
    corrupted = torch.as_tensor(corrupted, dtype=torch.float64)
    passed = [c for c, g in gates.items() if g.passed]
    gate_failed = len(passed) < len(gates) or not gates
    message = gate_message(gates, forced=force)
    solved = solved_mask(clean, corrupted).tolist()
    gated = [i for i, p in enumerate(pairs) if force or p.contrast in passed]
    kept = [i for i in gated if solved[i] or not solved_only]
    notes: list[str] = []
    if solved_only:
        notes.append(f"--solved-only: the gate ran on all {len(pairs)} pairs; of the {len(gated)} pairs it let "
                     f"through, kept {len(kept)} the model answers right both ways")
    withheld = None
    if not gated:
        withheld = message
    elif not kept:
        withheld = (f"{WITHHELD_PREFIX}of the {len(gated)} pairs that passed the gate, none is answered right both "
                    "ways (--solved-only): nothing to patch; run without --solved-only")
    halves, forced, refusal = _halves(pairs, gated, kept, force=force, select_fraction=select_fraction, seed=seed,
                                      notes=notes)
    withheld = withheld or refusal
    forced = forced or bool(force and gate_failed)
    half_gaps: dict[str, float] = {}
    split: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    if withheld is None and halves is not None:
        half_gaps = _half_gaps(clean - corrupted, gated, halves)
        forced_here, withheld = _check_half_gaps(half_gaps, force=force, notes=notes)
        forced = forced or forced_here
        sel, ev = (tuple(gated[i] for i in half if solved[gated[i]] or not solved_only) for half in halves)
        split = (sel, ev)
        empty = [h for h, idx in zip(("selection", "evaluation"), split, strict=True) if not idx]
        if withheld is None and empty:
            withheld = withheld_sentence(f"no {' or '.join(empty)} pair is answered right both ways (--solved-only); "
                                         "run without --solved-only, or with another --seed for the split")
    dropped = sorted(c for c in gates if c not in passed) if (passed and not force) else []
    verdict = "withheld" if withheld is not None else ("forced" if forced else "passed")
    return GateDecision(verdict, withheld, forced, message, tuple(notes), tuple(passed), tuple(dropped),
                        gate_failed, tuple(gated), tuple(kept), split, half_gaps)


def _halves(pairs: Sequence[Any], gated: list[int], kept: list[int], *, force: bool, select_fraction: float,
            seed: int, notes: list[str]) -> tuple[tuple[list[int], list[int]] | None, bool, str | None]:
    """(selection and evaluation halves as indices into `gated`, forced, the withheld sentence): the
    split by task of the gated pairs; where none is possible, the SAME pairs both ways when forced
    (noted), else withheld, since heads validated on the pairs that ranked them recover their own noise."""
    halves = split_selection([pairs[i] for i in gated], select_fraction, seed) if kept else None
    if not kept or halves is not None:
        return halves, False, None
    n_tasks = len({pairs[i].clean.task_id or pairs[i].id for i in gated})
    why = (f"{len(gated)} pairs from {n_tasks} task(s) cannot be split into selection and held-out evaluation "
           f"pairs (needs at least {MIN_SPLIT_PAIRS} pairs and 2 tasks)")
    if force:
        notes.append(f"FORCED: {why}; heads are ranked and validated on the SAME pairs")
        return (list(range(len(gated))), list(range(len(gated)))), True, None
    return None, False, withheld_sentence(f"{why}, and heads validated on the pairs that ranked them recover their "
                                          "own noise; use more pairs (--force runs everything anyway, flagged)")


def _half_gaps(gap: Tensor, gated: list[int], halves: tuple[list[int], list[int]]) -> dict[str, float]:
    """Each half's mean gap over ALL of its gated pairs (reading only solved pairs would read gaps
    positive by construction)."""
    return {half: float(gap[torch.tensor([gated[i] for i in idx])].mean())
            for half, idx in zip(("selection", "evaluation"), halves, strict=True)}


def _check_half_gaps(half_gaps: dict[str, float], *, force: bool, notes: list[str]) -> tuple[bool, str | None]:
    """(forced, withheld sentence): the pooled gate is not enough, as ranking is normalised by the
    selection pairs' own gap and validation by the held-out pairs'; a half whose mean gap is not
    positive divides by noise or the wrong sign."""
    bad = [f"the {h} pairs' mean gap is {g:.3f}" for h, g in half_gaps.items() if not g > 0]
    if not bad:
        return False, None
    why = ("; ".join(bad) + " (not positive, read over all of the half's gated pairs: heads ranked on the "
           "selection pairs and validated on the held-out pairs are normalised by that half's own gap)")
    if force:
        notes.append(f"FORCED: {why}")
        return True, None
    return False, withheld_sentence(f"{why}; use more tasks or another --seed for the split (--force runs "
                                    "everything anyway, flagged)")
