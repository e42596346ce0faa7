"""`tomlens cache`: cache activations of a stimulus file at chosen sites and token positions."""

from __future__ import annotations

import argparse
import sys

from tomlens.cli.options import add_model_options, add_positions, add_progress, add_sites, model_spec, split_items


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "cache",
        help="cache activations (sites x token positions) for a stimulus file",
        description="Run the stimuli through the model once, keep only the requested sites at the "
        "requested token positions, and store them as safetensors shards with a JSON manifest. "
        "The same request again loads the store without running the model; an interrupted run "
        "resumes. Prints where the store is and what it holds.",
    )
    p.add_argument("--stimuli", required=True, help="stimulus file (JSONL or CSV)")
    add_sites(p, ["resid_post"],
              "site specs: kind[:layers], kinds resid_pre resid_mid resid_post attn_out mlp_out z head_out "
              "(or patch's shorthands heads = head_out, resid = resid_pre, attn, mlp); "
              "layers like 3, 0-5 or 0,4,8 (default: resid_post, all layers)")
    add_positions(p, ["final"],
                  "token positions: final, a span role (last token; e.g. protagonist object location_1), "
                  "<role>:first, contrast_end (default: final)")
    p.add_argument("--store", default=None,
                   help="store root (default: $TOMLENS_HOME/activations or the user cache dir)")
    p.add_argument("--out", default=None,
                   help="run folder to record the request in (config.json, manifest.json, result.json); "
                   "the activations themselves stay in the store")
    p.add_argument("--batch-size", type=int, default=None, help="prompts per forward (halves on OOM)")
    p.add_argument("--flush-seconds", type=float, default=None,
                   help="write a shard once this much work is pending (default 120; the first after 15, "
                   "then 30, 60, ...): a killed run loses at most about this much; the numbers do not depend on it")
    add_model_options(p)
    add_progress(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tomlens.runs import cache
    from tomlens.runs.base import StimuliSpec

    config = cache.CacheConfig(model=model_spec(args), stimuli=StimuliSpec(path=args.stimuli),
                               sites=tuple(split_items(args.sites)), positions=tuple(split_items(args.positions)),
                               store=args.store, batch_size=args.batch_size, flush_seconds=args.flush_seconds)
    try:
        result = cache.run(config, progress=not args.no_progress)
    except KeyboardInterrupt:  # the cache said what it kept and lost: not the generic "finished work is kept"
        print("tomlens cache: interrupted", file=sys.stderr)
        return 130
    if args.out is not None:
        result.save(args.out)
    print(result.describe())
    if args.out is not None:
        print(f"wrote {args.out}/result.json")
    return 0
