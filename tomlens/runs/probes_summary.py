"""The probes stage's typed summary (`ProbesResult.summary`, its `result.json`): what was swept, where
its activations are, each target's selected unit and verdict, and the plan with its estimated and
measured times.

Field names are the JSON keys the stage wrote before its summary was typed, so those folders load
unchanged; a folder from before the plan was recorded does not fit, and says to rerun the stage."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tomlens.runs.files import summary_from_dict


@dataclass(frozen=True, kw_only=True)
class SelectedUnit:
    """One target's unit chosen on selection stories (`unit`, e.g. "resid_post:3"; "-" when none
    could be chosen), its verdict on held-out stories and why."""

    unit: str
    verdict: str
    reason: str
    found: bool


@dataclass(frozen=True, kw_only=True)
class PlannedStage:
    """One stage of the plan: its name, what it fits, how many fits and its estimated time (None:
    not estimated)."""

    name: str
    what: str
    fits: int
    estimated_seconds: float | None


@dataclass(frozen=True, kw_only=True)
class ProbePlanSummary:
    """The plan said before the first fit (`tomlens.probes.plan.ProbePlan.to_dict`) and, per stage
    or group of stages, the seconds it took (`measured_seconds`)."""

    stages: tuple[PlannedStage, ...]
    estimated_seconds: float | None
    budget_seconds: float | None
    calibration: str
    notes: tuple[str, ...]
    measured_seconds: dict[str, float]


@dataclass(frozen=True, kw_only=True)
class ProbesSummary:
    """A probe run: its size and targets, the site kinds and position, where its activations are,
    whether directions were saved, the sweep's notes, the selected unit per target and the plan."""

    rows: int
    targets: tuple[str, ...]
    sites: tuple[str, ...]
    position: str
    activations: str
    test_activations: str | None
    directions: bool
    notes: tuple[str, ...]
    selection: dict[str, SelectedUnit]
    plan: ProbePlanSummary

    @classmethod
    def from_json(cls, data: Mapping[str, Any], *, folder: str | Path) -> ProbesSummary:
        """The summary of a result.json; one that does not fit is one TomlensError saying to rerun."""
        return summary_from_dict(cls, data, folder=folder, stage="probes")


__all__ = ["PlannedStage", "ProbePlanSummary", "ProbesSummary", "SelectedUnit"]
