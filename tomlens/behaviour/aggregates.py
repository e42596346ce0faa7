"""The papers' aggregate rules over a per-prompt behaviour table (see `behaviour.score`).

- accuracy per family x condition x prompt type with Wilson 95% intervals;
- Kosinski's strict rule: a task counts only when every one of its prompts is right;
- Ruis et al.'s object bias o_b = p(obj) / (p(obj) + p(loc)) per cell and their
  selective-encoding criterion (animate differs from inanimate and control, which agree);
- probability curves over sentence prefixes (Kosinski's Figures 1-2).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
import pandas as pd

Z95 = 1.959963984540054


def wilson_interval(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion (well-behaved at 0 and 1, unlike Wald)."""
    if n == 0:
        return (float("nan"), float("nan"))
    p = k / n
    denom = 1 + z**2 / n
    centre = (p + z**2 / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z**2 / (4 * n**2)) / denom
    return (max(0.0, centre - half), min(1.0, centre + half))


def accuracy_table(df: pd.DataFrame, by: tuple[str, ...] = ("family", "condition", "prompt_type"),
                   column: str = "correct") -> pd.DataFrame:
    """Accuracy with a 95% interval per group."""
    rows = []
    for key, g in df.groupby(list(by), sort=True, dropna=False):
        key = key if isinstance(key, tuple) else (key,)
        k, n = int(g[column].sum()), len(g)
        lo, hi = wilson_interval(k, n)
        rows.append({**dict(zip(by, key)), "n": n, "accuracy": k / n, "ci_low": lo, "ci_high": hi,
                     "mean_p_answer": float(g["p_answer"].mean())})
    return pd.DataFrame(rows)


def strict_task_pass(df: pd.DataFrame, column: str = "correct") -> pd.DataFrame:
    """Kosinski's rule per family: a task is solved only when all its prompts are right.

    Chance is 0.5 ** (prompts per task): 1/65,536 for the 16-prompt false-belief tasks.
    """
    rows = []
    for family, g in df.groupby("family", sort=True):
        per_task = g.groupby("task_id")[column].agg(["all", "size"])
        k, n = int(per_task["all"].sum()), len(per_task)
        lo, hi = wilson_interval(k, n)
        prompts = int(per_task["size"].median())
        rows.append({"family": family, "tasks": n, "solved": k, "fraction_solved": k / n,
                     "ci_low": lo, "ci_high": hi, "prompts_per_task": prompts,
                     "chance": 0.5**prompts})
    return pd.DataFrame(rows)


def object_bias(df: pd.DataFrame) -> pd.Series:
    """Per-prompt o_b = p(object-bias target) / (p(obj) + p(location-bias target))."""
    obj_is_a = df["option_a"] == df["object_target"]
    return pd.Series(np.where(obj_is_a, df["p_a"], 1 - df["p_a"]), index=df.index, name="o_b")


GOAL_CELL = ("target_type", "anim_denotation", "k", "test_case")


def object_bias_table(df: pd.DataFrame, *, n_boot: int = 1000, seed: int = 0) -> pd.DataFrame:
    """Mean o_b per cell (target type x animacy wording x k x test case), sd and bootstrap 95% CI."""
    goal = df[df["prompt_type"] == "goal"].copy()
    goal["o_b"] = object_bias(goal)
    rng = np.random.default_rng(seed)
    rows = []
    for key, g in goal.groupby(list(GOAL_CELL), sort=True):
        v = g["o_b"].to_numpy()
        boots = rng.choice(v, size=(n_boot, len(v)), replace=True).mean(axis=1)
        rows.append({**dict(zip(GOAL_CELL, key)), "n": len(v), "o_b": float(v.mean()),
                     "sd": float(v.std(ddof=1)) if len(v) > 1 else 0.0,
                     "ci_low": float(np.quantile(boots, 0.025)),
                     "ci_high": float(np.quantile(boots, 0.975))})
    return pd.DataFrame(rows)


@dataclass(frozen=True)
class SelectiveEncoding:
    """Ruis et al.'s criterion for one (target type, animacy wording, k) group."""

    target_type: str
    anim_denotation: bool
    k: int
    o_animate: float
    o_inanimate: float
    o_control: float
    animate_vs_inanimate: tuple[float, float]
    animate_vs_control: tuple[float, float]
    inanimate_vs_control: tuple[float, float]
    passes: bool


def _paired_diff_ci(a: np.ndarray, b: np.ndarray, rng: np.random.Generator, n_boot: int) -> tuple[float, float]:
    """95% bootstrap interval of mean(a - b), resampling items (a[i] and b[i] are the same item)."""
    idx = rng.integers(0, len(a), (n_boot, len(a)))
    boots = (a[idx] - b[idx]).mean(1)
    return (float(np.quantile(boots, 0.025)), float(np.quantile(boots, 0.975)))


def _by_item(g: pd.DataFrame) -> pd.DataFrame:
    """o_b per item (row) and test case (column); items missing a case are dropped. Without
    `task_id` (a table not made by tomlens) rows are paired by their order within each case."""
    g = g.copy()
    if "task_id" in g:
        g["item"] = g["task_id"].astype(str)  # o_b is orientation-free: both option orders average
    else:
        g["item"] = g.groupby("test_case").cumcount()
    return g.pivot_table(index="item", columns="test_case", values="o_b", aggfunc="mean").dropna()


def selective_encoding(df: pd.DataFrame, *, margin: float = 0.1, n_boot: int = 1000,
                       seed: int = 0) -> pd.DataFrame:
    """Ruis et al.'s criterion per target type x animacy wording x k: the animate agent shows *more*
    object bias than both the inanimate agent and the accidental control (paired bootstrap 95%
    interval of each difference above 0, resampling items), while inanimate and control stay within
    `margin` of each other. The direction matters: an animate agent with *less* object bias
    (leaning to the location) is not goal encoding."""
    goal = df[df["prompt_type"] == "goal"].copy()
    goal["o_b"] = object_bias(goal)
    rng = np.random.default_rng(seed)
    out = []
    for (tt, anim, k), g in goal.groupby(["target_type", "anim_denotation", "k"], sort=True):
        wide = _by_item(g)
        if any(c not in wide for c in ("animate", "inanimate", "control")) or len(wide) < 2:
            continue
        v = {c: wide[c].to_numpy() for c in ("animate", "inanimate", "control")}
        m = {c: float(x.mean()) for c, x in v.items()}
        ai = _paired_diff_ci(v["animate"], v["inanimate"], rng, n_boot)
        ac = _paired_diff_ci(v["animate"], v["control"], rng, n_boot)
        ic = _paired_diff_ci(v["inanimate"], v["control"], rng, n_boot)
        passes = ai[0] > 0 and ac[0] > 0 and abs(m["inanimate"] - m["control"]) < margin
        out.append(asdict(SelectiveEncoding(tt, bool(anim), int(k), m["animate"], m["inanimate"],
                                            m["control"], ai, ac, ic, bool(passes))))
    return pd.DataFrame(out)


def prefix_curves(df: pd.DataFrame) -> pd.DataFrame:
    """Mean probability of the reference answer (starting location / label word) and of the
    correct answer at each sentence prefix, per family, story family (transfer and contents
    stories kept apart), condition and prompt type."""
    tr = df[df["prefix_index"].notna()].copy() if "prefix_index" in df else df.iloc[0:0].copy()
    keys = ["family", "story_family", "condition", "prompt_type", "prefix_index"]
    if tr.empty:
        return pd.DataFrame(columns=keys + ["p_reference", "p_answer", "n"])
    if "story_family" not in tr:
        tr["story_family"] = tr["family"]
    tr["story_family"] = tr["story_family"].fillna(tr["family"])
    ref_is_a = tr["option_a"] == tr["reference_state"]
    tr["p_reference"] = np.where(ref_is_a, tr["p_a"], 1 - tr["p_a"])
    g = tr.groupby(keys, sort=True)
    return g.agg(p_reference=("p_reference", "mean"), p_answer=("p_answer", "mean"),
                 n=("id", "size")).reset_index()
