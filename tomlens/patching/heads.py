"""Heads that carry belief: ranking, top-k recovery, mean ablation and one table per head.

A single head's patching effect says little about whether a small set of heads carries the
belief; these functions ask the joint questions:
- *Top-k recovery*: patch the k best heads together (clean into corrupted) and read the fraction
  of the logit difference recovered, for k in a short list, against k random heads drawn from the
  same layers as the top k (`layer_matched_draw`, many draws), with the share of draws that reach
  the top set's effect (an empirical p).
- *Mean ablation*: replace the top-k heads' outputs by their mean over all clean and corrupted
  stories and read the drop in false-belief accuracy, against k layer-matched random heads.
Rank on one set of pairs and validate on another (`tomlens.patching.gate.split_selection`): a
ranking validated on the pairs that made it recovers its own noise.
- *Per-head table*: patching effect, attribution score and (optionally) probe accuracy side by side.

All patched runs go through the batched engine of `tomlens.patching.engine`, laid out
(`HeadSetSweep`, `AblationSweep`) and run in checkpointed chunks like an exact sweep.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import pandas as pd
import torch
from torch import Tensor
from tqdm.auto import tqdm

from tomlens.devices import to_device
from tomlens.errors import TomlensError
from tomlens.models.protocol import Model
from tomlens.patching.cells import Cell, hook_for
from tomlens.patching.engine import DEFAULT_CHUNK_RUNS, Patch, Run, Stage, base_pass, forward_cost
from tomlens.patching.exact import CellSetSweep
from tomlens.patching.metric import Normalise, summarise
from tomlens.patching.pairs import Direction, PreparedPairs, as_prepared
from tomlens.patching.result import PatchingResult

Head = tuple[int, int]


def rank_heads(result: PatchingResult, *, position: str | None = None, by: Literal["signed", "abs"] = "signed"
               ) -> pd.DataFrame:
    """Heads sorted by importance, most important first, with a 1-based `rank`, at `position`
    (None: `PatchingResult.head_position`, "all" where the sweep has it, else "final").

    Importance is the denoising effect (how much of the clean behaviour the head restores), or
    `1 - effect` for noising (how much patching the corrupted head destroys); `by="abs"` ranks
    by magnitude, so heads that push against the belief answer rank high too.
    """
    position = position or result.head_position()
    df = result.select("head", position)
    if df.empty:
        raise TomlensError(
            f"the {result.method} result has no head cells at position {position!r}",
            "run the sweep with sites including 'heads' at that position",
        )
    df = df[["layer", "head", "effect", "se", "ci_low", "ci_high"]].copy()
    score = df.effect if result.direction == "denoise" else 1 - df.effect
    df["importance"] = score.abs() if by == "abs" else score
    df = df.sort_values(["importance", "layer", "head"], ascending=[False, True, True], kind="stable")
    df["rank"] = np.arange(1, len(df) + 1)
    return df.reset_index(drop=True)


def _as_heads(heads: Iterable[Sequence[int]]) -> list[Head]:
    """(layer, head) pairs as Python ints (a ranking read off a table holds NumPy integers)."""
    return [(int(layer), int(head)) for layer, head in heads]


def _all_heads(model) -> list[Head]:
    return [(l, h) for l in range(model.cfg.n_layers) for h in range(model.cfg.n_heads)]


def _uniform_sets(model, ks: Sequence[int], seed: int) -> dict[int, list[Head]]:
    """One draw of k distinct heads per k, uniform over all heads (stand-in top sets for a plan)."""
    heads = _all_heads(model)
    gen = np.random.default_rng(seed)
    return {k: [heads[i] for i in gen.choice(len(heads), size=min(k, len(heads)), replace=False)] for k in ks}


def layer_matched_draw(model, top: Sequence[Head], gen: np.random.Generator) -> list[Head]:
    """One random head set with exactly the layers of `top`: per layer, as many distinct heads as `top`
    has there, drawn from that layer's other heads (its top heads too only where it has too few others).
    Random heads spread over all layers would compare the top set with a different depth profile."""
    n_heads = model.cfg.n_heads
    top = _as_heads(top)
    out: list[Head] = []
    for layer in dict.fromkeys(l for l, _ in top):
        mine = [h for l, h in top if l == layer]
        others = [h for h in range(n_heads) if h not in mine]
        m = len(mine)
        if len(others) >= m:
            picked = [others[i] for i in gen.choice(len(others), size=m, replace=False)]
        else:
            fill = [mine[i] for i in gen.choice(len(mine), size=m - len(others), replace=False)]
            picked = others + fill
        out.extend((layer, h) for h in picked)
    return out


def _layer_options(model, top: Sequence[Head]) -> list[tuple[int, list[tuple[int, ...]]]]:
    """Per layer of `top` (in its order), every head subset a layer-matched draw can take there."""
    n_heads = model.cfg.n_heads
    top = _as_heads(top)
    out = []
    for layer in dict.fromkeys(l for l, _ in top):
        mine = [h for l, h in top if l == layer]
        others = [h for h in range(n_heads) if h not in mine]
        m = len(mine)
        if len(others) >= m:
            options = list(itertools.combinations(others, m))
        else:
            options = [tuple(others) + fill for fill in itertools.combinations(mine, m - len(others))]
        out.append((layer, options))
    return out


def n_layer_matched(model, top: Sequence[Head]) -> int:
    """How many distinct layer-matched head sets `top` has (`layer_matched_draw`'s support)."""
    n_heads = model.cfg.n_heads
    top = _as_heads(top)
    total = 1
    for layer in dict.fromkeys(l for l, _ in top):
        m = sum(1 for l, _ in top if l == layer)
        others = n_heads - m
        total *= math.comb(others, m) if others >= m else math.comb(m, m - others)
    return total


def layer_matched_sets(model, top: Sequence[Head], n_random: int, gen: np.random.Generator) -> list[list[Head]]:
    """Distinct layer-matched head sets for `top`: all of them (in a fixed order) when there are at most
    `n_random`, so the null is exact; else `n_random` drawn without replacement. Draws with replacement
    from a small support repeat the same few sets and make (1 + reaching) / (1 + draws) far too small
    (9 heads a layer, k = 1: 8 sets, p at least 1/9, not 1/201)."""
    n = n_layer_matched(model, top)
    if n <= n_random or n <= 4 * n_random:
        options = _layer_options(model, top)
        every = [[(layer, h) for (layer, _), hs in zip(options, combo, strict=True) for h in hs]
                 for combo in itertools.product(*(o for _, o in options))]
        if n <= n_random:
            return every
        return [every[i] for i in sorted(gen.choice(len(every), size=n_random, replace=False))]
    seen: set[frozenset[Head]] = set()
    out: list[list[Head]] = []
    while len(out) < n_random:
        draw = layer_matched_draw(model, top, gen)
        key = frozenset(draw)
        if key not in seen:
            seen.add(key)
            out.append(draw)
    return out


def _random_sets(model, top_sets: Mapping[int, Sequence[Head]], n_random: int, seed: int) -> dict[int, list[list[Head]]]:
    """Up to `n_random` distinct layer-matched sets (`layer_matched_sets`) for each k's top set, fixed by `seed`."""
    gen = np.random.default_rng(seed)
    return {k: layer_matched_sets(model, top, n_random, gen) for k, top in top_sets.items()}


def _prepared(model: Model, pairs: Any, position: str, batch_pairs: int) -> PreparedPairs:
    return as_prepared(model, pairs, () if position in ("all", "each") else (position,), batch_pairs)


@dataclass
class Recovery:
    """Top-k recovery: `table` one row per k (top-k effect with its interval, random baseline mean
    and 2.5-97.5 percentile interval over draws); `draws` one row per (k, draw) for the baseline."""

    table: pd.DataFrame
    draws: pd.DataFrame


def topk_settings(
    model, ranking: Sequence[Head] | None, ks: Sequence[int], n_random: int, seed: int
) -> list[tuple[str, int, int, list[Head]]]:
    """(selection, k, draw, heads) for the top-k sets of `ranking` (selection "top", draw -1) and up to
    `n_random` distinct random sets per k (selection "random", draw 0, 1, ...), each matched to its top
    set's layers (`layer_matched_sets`: every such set when there are at most `n_random`).

    `ranking=None` stands a uniform random draw in for each top set: same sizes, so a plan made
    before the ranking exists counts about the same runs (at most `n_random` draws per k)."""
    if ranking is None:
        tops = _uniform_sets(model, ks, seed + 1)
    else:
        tops = {k: _as_heads(ranking[:k]) for k in ks}
    top = [("top", k, -1, tops[k]) for k in ks]
    randoms = _random_sets(model, tops, n_random, seed)
    return top + [("random", k, d, heads) for k in ks for d, heads in enumerate(randoms[k])]


def _settings_frame(settings: Sequence[tuple[str, int, int, Sequence[Head]]], **columns: Any) -> pd.DataFrame:
    """One row per head set of `topk_settings` (selection, k, draw, heads as "L0H1;L2H3"), then
    `columns` (one value per set)."""
    return pd.DataFrame(
        {
            "selection": [s[0] for s in settings], "k": [s[1] for s in settings], "draw": [s[2] for s in settings],
            "heads": [";".join(f"L{l}H{h}" for l, h in s[3]) for s in settings],
            **columns,
        }
    )


class HeadSetSweep(CellSetSweep):
    """Each head set patched into every pair with all its heads at once, laid out per group and
    run in checkpointed chunks (`tomlens.patching.exact.CellSetSweep`)."""

    def __init__(
        self,
        model: Model,
        prepared: PreparedPairs,
        head_sets: Sequence[Sequence[Head]],
        *,
        position: str = "all",
        direction: Direction = "denoise",
        memory_mb: float = 1024.0,
        chunk_runs: int = DEFAULT_CHUNK_RUNS,
        name: str = "topk",
    ):
        sets = [[Cell("head", l, h, position, -1) for l, h in heads] for heads in head_sets]
        super().__init__(name, model, prepared, sets, direction, desc="top-k heads", memory_mb=memory_mb,
                         chunk_runs=chunk_runs)


def topk_recovery(
    model: Model,
    pairs: Any,
    ranking: Sequence[Head],
    *,
    k_max: int,
    ks: Sequence[int] | None = None,
    n_random: int = 200,
    seed: int = 0,
    position: str = "all",
    direction: Direction = "denoise",
    normalise: Normalise = "pooled",
    batch_pairs: int = 8,
    memory_mb: float = 1024.0,
    n_boot: int = 1000,
    progress: bool = True,
    checkpoints: Any = None,
    chunk_runs: int = DEFAULT_CHUNK_RUNS,
) -> Recovery:
    """Patch the top-k heads of `ranking` together for each k of `ks` (default 1..k_max; those above
    k_max dropped), and k layer-matched random heads, at `position`. `random_reach` is the share of
    random draws whose effect reaches the top set's (for noising, whose effect falls as low), `p_random`
    the empirical p (1 + reaching) / (1 + draws): exact when every distinct layer-matched set was
    patched (`n_random` = `n_distinct`), and per k, uncorrected across the ks. Pass the `position`
    the ranking was read at (`PatchingResult.head_position()`: "final" for a role-position sweep,
    the default of `exact_patching`); "all" needs token-aligned pairs. `checkpoints`: finished
    chunks are saved there and
    reused (see `exact_patching`)."""
    ranking = _as_heads(ranking)
    k_max = min(k_max, len(ranking))
    if k_max < 1:
        raise TomlensError("top-k recovery needs at least one ranked head", "pass a non-empty ranking")
    prepared = _prepared(model, pairs, position, batch_pairs)
    ks = list(range(1, k_max + 1)) if ks is None else sorted({int(k) for k in ks if 1 <= k <= k_max})
    if not ks:
        raise TomlensError(f"no k of the list is between 1 and {k_max}", "pass ks within the ranked heads")
    settings = topk_settings(model, ranking, ks, n_random, seed)
    sweep = HeadSetSweep(model, prepared, [s[3] for s in settings], position=position, direction=direction,
                         memory_mb=memory_mb, chunk_runs=chunk_runs, name=f"topk-{direction}-{position}")
    sweep.run(checkpoints=checkpoints, progress=progress)
    values, clean, corrupted = sweep.values()
    s = summarise(values, clean, corrupted, normalise=normalise, n_boot=n_boot, seed=seed)
    long = _settings_frame(settings, effect=s.mean, se=s.se, ci_low=s.ci_low, ci_high=s.ci_high)
    top = long[long.selection == "top"].set_index("k")
    rnd = long[long.selection == "random"].groupby("k").effect
    reach = _reach(long, "effect", higher=direction == "denoise")
    table = pd.DataFrame(
        {
            "k": ks,
            "heads": [top.loc[k, "heads"] for k in ks],
            "top_effect": [top.loc[k, "effect"] for k in ks],
            "top_se": [top.loc[k, "se"] for k in ks],
            "top_ci_low": [top.loc[k, "ci_low"] for k in ks],
            "top_ci_high": [top.loc[k, "ci_high"] for k in ks],
            "random_mean": [rnd.mean().get(k, np.nan) for k in ks],
            "random_low": [rnd.quantile(0.025).get(k, np.nan) for k in ks],
            "random_high": [rnd.quantile(0.975).get(k, np.nan) for k in ks],
            "random_reach": [reach[k][0] for k in ks],
            "p_random": [reach[k][1] for k in ks],
            **_draw_counts(model, settings, ks),
            "position": position,
            "direction": direction,
        }
    )
    return Recovery(table, long[long.selection == "random"].reset_index(drop=True))


def _draw_counts(model, settings: Sequence[tuple[str, int, int, Sequence[Head]]], ks: Sequence[int]
                 ) -> dict[str, list[int]]:
    """Per k: the random sets patched (`n_random`) and the distinct layer-matched sets there are
    (`n_distinct`; equal: the null is exact)."""
    drawn = {k: sum(1 for s in settings if s[0] == "random" and s[1] == k) for k in ks}
    tops = {s[1]: s[3] for s in settings if s[0] == "top"}
    return {"n_random": [drawn[k] for k in ks], "n_distinct": [n_layer_matched(model, tops[k]) for k in ks]}


def _reach(long: pd.DataFrame, column: str, *, higher: bool) -> dict[int, tuple[float, float]]:
    """Per k: (share of random draws whose `column` reaches the top set's, (1 + reaching) / (1 + draws));
    NaN without draws. `higher`: reaching is >= the top value, else <=."""
    out = {}
    for k, top in long[long.selection == "top"].set_index("k")[column].items():
        rnd = long[(long.selection == "random") & (long.k == k)][column].dropna().to_numpy()
        if len(rnd) == 0 or not np.isfinite(top):
            out[int(k)] = (float("nan"), float("nan"))
            continue
        hits = int((rnd >= top).sum() if higher else (rnd <= top).sum())
        out[int(k)] = (hits / len(rnd), (1 + hits) / (1 + len(rnd)))
    return out


# --------------------------------------------------------------------------------------------
# Mean ablation


@dataclass
class Ablation:
    """Mean ablation: `table` one row per k with false-belief (clean) and true-belief (corrupted)
    accuracy with the top-k heads ablated, the drop in false-belief accuracy from the unablated
    model, and the same for k random heads (mean and 2.5-97.5 percentile interval over draws)."""

    table: pd.DataFrame
    draws: pd.DataFrame
    baseline: dict[str, float]


def _head_means(
    model: Model, prepared: PreparedPairs, layers: Sequence[int], mode: Literal["final", "all"], *, progress: bool = False
) -> dict[int, Tensor]:
    """Mean `z` of every head over all clean and corrupted stories: at the final token
    (`[head, d_head]`), or per right-aligned position (`[n_aligned, head, d_head]`, averaged over
    the stories that have a token there).

    Summed on the model's device (in float64) and left there, where the ablation's patched runs
    read them; the counts come from the groups' host-side padding. No host sync per group or layer.
    """
    sums: dict[int, Tensor] = {}
    n_al = prepared.n_aligned
    counts = [0] * n_al  # stories with a token at each right-aligned position
    stories = 0
    hooks = {hook_for("head", l): l for l in layers}
    for group in tqdm(prepared.groups, desc="head means", disable=not progress):
        bp = base_pass(model, group, list(hooks), reuse_prefix=False)
        width = group.width
        stories += 2 * group.g
        for pad in group.batch.pad:
            for col in range(pad, width):
                counts[n_al - width + col] += 1
        mask = group.batch.attention_mask[:, :width].double() if mode != "final" else None
        for name, l in hooks.items():
            z = bp.sources[name].double()  # [story, pos, head, d]
            if mask is None:
                add = z[:, -1].sum(0)
            else:
                add = torch.zeros((n_al,) + tuple(z.shape[2:]), dtype=torch.float64, device=z.device)
                add[n_al - width :] += (z * mask[:, :, None, None]).sum(0)
            sums[l] = sums[l] + add if l in sums else add
    if mode == "final":
        return {l: (s / float(stories)).float() for l, s in sums.items()}
    per = to_device(torch.tensor(counts, dtype=torch.float64), _device(model)).clamp(min=1)
    return {l: (s / per.to(s.device)[:, None, None]).float() for l, s in sums.items()}


class AblationSweep:
    """Mean ablation laid out before it runs: every head set ablated in every clean and corrupted
    story (one run each), run in checkpointed chunks after the heads' means are computed (or
    read back from the checkpoints)."""

    def __init__(
        self,
        model: Model,
        prepared: PreparedPairs,
        head_sets: Sequence[Sequence[Head]],
        *,
        mode: Literal["final", "all"] = "final",
        memory_mb: float = 1024.0,
        chunk_runs: int = DEFAULT_CHUNK_RUNS,
    ):
        if mode not in ("final", "all"):
            raise TomlensError(f"unknown ablation mode {mode!r}", "use 'final' or 'all'")
        self.model, self.prepared, self.mode, self.n_sets = model, prepared, mode, len(head_sets)
        self.layers = sorted({l for hs in head_sets for l, _ in hs})
        self.means: dict[int, Tensor] | None = None
        runs: list[list[Run]] = []
        self.targets: list[list[tuple[int, int, int]]] = []
        for group in prepared.groups:
            g, width = group.g, group.width
            rs: list[Run] = []
            ts: list[tuple[int, int, int]] = []
            for s_i, heads in enumerate(head_sets):
                for story in range(2 * g):
                    pad = group.pad(story)  # its own: a role-aligned pair's stories differ in length
                    cols = [width - 1] if mode == "final" else list(range(pad, width))
                    rs.append(Run(story, [Patch(hook_for("head", l), l, h, cols, 0) for l, h in heads]))
                    ts.append((s_i, 0 if story < g else 1, group.index[story % g]))
            runs.append(rs)
            self.targets.append(ts)
        self.stage = Stage(f"ablation-{mode}", model, prepared, runs, sources=self._sources,
                           memory_mb=memory_mb, chunk_runs=chunk_runs)

    def means_cost(self) -> float:
        """Multiply-adds of the forwards that compute the heads' means (0 once they are known)."""
        if self.means is not None:
            return 0.0
        return float(sum(forward_cost(self.model, 2 * g.g, g.width) for g in self.prepared.groups))

    def _means_name(self) -> str:
        return f"means-{self.mode}-{hashlib.sha256(repr(self.layers).encode()).hexdigest()[:12]}"

    def _means_shapes(self) -> dict[str, tuple[int, ...]]:
        cfg = self.model.cfg
        shape = (cfg.n_heads, cfg.d_head) if self.mode == "final" else (self.prepared.n_aligned, cfg.n_heads, cfg.d_head)
        return {f"L{l}": shape for l in self.layers}

    def _sources(self, group) -> dict[str, Tensor]:
        """The heads' means laid out as a one-story source of the group's width, on the device."""
        assert self.means is not None
        width, n_al = group.width, self.prepared.n_aligned
        sources: dict[str, Tensor] = {}
        for l in self.layers:
            m = self.means[l]
            src = torch.zeros((1, width) + tuple(m.shape[-2:]), dtype=m.dtype, device=m.device)
            if self.mode == "final":
                src[0, -1] = m
            else:
                lo = max(0, n_al - width)
                src[0, width - (n_al - lo) :] = m[lo:]
            sources[hook_for("head", l)] = src
        return sources

    def load(self, checkpoints: Any) -> int:
        """Take the means and finished chunks from `checkpoints`; returns the runs loaded."""
        got = checkpoints.load(self._means_name(), self._means_shapes())
        if got is not None:
            device = _device(self.model)
            self.means = {l: to_device(got[f"L{l}"], device) for l in self.layers}
        return self.stage.load(checkpoints)

    def run(self, *, checkpoints: Any = None, progress: bool = True) -> tuple[Tensor, Tensor]:
        """Ablated metric `[set, clean/corrupted, pair]` and the unablated one `[clean/corrupted, pair]`."""
        stage = self.stage
        if checkpoints is not None:
            self.load(checkpoints)
        if self.means is None:
            self.means = _head_means(self.model, self.prepared, self.layers, self.mode, progress=progress)
            if checkpoints is not None:
                checkpoints.save(self._means_name(), {f"L{l}": m for l, m in self.means.items()})
        with tqdm(total=stage.n_runs, desc="mean ablation", unit="run", disable=not progress) as bar:
            bar.update(stage.n_done)
            stage.run(checkpoints=checkpoints, bar=bar)
        n_pair = len(self.prepared.pairs)
        ablated = torch.full((self.n_sets, 2, n_pair), float("nan"), dtype=torch.float64)
        base = torch.empty(2, n_pair, dtype=torch.float64)
        for gi, group in enumerate(self.prepared.groups):
            unpatched = stage.base[gi]
            if unpatched is None:
                raise RuntimeError(f"{stage.name}: group {gi} has not run")
            metric = unpatched.double()
            idx = torch.tensor(group.index)
            base[0, idx], base[1, idx] = metric[: group.g], metric[group.g :]
            t = torch.tensor(self.targets[gi])
            ablated[t[:, 0], t[:, 1], t[:, 2]] = stage.values[gi].double()
        return ablated, base


def mean_ablation(
    model: Model,
    pairs: Any,
    ranking: Sequence[Head],
    *,
    ks: Sequence[int],
    n_random: int = 200,
    seed: int = 0,
    mode: Literal["final", "all"] = "final",
    batch_pairs: int = 8,
    memory_mb: float = 1024.0,
    progress: bool = True,
    checkpoints: Any = None,
    chunk_runs: int = DEFAULT_CHUNK_RUNS,
) -> Ablation:
    """Ablate the top-k heads (and k random heads) in every clean and corrupted story.

    `mode="final"`: each ablated head's output at the final token is replaced by its mean final-token
    output over all clean and corrupted stories; other positions are untouched.
    `mode="all"`: every position is replaced by that head's mean at the same right-aligned position.
    False-belief accuracy is the share of clean stories whose logit difference favours the
    belief-consistent answer (> 0); true-belief accuracy the share of corrupted stories favouring
    the world-consistent one (< 0). Random sets are layer-matched and distinct (all of them when there
    are at most `n_random`: `n_distinct`); `random_reach` is the share of draws whose false-belief drop
    reaches the top set's, `p_random` the empirical p (1 + reaching) / (1 + draws), per k, uncorrected
    across the ks.
    `checkpoints`: see `exact_patching`.
    """
    if mode not in ("final", "all"):
        raise TomlensError(f"unknown ablation mode {mode!r}", "use 'final' or 'all'")
    ranking = _as_heads(ranking)
    ks = [k for k in ks if 1 <= k <= len(ranking)]
    if not ks:
        raise TomlensError("mean ablation needs k between 1 and the number of ranked heads")
    prepared = _prepared(model, pairs, "all", batch_pairs)
    settings = topk_settings(model, ranking, ks, n_random, seed)
    sweep = AblationSweep(model, prepared, [s[3] for s in settings], mode=mode, memory_mb=memory_mb,
                          chunk_runs=chunk_runs)
    ablated, base = sweep.run(checkpoints=checkpoints, progress=progress)
    fb = (ablated[:, 0] > 0).double().mean(1)  # clean stories: belief answer preferred
    tb = (ablated[:, 1] < 0).double().mean(1)  # corrupted stories: world answer preferred
    base_fb = float((base[0] > 0).double().mean())
    base_tb = float((base[1] < 0).double().mean())
    long = _settings_frame(
        settings, fb_accuracy=fb.numpy(), tb_accuracy=tb.numpy(), fb_drop=base_fb - fb.numpy(),
        tb_drop=base_tb - tb.numpy(), clean_logit_diff=ablated[:, 0].mean(1).numpy(),
        corrupted_logit_diff=ablated[:, 1].mean(1).numpy(),
    )
    top = long[long.selection == "top"].set_index("k")
    rnd = long[long.selection == "random"].groupby("k")
    reach = _reach(long, "fb_drop", higher=True)
    table = pd.DataFrame(
        {
            "k": ks,
            "heads": [top.loc[k, "heads"] for k in ks],
            "fb_accuracy": [top.loc[k, "fb_accuracy"] for k in ks],
            "tb_accuracy": [top.loc[k, "tb_accuracy"] for k in ks],
            "fb_drop": [top.loc[k, "fb_drop"] for k in ks],
            "clean_logit_diff": [top.loc[k, "clean_logit_diff"] for k in ks],
            "random_fb_drop_mean": [rnd.fb_drop.mean().get(k, np.nan) for k in ks],
            "random_fb_drop_low": [rnd.fb_drop.quantile(0.025).get(k, np.nan) for k in ks],
            "random_fb_drop_high": [rnd.fb_drop.quantile(0.975).get(k, np.nan) for k in ks],
            "random_tb_accuracy_mean": [rnd.tb_accuracy.mean().get(k, np.nan) for k in ks],
            "random_reach": [reach[k][0] for k in ks],
            "p_random": [reach[k][1] for k in ks],
            **_draw_counts(model, settings, ks),
            "mode": mode,
        }
    )
    baseline = {
        "fb_accuracy": base_fb, "tb_accuracy": base_tb,
        "clean_logit_diff": float(base[0].mean()), "corrupted_logit_diff": float(base[1].mean()),
    }
    return Ablation(table, long[long.selection == "random"].reset_index(drop=True), baseline)


def _device(model: Model) -> torch.device:
    return next(model.parameters()).device


# --------------------------------------------------------------------------------------------
# One table per head


def _pick(values: Sequence[Any], preferred: Sequence[Any]) -> Any:
    for p in preferred:
        if p in values:
            return p
    return sorted(values, key=str)[0]


PROBE_COLUMNS = ("kind", "layer", "head", "target", "train_on", "eval_set", "metric", "score")


def probe_accuracy_by_head(
    probe: pd.DataFrame, *, target: str = "protagonist_belief", position: str | None = None,
    kind: str = "head_out", probe_name: str | None = None,
) -> pd.DataFrame:
    """Per-head probe accuracy from the table `tomlens probe` writes (one row per kind, layer,
    head, position, target, train_on, eval_set and metric).

    Probes trained on all stories (`train_on == "all"`) at one position (the one given, else
    "final" when present): accuracy with its interval and selectivity on all held-out stories,
    and accuracy on the false-belief stories alone, where belief and world disagree.
    """
    missing = [c for c in PROBE_COLUMNS if c not in probe.columns]
    if missing:
        raise TomlensError(
            f"the probe table lacks columns {missing}",
            "pass the table written by `tomlens probe` (probes.parquet or probes.csv)",
        )
    df = probe[(probe["kind"] == kind) & (probe["target"] == target) & (probe["metric"] == "accuracy")
               & (probe["train_on"] == "all") & (probe["head"] >= 0)]
    if df.empty:
        raise TomlensError(
            f"the probe table has no {kind} accuracy rows for target {target!r} trained on all stories",
            f"run `tomlens probe --targets {target}` with --sites including {kind}",
        )
    chosen_position = None
    if "position" in df.columns:
        chosen_position = position if position is not None else _pick(list(df["position"].unique()), ["final"])
        df = df[df["position"] == chosen_position]
    if "probe" in df.columns:
        df = df[df["probe"] == (probe_name or _pick(list(df["probe"].unique()), ["logistic"]))]
    if df.empty:
        raise TomlensError(f"the probe table has no {kind} rows at position {chosen_position!r}",
                           f"pick one of the table's positions: {sorted(probe['position'].unique())}")
    key = ["layer", "head"]
    everything = df[df["eval_set"] == "all"]
    out = everything[key + ["score", "ci_low", "ci_high"] + (["selectivity"] if "selectivity" in df else [])]
    out = out.rename(columns={"score": "probe_accuracy", "ci_low": "probe_ci_low", "ci_high": "probe_ci_high",
                              "selectivity": "probe_selectivity"})
    fb = df[df["eval_set"] == "false_belief"][key + ["score"]].rename(columns={"score": "probe_accuracy_false_belief"})
    out = fb if out.empty else (out if fb.empty else out.merge(fb, on=key, how="outer"))
    out = out.groupby(key, as_index=False).mean(numeric_only=True)
    out["layer"] = out["layer"].astype(int)
    out["head"] = out["head"].astype(int)
    out["probe_position"] = chosen_position
    return out


def head_table(
    exact: PatchingResult | None = None,
    attribution: PatchingResult | None = None,
    probe: pd.DataFrame | None = None,
    *,
    position: str | None = None,
    probe_target: str = "protagonist_belief",
    probe_position: str | None = None,
) -> pd.DataFrame:
    """One row per head: exact patching effect (with interval and rank), attribution estimate
    (with rank) and belief-probe accuracy, whichever are given; heads at `position` (None: the
    exact result's `head_position`, else the attribution result's)."""
    base = exact if exact is not None else attribution
    if position is None and base is not None:
        position = base.head_position()
    frames = []
    for name, res in (("patch", exact), ("attribution", attribution)):
        if res is None:
            continue
        r = rank_heads(res, position=position)
        cols = {"effect": f"{name}_effect", "rank": f"{name}_rank"}
        keep = ["layer", "head", "effect", "rank"]
        if name == "patch":
            cols.update({"se": "patch_se", "ci_low": "patch_ci_low", "ci_high": "patch_ci_high"})
            keep += ["se", "ci_low", "ci_high"]
        frames.append(r[keep].rename(columns=cols).set_index(["layer", "head"]))
    if not frames and probe is None:
        raise TomlensError("head_table needs a patching result, an attribution result or a probe table")
    table: pd.DataFrame | None = None
    for f in frames:
        table = f if table is None else table.join(f, how="outer")
    if probe is not None:
        p = probe_accuracy_by_head(probe, target=probe_target, position=probe_position).set_index(["layer", "head"])
        table = p if table is None else table.join(p, how="left")
    assert table is not None  # a patching frame or the probe table, checked above
    table = table.reset_index()
    sort = "patch_rank" if "patch_rank" in table else ("attribution_rank" if "attribution_rank" in table else "layer")
    return table.sort_values([sort, "layer", "head"]).reset_index(drop=True)
