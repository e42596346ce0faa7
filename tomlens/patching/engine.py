"""Exact activation patching over minimal pairs, batched: every patched run of a sweep is a batch row.

A sweep patches one site at a time (a head's output, the residual stream at a layer and position,
an attention or MLP output) from one run of a pair into the other and reads the logit difference.
Denoising patches clean into corrupted ("is this site sufficient to restore the belief answer?"),
noising patches corrupted into clean ("is it necessary?"). Both report the same scale: 0 is the
corrupted run, 1 the clean run.

Why it is fast and still exact:
- Pairs are processed in groups; each group's clean and corrupted runs are cached once (activations
  at the patched sites, keys/values, last-token logits).
- Every (cell, pair) patched run is a row; rows are chunked to a memory budget and run together.
- Clean and corrupted stories are token-identical up to the contrast span, so nothing can change
  before the first differing token; positions before it are never recomputed (their keys and values
  come from the base run) and cells patched only there are not run at all.
- Blocks below the first patched block are not run either: the base run's residual stream enters
  the patched block directly. A one-off check per model confirms both shortcuts reproduce a plain
  run; if they do not (an architecture they do not fit), every run is a plain full forward.

Sweeps are laid out before they run (`ExactSweep`: every run of every group, with the work each
costs), so a plan can count and time them (`tomlens.patching.plan`), and they run in `Stage`
chunks that are checkpointed as they finish (`tomlens.patching.checkpoints`): a stopped sweep
resumes from the chunks on disk, which are reused only for exactly the runs that made them.

Positions: "all" (every token), a selector from `tomlens.hooks.resolve_positions` ("final", a span
role, ...), or "each" (one cell per token). "each" indexes tokens right-aligned across pairs (pairs
of different lengths share their ending, the belief question); a pair without a token at an index
gives NaN there and is left out of that cell's statistics.
"""

from __future__ import annotations

import hashlib
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Literal, Mapping, Sequence

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float, Int
from torch import Tensor
from tqdm.auto import tqdm

from tomlens.errors import TomlensError
from tomlens.patching.metric import Normalize, gap_is_unstable, logit_diff, option_first_tokens, summarise
from tomlens.hooks.patch import PatchIndex, PrefixCache, forward_last, patch_hooks, record_hooks
from tomlens.oom import OOM_ERRORS, release_memory

Direction = Literal["denoise", "noise"]

KIND_ALIASES: dict[str, str] = {
    "heads": "head", "head": "head", "z": "head", "head_out": "head",
    "resid": "resid_pre", "resid_pre": "resid_pre", "resid_mid": "resid_mid",
    "resid_post": "resid_post",
    "attn": "attn_out", "attn_out": "attn_out", "mlp": "mlp_out", "mlp_out": "mlp_out",
}
# Patching the whole residual stream at every position restores the clean run outright, so the
# residual stream is swept per position; heads, attention and MLP outputs at all positions.
DEFAULT_POSITIONS: dict[str, tuple[str, ...]] = {
    "head": ("all",), "resid_pre": ("each",), "resid_mid": ("each",), "resid_post": ("each",),
    "attn_out": ("all",), "mlp_out": ("all",),
}


def canonical_kind(name: str) -> str:
    try:
        return KIND_ALIASES[name.strip()]
    except KeyError:
        raise TomlensError(
            f"unknown patching site {name!r}", f"use one of {sorted(set(KIND_ALIASES))}"
        ) from None


def hook_for(kind: str, layer: int) -> str:
    """TransformerLens hook name for a patching kind; a head's output is patched through its z."""
    from tomlens.hooks import Site, hook_name

    return hook_name(Site("z" if kind == "head" else kind, layer))


# --------------------------------------------------------------------------------------------
# Pairs, tokenised and grouped


@dataclass
class Group:
    """A batch of pairs: rows `0..g-1` are the clean stories, `g..2g-1` the corrupted ones."""

    index: list[int]
    batch: Any  # tomlens.models.tokens.EncodedBatch
    tokens: Int[Tensor, "story 2"]
    first_diff: Int[Tensor, "g"]  # padded column of the first token where clean != corrupted
    positions: dict[str, Int[Tensor, "g"]]  # selector -> padded column (same in clean and corrupted)

    @property
    def g(self) -> int:
        return len(self.index)

    @property
    def width(self) -> int:
        return int(self.batch.input_ids.shape[1])

    def pad(self, j: int) -> int:
        return int(self.batch.pad[j])


@dataclass
class PreparedPairs:
    """Pairs tokenised once for a model: groups, answer tokens, aligned position labels."""

    pairs: list[Any]
    groups: list[Group]
    lengths: list[int]
    n_aligned: int
    token_labels: list[str]
    selectors: tuple[str, ...]

    @property
    def ids(self) -> list[str]:
        return [p.id for p in self.pairs]


def _other(options: tuple[str, str], answer: str) -> str:
    return options[1] if options[0] == answer else options[0]


def prepare_pairs(
    model, pairs: Sequence[Any], *, selectors: Sequence[str] = (), batch_pairs: int = 8
) -> PreparedPairs:
    """Tokenise pairs for `model`, check they are aligned, resolve selector positions.

    Pairs are sorted by length into groups of `batch_pairs` so a group carries little padding.
    """
    from tomlens.models.tokens import encode

    pairs = list(pairs)
    if not pairs:
        raise TomlensError("no minimal pairs to patch", "generate pairs with `tomlens pairs` first")
    for p in pairs:
        if tuple(p.clean.options) != tuple(p.corrupted.options):
            raise TomlensError(
                f"pair {p.id!r}: clean and corrupted stories have different options "
                f"({list(p.clean.options)} vs {list(p.corrupted.options)})",
                "build pairs with tomlens.stimuli.pairs.make_pairs",
            )
    selectors = tuple(s for s in selectors if s not in ("all", "each"))
    options = [(p.clean.answer, _other(p.clean.options, p.clean.answer)) for p in pairs]
    tokens = option_first_tokens(model, [p.clean for p in pairs], options)
    tok = model.tokenizer
    lengths = [len(tok(p.clean.text, add_special_tokens=True)["input_ids"]) for p in pairs]
    order = sorted(range(len(pairs)), key=lambda i: (-lengths[i], i))
    groups: list[Group] = []
    for a in range(0, len(order), max(1, batch_pairs)):
        idx = order[a : a + batch_pairs]
        g = len(idx)
        batch = encode(model, [pairs[i].clean.text for i in idx] + [pairs[i].corrupted.text for i in idx])
        ids = batch.input_ids
        first = torch.empty(g, dtype=torch.long)
        for j, i in enumerate(idx):
            if batch.lengths[j] != batch.lengths[g + j]:
                raise TomlensError(
                    f"pair {pairs[i].id!r} is not aligned: the clean story has {batch.lengths[j]} "
                    f"tokens, the corrupted one {batch.lengths[g + j]}",
                    "align pairs for this model's tokenizer with tomlens.stimuli.pairs.align_pairs",
                )
            diff = (ids[j] != ids[g + j]).nonzero().flatten()
            first[j] = int(diff[0]) if len(diff) else ids.shape[1]
        positions: dict[str, Tensor] = {}
        if selectors:
            from tomlens.models.positions import resolve_positions

            stories = [pairs[i].clean for i in idx] + [pairs[i].corrupted for i in idx]
            pos = resolve_positions(stories, batch, list(selectors)).cpu().long()
            for s_i, sel in enumerate(selectors):
                c, r = pos[:g, s_i], pos[g:, s_i]
                bad = (c != r).nonzero().flatten().tolist()
                if bad:
                    j = bad[0]
                    raise TomlensError(
                        f"pair {pairs[idx[j]].id!r}: position {sel!r} is token {int(c[j])} in the "
                        f"clean story and {int(r[j])} in the corrupted one",
                        "patch at selectors outside the contrast span, or re-align the pairs",
                    )
                positions[sel] = c
        t = tokens[idx]
        groups.append(Group(idx, batch, torch.cat([t, t]), first, positions))
    lengths = [0] * len(pairs)
    for grp in groups:
        for j, i in enumerate(grp.index):
            lengths[i] = int(grp.batch.lengths[j])
    n_aligned = max(lengths)
    return PreparedPairs(pairs, groups, lengths, n_aligned, _token_labels(model, groups, n_aligned), selectors)


def _token_labels(model, groups: Sequence[Group], n_aligned: int) -> list[str]:
    """Axis labels for right-aligned positions, from the longest pair ("clean|corrupted" where
    the two stories differ)."""
    grp = groups[0]  # the first group holds the longest pairs
    ids = grp.batch.input_ids
    width = grp.width
    out = []
    for k in range(n_aligned):
        col = width - n_aligned + k
        if col < grp.pad(0):
            out.append(f"{k}")
            continue
        a = model.tokenizer.decode([int(ids[0, col])])
        b = model.tokenizer.decode([int(ids[grp.g, col])])
        out.append(f"{k}:{a}" if a == b else f"{k}:{a}|{b}")
    return out


# --------------------------------------------------------------------------------------------
# The engine: base runs cached once, then chunks of patched rows


@dataclass
class Run:
    """One patched forward: a base story and the cells overwritten in it.

    `patches` holds (hook name, layer, head or -1, padded columns, source row) tuples; the source
    row indexes the `sources` tensors given to `run_patched`.
    """

    base: int
    patches: list[tuple[str, int, int, list[int], int]]

    @property
    def start(self) -> int:
        return min(min(p[3]) for p in self.patches)

    @property
    def layer(self) -> int:
        return min(p[1] for p in self.patches)


@dataclass
class BasePass:
    """Last-token metric, activations at the patched sites, the residual stream entering every
    block and keys/values, for every story of a group."""

    metric: Float[Tensor, "story"]
    sources: dict[str, Tensor]
    prefix: PrefixCache | None
    resid: dict[int, Tensor] = field(default_factory=dict)


def base_pass(
    model, group: Group, hook_names: Iterable[str], *, reuse_prefix: bool = True, skip_layers: bool | None = None
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


def _row_bytes(model, width: int, new: int, first_layer: int = 0) -> int:
    """Rough memory of one patched row: its KV cache over the layers it runs, one layer's transient
    activations and attention scores for the recomputed columns, and the last-token logits."""
    cfg = model.cfg
    n_kv = getattr(cfg, "n_key_value_heads", None) or cfg.n_heads
    d_mlp = getattr(cfg, "d_mlp", None) or 4 * cfg.d_model
    elt = torch.finfo(getattr(cfg, "dtype", torch.float32) or torch.float32).bits // 8
    floats = (
        (cfg.n_layers - first_layer + 1) * 2 * n_kv * cfg.d_head * width
        + new * (12 * cfg.d_model + 4 * d_mlp)
        + 4 * cfg.n_heads * new * width
        + 2 * cfg.d_vocab
    )
    return int(1.5 * floats * elt)


def _entries(chunk: Sequence[Run], sources: Mapping[str, Tensor]) -> dict[str, PatchIndex]:
    acc: dict[str, tuple[list[int], list[int], list[int], list[int]]] = {}
    for r, run in enumerate(chunk):
        for hook, _, head, cols, src in run.patches:
            rows, cs, hs, ss = acc.setdefault(hook, ([], [], [], []))
            rows.extend([r] * len(cols))
            cs.extend(cols)
            hs.extend([head] * len(cols))
            ss.extend([src] * len(cols))
    out: dict[str, PatchIndex] = {}
    for hook, (rows, cs, hs, ss) in acc.items():
        src = sources[hook]
        r_t = torch.tensor(rows, dtype=torch.long)
        c_t = torch.tensor(cs, dtype=torch.long)
        s_t = torch.tensor(ss, dtype=torch.long, device=src.device)
        if hs[0] >= 0:
            h_t = torch.tensor(hs, dtype=torch.long)
            values = src[s_t, c_t.to(src.device), h_t.to(src.device)]
        else:
            h_t = None
            values = src[s_t, c_t.to(src.device)]
        out[hook] = PatchIndex(r_t, c_t, h_t, values)
    return out


# Whether shared-prefix / skipped-block runs reproduce a plain run on this model (checked once).
_SHORTCUTS_OK: "weakref.WeakKeyDictionary[Any, bool]" = weakref.WeakKeyDictionary()
# The memory budget (MB) a model's patched forwards shrank to after running out of memory.
_MEMORY_CAP: "weakref.WeakKeyDictionary[Any, float]" = weakref.WeakKeyDictionary()


def _shortcuts_ok(model, group: Group, bp: BasePass) -> bool:
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
    rows = torch.tensor([0])
    skip = (layer, bp.resid[layer][rows, start:]) if layer in bp.resid else None
    batch = group.batch
    try:
        with torch.inference_mode():
            last, _ = forward_last(
                model, batch.input_ids, batch.forward_kwargs(), rows=rows, prefix=bp.prefix,
                start=start, skip=skip,
            )
        got = float(logit_diff(last, group.tokens[rows])[0])
        want = float(bp.metric[0])
        low = next(model.parameters()).dtype in (torch.float16, torch.bfloat16)
        ok = abs(got - want) <= (5e-2 if low else 1e-3) * (1 + abs(want))
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


def run_patched(
    model,
    group: Group,
    runs: Sequence[Run],
    sources: Mapping[str, Tensor],
    base: BasePass,
    *,
    memory_mb: float = 1024,
    bar: Any = None,
) -> Float[Tensor, "run"]:
    """Metric of every patched run, many runs per forward.

    Runs are sorted by the first block they patch and their first patched column (latest first)
    and cut into chunks that fit `memory_mb`. A chunk runs only the blocks from its earliest
    patched block on (the base run's residual stream enters there) and only the columns from its
    earliest patched column on (earlier keys and values come from the base run). A forward that
    runs out of accelerator memory is retried with half its rows (rows do not interact: the same
    numbers), and later forwards on this model keep the smaller budget.
    """
    out = torch.empty(len(runs), dtype=torch.float32)
    if not runs:
        return out
    width = group.width
    shortcuts = _shortcuts_ok(model, group, base)
    prefix = base.prefix if shortcuts else None
    starts = [run.start if shortcuts else 0 for run in runs]
    firsts = [run.layer if shortcuts and run.layer in base.resid else 0 for run in runs]
    order = sorted(range(len(runs)), key=lambda i: (-firsts[i], -starts[i]))
    budget = min(memory_mb, _MEMORY_CAP.get(model, memory_mb)) * 2**20
    batch = group.batch
    fk = batch.forward_kwargs()
    vocab, answer = torch.unique(group.tokens, return_inverse=True)  # the metric's tokens only
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
        rows = torch.tensor([run.base for run in chunk], dtype=torch.long)
        offset = start if prefix is not None else 0
        try:
            skip = (first, base.resid[first].index_select(0, rows.to(base.resid[first].device))[:, offset:]) if first > 0 else None
            hooks = patch_hooks(_entries(chunk, sources), offset=offset)
            with torch.inference_mode():
                last, _ = forward_last(
                    model, batch.input_ids, fk, hooks, rows=rows, prefix=prefix, start=start, skip=skip,
                    vocab=vocab,
                )
                values = logit_diff(last, answer[rows])
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
        out[torch.tensor(chunk_idx)] = values.cpu()
        if bar is not None:
            bar.update(len(chunk))
        a = b
    return out


# --------------------------------------------------------------------------------------------
# Stages: a sweep's patched runs laid out before they run, and run in checkpointed chunks

DEFAULT_CHUNK_RUNS = 1024
# A chunk also ends at this much work (multiply-adds): seconds on two CPU cores, so a stopped run
# loses seconds and the timed first chunk is short, whatever the runs cost.
CHUNK_MACS = 1.5e11


def layer_macs(model, width: int) -> float:
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


def run_cost(model, width: int, start: int, layer: int) -> float:
    """Work of one patched run, in multiply-adds: columns `[start, width)` through blocks `layer..`
    (what `run_patched` recomputes with its shortcuts) plus the per-row overhead of each block."""
    return (width - start + ROW_OVERHEAD_TOKENS) * (model.cfg.n_layers - layer) * layer_macs(model, width)


def forward_cost(model, rows: int, width: int) -> float:
    """Multiply-adds of a plain forward of `rows` stories of `width` tokens."""
    cfg = model.cfg
    return rows * (width * cfg.n_layers * layer_macs(model, width) + cfg.d_model * cfg.d_vocab)


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
        model,
        prepared: PreparedPairs,
        runs: Sequence[Sequence[Run]],
        *,
        hooks: Sequence[str] = (),
        sources: Callable[[Group], Mapping[str, Tensor]] | None = None,
        memory_mb: float = 1024,
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
        for gi, (group, rs) in enumerate(zip(prepared.groups, self.runs)):
            lo, cost, index = 0, 0.0, 0
            for i, r in enumerate(rs):
                cost += run_cost(model, group.width, r.start, r.layer)
                if i + 1 - lo >= chunk_runs or cost >= CHUNK_MACS or i + 1 == len(rs):
                    self.chunks.append(Chunk(gi, index, lo, i + 1, cost))
                    lo, cost, index = i + 1, 0.0, index + 1
        self.values = [torch.full((len(rs),), float("nan"), dtype=torch.float32) for rs in self.runs]
        self.base: list[Tensor | None] = [None] * len(self.runs)
        self.done: set[tuple[int, int]] = set()
        self._bp: tuple[int, BasePass] | None = None

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
        return sum(c.cost for c in self.pending())

    def forward_cost(self) -> float:
        """Multiply-adds of the base passes the chunks not done need (and of groups without one)."""
        groups = {c.group for c in self.pending()} | {g for g, b in enumerate(self.base) if b is None}
        return sum(forward_cost(self.model, 2 * self.prepared.groups[g].g, self.prepared.groups[g].width)
                   for g in groups)

    def _name(self, group: int, part: str) -> str:
        return f"{self.name}-g{group:04d}-{part}"

    def _base_name(self, group: int) -> str:
        ids = [self.prepared.pairs[i].id for i in self.prepared.groups[group].index]
        return self._name(group, f"base-{hashlib.sha256(repr(ids).encode()).hexdigest()[:12]}")

    def _tag(self, chunk: Chunk) -> str:
        runs = self.runs[chunk.group][chunk.lo : chunk.hi]
        blob = repr([(r.base, r.patches) for r in runs]).encode()
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
        """Group `gi`'s base pass (kept for the next chunks of that group; its metric is saved)."""
        if self._bp is not None and self._bp[0] == gi:
            return self._bp[1]
        self._bp = None  # free the previous group's activations first
        bp = base_pass(self.model, self.prepared.groups[gi], self.hooks, reuse_prefix=self.reuse_prefix)
        self._bp = (gi, bp)
        if self.base[gi] is None:
            self.base[gi] = bp.metric.float().cpu()
            if checkpoints is not None:
                checkpoints.save(self._base_name(gi), {"metric": self.base[gi]})
        return bp

    def run(self, *, checkpoints: Any = None, bar: Any = None, chunks: Sequence[Chunk] | None = None) -> None:
        """Run `chunks` (default: every chunk not done, and the base pass of every group), saving
        each to `checkpoints` as it finishes."""
        todo = [c for c in (self.chunks if chunks is None else chunks) if (c.group, c.index) not in self.done]
        for gi, group in enumerate(self.prepared.groups):
            mine = [c for c in todo if c.group == gi]
            if not mine and (chunks is not None or self.base[gi] is not None):
                continue
            bp = self.prepare(gi, checkpoints)
            sources = bp.sources if self.sources is None else self.sources(group)
            for c in mine:
                out = run_patched(self.model, group, self.runs[gi][c.lo : c.hi], sources, bp,
                                  memory_mb=self.memory_mb, bar=bar)
                self.values[gi][c.lo : c.hi] = out
                if checkpoints is not None:
                    checkpoints.save(self._name(gi, f"c{c.index:05d}-{self._tag(c)}"), {"values": out})
                self.done.add((gi, c.index))
        if chunks is None:
            self._bp = None


# --------------------------------------------------------------------------------------------
# Sweeps


@dataclass(frozen=True)
class Cell:
    """One patched site: kind ("head", "resid_pre", "attn_out", "mlp_out", ...), layer, head (-1
    when not a head), position ("all", a selector or "each") and aligned token index (-1 unless
    position is "each")."""

    kind: str
    layer: int
    head: int
    position: str
    pos: int


def plan_cells(
    model,
    sites: Sequence[str] | Mapping[str, Sequence[str]],
    positions: Sequence[str] = (),
    *,
    n_aligned: int,
    layers: Sequence[int] | None = None,
) -> list[Cell]:
    """Cells of a sweep. `sites` lists kinds (each with its default positions) or maps kinds to
    their own position lists; `positions` are added to every kind."""
    if isinstance(sites, str):
        sites = [s for s in sites.split(",") if s.strip()]
    if isinstance(sites, Mapping):
        spec = {canonical_kind(k): tuple(dict.fromkeys(tuple(v) + tuple(positions))) for k, v in sites.items()}
    else:
        spec = {}
        for k in sites:
            kind = canonical_kind(k)
            spec[kind] = tuple(dict.fromkeys(DEFAULT_POSITIONS[kind] + tuple(positions)))
    n_layers = model.cfg.n_layers
    layers = list(range(n_layers)) if layers is None else list(layers)
    bad = [l for l in layers if not 0 <= l < n_layers]
    if bad:
        raise TomlensError(f"layers {bad} do not exist (the model has {n_layers})", "pick layers in range")
    from tomlens.hooks import Site, check_sites

    check_sites(model, [Site("z" if kind == "head" else kind, l) for kind in spec for l in layers[:1]])
    cells: list[Cell] = []
    for kind, poss in spec.items():
        heads = range(model.cfg.n_heads) if kind == "head" else [-1]
        for position in poss:
            ks = range(n_aligned) if position == "each" else [-1]
            for layer in layers:
                for k in ks:
                    for h in heads:
                        cells.append(Cell(kind, layer, h, position, k))
    return cells


def cell_columns(cell: Cell, group: Group, j: int, n_aligned: int) -> list[int] | None:
    """Padded columns the cell patches in pair `j` of a group, dropping columns before the first
    differing token (identical in both runs). None when the pair has no token at that position."""
    width, fd = group.width, int(group.first_diff[j])
    if cell.position == "all":
        return list(range(fd, width))
    if cell.position == "each":
        col = width - n_aligned + cell.pos
        if col < group.pad(j):
            return None
        return [col] if col >= fd else []
    col = int(group.positions[cell.position][j])
    return [col] if col >= fd else []


def _roles(direction: Direction, g: int, j: int) -> tuple[int, int]:
    """(base row, source row) of pair j: denoising runs the corrupted story with clean values."""
    if direction == "denoise":
        return g + j, j
    if direction == "noise":
        return j, g + j
    raise TomlensError(f"unknown patching direction {direction!r}", "use 'denoise' or 'noise'")


@dataclass
class PatchingResult:
    """Raw patched metric for every cell and pair, with the clean and corrupted baselines.

    `values[c, p]` is the logit difference of pair p with cell c patched (for attribution: the
    first-order estimate of it); NaN where the pair has no token at that position.
    """

    method: str
    direction: str
    cells: list[Cell]
    values: Float[Tensor, "cell pair"]
    clean: Float[Tensor, "pair"]
    corrupted: Float[Tensor, "pair"]
    pair_ids: list[str]
    token_labels: list[str]
    normalize: Normalize = "pooled"
    seed: int = 0  # of the bootstrap
    _summaries: dict[tuple[int, int], pd.DataFrame] = field(default_factory=dict, repr=False)

    def cell_frame(self) -> pd.DataFrame:
        return pd.DataFrame(
            {
                "kind": [c.kind for c in self.cells],
                "layer": [c.layer for c in self.cells],
                "head": [c.head for c in self.cells],
                "position": [c.position for c in self.cells],
                "pos": [c.pos for c in self.cells],
            }
        )

    def summary(self, *, n_boot: int = 1000, seed: int | None = None) -> pd.DataFrame:
        """One row per cell: normalised effect (mean over pairs), SE, bootstrap 95% interval,
        number of pairs and the mean raw logit difference after the patch."""
        seed = self.seed if seed is None else seed
        if (n_boot, seed) in self._summaries:
            return self._summaries[(n_boot, seed)]
        s = summarise(self.values, self.clean, self.corrupted, normalize=self.normalize, n_boot=n_boot, seed=seed)
        df = self.cell_frame()
        df.insert(0, "direction", self.direction)
        df.insert(0, "method", self.method)
        df["token"] = [self.token_labels[c.pos] if c.pos >= 0 else "" for c in self.cells]
        df["effect"] = s.mean
        df["se"] = s.se
        df["ci_low"] = s.ci_low
        df["ci_high"] = s.ci_high
        df["n_pairs"] = s.n
        with np.errstate(all="ignore"):
            df["logit_diff"] = np.nanmean(self.values.double().numpy(), axis=1) if len(self.cells) else []
        self._summaries[(n_boot, seed)] = df
        return df

    def per_pair(self) -> pd.DataFrame:
        """Long table: one row per (cell, pair) with the raw and the normalised value."""
        from tomlens.patching.metric import normalise

        norm = normalise(self.values, self.clean, self.corrupted, self.normalize).numpy()
        n_cell, n_pair = self.values.shape
        df = self.cell_frame().loc[np.repeat(np.arange(n_cell), n_pair)].reset_index(drop=True)
        df.insert(0, "cell", np.repeat(np.arange(n_cell), n_pair))
        df["pair_id"] = np.tile(np.array(self.pair_ids, dtype=object), n_cell)
        df["logit_diff"] = self.values.double().numpy().reshape(-1)
        df["effect"] = norm.reshape(-1)
        return df

    def baselines(self) -> dict[str, float]:
        """Mean clean and corrupted metric, and their gap (the normaliser) with its standard error:
        when the gap is within about two standard errors of 0, normalised effects are unstable."""
        gap = (self.clean - self.corrupted).double()
        n = len(self.pair_ids)
        se = float(gap.std() / n**0.5) if n > 1 else float("nan")
        return {
            "clean_logit_diff": float(self.clean.double().mean()),
            "corrupted_logit_diff": float(self.corrupted.double().mean()),
            "gap": float(gap.mean()),
            "gap_se": se,
            "gap_unstable": gap_is_unstable(gap),
            "n_pairs": n,
        }

    def select(self, kind: str, position: str) -> pd.DataFrame:
        df = self.summary()
        return df[(df.kind == canonical_kind(kind)) & (df.position == position)]

    def grid(self, kind: str, position: str, column: str = "effect") -> np.ndarray:
        """`[layer, head]` for heads, `[layer, pos]` for position "each", `[layer, 1]` otherwise."""
        df = self.select(kind, position)
        if df.empty:
            raise TomlensError(f"the result has no cells of kind {kind!r} at position {position!r}")
        col = "head" if canonical_kind(kind) == "head" and position != "each" else "pos"
        if canonical_kind(kind) == "head" and position == "each":
            raise TomlensError("a per-position head sweep has three axes; use select() instead")
        layers = sorted(df.layer.unique())
        keys = sorted(df[col].unique())
        out = np.full((len(layers), len(keys)), np.nan)
        li = {l: i for i, l in enumerate(layers)}
        ki = {k: i for i, k in enumerate(keys)}
        for l, k, v in zip(df.layer, df[col], df[column]):
            out[li[l], ki[k]] = v
        return out


def _needed_hooks(cells: Sequence[Cell]) -> list[str]:
    return sorted({hook_for(c.kind, c.layer) for c in cells})


class ExactSweep:
    """An exact patching sweep laid out before it runs: one run per (cell, pair), except cells
    patched only before the pair's first differing token (nothing changes: the base run's own
    value) and positions the pair lacks (NaN). `stage` runs the rest; `result` assembles them."""

    def __init__(
        self,
        model,
        prepared: PreparedPairs,
        cells: Sequence[Cell],
        direction: Direction = "denoise",
        *,
        memory_mb: float = 1024,
        reuse_prefix: bool = True,
        chunk_runs: int = DEFAULT_CHUNK_RUNS,
    ):
        _check_selectors(cells, prepared)
        self.prepared, self.cells, self.direction = prepared, list(cells), direction
        runs: list[list[Run]] = []
        self.targets: list[list[tuple[int, int]]] = []
        self.fills: list[list[tuple[int, int, int]]] = []  # (cell, pair, base row): no run needed
        hooks = {c: hook_for(c.kind, c.layer) for c in set(self.cells)}
        for group in prepared.groups:
            g = group.g
            rs: list[Run] = []
            ts: list[tuple[int, int]] = []
            fs: list[tuple[int, int, int]] = []
            for c_i, cell in enumerate(self.cells):
                for j, p_i in enumerate(group.index):
                    base, src = _roles(direction, g, j)
                    cols = cell_columns(cell, group, j, prepared.n_aligned)
                    if cols is None:
                        continue
                    if not cols:
                        fs.append((c_i, p_i, base))
                        continue
                    rs.append(Run(base, [(hooks[cell], cell.layer, cell.head, cols, src)]))
                    ts.append((c_i, p_i))
            runs.append(rs)
            self.targets.append(ts)
            self.fills.append(fs)
        self.stage = Stage(f"exact-{direction}", model, prepared, runs, hooks=_needed_hooks(self.cells),
                           memory_mb=memory_mb, chunk_runs=chunk_runs, reuse_prefix=reuse_prefix)

    def load(self, checkpoints: Any) -> int:
        """Take finished chunks from `checkpoints`; returns the runs now done."""
        return self.stage.load(checkpoints)

    def run(self, *, checkpoints: Any = None, progress: bool = True) -> None:
        stage = self.stage
        if checkpoints is not None:
            stage.load(checkpoints)
        with tqdm(total=stage.n_runs, desc=f"patching ({self.direction})", unit="run", disable=not progress) as bar:
            bar.update(stage.n_done)
            stage.run(checkpoints=checkpoints, bar=bar)

    def result(self, normalize: Normalize = "pooled") -> PatchingResult:
        n_pair = len(self.prepared.pairs)
        values = torch.full((len(self.cells), n_pair), float("nan"), dtype=torch.float64)
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
        return PatchingResult(
            "exact", self.direction, self.cells, values, clean, corrupted, self.prepared.ids,
            self.prepared.token_labels, normalize,
        )


def exact_patching(
    model,
    pairs: Sequence[Any] | PreparedPairs,
    *,
    sites: Sequence[str] | Mapping[str, Sequence[str]] = ("heads",),
    positions: Sequence[str] = (),
    direction: Direction = "denoise",
    layers: Sequence[int] | None = None,
    normalize: Normalize = "pooled",
    batch_pairs: int = 8,
    memory_mb: float = 1024,
    reuse_prefix: bool = True,
    progress: bool = True,
    cells: Sequence[Cell] | None = None,
    checkpoints: Any = None,
    chunk_runs: int = DEFAULT_CHUNK_RUNS,
) -> PatchingResult:
    """Patch every cell of the requested sites, one batched forward per chunk of (cell, pair) runs.

    `sites`: kinds ("heads", "resid", "attn", "mlp", "resid_mid", ...) with their default positions
    (heads/attn/mlp at "all", resid at "each") plus `positions`, or a mapping kind -> positions.
    `cells`: an explicit list of cells to patch instead (e.g. the candidates a search verifies);
    `sites`, `positions` and `layers` are then ignored.
    `checkpoints` (a `tomlens.patching.checkpoints.Checkpoints`): finished chunks of
    `chunk_runs` runs are saved there and taken from there, so a stopped sweep resumes.
    """
    explicit = list(cells) if cells is not None else None
    extra = tuple(c.position for c in explicit or ())
    prepared = pairs if isinstance(pairs, PreparedPairs) else prepare_pairs(
        model, pairs, selectors=_selectors(sites, (*positions, *extra)), batch_pairs=batch_pairs
    )
    cells = explicit if explicit is not None else plan_cells(
        model, sites, positions, n_aligned=prepared.n_aligned, layers=layers
    )
    sweep = ExactSweep(model, prepared, cells, direction, memory_mb=memory_mb, reuse_prefix=reuse_prefix,
                       chunk_runs=chunk_runs)
    sweep.run(checkpoints=checkpoints, progress=progress)
    return sweep.result(normalize)


def _selectors(sites: Any, positions: Sequence[str]) -> tuple[str, ...]:
    found = list(positions)
    if isinstance(sites, Mapping):
        for v in sites.values():
            found.extend(v)
    return tuple(dict.fromkeys(s for s in found if s not in ("all", "each")))


def _check_selectors(cells: Sequence[Cell], prepared: PreparedPairs) -> None:
    missing = {c.position for c in cells if c.position not in ("all", "each")} - set(prepared.selectors)
    if missing:
        raise TomlensError(
            f"positions {sorted(missing)} were not resolved when the pairs were prepared",
            "pass them as `selectors` to prepare_pairs",
        )
