"""`tomlens behave`: score a model's answers on a stimulus file (both options' log-probs and how much of
the next word they get; with `--scoring first-word`, also Kosinski's first word of a greedy completion)."""

from __future__ import annotations

import argparse

from tomlens.cli.options import add_choice, add_model_options, add_progress, model_spec


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("behave", help="score both answer options of every prompt by log-probability")
    p.add_argument("--stimuli", required=True, help="stimulus file (JSONL or CSV)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--n-boot", type=int, default=1000,
                   help="bootstrap resamples of whole tasks for every interval (default 1000)")
    add_choice(p, "--scoring", choices=("logprob", "first-word"), default="logprob",
                   help="logprob: both options' log-probabilities (every family); first-word: also Kosinski's "
                        "scoring of unexpected-transfer and unexpected-contents, the first word of a greedy "
                        "completion, off-key answers wrong, and his strict rule over it")
    p.add_argument("--min-option-mass", type=float, default=None, metavar="P",
                   help="flag cells whose options get less than P of the next word's probability "
                        "(default 0.5: below it the model would more likely say neither option)")
    add_model_options(p)
    add_progress(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tomlens.runs import behaviour
    from tomlens.runs.base import StimuliSpec

    mass = {} if args.min_option_mass is None else {"min_option_mass": args.min_option_mass}
    config = behaviour.BehaviourConfig(model=model_spec(args), stimuli=(StimuliSpec(path=args.stimuli),),
                                       batch_size=args.batch_size, seed=args.seed, n_boot=args.n_boot,
                                       scoring=args.scoring, **mass)
    result = behaviour.run(config, progress=not args.no_progress)
    out = result.save(args.out)
    print(result.describe())
    print(f"wrote {out}/prompts.parquet and {out}/summary.json")
    from tomlens.report.experiment import write_stage_report

    print(f"wrote {write_stage_report('behaviour', result, out)}")
    return 0
