"""What an experiment file will do and about how long it takes, said before it starts.

`tomlens run --dry-run` prints `plan_experiment`'s plan and stops, writing nothing. `tomlens run`
and `tomlens demo` print its counts first (`estimate_experiment`: no model is loaded for them),
then, once the run has loaded a model for its first stage that needs weights, time one forward
of it and say the time left (`say_time_left`): that model's stages priced as the dry run prices
them, and the models not loaded yet named, to be timed when each loads (timing them up front
would load every model once more). Per model and stage it counts the prompts and the plain
forwards they need, and prices forwards with one small timed forward of that model's own prompts
(the weights are loaded once for it; no stage runs). Where the work is not a count of forwards it says what it can: the probes stage's fits
are counted by its own plan once activations exist (`tomlens probe` prints it), the patching
stage's patched runs come from its own dry run (`tomlens.runs.patching`, with the gate's verdict),
and steering and validation are counted, not timed, which the plan says. Stages a rerun would
reuse are counted as if they ran: the estimate is an upper bound on a rerun.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tomlens.messages import logger, say
from tomlens.models.protocol import Model
from tomlens.runs.base import ModelSpec
from tomlens.timing import format_seconds

TIMED_PROMPTS = 4  # prompts in the timed forward (after one untimed warm-up)
DRY_RUN_END = "dry run: nothing else run, nothing written"  # the last line of a dry run, said once


@dataclass(frozen=True)
class StageEstimate:
    """One stage of one model: its prompts, the plain forwards they need (None: not a count of
    forwards), the estimated seconds (None: not estimated, `note` says why) and what it does."""

    stage: str
    model: str
    what: str
    prompts: int | None = None
    forwards: int | None = None
    seconds: float | None = None
    note: str = ""
    untimed_part: str = ""  # work of the stage the seconds leave out (e.g. "probe fits")
    entry: int = 0  # the model's place in the experiment's `models` (two entries may share a name)


@dataclass(frozen=True)
class ExperimentPlan:
    """Every stage's estimate, in run order, and each model's timed seconds per prompt forward."""

    stages: tuple[StageEstimate, ...]
    seconds_per_prompt: dict[str, float]

    @property
    def total_seconds(self) -> float:
        """The estimated seconds of the stages that have an estimate."""
        return sum(s.seconds for s in self.stages if s.seconds is not None)

    @property
    def not_estimated(self) -> tuple[str, ...]:
        return tuple(f"{s.untimed_part if s.seconds is not None else s.stage} ({s.model})" for s in self.stages
                     if s.seconds is None or s.untimed_part)

    def total_line(self) -> str:
        """'estimated total: ~3 min plus what is not estimated: steering (smollm2-135m)'."""
        left = self.not_estimated
        extra = f" plus what is not estimated: {', '.join(left)}" if left else ""
        return f"estimated total: ~{format_seconds(self.total_seconds)}{extra}"

    def priced(self, entry: int, model: str, rate: float) -> ExperimentPlan:
        """This plan with model `entry`'s stages that are a count of forwards priced at `rate`
        seconds per prompt, as `plan_experiment` prices them."""
        stages = tuple(replace(s, seconds=s.forwards * rate) if s.entry == entry and s.forwards is not None
                       and s.seconds is None else s for s in self.stages)
        return ExperimentPlan(stages, {**self.seconds_per_prompt, model: rate})

    def time_left_line(self, entry: int, stage: str) -> str:
        """What a run has left once model `entry` is loaded for `stage`: the seconds of that stage
        and the later ones of this model, what of them is not estimated, and the later models
        (their forwards are timed when each loads). An upper bound where later stages are reused."""
        mine = [s for s in self.stages if s.entry == entry]
        names = [s.stage for s in mine]
        left = ExperimentPlan(tuple(mine[names.index(stage):] if stage in names else mine), {})
        later = list(dict.fromkeys(s.model for s in self.stages if s.entry > entry))
        untimed = [*left.not_estimated, *(f"the stages of {m} (timed when it loads)" for m in later)]
        extra = f" plus what is not estimated: {', '.join(untimed)}" if untimed else ""
        return f"estimated time left: ~{format_seconds(left.total_seconds)}{extra}"

    def counts_line(self) -> str:
        """One line of what each stage will do, untimed (what a run says before it starts)."""
        parts = []
        for s in self.stages:
            counts = ", ".join(x for x in (f"{s.prompts:,} prompts" if s.prompts is not None else "",
                                           f"{s.forwards:,} forwards" if s.forwards else "") if x)
            parts.append(f"{s.stage} {counts or s.what}")
        return "plan: " + "; ".join(parts) + " (timed once the model loads; every stage's plan first: --dry-run)"

    def lines(self) -> list[str]:
        several = len({s.model for s in self.stages}) > 1
        width = max([len(s.stage) for s in self.stages] + [5])
        out = ["experiment plan (counts, and seconds from one timed forward per model; nothing is run):"]
        for s in self.stages:
            counts = [f"{s.prompts:,} prompts" if s.prompts is not None else "",
                      f"{s.forwards:,} forwards" if s.forwards is not None else ""]
            eta = f"~{format_seconds(s.seconds)}" if s.seconds is not None else "not timed"
            parts = [p for p in (s.what, *counts, eta, s.note) if p]
            model = f" [{s.model}]" if several else ""
            out.append(f"  {s.stage:<{width}}{model}  " + "; ".join(parts))
        for model, rate in self.seconds_per_prompt.items():
            out.append(f"  timed: one forward of {TIMED_PROMPTS} prompts on {model}: {rate * 1e3:.0f} ms per prompt")
        out.append("  " + self.total_line())
        return out


def plan_experiment(config: Any, out: str | Path, *, time_forwards: bool = True,
                    patching_plans: bool = True) -> ExperimentPlan:
    """Every stage of `config` (an `ExperimentConfig`) for every model, counted and, with
    `time_forwards`, priced from one small timed forward per model; `patching_plans` also runs the
    patching stage's own dry run (its plan and the gate's verdict, said as it goes). Writes nothing."""
    from tomlens.runs.experiment import check_every_stage

    out = Path(out)
    check_every_stage(config, out)  # a bad setting refuses here as it would in the run
    stages: list[StageEstimate] = []
    rates: dict[str, float] = {}
    for entry, spec in enumerate(config.models):
        configs = _stage_configs(config, out, spec)
        model = spec.load() if time_forwards and _needs_weights(configs) else None
        rate = _seconds_per_prompt(model, configs) if model is not None else None
        if rate is not None:
            rates[spec.name] = rate
        for stage, cfg in configs.items():
            est = replace(_estimate(stage, cfg, spec), entry=entry)
            if stage == "patching" and patching_plans and model is not None:
                est = _patching_estimate(cfg, model, configs.get("pairs"), est)
            elif rate is not None and est.forwards is not None and est.seconds is None:
                est = replace(est, seconds=est.forwards * rate)
            stages.append(est)
    return ExperimentPlan(tuple(stages), rates)


def estimate_experiment(config: Any, out: str | Path) -> ExperimentPlan:
    """What `tomlens run` and `tomlens demo` say before they start: the counts only. Pricing them
    here would load the model once more (and a rerun whose stages are all reused loads none): the
    run prices them once it has loaded the model anyway (`say_time_left`)."""
    return plan_experiment(config, out, time_forwards=False, patching_plans=False)


def say_time_left(plan: ExperimentPlan | None, config: Any, out: str | Path, entry: int, stage: str,
                  model: Model) -> ExperimentPlan | None:
    """Time one forward of `model` (model `entry` of `config`, just loaded by the run for `stage`),
    price that model's stages with it as the dry run does, and say the time the run has left;
    returns the priced plan (`plan`, or the counts when None) for the next model, or `plan` when
    no stage of this model has prompts to time. A few prompts' forward after the load, once per
    model: no extra load and nothing inside a stage's loop."""
    from tomlens.runs.experiment import STAGES

    configs = _stage_configs(config, Path(out), config.models[entry])
    order = [s for s in STAGES if s in configs]
    first = order.index(stage) if stage in order else 0
    rate = _seconds_per_prompt(model, {s: configs[s] for s in [*order[first:], *order[:first]]})
    if rate is None:
        return plan
    name = config.models[entry].name
    priced = (plan or estimate_experiment(config, out)).priced(entry, name, rate)
    say(f"timed: one forward of {TIMED_PROMPTS} prompts on {name}: {rate * 1e3:.0f} ms per prompt; "
        + priced.time_left_line(entry, stage))
    return priced


def _stage_configs(config: Any, out: Path, spec: ModelSpec) -> dict[str, Any]:
    """Each stage's config for model `spec`, in run order, with its folders as the run lays them out."""
    from tomlens.runs.experiment import STAGES, model_slug

    folder = out / model_slug(spec) if len(config.models) > 1 else out
    folders = {s: folder / s for s in STAGES if s in config.stages}
    return {s: config.stage_config(s, spec, folders) for s in folders}


def _needs_weights(configs: dict[str, Any]) -> bool:
    return any(s not in ("audit", "pairs") for s in configs)


def _stimuli_of(cfg: Any) -> list[Any]:
    """The stimuli a stage config names (one spec or several), loaded (no model needed)."""
    from tomlens.runs.base import StimuliSpec

    specs: Any = getattr(cfg, "stimuli", None)
    items = specs if isinstance(specs, Sequence) else [specs]
    return [s for spec in items if isinstance(spec, StimuliSpec) for s in spec.load()]


def _estimate(stage: str, cfg: Any, spec: ModelSpec) -> StageEstimate:
    """The counts of one stage, from its config alone."""
    n = len(_stimuli_of(cfg))
    if stage == "audit":
        return StageEstimate(stage, spec.name, "the stimuli checked (tokenizer only)", n, 0, 0.0)
    if stage == "behaviour":
        return StageEstimate(stage, spec.name, "every prompt scored", n, n)
    if stage == "cache":
        return StageEstimate(stage, spec.name, "activations cached (a finished store is reused)", n, n)
    if stage == "probes":
        test = len(cfg.test_stimuli.load()) if cfg.test_stimuli is not None else 0
        forwards = (n + test) * (2 if cfg.random_twin else 1)
        return StageEstimate(stage, spec.name, "activations cached" + (" (and the random twin's)" if cfg.random_twin
                                                                     else ""), n + test, forwards,
                             note="the fits are planned once activations exist (tomlens probe prints that plan)",
                             untimed_part="probe fits")
    if stage == "pairs":
        return StageEstimate(stage, spec.name, "minimal pairs built (tokenizer only)", None, 0, 0.0)
    if stage == "patching":
        return StageEstimate(stage, spec.name, "patched runs", note="counts need the model and pairs "
                             "(tomlens patch --dry-run)")
    if stage == "steering":
        return StageEstimate(stage, spec.name, f"{len(cfg.alphas)} strengths x {1 + cfg.n_random} directions",
                             n, note="counts only")
    return StageEstimate(stage, spec.name, f"{cfg.n_tasks} tasks checked end to end", note="counts only")


def _seconds_per_prompt(model: Model, configs: dict[str, Any]) -> float | None:
    """Seconds per prompt of a plain forward, timed on a few of the experiment's own prompts after
    one untimed warm-up (which pays for first-call costs a long run pays once)."""
    import torch

    from tomlens.models import encode

    texts = next(([s.text for s in stimuli[:TIMED_PROMPTS]] for stimuli in map(_stimuli_of, configs.values())
                  if stimuli), None)
    if not texts:
        return None
    batch = encode(model, texts)
    kwargs = {"use_cache": False, **batch.forward_kwargs()}
    from tomlens.timing import time_call

    with torch.inference_mode():  # time_call syncs the GPU around the call: its kernels, not their launch
        return time_call(lambda: model(batch.input_ids, **kwargs)) / len(texts)


def _patching_estimate(cfg: Any, model: Model, pairs_cfg: Any, est: StageEstimate) -> StageEstimate:
    """The patching stage's own dry run (its plan with a timed chunk, and the gate's verdict), on
    pairs built in memory as the pairs stage would; a scratch folder, removed after. Its closing
    `DRY_RUN_END` is left unsaid: the experiment's plan goes on, and ends with that line itself."""
    from tomlens.runs import pairs as pairs_stage
    from tomlens.runs import patching

    say(f"-- patching ({est.model}): its own dry run --")
    pairs = pairs_stage.run(pairs_cfg, model=model).pairs if pairs_cfg is not None else None
    with tempfile.TemporaryDirectory(prefix="tomlens-plan-") as scratch, _unsaid(DRY_RUN_END):
        # the probe table an earlier stage writes does not exist yet: it only annotates the heads
        result = patching.run(replace(cfg, dry_run=True, probe_table=None), model=model, pairs=pairs, out=scratch,
                              progress=False)
    plan = result.plan
    if plan is None:
        return replace(est, note="nothing to patch")
    seconds = plan.estimated_seconds
    note = "withheld by the gate: the plan is what --force would run" if result.withheld else ""
    return replace(est, what=f"{plan.total_runs:,} patched runs", seconds=seconds, note=note)


@contextmanager
def _unsaid(line: str) -> Iterator[None]:
    """Drop `line` (exactly) from what tomlens says inside the block; everything else is said."""
    def keep(record: logging.LogRecord) -> bool:
        return record.getMessage() != line

    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)
