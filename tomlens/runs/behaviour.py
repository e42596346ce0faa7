"""The behaviour stage: score a model on stimuli, aggregate with the papers' rules, save the tables."""

from __future__ import annotations

import ast
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pandas as pd

from tomlens.behaviour import aggregates
from tomlens.behaviour.batteries import battery_summaries, enrich_table, headline
from tomlens.behaviour.scoring import score
from tomlens.errors import TomlensError
from tomlens.io import read_table, write_json, write_table
from tomlens.runs.base import ModelSpec, StimuliSpec, config_from_dict
from tomlens.provenance import run_manifest
from tomlens.runs.files import begin_save, finish_save, read_finished
from tomlens.stimuli.records import Stimulus, stimuli_hash

# Optional tables: written only when non-empty (an empty one is absent, and loads back empty).
_OPTIONAL = ("strict", "object_bias", "selective", "prefix_curves", "reality_gated", "knowledge_state")
# File names where they differ from the field's.
_FILES = {"knowledge_state": "knowledge_state_effect"}
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
    """Which model scores which stimuli; `seed` and `n_boot` drive the aggregates' bootstrap
    intervals (whole tasks resampled)."""

    model: ModelSpec = ModelSpec()
    stimuli: tuple[StimuliSpec, ...] = ()
    batch_size: int = 8
    seed: int = 0
    n_boot: int = 1000

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
        if self.n_boot < 1:
            raise TomlensError(f"n_boot = {self.n_boot} must be at least 1", "use e.g. n_boot = 1000")


@dataclass(frozen=True)
class BehaviourResult:
    table: pd.DataFrame  # one row per prompt
    accuracy: pd.DataFrame  # family x condition x prompt type, task-bootstrap intervals
    strict: pd.DataFrame  # Kosinski's all-prompts-right rule per family
    object_bias: pd.DataFrame  # Ruis et al. o_b per cell (empty without goal prompts)
    selective: pd.DataFrame  # selective-encoding criterion per group
    prefix_curves: pd.DataFrame  # probability over sentence prefixes
    summary: dict
    config: BehaviourConfig | None = None
    manifest: dict = field(default_factory=dict)
    reality_gated: pd.DataFrame = field(default_factory=pd.DataFrame)  # belief accuracy on reality-right stories
    knowledge_state: pd.DataFrame = field(default_factory=pd.DataFrame)  # paired FB - TB log-odds effect
    batteries: dict[str, pd.DataFrame] = field(default_factory=dict)  # family -> its paper's summary table

    def save(self, out: str | Path) -> Path:
        """prompts.parquet, accuracy.csv, the non-empty optional tables (reality_gated.csv and
        knowledge_state_effect.csv among them), battery_<family>.csv per battery, summary.json,
        config.json, manifest.json and, last, result.json."""
        out = begin_save(out)
        write_table(self.table, out / "prompts.parquet")
        write_table(self.accuracy, out / "accuracy.csv")
        for stale in out.glob("battery_*.csv"):
            if stale.stem.removeprefix("battery_") not in self.batteries:
                stale.unlink()  # from an earlier run into the same folder
        for family, df in self.batteries.items():
            write_table(df, out / f"battery_{family}.csv")
        for name in _OPTIONAL:
            df, path = getattr(self, name), out / f"{_FILES.get(name, name)}.csv"
            if len(df):
                write_table(df, path)
            elif path.exists():
                path.unlink()  # from an earlier run into the same folder: it does not belong to this one
        write_json(self.summary, out / "summary.json")
        return finish_save(out, self.config, self.manifest, self.summary)

    @classmethod
    def load(cls, out: str | Path) -> BehaviourResult:
        out, config, manifest, summary = read_finished(out, BehaviourConfig)
        optional = {name: _read_optional(out / f"{_FILES.get(name, name)}.csv") for name in _OPTIONAL}
        batteries = {family: _read_optional(out / f"battery_{family}.csv") for family in summary.get("batteries", [])}
        return cls(table=read_table(out / "prompts.parquet"), accuracy=_read_optional(out / "accuracy.csv"),
                   summary=summary, config=config, manifest=manifest, batteries=batteries, **optional)

    def describe(self) -> str:
        """Accuracy with task-bootstrap intervals, Kosinski's strict table, reality-gated belief
        accuracy, the knowledge-state effect and the selective-encoding verdicts, when present."""
        text = format_accuracy(self.accuracy)
        if len(self.strict):
            text += "\n" + self.strict.to_string(index=False)
        for block in (format_gated(self.reality_gated), format_knowledge_state(self.knowledge_state),
                      format_selective(self.selective)):
            if block:
                text += "\n" + block
        for family, df in sorted(self.batteries.items()):  # one order, before and after a reload
            top, what = headline(df)
            if top.empty:
                text += f"\n{family}: no rows"
                continue
            shown = top.astype(object).where(top.notna(), "")
            text += (f"\n{family}: {what} ({len(top)} of {len(df)} rows; all of them in battery_{family}.csv "
                     "and the report):\n" + shown.to_string(index=False))
        return text


def _iv(lo: float, hi: float, fmt: str = ".2f") -> str:
    return "[n/a: one task]" if math.isnan(lo) or math.isnan(hi) else f"[{lo:{fmt}}, {hi:{fmt}}]"


# Below this many tasks a percentile bootstrap over tasks sees too little between-task spread to
# trust (two tasks that both score 0.5 give the interval [0.5, 0.5]); such rows are marked.
FEW_TASKS = 5


def format_accuracy(acc: pd.DataFrame) -> str:
    """One line per family x condition x prompt type: prompts, tasks and accuracy with its 95%
    interval from a bootstrap over tasks; rows with fewer than FEW_TASKS tasks are marked *."""
    lines = [f"{'family':<24}{'condition':<16}{'prompt':<9}{'n':>5}{'tasks':>6}  accuracy [95% CI] (whole tasks resampled)"]
    few = False
    for r in acc.itertuples():
        n_tasks = getattr(r, "n_tasks", float("nan"))
        mark = " *" if n_tasks < FEW_TASKS else ""
        few = few or bool(mark)
        lines.append(f"{r.family:<24}{r.condition:<16}{r.prompt_type:<9}{r.n:>5}{n_tasks:>6}  "
                     f"{r.accuracy:.2f} {_iv(r.ci_low, r.ci_high)}{mark}")
    if few:
        lines.append(f"* fewer than {FEW_TASKS} tasks: the interval understates the uncertainty; use more tasks")
    return "\n".join(lines)


def format_gated(gated: pd.DataFrame) -> str:
    """Belief accuracy on stories whose reality prompt is right, one line per family x condition."""
    if gated.empty:
        return ""
    lines = ["belief accuracy gated on the reality prompt (kept / dropped stories):"]
    for r in gated.itertuples():
        acc = "n/a (none kept)" if r.n_kept == 0 else f"{r.accuracy:.2f} {_iv(r.ci_low, r.ci_high)}"
        lines.append(f"  {r.family:<24}{r.condition:<16}{r.n_kept:>4} / {r.n_dropped:<4} {acc}"
                     f"  joint {r.joint_accuracy:.2f}")
    return "\n".join(lines)


def format_knowledge_state(effect: pd.DataFrame) -> str:
    """The paired FB - TB log-odds effect per family and control. An effect from fewer than two
    tasks has no interval and reads "n tasks too few"; one whose interval has zero width (every
    task the same) or comes from fewer than FEW_TASKS tasks is marked *, never shown as a finding."""
    if effect.empty:
        return ""
    lines = ["knowledge-state effect, FB - TB log-odds of the start answer (> 0: follows belief):"]
    few = False
    for r in effect.itertuples():
        kind = getattr(r, "contrast_kind", "knowledge")
        kind = kind if isinstance(kind, str) else "knowledge"
        if r.n_tasks < 2 or math.isnan(r.ci_low) or math.isnan(r.ci_high):
            iv = "(n tasks too few: no interval)"
        else:
            iv = _iv(r.ci_low, r.ci_high, "+.3g")
            if r.ci_high - r.ci_low <= 0 or r.n_tasks < FEW_TASKS:
                iv += " *"
                few = True
        lines.append(f"  {r.family:<24}vs {r.contrast:<16}{kind + ' contrast':<19}{r.effect:+.3g} {iv}"
                     f"  pairs {r.n_pairs}, tasks {r.n_tasks}, positive in {r.share_tasks_positive:.0%} of tasks")
    if few:
        lines.append(f"* fewer than {FEW_TASKS} tasks or a zero-width interval: not evidence of an effect; use more tasks")
    return "\n".join(lines)


def format_selective(sel: pd.DataFrame) -> str:
    """Ruis et al.'s verdict per target type x animacy wording x k, with the TOST line."""
    if sel.empty or "equivalence_p" not in sel:
        return ""
    lines = ["selective goal encoding (animate > inanimate and control; inanimate = control by TOST):"]
    for r in sel.itertuples():
        verdict = "passes" if r.passes else "fails"
        lines.append(f"  {r.target_type:<7}{'anim' if r.anim_denotation else 'plain':<6}k={r.k:<3}"
                     f"o_b {r.o_animate:.2f}/{r.o_inanimate:.2f}/{r.o_control:.2f}  inanimate-control 90% "
                     f"[{r.equivalence_low:+.3f}, {r.equivalence_high:+.3f}] vs +/-{r.equivalence_margin:g}, "
                     f"TOST p={r.equivalence_p:.2g}  {verdict}")
    return "\n".join(lines)


def load_stimuli(specs: Sequence[StimuliSpec]) -> list[Stimulus]:
    """Every spec's stimuli, in order."""
    return [s for spec in specs for s in spec.load()]


def run(config: BehaviourConfig, *, model: Any = None, progress: bool = True) -> BehaviourResult:
    """Score `config.stimuli` with `config.model` (or the loaded `model`)."""
    stimuli = load_stimuli(config.stimuli)  # a bad file fails before the model loads
    if model is None:
        model = config.model.load()
    result = run_behaviour(model, stimuli, batch_size=config.batch_size, progress=progress, seed=config.seed,
                           n_boot=config.n_boot)
    manifest = run_manifest(model, config, stimuli_hash=stimuli_hash(stimuli))
    return replace(result, config=config, manifest=manifest)


def run_behaviour(model: Any, stimuli: Sequence[Stimulus], *, batch_size: int = 8,
                  progress: bool = True, seed: int = 0, n_boot: int = 1000) -> BehaviourResult:
    """The engine of `run`: score loaded stimuli with a loaded model."""
    from tomlens.models import provenance

    stimuli = list(stimuli)
    if not stimuli:
        raise TomlensError("no stimuli to score", "check the stimulus file: it has no rows")
    t0 = time.time()
    table = score(model, stimuli, batch_size=batch_size, progress=progress)
    table = enrich_table(model, stimuli, table, batch_size=batch_size, progress=progress)
    batteries = battery_summaries(table, n_boot=n_boot, seed=seed)
    acc = aggregates.accuracy_table(table, n_boot=n_boot, seed=seed)
    gated = aggregates.reality_gated_accuracy(table, n_boot=n_boot, seed=seed)
    effect = aggregates.knowledge_state_effect(table, n_boot=n_boot, seed=seed)
    fb = table[table["family"].isin(["unexpected-transfer", "unexpected-contents"])
               & table["prefix_index"].isna()] if "prefix_index" in table else \
        table[table["family"].isin(["unexpected-transfer", "unexpected-contents"])]
    strict = aggregates.strict_task_pass(fb) if len(fb) else pd.DataFrame()
    has_goal = "object_target" in table and (table["prompt_type"] == "goal").any()
    ob = aggregates.object_bias_table(table, n_boot=n_boot, seed=seed) if has_goal else pd.DataFrame()
    sel = aggregates.selective_encoding(table, n_boot=n_boot, seed=seed) if has_goal else pd.DataFrame()
    curves = aggregates.prefix_curves(table)
    summary = {
        "provenance": {**provenance(model), "stimuli_hash": stimuli_hash(stimuli),
                       "n_stimuli": len(stimuli), "seed": seed,
                       "scoring": "sum of option-token log-probs with a leading space; "
                                  "p(a)/(p(a)+p(b)); first-token variant alongside",
                       "intervals": f"bootstrap over tasks, {n_boot} resamples; Wilson over tasks "
                                    "for the strict rule",
                       "seconds": round(time.time() - t0, 2)},
        "accuracy": acc.to_dict(orient="records"),
        "reality_gated": gated.to_dict(orient="records"),
        "knowledge_state_effect": effect.to_dict(orient="records"),
        "strict_task_pass": strict.to_dict(orient="records"),
        "object_bias": ob.to_dict(orient="records"),
        "selective_encoding": sel.to_dict(orient="records"),
        "batteries": sorted(batteries),  # battery_<family>.csv: each paper's own summary
    }
    return BehaviourResult(table, acc, strict, ob, sel, curves, summary, reality_gated=gated,
                           knowledge_state=effect, batteries=batteries)
