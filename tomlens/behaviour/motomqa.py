"""Street et al.'s scoring and aggregates for the higher-order statements (`motomqa`).

Scoring (their section 2.2): the probability of answering "true" pools the case variants,
P(true) = sum_{True,true,TRUE} e^x / (sum_{True,true,TRUE} e^x + sum_{False,false,FALSE} e^x), and
the answer is "true" when P(true) > 0.5. `pooled_scores` runs the six continuations through
`tomlens.behaviour.scoring.score_options`, and records how much probability the six got together
(`option_mass_pooled`): a model that would say neither "true" nor "false" looks, in P(true),
like one that chose. `add_pooled` puts the result beside a behaviour table. A table without them
falls back to the two lower-case options every prompt carries (the `scoring` column of the summary
says which was used).

Aggregates (their Tables 2 and 3 and the anchoring test): accuracy per ToM order and per factual
level, ToM and factual overall (with the exact binomial test against chance the paper ran), the
ToM-minus-factual gap, the anchoring index (% "true" when "true" is offered first minus % "true"
when "false" is), and a flag when a model answers "true" to nearly everything (LaMDA's degenerate
50%). Intervals are bootstraps over whole stories (the statements of a story share its text).

What a number at an order means: per order, each shortcut the generator records
(`tomlens.stimuli.motomqa.SHORTCUTS`: the last one or two believers alone, the first, the world,
the least informed believer, whoever missed the change) is scored as a reader
(`baseline_<shortcut>`, from the rows' `<shortcut>_true`), and the model's accuracy above it
(`above_<shortcut>`: the difference with a paired task-bootstrap interval, the shortcut's accuracy
in `baseline`, and McNemar's test of model vs shortcut on the same statements). On the generated
set every shortcut scores 50%; on a user's own statements it may not, and accuracy at orders 4-6
near `baseline_last_2` is what an order-3 reading gives.

Tests as the paper runs them (SPSS, section 3): Cochran's Q over related samples and McNemar's test
for pairs (continuity-corrected chi-square, or the exact binomial where fewer than 25 pairs differ,
as SPSS does; the paper's footnote 5), two-proportion z-tests for independent samples, exact
binomial tests against chance. The paper compared subjects (models and humans) on the same
statements: `subject_tests` does that for several models' tables. Within one model the related
samples are the orders (or levels): the statements of one story, prompt condition and truth value
form a block with one statement per order, so `summary` gives Cochran's Q across orders, McNemar
for each order against the next, and McNemar for ToM order n against factual level n (the paper's
ToM-vs-factual z-test is kept beside it).

Reference columns: Street et al.'s numbers come from their 7 stories (140 statements) and their
subjects (humans, GPT-4, Flan-PaLM), never from these generated stories or this model, so they sit
in columns named for what they are (`paper_other_items_humans`, `..._gpt4`, `..._flan_palm`:
"paper, other items and model"), for context and not for comparison.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import combinations
from typing import Any, TypeAlias

import numpy as np
import pandas as pd
from scipy import stats

from tomlens.behaviour.aggregates import per_task, task_bootstrap
from tomlens.behaviour.scoring import score_options
from tomlens.errors import TomlensError
from tomlens.stimuli.motomqa import SHORTCUTS
from tomlens.stimuli.records import Stimulus

FAMILY = "motomqa"
CASE_VARIANTS: dict[str, tuple[str, ...]] = {"true": ("True", "true", "TRUE"),
                                              "false": ("False", "false", "FALSE")}
ALWAYS_TRUE_SHARE = 0.95  # one answer ("true", or "false") to at least this share of statements is flagged
# A cell whose six answer words get less than this share of the next-word probability on average is
# flagged: the model would more likely write something else, and P(true) describes the minority of
# what it would say (the same bar as `tomlens.behaviour.aggregates`' option mass).
LOW_MASS = 0.5
EXACT_BELOW = 25  # McNemar: the exact binomial where fewer pairs than this differ (SPSS; paper footnote 5)
# Street et al. (seeds-notes.md 2.3): humans, GPT-4 and Flan-PaLM, % correct, on their own 7 stories.
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
# Street et al.'s items are their 7 stories, never these generated ones: each column says so.
PAPER_COLUMNS: dict[str, str] = {
    "paper_other_items_humans": "paper, other items and subjects: humans",
    "paper_other_items_gpt4": "paper, other items and model: GPT-4",
    "paper_other_items_flan_palm": "paper, other items and model: Flan-PaLM",
}
_PAPER_KEYS = dict(zip(PAPER_COLUMNS, ("humans", "gpt4", "flan_palm"), strict=True))
SUMMARY_COLUMNS: tuple[str, ...] = (
    "metric", "stmt_type", "order_or_level", "versus", "n", "n_tasks", "value", "ci_low", "ci_high",
    "baseline", "test", "statistic", "p_value", "mean_option_mass", *PAPER_COLUMNS, "scoring", "flag",
)


# ---- tests as Street et al. ran them --------------------------------------------------------------


@dataclass(frozen=True)
class TestResult:
    """One significance test: `statistic` is None for an exact test (SPSS prints no chi-square
    there either); `n` counts pairs or blocks, `discordant` those that differ."""

    __test__ = False  # not a pytest class

    test: str
    statistic: float | None
    df: int | None
    p_value: float
    n: int
    discordant: int


def _booleans(x: Any, name: str) -> np.ndarray:
    arr = np.asarray(x)
    if arr.dtype != bool and not np.isin(arr, (0, 1)).all():
        raise TomlensError(f"{name} must be right/wrong (booleans or 0/1)", "pass one boolean per statement")
    return arr.astype(bool)


Bools: TypeAlias = Sequence[bool] | np.ndarray | pd.Series  # one right/wrong per statement


def mcnemar(a: Bools, b: Bools) -> TestResult:
    """McNemar's test of two related right/wrong series (the same statements answered twice).

    As SPSS runs it (and so Street et al.): with fewer than `EXACT_BELOW` discordant pairs, the
    exact two-sided binomial test of the discordant split against 1/2; else the continuity-
    corrected chi-square (|b - c| - 1)^2 / (b + c) on 1 df."""
    x, y = _booleans(a, "a"), _booleans(b, "b")
    if x.shape != y.shape or x.ndim != 1:
        raise TomlensError(f"McNemar needs two series of one length, got {x.shape} and {y.shape}",
                           "pair the same statements in both")
    only_a, only_b = int((x & ~y).sum()), int((~x & y).sum())
    d = only_a + only_b
    if d < EXACT_BELOW:
        p = float(stats.binomtest(only_a, d, 0.5).pvalue) if d else 1.0
        return TestResult("McNemar (exact binomial)", None, None, p, len(x), d)
    chi2 = (abs(only_a - only_b) - 1) ** 2 / d
    return TestResult("McNemar (chi-square, continuity-corrected)", float(chi2), 1,
                      float(stats.chi2.sf(chi2, 1)), len(x), d)


def cochran_q(blocks: Any) -> TestResult:
    """Cochran's Q of k related right/wrong samples: `blocks` is (n blocks) x (k samples), one
    row per block (a statement answered by every subject, or a story's statements at every
    order). Q = (k - 1) (k sum_j C_j^2 - N^2) / (k N - sum_i R_i^2) on k - 1 df (C: column sums,
    R: row sums, N: all); blocks with all right or all wrong carry no information."""
    x = np.asarray(blocks)
    if x.ndim != 2 or x.shape[1] < 2:
        raise TomlensError(f"Cochran's Q needs blocks x samples with 2+ samples, got shape {x.shape}",
                           "pass one row per block and one column per sample")
    x = _booleans(x, "blocks").astype(float)
    k = x.shape[1]
    cols, rows = x.sum(0), x.sum(1)
    total = float(x.sum())
    denom = k * total - float((rows ** 2).sum())
    informative = int(((rows > 0) & (rows < k)).sum())
    if denom == 0:
        return TestResult("Cochran's Q", 0.0, k - 1, 1.0, len(x), informative)
    q = (k - 1) * (k * float((cols ** 2).sum()) - total ** 2) / denom
    return TestResult("Cochran's Q", float(q), k - 1, float(stats.chi2.sf(q, k - 1)), len(x), informative)


def binomial_vs_chance(k: int, n: int) -> float:
    """The exact two-sided binomial test of k right of n against 1/2 (the paper's test of chance)."""
    return float(stats.binomtest(k, n, 0.5).pvalue) if n else float("nan")


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


@dataclass(frozen=True)
class SubjectTests:
    """Street et al.'s comparison of subjects on the same statements: Cochran's Q over all of
    them, then McNemar for each pair (`pairs`: (subject a, subject b, % right a, % right b, test))."""

    subjects: tuple[str, ...]
    n_statements: int
    overall: TestResult
    pairs: tuple[tuple[str, str, float, float, TestResult], ...]

    def table(self) -> pd.DataFrame:
        rows = [{"a": "all", "b": "", "pct_a": None, "pct_b": None, **self.overall.__dict__}]
        rows += [{"a": a, "b": b, "pct_a": pa, "pct_b": pb, **t.__dict__} for a, b, pa, pb, t in self.pairs]
        return pd.DataFrame(rows)


def subject_tests(tables: Mapping[str, pd.DataFrame], stmt_type: str | None = "tom") -> SubjectTests:
    """Cochran's Q across subjects and McNemar for each pair, on the statements every table has
    (matched on `id`), as the paper compares models and humans. `tables` maps a subject's name to
    its behaviour table (pooled or two-option scoring, `answered_true`); `stmt_type` keeps "tom"
    or "fact" statements (None: both)."""
    if len(tables) < 2:
        raise TomlensError(f"{len(tables)} subject(s) to compare", "pass the tables of two or more models")
    right: dict[str, pd.Series] = {}
    for name, df in tables.items():
        d = df if stmt_type is None else df[df["stmt_type"] == stmt_type]
        said, _ = answered_true(d)
        right[name] = pd.Series((said == (d["answer"] == "true")).to_numpy(), index=d["id"].astype(str))
    common = sorted(set.intersection(*(set(r.index) for r in right.values())))
    if not common:
        raise TomlensError("the tables share no statement id", "score the same stimuli with every model")
    matrix = np.column_stack([right[n].loc[common].to_numpy() for n in tables])
    names = tuple(tables)
    pairs = tuple((a, b, 100 * float(right[a].loc[common].mean()), 100 * float(right[b].loc[common].mean()),
                   mcnemar(right[a].loc[common], right[b].loc[common])) for a, b in combinations(names, 2))
    return SubjectTests(names, len(common), cochran_q(matrix), pairs)


# ---- scoring ---------------------------------------------------------------------------------------


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
    over them, the pooled answer and whether it is right, and `option_mass_pooled`, the probability
    of the six continuations together (how much of what the model would write is an answer at
    all). Three forward pairs per prompt ((True, False), (true, false), (TRUE, FALSE)), through
    `score_options`."""
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
                     "correct_pooled": (p > 0.5) == (s.answer == "true"),
                     "option_mass_pooled": float(sum(math.exp(x) for x in logps.values()))})
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


def _option_mass(df: pd.DataFrame) -> pd.Series | None:
    """Per row, the probability the answer words got: the six case variants where pooled, else the
    two options' whole continuations; None for a table scored before option mass was recorded."""
    for col in ("option_mass_pooled", "option_mass"):
        if col in df and df[col].notna().any():
            return df[col].astype(float)
    return None


# ---- the summary ------------------------------------------------------------------------------------


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


def _shortcut_answers(df: pd.DataFrame) -> dict[str, pd.Series]:
    """Per shortcut the generator recorded (`<shortcut>_true` columns; the world's also from
    `world_state`), its answer ("true" = True) on each row, missing where it does not apply."""
    out = {}
    for k in SHORTCUTS:
        col = f"{k}_true"
        if col in df and df[col].notna().any():
            out[k] = df[col]
        elif k == "world" and "world_state" in df and df["world_state"].notna().any():
            out[k] = df["world_state"].map({"true": True, "false": False})
    return out


def _blocks(df: pd.DataFrame, correct: pd.Series, levels: Sequence[int]) -> pd.DataFrame:
    """Right/wrong per block (a story, prompt condition and truth value) x order or level, blocks
    with a statement at every one of `levels` only."""
    keys = [c for c in ("task_id", "condition", "answer") if c in df]
    if len(keys) < 3:
        return pd.DataFrame()
    d = df[keys].assign(_level=df["order_or_level"].astype(int), _right=correct.astype(bool))
    d = d[d["_level"].isin(levels)]
    wide = d.pivot_table(index=keys, columns="_level", values="_right", aggfunc="first")
    return wide.dropna().astype(bool)


def summary(df: pd.DataFrame, *, n_boot: int = 1000) -> pd.DataFrame:
    """One row per cell Street et al. report, and what a cell is above: ToM accuracy per order
    and overall, factual accuracy per level and overall, each shortcut's accuracy per order
    (`baseline_<shortcut>`) and the model's accuracy above it (`above_<shortcut>`), Cochran's Q
    across orders and across levels, McNemar for each order against the next and for ToM order n
    against factual level n, the ToM-minus-factual gap (the paper's z-test), the anchoring index,
    and the share of "true" answers with the always-true flag. Values are percentages (points for
    differences); `paper_other_items_*` hold Street et al.'s numbers for their own stories."""
    need = ("stmt_type", "order_or_level", "options_order", "answer")
    missing = [c for c in need if c not in df]
    if missing:
        raise TomlensError(f"the behaviour table has no {missing} column(s)",
                           "score motomqa stimuli with run_behaviour (it copies their meta)")
    df = df[df["stmt_type"].isin(("tom", "fact"))]
    if df.empty:
        return pd.DataFrame(columns=SUMMARY_COLUMNS)
    scored = _Scored.of(df, n_boot)
    rows = [*_accuracy_rows(scored), *_shortcut_rows(scored), *_level_rows(scored), *_gap_rows(scored),
            *_anchoring_rows(scored), _share_true_row(scored)]
    out = pd.DataFrame(rows)
    for col in SUMMARY_COLUMNS:
        if col not in out:
            out[col] = None
    out["scoring"] = scored.scoring
    out["flag"] = out["flag"].fillna("")
    out["order_or_level"] = out["order_or_level"].astype("Int64")
    return out[list(SUMMARY_COLUMNS)]


@dataclass(frozen=True)
class _Scored:
    """A motomqa behaviour table (ToM and factual rows) with what every summary cell reads: the
    model's "true" answers and how they were scored, which answers are right, each row's task (the
    bootstrap's unit), the answer words' probability (None: not recorded) and the order or level."""

    df: pd.DataFrame
    said_true: pd.Series
    scoring: str
    correct: pd.Series
    tasks: pd.Series
    mass: pd.Series | None
    level_of: pd.Series
    n_boot: int

    @classmethod
    def of(cls, df: pd.DataFrame, n_boot: int) -> _Scored:
        said_true, scoring = answered_true(df)
        tasks = df["task_id"].astype(str) if "task_id" in df else df["id"].astype(str)
        return cls(df, said_true, scoring, said_true == (df["answer"] == "true"), tasks, _option_mass(df),
                   df["order_or_level"].astype(int), n_boot)

    def cell(self, metric: str, mask: pd.Series, stmt_type: str, level: int | None) -> dict[str, Any]:
        """The columns every cell starts with: what it is and how many rows and tasks it counts."""
        return {"metric": metric, "stmt_type": stmt_type, "order_or_level": level,
                "n": int(mask.sum()), "n_tasks": int(self.tasks[mask].nunique())}


def _paper(cell: dict[str, float] | None) -> dict[str, float | None]:
    cell = cell or {}
    return {col: cell.get(key) for col, key in _PAPER_KEYS.items()}


def _test_cols(t: TestResult) -> dict[str, Any]:
    return {"test": t.test, "statistic": t.statistic, "p_value": t.p_value}


def _accuracy_rows(s: _Scored) -> list[dict[str, Any]]:
    """Accuracy per ToM order and factual level, and overall per type (with the exact binomial test
    against 50%), each flagged where the answer words get little of the probability."""
    rows = []
    for stmt_type in ("tom", "fact"):
        of_type = s.df["stmt_type"] == stmt_type
        if not of_type.any():
            continue
        for level in sorted(s.level_of[of_type].unique()):
            rows.append(_accuracy_row(s, "accuracy", of_type & (s.level_of == level), stmt_type, int(level),
                                      PAPER_TOM_BY_ORDER.get(int(level)) if stmt_type == "tom" else None))
        rows.append(_accuracy_row(s, "accuracy_overall", of_type, stmt_type, None, PAPER_OVERALL[stmt_type]))
    return rows


def _accuracy_row(s: _Scored, metric: str, mask: pd.Series, stmt_type: str, level: int | None,
                  ref: dict[str, float] | None) -> dict[str, Any]:
    correct = s.correct
    lo, hi = _boot_ratio(correct[mask], s.tasks[mask], (metric, stmt_type, level), s.n_boot)
    row = {**s.cell(metric, mask, stmt_type, level), "value": 100 * float(correct[mask].mean()),
           "ci_low": 100 * lo, "ci_high": 100 * hi, **_paper(ref)}
    if metric == "accuracy_overall":
        row.update(test="exact binomial vs 50%",
                   p_value=binomial_vs_chance(int(correct[mask].sum()), int(mask.sum())))
    if s.mass is not None and s.mass[mask].notna().any():
        row["mean_option_mass"] = float(s.mass[mask].mean())
        if row["mean_option_mass"] < LOW_MASS:
            row["flag"] = (f"the answer words get {row['mean_option_mass']:.2f} of the probability: "
                           "the model would mostly say something else")
    return row


def _shortcut_rows(s: _Scored) -> list[dict[str, Any]]:
    """Per shortcut and ToM order: what the shortcut scores, and the model above it (McNemar)."""
    df, correct, tasks = s.df, s.correct, s.tasks
    tom = df["stmt_type"] == "tom"
    rows = []
    for name, answers in _shortcut_answers(df).items():
        has = tom & answers.notna()
        agree = answers.where(has, False).astype(bool) == (df["answer"] == "true")
        for level in sorted(s.level_of[has].unique()):
            mask = has & (s.level_of == level)
            acc, shortcut = 100 * float(correct[mask].mean()), 100 * float(agree[mask].mean())
            lo, hi = _boot_ratio(agree[mask], tasks[mask], (name, level), s.n_boot)
            rows.append({**s.cell(f"baseline_{name}", mask, "tom", int(level)), "value": shortcut,
                         "ci_low": 100 * lo, "ci_high": 100 * hi})
            lo, hi = _boot_difference(correct[mask], tasks[mask], agree[mask], tasks[mask],
                                      ("above", name, level), s.n_boot)
            rows.append({**s.cell(f"above_{name}", mask, "tom", int(level)), "versus": f"shortcut {name}",
                         "value": acc - shortcut, "ci_low": 100 * lo, "ci_high": 100 * hi,
                         "baseline": shortcut, **_test_cols(mcnemar(correct[mask], agree[mask]))})
    return rows


def _level_rows(s: _Scored) -> list[dict[str, Any]]:
    """Per type, on the related samples (the same story and condition at every order or level):
    Cochran's Q across them, and each order (level) against the one below (McNemar)."""
    rows = []
    for stmt_type in ("tom", "fact"):
        mask = s.df["stmt_type"] == stmt_type
        levels = sorted(int(x) for x in s.level_of[mask].unique())
        if len(levels) < 2:
            continue
        wide = _blocks(s.df[mask], s.correct[mask], levels)
        if len(wide) < 2:
            continue
        word = "orders" if stmt_type == "tom" else "levels"
        rows.append({"metric": "cochran_q", "stmt_type": stmt_type, "order_or_level": None,
                     "versus": f"{word} {', '.join(map(str, levels))}", "n": len(wide) * len(levels),
                     "n_tasks": int(wide.index.get_level_values(0).nunique()),
                     **_test_cols(cochran_q(wide[levels].to_numpy()))})
        block_tasks = pd.Series(wide.index.get_level_values(0).astype(str))
        for lo_level, hi_level in zip(levels, levels[1:], strict=False):
            a, b = pd.Series(wide[hi_level].to_numpy()), pd.Series(wide[lo_level].to_numpy())
            lo, hi = _boot_difference(a, block_tasks, b, block_tasks, ("step", stmt_type, hi_level), s.n_boot)
            rows.append({"metric": "level_step", "stmt_type": stmt_type, "order_or_level": hi_level,
                         "versus": f"{word[:-1]} {lo_level}", "n": 2 * len(wide),
                         "n_tasks": int(block_tasks.nunique()), "value": 100 * float(a.mean() - b.mean()),
                         "ci_low": 100 * lo, "ci_high": 100 * hi, **_test_cols(mcnemar(a, b))})
    return rows


def _gap_rows(s: _Scored) -> list[dict[str, Any]]:
    """ToM minus factual accuracy (the paper's two-proportion z-test), then the paired comparisons
    of ToM order n with factual level n; none unless the table has both types."""
    df, correct, tasks = s.df, s.correct, s.tasks
    tom, fact = df["stmt_type"] == "tom", df["stmt_type"] == "fact"
    if not (tom.any() and fact.any()):
        return []
    lo, hi = _boot_difference(correct[tom], tasks[tom], correct[fact], tasks[fact], "gap", s.n_boot)
    z, p = two_proportion_z(int(correct[tom].sum()), int(tom.sum()), int(correct[fact].sum()), int(fact.sum()))
    return [{"metric": "tom_minus_fact", "stmt_type": "both", "order_or_level": None,
             "versus": "factual", "n": len(df), "n_tasks": int(tasks.nunique()),
             "value": 100 * (float(correct[tom].mean()) - float(correct[fact].mean())),
             "ci_low": 100 * lo, "ci_high": 100 * hi, "test": "two-proportion z",
             "statistic": z, "p_value": p, **_paper(PAPER_OVERALL["gap"])},
            *_paired_tom_fact(df, correct, s.n_boot)]


def _anchoring_rows(s: _Scored) -> list[dict[str, Any]]:
    """The anchoring index: the share of "true" answers with "true" offered first minus with it
    second; none unless the table has both option orders."""
    df, said_true, tasks = s.df, s.said_true, s.tasks
    tf, ff = df["options_order"] == "true-first", df["options_order"] == "false-first"
    if not (tf.any() and ff.any()):
        return []
    lo, hi = _boot_difference(said_true[tf], tasks[tf], said_true[ff], tasks[ff], "anchoring", s.n_boot)
    z, p = two_proportion_z(int(said_true[tf].sum()), int(tf.sum()), int(said_true[ff].sum()), int(ff.sum()))
    return [{"metric": "anchoring_index", "stmt_type": "both", "order_or_level": None,
             "versus": "false-first", "n": len(df), "n_tasks": int(tasks.nunique()),
             "value": 100 * (float(said_true[tf].mean()) - float(said_true[ff].mean())),
             "ci_low": 100 * lo, "ci_high": 100 * hi, "test": "two-proportion z",
             "statistic": z, "p_value": p, **_paper(PAPER_OVERALL["anchoring"])}]


def _share_true_row(s: _Scored) -> dict[str, Any]:
    """The share of "true" answers, flagged when the model gives one answer throughout."""
    share = float(s.said_true.mean())
    lo, hi = _boot_ratio(s.said_true, s.tasks, "share_true", s.n_boot)
    truth_share = float((s.df["answer"] == "true").mean())
    return {"metric": "share_true", "stmt_type": "both", "order_or_level": None, "n": len(s.df),
            "n_tasks": int(s.tasks.nunique()), "value": 100 * share, "ci_low": 100 * lo, "ci_high": 100 * hi,
            "flag": _one_answer_flag(share, truth_share)}


def _paired_tom_fact(df: pd.DataFrame, correct: pd.Series, n_boot: int) -> list[dict[str, Any]]:
    """ToM order n against factual level n on the same story, condition and truth value
    (McNemar), per n and over all n: the paired version of the paper's ToM-vs-factual test."""
    keys = [c for c in ("task_id", "condition", "answer") if c in df]
    if len(keys) < 3:
        return []
    d = df[keys].assign(_n=df["order_or_level"].astype(int), _right=correct.astype(bool),
                        _type=df["stmt_type"])
    m = d[d["_type"] == "tom"].merge(d[d["_type"] == "fact"], on=[*keys, "_n"], suffixes=("_tom", "_fact"))
    if m.empty:
        return []
    rows = []
    for n in [None, *sorted(m["_n"].unique())]:
        g = m if n is None else m[m["_n"] == n]
        a, b = g["_right_tom"].reset_index(drop=True), g["_right_fact"].reset_index(drop=True)
        t = g["task_id"].astype(str).reset_index(drop=True)
        lo, hi = _boot_difference(a, t, b, t, ("paired gap", n), n_boot)
        test = mcnemar(a, b)
        rows.append({"metric": "tom_minus_fact_paired", "stmt_type": "both",
                     "order_or_level": None if n is None else int(n), "versus": "factual, same level",
                     "n": 2 * len(g), "n_tasks": int(t.nunique()), "value": 100 * float(a.mean() - b.mean()),
                     "ci_low": 100 * lo, "ci_high": 100 * hi, "test": test.test,
                     "statistic": test.statistic, "p_value": test.p_value})
    return rows
