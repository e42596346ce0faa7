"""Controls that say how much of a probe's accuracy is about the model rather than the probe or text.

- Type-level control task (Hewitt & Liang): every type cell of the stimuli, (template_id,
  meta cue_id where present, condition), or (template_id, condition) where cue phrasings do not
  recur across folds (the sweep picks the finer level whose cells recur, and says which), gets one
  random binary label, drawn so both labels are in
  every training split and the labels are balanced within folds as far as the cells allow. The same
  probe, same C search and same folds is trained on these labels and scored on them (its own labels,
  with its own chance level, `control_chance`). Because held-out stories of the same template and
  condition share the training cells' labels, a probe whose features tell the cells apart scores
  well above chance on the control: then its accuracy on the real target may be cell memorisation
  (words of the template and the condition), not belief. selectivity = score - control (paired on
  the same test stories).
  What it can show: that the features (and the probe's capacity) identify template x cue x
  condition, i.e. that a high target score is no evidence by itself. What it cannot show: that a
  low control means the target is read from belief (the target may still ride on one cell-level
  cue the control's random labels did not pick); and where test cells never occur in training
  (folds grouped by template or cue, order-only stories with one template per task, or
  true -> false-belief transfer, whose cells differ in condition) the control is at chance by
  construction: the sweep says so in a note.
- Condition split: the same probe decoding an arbitrary split of the set's conditions into two
  halves (the balanced split least correlated with the target). If it decodes as well as the
  target, the features separate conditions, and the target is one more split of them.
- Bag of words: a logistic probe on word counts of the stimulus text. If the words alone give the
  label away (they often do: "while Anna was away" marks a false-belief story), a layer's accuracy
  means little until it beats this line. Length and position baselines live in `baselines`.
- No row-shuffled control: scored against the true labels it is at chance by construction and
  cannot fail (the permutation null of `selection` permutes labels for its own test).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Hashable, Sequence
from itertools import combinations

import numpy as np
import torch
from jaxtyping import Float, Int
from torch import Tensor

from tomlens.stimuli.records import Stimulus

_WORD = re.compile(r"[a-z0-9]+(?:'[a-z]+)?")


def words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def bag_of_words(stimuli: Sequence[Stimulus], vocabulary: Sequence[str] | None = None,
                 *, min_count: int = 1) -> tuple[Float[Tensor, "n v"], list[str]]:
    """Word counts of each stimulus text over `vocabulary` (default: every word seen at least
    `min_count` times in these texts, sorted). Words outside the vocabulary are ignored, so a
    test set can be encoded with the training set's vocabulary."""
    tokens = [words(s.text) for s in stimuli]
    if vocabulary is None:
        counts = Counter(w for t in tokens for w in t)
        vocabulary = sorted(w for w, c in counts.items() if c >= min_count)
    vocab = list(vocabulary)
    index = {w: i for i, w in enumerate(vocab)}
    X = np.zeros((len(stimuli), max(len(vocab), 1)), dtype=np.float32)
    for i, t in enumerate(tokens):
        for w, c in Counter(t).items():
            j = index.get(w)
            if j is not None:
                X[i, j] = c
    return torch.from_numpy(X), vocab


CELL_LEVELS: dict[str, str] = {
    "template_cue_condition": "template x cue x condition",
    "template_condition": "template x condition",
    # for sets whose template is the task (order-only, the factorial): no template recurs across
    # folds, but the cue phrasings do
    "cue_condition": "cue x condition",
}


def type_cells(stimuli: Sequence[Stimulus], level: str = "template_cue_condition") -> list[tuple[Hashable, ...]]:
    """The type cell of each row: (template_id, meta cue_id or "", condition); at level
    "template_condition" (template_id, condition), for sets whose cue phrasings do not recur across
    folds; at level "cue_condition" (cue_id, condition), for sets whose templates do not recur (one
    template per task). A list of cue ids (a story with several cues) counts as one cue phrasing."""
    if level not in CELL_LEVELS:
        raise ValueError(f"unknown cell level {level!r}: use one of {', '.join(CELL_LEVELS)}")
    out: list[tuple[Hashable, ...]] = []
    for s in stimuli:
        if level == "template_condition":
            out.append((s.template_id, s.condition))
            continue
        cue = s.meta.get("cue_id", "")
        cue = tuple(cue) if isinstance(cue, (list, tuple)) else ("" if cue is None else cue)
        out.append((cue, s.condition) if level == "cue_condition" else (s.template_id, cue, s.condition))
    return out


def seen_share(cells_train: Sequence[Hashable], cells_test: Sequence[Hashable],
               splits: Sequence[tuple[Sequence[int], Sequence[int]]]) -> float:
    """The share of the splits' test rows (indices into `cells_test`) whose cell occurs among their
    split's training rows (indices into `cells_train`); 0 when no split has test rows."""
    seen = total = 0
    for train, test in splits:
        known = {cells_train[i] for i in train}
        seen += sum(cells_test[i] in known for i in test)
        total += len(test)
    return seen / total if total else 0.0


def choose_cell_level(train: Sequence[Stimulus], test: Sequence[Stimulus] | None = None,
                      splits: Sequence[tuple[Sequence[int], Sequence[int]]] | None = None) -> tuple[str, float]:
    """The finest type-cell level whose cells recur across `splits` (row indices into `train` and
    into `test`, or into `train` again when `test` is None; default: one split of every training
    row against every test row), and its seen share (`seen_share`).

    A control whose test cells never occur in training is at chance by construction and cannot
    fail, so the first level in `CELL_LEVELS` with at least half its test rows seen is chosen; the
    level "cue_condition" only where some stimulus carries a cue_id (without one its cells are the
    conditions). Where no level reaches half, the one with the largest share (the caller then
    withholds the control: share < 0.5)."""
    test_rows = train if test is None else test
    if splits is None:
        splits = [(range(len(train)), range(len(test_rows)))]
    has_cue = any(s.meta.get("cue_id") not in (None, "") for s in [*train, *test_rows])
    best: tuple[str, float] | None = None
    for level in CELL_LEVELS:
        if level == "cue_condition" and not has_cue:
            continue
        cells_tr = type_cells(train, level)
        cells_te = cells_tr if test is None else type_cells(test, level)
        share = seen_share(cells_tr, cells_te, splits)
        if share >= 0.5:
            return level, share
        if best is None or share > best[1]:
            best = (level, share)
    assert best is not None
    return best


def _balance_cost(labels: np.ndarray, splits: Sequence[tuple[np.ndarray, np.ndarray]]) -> float:
    """How far the worst training or test side of any split is from half ones (inf when a training
    side lacks a class)."""
    worst = abs(labels.mean() - 0.5) if labels.size else 0.0
    for train, test in splits:
        tr = labels[train]
        if tr.size and (tr.min() == tr.max()):
            return float("inf")
        for side in (tr, labels[test]):
            if side.size:
                worst = max(worst, abs(side.mean() - 0.5))
    return float(worst)


def type_control_labels(cells: Sequence[Hashable], splits: Sequence[tuple[Sequence[int], Sequence[int]]] = (),
                        seed: int = 0, *, tries: int = 64,
                        test_cells: Sequence[Hashable] | None = None) -> tuple[Int[Tensor, " n"], Int[Tensor, " m"]] | None:
    """One random 0/1 label per distinct cell of `cells` (one cell per training row), chosen among
    `tries` seeded draws as the one whose labels are most balanced on the training and test side of
    every split in `splits` (row indices into `cells`), with both labels in every training side.

    Returns the labels of the training rows and of `test_cells` (rows of another stimulus set;
    default: none; a cell not seen in training gets its own seeded random label), or None when
    fewer than two cells exist or no draw puts both labels in every training side.
    """
    codes: dict[Hashable, int] = {}
    row_code = np.array([codes.setdefault(c, len(codes)) for c in cells], dtype=np.int64)
    k = len(codes)
    if k < 2:
        return None
    sizes = np.bincount(row_code, minlength=k)
    sp = [(np.asarray(list(tr), dtype=np.int64), np.asarray(list(te), dtype=np.int64)) for tr, te in splits]
    rng = np.random.default_rng(seed)
    best: tuple[float, np.ndarray] | None = None
    for _ in range(max(1, tries)):
        # cells in random order, each to the label with fewer rows so far: balanced overall
        cell_label = np.zeros(k, dtype=np.int64)
        load = [0, 0]
        for c in rng.permutation(k):
            lab = int(load[1] < load[0]) if load[0] != load[1] else int(rng.integers(2))
            cell_label[c] = lab
            load[lab] += int(sizes[c])
        cost = _balance_cost(cell_label[row_code], sp)
        if best is None or cost < best[0]:
            best = (cost, cell_label)
    assert best is not None
    if not np.isfinite(best[0]):
        return None
    cell_label = best[1]
    train = torch.as_tensor(cell_label[row_code])
    extra: list[int] = []
    for c in test_cells or ():
        if c not in codes:
            codes[c] = len(codes)
            cell_label = np.append(cell_label, int(rng.integers(2)))
        extra.append(int(cell_label[codes[c]]))
    return train, torch.tensor(extra, dtype=torch.long)


def _abs_corr(a: np.ndarray, y: np.ndarray) -> float:
    """|Pearson r| of a 0/1 vector with the labels (for several classes: the largest over one-vs-rest)."""
    classes = np.unique(y)
    targets = [y == classes[1]] if classes.size == 2 else [y == c for c in classes]
    out = 0.0
    for t in targets:
        t = t.astype(np.float64)
        if a.std() == 0 or t.std() == 0:
            continue
        out = max(out, abs(float(np.corrcoef(a.astype(np.float64), t)[0, 1])))
    return out


def condition_split(conditions: Sequence[str], y: Int[Tensor, " n"], seed: int = 0,
                    *, max_splits: int = 2000) -> tuple[frozenset[str], float] | None:
    """The balanced split of the distinct `conditions` into two halves (sizes differ by at most one)
    least correlated with the labels `y` (rows aligned with `conditions`): the conditions of the
    half labelled 1 and its |correlation| with `y`. Ties go to the first in a seeded order; with
    many conditions `max_splits` random halves are tried. None for fewer than 3 conditions (with
    two, the only split is the one between them, which is the label itself or its complement)."""
    names = sorted(set(conditions))
    m = len(names)
    if m < 3:
        return None
    rng = np.random.default_rng(seed)
    cond = np.asarray(list(conditions), dtype=object)
    yy = y.cpu().numpy()
    half = m // 2
    from math import comb

    if comb(m, half) <= max_splits:
        options = [frozenset(c) for c in combinations(names, half)]
    else:
        options = [frozenset(rng.choice(names, half, replace=False).tolist()) for _ in range(max_splits)]
    if m % 2 == 0:  # a half and its complement are the same split
        options = [o for o in options if names[0] in o] or options
    order = rng.permutation(len(options))
    best: tuple[frozenset[str], float] | None = None
    for i in order:
        one = options[i]
        r = _abs_corr(np.isin(cond, list(one)), yy)
        if best is None or r < best[1] - 1e-12:
            best = (one, r)
    return best


def split_labels(conditions: Sequence[str], half: frozenset[str]) -> Int[Tensor, " n"]:
    """0/1 labels of rows whose condition is in `half` (see `condition_split`)."""
    return torch.tensor([int(c in half) for c in conditions], dtype=torch.long)
