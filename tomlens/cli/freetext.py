"""`tomlens freetext`: EPITOME's free-text tasks. `answer` generates greedy answers and the coding
sheet, `score` turns the filled sheet into the summary, `items` lists what can be asked. The work is
in `tomlens.runs.freetext`."""

from __future__ import annotations

import argparse

from tomlens.cli.options import add_choice, add_model_options, add_progress, model_spec, split_items


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("freetext", help="EPITOME's Short Story / Strange Stories: answer, code by hand, score")
    actions = p.add_subparsers(dest="action", required=True)

    a = actions.add_parser("answer", help="greedy answers + a coding sheet with the rubric for a human coder")
    add_choice(a, "--family", required=True, choices=["short-story", "strange-stories", "all"], what="free-text family")
    a.add_argument("--out", required=True, help="output directory (answers.csv, coding.csv, config.json, manifest.json, "
                   "result.json)")
    a.add_argument("--max-new-tokens", type=int, default=48, help="longest answer in tokens (default 48)")
    a.add_argument("--items", nargs="+", default=[],
                   help="only these items: ids or 1-based positions (space- or comma-separated); default all")
    add_model_options(a)
    add_progress(a)
    a.set_defaults(func=answer)

    s = actions.add_parser("score", help="the summary from a filled coding sheet")
    s.add_argument("sheet", help="the coding.csv written by `answer`, with `code` filled on every row")
    s.add_argument("--out", required=True, help="output directory (summary.csv, score.json)")
    s.add_argument("--n-boot", type=int, default=1000, help="bootstrap resamples for the intervals (default 1000)")
    s.add_argument("--seed", type=int, default=0, help="bootstrap seed")
    s.set_defaults(func=score)

    i = actions.add_parser("items", help="list the items (position, id, question type, question)")
    add_choice(i, "--family", required=True, choices=["short-story", "strange-stories", "all"], what="free-text family")
    i.set_defaults(func=items)


def answer(args: argparse.Namespace) -> int:
    from tomlens.runs import freetext

    config = freetext.FreeTextConfig(model=model_spec(args), family=args.family,
                                     items=tuple(split_items(args.items)), max_new_tokens=args.max_new_tokens,
                                     seed=args.seed)
    result = freetext.run(config, progress=not args.no_progress)
    out = result.save(args.out)
    print(f"wrote {out}/{freetext.ANSWERS}, {out}/{freetext.CODING} and {out}/manifest.json")
    print(result.describe(out))
    return 0


def score(args: argparse.Namespace) -> int:
    from tomlens.runs import freetext

    if args.n_boot < 1:
        from tomlens.errors import TomlensError

        raise TomlensError(f"--n-boot {args.n_boot} must be at least 1", "use e.g. --n-boot 1000")
    _, summary = freetext.score_sheet(args.sheet, n_boot=args.n_boot, seed=args.seed)
    path = freetext.save_scores(summary, args.sheet, args.out, n_boot=args.n_boot, seed=args.seed)
    shown = summary.astype(object).where(summary.notna(), "")
    print(shown.to_string(index=False))
    print(f"wrote {path}")
    return 0


def items(args: argparse.Namespace) -> int:
    from tomlens.runs import freetext

    for k, it in enumerate(freetext.family_items(args.family), start=1):
        print(f"{k:>3}  {it.id:<14}{it.question_type:<15}{it.question}")
    return 0
