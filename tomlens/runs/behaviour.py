"""The behaviour job: score a model on stimuli, aggregate with the papers' rules, write the results."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import pandas as pd

from tomlens.errors import TomlensError
from tomlens.behaviour import aggregates
from tomlens.behaviour.scoring import score
from tomlens.io import write_json, write_table
from tomlens.stimuli.records import Stimulus, stimuli_hash


@dataclass(frozen=True)
class BehaviourResult:
    table: pd.DataFrame  # one row per prompt
    accuracy: pd.DataFrame  # family x condition x prompt type
    strict: pd.DataFrame  # Kosinski's all-prompts-right rule per family
    object_bias: pd.DataFrame  # Ruis et al. o_b per cell (empty without goal prompts)
    selective: pd.DataFrame  # selective-encoding criterion per group
    prefix_curves: pd.DataFrame  # probability over sentence prefixes
    summary: dict


def run_behaviour(model, stimuli: Sequence[Stimulus], *, batch_size: int = 8,
                  progress: bool = True, seed: int = 0) -> BehaviourResult:
    from tomlens.models import provenance

    stimuli = list(stimuli)
    if not stimuli:
        raise TomlensError("no stimuli to score", "check the stimulus file: it has no rows")
    t0 = time.time()
    table = score(model, stimuli, batch_size=batch_size, progress=progress)
    acc = aggregates.accuracy_table(table)
    fb = table[table["family"].isin(["unexpected-transfer", "unexpected-contents"])
               & table["prefix_index"].isna()] if "prefix_index" in table else \
        table[table["family"].isin(["unexpected-transfer", "unexpected-contents"])]
    strict = aggregates.strict_task_pass(fb) if len(fb) else pd.DataFrame()
    has_goal = "object_target" in table and (table["prompt_type"] == "goal").any()
    ob = aggregates.object_bias_table(table, seed=seed) if has_goal else pd.DataFrame()
    sel = aggregates.selective_encoding(table, seed=seed) if has_goal else pd.DataFrame()
    curves = aggregates.prefix_curves(table)
    summary = {
        "provenance": {**provenance(model), "stimuli_hash": stimuli_hash(stimuli),
                       "n_stimuli": len(stimuli), "seed": seed,
                       "scoring": "sum of option-token log-probs with a leading space; "
                                  "p(a)/(p(a)+p(b)); first-token variant alongside",
                       "seconds": round(time.time() - t0, 2)},
        "accuracy": acc.to_dict(orient="records"),
        "strict_task_pass": strict.to_dict(orient="records"),
        "object_bias": ob.to_dict(orient="records"),
        "selective_encoding": sel.to_dict(orient="records"),
    }
    return BehaviourResult(table, acc, strict, ob, sel, curves, summary)


def write_behaviour(result: BehaviourResult, out: str | Path) -> Path:
    out = Path(out)
    write_table(result.table, out / "prompts.parquet")
    write_table(result.accuracy, out / "accuracy.csv")
    for name in ("strict", "object_bias", "selective", "prefix_curves"):
        df, path = getattr(result, name), out / f"{name}.csv"
        if len(df):
            write_table(df, path)
        elif path.exists():
            path.unlink()  # from an earlier run into the same folder: it does not belong to this one
    write_json(result.summary, out / "summary.json")
    return out
