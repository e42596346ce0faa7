"""Closed sets of words (sites, scorings, contrasts, executors, ...): one refusal for a word outside
its set, naming the set and the nearest word, so that a typo costs one line and no guess.

Every config's `__post_init__` and every command checks its closed sets here, rather than with
argparse's `choices=`, whose refusal prints the whole usage and suggests nothing.
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Callable, Iterable, Mapping
from typing import ParamSpec, TypeVar

from tomlens.errors import TomlensError

__all__ = ["nearest", "one_of", "renamed_arguments", "unknown"]


def nearest(value: object, allowed: Iterable[str], hints: Mapping[str, str] | None = None) -> str | None:
    """The allowed word closest to `value` (difflib, as for TOML keys and model names), or the word
    `hints` maps it to (another command's spelling of the same idea); None when nothing is close."""
    text = str(value)
    if hints and text in hints:
        return hints[text]
    near = difflib.get_close_matches(text, list(allowed), n=1, cutoff=0.5)
    return near[0] if near else None


def unknown(what: str, value: object, allowed: Iterable[str], hints: Mapping[str, str] | None = None) -> TomlensError:
    """The error for `value`, which is not one of `allowed` (a `what`: "site", "scoring", ...)."""
    words = list(dict.fromkeys(allowed))
    near = nearest(value, words, hints)
    return TomlensError(f"unknown {what} {value!r}" + (f": did you mean {near!r}?" if near else ""),
                        f"use one of {', '.join(words)}")


def one_of(what: str, value: object, allowed: Iterable[str], hints: Mapping[str, str] | None = None) -> None:
    """Refuse `value` unless it is one of `allowed`, with the nearest word."""
    words = tuple(allowed)
    if value not in words:
        raise unknown(what, value, words, hints)


_P = ParamSpec("_P")
_R = TypeVar("_R")


def renamed_arguments(**renamed: str) -> Callable[[Callable[_P, _R]], Callable[_P, _R]]:
    """Accept each old keyword of `renamed` (old -> new) under its new name for one release, with a
    line naming the new one, as a renamed setting (`tomlens.runs.base.RENAMED_SETTINGS`) or flag
    (`tomlens.cli.options.add_renamed`) does: one name per idea in Python too, and a researcher's
    script written before the rename still runs. Both names given is an error."""
    def wrap(fn: Callable[_P, _R]) -> Callable[_P, _R]:
        @functools.wraps(fn)
        def call(*args: _P.args, **kwargs: _P.kwargs) -> _R:
            for old, new in renamed.items():
                if old not in kwargs:
                    continue
                if new in kwargs:
                    raise TomlensError(f"both {old}= and {new}= were given to {fn.__name__}",
                                       f"keep only {new}= ({old}= is its old name)")
                from tomlens.messages import warn

                warn(f"{fn.__name__}: argument {old}= is now {new}= (one name per idea); "
                     "the old name goes in a later release")
                kwargs[new] = kwargs.pop(old)
            return fn(*args, **kwargs)
        return call
    return wrap
