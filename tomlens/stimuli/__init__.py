"""Stimuli: generated ToM tasks, external sets and user files, all as `Stimulus` records."""

from __future__ import annotations

import importlib
from typing import Any

from tomlens.errors import TomlensError
from tomlens.stimuli.records import Span, Stimulus, stimuli_hash, write_jsonl
from tomlens.stimuli.user import load_user_file, write_user_csv

# What `write_jsonl` writes reads back through the user-file reader (which also takes CSV).
read_jsonl = load_user_file

# family name -> (module, function). Each function takes (n, seed, **options) -> list[Stimulus].
FAMILIES: dict[str, tuple[str, str]] = {
    "unexpected-transfer": ("tomlens.stimuli.false_belief", "unexpected_transfer"),
    "unexpected-contents": ("tomlens.stimuli.false_belief", "unexpected_contents"),
    "goal-encoding": ("tomlens.stimuli.goal_encoding", "goal_encoding"),
    "belief-tracking": ("tomlens.stimuli.tracking", "belief_tracking"),
    "belief-statements": ("tomlens.stimuli.statements", "belief_statements"),
}


def generate(family: str, /, n: int = 20, seed: int = 0, **options: Any) -> list[Stimulus]:
    """Generate `n` tasks of a built-in family, deterministically given `seed`."""
    if family not in FAMILIES:
        raise TomlensError(
            f"unknown stimulus family {family!r}",
            f"use one of {sorted(FAMILIES)} (or `load_bigtom(path)` / `load_user_file(path)`)",
        )
    module, fn = FAMILIES[family]
    return getattr(importlib.import_module(module), fn)(n=n, seed=seed, **options)


def load_bigtom(path, **options):  # noqa: ANN001
    from tomlens.stimuli.bigtom import load_bigtom as _load

    return _load(path, **options)


__all__ = [
    "FAMILIES", "Span", "Stimulus", "generate", "load_bigtom", "load_user_file", "read_jsonl",
    "stimuli_hash", "write_jsonl", "write_user_csv",
]
