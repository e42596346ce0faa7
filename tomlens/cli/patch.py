"""`tomlens patch`: activation and attribution patching over minimal pairs, heads that carry belief.

The flags make a `tomlens.runs.patching.PatchingConfig`; the run (plan, budget, dry run, checkpoints
and resume, the search) is `tomlens.runs.patching.run`, its figures `tomlens.report.patching`.
Prints the plan first; `--dry-run` stops there and writes nothing. The gate comes before the plan: when
no contrast's false-minus-true-belief gap is reliably positive, only the gate and the raw logit
differences are written and the message says what was withheld (`--force` runs everything, flagged).

Writes, under --out: the gate (`gate`), per-pair unpatched logit differences (`base`), per-cell tables (`cells_<method>_<direction>`), per-pair tables
(`pairs_<method>_<direction>`), the per-head table (`heads`), top-k recovery (`topk`,
`topk_random`), mean ablation (`ablation`, `ablation_random`), `config.json`, `manifest.json`,
`summary.json` with provenance and the plan, `result.json`, and HTML figures under `figures/`.
"""

from __future__ import annotations

import argparse

from tomlens.cli.options import add_choice, add_model_options, add_positions, add_progress, add_sites, model_spec
from tomlens.runs.patching import (
    ATTRIBUTION_PATHS,
    DEFAULT_ATTRIBUTION_PATH,
    DEFAULT_ATTRIBUTION_STEPS,
    DEFAULT_CHUNK_RUNS,
    DEFAULT_KS,
    DEFAULT_MAX_RUNS,
    DIRECTIONS,
    METHODS,
)


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
    add_model_options(p)
    p.add_argument("--pairs", required=True, help="minimal pairs file written by `tomlens pairs`")
    add_choice(p, "--method", choices=METHODS, default="both")
    add_sites(p, ("heads", "resid"),
              "site kinds, named as on cache and probe: head_out (each head; z patches the same), resid_pre, "
              "resid_mid, resid_post, attn_out, mlp_out, or the shorthands every command takes: heads = head_out, "
              "resid = resid_pre, attn = attn_out, mlp = mlp_out (default: heads resid)")
    add_positions(p, ("roles",),
                  "an item is a position for every site or SITE=POSITION for one. "
                  "roles (default): the final token, the contrast sentence's end and the question's "
                  "protagonist and object mentions (heads: without the contrast); all: every position "
                  "(heads/attn/mlp all at once, resid one at a time; the sweep before roles); each: one "
                  "cell per position for every site; or a selector (final, contrast, query_protagonist, "
                  "object:first, ...). E.g. --positions all, --positions roles,heads=contrast")
    add_choice(p, "--direction", choices=DIRECTIONS, default="denoise",
                   help="denoise: clean into corrupted; noise: corrupted into clean")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--top-k", type=int, default=10, help="K for top-k recovery and mean ablation (0: skip both)")
    p.add_argument("--n-random", type=int, default=200,
                   help="random head sets per k, each from the top set's layers (baseline)")
    p.add_argument("--ks", default=",".join(map(str, DEFAULT_KS)),
                   help="the k (up to --top-k) at which top-k recovery and ablation run, e.g. 1,2,3,5,10")
    p.add_argument("--select-fraction", type=float, default=0.5,
                   help="share of tasks whose pairs select and rank heads; the rest validate them (held out)")
    p.add_argument("--solved-only", action="store_true",
                   help="after the gate (which always sees every pair), patch only pairs the model answers right both "
                   "ways (clean: belief answer; corrupted: its own)")
    p.add_argument("--force", action="store_true",
                   help="run the sweeps, ranking and validations even when the gate fails (or pairs are too few to "
                   "split); every output is flagged FORCED")
    add_choice(p, "--ablation", choices=("final", "all", "none"), default="final",
                   help="mean-ablate at the final token, at every position, or skip")
    p.add_argument("--max-runs", type=int, default=DEFAULT_MAX_RUNS,
                   help=f"refuse a plan of more patched runs than this (default {DEFAULT_MAX_RUNS:,})")
    p.add_argument("--dry-run", action="store_true",
                   help="print the plan with its time (from one timed chunk) and exit without writing anything")
    p.add_argument("--chunk-runs", type=int, default=DEFAULT_CHUNK_RUNS,
                   help="patched runs per checkpointed chunk (a stopped run loses at most one chunk)")
    p.add_argument("--probe-table", default=None, help="probe sweep table (Parquet/CSV) for the per-head table")
    p.add_argument("--batch-pairs", type=int, default=8, help="pairs per cached group")
    p.add_argument("--memory-mb", type=float, default=1024.0, help="memory budget for one batched forward")
    add_choice(p, "--format", choices=("parquet", "csv"), default="parquet")
    add_progress(p)
    p.add_argument("--search-budget", type=int, default=None,
                   help="--method search: at most this many cells patched by its rule (default 4 x top-k per site "
                   "and position)")
    p.add_argument("--search-threshold", type=float, default=None,
                   help="--method search: also patch every cell whose estimates could reach this |effect|, and bound "
                   "false negatives at it (default: the top-k-th verified |effect|)")
    p.add_argument("--search-samples", type=int, default=10,
                   help="--method search: random left-out cells patched per site and position for the "
                   "false-negative bound")
    add_choice(p, "--graddrop", choices=("auto", "on", "off"), default="auto",
                   help="--method search: GradDrop (auto: when there are at least 10 cells per layer)")
    p.add_argument("--attribution-steps", type=int, default=DEFAULT_ATTRIBUTION_STEPS,
                   help="attribution: points on the path between the two stories (integrated gradients; 1 = plain "
                   f"attribution patching; default {DEFAULT_ATTRIBUTION_STEPS})")
    add_choice(p, "--attribution-path", choices=ATTRIBUTION_PATHS, default=DEFAULT_ATTRIBUTION_PATH,
                   help="what integrated gradients move: each patched hook point in turn at one patched position "
                   "(a layer's heads together), the blocks after it recomputed as exact patching does (sites), or the token "
                   "embeddings, one run per step but a chain of heads' effect shared out among them "
                   f"(embeddings); default {DEFAULT_ATTRIBUTION_PATH}")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tomlens.report.patching import write_patching_figures
    from tomlens.runs.patching import PatchingConfig, parse_ks
    from tomlens.runs.patching import run as run_patching

    config = PatchingConfig(
        model=model_spec(args), pairs_path=args.pairs, method=args.method, sites=tuple(args.sites),
        positions=tuple(args.positions), direction=args.direction, top_k=args.top_k, n_random=args.n_random,
        ablation=args.ablation, probe_table=args.probe_table, seed=args.seed, batch_pairs=args.batch_pairs,
        memory_mb=args.memory_mb, max_runs=args.max_runs, dry_run=args.dry_run, chunk_runs=args.chunk_runs,
        search_budget=args.search_budget, search_threshold=args.search_threshold,
        search_samples=args.search_samples, graddrop=args.graddrop, attribution_steps=args.attribution_steps,
        attribution_path=args.attribution_path,
        format=args.format,
        ks=parse_ks(args.ks), force=args.force, solved_only=args.solved_only, select_fraction=args.select_fraction,
    )
    result = run_patching(config, out=args.out, progress=not args.no_progress)
    if result.dry_run:
        return 0
    out = result.save(args.out)
    figures = {} if result.withheld else write_patching_figures(result, out)
    print(result.describe())
    print(f"wrote {len(result.summary.files)} tables, {len(figures)} figures and summary.json under {args.out}")
    from tomlens.report.experiment import write_stage_report

    print(f"wrote {write_stage_report('patching', result, out, figures)}")
    return 0
