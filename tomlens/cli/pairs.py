"""`tomlens pairs`: build clean/corrupted minimal pairs, keep those token-aligned for a model.

Only the model's tokenizer is used; the pairs file feeds `tomlens patch`. The report (how many
pairs aligned, and why each other pair was dropped) is printed and written beside the pairs.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tomlens.cli.options import add_prepend_bos
from tomlens.errors import TomlensError


def register(sub: argparse._SubParsersAction) -> None:
    from tomlens.stimuli.pairs import CONTRASTS, PAIR_FAMILIES

    contrasts = sorted({c for cs in CONTRASTS.values() for c in cs})
    p = sub.add_parser(
        "pairs",
        help="build false-belief / true-belief minimal pairs aligned for a model's tokenizer",
        description="Write the clean/corrupted pairs whose texts have the same number of tokens "
        "and differ only inside the contrast span; report every pair left out and why.",
    )
    p.add_argument("family", choices=PAIR_FAMILIES, help="stimulus family")
    p.add_argument("--model", default="smollm2-135m",
                   help="model whose tokenizer decides alignment (see `tomlens models`)")
    p.add_argument("--revision", default=None, help="hub commit, branch or tag to pin (hub ids only)")
    p.add_argument("--n", type=int, default=None,
                   help="tasks / items (default 20) or the first N BigToM stories (default all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--path", default=None, help="bigtom.csv (family `bigtom` only)")
    p.add_argument("--contrast", dest="contrasts", action="append", choices=contrasts,
                   default=None, help="control condition to pair with (repeatable; default: the "
                   "family's witnessed / informed controls)")
    p.add_argument("--set", dest="options", action="append", default=[], metavar="KEY=VALUE",
                   help="generator option, VALUE as JSON when it parses (e.g. --set 'ks=[0,6]')")
    p.add_argument("--out", required=True, help="output pairs file (JSONL)")
    add_prepend_bos(p)
    p.set_defaults(func=run)


def report_path(out: str | Path) -> Path:
    out = Path(out)
    return out.with_name(out.stem + ".report.json")


def run(args: argparse.Namespace) -> int:
    from tomlens.cli.stimuli import parse_options
    from tomlens.stimuli.pairs import align_pairs, make_pairs, write_pairs
    from tomlens.stimuli.records import stimuli_hash

    if args.family == "bigtom" and not args.path:
        raise TomlensError("`tomlens pairs bigtom` needs --path", "give the BigToM csv with --path")
    if args.family != "bigtom" and args.path:
        raise TomlensError(f"--path is for `bigtom`, not {args.family!r}", "drop --path")
    if args.n is not None and args.n < 1:
        raise TomlensError(f"--n {args.n} must be at least 1", "pass --n 1 or more")
    options = parse_options(args.options)
    if args.contrasts:
        options["contrasts"] = tuple(args.contrasts)
    if args.family == "bigtom":
        n = args.n
    else:
        n = 20 if args.n is None else args.n
    # Build and check the candidates before loading anything heavy, then align for the model.
    candidates, report = make_pairs(args.family, n, args.seed, tokenizer=None, path=args.path,
                                    **options)
    from tomlens.models import load_tokenizer
    from tomlens.models.tokens import bos_record

    # No weights: alignment only tokenizes. Align with the BOS rule `tomlens patch` will use.
    tokenizer = load_tokenizer(args.model, revision=args.revision, prepend_bos=args.prepend_bos)
    pairs, token_report = align_pairs(candidates, tokenizer)
    report.merge(token_report)
    print(report.summary())
    if not pairs:
        raise TomlensError(
            f"no {args.family} pair is token-aligned for {args.model}'s tokenizer",
            "see the reasons above; try another --contrast or family",
        )
    out = write_pairs(pairs, args.out)
    record = {
        **report.to_dict(), "model": args.model, "seed": args.seed, "n": n,
        "bos": bos_record(tokenizer, "tokenizer" if args.prepend_bos is None else "user"),
        "options": {k: list(v) if isinstance(v, tuple) else v for k, v in options.items()},
        "stimuli_hash": stimuli_hash([s for p in pairs for s in (p.clean, p.corrupted)]),
        "pairs_file": str(out),
    }
    rpath = report_path(out)
    tmp = rpath.with_name(rpath.name + ".tmp")
    tmp.write_text(json.dumps(record, indent=2))
    tmp.replace(rpath)
    print(f"wrote {len(pairs)} pairs to {out} and the report to {rpath}")
    return 0
