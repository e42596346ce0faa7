"""The main job on the embedded model, end to end: `make demo` runs `python -m tomlens.demo`.

Sized to finish in under ten minutes on two CPU cores; `--n` scales every stage.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from tomlens.errors import TomlensError


def _section(title: str) -> None:
    print(f"\n== {title} ==", flush=True)


def behaviour_stage(model, out: Path, n: int, seed: int) -> None:
    from tomlens.commands.behave import format_accuracy
    from tomlens.experiments.behaviour_run import run_behaviour, write_behaviour
    from tomlens.stimuli import generate, write_jsonl

    stimuli = (generate("unexpected-transfer", n=n, seed=seed)
               + generate("unexpected-contents", n=n, seed=seed)
               + generate("goal-encoding", n=max(2, n // 2), seed=seed, ks=(0, 6)))
    write_jsonl(stimuli, out / "stimuli.jsonl")
    print(f"{len(stimuli)} prompts -> {out / 'stimuli.jsonl'}")
    result = run_behaviour(model, stimuli, seed=seed)
    write_behaviour(result, out / "behaviour")
    print(format_accuracy(result.accuracy))
    if len(result.strict):
        _section("Kosinski's strict rule (a task counts only when all its prompts are right)")
        print(result.strict[["family", "tasks", "solved", "fraction_solved", "ci_low", "ci_high",
                             "chance"]].to_string(index=False))
    if len(result.object_bias):
        _section("Ruis et al. object bias o_b per cell")
        print(result.object_bias[["target_type", "anim_denotation", "k", "test_case", "n",
                                  "o_b", "ci_low", "ci_high"]].to_string(index=False))
        print(result.selective[["target_type", "anim_denotation", "k", "passes"]]
              .to_string(index=False))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tomlens.demo", description=__doc__)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--out", default="demo-out")
    parser.add_argument("--n", type=int, default=8, help="tasks per false-belief family")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    try:
        from tomlens.models import load_model

        _section(f"loading {args.model}")
        model = load_model(args.model)
        _section("behaviour: both options scored by log-probability")
        behaviour_stage(model, out, args.n, args.seed)
    except TomlensError as e:
        print(f"demo: error: {e}", file=sys.stderr)
        return 2
    print(f"\ndone in {time.time() - t0:.0f} s; results under {out}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
