"""The files every stage's result writes beside its tables, in one place: `config.json` (the
resolved config), `manifest.json` (provenance) and, last, `result.json` (the summary), whose
presence marks a finished run. A save removes `result.json` first, so a folder caught half-way
through being rewritten never looks finished."""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol, TypeVar, runtime_checkable

from tomlens.errors import TomlensError
from tomlens.io import read_json, write_json
from tomlens.runs.base import config_from_dict, config_to_dict
from tomlens.runs.index import record_run

C = TypeVar("C")

CONFIG = "config.json"
MANIFEST = "manifest.json"
RESULT = "result.json"
INPUTS = "inputs.json"  # an experiment stage's input fingerprints (`tomlens.runs.experiment`)


def check_store_writable(config: Any) -> None:
    """Refuse, before a model loads, a stage whose activation store (`config.store`, else the
    default store) this process cannot write: found out later, it would cost the model's loading
    and end in a bare PermissionError. A config with no `store` setting uses none."""
    if not any(f.name == "store" for f in dataclasses.fields(config)):
        return
    from tomlens.activations.store import check_writable, default_store

    check_writable(Path(config.store) if config.store else default_store())


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


@runtime_checkable
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


def _nulls_as_nan(cls: Any, data: Any) -> Any:
    """`data` with null in every `float` field (not `float | None`) as NaN: JSON writes NaN as null
    (`tomlens.io.write_json`), so a number that could not be measured comes back as it was. Nested
    summaries, tuples of them and dicts of them are walked; anything else is left as it is."""
    if not (dataclasses.is_dataclass(cls) and isinstance(data, Mapping)):
        return data
    hints = typing.get_type_hints(cls)
    out = dict(data)
    for key, value in data.items():
        tp = hints.get(key)
        if tp is float and value is None:
            out[key] = math.nan
            continue
        if _holds_floats(tp):  # dict[str, float], tuple[float, ...]: their nulls too
            out[key] = ({k: math.nan if v is None else v for k, v in value.items()} if isinstance(value, Mapping)
                        else [math.nan if v is None else v for v in value] if isinstance(value, list) else value)
            continue
        for inner in _summary_classes(tp):
            if isinstance(value, Mapping) and not dataclasses.is_dataclass(value):
                out[key] = (_nulls_as_nan(inner, value) if _is_class_table(tp)
                            else {k: _nulls_as_nan(inner, v) for k, v in value.items()})
            elif isinstance(value, list):
                out[key] = [_nulls_as_nan(inner, v) for v in value]
    return out


def _holds_floats(tp: Any) -> bool:
    """`dict[str, float]` or `tuple[float, ...]` (alone or `| None`): containers of plain floats."""
    options = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
    for option in options:
        args = typing.get_args(option)
        if typing.get_origin(option) is dict and args[1:] == (float,):
            return True
        if typing.get_origin(option) is tuple and args == (float, Ellipsis):
            return True
    return False


def _summary_classes(tp: Any) -> list[type]:
    """The dataclasses an annotation holds: `X`, `X | None`, `tuple[X, ...]`, `dict[str, X]`."""
    found = []
    for arg in (tp, *typing.get_args(tp)):
        for inner in (arg, *typing.get_args(arg)):
            if isinstance(inner, type) and dataclasses.is_dataclass(inner):
                found.append(inner)
    return list(dict.fromkeys(found))


def _is_class_table(tp: Any) -> bool:
    """The annotation is a dataclass itself (or one `| None`), not a dict of them."""
    options = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
    return any(isinstance(a, type) and dataclasses.is_dataclass(a) for a in options)


def summary_from_dict(cls: type[S], data: Mapping[str, Any], *, folder: str | Path, stage: str) -> S:
    """The typed summary `cls` from a result.json's dict. A folder written before its stage's
    summary was typed (or by a later tomlens) does not fit: say so, and that rerunning the stage
    into the folder rewrites it, instead of failing later on a missing field."""
    try:
        return config_from_dict(cls, _nulls_as_nan(cls, data))
    except (TomlensError, TypeError) as e:
        why = e.problem if isinstance(e, TomlensError) else str(e)
        raise TomlensError(
            f"{folder}: its result.json does not fit this tomlens's {stage} result ({why})",
            f"rerun the {stage} stage into that folder (a rerun reuses its cached activations), "
            "or read it with the tomlens version that wrote it (its manifest.json names it)") from e
