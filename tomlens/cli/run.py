"""`tomlens run FILE.toml`: an experiment file run end to end into one self-describing folder.

The file names the model(s) and the stages (`tomlens.runs.experiment`); the folder gets the
resolved `config.json`, `manifest.json`, one subfolder per stage, the figures and `report.html`.
Running the same file again reuses every stage that finished with the same settings and inputs.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from tomlens.cli.options import add_progress


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="run an experiment file (TOML): model(s), stages, report",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("file", help="experiment file, e.g. examples/demo.toml")
    p.add_argument("--out", default=None, help="output folder (default: runs/<name>)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="change one setting of the file, e.g. --set model.name=tiny-llama "
                   "--set probes.stimuli.n=5 (VALUE is a TOML value; repeatable)")
    p.add_argument("--dry-run", action="store_true",
                   help="print every stage's plan (prompts, forwards, patched runs, the gate's verdict) and a "
                   "total time estimate from one timed forward, then stop: nothing else runs, nothing is written")
    add_progress(p)
    p.set_defaults(func=run)


def _section(title: str) -> None:
    print(f"\n== {title} ==", flush=True)


def run_file(config: Any, out: Path, *, progress: bool = True, headers: dict[str, str] | None = None,
             plan: Any = None) -> Any:
    """Run `config` into `out`, printing a header before and `describe()` after each stage, then
    write the figures and report.html. `headers` replaces the stage names in the headers; `plan`
    (`say_estimate`'s counts) is priced once the first model loads (`run_experiment`)."""
    from tomlens.report.experiment import write_experiment_figures, write_experiment_report
    from tomlens.report.findings import variant_names
    from tomlens.runs.experiment import run_experiment

    several = len(config.models) > 1
    labels = dict(zip(map(id, config.models), variant_names([m.name for m in config.models], config.models),
                      strict=True))  # two entries of one model are told apart by their settings

    def before(stage: str, model: Any) -> None:
        if headers is None or stage in headers:
            title = (headers or {}).get(stage, stage)
            _section(f"{title} ({labels.get(id(model), model.name)})" if several else title)

    def after(stage: str, model: Any, result: Any) -> None:
        text = result.describe()
        if text:
            print(text, flush=True)

    result = run_experiment(config, out, progress=progress, before=before, after=after, plan=plan)
    if headers is None or "report" in headers:
        _section((headers or {}).get("report", "report"))
    figures = write_experiment_figures(result)
    path = write_experiment_report(result, out, figures=figures)
    print(f"wrote {path}")
    return result


def run(args: argparse.Namespace) -> int:
    from tomlens.runs.experiment import ExperimentConfig

    t0 = time.time()
    config = ExperimentConfig.load(args.file, args.overrides)
    out = Path(args.out) if args.out else Path("runs") / config.name
    from tomlens.report.findings import variant_names

    models = variant_names([m.name for m in config.models], config.models)
    print(f"experiment {config.name!r}: {', '.join(config.stages)} on {', '.join(models)} -> {out}/")
    if args.dry_run:
        return dry_run(config, out)
    plan = say_estimate(config, out)
    result = run_file(config, out, progress=not args.no_progress, plan=plan)
    print(f"\ndone in {time.time() - t0:.0f} s; results under {out}/")
    return validation_exit_code(result)


def dry_run(config: Any, out: Path) -> int:
    """`tomlens run --dry-run`: every stage's plan and the total, then stop (nothing written)."""
    from tomlens.runs.experiment_plan import DRY_RUN_END, plan_experiment

    plan = plan_experiment(config, out)
    print("\n".join(plan.lines()))
    print(DRY_RUN_END)  # once: the patching stage's own dry run leaves its closing line to this one
    return 0


def say_estimate(config: Any, out: Path) -> Any:
    """What a run says before it starts: each stage's counts (no model is loaded for them). The
    time comes once the run has loaded the first model it needs (`run_experiment`); returns the
    counted plan (an `ExperimentPlan`) for it to price."""
    from tomlens.runs.experiment_plan import estimate_experiment

    plan = estimate_experiment(config, out)
    print(plan.counts_line(), flush=True)
    return plan


def validation_exit_code(result: Any) -> int:
    """1 when a [validate] stage ran and one of its checks failed (as `tomlens validate` exits), else 0."""
    failed = [run.model.name for run in result.runs
              if run.results.get("validate") is not None and not run.results["validate"].passed]
    if failed:
        print(f"validation FAILED for {', '.join(failed)}: see the validate section of the report", flush=True)
        return 1
    return 0
