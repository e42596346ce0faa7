"""Exact patching sweeps: sets of cells patched into every pair, each (set, pair) one batched run.

A sweep patches one site at a time (a head's output, the residual stream at a layer and position,
an attention or MLP output) from one run of a pair into the other and reads the logit difference.
Denoising patches clean into corrupted ("is this site sufficient to restore the belief answer?"),
noising patches corrupted into clean ("is it necessary?"). Both report the same scale: 0 is the
corrupted run, 1 the clean run.

`CellSetSweep` is the one loop behind every exact sweep: the per-cell sweep (`ExactSweep`, a set
of one cell each) and the head sets of top-k recovery (`tomlens.patching.heads.HeadSetSweep`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, overload

import torch
from jaxtyping import Float
from torch import Tensor
from tqdm.auto import tqdm

from tomlens.errors import TomlensError
from tomlens.messages import say
from tomlens.models.protocol import Model
from tomlens.patching.cells import (
    Cell,
    canonical_kind,
    cell_hooks,
    cell_patch,
    check_selectors,
    hook_for,
    plan_cells,
    selectors_in,
)
from tomlens.patching.engine import DEFAULT_CHUNK_RUNS, Patch, Run, Stage
from tomlens.patching.metric import Normalise
from tomlens.patching.pairs import Direction, PreparedPairs, prepare_pairs, roles
from tomlens.patching.result import PatchingResult

if TYPE_CHECKING:
    from tomlens.patching.plan import Plan, Positions

DEFAULT_MAX_RUNS = 100_000  # patched runs a sweep may plan before it is refused (CLI --max-runs, Python max_runs)


class CellSetSweep:
    """Each set of cells patched into every pair with all its cells at once, laid out per group
    before it runs (`stage`, run in checkpointed chunks).

    A (set, pair) needs no run when every cell falls before the pair's first differing token
    (nothing changes: the base run's own metric) and is NaN when no cell has a token in the pair
    (a position the pair lacks).
    """

    def __init__(
        self,
        name: str,
        model: Model,
        prepared: PreparedPairs,
        sets: Sequence[Sequence[Cell]],
        direction: Direction = "denoise",
        *,
        desc: str = "patching",
        memory_mb: float = 1024.0,
        chunk_runs: int = DEFAULT_CHUNK_RUNS,
        reuse_prefix: bool = True,
    ):
        self.prepared, self.direction, self.n_sets, self.desc = prepared, direction, len(sets), desc
        hooks = {c: hook_for(c.kind, c.layer) for s in sets for c in s}
        runs: list[list[Run]] = []
        self.targets: list[list[tuple[int, int]]] = []  # (set, pair) of each run
        self.fills: list[list[tuple[int, int, int]]] = []  # (set, pair, base row): no run needed
        for group in prepared.groups:
            g = group.g
            rs: list[Run] = []
            ts: list[tuple[int, int]] = []
            fs: list[tuple[int, int, int]] = []
            for s_i, cells in enumerate(sets):
                for j, p_i in enumerate(group.index):
                    base, src = roles(direction, g, j)
                    where = [cell_patch(c, group, j, prepared.n_aligned, base=base, source=src) for c in cells]
                    if where and all(w is None for w in where):
                        continue
                    patches = [Patch(hooks[c], c.layer, c.head, w[0], src, None if w[1] == w[0] else w[1])
                               for c, w in zip(cells, where, strict=True) if w and w[0]]
                    if not patches:
                        fs.append((s_i, p_i, base))
                        continue
                    rs.append(Run(base, patches))
                    ts.append((s_i, p_i))
            runs.append(rs)
            self.targets.append(ts)
            self.fills.append(fs)
        self.stage = Stage(name, model, prepared, runs, hooks=cell_hooks([c for s in sets for c in s]),
                           memory_mb=memory_mb, chunk_runs=chunk_runs, reuse_prefix=reuse_prefix)

    def load(self, checkpoints: Any) -> int:
        """Take finished chunks from `checkpoints`; returns the runs now done."""
        return self.stage.load(checkpoints)

    def run(self, *, checkpoints: Any = None, progress: bool = True) -> None:
        """Run every chunk not done (taking finished ones from `checkpoints` first, saving new ones)."""
        stage = self.stage
        if checkpoints is not None:
            stage.load(checkpoints)
        with tqdm(total=stage.n_runs, desc=self.desc, unit="run", disable=not progress) as bar:
            bar.update(stage.n_done)
            stage.run(checkpoints=checkpoints, bar=bar)

    def values(self) -> tuple[Float[Tensor, "set pair"], Float[Tensor, " pair"], Float[Tensor, " pair"]]:
        """Raw metric `[set, pair]` with the clean and corrupted baselines `[pair]`, once run."""
        n_pair = len(self.prepared.pairs)
        values = torch.full((self.n_sets, n_pair), float("nan"), dtype=torch.float64)
        clean = torch.empty(n_pair, dtype=torch.float64)
        corrupted = torch.empty(n_pair, dtype=torch.float64)
        for gi, group in enumerate(self.prepared.groups):
            metric = self.stage.base[gi]
            if metric is None:
                raise RuntimeError(f"{self.stage.name}: group {gi} has not run")
            metric = metric.double()
            clean[group.index] = metric[: group.g]
            corrupted[group.index] = metric[group.g :]
            if self.targets[gi]:
                t = torch.tensor(self.targets[gi])
                values[t[:, 0], t[:, 1]] = self.stage.values[gi].double()
            if self.fills[gi]:
                f = torch.tensor(self.fills[gi])
                values[f[:, 0], f[:, 1]] = metric[f[:, 2]]
        return values, clean, corrupted


class ExactSweep(CellSetSweep):
    """An exact patching sweep laid out before it runs: one run per (cell, pair), except cells
    patched only before the pair's first differing token and positions the pair lacks (see
    `CellSetSweep`). `run` runs the rest; `result` assembles them."""

    def __init__(
        self,
        model: Model,
        prepared: PreparedPairs,
        cells: Sequence[Cell],
        direction: Direction = "denoise",
        *,
        memory_mb: float = 1024.0,
        reuse_prefix: bool = True,
        chunk_runs: int = DEFAULT_CHUNK_RUNS,
    ):
        check_selectors(cells, prepared)
        self.cells = list(cells)
        super().__init__(f"exact-{direction}", model, prepared, [[c] for c in self.cells], direction,
                         desc=f"patching ({direction})", memory_mb=memory_mb, chunk_runs=chunk_runs,
                         reuse_prefix=reuse_prefix)

    def result(self, normalise: Normalise = "pooled") -> PatchingResult:
        values, clean, corrupted = self.values()
        return PatchingResult(
            "exact", self.direction, self.cells, values, clean, corrupted, self.prepared.ids,
            self.prepared.token_labels, normalise,
        )


ROLE_DEFAULT: tuple[str, ...] = ("roles",)  # the Python API's positions, as `tomlens patch --positions roles`


@dataclass(frozen=True)
class SweepPositions:
    """Where a Python sweep patches, resolved against its pairs: each kind's cell positions (what
    `plan_cells` takes as a mapping) and the notes of positions left out (a role span some stories
    lack, a mention not every pair has), which the sweep says."""

    spec: dict[str, tuple[str, ...]]
    notes: tuple[str, ...] = ()

    @property
    def selectors(self) -> tuple[str, ...]:
        """The positions `prepare_pairs` must resolve (not "all" or "each")."""
        return selectors_in(self.spec, ())


def _mapped_positions(sites: Mapping[str, Sequence[str]], positions: str | Sequence[str]) -> Positions:
    """A kind -> positions mapping as it always read (a kind's own cell positions: "all" is every
    token at once, for the residual stream too), with `roles` and `mentions` understood as in
    `--positions`; `positions` other than the default are added to every kind in it."""
    from tomlens.patching.plan import Positions, parse_positions
    from tomlens.syntax import split_items

    spec: dict[str, list[str]] = {}
    from_roles: dict[str, set[str]] = {}

    def add(kind: str, chosen: Sequence[str], roles: Sequence[str] = ()) -> None:
        from_roles[kind].update(p for p in roles if p not in spec[kind])
        spec[kind].extend(p for p in chosen if p not in spec[kind])

    for name, values in sites.items():
        kind = canonical_kind(name)
        spec[kind], from_roles[kind] = [], set()
        for value in split_items(values):
            if value == "roles":
                role = parse_positions(value, [kind])
                add(kind, role.spec[kind], tuple(role.from_roles[kind]))
            else:
                add(kind, [value])
    items = split_items(positions)
    if items == list(ROLE_DEFAULT):
        items = []
    for item in items:
        site = item.rpartition("=")[0]
        if site and canonical_kind(site) not in spec:
            raise TomlensError(f"positions item {item!r} names site {site!r}, which sites does not map",
                               f"add it to sites or drop the item (sites: {', '.join(spec)})")
    for kind in spec:
        mine = [i for i in items if "=" not in i or canonical_kind(i.rpartition("=")[0]) == kind]
        if mine:
            added = parse_positions(mine, [kind])
            add(kind, added.spec[kind], tuple(added.from_roles[kind]))
    return Positions({k: tuple(v) for k, v in spec.items()}, from_roles)


def sweep_positions(
    model: Model, pairs: Sequence[Any] | PreparedPairs, sites: str | Sequence[str] | Mapping[str, Sequence[str]],
    positions: str | Sequence[str] = ROLE_DEFAULT,
) -> SweepPositions:
    """The positions a Python sweep patches, as `tomlens patch` resolves `--sites` and `--positions`
    (`tomlens.patching.plan`): a misspelt site or position refused with the nearest word, `roles`
    (the default) the role positions per kind, `all` / `each` / `mentions` / selectors /
    `SITE=POSITION` as there; `mentions` expanded for these pairs and role positions some stories
    have no span for left out with a note. So a Python call and the command plan the same cells.

    `sites` as a mapping keeps its own meaning (kind -> cell positions, e.g. {"heads": ["all"]}):
    the default positions add nothing to it, other positions are added to every kind in it."""
    from tomlens.patching.plan import drop_missing_roles, expand_mentions, parse_positions
    from tomlens.runs.patching import check_patching_words
    from tomlens.syntax import split_items

    if isinstance(sites, Mapping):
        words = split_items(positions)
        check_patching_words(list(sites), [] if words == list(ROLE_DEFAULT) else words)
        pos = _mapped_positions(sites, positions)
    else:
        names = split_items(sites)
        check_patching_words(names, split_items(positions))
        pos = parse_positions(positions, list(dict.fromkeys(canonical_kind(s) for s in names)))
    given = list(pairs.pairs if isinstance(pairs, PreparedPairs) else pairs)
    pos = drop_missing_roles(expand_mentions(pos, given, model.tokenizer),
                             [s for p in given for s in (p.clean, p.corrupted)])
    return SweepPositions(dict(pos.spec), tuple(pos.notes))


def prepared_with(model: Model, pairs: Sequence[Any] | PreparedPairs, selectors: Sequence[str],
                  batch_pairs: int) -> PreparedPairs:
    """`pairs` prepared with `selectors` resolved: pairs already prepared with them as they are,
    pairs prepared without some (e.g. before the default became the role positions) prepared again
    in the same groups (as many pairs a group as their largest) with the missing ones added."""
    if not isinstance(pairs, PreparedPairs):
        return prepare_pairs(model, pairs, selectors=selectors, batch_pairs=batch_pairs)
    missing = [s for s in selectors if s not in pairs.selectors]
    if not missing:
        return pairs
    same_groups = max(g.g for g in pairs.groups)
    return prepare_pairs(model, pairs.pairs, selectors=(*pairs.selectors, *missing), batch_pairs=same_groups)


@overload
def exact_patching(
    model: Model, pairs: Sequence[Any] | PreparedPairs, *,
    sites: Sequence[str] | Mapping[str, Sequence[str]] = ..., positions: str | Sequence[str] = ...,
    direction: Direction = ..., layers: Sequence[int] | None = ..., normalise: Normalise = ...,
    batch_pairs: int = ..., memory_mb: float = ..., reuse_prefix: bool = ..., progress: bool = ...,
    cells: Sequence[Cell] | None = ..., checkpoints: Any = ..., chunk_runs: int = ...,
    dry_run: Literal[True], max_runs: int | None = ...,
) -> Plan: ...


@overload
def exact_patching(
    model: Model, pairs: Sequence[Any] | PreparedPairs, *,
    sites: Sequence[str] | Mapping[str, Sequence[str]] = ..., positions: str | Sequence[str] = ...,
    direction: Direction = ..., layers: Sequence[int] | None = ..., normalise: Normalise = ...,
    batch_pairs: int = ..., memory_mb: float = ..., reuse_prefix: bool = ..., progress: bool = ...,
    cells: Sequence[Cell] | None = ..., checkpoints: Any = ..., chunk_runs: int = ...,
    dry_run: Literal[False] = ..., max_runs: int | None = ...,
) -> PatchingResult: ...


def exact_patching(
    model: Model,
    pairs: Sequence[Any] | PreparedPairs,
    *,
    sites: Sequence[str] | Mapping[str, Sequence[str]] = ("heads",),
    positions: str | Sequence[str] = ROLE_DEFAULT,
    direction: Direction = "denoise",
    layers: Sequence[int] | None = None,
    normalise: Normalise = "pooled",
    batch_pairs: int = 8,
    memory_mb: float = 1024.0,
    reuse_prefix: bool = True,
    progress: bool = True,
    cells: Sequence[Cell] | None = None,
    checkpoints: Any = None,
    chunk_runs: int = DEFAULT_CHUNK_RUNS,
    dry_run: bool = False,
    max_runs: int | None = DEFAULT_MAX_RUNS,
) -> PatchingResult | Plan:
    """Patch every cell of the requested sites, one batched forward per chunk of (cell, pair) runs.

    `sites` and `positions` read as `tomlens patch --sites` and `--positions` (`sweep_positions`),
    so a call plans the cells the command plans: sites are kinds ("heads", "resid", "attn", "mlp",
    "resid_mid", ...); `positions` defaults to the role positions (`roles`: the final token, the
    contrast's end and the question's mentions of protagonist and object; heads without the
    contrast), role positions the pairs' stories lack left out with a note. `positions=("all",)` is
    the every-position sweep (heads, attention and MLP outputs at all positions at once, the
    residual stream one position at a time); `each`, `mentions`, selectors ("final",
    "query_protagonist", "protagonist@2", ...) and `SITE=POSITION` items ("heads=final") as on the
    command line. A misspelt site or position is refused with the nearest word before any forward.
    `sites` may instead map kinds to their own cell positions ({"heads": ["all"], "resid":
    ["final"]}: "all" there is every token at once for any kind); positions other than the default
    are then added to every kind.
    `cells`: an explicit list of cells to patch instead (e.g. the candidates a search verifies);
    `sites`, `positions` and `layers` are then ignored. Pairs already prepared without a position
    the sweep needs are prepared again, in the same groups, with it resolved.
    `checkpoints` (a `tomlens.patching.checkpoints.Checkpoints`): finished chunks of
    `chunk_runs` runs are saved there and taken from there, so a stopped sweep resumes.
    `dry_run`: lay the sweep out, say its plan and return it (a `tomlens.patching.plan.Plan`)
    without running a patched forward. `max_runs`: a sweep of more patched runs than this (default,
    as `tomlens patch --max-runs`: 100,000) says its plan and raises instead of running; None: no limit.
    With `progress`, the plan (with its notes: positions left out) is said before the sweep runs.
    """
    if cells is not None:
        cells = list(cells)
        notes: tuple[str, ...] = ()
        prepared = prepared_with(model, pairs, selectors_in({}, [c.position for c in cells]), batch_pairs)
    else:
        where = sweep_positions(model, pairs, sites, positions)
        notes = where.notes
        prepared = prepared_with(model, pairs, where.selectors, batch_pairs)
        cells = plan_cells(model, where.spec, n_aligned=prepared.n_aligned, layers=layers)
    sweep = ExactSweep(model, prepared, cells, direction, memory_mb=memory_mb, reuse_prefix=reuse_prefix,
                       chunk_runs=chunk_runs)
    plan = sweep_plan(sweep, max_runs)
    plan.notes.extend(notes)
    if dry_run:
        say("\n".join([*plan.lines(), "dry run: nothing run"]))
        return plan
    check_python_budget(plan)
    if progress:  # with its bar, the plan first: how many runs the bar is about to count
        say("\n".join(plan.lines()))
    sweep.run(checkpoints=checkpoints, progress=progress)
    return sweep.result(normalise)


def sweep_plan(sweep: ExactSweep, max_runs: int | None) -> Plan:
    """The plan of one exact sweep (its patched runs, unpatched forwards and memory), untimed: a
    timing would need a forward, and a dry run runs none."""
    from tomlens.patching.plan import Plan, plan_stages

    n_pairs = len(sweep.prepared.pairs)
    return Plan(plan_stages({sweep.direction: sweep}, {}, None, None, n_pairs=n_pairs), n_pairs, max_runs)


def check_python_budget(plan: Plan) -> None:
    """Refuse, in the Python API's words, a plan of more patched runs than its `max_runs`: the plan
    is said first, and the error names the argument that raises the limit (the CLI's names flags)."""
    if plan.max_runs is None or plan.total_runs <= plan.max_runs:
        return
    say("\n".join(plan.lines()))
    raise TomlensError(
        f"the plan needs {plan.total_runs:,} patched runs ({plan.n_pairs} pairs), more than max_runs={plan.max_runs:,}",
        "patch fewer cells (sites=['heads'], positions=['final'] or role positions, layers=[...]) or fewer pairs; "
        f"or pass max_runs={plan.total_runs} (None: no limit); dry_run=True returns the plan without running")
