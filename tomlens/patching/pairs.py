"""Minimal pairs made ready for patching: tokenised once for a model, checked to be aligned, sorted
by length into groups of pairs (little padding), with the answer tokens of the metric and the
padded column of every selector position.

In a group's batch, rows `0..g-1` are the clean stories and `g..2g-1` the corrupted ones; `roles`
says which row a patched run is based on and which one its patched values come from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Sequence

import torch
from jaxtyping import Int
from torch import Tensor

from tomlens.errors import TomlensError
from tomlens.models.tokens import option_first_tokens

Direction = Literal["denoise", "noise"]


@dataclass
class Group:
    """A batch of pairs: rows `0..g-1` are the clean stories, `g..2g-1` the corrupted ones."""

    index: list[int]
    batch: Any  # tomlens.models.tokens.EncodedBatch
    tokens: Int[Tensor, "story 2"]
    first_diff: Int[Tensor, "g"]  # padded column of the first token where clean != corrupted
    positions: dict[str, Int[Tensor, "g"]]  # selector -> padded column (same in clean and corrupted)

    @property
    def g(self) -> int:
        return len(self.index)

    @property
    def width(self) -> int:
        return int(self.batch.input_ids.shape[1])

    def pad(self, j: int) -> int:
        return int(self.batch.pad[j])


@dataclass
class PreparedPairs:
    """Pairs tokenised once for a model: groups, answer tokens, aligned position labels."""

    pairs: list[Any]
    groups: list[Group]
    lengths: list[int]
    n_aligned: int
    token_labels: list[str]
    selectors: tuple[str, ...]

    @property
    def ids(self) -> list[str]:
        return [p.id for p in self.pairs]


def _other(options: tuple[str, str], answer: str) -> str:
    return options[1] if options[0] == answer else options[0]


def prepare_pairs(
    model, pairs: Sequence[Any], *, selectors: Sequence[str] = (), batch_pairs: int = 8
) -> PreparedPairs:
    """Tokenise pairs for `model`, check they are aligned, resolve selector positions.

    Pairs are sorted by length into groups of `batch_pairs` so a group carries little padding.
    """
    from tomlens.models.tokens import encode

    pairs = list(pairs)
    if not pairs:
        raise TomlensError("no minimal pairs to patch", "generate pairs with `tomlens pairs` first")
    for p in pairs:
        if tuple(p.clean.options) != tuple(p.corrupted.options):
            raise TomlensError(
                f"pair {p.id!r}: clean and corrupted stories have different options "
                f"({list(p.clean.options)} vs {list(p.corrupted.options)})",
                "build pairs with tomlens.stimuli.pairs.make_pairs",
            )
    selectors = tuple(s for s in selectors if s not in ("all", "each"))
    options = [(p.clean.answer, _other(p.clean.options, p.clean.answer)) for p in pairs]
    tokens = option_first_tokens(model, [p.clean for p in pairs], options)
    tok = model.tokenizer
    lengths = [len(tok(p.clean.text, add_special_tokens=True)["input_ids"]) for p in pairs]
    order = sorted(range(len(pairs)), key=lambda i: (-lengths[i], i))
    groups: list[Group] = []
    for a in range(0, len(order), max(1, batch_pairs)):
        idx = order[a : a + batch_pairs]
        g = len(idx)
        batch = encode(model, [pairs[i].clean.text for i in idx] + [pairs[i].corrupted.text for i in idx])
        ids = batch.input_ids
        first = torch.empty(g, dtype=torch.long)
        for j, i in enumerate(idx):
            if batch.lengths[j] != batch.lengths[g + j]:
                raise TomlensError(
                    f"pair {pairs[i].id!r} is not aligned: the clean story has {batch.lengths[j]} "
                    f"tokens, the corrupted one {batch.lengths[g + j]}",
                    "align pairs for this model's tokenizer with tomlens.stimuli.pairs.align_pairs",
                )
            diff = (ids[j] != ids[g + j]).nonzero().flatten()
            first[j] = int(diff[0]) if len(diff) else ids.shape[1]
        positions: dict[str, Tensor] = {}
        if selectors:
            from tomlens.models.positions import resolve_positions

            stories = [pairs[i].clean for i in idx] + [pairs[i].corrupted for i in idx]
            pos = resolve_positions(stories, batch, list(selectors)).cpu().long()
            for s_i, sel in enumerate(selectors):
                c, r = pos[:g, s_i], pos[g:, s_i]
                bad = (c != r).nonzero().flatten().tolist()
                if bad:
                    j = bad[0]
                    raise TomlensError(
                        f"pair {pairs[idx[j]].id!r}: position {sel!r} is token {int(c[j])} in the "
                        f"clean story and {int(r[j])} in the corrupted one",
                        "patch at selectors outside the contrast span, or re-align the pairs",
                    )
                positions[sel] = c
        t = tokens[idx]
        groups.append(Group(idx, batch, torch.cat([t, t]), first, positions))
    lengths = [0] * len(pairs)
    for grp in groups:
        for j, i in enumerate(grp.index):
            lengths[i] = int(grp.batch.lengths[j])
    n_aligned = max(lengths)
    return PreparedPairs(pairs, groups, lengths, n_aligned, _token_labels(model, groups, n_aligned), selectors)


def _token_labels(model, groups: Sequence[Group], n_aligned: int) -> list[str]:
    """Axis labels for right-aligned positions, from the longest pair ("clean|corrupted" where
    the two stories differ)."""
    grp = groups[0]  # the first group holds the longest pairs
    ids = grp.batch.input_ids
    width = grp.width
    out = []
    for k in range(n_aligned):
        col = width - n_aligned + k
        if col < grp.pad(0):
            out.append(f"{k}")
            continue
        a = model.tokenizer.decode([int(ids[0, col])])
        b = model.tokenizer.decode([int(ids[grp.g, col])])
        out.append(f"{k}:{a}" if a == b else f"{k}:{a}|{b}")
    return out


def roles(direction: Direction, g: int, j: int) -> tuple[int, int]:
    """(base row, source row) of pair j: denoising runs the corrupted story with clean values."""
    if direction == "denoise":
        return g + j, j
    if direction == "noise":
        return j, g + j
    raise TomlensError(f"unknown patching direction {direction!r}", "use 'denoise' or 'noise'")


def as_prepared(
    model, pairs: Sequence[Any] | PreparedPairs, selectors: Sequence[str] = (), batch_pairs: int = 8
) -> PreparedPairs:
    """Pairs already prepared as they are, else prepared for `model` with `selectors` (so every
    sweep accepts either)."""
    if isinstance(pairs, PreparedPairs):
        return pairs
    return prepare_pairs(model, pairs, selectors=selectors, batch_pairs=batch_pairs)
