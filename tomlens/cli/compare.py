"""`tomlens compare RUN [RUN ...] --out DIR`: runs of several models side by side on relative depth.

Each RUN is the folder of `tomlens run` or `tomlens study` (one model or several). Probe curves and
per-head patching effects are put on relative depth, layer / (n_layers - 1), so models of different
depths line up; patching effects stay fractions of each model's own false-minus-true-belief gap
(effect / the model's largest |effect| is a column beside them). The folder gets
`report.html` (findings first: only results that passed their gate are stated), the tables as csv
and parquet, one HTML file per figure and `result.json` (provenance of every run, versions).
"""

from __future__ import annotations

import argparse
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compare", help="compare runs of several models on relative depth (report + tables)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", metavar="RUN", help="run folders (of `tomlens run` or `tomlens study`)")
    p.add_argument("--out", required=True, help="output folder for report.html and the tables")
    p.add_argument("--label", dest="labels", action="append", default=None, metavar="NAME",
                   help="a name for each RUN, in order (repeat once per RUN; default: the model's folder name)")
    p.add_argument("--missing", action="append", default=[], metavar="MODEL",
                   help="a model that was asked for and did not finish: listed as missing (repeatable)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tomlens.report.compare import write_compare_report
    from tomlens.runs.compare import compare_runs

    result = compare_runs([Path(r) for r in args.runs], missing=args.missing, labels=args.labels)
    print(result.describe(), flush=True)
    path = write_compare_report(result, Path(args.out))
    print(f"wrote {path}")
    return 0
