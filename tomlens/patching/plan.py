"""What a patching experiment will do, said before it does it: positions, stages, counts, time.

A patching run (`tomlens.runs.patching.run`) lays every stage out (`ExactSweep`, `AttributionSweep`,
`HeadSetSweep`, `AblationSweep`), counts them into a `Plan`, checks the budget, times one chunk
(`calibrate`) and only then runs them.

A sweep can cost minutes or hours, and which depends less on the number of cells than on where
they sit: a patch recomputes every token from its position on, from its layer up. So positions
default to the tokens a researcher looks at first (`ROLE_POSITIONS`), every stage's patched runs
are counted before anything runs (sites x positions x pairs x directions, less the cells patched
only where the two stories agree, which need no run), one chunk of real runs is timed, and the
estimate scales that by each stage's work in multiply-adds. `--max-runs` refuses a plan over budget
before any run. The plan also says how much memory its largest stage will take at its peak above the
loaded model (`stage_memory`): the base pass of a group, or what it keeps plus the largest patched
forward that `--memory-mb` lets through.

`--positions` syntax: a comma list of items; an item is a position, applied to every site, or
`SITE=POSITION`, applied to one site (sites as in `--sites`: heads, resid, attn, mlp, ...):
  roles     the role positions (default): for the residual stream, attention and MLP outputs the
            final token, the end of the contrast sentence and the question's mentions of the
            protagonist and of the object; for heads the same without the contrast (a head patched
            mid-story recomputes the rest of the story, for every head: on 64 transfer pairs that
            nearly doubles the default's time; add it with `heads=contrast`)
  all       every position: heads, attention and MLP outputs patched at all positions at once (one
            cell per head; the sweep before role positions), the residual stream one position at
            a time
  mentions  one cell per role mention that every pair has, in the order of the first pair
            ("protagonist@1", "protagonist@2", ..., "cue", "query_object", then "final"), each
            resolved in every pair to that pair's own token (`tomlens.patching.roles`); a mention
            at different tokens in a pair's two stories (order-only pairs) is left out with a note
  each      one cell per position (right-aligned), for every site: heads x every position is the
            largest sweep there is. When pairs differ in length a column holds different roles in
            different pairs: use it to find where effects sit, and `mentions` (or
            `tomlens.patching.roles.role_aligned` on the result) to say which role they sit on
  a selector  `final`, a span role (`contrast`, `query_protagonist`, `object`, ...),
            `<role>:first`, or a mention `<role>@<k>` / `<role>@last` (with `:first` too), as in
            `tomlens.models.positions`
Examples: `--positions all` (the every-position sweep), `--positions roles,heads=contrast`,
`--positions heads=each,resid=final`, `--positions resid=mentions,heads=roles`.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
from torch import Tensor
from tqdm.auto import tqdm

from tomlens.errors import TomlensError
from tomlens.hooks import Site, hook_name
from tomlens.hooks.attention import is_joint_qkv
from tomlens.models.protocol import Model
from tomlens.patching import engine, exact
from tomlens.patching.attribution import (
    IG_PATHS,
    IGPath,
    attribution_patching,
    check_integrable,
    hook_blocks,
    path_moves,
)
from tomlens.patching.cells import MENTIONS, Cell, canonical_kind, plan_cells
from tomlens.patching.checkpoints import Checkpoints
from tomlens.patching.engine import forward_cost
from tomlens.patching.exact import ExactSweep
from tomlens.patching.heads import AblationSweep, HeadSetSweep
from tomlens.patching.pairs import Direction, Group, PreparedPairs
from tomlens.patching.result import PatchingResult

DEFAULT_MAX_RUNS = exact.DEFAULT_MAX_RUNS  # the CLI's --max-runs and the Python API's max_runs
ROLE_POSITIONS: tuple[str, ...] = ("final", "contrast", "query_protagonist", "query_object")
HEAD_ROLE_POSITIONS: tuple[str, ...] = ("final", "query_protagonist", "query_object")
# Sites whose every-position patch is one cell (all positions at once); the residual stream at all
# positions at once just restores the other run, so "all" sweeps it one position at a time.
WHOLE = ("head", "attn_out", "mlp_out")
SHRINK = ("--sites (e.g. heads only)", "--positions (the default role positions instead of all or each)",
          "--top-k", "--n-random", "fewer pairs", "--method attribution")


@dataclass
class Positions:
    """Positions per site kind, and which of them came from `roles` (those fall back, with a note,
    when the pairs' stories lack the span)."""

    spec: dict[str, tuple[str, ...]]
    from_roles: dict[str, set[str]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def selectors(self) -> list[str]:
        return list(dict.fromkeys(p for ps in self.spec.values() for p in ps if p not in ("all", "each", MENTIONS)))

    def rank_position(self) -> str | None:
        """Where heads are ranked for top-k recovery and the per-head table: all positions when
        swept there, else the final token, else the first head position (None: no heads)."""
        heads = self.spec.get("head")
        if not heads:
            return None
        return next((p for p in ("all", "final") if p in heads), heads[0])


def parse_positions(text: str | Sequence[str], kinds: Sequence[str]) -> Positions:
    """Positions per site kind from the `--positions` syntax (module docstring); empty = `roles`."""
    from tomlens.models.positions import parse_selectors
    from tomlens.syntax import split_items

    items = split_items(text if isinstance(text, str) else [str(t) for t in text]) or ["roles"]
    spec: dict[str, list[str]] = {k: [] for k in kinds}
    roles: dict[str, set[str]] = {k: set() for k in kinds}
    for item in items:
        site, sep, pos = item.rpartition("=")
        if sep:
            kind = canonical_kind(site)
            if kind not in spec:
                raise TomlensError(f"--positions item {item!r} names site {site!r}, which --sites does not include",
                                   f"add it to --sites or drop the item (sites: {', '.join(kinds)})")
            targets = [kind]
        else:
            targets = list(kinds)
        if not pos:
            raise TomlensError(f"--positions item {item!r} has no position", "write e.g. heads=final")
        for kind in targets:
            if pos == "roles":
                chosen = HEAD_ROLE_POSITIONS if kind == "head" else ROLE_POSITIONS
                roles[kind].update(p for p in chosen if p not in spec[kind])
            elif pos == "all":
                chosen = ("all",) if kind in WHOLE else ("each",)
            elif pos == "each":
                chosen = ("each",)
            elif pos == MENTIONS:
                chosen = (MENTIONS,)
            else:
                chosen = tuple(parse_selectors([pos]))
            spec[kind].extend(p for p in chosen if p not in spec[kind])
    bare = [k for k, v in spec.items() if not v]
    if bare:
        raise TomlensError(f"--positions {','.join(items)!r} gives site(s) {bare} no position",
                           "add positions for them (e.g. roles, or SITE=final) or leave them out of --sites")
    return Positions({k: tuple(v) for k, v in spec.items()}, roles)


def expand_mentions(positions: Positions, pairs: Sequence[Any], tokenizer: Any = None) -> Positions:
    """Replace the `mentions` keyword with the role mentions every pair has (`mention_selectors`),
    with its notes; positions without the keyword come back unchanged."""
    if not any(MENTIONS in ps for ps in positions.spec.values()):
        return positions
    from tomlens.patching.roles import mention_selectors

    sels, notes = mention_selectors(pairs, tokenizer)
    spec = {}
    for kind, ps in positions.spec.items():
        out: list[str] = []
        for p in ps:
            out.extend(x for x in (sels if p == MENTIONS else [p]) if x not in out)
        spec[kind] = tuple(out)
    return Positions(spec, positions.from_roles, positions.notes + notes)


def drop_missing_roles(positions: Positions, stimuli: Sequence[Any]) -> Positions:
    """Leave out role positions some stories have no span for (pairs written before the span
    existed, or a family without it), with a note; explicit positions are left to fail loudly."""
    from tomlens.models.positions import lacking

    role_sels = sorted({p for ps in positions.from_roles.values() for p in ps})
    missing = lacking(stimuli, role_sels)
    if not missing:
        return positions
    spec = {}
    for kind, ps in positions.spec.items():
        kept = tuple(p for p in ps if not (p in missing and p in positions.from_roles.get(kind, ())))
        spec[kind] = kept or ("final",)
    notes = [_missing_note(sel, n, stimuli) for sel, n in missing.items()]
    return Positions(spec, positions.from_roles, positions.notes + notes)


def _missing_note(selector: str, n: int, stimuli: Sequence[Any]) -> str:
    """Why a role position is left out: a user's own story says why its span is missing (recorded
    when its pairs were built, `tomlens.stimuli.user_pairs`), with the stories and how to add it;
    a generated family's pairs were written before the span existed."""
    from tomlens.stimuli.user_pairs import MISSING

    span = selector.partition("@")[0].partition(":")[0]
    why = [(s.id, s.meta[MISSING][span]) for s in stimuli
           if isinstance(s.meta, dict) and span in s.meta.get(MISSING, {})]
    if why:
        ids = ", ".join(i for i, _ in why[:3]) + (f" and {len(why) - 3} more" if len(why) > 3 else "")
        return f"position {selector!r} left out: {n} of {len(stimuli)} stories have no {span!r} span ({ids}): {why[0][1]}"
    return (f"position {selector!r} left out: {n} of {len(stimuli)} stories have no {selector!r} span (pairs "
            "written by an older tomlens, or a family without it; rewrite them with `tomlens pairs` "
            "to patch there)")


def _describe_cells(cells: Sequence[Cell]) -> str:
    """'heads 270 x 3 positions + resid_pre 30 x 4 positions': sites x positions per kind."""
    parts = []
    for kind in dict.fromkeys(c.kind for c in cells):
        mine = [c for c in cells if c.kind == kind]
        sites = len({(c.layer, c.head) for c in mine})
        poss = len({(c.position, c.pos) for c in mine})
        name = "heads" if kind == "head" else kind
        parts.append(f"{name} {sites:,} x {poss:,} position{'s' if poss != 1 else ''}")
    return " + ".join(parts)


@dataclass
class PlanStage:
    """One stage: `what` it patches (sites x positions, or head sets), over `pairs` pairs in one
    direction; `runs` patched forwards (of which `done` are already checkpointed); the work still to
    do, as patched-run work (`cost`, see `run_cost`) and as plain forwards (`forward`, multiply-adds);
    `extra` the forwards that are not patched runs."""

    name: str
    what: str
    units: int
    pairs: int
    runs: int
    cost: float
    forward: float = 0.0
    done: int = 0
    extra: str = ""
    unit: str = "cells"
    per_pair: int = 1  # runs per (unit, pair): 2 where both stories of a pair run
    peak_bytes: int = 0  # the stage's memory peak above the loaded model (`stage_memory`; 0: not estimated)
    memory: str = ""  # what makes that peak, in words


def _fmt_seconds(s: float) -> str:
    from tomlens.timing import format_seconds

    return format_seconds(s)


@dataclass
class Plan:
    """Every stage of an experiment with its counts, and the seconds per unit of work from a timed
    chunk: `seconds_per_mac` of patched runs (`run_cost`, per-row overhead included) and
    `seconds_per_forward_mac` of plain forwards, timed apart because their kernels differ."""

    stages: list[PlanStage]
    n_pairs: int
    max_runs: int | None = DEFAULT_MAX_RUNS
    seconds_per_mac: float | None = None
    seconds_per_forward_mac: float | None = None
    calibration: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def total_runs(self) -> int:
        return sum(s.runs for s in self.stages)

    @property
    def done_runs(self) -> int:
        return sum(s.done for s in self.stages)

    @property
    def peak_bytes(self) -> int:
        """The largest stage's memory peak above the loaded model (stages run one after another)."""
        return max((s.peak_bytes for s in self.stages), default=0)

    def seconds(self, stage: PlanStage | None = None) -> float | None:
        """Estimated seconds still to go (one stage, or all)."""
        if self.seconds_per_mac is None or self.seconds_per_forward_mac is None:
            return None
        stages = [stage] if stage is not None else self.stages
        return float(sum(s.cost * self.seconds_per_mac + s.forward * self.seconds_per_forward_mac for s in stages))

    def check_budget(self) -> None:
        """Refuse a plan of more patched runs than `max_runs`, naming what shrinks it."""
        if self.max_runs is None or self.total_runs <= self.max_runs:
            return
        biggest = max(self.stages, key=lambda s: s.runs)
        raise TomlensError(
            f"the plan needs {self.total_runs:,} patched runs, more than --max-runs {self.max_runs:,} "
            f"(largest stage: {biggest.name}, {biggest.runs:,} runs)",
            f"shrink it with {', '.join(SHRINK)}; or raise --max-runs to {self.total_runs:,}; "
            "--dry-run shows the plan and its time",
        )

    def lines(self) -> list[str]:
        width = max([len(s.name) for s in self.stages] + [len("total")])
        out = [f"plan ({self.n_pairs} pairs; runs = sites x positions x pairs x directions, less cells "
               "that need no run):"]
        for s in self.stages:
            if s.unit == "cells":
                count = f"{s.what} = {s.units:,} cells x {s.pairs} pairs x 1 direction"
            else:
                count = f"{s.what} x {s.pairs} pairs" + (" x 2 stories" if s.per_pair == 2 else " x 1 direction")
            runs = f" = {s.runs:,} patched runs" if s.runs or s.unit != "cells" or not s.extra else ""
            gross = s.units * s.pairs * s.per_pair
            skipped = f" ({gross - s.runs:,} need none)" if s.runs and gross != s.runs else ""
            extra = f"; {s.extra}" if s.extra else ""
            left = f"; {s.done:,} already run" if s.done else ""
            t = self.seconds(s)
            eta = f"; ~{_fmt_seconds(t)}" if t is not None else ""
            out.append(f"  {s.name:<{width}}  {count}{runs}{skipped}{extra}{left}{eta}")
        budget = f" (--max-runs {self.max_runs:,})" if self.max_runs is not None else ""
        total = self.seconds()
        eta = f"; estimated {_fmt_seconds(total)}" if total is not None else ""
        done = f", {self.done_runs:,} already run" if self.done_runs else ""
        out.append(f"  {'total':<{width}}  {self.total_runs:,} patched runs{budget}{done}{eta}")
        if self.calibration:
            out.append(f"  {'':<{width}}  {self.calibration}")
        peak = max(self.stages, key=lambda s: s.peak_bytes, default=None)
        if peak is not None and peak.peak_bytes:
            out.append(f"  {'memory':<{width}}  {peak.name}: {peak.memory}")
        out.extend(f"note: {n}" for n in self.notes)
        return out

    def to_dict(self) -> dict[str, Any]:
        total = self.seconds()
        return {
            "stages": [{**asdict(s), "cost": float(s.cost), "forward": float(s.forward)} for s in self.stages],
            "total_runs": self.total_runs, "done_runs": self.done_runs, "max_runs": self.max_runs,
            "peak_bytes": self.peak_bytes,
            "estimated_seconds": None if total is None or not math.isfinite(total) else round(total, 1),
            "calibration": self.calibration, "notes": list(self.notes),
        }


class AttributionSweep:
    """Attribution patching of one direction laid out per group of pairs: each group's estimates
    need that group's forwards and backward only, so each group is a chunk, checkpointed."""

    def __init__(self, model: Model, prepared: PreparedPairs, spec: Mapping[str, Sequence[str]], direction: Direction,
                 steps: int = 1, path: IGPath = "sites"):
        self.model, self.prepared, self.spec, self.direction = model, prepared, dict(spec), direction
        self.steps = int(steps)  # 1: plain attribution; more: integrated gradients over that many points
        if path not in IG_PATHS:
            raise TomlensError(f"attribution path {path!r}", f"use one of {', '.join(IG_PATHS)}")
        self.path = path  # what integrated gradients move: the token embeddings or each site
        if self.steps > 1 and path == "embeddings":
            check_integrable(model)  # before any stage runs, not after the exact sweep
        self.cells = plan_cells(model, self.spec, n_aligned=prepared.n_aligned)
        # "sites@position": the site path moves one position at a time (chunks written when it moved
        # every differing token are not resumed into a run of the new path)
        how = (f"steps={self.steps}" if self.steps > 1 else "") + (f" path={path}@position" if self.steps > 1 and
                                                                   path != "embeddings" else "")
        tag = hashlib.sha256((repr(self.cells) + how).encode()).hexdigest()[:12]
        self.names = [f"attribution-{direction}-g{gi:04d}-{tag}" for gi in range(len(prepared.groups))]
        self.parts: dict[int, dict[str, Tensor]] = {}

    def cost(self, gi: int) -> float:
        """Multiply-adds of one group: the source forward, then per run a forward and a backward
        (about two forwards) from the first differing token: one run per step along the
        embeddings; the plain run, then per step one run per hook point and position (a selector
        no pair of a group has at a differing token costs less: an upper bound), through the
        blocks from its block on, along the sites."""
        grp = self.prepared.groups[gi]
        run = 3 * forward_cost(self.model, grp.g, grp.width - int(grp.first_diff.min()))
        runs: float  # a whole number of runs along the embeddings, a mean over hooks along the sites
        if self.path == "embeddings" or self.steps == 1:
            runs = self.steps
        else:
            n = self.model.cfg.n_layers
            blocks = hook_blocks(self.cells)
            moves = path_moves(self.cells, steps=self.steps, path=self.path).values()
            runs = 1 + (self.steps - 1) * sum((n - blocks[m.hook]) / n for m in moves)
        return forward_cost(self.model, grp.g, grp.width) + runs * run

    def pending(self) -> list[int]:
        return [gi for gi in range(len(self.names)) if gi not in self.parts]

    def load(self, checkpoints: Checkpoints) -> None:
        for gi in self.pending():
            g = self.prepared.groups[gi].g
            got = checkpoints.load(self.names[gi], {"values": (len(self.cells), g), "clean": (g,), "corrupted": (g,)})
            if got is not None:
                self.parts[gi] = got

    def run_group(self, gi: int, checkpoints: Checkpoints | None = None) -> None:
        p, grp = self.prepared, self.prepared.groups[gi]
        one = PreparedPairs([p.pairs[i] for i in grp.index],
                            [Group(list(range(grp.g)), grp.batch, grp.tokens, grp.first_diff, grp.positions,
                                   corrupted_cols=grp.corrupted_cols, unequal=grp.unequal, roles=grp.roles)],
                            [p.lengths[i] for i in grp.index], p.n_aligned, p.token_labels, p.selectors)
        res = attribution_patching(self.model, one, sites=self.spec, direction=self.direction, steps=self.steps,
                                   path=self.path, progress=False)
        part = {"values": res.values.float(), "clean": res.clean.float(), "corrupted": res.corrupted.float()}
        if checkpoints is not None:
            checkpoints.save(self.names[gi], part)
        self.parts[gi] = part

    def result(self, checkpoints: Checkpoints | None = None, progress: bool = True) -> PatchingResult:
        for gi in tqdm(self.pending(), desc=f"attribution ({self.direction})", unit="group", disable=not progress):
            self.run_group(gi, checkpoints)
        p = self.prepared
        n = len(p.pairs)
        values = torch.empty((len(self.cells), n), dtype=torch.float64)
        clean, corrupted = torch.empty(n, dtype=torch.float64), torch.empty(n, dtype=torch.float64)
        for gi, grp in enumerate(p.groups):
            part = self.parts[gi]
            values[:, grp.index] = part["values"].double()
            clean[grp.index], corrupted[grp.index] = part["clean"].double(), part["corrupted"].double()
        return PatchingResult("attribution", self.direction, self.cells, values, clean, corrupted, p.ids, p.token_labels)


def _forwards(n: int, what: str) -> str:
    return f"+ {n} {what} forward{'s' if n != 1 else ''}"


def _memory(stage: engine.Stage) -> dict[str, Any]:
    """A stage's memory figure as `PlanStage` fields (attribution stages have none: see `stage_memory`)."""
    est = stage_memory(stage)
    return {"peak_bytes": est.peak, "memory": est.line()}


def plan_stages(
    exact: Mapping[str, ExactSweep],
    attribution: Mapping[str, AttributionSweep],
    topk: HeadSetSweep | None,
    ablation: AblationSweep | None,
    *,
    n_pairs: int,
    k_max: int = 0,
    n_random: int = 0,
) -> list[PlanStage]:
    """The plan's stages from the laid-out sweeps, with the runs already done and the work left."""
    stages = []
    for d, sw in exact.items():
        st = sw.stage
        stages.append(PlanStage(f"exact {d}", _describe_cells(sw.cells), len(sw.cells), n_pairs, st.n_runs,
                                st.cost(), st.forward_cost(), done=st.n_done,
                                extra=_forwards(len(st.prepared.groups), "unpatched"), **_memory(st)))
    for d, at in attribution.items():
        n_groups = len(at.prepared.groups)
        stages.append(PlanStage(f"attribution {d}", _describe_cells(at.cells), len(at.cells), n_pairs, 0,
                                0.0, sum(at.cost(gi) for gi in at.pending()),
                                extra=f"estimated by gradients: {n_groups} x (a forward, then "
                                + ("a forward and backward" if at.steps == 1 else
                                   f"{at.steps} forwards and backwards, integrated gradients along the embeddings"
                                   if at.path == "embeddings" else
                                   f"a forward and backward, then {at.steps - 1} per site and layer, integrated "
                                   "gradients along each site") + "), no patched runs"))
    if topk is not None:
        stages.append(PlanStage("top-k recovery", f"{k_max} top + {k_max * n_random} random head sets (k = 1..{k_max})",
                                topk.n_sets, n_pairs, topk.stage.n_runs, topk.stage.cost(), topk.stage.forward_cost(),
                                unit="head sets", **_memory(topk.stage)))
    if ablation is not None:
        st = ablation.stage
        stages.append(PlanStage(f"mean ablation ({ablation.mode})", f"{ablation.n_sets} head sets", ablation.n_sets,
                                n_pairs, st.n_runs, st.cost(), st.forward_cost() + ablation.means_cost(),
                                extra=_forwards(len(ablation.prepared.groups), "plain") + " for the heads' means",
                                unit="head sets", per_pair=2, **_memory(st)))
    return stages


def calibrate(
    plan: Plan,
    exact: Mapping[str, ExactSweep],
    attribution: Mapping[str, AttributionSweep],
    checkpoints: Checkpoints,
    *,
    keep: bool = True,
) -> None:
    """Time one chunk of real runs, and the base pass it needs, and set the plan's seconds per unit
    of work: a pending exact chunk whose runs cost about the plan's average (else one attribution
    group, whose rate then prices patched runs too). With `keep` the chunk's results are
    checkpointed like any other's (the run goes on from them); a resumed run with nothing left to
    time reuses the timing its first run saved."""
    store = checkpoints if keep else None
    runs = sum(s.runs - s.done for s in plan.stages)
    per_run = sum(s.cost for s in plan.stages) / max(runs, 1)
    for d, sw in exact.items():
        pending = sw.stage.pending()
        if not pending:
            continue
        first = [c for c in pending if c.group == pending[0].group]
        chunk = min(first, key=lambda c: abs(c.cost / c.n_runs - per_run))
        group = sw.prepared.groups[chunk.group]
        t0 = time.perf_counter()
        sw.stage.prepare(chunk.group, store)
        t1 = time.perf_counter()
        sw.stage.run(chunks=[chunk], checkpoints=store)
        t2 = time.perf_counter()
        rates = ((t2 - t1) / max(chunk.cost, 1.0), (t1 - t0) / forward_cost(sw.stage.model, 2 * group.g, group.width))
        what = (f"timed: {chunk.n_runs:,} runs of exact {d} (group {chunk.group}) in {t2 - t1:.1f} s, "
                f"its base pass in {t1 - t0:.1f} s")
        break
    else:
        pending_groups = [(d, gi) for d, at in attribution.items() for gi in at.pending()]
        if not pending_groups:
            got = checkpoints.load("calibration", {"seconds_per_mac": (2,)})
            if got is not None:
                plan.seconds_per_mac, plan.seconds_per_forward_mac = map(float, got["seconds_per_mac"])
                plan.calibration = "timing saved by the run being resumed"
            return
        d, gi = pending_groups[0]
        t0 = time.perf_counter()
        attribution[d].run_group(gi, store)
        seconds = time.perf_counter() - t0
        forward = seconds / attribution[d].cost(gi)
        rates = (forward, forward)
        what = f"timed: attribution {d} of group {gi} in {seconds:.1f} s"
    plan.seconds_per_mac, plan.seconds_per_forward_mac = rates
    plan.calibration = what + (" (kept)" if keep else "")
    if keep:
        checkpoints.save("calibration", {"seconds_per_mac": torch.tensor(rates, dtype=torch.float64)})


# ---- memory: what a patching stage holds at its peak ---------------------------------------------
#
# "Peak" throughout is the most tensor memory a stage's run holds at once above what was held before
# it started (the loaded model, the tokenized pairs): on CUDA `torch.cuda.max_memory_allocated()`
# minus `torch.cuda.memory_allocated()` taken just before the run, on the CPU the resident set's high
# water mark minus the resident set just before it. The figures follow what the engine and the
# TransformerLens bridge allocate (measured op by op on Llama, GPT-2 and GPT-NeoX shapes):
#   - a group's base pass: every story's keys and values for all layers, the activations the patched
#     runs take their values from and the residual stream entering every block (all kept), plus one
#     block's transient and the last position's logits over the whole vocabulary;
#   - a patched forward of r rows: each row's copy of the shared prefix's keys and values for the
#     layers it runs (`PrefixCache.select`, the whole width), plus one block's transient;
#   - one block's transient: the bridge computes attention eagerly (also where HF would use sdpa):
#     grouped-query keys and values expanded to every query head, the scores `[heads, new, keys]`
#     in the model's dtype next to their fp32 softmax (and its cast back), the mask, the projections;
#     or the MLP's intermediates, whichever is larger.
#   - bridges whose attention keeps its last pattern on the module (TransformerLens's joint-QKV
#     attention: GPT-2, GPT-NeoX) hold one pattern per layer from forward to forward.

SOFTMAX_BYTES = 4  # Llama-style attention in the bridge softmaxes in fp32 whatever the model's dtype
# What the counts above leave out: allocator rounding (CUDA rounds each block to 512 bytes), index
# tables and small tensors, pages the CPU's allocator has not handed back yet. Measured op by op the
# counts were 2-23% above the tensors actually live; this keeps the figure above the peak.
HEADROOM, SLACK = 1.05, 2**20


@dataclass(frozen=True)
class Shape:
    """The sizes a forward's memory depends on, and the bytes of one element of the model's dtype."""

    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    d_head: int
    d_mlp: int
    d_vocab: int
    elt: int
    keeps_patterns: bool = False
    softmax_elt: int = 4  # bytes of an element of the attention softmax

    @classmethod
    def of_model(cls, model: Model) -> Shape:
        """From a loaded bridge: its config, its dtype and which attention the bridge runs."""
        cfg = model.cfg
        dtype = getattr(cfg, "dtype", None) or next(model.parameters()).dtype
        elt, joint = torch.finfo(dtype).bits // 8, is_joint_qkv(model)
        return cls(cfg.n_layers, cfg.d_model, cfg.n_heads, getattr(cfg, "n_key_value_heads", None) or cfg.n_heads,
                   cfg.d_head, getattr(cfg, "d_mlp", None) or 4 * cfg.d_model, cfg.d_vocab, elt,
                   keeps_patterns=joint, softmax_elt=elt if joint else SOFTMAX_BYTES)

    @classmethod
    def of_config(cls, config: Any, dtype: torch.dtype) -> Shape:
        """From a Hugging Face Llama-style config, without building the model (benchmark shapes)."""
        heads = config.num_attention_heads
        d_head = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(config.num_hidden_layers, config.hidden_size, heads,
                   getattr(config, "num_key_value_heads", None) or heads, d_head, config.intermediate_size,
                   config.vocab_size, torch.finfo(dtype).bits // 8)


def kv_bytes(shape: Shape, width: int, layers: int) -> int:
    """Keys AND values of one story: per layer, per KV head, `d_head` per token."""
    return layers * 2 * shape.n_kv_heads * shape.d_head * width * shape.elt


def _pattern_bytes(shape: Shape, new: int, keys: int) -> int:
    """One layer's attention pattern of one row, `[heads, new, keys]` in the model's dtype."""
    return shape.n_heads * new * keys * shape.elt


def _block_bytes(shape: Shape, new: int, keys: int) -> int:
    """One row's transient inside one block at its peak: attention or the MLP, whichever is larger
    (the residual stream beside either is counted by the caller)."""
    e = shape.elt
    expanded = 2 * shape.n_heads * keys * shape.d_head * e if shape.n_kv_heads != shape.n_heads else 0
    # scores, and when the softmax runs in fp32 on half-precision scores also the masked copy and the
    # cast back (bf16 Llama: 2 + 2 + 4 + 2 bytes an element; measured 12% over the old count on an H200)
    scores = shape.n_heads * new * keys * (e + shape.softmax_elt + (2 * e if e != shape.softmax_elt else 0))
    mask = new * keys * e
    projections = new * (5 * shape.n_heads + 4 * shape.n_kv_heads) * shape.d_head * e
    mlp = 4 * new * shape.d_mlp * e + _pattern_bytes(shape, new, keys)  # the block holds its pattern until it returns
    return max(expanded + scores + mask + projections, mlp)


def row_bytes(shape: Shape, width: int, new: int, first_layer: int = 0, *, prefix: bool = True,
              vocab: int = 2) -> int:
    """Peak memory of one patched row: its copy of the shared prefix's keys and values over the
    layers it runs (the whole `width`; layers below `first_layer` share layer 0's), the residual
    stream of its `new` columns (and, starting above block 0, the base run's stream entering
    `first_layer`, taken at the whole width before it is sliced), one block's transient and the
    logits of `vocab` tokens at the last position. Without a prefix (`prefix=False`: every column
    recomputed) nothing is cached and the keys are the new columns. Rows are independent, so a
    forward of r rows takes r times this."""
    runs = shape.n_layers - first_layer
    cached = kv_bytes(shape, width, runs + (1 if first_layer > 0 else 0)) if prefix else 0
    keys = width if prefix else new
    resid = 3 * new * shape.d_model * shape.elt
    skipped = width * shape.d_model * shape.elt if first_layer > 0 else 0  # the base run's stream, whole width
    own_patterns = runs * _pattern_bytes(shape, new, keys) if shape.keeps_patterns else 0
    return cached + resid + skipped + own_patterns + max(_block_bytes(shape, new, keys), vocab * shape.elt)


def _hook_width(shape: Shape, hook: str) -> int:
    """Elements per token of a recorded activation: a head hook's every head, else the stream."""
    return shape.n_heads * shape.d_head if ".attn.hook_" in hook else shape.d_model


def base_bytes(shape: Shape, width: int, hooks: Sequence[str]) -> tuple[int, int]:
    """(peak, kept) of one story in a group's base pass: kept are its keys and values for every layer
    and the activations at `hooks` (sources and the residual stream entering each block); the peak
    adds one block's transient, or the last position's logits over the whole vocabulary. Patterns a
    bridge keeps (`Shape.keeps_patterns`) are not in it: `stage_memory` counts them per layer."""
    kept = kv_bytes(shape, width, shape.n_layers) + sum(width * _hook_width(shape, h) for h in hooks) * shape.elt
    transient = max(_block_bytes(shape, width, width), shape.d_vocab * shape.elt)
    return kept + 3 * width * shape.d_model * shape.elt + transient, kept


@dataclass(frozen=True)
class MemoryEstimate:
    """A stage's peak (bytes above what was held before it ran, see the section's comment) and what
    makes it: a base pass of `base_rows` stories, or the largest patched forward of `rows` rows."""

    peak: int
    base_peak: int = 0
    kept: int = 0
    forward_peak: int = 0
    rows: int = 0
    base_rows: int = 0

    def line(self) -> str:
        mib = 2**20
        return (f"peak ~{self.peak / mib:,.0f} MiB above the loaded model (base pass of {self.base_rows} stories "
                f"{self.base_peak / mib:,.0f} MiB, keeping {self.kept / mib:,.0f} MiB; patched forwards of up to "
                f"{self.rows:,} rows {self.forward_peak / mib:,.0f} MiB)")


def _forward_chunks(model: Model, width: int, starts: Sequence[int], firsts: Sequence[int],
                    budget: float) -> list[tuple[int, int, int]]:
    """(rows, first column, first block) of each forward `run_patched` makes of these runs: the same
    order and the same greedy cut at `budget` bytes by the engine's own `_row_bytes`."""
    order = sorted(range(len(starts)), key=lambda i: (-firsts[i], -starts[i]))
    out: list[tuple[int, int, int]] = []
    a = 0
    while a < len(order):
        b, start, first = a + 1, starts[order[a]], firsts[order[a]]
        while b < len(order) and b - a < 4096:
            s2, f2 = min(start, starts[order[b]]), min(first, firsts[order[b]])
            if (b - a + 1) * engine._row_bytes(model, width, width - s2, f2) > budget:
                break
            start, first, b = s2, f2, b + 1
        out.append((b - a, start, first))
        a = b
    return out


def _patch_bytes(shape: Shape, runs: Sequence[Any]) -> int:
    """The values a forward's hooks write, gathered before it: per patched column one head's or
    the stream's vector, with its four indices."""
    return sum(len(cols) * ((shape.d_head if head >= 0 else shape.d_model) * shape.elt + 32)
               for run in runs for _, _, head, cols, *_ in run.patches)


def _group_forwards(stage: engine.Stage, gi: int, shape: Shape, shortcuts: bool,
                    budget: float) -> tuple[int, int, int]:
    """(bytes, rows) of group `gi`'s largest patched forward, less the patterns a bridge keeps, and
    the largest pattern one layer of any of its forwards keeps (0 unless `Shape.keeps_patterns`)."""
    group = stage.prepared.groups[gi]
    width = group.width
    plain = replace(shape, keeps_patterns=False)
    vocab = len({t for row in group.answer_ids or [] for t in row}) or 2
    peak, rows, pattern = 0, 0, 0
    for c in (c for c in stage.chunks if c.group == gi):
        runs = stage.runs[gi][c.lo : c.hi]
        starts = [r.start if shortcuts else 0 for r in runs]
        firsts = [r.layer if shortcuts and 0 < r.layer < shape.n_layers else 0 for r in runs]
        order = sorted(range(len(runs)), key=lambda i: (-firsts[i], -starts[i]))
        at = 0
        for r, start, first in _forward_chunks(stage.model, width, starts, firsts, budget):
            cached = shortcuts and start > 0
            size = r * row_bytes(plain, width, width - start, first, prefix=cached, vocab=vocab)
            size += _patch_bytes(shape, [runs[i] for i in order[at : at + r]])
            if size > peak:
                peak, rows = size, r
            if shape.keeps_patterns:
                pattern = max(pattern, r * _pattern_bytes(shape, width - start, width if cached else width - start))
            at += r
    return peak, rows, pattern


def stage_memory(stage: engine.Stage) -> MemoryEstimate:
    """The peak of running `stage` (a `tomlens.patching.engine.Stage`): per group, the base pass, or
    what it keeps plus its largest patched forward, whichever is larger.

    Two things outlive the forward that made them and are counted too: the previous group's kept
    activations while the next base pass runs (`Stage.run` still holds them then), and, where the
    bridge keeps each layer's last pattern, one pattern per layer, the largest any of the stage's
    forwards so far left there (a forward's own pattern replaces its layer's older one; patterns
    left by forwards before the stage are part of what was held before it, never a rise).
    Attribution stages (gradients) are not estimated here."""
    model, shape = stage.model, Shape.of_model(stage.model)
    shortcuts = stage.reuse_prefix and engine.shortcuts_verdict(model) is not False
    resid = [hook_name(Site("resid_pre", layer)) for layer in range(1, shape.n_layers)] if shortcuts else []
    hooks = sorted(set(stage.hooks) | set(resid))
    budget = min(stage.memory_mb, engine._MEMORY_CAP.get(model, stage.memory_mb)) * 2**20
    best, kept_before, pattern, layers = MemoryEstimate(0), 0, 0, shape.n_layers
    for gi, group in enumerate(stage.prepared.groups):
        n = 2 * group.g
        base_peak, kept = (x * n for x in base_bytes(shape, group.width, hooks))
        own = n * _pattern_bytes(shape, group.width, group.width) if shape.keeps_patterns else 0
        # finished blocks hold this pass's pattern or an older one; the running block both (the
        # older until it returns; its own is in its transient)
        base_peak += (layers - 1) * max(pattern, own) + pattern
        fwd, rows, chunk_pattern = _group_forwards(stage, gi, shape, shortcuts, budget)
        pattern = max(pattern, own, chunk_pattern)
        fwd += layers * pattern
        peak = int(HEADROOM * max(kept_before + base_peak, kept + fwd)) + SLACK
        if peak > best.peak:
            best = MemoryEstimate(peak, base_peak, kept, fwd, rows, n)
        kept_before = kept
    return best
