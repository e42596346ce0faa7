"""Street et al.'s scoring and aggregates for the higher-order statements (`motomqa`).

Scoring (their section 2.2): the probability of answering "true" pools the case variants,
P(true) = sum_{True,true,TRUE} e^x / (sum_{True,true,TRUE} e^x + sum_{False,false,FALSE} e^x), and
the answer is "true" when P(true) > 0.5. `pooled_scores` runs the six continuations through
`tomlens.behaviour.scoring.score_options`; `add_pooled` puts the result beside a behaviour table.
A table without them falls back to the two lower-case options every prompt carries (the
`scoring` column of the summary says which was used).

Aggregates (their Tables 2 and 3 and the anchoring test): accuracy per ToM order and per factual
level, ToM and factual overall, the shortcut baselines per order (`baseline_last_1` /
`baseline_last_2`: % of ToM statements that a reader of only the chain's last one / two believers
would label right, from the `last_1_true` / `last_2_true` meta; accuracy at orders 4-6 near
`baseline_last_2` is what an order-3 reading gives), the ToM-minus-factual gap, the anchoring index (% "true" when
"true" is offered first minus % "true" when "false" is), and a flag when a model answers "true" to
nearly everything (LaMDA's degenerate 50%). Intervals are bootstraps over whole stories (the
statements of a story share its text), and the two-proportion z-tests the paper used (which treat
trials as independent) are given beside them for comparison with its numbers.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd
from scipy import stats

from tomlens.behaviour.aggregates import per_task, task_bootstrap
from tomlens.behaviour.scoring import score_options
from tomlens.errors import TomlensError
from tomlens.stimuli.records import Stimulus

FAMILY = "motomqa"
CASE_VARIANTS: dict[str, tuple[str, ...]] = {"true": ("True", "true", "TRUE"),
                                              "false": ("False", "false", "FALSE")}
ALWAYS_TRUE_SHARE = 0.95  # one answer ("true", or "false") to at least this share of statements is flagged
# Street et al. (seeds-notes.md 2.3): humans, GPT-4 and Flan-PaLM, % correct.
PAPER_TOM_BY_ORDER: dict[int, dict[str, float]] = {
    2: {"humans": 96, "gpt4": 100, "flan_palm": 100}, 3: {"humans": 93, "gpt4": 95, "flan_palm": 95},
    4: {"humans": 82, "gpt4": 73, "flan_palm": 79}, 5: {"humans": 98, "gpt4": 82, "flan_palm": 77},
    6: {"humans": 82, "gpt4": 93, "flan_palm": 71},
}
PAPER_OVERALL: dict[str, dict[str, float]] = {
    "tom": {"humans": 90.4, "gpt4": 88.6, "flan_palm": 84.3},
    "fact": {"humans": 97.5, "gpt4": 94.3, "flan_palm": 93.6},
    "gap": {"humans": 90.4 - 97.5, "gpt4": 88.6 - 94.3, "flan_palm": 84.3 - 93.6},
    "anchoring": {"humans": 55.4 - 53.9, "gpt4": 0.0, "flan_palm": 58.6 - 57.9},
}
SUMMARY_COLUMNS: tuple[str, ...] = (
    "metric", "stmt_type", "order_or_level", "n", "n_tasks", "value", "ci_low", "ci_high", "z",
    "p_value", "paper", "paper_gpt4", "paper_flan_palm", "scoring", "flag",
)


def pooled_p_true(logps: dict[str, float]) -> float:
    """Street et al.'s P(true) from the log-probabilities of the six case variants (a variant
    missing from `logps` is left out of its sum; at least one of each side is needed)."""
    sides = []
    for side in ("true", "false"):
        xs = [logps[v] for v in CASE_VARIANTS[side] if v in logps]
        if not xs:
            raise TomlensError(f"no log-probability for any of {CASE_VARIANTS[side]}",
                               "score the case variants with pooled_scores")
        m = max(xs)
        sides.append(m + math.log(sum(math.exp(x - m) for x in xs)))
    return 1.0 / (1.0 + math.exp(sides[1] - sides[0]))


def pooled_scores(model: Any, stimuli: Sequence[Stimulus], *, batch_size: int = 8,
                  progress: bool = True) -> pd.DataFrame:
    """Per prompt: the summed log-probability of each case variant as the answer, P(true) pooled
    over them, the pooled answer and whether it is right. Three forward pairs per prompt
    ((True, False), (true, false), (TRUE, FALSE)), through `score_options`."""
    stimuli = list(stimuli)
    if not stimuli:
        raise TomlensError("no stimuli to score", "pass the motomqa prompts")
    variants = []
    for s in stimuli:
        if s.answer not in ("true", "false"):
            raise TomlensError(f"stimulus {s.id!r} has answer {s.answer!r}, not true/false",
                               "pool case variants only over true/false statements (motomqa)")
        for k in range(3):
            t, f = CASE_VARIANTS["true"][k], CASE_VARIANTS["false"][k]
            variants.append(s.with_(id=f"{s.id}#{t}", options=(t, f), answer=t if s.answer == "true" else f))
    scored = score_options(model, variants, batch_size=batch_size, progress=progress)
    rows = []
    for i, s in enumerate(stimuli):
        logps: dict[str, float] = {}
        for k in range(3):
            a, b = scored[3 * i + k]
            logps[CASE_VARIANTS["true"][k]] = a.logp_sum
            logps[CASE_VARIANTS["false"][k]] = b.logp_sum
        p = pooled_p_true(logps)
        rows.append({"id": s.id, **{f"logp_{v}": x for v, x in logps.items()}, "p_true_pooled": p,
                     "answer_pooled": "true" if p > 0.5 else "false",
                     "correct_pooled": (p > 0.5) == (s.answer == "true")})
    return pd.DataFrame(rows)


def add_pooled(df: pd.DataFrame, pooled: pd.DataFrame) -> pd.DataFrame:
    """The behaviour table with the pooled columns joined on `id` (every row must have them)."""
    out = df.merge(pooled, on="id", how="left", validate="one_to_one")
    if out["p_true_pooled"].isna().any():
        missing = out.loc[out["p_true_pooled"].isna(), "id"].head(3).tolist()
        raise TomlensError(f"no pooled score for rows such as {missing}",
                           "score the same stimuli with pooled_scores")
    return out


def answered_true(df: pd.DataFrame) -> tuple[pd.Series, str]:
    """Per row, whether the model answered "true", and how that was scored: pooled over case
    variants where `p_true_pooled` exists, else the two lower-case options' `p_a`."""
    if "p_true_pooled" in df:
        return df["p_true_pooled"].astype(float) > 0.5, "pooled case variants"
    for col in ("option_a", "p_a"):
        if col not in df:
            raise TomlensError(f"the behaviour table has no {col!r} column",
                               "pass the table that run_behaviour returns")
    p_true = df["p_a"].astype(float).where(df["option_a"] == "true", 1 - df["p_a"].astype(float))
    return p_true > 0.5, "two options (true, false)"


def _rng(key: object) -> np.random.Generator:
    return np.random.default_rng([0, zlib.crc32(repr(key).encode())])


def _boot_ratio(values: pd.Series, tasks: pd.Series, key: object, n_boot: int) -> tuple[float, float]:
    total, count = per_task(values, tasks)
    return task_bootstrap(total, count, n_boot=n_boot, rng=_rng(key))


def _boot_difference(a: pd.Series, ta: pd.Series, b: pd.Series, tb: pd.Series, key: object,
                     n_boot: int) -> tuple[float, float]:
    """Interval of mean(a) - mean(b) with whole tasks resampled (the same draw for both sides)."""
    tasks = sorted(set(ta) | set(tb))
    if len(tasks) < 2:
        return (float("nan"), float("nan"))
    idx = {t: i for i, t in enumerate(tasks)}
    sums = np.zeros((2, len(tasks)))
    counts = np.zeros((2, len(tasks)))
    for side, (v, t) in enumerate(((a, ta), (b, tb))):
        np.add.at(sums[side], [idx[x] for x in t], v.astype(float).to_numpy())
        np.add.at(counts[side], [idx[x] for x in t], 1.0)
    draw = _rng(key).integers(0, len(tasks), (n_boot, len(tasks)))
    with np.errstate(invalid="ignore", divide="ignore"):
        diff = sums[0][draw].sum(1) / counts[0][draw].sum(1) - sums[1][draw].sum(1) / counts[1][draw].sum(1)
    diff = diff[np.isfinite(diff)]
    if not len(diff):
        return (float("nan"), float("nan"))
    return (float(np.quantile(diff, 0.025)), float(np.quantile(diff, 0.975)))


def two_proportion_z(k1: int, n1: int, k2: int, n2: int) -> tuple[float, float]:
    """The pooled two-proportion z-test (Street et al.'s independent-samples test): (z, p)."""
    if min(n1, n2) == 0:
        return (float("nan"), float("nan"))
    p = (k1 + k2) / (n1 + n2)
    se = math.sqrt(p * (1 - p) * (1 / n1 + 1 / n2))
    if se == 0:
        return (0.0, 1.0)
    z = (k1 / n1 - k2 / n2) / se
    return (z, float(2 * stats.norm.sf(abs(z))))


def _one_answer_flag(share_true: float, truth_share: float) -> str:
    """Why accuracy means nothing when one answer is given to nearly everything ('' otherwise):
    "true" throughout is LaMDA's degenerate 50%; "false" throughout is the same pattern mirrored."""
    for word, share in (("true", share_true), ("false", 1 - share_true)):
        if share >= ALWAYS_TRUE_SHARE:
            right = truth_share if word == "true" else 1 - truth_share
            return (f"answers '{word}' to {100 * share:.0f}% of statements ({100 * right:.0f}% are "
                    f"{word}): accuracy near that share is {'LaMDA' if word == 'true' else 'a mirror of LaMDA'}'s "
                    "degenerate pattern, not a reading of the stories")
    return ""


def summary(df: pd.DataFrame, *, n_boot: int = 1000) -> pd.DataFrame:
    """One row per cell Street et al. report: ToM accuracy per order and overall, factual accuracy
    per level and overall, the shortcut baselines per order (the answer of the last one / two
    believers alone: accuracy near them is what a shorter chain gives), the ToM-minus-factual gap, the anchoring index, and the share of "true"
    answers with the always-true flag. Values are percentages; `paper*` are their numbers (humans,
    GPT-4, Flan-PaLM) where they report one."""
    need = ("stmt_type", "order_or_level", "options_order", "answer")
    missing = [c for c in need if c not in df]
    if missing:
        raise TomlensError(f"the behaviour table has no {missing} column(s)",
                           "score motomqa stimuli with run_behaviour (it copies their meta)")
    df = df[df["stmt_type"].isin(("tom", "fact"))]
    if df.empty:
        return pd.DataFrame(columns=SUMMARY_COLUMNS)
    said_true, scoring = answered_true(df)
    correct = said_true == (df["answer"] == "true")
    tasks = df["task_id"].astype(str) if "task_id" in df else df["id"].astype(str)
    rows: list[dict[str, Any]] = []

    def paper(cell: dict[str, float] | None) -> dict[str, float | None]:
        cell = cell or {}
        return {"paper": cell.get("humans"), "paper_gpt4": cell.get("gpt4"), "paper_flan_palm": cell.get("flan_palm")}

    def acc_row(metric: str, mask: pd.Series, stmt_type: str, level: int | None,
                ref: dict[str, float] | None) -> None:
        lo, hi = _boot_ratio(correct[mask], tasks[mask], (metric, stmt_type, level), n_boot)
        rows.append({"metric": metric, "stmt_type": stmt_type, "order_or_level": level,
                     "n": int(mask.sum()), "n_tasks": int(tasks[mask].nunique()),
                     "value": 100 * float(correct[mask].mean()), "ci_low": 100 * lo, "ci_high": 100 * hi,
                     **paper(ref)})

    for stmt_type in ("tom", "fact"):
        of_type = df["stmt_type"] == stmt_type
        if not of_type.any():
            continue
        for level in sorted(int(x) for x in df.loc[of_type, "order_or_level"].unique()):
            mask = of_type & (df["order_or_level"].astype(int) == level)
            acc_row("accuracy", mask, stmt_type, level,
                    PAPER_TOM_BY_ORDER.get(level) if stmt_type == "tom" else None)
        acc_row("accuracy_overall", of_type, stmt_type, None, PAPER_OVERALL[stmt_type])
    for k in (1, 2):  # shortcut baselines: the answer of the last k believers alone, per order
        col = f"last_{k}_true"
        if col not in df:
            continue
        has = (df["stmt_type"] == "tom") & df[col].notna()
        agree = df[col].where(has, False).astype(bool) == (df["answer"] == "true")
        for level in sorted(int(x) for x in df.loc[has, "order_or_level"].unique()):
            mask = has & (df["order_or_level"].astype(int) == level)
            lo, hi = _boot_ratio(agree[mask], tasks[mask], (col, level), n_boot)
            rows.append({"metric": f"baseline_last_{k}", "stmt_type": "tom", "order_or_level": level,
                         "n": int(mask.sum()), "n_tasks": int(tasks[mask].nunique()),
                         "value": 100 * float(agree[mask].mean()), "ci_low": 100 * lo, "ci_high": 100 * hi,
                         **paper(None)})
    tom, fact = df["stmt_type"] == "tom", df["stmt_type"] == "fact"
    if tom.any() and fact.any():
        lo, hi = _boot_difference(correct[tom], tasks[tom], correct[fact], tasks[fact], "gap", n_boot)
        z, p = two_proportion_z(int(correct[tom].sum()), int(tom.sum()), int(correct[fact].sum()), int(fact.sum()))
        rows.append({"metric": "tom_minus_fact", "stmt_type": "both", "order_or_level": None,
                     "n": len(df), "n_tasks": int(tasks.nunique()),
                     "value": 100 * (float(correct[tom].mean()) - float(correct[fact].mean())),
                     "ci_low": 100 * lo, "ci_high": 100 * hi, "z": z, "p_value": p, **paper(PAPER_OVERALL["gap"])})
    tf, ff = df["options_order"] == "true-first", df["options_order"] == "false-first"
    if tf.any() and ff.any():
        lo, hi = _boot_difference(said_true[tf], tasks[tf], said_true[ff], tasks[ff], "anchoring", n_boot)
        z, p = two_proportion_z(int(said_true[tf].sum()), int(tf.sum()), int(said_true[ff].sum()), int(ff.sum()))
        rows.append({"metric": "anchoring_index", "stmt_type": "both", "order_or_level": None,
                     "n": len(df), "n_tasks": int(tasks.nunique()),
                     "value": 100 * (float(said_true[tf].mean()) - float(said_true[ff].mean())),
                     "ci_low": 100 * lo, "ci_high": 100 * hi, "z": z, "p_value": p,
                     **paper(PAPER_OVERALL["anchoring"])})
    share = float(said_true.mean())
    lo, hi = _boot_ratio(said_true, tasks, "share_true", n_boot)
    truth_share = float((df["answer"] == "true").mean())
    rows.append({"metric": "share_true", "stmt_type": "both", "order_or_level": None, "n": len(df),
                 "n_tasks": int(tasks.nunique()), "value": 100 * share, "ci_low": 100 * lo, "ci_high": 100 * hi,
                 **paper(None),
                 "flag": _one_answer_flag(share, truth_share)})
    out = pd.DataFrame(rows)
    for col in SUMMARY_COLUMNS:
        if col not in out:
            out[col] = None
    out["scoring"] = scoring
    out["flag"] = out["flag"].fillna("")
    out["order_or_level"] = out["order_or_level"].astype("Int64")
    return out[list(SUMMARY_COLUMNS)]
