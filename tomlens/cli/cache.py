"""`tomlens cache`: cache activations of a stimulus file at chosen sites and token positions."""

from __future__ import annotations

import argparse

from tomlens.cli.options import add_prepend_bos


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "cache",
        help="cache activations (sites x token positions) for a stimulus file",
        description="Run the stimuli through the model once, keep only the requested sites at the "
        "requested token positions, and store them as safetensors shards with a JSON manifest. "
        "The same request again loads the store without running the model; an interrupted run "
        "resumes. Prints where the store is and what it holds.",
    )
    p.add_argument("--model", default="smollm2-135m", help="model name (see `tomlens models`)")
    p.add_argument("--revision", default=None, help="hub commit, branch or tag to pin (hub ids only)")
    p.add_argument("--stimuli", required=True, help="stimulus file (JSONL or CSV)")
    p.add_argument("--sites", nargs="+", default=["resid_post"],
                   help="site specs: kind[:layers], kinds resid_pre resid_mid resid_post attn_out "
                   "mlp_out z head_out; layers like 3, 0-5 or 0,4,8 (default: resid_post, all layers)")
    p.add_argument("--positions", nargs="+", default=["final"],
                   help="token positions: final, a span role (last token; e.g. protagonist object "
                   "location_1), <role>:first, contrast_end (default: final)")
    p.add_argument("--store", default=None,
                   help="store root (default: $TOMLENS_HOME/activations or the user cache dir)")
    p.add_argument("--batch-size", type=int, default=None, help="prompts per forward (halves on OOM)")
    p.add_argument("--flush-seconds", type=float, default=None,
                   help="write a shard once this much work is pending (default 120): a killed run "
                   "loses at most about this much; the numbers do not depend on it")
    p.add_argument("--dtype", default=None, help="model and storage dtype (default: bf16 on GPU, fp32 on CPU)")
    p.add_argument("--device", default=None)
    p.add_argument("--seed", type=int, default=0, help="seed for random-weight test models")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_prepend_bos(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tomlens.activations import cache_activations
    from tomlens.models import load_model
    from tomlens.stimuli import read_jsonl

    stimuli = read_jsonl(args.stimuli)
    model = load_model(args.model, revision=args.revision, device=args.device, dtype=args.dtype, seed=args.seed,
                       prepend_bos=args.prepend_bos)
    result = cache_activations(model, stimuli, args.sites, args.positions, store=args.store,
                               batch_size=args.batch_size, flush_seconds=args.flush_seconds,
                               progress=not args.no_progress)
    print(result.describe())
    return 0
