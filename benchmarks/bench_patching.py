"""Patching benchmark: batched exact head patching against TransformerLens's looped patching, and
attribution patching against exact patching.

Task: patch every head's output (all positions, denoising: clean into corrupted) on the embedded
SmolLM2-135M (30 layers x 9 heads = 270 cells), over 32 unexpected-transfer minimal pairs (false
belief vs the protagonist present, from `tomlens.stimuli.pairs.make_pairs`, token-aligned for the
model's tokenizer); metric: logit difference belief - world at the last token.

  exact vs TransformerLens : tomlens's batched exact patching (every (cell, pair) a batch row;
      shared KV prefix before the first differing token; blocks below the patched one skipped;
      last-token logits only) against TransformerLens's looped patching, one forward per cell:
      `generic_activation_patch` with `layer_head_vector_patch_setter` on `z`, which is exactly what
      `get_act_patch_attn_head_out_all_pos` runs, given one layer's heads at a time. It passes no
      attention mask, so it runs on a group of equal-length pairs (no padding: the most favourable
      fair setting for it). The two are timed on the same pairs, alternating layer by layer (in
      mirror pairs whose mean depth is the model's), so both see the same machine load; ours is charged its cached
      base run (prorated when not every layer is timed), TransformerLens its clean-run cache. Same numbers: max |difference| of the per-pair logit difference over the cells timed.
      Target >= 5x.
  exact sweep              : the full all-heads sweep over all pairs (groups of 4 pairs).
  attribution vs exact     : tomlens attribution patching (two forwards, one backward per group)
      timed right after the exact sweep of the same group; agreement over the pairs both ran as
      Spearman correlation and top-10 overlap of the 270 head effects. Target >= 20x.

On a slow machine the exact sweep stops starting new groups when the next would end past
--budget-s, and the side-by-side comparison stops starting new layers past --tl-budget-s; per-pair
times are projected to all pairs and the JSON says what actually ran.

    .venv/bin/python benchmarks/bench_patching.py [--pairs 32] [--tl-pairs 2] [--budget-s 280]

Writes bench-out/patching.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")  # TransformerLens's per-cell progress bar

HERE = Path(__file__).resolve().parent
OUT = HERE.parent / "bench-out"


def clock() -> float:
    """`time.perf_counter()` once the GPU has finished its queued work: without the wait, a CUDA
    timing stops when the last kernel is queued, not when it has run."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


def merge(results):
    """PatchingResults of disjoint pair sets (same cells) as one."""
    import torch

    first = results[0]
    return type(first)(
        first.method, first.direction, first.cells, torch.cat([r.values for r in results], 1),
        torch.cat([r.clean for r in results]), torch.cat([r.corrupted for r in results]),
        [i for r in results for i in r.pair_ids], first.token_labels, first.normalise,
    )


def layer_blocks(n_layers: int) -> list[list[int]]:
    """Layers in blocks whose mean depth is the model's: the middle layer (odd counts), then mirror
    pairs (l, n-1-l) with l bisecting the lower half. A patched block-l run costs tomlens about
    n - l blocks, so stopping after any block keeps the timed layers' average cost representative."""
    order, queue = [], [(0, n_layers // 2)]
    while queue:
        lo, hi = queue.pop(0)
        if lo < hi:
            mid = (lo + hi) // 2
            order.append(mid)
            queue += [(lo, mid), (mid + 1, hi)]
    blocks = [[n_layers // 2]] if n_layers % 2 else []
    return blocks + [[l, n_layers - 1 - l] for l in order]


def side_by_side(model, pairs, budget_s: float):
    """Time tomlens's batched engine and TransformerLens's looped patching on the same
    equal-length pairs, alternating layer by layer; returns timings and the largest difference."""
    import pandas as pd
    import torch
    from transformer_lens import patching

    from tomlens.patching.cells import Cell, cell_columns, hook_for
    from tomlens.patching.engine import Patch, Run, base_pass, run_patched
    from tomlens.patching.metric import logit_diff
    from tomlens.patching.pairs import prepare_pairs

    L, H = model.cfg.n_layers, model.cfg.n_heads
    prep = prepare_pairs(model, pairs, batch_pairs=len(pairs))
    (group,) = prep.groups
    g = group.g
    assert group.batch.pad == [0] * (2 * g), "an equal-length group was expected"
    ids = group.batch.input_ids
    tokens = group.tokens[:g]

    def metric(logits):  # per pair, so per-pair numbers can be compared
        return logit_diff(logits[:, -1], tokens)

    t0 = clock()
    bp = base_pass(model, group, [hook_for("head", l) for l in range(L)])
    t_base = clock() - t0
    t_ours = 0.0
    with torch.inference_mode():
        t0 = clock()
        _, cache = model.run_with_cache(ids[:g], names_filter=lambda name: name.endswith("hook_z"))
        t_tl = clock() - t0

    def _time_layer(layer: int) -> float:
        nonlocal t_ours, t_tl
        runs = [
            Run(g + j, [Patch(hook_for("head", layer), layer, h, cell_columns(Cell("head", layer, h, "all", -1), group, j, prep.n_aligned), j)])
            for h in range(H) for j in range(g)
        ]
        t0 = clock()
        ours = run_patched(model, group, runs, bp.sources, bp).double().view(H, g)
        t_ours += clock() - t0
        index = pd.DataFrame({"layer": [layer] * H, "head": list(range(H))})
        with torch.inference_mode():
            t0 = clock()
            tl = patching.generic_activation_patch(
                model, ids[g:], cache, metric, patching.layer_head_vector_patch_setter, "z",
                index_df=index, reduce="none",
            )
            t_tl += clock() - t0
        return float((ours - tl.values.double().cpu()).abs().max())
    done, diffs = [], []
    for block in layer_blocks(L):
        if done and (t_tl + t_ours + t_base) / len(done) * (len(done) + len(block)) > budget_s:
            break
        for layer in block:
            diffs.append(_time_layer(layer))
            done.append(layer)
    # ours paid its cached base run once for every layer; charge the layers timed their share
    t_ours = t_base * len(done) / L + t_ours
    return {
        "pairs": g, "pair_ids": [p.id for p in pairs], "tokens": int(ids.shape[1]),
        "layers_timed": done, "cells_timed": len(done) * H, "tomlens_base_run_s": round(t_base, 2),
        "tomlens_s": round(t_ours, 2),
        "transformer_lens_s": round(t_tl, 2), "ratio": t_tl / t_ours, "max_abs_diff": max(diffs),
        "tl_per_pair_projected_s": round(t_tl / g * L / len(done), 2),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--pairs", type=int, default=32)
    ap.add_argument("--tl-pairs", type=int, default=2, help="equal-length pairs for the side-by-side comparison")
    ap.add_argument("--budget-s", type=float, default=280.0, help="time budget of the exact sweep")
    ap.add_argument("--tl-budget-s", type=float, default=120.0, help="time budget of the side-by-side comparison")
    ap.add_argument("--group", type=int, default=4, help="pairs per cached group of the exact sweep")
    ap.add_argument("--memory-mb", type=float, default=1024)
    ap.add_argument("--dtype", default=None, help="model dtype (default: float32 on CPU, the device's default on CUDA)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--out", default=str(OUT / "patching.json"))
    args = ap.parse_args()

    import pandas as pd
    import torch

    from tomlens.models import load_model, provenance
    from tomlens.patching.attribution import attribution_patching, compare
    from tomlens.patching.exact import exact_patching
    from tomlens.patching.pairs import prepare_pairs
    from tomlens.stimuli.pairs import make_pairs

    if args.threads:
        torch.set_num_threads(args.threads)
    load_start = os.getloadavg()[0]  # other work on the machine skews every timing below
    t0 = clock()
    model = load_model(args.model, dtype=args.dtype or (None if torch.cuda.is_available() else "float32"))
    t_load = clock() - t0
    pairs, report = make_pairs("unexpected-transfer", (args.pairs + 1) // 2, seed=0,
                               tokenizer=model.tokenizer, contrasts=("present",))
    pairs = pairs[: args.pairs]
    n = len(pairs)
    L, H = model.cfg.n_layers, model.cfg.n_heads
    print(f"{args.model}: {L} layers x {H} heads = {L * H} cells; {n} pairs ({report.aligned} aligned); "
          f"torch threads {torch.get_num_threads()}; loaded in {t_load:.0f} s", flush=True)

    # warm-up: library initialisation and the engine's one-off shortcut check, not timed
    exact_patching(model, pairs[:1], sites=["heads"], positions=("all",), layers=[L - 1], progress=False)
    attribution_patching(model, pairs[:1], sites=["heads"], positions=("all",), progress=False)

    # ---- side by side with TransformerLens on one group of equal-length pairs
    prep = prepare_pairs(model, pairs, batch_pairs=1)
    length = {pairs[g.index[0]].id: g.batch.lengths[0] for g in prep.groups}
    by_len = pd.Series(length).groupby(lambda i: length[i]).groups
    best = max(by_len, key=lambda k: (min(len(by_len[k]), args.tl_pairs), k))
    tl_pairs = [p for p in pairs if p.id in set(list(by_len[best])[: args.tl_pairs])]
    sbs = side_by_side(model, tl_pairs, args.tl_budget_s)
    print(f"side by side on {sbs['pairs']} equal-length pairs ({sbs['tokens']} tokens), {sbs['cells_timed']} cells: "
          f"tomlens {sbs['tomlens_s']:.1f} s, TransformerLens {sbs['transformer_lens_s']:.1f} s -> "
          f"{sbs['ratio']:.2f}x; max |diff| {sbs['max_abs_diff']:.2e}", flush=True)

    # ---- the full exact sweep group by group, each followed by attribution on the same group
    order = prepare_pairs(model, pairs, batch_pairs=args.group)  # groups of similar length
    groups = [[pairs[i] for i in g.index] for g in order.groups]
    exact_parts, attr_parts, done = [], [], []
    t_exact = t_attr = 0.0
    for grp in groups:
        if done and t_exact / len(done) * (len(done) + len(grp)) > args.budget_s:
            break
        t0 = clock()
        exact_parts.append(exact_patching(model, grp, sites=["heads"], positions=("all",), batch_pairs=args.group,
                                          memory_mb=args.memory_mb, progress=False))
        t_exact += clock() - t0
        t0 = clock()
        attr_parts.append(attribution_patching(model, grp, sites=["heads"], positions=("all",), batch_pairs=args.group,
                                               progress=False))
        t_attr += clock() - t0
        done.extend(grp)
        print(f"exact sweep: {len(done)}/{n} pairs, {t_exact:.0f} s; attribution {t_attr:.1f} s", flush=True)
    rest = [p for p in pairs if p not in done]
    t_attr_rest = 0.0
    if rest:  # attribution is cheap: run it on every pair anyway
        t0 = clock()
        attribution_patching(model, rest, sites=["heads"], positions=("all",), batch_pairs=args.group, progress=False)
        t_attr_rest = clock() - t0
    exact, attr = merge(exact_parts), merge(attr_parts)
    exact_per_pair = t_exact / len(done)
    attr_per_pair = t_attr / len(done)
    agree = compare(exact, attr, kind="head", position="all", k=10)
    agree_signed = compare(exact, attr, kind="head", position="all", k=10, by="signed")
    top = exact.summary().sort_values("effect", ascending=False).head(5)

    result = {
        "task": "all-heads exact activation patching (denoising, all positions), logit difference at the last token",
        "model": provenance(model),
        "threads": torch.get_num_threads(),
        "load_average_1min": {"start": load_start, "end": os.getloadavg()[0]},
        "load_s": round(t_load, 1),
        "pairs": {"family": "unexpected-transfer", "contrast": "present", "n": n, "ids": [p.id for p in pairs]},
        "side_by_side": {
            "baseline": "transformer_lens.patching.generic_activation_patch + layer_head_vector_patch_setter on 'z' "
            "(= get_act_patch_attn_head_out_all_pos), reduce='none', one forward per cell",
            "mode": "one batch of equal-length pairs (no padding, so no mask needed); alternating layer by layer",
            **sbs,
        },
        "exact_sweep": {
            "pairs_run": len(done), "seconds": round(t_exact, 2), "per_pair_s": round(exact_per_pair, 3),
            "projected_s_all_pairs": round(exact_per_pair * n, 1), "cells": L * H,
            "clean_logit_diff": float(exact.clean.mean()), "corrupted_logit_diff": float(exact.corrupted.mean()),
            "top_heads": [f"L{r.layer}H{r.head} {r.effect:.3f}" for r in top.itertuples()],
        },
        "attribution": {
            "pairs_timed": len(done), "seconds": round(t_attr, 2), "per_pair_s": round(attr_per_pair, 4),
            "all_pairs_s": round(t_attr + t_attr_rest, 2),
            "spearman": agree["spearman"], "pearson": agree["pearson"],
            "top10_overlap_abs": agree["topk_overlap"], "top10_overlap_signed": agree_signed["topk_overlap"],
        },
        "ratios": {
            "exact vs TransformerLens looped (x, target >= 5)": round(sbs["ratio"], 2),
            "attribution vs exact (x, target >= 20)": round(exact_per_pair / attr_per_pair, 1),
            "max |exact - TransformerLens| (logit diff)": float(f"{sbs['max_abs_diff']:.3g}"),
            "attribution/exact Spearman (heads)": round(agree["spearman"], 3),
            "attribution/exact top-10 overlap": round(agree["topk_overlap"], 2),
        },
    }
    from tomlens.io import write_atomic

    write_atomic(json.dumps(result, indent=2) + "\n", args.out)

    print(f"exact sweep (tomlens)    : {exact_per_pair:8.2f} s/pair  ({len(done)} of {n} pairs run in {t_exact:.0f} s; "
          f"all {n}: ~{exact_per_pair * n:.0f} s)")
    print(f"TransformerLens looped   : {sbs['tl_per_pair_projected_s']:8.2f} s/pair  (projected from {sbs['cells_timed']} "
          f"cells on {sbs['pairs']} pairs)")
    print(f"attribution (tomlens)    : {attr_per_pair:8.3f} s/pair  (all {n} pairs: {t_attr + t_attr_rest:.1f} s)")
    print(f"speed: exact vs looped {sbs['ratio']:.2f}x (target >= 5, side by side); "
          f"attribution vs exact {exact_per_pair / attr_per_pair:.1f}x (target >= 20)")
    print(f"same numbers: max |diff| {sbs['max_abs_diff']:.2e}; attribution vs exact: Spearman {agree['spearman']:.3f}, "
          f"top-10 overlap {agree['topk_overlap']:.2f} (|effect|), {agree_signed['topk_overlap']:.2f} (signed)")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
