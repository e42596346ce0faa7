"""What every run shares: which model, which stimuli, configs built from plain dicts (a TOML table,
parsed flags) with misspelt keys caught, and the content hash that says whether a run is done.

A config is a frozen dataclass whose fields are plain values or other configs; `config_from_dict`
builds one from a mapping and `config_to_dict` is its inverse, so a resolved config can be written
beside its results and read back. A run directory's `config.json` is that dict; `config_hash`
(over the fields that change the numbers, not where output goes or whether bars show) is what
"rerunning the same config reuses what is done" compares.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import difflib
import hashlib
import json
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from tomlens.errors import TomlensError
from tomlens.provenance import plain_values
from tomlens.syntax import split_items  # the one list syntax (re-exported here for the runs layer)

C = TypeVar("C")

# Fields that say where output goes or how it is shown: they do not change a run's numbers.
PRESENTATION_FIELDS = frozenset({"out", "progress", "format", "store", "dry_run", "max_runs"})

DEFAULT_N = 20  # tasks of a generated stimulus family when `n` is not given


@dataclass(frozen=True)
class ModelSpec:
    """Which model a run uses and how it is loaded (`tomlens.models.load_model`)."""

    name: str = "smollm2-135m"
    revision: str | None = None
    dtype: str | None = None  # None: bf16 on a GPU, fp32 on a CPU
    device: str | None = None
    prepend_bos: bool | None = None  # None: the tokenizer's own rule
    seed: int = 0  # weights of random-init models ("tiny-*", "random:*")
    # accelerate placement ("auto", ...) for a hub or folder model; not with device. A string here:
    # a dict module -> device only through load_model.
    device_map: str | None = None

    def load(self) -> Any:
        from tomlens.models import load_model

        return load_model(self.name, revision=self.revision, device=self.device, dtype=self.dtype,
                          seed=self.seed, prepend_bos=self.prepend_bos, device_map=self.device_map)

    def load_tokenizer(self) -> Any:
        from tomlens.models import load_tokenizer

        return load_tokenizer(self.name, revision=self.revision, prepend_bos=self.prepend_bos)


@dataclass(frozen=True)
class StimuliSpec:
    """A generated family with its parameters, or a file (JSONL or CSV; BigToM's csv with
    `family = "bigtom"`). `n` counts tasks of a generated family (default 20), stories of BigToM and
    rows of a file; None (the default for files) means all of them."""

    family: str | None = None
    n: int | None = None
    seed: int = 0
    path: str | None = None
    options: Mapping[str, Any] = field(default_factory=dict)  # generator options, e.g. {ks = [0, 6]}

    def __post_init__(self) -> None:
        from tomlens.stimuli import check_options

        if (self.family is None) == (self.path is None) and self.family != "bigtom":
            raise TomlensError("a stimuli entry needs exactly one of `family` and `path`",
                               'e.g. {family = "unexpected-transfer", n = 8} or {path = "stimuli.jsonl"}')
        if self.family == "bigtom" and self.path is None:
            raise TomlensError("the `bigtom` family needs `path` (its csv)", "add path = \".../bigtom.csv\"")
        if self.family is not None:
            check_options(self.family, self.options)  # an unknown family or a misspelt option, now
        elif self.options:
            raise TomlensError(f"a stimulus file takes no options (got {', '.join(map(str, self.options))})",
                               "drop `options`, or use `family` to generate stimuli")
        if self.n is None and self.family is not None and self.family != "bigtom":
            object.__setattr__(self, "n", DEFAULT_N)
        if self.n is not None and self.n < 1:
            raise TomlensError(f"stimuli n = {self.n} must be at least 1",
                               "use n = 1 or more (leave it out for every story or row of a file)")

    def load(self) -> list[Any]:
        """The stimuli, in order; the same spec always gives the same list."""
        from tomlens.stimuli import generate, load_bigtom, read_jsonl

        if self.family == "bigtom":
            return load_bigtom(self.path, limit=self.n, **dict(self.options))
        if self.path is not None:
            if not Path(self.path).is_file():
                raise TomlensError(f"stimulus file {self.path!r} does not exist",
                                   "write one with `tomlens stimuli ...` or fix the path")
            stimuli = read_jsonl(self.path)
            if not stimuli:
                raise TomlensError(f"{self.path} has no stimuli", "write stimuli into it first, e.g. `tomlens stimuli ...`")
            return stimuli if self.n is None else stimuli[: self.n]
        assert self.family is not None and self.n is not None  # __post_init__: a family has n
        return generate(self.family, n=self.n, seed=self.seed, **dict(self.options))


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _is_dataclass_type(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _config_class(tp: Any) -> type | None:
    """The dataclass inside an annotation (`X`, `X | None`), or None."""
    if _is_dataclass_type(tp):
        return typing.cast(type, tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(inner) == 1 and _is_dataclass_type(inner[0]):
            return typing.cast(type, inner[0])
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
    if origin in (dict, collections.abc.Mapping) and isinstance(value, Mapping):
        args = typing.get_args(tp)  # dict[str, Spec]: a table of tables (a typed result's per-key rows)
        inner = _config_class(args[1]) if len(args) == 2 else None
        if inner is not None:
            return {k: config_from_dict(inner, v, where=f"{where}.{k}") if isinstance(v, Mapping) else v
                    for k, v in value.items()}
    if origin in (typing.Union, types.UnionType) and isinstance(value, (list, Mapping)):
        inner_types = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(inner_types) == 1:  # `tuple[Spec, ...] | None`, `dict[str, Spec] | None`
            return _convert(value, inner_types[0], where)
    if origin in (typing.Union, types.UnionType) and isinstance(value, list) \
            and any(typing.get_origin(a) is tuple for a in typing.get_args(tp)):
        return tuple(value)  # `tuple[str, ...] | str`: a list is the tuple
    if isinstance(value, int) and not isinstance(value, bool) and float in _options(tp) and int not in _options(tp):
        return float(value)  # TOML's `1` for a float setting
    return value


def _renamed_keys(cls: type, data: Mapping[str, Any], where: str) -> Mapping[str, Any]:
    """`data` with each key a config class has renamed (its `RENAMED`: old -> new) under its new
    name, saying so once per key: an old settings file or run folder still reads, for one release."""
    renamed: Mapping[str, str] = {**RENAMED_SETTINGS, **getattr(cls, "RENAMED", {})}
    if not any(k in renamed for k in data):
        return data
    from tomlens.messages import warn

    out: dict[str, Any] = {}
    for key, value in data.items():
        new = renamed.get(key)
        if new is None:
            out[key] = value
            continue
        if new in data:
            raise TomlensError(f"both {key!r} and {new!r} are set{' in ' + where if where else ''}",
                               f"keep only {new!r} ({key!r} is its old name)")
        warn(f"setting {key!r} is now {new!r} (one name per idea); the old name goes in a later release")
        out[new] = value
    return out


def config_from_dict(cls: type[C], data: Mapping[str, Any], *, where: str = "") -> C:
    """Build config `cls` from `data`; a key that is not a field is an error naming the nearest one."""
    if not isinstance(data, Mapping):
        raise TomlensError(f"{where or cls.__name__} must be a table of settings, not {type(data).__name__}",
                           "write it as key = value lines under its [section]")
    hints = _hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]  # type: ignore[arg-type]  # a dataclass by contract
    kwargs: dict[str, Any] = {}
    for key, value in _renamed_keys(cls, data, where).items():
        path = f"{where}.{key}" if where else key
        if key not in names:
            near = difflib.get_close_matches(key, names, n=1, cutoff=0.5)
            raise TomlensError(
                f"unknown setting {path!r}" + (f": did you mean {near[0]!r}?" if near else ""),
                f"valid settings{' in ' + where if where else ''}: {', '.join(names)}")
        kwargs[key] = _convert(value, hints[key], path)
        _check_type(kwargs[key], hints[key], path, given=value)
    return cls(**kwargs)


def _matches(value: Any, tp: Any) -> bool:
    """Whether `value` fits annotation `tp`; an annotation this does not know (Any, a class) fits anything."""
    if tp is Any:
        return True
    if tp is None or tp is type(None):
        return value is None
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, a) for a in typing.get_args(tp))
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, str)
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(value, (tuple, list)):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(_matches(v, args[0]) for v in value)
        return len(args) == len(value) and all(_matches(v, a) for v, a in zip(value, args, strict=True))
    if origin is not None and isinstance(origin, type) and issubclass(origin, Mapping) or tp is Mapping:
        return isinstance(value, Mapping)
    if _is_dataclass_type(tp):
        return isinstance(value, tp)
    return True


def _describe(tp: Any) -> str:
    """An annotation in the words of a config file: 'an integer', 'a list of strings', ..."""
    if tp is None or tp is type(None):
        return "none (leave it out)"
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp) if a is not type(None))
    if origin is tuple:
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            inner = _describe(args[0]).split(" ", 1)[-1]
            return f"a list of {inner if inner.endswith('s') else inner + 's'}"
        return f"a list of {len(args)} values"
    if _is_dataclass_type(tp):
        return f"a table of {tp.__name__} settings"
    if origin is not None and isinstance(origin, type) and issubclass(origin, Mapping) or tp is Mapping:
        return "a table"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(
        tp, getattr(tp, "__name__", str(tp)))


def _check_type(value: Any, tp: Any, path: str, given: Any) -> None:
    """Raise TomlensError naming the setting, the value as `given` and the type it needs, before the
    dataclass would fail with a bare TypeError."""
    if not _matches(value, tp):
        raise TomlensError(f"setting {path!r} = {given!r} is {type(given).__name__}, but it must be {_describe(tp)}",
                           f"write {path} as {_describe(tp)}")


def config_to_dict(config: Any) -> dict[str, Any]:
    """The config as plain JSON/TOML values (tuples as lists, nested configs as tables)."""
    return plain_values(config)


# Settings renamed for one word per idea (old key -> new), read under their new name by every config
# (with a line saying so) and hashed under it, so a run folder written before the rename is reused.
RENAMED_SETTINGS: Mapping[str, str] = {"selection_fraction": "select_fraction"}

UNSET_NOT_HASHED = frozenset({"device_map"})  # fields that enter a config's hash only when not None


def config_hash(config: Any, *, ignore: frozenset[str] = PRESENTATION_FIELDS) -> str:
    """Content hash of the settings that change a run's numbers (16 hex digits)."""
    def strip(v: Any) -> Any:
        if isinstance(v, dict):  # a field added later hashes only when set, so earlier runs stay reused
            return {RENAMED_SETTINGS.get(k, k): strip(x) for k, x in v.items()
                    if k not in ignore and not (k in UNSET_NOT_HASHED and x is None)}
        if isinstance(v, list):
            return [strip(x) for x in v]
        return v
    text = json.dumps(strip(config_to_dict(config)), sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
