"""`tomlens validate`: the method checks on a model, each with its number, threshold and pass/fail.

The flags make a `tomlens.runs.validate.ValidateConfig`; the run is `tomlens.runs.validate.run`.
Exit codes: 0 when every check passes, 1 when one fails, 2 on bad input (a TomlensError).
"""

from __future__ import annotations

import argparse
from dataclasses import fields

from tomlens.cli.options import add_choice, add_model_options, add_progress, add_renamed, model_spec
from tomlens.runs.patching import ATTRIBUTION_PATHS, DEFAULT_ATTRIBUTION_PATH, DEFAULT_ATTRIBUTION_STEPS

# flag -> (Thresholds field, help)
THRESHOLD_FLAGS: dict[str, tuple[str, str]] = {
    "--min-probe": ("min_probe", "held-out probe accuracy needed (default 0.95)"),
    "--max-bow": ("max_bow", "largest bag-of-words accuracy that counts as chance (default 0.6)"),
    "--min-recovery": ("min_recovery", "share of the gap the top-k heads must recover (default 0.8)"),
    "--max-random-recovery": ("max_random_recovery", "largest mean recovery of random head sets (default 0.2)"),
    "--min-spearman": ("min_spearman", "attribution vs exact patching, Spearman over the heads that move the "
                       "metric by >= 1%% of the gap (default 0.8)"),
    "--min-topk-overlap": ("min_topk_overlap", "share of exact patching's top-k heads that attribution's top-k "
                           "must hold (default 0.5)"),
    "--max-ablated-accuracy": ("max_ablated_accuracy",
                               "false-belief accuracy allowed with the top-k heads ablated (default 0.6)"),
    "--min-random-ablated-accuracy": ("min_random_ablated_accuracy",
                                      "false-belief accuracy needed with k random heads ablated (default 0.9)"),
    "--min-flip": ("min_flip", "share of false-belief answers the belief direction must flip (default 0.8)"),
    "--max-random-flip": ("max_random_flip", "largest mean flip rate of the norm-matched random directions "
                          "(default 0.1); the belief direction must also flip more than their 95th percentile. A "
                          "mean and a quantile, not the most-flipping direction: that maximum grows with the number "
                          "drawn (--n-random-directions), so a check on it would fail any model given enough draws"),
}


def _floats(text: str) -> tuple[float, ...]:
    from tomlens.runs.base import split_items

    return tuple(float(x) for x in split_items(text))


def _ints(text: str) -> tuple[int, ...]:
    from tomlens.runs.base import split_items

    return tuple(int(x) for x in split_items(text))


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "validate",
        help="run the method checks (probe, top-k heads, attribution, ablation, steering) with thresholds",
        description="Run the probe, patching and steering stages on order-only stories and judge five checks: "
        "a held-out belief probe with the bag of words at chance; top-k head recovery against layer-matched "
        "random heads; attribution vs exact patching; mean ablation of the top-k heads against random heads; "
        "steering along the belief direction against random directions (their mean and 95th percentile: every "
        "control is a mean or a quantile, which more random draws do not inflate, never a maximum). Prints each "
        "check with its number, threshold and PASS/FAIL, writes the table, and exits 0 only when every check "
        "passes (1 when one "
        "fails, 2 on bad input). The plan (forward passes, rough time) is printed first.",
    )
    add_model_options(p)
    p.add_argument("--out", default=None, help="output directory (default: validate-<model>)")
    p.add_argument("--n-tasks", type=int, default=48, help="order-only tasks (default 48)")
    p.add_argument("--k", type=int, default=None, help="heads in the top set (default: 5%% of all heads, at least 1)")
    p.add_argument("--n-permutations", type=int, default=1000, help="probe permutation null (default 1000)")
    add_renamed(p, "--permutations", "--n-permutations", type=int)
    p.add_argument("--n-random-heads", type=int, default=200, help="layer-matched random head sets (default 200)")
    p.add_argument("--n-random-directions", type=int, default=20, help="random steering directions (default 20)")
    p.add_argument("--attribution-steps", type=int, default=DEFAULT_ATTRIBUTION_STEPS,
                   help=f"integrated-gradient steps of attribution (1 = plain attribution; default "
                   f"{DEFAULT_ATTRIBUTION_STEPS})")
    add_choice(p, "--attribution-path", choices=ATTRIBUTION_PATHS, default=DEFAULT_ATTRIBUTION_PATH,
                   help="what integrated gradients move: each layer's head outputs in turn at the patched token, every block after them "
                   "recomputed, as exact patching of a head does (sites), "
                   f"or the token embeddings (embeddings); default {DEFAULT_ATTRIBUTION_PATH}")
    p.add_argument("--select-fraction", type=float, default=0.5, help="share of tasks that select (default 0.5)")
    p.add_argument("--head-position", default="final", help="where heads are patched and ranked (default final)")
    add_choice(p, "--ablation", choices=("final", "all"), default="final", help="mean ablation positions")
    p.add_argument("--layers", type=_ints, default=None, help="steering layers, e.g. 2,3 (default: the stage's)")
    p.add_argument("--depths", type=_floats, default=None,
                   help="steering layers as fractions of the depth, e.g. 0.25,0.5,0.75 (the same places in "
                   "models of different depth; not with --layers)")
    p.add_argument("--alphas", type=_floats, default=None, help="steering alphas, written --alphas=-4,-2,0,2,4 (with \"=\": a leading minus would read as a flag)")
    p.add_argument("--store", default=None, help="activation store root (default: the tomlens cache dir)")
    p.add_argument("--batch-size", type=int, default=None, help="prompts per forward when caching")
    add_choice(p, "--format", choices=("csv", "parquet"), default="csv", help="table format (default csv)")
    for flag, (_, text) in THRESHOLD_FLAGS.items():
        p.add_argument(flag, type=float, default=None, help=text)
    add_progress(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tomlens.runs.validate import Thresholds, ValidateConfig
    from tomlens.runs.validate import run as run_validate

    defaults = {f.name: f.default for f in fields(Thresholds)}
    given = {name: getattr(args, flag[2:].replace("-", "_")) for flag, (name, _) in THRESHOLD_FLAGS.items()}
    thresholds = Thresholds(**{**defaults, **{k: v for k, v in given.items() if v is not None}})
    config = ValidateConfig(
        model=model_spec(args), n_tasks=args.n_tasks, thresholds=thresholds, k=args.k, seed=args.seed,
        select_fraction=args.select_fraction, n_permutations=args.n_permutations,
        n_random_heads=args.n_random_heads, n_random_directions=args.n_random_directions,
        attribution_steps=args.attribution_steps, attribution_path=args.attribution_path,
        head_position=args.head_position, ablation=args.ablation, steering_layers=args.layers,
        steering_depths=args.depths, alphas=args.alphas,
        store=args.store, batch_size=args.batch_size, format=args.format)
    out = args.out or "validate-" + "".join(c if c.isalnum() or c in "-_." else "-" for c in args.model)
    result = run_validate(config, progress=not args.no_progress)
    folder = result.save(out)
    print(result.describe())
    print(f"wrote checks.{config.format}, checks.json and the stages' folders under {folder}")
    return result.exit_code
