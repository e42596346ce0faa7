"""The seed papers' batteries: for each family, the function that summarises a behaviour table the
way its paper reports it (one row per reported cell, with intervals and the paper's number), and the
scoring a paper needs beyond the two options' log-probs (a story-free baseline, bets over counts,
case variants), which the behaviour stage runs before it summarises."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence

import pandas as pd

from tomlens.behaviour import epitome, kosoy, motomqa
from tomlens.behaviour.aggregates import MIN_OPTION_MASS
from tomlens.models.protocol import Model
from tomlens.stimuli.records import Stimulus


def _motomqa_pooled(model: Model, stimuli: Sequence[Stimulus], table: pd.DataFrame, *, batch_size: int = 8,
                    progress: bool = False) -> pd.DataFrame:
    """Street et al.'s P(true) pooled over the answer's case variants, joined to the motomqa rows."""
    rows = [s for s in stimuli if s.family == "motomqa"]
    pooled = motomqa.pooled_scores(model, rows, batch_size=batch_size, progress=progress)
    motomqa.add_pooled(table[table["family"].astype(str) == "motomqa"], pooled)  # raises if a row lacks its score
    return table.merge(pooled, on="id", how="left", validate="one_to_one")


# family -> summary(df[, n_boot, seed]) -> the paper's table
BATTERIES: dict[str, Callable[..., pd.DataFrame]] = {
    "false-belief-factorial": epitome.fb_summary,  # EPITOME (Jones, Trott & Bergen)
    epitome.RM_FAMILY: epitome.rm_summary,
    "indirect-request": epitome.ir_summary,
    epitome.SI_FAMILY: epitome.si_summary,
    "motomqa": motomqa.summary,  # Street et al.
    "kosoy": kosoy.summary,  # Kosoy et al.'s developmental battery
}
# family -> enrich(model, stimuli, table, batch_size=, progress=) -> the table with its extra columns
ENRICHERS: dict[str, Callable[..., pd.DataFrame]] = {
    epitome.RM_FAMILY: epitome.enrich,  # story-free scores for PMI_DC
    epitome.SI_FAMILY: epitome.enrich,  # the bets over "0".."3"
    "motomqa": _motomqa_pooled,  # P(true) pooled over True/true/TRUE
}


def enrich_table(model: Model, stimuli: Sequence[Stimulus], table: pd.DataFrame, *, batch_size: int = 8,
                 progress: bool = False) -> pd.DataFrame:
    """The behaviour table with every present battery's extra scores (each enricher runs once,
    however many of its families are present)."""
    present = set(table["family"].astype(str)) if "family" in table.columns else set()
    done: set[int] = set()
    for family, fn in ENRICHERS.items():
        if family in present and id(fn) not in done:
            table = fn(model, stimuli, table, batch_size=batch_size, progress=progress)
            done.add(id(fn))
    return table


def battery_summaries(df: pd.DataFrame, *, n_boot: int = 1000, seed: int = 0,
                      min_mass: float = MIN_OPTION_MASS) -> dict[str, pd.DataFrame]:
    """The summary of every battery family present in a behaviour table; the run's `n_boot`,
    `seed` and option-mass threshold `min_mass` go to each summary function that accepts them (a
    summary reports its cells' option mass with `aggregates.option_mass_columns(cell, min_mass)`)."""
    if "family" not in df.columns:
        return {}
    present = set(df["family"].astype(str))
    out = {}
    for family, fn in BATTERIES.items():
        if family in present:
            params = inspect.signature(fn).parameters
            kwargs = {k: v for k, v in (("n_boot", n_boot), ("seed", seed), ("min_mass", min_mass)) if k in params}
            out[family] = fn(df[df["family"] == family], **kwargs)
    return out


HEADLINE_ROWS = 12


def paper_columns(table: pd.DataFrame) -> list[str]:
    """The columns that hold a paper's number (each named for what it is: `paper_other_items_gpt4`,
    `paper_lrs`, ...); `paper_condition` is a label, not a number."""
    return [c for c in table.columns if c.startswith("paper") and c != "paper_condition"
            and pd.api.types.is_numeric_dtype(table[c])]


def headline(summary: pd.DataFrame) -> tuple[pd.DataFrame, str]:
    """The rows of a battery summary a terminal shows, and what they are: the paper's own headline
    cells (Kosoy's domains and contrast; elsewhere the rows with the paper's number) plus any flagged
    row (e.g. "answers 'false' to 95% of statements"), or the first rows when the paper gives no
    number; at most HEADLINE_ROWS, without columns that are empty there, repeat the family or hold
    long notes. Blank strings count as empty, so the text is the same before and after a CSV reload.
    The full table is the CSV and the report."""
    table = summary.replace("", pd.NA)
    flagged = table["flag"].notna() if "flag" in table.columns else pd.Series(False, index=table.index)
    if "level" in table.columns and (table["level"] != "cell").any():
        keep, what = (table["level"] != "cell") | flagged, "the paper's headline cells"
    elif paper_columns(table) and table[paper_columns(table)].notna().any(axis=None):
        keep, what = table[paper_columns(table)].notna().any(axis=1) | flagged, "the paper's headline cells"
    else:
        keep, what = pd.Series(True, index=table.index), "the first rows"
    room = max(0, HEADLINE_ROWS - int(flagged.sum()))
    chosen = flagged | (keep & (keep.cumsum() <= room))  # every flag, then the first headline rows
    rows = table[chosen].head(HEADLINE_ROWS).drop(columns=[c for c in ("note", "family") if c in table.columns])
    return rows.dropna(axis=1, how="all"), what
