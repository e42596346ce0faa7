"""`tomlens probe`: linear probes for every layer (and head) of a model on a stimulus file."""

from __future__ import annotations

import argparse

from tomlens.cli.options import (
    add_choice,
    add_model_options,
    add_positions,
    add_progress,
    add_renamed,
    add_sites,
    model_spec,
    split_items,
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "probe",
        help="train linear probes on every layer and head (belief vs world state)",
        description="Cache the activations that are missing, train one probe per layer and per "
        "layer x head on grouped folds (no story on both sides), and write a tidy table with 95% "
        "intervals over held-out stories, controls and baselines, the probe directions (safetensors) "
        "and a per-layer figure (standalone HTML). The best unit is also chosen on a selection half "
        "of the stories and scored on the other half, with a max-statistic permutation null; that "
        "held-out score and its verdict (found, or withheld with the reason) lead the output. A unit whose probe "
        "cannot be fitted (NaN activations, a failed solve) keeps its rows with NaN scores and a "
        "fit_status reason; one line says how many and why. Before fitting it prints its plan: the fits of "
        "each stage and the estimated time; --budget-minutes refuses a plan over budget.",
    )
    p.add_argument("--stimuli", required=True, help="stimulus file (JSONL or CSV)")
    p.add_argument("--targets", nargs="+", default=["protagonist_belief"],
                   help="targets: protagonist_belief world_state joint statement_literal statement_protagonist "
                   "statement_world (default: protagonist_belief)")
    add_renamed(p, "--target", "--targets", nargs="+")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--test-stimuli", default=None,
                   help="a second stimulus file to test on (train on --stimuli, test here)")
    add_sites(p, ["resid_post", "head_out"],
              "site kinds to probe, every layer of each: resid_pre resid_mid resid_post attn_out mlp_out z "
              "head_out, or patch's shorthands heads (head_out), resid (resid_pre), attn, mlp "
              "(default: resid_post head_out)")
    add_positions(p, ["final"], "the one token position to probe at (default: final)")
    add_choice(p, "--probe", default="logistic", choices=["logistic", "mass_mean"])
    p.add_argument("--store", default=None, help="activation store root (default: the tomlens cache dir)")
    p.add_argument("--folds", type=int, default=5, help="outer grouped folds (default 5)")
    p.add_argument("--inner-folds", type=int, default=3, help="grouped folds for choosing C (default 3)")
    add_choice(p, "--evaluation", default="crossfit", choices=["crossfit", "holdout"],
                   help="crossfit: every story held out once; holdout: one held-out fold")
    add_choice(p, "--group-by", default="task", choices=["task", "template", "cue"],
                   help="keep whole tasks (or whole templates, or cue phrasings, too) on one side of every split")
    p.add_argument("--c-grid", nargs="+", type=float, default=None,
                   help="inverse regularisation strengths to choose from (default 0.001 ... 10)")
    p.add_argument("--n-boot", type=int, default=1000, help="bootstrap replicates (default 1000)")
    p.add_argument("--no-controls", action="store_true", help="skip the type-level control task")
    p.add_argument("--no-bow", action="store_true", help="skip the bag-of-words baseline")
    p.add_argument("--no-conditions", action="store_true",
                   help="skip train-on-true-belief / test-on-false-belief generalisation")
    p.add_argument("--no-selection", action="store_true",
                   help="skip choosing the unit on selection stories and reporting it on held-out evaluation "
                   "stories (then only the selection-biased per-unit maxima are printed)")
    p.add_argument("--select-fraction", type=float, default=0.5,
                   help="fraction of the story groups used to choose the unit (default 0.5)")
    add_renamed(p, "--selection-fraction", "--select-fraction", type=float)
    p.add_argument("--n-permutations", type=int, default=None, metavar="N",
                   help="permutations of the max-statistic null for the best unit (default 1000; 0 skips "
                   "it, and the verdict is then withheld). Its cost is about one ridge fit per unit and "
                   "fold whatever N is (one solve serves every permutation; the time is in the notes). "
                   "The smallest p_max is 1 / (N + 1): with N <= 19 it can never be below 0.05, so no "
                   "unit can be found (a note says so)")
    add_renamed(p, "--permutations", "--n-permutations", type=int, metavar="N")
    p.add_argument("--random-twin", action=argparse.BooleanOptionalAction, default=True,
                   help="also cache and sweep random:MODEL (same architecture, fresh weights, same seed) "
                   "and add its score as the baseline_random_init column (default on; --no-random-twin "
                   "skips it)")
    p.add_argument("--budget-minutes", type=float, default=None, metavar="M",
                   help="refuse, before any fit, a plan whose estimated time is over M minutes (default 60; "
                   "0 or less: no limit). The plan (fits per stage and the estimate, from one small timed fit "
                   "per site kind) is printed before fitting either way")
    add_choice(p, "--format", default="parquet", choices=["parquet", "csv"], help="table format")
    p.add_argument("--batch-size", type=int, default=None, help="prompts per forward when caching")
    add_model_options(p)
    add_progress(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tomlens.report.layers import write_probe_figures
    from tomlens.runs import probes
    from tomlens.runs.base import StimuliSpec

    config = probes.ProbesConfig(
        model=model_spec(args), stimuli=StimuliSpec(path=args.stimuli),
        test_stimuli=StimuliSpec(path=args.test_stimuli) if args.test_stimuli else None,
        targets=tuple(args.targets), sites=tuple(split_items(args.sites)),
        positions=tuple(split_items(args.positions)), probe=args.probe, store=args.store, folds=args.folds,
        inner_folds=args.inner_folds, evaluation=args.evaluation, group_by=args.group_by,
        c_grid=tuple(args.c_grid) if args.c_grid else None, n_boot=args.n_boot, controls=not args.no_controls,
        bow=not args.no_bow, conditions=not args.no_conditions, batch_size=args.batch_size, seed=args.seed,
        format=args.format, selection=not args.no_selection, select_fraction=args.select_fraction,
        n_permutations=probes.DEFAULT_PERMUTATIONS if args.n_permutations is None else args.n_permutations,
        random_twin=args.random_twin,
        budget_minutes=probes.DEFAULT_BUDGET_MINUTES if args.budget_minutes is None
        else (args.budget_minutes if args.budget_minutes > 0 else None))
    result = probes.run(config, progress=not args.no_progress, out=args.out)  # a killed run resumes its fits
    out = result.save(args.out)
    figures = write_probe_figures(result.table, out, selection=result.selection)
    print(result.describe())
    print("wrote " + ", ".join(str(f) for f in [*result.files(out), *(out / f"{stem}.html" for stem in figures)]))
    from tomlens.report.experiment import write_stage_report

    print(f"wrote {write_stage_report('probes', result, out, figures)}")
    return 0
