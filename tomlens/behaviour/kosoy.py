"""Kosoy et al.'s developmental battery (family `kosoy`): the control rule and the paper's table.

The rule (their scoring, as for children): a story scores only when every control question of the
story (reality, memory) is answered right; failing a control scores 0, whatever the test answer.
`score` is that gated pass rate (0-1) over the stories of a cell, with the chance level of the gated
rule (`chance`, 0.5 ** (1 + controls)), which a two-option test passes by guessing, and which
always choosing the first option (or always "yes") also scores, since the generator crosses the
test's and controls' option orders and balances every answer word.

What the paper's number is, and why it is kept apart: Kosoy et al. score free-text LaMDA answers to
their own items on a 0-10 rubric (the LRS: 10 = child-like and right on every prompt, 5 = partly)
and average it over 10 runs. That is a rating of other items by another model, not a pass rate, so
no column here rescales our score onto it (there is no `score_10`), and the paper's number sits in
the last column, `paper_lrs`, labelled for what it is (`COLUMN_NOTES`); `paper_condition` names the
paper's row a cell renders. Order twins (`tomlens.stimuli.kosoy.TWINS`, the same sentences in
another order, the answer flipped) and the non-human Woodward comparison have no paper row.

Intervals resample items (`task_id`) and keep the cells of one task together (Ullman's alterations
and their twins, or gears' two conditions, are renderings of the same items), so a domain mean's
interval reflects the items it rests on.
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np
import pandas as pd

from tomlens.behaviour.aggregates import MASS_COLUMNS, MIN_OPTION_MASS, option_mass_columns
from tomlens.errors import TomlensError
from tomlens.stimuli.kosoy import CELLS, COMPARISON_CELLS, DOMAINS, PAIR_CELLS, TASKS, TWINS

FAMILY = "kosoy"
# cell -> (the paper's condition label, LaMDA's LRS 0-10), from seeds-notes.md section 5.3.
PAPER: dict[str, tuple[str, float]] = {
    "object-permanence": ("Object permanence: original", 8.0),
    "addition": ("Addition/subtraction: original", 2.0),
    "rational-action": ("Rational action: rational", 7.3),
    "woodward": ("Woodward: standard", 3.0),
    "sally-anne": ("Sally-Anne: original", 4.7),
    "ullman-transparent": ("Ullman 1: transparent", 5.7),
    "ullman-relationship-change": ("Ullman 2: relationship change", 5.5),
    "ullman-trusted-communication": ("Ullman 3: trusted communication", 3.5),
    "ullman-additional-actor": ("Ullman 4: additional actor", 4.0),
    "smarties": ("False belief: Smarties/pencils", 7.3),
    "helper-hinderer": ("Helper/hinderer: successful", 10.0),
    "altruism-out-of-reach": ("Altruism and intention 1: constraint, out of reach", 8.8),
    "altruism-physical-obstacle": ("Altruism and intention 2: constraint, physical obstacle", 6.6),
    "gears-a-pushes-b": ("Gears 1: A pushes B", 6.4),
    "gears-symbiotic": ("Gears 2: A and B symbiotic", 2.6),
    "blicket-categorisation": ("Blicket 1: categorisation", 0.8),
    "blicket-induction": ("Blicket 2: induction", 1.3),
    "lucas-given-conjunctive": ("Lucas 1: given hypothesis, conjunctive", 1.0),
    "lucas-given-disjunctive": ("Lucas 2: given hypothesis, disjunctive", 1.2),
    "lucas-open-conjunctive": ("Lucas 3: not given, conjunctive", 1.0),
    "lucas-open-disjunctive": ("Lucas 4: not given, disjunctive", 0.0),
}
# Table 2's domain averages, and how many of the paper's cells each holds.
PAPER_DOMAINS: dict[str, tuple[float, int]] = {
    "object": (5.08, 4), "tom": (5.12, 6), "social": (8.47, 3), "causal": (1.79, 8)}
NOTES: dict[str, str] = {
    "woodward": "the goal object is also the option the story names most (every habituation reach names it): "
                "read it beside woodward-nonhuman, whose text has the same counts",
    "woodward-nonhuman": "object bias with a non-human mover (the paper's comparison): not a right answer",
    "rational-action": "the paper's 'Rational' condition: the same jump with and without a wall between, crossed "
                       "with the question's polarity",
    "addition": "Wynn's 1 + 1 and 2 - 1, two stories per item, asking about either kind of bird",
    **{twin: f"order twin of {base} (not a paper cell): {what}" for twin, (base, what) in TWINS.items()},
}
COLUMNS: tuple[str, ...] = (
    "level", "domain", "task", "condition", "n_stories", "n_tasks", "n_unmatched",
    "control_pass", "test_accuracy", "gated_accuracy", "score", "ci_low", "ci_high", "chance", *MASS_COLUMNS,
    "n_cells", "n_cells_paper", "note", "paper_condition", "paper_lrs")
# What the columns that are not ours hold: the paper's items and scoring differ from these, so its
# number is a rating of other items by another model, never a pass rate to read beside `score`.
COLUMN_NOTES: dict[str, str] = {
    "paper_condition": "the paper's row this cell renders (Kosoy et al., Tables 3-6); other items, other model",
    "paper_lrs": "paper LRS (LaMDA 137B's 0-10 rating of free-text answers to the paper's own items, averaged "
                 "over 10 runs): a rating, not a pass rate; not comparable with score",
}
REQUIRED: tuple[str, ...] = ("condition", "task_id", "story_id", "question", "correct")


def score_stories(df: pd.DataFrame) -> pd.DataFrame:
    """One row per story: was the test answered right, were all its controls, and did it pass.

    Stories are keyed by `story_id` (the text before the question, which a story's test and control
    prompts share). A story without a control cannot be scored by the rule: `n_controls` is 0 and `passed` is
    missing (NA), so it is counted apart rather than scored.
    """
    d = df[df["family"] == FAMILY] if "family" in df else df
    missing = [c for c in REQUIRED if c not in d.columns]
    if missing:
        raise TomlensError(f"the behaviour table lacks {missing} for the kosoy control rule",
                           "score kosoy stimuli with `tomlens behaviour` (it writes story_id and question)")
    # the pairs-only twins (`witnessed=True`) are for probes and patching, not the paper's battery
    d = d[~d["condition"].astype(str).isin(PAIR_CELLS)]
    unknown = sorted(set(d["condition"].astype(str)) - set(CELLS))
    if unknown:
        raise TomlensError(f"kosoy rows with unknown conditions {unknown}", f"conditions are {list(CELLS)}")
    bad_q = sorted(set(d["question"].astype(str)) - {"test", "control"})
    if bad_q:
        raise TomlensError(f"kosoy rows with question {bad_q}", "question is 'test' or 'control'")
    rows = []
    for sid, g in d.groupby("story_id", sort=True):
        tests, controls = g[g["question"] == "test"], g[g["question"] == "control"]
        if len(tests) != 1 or g["condition"].nunique() != 1 or g["task_id"].nunique() != 1:
            raise TomlensError(f"story {sid}: {len(tests)} test rows over conditions {sorted(set(g['condition']))}",
                               "a kosoy story has one test prompt and its controls, in one condition")
        test_ok = bool(tests["correct"].iloc[0])
        ctrl_ok = bool(controls["correct"].astype(bool).all()) if len(controls) else None
        rows.append({"story_id": sid, "condition": tests["condition"].iloc[0],
                     "task": CELLS[tests["condition"].iloc[0]], "task_id": tests["task_id"].iloc[0],
                     "test_correct": test_ok, "n_controls": len(controls), "controls_correct": ctrl_ok,
                     "passed": (test_ok and ctrl_ok) if ctrl_ok is not None else None})
    return pd.DataFrame(rows, columns=["story_id", "condition", "task", "task_id", "test_correct", "n_controls",
                                       "controls_correct", "passed"])


def _rng(seed: int, key: str) -> np.random.Generator:
    return np.random.default_rng([int(seed), zlib.crc32(key.encode())])


def _cell_boots(stories: pd.DataFrame, n_boot: int, seed: int) -> dict[str, np.ndarray]:
    """Bootstrap draws of each cell's gated score, resampling item ids once per task so that the
    cells of one task move together."""
    out: dict[str, np.ndarray] = {}
    for task, g in stories.groupby("task", sort=True):
        ids = sorted(g["task_id"].astype(str).unique())
        if len(ids) < 2:
            for cell in g["condition"].unique():
                out[cell] = np.full(n_boot, np.nan)
            continue
        pos = {t: k for k, t in enumerate(ids)}
        idx = _rng(seed, task).integers(0, len(ids), (n_boot, len(ids)))
        for cell, c in g.groupby("condition"):
            tot, cnt = np.zeros(len(ids)), np.zeros(len(ids))
            for tid, passed in zip(c["task_id"].astype(str), c["passed"].astype(float), strict=True):
                tot[pos[tid]] += passed
                cnt[pos[tid]] += 1
            with np.errstate(invalid="ignore", divide="ignore"):
                out[cell] = tot[idx].sum(1) / cnt[idx].sum(1)
    return out


def _ci(boots: np.ndarray) -> tuple[float, float]:
    b = boots[~np.isnan(boots)]
    if len(b) < len(boots) * 0.5 or len(b) == 0:
        return (float("nan"), float("nan"))
    return (float(np.quantile(b, 0.025)), float(np.quantile(b, 0.975)))


def _rows_of(df: pd.DataFrame, cells: list[str] | pd.Series) -> pd.DataFrame:
    """The behaviour rows (tests and controls) of some cells, for their option mass."""
    d = df[df["family"] == FAMILY] if "family" in df else df
    return d[d["condition"].astype(str).isin(list(cells))]


def cell_summary(df: pd.DataFrame, *, n_boot: int = 1000, seed: int = 0,
                 min_mass: float = MIN_OPTION_MASS) -> pd.DataFrame:
    """One row per cell present (the paper's table rows): control pass rate, ungated test accuracy,
    test accuracy among stories whose controls passed, and the gated score with its interval; and
    how much next-word probability its prompts (tests and controls) put on their two options, with
    `low_option_mass` where that is under `min_mass` (there the model would more likely say
    neither option, and a two-way choice describes the minority of what it would say)."""
    stories = score_stories(df)
    gated = stories[stories["passed"].notna()]
    boots = _cell_boots(gated, n_boot, seed)
    rows = []
    for cell in CELLS:
        s = stories[stories["condition"] == cell]
        if s.empty:
            continue
        g = s[s["passed"].notna()]
        task = CELLS[cell]
        domain = TASKS[task][0]
        controls = int(g["n_controls"].median()) if len(g) else 0
        ok = g[g["controls_correct"].astype(bool)] if len(g) else g
        score = float(g["passed"].astype(float).mean()) if len(g) else float("nan")
        lo, hi = _ci(boots[cell]) if cell in boots else (float("nan"), float("nan"))
        label, lrs = PAPER.get(cell, ("", float("nan")))
        rows.append({
            "level": "cell", "domain": domain, "task": task, "condition": cell,
            "n_stories": len(g), "n_tasks": int(g["task_id"].nunique()), "n_unmatched": len(s) - len(g),
            "control_pass": float(g["controls_correct"].astype(float).mean()) if len(g) else float("nan"),
            "test_accuracy": float(g["test_correct"].astype(float).mean()) if len(g) else float("nan"),
            "gated_accuracy": float(ok["test_correct"].astype(float).mean()) if len(ok) else float("nan"),
            "score": score, "ci_low": lo, "ci_high": hi,
            "chance": 0.5 ** (1 + controls) if len(g) else float("nan"),
            **option_mass_columns(_rows_of(df, [cell]), min_mass),
            "n_cells": 1, "n_cells_paper": 1 if cell in PAPER else 0,
            "note": NOTES.get(cell, ""), "paper_condition": label, "paper_lrs": lrs})
    return pd.DataFrame(rows, columns=list(COLUMNS))


def domain_summary(df: pd.DataFrame, *, n_boot: int = 1000, seed: int = 0, min_mass: float = MIN_OPTION_MASS,
                   cells: pd.DataFrame | None = None) -> pd.DataFrame:
    """Per domain, the unweighted mean of its cells' gated scores (as Table 2 averages its cells),
    then ToM beside the non-ToM domains and their difference. The order twins count as cells (each
    flips its paper cell's answer, so a model that always names the start location or the label
    scores half the ToM cells, not most of them); the non-human Woodward comparison does not, since
    its "correct" is a bias."""
    cells = cell_summary(df, n_boot=n_boot, seed=seed, min_mass=min_mass) if cells is None else cells
    stories = score_stories(df)
    boots = _cell_boots(stories[stories["passed"].notna()], n_boot, seed)
    scored = cells[~cells["condition"].isin(COMPARISON_CELLS) & cells["score"].notna()]
    rows: list[dict[str, Any]] = []  # one table row each: text, counts and rates side by side
    draws: dict[str, np.ndarray] = {}
    groups = [(d, [d]) for d in DOMAINS] + [("non-tom", [d for d in DOMAINS if d != "tom"])]
    for name, members in groups:
        c = scored[scored["domain"].isin(members)]
        if c.empty:
            continue
        stack = np.vstack([boots[x] for x in c["condition"]])
        with np.errstate(invalid="ignore"):
            draws[name] = stack.mean(0)
        lo, hi = _ci(draws[name])
        paper, n_paper = PAPER_DOMAINS.get(name, (float("nan"), sum(PAPER_DOMAINS[m][1] for m in members)))
        score = float(c["score"].mean())
        rows.append({
            "level": "domain", "domain": name, "task": "", "condition": "", "paper_condition": "",
            "paper_lrs": paper,
            "n_stories": int(c["n_stories"].sum()),
            "n_tasks": int(stories.loc[stories["condition"].isin(c["condition"]), "task_id"].nunique()),
            "n_unmatched": int(c["n_unmatched"].sum()),
            "control_pass": float(c["control_pass"].mean()), "test_accuracy": float(c["test_accuracy"].mean()),
            "gated_accuracy": float(c["gated_accuracy"].mean()), "score": score, "ci_low": lo, "ci_high": hi,
            "chance": float(c["chance"].mean()), **option_mass_columns(_rows_of(df, c["condition"]), min_mass),
            "n_cells": len(c), "n_cells_paper": n_paper, "note": NOTES.get(name, "")})
    if "tom" in draws and "non-tom" in draws:
        tom = next(r for r in rows if r["domain"] == "tom")
        non = next(r for r in rows if r["domain"] == "non-tom")
        lo, hi = _ci(draws["tom"] - draws["non-tom"])
        diff = tom["score"] - non["score"]
        rows.append({**{k: float("nan") for k in COLUMNS}, "low_option_mass": False, "level": "contrast",
                     "domain": "tom-minus-non-tom",
                     "task": "", "condition": "", "paper_condition": "", "score": diff, "ci_low": lo, "ci_high": hi,
                     "n_cells": tom["n_cells"] + non["n_cells"],
                     "n_stories": tom["n_stories"] + non["n_stories"], "n_tasks": tom["n_tasks"] + non["n_tasks"],
                     "n_cells_paper": 0, "note": "gated score, ToM cells' mean minus the non-ToM cells' mean"})
    return pd.DataFrame(rows, columns=list(COLUMNS))


def twin_rows(df: pd.DataFrame) -> int:
    """How many rows of `df` are pairs-only twins (`PAIR_CELLS`), which `gate` leaves out."""
    d = df[df["family"] == FAMILY] if "family" in df else df
    return int(d["condition"].astype(str).isin(PAIR_CELLS).sum()) if "condition" in d else 0


def summary(df: pd.DataFrame, *, n_boot: int = 1000, seed: int = 0, min_mass: float = MIN_OPTION_MASS) -> pd.DataFrame:
    """The battery's table: one row per cell present, then per domain, ToM vs non-ToM and their
    difference; `paper_lrs` (last) holds LaMDA's LRS (0-10) where the paper reports one: a rating of
    other items, not a pass rate (see `COLUMN_NOTES`). Pairs-only twin rows (`kosoy(...,
    witnessed=True)`) are left out, and every row's `note` then says how many, so a reader sees
    that the table holds the battery's cells only."""
    cells = cell_summary(df, n_boot=n_boot, seed=seed, min_mass=min_mass)
    if cells.empty:
        return cells
    out = pd.concat([cells, domain_summary(df, n_boot=n_boot, seed=seed, min_mass=min_mass, cells=cells)],
                    ignore_index=True)
    n_twins = twin_rows(df)
    if n_twins:
        left = (f"{n_twins} pairs-only twin rows ({', '.join(PAIR_CELLS)}) left out: not the paper's cells")
        out["note"] = [f"{n}; {left}" if n else left for n in out["note"].fillna("").astype(str)]
    return out
