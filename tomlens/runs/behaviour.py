"""The behaviour stage: score a model on stimuli, aggregate with the papers' rules, save the tables."""

from __future__ import annotations

import ast
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from tomlens.behaviour import aggregates
from tomlens.behaviour.scoring import score
from tomlens.errors import TomlensError
from tomlens.io import read_table, write_json, write_table
from tomlens.runs.base import ModelSpec, StimuliSpec, config_from_dict
from tomlens.provenance import run_manifest
from tomlens.runs.files import begin_save, finish_save, read_finished
from tomlens.stimuli.records import Stimulus, stimuli_hash

# Optional tables: written only when non-empty (an empty one is absent, and loads back empty).
_OPTIONAL = ("strict", "object_bias", "selective", "prefix_curves")
# Interval columns of `selective` hold (low, high) tuples, which a CSV holds as their text.
_INTERVALS = ("animate_vs_inanimate", "animate_vs_control", "inanimate_vs_control")


def _read_optional(path: Path) -> pd.DataFrame:
    if not path.is_file():
        return pd.DataFrame()
    df = pd.read_csv(path)  # pandas 3 reads floats back exactly
    for col in _INTERVALS:
        if col in df:
            df[col] = [tuple(float(x) for x in ast.literal_eval(v)) if isinstance(v, str) else v for v in df[col]]
    return df


@dataclass(frozen=True)
class BehaviourConfig:
    """Which model scores which stimuli; `seed` drives the aggregates' bootstrap intervals."""

    model: ModelSpec = ModelSpec()
    stimuli: tuple[StimuliSpec, ...] = ()
    batch_size: int = 8
    seed: int = 0

    def __post_init__(self) -> None:
        stimuli = self.stimuli
        if isinstance(stimuli, (StimuliSpec, Mapping)):  # one table where a list was meant
            stimuli = (stimuli,)
        stimuli = tuple(config_from_dict(StimuliSpec, s, where=f"stimuli[{i}]") if isinstance(s, Mapping) else s
                        for i, s in enumerate(stimuli))
        object.__setattr__(self, "stimuli", stimuli)
        if not stimuli:
            raise TomlensError("a behaviour run needs stimuli",
                               'add e.g. stimuli = [{family = "unexpected-transfer", n = 8}] or --stimuli FILE')
        if self.batch_size < 1:
            raise TomlensError(f"batch_size = {self.batch_size} must be at least 1", "use batch_size = 1 or more")


@dataclass(frozen=True)
class BehaviourResult:
    table: pd.DataFrame  # one row per prompt
    accuracy: pd.DataFrame  # family x condition x prompt type
    strict: pd.DataFrame  # Kosinski's all-prompts-right rule per family
    object_bias: pd.DataFrame  # Ruis et al. o_b per cell (empty without goal prompts)
    selective: pd.DataFrame  # selective-encoding criterion per group
    prefix_curves: pd.DataFrame  # probability over sentence prefixes
    summary: dict
    config: BehaviourConfig | None = None
    manifest: dict = field(default_factory=dict)

    def save(self, out: str | Path) -> Path:
        """prompts.parquet, accuracy.csv, the non-empty optional tables, summary.json, config.json,
        manifest.json and, last, result.json."""
        out = begin_save(out)
        write_table(self.table, out / "prompts.parquet")
        write_table(self.accuracy, out / "accuracy.csv")
        for name in _OPTIONAL:
            df, path = getattr(self, name), out / f"{name}.csv"
            if len(df):
                write_table(df, path)
            elif path.exists():
                path.unlink()  # from an earlier run into the same folder: it does not belong to this one
        write_json(self.summary, out / "summary.json")
        return finish_save(out, self.config, self.manifest, self.summary)

    @classmethod
    def load(cls, out: str | Path) -> BehaviourResult:
        out, config, manifest, summary = read_finished(out, BehaviourConfig)
        optional = {name: _read_optional(out / f"{name}.csv") for name in _OPTIONAL}
        return cls(table=read_table(out / "prompts.parquet"), accuracy=_read_optional(out / "accuracy.csv"),
                   summary=summary, config=config, manifest=manifest, **optional)

    def describe(self) -> str:
        """The accuracy table and, for false-belief stories, the strict whole-task table."""
        text = format_accuracy(self.accuracy)
        if len(self.strict):
            text += "\n" + self.strict.to_string(index=False)
        return text


def format_accuracy(acc: pd.DataFrame) -> str:
    """One line per family x condition x prompt type: n and accuracy with its 95% interval."""
    lines = [f"{'family':<22}{'condition':<16}{'prompt':<9}{'n':>5}  accuracy [95% CI]"]
    for r in acc.itertuples():
        lines.append(f"{r.family:<22}{r.condition:<16}{r.prompt_type:<9}{r.n:>5}  "
                     f"{r.accuracy:.2f} [{r.ci_low:.2f}, {r.ci_high:.2f}]")
    return "\n".join(lines)


def load_stimuli(specs: Sequence[StimuliSpec]) -> list[Stimulus]:
    """Every spec's stimuli, in order."""
    return [s for spec in specs for s in spec.load()]


def run(config: BehaviourConfig, *, model: Any = None, progress: bool = True) -> BehaviourResult:
    """Score `config.stimuli` with `config.model` (or the loaded `model`)."""
    stimuli = load_stimuli(config.stimuli)  # a bad file fails before the model loads
    if model is None:
        model = config.model.load()
    result = run_behaviour(model, stimuli, batch_size=config.batch_size, progress=progress, seed=config.seed)
    manifest = run_manifest(model, config, stimuli_hash=stimuli_hash(stimuli))
    return BehaviourResult(result.table, result.accuracy, result.strict, result.object_bias, result.selective,
                           result.prefix_curves, result.summary, config=config, manifest=manifest)


def run_behaviour(model: Any, stimuli: Sequence[Stimulus], *, batch_size: int = 8,
                  progress: bool = True, seed: int = 0) -> BehaviourResult:
    """The engine of `run`: score loaded stimuli with a loaded model."""
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
