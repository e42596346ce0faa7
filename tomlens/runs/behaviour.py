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

from tomlens.behaviour import aggregates, first_word
from tomlens.behaviour.aggregates import MIN_OPTION_MASS
from tomlens.behaviour.batteries import battery_summaries, enrich_table, headline
from tomlens.behaviour.scoring import score
from tomlens.errors import TomlensError
from tomlens.io import jsonable, read_table, write_json, write_table
from tomlens.models.protocol import Model
from tomlens.provenance import run_manifest
from tomlens.runs.base import ModelSpec, StimuliSpec, config_from_dict
from tomlens.runs.files import begin_save, finish_save, read_finished, summary_from_dict, summary_to_dict
from tomlens.stimuli.records import Stimulus, stimuli_hash
from tomlens.vocabulary import nearest

# Optional tables: written only when non-empty (an empty one is absent, and loads back empty).
_OPTIONAL = ("strict", "object_bias", "selective", "prefix_curves", "reality_gated", "knowledge_state",
             "k0_check", "first_word")
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


# How answers are scored: both options' log-probs (every family), or that plus Kosinski's first
# word of a greedy completion on his two families (`tomlens.behaviour.first_word`).
SCORINGS: tuple[str, ...] = ("logprob", "first-word")


@dataclass(frozen=True)
class BehaviourConfig:
    """Which model scores which stimuli; `seed` and `n_boot` drive the aggregates' bootstrap
    intervals (whole tasks resampled). `scoring = "first-word"` adds Kosinski's first-word answers
    (and his strict rule over them) to the log-prob scores; `min_option_mass` is the share of the
    next word's probability below which a table flags a cell's options as getting little of it
    (`tomlens.behaviour.aggregates.MIN_OPTION_MASS` says why one half)."""

    model: ModelSpec = ModelSpec()
    stimuli: tuple[StimuliSpec, ...] = ()
    batch_size: int = 8
    seed: int = 0
    n_boot: int = 1000
    scoring: str = "logprob"
    min_option_mass: float = MIN_OPTION_MASS

    def __post_init__(self) -> None:
        stimuli: Any = self.stimuli  # a table file may give one table, or tables, where specs belong
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
        check_scoring(self.scoring)
        aggregates.check_min_mass(self.min_option_mass)


def check_scoring(scoring: str) -> str:
    if scoring not in SCORINGS:
        raise TomlensError(f"unknown scoring {scoring!r}" + (f": did you mean {near!r}?" if (near := nearest(scoring, SCORINGS)) else ""),
                           'use scoring = "logprob" (both options\' log-probs) or "first-word" (Kosinski\'s)')
    return scoring


@dataclass(frozen=True, kw_only=True)
class BehaviourSummary:
    """What a behaviour run says about itself (its summary.json and result.json): how it scored and
    with what (`provenance`: the model's record, `tomlens.models.provenance`, with the stimuli's hash
    and count, the seed, the scoring rule, what option mass and the intervals are, the seconds), each
    aggregate table's rows, and the families with a battery table (battery_<family>.csv).

    The row lists are the tables the result holds as DataFrames (and saves as CSV beside this), as
    JSON rows: their columns are the aggregates' and differ by family and scoring, so readers read the
    DataFrames, never these. They are kept as JSON holds them (NaN as None, intervals as lists), so a
    loaded summary equals the one saved. Field names are the keys the stage wrote before its summary
    was typed, so those folders load unchanged."""

    provenance: dict[str, Any]
    accuracy: tuple[dict[str, Any], ...]
    first_word: tuple[dict[str, Any], ...]
    reality_gated: tuple[dict[str, Any], ...]
    knowledge_state_effect: tuple[dict[str, Any], ...]
    strict_task_pass: tuple[dict[str, Any], ...]
    object_bias: tuple[dict[str, Any], ...]
    selective_encoding: tuple[dict[str, Any], ...]
    k0_check: tuple[dict[str, Any], ...]
    batteries: tuple[str, ...]  # battery_<family>.csv: each paper's own summary


def json_rows(df: pd.DataFrame) -> tuple[dict[str, Any], ...]:
    """A table's rows as result.json holds them (NaN as None, tuples as lists, numpy numbers as
    Python's): what a loaded summary reads back."""
    return tuple(jsonable(df.to_dict(orient="records")))


@dataclass(frozen=True)
class BehaviourResult:
    table: pd.DataFrame  # one row per prompt
    accuracy: pd.DataFrame  # family x condition x prompt type, task-bootstrap intervals
    strict: pd.DataFrame  # Kosinski's all-prompts-right rule per family
    object_bias: pd.DataFrame  # Ruis et al. o_b per cell (empty without goal prompts)
    selective: pd.DataFrame  # selective-encoding criterion per group
    prefix_curves: pd.DataFrame  # probability over sentence prefixes
    summary: BehaviourSummary
    config: BehaviourConfig | None = None
    manifest: dict[str, Any] = field(default_factory=dict)
    reality_gated: pd.DataFrame = field(default_factory=pd.DataFrame)  # belief accuracy on reality-right stories
    knowledge_state: pd.DataFrame = field(default_factory=pd.DataFrame)  # paired FB - TB log-odds effect
    batteries: dict[str, pd.DataFrame] = field(default_factory=dict)  # family -> its paper's summary table
    k0_check: pd.DataFrame = field(default_factory=pd.DataFrame)  # goal encoding's o_b at k = 0 against 0.5
    first_word: pd.DataFrame = field(default_factory=pd.DataFrame)  # Kosinski's first-word accuracy per cell

    def save(self, out: str | Path) -> Path:
        """prompts.parquet, accuracy.csv, the non-empty optional tables (reality_gated.csv,
        knowledge_state_effect.csv, k0_check.csv and, with first-word scoring, first_word.csv among
        them), battery_<family>.csv per battery, summary.json, config.json, manifest.json and, last,
        result.json."""
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
        summary = summary_to_dict(self.summary)
        write_json(summary, out / "summary.json")
        return finish_save(out, self.config, self.manifest, summary)

    @classmethod
    def load(cls, out: str | Path) -> BehaviourResult:
        """The tables, config, manifest and summary a finished behaviour folder holds; a folder whose
        result.json does not fit this tomlens is one TomlensError saying to rerun the stage."""
        out, config, manifest, data = read_finished(out, BehaviourConfig)
        summary = summary_from_dict(BehaviourSummary, data, folder=out, stage="behaviour")
        optional = {name: _read_optional(out / f"{_FILES.get(name, name)}.csv") for name in _OPTIONAL}
        batteries = {family: _read_optional(out / f"battery_{family}.csv") for family in summary.batteries}
        return cls(table=read_table(out / "prompts.parquet"), accuracy=_read_optional(out / "accuracy.csv"),
                   summary=summary, config=config, manifest=manifest, batteries=batteries, **optional)

    def describe(self) -> str:
        """Accuracy with task-bootstrap intervals and option mass, Kosinski's first-word accuracy and
        strict table, reality-gated belief accuracy, the knowledge-state effect, goal encoding's
        unclassified share, k = 0 check and selective-encoding verdicts, when present."""
        min_mass = self.config.min_option_mass if self.config is not None else MIN_OPTION_MASS
        text = format_accuracy(self.accuracy, min_mass)
        for block in (format_first_word(self.first_word, min_mass), format_strict(self.strict),
                      format_gated(self.reality_gated), format_knowledge_state(self.knowledge_state),
                      format_object_bias(self.object_bias, self.k0_check), format_selective(self.selective)):
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


def _mass(r: Any) -> tuple[str, bool]:
    """A row's mean first-token option mass as text, and whether it is flagged low ("" and False
    for a table scored before option mass was recorded)."""
    mass = getattr(r, "mean_option_mass_first", float("nan"))
    if mass is None or isinstance(mass, float) and math.isnan(mass):
        return "", False
    low = bool(getattr(r, "low_option_mass", False))
    return f"{mass:.2g}{' !' if low else ''}", low


def mass_note(min_mass: float) -> str:
    """The footnote of a flagged cell: what the flag means and what it does to the score."""
    return (f"! the options get under {min_mass:g} of the next word's probability: the model would more likely "
            "say neither, so a two-way score describes a choice it mostly would not make")


def format_accuracy(acc: pd.DataFrame, min_mass: float = MIN_OPTION_MASS) -> str:
    """One line per family x condition x prompt type: prompts, tasks and accuracy with its 95%
    interval from a bootstrap over tasks, and the mean next-word probability of the two options
    (`mass`); rows with fewer than FEW_TASKS tasks are marked *, cells whose options get under
    `min_mass` of the next word !."""
    lines = [f"{'family':<24}{'condition':<16}{'prompt':<9}{'n':>5}{'tasks':>6}  "
             f"{'accuracy [95% CI] (whole tasks resampled)':<44}option mass"]
    few = low = False
    for r in acc.itertuples():
        n_tasks = getattr(r, "n_tasks", float("nan"))
        mark = " *" if n_tasks < FEW_TASKS else ""
        few = few or bool(mark)
        mass, flagged = _mass(r)
        low = low or flagged
        score = f"{r.accuracy:.2f} {_iv(r.ci_low, r.ci_high)}{mark}"
        lines.append(f"{r.family:<24}{r.condition:<16}{r.prompt_type:<9}{r.n:>5}{n_tasks:>6}  {score:<44}{mass}")
    if few:
        lines.append(f"* fewer than {FEW_TASKS} tasks: the interval understates the uncertainty; use more tasks")
    if low:
        lines.append(mass_note(min_mass))
    return "\n".join(lines)


def format_first_word(fw: pd.DataFrame, min_mass: float = MIN_OPTION_MASS) -> str:
    """Kosinski's first-word accuracy per cell, with the share of off-key answers (counted wrong)."""
    if fw.empty:
        return ""
    lines = ["first word of a greedy completion (Kosinski's scoring; an off-key answer is wrong):",
             f"  {'family':<24}{'condition':<16}{'prompt':<9}{'n':>5}  {'accuracy [95% CI]':<24}{'off-key':>8}"
             "  option mass"]
    low = False
    for r in fw.itertuples():
        mass, flagged = _mass(r)
        low = low or flagged
        score = f"{r.accuracy:.2f} {_iv(r.ci_low, r.ci_high)}"
        lines.append(f"  {r.family:<24}{r.condition:<16}{r.prompt_type:<9}{r.n:>5}  {score:<24}{r.off_key:>8.2f}"
                     f"  {mass}")
    if low:
        lines.append("  " + mass_note(min_mass))
    return "\n".join(lines)


def format_strict(strict: pd.DataFrame) -> str:
    """Kosinski's strict rule per family and scoring: tasks with every prompt right."""
    if strict.empty:
        return ""
    lines = ["Kosinski's strict rule (a task counts only when all its prompts are right):"]
    for r in strict.itertuples():
        scoring = getattr(r, "scoring", aggregates.TWO_WAY)
        mass, _ = _mass(r)
        lines.append(f"  {r.family:<24}{scoring:<22}{r.solved:>4} / {r.tasks:<4} solved  {r.fraction_solved:.2f} "
                     f"{_iv(r.ci_low, r.ci_high)}  chance {r.chance:.2g} ({r.prompts_per_task} prompts per task)"
                     + (f"  option mass {mass}" if mass else ""))
    return "\n".join(lines)


def format_object_bias(ob: pd.DataFrame, k0: pd.DataFrame) -> str:
    """Goal encoding: the unclassified share per test case (the probability o_b leaves out) and the
    k = 0 check (with no habituation, o_b should sit near 0.5)."""
    if ob.empty or "unclassified" not in ob:
        return ""
    lines = ["goal encoding: probability on neither target (unclassified), mean over cells:"]
    by_case = ob.groupby("test_case", sort=True)[["unclassified", "o_b"]].mean()
    flagged = set(ob.loc[ob["low_option_mass"].astype(bool), "test_case"]) if "low_option_mass" in ob else set()
    for case, r in by_case.iterrows():
        lines.append(f"  {case:<10} unclassified {r['unclassified']:.2f}  o_b {r['o_b']:.2f}"
                     + ("  ! some cells' targets get little of the next word" if case in flagged else ""))
    for r in k0.itertuples():
        verdict = "near 0.5" if r.near_half else "NOT shown near 0.5: a baseline bias the k > 0 cells carry too"
        lines.append(f"  k=0 {r.target_type:<7}{'anim' if r.anim_denotation else 'plain':<6}{r.test_case:<10}"
                     f"o_b {r.o_b:.2f}, 90% [{r.low:.3f}, {r.high:.3f}] vs 0.5 +/-{r.margin:g}: {verdict}")
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
    """Ruis et al.'s verdict per target type x animacy wording x k (the paper's two-sided "distinct"
    criterion, with the direction the animate case differs in), with the TOST line."""
    if sel.empty or "equivalence_p" not in sel:
        return ""
    lines = ["selective goal encoding (Ruis et al.: animate distinct from inanimate and from control; "
             "inanimate = control by TOST):"]
    for r in sel.itertuples():
        verdict = "passes" if r.passes else "fails"
        direction = getattr(r, "direction", None)
        if isinstance(direction, str) and direction != "none":
            verdict += f" (animate toward the {direction})"
        lines.append(f"  {r.target_type:<7}{'anim' if r.anim_denotation else 'plain':<6}k={r.k:<3}"
                     f"o_b {r.o_animate:.2f}/{r.o_inanimate:.2f}/{r.o_control:.2f}  inanimate-control 90% "
                     f"[{r.equivalence_low:+.3f}, {r.equivalence_high:+.3f}] vs +/-{r.equivalence_margin:g}, "
                     f"TOST p={r.equivalence_p:.2g}  {verdict}")
    return "\n".join(lines)


def load_stimuli(specs: Sequence[StimuliSpec]) -> list[Stimulus]:
    """Every spec's stimuli, in order."""
    return [s for spec in specs for s in spec.load()]


def run(config: BehaviourConfig, *, model: Model | None = None, progress: bool = True) -> BehaviourResult:
    """Score `config.stimuli` with `config.model` (or the loaded `model`)."""
    stimuli = load_stimuli(config.stimuli)  # a bad file fails before the model loads
    if config.scoring == "first-word":  # a set first words cannot score fails before the model loads
        first_word.check_set(stimuli)
    if model is None:
        model = config.model.load()
    result = run_behaviour(model, stimuli, batch_size=config.batch_size, progress=progress, seed=config.seed,
                           n_boot=config.n_boot, scoring=config.scoring, min_option_mass=config.min_option_mass)
    manifest = run_manifest(model, config, stimuli_hash=stimuli_hash(stimuli))
    return replace(result, config=config, manifest=manifest)


def _strict_tables(table: pd.DataFrame, min_mass: float) -> pd.DataFrame:
    """Kosinski's strict rule on his two families' whole-story prompts, by the two-way choice and,
    where first words were read, by the first word."""
    fb = table[first_word.scored_rows(table)]
    if fb.empty:
        return pd.DataFrame()
    parts = [aggregates.strict_task_pass(fb, min_mass=min_mass)]
    if "correct_first_word" in fb:
        parts.append(aggregates.strict_task_pass(fb, "correct_first_word", scoring="first word (greedy)",
                                                 min_mass=min_mass))
    return pd.concat(parts, ignore_index=True)


def _scoring_words(scoring: str) -> str:
    """How answers were scored, in the words the summary's provenance records."""
    return ("sum of option-token log-probs with a leading space; p(a)/(p(a)+p(b)); first-token variant alongside"
            + ("; and the first word of a greedy completion on unexpected-transfer and unexpected-contents "
               "(Kosinski), off-key answers wrong" if scoring == "first-word" else ""))


def _option_mass_words(min_mass: float) -> str:
    """What the option-mass columns are, in the words the summary's provenance records."""
    return (f"per prompt: next-word probability of the options' first tokens (option_mass_first) and of the "
            f"whole options (option_mass); per cell their means, low_option_mass where the first is under "
            f"{min_mass:g}")


def run_behaviour(model: Model, stimuli: Sequence[Stimulus], *, batch_size: int = 8,
                  progress: bool = True, seed: int = 0, n_boot: int = 1000, scoring: str = "logprob",
                  min_option_mass: float = MIN_OPTION_MASS) -> BehaviourResult:
    """The engine of `run`: score loaded stimuli with a loaded model."""
    from tomlens.models import provenance

    stimuli = list(stimuli)
    if not stimuli:
        raise TomlensError("no stimuli to score", "check the stimulus file: it has no rows")
    check_scoring(scoring)
    m = aggregates.check_min_mass(min_option_mass)
    t0 = time.time()
    table = score(model, stimuli, batch_size=batch_size, progress=progress)
    if scoring == "first-word":
        table = first_word.first_word_columns(model, stimuli, table, batch_size=batch_size, progress=progress)
    table = enrich_table(model, stimuli, table, batch_size=batch_size, progress=progress)
    batteries = battery_summaries(table, n_boot=n_boot, seed=seed, min_mass=m)
    acc = aggregates.accuracy_table(table, n_boot=n_boot, seed=seed, min_mass=m)
    fw = first_word.first_word_accuracy(table, n_boot=n_boot, seed=seed, min_mass=m)
    gated = aggregates.reality_gated_accuracy(table, n_boot=n_boot, seed=seed, min_mass=m)
    effect = aggregates.knowledge_state_effect(table, n_boot=n_boot, seed=seed, min_mass=m)
    strict = _strict_tables(table, m)
    has_goal = "object_target" in table and (table["prompt_type"] == "goal").any()
    ob = aggregates.object_bias_table(table, n_boot=n_boot, seed=seed, min_mass=m) if has_goal else pd.DataFrame()
    sel = aggregates.selective_encoding(table, n_boot=n_boot, seed=seed, min_mass=m) if has_goal else pd.DataFrame()
    k0 = aggregates.k0_check(table, min_mass=m) if has_goal else pd.DataFrame()
    curves = aggregates.prefix_curves(table, min_mass=m)
    summary = BehaviourSummary(
        provenance={**provenance(model), "stimuli_hash": stimuli_hash(stimuli), "n_stimuli": len(stimuli),
                    "seed": seed, "scoring": _scoring_words(scoring), "option_mass": _option_mass_words(m),
                    "intervals": f"bootstrap over tasks, {n_boot} resamples; Wilson over tasks for the strict rule",
                    "seconds": round(time.time() - t0, 2)},
        accuracy=json_rows(acc), first_word=json_rows(fw), reality_gated=json_rows(gated),
        knowledge_state_effect=json_rows(effect), strict_task_pass=json_rows(strict), object_bias=json_rows(ob),
        selective_encoding=json_rows(sel), k0_check=json_rows(k0), batteries=tuple(sorted(batteries)))
    return BehaviourResult(table, acc, strict, ob, sel, curves, summary, reality_gated=gated,
                           knowledge_state=effect, batteries=batteries, k0_check=k0, first_word=fw)
