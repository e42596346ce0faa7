"""What every run shares: which model, which stimuli, configs built from plain dicts (a TOML table,
parsed flags) with misspelt keys caught, and the content hash that says whether a run is done.

A config is a frozen dataclass whose fields are plain values or other configs; `config_from_dict`
builds one from a mapping and `config_to_dict` is its inverse, so a resolved config can be written
beside its results and read back. A run directory's `config.json` is that dict; `config_hash`
(over the fields that change the numbers, not where output goes or whether bars show) is what
"rerunning the same config reuses what is done" compares.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence, TypeVar

from tomlens.errors import TomlensError

C = TypeVar("C")

# Fields that say where output goes or how it is shown: they do not change a run's numbers.
PRESENTATION_FIELDS = frozenset({"out", "progress", "format", "store", "dry_run", "max_runs"})


@dataclass(frozen=True)
class ModelSpec:
    """Which model a run uses and how it is loaded (`tomlens.models.load_model`)."""

    name: str = "smollm2-135m"
    revision: str | None = None
    dtype: str | None = None  # None: bf16 on a GPU, fp32 on a CPU
    device: str | None = None
    prepend_bos: bool | None = None  # None: the tokenizer's own rule
    seed: int = 0  # weights of random-init models ("tiny-*", "random:*")

    def load(self) -> Any:
        from tomlens.models import load_model

        return load_model(self.name, revision=self.revision, device=self.device, dtype=self.dtype,
                          seed=self.seed, prepend_bos=self.prepend_bos)

    def load_tokenizer(self) -> Any:
        from tomlens.models import load_tokenizer

        return load_tokenizer(self.name, revision=self.revision, prepend_bos=self.prepend_bos)


@dataclass(frozen=True)
class StimuliSpec:
    """A generated family with its parameters, or a file (JSONL or CSV; BigToM's csv with
    `family = "bigtom"`)."""

    family: str | None = None
    n: int = 20
    seed: int = 0
    path: str | None = None
    options: Mapping[str, Any] = field(default_factory=dict)  # generator options, e.g. {ks = [0, 6]}

    def __post_init__(self) -> None:
        if (self.family is None) == (self.path is None) and self.family != "bigtom":
            raise TomlensError("a stimuli entry needs exactly one of `family` and `path`",
                               'e.g. {family = "unexpected-transfer", n = 8} or {path = "stimuli.jsonl"}')
        if self.family == "bigtom" and self.path is None:
            raise TomlensError("the `bigtom` family needs `path` (its csv)", "add path = \".../bigtom.csv\"")
        if self.n < 1:
            raise TomlensError(f"stimuli n = {self.n} must be at least 1", "use n = 1 or more")

    def load(self) -> list[Any]:
        """The stimuli, in order; the same spec always gives the same list."""
        from tomlens.stimuli import generate, load_bigtom, read_jsonl

        if self.family == "bigtom":
            return load_bigtom(self.path, **dict(self.options))[: self.n]
        if self.path is not None:
            if not Path(self.path).is_file():
                raise TomlensError(f"stimulus file {self.path!r} does not exist",
                                   "write one with `tomlens stimuli ...` or fix the path")
            stimuli = read_jsonl(self.path)
            if not stimuli:
                raise TomlensError(f"{self.path} has no stimuli", "write stimuli into it first, e.g. `tomlens stimuli ...`")
            return stimuli
        return generate(self.family, n=self.n, seed=self.seed, **dict(self.options))


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _config_class(tp: Any) -> type | None:
    """The dataclass inside an annotation (`X`, `X | None`), or None."""
    if dataclasses.is_dataclass(tp):
        return tp
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(inner) == 1 and dataclasses.is_dataclass(inner[0]):
            return inner[0]
    return None


def _options(tp: Any) -> tuple[Any, ...]:
    """The members of a union annotation, or the annotation alone."""
    return typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)


def _is_str_tuple(tp: Any) -> bool:
    """`tuple[str, ...]`, alone or in a union (`tuple[str, ...] | None`)."""
    options = _options(tp)
    return any(typing.get_origin(o) is tuple and typing.get_args(o)[:1] == (str,) for o in options)


def _convert(value: Any, tp: Any, where: str) -> Any:
    cls = _config_class(tp)
    if cls is not None and isinstance(value, Mapping):
        return config_from_dict(cls, value, where=where)
    origin = typing.get_origin(tp)
    if isinstance(value, str) and _is_str_tuple(tp):  # sites = "resid_post head_out": the list syntax
        return tuple(split_items(value))
    if origin is tuple and isinstance(value, (list, tuple)):  # tuple[Spec, ...]: a list of tables
        args = typing.get_args(tp)
        inner = _config_class(args[0]) if args else None
        if inner is not None:
            return tuple(config_from_dict(inner, v, where=f"{where}[{i}]") if isinstance(v, Mapping) else v
                         for i, v in enumerate(value))
    if origin is tuple and isinstance(value, list):
        return tuple(value)
    if origin in (typing.Union, types.UnionType) and isinstance(value, list) \
            and any(typing.get_origin(a) is tuple for a in typing.get_args(tp)):
        return tuple(value)
    if isinstance(value, int) and not isinstance(value, bool) and float in _options(tp) and int not in _options(tp):
        return float(value)  # TOML's `1` for a float setting
    return value


def config_from_dict(cls: type[C], data: Mapping[str, Any], *, where: str = "") -> C:
    """Build config `cls` from `data`; a key that is not a field is an error naming the nearest one."""
    if not isinstance(data, Mapping):
        raise TomlensError(f"{where or cls.__name__} must be a table of settings, not {type(data).__name__}",
                           "write it as key = value lines under its [section]")
    hints = _hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        path = f"{where}.{key}" if where else key
        if key not in names:
            near = difflib.get_close_matches(key, names, n=1, cutoff=0.5)
            raise TomlensError(
                f"unknown setting {path!r}" + (f": did you mean {near[0]!r}?" if near else ""),
                f"valid settings{' in ' + where if where else ''}: {', '.join(names)}")
        kwargs[key] = _convert(value, hints[key], path)
    return cls(**kwargs)


def split_items(values: str | Sequence[str]) -> list[str]:
    """The one list syntax of sites and positions: items separated by commas and/or spaces. A
    layer list stays with its site: `resid_post:0,4,8,head_out` is `resid_post:0,4,8` and `head_out`."""
    items: list[str] = []
    for value in [values] if isinstance(values, str) else list(values):
        for word in value.split():
            for piece in (p for p in word.split(",") if p):
                if items and ":" in items[-1] and re.fullmatch(r"\d+(-\d+)?", piece):
                    items[-1] += "," + piece
                else:
                    items.append(piece)
    return items


def config_to_dict(config: Any) -> dict[str, Any]:
    """The config as plain JSON/TOML values (tuples as lists, nested configs as tables)."""
    def plain(v: Any) -> Any:
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            return {f.name: plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        if isinstance(v, Mapping):
            return {str(k): plain(x) for k, x in v.items()}
        if isinstance(v, Path):
            return str(v)
        return v
    return plain(config)


def config_hash(config: Any, *, ignore: frozenset[str] = PRESENTATION_FIELDS) -> str:
    """Content hash of the settings that change a run's numbers (16 hex digits)."""
    def strip(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: strip(x) for k, x in v.items() if k not in ignore}
        if isinstance(v, list):
            return [strip(x) for x in v]
        return v
    text = json.dumps(strip(config_to_dict(config)), sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
