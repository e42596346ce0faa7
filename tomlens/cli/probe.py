"""`tomlens probe`: linear probes for every layer (and head) of a model on a stimulus file."""

from __future__ import annotations

import argparse

from tomlens.cli.options import add_prepend_bos
from tomlens.errors import TomlensError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "probe",
        help="train linear probes on every layer and head (belief vs world state)",
        description="Cache the activations that are missing, train one probe per layer and per "
        "layer x head on grouped folds (no story on both sides), and write a tidy table with 95% "
        "intervals over held-out stories, shuffled-label controls, a bag-of-words baseline, the "
        "probe directions (safetensors) and a per-layer figure (standalone HTML). A unit whose probe "
        "cannot be fitted (NaN activations, a failed solve) keeps its rows with NaN scores and a "
        "fit_status reason; one line says how many and why.",
    )
    p.add_argument("--model", default="smollm2-135m", help="model name (see `tomlens models`)")
    p.add_argument("--revision", default=None, help="hub commit, branch or tag to pin (hub ids only)")
    p.add_argument("--stimuli", required=True, help="stimulus file (JSONL or CSV)")
    p.add_argument("--target", nargs="+", default=["protagonist_belief"],
                   help="targets: protagonist_belief world_state joint statement_protagonist "
                   "statement_world (default: protagonist_belief)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--test-stimuli", default=None,
                   help="a second stimulus file to test on (train on --stimuli, test here)")
    p.add_argument("--position", default="final", help="token position (default: final)")
    p.add_argument("--kinds", nargs="+", default=["resid_post", "head_out"],
                   help="site kinds to probe (default: resid_post head_out)")
    p.add_argument("--probe", default="logistic", choices=["logistic", "mass_mean"])
    p.add_argument("--store", default=None, help="activation store root (default: the tomlens cache dir)")
    p.add_argument("--folds", type=int, default=5, help="outer grouped folds (default 5)")
    p.add_argument("--inner-folds", type=int, default=4, help="grouped folds for choosing C (default 4)")
    p.add_argument("--evaluation", default="crossfit", choices=["crossfit", "holdout"],
                   help="crossfit: every story held out once; holdout: one held-out fold")
    p.add_argument("--group-by", default="task", choices=["task", "template"],
                   help="keep whole tasks (or whole templates too) on one side of every split")
    p.add_argument("--c-grid", nargs="+", type=float, default=None,
                   help="inverse regularisation strengths to choose from (default 0.001 ... 10)")
    p.add_argument("--n-boot", type=int, default=1000, help="bootstrap replicates (default 1000)")
    p.add_argument("--no-controls", action="store_true", help="skip the shuffled-label control")
    p.add_argument("--no-bow", action="store_true", help="skip the bag-of-words baseline")
    p.add_argument("--no-conditions", action="store_true",
                   help="skip train-on-true-belief / test-on-false-belief generalisation")
    p.add_argument("--format", default="parquet", choices=["parquet", "csv"], help="table format")
    p.add_argument("--batch-size", type=int, default=None, help="prompts per forward when caching")
    p.add_argument("--dtype", default=None, help="model dtype (default: bf16 on GPU, fp32 on CPU)")
    p.add_argument("--device", default=None, help="device for the model and the probes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    add_prepend_bos(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tomlens.activations import cache_activations
    from tomlens.probes.sweep import SweepConfig, run_probe_sweep, write_probe_sweep
    from tomlens.report.layers import write_probe_figures
    from tomlens.models import load_model
    from tomlens.probes.logistic import C_GRID
    from tomlens.probes.targets import get_target
    from tomlens.stimuli import read_jsonl

    from tomlens.hooks.sites import KINDS

    for t in args.target:
        get_target(t)  # fail on a typo before loading anything
    bad = [k for k in args.kinds if k not in KINDS]
    if bad:
        raise TomlensError(f"--kinds {' '.join(bad)}: not a site kind (layers are not chosen here: every layer is probed)",
                           f"use bare kinds from {', '.join(KINDS)}")
    stimuli = read_jsonl(args.stimuli)
    test = read_jsonl(args.test_stimuli) if args.test_stimuli else None
    model = load_model(args.model, revision=args.revision, device=args.device, dtype=args.dtype, seed=args.seed,
                       prepend_bos=args.prepend_bos)
    sites = " ".join(args.kinds)
    progress = not args.no_progress
    acts = cache_activations(model, stimuli, sites, [args.position], store=args.store,
                             batch_size=args.batch_size, progress=progress)
    test_acts = None if test is None else cache_activations(
        model, test, sites, [args.position], store=args.store, batch_size=args.batch_size, progress=progress)
    cfg = SweepConfig(c_grid=tuple(args.c_grid) if args.c_grid else C_GRID, folds=args.folds,
                      inner_folds=args.inner_folds, evaluation=args.evaluation, group_by=args.group_by,
                      n_boot=args.n_boot, controls=not args.no_controls, bow=not args.no_bow,
                      conditions=not args.no_conditions, device=args.device, progress=progress)
    result = run_probe_sweep(acts, args.target, kinds=args.kinds, position=args.position,
                             test_acts=test_acts, probe=args.probe, seed=args.seed, config=cfg)
    out = write_probe_sweep(result, args.out, table_format=args.format)
    figures = write_probe_figures(result.table, out)
    print(summarise(result.table))
    for note in result.metadata.get("notes", []):
        print(f"note: {note}")
    print(f"wrote {out}/probes.{args.format}, {out}/probes.json"
          + (f", {out}/directions.safetensors" if result.directions else "")
          + "".join(f", {f}" for f in figures))
    return 0


def summarise(table) -> str:  # noqa: ANN001 - the sweep's DataFrame
    """Best layer (whole-layer sites) and best head per target and evaluation, with intervals;
    units that could not be fitted (NaN score, see `fit_status`) are left out of the choice."""
    acc = table[table["metric"] == "accuracy"]
    lines = [f"{'target':<22}{'train -> eval':<30}{'site':<22}{'accuracy [95% CI]':<24}"
             f"{'control':>8}{'bow':>7}{'chance':>8}"]
    for (target, train_on, eval_set), g in acc.groupby(["target", "train_on", "eval_set"], sort=False):
        bow = g[g["kind"] == "bow"]
        bow_s = f"{bow['score'].iloc[0]:.2f}" if len(bow) else "-"
        for kind, k in g[g["kind"] != "bow"].groupby("kind", sort=False):
            k = k[k["score"].notna()]
            if k.empty:
                lines.append(f"{target:<22}{train_on + ' -> ' + eval_set:<30}{kind:<22}no unit could be fitted")
                continue
            best = k.loc[k["score"].idxmax()]
            site = f"{kind}:{int(best['layer'])}" + ("" if best["head"] < 0 else f".h{int(best['head'])}")
            ctrl = "-" if best["control"] != best["control"] else f"{best['control']:.2f}"
            lines.append(f"{target:<22}{train_on + ' -> ' + eval_set:<30}{site:<22}"
                         f"{best['score']:.2f} [{best['ci_low']:.2f}, {best['ci_high']:.2f}]{'':<8}"
                         f"{ctrl:>8}{bow_s:>7}{best['chance']:>8.2f}")
    return "\n".join(lines)
