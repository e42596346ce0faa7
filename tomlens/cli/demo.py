"""`tomlens demo` (`make demo`): the main job on the embedded model, end to end.

The demo is a packaged experiment file, `tomlens/runs/demo.toml` (= examples/demo.toml), run the
way `tomlens run` runs any file: the shortcut audit of its stimulus sets; behaviour on false-belief and goal-encoding stimuli; activations
cached and probed per layer and per head for protagonist belief vs world state; minimal pairs
patched per head (exact and attribution) with the top heads validated; `report.html`. Sized to
finish in under ten minutes on two CPU cores; `--n`, `--probe-tasks` and `--n-pairs` scale it up.
`python -m tomlens.cli.demo` is the same command.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from tomlens.cli.options import add_prepend_bos, add_renamed
from tomlens.errors import TomlensError

HEADERS = {
    "audit": "1/5 audit: can a text shortcut tell the sets' contrasts apart?",
    "behaviour": "2/5 behaviour: both options scored by log-probability",
    "probes": "3/5 probes: where is the protagonist's belief readable?",
    "pairs": "4/5 patching: which heads carry it?",
    "report": "5/5 report",
}


def demo_file() -> Any:
    """The packaged demo config (a `Traversable`; read it with `.read_text()`)."""
    from importlib.resources import files

    return files("tomlens.runs").joinpath("demo.toml")


def demo_config(args: argparse.Namespace) -> Any:
    """The packaged demo with the command's flags applied."""
    import tomllib

    from tomlens.runs.experiment import ExperimentConfig

    data = tomllib.loads(demo_file().read_text(encoding="utf-8"))
    seed = args.seed
    data["seed"] = seed
    data["model"] = {**data["model"], "name": args.model}
    if args.prepend_bos is not None:
        data["model"]["prepend_bos"] = args.prepend_bos
    for spec in data["behaviour"]["stimuli"]:
        spec["seed"] = seed
        spec["n"] = {"goal-encoding": max(2, args.n // 2), "indirect-request": max(2, args.n // 2),
                     "false-belief-factorial": max(2, args.n // 4),
                     **dict.fromkeys(("motomqa", "recursive-mindreading", "scalar-implicature", "kosoy"),
                                     max(1, args.n // 8))}.get(spec["family"], args.n)
    data["probes"]["stimuli"] = {**data["probes"]["stimuli"], "n": args.probe_tasks, "seed": seed + 1}
    data["audit"]["min_tasks"] = args.audit_tasks
    data["probes"]["store"] = str(Path(args.out) / "activations")  # the demo's activations stay in its folder
    if args.n_pairs < 1:
        raise TomlensError(f"--n-pairs {args.n_pairs} must be at least 1", "pass --n-pairs 1 or more")
    data["pairs"]["n"] = max(1, (args.n_pairs + 1) // 2)  # tasks; each gives two pairs
    data["pairs"]["max_pairs"] = args.n_pairs  # exactly --n-pairs of them, an odd number too
    data["pairs"]["seed"] = seed + 2
    return ExperimentConfig.from_dict(data)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--out", default="demo-out")
    p.add_argument("--n", type=int, default=8, help="tasks per false-belief family (behaviour)")
    p.add_argument("--probe-tasks", type=int, default=48, help="order-only tasks for the probes (4 prompts each)")
    p.add_argument("--n-pairs", type=int, default=4, help="minimal pairs for patching")
    add_renamed(p, "--pairs", "--n-pairs", type=int)  # `--pairs` is the pairs file on `tomlens patch`
    p.add_argument("--audit-tasks", type=int, default=64,
                   help="tasks of each generated family in the shortcut audit (at least 8)")
    p.add_argument("--seed", type=int, default=0)
    add_prepend_bos(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="the main job end to end on the embedded model (behaviour, probes, "
                       "patching, report)", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tomlens.cli.run import run_file, say_estimate

    t0 = time.time()
    config = demo_config(args)
    out = Path(args.out)
    plan = say_estimate(config, out)
    run_file(config, out, progress=not args.no_progress, headers=HEADERS, plan=plan)
    print(f"\ndone in {time.time() - t0:.0f} s; results under {out}/")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tomlens.cli.demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except TomlensError as e:
        print(f"demo: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
