"""The probes stage: cache what is missing, then a probe for every layer (and head) of each site kind.

The activations go through the store (`tomlens.runs.cache`), so a second run on the same request
reuses them; the sweep itself (`tomlens.probes.sweep.run_probe_sweep`) does the fitting.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
from torch import Tensor

from tomlens.activations import cache_activations
from tomlens.errors import TomlensError
from tomlens.hooks.sites import KINDS
from tomlens.models.positions import parse_selectors
from tomlens.probes.logistic import C_GRID
from tomlens.probes.sweep import PROBES, ProbeSweepResult, SweepConfig, read_probe_sweep, run_probe_sweep, \
    write_probe_sweep
from tomlens.probes.targets import get_target
from tomlens.runs.base import ModelSpec, StimuliSpec, split_items
from tomlens.provenance import run_manifest
from tomlens.runs.files import begin_save, finish_save, read_finished
from tomlens.stimuli.records import stimuli_hash

EVALUATIONS = ("crossfit", "holdout")
GROUPINGS = ("task", "template")
FORMATS = ("parquet", "csv")


def _one_of(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise TomlensError(f"{name} = {value!r} is not one of {', '.join(allowed)}", f"use one of {', '.join(allowed)}")


@dataclass(frozen=True)
class ProbesConfig:
    """A probe sweep: which activations (model, stimuli, site kinds, one position) and how probes are
    trained and scored (folds, C grid, controls, intervals)."""

    model: ModelSpec = ModelSpec()
    stimuli: StimuliSpec | None = None
    test_stimuli: StimuliSpec | None = None  # train on `stimuli`, test here (no cross-fitting)
    targets: tuple[str, ...] = ("protagonist_belief",)
    sites: tuple[str, ...] = ("resid_post", "head_out")  # bare kinds: every layer is probed
    positions: tuple[str, ...] = ("final",)  # exactly one
    probe: str = "logistic"
    store: str | None = None  # activation store root
    folds: int = 5
    inner_folds: int = 4
    evaluation: str = "crossfit"
    group_by: str = "task"
    c_grid: tuple[float, ...] | None = None  # None: C_GRID
    n_boot: int = 1000
    controls: bool = True
    bow: bool = True
    conditions: bool = True
    batch_size: int | None = None  # prompts per forward when caching
    seed: int = 0
    format: str = "parquet"

    def __post_init__(self) -> None:
        if self.stimuli is None:
            raise TomlensError("a probes run needs stimuli", "add stimuli = {path = \"...\"} or --stimuli FILE")
        targets = (self.targets,) if isinstance(self.targets, str) else tuple(self.targets)
        object.__setattr__(self, "targets", targets)
        if not targets:
            raise TomlensError("no probe targets were given", "name at least one, e.g. protagonist_belief")
        for t in targets:
            get_target(t)
        sites = tuple(split_items(self.sites))
        object.__setattr__(self, "sites", sites)
        bad = [k for k in sites if k not in KINDS]
        if bad or not sites:
            raise TomlensError(f"sites {' '.join(bad) or '(none)'}: not a site kind "
                               "(layers are not chosen here: every layer is probed)",
                               f"use bare kinds from {', '.join(KINDS)}")
        positions = tuple(parse_selectors(split_items(self.positions)))
        object.__setattr__(self, "positions", positions)
        if len(positions) != 1:
            raise TomlensError(f"positions {', '.join(positions)}: the probe sweep uses one position",
                               "give one position (e.g. final), and run the sweep once per position")
        if self.c_grid is not None:
            object.__setattr__(self, "c_grid", tuple(float(c) for c in self.c_grid))
        _one_of("probe", self.probe, PROBES)
        _one_of("evaluation", self.evaluation, EVALUATIONS)
        _one_of("group_by", self.group_by, GROUPINGS)
        _one_of("format", self.format, FORMATS)

    @property
    def position(self) -> str:
        return self.positions[0]


@dataclass
class ProbesResult:
    """The sweep's tidy table, the probe directions and the sweep's metadata (provenance, notes)."""

    sweep: ProbeSweepResult
    summary: dict[str, Any]
    config: ProbesConfig | None = None
    manifest: dict[str, Any] = field(default_factory=dict)

    @property
    def table(self) -> pd.DataFrame:
        return self.sweep.table

    @property
    def directions(self) -> dict[str, Tensor]:
        return self.sweep.directions

    @property
    def metadata(self) -> dict[str, Any]:
        return self.sweep.metadata

    def files(self, out: str | Path) -> list[Path]:
        """The files `save` writes besides config.json, manifest.json and result.json."""
        out = Path(out)
        fmt = self.config.format if self.config is not None else "parquet"
        return [out / f"probes.{fmt}", out / "probes.json"] + \
            ([out / "directions.safetensors"] if self.directions else [])

    def save(self, out: str | Path) -> Path:
        """probes.<format>, directions.safetensors (+ .json), probes.json, then config.json,
        manifest.json and, last, result.json."""
        out = begin_save(out)
        write_probe_sweep(self.sweep, out, table_format=self.config.format if self.config is not None else "parquet")
        return finish_save(out, self.config, self.manifest, self.summary)

    @classmethod
    def load(cls, out: str | Path) -> ProbesResult:
        out, config, manifest, summary = read_finished(out, ProbesConfig)
        return cls(sweep=read_probe_sweep(out), summary=summary, config=config, manifest=manifest)

    def describe(self) -> str:
        """Best layer and best head per target and evaluation, then the sweep's notes."""
        return "\n".join([summarise(self.table), *(f"note: {n}" for n in self.metadata.get("notes", []))])


def summarise(table: pd.DataFrame) -> str:
    """Best layer (whole-layer sites) and best head per target and evaluation, with intervals;
    units that could not be fitted (NaN score, see `fit_status`) are left out of the choice."""
    acc = table[table["metric"] == "accuracy"]
    lines = [f"{'target':<22}{'train -> eval':<30}{'site':<22}{'accuracy [95% CI]':<24}"
             f"{'control':>8}{'bow':>7}{'chance':>8}"]
    for (target, train_on, eval_set), g in acc.groupby(["target", "train_on", "eval_set"], sort=False):
        bow = g[g["features"] == "bag_of_words"]
        bow_s = f"{bow['score'].iloc[0]:.2f}" if len(bow) else "-"
        for kind, k in g[g["features"] == "activations"].groupby("kind", sort=False):
            k = k[k["score"].notna()]
            if k.empty:
                lines.append(f"{target:<22}{train_on + ' -> ' + eval_set:<30}{kind:<22}no unit could be fitted")
                continue
            best = k.loc[k["score"].idxmax()]
            site = f"{kind}:{int(best['layer'])}" + ("" if best["head"] < 0 else f".h{int(best['head'])}")
            ctrl = "-" if best["control"] != best["control"] else f"{best['control']:.2f}"
            lines.append(f"{target:<22}{train_on + ' -> ' + eval_set:<30}{site:<22}"
                         f"{best['score']:.2f} [{best['ci_low']:.2f}, {best['ci_high']:.2f}]{'':<8}"
                         f"{ctrl:>8}{bow_s:>7}{best['chance']:>8.2f}")
    return "\n".join(lines)


def sweep_config(config: ProbesConfig, *, progress: bool = True) -> SweepConfig:
    """The sweep settings `config` names (the probes train on the model's device)."""
    return SweepConfig(c_grid=config.c_grid or C_GRID, folds=config.folds, inner_folds=config.inner_folds,
                       evaluation=config.evaluation, group_by=config.group_by, n_boot=config.n_boot,
                       controls=config.controls, bow=config.bow, conditions=config.conditions,
                       device=config.model.device, progress=progress)


def run(config: ProbesConfig, *, model: Any = None, progress: bool = True) -> ProbesResult:
    """Cache the activations that are missing, then run the probe sweep."""
    assert config.stimuli is not None  # checked in ProbesConfig
    stimuli = config.stimuli.load()  # bad files fail before the model loads
    test = config.test_stimuli.load() if config.test_stimuli is not None else None
    if model is None:
        model = config.model.load()
    sites = " ".join(config.sites)
    acts = cache_activations(model, stimuli, sites, [config.position], store=config.store,
                             batch_size=config.batch_size, progress=progress)
    test_acts = None if test is None else cache_activations(
        model, test, sites, [config.position], store=config.store, batch_size=config.batch_size, progress=progress)
    sweep = run_probe_sweep(acts, list(config.targets), sites=list(config.sites), positions=config.positions,
                            test_acts=test_acts, probe=config.probe, seed=config.seed,
                            config=sweep_config(config, progress=progress))
    summary = {"rows": len(sweep.table), "targets": list(config.targets), "sites": list(config.sites),
               "position": config.position, "activations": str(acts.path),
               "test_activations": None if test_acts is None else str(test_acts.path),
               "directions": bool(sweep.directions), "notes": list(sweep.metadata.get("notes", []))}
    extra = None if test is None else {"test_stimuli_hash": stimuli_hash(test)}
    manifest = run_manifest(model, config, stimuli_hash=stimuli_hash(stimuli), extra=extra)
    return ProbesResult(sweep=sweep, summary=summary, config=config, manifest=manifest)
