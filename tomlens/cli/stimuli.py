"""`tomlens stimuli`: generate a stimulus family, load BigToM, or check and convert a user file."""

from __future__ import annotations

import argparse
import json
from collections import Counter
from collections.abc import Sequence
from typing import Any

from tomlens.cli.options import add_choice
from tomlens.errors import TomlensError
from tomlens.stimuli.records import Stimulus

FILE_FAMILIES: tuple[str, ...] = ("bigtom", "user")


def _families() -> list[str]:
    from tomlens.stimuli import FAMILIES

    return [*FAMILIES, *FILE_FAMILIES]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "stimuli",
        help="generate stimuli (or read BigToM / a user file) and write them as JSONL",
        description="Write stimuli as JSONL and print a one-line summary "
        "(count per condition x prompt type).",
    )
    add_choice(p, "family", choices=_families(), what="stimulus family", help="stimulus family")
    p.add_argument("--n", type=int, default=None,
                   help="tasks / items, each rendered in every condition (generated families; "
                   "default 20), the first N stories (bigtom) or rows (user); default all")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--path", default=None, help="input file for `bigtom` (bigtom.csv) and `user`")
    p.add_argument("--out", default=None,
                   help="output JSONL file; without it the stimuli are only checked and summarised")
    p.add_argument("--set", dest="options", action="append", default=[], metavar="KEY=VALUE",
                   help="a family option, VALUE as JSON when it parses (e.g. --set 'ks=[0,6]' "
                   "--set orders=[1,2] --set include_initial_belief=true); repeatable")
    p.set_defaults(func=run)


def parse_options(items: Sequence[str]) -> dict[str, Any]:
    """`KEY=VALUE` strings -> keyword arguments; VALUE is JSON when it parses, else a string."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key.isidentifier():
            raise TomlensError(f"--set {item!r} is not KEY=VALUE", "e.g. --set 'ks=[0,6]'")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        out[key] = tuple(value) if isinstance(value, list) else value
    return out


def summary(stimuli: Sequence[Stimulus]) -> str:
    """'N stimuli (condition/prompt_type=count, ...)'."""
    counts = Counter((s.condition or "-", s.prompt_type) for s in stimuli)
    cells = ", ".join(f"{c}/{p}={k}" for (c, p), k in sorted(counts.items()))
    return f"{len(stimuli)} stimuli ({cells})"


def load(args: argparse.Namespace) -> list[Stimulus]:
    from tomlens.stimuli import check_options, generate
    from tomlens.stimuli.bigtom import load_bigtom
    from tomlens.stimuli.user import load_user_file

    options = parse_options(args.options)
    if args.family in FILE_FAMILIES:
        if not args.path:
            raise TomlensError(f"`tomlens stimuli {args.family}` needs --path",
                               "give the input file with --path FILE")
        if args.family == "user":
            if options:
                raise TomlensError("`tomlens stimuli user` takes no --set options",
                                   "drop the --set arguments")
            stimuli = load_user_file(args.path)
            return stimuli[: args.n] if args.n is not None else stimuli
        if args.n is not None:
            options["limit"] = args.n
        check_options("bigtom", options, reserved=("path",))
        return load_bigtom(args.path, **options)
    if args.path:
        raise TomlensError(f"--path is for `bigtom` and `user`, not {args.family!r}",
                           "drop --path")
    n = 20 if args.n is None else args.n
    check_options(args.family, options)
    return generate(args.family, n=n, seed=args.seed, **options)


def run(args: argparse.Namespace) -> int:
    from tomlens.stimuli.records import stimuli_hash, write_jsonl

    stimuli = load(args)
    if not stimuli:
        raise TomlensError(f"{args.family}: no stimuli produced", "check --n and the options")
    line = f"{args.family}: {summary(stimuli)} hash {stimuli_hash(stimuli)}"
    if args.out:
        path = write_jsonl(stimuli, args.out)
        line += f" -> {path}"
    print(line)
    return 0
