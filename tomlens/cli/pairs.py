"""`tomlens pairs`: build clean/corrupted minimal pairs, keep those token-aligned for a model.

Only the model's tokenizer is used; the pairs file feeds `tomlens patch`. The report (how many
pairs aligned, and why each other pair was dropped) is printed and written beside the pairs.
`tomlens pairs user --path my.jsonl` pairs a researcher's own false- and true-belief stories
(`tomlens.stimuli.user_pairs`): role-aligned, so the report also says which role spans each story
carries. `--contrast` is free-form there (the file's own conditions), so it is checked when the
config is built (`PairsConfig`), not as a closed set of the parser.
"""

from __future__ import annotations

import argparse

from tomlens.cli.options import add_choice, add_model_options


def register(sub: argparse._SubParsersAction) -> None:
    from tomlens.stimuli.pairs import CONTRASTS, PAIR_FAMILIES

    contrasts = sorted({c for cs in CONTRASTS.values() for c in cs})
    shown = "{" + ",".join(contrasts) + ",...}"
    p = sub.add_parser(
        "pairs",
        help="build false-belief / true-belief minimal pairs aligned for a model's tokenizer",
        description="Write the clean/corrupted pairs whose texts have the same number of tokens "
        "and differ only inside the contrast span; report every pair left out and why. "
        "`tomlens pairs user --path my.jsonl` pairs your own false- and true-belief stories "
        "(rows grouped by task_id; they may differ in length and wording: role-aligned pairs, "
        "patched at role positions); see docs/stimulus-format.md.",
    )
    add_choice(p, "family", choices=PAIR_FAMILIES, what="pairs family", help="stimulus family")
    add_model_options(p, weights=False)  # only the tokenizer (and its BOS rule) decides alignment
    p.add_argument("--n", type=int, default=None,
                   help="tasks / items (default 20; kosoy and indirect-request 24, whole blocks of 8), "
                        "the first N BigToM stories or the first N tasks of your file (default all)")
    p.add_argument("--path", default=None,
                   help="bigtom.csv (family `bigtom`) or your stimulus file, JSONL or CSV (family `user`)")
    p.add_argument("--contrast", dest="contrasts", action="append", default=None, metavar=shown,
                   help="control condition to pair with (repeatable; default: the family's witnessed / "
                   "informed controls; for `user` any condition your file has, default true_belief)")
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
