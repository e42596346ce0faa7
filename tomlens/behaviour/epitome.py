"""EPITOME's scoring and summaries (Jones, Trott & Bergen 2023), over the behaviour table.

What each task reports, and how:
* false belief (the factorial, `false-belief-factorial`): log-odds log p(Start) - log p(End) per
  belief prompt; correct when positive in false-belief and negative in true-belief versions (the
  table's `correct`, since the answer is Start / End). The knowledge-state effect is
  `aggregates.knowledge_state_effect` (the mean paired FB - TB difference of that same log-odds,
  i.e. the paper's "Knowledge State affects the log-odds" analysis): reused, not re-implemented.
* recursive mindreading: log p(A) - log p(B) corrected by PMI_DC (Holtzman et al. 2022): each
  option's log-prob after the story minus its log-prob after the story-free tail (meta
  `story_free_text`, scored by `score_options`); correct when the consistent continuation wins.
  Accuracy by level, mental vs non-mental. Without the story-free scores (`enrich` not run) the
  PMI_DC rows are withheld and the raw log-odds accuracy is shown, marked as such.
* indirect request: log p(Yes) - log p(No); correct when positive for an unaware speaker and
  negative for an aware one. Also the share of "Yes" (GPT-3 said Yes to everything: 50%).
* scalar implicature: the probability over "0", "1", "2", "3" (summed token log-probs, normalised
  over the four) before and after the utterance; Δbet = after - before per count; the paper's
  criteria (Appendix C). E1's printed table and its text disagree in sign: the text's rule (bets
  on 3 fall at full access and do not fall otherwise) is the default, `e1_rule="table"` the print.
* Short Story / Strange Stories: free-text answers (`tomlens.behaviour.generate`) exported with
  the rubric for human coding (`export_for_coding`), codes read back (`import_codes`: each exported
  id exactly once, maxima from the items) and scored (`free_text_summary`: Strange Stories
  justifications unfiltered against the paper, filtered on comprehension as a secondary row).
* The scalar-implicature two-option view (the table's `correct`) is coarse: "3" is the answer in 6
  of 10 prompts, so its chance (best constant preference) is 0.6; the summary prints it.
* Every summary takes `n_boot` and `seed` (the run's), for `batteries.battery_summaries`.
"""

from __future__ import annotations

import csv
import itertools
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from tomlens.behaviour import aggregates
from tomlens.behaviour.generate import CUT_OFF_REASONS, allowed_codes
from tomlens.behaviour.scoring import score_options
from tomlens.errors import TomlensError
from tomlens.models.protocol import Model
from tomlens.stimuli.epitome import free_text_items
from tomlens.stimuli.records import Stimulus

FB_FAMILY = "false-belief-factorial"
RM_FAMILY = "recursive-mindreading"
IR_FAMILY = "indirect-request"
SI_FAMILY = "scalar-implicature"
BETS: tuple[str, ...] = ("0", "1", "2", "3")
PAPER_MODEL_COLUMN = "paper_other_items_text_davinci_002"
PAPER_HUMAN_COLUMN = "paper_other_items_humans"
SUMMARY_COLUMNS: list[str] = ["family", "cell", "metric", "n", "n_tasks", "value", "ci_low", "ci_high",
                              *aggregates.MASS_COLUMNS, PAPER_MODEL_COLUMN, PAPER_HUMAN_COLUMN, "note"]
# Jones, Trott & Bergen Table 1: (text-davinci-002, humans), each on the paper's own items. No
# tomlens item is one of the paper's (the stories, passages and free-text items are tomlens's own),
# so no number here is a target for tomlens's: the columns say so in their names, and appear only
# beside the row the paper's number summarises (same task and scoring rule, other items).
PAPER: dict[str, tuple[float, float]] = {"FB": (0.74, 0.83), "RM": (0.73, 0.84), "IR": (0.50, 0.63),
                                         "SI E1": (0.25, 0.59), "SI E2": (0.45, 0.73), "StS": (0.83, 0.86),
                                         "ShS EMSR": (0.62, 0.46), "ShS RC": (1.00, 0.83),
                                         "ShS SMSI": (1.00, 0.42)}
COLUMN_NOTES: dict[str, str] = {
    PAPER_MODEL_COLUMN: "paper, other items and model: text-davinci-002 (Jones, Trott & Bergen Table 1 / text)",
    PAPER_HUMAN_COLUMN: "paper, other items and subjects: humans (Jones, Trott & Bergen Table 1 / text)",
}
PAPER_NOTE = (f"{PAPER_MODEL_COLUMN} / {PAPER_HUMAN_COLUMN}: Jones, Trott & Bergen's text-davinci-002 and "
              "humans on the paper's own items (Table 1 / text), same task and scoring rule; tomlens's items are "
              "its own, so these are context, not a target")


# ---- extra scoring on a model -------------------------------------------------------------------

def story_free_stimuli(stimuli: Sequence[Stimulus]) -> list[Stimulus]:
    """For each recursive-mindreading prompt, the same two options after its story-free tail only
    (meta `story_free_text`): the PMI_DC denominator."""
    out = []
    for s in stimuli:
        tail = s.meta.get("story_free_text")
        if not tail:
            raise TomlensError(f"stimulus {s.id} has no meta 'story_free_text'",
                               "generate it with tomlens.stimuli.epitome.recursive_mindreading")
        out.append(Stimulus(id=f"{s.id}/no-story", text=tail, options=s.options, answer=s.answer))
    return out


def story_free_scores(model: Model, stimuli: Sequence[Stimulus], *, batch_size: int = 8,
                      progress: bool = False) -> pd.DataFrame:
    """`id`, `logp_a_nostory`, `logp_b_nostory`: each option's summed log-prob without the story."""
    scores = score_options(model, story_free_stimuli(stimuli), batch_size=batch_size, progress=progress)
    return pd.DataFrame({"id": [s.id for s in stimuli], "logp_a_nostory": [a.logp_sum for a, _ in scores],
                         "logp_b_nostory": [b.logp_sum for _, b in scores]})


def bet_scores(model: Model, stimuli: Sequence[Stimulus], *, batch_size: int = 8,
               progress: bool = False) -> pd.DataFrame:
    """`id`, `logp_0`..`logp_3` (each count's summed log-prob as the answer) and `p_0`..`p_3` (the
    four normalised to sum to 1, as the paper does). Two helper prompts per stimulus carry the
    four counts through the two-option scorer."""
    helpers = []
    for s in stimuli:
        helpers.append(Stimulus(id=f"{s.id}/01", text=s.text, options=("0", "1"), answer="0"))
        helpers.append(Stimulus(id=f"{s.id}/23", text=s.text, options=("2", "3"), answer="2"))
    scores = score_options(model, helpers, batch_size=batch_size, progress=progress)
    rows = []
    for i, s in enumerate(stimuli):
        (l0, l1), (l2, l3) = scores[2 * i], scores[2 * i + 1]
        lps = np.array([l0.logp_sum, l1.logp_sum, l2.logp_sum, l3.logp_sum], dtype=float)
        p = np.exp(lps - lps.max())
        p = p / p.sum()
        rows.append({"id": s.id, **{f"logp_{k}": float(v) for k, v in zip(BETS, lps, strict=True)},
                     **{f"p_{k}": float(v) for k, v in zip(BETS, p, strict=True)}})
    return pd.DataFrame(rows)


def enrich(model: Model, stimuli: Sequence[Stimulus], table: pd.DataFrame, *, batch_size: int = 8,
           progress: bool = False) -> pd.DataFrame:
    """The behaviour table with EPITOME's extra columns: story-free option scores for recursive
    mindreading, the four bets for scalar implicature, and the meta labels the summaries use
    (`story` for scalar implicature). Other families' rows keep their values; the added columns are
    empty there."""
    by_id = {s.id: s for s in stimuli}
    missing = [i for i in table["id"] if i not in by_id]
    if missing:
        raise TomlensError(f"{len(missing)} table rows have no stimulus (first {missing[0]!r})",
                           "pass the stimuli the table was scored from")
    out = table.copy()
    rm = [by_id[i] for i in out["id"] if by_id[i].family == RM_FAMILY]
    si = [by_id[i] for i in out["id"] if by_id[i].family == SI_FAMILY]
    if rm:
        out = out.merge(story_free_scores(model, rm, batch_size=batch_size, progress=progress), on="id", how="left")
    if si:
        out = out.merge(bet_scores(model, si, batch_size=batch_size, progress=progress), on="id", how="left")
        out["story"] = [by_id[i].meta.get("story") for i in out["id"]]
    return out


# ---- recursive mindreading ----------------------------------------------------------------------

def _consistent_is_a(df: pd.DataFrame) -> pd.Series:
    return df["answer"].astype(str) == df["option_a"].astype(str)


def rm_scores(df: pd.DataFrame) -> pd.DataFrame:
    """Per prompt: `logodds` = log p(consistent) - log p(inconsistent) after the story, and where
    the story-free scores exist `pmi_dc` = the same with each option's story-free log-prob
    subtracted; `correct_raw` / `correct_pmi` when positive (nan when not computable)."""
    d = df.copy()
    sign = np.where(_consistent_is_a(d), 1.0, -1.0)
    d["logodds"] = sign * (d["logp_a"].astype(float) - d["logp_b"].astype(float))
    d["correct_raw"] = d["logodds"] > 0
    if {"logp_a_nostory", "logp_b_nostory"} <= set(d.columns):
        pa = d["logp_a"].astype(float) - d["logp_a_nostory"].astype(float)
        pb = d["logp_b"].astype(float) - d["logp_b_nostory"].astype(float)
        d["pmi_dc"] = sign * (pa - pb)
        d["correct_pmi"] = (d["pmi_dc"] > 0).where(d["pmi_dc"].notna())
    else:
        d["pmi_dc"] = np.nan
        d["correct_pmi"] = np.nan
    return d


def _paper_columns(paper: tuple[float, float] | None) -> dict[str, float]:
    return {PAPER_MODEL_COLUMN: paper[0] if paper else np.nan, PAPER_HUMAN_COLUMN: paper[1] if paper else np.nan}


def _row(family: str, cell: str, metric: str, g: pd.DataFrame, column: str, *, n_boot: int, seed: int,
         paper: tuple[float, float] | None = None, note: str = "",
         min_mass: float = aggregates.MIN_OPTION_MASS) -> dict[str, Any]:
    """One summary row: the mean of `column` over `g` with a task-bootstrap 95% interval, and the
    cell's option mass (how much of the next word the two options get; `low_option_mass` below
    `min_mass`)."""
    vals = g[column].astype(float)
    keep = vals.notna()
    mass = aggregates.option_mass_columns(g, min_mass)
    if not keep.any():
        return {"family": family, "cell": cell, "metric": metric, "n": 0, "n_tasks": 0, "value": np.nan,
                "ci_low": np.nan, "ci_high": np.nan, **mass, **_paper_columns(paper),
                "note": note or "withheld: no scores"}
    tasks = aggregates.task_of(g[keep])
    total, count = aggregates.per_task(vals[keep], tasks)
    rng = np.random.default_rng([int(seed), zlib.crc32(f"{family}|{cell}|{metric}".encode())])
    lo, hi = aggregates.task_bootstrap(total, count, n_boot=n_boot, rng=rng)
    return {"family": family, "cell": cell, "metric": metric, "n": int(keep.sum()), "n_tasks": len(total),
            "value": float(vals[keep].mean()), "ci_low": lo, "ci_high": hi, **mass, **_paper_columns(paper),
            "note": note}


_SUBJECT_SUFFIX = r"-(insider|outsider)$"
_NEGATED = r"\b(?:does not|is not)\b"
RM_CELLS: tuple[tuple[str, str], ...] = (("insider", "affirmative"), ("insider", "negated"),
                                         ("outsider", "affirmative"), ("outsider", "negated"))


def rm_cells(df: pd.DataFrame) -> pd.DataFrame:
    """The table with `subject_type` (insider / outsider: who the statement is about) and
    `keyed_polarity` (affirmative / negated: the consistent option's outer verb) per row: the meta
    columns where the table has them, else read from the id's suffix and the consistent option's
    text. A set made before the two were crossed (ids without the suffix) has no subject type."""
    d = df.copy()
    if "subject_type" not in d:
        d["subject_type"] = d["id"].astype(str).str.extract(_SUBJECT_SUFFIX)[0] if "id" in d else np.nan
    if "keyed_polarity" not in d:
        negated = d["answer"].astype(str).str.contains(_NEGATED, regex=True)
        d["keyed_polarity"] = np.where(negated, "negated", "affirmative")
    return d


def _balance_note(g: pd.DataFrame) -> str:
    """How many prompts of each subject type x polarity cell a row averages over: accuracy by level
    means depth only where the four are equal (before, every outsider prompt was negated)."""
    if g["subject_type"].isna().all():
        return "subject type unknown: not crossed with polarity (a set made before tomlens crossed them)"
    counts = g.groupby(["subject_type", "keyed_polarity"]).size()
    shown = "/".join(str(int(counts.get(c, 0))) for c in RM_CELLS)
    equal = len({int(counts.get(c, 0)) for c in RM_CELLS}) == 1
    return f"insider aff/neg, outsider aff/neg: {shown}" + ("" if equal else " (unbalanced)")


def rm_summary(df: pd.DataFrame, *, n_boot: int = 1000, seed: int = 0,
               min_mass: float = aggregates.MIN_OPTION_MASS) -> pd.DataFrame:
    """Accuracy by level (1..7) x mental / non-mental, each level over the four subject type x
    polarity cells in equal parts (the note counts them), and overall mental (the row the paper's
    RM number summarises); then per subject type x polarity cell, so an answer that follows who the
    statement is about or its "not" shows. PMI_DC-corrected, the raw log-odds accuracy beside it."""
    d = df[df["family"] == RM_FAMILY] if "family" in df else df
    if d.empty:
        return pd.DataFrame(columns=SUMMARY_COLUMNS)
    d = rm_cells(rm_scores(d))
    has_pmi = d["correct_pmi"].notna().any()
    withheld = "withheld: no story-free scores (run tomlens.behaviour.epitome.enrich)"

    def pair(cell: str, g: pd.DataFrame, note: str = "", paper: tuple[float, float] | None = None) -> list[dict]:
        pmi_note = "; ".join(x for x in ("" if has_pmi else withheld, PAPER_NOTE if paper else "", note) if x)
        return [_row(RM_FAMILY, cell, "accuracy (PMI_DC)", g, "correct_pmi", n_boot=n_boot, seed=seed, paper=paper,
                     note=pmi_note, min_mass=min_mass),
                _row(RM_FAMILY, cell, "accuracy (raw log-odds)", g, "correct_raw", n_boot=n_boot, seed=seed,
                     note=note, min_mass=min_mass)]

    rows: list[dict] = []
    for mental, kind in ((True, "mental"), (False, "non-mental")):
        g = d[d["mental"].astype(bool) == mental]
        if g.empty:
            continue
        rows += pair(f"{kind}, all levels", g, _balance_note(g), PAPER["RM"] if mental else None)
        for level, gl in g.groupby("level", sort=True):
            rows += pair(f"{kind}, level {int(level)}", gl, _balance_note(gl))
        for (subject, polarity), gc in g.groupby(["subject_type", "keyed_polarity"], sort=True):
            rows += pair(f"{kind}, {subject} subject, {polarity} answer", gc)
    return pd.DataFrame(rows, columns=SUMMARY_COLUMNS)


# ---- indirect request ---------------------------------------------------------------------------

def ir_scores(df: pd.DataFrame) -> pd.DataFrame:
    """Per prompt: `logodds_yes` = log p(Yes) - log p(No), `says_yes`, and `correct_ir` (positive
    for an unaware speaker, negative for an aware one)."""
    d = df.copy()
    a_yes = d["option_a"].astype(str) == "Yes"
    b_yes = d["option_b"].astype(str) == "Yes"
    if not (a_yes ^ b_yes).all():
        raise TomlensError("indirect-request rows must have the options Yes and No",
                           "score prompts from tomlens.stimuli.epitome.indirect_request")
    la, lb = d["logp_a"].astype(float), d["logp_b"].astype(float)
    d["logodds_yes"] = np.where(a_yes, la - lb, lb - la)
    d["says_yes"] = d["logodds_yes"] > 0
    aware = d["speaker_aware"].astype(bool) if "speaker_aware" in d else d["condition"].astype(str) == "aware"
    d["correct_ir"] = d["says_yes"] != aware
    return d


def ir_summary(df: pd.DataFrame, *, n_boot: int = 1000, seed: int = 0,
               min_mass: float = aggregates.MIN_OPTION_MASS) -> pd.DataFrame:
    """Accuracy overall (the paper's IR number) and per awareness x cue, the share of "Yes", and the
    awareness effect on the log-odds (unaware - aware; GPT-3 showed none)."""
    d = df[df["family"] == IR_FAMILY] if "family" in df else df
    matched = _matched_cue(d)
    d = d[~matched]
    if d.empty:
        return pd.DataFrame(columns=SUMMARY_COLUMNS)
    d = ir_scores(d)
    rows = [_row(IR_FAMILY, "all", "accuracy", d, "correct_ir", n_boot=n_boot, seed=seed, min_mass=min_mass,
                 paper=PAPER["IR"], note=PAPER_NOTE),
            _row(IR_FAMILY, "all", "share answering Yes", d, "says_yes", n_boot=n_boot, seed=seed, min_mass=min_mass,
                 note="always Yes gives accuracy 0.5")]
    aware = d["condition"].astype(str)
    for (cond, cue), g in d.assign(_c=aware).groupby(["_c", "knowledge_cue"], sort=True):
        rows.append(_row(IR_FAMILY, f"{cond}, {cue} cue", "accuracy", g, "correct_ir", n_boot=n_boot, seed=seed,
                         min_mass=min_mass))
    # awareness effect, paired within passage and cue
    piv = d.assign(_c=aware).pivot_table(index=["task_id", "knowledge_cue"], columns="_c", values="logodds_yes")
    if {"aware", "unaware"} <= set(piv.columns):
        diff = (piv["unaware"] - piv["aware"]).dropna().rename("effect").reset_index()
        diff["id"] = diff["task_id"].astype(str) + "/" + diff["knowledge_cue"].astype(str)
        rows.append(_row(IR_FAMILY, "unaware - aware", "mean log-odds difference", diff, "effect",
                         n_boot=n_boot, seed=seed, min_mass=min_mass,
                         note="positive: the speaker's knowledge moves the answer"))
    out = pd.DataFrame(rows, columns=SUMMARY_COLUMNS)
    if matched.any():
        left = (f"{int(matched.sum())} matched-cue rows (minimal-pair wording, "
                "indirect_request(matched_cue=True)) left out: not the battery's text")
        out["note"] = [f"{n}; {left}" if n else left for n in out["note"].fillna("").astype(str)]
    return out


def _yes_no(v: Any) -> str:
    """"true"/"false" from a bool or its CSV spelling; a blank or anything else is "unknown"."""
    if isinstance(v, (bool, np.bool_)):
        return "true" if v else "false"
    text = str(v).strip().lower() if isinstance(v, str) else ""
    return text if text in ("true", "false") else "unknown"


def _flags(values: pd.Series) -> pd.Series:
    """True/False from a column that may hold booleans, "true"/"false" strings (a CSV round trip) or
    blanks; anything but an explicit true is False (`.astype(bool)` would make "false" and NaN True)."""
    return values.map(_yes_no).eq("true")


def _matched_cue(d: pd.DataFrame) -> pd.Series:
    """Rows worded for minimal pairs (`indirect_request(matched_cue=True)`): the meta flag, or the
    "-matched" id suffix where the table lost the flag."""
    flag = _flags(d["matched_cue"]) if "matched_cue" in d else pd.Series(False, index=d.index)
    if "id" in d:
        flag = flag | d["id"].astype(str).str.endswith("-matched")
    return flag


# ---- scalar implicature -------------------------------------------------------------------------

E2_CRITERIA: dict[tuple[int, str], Any] = {
    (3, "3"): lambda d2, d3: d3 > 0,
    (3, "2"): lambda d2, d3: d3 < 0,
    (3, "1"): lambda d2, d3: d3 < 0 and d2 < 0,
    (2, "2"): lambda d2, d3: d2 > 0 and d3 >= 0,
    (2, "1"): lambda d2, d3: d2 >= 0 and d3 < 0,
    (1, "1"): lambda d2, d3: d2 >= 0 and d3 >= 0,
}


def si_criterion(experiment: str, access: int, said: str, delta2: float, delta3: float, *,
                 e1_rule: str = "text") -> bool:
    """The paper's Appendix C criterion on the change in bets on 2 and 3. E1 ("Some"): with
    `e1_rule="text"` (default) bets on 3 must fall at access 3 and not fall at access < 3; with
    "table", the signs as Table 2 prints them (rise at 3, not rise below)."""
    if experiment == "E1":
        if e1_rule not in ("text", "table"):
            raise TomlensError(f"e1_rule={e1_rule!r} is not 'text' or 'table'", "use e1_rule='text' (default)")
        if e1_rule == "text":
            return delta3 < 0 if access == 3 else delta3 >= 0
        return delta3 > 0 if access == 3 else delta3 <= 0
    if experiment == "E2":
        key = (int(access), str(said))
        if key not in E2_CRITERIA:
            raise TomlensError(f"no E2 criterion for access {access}, n = {said}",
                               f"use one of {sorted(E2_CRITERIA)}")
        return bool(E2_CRITERIA[key](delta2, delta3))
    raise TomlensError(f"experiment {experiment!r} is not E1 or E2", "use the generator's meta 'experiment'")


def si_deltas(df: pd.DataFrame, *, e1_rule: str = "text") -> pd.DataFrame:
    """One row per after-utterance prompt: the bets before (its story's before prompt) and after,
    `delta_0`..`delta_3`, and `correct_si` by `si_criterion`. Needs `p_0`..`p_3` (from `enrich`)."""
    need = {f"p_{k}" for k in BETS} | {"timing", "experiment", "access", "said"}
    if not need <= set(df.columns):
        raise TomlensError(f"the table lacks {sorted(need - set(df.columns))}",
                           "score the four bets with tomlens.behaviour.epitome.enrich(model, stimuli, table)")
    story = df["story"] if "story" in df else df["task_id"]
    d = df.assign(_story=story.astype(str))
    before = d[d["timing"] == "before"].drop_duplicates("_story").set_index("_story")
    after = d[d["timing"] == "after"].copy()
    missing = sorted(set(after["_story"]) - set(before.index))
    if missing:
        raise TomlensError(f"{len(missing)} stories have no before-utterance prompt (first {missing[0]!r})",
                           "score the before prompts too (timing 'before')")
    for k in BETS:
        after[f"before_{k}"] = before.loc[after["_story"], f"p_{k}"].to_numpy()
        after[f"delta_{k}"] = after[f"p_{k}"].astype(float) - after[f"before_{k}"]
    after["correct_si"] = [si_criterion(e, int(a), str(s), d2, d3, e1_rule=e1_rule) for e, a, s, d2, d3 in zip(
        after["experiment"], after["access"], after["said"], after["delta_2"], after["delta_3"], strict=True)]
    return after.drop(columns="_story")


def constant_preference_chance(df: pd.DataFrame) -> float:
    """The best two-option accuracy of a model that ignores the prompt and ranks the counts in one
    fixed order (max over the 24 orders of "0".."3"): the chance level of the coarse view."""
    a, b, ans = df["option_a"].astype(str), df["option_b"].astype(str), df["answer"].astype(str)
    foil = b.where(ans == a, a)
    best = 0.0
    for order in itertools.permutations(BETS):
        rank = {k: i for i, k in enumerate(order)}
        best = max(best, float(np.mean([rank.get(x, 9) < rank.get(y, 9) for x, y in zip(ans, foil, strict=True)])))
    return best


def si_two_option_rows(d: pd.DataFrame, *, n_boot: int, seed: int,
                       min_mass: float = aggregates.MIN_OPTION_MASS) -> list[dict[str, Any]]:
    """The coarse two-option view (the table's `correct`) with its chance made explicit: the same
    items' accuracy for the best constant preference (always "3" scores 0.6 by design). Not the
    paper's measure; the Δbet rows are."""
    if not {"correct", "option_a", "option_b", "answer"} <= set(d.columns) or d.empty:
        return []
    chance = constant_preference_chance(d)
    row = _row(SI_FAMILY, "two-option view", "accuracy (coarse; not the paper's measure)", d, "correct",
               n_boot=n_boot, seed=seed, min_mass=min_mass,
               note=f"chance = {chance:.2f}: a constant preference (always '3') scores this without reading the prompt")
    return [row, {"family": SI_FAMILY, "cell": "two-option view", "metric": "chance: best constant preference",
                  "n": int(len(d)), "n_tasks": int(aggregates.task_of(d).nunique()), "value": chance,
                  "ci_low": np.nan, "ci_high": np.nan, **aggregates.option_mass_columns(d, min_mass),
                  **_paper_columns(None), "note": "max over the 24 fixed orders of 0..3"}]


def si_summary(df: pd.DataFrame, *, n_boot: int = 1000, seed: int = 0, e1_rule: str = "text",
               min_mass: float = aggregates.MIN_OPTION_MASS) -> pd.DataFrame:
    """Accuracy by the Δbet criteria for E1 and E2 (the paper's numbers) and per (access, n), with
    the mean Δbet on 2 and 3 per cell (withheld without the four bets); first, the coarse
    two-option view's accuracy beside its constant-preference chance (0.6, not 0.5)."""
    d = df[df["family"] == SI_FAMILY] if "family" in df else df
    if d.empty:
        return pd.DataFrame(columns=SUMMARY_COLUMNS)
    if not {f"p_{k}" for k in BETS} <= set(d.columns) or d["p_0"].isna().all():
        return pd.DataFrame(si_two_option_rows(d, n_boot=n_boot, seed=seed, min_mass=min_mass) + [
                             {"family": SI_FAMILY, "cell": exp, "metric": "accuracy (Δbet criteria)", "n": 0,
                              "n_tasks": 0, "value": np.nan, "ci_low": np.nan, "ci_high": np.nan,
                              **aggregates.option_mass_columns(d, min_mass), **_paper_columns(PAPER[f"SI {exp}"]),
                              "note": "withheld: no bets over 0..3 (run tomlens.behaviour.epitome.enrich)"}
                             for exp in ("E1", "E2")], columns=SUMMARY_COLUMNS)
    a = si_deltas(d, e1_rule=e1_rule)
    rows = si_two_option_rows(d, n_boot=n_boot, seed=seed, min_mass=min_mass)
    for exp, g in a.groupby("experiment", sort=True):
        rows.append(_row(SI_FAMILY, exp, "accuracy (Δbet criteria)", g, "correct_si", n_boot=n_boot, seed=seed,
                         min_mass=min_mass, paper=PAPER[f"SI {exp}"],
                         note=PAPER_NOTE + (f"; E1 rule: {e1_rule}" if exp == "E1" else "")))
        for (acc, said), gc in g.groupby(["access", "said"], sort=True):
            cell = f"{exp}, a={int(acc)}, n={said}"
            rows.append(_row(SI_FAMILY, cell, "accuracy (Δbet criteria)", gc, "correct_si", n_boot=n_boot, seed=seed,
                             min_mass=min_mass))
            for k in ("2", "3"):
                rows.append(_row(SI_FAMILY, cell, f"mean Δbet on {k}", gc, f"delta_{k}", n_boot=n_boot, seed=seed,
                                 min_mass=min_mass))
    return pd.DataFrame(rows, columns=SUMMARY_COLUMNS)


# ---- false belief (the factorial as EPITOME's first task) ---------------------------------------

def fb_summary(df: pd.DataFrame, *, n_boot: int = 1000, seed: int = 0,
               min_mass: float = aggregates.MIN_OPTION_MASS) -> pd.DataFrame:
    """Belief-prompt accuracy by the sign of log p(Start) - log p(End) (overall: the paper's FB
    number; and per knowledge state) and the knowledge-state effect from
    `aggregates.knowledge_state_effect` (mean paired FB - TB log-odds)."""
    d = df[(df["family"] == FB_FAMILY) & (df["prompt_type"] == "belief")] if "family" in df else df
    if d.empty:
        return pd.DataFrame(columns=SUMMARY_COLUMNS)
    rows = [_row(FB_FAMILY, "all belief prompts", "accuracy (log-odds sign)", d, "correct", n_boot=n_boot,
                 seed=seed, paper=PAPER["FB"], note=PAPER_NOTE, min_mass=min_mass)]
    for cond, g in d.groupby("condition", sort=True):
        rows.append(_row(FB_FAMILY, str(cond), "accuracy (log-odds sign)", g, "correct", n_boot=n_boot, seed=seed,
                         min_mass=min_mass))
    eff = aggregates.knowledge_state_effect(d, n_boot=n_boot, seed=seed, min_mass=min_mass)
    for r in eff.to_dict(orient="records"):
        rows.append({"family": FB_FAMILY, "cell": f"false - true belief ({r['contrast']})",
                     "metric": "knowledge-state effect on log p(Start) - log p(End)", "n": int(r["n_pairs"]),
                     "n_tasks": int(r["n_tasks"]), "value": float(r["effect"]), "ci_low": float(r["ci_low"]),
                     "ci_high": float(r["ci_high"]), **{c: r.get(c, np.nan) for c in aggregates.MASS_COLUMNS},
                     **_paper_columns(None), "note": "positive: the answer follows what the protagonist saw"})
    return pd.DataFrame(rows, columns=SUMMARY_COLUMNS)


# ---- free-text tasks: export for human coding, import, score ------------------------------------

CODING_COLUMNS: list[str] = ["id", "family", "story_id", "kind", "question_type", "question", "answer",
                             "cut_off", "rubric", "max_score", "allowed", "code"]
# The columns a coded sheet must keep to be imported (sheets exported before `cut_off` and `allowed`
# existed still import: neither changes a score).
REQUIRED_CODING_COLUMNS: list[str] = ["id", "family", "story_id", "kind", "question_type", "question", "answer",
                                      "rubric", "max_score", "code"]
CUT_OFF_NOTE = ("[cut off: decoding stopped at the token limit, not at the answer's end, so the answer may be "
                "incomplete; code the text as written]")


def export_for_coding(answers: pd.DataFrame, path: str | Path) -> Path:
    """Write the generated answers with their rubric as CSV for a human coder, who fills `code`
    (an integer from 0 to `max_score`, the values listed in `allowed`). `answers` is
    `generate.generate_answers`'s table. `cut_off` is true where decoding stopped at the token limit
    (or the context window) rather than at the answer's end, and such rows' rubric starts with a
    note saying so; a table without `cut_off` or `stop_reason` writes "unknown"."""
    need = set(REQUIRED_CODING_COLUMNS) - {"code"}
    if not need <= set(answers.columns):
        raise TomlensError(f"the answers table lacks {sorted(need - set(answers.columns))}",
                           "pass the table from tomlens.behaviour.generate.generate_answers")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    out = answers[[c for c in REQUIRED_CODING_COLUMNS if c != "code"]].copy()
    if "cut_off" in answers:
        cut = answers["cut_off"].map(_yes_no)
    elif "stop_reason" in answers:
        cut = answers["stop_reason"].map(lambda r: "unknown" if not isinstance(r, str) or not r
                                         else "true" if r in CUT_OFF_REASONS else "false")
    else:
        cut = pd.Series("unknown", index=answers.index)
    out["cut_off"] = cut
    out["rubric"] = [f"{CUT_OFF_NOTE} {r}" if c == "true" else str(r) for c, r in zip(out["cut_off"], out["rubric"], strict=True)]
    out["allowed"] = out["max_score"].map(allowed_codes)
    out["code"] = ""
    out = out[CODING_COLUMNS]
    tmp = path.with_suffix(path.suffix + ".tmp")
    out.to_csv(tmp, index=False, quoting=csv.QUOTE_NONNUMERIC)
    tmp.replace(path)
    return path


def import_codes(path: str | Path, items: Sequence[Any] | None = None) -> pd.DataFrame:
    """Read a coded CSV back. Every item of `items` (default: all free-text items of the families in
    the file, `tomlens.stimuli.epitome.free_text_items`) must appear exactly once and no other id
    may; `max_score` comes from the items, not the CSV (an edited CSV cannot raise a maximum); every
    `code` must be an integer in 0..max_score (a blank is an error: an uncoded answer must not
    count as 0)."""
    path = Path(path)
    if not path.exists():
        raise TomlensError(f"no coded file at {path}",
                           "pass the coding.csv that `tomlens freetext answer --out DIR` wrote (DIR/coding.csv; "
                           "in Python, export_for_coding's CSV), with `code` filled on every row")
    d = pd.read_csv(path, dtype={"code": str, "id": str})
    if not set(REQUIRED_CODING_COLUMNS) <= set(d.columns):
        raise TomlensError(f"{path} lacks columns {sorted(set(REQUIRED_CODING_COLUMNS) - set(d.columns))}",
                           "keep the columns export_for_coding wrote")
    if items is None:
        items = [it for fam in sorted(set(d["family"].astype(str))) for it in free_text_items(fam)]
    expected = {it.id: it for it in items}
    counts = d["id"].value_counts()
    dup = sorted(counts[counts > 1].index)
    unknown = sorted(set(d["id"]) - set(expected))
    missing = sorted(set(expected) - set(d["id"]))
    if dup or unknown or missing:
        found = (("repeated", dup), ("unknown", unknown), ("missing", missing))
        what = "; ".join(f"{k} {v[:3]}" for k, v in found if v)
        raise TomlensError(f"{path}: each exported id must appear exactly once ({what})",
                           "code the coding.csv `tomlens freetext answer` wrote without adding, copying or "
                           "deleting rows, and keep its config.json beside it (it names the exported items; "
                           "in Python, pass them as `items`)")
    d["max_score"] = [expected[i].max_score for i in d["id"]]
    codes = pd.to_numeric(d["code"].fillna("").str.strip(), errors="coerce")
    bad = d[codes.isna() | (codes != codes.round()) | (codes < 0) | (codes > d["max_score"])]
    if len(bad):
        # sheet lines as a spreadsheet numbers them: the header is line 1
        shown = [f"line {i + 2} ({r['id']}: " + (f"{r['code'].strip()!r}" if isinstance(r["code"], str)
                 and r["code"].strip() else "blank") + f", allowed {allowed_codes(r['max_score'])})"
                 for i, r in bad.head(8).iterrows()]
        more = f" and {len(bad) - 8} more" if len(bad) > 8 else ""
        raise TomlensError(f"{len(bad)} rows of {path} have no valid code: " + "; ".join(shown) + more,
                           "fill `code` with one of the row's allowed values (an integer from 0 to max_score) "
                           "on every row; a blank is not 0")
    return d.assign(code=codes.astype(int))


def free_text_summary(coded: pd.DataFrame, *, n_boot: int = 1000, seed: int = 0) -> pd.DataFrame:
    """Mean score as a share of the maximum per family and question type (the paper's ShS RC /
    EMSR / SMSI and StS numbers), with a bootstrap interval over questions. Strange Stories: the
    justification mean over all mental stories is the row compared with the paper (the model's
    justifications are not filtered on its own comprehension answers, since its justification
    prompt already carries the right answer); the mean over stories whose comprehension it got
    right is a secondary row (the paper removed human trials that way)."""
    d = coded.copy()
    d["score"] = d["code"].astype(float) / d["max_score"].astype(float)
    rows = []
    sts = d[d["family"] == "strange-stories"]
    if not sts.empty:
        comp = sts[sts["question_type"] == "comprehension"].set_index("story_id")["code"]
        just = sts[sts["question_type"] == "justification"].copy()
        just = just.assign(_ok=comp.reindex(just["story_id"]).to_numpy() == 1, task_id=just["id"])
        mental = just["kind"].astype(str) != "control"
        for label, g in (("mental", just[mental]), ("control", just[~mental])):
            paper = PAPER["StS"] if label == "mental" else None
            rows.append(_row("strange-stories", f"justification, {label}", "mean score / 2", g, "score",
                             n_boot=n_boot, seed=seed, paper=paper, note=PAPER_NOTE if paper else ""))
            kept = g[g["_ok"]]
            rows.append(_row("strange-stories", f"justification, {label}, comprehension right",
                             "mean score / 2 (secondary)", kept, "score", n_boot=n_boot, seed=seed,
                             note=f"{int((~g['_ok']).sum())} justifications dropped after a wrong comprehension "
                                  "answer (the paper's filter for humans)"))
        cg = sts[sts["question_type"] == "comprehension"]
        rows.append(_row("strange-stories", "comprehension", "share correct", cg.assign(task_id=cg["id"]),
                         "score", n_boot=n_boot, seed=seed))
    shs = d[d["family"] == "short-story"]
    for kind, g in shs.groupby("question_type", sort=True):
        note = PAPER_NOTE if f"ShS {kind}" in PAPER else ""
        if kind == "RC":
            note += f"; {len(g)} RC questions here, 5 in the paper"
        rows.append(_row("short-story", str(kind), "mean score / max", g.assign(task_id=g["id"]), "score",
                         n_boot=n_boot, seed=seed, paper=PAPER.get(f"ShS {kind}"), note=note))
    return pd.DataFrame(rows, columns=SUMMARY_COLUMNS)


def summaries(df: pd.DataFrame, *, n_boot: int = 1000, seed: int = 0) -> dict[str, pd.DataFrame]:
    """Every EPITOME family's summary present in a behaviour table."""
    fams = set(df["family"].astype(str)) if "family" in df else set()
    fns = {FB_FAMILY: fb_summary, RM_FAMILY: rm_summary, IR_FAMILY: ir_summary, SI_FAMILY: si_summary}
    return {f: fn(df, n_boot=n_boot, seed=seed) for f, fn in fns.items() if f in fams}


__all__ = ["BETS", "CODING_COLUMNS", "CUT_OFF_NOTE", "PAPER", "REQUIRED_CODING_COLUMNS", "SUMMARY_COLUMNS",
           "bet_scores", "constant_preference_chance", "enrich",
           "export_for_coding", "fb_summary", "free_text_summary", "import_codes", "ir_scores", "ir_summary",
           "rm_scores", "rm_summary", "si_criterion", "si_deltas", "si_summary", "si_two_option_rows",
           "story_free_scores", "story_free_stimuli", "summaries"]
