"""`tomlens behave`: score a model's answers on a stimulus file."""

from __future__ import annotations

import argparse

from tomlens.cli.options import add_model_options, add_progress, model_spec


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("behave", help="score both answer options of every prompt by log-probability")
    p.add_argument("--stimuli", required=True, help="stimulus file (JSONL or CSV)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--n-boot", type=int, default=1000,
                   help="bootstrap resamples of whole tasks for every interval (default 1000)")
    add_model_options(p)
    add_progress(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tomlens.runs import behaviour
    from tomlens.runs.base import StimuliSpec

    config = behaviour.BehaviourConfig(model=model_spec(args), stimuli=(StimuliSpec(path=args.stimuli),),
                                       batch_size=args.batch_size, seed=args.seed, n_boot=args.n_boot)
    result = behaviour.run(config, progress=not args.no_progress)
    out = result.save(args.out)
    print(result.describe())
    print(f"wrote {out}/prompts.parquet and {out}/summary.json")
    return 0
