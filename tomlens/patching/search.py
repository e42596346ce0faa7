"""Attribution-guided search (AtP*, Kramár et al. 2024): estimate every cell from gradients, patch
exactly only the cells the estimates cannot rule out, and bound what was left unpatched.

Exact patching costs one patched run per cell and pair. Attribution patching (AtP) estimates every
cell from two forwards and one backward, but fails in two known ways, which AtP* repairs:

- *Attention saturation.* Moving a head's query or key acts through its softmax; where the softmax
  is saturated its gradient is near zero and AtP reports nothing. The query/key fix recomputes the
  head's pattern exactly with the patched queries (row by row) or keys (column by column, in closed
  form) and linearises only after it: `sum((pattern_patched - pattern) * d metric / d pattern)`.
  It applies to the `q` and `k` sites. A head's output (`heads`) needs no fix: the value patched in
  is the source run's exact output, so its estimate already linearises only after the head.
- *Cancellation.* A cell's direct effect and its effect through later layers can cancel in the
  gradient while the real patch does not. GradDrop repeats the backward pass once per layer l with
  the gradient through layer l's residual contribution (attention and MLP outputs) dropped; the
  paper scores a cell by `sum_l |estimate_l| / (L - 1)` (the `graddrop` column). Dropping layer l
  changes only gradients below it, so each repeat is one backward from layer l's input down (about
  L/2 full backwards in all; `graddrop_blocks` drops contiguous blocks of layers for fewer).

Verification (the rule). Importance is the magnitude of a cell's normalised effect (`|effect|`
denoising, `|1 - effect|` noising), compared within each (kind, position). A cell's *bound* is the
most any of its estimates gives, `max(|AtP*|, max_l |estimate_l|)` (the spread of the GradDrop
estimates is where the linearisation is fragile; a spread over pairs would not be: the exact effect
averages over the same pairs). The top-k cells by estimated importance are patched exactly, then
every cell whose bound reaches the cut: the k-th largest verified importance (it could still enter
the top k), or `threshold` if that is lower (it could still matter). Verifying raises the cut, so
this repeats until no unverified cell reaches it or `budget` cells have been patched. GradDrop thus
widens what must be verified where a dropped layer reveals a larger effect; it does not reorder the
candidates (its score, a mean over drops, ranks worse than the plain estimate where no layer
cancels).

False negatives (the bound). The rule can be wrong where the estimates are, so `fn_samples` cells
per (kind, position) are drawn at random from those the rule left out and patched exactly. If x of
n sampled cells out of N left out have importance at or above the threshold (the given one, else
the k-th verified), the hypergeometric distribution gives K, the most such cells N can hold at the
given confidence: `fn_rate_upper = K / N` bounds the chance that a cell the search did not verify
by the rule is a false negative. Sampled cells count as verified; a sampled hit is a false negative
found, and shows in the table.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import torch
from jaxtyping import Bool, Float
from torch import Tensor
from tqdm.auto import tqdm

from tomlens.devices import to_device
from tomlens.errors import TomlensError
from tomlens.hooks.attention import (
    AttentionHooks,
    attention_hooks,
    masked,
    n_kv_heads,
    qk_scores,
    score_error,
    score_scale,
    scores_from,
    unsupported,
)
from tomlens.hooks.patch import PrefixCache, forward_last, record_hooks
from tomlens.models.protocol import Model
from tomlens.patching.attribution import (
    CellIndex,
    GroupRows,
    column_scores,
    group_rows,
    source_run,
    to_host_by_pair,
)
from tomlens.patching.cells import (
    Cell,
    canonical_kind,
    cell_columns,
    check_selectors,
    hook_for,
    layer_list,
    plan_cells,
    selectors_in,
)
from tomlens.patching.engine import BasePass, Patch, Run, run_patched
from tomlens.patching.metric import Normalise, logit_diff, normalised_effects
from tomlens.patching.pairs import Direction, Group, PreparedPairs, as_prepared, roles
from tomlens.patching.result import PatchingResult

# Queries (one cell per query head) and keys (one per key/value head), patched where the scores read them.
QK_KINDS: dict[str, str] = {"q": "q", "query": "q", "queries": "q", "k": "k", "key": "k", "keys": "k"}
# Activations that reach the residual stream only through their own layer's outputs: dropping that
# layer's gradient leaves them none.
_COMPONENTS = frozenset({"head", "q", "k", "pattern", "attn_out", "mlp_out"})


def _kind(name: str) -> str:
    name = name.strip()
    return QK_KINDS[name] if name in QK_KINDS else canonical_kind(name)


def plan_search(
    model: Model,
    sites: Sequence[str] | Mapping[str, Sequence[str]],
    positions: Sequence[str] = (),
    *,
    n_aligned: int,
    layers: Sequence[int] | None = None,
) -> list[Cell]:
    """Cells of a search: the kinds `plan_cells` knows, plus `q` (per query head) and `k` (per
    key/value head) at "all" positions by default (and `positions`)."""
    if isinstance(sites, str):
        sites = [s for s in sites.split(",") if s.strip()]
    spec: dict[str, Sequence[str] | None] = dict(sites) if isinstance(sites, Mapping) else dict.fromkeys(sites)
    if not spec:
        raise TomlensError("no sites to search", "pass e.g. sites=('heads',)")
    # the kinds plan_cells knows, in the form they were given (kinds with their positions, or kinds)
    plain: Sequence[str] | Mapping[str, Sequence[str]]
    if isinstance(sites, Mapping):
        plain = {k: v for k, v in sites.items() if _kind(k) not in ("q", "k")}
    else:
        plain = [k for k in spec if _kind(k) not in ("q", "k")]
    cells: list[Cell] = []
    if plain:
        cells = plan_cells(model, plain, positions, n_aligned=n_aligned, layers=layers)
    chosen = layer_list(model, layers)
    for name, poss in spec.items():
        kind = _kind(name)
        if kind not in ("q", "k"):
            continue
        poss = tuple(dict.fromkeys((tuple(poss) if poss is not None else ("all",)) + tuple(positions)))
        heads = range(model.cfg.n_heads if kind == "q" else n_kv_heads(model))
        for position in poss:
            for layer in chosen:
                for k in range(n_aligned) if position == "each" else [-1]:
                    cells.extend(Cell(kind, layer, h, position, k) for h in heads)
    return list(dict.fromkeys(cells))


def cell_hook(model: Model, cell: Cell) -> str:
    """The hook a cell patches (queries and keys before any rotary embedding)."""
    if cell.kind in ("q", "k"):
        hooks = attention_hooks(model, cell.layer)
        return hooks.q if cell.kind == "q" else hooks.k
    return hook_for(cell.kind, cell.layer)


# --------------------------------------------------------------------------------------------
# Estimates: AtP with the query/key fix, and GradDrop


@dataclass
class Estimates:
    """AtP* estimates of every cell, as changes of the metric its patch would cause.

    `atp[c, p]`: the estimate for pair p (query/key-fixed for `q` and `k` cells); `dropped[c, b, p]`
    the same with the gradient through the residual contributions of layer block b
    (`blocks[b] = (first, end)`) dropped, None without GradDrop; `base[p]` the metric of the run
    patched into (corrupted when denoising).
    """

    direction: str
    cells: list[Cell]
    atp: Float[Tensor, "cell pair"]
    dropped: Float[Tensor, "cell block pair"] | None
    blocks: list[tuple[int, int]]
    base: Float[Tensor, " pair"]
    clean: Float[Tensor, " pair"]
    corrupted: Float[Tensor, " pair"]
    pair_ids: list[str]
    token_labels: list[str]
    qk_fix: bool

    def result(self, normalise: Normalise = "pooled") -> PatchingResult:
        """The estimates as a patching result (values = base metric + estimate), like attribution's."""
        return PatchingResult(
            "attribution*", self.direction, self.cells, self.base[None, :] + self.atp, self.clean,
            self.corrupted, self.pair_ids, self.token_labels, normalise,
        )


def graddrop_blocks(n_layers: int, n_blocks: int | None = None) -> list[tuple[int, int]]:
    """Contiguous layer blocks `(first, end)` whose residual contributions GradDrop drops together:
    one per layer by default (the paper's), fewer for fewer backward passes."""
    n = n_layers if n_blocks is None else n_blocks
    if not 1 <= n <= n_layers:
        raise TomlensError(f"{n} GradDrop blocks for {n_layers} layers", f"pass between 1 and {n_layers}")
    edges = np.linspace(0, n_layers, n + 1).round().astype(int)
    return [(int(a), int(b)) for a, b in zip(edges[:-1], edges[1:], strict=True)]


@dataclass
class _QKLayer:
    """Pattern changes of one layer's query and key patches (`[g, head, new q, k]`), computed
    before the backward pass, so any gradient of the pattern (full or GradDrop) turns them into
    estimates: query rows `sum_t dq * G`, key columns `sum_s c1 * sum_t(A * G) + c2 * G` (one key
    column changed, the softmax renormalised in closed form), all keys `sum dk_all * G`. `check`:
    how far the rebuilt scores are from the model's (`score_error`, a device scalar), read on the
    host with the estimates."""

    hooks: AttentionHooks
    rep: int
    pattern: Tensor
    check: Tensor
    dq: Tensor | None = None
    dk_all: Tensor | None = None
    c1: Tensor | None = None
    c2: Tensor | None = None

    def scores(self, grad: Tensor | None, start: int, keep: Tensor) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        g, n_head, _, width = self.pattern.shape
        G = torch.zeros_like(self.pattern) if grad is None else grad.detach().double()
        scores: dict[str, Tensor] = {}
        totals: dict[str, Tensor] = {}
        device = self.pattern.device
        if self.dq is not None:
            rows = torch.zeros((g, width, n_head), dtype=torch.float64, device=device)
            rows[:, start:] = (self.dq * G).sum(-1).transpose(1, 2)
            scores[self.hooks.q] = rows * keep[..., None]
        if self.c1 is not None and self.c2 is not None:  # set together, by the "k_column" fix
            p = (self.pattern * G).sum(-1, keepdim=True)
            cols = (self.c1 * p + self.c2 * G).sum(2)  # [g, head, key]
            cols = cols.view(g, n_head // self.rep, self.rep, width).sum(2).transpose(1, 2)
            scores[self.hooks.k] = cols * keep[..., None]
        if self.dk_all is not None:
            total = (self.dk_all * G).sum((-1, -2)).view(g, n_head // self.rep, self.rep).sum(-1)
            totals[self.hooks.k] = total
            scores.setdefault(self.hooks.k, torch.zeros((g, width, n_head // self.rep), dtype=torch.float64,
                                                        device=device))
        return scores, totals


def _raise_on_bad_scores(errors: Mapping[int, Sequence[float]]) -> None:
    """Fail, as `check_scores` would have, at the first layer whose rebuilt scores are off:
    `errors[layer]` holds, per pair, `score_error` of its group's scores (`<= 1`: within float32
    rounding), read on the host with the estimates instead of once per layer and group."""
    for layer, errs in sorted(errors.items()):
        if not all(e <= 1 for e in errs):
            worst = max(errs, key=lambda e: float("inf") if e != e else e)
            raise unsupported(layer, f"scale * q.k differs from the model's scores by {worst:.3g} times the float32 "
                              "rounding tolerance (this architecture scores attention in a way tomlens does not see: "
                              "soft-capping, ALiBi, ...)")


def _qk_layer(
    model: Model, layer: int, hooks: AttentionHooks, needs: set[str], src: dict[str, Tensor],
    base: dict[str, Tensor], start: int, differs: Bool[Tensor, "g pos"],
) -> _QKLayer:
    """The exact pattern change of the layer's query patches (`needs` "q"), key patches at every
    differing column at once ("k_all") and key patches one column at a time ("k_column"), float64.
    `differs`: each pair's columns from its first differing token on, on the device."""
    for name, store in ((hooks.q_rot, src), (hooks.k_rot, src), (hooks.q_rot, base), (hooks.k_rot, base),
                        (hooks.scores, base)):
        if name not in store:
            raise unsupported(layer, f"the hook {name} did not fire (no hook sees this model's queries and keys "
                              "as its scores do)")
    S = base[hooks.scores].detach().double()
    q_base = base[hooks.q_rot].detach().double()
    k_src = src[hooks.k_rot].double()
    k_base = torch.cat([k_src[:, :start], base[hooks.k_rot].detach().double()], 1)
    scale = score_scale(model, layer)
    check = score_error(scores_from(q_base, k_base, scale, S), S)
    A = torch.softmax(S, -1)
    out = _QKLayer(hooks, q_base.shape[2] // k_base.shape[2], A, check)
    if "q" in needs:
        out.dq = torch.softmax(scores_from(src[hooks.q_rot][:, start:].double(), k_base, scale, S), -1) - A
    if "k_all" in needs:
        later = differs[..., None, None]
        out.dk_all = torch.softmax(scores_from(q_base, torch.where(later, k_src, k_base), scale, S), -1) - A
    if "k_column" in needs:
        moved = torch.where(masked(S), S, S + qk_scores(q_base, k_src - k_base, scale))
        lse = torch.logsumexp(S, -1, keepdim=True)
        lse_moved = torch.logaddexp(lse + torch.log1p(-A.clamp(max=1.0)), moved)  # one column moved
        ratio = torch.exp(lse - lse_moved)  # how every other column of the row is rescaled
        out.c1 = ratio - 1
        out.c2 = (torch.exp(moved - lse_moved) - A) - out.c1 * A
    return out


def _base_group(group: Group, rows: GroupRows) -> Group:
    """The group's stories that are patched into (one per pair, in pair order), as a group of their
    own: device tensors picked on the device, host lists on the host."""
    batch = group.batch
    n = len(batch)
    picked = rows.base_host
    changes: dict[str, Any] = {}
    for f in dataclasses.fields(batch):
        v = getattr(batch, f.name)
        if isinstance(v, Tensor) and v.ndim >= 1 and v.shape[0] == n:
            changes[f.name] = v.index_select(0, to_device(rows.base, v.device))
        elif isinstance(v, (list, tuple)) and len(v) == n:
            changes[f.name] = type(v)(v[r] for r in picked)
    # Group.__post_init__ fills the column lists; the answer ids stay unread (None) until the metric
    # first needs them, and the new group then reads its own from its tokens
    assert group.first_diff_cols is not None and group.position_cols is not None
    answer_ids = None if group.answer_ids is None else [group.answer_ids[r] for r in picked]
    return Group(group.index, dataclasses.replace(batch, **changes), rows.base_tokens, group.first_diff,
                 group.positions, first_diff_cols=list(group.first_diff_cols),
                 position_cols=dict(group.position_cols), answer_ids=answer_ids)


@dataclass
class _Group:
    """One group's estimates, and what exact patching of its cells reuses: the stories patched into
    as a group of their own, with their metric, keys and values, residual stream per block, and the
    source activations (`BasePass` with base rows only; a run's source row is its pair). Tensors
    stay on the model's device until `_estimate` moves every group's to the host in one copy."""

    atp: Tensor
    dropped: Tensor | None
    base_metric: Tensor
    src_metric: Tensor
    checks: dict[int, Tensor]  # layer -> `score_error` of the query/key fix
    verify: tuple[Group, BasePass] | None


@dataclass(frozen=True)
class _HookLayout:
    """The hooks a group's estimates read. `layer_of`: hook -> (layer, kind) of every activation
    with a gradient (a `pattern` hook stands for its layer's query/key fix); `patched`: the hooks
    the cells patch; `qk`: layer -> its attention hooks and the pattern changes it needs ("q",
    "k_all", "k_column"); `acts`: the activations estimated as `(source - base) . gradient`;
    `resid`: the residual stream entering each block (`n_layers`: leaving the last)."""

    layer_of: dict[str, tuple[int, str]]
    patched: set[str]
    qk: dict[int, tuple[AttentionHooks, set[str]]]
    acts: list[str]
    resid: dict[int, str]


def _hook_layout(model: Model, cells: Sequence[Cell], *, qk_fix: bool, graddrop: bool) -> _HookLayout:
    """Which hooks the estimates record and take gradients at; with GradDrop, also the residual
    stream entering every block (where a dropped block's gradient is read)."""
    n_layers = model.cfg.n_layers
    layer_of: dict[str, tuple[int, str]] = {}
    qk: dict[int, tuple[AttentionHooks, set[str]]] = {}
    for cell in cells:
        if cell.kind in ("q", "k") and qk_fix:
            hooks, needs = qk.setdefault(cell.layer, (attention_hooks(model, cell.layer), set()))
            needs.add("q" if cell.kind == "q" else "k_all" if cell.position == "all" else "k_column")
            layer_of[hooks.pattern] = (cell.layer, "pattern")
        else:
            layer_of[cell_hook(model, cell)] = (cell.layer, cell.kind)
    acts = [n for n, (_, kind) in layer_of.items() if kind != "pattern"]
    resid = {l: hook_for("resid_pre", l) for l in range(1, n_layers)}  # the stream entering each block
    resid[n_layers] = hook_for("resid_post", n_layers - 1)
    if graddrop:
        for l, name in resid.items():
            layer_of.setdefault(name, (l, "resid_pre") if l < n_layers else (l - 1, "resid_post"))
    return _HookLayout(layer_of, {cell_hook(model, c) for c in cells}, qk, acts, resid)


@dataclass
class _BaseRun:
    """A group's grad-enabled base run: its recorded activations (`store`), metric, keys and values
    (`cache`, with `keep`), the full gradient of every hook `inputs` names, and the column it
    starts at (`start`, on the source runs' prefix)."""

    store: dict[str, Tensor]
    metric: Tensor
    cache: PrefixCache | None
    full: Mapping[str, Tensor | None]
    inputs: list[str]
    start: int


def _base_run(
    model: Model, group: Group, rows: GroupRows, layout: _HookLayout, prefix: PrefixCache | None, *,
    keep: bool, retain_graph: bool,
) -> _BaseRun:
    """The base run on the source runs' prefix, recording every hook with a gradient (and, with
    `keep`, the residual stream exact patching reuses), and one backward of the summed metric."""
    n_layers = model.cfg.n_layers
    start = min(rows.start, group.width - 1) if prefix is not None else 0
    base: dict[str, Tensor] = {}
    grad_names = sorted(layout.layer_of)
    plain = {n for hooks, _ in layout.qk.values() for n in (hooks.q_rot, hooks.k_rot, hooks.scores)}
    plain |= {layout.resid[l] for l in range(1, n_layers)} if keep else set()
    with torch.enable_grad():
        last, cache = forward_last(
            model, group.batch.input_ids, group.batch.forward_kwargs(),
            record_hooks(grad_names, base, requires_grad=True) + record_hooks(sorted(plain - set(grad_names)), base),
            rows=rows.base, prefix=prefix, start=start, prefix_rows=rows.pairs, keep_cache=keep,
        )
        metric = logit_diff(last, rows.base_tokens)
        inputs = [n for n in grad_names if n in base]
        full = dict(zip(inputs, torch.autograd.grad(
            metric.sum(), [base[n] for n in inputs], allow_unused=True, retain_graph=retain_graph
        ), strict=True))
    return _BaseRun(base, metric, cache, full, inputs, start)


class _Estimator:
    """Turns a set of gradients (full or GradDrop) into every cell's estimate for the group's
    pairs: `(source - base) . gradient` per activation, the query/key fix per layer, read out
    through the cell index. Everything stays on the device."""

    def __init__(self, index: CellIndex, layout: _HookLayout, diffs: dict[str, Tensor],
                 layers: dict[int, _QKLayer], start: int, width: int, differs: Tensor) -> None:
        self.index, self.layout, self.diffs, self.layers = index, layout, diffs, layers
        self.start, self.width, self.differs = start, width, differs

    def __call__(self, grads: Mapping[str, Tensor | None]) -> Tensor:
        scores = {n: column_scores(self.diffs[n], grads.get(n), self.start, self.width, self.differs)
                  for n in self.layout.acts}
        totals: dict[str, Tensor] = {}
        for part in self.layers.values():
            s, t = part.scores(grads.get(part.hooks.pattern), self.start, self.differs)
            scores.update(s)
            totals.update(t)
        return self.index.values(scores, totals)


def _graddrop(
    run: _BaseRun, layout: _HookLayout, blocks: list[tuple[int, int]], estimate: _Estimator, n_cells: int, g: int,
) -> Tensor:
    """The estimates `[cell, block, g]` with the gradient through each block's residual
    contributions dropped: one partial backward per block, from the block's input down."""
    full, base = run.full, run.store
    dropped = torch.empty((n_cells, len(blocks), g), dtype=torch.float64, device=run.metric.device)
    for b, (first, end) in enumerate(blocks):
        g_out = full[layout.resid[end]]  # the gradient leaving the block, unchanged by the drop
        grads: dict[str, Tensor | None] = {}
        for name, (at, kind) in layout.layer_of.items():
            if at >= end or (at == end - 1 and kind == "resid_post"):
                grads[name] = full.get(name)
            elif at >= first:  # inside the block: only the skip path is left
                grads[name] = None if kind in _COMPONENTS else g_out
        lower = [n for n in run.inputs if layout.layer_of[n][0] < first]
        if lower:
            with torch.enable_grad():
                below = torch.autograd.grad(
                    base[layout.resid[first]], [base[n] for n in lower], grad_outputs=g_out, allow_unused=True,
                    retain_graph=True,
                )
            grads.update(zip(lower, below, strict=True))
        dropped[:, b] = estimate(grads)
    return dropped


def _kept_state(
    group: Group, rows: GroupRows, run: _BaseRun, layout: _HookLayout, src: dict[str, Tensor], n_layers: int,
) -> tuple[Group, BasePass]:
    """What exact patching of the group's cells reuses: the stories patched into as a group of
    their own, and a `BasePass` of their metric, the source activations, keys and values and
    residual stream per block (zero before the run's first column)."""
    g, width, start = group.g, group.width, run.start
    stream = {}
    for l in range(1, n_layers):
        new = run.store[layout.resid[l]].detach()
        stream[l] = torch.zeros((g, width) + tuple(new.shape[2:]), dtype=new.dtype, device=new.device)
        stream[l][:, start:] = new
    cache = run.cache
    if cache is not None:
        cache = PrefixCache([k.detach() for k in cache.keys], [v.detach() for v in cache.values])
    sources = {n: src[n] for n in layout.patched}
    return _base_group(group, rows), BasePass(run.metric.detach().float(), sources, cache, stream)


def _estimate_group(
    model: Model, group: Group, cells: Sequence[Cell], index: CellIndex, direction: Direction, *, qk_fix: bool,
    blocks: list[tuple[int, int]] | None, reuse_prefix: bool, keep: bool,
) -> _Group:
    """AtP* estimates of a group's pairs, GradDrop per layer block, and (`keep`) the state exact
    patching reuses."""
    rows = group_rows(group, direction)
    layout = _hook_layout(model, cells, qk_fix=qk_fix, graddrop=blocks is not None)
    src_names = (set(layout.acts) | layout.patched
                 | {n for hooks, _ in layout.qk.values() for n in (hooks.q_rot, hooks.k_rot)})
    src, src_metric, prefix = source_run(model, group, rows, sorted(src_names), keep_cache=reuse_prefix)
    run = _base_run(model, group, rows, layout, prefix, keep=keep, retain_graph=blocks is not None)
    start, base, differs = run.start, run.store, rows.differs  # differs: [g, pos], the columns that differ
    diffs = {n: src[n][:, start:].to(base[n].dtype) - base[n].detach() for n in layout.acts}
    layers = {
        l: _qk_layer(model, l, hooks, needs, src, base, start, differs) for l, (hooks, needs) in layout.qk.items()
    }
    estimate = _Estimator(index, layout, diffs, layers, start, group.width, differs)
    atp = estimate(run.full)
    dropped = None if blocks is None else _graddrop(run, layout, blocks, estimate, len(cells), group.g)
    kept = _kept_state(group, rows, run, layout, src, model.cfg.n_layers) if keep else None
    checks = {l: part.check for l, part in layers.items()}
    return _Group(atp, dropped, run.metric.detach().double(), src_metric.double(), checks, kept)


def _estimate(
    model: Model, prepared: PreparedPairs, cells: list[Cell], direction: Direction, *, qk_fix: bool,
    graddrop: bool, n_blocks: int | None, reuse_prefix: bool, keep: bool, progress: bool,
) -> tuple[Estimates, list[tuple[Group, BasePass] | None]]:
    check_selectors(cells, prepared)
    blocks = graddrop_blocks(model.cfg.n_layers, n_blocks) if graddrop else None
    n_pair = len(prepared.pairs)
    n_cell, n_block = len(cells), len(blocks or [])
    qk_layers = sorted({c.layer for c in cells if c.kind in ("q", "k")}) if qk_fix else []
    parts, kept = [], []
    for group in tqdm(prepared.groups, desc=f"AtP* ({direction})", unit="group", disable=not progress):
        index = CellIndex(cells, group, prepared.n_aligned, key=lambda c: cell_hook(model, c),
                          device=group.batch.input_ids.device)
        out = _estimate_group(model, group, cells, index, direction, qk_fix=qk_fix, blocks=blocks,
                              reuse_prefix=reuse_prefix, keep=keep)
        # one table per group, pairs along the last axis: AtP* [cell], GradDrop [cell * block], the
        # score check of the query/key fix [1 per layer, the same for every pair], base and source metric
        drop_rows = [] if out.dropped is None else [out.dropped.reshape(n_cell * n_block, group.g)]
        checks = [out.checks[l].double().expand(1, group.g) for l in qk_layers]
        parts.append(torch.cat([out.atp, *drop_rows, *checks, out.base_metric[None, :], out.src_metric[None, :]]))
        kept.append(out.verify)
    table = to_host_by_pair(parts, prepared.groups, n_pair)  # what the search reads, in one copy
    at = n_cell * (1 + n_block)
    if qk_layers:  # a host table: its numbers as Python floats, read once
        _raise_on_bad_scores(dict(zip(qk_layers, table[at : at + len(qk_layers)].tolist(), strict=True)))
    atp, base, src = table[:n_cell].clone(), table[-2].clone(), table[-1].clone()
    dropped = table[n_cell:at].reshape(n_cell, n_block, n_pair).clone() if blocks else None
    clean, corrupted = (src, base) if direction == "denoise" else (base, src)
    est = Estimates(direction, cells, atp, dropped, blocks or [], base, clean, corrupted, prepared.ids,
                    prepared.token_labels, qk_fix)
    return est, kept


def atp_star(
    model: Model,
    pairs: Sequence[Any] | PreparedPairs,
    *,
    sites: Sequence[str] | Mapping[str, Sequence[str]] = ("heads",),
    positions: Sequence[str] = (),
    direction: Direction = "denoise",
    layers: Sequence[int] | None = None,
    cells: Sequence[Cell] | None = None,
    qk_fix: bool = True,
    graddrop: bool = True,
    graddrop_blocks: int | None = None,
    batch_pairs: int = 8,
    reuse_prefix: bool = True,
    progress: bool = True,
) -> Estimates:
    """AtP* estimates of every cell of the requested sites (or of `cells`): one source forward, one
    grad-enabled base forward and one backward per group of pairs, plus one partial backward per
    GradDrop block (`graddrop_blocks` contiguous blocks of layers; default one per layer)."""
    roles(direction, 1, 0)  # an unknown direction fails here, before any forward
    prepared = as_prepared(model, pairs, selectors_in(sites, (*positions, *(c.position for c in cells or ()))),
                           batch_pairs)
    cells = list(cells) if cells is not None else plan_search(
        model, sites, positions, n_aligned=prepared.n_aligned, layers=layers
    )
    est, _ = _estimate(model, prepared, cells, direction, qk_fix=qk_fix, graddrop=graddrop, n_blocks=graddrop_blocks,
                       reuse_prefix=reuse_prefix, keep=False, progress=progress)
    return est


def _verify(
    model: Model, prepared: PreparedPairs, kept: Sequence[tuple[Group, BasePass]], cells: Sequence[Cell],
    idx: Sequence[int], values: Tensor, base: Float[Tensor, " pair"], *, memory_mb: float, progress: bool,
) -> None:
    """Exact patching of cells `idx` into `values` (raw metric), every (cell, pair) a batched row,
    on the estimation pass's base runs: no base pass of its own. A cell that patches nothing in a
    pair takes that pair's base metric from `base` (the estimates' host copy of the same run)."""
    bar = tqdm(total=len(idx) * len(prepared.pairs), desc="verifying", unit="run", disable=not progress)
    outs: list[Tensor] = []
    targets: list[tuple[int, int]] = []
    for group, bp in kept:
        runs: list[Run] = []
        for c_i in idx:
            cell = cells[c_i]
            hook = cell_hook(model, cell)
            for j, p_i in enumerate(group.index):
                cols = cell_columns(cell, group, j, prepared.n_aligned)
                if cols is None:
                    continue
                if not cols:
                    values[c_i, p_i] = base[p_i]
                    continue
                runs.append(Run(j, [Patch(hook, cell.layer, cell.head, cols, j)]))
                targets.append((c_i, p_i))
        bar.update(len(idx) * group.g - len(runs))
        outs.append(run_patched(model, group, runs, bp.sources, bp, memory_mb=memory_mb, bar=bar, on_device=True))
    if targets:  # every group's metrics in one copy
        t = torch.tensor(targets)
        values[t[:, 0], t[:, 1]] = torch.cat(outs).cpu().double()
    bar.close()


# --------------------------------------------------------------------------------------------
# The search


@dataclass
class SearchResult(PatchingResult):
    """A patching result whose values are exact where the search patched a cell and the AtP*
    estimate elsewhere; `summary()` says which (`verified`) and adds the estimates beside.

    `verified_as[c]`: "rule" (a top candidate or a cell the estimates could not rule out),
    "sample" (drawn for the false-negative bound) or "" (estimate only). `false_negatives`: one
    record per (kind, position) with the bound and what it means.
    """

    verified: Bool[Tensor, " cell"] = field(default_factory=lambda: torch.zeros(0, dtype=torch.bool))
    verified_as: list[str] = field(default_factory=list)
    estimates: Estimates | None = None
    estimate: np.ndarray = field(default_factory=lambda: np.zeros(0))
    estimate_se: np.ndarray = field(default_factory=lambda: np.zeros(0))
    graddrop: np.ndarray = field(default_factory=lambda: np.zeros(0))
    bound: np.ndarray = field(default_factory=lambda: np.zeros(0))
    false_negatives: list[dict[str, Any]] = field(default_factory=list)
    settings: dict[str, Any] = field(default_factory=dict)

    def summary(self, *, n_boot: int = 1000, seed: int | None = None) -> pd.DataFrame:
        """`PatchingResult.summary` (effect: exact where verified, else the estimate) plus the
        AtP* estimate with its standard error, the GradDrop score, the bound the rule used,
        `exact_effect` (NaN where not patched) and `verified` / `verified_as`."""
        df = super().summary(n_boot=n_boot, seed=seed)
        if "verified" not in df:
            ver = self.verified.numpy()
            df["estimate"] = self.estimate
            df["estimate_se"] = self.estimate_se
            df["graddrop"] = self.graddrop
            df["bound"] = self.bound
            df["exact_effect"] = np.where(ver, df["effect"], np.nan)
            df["verified"] = ver
            df["verified_as"] = self.verified_as
        return df

    def per_pair(self) -> pd.DataFrame:
        df = super().per_pair()
        df["verified"] = self.verified.numpy()[df["cell"].to_numpy()]
        return df

    def select(self, kind: str, position: str) -> pd.DataFrame:
        if kind.strip() in QK_KINDS:
            df = self.summary()
            return df[(df.kind == QK_KINDS[kind.strip()]) & (df.position == position)]
        return super().select(kind, position)

    def exact(self) -> PatchingResult:
        """The verified cells alone, as an exact patching result."""
        idx = self.verified.nonzero().flatten()
        return PatchingResult(
            "exact", self.direction, [self.cells[i] for i in idx.tolist()], self.values[idx], self.clean,
            self.corrupted, self.pair_ids, self.token_labels, self.normalise, self.seed,
        )

    def report(self) -> dict[str, Any]:
        """What the search did, for a run's summary: settings, cells verified and the bounds."""
        return {
            **self.settings,
            "n_cells": len(self.cells),
            "n_verified_rule": self.verified_as.count("rule"),
            "n_verified_sample": self.verified_as.count("sample"),
            "false_negatives": self.false_negatives,
        }


def _importance(effect: np.ndarray, direction: str) -> np.ndarray:
    """Magnitude of a normalised effect as `rank_heads(by="abs")` reads it."""
    return np.abs(effect) if direction == "denoise" else np.abs(1 - effect)


def _mean_se(norm: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mean and standard error over the last axis, NaN (pair not patched there) left out."""
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN cells: no token at that position
        n = (~np.isnan(norm)).sum(-1)
        mean = np.nanmean(norm, -1)
        se = np.where(n > 1, np.nanstd(norm, -1, ddof=1) / np.sqrt(np.maximum(n, 1)), 0.0)
    return mean, se


def hypergeom_upper(n_pop: int, n_drawn: int, hits: int, confidence: float) -> int:
    """The largest number K of marked cells among `n_pop` that still gives at least `1 - confidence`
    probability of drawing at most `hits` marked cells in `n_drawn` draws without replacement."""
    from scipy.stats import hypergeom

    if n_pop == 0:
        return 0
    ks = np.arange(hits, n_pop - (n_drawn - hits) + 1)
    ok = hypergeom.cdf(hits, n_pop, ks, n_drawn) >= 1 - confidence
    return int(ks[ok].max()) if ok.any() else hits


def _check_search_args(k: int, budget: int | None, confidence: float, fn_samples: int) -> None:
    """Refuse settings the search cannot honour, before any forward."""
    if k < 1:
        raise TomlensError(f"k = {k}: the search needs at least one top cell to find", "pass k >= 1")
    if budget is not None and budget < k:
        raise TomlensError(f"budget {budget} is smaller than k = {k}", "raise the budget or lower k")
    if not 0 < confidence < 1:
        raise TomlensError(f"confidence {confidence} is not between 0 and 1", "pass e.g. 0.95")
    if fn_samples < 0:
        raise TomlensError(f"fn_samples {fn_samples} is negative", "pass 0 to skip the false-negative bound")


def _groups_and_budget(
    cells: Sequence[Cell], k: int, budget: int | None
) -> tuple[dict[tuple[str, str], np.ndarray], int]:
    """The cells' indices per (kind, position), where the rule and the bound are applied, and the
    budget (default 4k per group), refused where it cannot cover the top k of every group."""
    members: dict[tuple[str, str], list[int]] = {}
    for i, c in enumerate(cells):
        members.setdefault((c.kind, c.position), []).append(i)
    groups = {key: np.array(idx) for key, idx in members.items()}
    budget = 4 * k * len(groups) if budget is None else budget
    if k * len(groups) > budget:
        raise TomlensError(
            f"budget {budget} cannot cover the top {k} of each of {len(groups)} kinds and positions",
            f"raise the budget to at least {k * len(groups)}, lower k, or search fewer sites or positions",
        )
    return groups, budget


@dataclass(frozen=True)
class _Candidates:
    """What the estimates say of every cell (host arrays `[cell]`): the AtP* `estimate` (mean
    normalised effect) and its `se`, whether any pair patches it (`patchable`), the `score` that
    ranks the candidates (importance, -inf where unpatchable), the GradDrop score and the `bound`
    the rule verifies against (the largest importance any estimate gives)."""

    estimate: np.ndarray
    se: np.ndarray
    patchable: np.ndarray
    score: np.ndarray
    graddrop: np.ndarray
    bound: np.ndarray


def _candidates(est: Estimates, direction: str, normalise: Normalise) -> _Candidates:
    """The estimates read on the normalised-effect scale, once, on the host."""
    norm = normalised_effects(est.base[None, :] + est.atp, est.clean, est.corrupted, normalise).numpy()
    estimate, se = _mean_se(norm)
    patchable = ~np.isnan(estimate)
    score = np.where(patchable, _importance(estimate, direction), -np.inf)  # ranks the candidates
    gd = np.full(len(est.cells), np.nan)
    bound = score.copy()
    if est.dropped is not None:
        per_block = _importance(_mean_se(normalised_effects(
            est.base[None, None, :] + est.dropped, est.clean, est.corrupted, normalise
        ).numpy())[0], direction)  # [cell, block]
        gd = np.nansum(per_block, 1) / max(len(est.blocks) - 1, 1)
        bound = np.fmax(bound, np.max(np.where(np.isnan(per_block), -np.inf, per_block), 1))
    return _Candidates(estimate, se, patchable, score, gd, bound)


@dataclass
class _Exact:
    """The search's exact patching, round by round, on the estimation pass's kept runs (`kept`,
    device state held until `release`): the raw metrics (`values`, `[cell, pair]` on the host),
    their normalised effects (`norm`, the host numbers the rounds read) and which cells are done."""

    model: Model
    prepared: PreparedPairs
    kept: list[tuple[Group, BasePass]]
    est: Estimates
    normalise: Normalise
    memory_mb: float
    progress: bool
    values: Tensor = field(init=False)
    norm: np.ndarray = field(init=False)
    verified: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        shape = (len(self.est.cells), len(self.est.pair_ids))
        self.values = torch.full(shape, float("nan"), dtype=torch.float64)
        self.norm = np.full(shape, np.nan)
        self.verified = np.zeros(shape[0], dtype=bool)

    def verify(self, idx: Sequence[int] | np.ndarray) -> None:
        """Patch the cells `idx` not yet verified, every group's metrics read back in one copy."""
        todo = [int(i) for i in idx if not self.verified[i]]
        if todo:
            _verify(self.model, self.prepared, self.kept, self.est.cells, todo, self.values, self.est.base,
                    memory_mb=self.memory_mb, progress=self.progress)
            self.verified[todo] = True
            # effects are normalised row by row, so the new rows alone, converted once per call
            self.norm[todo] = normalised_effects(self.values[todo], self.est.clean, self.est.corrupted,
                                                 self.normalise).numpy()

    def importance(self, idx: np.ndarray) -> np.ndarray:
        """The exact importance of verified cells `idx` (mean over pairs)."""
        return _importance(_mean_se(self.norm[idx])[0], self.est.direction)

    def release(self) -> None:
        """Let the kept device state go: the rounds are over."""
        self.kept = []


def _first_round(
    groups: Mapping[tuple[str, str], np.ndarray], cand: _Candidates, k: int, fn_samples: int, seed: int,
) -> tuple[np.ndarray, np.ndarray]:
    """(rule, sampled) masks `[cell]` of round 1: the top k of each group by estimate, and the
    false-negative samples drawn at random from the rest of each group."""
    n_cell = len(cand.score)
    rule = np.zeros(n_cell, dtype=bool)
    for idx in groups.values():
        top = idx[np.argsort(-cand.score[idx], kind="stable")][:k]
        rule[top[np.isfinite(cand.score[top])]] = True
    rng = np.random.default_rng(seed)
    sampled = np.zeros(n_cell, dtype=bool)
    for idx in groups.values():
        pool = idx[~rule[idx] & cand.patchable[idx]]
        sampled[rng.choice(pool, size=min(fn_samples, len(pool)), replace=False)] = True
    return rule, sampled


def _rule_rounds(
    exact: _Exact, groups: Mapping[tuple[str, str], np.ndarray], rule: np.ndarray, cand: _Candidates, *,
    k: int, threshold: float | None, budget: int,
) -> tuple[int, dict[tuple[str, str], float], int]:
    """Later rounds: patch every cell whose bound reaches the cut (the k-th verified importance, or
    the threshold if lower); each round can raise the cut. Only the rule's own cells set the cut, so
    which cells the rule picks does not depend on the random sample. `rule` grows in place; returns
    (rounds, the last cut per group, cells the budget left unresolved)."""
    rounds = 1
    cut: dict[tuple[str, str], float] = {}
    unresolved = 0
    bound = cand.bound
    while True:
        for key, idx in groups.items():
            imp = exact.importance(idx[rule[idx] & cand.patchable[idx]])
            imp = np.sort(imp[~np.isnan(imp)])[::-1]
            kth = float(imp[min(k, len(imp)) - 1]) if len(imp) else np.inf
            cut[key] = min(kth, threshold) if threshold is not None else kth
        cut_of = np.array([cut[(c.kind, c.position)] for c in exact.est.cells])
        pending = np.flatnonzero(~rule & (bound >= cut_of))
        pending = pending[np.argsort(-(bound[pending] - cut_of[pending]), kind="stable")]
        room = budget - int(rule.sum())
        unresolved = max(0, len(pending) - room)
        new = pending[:room]
        if not len(new):
            break
        rule[new] = True
        exact.verify(new)
        rounds += 1
    return rounds, cut, unresolved


def _false_negatives(
    exact: _Exact, key: tuple[str, str], idx: np.ndarray, rule: np.ndarray, sampled: np.ndarray,
    cand: _Candidates, cut: float, *, k: int, threshold: float | None, confidence: float,
) -> dict[str, Any]:
    """The false-negative bound of one (kind, position), over the cells the rule left out."""
    kind, position = key
    theta = threshold if threshold is not None else cut
    pop = idx[~rule[idx] & cand.patchable[idx]]
    drawn = pop[sampled[pop]]
    imp = exact.importance(drawn) if len(drawn) else np.array([])
    hits = int(np.sum(imp >= theta))
    upper = hypergeom_upper(len(pop), len(drawn), hits, confidence)
    return {
        "kind": kind, "position": position, "k": k, "threshold": float(theta),
        "threshold_from": "given" if threshold is not None else "k-th verified importance",
        "n_cells": len(idx), "n_verified_rule": int(rule[idx].sum()), "n_left_out": len(pop),
        "n_sampled": len(drawn), "hits": hits,
        "max_sampled_importance": float(np.nanmax(imp)) if len(imp) else float("nan"),
        "confidence": confidence, "fn_count_upper": upper,
        "fn_rate_upper": upper / len(pop) if len(pop) else 0.0,
        "unresolved_by_budget": int(np.sum(~rule[idx] & (cand.bound[idx] >= cut))),
        "meaning": (
            f"with {confidence:.0%} confidence at most {upper} of the {len(pop)} cells the rule left out "
            f"have importance >= {theta:.3g} ({hits} found among {len(drawn)} sampled and now verified)"
        ),
    }


def search(
    model: Model,
    pairs: Sequence[Any] | PreparedPairs,
    *,
    sites: Sequence[str] | Mapping[str, Sequence[str]] = ("heads",),
    positions: Sequence[str] = (),
    direction: Direction = "denoise",
    layers: Sequence[int] | None = None,
    k: int = 10,
    budget: int | None = None,
    threshold: float | None = None,
    fn_samples: int = 10,
    confidence: float = 0.95,
    qk_fix: bool = True,
    graddrop: bool | None = None,
    graddrop_blocks: int | None = None,
    normalise: Normalise = "pooled",
    batch_pairs: int = 8,
    memory_mb: float = 1024.0,
    seed: int = 0,
    progress: bool = True,
) -> SearchResult:
    """Find the cells with the largest patching effects without patching every cell (AtP*).

    `k`: the top cells per (kind, position) the search must get right. `budget`: at most this many
    cells patched by the rule (default 4k per kind and position). `threshold`: also verify every
    cell whose bound reaches this importance (normalised effect scale), and bound false negatives
    at it (default: the k-th verified importance). `fn_samples`: random left-out cells patched per
    (kind, position) for the false-negative bound, at `confidence`. `graddrop`: None (default) runs
    it when `graddrop_blocks` is given or the search has at least 10 cells per layer: per layer it
    costs about L/2 backward passes, about as much as patching L cells exactly, so only then does
    it stay under a tenth of an exhaustive sweep (AtP*'s setting: cells far outnumber layers).
    `qk_fix` and `graddrop_blocks` as in `atp_star`. See the module docstring for the rule.

    Exact patching reuses the estimation pass's runs (keys and values, residual stream, source
    activations) for every group, so it needs no base pass of its own; that state is held for all
    pairs at once until the search ends.
    """
    _check_search_args(k, budget, confidence, fn_samples)
    started = time.time()
    prepared = as_prepared(model, pairs, selectors_in(sites, positions), batch_pairs)
    roles(direction, 1, 0)  # an unknown direction fails here, before any forward
    cells = plan_search(model, sites, positions, n_aligned=prepared.n_aligned, layers=layers)
    groups, budget = _groups_and_budget(cells, k, budget)
    if graddrop is None:
        graddrop = graddrop_blocks is not None or len(cells) >= 10 * model.cfg.n_layers
    est, kept = _estimate(model, prepared, cells, direction, qk_fix=qk_fix, graddrop=graddrop,
                          n_blocks=graddrop_blocks, reuse_prefix=True, keep=True, progress=progress)
    t_estimates = time.time() - started
    cand = _candidates(est, direction, normalise)
    exact = _Exact(model, prepared, [part for part in kept if part is not None], est, normalise, memory_mb, progress)
    del kept
    rule, sampled = _first_round(groups, cand, k, fn_samples, seed)
    exact.verify(np.flatnonzero(rule))
    t0 = time.time()
    exact.verify(np.flatnonzero(sampled))
    t_samples = time.time() - t0
    rounds, cut, unresolved = _rule_rounds(exact, groups, rule, cand, k=k, threshold=threshold, budget=budget)
    false_negatives = [
        _false_negatives(exact, key, idx, rule, sampled, cand, cut[key], k=k, threshold=threshold,
                         confidence=confidence)
        for key, idx in groups.items()
    ]
    exact.release()
    values = torch.where(torch.from_numpy(exact.verified)[:, None], exact.values, est.base[None, :] + est.atp)
    settings = {
        "method": "AtP* (Kramar et al. 2024)", "direction": direction, "k": k, "budget": budget,
        "threshold": threshold, "fn_samples": fn_samples, "confidence": confidence, "qk_fix": qk_fix,
        "graddrop": graddrop, "graddrop_blocks": len(est.blocks), "rounds": rounds, "unresolved_by_budget": unresolved,
        "seconds_estimates": round(t_estimates, 2), "seconds_samples": round(t_samples, 2),
        "seconds": round(time.time() - started, 2),
    }
    return SearchResult(
        "search", direction, cells, values, est.clean, est.corrupted, est.pair_ids, est.token_labels, normalise, seed,
        verified=torch.from_numpy(exact.verified),
        verified_as=["rule" if r else ("sample" if s else "") for r, s in zip(rule, sampled, strict=True)],
        estimates=est, estimate=cand.estimate, estimate_se=cand.se, graddrop=cand.graddrop,
        bound=np.where(np.isfinite(cand.bound), cand.bound, np.nan), false_negatives=false_negatives,
        settings=settings,
    )


__all__ = [
    "Estimates", "QK_KINDS", "SearchResult", "atp_star", "cell_hook", "hypergeom_upper",
    "graddrop_blocks", "plan_search", "search",
]
