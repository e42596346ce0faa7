"""`audit_stimuli`: every contrast of a set against every heuristic of its battery.

Rows are audited family by family (a user file may mix them): each family's contrasts
(`tomlens.audit.contrasts`) against the generic battery plus its registered rules. The interval
level is Bonferroni-corrected over all rows of the report, so the chance that a set with no shortcut
shows one anywhere is at most about `alpha`.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tomlens.audit.contrasts import BELIEF, contrasts_for, family_rules, unaudited
from tomlens.audit.evaluate import (
    MIN_TASKS,
    SHORTCUT,
    chance_of,
    class_weights,
    cluster_interval,
    confirmed,
    held_out_correct,
    not_significant,
    permutation_null,
    task_folds,
    verdict,
)
from tomlens.audit.heuristics import (
    BagHeuristic,
    CueHeuristic,
    Heuristic,
    generic_battery,
    rule_heuristic,
    story_of,
)
from tomlens.audit.result import AuditReport, AuditRow
from tomlens.errors import TomlensError
from tomlens.stimuli.records import Stimulus, stimuli_hash
from tomlens.stimuli.shortcuts import Contrast


@dataclass(frozen=True)
class _Job:
    """One row to compute: a heuristic on the rows of one contrast (`rows`: indexes into the
    family's stimuli, so a feature matrix is built once per family and heuristic)."""

    family: str
    contrast: Contrast
    heuristic: Heuristic
    rows: tuple[int, ...]
    labels: tuple[Hashable, ...]


class _Features:
    """Each heuristic's features over one family's rows, computed on first use."""

    def __init__(self, stimuli: Sequence[Stimulus]) -> None:
        self.stimuli = stimuli
        self._cache: dict[str, Any] = {}

    def of(self, h: Heuristic) -> Any:
        if h.name not in self._cache:
            self._cache[h.name] = h.values(self.stimuli) if isinstance(h, CueHeuristic) else h.encode(self.stimuli)
        return self._cache[h.name]

    def rows(self, h: Heuristic, rows: Sequence[int]) -> Any:
        full = self.of(h)
        return [full[i] for i in rows] if isinstance(full, list) else full[np.asarray(rows)]


def _task(s: Stimulus) -> str:
    """The held-out unit: the task, else (a file without task ids) the story before the question, so
    that a story's belief and reality prompts are held out together."""
    return s.task_id or "story:" + story_of(s).strip()


def _labelled(contrast: Contrast, rows: Sequence[Stimulus]) -> tuple[list[int], list[Hashable]]:
    kept, labels = [], []
    for i, s in enumerate(rows):
        try:
            label = contrast.label(s)
        except (KeyError, AttributeError, IndexError, TypeError, ValueError):
            label = None
        if label is not None:
            kept.append(i)
            labels.append(label)
    return kept, labels


def _jobs_for_family(family: str, rows: Sequence[Stimulus], features: _Features, skipped: list[str]) -> list[_Job]:
    battery: list[Heuristic] = [*generic_battery(), *(rule_heuristic(r) for r in family_rules(family))]
    rules = {f"rule: {r.name}": r for r in family_rules(family)}
    jobs: list[_Job] = []
    absent: dict[str, list[str]] = {}
    skipped += [f"{family}: {name}: not audited by design: {why}" for name, why in unaudited(family).items()]
    for contrast in contrasts_for(family, rows):
        kept, labels = _labelled(contrast, rows)
        if len(set(labels)) < 2 and not (kept and contrast.chance is not None):
            if kept or contrast is not BELIEF:
                skipped.append(f"{family}: {contrast.name}: " + (
                    f"one class only ({labels[0]!r})" if kept else "no row is labelled for it"))
            continue
        for h in battery:
            if h.name in rules and not rules[h.name].applies_to(contrast.name):
                continue
            if isinstance(h, CueHeuristic) and all(v is None for v in features.rows(h, kept)):
                absent.setdefault(h.name, []).append(contrast.name)
                continue
            jobs.append(_Job(family, contrast, h, tuple(kept), tuple(labels)))
    skipped += [f"{family}: {name}: the cue never occurs (in {', '.join(cs)})" for name, cs in absent.items()]
    return jobs


def _run_job(job: _Job, features: _Features, level: float, seed: int) -> AuditRow:
    tasks = [_task(features.stimuli[i]) for i in job.rows]
    labels = list(job.labels)
    balanced = job.contrast.chance is None
    folds = task_folds(tasks, seed)
    values = features.rows(job.heuristic, job.rows)
    correct = held_out_correct(values, labels, folds, balanced=balanced)
    score = cluster_interval(correct, tasks, level, class_weights(labels, balanced))
    chance = chance_of(labels, job.contrast.chance)
    ngram = isinstance(job.heuristic, BagHeuristic) and job.heuristic.is_ngram_bag
    source = "family rule" if isinstance(job.heuristic, CueHeuristic) and job.heuristic.family_rule else "generic"
    said = verdict(score, chance, ngram_bag=ngram)
    null_mean = null_sd = float("nan")
    if said == SHORTCUT:
        null_mean, null_sd = permutation_null(values, labels, tasks, folds, balanced=balanced, seed=seed)
        # a stated chance is the design's (answers balanced over positions): the imbalance itself is the
        # shortcut, which shuffling labels keeps, so the null is centred there and only lends its spread
        centre = job.contrast.chance if job.contrast.chance is not None else null_mean
        if confirmed(score, centre, null_sd, level) != SHORTCUT:
            said = not_significant(score, chance, ngram_bag=ngram)
    return AuditRow(job.family, job.contrast.name, job.heuristic.name, source, score.accuracy, score.ci_low,
                    score.ci_high, chance, score.n_rows, score.n_tasks, said, null_mean, null_sd)


def audit_stimuli(stimuli: Sequence[Stimulus], *, seed: int = 0, alpha: float = 0.05,
                  progress: Callable[[int, int, str], None] | None = None) -> AuditReport:
    """Every (contrast, heuristic) row of every family in `stimuli`, scored on held-out tasks.

    `alpha` is the battery's family-wise error: each row's interval is at 1 - alpha / rows.
    `progress(done, total, what)` is called after each row (the CLI prints it)."""
    if not stimuli:
        raise TomlensError("no stimuli to audit", "give a stimulus file with rows, or a family name")
    if not 0 < alpha < 1:
        raise TomlensError(f"alpha = {alpha} is not in (0, 1)", "use e.g. 0.05")
    by_family: dict[str, list[Stimulus]] = {}
    for s in stimuli:
        by_family.setdefault(s.family, []).append(s)
    skipped: list[str] = []
    features = {fam: _Features(rows) for fam, rows in by_family.items()}
    jobs = [j for fam, rows in by_family.items() for j in _jobs_for_family(fam, rows, features[fam], skipped)]
    for fam, rows in by_family.items():
        if any(not s.task_id for s in rows):
            skipped.append(f"{fam}: {sum(not s.task_id for s in rows)} rows have no task_id; they are grouped by "
                           "their story text, which cannot join twins told differently (give task_id to hold "
                           "a story's versions out together)")
        n_tasks = len({_task(s) for s in rows})
        if n_tasks < MIN_TASKS:
            skipped.append(f"{fam}: {n_tasks} tasks; at least {MIN_TASKS} are needed to tell a cue from luck "
                           f"(generate more, e.g. --n 64)")
    level = 1 - alpha / max(len(jobs), 1)
    audit_rows: list[AuditRow] = []
    for i, job in enumerate(jobs):
        audit_rows.append(_run_job(job, features[job.family], level, seed))
        if progress is not None:
            progress(i + 1, len(jobs), f"{job.family}: {job.contrast.name} <- {job.heuristic.name}")
    return AuditReport(tuple(audit_rows), tuple(dict.fromkeys(skipped)), level, seed, stimuli_hash(stimuli),
                       tuple(by_family))


def sample_per_task(stimuli: Sequence[Stimulus], k: int, seed: int = 0) -> list[Stimulus]:
    """At most `k` rows of each task, for a quicker audit of a large set (the held-out unit is the
    task either way). Rows are dealt round-robin over the task's condition x prompt type cells
    (each shuffled by `seed`): drawn at random, the sample's own mix of reality and belief prompts
    gave a prompt bag 0.60-0.64 on sets at chance in full."""
    if k < 1:
        raise TomlensError(f"--per-task {k} must be at least 1", "pass 1 or more, or leave it out")
    rng = np.random.default_rng(seed)
    by_task: dict[tuple[str, str], dict[tuple[str, str], list[int]]] = {}
    for i, s in enumerate(stimuli):
        by_task.setdefault((s.family, _task(s)), {}).setdefault((s.condition, s.prompt_type), []).append(i)
    keep: set[int] = set()
    for cells in by_task.values():
        queues = [list(rng.permutation(idx)) for idx in cells.values()]
        taken: list[int] = []
        while len(taken) < k and any(queues):
            for q in queues:
                if q and len(taken) < k:
                    taken.append(int(q.pop()))
        keep.update(taken)
    return [s for i, s in enumerate(stimuli) if i in keep]
