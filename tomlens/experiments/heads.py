"""Heads that carry belief: ranking, top-k recovery, mean ablation and one table per head.

A single head's patching effect says little about whether a small set of heads carries the
belief; these functions ask the joint questions:
- *Top-k recovery*: patch the k best heads together (clean into corrupted) and read the fraction
  of the logit difference recovered, for k = 1..K, against k random heads (several draws).
- *Mean ablation*: replace the top-k heads' outputs by their mean over all clean and corrupted
  stories and read the drop in false-belief accuracy, against k random heads.
- *Per-head table*: patching effect, attribution score and (optionally) probe accuracy side by side.

All patched runs go through the batched engine of `tomlens.experiments.patching`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Sequence

import numpy as np
import pandas as pd
import torch
from torch import Tensor
from tqdm.auto import tqdm

from tomlens.errors import TomlensError
from tomlens.experiments.metric import Normalize, summarise
from tomlens.experiments.patching import (
    Cell,
    Direction,
    PatchingResult,
    PreparedPairs,
    Run,
    _roles,
    base_pass,
    cell_columns,
    hook_for,
    prepare_pairs,
    run_patched,
)

Head = tuple[int, int]


def rank_heads(result: PatchingResult, *, position: str = "all", by: Literal["signed", "abs"] = "signed") -> pd.DataFrame:
    """Heads sorted by importance, most important first, with a 1-based `rank`.

    Importance is the denoising effect (how much of the clean behaviour the head restores), or
    `1 - effect` for noising (how much patching the corrupted head destroys); `by="abs"` ranks
    by magnitude, so heads that push against the belief answer rank high too.
    """
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


def _all_heads(model) -> list[Head]:
    return [(l, h) for l in range(model.cfg.n_layers) for h in range(model.cfg.n_heads)]


def _random_sets(model, ks: Sequence[int], n_random: int, seed: int) -> dict[int, list[list[Head]]]:
    """`n_random` draws of k distinct heads for each k, uniform over all heads, fixed by `seed`."""
    heads = _all_heads(model)
    gen = np.random.default_rng(seed)
    return {
        k: [[heads[i] for i in gen.choice(len(heads), size=min(k, len(heads)), replace=False)] for _ in range(n_random)]
        for k in ks
    }


def _prepared(model, pairs: Any, position: str, batch_pairs: int) -> PreparedPairs:
    if isinstance(pairs, PreparedPairs):
        return pairs
    sel = () if position in ("all", "each") else (position,)
    return prepare_pairs(model, pairs, selectors=sel, batch_pairs=batch_pairs)


@dataclass
class Recovery:
    """Top-k recovery: `table` one row per k (top-k effect with its interval, random baseline mean
    and 2.5-97.5 percentile interval over draws); `draws` one row per (k, draw) for the baseline."""

    table: pd.DataFrame
    draws: pd.DataFrame


def topk_recovery(
    model,
    pairs: Any,
    ranking: Sequence[Head],
    *,
    k_max: int,
    n_random: int = 10,
    seed: int = 0,
    position: str = "all",
    direction: Direction = "denoise",
    normalize: Normalize = "pooled",
    batch_pairs: int = 8,
    memory_mb: float = 1024,
    n_boot: int = 1000,
    progress: bool = True,
) -> Recovery:
    """Patch the top-k heads of `ranking` together for k = 1..k_max, and k random heads."""
    ranking = [tuple(map(int, h)) for h in ranking]
    k_max = min(k_max, len(ranking))
    if k_max < 1:
        raise TomlensError("top-k recovery needs at least one ranked head", "pass a non-empty ranking")
    prepared = _prepared(model, pairs, position, batch_pairs)
    ks = list(range(1, k_max + 1))
    randoms = _random_sets(model, ks, n_random, seed)
    settings: list[tuple[str, int, int, list[Head]]] = [("top", k, -1, ranking[:k]) for k in ks]
    settings += [("random", k, d, heads) for k in ks for d, heads in enumerate(randoms[k])]
    values, clean, corrupted = _run_settings(
        model, prepared, [s[3] for s in settings], position, direction, batch_pairs, memory_mb, progress
    )
    s = summarise(values, clean, corrupted, normalize=normalize, n_boot=n_boot, seed=seed)
    long = pd.DataFrame(
        {
            "kind": [x[0] for x in settings], "k": [x[1] for x in settings], "draw": [x[2] for x in settings],
            "heads": [";".join(f"L{l}H{h}" for l, h in x[3]) for x in settings],
            "effect": s.mean, "se": s.se, "ci_low": s.ci_low, "ci_high": s.ci_high,
        }
    )
    top = long[long.kind == "top"].set_index("k")
    rnd = long[long.kind == "random"].groupby("k").effect
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
            "n_random": n_random,
            "position": position,
            "direction": direction,
        }
    )
    return Recovery(table, long[long.kind == "random"].reset_index(drop=True))


def _run_settings(
    model,
    prepared: PreparedPairs,
    head_sets: Sequence[Sequence[Head]],
    position: str,
    direction: Direction,
    batch_pairs: int,
    memory_mb: float,
    progress: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """Patch each head set (all its heads at once) into every pair; raw metric [set, pair]."""
    n_pair = len(prepared.pairs)
    values = torch.full((len(head_sets), n_pair), float("nan"), dtype=torch.float64)
    clean = torch.empty(n_pair, dtype=torch.float64)
    corrupted = torch.empty(n_pair, dtype=torch.float64)
    layers = sorted({l for hs in head_sets for l, _ in hs})
    hooks = [hook_for("head", l) for l in layers]
    bar = tqdm(total=len(head_sets) * n_pair, desc="top-k heads", unit="run", disable=not progress)
    for group in prepared.groups:
        g = group.g
        bp = base_pass(model, group, hooks)
        metric = bp.metric.double().cpu()
        clean[group.index] = metric[:g]
        corrupted[group.index] = metric[g:]
        runs: list[Run] = []
        targets: list[tuple[int, int]] = []
        for s_i, heads in enumerate(head_sets):
            for j, p_i in enumerate(group.index):
                base, src = _roles(direction, g, j)
                patches = []
                for l, h in heads:
                    cols = cell_columns(Cell("head", l, h, position, -1), group, j, prepared.n_aligned)
                    if cols:
                        patches.append((hook_for("head", l), l, h, cols, src))
                if not patches:
                    values[s_i, p_i] = metric[base]
                    continue
                runs.append(Run(base, patches))
                targets.append((s_i, p_i))
        bar.update(len(head_sets) * g - len(runs))
        out = run_patched(model, group, runs, bp.sources, bp, memory_mb=memory_mb, bar=bar)
        if targets:
            t = torch.tensor(targets)
            values[t[:, 0], t[:, 1]] = out.double()
    bar.close()
    return values, clean, corrupted


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


def head_means(
    model, prepared: PreparedPairs, layers: Sequence[int], mode: Literal["final", "all"], *, progress: bool = False
) -> dict[int, Tensor]:
    """Mean `z` of every head over all clean and corrupted stories: at the final token
    (`[head, d_head]`), or per right-aligned position (`[n_aligned, head, d_head]`, averaged over
    the stories that have a token there)."""
    sums: dict[int, Tensor] = {}
    counts: Tensor | None = None
    n_al = prepared.n_aligned
    hooks = {hook_for("head", l): l for l in layers}
    for group in tqdm(prepared.groups, desc="head means", disable=not progress):
        bp = base_pass(model, group, list(hooks), reuse_prefix=False)
        width = group.width
        for name, l in hooks.items():
            z = bp.sources[name].double().cpu()  # [story, pos, head, d]
            if mode == "final":
                add = z[:, -1].sum(0)
            else:
                add = torch.zeros((n_al,) + tuple(z.shape[2:]), dtype=torch.float64)
                add[n_al - width :] += _masked_sum(z, group, width)
            sums[l] = sums[l] + add if l in sums else add
        if mode == "final":
            c = torch.tensor(float(2 * group.g))
        else:
            c = torch.zeros(n_al, dtype=torch.float64)
            mask = group.batch.attention_mask.double().cpu()
            c[n_al - width :] += mask.sum(0)
        counts = c if counts is None else counts + c
    assert counts is not None
    if mode == "final":
        return {l: (s / counts).float() for l, s in sums.items()}
    return {l: (s / counts.clamp(min=1)[:, None, None]).float() for l, s in sums.items()}


def _masked_sum(z: Tensor, group, width: int) -> Tensor:
    mask = group.batch.attention_mask.double().cpu()[:, :width]
    return (z * mask[:, :, None, None]).sum(0)


def mean_ablation(
    model,
    pairs: Any,
    ranking: Sequence[Head],
    *,
    ks: Sequence[int],
    n_random: int = 10,
    seed: int = 0,
    mode: Literal["final", "all"] = "final",
    batch_pairs: int = 8,
    memory_mb: float = 1024,
    progress: bool = True,
) -> Ablation:
    """Ablate the top-k heads (and k random heads) in every clean and corrupted story.

    `mode="final"`: each ablated head's output at the final token is replaced by its mean final-token
    output over all clean and corrupted stories; other positions are untouched.
    `mode="all"`: every position is replaced by that head's mean at the same right-aligned position.
    False-belief accuracy is the share of clean stories whose logit difference favours the
    belief-consistent answer (> 0); true-belief accuracy the share of corrupted stories favouring
    the world-consistent one (< 0).
    """
    if mode not in ("final", "all"):
        raise TomlensError(f"unknown ablation mode {mode!r}", "use 'final' or 'all'")
    ranking = [tuple(map(int, h)) for h in ranking]
    ks = [k for k in ks if 1 <= k <= len(ranking)]
    if not ks:
        raise TomlensError("mean ablation needs k between 1 and the number of ranked heads")
    prepared = _prepared(model, pairs, "all", batch_pairs)
    randoms = _random_sets(model, ks, n_random, seed)
    settings: list[tuple[str, int, int, list[Head]]] = [("top", k, -1, ranking[:k]) for k in ks]
    settings += [("random", k, d, hs) for k in ks for d, hs in enumerate(randoms[k])]
    layers = sorted({l for *_, hs in settings for l, _ in hs})
    means = head_means(model, prepared, layers, mode, progress=progress)
    n_pair = len(prepared.pairs)
    ablated = torch.full((len(settings), 2, n_pair), float("nan"), dtype=torch.float64)  # [set, clean/corr, pair]
    base = torch.empty(2, n_pair, dtype=torch.float64)
    n_al = prepared.n_aligned
    bar = tqdm(total=len(settings) * 2 * n_pair, desc="mean ablation", unit="run", disable=not progress)
    for group in prepared.groups:
        g, width = group.g, group.width
        bp = base_pass(model, group, [])
        metric = bp.metric.double().cpu()
        idx = torch.tensor(group.index)
        base[0, idx], base[1, idx] = metric[:g], metric[g:]
        sources: dict[str, Tensor] = {}
        for l in layers:
            m = means[l]
            src = torch.zeros((1, width) + tuple(m.shape[-2:]), dtype=m.dtype)
            if mode == "final":
                src[0, -1] = m
            else:
                lo = max(0, n_al - width)
                src[0, width - (n_al - lo) :] = m[lo:]
            sources[hook_for("head", l)] = src.to(_device(model))
        runs: list[Run] = []
        targets: list[tuple[int, int, int]] = []
        for s_i, (*_, heads) in enumerate(settings):
            for story in range(2 * g):
                pad = group.pad(story % g)  # a pair's two stories share their padding
                cols = [width - 1] if mode == "final" else list(range(pad, width))
                runs.append(Run(story, [(hook_for("head", l), l, h, cols, 0) for l, h in heads]))
                targets.append((s_i, 0 if story < g else 1, group.index[story % g]))
        out = run_patched(model, group, runs, sources, bp, memory_mb=memory_mb, bar=bar)
        t = torch.tensor(targets)
        ablated[t[:, 0], t[:, 1], t[:, 2]] = out.double()
    bar.close()
    fb = (ablated[:, 0] > 0).double().mean(1)  # clean stories: belief answer preferred
    tb = (ablated[:, 1] < 0).double().mean(1)  # corrupted stories: world answer preferred
    base_fb = float((base[0] > 0).double().mean())
    base_tb = float((base[1] < 0).double().mean())
    long = pd.DataFrame(
        {
            "kind": [s[0] for s in settings], "k": [s[1] for s in settings], "draw": [s[2] for s in settings],
            "heads": [";".join(f"L{l}H{h}" for l, h in s[3]) for s in settings],
            "fb_accuracy": fb.numpy(), "tb_accuracy": tb.numpy(),
            "fb_drop": base_fb - fb.numpy(), "tb_drop": base_tb - tb.numpy(),
            "clean_logit_diff": ablated[:, 0].mean(1).numpy(),
            "corrupted_logit_diff": ablated[:, 1].mean(1).numpy(),
        }
    )
    top = long[long.kind == "top"].set_index("k")
    rnd = long[long.kind == "random"].groupby("k")
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
            "n_random": n_random,
            "mode": mode,
        }
    )
    baseline = {
        "fb_accuracy": base_fb, "tb_accuracy": base_tb,
        "clean_logit_diff": float(base[0].mean()), "corrupted_logit_diff": float(base[1].mean()),
    }
    return Ablation(table, long[long.kind == "random"].reset_index(drop=True), baseline)


def _device(model) -> torch.device:
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
            f"run `tomlens probe --target {target}` with --kinds including {kind}",
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
    position: str = "all",
    probe_target: str = "protagonist_belief",
    probe_position: str | None = None,
) -> pd.DataFrame:
    """One row per head: exact patching effect (with interval and rank), attribution estimate
    (with rank) and belief-probe accuracy, whichever are given."""
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
    table = frames[0] if frames else None
    for f in frames[1:]:
        table = table.join(f, how="outer")
    if probe is not None:
        p = probe_accuracy_by_head(probe, target=probe_target, position=probe_position).set_index(["layer", "head"])
        table = p if table is None else table.join(p, how="left")
    table = table.reset_index()
    sort = "patch_rank" if "patch_rank" in table else ("attribution_rank" if "attribution_rank" in table else "layer")
    return table.sort_values([sort, "layer", "head"]).reset_index(drop=True)
