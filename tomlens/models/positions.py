"""Token positions from stimulus role spans, through the tokenizer's character offsets.

A probe or a patch reads "the protagonist's mention" or "the final token", never a hard-coded
index: prompts differ in length and tokenizers split words differently. A selector names a role;
the position is found by intersecting the role's character span with each token's offsets.

Selectors:
  - `final`: the last real token (the answer is predicted from here);
  - `<role>`: the last token of that role's span (e.g. `protagonist`, `object`, `location_1`);
  - `<role>:first`: the first token of that span;
  - `contrast_end`: the last token of the contrast sentence (same as `contrast`, named for intent);
  - `query_protagonist`, `query_object`: the question's own mention of the protagonist and of what
    it asks about (generated false-belief stories; BigToM pairs have `query_protagonist`), which
    differ from `protagonist` / `object` (their first mentions in the story).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from jaxtyping import Int
from torch import Tensor

from tomlens.errors import TomlensError
from tomlens.stimuli.records import Stimulus

FINAL = "final"
ALIASES: dict[str, str] = {"contrast_end": "contrast"}


def parse_selectors(selectors: str | Sequence[str]) -> list[str]:
    """Normalise a selector or a list of them (a string may hold several, separated by spaces)."""
    items = selectors.split() if isinstance(selectors, str) else [str(s).strip() for s in selectors]
    items = [s for s in items if s]
    if not items:
        raise TomlensError("no positions were given", "name at least one, e.g. final or protagonist")
    for s in items:
        role, sep, which = s.partition(":")
        if sep and which not in ("first", "last"):
            raise TomlensError(
                f"position {s!r}: {which!r} is not first or last",
                "write <role>, <role>:first or <role>:last (e.g. object:first)",
            )
        if not role or (role == FINAL and sep):
            raise TomlensError(f"position {s!r} is malformed", "write final, <role> or <role>:first")
    return list(dict.fromkeys(items))


def _span_of(stimulus: Stimulus, selector: str) -> tuple[str, bool]:
    """(role, first?) for a span selector, checking the stimulus has that span."""
    role, _, which = selector.partition(":")
    role = ALIASES.get(role, role)
    if role not in stimulus.spans:
        have = ", ".join(sorted(stimulus.spans)) or "none"
        raise TomlensError(
            f"stimulus {stimulus.id!r} has no span {role!r} (position {selector!r}); its spans: {have}",
            "choose a position from its spans, or use `final`",
        )
    return role, which == "first"


def check_selectors(stimuli: Sequence[Stimulus], selectors: Sequence[str]) -> None:
    """Fail before any forward if a stimulus lacks a span a selector needs."""
    for s in stimuli:
        for sel in selectors:
            if sel != FINAL:
                _span_of(s, sel)


def lacking(stimuli: Sequence[Stimulus], selectors: Sequence[str]) -> dict[str, int]:
    """How many stimuli lack the span each selector needs (selectors every stimulus has are left
    out), so a caller can drop a default position with a note instead of failing."""
    out: dict[str, int] = {}
    for sel in selectors:
        if sel == FINAL:
            continue
        role = ALIASES.get(sel.partition(":")[0], sel.partition(":")[0])
        n = sum(role not in s.spans for s in stimuli)
        if n:
            out[sel] = n
    return out


def span_position(stimulus: Stimulus, batch: Any, row: int, selector: str) -> int:
    """Padded index of the first or last token whose characters overlap the selector's span."""
    role, first = _span_of(stimulus, selector)
    span = stimulus.spans[role]
    tokens = [
        t
        for t, (start, end) in enumerate(batch.offsets[row])
        if end > start and start < span.end and end > span.start
    ]
    if not tokens:
        raise TomlensError(
            f"stimulus {stimulus.id!r}: no token covers span {role!r} "
            f"[{span.start}, {span.end}) = {span.of(stimulus.text)!r}",
            "check the span offsets against the text (end is exclusive)",
        )
    return int(batch.pad[row] + (tokens[0] if first else tokens[-1]))


def resolve_positions(
    stimuli: Sequence[Stimulus], batch: Any, selectors: str | Sequence[str]
) -> Int[Tensor, "batch n_sel"]:
    """Padded token index of every selector for every row of an `EncodedBatch` of these stimuli.

    The tensor is on the batch's device, ready to gather activations with.
    """
    sels = parse_selectors(selectors)
    if len(stimuli) != len(batch):
        raise ValueError(f"{len(stimuli)} stimuli but a batch of {len(batch)} rows")
    for row, s in enumerate(stimuli):
        if batch.texts and batch.texts[row] != s.text:
            raise ValueError(f"batch row {row} was not encoded from stimulus {s.id!r}")
    out = torch.empty((len(stimuli), len(sels)), dtype=torch.long)
    for row, s in enumerate(stimuli):
        for j, sel in enumerate(sels):
            out[row, j] = int(batch.last[row]) if sel == FINAL else span_position(s, batch, row, sel)
    return out.to(batch.input_ids.device)
