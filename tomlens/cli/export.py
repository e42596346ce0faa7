"""`tomlens export`: a run's result tables and stimuli, or a stimulus set, as Hugging Face `datasets`
(save_to_disk) and Parquet, the formats the field exchanges data in."""

from __future__ import annotations

import argparse

from tomlens.errors import TomlensError

FORMAT_CHOICES: dict[str, tuple[str, ...]] = {"datasets": ("datasets",), "parquet": ("parquet",),
                                              "both": ("datasets", "parquet")}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export",
        help="export a run's tables and stimuli (or a stimulus set) as Hugging Face datasets and Parquet",
        description="With RUN_FOLDER (what `tomlens run` wrote): every result table of every finished "
        "stage and model as one split each (datasets/ via save_to_disk, parquet/<split>.parquet), the "
        "stimuli each stage recorded (the pairs stage's with pair_id, contrast and side), provenance.json "
        "(the run's manifest, each stage's JSON results, and every file not exported with why) and a "
        "dataset card. With "
        "--stimuli FILE or --family NAME: one row per prompt (labels, options, role spans, meta).",
    )
    p.add_argument("run_folder", nargs="?", default=None, help="a `tomlens run` output folder")
    p.add_argument("--out", required=True, help="export folder (new or empty; --force replaces an earlier export)")
    p.add_argument("--format", default="both", help="datasets, parquet or both (default both)")
    p.add_argument("--stimuli", default=None, help="export this stimulus file (JSONL or CSV; BigToM's csv with --family bigtom)")
    p.add_argument("--family", default=None, help="export a generated family (see `tomlens stimuli --help`)")
    p.add_argument("--n", type=int, default=None, help="tasks of --family (default 20) or rows of --stimuli (default all)")
    p.add_argument("--seed", type=int, default=0, help="seed of --family")
    p.add_argument("--no-stimuli", action="store_true", help="with RUN_FOLDER: tables only, no stimuli")
    p.add_argument("--force", action="store_true",
                   help="replace an earlier export in --out: only the files its provenance.json lists, and only "
                   "once the new export is complete (a user's own files there are refused, never deleted)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tomlens.runs.export import export_run, export_stimuli

    if args.format not in FORMAT_CHOICES:
        raise TomlensError(f"unknown --format {args.format!r}", f"use one of {', '.join(FORMAT_CHOICES)}")
    formats = FORMAT_CHOICES[args.format]
    stimuli_source = args.stimuli is not None or args.family is not None
    if (args.run_folder is None) == (not stimuli_source):
        raise TomlensError("give either RUN_FOLDER or a stimulus source (--stimuli FILE / --family NAME), not both or neither",
                           "e.g. `tomlens export runs/demo --out export/` or `tomlens export --family order-only --n 4 --out export/`")
    progress = not args.no_progress
    if args.run_folder is not None:
        written = export_run(args.run_folder, args.out, formats=formats, force=args.force,
                             stimuli=not args.no_stimuli, progress=progress)
        from tomlens.io import read_json

        prov = read_json(written["provenance"])
        print(f"{len(prov['splits'])} splits; {len(prov['skipped'])} files or stages not exported "
              f"(listed with why under `skipped` in {written['provenance']})")
    else:
        from tomlens.runs.base import StimuliSpec

        spec = StimuliSpec(family=args.family, n=args.n, seed=args.seed, path=args.stimuli)
        stimuli = spec.load()
        written = export_stimuli(stimuli, args.out, formats=formats, force=args.force, progress=progress)
        print(f"{len(stimuli)} stimuli")
    for kind, path in written.items():
        print(f"wrote {kind}: {path}")
    return 0
