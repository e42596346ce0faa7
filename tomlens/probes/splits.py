"""Leak-free splits: every story (task) lies wholly on one side, optionally every template or cue too.

The prompts of one task share their story, so a prompt-level split lets a probe memorise stories
(RepBelief's 80/20 split over prompts can put one story's prompts on both sides). Here rows are
grouped first and groups are assigned to folds; folds are deterministic given the seed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from jaxtyping import Int
from torch import Tensor

from tomlens.errors import TomlensError
from tomlens.stimuli.records import Stimulus

GROUPINGS: dict[str, tuple[str, ...]] = {
    "task": ("task_id",),  # no story on both sides
    "template": ("task_id", "template_id"),  # no story and no template on both sides
    "cue": ("task_id", "meta:cue_id"),  # no story and no cue phrasing on both sides
}


def _values(s: Stimulus, field: str) -> list[str]:
    """The values of one grouping field for a row: `meta:NAME` reads `s.meta[NAME]` (a string, or a
    list of them when a story has several cues); an empty task id stands for the row's own id."""
    if field.startswith("meta:"):
        value = s.meta.get(field[5:])
        if value is None or value == "":
            return []  # no cue phrasing recorded: the row falls back to the task grouping
        items = value if isinstance(value, (list, tuple)) else [value]
        return [f"{field}={v}" for v in items if v is not None and v != ""]
    value = getattr(s, field) or (s.id if field == "task_id" else "")
    return [value] if value else []


@dataclass(frozen=True)
class Split:
    """Row indices of one train/test split (sorted, disjoint)."""

    train: Int[Tensor, " n_train"]
    test: Int[Tensor, " n_test"]


def group_codes(stimuli: Sequence[Stimulus], by: str = "task") -> Int[Tensor, " n"]:
    """One integer group per row. Rows sharing a value of any field in the grouping are joined
    (union-find), so `by="template"` also keeps a task whose prompts use several templates
    together. Rows with an empty task id are their own group."""
    if by not in GROUPINGS:
        raise TomlensError(f"unknown grouping {by!r}", f"use one of {sorted(GROUPINGS)}")
    parent = list(range(len(stimuli)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for field in GROUPINGS[by]:
        first: dict[str, int] = {}
        for i, s in enumerate(stimuli):
            for value in _values(s, field):
                j = first.setdefault(value, i)
                ri, rj = find(i), find(j)
                if ri != rj:
                    parent[ri] = rj
    return as_codes([find(i) for i in range(len(stimuli))], len(stimuli))


def as_codes(groups: Sequence[Any] | Tensor | None, n: int) -> Int[Tensor, " n"]:
    """Integer codes for arbitrary group labels, numbered by first appearance (so folds do not
    depend on how groups are named); None makes every row its own group."""
    return torch.tensor(_code_list(groups, n), dtype=torch.long)


def _code_list(groups: Sequence[Any] | Tensor | None, n: int) -> list[int]:
    """`as_codes` as a Python list (host work stays off tensors)."""
    if groups is None:
        return list(range(n))
    values = groups.tolist() if isinstance(groups, Tensor) else list(groups)
    if len(values) != n:
        raise TomlensError(f"{len(values)} group labels for {n} rows", "pass one group label per row")
    first: dict[Any, int] = {}
    return [first.setdefault(v, len(first)) for v in values]


def group_kfold(groups: Sequence[Any] | Tensor, n_splits: int = 5, seed: int = 0) -> list[Split]:
    """K folds over groups: each group is in exactly one test fold.

    Groups are shuffled by `seed`, then placed largest first into the fold with the fewest rows,
    so folds are balanced even when groups differ in size.
    """
    codes = np.asarray(_code_list(groups, len(groups)), dtype=np.int64)  # all on the host, in numpy
    uniq, counts = np.unique(codes, return_counts=True)
    if n_splits < 2:
        raise TomlensError(f"n_splits={n_splits}", "use at least 2 folds")
    if uniq.size < n_splits:
        raise TomlensError(
            f"{uniq.size} groups cannot fill {n_splits} grouped folds (a group is a task, or with "
            "group_by='template' every task sharing a template, with group_by='cue' every task sharing a cue "
            "phrasing; generated families have 4 templates)",
            (f"use fewer folds (--folds {uniq.size} or less), group by task, or more stimuli"
             if uniq.size >= 2 else "group by task, or use more stimuli (at least 2 groups are needed)"),
        )
    rng = np.random.default_rng(seed)
    order = rng.permutation(uniq.size)
    order = order[np.argsort(-counts[order], kind="stable")]
    fold_of_group = np.zeros(uniq.size, dtype=np.int64)
    load = np.zeros(n_splits, dtype=np.int64)
    for g in order:
        f = int(np.argmin(load))
        fold_of_group[g] = f
        load[f] += int(counts[g])
    fold = fold_of_group[np.searchsorted(uniq, codes)]
    return [Split(train=torch.from_numpy(np.flatnonzero(fold != f)), test=torch.from_numpy(np.flatnonzero(fold == f)))
            for f in range(n_splits)]


def holdout(groups: Sequence[Any] | Tensor, test_size: float = 0.2, seed: int = 0) -> Split:
    """One grouped train/test split with about `test_size` of the rows in the test side."""
    if not 0 < test_size < 1:
        raise TomlensError(f"test_size={test_size}", "use a fraction between 0 and 1")
    k = max(2, int(round(1 / test_size)))
    return group_kfold(groups, k, seed)[0]


def fraction_split(groups: Sequence[Any] | Tensor, fraction: float, seed: int = 0) -> Split:
    """Whole groups on one side: about `fraction` of the distinct groups (at least one, and at least
    one left over) in `train`, the rest in `test`, drawn with `seed`. Needs two or more groups
    (callers say what that means for them first)."""
    keys = groups.tolist() if isinstance(groups, Tensor) else list(groups)
    uniq = sorted(set(keys))
    if len(uniq) < 2:
        raise TomlensError(f"{len(uniq)} group(s) cannot be split in two", "use more groups")
    k = min(len(uniq) - 1, max(1, round(fraction * len(uniq))))
    chosen = {uniq[i] for i in np.random.default_rng(seed).permutation(len(uniq))[:k]}
    inside = torch.tensor([key in chosen for key in keys], dtype=torch.bool)
    rows = torch.arange(len(keys))
    return Split(train=rows[inside], test=rows[~inside])


def restrict(split: Split, train_mask: Tensor, test_mask: Tensor) -> Split:
    """Keep only training rows where `train_mask` holds and test rows where `test_mask` holds
    (e.g. train on true-belief stories, test on false-belief stories of held-out tasks)."""
    return Split(train=split.train[train_mask[split.train]], test=split.test[test_mask[split.test]])


def leaked_groups(split: Split, groups: Sequence[Any] | Tensor) -> set[int]:
    """Group codes present on both sides of a split (empty for a leak-free split)."""
    codes = as_codes(groups, len(groups))
    return set(codes[split.train].tolist()) & set(codes[split.test].tolist())
