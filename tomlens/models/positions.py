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
    differ from `protagonist` / `object` (their first mentions in the story);
  - `<role>@<k>` (k-th mention, 1-based) and `<role>@last` (last mention), from
    `Stimulus.mentions`, each combinable with `:first` / `:last`: a role's first mention often sits
    in the first sentence, before anything that bears on belief, so a position can name the
    protagonist's mention after the cue (`protagonist@3`) or the last one (`protagonist@last`).
    `@1` falls back to `spans[role]` for records without mentions.

`role_mentions(stimulus)` lists every mention as (`role@k`, span) in text order.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Sequence
from typing import Any, Literal

import torch
from jaxtyping import Int
from torch import Tensor

from tomlens.devices import to_device
from tomlens.errors import TomlensError
from tomlens.stimuli.records import Span, Stimulus

FINAL = "final"
ALIASES: dict[str, str] = {"contrast_end": "contrast"}
# Roles that name a word (a mention) rather than a sentence; `role_mentions` falls back to their
# `spans` entry (as `@1`) when a record has no `mentions` for them.
MENTION_ROLES: tuple[str, ...] = (
    "protagonist", "other_agent", "object", "location_1", "location_2", "container", "cue",
    "query_protagonist", "query_object",
)
# Every role a built-in family's stories name (spans or mentions); a user's file may add its own.
KNOWN_ROLES: tuple[str, ...] = (
    FINAL, "bystander", "container", "contrast", "contrast_label", "contrast_leave", "contrast_move",
    "contrast_seen", "contrast_told", "cue", "lead_in", "location_1", "location_2", "object", "other_agent",
    "protagonist", "query", "query_object", "query_protagonist", "question", "scene", "statement",
    "statement_claim", "statement_place", "story", "third_agent", "fourth_agent", "fifth_agent", "utterance",
)
_SELECTOR = re.compile(r"^(?P<role>[^@:\s]+)(?:@(?P<k>[0-9]+|last))?(?::(?P<which>[^:]*))?$")


def split_selector(selector: str) -> tuple[str, int | Literal["last"] | None, bool]:
    """(role, mention, first?) of a selector: mention is None (the span), k >= 1 or "last"."""
    m = _SELECTOR.match(selector)
    if m is None:
        raise TomlensError(f"position {selector!r} is malformed",
                           "write final, <role>, <role>@<k>, <role>@last, each optionally with :first")
    role, k, which = m.group("role"), m.group("k"), m.group("which")
    if which is not None and which not in ("first", "last"):
        raise TomlensError(
            f"position {selector!r}: {which!r} is not first or last",
            "write <role>, <role>:first or <role>:last (e.g. object:first, protagonist@2:first)",
        )
    if k is not None and k != "last" and int(k) < 1:
        raise TomlensError(f"position {selector!r}: mentions count from 1", "write <role>@1 for the first mention")
    if role == FINAL and (k is not None or which is not None):
        raise TomlensError(f"position {selector!r} is malformed", "write final, <role> or <role>:first")
    mention: int | Literal["last"] | None = None if k is None else ("last" if k == "last" else int(k))
    return ALIASES.get(role, role), mention, which == "first"


def parse_selectors(selectors: str | Sequence[str]) -> list[str]:
    """Normalise a selector or a list of them (a string may hold several, separated by spaces)."""
    items = selectors.split() if isinstance(selectors, str) else [str(s).strip() for s in selectors]
    items = [s for s in items if s]
    if not items:
        raise TomlensError("no positions were given", "name at least one, e.g. final or protagonist")
    for s in items:
        split_selector(s)
    return list(dict.fromkeys(items))


def refuse_near_misses(selectors: Sequence[str], *, user_spans: bool = False) -> None:
    """Refuse, before any model loads, a position whose role is not one tomlens knows but is close to
    one (`protagnist`, `fnal`), naming it; a role far from every known one may be a user's own span
    and is left to the stimuli to confirm (`check_selectors`). With `user_spans` (some stories come
    from a user's file, whose spans may be named anything, `cues` or `location` too) nothing is
    refused here: the stimuli say which spans exist, and a missing one is refused with a suggestion
    from them."""
    if user_spans:
        return
    for selector in selectors:
        role = split_selector(selector)[0]
        if role in KNOWN_ROLES or re.search(r"_\d+$", role):
            continue
        near = difflib.get_close_matches(role, KNOWN_ROLES, n=1, cutoff=0.8)
        if near:
            raise TomlensError(f"unknown position {selector!r}: did you mean {near[0]!r}?",
                               f"use final or a role the stories name ({', '.join(KNOWN_ROLES)}), "
                               "each optionally with @<k> and :first")


def _mentions_of(stimulus: Stimulus, role: str) -> tuple[Span, ...]:
    """A role's mentions in text order: `mentions[role]`, else its first-mention span alone."""
    if role in stimulus.mentions:
        return stimulus.mentions[role]
    return (stimulus.spans[role],) if role in stimulus.spans else ()


def selector_span(stimulus: Stimulus, selector: str) -> tuple[Span, bool]:
    """(span, first?) a span selector points into, checking the stimulus has that span or mention."""
    role, mention, first = split_selector(selector)
    if mention is None:
        if role in stimulus.spans:
            return stimulus.spans[role], first
        if stimulus.mentions.get(role):
            return stimulus.mentions[role][0], first
        have = ", ".join(sorted(stimulus.spans)) or "none"
        near = difflib.get_close_matches(role, [FINAL, *stimulus.spans, *stimulus.mentions], n=1, cutoff=0.5)
        raise TomlensError(
            f"stimulus {stimulus.id!r} has no span {role!r} (position {selector!r}"
            + (f"; did you mean {near[0]!r}?" if near else "") + f"); its spans: {have}",
            "choose a position from its spans, or use `final`",
        )
    found = _mentions_of(stimulus, role)
    if mention == "last":
        if role in stimulus.mentions and found:
            return found[-1], first
        raise TomlensError(
            f"stimulus {stimulus.id!r} records no mentions of {role!r} (position {selector!r}), so its last "
            f"mention is unknown" + (" (it has the first mention only, as a span)" if found else ""),
            "regenerate the stimuli with a tomlens that fills `mentions`, or use "
            f"{role}@1 / {role}",
        )
    if mention > len(found) or (mention > 1 and role not in stimulus.mentions):
        n = len(stimulus.mentions.get(role, ())) if role in stimulus.mentions else len(found)
        where = "mentions" if role in stimulus.mentions else ("a first-mention span only" if found else "no mention")
        raise TomlensError(
            f"stimulus {stimulus.id!r} has {n} mention(s) of {role!r} ({where}), so position {selector!r} "
            "does not exist",
            f"use {role}@1..{role}@{n} or {role}@last" if n else "choose a role the stimulus mentions",
        )
    return found[mention - 1], first


def check_selectors(stimuli: Sequence[Stimulus], selectors: Sequence[str]) -> None:
    """Fail before any forward if a stimulus lacks a span or mention a selector needs."""
    for s in stimuli:
        for sel in selectors:
            if sel != FINAL:
                selector_span(s, sel)


def lacking(stimuli: Sequence[Stimulus], selectors: Sequence[str]) -> dict[str, int]:
    """How many stimuli lack the span or mention each selector needs (selectors every stimulus has
    are left out), so a caller can drop a default position with a note instead of failing."""
    out: dict[str, int] = {}
    for sel in selectors:
        if sel == FINAL:
            continue
        n = 0
        for s in stimuli:
            try:
                selector_span(s, sel)
            except TomlensError:
                n += 1
        if n:
            out[sel] = n
    return out


def role_mentions(stimulus: Stimulus) -> list[tuple[str, Span]]:
    """Every mention of every role as ("protagonist@1", span), ... in text order: `mentions`, plus
    the first-mention span (as `@1`) of a word role (`MENTION_ROLES`) that has no mentions recorded."""
    found = {role: tuple(spans) for role, spans in stimulus.mentions.items()}
    for role in MENTION_ROLES:
        if role not in found and role in stimulus.spans:
            found[role] = (stimulus.spans[role],)
    out = [(f"{role}@{k}", span) for role, spans in found.items() for k, span in enumerate(spans, 1)]
    return sorted(out, key=lambda x: (x[1].start, x[1].end, x[0]))


def token_index(stimulus: Stimulus, offsets: Sequence[tuple[int, int]], selector: str) -> int:
    """Index (into `offsets`, i.e. unpadded) of the first or last token whose characters overlap
    the selector's span."""
    span, first = selector_span(stimulus, selector)
    tokens = [t for t, (start, end) in enumerate(offsets) if end > start and start < span.end and end > span.start]
    if not tokens:
        raise TomlensError(
            f"stimulus {stimulus.id!r}: no token covers position {selector!r} "
            f"[{span.start}, {span.end}) = {span.of(stimulus.text)!r}",
            "check the span offsets against the text (end is exclusive)",
        )
    return tokens[0] if first else tokens[-1]


def host_positions(stimuli: Sequence[Stimulus], batch: Any, selectors: Sequence[str]) -> list[list[int]]:
    """Padded token index of every selector for every row, from the tokenizer's output alone.

    Read off the batch's host-side pads, lengths and offsets, never its device tensors: on a GPU
    each `int()` of a device value waits for every queued kernel (two per prompt made a caching
    forward run as dozens of short bursts)."""
    return [[batch.pad[row] + i for i in at] for row, at in enumerate(token_positions(stimuli, batch.offsets, selectors))]


def token_positions(stimuli: Sequence[Stimulus], offsets: Sequence[Sequence[tuple[int, int]]],
                    selectors: Sequence[str]) -> list[list[int]]:
    """Unpadded token index of every selector for every row, from each row's character offsets
    (`tokenize`'s): where a row sits in a padded batch adds its pad count, and nothing else."""
    return [[len(offs) - 1 if sel == FINAL else token_index(s, offs, sel) for sel in selectors]
            for s, offs in zip(stimuli, offsets, strict=True)]


def resolve_positions(
    stimuli: Sequence[Stimulus], batch: Any, selectors: str | Sequence[str]
) -> Int[Tensor, "batch n_sel"]:
    """Padded token index of every selector for every row of an `EncodedBatch` of these stimuli.

    Computed on the host (`host_positions`) and moved to the batch's device in one copy, ready to
    gather activations with; no host sync.
    """
    sels = parse_selectors(selectors)
    if len(stimuli) != len(batch):
        raise ValueError(f"{len(stimuli)} stimuli but a batch of {len(batch)} rows")
    for row, s in enumerate(stimuli):
        if batch.texts and batch.texts[row] != s.text:
            raise ValueError(f"batch row {row} was not encoded from stimulus {s.id!r}")
    return to_device(torch.tensor(host_positions(stimuli, batch, sels), dtype=torch.long), batch.input_ids.device)
