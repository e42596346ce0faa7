"""`tomlens study FILE.toml`: an experiment over many models, checkpoints or seeds, one job per model
entry, dispatched through submitit (its local executor here, SLURM on a cluster).

A model entry may list `revisions = [...]` (training checkpoints) and/or `seeds = [...]` (weights of a
random-init model): each value is one job, run into `<out>/<model>/` (the layout of a multi-model
`tomlens run`). A job that finished with the same settings is reused, not rerun; a failed job is
recorded in its folder (`study-failed.json`) and the others go on. `<out>/study.json` lists every job;
the comparison of what finished is written to `<out>/compare/`, naming what is missing.

Exit status: 0 every job finished, 1 some failed or did not finish (named, with their logs),
2 bad input, 130 stopped by Ctrl-C, 143 stopped by SIGTERM (study.json records every job either
way). With `--executor slurm --no-wait` the jobs are submitted and the command returns; the same
command without --no-wait collects them (it reattaches the SLURM jobs whatever --executor it is
given; a job whose settings or input files changed since is cancelled and submitted again).

`tomlens sweep` is this command's name before 0.2: it still works, with a line saying so, and a
study folder it wrote (`sweep.json`, `sweep-done.json`) is read as this command's.

Local jobs see the GPUs this shell sees unless --gpus-per-job asks for a number. A model larger than
one GPU loads across several with `device_map = "auto"` in its model entry (accelerate), e.g. with
--executor slurm --gpus-per-job 4.
"""

from __future__ import annotations

import argparse
import shlex
import signal
import sys
import time
from pathlib import Path

from tomlens.cli.options import add_choice, add_progress

EXIT_TERMINATED = 128 + signal.SIGTERM  # 143: what a shell reports for a command SIGTERM stopped


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("study", aliases=["sweep"], help="run an experiment over many models / checkpoints / seeds as submitit jobs",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("file", help="experiment file; model entries may list revisions = [...] or seeds = [...]")
    p.add_argument("--out", default=None, help="study folder (default: runs/<name>)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="change one setting of the file, e.g. --set models.0.seeds=[0,1] (repeatable)")
    add_choice(p, "--executor", choices=["local", "slurm"], default="local",
                   help="submitit's LocalExecutor (subprocesses on this machine; default) or SlurmExecutor")
    p.add_argument("--parallel", type=int, default=None,
                   help="jobs at once (local: default 1; SLURM: the job array's parallelism, by default "
                        "submitit's cap of 256)")
    p.add_argument("--no-wait", action="store_true",
                   help="SLURM: submit and return; the same command without --no-wait collects")
    slurm = p.add_argument_group("SLURM (with --executor slurm)")
    slurm.add_argument("--slurm-partition", default=None, help="partition to submit to")
    slurm.add_argument("--gpus-per-job", type=int, default=0,
                       help="GPUs per job (default 0: SLURM asks for none; local jobs see this shell's GPUs)")
    slurm.add_argument("--time", type=int, default=None, dest="time_min",
                       help="minutes a job may run (default: 60 on SLURM, 24 h locally)")
    slurm.add_argument("--mem", type=float, default=None, dest="mem_gb", help="memory per job in GB")
    slurm.add_argument("--cpus-per-job", type=int, default=None, help="CPU cores per job")
    slurm.add_argument("--slurm-arg", action="append", default=[], metavar="KEY=VALUE",
                       help="any other sbatch option, passed through, e.g. --slurm-arg constraint=a100; a bare KEY "
                            "is a flag, e.g. --slurm-arg exclusive (repeatable)")
    add_progress(p)
    p.set_defaults(func=run)


def collect_argv(args: argparse.Namespace) -> list[str]:
    """The arguments of this command without --no-wait: what collects a --no-wait study."""
    argv = [str(args.file)]
    if args.out is not None:
        argv += ["--out", str(args.out)]
    for override in args.overrides:
        argv += ["--set", override]
    argv += ["--executor", args.executor]
    for flag, value in (("--parallel", args.parallel), ("--slurm-partition", args.slurm_partition),
                        ("--gpus-per-job", args.gpus_per_job or None), ("--time", args.time_min),
                        ("--mem", args.mem_gb), ("--cpus-per-job", args.cpus_per_job)):
        if value is not None:
            argv += [flag, f"{value:g}" if isinstance(value, float) else str(value)]
    for item in args.slurm_arg:
        argv += ["--slurm-arg", item]
    if args.no_progress:
        argv.append("--no-progress")
    return argv


def run(args: argparse.Namespace) -> int:
    from tomlens.runs.experiment import ExperimentConfig
    from tomlens.runs.study import ExecutorOptions, StudyTerminated, parse_slurm_args, run_study

    if args.command == "sweep":
        print("tomlens sweep is now `tomlens study` (one word, one meaning: a sweep is one method over every "
              "unit of one model); the old name goes in a later release", file=sys.stderr)
    t0 = time.time()
    options = ExecutorOptions(executor=args.executor, parallel=args.parallel, partition=args.slurm_partition,
                              gpus_per_job=args.gpus_per_job, time_min=args.time_min, mem_gb=args.mem_gb,
                              cpus_per_job=args.cpus_per_job, slurm_args=parse_slurm_args(args.slurm_arg))
    config = ExperimentConfig.load(args.file, args.overrides)
    out = Path(args.out) if args.out else Path("runs") / config.name
    command = ["tomlens", "study", *collect_argv(args)]
    try:
        result = run_study(config, out, options, wait=not args.no_wait, progress=not args.no_progress,
                           command=command)
    except StudyTerminated:  # Ctrl-C (a plain KeyboardInterrupt) is the CLI's: it exits 130
        print("tomlens study: terminated (SIGTERM); finished work is kept", file=sys.stderr)
        return EXIT_TERMINATED
    print()
    print(result.describe())
    print(f"jobs listed in {out / 'study.json'}; logs in {out / 'study-logs'}/")
    if not result.waited:
        print(f"\nsubmitted; collect with: {shlex.join(command)}")
        return 0
    if result.comparison is not None:
        try:
            from tomlens.report.compare import write_compare_report
        except ModuleNotFoundError as e:
            if e.name != "tomlens.report.compare":
                raise
            print("comparison computed, but no report written: tomlens.report.compare is not available")
        else:
            path = write_compare_report(result.comparison, out / "compare")
            print(f"comparison of {len(result.finished)} finished job(s)"
                  + (f" ({len(result.unfinished)} missing)" if result.unfinished else "") + f": {path}")
    else:
        print(result.comparison_note)
    print(f"\n{len(result.finished)}/{len(result.jobs)} jobs finished in {time.time() - t0:.0f} s")
    if result.unfinished:
        print("not finished: " + ", ".join(f"{j.slug} ({j.state}; log {j.log or 'none'})" for j in result.unfinished))
        return 1
    return 0
