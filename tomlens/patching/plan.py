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
before any run.

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
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping, Sequence

import torch
from torch import Tensor
from tqdm.auto import tqdm

from tomlens.errors import TomlensError
from tomlens.patching.attribution import IG_PATHS, IGPath, attribution_patching, check_integrable, hook_blocks
from tomlens.patching.checkpoints import Checkpoints
from tomlens.patching.heads import AblationSweep, HeadSetSweep
from tomlens.patching.cells import MENTIONS, Cell, canonical_kind, plan_cells
from tomlens.patching.engine import forward_cost
from tomlens.patching.exact import ExactSweep
from tomlens.patching.pairs import Direction, Group, PreparedPairs
from tomlens.patching.result import PatchingResult

DEFAULT_MAX_RUNS = 100_000
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
    notes = [f"position {sel!r} left out: {n} of {len(stimuli)} stories have no {sel!r} span (pairs "
             "written by an older tomlens, or a family without it; rewrite them with `tomlens pairs` "
             "to patch there)" for sel, n in missing.items()]
    return Positions(spec, positions.from_roles, positions.notes + notes)


def describe_cells(cells: Sequence[Cell]) -> str:
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
        out.extend(f"note: {n}" for n in self.notes)
        return out

    def to_dict(self) -> dict[str, Any]:
        total = self.seconds()
        return {
            "stages": [{**asdict(s), "cost": float(s.cost), "forward": float(s.forward)} for s in self.stages],
            "total_runs": self.total_runs, "done_runs": self.done_runs, "max_runs": self.max_runs,
            "estimated_seconds": None if total is None or not math.isfinite(total) else round(total, 1),
            "calibration": self.calibration, "notes": list(self.notes),
        }


class AttributionSweep:
    """Attribution patching of one direction laid out per group of pairs: each group's estimates
    need that group's forwards and backward only, so each group is a chunk, checkpointed."""

    def __init__(self, model, prepared: PreparedPairs, spec: Mapping[str, Sequence[str]], direction: Direction,
                 steps: int = 1, path: IGPath = "sites"):
        self.model, self.prepared, self.spec, self.direction = model, prepared, dict(spec), direction
        self.steps = int(steps)  # 1: plain attribution; more: integrated gradients over that many points
        if path not in IG_PATHS:
            raise TomlensError(f"attribution path {path!r}", f"use one of {', '.join(IG_PATHS)}")
        self.path = path  # what integrated gradients move: the token embeddings or each site
        if self.steps > 1 and path == "embeddings":
            check_integrable(model)  # before any stage runs, not after the exact sweep
        self.cells = plan_cells(model, self.spec, n_aligned=prepared.n_aligned)
        how = (f"steps={self.steps}" if self.steps > 1 else "") + (f" path={path}" if self.steps > 1 and
                                                                   path != "embeddings" else "")
        tag = hashlib.sha256((repr(self.cells) + how).encode()).hexdigest()[:12]
        self.names = [f"attribution-{direction}-g{gi:04d}-{tag}" for gi in range(len(prepared.groups))]
        self.parts: dict[int, dict[str, Tensor]] = {}

    def cost(self, gi: int) -> float:
        """Multiply-adds of one group: the source forward, then per run a forward and a backward
        (about two forwards) from the first differing token: one run per step along the
        embeddings; the plain run, then per step one run per hook point, through the blocks from
        its block on, along the sites."""
        grp = self.prepared.groups[gi]
        run = 3 * forward_cost(self.model, grp.g, grp.width - int(grp.first_diff.min()))
        if self.path == "embeddings" or self.steps == 1:
            runs = self.steps
        else:
            n = self.model.cfg.n_layers
            runs = 1 + (self.steps - 1) * sum((n - block) / n for block in hook_blocks(self.cells).values())
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
                            [Group(list(range(grp.g)), grp.batch, grp.tokens, grp.first_diff, grp.positions)],
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
        stages.append(PlanStage(f"exact {d}", describe_cells(sw.cells), len(sw.cells), n_pairs, st.n_runs,
                                st.cost(), st.forward_cost(), done=st.n_done,
                                extra=_forwards(len(st.prepared.groups), "unpatched")))
    for d, at in attribution.items():
        n_groups = len(at.prepared.groups)
        stages.append(PlanStage(f"attribution {d}", describe_cells(at.cells), len(at.cells), n_pairs, 0,
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
                                unit="head sets"))
    if ablation is not None:
        st = ablation.stage
        stages.append(PlanStage(f"mean ablation ({ablation.mode})", f"{ablation.n_sets} head sets", ablation.n_sets,
                                n_pairs, st.n_runs, st.cost(), st.forward_cost() + ablation.means_cost(),
                                extra=_forwards(len(ablation.prepared.groups), "plain") + " for the heads' means",
                                unit="head sets", per_pair=2))
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
