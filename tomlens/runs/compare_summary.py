"""The comparison's typed summary (`CompareResult.summary`, its `result.json`): each compared model
with its folder, depth and provenance, each run folder with its manifest, and the words that say
how the tables are to be read (the depth axis, the normalisation, 0-based layers).

Field names are the JSON keys `tomlens compare` wrote before its summary was typed, so those
folders load unchanged; `tables` lists the tables saved beside it (all of `TABLES` in a folder
written before it was recorded)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tomlens.runs.files import summary_from_dict

TABLES: tuple[str, ...] = ("models", "behaviour", "probes", "probe_best", "patching", "validation", "gates", "missing")


@dataclass(frozen=True, kw_only=True)
class ComparedModel:
    """One model of the comparison: its label, its folder and the run folder it was found in, its
    depth, the stages its config asked for and those that finished, and its provenance."""

    label: str
    folder: str
    run: str
    n_layers: int
    n_heads: int | None
    asked: tuple[str, ...]
    finished: tuple[str, ...]
    provenance: dict[str, Any]


@dataclass(frozen=True, kw_only=True)
class ComparedRun:
    """One run folder given to the comparison and its manifest.json (None: it has none)."""

    folder: str
    manifest: dict[str, Any] | None


@dataclass(frozen=True, kw_only=True)
class CompareSummary:
    """What a comparison says about itself: how its axis and numbers are to be read, the models and
    runs it compared, the models asked for and absent, the versions, when, and its tables' names."""

    command: str
    axis: str
    normalisation: str
    layers: str
    models: tuple[ComparedModel, ...]
    missing: tuple[str, ...]
    runs: tuple[ComparedRun, ...]
    versions: dict[str, Any]
    time: str
    tables: tuple[str, ...] = TABLES

    @classmethod
    def from_json(cls, data: Mapping[str, Any], *, folder: str | Path) -> CompareSummary:
        """The summary of a comparison's result.json; one that does not fit is one TomlensError
        saying to rerun `tomlens compare` into the folder."""
        return summary_from_dict(cls, data, folder=folder, stage="compare")


__all__ = ["ComparedModel", "ComparedRun", "CompareSummary", "TABLES"]
