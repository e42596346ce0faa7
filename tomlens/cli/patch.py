"""`tomlens patch`: activation and attribution patching over minimal pairs, heads that carry belief.

Before anything runs, the command prints its plan: every stage (each method x direction sweep, top-k
recovery and mean ablation with their random draws) as sites x positions x pairs x directions =
patched runs, the total, and the time estimated from one timed chunk of real runs (kept, not thrown
away). `--dry-run` stops there; `--max-runs` refuses a larger plan before any run. Positions default
to the role positions (`tomlens.patching.plan` has the `--positions` syntax).

Finished chunks are checkpointed under `<out>/.partial/<key>/` (the key hashes the model, the pairs
and the settings), so a stopped run resumes when the same command runs again; the outputs are
written only once every stage is complete, `summary.json` last, and the checkpoints are then removed.

Writes, under --out: per-cell tables (`cells_<method>_<direction>`), per-pair tables
(`pairs_<method>_<direction>`), the per-head table (`heads`), top-k recovery (`topk`,
`topk_random`), mean ablation (`ablation`, `ablation_random`), `summary.json` with provenance and
the plan, and HTML figures under `figures/`. `patch_experiment` is the same run as a Python call.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import re
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from tomlens.cli.options import add_prepend_bos
from tomlens.errors import TomlensError

METHODS = ("exact", "attribution", "both", "search")
DIRECTIONS = ("denoise", "noise", "both")
DEFAULT_MAX_RUNS = 100_000  # = tomlens.patching.plan.DEFAULT_MAX_RUNS (the CLI starts without torch)
DEFAULT_CHUNK_RUNS = 1024  # = tomlens.patching.engine.DEFAULT_CHUNK_RUNS


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "patch",
        help="activation / attribution patching over minimal pairs; rank the heads that carry belief",
        description="Patch clean (false-belief) activations into corrupted (true-belief) runs and back, "
        "per head, layer and position; compare attribution patching; test the top-k heads together "
        "(recovery, mean ablation) against random heads. Prints the plan (runs and estimated time) "
        "first; a stopped run resumes when the same command runs again.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="smollm2-135m", help="model name (see `tomlens models`)")
    p.add_argument("--revision", default=None, help="hub commit, branch or tag to pin (hub ids only)")
    p.add_argument("--pairs", required=True, help="minimal pairs file written by `tomlens pairs`")
    p.add_argument("--method", choices=METHODS, default="both")
    p.add_argument("--sites", default="heads,resid",
                   help="comma list of heads, resid, attn, mlp (also resid_mid, resid_post)")
    p.add_argument("--positions", default="roles",
                   help="comma list; an item is a position for every site or SITE=POSITION for one. "
                   "roles (default): the final token, the contrast sentence's end and the question's "
                   "protagonist and object mentions (heads: without the contrast); all: every position "
                   "(heads/attn/mlp all at once, resid one at a time; the sweep before roles); each: one "
                   "cell per position for every site; or a selector (final, contrast, query_protagonist, "
                   "object:first, ...). E.g. --positions all, --positions roles,heads=contrast")
    p.add_argument("--direction", choices=DIRECTIONS, default="denoise",
                   help="denoise: clean into corrupted; noise: corrupted into clean")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--top-k", type=int, default=10, help="K for top-k recovery and mean ablation (0: skip both)")
    p.add_argument("--n-random", type=int, default=10, help="random head sets per k (baseline)")
    p.add_argument("--ablation", choices=("final", "all", "none"), default="final",
                   help="mean-ablate at the final token, at every position, or skip")
    p.add_argument("--max-runs", type=int, default=DEFAULT_MAX_RUNS,
                   help=f"refuse a plan of more patched runs than this (default {DEFAULT_MAX_RUNS:,})")
    p.add_argument("--dry-run", action="store_true",
                   help="print the plan with its time (from one timed chunk) and exit without writing anything")
    p.add_argument("--chunk-runs", type=int, default=DEFAULT_CHUNK_RUNS,
                   help="patched runs per checkpointed chunk (a stopped run loses at most one chunk)")
    p.add_argument("--probe-table", default=None, help="probe sweep table (Parquet/CSV) for the per-head table")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-pairs", type=int, default=8, help="pairs per cached group")
    p.add_argument("--memory-mb", type=float, default=1024, help="memory budget for one batched forward")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--format", choices=("parquet", "csv"), default="parquet")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--search-budget", type=int, default=None,
                   help="--method search: at most this many cells patched by its rule (default 4 x top-k per site "
                   "and position)")
    p.add_argument("--search-threshold", type=float, default=None,
                   help="--method search: also patch every cell whose estimates could reach this |effect|, and bound "
                   "false negatives at it (default: the top-k-th verified |effect|)")
    p.add_argument("--search-samples", type=int, default=10,
                   help="--method search: random left-out cells patched per site and position for the "
                   "false-negative bound")
    p.add_argument("--graddrop", choices=("auto", "on", "off"), default="auto",
                   help="--method search: GradDrop (auto: when there are at least 10 cells per layer)")
    add_prepend_bos(p)
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
        from tomlens.patching.metric import gap_warnings_silenced

        with gap_warnings_silenced():
            return fn(*args, **kwargs)
    return run


def _stem(position: str) -> str:
    return re.sub(r"[^A-Za-z0-9_]+", "-", position)


@_gap_said_once
def patch_experiment(
    model,
    pairs: Sequence[Any],
    out: str | Path,
    *,
    method: str = "both",
    sites: str | Sequence[str] = ("heads", "resid"),
    positions: str | Sequence[str] = "roles",
    direction: str = "denoise",
    top_k: int = 10,
    n_random: int = 10,
    ablation: str = "final",
    probe_table: str | Path | None = None,
    seed: int = 0,
    batch_pairs: int = 8,
    memory_mb: float = 1024,
    max_runs: int | None = DEFAULT_MAX_RUNS,
    dry_run: bool = False,
    chunk_runs: int = DEFAULT_CHUNK_RUNS,
    search_options: dict[str, Any] | None = None,
    fmt: str = "parquet",
    progress: bool = True,
    figures: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Run the whole patching experiment and write its tables, figures and summary under `out`.

    Prints the plan first (`--positions` syntax and defaults: `tomlens.patching.plan`); refuses a
    plan of more than `max_runs` patched runs (None: no limit); `dry_run` returns after the plan
    (`{"plan": ..., "dry_run": True}`) having written nothing. Finished chunks are checkpointed
    under `out/.partial/`, so calling again with the same arguments resumes. An unstable
    clean - corrupted gap is said once (printed, and in the summary's baselines).

    `figures`: a dict that also receives every plotly figure written, by file stem (for a report).
    """
    import torch

    from tomlens.activations.cache import weights_fingerprint
    from tomlens.patching.attribution import compare
    from tomlens.patching.checkpoints import Checkpoints
    from tomlens.patching.heads import (
        AblationSweep, HeadSetSweep, head_table, mean_ablation, rank_heads, topk_recovery, topk_settings,
    )
    from tomlens.io import read_table, write_json, write_table
    from tomlens.patching.metric import METRIC_NAME, gap_note
    from tomlens.patching.engine import ExactSweep, canonical_kind, plan_cells, prepare_pairs
    from tomlens.patching.plan import (
        AttributionSweep, Plan, calibrate, drop_missing_roles, parse_positions, plan_stages,
    )
    from tomlens.report.patching import (
        attribution_scatter, head_heatmap, position_heatmap, recovery_curve, resid_heatmap, write_figure,
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
    kinds = list(dict.fromkeys(canonical_kind(s) for s in site_list))
    if top_k < 0:
        raise TomlensError(f"--top-k {top_k} is negative", "pass 0 to skip top-k experiments, or a positive K")
    if n_random < 0:
        raise TomlensError(f"--n-random {n_random} is negative", "pass 0 for no random baseline, or a positive number")
    if max_runs is not None and max_runs < 0:
        raise TomlensError(f"--max-runs {max_runs} is negative", "pass the largest number of patched runs to allow")
    if chunk_runs < 1:
        raise TomlensError(f"--chunk-runs {chunk_runs} must be at least 1", "pass e.g. 1024")
    pos = parse_positions(positions, kinds)
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
    pos = drop_missing_roles(pos, [s for p in aligned for s in (p.clean, p.corrupted)])
    prepared = prepare_pairs(model, aligned, selectors=pos.selectors, batch_pairs=batch_pairs)
    cells = plan_cells(model, pos.spec, n_aligned=prepared.n_aligned)
    rank_position = pos.rank_position()
    out = Path(out)
    methods = ["exact", "attribution"] if method == "both" else [method]
    directions = ["denoise", "noise"] if direction == "both" else [direction]
    main_dir = directions[0]
    checkpoints = Checkpoints(out, {
        "provenance": provenance(model), "weights": weights_fingerprint(model), "pairs": pairs_hash(aligned),
        "positions": pos.spec, "methods": methods, "directions": directions, "top_k": top_k,
        "n_random": n_random, "ablation": ablation, "seed": seed, "batch_pairs": batch_pairs,
        "chunk_runs": chunk_runs, "search": search_options,
    })

    # Every stage laid out before anything runs: exact sweeps and attribution (with what the
    # checkpoints already hold), and top-k / ablation with stand-in top sets (same counts).
    exact = {d: ExactSweep(model, prepared, cells, d, memory_mb=memory_mb, chunk_runs=chunk_runs)
             for d in directions} if "exact" in methods else {}
    attribution = ({d: AttributionSweep(model, prepared, pos.spec, d) for d in directions}
                   if "attribution" in methods else {})
    for sweep in [*exact.values(), *attribution.values()]:
        sweep.load(checkpoints)
    topk_plan = ablation_plan = None
    k_max = min(top_k, model.cfg.n_layers * model.cfg.n_heads)
    if rank_position is not None and top_k > 0:
        stand_in = [s[3] for s in topk_settings(model, None, list(range(1, k_max + 1)), n_random, seed)]
        topk_plan = HeadSetSweep(model, prepared, stand_in, position=rank_position, direction=main_dir,
                                 chunk_runs=chunk_runs)
        if ablation != "none":
            ablation_plan = AblationSweep(model, prepared, stand_in, mode=ablation, chunk_runs=chunk_runs)

    def stages() -> list[Any]:
        return plan_stages(exact, attribution, topk_plan, ablation_plan, n_pairs=len(aligned), k_max=k_max,
                           n_random=n_random)
    plan = Plan(stages(), len(aligned), max_runs, notes=list(pos.notes))
    if rank_position is None and top_k > 0:
        plan.notes.append("top-k recovery and ablation need --sites to include heads; skipped")
    if "search" in methods:
        plan.notes.append("search (not counted above): attribution estimates of every cell, then exact patching of "
                          "the top-k per site and position, of every cell they cannot rule out (--search-budget) "
                          "and of --search-samples random others")
    if not dry_run and max_runs is not None and plan.total_runs > max_runs:
        print("\n".join(plan.lines()))
        plan.check_budget()
    calibrate(plan, exact, attribution, checkpoints, keep=not dry_run)
    if not dry_run:  # the timed chunk is part of the run: count it as done
        plan.stages = stages()
    print("\n".join(plan.lines()))
    if dry_run:
        if max_runs is not None and plan.total_runs > max_runs:
            print(f"note: over --max-runs {max_runs:,}: without --dry-run this plan stops before running")
        print("dry run: nothing else run, nothing written")
        return {"plan": plan.to_dict(), "dry_run": True}

    try:
        results: dict[tuple[str, str], Any] = {}
        for d in directions:
            for m in methods:
                if m == "exact":
                    exact[d].run(checkpoints=checkpoints, progress=progress)
                    res = exact[d].result()
                elif m == "attribution":
                    res = attribution[d].result(checkpoints, progress=progress)
                elif m == "search":
                    from tomlens.patching.search import search

                    res = search(model, prepared, sites=pos.spec, direction=d, k=top_k or 10, seed=seed,
                                 batch_pairs=batch_pairs, memory_mb=memory_mb, progress=progress,
                                 **(search_options or {}))
                res.seed = seed
                results[(m, d)] = res
        ranking_source = (results.get(("exact", main_dir)) or results.get(("attribution", main_dir))
                          or results.get(("search", main_dir)))
        rec = ab = ranking = None
        if rank_position is not None and ranking_source is not None:
            ranking = list(zip(*[rank_heads(ranking_source, position=rank_position)[c] for c in ("layer", "head")]))
            if top_k > 0:
                rec = topk_recovery(model, prepared, ranking, k_max=top_k, n_random=n_random, seed=seed,
                                    position=rank_position, direction=main_dir, memory_mb=memory_mb,
                                    progress=progress, checkpoints=checkpoints, chunk_runs=chunk_runs)
                if ablation != "none":
                    ab = mean_ablation(model, prepared, ranking, ks=list(range(1, top_k + 1)), n_random=n_random,
                                       seed=seed, mode=ablation, memory_mb=memory_mb, progress=progress,
                                       checkpoints=checkpoints, chunk_runs=chunk_runs)
    except KeyboardInterrupt:
        print(f"stopped: {checkpoints.count()} finished chunks kept under {checkpoints.folder}; "
              "run the same command again to resume", file=sys.stderr)
        raise

    # Every stage is complete: write the outputs, summary.json last (its presence marks a finished run).
    (out / "summary.json").unlink(missing_ok=True)
    figs = out / "figures"

    def _figure(fig: Any, stem: str) -> Path:
        if figures is not None:
            figures[stem] = fig
        return write_figure(fig, figs / f"{stem}.html")
    ext = ".parquet" if fmt == "parquet" else ".csv"
    files: list[str] = []
    for (m, d), res in results.items():
        files.append(str(write_table(res.summary(), out / f"cells_{m}_{d}{ext}")))
        files.append(str(write_table(res.per_pair(), out / f"pairs_{m}_{d}{ext}")))
        for p in pos.spec.get("head", ()):
            if p != "each":
                stem = f"heads_{m}_{d}" if p == rank_position else f"heads_{_stem(p)}_{m}_{d}"
                files.append(str(_figure(head_heatmap(res, p), stem)))
        for kind in kinds:
            if kind == "head":
                continue
            if "each" in pos.spec[kind]:
                files.append(str(_figure(resid_heatmap(res, kind), f"{kind}_{m}_{d}")))
            if any(p not in ("all", "each") for p in pos.spec[kind]):
                files.append(str(_figure(position_heatmap(res, kind), f"{kind}_positions_{m}_{d}")))

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
        "sites": kinds, "positions": {k: list(v) for k, v in pos.spec.items()}, "methods": methods,
        "directions": directions,
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
            if rank_position is not None:
                files.append(str(_figure(attribution_scatter(ex, at, rank_position), f"attribution_vs_exact_{d}")))

    if ranking is not None:
        found = results.get(("search", main_dir))  # its verified cells as exact, its estimates as attribution
        table = head_table(results.get(("exact", main_dir)) or (found and found.exact()),
                           results.get(("attribution", main_dir)) or (found and found.estimates.result()), probe,
                           position=rank_position)
        files.append(str(write_table(table, out / f"heads{ext}")))
        summary["rank_position"] = rank_position
        summary["top_heads"] = [f"L{l}H{h}" for l, h in ranking[: max(top_k, 10)]]
        summary["ranked_by"] = f"{ranking_source.method} {ranking_source.direction} effect, heads at {rank_position}"
    if rec is not None:
        files.append(str(write_table(rec.table, out / f"topk{ext}")))
        files.append(str(write_table(rec.draws, out / f"topk_random{ext}")))
        files.append(str(_figure(recovery_curve(rec.table), "topk_recovery")))
        summary["topk"] = rec.table.to_dict(orient="records")
    if ab is not None:
        files.append(str(write_table(ab.table, out / f"ablation{ext}")))
        files.append(str(write_table(ab.draws, out / f"ablation_random{ext}")))
        summary["ablation"] = {
            "mode": ablation,
            "mean": "each ablated head's z replaced by its mean over all clean and corrupted stories "
            + ("at the final token" if ablation == "final" else "at the same right-aligned position"),
            "baseline": ab.baseline, "table": ab.table.to_dict(orient="records"),
        }
    if rank_position is None and top_k > 0:
        summary["topk_skipped"] = "top-k recovery and ablation need --sites to include heads"
    if "search" in methods:
        summary["search"] = {d: r.report() for (m, d), r in results.items() if m == "search"}
    summary["plan"] = plan.to_dict()
    summary["seconds"] = round(time.time() - started, 2)
    summary["files"] = [str(Path(f).relative_to(out)) for f in files]
    write_json(summary, out / "summary.json")
    checkpoints.clear()
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
    model = load_model(args.model, revision=args.revision, device=args.device, dtype=args.dtype, seed=args.seed,
                       prepend_bos=args.prepend_bos)
    summary = patch_experiment(
        model, pairs, args.out, method=args.method, sites=args.sites, positions=args.positions,
        direction=args.direction, top_k=args.top_k, n_random=args.n_random, ablation=args.ablation,
        probe_table=args.probe_table, seed=args.seed, batch_pairs=args.batch_pairs,
        memory_mb=args.memory_mb, max_runs=args.max_runs, dry_run=args.dry_run, chunk_runs=args.chunk_runs,
        search_options={"budget": args.search_budget, "threshold": args.search_threshold,
                        "fn_samples": args.search_samples,
                        "graddrop": {"auto": None, "on": True, "off": False}[args.graddrop]},
        fmt=args.format, progress=not args.no_progress,
    )
    if summary.get("dry_run"):
        return 0
    b = next(iter(summary["baselines"].values()))
    print(f"{summary['pairs']['n_aligned']} pairs; logit diff clean {b['clean_logit_diff']:.3f}, "
          f"corrupted {b['corrupted_logit_diff']:.3f}")
    if "top_heads" in summary:
        print(f"top heads ({summary['ranked_by']}): {', '.join(summary['top_heads'][:10])}")
    for d, rep in summary.get("search", {}).items():
        for fn in rep["false_negatives"]:
            print(f"search ({d}, {fn['kind']} at {fn['position']}): {fn['n_verified_rule']} of {fn['n_cells']} cells "
                  f"patched by the rule, {fn['n_sampled']} sampled; false negatives: {fn['meaning']}")
    for c in summary["comparisons"]:
        if c["kind"] == "head" and c["position"] == summary.get("rank_position"):
            print(f"attribution vs exact ({c['direction']}): Spearman {c['spearman']:.2f}, "
                  f"top-{c['k']} overlap {c['topk_overlap']:.2f}")
    print(f"wrote {len(summary['files'])} files and summary.json under {args.out}")
    return 0
