"""The papers' aggregate rules over a per-prompt behaviour table (see `behaviour.score`).

The unit of replication is the task (one story frame with its names, objects and places): the
prompts of a task share nearly all their words, so they are not independent draws, and an interval
that counts them as such is too narrow by up to the square root of the prompts per task. Every
interval over prompts here is therefore a bootstrap that resamples whole tasks (`task_id`).

- accuracy per family x condition x prompt type, with a task-bootstrap 95% interval and n_tasks;
- belief accuracy gated on the reality prompt of the same story (Kosinski; Kosoy et al.);
- the paired false- vs true-belief log-odds effect (Jones, Trott & Bergen's knowledge-state effect),
  only where belief answers are states or places, with label controls kept apart;
- Kosinski's strict rule: a task counts only when every one of its prompts is right (tasks are
  independent units, so a Wilson interval over tasks is the right one there);
- Ruis et al.'s object bias o_b = p(obj) / (p(obj) + p(loc)) per cell with the unclassified share
  (the probability on neither target, which o_b leaves out), a k = 0 check (with no habituation
  nothing marks a goal, so o_b should sit near 0.5) and their selective-encoding criterion
  (animate *distinct* from inanimate and from control, two-sided as the paper asks, with the
  direction reported; inanimate and control equivalent by a TOST equivalence test);
- probability curves over sentence prefixes (Kosinski's Figures 1-2).

Every table here also says how much of the model's probability its cell's options got
(`mean_option_mass_first`, `mean_option_mass`; `tomlens.behaviour.scoring`) and flags a cell whose
options get less than `min_mass` of the next-word probability (`low_option_mass`): there a two-way
score describes a choice the model would mostly not make.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import asdict, dataclass

import numpy as np
import pandas as pd
from scipy import stats

from tomlens.errors import TomlensError

Z95 = 1.959963984540054
# Factors that identify one version of a task besides its condition (Jones et al.'s factorial):
# a false-belief story is paired with the true-belief story that agrees on all of them.
PAIR_FACTORS: tuple[str, ...] = ("first_mention", "recent_mention", "knowledge_cue")
FALSE_BELIEF = "false_belief"
# How a strict-rule row was scored (`strict_task_pass`'s `scoring` column).
TWO_WAY = "two-way log-prob"


# A cell is flagged when its options get less than this share of the next-word probability on
# average. Why one half: below it the model is more likely to write something other than either
# option than to write one of them, so "neither" is its likeliest answer and p(a) / (p(a) + p(b))
# describes the minority of what it would say. The value is a parameter (`min_mass`, the behaviour
# run's `min_option_mass`, `tomlens behave --min-option-mass`): a study of base models on
# completion prompts may want a lower bar, one of instruction-tuned models a higher one.
MIN_OPTION_MASS = 0.5
MASS_COLUMNS: tuple[str, ...] = ("mean_option_mass_first", "mean_option_mass", "low_option_mass")


def check_min_mass(min_mass: float) -> float:
    """`min_mass` as a float, or a TomlensError when it is no share of probability."""
    if not 0 <= float(min_mass) <= 1:
        raise TomlensError(f"min_mass = {min_mass} is not a share of probability",
                           f"use a value from 0 to 1, e.g. {MIN_OPTION_MASS}")
    return float(min_mass)


def option_mass_columns(g: pd.DataFrame, min_mass: float = MIN_OPTION_MASS) -> dict[str, float | bool]:
    """A cell's mean option mass (first token and whole continuation) and whether its options get
    less than `min_mass` of the next-word probability; a table scored before option mass was
    recorded has no mass (nan) and no flag."""
    first = g["option_mass_first"].astype(float) if "option_mass_first" in g else pd.Series(dtype=float)
    whole = g["option_mass"].astype(float) if "option_mass" in g else pd.Series(dtype=float)
    mean_first = float(first.mean()) if first.notna().any() else float("nan")
    mean_whole = float(whole.mean()) if whole.notna().any() else float("nan")
    return {"mean_option_mass_first": mean_first, "mean_option_mass": mean_whole,
            "low_option_mass": bool(mean_first < check_min_mass(min_mass))}


def wilson_interval(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion (well-behaved at 0 and 1, unlike Wald)."""
    if n == 0:
        return (float("nan"), float("nan"))
    p = k / n
    denom = 1 + z**2 / n
    centre = (p + z**2 / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z**2 / (4 * n**2)) / denom
    return (max(0.0, centre - half), min(1.0, centre + half))


def _cell_rng(seed: int, key: object) -> np.random.Generator:
    """A generator per table cell, so a cell's interval does not depend on which others exist."""
    return np.random.default_rng([int(seed), zlib.crc32(repr(key).encode())])


def task_bootstrap(total: np.ndarray, count: np.ndarray, *, n_boot: int = 1000,
                   rng: np.random.Generator | None = None, level: float = 0.95) -> tuple[float, float]:
    """Percentile interval of sum(total) / sum(count) with whole tasks resampled.

    `total[t]` and `count[t]` are task t's sum of the measure and its number of rows, so rows of
    one task move together: duplicating a task's rows leaves the interval unchanged. Fewer than two
    tasks give no interval (nan, nan).
    """
    total, count = np.asarray(total, float), np.asarray(count, float)
    if n_boot < 1:
        raise TomlensError(f"n_boot = {n_boot} must be at least 1", "use e.g. n_boot = 1000")
    if len(total) < 2:
        return (float("nan"), float("nan"))
    rng = rng if rng is not None else np.random.default_rng(0)
    idx = rng.integers(0, len(total), (n_boot, len(total)))
    boots = total[idx].sum(1) / count[idx].sum(1)
    a = (1 - level) / 2
    return (float(np.quantile(boots, a)), float(np.quantile(boots, 1 - a)))


def task_of(df: pd.DataFrame) -> pd.Series:
    """The resampling unit of each row: its `task_id`; a row without one is its own unit."""
    ids = df["id"].astype(str) if "id" in df else pd.Series(df.index.astype(str), index=df.index)
    if "task_id" not in df:
        return ids
    task = df["task_id"]
    missing = task.isna() | (task.astype(str) == "")
    return task.astype(str).where(~missing, "row:" + ids)


def per_task(values: pd.Series, tasks: pd.Series) -> tuple[np.ndarray, np.ndarray]:
    """Sum and count of `values` per task (sorted by task): the inputs of `task_bootstrap`."""
    g = values.astype(float).groupby(tasks.to_numpy(), sort=True)
    return g.sum().to_numpy(), g.size().to_numpy().astype(float)


def accuracy_table(df: pd.DataFrame, by: tuple[str, ...] = ("family", "condition", "prompt_type"),
                   column: str = "correct", *, n_boot: int = 1000, seed: int = 0,
                   min_mass: float = MIN_OPTION_MASS) -> pd.DataFrame:
    """Accuracy per group with a 95% interval from a bootstrap over tasks (whole tasks resampled),
    and the group's option mass (`option_mass_columns`).

    No Wilson interval here: the prompts of a task are not independent, so a binomial interval
    over prompts would be too narrow. `n` counts prompts, `n_tasks` the resampled units (a row
    without a `task_id` is its own unit); a group from one task has no interval (nan).
    """
    cols = [*by, "n", "n_tasks", "accuracy", "ci_low", "ci_high", "mean_p_answer", *MASS_COLUMNS]
    if df.empty:
        return pd.DataFrame(columns=cols)
    tasks = task_of(df)
    rows = []
    for key, g in df.groupby(list(by), sort=True, dropna=False):
        key = key if isinstance(key, tuple) else (key,)
        total, count = per_task(g[column], tasks.loc[g.index])
        lo, hi = task_bootstrap(total, count, n_boot=n_boot, rng=_cell_rng(seed, key))
        rows.append({**dict(zip(by, key, strict=True)), "n": len(g), "n_tasks": len(total),
                     "accuracy": float(g[column].astype(float).mean()), "ci_low": lo, "ci_high": hi,
                     "mean_p_answer": float(g["p_answer"].mean()), **option_mass_columns(g, min_mass)})
    return pd.DataFrame(rows, columns=cols)


def _unprefixed(df: pd.DataFrame) -> pd.DataFrame:
    """Whole-story prompts: sentence-prefix rows (belief tracking) are curves, not trials."""
    return df[df["prefix_index"].isna()] if "prefix_index" in df else df


def _story_keys(df: pd.DataFrame) -> pd.Series:
    """One key per story: the `story_id` the scorer writes (the text before the question, which the
    reality and belief prompts of a story share), else family x task x condition x version."""
    parts = [df[c].astype(str) for c in ("family", "task_id", "condition", "reversed") if c in df]
    fallback = pd.Series(["|".join(x) for x in zip(*parts, strict=True)], index=df.index, dtype=object)
    if "story_id" not in df:
        return fallback
    sid = df["story_id"]
    return ("story:" + sid.astype(str)).where(sid.notna() & (sid.astype(str) != ""), fallback)


def reality_gated_accuracy(df: pd.DataFrame, *, by: tuple[str, ...] = ("family", "condition"),
                           n_boot: int = 1000, seed: int = 0, min_mass: float = MIN_OPTION_MASS) -> pd.DataFrame:
    """Belief accuracy counted only on stories whose reality prompt the model answers right.

    A belief prompt is kept when every reality prompt of its story is right and dropped when one
    is wrong; one without a reality prompt in its story cannot be gated (`n_unmatched`, left out).
    `accuracy` is belief accuracy on the kept prompts; `joint_accuracy` scores a dropped prompt as
    wrong (Kosoy et al.: failing the control scores 0); `ungated_accuracy` is the plain rate on the
    same matched prompts. Intervals resample whole tasks. Pass `by=("family", "task_id",
    "condition")` for one row per task and condition. The option mass is the matched belief prompts'.
    """
    cols = [*by, "n_belief", "n_kept", "n_dropped", "n_unmatched", "n_tasks", "accuracy", "ci_low",
            "ci_high", "joint_accuracy", "joint_ci_low", "joint_ci_high", "ungated_accuracy", *MASS_COLUMNS]
    d = _unprefixed(df)
    d = d[d["prompt_type"].isin(["reality", "belief"])]
    if d.empty:
        return pd.DataFrame(columns=cols)
    d = d.assign(_story=_story_keys(d), _task=task_of(d))
    reality_ok = d[d["prompt_type"] == "reality"].groupby("_story")["correct"].agg(
        lambda x: bool(np.all(x.astype(bool))))
    belief = d[d["prompt_type"] == "belief"].copy()
    if belief.empty or reality_ok.empty:
        return pd.DataFrame(columns=cols)
    belief["_reality"] = belief["_story"].map(reality_ok)
    rows = []
    for key, g in belief.groupby(list(by), sort=True, dropna=False):
        key = key if isinstance(key, tuple) else (key,)
        matched = g[g["_reality"].notna()]
        if matched.empty:
            continue
        ok = matched["_reality"].astype(bool)
        kept = matched[ok]
        correct = matched["correct"].astype(bool)
        rng = _cell_rng(seed, ("gated", *key))
        if len(kept):
            lo, hi = task_bootstrap(*per_task(kept["correct"], kept["_task"]), n_boot=n_boot, rng=rng)
        else:
            lo = hi = float("nan")
        joint = correct & ok
        jlo, jhi = task_bootstrap(*per_task(joint, matched["_task"]), n_boot=n_boot, rng=rng)
        rows.append({**dict(zip(by, key, strict=True)), "n_belief": len(matched), "n_kept": len(kept),
                     "n_dropped": len(matched) - len(kept), "n_unmatched": len(g) - len(matched),
                     "n_tasks": int(kept["_task"].nunique()),
                     "accuracy": float(kept["correct"].astype(float).mean()) if len(kept) else float("nan"),
                     "ci_low": lo, "ci_high": hi, "joint_accuracy": float(joint.mean()),
                     "joint_ci_low": jlo, "joint_ci_high": jhi,
                     "ungated_accuracy": float(correct.mean()), **option_mass_columns(matched, min_mass)})
    return pd.DataFrame(rows, columns=cols)


def _is_false_belief(df: pd.DataFrame) -> pd.Series:
    """Knowledge state per row: `knowledge_state` where the generator wrote it, else the condition."""
    cond = df["condition"].astype(str)
    if "knowledge_state" in df:
        ks = df["knowledge_state"]
        cond = ks.astype(str).where(ks.notna() & (ks.astype(str) != ""), cond)
    return cond == FALSE_BELIEF


def _log_odds(df: pd.DataFrame, word: pd.Series) -> pd.Series:
    """log p(word) - log p(the other option) per row; nan where `word` is not one of the options."""
    a, b = df["logp_a"].astype(float), df["logp_b"].astype(float)
    return pd.Series(np.where(df["option_a"] == word, a - b, np.where(df["option_b"] == word, b - a, np.nan)),
                     index=df.index, dtype=float)


# Families whose belief answers are states or places (where the object is, what the container
# holds), so "the start answer" means something. Other built-in families answer something else
# ("true"/"false" statements, goal targets, tracking curves) and never get a knowledge-state row.
STATE_FAMILIES: tuple[str, ...] = ("unexpected-transfer", "unexpected-contents", "order-only",
                                   "false-belief-factorial")
NON_STATE_FAMILIES: tuple[str, ...] = ("belief-statements", "goal-encoding", "belief-tracking")
# Controls that change what the start answer is rather than what the protagonist knows: in the
# contents family's correct-label control the label itself names the true contents.
LABEL_CONTRASTS: dict[str, tuple[str, ...]] = {"unexpected-contents": ("correct_label",)}
# Below this many tasks an effect has no interval (a bootstrap over one task is a point).
MIN_EFFECT_TASKS = 2


def _column(df: pd.DataFrame, name: str) -> pd.Series:
    """`df[name]` as objects with missing values as None (a column that is absent is all None)."""
    if name not in df:
        return pd.Series([None] * len(df), index=df.index, dtype=object)
    col = df[name].astype(object)
    return col.where(col.notna() & (col.astype(str) != ""), None)


def _among_options(df: pd.DataFrame, word: pd.Series) -> pd.Series:
    return word.notna() & ((word == df["option_a"]) | (word == df["option_b"]))


def _state_rows(d: pd.DataFrame) -> pd.DataFrame:
    """Belief rows whose answers are states/places: the STATE_FAMILIES, and rows of other families
    (user files, BigToM) whose belief, world state and reference state are all among the options."""
    belief, world, ref = (_column(d, c) for c in ("protagonist_belief", "world_state", "reference_state"))
    family = d["family"].astype(str)
    other = ~family.isin(STATE_FAMILIES) & ~family.isin(NON_STATE_FAMILIES)
    user_ok = other & _among_options(d, belief) & _among_options(d, world) & _among_options(d, ref)
    return d[family.isin(STATE_FAMILIES) | user_ok]


def knowledge_state_effect(df: pd.DataFrame, *, n_boot: int = 1000, seed: int = 0,
                           min_mass: float = MIN_OPTION_MASS) -> pd.DataFrame:
    """Jones, Trott & Bergen's knowledge-state effect on belief prompts, paired story by story.

    Only for families whose belief answers are states or places (STATE_FAMILIES, and user rows
    whose belief, world and reference states are among the options): for true/false statements
    there is no "start answer", and pairing them would compare unrelated statements.
    Each false-belief story is paired with each true-belief control of the same task, version
    (`reversed`, and the factorial's first/recent mention and knowledge cue where present) and
    option pair. In both, log-odds = log p(start) - log p(other option), where `start` is the
    false-belief row's `protagonist_belief` (its `reference_state`, the starting place or label
    word). The effect is the mean paired difference FB - TB: positive when the model's answer
    follows what the protagonist knows. A control whose belief is also `start` (no transfer)
    makes no contrast and is left out. `contrast_kind` is "knowledge" when the control keeps the
    start (its `reference_state`) and changes only what the protagonist knows, "label" when the
    control changes the start itself (the contents family's correct label). One row per family x
    control: n_pairs, n_tasks, the effect with a task-bootstrap 95% interval (nan with fewer than
    MIN_EFFECT_TASKS tasks, and `few_tasks` True), the share of tasks whose mean paired difference
    is positive, and the mean log-odds in each condition; the option mass is the mean over the
    pairs' two rows (each pair's false-belief side counted as its stories' mean).
    """
    cols = ["family", "contrast", "contrast_kind", "n_pairs", "n_tasks", "effect", "ci_low", "ci_high",
            "few_tasks", "share_tasks_positive", "logodds_false_belief", "logodds_true_belief", *MASS_COLUMNS]
    d = _unprefixed(df)
    need = {"option_a", "option_b", "logp_a", "logp_b", "answer", "condition", "family", "prompt_type"}
    if d.empty or not need <= set(d.columns):
        return pd.DataFrame(columns=cols)
    d = _state_rows(d[d["prompt_type"] == "belief"])
    if d.empty:
        return pd.DataFrame(columns=cols)
    belief = _column(d, "protagonist_belief").where(lambda x: x.notna(), d["answer"].astype(object))
    ref = _column(d, "reference_state")
    options = ["\x1f".join(sorted(map(str, ab))) for ab in zip(d["option_a"], d["option_b"], strict=True)]
    d = d.assign(_fb=_is_false_belief(d), _task=task_of(d), _belief=belief, _ref=ref, _options=options)
    keys = ["family", "_task", "_options"] + [c for c in ("reversed", *PAIR_FACTORS) if c in d]
    d[keys] = d[keys].astype(object).where(d[keys].notna(), "")
    fb, tb = d[d["_fb"]], d[~d["_fb"]]
    if fb.empty or tb.empty:
        return pd.DataFrame(columns=cols)
    fb = fb.assign(_start=fb["_belief"])
    fb = fb.assign(_lo=_log_odds(fb, fb["_start"]))
    masses = [c for c in ("option_mass_first", "option_mass") if c in fb]
    fb_one = fb.groupby(keys, sort=False).agg(_start=("_start", "first"), _lo_fb=("_lo", "mean"),
                                              **{f"_fb_{c}": (c, "mean") for c in masses})
    m = tb.merge(fb_one.reset_index(), on=keys, how="inner")
    m = m[m["_belief"] != m["_start"]]  # the control must call for the other answer
    m["_lo_tb"] = _log_odds(m, m["_start"])
    m = m[m["_lo_tb"].notna() & m["_lo_fb"].notna()]
    m["_diff"] = m["_lo_fb"] - m["_lo_tb"]
    label = m["_ref"].notna() & (m["_ref"] != m["_start"])
    label |= pd.Series([c in LABEL_CONTRASTS.get(f, ()) for f, c in zip(m["family"], m["condition"], strict=True)],
                       index=m.index, dtype=bool)
    m["_kind"] = np.where(label, "label", "knowledge")
    rows = []
    for (family, contrast, kind), g in m.groupby(["family", "condition", "_kind"], sort=True):
        total, count = per_task(g["_diff"], g["_task"])
        few = len(total) < MIN_EFFECT_TASKS
        if few:
            lo = hi = float("nan")
        else:
            lo, hi = task_bootstrap(total, count, n_boot=n_boot,
                                    rng=_cell_rng(seed, ("ks", family, contrast)))
        both = pd.DataFrame({c: np.concatenate([g[c].to_numpy(float), g[f"_fb_{c}"].to_numpy(float)])
                             for c in masses})
        rows.append({"family": family, "contrast": contrast, "contrast_kind": kind, "n_pairs": len(g),
                     "n_tasks": len(total), "effect": float(g["_diff"].mean()), "ci_low": lo, "ci_high": hi,
                     "few_tasks": few, "share_tasks_positive": float(np.mean(total / count > 0)),
                     "logodds_false_belief": float(g["_lo_fb"].mean()),
                     "logodds_true_belief": float(g["_lo_tb"].mean()), **option_mass_columns(both, min_mass)})
    return pd.DataFrame(rows, columns=cols)


def strict_task_pass(df: pd.DataFrame, column: str = "correct", *, scoring: str = TWO_WAY,
                     min_mass: float = MIN_OPTION_MASS) -> pd.DataFrame:
    """Kosinski's rule per family: a task is solved only when all its prompts are right by
    `column` (`correct`: the two-way log-prob choice; `correct_first_word`: the first word of a
    greedy completion, `tomlens.behaviour.first_word`), named in the `scoring` column.

    Chance is 0.5 ** (prompts per task) for a two-way choice: 1/65,536 for the 16-prompt
    false-belief tasks (first-word answers can also be off-key, so there it is lower still). The
    interval is Wilson's over tasks, which are independent units (each its own names and places).
    A row whose `column` is missing (a prompt the scoring did not answer) fails its task.
    """
    rows = []
    for family, g in df.groupby("family", sort=True):
        right = g[column].astype(object).where(g[column].notna(), False).astype(bool)
        per_task = right.groupby(g["task_id"]).agg(["all", "size"])
        k, n = int(per_task["all"].sum()), len(per_task)
        lo, hi = wilson_interval(k, n)
        prompts = int(per_task["size"].median())
        rows.append({"family": family, "scoring": scoring, "tasks": n, "solved": k, "fraction_solved": k / n,
                     "ci_low": lo, "ci_high": hi, "prompts_per_task": prompts,
                     "chance": 0.5**prompts, **option_mass_columns(g, min_mass)})
    return pd.DataFrame(rows)


def object_bias(df: pd.DataFrame) -> pd.Series:
    """Per-prompt o_b = p(object-bias target) / (p(obj) + p(location-bias target))."""
    obj_is_a = df["option_a"] == df["object_target"]
    return pd.Series(np.where(obj_is_a, df["p_a"], 1 - df["p_a"]), index=df.index, name="o_b")


GOAL_CELL = ("target_type", "anim_denotation", "k", "test_case")


def _goal_rows(df: pd.DataFrame) -> pd.DataFrame:
    goal = df[df["prompt_type"] == "goal"].copy()
    goal["o_b"] = object_bias(goal)
    return goal


def unclassified_columns(g: pd.DataFrame) -> dict[str, float]:
    """The share of the model's probability on neither target (Ruis et al. count answers that name
    neither as unclassified; o_b, normalised over the two, hides them): one minus the targets'
    next-word mass, and one minus the whole targets' mass (nan for a table without option mass)."""
    mass = option_mass_columns(g)
    return {"unclassified": 1 - mass["mean_option_mass_first"], "unclassified_whole": 1 - mass["mean_option_mass"]}


def object_bias_table(df: pd.DataFrame, *, n_boot: int = 1000, seed: int = 0,
                      min_mass: float = MIN_OPTION_MASS) -> pd.DataFrame:
    """Mean o_b per cell (target type x animacy wording x k x test case), sd and bootstrap 95% CI,
    the cell's unclassified share and option mass, flagged where the targets get less than
    `min_mass` of the next word: there o_b describes a choice between two answers the model would
    mostly not give."""
    goal = _goal_rows(df)
    rng = np.random.default_rng(seed)
    rows = []
    for key, g in goal.groupby(list(GOAL_CELL), sort=True):
        v = g["o_b"].to_numpy()
        boots = rng.choice(v, size=(n_boot, len(v)), replace=True).mean(axis=1)
        rows.append({**dict(zip(GOAL_CELL, key, strict=True)), "n": len(v), "o_b": float(v.mean()),
                     "sd": float(v.std(ddof=1)) if len(v) > 1 else 0.0,
                     "ci_low": float(np.quantile(boots, 0.025)),
                     "ci_high": float(np.quantile(boots, 0.975)),
                     **unclassified_columns(g), **option_mass_columns(g, min_mass)})
    return pd.DataFrame(rows)


# How far from 0.5 the k = 0 object bias may sit and still count as "near 0.5" (TOST margin).
K0_MARGIN = 0.1


def k0_check(df: pd.DataFrame, *, margin: float = K0_MARGIN, alpha: float = 0.05,
             min_mass: float = MIN_OPTION_MASS) -> pd.DataFrame:
    """o_b at k = 0 per target type x animacy wording x test case, tested for equivalence with 0.5.

    With no habituation reach nothing in the story marks the goal fruit or the habituated pillar
    (the generator cycles the placements and alternates the option order), so a model with no
    bias for a position, an ordinal word or a fruit name sits at 0.5. A k = 0 o_b away from 0.5 is
    a bias the k > 0 cells carry too: read their o_b against it, not against 0.5. `near_half` is a
    one-sample TOST over items (o_b averaged per task) that their mean is within +/- `margin` of
    0.5; few or noisy items cannot show it. Each row also gives its unclassified share and option
    mass. Empty without k = 0 prompts."""
    cols = ["target_type", "anim_denotation", "test_case", "n_items", "o_b", "low", "high", "p", "margin",
            "near_half", "unclassified", "unclassified_whole", *MASS_COLUMNS]
    goal = _goal_rows(df)
    goal = goal[goal["k"].astype(float) == 0] if "k" in goal else goal.iloc[0:0]
    rows = []
    for (tt, anim, case), g in goal.groupby(["target_type", "anim_denotation", "test_case"], sort=True):
        items = g.groupby(task_of(g).to_numpy())["o_b"].mean().to_numpy(float)
        eq = equivalence_test(items, np.full_like(items, 0.5), margin=margin, alpha=alpha)
        rows.append({"target_type": tt, "anim_denotation": bool(anim), "test_case": case, "n_items": len(items),
                     "o_b": float(items.mean()), "low": eq.low + 0.5, "high": eq.high + 0.5, "p": eq.p,
                     "margin": margin, "near_half": bool(eq.equivalent), **unclassified_columns(g),
                     **option_mass_columns(g, min_mass)})
    return pd.DataFrame(rows, columns=cols)


@dataclass(frozen=True)
class Equivalence:
    """A paired TOST: is the mean of a - b inside [-margin, margin]?"""

    n: int
    diff: float
    low: float  # the (1 - 2 alpha) t interval of the mean difference: 90% at alpha = 0.05
    high: float
    p: float  # the larger of the two one-sided p-values
    margin: float
    equivalent: bool


def equivalence_test(a: np.ndarray, b: np.ndarray, *, margin: float, alpha: float = 0.05) -> Equivalence:
    """Two one-sided t-tests (Schuirmann's TOST) on paired items a[i], b[i]: equivalence when both
    "mean(a - b) <= -margin" and "mean(a - b) >= margin" are rejected at `alpha`, i.e. when the
    (1 - 2 alpha) interval lies inside [-margin, margin]. Few or noisy items give a wide interval,
    so they cannot show equivalence; fewer than two items never do."""
    if not margin > 0 or not 0 < alpha < 0.5:
        raise TomlensError(f"equivalence margin {margin} and alpha {alpha}",
                           "use a margin above 0 and 0 < alpha < 0.5, e.g. margin = 0.1, alpha = 0.05")
    d = np.asarray(a, float) - np.asarray(b, float)
    n = len(d)
    if n < 2:
        return Equivalence(n, float(d.mean()) if n else float("nan"), float("nan"), float("nan"), 1.0,
                           margin, False)
    mean, se = float(d.mean()), float(d.std(ddof=1) / math.sqrt(n))
    if se == 0:  # every item has the same difference: the interval is that value
        p = 0.0 if abs(mean) < margin else 1.0
        return Equivalence(n, mean, mean, mean, p, margin, p < alpha)
    t = stats.t(df=n - 1)
    p = max(float(t.sf((mean + margin) / se)), float(t.cdf((mean - margin) / se)))
    half = float(t.ppf(1 - alpha)) * se
    return Equivalence(n, mean, mean - half, mean + half, p, margin, p < alpha)


@dataclass(frozen=True)
class SelectiveEncoding:
    """Ruis et al.'s criterion for one (target type, animacy wording, k) group.

    `passes` is the paper's criterion: the animate case distinct from both others (each paired
    interval excludes 0, on the same side) and inanimate equivalent to control. `direction` says
    which way the animate case differs ("object", "location" or "none"); `passes_object_bias` also
    asks that it be toward the goal object, as a goal encoder's should (Woodward's infants look
    longer at the new-goal event). `unclassified` is the group's probability on neither target."""

    target_type: str
    anim_denotation: bool
    k: int
    n_items: int
    o_animate: float
    o_inanimate: float
    o_control: float
    animate_vs_inanimate: tuple[float, float]
    animate_vs_control: tuple[float, float]
    inanimate_vs_control: tuple[float, float]
    equivalence_margin: float
    equivalence_low: float  # 90% t interval of inanimate - control (TOST at alpha 0.05)
    equivalence_high: float
    equivalence_p: float
    inanimate_equals_control: bool
    animate_distinct: bool
    direction: str
    passes: bool
    passes_object_bias: bool
    unclassified: float
    mean_option_mass_first: float
    low_option_mass: bool


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


def _side(ci: tuple[float, float]) -> int:
    """+1 when an interval lies above 0, -1 below, 0 when it covers 0."""
    return 1 if ci[0] > 0 else -1 if ci[1] < 0 else 0


def animate_direction(vs_inanimate: tuple[float, float], vs_control: tuple[float, float]) -> str:
    """Which way the animate case is distinct from both others: "object" (more object bias than
    both), "location" (less than both), or "none" (not distinct from one, or on opposite sides)."""
    a, b = _side(vs_inanimate), _side(vs_control)
    return "object" if a == b == 1 else "location" if a == b == -1 else "none"


def selective_encoding(df: pd.DataFrame, *, margin: float = 0.1, alpha: float = 0.05,
                       n_boot: int = 1000, seed: int = 0, min_mass: float = MIN_OPTION_MASS) -> pd.DataFrame:
    """Ruis et al.'s criterion per target type x animacy wording x k: the animate agent's o_b is
    *distinct* from both the inanimate agent's and the accidental control's (paired bootstrap 95%
    interval of each difference excluding 0, both on the same side, resampling items), and
    inanimate and control are *equivalent*: a paired TOST at `alpha` shows their mean o_b
    difference inside +/- `margin` (its 90% t interval lies inside [-margin, margin]). "Not
    significantly different" would pass on too few items; equivalence has to be shown, so few or
    noisy items fail. `passes` is that two-sided criterion, the paper's; `passes_object_bias`
    adds the goal direction (animate above both), which an animate agent leaning to the location
    does not meet. Each group also reports its unclassified share and option mass."""
    goal = _goal_rows(df)
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
        eq = equivalence_test(v["inanimate"], v["control"], margin=margin, alpha=alpha)
        direction = animate_direction(ai, ac)
        distinct = direction != "none"
        mass = option_mass_columns(g, min_mass)
        out.append(asdict(SelectiveEncoding(
            tt, bool(anim), int(k), len(wide), m["animate"], m["inanimate"], m["control"], ai, ac, ic,
            margin, eq.low, eq.high, eq.p, bool(eq.equivalent), distinct, direction,
            bool(distinct and eq.equivalent), bool(direction == "object" and eq.equivalent),
            unclassified_columns(g)["unclassified"], mass["mean_option_mass_first"],
            bool(mass["low_option_mass"]))))
    return pd.DataFrame(out)


def prefix_curves(df: pd.DataFrame, *, min_mass: float = MIN_OPTION_MASS) -> pd.DataFrame:
    """Mean probability of the reference answer (starting location / label word) and of the
    correct answer at each sentence prefix, per family, story family (transfer and contents
    stories kept apart), condition and prompt type, with each point's option mass: after an early
    prefix the options may get little of the next word, and the curve's two-way probability then
    says little about what the model expects."""
    tr = df[df["prefix_index"].notna()].copy() if "prefix_index" in df else df.iloc[0:0].copy()
    keys = ["family", "story_family", "condition", "prompt_type", "prefix_index"]
    if tr.empty:
        return pd.DataFrame(columns=keys + ["p_reference", "p_answer", "n", *MASS_COLUMNS])
    if "story_family" not in tr:
        tr["story_family"] = tr["family"]
    tr["story_family"] = tr["story_family"].fillna(tr["family"])
    ref_is_a = tr["option_a"] == tr["reference_state"]
    tr["p_reference"] = np.where(ref_is_a, tr["p_a"], 1 - tr["p_a"])
    rows = []
    for key, g in tr.groupby(keys, sort=True):
        rows.append({**dict(zip(keys, key, strict=True)), "p_reference": float(g["p_reference"].mean()),
                     "p_answer": float(g["p_answer"].mean()), "n": len(g), **option_mass_columns(g, min_mass)})
    return pd.DataFrame(rows, columns=keys + ["p_reference", "p_answer", "n", *MASS_COLUMNS])
