"""`tomlens behave`: score a model's answers on a stimulus file."""

from __future__ import annotations

import argparse

from tomlens.cli.options import add_prepend_bos
from tomlens.errors import TomlensError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("behave", help="score both answer options of every prompt by log-probability")
    p.add_argument("--model", default="smollm2-135m", help="model name (see `tomlens models`)")
    p.add_argument("--revision", default=None, help="hub commit, branch or tag to pin (hub ids only)")
    p.add_argument("--stimuli", required=True, help="stimulus file (JSONL or CSV)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--device", default=None)
    p.add_argument("--seed", type=int, default=0)
    add_prepend_bos(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tomlens.runs.behaviour import run_behaviour, write_behaviour
    from tomlens.models import load_model
    from tomlens.stimuli import read_jsonl

    stimuli = read_jsonl(args.stimuli)
    if not stimuli:
        raise TomlensError(f"{args.stimuli} has no stimuli", "write stimuli into it first, e.g. `tomlens stimuli ...`")
    model = load_model(args.model, revision=args.revision, device=args.device, prepend_bos=args.prepend_bos)
    result = run_behaviour(model, stimuli, batch_size=args.batch_size, seed=args.seed)
    out = write_behaviour(result, args.out)
    print(format_accuracy(result.accuracy))
    if len(result.strict):
        print(result.strict.to_string(index=False))
    print(f"wrote {out}/prompts.parquet and {out}/summary.json")
    return 0


def format_accuracy(acc) -> str:  # noqa: ANN001 - a DataFrame from aggregates.accuracy_table
    lines = [f"{'family':<22}{'condition':<16}{'prompt':<9}{'n':>5}  accuracy [95% CI]"]
    for r in acc.itertuples():
        lines.append(f"{r.family:<22}{r.condition:<16}{r.prompt_type:<9}{r.n:>5}  "
                     f"{r.accuracy:.2f} [{r.ci_low:.2f}, {r.ci_high:.2f}]")
    return "\n".join(lines)
