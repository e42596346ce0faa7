"""`tomlens models`: list the built-in model names; `--convert` prepares a packaged GGUF model (SmolLM2,
Gemma 3 270M) offline ahead of its first use."""

from __future__ import annotations

import argparse

from tomlens.cli.options import add_choice

CONVERTIBLE: tuple[str, ...] = ("smollm2-135m", "gemma3-270m", "all")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "models",
        help="list the built-in model names",
        description="List the built-in model names. Any Hugging Face id or local model directory "
        "also works wherever a model name is asked for.",
    )
    add_choice(
        parser,
        "--convert",
        nargs="?",
        const="smollm2-135m",
        choices=CONVERTIBLE,
        what="model to convert",
        help="convert a packaged GGUF into the local safetensors cache now, otherwise it happens on "
        "first use: smollm2-135m (the default; no value needed), gemma3-270m (needs tomlens[gemma]) or all",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tomlens.models import DEFAULT_MODEL, list_models

    names = list_models()
    width = max(len(m.name) for m in names)
    for m in names:
        default = "  [default]" if m.name == DEFAULT_MODEL else ""
        print(f"{m.name:<{width}}  {m.source:<8}  {m.description}{default}")
    print(f"{'<hf-id>':<{width}}  {'hub':<8}  any Hugging Face causal LM id, e.g. HuggingFaceTB/SmolLM2-360M (--revision to pin)")
    print(f"{'<folder>':<{width}}  {'local':<8}  a directory written by save_pretrained (config.json, weights, tokenizer)")
    if args.convert in ("smollm2-135m", "all"):
        from tomlens.models.embedded import embedded_dir

        print(f"converted: {embedded_dir()}")
    if args.convert in ("gemma3-270m", "all"):
        from tomlens.models.gemma import gemma_dir

        print(f"converted: {gemma_dir()}")
    return 0
