"""The probes stage: cache what is missing, then a probe for every layer (and head) of each site kind.

The activations go through the store (`tomlens.runs.cache`), so a second run on the same request
reuses them; the sweep itself (`tomlens.probes.sweep.run_probe_sweep`) does the fitting. resid_pre:0
is cached as well, so the sweep can run its embeddings baseline.

The best unit of the per-unit table is the maximum of many scores on the stories it is scored on:
biased upwards. So, by default, the unit is also chosen on a selection half of the stories and
reported on the other half, with a max-statistic permutation null (`tomlens.probes.selection`);
that held-out result and its verdict lead the description. With `random_twin`, the same stimuli
are cached and swept on `random:<model>` (same architecture, fresh weights, same seed), and its
score joins the table as the baseline `baseline_random_init`.

Before the first fit the stage prints its plan (`stage_plan`): the fits of the sweep, its
baselines, the twin and the selection, with the time each will take, from one small fit per site
kind timed on this machine (`tomlens.probes.plan`); `budget_minutes` (default 60) refuses a plan
estimated over it, before any fit. As each stage ends it says how long it took against its
estimate; `result.json` keeps both under "plan".
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pandas as pd
from torch import Tensor

from tomlens.activations import cache_activations
from tomlens.devices import default_device
from tomlens.errors import TomlensError
from tomlens.hooks.sites import KINDS, SHORTHANDS
from tomlens.messages import say
from tomlens.models import provenance
from tomlens.models.positions import parse_selectors, refuse_near_misses
from tomlens.models.protocol import Model
from tomlens.probes.baselines import TWIN_KEYS, merge_twin  # noqa: F401 - TWIN_KEYS: re-exported
from tomlens.probes.logistic import C_GRID
from tomlens.probes.plan import PlanStage, ProbePlan
from tomlens.probes.resume import remove_fit_checkpoints
from tomlens.probes.selection import (
    DEFAULT_PERMUTATIONS,
    EMBEDDINGS_KIND,
    FOUND,
    SelectionResult,
    select_and_evaluate,
    selection_stage,
)
from tomlens.probes.splits import GROUPINGS as SPLIT_GROUPINGS
from tomlens.probes.sweep import (
    PROBES,
    ProbeSweepResult,
    SweepConfig,
    SweepLayout,
    fit_layout,
    lay_out_sweep,
    read_probe_sweep,
    run_probe_sweep,
    twin_sweep_config,
    write_probe_sweep,
)
from tomlens.probes.sweep_plan import sweep_stages, time_fits
from tomlens.probes.targets import TARGETS
from tomlens.provenance import run_manifest
from tomlens.runs.base import ModelSpec, StimuliSpec, split_items
from tomlens.runs.files import begin_save, check_store_writable, finish_save, read_finished, summary_to_dict
from tomlens.runs.probes_summary import PlannedStage, ProbePlanSummary, ProbesSummary, SelectedUnit
from tomlens.stimuli.records import stimuli_hash
from tomlens.timing import format_seconds
from tomlens.vocabulary import one_of, unknown

EVALUATIONS = ("crossfit", "holdout")
GROUPINGS = tuple(SPLIT_GROUPINGS)  # task, template (and cue phrasing where the splits know it)
FORMATS = ("parquet", "csv")
DEFAULT_BUDGET_MINUTES = 60.0
TWIN, TWIN_CACHE = "random twin", "twin caching"  # the plan's stage names for the random-init twin


def _one_of(name: str, value: str, allowed: tuple[str, ...]) -> None:
    one_of(name, value, allowed)


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
    inner_folds: int = 3  # see SweepConfig.inner_folds
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
    selection: bool = True  # choose the unit on selection stories, report it on evaluation stories
    select_fraction: float = 0.5  # of the story groups, for selection
    n_permutations: int = DEFAULT_PERMUTATIONS  # max-statistic permutation null of the best unit
    # sweep random:<model> too (baseline_random_init): the issue lists the random-init model among
    # every table's baselines, so it is on by default (a tiny model's twin is itself: said in a note)
    random_twin: bool = True
    # refuse, before any fit, a plan whose estimated time exceeds this many minutes (None: no limit)
    budget_minutes: float | None = DEFAULT_BUDGET_MINUTES

    def __post_init__(self) -> None:
        if self.stimuli is None:
            raise TomlensError("a probes run needs stimuli", "add stimuli = {path = \"...\"} or --stimuli FILE")
        targets = (self.targets,) if isinstance(self.targets, str) else tuple(self.targets)
        object.__setattr__(self, "targets", targets)
        if not targets:
            raise TomlensError("no probe targets were given", "name at least one, e.g. protagonist_belief")
        for t in targets:
            one_of("probe target", t, TARGETS)
        sites = tuple(SHORTHANDS.get(k, k) for k in split_items(self.sites))  # patch's shorthands: heads = head_out
        object.__setattr__(self, "sites", sites)
        bad = [k for k in sites if k not in KINDS]
        if bad and ":" not in bad[0]:
            raise unknown("site kind", bad[0], KINDS, SHORTHANDS)
        if bad or not sites:
            raise TomlensError(f"sites {' '.join(bad) or '(none)'}: not a site kind "
                               "(layers are not chosen here: every layer is probed)",
                               f"use bare kinds from {', '.join(KINDS)}")
        positions = tuple(parse_selectors(split_items(self.positions)))
        refuse_near_misses(positions, user_spans=any(s is not None and s.path is not None
                                                     for s in (self.stimuli, self.test_stimuli)))
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
        if not 0 < float(self.select_fraction) < 1:
            raise TomlensError(f"select_fraction = {self.select_fraction}",
                               "use a fraction strictly between 0 and 1 (e.g. 0.5)")
        if int(self.n_permutations) < 0:
            raise TomlensError(f"n_permutations = {self.n_permutations}", "use 0 (no null: always withheld) or more")
        if self.budget_minutes is not None and not float(self.budget_minutes) > 0:
            raise TomlensError(f"budget_minutes = {self.budget_minutes}", "use a positive number of minutes, or none")

    @property
    def position(self) -> str:
        return self.positions[0]


@dataclass
class ProbesResult:
    """The sweep's tidy table, the probe directions and the sweep's metadata (provenance, notes)."""

    sweep: ProbeSweepResult
    summary: ProbesSummary
    config: ProbesConfig | None = None
    manifest: dict[str, Any] = field(default_factory=dict)
    selection: dict[str, SelectionResult] = field(default_factory=dict)  # per target

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
            ([out / "directions.safetensors"] if self.directions else []) + \
            ([out / "selection.json"] if self.selection else [])

    def save(self, out: str | Path) -> Path:
        """probes.<format>, directions.safetensors (+ .json), probes.json, selection.json, then
        config.json, manifest.json and, last, result.json."""
        from tomlens.io import write_json

        out = begin_save(out)
        write_probe_sweep(self.sweep, out, table_format=self.config.format if self.config is not None else "parquet")
        (out / "selection.json").unlink(missing_ok=True)
        if self.selection:
            write_json({t: r.to_dict() for t, r in self.selection.items()}, out / "selection.json")
        finish_save(out, self.config, self.manifest, summary_to_dict(self.summary))
        remove_fit_checkpoints(out)  # only now: a run killed before result.json keeps its finished fits
        return out

    @classmethod
    def load(cls, out: str | Path) -> ProbesResult:
        from tomlens.io import read_json

        out, config, manifest, data = read_finished(out, ProbesConfig)
        summary = ProbesSummary.from_json(data, folder=out)
        selection = {t: SelectionResult.from_dict(r) for t, r in read_json(out / "selection.json").items()} \
            if (out / "selection.json").is_file() else {}
        return cls(sweep=read_probe_sweep(out), summary=summary, config=config, manifest=manifest,
                   selection=selection)

    def describe(self) -> str:
        """The selected unit's held-out score and verdict per target, then the per-unit maxima
        (selection-biased), then the notes of the sweep and of the selection."""
        notes = [*self.metadata.get("notes", []),
                 *(f"selection ({t}): {n}" for t, r in self.selection.items() for n in r.notes)]
        return "\n".join([summarise(self.table, self.selection), *(f"note: {n}" for n in notes)])


def summarise(table: pd.DataFrame, selection: dict[str, SelectionResult] | None = None) -> str:
    """First, per target, the unit chosen on selection stories with its score on held-out evaluation
    stories and its verdict ("withheld: ..." when it fails its gate); then the best layer
    (whole-layer sites) and best head per target and evaluation, with intervals: maxima over units
    on the stories they are scored on, marked as selection-biased. Units that could not be fitted
    (NaN score, see `fit_status`) are left out of the choice."""
    acc = table[table["metric"] == "accuracy"]
    lines: list[str] = []
    if selection:
        lines.append("selected unit, scored on held-out evaluation stories:")
        lines.extend(f"  {r.line()}" for r in selection.values())
    lines.append("per-unit maxima (selection-biased: the best unit on the stories it is scored on; "
                 "read the lines above for a held-out score):" if selection else
                 "per-unit maxima (selection-biased: the best unit on the stories it is scored on; "
                 "no held-out selection was run):")
    lines.append(f"{'target':<22}{'train -> eval':<30}{'site':<22}{'accuracy [95% CI]':<24}"
                 f"{'control':>8}{'bow':>7} {'best baseline':>17}{'chance':>8}")
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
            bb = best.get("best_baseline", float("nan"))
            base = "-" if bb != bb else f"{best.get('best_baseline_name', '')} {bb:.2f}"
            lines.append(f"{target:<22}{train_on + ' -> ' + eval_set:<30}{site:<22}"
                         f"{best['score']:.2f} [{best['ci_low']:.2f}, {best['ci_high']:.2f}]{'':<8}"
                         f"{ctrl:>8}{bow_s:>7} {base:>17}{best['chance']:>8.2f}")
    return "\n".join(lines)


def sweep_config(config: ProbesConfig, *, progress: bool = True) -> SweepConfig:
    """The sweep settings `config` names (the probes train on the model's device)."""
    return SweepConfig(c_grid=config.c_grid or C_GRID, folds=config.folds, inner_folds=config.inner_folds,
                       evaluation=config.evaluation, group_by=config.group_by, n_boot=config.n_boot,
                       controls=config.controls, bow=config.bow, conditions=config.conditions,
                       device=config.model.device, progress=progress, show_plan=False)


def cache_sites(config: ProbesConfig) -> str:
    """The sites to cache: the probed kinds, plus resid_pre:0 for the embeddings baseline."""
    sites = list(config.sites)
    if EMBEDDINGS_KIND not in sites:
        sites.append(f"{EMBEDDINGS_KIND}:0")
    return " ".join(sites)


def twin_spec(config: ProbesConfig) -> ModelSpec:
    """random:<model>, seeded as the model is (a tiny model is random already: its twin is itself).
    A random model loads on one device (load_model refuses a device map for it): the model's map is
    dropped, and a map onto the CPU alone keeps the twin on the CPU."""
    name = config.model.name
    spec = config.model
    if spec.device_map is not None:
        on_cpu = isinstance(spec.device_map, str) and spec.device_map.strip().lower() == "cpu"
        spec = replace(spec, device_map=None, device="cpu" if on_cpu else spec.device)
    return replace(spec, name=name if name.startswith("random:") else f"random:{name}")


def run(config: ProbesConfig, *, model: Model | None = None, progress: bool = True,
        out: str | Path | None = None) -> ProbesResult:
    """Cache the activations that are missing, print the plan (every fit of the sweep, its
    baselines, the random-init twin and the selection, with the estimated time; refused before any
    fit when over `budget_minutes`), run the probe sweep, then (by default) choose the best unit on
    selection stories and report it on evaluation stories; with `random_twin`, the same on
    random:<model>, merged as a baseline. Each stage says when it is done and how long it took.

    `out`: the run folder; the sweeps keep their finished fits under `out/.partial/` while the run
    goes on (`tomlens.probes.resume`), so a killed run started again fits only what it had left
    (None: nothing is kept). They are removed once the result is saved into `out` (`save`)."""
    assert config.stimuli is not None  # checked in ProbesConfig
    stimuli = config.stimuli.load()  # bad files fail before the model loads
    test = config.test_stimuli.load() if config.test_stimuli is not None else None
    check_store_writable(config)  # a read-only store: one clear error before the model loads
    if model is None:
        model = config.model.load()
    sites = cache_sites(config)

    def cache(m: Any, st: Any) -> Any:
        return cache_activations(m, st, sites, [config.position], store=config.store,
                                 batch_size=config.batch_size, progress=progress)

    t0 = time.perf_counter()
    acts = cache(model, stimuli)
    test_acts = None if test is None else cache(model, test)
    cache_seconds = None if acts.reused and (test_acts is None or test_acts.reused) else time.perf_counter() - t0
    scfg = sweep_config(config, progress=progress)
    layout = lay_out_sweep(acts, list(config.targets), sites=list(config.sites), positions=config.positions,
                           test_acts=test_acts, probe=config.probe, seed=config.seed, config=scfg)
    plan = stage_plan(config, layout, cache_seconds)
    time_fits(plan, layout)
    say("\n".join(plan.lines()))  # always: what the run costs is said before it costs it
    plan.check_budget()
    clock = _Clock(plan)
    sweep = fit_layout(layout, resume_in=out)
    clock.done("sweep", "baselines")
    twin_acts = twin_test = None
    notes = list(sweep.metadata.get("notes", []))
    if config.random_twin:
        spec = twin_spec(config)
        twin_model = spec.load()
        twin_acts = cache(twin_model, stimuli)
        twin_test = None if test is None else cache(twin_model, test)
        twin = run_probe_sweep(twin_acts, list(config.targets), sites=list(config.sites), positions=config.positions,
                               test_acts=twin_test, probe=config.probe, seed=config.seed, config=twin_sweep_config(scfg),
                               resume_in=out)
        sweep.table = merge_twin(sweep.table, twin.table)
        twin_rev = provenance(twin_model)["revision"]
        sweep.metadata["random_twin"] = {"model": spec.name, "revision": twin_rev, "activations": str(twin_acts.path)}
        notes.append(f"baseline_random_init: the same sweep on {spec.name} ({twin_rev})"
                     + (" - the model is random-init itself, so its twin is the same model"
                        if config.model.name.startswith(("random:", "tiny-")) else ""))
        sweep.metadata["notes"] = sorted(set(notes))
        clock.done(TWIN_CACHE, TWIN)
    selection: dict[str, SelectionResult] = {}
    if config.selection:
        for target in config.targets:
            selection[target] = select_and_evaluate(
                acts, target, sites=list(config.sites), position=config.position, seed=config.seed,
                select_fraction=config.select_fraction, n_permutations=config.n_permutations,
                config=replace(scfg, progress=False), probe=config.probe, test_acts=test_acts,
                twin_acts=twin_acts, twin_test_acts=twin_test)
            clock.done(f"selection ({target})")
    summary = probes_summary(config, sweep, selection, plan, clock.measured, acts=str(acts.path),
                             test_acts=None if test_acts is None else str(test_acts.path))
    extra = None if test is None else {"test_stimuli_hash": stimuli_hash(test)}
    manifest = run_manifest(model, config, stimuli_hash=stimuli_hash(stimuli), extra=extra)
    return ProbesResult(sweep=sweep, summary=summary, config=config, manifest=manifest, selection=selection)



def probes_summary(config: ProbesConfig, sweep: ProbeSweepResult, selection: dict[str, SelectionResult],
                   plan: ProbePlan, measured: dict[str, float], *, acts: str, test_acts: str | None) -> ProbesSummary:
    """The run's summary: its size, targets and sites, where its activations are, the selected unit
    per target, and the plan with the seconds each stage took."""
    planned = plan.to_dict()
    return ProbesSummary(
        rows=len(sweep.table), targets=tuple(config.targets), sites=tuple(config.sites), position=config.position,
        activations=acts, test_activations=test_acts, directions=bool(sweep.directions),
        notes=tuple(sweep.metadata.get("notes", [])),
        selection={t: SelectedUnit(unit=r.site, verdict=r.verdict, reason=r.reason, found=r.verdict == FOUND)
                   for t, r in selection.items()},
        plan=ProbePlanSummary(
            stages=tuple(PlannedStage(**s) for s in planned["stages"]), estimated_seconds=planned["estimated_seconds"],
            budget_seconds=planned["budget_seconds"], calibration=planned["calibration"],
            notes=tuple(planned["notes"]), measured_seconds=dict(measured)))


def stage_plan(config: ProbesConfig, layout: SweepLayout, cache_seconds: float | None) -> ProbePlan:
    """The plan of the whole stage (not yet timed: `sweep_plan.time_fits`): the sweep and its
    baselines as `layout` lays them out, the random-init twin (the same units, plans and folds,
    target only), and per target the selection; caching the twin is priced at what caching the
    model took (`cache_seconds`, None when the model's activations came from the store)."""
    cfg = layout.cfg
    stages = sweep_stages(layout)
    if config.random_twin:
        twin = lay_out_sweep(layout.acts, list(config.targets), sites=list(config.sites),
                             positions=config.positions, test_acts=layout.test_acts, probe=config.probe,
                             seed=config.seed, config=twin_sweep_config(cfg))
        name = twin_spec(config).name
        stages.append(PlanStage(TWIN_CACHE, f"caching {name} activations" + (
            ", about as long as the model's took" if cache_seconds is not None else
            " (not estimated: the model's own came from the store)"), seconds=cache_seconds))
        st = sweep_stages(twin, baselines=False)[0]
        stages.append(PlanStage(TWIN, f"the same sweep on {name}, target only: {st.fits:,} fits", st.shapes))
    if config.selection:
        for target in config.targets:
            stages.append(selection_stage(
                layout.acts, target, sites=list(config.sites), position=config.position, seed=config.seed,
                select_fraction=config.select_fraction, n_permutations=config.n_permutations,
                config=replace(cfg, progress=False), probe=config.probe, test_acts=layout.test_acts,
                twin=config.random_twin))
    dev = cfg.device or str(default_device())
    header = (f"probe plan ({layout.n_rows} prompts; {', '.join(config.targets)} at {config.position}; "
              f"{config.folds} folds, {config.evaluation}; device {dev}):")
    budget = None if config.budget_minutes is None else 60.0 * config.budget_minutes
    return ProbePlan(stages, header, budget_seconds=budget)


class _Clock:
    """Says, as each stage ends, how long it took against its estimate and what is left."""

    def __init__(self, plan: ProbePlan) -> None:
        self.plan = plan
        self.t = time.perf_counter()
        self.measured: dict[str, float] = {}
        self.left = {s.name for s in plan.stages}

    def done(self, *names: str) -> None:
        now = time.perf_counter()
        took, self.t = now - self.t, now
        stages = [s for s in self.plan.stages if s.name in names]
        self.measured[" + ".join(names)] = round(took, 1)
        self.left -= set(names)
        est = [self.plan.seconds(s) for s in stages]
        eta = f" (estimated {format_seconds(sum(e for e in est if e is not None))})" if any(
            e is not None for e in est) else ""
        rest = [self.plan.seconds(s) for s in self.plan.stages if s.name in self.left]
        left = f"; about {format_seconds(sum(r for r in rest if r is not None))} left" if self.left else ""
        say(f"probe: {' + '.join(names)} done in {format_seconds(took)}{eta}{left}")
