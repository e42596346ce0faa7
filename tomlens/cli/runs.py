"""`tomlens runs`: the runs this machine has made (from the index every finished save appends to),
newest first, with their models, stages, verdict, size and date."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "runs", help="list past runs: name, model, stages, verdict, size, date",
        description="List the runs recorded in $TOMLENS_HOME/runs.jsonl (every finished stage is), "
        "grouped by experiment, newest first; folders deleted since are dropped from the list.")
    parser.add_argument("folders", nargs="*", type=Path,
                        help="also list finished runs found under these folders (e.g. runs made elsewhere)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tomlens.activations.housekeeping import human_bytes
    from tomlens.runs.index import index_path, list_runs

    entries = list_runs(args.folders)
    if not entries:
        print(f"no runs recorded in {index_path()}" + (" or found under the folders given" if args.folders else ""))
        return 0
    for e in entries:
        stages = ", ".join(e.stages) + (f" (unfinished: {', '.join(e.unfinished)})" if e.unfinished else "")
        print(f"{e.time:%Y-%m-%d %H:%M}  {e.name}  [{e.kind}]  {', '.join(e.models) or '?'}  "
              f"{stages}  {e.verdict}  {human_bytes(e.bytes)}  {e.folder}")
    return 0
