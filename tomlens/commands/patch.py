"""`tomlens patch`: activation and attribution patching over minimal pairs, heads that carry belief.

Writes, under --out: per-cell tables (`cells_<method>_<direction>`), per-pair tables
(`pairs_<method>_<direction>`), the per-head table (`heads`), top-k recovery (`topk`,
`topk_random`), mean ablation (`ablation`, `ablation_random`), `summary.json` with provenance,
and HTML figures under `figures/`. `patch_experiment` is the same run as a Python call.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import time
from pathlib import Path
from typing import Any, Sequence

from tomlens.errors import TomlensError

METHODS = ("exact", "attribution", "both")
DIRECTIONS = ("denoise", "noise", "both")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "patch",
        help="activation / attribution patching over minimal pairs; rank the heads that carry belief",
        description="Patch clean (false-belief) activations into corrupted (true-belief) runs and back, "
        "per head, layer and position; compare attribution patching; test the top-k heads together "
        "(recovery, mean ablation) against random heads.",
    )
    p.add_argument("--model", default="smollm2-135m", help="model name (see `tomlens models`)")
    p.add_argument("--revision", default=None, help="hub commit, branch or tag to pin (hub ids only)")
    p.add_argument("--pairs", required=True, help="minimal pairs file written by `tomlens pairs`")
    p.add_argument("--method", choices=METHODS, default="both")
    p.add_argument("--sites", default="heads,resid",
                   help="comma list of heads, resid, attn, mlp (also resid_mid, resid_post)")
    p.add_argument("--positions", default="",
                   help="extra position selectors patched for every site, comma list (e.g. final,protagonist); "
                   "heads/attn/mlp always run at all positions, resid at each position")
    p.add_argument("--direction", choices=DIRECTIONS, default="denoise",
                   help="denoise: clean into corrupted; noise: corrupted into clean")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--top-k", type=int, default=10, help="K for top-k recovery and mean ablation (0: skip both)")
    p.add_argument("--n-random", type=int, default=10, help="random head sets per k (baseline)")
    p.add_argument("--ablation", choices=("final", "all", "none"), default="final",
                   help="mean-ablate at the final token, at every position, or skip")
    p.add_argument("--probe-table", default=None, help="probe sweep table (Parquet/CSV) for the per-head table")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-pairs", type=int, default=8, help="pairs per cached group")
    p.add_argument("--memory-mb", type=float, default=1024, help="memory budget for one batched forward")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--format", choices=("parquet", "csv"), default="parquet")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run)


def _split(text: str | Sequence[str]) -> list[str]:
    if isinstance(text, str):
        return [t.strip() for t in text.split(",") if t.strip()]
    return list(text)


def pairs_hash(pairs: Sequence[Any]) -> str:
    """Content hash of the pairs in order (clean and corrupted records, ids, contrasts)."""
    h = hashlib.sha256()
    for p in pairs:
        h.update(json.dumps(p.to_dict(), sort_keys=True, ensure_ascii=False).encode())
        h.update(b"\n")
    return h.hexdigest()[:16]


def _gap_said_once(fn):  # noqa: ANN001, ANN202 - a decorator
    """Silence the per-summary unstable-gap warnings; the experiment says it once at the end. (The
    import is deferred: the CLI starts without torch.)"""
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        from tomlens.experiments.metric import gap_warnings_silenced

        with gap_warnings_silenced():
            return fn(*args, **kwargs)
    return run


@_gap_said_once
def patch_experiment(
    model,
    pairs: Sequence[Any],
    out: str | Path,
    *,
    method: str = "both",
    sites: str | Sequence[str] = ("heads", "resid"),
    positions: str | Sequence[str] = (),
    direction: str = "denoise",
    top_k: int = 10,
    n_random: int = 10,
    ablation: str = "final",
    probe_table: str | Path | None = None,
    seed: int = 0,
    batch_pairs: int = 8,
    memory_mb: float = 1024,
    fmt: str = "parquet",
    progress: bool = True,
    figures: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Run the whole patching experiment and write its tables, figures and summary under `out`.
    An unstable clean - corrupted gap is said once (printed, and in the summary's baselines).

    `figures`: a dict that also receives every plotly figure written, by file stem (for a report).
    """
    import torch

    from tomlens.experiments.attribution import attribution_patching, compare
    from tomlens.experiments.heads import head_table, mean_ablation, rank_heads, topk_recovery
    from tomlens.experiments.io import read_table, write_json, write_table
    from tomlens.experiments.metric import METRIC_NAME, gap_note
    from tomlens.experiments.patching import canonical_kind, exact_patching, prepare_pairs
    from tomlens.figures.patching import (
        attribution_scatter, head_heatmap, recovery_curve, resid_heatmap, write_figure,
    )
    from tomlens.models import provenance
    from tomlens.stimuli.pairs import check_pairs

    if method not in METHODS:
        raise TomlensError(f"unknown method {method!r}", f"use one of {list(METHODS)}")
    if direction not in DIRECTIONS:
        raise TomlensError(f"unknown direction {direction!r}", f"use one of {list(DIRECTIONS)}")
    site_list = _split(sites)
    if not site_list:
        raise TomlensError("no patching sites given", "pass e.g. --sites heads,resid")
    kinds = [canonical_kind(s) for s in site_list]
    selectors = [p for p in _split(positions) if p not in ("all", "each")]
    if top_k < 0:
        raise TomlensError(f"--top-k {top_k} is negative", "pass 0 to skip top-k experiments, or a positive K")
    probe = None
    if probe_table is not None:
        if not Path(probe_table).is_file():
            raise TomlensError(f"probe table {str(probe_table)!r} does not exist", "pass the table written by `tomlens probe`")
        probe = read_table(probe_table)

    started = time.time()
    torch.manual_seed(seed)
    aligned, report = check_pairs(list(pairs), model.tokenizer)
    if report.dropped:
        print(report.summary())
    if not aligned:
        raise TomlensError(
            "no minimal pair is token-aligned for this model's tokenizer",
            "write the pairs with `tomlens pairs --model` set to this model",
        )
    prepared = prepare_pairs(model, aligned, selectors=selectors, batch_pairs=batch_pairs)
    out = Path(out)
    figs = out / "figures"

    def _figure(fig: Any, stem: str) -> Path:
        if figures is not None:
            figures[stem] = fig
        return write_figure(fig, figs / f"{stem}.html")
    ext = ".parquet" if fmt == "parquet" else ".csv"
    methods = ["exact", "attribution"] if method == "both" else [method]
    directions = ["denoise", "noise"] if direction == "both" else [direction]
    results: dict[tuple[str, str], Any] = {}
    files: list[str] = []
    for d in directions:
        for m in methods:
            kwargs = dict(sites=kinds, positions=selectors, direction=d, progress=progress)
            if m == "exact":
                res = exact_patching(model, prepared, memory_mb=memory_mb, **kwargs)
            else:
                res = attribution_patching(model, prepared, **kwargs)
            res.seed = seed
            results[(m, d)] = res
            files.append(str(write_table(res.summary(), out / f"cells_{m}_{d}{ext}")))
            files.append(str(write_table(res.per_pair(), out / f"pairs_{m}_{d}{ext}")))
            if "head" in kinds:
                files.append(str(_figure(head_heatmap(res, "all"), f"heads_{m}_{d}")))
            for kind in kinds:
                if kind.startswith("resid"):
                    files.append(str(_figure(resid_heatmap(res, kind), f"{kind}_{m}_{d}")))

    summary: dict[str, Any] = {
        "command": "patch",
        "provenance": provenance(model),
        "seed": seed,
        "pairs": {
            "n_given": len(pairs), "n_aligned": len(aligned), "hash": pairs_hash(aligned),
            "families": sorted({p.family for p in aligned}), "contrasts": sorted({p.contrast for p in aligned}),
            "dropped": report.dropped_pairs,
        },
        "metric": METRIC_NAME,
        "normalisation": "effect = (patched - corrupted) / mean(clean - corrupted) per pair; 0 = corrupted run, 1 = clean run",
        "corruption": "minimal pairs: clean = false-belief story, corrupted = matched control differing only in the "
        "contrast span (token-aligned); denoise patches clean into corrupted, noise corrupted into clean",
        "sites": kinds, "positions": ["all", "each", *selectors], "methods": methods, "directions": directions,
        "baselines": {f"{m}_{d}": r.baselines() for (m, d), r in results.items()},
        "comparisons": [],
    }
    for d in directions:
        if ("exact", d) in results and ("attribution", d) in results:
            ex, at = results[("exact", d)], results[("attribution", d)]
            for kind in kinds:
                for position in sorted(set(ex.summary().query("kind == @kind").position)):
                    c = compare(ex, at, kind=kind, position=position, k=min(10, max(1, top_k)))
                    summary["comparisons"].append({"direction": d, **c})
            if "head" in kinds:
                files.append(str(_figure(attribution_scatter(ex, at, "all"), f"attribution_vs_exact_{d}")))

    main_dir = directions[0]
    ranking_source = results.get(("exact", main_dir)) or results.get(("attribution", main_dir))
    if "head" in kinds and ranking_source is not None:
        table = head_table(
            results.get(("exact", main_dir)), results.get(("attribution", main_dir)), probe, position="all"
        )
        files.append(str(write_table(table, out / f"heads{ext}")))
        ranking = list(zip(*[rank_heads(ranking_source, position="all")[c] for c in ("layer", "head")]))
        summary["top_heads"] = [f"L{l}H{h}" for l, h in ranking[: max(top_k, 10)]]
        summary["ranked_by"] = f"{ranking_source.method} {ranking_source.direction} effect, heads at all positions"
        if top_k > 0:
            rec = topk_recovery(
                model, prepared, ranking, k_max=top_k, n_random=n_random, seed=seed,
                direction=main_dir, memory_mb=memory_mb, progress=progress,
            )
            files.append(str(write_table(rec.table, out / f"topk{ext}")))
            files.append(str(write_table(rec.draws, out / f"topk_random{ext}")))
            files.append(str(_figure(recovery_curve(rec.table), "topk_recovery")))
            summary["topk"] = rec.table.to_dict(orient="records")
            if ablation != "none":
                ab = mean_ablation(
                    model, prepared, ranking, ks=list(range(1, top_k + 1)), n_random=n_random, seed=seed,
                    mode=ablation, memory_mb=memory_mb, progress=progress,
                )
                files.append(str(write_table(ab.table, out / f"ablation{ext}")))
                files.append(str(write_table(ab.draws, out / f"ablation_random{ext}")))
                summary["ablation"] = {
                    "mode": ablation,
                    "mean": "each ablated head's z replaced by its mean over all clean and corrupted stories "
                    + ("at the final token" if ablation == "final" else "at the same right-aligned position"),
                    "baseline": ab.baseline, "table": ab.table.to_dict(orient="records"),
                }
    elif "head" not in kinds and top_k > 0:
        summary["topk_skipped"] = "top-k recovery and ablation need --sites to include heads"
    summary["seconds"] = round(time.time() - started, 2)
    summary["files"] = [str(Path(f).relative_to(out)) for f in files]
    write_json(summary, out / "summary.json")
    note = gap_note(summary["baselines"][f"{ranking_source.method}_{main_dir}"] if ranking_source is not None
                    else next(iter(summary["baselines"].values())))
    if note:
        print(f"note: {note}")
    return summary


def run(args: argparse.Namespace) -> int:
    from tomlens.models import load_model
    from tomlens.stimuli.pairs import read_pairs

    pairs = read_pairs(args.pairs)
    if not pairs:
        raise TomlensError(f"pairs file {args.pairs!r} holds no pairs", "write pairs with `tomlens pairs`")
    model = load_model(args.model, revision=args.revision, device=args.device, dtype=args.dtype, seed=args.seed)
    summary = patch_experiment(
        model, pairs, args.out, method=args.method, sites=args.sites, positions=args.positions,
        direction=args.direction, top_k=args.top_k, n_random=args.n_random, ablation=args.ablation,
        probe_table=args.probe_table, seed=args.seed, batch_pairs=args.batch_pairs,
        memory_mb=args.memory_mb, fmt=args.format, progress=not args.no_progress,
    )
    b = next(iter(summary["baselines"].values()))
    print(f"{summary['pairs']['n_aligned']} pairs; logit diff clean {b['clean_logit_diff']:.3f}, "
          f"corrupted {b['corrupted_logit_diff']:.3f}")
    if "top_heads" in summary:
        print(f"top heads ({summary['ranked_by']}): {', '.join(summary['top_heads'][:10])}")
    for c in summary["comparisons"]:
        if c["kind"] == "head" and c["position"] == "all":
            print(f"attribution vs exact ({c['direction']}): Spearman {c['spearman']:.2f}, "
                  f"top-{c['k']} overlap {c['topk_overlap']:.2f}")
    print(f"wrote {len(summary['files'])} files and summary.json under {args.out}")
    return 0
