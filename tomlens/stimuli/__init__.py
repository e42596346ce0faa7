"""Stimuli: generated ToM tasks, external sets and user files, all as `Stimulus` records."""

from __future__ import annotations

import difflib
import importlib
import inspect
from collections.abc import Callable, Mapping, Sequence
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
    "order-only": ("tomlens.stimuli.order_only", "order_only"),
    "false-belief-factorial": ("tomlens.stimuli.factorial", "false_belief_factorial"),
    "recursive-mindreading": ("tomlens.stimuli.epitome", "recursive_mindreading"),
    "indirect-request": ("tomlens.stimuli.epitome", "indirect_request"),
    "scalar-implicature": ("tomlens.stimuli.epitome", "scalar_implicature"),
    "motomqa": ("tomlens.stimuli.motomqa", "motomqa"),
    "kosoy": ("tomlens.stimuli.kosoy", "kosoy"),
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


# Parameters set apart from a family's options: a generator's n and seed, BigToM's path and limit.
RESERVED: dict[str, tuple[str, ...]] = {"generated": ("n", "seed"), "bigtom": ("path", "limit")}


def _unknown_family(family: str) -> TomlensError:
    names = [*FAMILIES, "bigtom"]
    near = difflib.get_close_matches(str(family), names, n=1, cutoff=0.5)
    return TomlensError(f"unknown stimulus family {family!r}" + (f": did you mean {near[0]!r}?" if near else ""),
                        f"use one of {', '.join(names)} (or a file with `path`)")


def family_function(family: str) -> Callable[..., list[Stimulus]]:
    """The generator of a built-in family, or BigToM's loader; an unknown name is a TomlensError."""
    if family == "bigtom":
        from tomlens.stimuli.bigtom import load_bigtom as fn

        return fn
    if family not in FAMILIES:
        raise _unknown_family(family)
    module, name = FAMILIES[family]
    return getattr(importlib.import_module(module), name)


def check_options(family: str, options: Mapping[str, Any], reserved: Sequence[str] | None = None) -> None:
    """Name an unknown family, or an option its generator does not take, before anything runs (a
    misspelt option would otherwise surface as a bare TypeError deep in a run). `reserved` are the
    parameters set apart from the options (default `RESERVED`)."""
    fn = family_function(family)
    if reserved is None:
        reserved = RESERVED["bigtom" if family == "bigtom" else "generated"]
    params = inspect.signature(fn).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    accepted = [k for k, p in params.items() if k not in reserved and p.kind in (
        inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]
    for key in options:
        if key in reserved or (key not in accepted and not takes_any):
            near = difflib.get_close_matches(str(key), accepted, n=1, cutoff=0.5)
            raise TomlensError(
                f"stimulus family {family!r} has no option {key!r}" + (
                    f": did you mean {near[0]!r}?" if near and key not in reserved else ""),
                f"options: {', '.join(accepted) or '(none)'}" + (
                    f" ({', '.join(reserved)} are set on their own, not as options)" if key in reserved else ""),
            )


def load_bigtom(path, **options):  # noqa: ANN001
    from tomlens.stimuli.bigtom import load_bigtom as _load

    return _load(path, **options)


__all__ = [
    "FAMILIES", "RESERVED", "Span", "Stimulus", "check_options", "family_function", "generate", "load_bigtom", "load_user_file", "read_jsonl",
    "stimuli_hash", "write_jsonl", "write_user_csv",
]
