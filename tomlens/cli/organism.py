"""`tomlens train-organism`: train the model organism and write its folder."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "train-organism",
        help="train tom-organism, the model known to track belief, into a folder",
        description="Train the model organism on tomlens's own stories (deterministic given the seed) "
        "and write a model folder: weights, config, tokenizer, training.json and MODEL_CARD.md. "
        "The defaults reproduce the shipped tom-organism. Exit 0 when it reaches the held-out "
        "accuracy target in every condition, 1 when it does not (the folder is written either way).",
    )
    parser.add_argument("--out", required=True, help="folder to write (replaced if it exists)")
    parser.add_argument("--seed", type=int, default=None, help="seed of data, split, weights and batches")
    parser.add_argument("--steps", type=int, default=None, help="optimiser steps")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads while training")
    parser.add_argument("--quick", action="store_true",
                        help="a reduced run (small data, few steps) that checks the script works; "
                        "it does not reach the accuracy target")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from tomlens.organism.card import meets_target, save_organism
    from tomlens.organism.train import ACCURACY_TARGET, OrganismConfig, quick_config, train

    cfg = quick_config() if args.quick else OrganismConfig()
    changes = {k: v for k, v in (("seed", args.seed), ("steps", args.steps), ("threads", args.threads)) if v is not None}
    cfg = replace(cfg, **changes)
    print(f"train-organism: {cfg.n_layers} layers x {cfg.n_heads} heads, d_model {cfg.d_model}, {cfg.steps} steps "
          f"of {cfg.batch_size} prompts; about {estimate_minutes(cfg):.0f} min on {cfg.threads or 'all'} CPU "
          "thread(s) of a machine like the one measured", flush=True)
    model, tokenizer, record = train(cfg)
    folder = save_organism(model, tokenizer, record, args.out)
    worst = min(record["test_accuracy"].items(), key=lambda kv: kv[1])
    print(f"wrote {folder}: lowest held-out accuracy {worst[1]:.3f} ({worst[0]}); "
          f"{record['train_seconds']:.0f} s")
    if meets_target(record):
        print(f"every condition reaches {ACCURACY_TARGET}")
        return 0
    print(f"below the target of {ACCURACY_TARGET} in some condition (see {folder}/MODEL_CARD.md)")
    return 1


def estimate_minutes(cfg) -> float:  # noqa: ANN001 - an OrganismConfig
    """Measured here (2 CPU threads, the shipped shape: 5 layers, d_model 64, batch 64): about 0.62 s
    a step with the interchange, 1.0 s once the knockout starts (about the last 40% of
    the steps), 0.45 s without the interchange; plus about a minute to generate and split the stories."""
    size = (cfg.batch_size / 64) * (cfg.n_layers / 5) * (cfg.d_model / 64) ** 2
    per_step = (0.62 * 0.6 + 1.0 * 0.4) if cfg.interchange else 0.45
    return 1 + cfg.steps * per_step * size / 60
