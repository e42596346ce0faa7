"""Probe targets, defined relative to the story so they mean the same thing in every item.

"protagonist_belief" is 1 when the protagonist believes the object is where it started (for
contents stories: believes the label), "world_state" is 1 when the object is where it started.
Across false- and true-belief stories the two come apart: only on false-belief rows
(`belief_differs`) do they disagree, which is where a probe shows which of the two it reads.
"joint" is the 4-way label 2 * world + belief. The statement targets follow Zhu et al.: is the
statement after the story true from the protagonist's point of view, or from the world's, and
(`statement_literal`) is it literally true, as the recursive belief tracker labels "Ben thinks that
Anna believes ..." (the label the statements' question asks for).

Why `label_variation`: a target that is constant within a condition (protagonist_belief on
false-belief transfer rows) can be decoded from whatever marks the condition, so a probe report
should say, per condition, whether the label varies there. Each target's description says which.

Rows without a label for the target are dropped (`keep` is False), never guessed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pandas as pd
import torch
from jaxtyping import Bool, Int
from torch import Tensor

from tomlens.errors import TomlensError
from tomlens.stimuli.records import Stimulus


@dataclass(frozen=True)
class Target:
    name: str
    description: str
    classes: tuple[str, ...]  # class names, index = label value
    label: Callable[[Stimulus], int | None]


def _flag(value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, str):
        v = value.strip().lower()
        if v in ("true", "1", "yes"):
            return 1
        if v in ("false", "0", "no"):
            return 0
        return None
    return int(bool(value))


def _joint(s: Stimulus) -> int | None:
    w, b = s.world_is_reference, s.belief_is_reference
    if w is None or b is None:
        return None
    return 2 * int(w) + int(b)


_CONSTANT = ("; constant within each condition of the transfer, contents, order-only and factorial "
             "families (it marks the condition there; world_state has one class in the order-only and "
             "factorial sets): check label_variation")
TARGETS: dict[str, Target] = {
    t.name: t
    for t in (
        Target("protagonist_belief", "the protagonist believes the object is where it started"
               + _CONSTANT, ("elsewhere", "where it started"), lambda s: _flag(s.belief_is_reference)),
        Target("world_state", "the object is where it started" + _CONSTANT,
               ("elsewhere", "where it started"), lambda s: _flag(s.world_is_reference)),
        Target("joint", "world state x protagonist belief (2 * world + belief)" + _CONSTANT,
               ("world moved, belief moved", "world moved, belief start",
                "world start, belief moved", "world start, belief start"), _joint),
        Target("statement_protagonist", "the statement's embedded claim is true for the protagonist; "
               "varies within every condition (the place named), but within a condition it is "
               "fixed by which place the statement names",
               ("false", "true"), lambda s: _flag(s.meta.get("statement_true_for_protagonist"))),
        Target("statement_world", "the statement's embedded claim is true of the world; varies "
               "within every condition (the place named), but within a condition it is fixed by "
               "which place the statement names",
               ("false", "true"), lambda s: _flag(s.meta.get("statement_true_for_world"))),
        Target("statement_literal", "the statement is literally true (recursive belief tracker over "
               "its chain of believers); varies within every condition and order, and which place "
               "is true depends on the chain",
               ("false", "true"), lambda s: _flag(s.meta.get("statement_literal_true"))),
    )
}


def get_target(name: str) -> Target:
    if name not in TARGETS:
        raise TomlensError(f"unknown probe target {name!r}", f"use one of {', '.join(TARGETS)}")
    return TARGETS[name]


def make_target(stimuli: Sequence[Stimulus], name: str) -> tuple[Int[Tensor, " n"], Bool[Tensor, " n"]]:
    """Labels for every row (0 where unlabelled) and which rows carry a label."""
    target = get_target(name)
    labels = [target.label(s) for s in stimuli]
    keep = torch.tensor([v is not None for v in labels], dtype=torch.bool)
    y = torch.tensor([0 if v is None else v for v in labels], dtype=torch.long)
    if not bool(keep.any()):
        raise TomlensError(
            f"no stimulus carries a label for target {name!r} ({target.description})",
            "use stimuli with world_state / protagonist_belief / reference_state "
            "(or statement labels in meta for the statement targets), or another target",
        )
    return y, keep


def false_belief_mask(stimuli: Sequence[Stimulus]) -> Bool[Tensor, " n"]:
    """Rows where the protagonist's belief and the world disagree (belief and world targets come
    apart here): `belief_differs`, or statement labels that disagree."""
    out = []
    for s in stimuli:
        p = _flag(s.meta.get("statement_true_for_protagonist"))
        w = _flag(s.meta.get("statement_true_for_world"))
        out.append(bool(s.belief_differs) or (p is not None and w is not None and p != w))
    return torch.tensor(out, dtype=torch.bool)


def true_belief_mask(stimuli: Sequence[Stimulus]) -> Bool[Tensor, " n"]:
    """Rows whose belief and world are both known and agree."""
    out = []
    for s in stimuli:
        known = s.world_state is not None and s.protagonist_belief is not None
        p = _flag(s.meta.get("statement_true_for_protagonist"))
        w = _flag(s.meta.get("statement_true_for_world"))
        if p is not None and w is not None:
            out.append(p == w and not s.belief_differs)
        else:
            out.append(known and not s.belief_differs)
    return torch.tensor(out, dtype=torch.bool)


def label_variation(stimuli: Sequence[Stimulus], target: str) -> pd.DataFrame:
    """Per condition: rows with a label (`n`), the share of label 1 (`share_1`; for the 4-way
    `joint` the share of its most common class is in `share_top`) and whether the label `varies`.

    Cheap (one pass over the records), so a probe table can flag a target that is constant within
    a condition: there a probe can be right by reading the condition alone."""
    t = get_target(target)
    rows: dict[str, list[int]] = {}
    for s in stimuli:
        v = t.label(s)
        if v is not None:
            rows.setdefault(s.condition, []).append(v)
    if not rows:
        raise TomlensError(f"no stimulus carries a label for target {target!r}",
                           "use stimuli that carry this target's labels")
    out = []
    for condition in sorted(rows):
        labels = rows[condition]
        top = max(labels.count(c) for c in set(labels))
        out.append({"condition": condition, "n": len(labels),
                    "share_1": sum(1 for v in labels if v == 1) / len(labels),
                    "share_top": top / len(labels), "varies": len(set(labels)) > 1})
    return pd.DataFrame(out, columns=["condition", "n", "share_1", "share_top", "varies"])
