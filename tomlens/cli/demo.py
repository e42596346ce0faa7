"""The main job on the embedded model, end to end: `make demo` runs `python -m tomlens.cli.demo`.

Four stages, each writing its own folder under `--out`, then one HTML report over all of them:
behaviour on false-belief and goal-encoding stimuli; activations cached and probed per layer and
per head for protagonist belief vs world state; minimal pairs patched per head (exact and
attribution) with the top heads validated; `report.html`. Sized to finish in under ten minutes on
two CPU cores; `--n` and `--pairs` scale it up on a workstation.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from tomlens.cli.options import add_prepend_bos
from tomlens.errors import TomlensError


def _section(title: str) -> None:
    print(f"\n== {title} ==", flush=True)


def behaviour_stage(model: Any, out: Path, n: int, seed: int) -> Any:
    """Both options of every prompt scored; accuracy per condition and the papers' aggregates."""
    from tomlens.cli.behave import format_accuracy
    from tomlens.runs.behaviour import run_behaviour, write_behaviour
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
    return result


def probe_stage(model: Any, out: Path, n: int, seed: int) -> Any:
    """Cache resid_post and every head's output at the final token of transfer stories, then probe
    protagonist belief and world state per layer and per head (grouped folds, controls, intervals)."""
    from tomlens.activations import cache_activations
    from tomlens.cli.probe import summarise
    from tomlens.probes.sweep import SweepConfig, run_probe_sweep, write_probe_sweep
    from tomlens.report.layers import write_probe_figures
    from tomlens.stimuli import generate

    stimuli = generate("unexpected-transfer", n=n, seed=seed + 1)
    acts = cache_activations(model, stimuli, ["resid_post", "head_out"], ["final"], store=out / "activations")
    print(f"{'reused' if acts.reused else 'cached'} {len(stimuli)} prompts at {acts.path}")
    cfg = SweepConfig(folds=4, inner_folds=3, c_grid=(0.01, 0.1, 1.0), n_boot=300)
    result = run_probe_sweep(acts, ["protagonist_belief", "world_state"], kinds=["resid_post", "head_out"],
                             seed=seed, config=cfg)
    folder = write_probe_sweep(result, out / "probes", table_format="csv")
    write_probe_figures(result.table, folder)
    print(summarise(result.table))
    return result


def patch_stage(model: Any, out: Path, n_pairs: int, probe_table: Path | None, seed: int,
                figures: dict[str, Any] | None = None) -> dict[str, Any]:
    """Every head patched from false-belief into matched present-protagonist stories (exact and
    attribution), the top heads tested together against random heads. `figures` receives the
    plotly figures by name."""
    from tomlens.cli.patch import patch_experiment
    from tomlens.stimuli.pairs import make_pairs, write_pairs

    pairs, report = make_pairs("unexpected-transfer", n=max(1, (n_pairs + 1) // 2), seed=seed + 2,
                               tokenizer=model.tokenizer, contrasts=("present",))
    pairs = pairs[:n_pairs]
    print(report.summary())
    write_pairs(pairs, out / "pairs.jsonl")
    summary = patch_experiment(model, pairs, out / "patching", method="both", sites="heads",
                               top_k=3, n_random=3, probe_table=probe_table, seed=seed, fmt="csv",
                               figures=figures)
    b = summary["baselines"]["exact_denoise"]
    print(f"{summary['pairs']['n_aligned']} pairs; logit diff (belief - world answer): "
          f"false-belief {b['clean_logit_diff']:.3f}, protagonist present {b['corrupted_logit_diff']:.3f}")
    print(f"top heads by exact patching effect: {', '.join(summary['top_heads'][:5])}")
    for c in summary["comparisons"]:
        if c["kind"] == "head" and c["position"] == "all":
            print(f"attribution vs exact: Spearman {c['spearman']:.2f}, top-{c['k']} overlap {c['topk_overlap']:.2f}")
    return summary


def write_demo_report(out: Path, behaviour: Any, probes: Any, patching: dict[str, Any], provenance: dict,
                      patch_figures: dict[str, Any] | None = None) -> Path:
    """One self-contained HTML page with the stages' tables and figures."""
    import pandas as pd

    from tomlens.io import read_table
    from tomlens.patching.metric import gap_note
    from tomlens.report.layers import head_heatmap, layer_figure
    from tomlens.report.patching import recovery_curve
    from tomlens.report.html import Section, write_report

    table = probes.table
    best = (table[(table["metric"] == "accuracy") & (table["kind"] != "bow")]
            .sort_values("score", ascending=False)
            .groupby(["target", "train_on", "eval_set", "kind"], sort=False).head(1)
            [["target", "train_on", "eval_set", "kind", "layer", "head", "score", "ci_low", "ci_high",
              "control", "selectivity", "chance"]])
    patch_dir = out / "patching"
    sections = [
        Section("Behaviour", "Accuracy per family, condition and prompt type (95% Wilson intervals).",
                tables=[behaviour.accuracy] + ([behaviour.strict] if len(behaviour.strict) else [])),
        Section("Probes: protagonist belief vs world state",
                "Logistic probes per layer (resid_post) and per head (each head's own write to the residual "
                "stream), scored on held-out stories; bands are bootstrap 95% intervals over test stories.",
                tables=[best], figures=[layer_figure(table, kind="resid_post"),
                                        head_heatmap(table, target="protagonist_belief")]),
    ]
    heads = read_table(patch_dir / "heads.csv")
    topk = read_table(patch_dir / "topk.csv")
    figs = patch_figures or {}
    note = gap_note(patching["baselines"]["exact_denoise"])
    sections.append(Section(
        "Patching: heads that carry belief",
        "Exact and attribution patching of every head from the false-belief story into its matched "
        "true-belief story (effect 0 = true-belief run, 1 = false-belief run), then the top-k heads "
        "patched together against random heads." + (f" Note: {note}." if note else ""),
        tables=[heads.head(15), topk],
        figures=[f for f in (figs.get("heads_exact_denoise"), figs.get("attribution_vs_exact_denoise"))
                 if f is not None] + [recovery_curve(topk)]))
    ablation = patch_dir / "ablation.csv"
    if ablation.exists():
        sections.append(Section(
            "Mean ablation of the top heads",
            "Each of the top-k heads' outputs replaced by its mean over all stories at the final token: "
            "false-belief accuracy and its drop, against the same number of random heads.",
            tables=[read_table(ablation)]))
    comparisons = [c for c in patching["comparisons"] if c["kind"] == "head" and c["position"] == "all"]
    sections.append(Section("Patching summary", tables=[pd.DataFrame(
        [{"pairs": patching["pairs"]["n_aligned"], "top heads": ", ".join(patching["top_heads"][:5]),
          **({"attribution vs exact Spearman": round(comparisons[0]["spearman"], 3),
              f"top-{comparisons[0]['k']} overlap": comparisons[0]["topk_overlap"]} if comparisons else {})}])]))
    return write_report(out / "report.html", "tomlens demo: theory of mind in smollm2-135m", sections, provenance)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tomlens.cli.demo", description=__doc__)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--out", default="demo-out")
    parser.add_argument("--n", type=int, default=8, help="tasks per false-belief family (behaviour)")
    parser.add_argument("--probe-tasks", type=int, default=12, help="transfer tasks for the probes (16 prompts each)")
    parser.add_argument("--pairs", type=int, default=4, help="minimal pairs for patching")
    parser.add_argument("--seed", type=int, default=0)
    add_prepend_bos(parser)
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    try:
        from tomlens.models import load_model, provenance

        _section(f"loading {args.model}")
        model = load_model(args.model, prepend_bos=args.prepend_bos)
        _section("1/4 behaviour: both options scored by log-probability")
        behaviour = behaviour_stage(model, out, args.n, args.seed)
        _section("2/4 probes: where is the protagonist's belief readable?")
        probes = probe_stage(model, out, args.probe_tasks, args.seed)
        _section("3/4 patching: which heads carry it?")
        patch_figures: dict[str, Any] = {}
        patching = patch_stage(model, out, args.pairs, out / "probes" / "probes.csv", args.seed, patch_figures)
        _section("4/4 report")
        path = write_demo_report(out, behaviour, probes, patching,
                                 {**provenance(model), "seed": args.seed, "argv": sys.argv[1:]}, patch_figures)
        print(f"wrote {path}")
    except TomlensError as e:
        print(f"demo: error: {e}", file=sys.stderr)
        return 2
    print(f"\ndone in {time.time() - t0:.0f} s; results under {out}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
