"""`tomlens store`: what the activation store holds (`ls`), how much room it takes (`du`), and
removing entries (`prune`), so a researcher can keep the cache that runs reuse within bounds."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "store", help="list, size and prune the activation store",
        description="Manage the content-addressed activation store (default $TOMLENS_HOME/activations). "
        "Removing an entry never loses a result: run folders keep their own tables, and a run that "
        "needs the entry again recomputes it.")
    parser.add_argument("--store", default=None, help="store root (default: $TOMLENS_HOME/activations or the user cache dir)")
    actions = parser.add_subparsers(dest="action", required=True)
    actions.add_parser("ls", help="one line per entry: key, model, prompts, sites, date, size")
    actions.add_parser("du", help="the store's size, in all and per model")
    prune = actions.add_parser("prune", help="remove entries picked by age, by run or by state (criteria combine)")
    prune.add_argument("--older-than", default=None, metavar="AGE",
                       help="entries written longer ago than AGE (e.g. 30d, 12h, 2w; days when no unit)")
    prune.add_argument("--run", default=None, metavar="FOLDER",
                       help="the entries a run folder read or wrote (named in its JSON files)")
    prune.add_argument("--incomplete", action="store_true", help="unfinished entries (a killed cache's folder)")
    prune.add_argument("--all", action="store_true", help="every entry")
    prune.add_argument("--dry-run", action="store_true", help="say what would be removed; remove nothing")
    parser.set_defaults(func=run)


def _root(args: argparse.Namespace) -> Path:
    from tomlens.activations.store import default_store

    return Path(args.store) if args.store else default_store()


def _list(root: Path) -> int:
    from tomlens.activations.housekeeping import human_bytes, list_entries

    entries = list_entries(root)
    if not entries:
        print(f"{root}: no entries")
        return 0
    for e in entries:
        when = e.created.strftime("%Y-%m-%d %H:%M") if e.created else "?"
        state = "" if e.complete else "  [unfinished]"
        print(f"{e.key}  {when}  {human_bytes(e.bytes):>9}  {e.model}  {e.rows} prompts  {e.sites}  @ {e.positions}{state}")
    print(f"{len(entries)} entries, {human_bytes(sum(e.bytes for e in entries))} in {root}")
    return 0


def _usage(root: Path) -> int:
    from tomlens.activations.housekeeping import human_bytes, list_entries, usage_by_model

    entries = list_entries(root)
    for u in usage_by_model(entries):
        print(f"{human_bytes(u.bytes):>9}  {u.entries:>4} entries  {u.model}")
    print(f"{human_bytes(sum(e.bytes for e in entries)):>9}  {len(entries):>4} entries  in all ({root})")
    return 0


def _prune(root: Path, args: argparse.Namespace) -> int:
    from tomlens.activations.housekeeping import (
        human_bytes,
        list_entries,
        parse_age,
        remove_entries,
        select_for_pruning,
        store_folders_named_in,
    )

    older = parse_age(args.older_than) if args.older_than is not None else None
    run_keys = store_folders_named_in(Path(args.run), root) if args.run else None
    picked = select_for_pruning(list_entries(root), older_than=older, run_keys=run_keys,
                                incomplete=args.incomplete, everything=args.all)
    size = human_bytes(sum(e.bytes for e in picked))
    if args.dry_run:
        for e in picked:
            print(f"would remove {e.key}  {e.model}  {human_bytes(e.bytes)}")
        print(f"dry run: {len(picked)} entries ({size}) would be removed; nothing removed")
        return 0
    removed, busy = remove_entries(picked)
    for e in busy:
        print(f"kept {e.key}: another process is writing it")
    print(f"removed {len(removed)} entries ({human_bytes(sum(e.bytes for e in removed))}) from {root}")
    return 0


def run(args: argparse.Namespace) -> int:
    root = _root(args)
    if args.action == "ls":
        return _list(root)
    if args.action == "du":
        return _usage(root)
    return _prune(root, args)
