"""Experiments as files: one TOML names the model(s) and the stages with their settings, and
`run_experiment` runs them in pipeline order into one self-describing folder.

A stage table holds the stage config's fields minus `model` (which comes from `[model]` or each
`[[models]]` entry). A stage whose folder already holds a finished result (`result.json`) with the
same `config_hash`, the same input fingerprints (`inputs.json`: the files its config names and the
results of the earlier stages it reads; the hash covers paths, not contents), a model loaded the
same way (resolved dtype and device) and whose inputs were not rerun, is loaded instead of run:
rerunning the same file reuses what is done. Figures and `report.html` are the report layer's job
(`tomlens run`).
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import inspect
import json
import re
import sys
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tomlens.errors import TomlensError
from tomlens.io import file_sha256, read_json, write_json
from tomlens.messages import say
from tomlens.runs.base import ModelSpec, config_from_dict, config_hash, config_to_dict
from tomlens.runs.files import (
    CONFIG,
    INPUTS,
    MANIFEST,
    RESULT,
    RunResult,
    begin_save,
    check_store_writable,
    summary_from_dict,
)

# Pipeline order; each stage is `tomlens.runs.<stage>` with these config and result classes.
STAGES: tuple[str, ...] = ("audit", "behaviour", "cache", "probes", "pairs", "patching", "steering", "validate")
STAGE_CLASSES: dict[str, tuple[str, str]] = {
    "audit": ("AuditConfig", "AuditResult"),
    "behaviour": ("BehaviourConfig", "BehaviourResult"),
    "cache": ("CacheConfig", "CacheResult"),
    "probes": ("ProbesConfig", "ProbesResult"),
    "pairs": ("PairsConfig", "PairsResult"),
    "patching": ("PatchingConfig", "PatchingRunResult"),
    "steering": ("SteeringConfig", "SteeringResult"),
    "validate": ("ValidateConfig", "ValidationResult"),
}
TOP_LEVEL_KEYS: tuple[str, ...] = ("name", "description", "seed", "model", "models", *STAGES)
TOKENIZER_ONLY = frozenset({"audit", "pairs"})  # stages that need no weights when no model is loaded yet
PROBES_TABLE = "probes"  # `patching.probe_table = "probes"`: the probes stage's table, same model
PATH_KEYS = frozenset({"path", "pairs_path", "probe_table", "directions_path"})  # config keys that name an input file


def stage_module(stage: str) -> Any:
    """The runs module of `stage` (imported on use: a run needs only its own stages' code)."""
    if stage not in STAGES:
        raise TomlensError(f"unknown stage {stage!r}", f"stages are {', '.join(STAGES)}")
    return importlib.import_module(f"tomlens.runs.{stage}")


def _stage_classes(stage: str) -> tuple[type, type[RunResult]]:
    module = stage_module(stage)
    config_name, result_name = STAGE_CLASSES[stage]
    return getattr(module, config_name), getattr(module, result_name)


def _unknown(key: str, valid: tuple[str, ...] | list[str], where: str) -> TomlensError:
    near = difflib.get_close_matches(key, list(valid), n=1, cutoff=0.5)
    return TomlensError(f"unknown setting {key!r}" + (f" in {where}" if where else "")
                        + (f": did you mean {near[0]!r}?" if near else ""),
                        f"valid settings{' in ' + where if where else ''}: {', '.join(valid)}")


def model_slug(spec: ModelSpec) -> str:
    """A folder name for a model entry: its name and the settings it changes from the defaults
    (revision, dtype, BOS rule, weight seed), path-safe, so two entries of one model get two folders."""
    parts = [spec.name + (f"@{spec.revision}" if spec.revision else "")]
    if spec.dtype:
        parts.append(spec.dtype)
    if spec.prepend_bos is not None:
        parts.append("bos" if spec.prepend_bos else "no-bos")
    if spec.seed:
        parts.append(f"seed{spec.seed}")
    return re.sub(r"[^A-Za-z0-9._@-]+", "-", "-".join(parts)).strip("-.") or "model"


def expand_model_entry(entry: Any, where: str) -> list[tuple[Any, str]]:
    """A model entry with `revisions = [...]` and/or `seeds = [...]` as one plain entry per value
    (revisions x seeds), each with where it came from: a study over training checkpoints or weight
    seeds is written once and runs as one model per value (`tomlens study`, `tomlens run`)."""
    if not isinstance(entry, Mapping) or not ({"revisions", "seeds"} & set(entry)):
        return [(entry, where)]
    lists: dict[str, list[Any]] = {}
    for plural, singular in (("revisions", "revision"), ("seeds", "seed")):
        if plural not in entry:
            continue
        values = entry[plural]
        if singular in entry:
            raise TomlensError(f"{where} sets both `{singular}` and `{plural}`",
                               f"keep one: `{plural} = [...]` runs one model per value")
        if not isinstance(values, list) or not values:
            raise TomlensError(f"{where}.{plural} = {values!r} is not a non-empty list",
                               f"write e.g. {plural} = {['step1000', 'step2000'] if plural == 'revisions' else [0, 1]}")
        if len(set(map(str, values))) < len(values):
            raise TomlensError(f"{where}.{plural} lists a value twice ({values!r})", "list each value once")
        lists[singular] = values
    if "seed" in lists:
        from tomlens.models.tiny import TINY

        name = str(entry.get("name", ModelSpec.name))
        if not (name.startswith("random:") or name in TINY):
            raise TomlensError(f"{where}.seeds: {name!r} has trained weights, so every seed would give the same run",
                               'seeds are for random-init models: use name = "random:' + name + '" or a tiny-* model')
    base = {k: v for k, v in entry.items() if k not in ("revisions", "seeds")}
    out = [(base, where)]
    for key, values in lists.items():
        out = [({**e, key: v}, f"{w}.{key}s[{i}]") for e, w in out for i, v in enumerate(values)]
    return out


@dataclass(frozen=True)
class ExperimentConfig:
    """A whole experiment: which models, which stages, each stage's settings as written."""

    name: str
    models: tuple[ModelSpec, ...]
    seed: int = 0  # each stage's `seed` unless its table sets one
    description: str = ""
    stages: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)  # stage -> its table

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", self.name):
            raise TomlensError(f"experiment name {self.name!r} is not a plain folder name",
                               'use letters, digits, ".", "_" and "-", e.g. name = "probe-study"')
        if not self.models:
            raise TomlensError("the experiment names no model", 'add a [model] table, e.g. name = "smollm2-135m"')
        if not self.stages:
            raise TomlensError("the experiment has no stage", f"add at least one of the tables [{'], ['.join(STAGES)}]")
        for stage, table in self.stages.items():
            if stage not in STAGES:
                raise _unknown(stage, TOP_LEVEL_KEYS, "")
            if not isinstance(table, Mapping):
                raise TomlensError(f"[{stage}] must be a table of settings", f"write it as [{stage}] with key = value lines")
            if "model" in table:
                raise TomlensError(f"[{stage}] sets `model`; the model comes from the experiment's [model] / [[models]]",
                                   f"remove `model` from [{stage}]")
        if self.stages.get("patching", {}).get("dry_run"):
            raise TomlensError("patching.dry_run = true: an experiment runs every stage to the end",
                               "see a patching plan with `tomlens patch --dry-run`, then drop dry_run here")
        probe_table = self.stages.get("patching", {}).get("probe_table")
        if probe_table == PROBES_TABLE and "probes" not in self.stages:
            raise TomlensError('patching.probe_table = "probes" but the experiment has no [probes] stage',
                               "add a [probes] table, or give probe_table a table file's path")
        slugs = [model_slug(m) for m in self.models]
        if len(set(slugs)) < len(slugs):
            raise TomlensError(f"two model entries share a folder name ({', '.join(slugs)})",
                               "list each model (name, revision, dtype, prepend_bos, seed) once")
        for stage in self.stages:  # misspelt keys and bad values fail now, before any model loads
            self.stage_config(stage, self.models[0])
        if probe_table == PROBES_TABLE and "head_out" not in self.stage_config("probes", self.models[0]).sites:
            raise TomlensError('patching.probe_table = "probes" needs per-head probes, but probes.sites has no head_out',
                               'add "head_out" to probes.sites, or drop probe_table')

    # -- reading ------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ExperimentConfig:
        """From a parsed TOML (or a run's resolved `config.json`)."""
        if not isinstance(data, Mapping):
            raise TomlensError("an experiment file must be a TOML table", "start with name = \"...\" and a [model] table")
        for key in data:
            if key not in TOP_LEVEL_KEYS:
                raise _unknown(key, TOP_LEVEL_KEYS, "the experiment file")
        if "name" not in data:
            raise TomlensError("the experiment has no `name`", 'add name = "my-study" at the top (it names the run folder)')
        if "model" in data and "models" in data:
            raise TomlensError("the experiment has both [model] and [[models]]", "keep one: [model] for one model")
        if "model" in data:
            entries = [data["model"]]
            where = ["model"]
        elif "models" in data:
            entries = data["models"] if isinstance(data["models"], list) else [data["models"]]
            where = [f"models[{i}]" for i in range(len(entries))]
        else:
            raise TomlensError("the experiment names no model", 'add [model] with name = "smollm2-135m" (or [[models]])')
        models = tuple(config_from_dict(ModelSpec, m, where=w)
                       for e, w0 in zip(entries, where, strict=True) for m, w in expand_model_entry(e, w0))
        seed = data.get("seed", 0)
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise TomlensError(f"seed = {seed!r} is not an integer", "use e.g. seed = 0")
        for stage in STAGES:
            if stage in data and not isinstance(data[stage], Mapping):
                raise TomlensError(f"`{stage}` must be a table of settings, not {type(data[stage]).__name__}",
                                   f"write it as [{stage}] with key = value lines")
        if not isinstance(data["name"], str):
            raise TomlensError(f"name = {data['name']!r} is not a string", 'use e.g. name = "probe-study"')
        return cls(name=data["name"], models=models, seed=seed, description=str(data.get("description", "")),
                   stages={s: dict(data[s]) for s in STAGES if s in data})

    @classmethod
    def load(cls, path: str | Path, overrides: list[str] | None = None) -> ExperimentConfig:
        """Read an experiment file (TOML; a run's `config.json` works too), with `apply_overrides`."""
        data = read_experiment_file(path)
        if Path(path).suffix != ".json":  # a TOML's relative input files are its own folder's
            data = files_from(data, Path(path).parent)
        return cls.from_dict(apply_overrides(data, overrides) if overrides else data)

    # -- resolving ----------------------------------------------------------------------------------
    def stage_config(self, stage: str, model: ModelSpec, folders: Mapping[str, Path] | None = None) -> Any:
        """Stage `stage`'s config for `model`. With `folders` (stage -> its output folder), a
        `probe_table = "probes"` becomes the probes stage's table file there."""
        config_cls, _ = _stage_classes(stage)
        table = dict(self.stages[stage])
        names = [f.name for f in dataclasses.fields(config_cls) if f.init]
        if "seed" in names and "seed" not in table:
            table["seed"] = self.seed
        table["model"] = config_to_dict(model)
        if stage == "audit" and "stimuli" not in table:
            table["stimuli"] = self.audited_sets()
        if stage == "patching":
            if "pairs" not in table and "pairs_path" not in table and "pairs" in self.stages:
                table["pairs"] = config_to_dict(self.stage_config("pairs", model))
            if isinstance(table.get("pairs"), Mapping):
                table["pairs"] = {**table["pairs"], "model": config_to_dict(model)}
            if table.get("probe_table") == PROBES_TABLE and folders is not None:
                table["probe_table"] = str(probe_table_file(folders["probes"], self.stage_config("probes", model)))
        return config_from_dict(config_cls, table, where=stage)

    def audited_sets(self) -> list[Any]:
        """What `[audit]` without stimuli audits: the behaviour stage's sets and the probes stage's."""
        behaviour = self.stages.get("behaviour", {}).get("stimuli", ())
        sets: list[Any] = [behaviour] if isinstance(behaviour, Mapping) else list(behaviour)
        for key in ("stimuli", "test_stimuli"):
            if self.stages.get("probes", {}).get(key):
                sets.append(self.stages["probes"][key])
        return sets

    def to_dict(self) -> dict[str, Any]:
        """The resolved experiment (every default filled in) as plain values; `from_dict` reads it back."""
        out: dict[str, Any] = {"name": self.name, "description": self.description, "seed": self.seed,
                               "models": [config_to_dict(m) for m in self.models]}
        for stage in STAGES:
            if stage in self.stages:
                resolved = config_to_dict(self.stage_config(stage, self.models[0]))
                resolved.pop("model", None)
                if isinstance(resolved.get("pairs"), dict):
                    resolved["pairs"].pop("model", None)
                out[stage] = resolved
        return out


def probe_table_file(folder: Path, probes: Any) -> Path:
    """The table the probes stage left in `folder`: the format its finished run recorded (a reused
    run keeps its own, since `format` is not part of the hash), else whichever table exists, else
    the one `probes` (the config of this run) will write."""
    saved = folder / CONFIG
    formats = [read_json(saved).get("format")] if (folder / RESULT).is_file() and saved.is_file() else []
    formats += [getattr(probes, "format", "parquet"), "parquet", "csv"]
    for fmt in formats:
        if fmt in ("parquet", "csv") and (folder / f"probes.{fmt}").is_file():
            return folder / f"probes.{fmt}"
    return folder / f"probes.{'csv' if getattr(probes, 'format', 'parquet') == 'csv' else 'parquet'}"


def files_from(value: Any, folder: Path) -> Any:
    """`value` with every relative input file it names (`PATH_KEYS`) read from `folder`: an experiment
    file names its stories beside itself, whatever folder `tomlens run` is started in (a `--set`
    given on the command line stays relative to that folder). `probe_table = "probes"` is a keyword."""
    if isinstance(value, Mapping):
        return {k: _input_file(x, folder) if k in PATH_KEYS and isinstance(x, str) and x != PROBES_TABLE
                and not Path(x).is_absolute() else files_from(x, folder) for k, x in value.items()}
    if isinstance(value, list):
        return [files_from(x, folder) for x in value]
    return value


def _input_file(value: str, folder: Path) -> str:
    """A relative input file of an experiment file, absolute: beside the file; or, for a file written
    when paths were read from the folder tomlens runs in, there, with a line saying so."""
    beside = folder / value
    if not beside.exists() and Path(value).exists():
        from tomlens.messages import warn

        warn(f"{value!r} is not beside the experiment file ({beside}) but is in the folder tomlens runs in, "
             "so it is read from there; relative paths in an experiment file are read from the file's own folder: "
             "write this one relative to it")
        return str(Path(value).resolve())
    return str(beside.resolve())


def read_experiment_file(path: str | Path) -> dict[str, Any]:
    """The plain values of an experiment file (TOML, or JSON for a run's `config.json`)."""
    path = Path(path)
    if not path.is_file():
        raise TomlensError(f"experiment file {str(path)!r} does not exist", "pass a .toml file, e.g. examples/demo.toml")
    text = path.read_text(encoding="utf-8")
    try:
        return json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
        raise TomlensError(f"{path} is not valid {'JSON' if path.suffix == '.json' else 'TOML'}: {e}",
                           "fix the line it names") from None


def apply_overrides(data: Mapping[str, Any], assignments: list[str]) -> dict[str, Any]:
    """A copy of a parsed experiment file with `KEY.PATH=VALUE` assignments applied (VALUE is a
    TOML value; a bare word is a string; a number in the path indexes a list of tables), e.g.
    `model.name=tiny-llama`, `probes.stimuli.n=5`, `behaviour.stimuli.0.n=1`."""
    copy: dict[str, Any] = json.loads(json.dumps(data))  # deep copy of plain TOML values
    for text in assignments:
        key, sep, raw = text.partition("=")
        if not sep or not key.strip():
            raise TomlensError(f"override {text!r} is not KEY=VALUE", "write e.g. --set model.name=tiny-llama")
        try:
            value = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw  # a bare word
        *path, last = key.strip().split(".")
        node: Any = copy
        for i, part in enumerate(path):
            if isinstance(node, list):
                if not part.isdigit() or int(part) >= len(node):
                    raise TomlensError(f"override {key!r}: {'.'.join(path[:i]) or 'the file'} is a list of "
                                       f"{len(node)} tables; {part!r} is not an index of it", "use 0, 1, ...")
                node = node[int(part)]
            else:
                node = node.setdefault(part, {})
            if not isinstance(node, (dict, list)):
                raise TomlensError(f"override {key!r}: {'.'.join(path[:i + 1])} is a value, not a table",
                                   "set the value itself")
        if isinstance(node, list):
            if not last.isdigit() or int(last) >= len(node):
                raise TomlensError(f"override {key!r}: {last!r} is not an index of a list of {len(node)}", "use 0, 1, ...")
            node[int(last)] = value
        else:
            node[last] = value
    return copy


@dataclass
class ModelRun:
    """One model's stages: results by stage, where each lives, and whether it was reused."""

    model: ModelSpec
    folder: Path
    results: dict[str, Any] = field(default_factory=dict)
    folders: dict[str, Path] = field(default_factory=dict)
    reused: dict[str, bool] = field(default_factory=dict)
    provenance: dict[str, Any] | None = None  # tomlens.models.provenance of the loaded model


@dataclass
class ExperimentResult:
    config: ExperimentConfig
    out: Path
    runs: list[ModelRun]
    manifest: dict[str, Any]

    def result(self, stage: str, model: int = 0) -> Any:
        """Stage `stage`'s result for the `model`-th model (None when the stage did not run)."""
        return self.runs[model].results.get(stage)

    def describe(self) -> str:
        """One line per model entry; two entries of one model are told apart by their folder name
        (`model_slug`: the settings they change)."""
        names = [run.model.name for run in self.runs]
        lines = []
        for run in self.runs:
            done = ", ".join(f"{s}{' (reused)' if run.reused[s] else ''}" for s in run.results)
            label = model_slug(run.model) if names.count(run.model.name) > 1 else run.model.name
            lines.append(f"{label}: {done} -> {run.folder}")
        return "\n".join(lines)


def _finished(folder: Path, config: Any) -> bool:
    """A finished run of the same settings is in `folder`."""
    if not (folder / RESULT).is_file() or not (folder / CONFIG).is_file():
        return False
    try:
        saved = json.loads((folder / CONFIG).read_text(encoding="utf-8"))
    except json.JSONDecodeError:
        return False
    return config_hash(saved) == config_hash(config)


def input_files(config: Any) -> list[str]:
    """Every file a stage's config names (stimulus files, a BigToM csv, a pairs file, a probe table)."""
    found: set[str] = set()

    def walk(value: Any) -> None:
        if isinstance(value, dict):
            for key, x in value.items():
                if key in PATH_KEYS and isinstance(x, str):
                    found.add(x)
                else:
                    walk(x)
        elif isinstance(value, list):
            for x in value:
                walk(x)
    walk(config_to_dict(config))
    return sorted(found)


def stage_inputs(config: Any, folders: Mapping[str, Path], upstream: set[str]) -> dict[str, Any]:
    """Fingerprints of what a stage reads beyond its settings: the sha256 of each file its config
    names (None: missing) and of the `result.json` of each earlier stage it reads."""
    files = {p: file_sha256(p) if Path(p).is_file() else None for p in input_files(config)}
    stages = {s: file_sha256(folders[s] / RESULT) if (folders[s] / RESULT).is_file() else None
              for s in sorted(upstream)}
    return {"files": files, "stages": stages}


def _model_mismatch(saved: Any, spec: ModelSpec, loaded: Any) -> str | None:
    """Why a saved run's model is not the one this run would load (None: the same). The dtype and
    device are compared resolved (dtype None is bf16 on a GPU, fp32 on a CPU). The revision is
    compared when it is known without loading: from the model this run already loaded, a tiny
    model's seed, or a commit id asked for; a branch (or no revision) resolves only when the hub
    is asked, and the revision asked for is already part of the config hash."""
    if not isinstance(saved, Mapping) or "dtype" not in saved:
        return None  # a stage that loads no weights (pairs: the tokenizer only)
    if loaded is not None:
        from tomlens.models import provenance

        now = provenance(loaded)
        want = {"dtype": now["dtype"], "device": now["device"], "revision": now["revision"]}
    else:
        import torch

        from tomlens.devices import dtype_name, resolve_device, resolve_dtype
        from tomlens.models.tiny import TINY

        try:
            device = resolve_device(spec.device)
        except TomlensError as e:
            return e.problem
        want = {"dtype": dtype_name(resolve_dtype(spec.dtype, device)), "device": str(device), "revision": None}
        if spec.name in TINY:
            want["revision"] = f"random-init:seed={spec.seed}"
        elif spec.revision and re.fullmatch(r"[0-9a-f]{7,40}", spec.revision):
            want["revision"] = spec.revision
        if torch.device(saved.get("device", "cpu")).type == device.type and device.index is None:
            want["device"] = saved.get("device")  # "cuda" asked, "cuda:0" recorded: the same machine's GPU
    if saved.get("dtype") != want["dtype"]:
        return f"it ran in {saved.get('dtype')}, this run loads {want['dtype']}"
    if saved.get("device") != want["device"]:
        return f"it ran on {saved.get('device')}, this run loads onto {want['device']}"
    if want["revision"] is not None and not str(saved.get("revision", "")).startswith(want["revision"]):
        return f"it ran revision {saved.get('revision')}, this run loads {want['revision']}"
    return None


def stale_reason(stage: str, folder: Path, config: Any, inputs: Mapping[str, Any], spec: ModelSpec,
                 loaded: Any = None) -> str | None:
    """Why the finished run in `folder` cannot stand for this one (None: reuse it). A folder with
    no finished run of the same settings gives "" (run it, nothing to say)."""
    if not _finished(folder, config):
        return ""
    saved_inputs = read_json(folder / INPUTS) if (folder / INPUTS).is_file() else None
    if saved_inputs != json.loads(json.dumps(inputs)):
        changed = [p for p, h in inputs.get("files", {}).items()
                   if (saved_inputs or {}).get("files", {}).get(p) != h]
        changed += [f"the {s} stage's result" for s, h in inputs.get("stages", {}).items()
                    if (saved_inputs or {}).get("stages", {}).get(s) != h]
        return ("its inputs changed: " + ", ".join(changed)) if saved_inputs and changed \
            else "no record of its inputs"
    manifest = read_json(folder / MANIFEST) if (folder / MANIFEST).is_file() else {}
    why = _model_mismatch(manifest.get("model"), spec, loaded)
    if why:
        return why
    if stage == "steering":
        why = _older_steering_rule(folder)
        if why:
            return why
    if stage == "audit":
        from tomlens.runs.audit import changed_since

        why = changed_since(folder, config)
        if why:
            return why
    if stage == "cache":
        from tomlens.activations.store import is_complete
        from tomlens.runs.cache import CacheSummary

        try:
            store = summary_from_dict(CacheSummary, read_json(folder / RESULT), folder=folder, stage="cache").store
        except TomlensError as e:  # written by an older tomlens: run it again
            return e.problem
        if not store or not is_complete(Path(store)):
            return f"its activation store {store} is gone"
    return None


def _older_steering_rule(folder: Path) -> str | None:
    """Why a finished steering run's layer and dose cannot stand for a run of today's rule (None:
    they can): rows without the selection half's random directions (`selection_margin`), or a
    summary without `random_quantile` (judged by the random directions' maximum), or one that does
    not fit today's summary at all."""
    from tomlens.runs.steering_summary import SteeringSummary

    try:
        saved = summary_from_dict(SteeringSummary, read_json(folder / RESULT), folder=folder, stage="steering")
    except TomlensError as e:  # written by an older tomlens still: run it again
        return e.problem
    if saved.layers and all(d.selection_margin is None for d in saved.layers):
        return "its layer and dose were chosen by an older rule (without the selection half's random directions)"
    if saved.layers and saved.random_quantile is None:
        return "its layer and dose were chosen by an older rule (the random directions' maximum)"
    return None


def _inputs(stage: str, config: Any, folders: Mapping[str, Path]) -> set[str]:
    """The earlier stages whose output `stage` reads: rerunning one of them reruns it."""
    if stage != "patching":
        return set()
    needs = set()
    if "pairs" in folders and getattr(config, "pairs_path", None) is None:
        needs.add("pairs")
    table = getattr(config, "probe_table", None)
    if table is not None and "probes" in folders and Path(table).parent == folders["probes"]:
        needs.add("probes")
    return needs


def _saved_provenance(folders: Mapping[str, Path]) -> dict[str, Any] | None:
    """The model provenance a reused stage recorded (no model was loaded this time)."""
    for folder in folders.values():
        path = folder / MANIFEST
        if path.is_file():
            model = read_json(path).get("model")
            if model:
                return model
    return None


def _stimuli_hashes(folders: Mapping[str, Path]) -> dict[str, Any]:
    """Each stage's stimulus hash, as its own manifest recorded it."""
    return {s: read_json(f / MANIFEST).get("stimuli_hash") if (f / MANIFEST).is_file() else None
            for s, f in folders.items()}


def check_every_stage(config: ExperimentConfig, out: Path) -> None:
    """Build every stage's config for every model (each checks its own words and values) and check
    each activation store is writable and a user's pairs file gives pairs (`check_user_pairs`), so
    that a bad setting refuses before `config.json` is written or a model loads; `ExperimentConfig` itself checks the first model's stages only."""
    several = len(config.models) > 1
    for spec in config.models:
        folder = out / model_slug(spec) if several else out
        folders = {s: folder / s for s in STAGES if s in config.stages}
        for stage in folders:
            stage_config = config.stage_config(stage, spec, folders)
            check_store_writable(stage_config)
            check_user_pairs(stage_config)


def check_user_pairs(stage_config: Any) -> None:
    """A pairs stage of a user's own stories reads its file now (it is small, and needs no
    tokenizer): a missing file, a row without task_id, or a contrast the file does not have
    refuses the run before anything is written, not when the stage is reached."""
    from tomlens.runs.pairs import PairsConfig
    from tomlens.stimuli.pairs import USER

    stage_config = getattr(stage_config, "pairs", None) or stage_config  # patching builds its own pairs
    if isinstance(stage_config, PairsConfig) and stage_config.family == USER and stage_config.path:
        from tomlens.stimuli.user_pairs import read_user_pairs

        read_user_pairs(stage_config.path, contrasts=stage_config.contrasts, n=stage_config.n)


def run_experiment(config: ExperimentConfig, out: str | Path, *, progress: bool = True,
                   before: Callable[[str, ModelSpec], None] | None = None,
                   after: Callable[[str, ModelSpec, Any], None] | None = None,
                   plan: Any = None) -> ExperimentResult:
    """Run every stage of `config` for each model into `out` (`<out>/<stage>/` for one model,
    `<out>/<model>/<stage>/` for several), loading each model once and only if a stage must run.
    Once a model loads, one timed forward of it says the time left (`experiment_plan.say_time_left`,
    pricing `plan`, the counts a caller already made, or new ones).

    `before(stage, model)` and `after(stage, model, result)` let a caller print around each stage.
    Writes `config.json` (resolved) first and `manifest.json` (provenance per model) last.
    """
    from tomlens.provenance import run_manifest
    from tomlens.runs.experiment_plan import say_time_left

    out = Path(out)
    check_every_stage(config, out)  # a refused run writes nothing and loads no model
    out.mkdir(parents=True, exist_ok=True)
    resolved = config.to_dict()
    write_json(resolved, out / "config.json")
    several = len(config.models) > 1
    runs: list[ModelRun] = []
    manifests: list[dict[str, Any]] = []
    for entry, spec in enumerate(config.models):
        folder = out / model_slug(spec) if several else out
        run = ModelRun(spec, folder)
        run.folders = {s: folder / s for s in STAGES if s in config.stages}
        loaded: Any = None
        rerun: set[str] = set()
        for stage in STAGES:
            if stage not in config.stages:
                continue
            stage_dir = run.folders[stage]
            stage_cfg = config.stage_config(stage, spec, run.folders)
            module = stage_module(stage)
            _, result_cls = _stage_classes(stage)
            if before is not None:
                before(stage, spec)
            upstream = _inputs(stage, stage_cfg, run.folders)
            inputs = stage_inputs(stage_cfg, run.folders, upstream)
            why = "" if upstream & rerun else stale_reason(stage, stage_dir, stage_cfg, inputs, spec, loaded)
            if why:
                say(f"{stage}: not reused ({why})")
            if why is None:
                result = result_cls.load(stage_dir)
                run.reused[stage] = True
                say(f"{stage}: reused {stage_dir} (finished with the same settings, "
                    f"config {config_hash(stage_cfg)})")
            else:
                if loaded is None and stage not in TOKENIZER_ONLY:
                    say(f"loading {spec.name}")
                    loaded = spec.load()
                    plan = say_time_left(plan, config, out, entry, stage, loaded)
                kwargs: dict[str, Any] = {}
                accepts = inspect.signature(module.run).parameters
                if stage == "patching" and "pairs" in run.results and "pairs" in accepts:
                    kwargs["pairs"] = run.results["pairs"].pairs  # made once, by the pairs stage
                if "out" in accepts:
                    kwargs["out"] = stage_dir  # its checkpoints: a stopped run resumes
                result = module.run(stage_cfg, model=loaded, progress=progress, **kwargs)
                begin_save(stage_dir)  # no finished marker while inputs.json describes the new run
                write_json(inputs, stage_dir / INPUTS)
                result.save(stage_dir)
                run.reused[stage] = False
                rerun.add(stage)
            run.results[stage] = result
            if after is not None:
                after(stage, spec, result)
        if loaded is not None:
            from tomlens.models import provenance

            run.provenance = provenance(loaded)
        else:
            run.provenance = _saved_provenance(run.folders)
        manifest = run_manifest(None, {**resolved, "models": [config_to_dict(spec)]},
                                extra={"folder": str(folder), "reused": run.reused,
                                       "stages": {s: str(p) for s, p in run.folders.items()}})
        manifest["model"] = run.provenance or {"model": spec.name, "revision": spec.revision,
                                               "loaded": False}  # no stage needed the weights
        manifest["stimuli_hash"] = _stimuli_hashes(run.folders)  # by stage
        manifests.append(manifest)
        runs.append(run)
        del loaded  # one model in memory at a time
    manifest = {"name": config.name, "argv": list(sys.argv), "models": manifests}
    write_json(manifest, out / MANIFEST)
    return ExperimentResult(config, out, runs, manifest)
