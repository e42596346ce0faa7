"""The audit stage: the shortcut battery on the sets an experiment's findings are made on.

In an experiment file `[audit]` with no `stimuli` audits the behaviour and probes stages' sets. A
generated family is audited at `min_tasks` tasks at least (its own seed and options): a generator's
shortcuts do not depend on how many tasks a run draws, and eight tasks cannot tell a cue from luck.
A file is audited as it is. No model is loaded. The report's findings read `AuditResult.report` and
flag every behaviour or probe finding whose family a shortcut explains.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tomlens.errors import TomlensError
from tomlens.messages import say
from tomlens.models.protocol import Model
from tomlens.runs.base import ModelSpec, StimuliSpec, config_from_dict

if TYPE_CHECKING:
    from tomlens.stimuli.records import Stimulus

__all__ = ["AuditConfig", "AuditResult", "run"]
REPORT_FILE = "audit.json"


@dataclass(frozen=True)
class AuditConfig:
    """Which sets to audit and how finely. `per_task` keeps at most that many prompts of each task
    (the task is the unit either way; it bounds the time on large families)."""

    model: ModelSpec = field(default_factory=ModelSpec)  # recorded only: the audit reads text
    stimuli: tuple[StimuliSpec, ...] = ()
    min_tasks: int = 64
    per_task: int | None = 4
    alpha: float = 0.05
    seed: int = 0

    def __post_init__(self) -> None:
        # a script or a TOML table may give one spec or one mapping where the field says a tuple
        given: Any = self.stimuli
        stimuli = (given,) if isinstance(given, (StimuliSpec, Mapping)) else given
        object.__setattr__(self, "stimuli", tuple(
            config_from_dict(StimuliSpec, s, where=f"audit.stimuli[{i}]") if isinstance(s, Mapping) else s
            for i, s in enumerate(stimuli)))
        if self.min_tasks < 8:
            raise TomlensError(f"audit min_tasks = {self.min_tasks} is below 8",
                               "use 64 (fewer held-out tasks cannot tell a cue from luck)")
        if self.per_task is not None and self.per_task < 1:
            raise TomlensError(f"audit per_task = {self.per_task} must be at least 1", "use 1 or more, or leave it out")
        if not 0 < self.alpha < 1:
            raise TomlensError(f"audit alpha = {self.alpha} is not in (0, 1)", "use e.g. 0.05")

    def audited_specs(self) -> list[StimuliSpec]:
        """The specs as audited: generated families at `min_tasks` tasks at least, each family once
        per (seed, options)."""
        out: dict[str, StimuliSpec] = {}
        for spec in self.stimuli:
            if spec.family is not None and spec.family != "bigtom":
                spec = dataclasses.replace(spec, n=max(spec.n or 0, self.min_tasks))
            out.setdefault(repr((spec.family, spec.path, spec.n, spec.seed, sorted(dict(spec.options).items()))), spec)
        return list(out.values())

    def audited_rows(self) -> list[Stimulus]:
        """The rows audited: every audited spec's, then at most `per_task` of each task."""
        from tomlens.audit import sample_per_task

        rows = _distinct_tasks([list(spec.load()) for spec in self.audited_specs()])
        return rows if self.per_task is None else sample_per_task(rows, self.per_task, seed=self.seed)


def _distinct_tasks(sets: list[list[Stimulus]]) -> list[Stimulus]:
    """The sets' rows, one list, each story once and each task held out as one. A row an earlier set
    already holds (the same id and text: the same generator and seed at another `n`) is dropped. A
    task whose rows reuse an earlier set's ids for other text (the same seed with other options
    tells other stories under the same ids) gets a suffix ("ut-s0-0003@1", unused by any set), so
    the audit holds it out and counts it apart; rows that only add to an earlier task (another
    condition of it) keep its id."""
    texts: dict[tuple[str, str], str] = {}
    used = {(s.family, s.task_id) for rows in sets for s in rows if s.task_id}
    out: list[Stimulus] = []
    for rows in sets:
        retold = {(s.family, s.task_id) for s in rows
                  if s.task_id and texts.get((s.family, s.id), s.text) != s.text}
        renamed = {key: _unused_id(key, used) for key in retold}
        for s in rows:
            if texts.get((s.family, s.id)) == s.text:
                continue
            key = (s.family, s.task_id)
            if key in renamed:
                s = s.with_(task_id=renamed[key], id=f"{s.id}@{renamed[key].rsplit('@', 1)[1]}")
            texts[(s.family, s.id)] = s.text
            out.append(s)
    return out


def _unused_id(key: tuple[str, str], used: set[tuple[str, str]]) -> str:
    family, task = key
    k = 1
    while (family, f"{task}@{k}") in used:
        k += 1
    used.add((family, f"{task}@{k}"))
    return f"{task}@{k}"


@dataclass
class AuditResult:
    config: AuditConfig
    report: Any  # tomlens.audit.AuditReport

    def describe(self) -> str:
        """The rows that are not at chance and the verdict (`tomlens audit` prints every row)."""
        return self.report.table(only_flagged=True)

    def save(self, out: str | Path) -> Path:
        from tomlens.provenance import run_manifest
        from tomlens.runs.files import begin_save, finish_save

        out = begin_save(out)
        self.report.write(out / REPORT_FILE)
        manifest = run_manifest(None, self.config, stimuli_hash=self.report.stimuli_hash)
        return finish_save(out, self.config, manifest, {"verdict": self.report.verdict(),
                                                          "shortcuts": len(self.report.shortcuts),
                                                          "rows": len(self.report.rows)})

    @classmethod
    def load(cls, out: str | Path) -> AuditResult:
        from tomlens.audit import AuditReport
        from tomlens.runs.files import read_finished

        folder, config, _, _ = read_finished(out, AuditConfig)
        return cls(config or AuditConfig(), AuditReport.read(folder / REPORT_FILE))


def changed_since(folder: Path, config: AuditConfig) -> str | None:
    """Why a finished audit in `folder` cannot stand for `config` now: the rows it would audit are
    not the rows it audited (a generator changed its texts, a file changed), or its shortcut rows
    predate the permutation null. None: reuse it. Regenerating the rows takes seconds."""
    from tomlens.audit import AuditReport
    from tomlens.stimuli.records import stimuli_hash

    path = Path(folder) / REPORT_FILE
    if not path.is_file():
        return "no audit.json"
    saved = AuditReport.read(path)
    if saved.stimuli_hash != stimuli_hash(config.audited_rows()):
        return "the stimuli it audits changed (a generator or a file)"
    if any(r.null_mean != r.null_mean for r in saved.shortcuts):
        return "its shortcut rows predate the permutation null"
    return None


def run(config: AuditConfig, *, model: Model | None = None, progress: bool = True) -> AuditResult:
    """Audit every set of `config` (one report over all of them; rows are per family)."""
    from tomlens.audit import audit_stimuli

    if not config.stimuli:
        raise TomlensError("the audit stage has no stimuli",
                           "add [[audit.stimuli]] entries, or a behaviour or probes stage for it to audit")
    stimuli = config.audited_rows()
    if progress:
        families = sorted({s.family for s in stimuli})
        say(f"audit: {len(stimuli)} prompts of {len(families)} families ({', '.join(families)}), "
            f"about {max(1, len(stimuli) // 40)} s")
    return AuditResult(config, audit_stimuli(stimuli, seed=config.seed, alpha=config.alpha))
