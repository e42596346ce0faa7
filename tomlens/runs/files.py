"""The files every stage's result writes beside its tables, in one place: `config.json` (the
resolved config), `manifest.json` (provenance) and, last, `result.json` (the summary), whose
presence marks a finished run. A save removes `result.json` first, so a folder caught half-way
through being rewritten never looks finished."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Protocol, TypeVar

from tomlens.errors import TomlensError
from tomlens.io import read_json, write_json
from tomlens.runs.base import config_from_dict, config_to_dict
from tomlens.runs.index import record_run

C = TypeVar("C")

CONFIG = "config.json"
MANIFEST = "manifest.json"
RESULT = "result.json"
INPUTS = "inputs.json"  # an experiment stage's input fingerprints (`tomlens.runs.experiment`)


def begin_save(out: str | Path) -> Path:
    """Create `out` and remove its finished-run marker before anything else is written."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / RESULT).unlink(missing_ok=True)
    return out


def finish_save(out: Path, config: Any, manifest: dict[str, Any], summary: dict[str, Any]) -> Path:
    """Write config.json and manifest.json, then (last) result.json."""
    if config is not None:
        write_json(config_to_dict(config), out / CONFIG)
    write_json(manifest, out / MANIFEST)
    write_json(summary, out / RESULT)
    record_run(out)  # `tomlens runs` lists it
    return out


def read_finished(out: str | Path, config_class: type[C]) -> tuple[Path, C | None, dict[str, Any], dict[str, Any]]:
    """(folder, config, manifest, summary) of a finished run folder; an error if it is not one."""
    out = Path(out)
    if not (out / RESULT).is_file():
        raise TomlensError(f"{out} holds no finished run (no {RESULT})",
                           "run the stage into that folder first (an interrupted run leaves no result.json)")
    config = config_from_dict(config_class, read_json(out / CONFIG)) if (out / CONFIG).is_file() else None
    manifest = read_json(out / MANIFEST) if (out / MANIFEST).is_file() else {}
    return out, config, manifest, read_json(out / RESULT)


class RunResult(Protocol):
    """What every stage's result offers: `save(out)` writes the folder (result.json last), the
    class's `load(out)` reads it back, and `describe()` is the few lines a terminal prints."""

    def save(self, out: str | Path) -> Path: ...

    @classmethod
    def load(cls, out: str | Path) -> RunResult: ...

    def describe(self) -> str: ...


S = TypeVar("S")


def summary_to_dict(summary: Any) -> dict[str, Any]:
    """A typed summary (a frozen dataclass tree) as plain JSON values, for result.json."""
    return config_to_dict(summary)


def summary_from_dict(cls: type[S], data: Mapping[str, Any], *, folder: str | Path, stage: str) -> S:
    """The typed summary `cls` from a result.json's dict. A folder written before its stage's
    summary was typed (or by a later tomlens) does not fit: say so, and that rerunning the stage
    into the folder rewrites it, instead of failing later on a missing field."""
    try:
        return config_from_dict(cls, data)
    except (TomlensError, TypeError) as e:
        why = e.problem if isinstance(e, TomlensError) else str(e)
        raise TomlensError(
            f"{folder}: its result.json does not fit this tomlens's {stage} result ({why})",
            f"rerun the {stage} stage into that folder (a rerun reuses its cached activations), "
            "or read it with the tomlens version that wrote it (its manifest.json names it)") from e
