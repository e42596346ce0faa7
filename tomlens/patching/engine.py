"""The batched patched-run engine: every patched run of a sweep is a batch row.

A patched run is a base story with some cells overwritten by values from a source run (`Run`);
its result is the logit difference at the last token (`tomlens.patching.metric`).

Why it is fast and still exact:
- Pairs are processed in groups (`tomlens.patching.pairs`); each group's clean and corrupted runs
  are cached once (activations at the patched sites, keys/values, last-token logits: `base_pass`).
- Patched runs are rows; rows are chunked to a memory budget and run together (`run_patched`).
- Clean and corrupted stories are token-identical up to the contrast span, so nothing can change
  before the first differing token; positions before it are never recomputed (their keys and values
  come from the base run). A role-aligned pair (stories worded differently) is patched from its
  clean story's role token into its corrupted story's role token (`Patch.source_cols`).
- Blocks below the first patched block are not run either: the base run's residual stream enters
  the patched block directly. A one-off check per model confirms both shortcuts reproduce a plain
  run; if they do not (an architecture they do not fit), every run is a plain full forward.
- Nothing waits for the GPU between forwards: runs, rows and cells are laid out on the host from
  the tokenizer's output and moved in non-blocking copies, metrics stay on the device, and a stage
  brings them to the host as they finish, one chunk behind (`_Landing`).

Sweeps lay out their runs before they run (`Stage`: every run of every group, with the work each
costs), so a plan can count and time them (`tomlens.patching.plan`), and run them in chunks that
are checkpointed as they finish (`tomlens.patching.checkpoints`): a stopped sweep resumes from the
chunks on disk, which are reused only for exactly the runs that made them.
"""

from __future__ import annotations

import functools
import hashlib
import warnings
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from jaxtyping import Float
from torch import Tensor

from tomlens.devices import to_device
from tomlens.errors import TomlensError
from tomlens.hooks.patch import PatchIndex, PrefixCache, forward_last, patch_hooks, record_hooks
from tomlens.models.protocol import Model
from tomlens.oom import OOM_ERRORS, release_memory
from tomlens.patching.metric import logit_diff
from tomlens.patching.pairs import Group, PreparedPairs

# --------------------------------------------------------------------------------------------
# The engine: base runs cached once, then chunks of patched rows


class Patch(NamedTuple):
    """One site overwritten in a patched run: the hook, its layer and head (-1: no head axis), the
    padded columns written in the base row, the source row (it indexes the `sources` tensors given
    to `run_patched`) and the columns read there (None: the same columns, as in token-aligned pairs;
    a role-aligned pair reads its clean story's role token, wherever that story has it)."""

    hook: str
    layer: int
    head: int
    cols: list[int]
    source: int
    source_cols: list[int] | None = None

    @property
    def read_cols(self) -> list[int]:
        return self.cols if self.source_cols is None else self.source_cols

    def key(self) -> tuple:
        """What a checkpoint's tag hashes: the plain 5-tuple when the columns are shared, so the
        chunks of runs made before role-aligned pairs existed keep their tags."""
        return tuple(self) if self.source_cols is not None else tuple(self)[:5]


@dataclass
class Run:
    """One patched forward: a base story (row) and the sites overwritten in it (`Patch`)."""

    base: int
    patches: list[Patch]

    @property
    def start(self) -> int:
        return min(min(p.cols) for p in self.patches)

    @property
    def layer(self) -> int:
        return min(p.layer for p in self.patches)


@dataclass
class BasePass:
    """Last-token metric, activations at the patched sites, the residual stream entering every
    block and keys/values, for every story of a group."""

    metric: Float[Tensor, " story"]
    sources: dict[str, Tensor]
    prefix: PrefixCache | None
    resid: dict[int, Tensor] = field(default_factory=dict)


def base_pass(
    model: Model, group: Group, hook_names: Iterable[str], *, reuse_prefix: bool = True, skip_layers: bool | None = None
) -> BasePass:
    """Run every story of a group once, keeping what the patched runs reuse.

    With `skip_layers` (default: same as `reuse_prefix`), the residual stream entering each block
    is kept so patched runs can start at the first block they patch.
    """
    from tomlens.hooks import Site, hook_name

    skip_layers = reuse_prefix if skip_layers is None else skip_layers
    names = set(hook_names)
    resid_names = {hook_name(Site("resid_pre", l)): l for l in range(1, model.cfg.n_layers)} if skip_layers else {}
    store: dict[str, Tensor] = {}
    batch = group.batch
    with torch.inference_mode():
        last, prefix = forward_last(
            model, batch.input_ids, batch.forward_kwargs(),
            record_hooks(sorted(names | set(resid_names)), store), keep_cache=reuse_prefix,
        )
    sources = {n: store[n] for n in names}
    resid = {l: store[n] for n, l in resid_names.items() if n in store}
    return BasePass(logit_diff(last, group.tokens), sources, prefix, resid)


def _row_bytes(model: Model, width: int, new: int, first_layer: int = 0) -> int:
    """Memory of one patched row, as the plan counts it (`plan.row_bytes`, tensor by tensor), so the
    chunks this engine cuts hold `memory_mb` and the plan's memory figure describes what ran."""
    from tomlens.patching.plan import Shape, row_bytes  # plan imports this module

    dtype = next(model.parameters()).dtype
    cached = _SHAPES.get(model)
    if cached is None or cached[0] != dtype:  # a model cast after its first run is costed anew
        cached = _SHAPES[model] = (dtype, Shape.of_model(model))
    return row_bytes(cached[1], width, new, first_layer)


_SHAPES: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def _entries(chunk: Sequence[Run], sources: Mapping[str, Tensor]) -> dict[str, PatchIndex]:
    """Every hook's cells of a chunk as index tensors on the sources' device, with the values they
    take gathered there. The index table is built on the host from the runs and moved in one
    non-blocking copy: no host sync, whatever the number of runs, hooks, heads or columns."""
    acc: dict[str, tuple[list[int], list[int], list[int], list[int], list[int]]] = {}
    for r, run in enumerate(chunk):
        for p in run.patches:
            rows, cs, hs, ss, reads = acc.setdefault(p.hook, ([], [], [], [], []))
            n = len(p.cols)
            rows.extend([r] * n)
            cs.extend(p.cols)
            hs.extend([p.head] * n)
            ss.extend([p.source] * n)
            reads.extend(p.read_cols)
    if not acc:
        return {}
    device = next(iter(sources.values())).device if sources else torch.device("cpu")
    flat: list[list[int]] = [[], [], [], [], []]
    spans: dict[str, tuple[int, int]] = {}
    for hook, lists in acc.items():
        spans[hook] = (len(flat[0]), len(flat[0]) + len(lists[0]))
        for k in range(5):
            flat[k].extend(lists[k])
    table = to_device(torch.tensor(flat, dtype=torch.long), device)  # [rows, cols, heads, sources, read cols]
    out: dict[str, PatchIndex] = {}
    for hook, (a, b) in spans.items():
        acts = sources[hook]
        t = table[:, a:b] if acts.device == device else to_device(table[:, a:b], acts.device)
        if acc[hook][2][0] >= 0:
            out[hook] = PatchIndex(t[0], t[1], t[2], acts[t[3], t[4], t[2]])
        else:
            out[hook] = PatchIndex(t[0], t[1], None, acts[t[3], t[4]])
    return out


# Whether shared-prefix / skipped-block runs reproduce a plain run on this model (checked once).
_SHORTCUTS_OK: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()
# The memory budget (MB) a model's patched forwards shrank to after running out of memory.
_MEMORY_CAP: weakref.WeakKeyDictionary[Any, float] = weakref.WeakKeyDictionary()


def _shortcuts_ok(model: Model, group: Group, bp: BasePass) -> bool:
    """Check once per model that a run through the shortcuts (KV prefix from the last column,
    blocks below the middle skipped) gives the base run's own metric; if not, do without them."""
    if bp.prefix is None:
        return False
    try:
        return _SHORTCUTS_OK[model]
    except (KeyError, TypeError):
        pass
    width = group.width
    start = width - 1
    layer = model.cfg.n_layers // 2
    batch = group.batch
    rows = to_device(torch.tensor([0]), batch.input_ids.device)
    skip = (layer, bp.resid[layer][rows, start:]) if layer in bp.resid else None
    try:
        with torch.inference_mode():
            last, _ = forward_last(
                model, batch.input_ids, batch.forward_kwargs(), rows=rows, prefix=bp.prefix,
                start=start, skip=skip,
            )
            got = logit_diff(last, group.tokens[rows])[0].double()
            want = bp.metric[0].double()
        low = next(model.parameters()).dtype in (torch.float16, torch.bfloat16)
        ok = bool((got - want).abs() <= (5e-2 if low else 1e-3) * (1 + want.abs()))  # the one sync, once per model
        if not ok:
            warnings.warn("shared-prefix shortcuts disagree with a plain run on this model; not using them", stacklevel=3)
    except Exception as e:  # noqa: BLE001 - an architecture the shortcuts do not fit
        warnings.warn(f"patching without shared-prefix shortcuts: {type(e).__name__}: {e}", stacklevel=3)
        ok = False
    try:
        _SHORTCUTS_OK[model] = ok
    except TypeError:
        pass
    return ok


def shortcuts_verdict(model: Model) -> bool | None:
    """Whether the shared-prefix shortcuts reproduced a plain run on this model (None: not checked
    yet). Other passes that start at the first differing token do without them on False."""
    try:
        return _SHORTCUTS_OK.get(model)
    except TypeError:
        return None


def run_patched(
    model: Model,
    group: Group,
    runs: Sequence[Run],
    sources: Mapping[str, Tensor],
    base: BasePass,
    *,
    memory_mb: float = 1024.0,
    bar: Any = None,
    on_device: bool = False,
) -> Float[Tensor, " run"]:
    """Metric of every patched run, many runs per forward.

    Runs are sorted by the first block they patch and their first patched column (latest first)
    and cut into chunks that fit `memory_mb`. A chunk runs only the blocks from its earliest
    patched block on (the base run's residual stream enters there) and only the columns from its
    earliest patched column on (earlier keys and values come from the base run). A forward that
    runs out of accelerator memory is retried with half its rows (rows do not interact: the same
    numbers), and later forwards on this model keep the smaller budget.

    Nothing between the forwards waits for the GPU: every chunk's rows and cells are laid out on
    the host and moved in non-blocking copies, and the metrics stay on the device. The result is
    moved to the host once at the end (`on_device=True`: left on the device, for a caller that
    gathers many calls' results before one move).
    """
    device = group.batch.input_ids.device
    out = torch.full((len(runs),), float("nan"), dtype=torch.float32, device=device)
    if not runs:
        return out if on_device else out.cpu()
    width = group.width
    shortcuts = _shortcuts_ok(model, group, base)
    prefix = base.prefix if shortcuts else None
    starts = [run.start if shortcuts else 0 for run in runs]
    firsts = [run.layer if shortcuts and run.layer in base.resid else 0 for run in runs]
    order = sorted(range(len(runs)), key=lambda i: (-firsts[i], -starts[i]))
    budget = min(memory_mb, _MEMORY_CAP.get(model, memory_mb)) * 2**20
    batch = group.batch
    fk = batch.forward_kwargs()
    vocab, answer = group.metric_vocab()  # the metric's tokens only
    a = 0
    while a < len(order):
        b = a + 1
        start, first = starts[order[a]], firsts[order[a]]
        while b < len(order) and b - a < 4096:
            s2, f2 = min(start, starts[order[b]]), min(first, firsts[order[b]])
            if (b - a + 1) * _row_bytes(model, width, width - s2, f2) > budget:
                break
            start, first = s2, f2
            b += 1
        chunk_idx = order[a:b]
        chunk = [runs[i] for i in chunk_idx]
        # base rows and where their results go, moved in one non-blocking copy
        index = to_device(torch.tensor([[run.base for run in chunk], chunk_idx], dtype=torch.long), device)
        rows, dest = index[0], index[1]
        offset = start if prefix is not None else 0
        try:
            skip = (first, base.resid[first].index_select(0, rows.to(base.resid[first].device))[:, offset:]) if first > 0 else None
            hooks = patch_hooks(_entries(chunk, sources), offset=offset)
            with torch.inference_mode():
                last, _ = forward_last(
                    model, batch.input_ids, fk, hooks, rows=rows, prefix=prefix, start=start, skip=skip,
                    vocab=vocab,
                )
                out.index_copy_(0, dest, logit_diff(last, answer.index_select(0, rows)))
        except OOM_ERRORS:
            if len(chunk) == 1:
                raise
            # Rows do not interact, so half as many rows per forward gives the same numbers.
            release_memory()
            budget = (len(chunk) // 2) * _row_bytes(model, width, width - start, first)
            _MEMORY_CAP[model] = budget / 2**20
            warnings.warn(f"out of memory in a patched forward of {len(chunk)} runs; continuing with "
                          f"{len(chunk) // 2} per forward", stacklevel=2)
            continue
        if bar is not None:
            bar.update(len(chunk))
        a = b
    return out if on_device else out.cpu()


# --------------------------------------------------------------------------------------------
# Stages: a sweep's patched runs laid out before they run, and run in checkpointed chunks

DEFAULT_CHUNK_RUNS = 1024
# A chunk also ends at this much work (multiply-adds): seconds on two CPU cores, so a stopped run
# loses seconds and the timed first chunk is short, whatever the runs cost.
CHUNK_MACS = 1.5e11
# The same seconds on an accelerator: a GPU does about a thousand times the work of two CPU cores,
# and a chunk of CPU size would hold a few runs of a 1B model (a few rows per forward, the GPU idle
# between them). There `chunk_runs` is what ends a chunk.
ACCELERATOR_CHUNK_MACS = 1.5e14


def _chunk_macs(model: Model) -> float:
    """The work at which a stage's chunk ends on the model's device (`CHUNK_MACS` on the CPU)."""
    return CHUNK_MACS if _model_device(model).type == "cpu" else ACCELERATOR_CHUNK_MACS


def _model_device(model: Model) -> torch.device:
    try:
        return next(model.parameters()).device
    except (StopIteration, AttributeError):
        return torch.device("cpu")


@dataclass
class _Landing:
    """A result on its way to the host: queued as a non-blocking copy into pinned memory right
    after the forwards that make it, so the host waits for it (`wait`) only when it must write it,
    by which time the GPU is busy with later forwards. On the CPU it is there already."""

    host: Tensor
    event: Any = None

    @classmethod
    def start(cls, t: Tensor) -> _Landing:
        t = t.detach()
        if t.device.type == "cpu":
            return cls(t)
        if t.device.type != "cuda":
            return cls(t.to("cpu"))
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(t.device))  # the copy's stream, on the model's GPU (cuda:1 too)
        return cls(host, event)

    def wait(self) -> Tensor:
        if self.event is not None:
            self.event.synchronize()
            self.event = None
        return self.host


def _layer_macs(model: Model, width: int) -> float:
    """Multiply-adds of one token through one block (projections, MLP, attention over `width`)."""
    cfg = model.cfg
    n_kv = getattr(cfg, "n_key_value_heads", None) or cfg.n_heads
    d_mlp = getattr(cfg, "d_mlp", None) or 4 * cfg.d_model
    mats = 3 if getattr(cfg, "gated_mlp", False) else 2
    attn = cfg.d_model * cfg.d_head * (2 * cfg.n_heads + 2 * n_kv) + 2 * cfg.n_heads * cfg.d_head * width
    return float(attn + mats * cfg.d_model * d_mlp)


# What a patched run pays per block beyond its own tokens, as a number of tokens' work: the shared
# prefix's keys and values copied into its row (twice, and expanded for grouped-query attention).
# Measured on CPU (SmolLM2-135M, 101 tokens): a one-token run costs about nine tokens of a forward.
ROW_OVERHEAD_TOKENS = 8


def run_cost(model: Model, width: int, start: int, layer: int) -> float:
    """Work of one patched run, in multiply-adds: columns `[start, width)` through blocks `layer..`
    (what `run_patched` recomputes with its shortcuts) plus the per-row overhead of each block."""
    return (width - start + ROW_OVERHEAD_TOKENS) * (model.cfg.n_layers - layer) * _layer_macs(model, width)


def forward_cost(model: Model, rows: int, width: int) -> float:
    """Multiply-adds of a plain forward of `rows` stories of `width` tokens."""
    cfg = model.cfg
    return rows * (width * cfg.n_layers * _layer_macs(model, width) + cfg.d_model * cfg.d_vocab)


@dataclass(frozen=True)
class Chunk:
    """Runs `[lo, hi)` of one group's runs: the unit a stage checkpoints, resumes and times."""

    group: int
    index: int
    lo: int
    hi: int
    cost: float

    @property
    def n_runs(self) -> int:
        return self.hi - self.lo


class Stage:
    """The patched runs of one stage of a sweep, laid out per group before anything runs, then run
    in chunks of at most `chunk_runs` runs (and about `CHUNK_MACS` of work), each checkpointed as
    it finishes.

    `runs[g]` are group g's runs; each group's base pass records `hooks`, which are the patch
    sources unless `sources(group)` gives them. After `run`, `values[g]` holds the metric of every
    run of group g (in `runs[g]` order) and `base[g]` the unpatched metric of each of its stories.
    A chunk is tied to its runs by a hash (`tag`), so a chunk on disk is reused only for the very
    same runs.
    """

    def __init__(
        self,
        name: str,
        model: Model,
        prepared: PreparedPairs,
        runs: Sequence[Sequence[Run]],
        *,
        hooks: Sequence[str] = (),
        sources: Callable[[Group], Mapping[str, Tensor]] | None = None,
        memory_mb: float = 1024.0,
        chunk_runs: int = DEFAULT_CHUNK_RUNS,
        reuse_prefix: bool = True,
    ):
        if chunk_runs < 1:
            raise TomlensError(f"chunk_runs={chunk_runs} must be at least 1", "pass a positive number of runs per chunk")
        self.name, self.model, self.prepared = name, model, prepared
        self.runs = [list(r) for r in runs]
        self.hooks, self.sources = sorted(set(hooks)), sources
        self.memory_mb, self.reuse_prefix = memory_mb, reuse_prefix
        self.chunks: list[Chunk] = []
        max_macs = _chunk_macs(model)
        for gi, (group, rs) in enumerate(zip(prepared.groups, self.runs, strict=True)):
            lo, cost, index = 0, 0.0, 0
            for i, r in enumerate(rs):
                cost += run_cost(model, group.width, r.start, r.layer)
                if i + 1 - lo >= chunk_runs or cost >= max_macs or i + 1 == len(rs):
                    self.chunks.append(Chunk(gi, index, lo, i + 1, cost))
                    lo, cost, index = i + 1, 0.0, index + 1
        self.values = [torch.full((len(rs),), float("nan"), dtype=torch.float32) for rs in self.runs]
        self.base: list[Tensor | None] = [None] * len(self.runs)
        self.done: set[tuple[int, int]] = set()
        self._bp: tuple[int, BasePass] | None = None
        # results on their way to the host, with what to do once they are there (oldest first)
        self._landing: list[tuple[_Landing, Callable[[Tensor], None]]] = []

    @property
    def n_runs(self) -> int:
        return sum(len(r) for r in self.runs)

    @property
    def n_done(self) -> int:
        return self.n_runs - sum(c.n_runs for c in self.pending())

    def pending(self) -> list[Chunk]:
        return [c for c in self.chunks if (c.group, c.index) not in self.done]

    def cost(self) -> float:
        """Work (`run_cost`) of the chunks not done."""
        return float(sum(c.cost for c in self.pending()))

    def forward_cost(self) -> float:
        """Multiply-adds of the base passes the chunks not done need (and of groups without one)."""
        groups = {c.group for c in self.pending()} | {g for g, b in enumerate(self.base) if b is None}
        return float(sum(forward_cost(self.model, 2 * self.prepared.groups[g].g, self.prepared.groups[g].width)
                         for g in groups))

    def _name(self, group: int, part: str) -> str:
        return f"{self.name}-g{group:04d}-{part}"

    def _base_name(self, group: int) -> str:
        ids = [self.prepared.pairs[i].id for i in self.prepared.groups[group].index]
        return self._name(group, f"base-{hashlib.sha256(repr(ids).encode()).hexdigest()[:12]}")

    def _tag(self, chunk: Chunk) -> str:
        runs = self.runs[chunk.group][chunk.lo : chunk.hi]
        blob = repr([(r.base, [p.key() for p in r.patches]) for r in runs]).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def load(self, checkpoints: Any) -> int:
        """Take every finished chunk and base metric of this stage from `checkpoints`
        (a `tomlens.patching.checkpoints.Checkpoints`); returns the number of runs done."""
        for gi, group in enumerate(self.prepared.groups):
            if self.base[gi] is None:
                got = checkpoints.load(self._base_name(gi), {"metric": (2 * group.g,)})
                if got is not None:
                    self.base[gi] = got["metric"]
        for c in self.pending():
            got = checkpoints.load(self._name(c.group, f"c{c.index:05d}-{self._tag(c)}"), {"values": (c.n_runs,)})
            if got is not None:
                self.values[c.group][c.lo : c.hi] = got["values"]
                self.done.add((c.group, c.index))
        return self.n_done

    def prepare(self, gi: int, checkpoints: Any = None) -> BasePass:
        """Group `gi`'s base pass (kept for the next chunks of that group; its metric is saved),
        finished: its metric is on the host when this returns (so a caller can time it)."""
        bp = self._prepare(gi, checkpoints)
        self._settle()
        return bp

    def _prepare(self, gi: int, checkpoints: Any = None) -> BasePass:
        """`prepare` without waiting: the base pass is queued and its metric lands later."""
        if self._bp is not None and self._bp[0] == gi:
            return self._bp[1]
        self._bp = None  # free the previous group's activations first
        bp = base_pass(self.model, self.prepared.groups[gi], self.hooks, reuse_prefix=self.reuse_prefix)
        self._bp = (gi, bp)
        if self.base[gi] is None:
            self._land(bp.metric.float(), lambda host: self._base_landed(gi, host, checkpoints))
        return bp

    def _base_landed(self, gi: int, metric: Tensor, checkpoints: Any) -> None:
        self.base[gi] = metric
        if checkpoints is not None:
            checkpoints.save(self._base_name(gi), {"metric": metric})

    def _chunk_landed(self, c: Chunk, out: Tensor, checkpoints: Any) -> None:
        self.values[c.group][c.lo : c.hi] = out
        if checkpoints is not None:
            checkpoints.save(self._name(c.group, f"c{c.index:05d}-{self._tag(c)}"), {"values": out})
        self.done.add((c.group, c.index))

    def _land(self, t: Tensor, then: Callable[[Tensor], None]) -> None:
        self._landing.append((_Landing.start(t), then))

    def _settle(self, keep: int = 0) -> None:
        """Wait for all but the `keep` newest results to reach the host, and write them."""
        while len(self._landing) > keep:
            landing, then = self._landing.pop(0)
            then(landing.wait())

    def run(self, *, checkpoints: Any = None, bar: Any = None, chunks: Sequence[Chunk] | None = None) -> None:
        """Run `chunks` (default: every chunk not done, and the base pass of every group), saving
        each to `checkpoints` as it finishes.

        The host never waits for the GPU between chunks: each chunk's metrics travel to the host
        while later chunks run. With `checkpoints` a chunk is written once the next one is queued
        (the host waits for that chunk alone, the GPU busy with the next); without, nothing is
        waited for until the end. Everything has landed when this returns, also on an error."""
        todo = [c for c in (self.chunks if chunks is None else chunks) if (c.group, c.index) not in self.done]
        try:
            for gi, group in enumerate(self.prepared.groups):
                mine = [c for c in todo if c.group == gi]
                if not mine and (chunks is not None or self.base[gi] is not None):
                    continue
                bp = sources = None  # the last group's base pass is freed before the next one is made
                bp = self._prepare(gi, checkpoints)
                sources = bp.sources if self.sources is None else self.sources(group)
                for c in mine:
                    out = run_patched(self.model, group, self.runs[gi][c.lo : c.hi], sources, bp,
                                      memory_mb=self.memory_mb, bar=bar, on_device=True)
                    self._land(out, functools.partial(self._chunk_landed, c, checkpoints=checkpoints))
                    if checkpoints is not None:  # write the previous chunk while this one runs
                        self._settle(keep=1)
        finally:
            self._settle()
        if chunks is None:
            self._bp = None
