"""`tomlens audit`: can a reader who tracks nobody's mind tell the set's contrasts apart?

`tomlens audit FAMILY` generates the family (64 tasks unless `--n`), `tomlens audit FILE` reads a
user's JSONL or CSV (`bigtom --path CSV` reads BigToM); the table lists every contrast x heuristic
row with its held-out accuracy, interval and chance, and a last line gives the verdict. `--check`
exits 1 when a shortcut explains a contrast (for CI over a user's stimulus files).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from tomlens.errors import TomlensError

DEFAULT_TASKS = 64  # the floor for a verdict: fewer tasks give intervals too wide to mean much


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("audit", help="run the shortcut battery on a stimulus family or file",
                       description="Score text heuristics (n-gram bags, length, option order and mentions, "
                       "presence/absence cues, the family's own rules) on every contrast of a set, "
                       "with task-held-out folds, and say which contrasts a shortcut explains.")
    p.add_argument("source", help="a family name (see `tomlens stimuli --help`), `bigtom` with --path, "
                   "or a stimulus file (.jsonl / .csv)")
    p.add_argument("--n", type=int, default=None, help=f"tasks of a generated family (default {DEFAULT_TASKS}); "
                   "the first N rows of a file or stories of BigToM (default all)")
    p.add_argument("--seed", type=int, default=0, help="the generator's seed (a fresh seed is a fair test)")
    p.add_argument("--path", default=None, help="BigToM's csv, for `tomlens audit bigtom`")
    p.add_argument("--set", dest="options", action="append", default=[], metavar="KEY=VALUE",
                   help="a family option, as for `tomlens stimuli`; repeatable")
    p.add_argument("--per-task", type=int, default=None, metavar="K",
                   help="audit at most K rows of each task (quicker on large sets; tasks stay the unit)")
    p.add_argument("--fold-seed", type=int, default=0, help="how tasks are dealt into folds")
    p.add_argument("--alpha", type=float, default=0.05, help="the battery's family-wise error (default 0.05)")
    p.add_argument("--out", default=None, help="also write the report as JSON here")
    p.add_argument("--check", action="store_true", help="exit with status 1 when a shortcut is found")
    p.set_defaults(func=run)


def load_source(args: argparse.Namespace) -> list:
    """The stimuli named by `source`: a family, BigToM, or a file."""
    from tomlens.cli.stimuli import parse_options
    from tomlens.stimuli import FAMILIES, check_options, generate, load_bigtom, read_jsonl

    options = parse_options(args.options)
    if args.source == "bigtom":
        if not args.path:
            raise TomlensError("`tomlens audit bigtom` needs --path", "give BigToM's csv with --path FILE")
        return load_bigtom(args.path, limit=args.n, **options)
    if args.source in FAMILIES:
        check_options(args.source, options)
        return generate(args.source, n=args.n or DEFAULT_TASKS, seed=args.seed, **options)
    path = Path(args.source)
    if not path.is_file():
        raise TomlensError(f"{args.source!r} is neither a stimulus family nor a file",
                           f"use one of {', '.join(FAMILIES)}, bigtom --path CSV, or a .jsonl/.csv path")
    if options:
        raise TomlensError("a stimulus file takes no --set options", "drop the --set arguments")
    stimuli = read_jsonl(path)
    return stimuli if args.n is None else stimuli[: args.n]


def _progress(started: float):  # noqa: ANN202
    step = {"next": 0.0}

    def report(done: int, total: int, what: str) -> None:
        if done / total >= step["next"] or done == total:
            left = (time.monotonic() - started) / done * (total - done)
            print(f"  [{done}/{total}] {what} (about {left:.0f} s left)", file=sys.stderr, flush=True)
            step["next"] = done / total + 0.1

    return report


def run(args: argparse.Namespace) -> int:
    from tomlens.audit import audit_stimuli, sample_per_task

    stimuli = load_source(args)
    if args.per_task is not None:
        stimuli = sample_per_task(stimuli, args.per_task, seed=args.fold_seed)
    tasks = len({s.task_id or s.id for s in stimuli})
    families = sorted({s.family for s in stimuli})
    print(f"auditing {len(stimuli)} prompts of {tasks} tasks ({', '.join(families)}): every contrast x "
          f"heuristic, {min(5, tasks)} task-held-out folds; about {max(1, len(stimuli) // 40)} s on one core",
          file=sys.stderr, flush=True)
    report = audit_stimuli(stimuli, seed=args.fold_seed, alpha=args.alpha, progress=_progress(time.monotonic()))
    print(report.table())
    if args.out:
        print(f"wrote {report.write(args.out)}", file=sys.stderr)
    return 1 if args.check and report.shortcuts else 0
