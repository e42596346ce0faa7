"""Flags shared by every command that loads a model or its tokenizer."""

from __future__ import annotations

import argparse


def add_prepend_bos(p: argparse.ArgumentParser) -> None:
    """`--prepend-bos / --no-prepend-bos`; unset (None) follows the tokenizer's own rule."""
    p.add_argument("--prepend-bos", action=argparse.BooleanOptionalAction, default=None,
                   help="prepend the BOS token to every prompt (TransformerLens's convention) or "
                   "never; default: the tokenizer's own rule, as plain transformers runs it")
