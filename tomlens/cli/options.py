"""Flags shared by the commands, so that every command spells a setting the same way.

`--sites` and `--positions` take one or more items, each of which may hold a comma list
(`--sites resid_post head_out` = `--sites resid_post,head_out`); `split_items` is the one parser
of that syntax. The model flags build a `ModelSpec`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from tomlens.runs.base import ModelSpec, split_items

__all__ = ["add_choice", "add_model_options", "add_positions", "add_prepend_bos", "add_progress", "add_renamed",
           "add_sites", "check_choices", "model_spec", "split_items"]

CLOSED_SETS = "closed_sets"  # the namespace entry add_choice fills: dest -> (what, allowed words)


def add_prepend_bos(p: argparse.ArgumentParser) -> None:
    """`--prepend-bos / --no-prepend-bos`; unset (None) follows the tokenizer's own rule."""
    p.add_argument("--prepend-bos", action=argparse.BooleanOptionalAction, default=None,
                   help="prepend the BOS token to every prompt (TransformerLens's convention) or "
                   "never; default: the tokenizer's own rule, as plain transformers runs it")


def add_model_options(p: argparse.ArgumentParser, *, weights: bool = True) -> None:
    """--model, --revision, --prepend-bos; with `weights`, also --dtype, --device and --seed."""
    p.add_argument("--model", default="smollm2-135m", help="model name (see `tomlens models`)")
    p.add_argument("--revision", default=None, help="hub commit, branch or tag to pin (hub ids only)")
    if weights:
        p.add_argument("--dtype", default=None, help="model dtype (default: bf16 on GPU, fp32 on CPU)")
        p.add_argument("--device", default=None, help="device (default: $TOMLENS_DEVICE, else CUDA when present, else CPU)")
    p.add_argument("--seed", type=int, default=0, help="random seed (and the weights of random-init models)")
    add_prepend_bos(p)


def model_spec(args: argparse.Namespace) -> ModelSpec:
    """The `ModelSpec` the model flags describe."""
    return ModelSpec(name=args.model, revision=args.revision, dtype=getattr(args, "dtype", None),
                     device=getattr(args, "device", None), prepend_bos=args.prepend_bos, seed=args.seed)


def add_sites(p: argparse.ArgumentParser, default: Sequence[str], help: str) -> None:
    p.add_argument("--sites", nargs="+", default=list(default), help=help + " (space- or comma-separated)")


def add_positions(p: argparse.ArgumentParser, default: Sequence[str], help: str) -> None:
    p.add_argument("--positions", nargs="+", default=list(default), help=help + " (space- or comma-separated)")


def add_progress(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


class _Renamed(argparse.Action):
    """An old flag name: stores into the new one's destination and says the new name once."""

    def __init__(self, option_strings: Sequence[str], dest: str, new: str = "", **kwargs: object) -> None:
        self.new = new
        super().__init__(option_strings, dest, **kwargs)  # type: ignore[arg-type]

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        print(f"{option_string} is now {self.new} (one name per idea); the old name goes in a later release",
              file=sys.stderr)
        setattr(namespace, self.dest, values)


def add_renamed(p: argparse.ArgumentParser, old: str, new: str, **kwargs: object) -> None:
    """Accept `old`, a flag renamed to `new` (added before), for one release, hidden from --help."""
    dest = new.lstrip("-").replace("-", "_")
    p.add_argument(old, dest=dest, action=_Renamed, new=new, help=argparse.SUPPRESS, **kwargs)  # type: ignore[arg-type]


def add_choice(p: argparse.ArgumentParser, *flags: str, choices: Sequence[str], what: str | None = None,
               **kwargs: object) -> argparse.Action:
    """An argument that takes one word of `choices`, shown as `{a,b}` as argparse's `choices=` shows
    it, but checked by `check_choices` when the command runs: a misspelt word then gets one line
    naming the nearest word and the set, not argparse's whole usage with no suggestion."""
    action = p.add_argument(*flags, **kwargs)  # type: ignore[arg-type]
    if action.metavar is None:
        action.metavar = "{" + ",".join(choices) + "}"
    closed = dict(p.get_default(CLOSED_SETS) or {})
    closed[action.dest] = (what or flags[0].lstrip("-").replace("-", " "), tuple(choices))
    p.set_defaults(**{CLOSED_SETS: closed})
    return action


def check_choices(args: argparse.Namespace) -> None:
    """Refuse a word outside its closed set (see `add_choice`), naming the nearest: one TomlensError."""
    from tomlens.vocabulary import one_of

    for dest, (what, allowed) in (getattr(args, CLOSED_SETS, None) or {}).items():
        value = getattr(args, dest, None)
        for word in value if isinstance(value, list) else [value]:
            if word is not None:
                one_of(what, word, allowed)
