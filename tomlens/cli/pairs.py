"""`tomlens pairs`: build clean/corrupted minimal pairs, keep those token-aligned for a model.

Only the model's tokenizer is used; the pairs file feeds `tomlens patch`. The report (how many
pairs aligned, and why each other pair was dropped) is printed and written beside the pairs.
"""

from __future__ import annotations

import argparse

from tomlens.cli.options import add_choice, add_model_options


def register(sub: argparse._SubParsersAction) -> None:
    from tomlens.stimuli.pairs import CONTRASTS, PAIR_FAMILIES

    contrasts = sorted({c for cs in CONTRASTS.values() for c in cs})
    p = sub.add_parser(
        "pairs",
        help="build false-belief / true-belief minimal pairs aligned for a model's tokenizer",
        description="Write the clean/corrupted pairs whose texts have the same number of tokens "
        "and differ only inside the contrast span; report every pair left out and why.",
    )
    add_choice(p, "family", choices=PAIR_FAMILIES, what="pairs family", help="stimulus family")
    add_model_options(p, weights=False)  # only the tokenizer (and its BOS rule) decides alignment
    p.add_argument("--n", type=int, default=None,
                   help="tasks / items (default 20; kosoy and indirect-request 24, whole blocks of 8) "
                        "or the first N BigToM stories (default all)")
    p.add_argument("--path", default=None, help="bigtom.csv (family `bigtom` only)")
    add_choice(p, "--contrast", dest="contrasts", action="append", choices=contrasts, what="contrast",
               default=None, help="control condition to pair with (repeatable; default: the "
               "family's witnessed / informed controls)")
    p.add_argument("--set", dest="options", action="append", default=[], metavar="KEY=VALUE",
                   help="generator option, VALUE as JSON when it parses (e.g. --set 'ks=[0,6]')")
    p.add_argument("--out", required=True, help="output pairs file (JSONL)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tomlens.cli.options import model_spec
    from tomlens.cli.stimuli import parse_options
    from tomlens.runs.pairs import PairsConfig, report_path
    from tomlens.runs.pairs import run as run_pairs

    config = PairsConfig(model=model_spec(args), family=args.family, n=args.n, seed=args.seed, path=args.path,
                         contrasts=tuple(args.contrasts) if args.contrasts else None,
                         options=parse_options(args.options))
    result = run_pairs(config)
    print(result.describe())
    out = result.write_file(args.out)
    print(f"wrote {len(result.pairs)} pairs to {out} and the report to {report_path(out)}")
    return 0
