"""Text baselines for the probe table, and the per-row comparison of each activation probe with them.

A probe's accuracy means little until it beats what the text gives away without any model. The
sweep fits the same probe, on the same folds and plans, to:

- bag of words (`controls.bag_of_words`): word counts of the prompt;
- length: the prompt's number of words and of characters (2 features, standardised);
- position: where the probed token sits, as its word index and as that index over the prompt's
  word count (at `final` the index is the prompt's length in words). A probe at a token can read
  how far into the prompt it is; this line says how much of the label that alone gives away. It
  deliberately does not encode where *other* sentences sit: in order-only stories the order of
  the leaving and moving sentences is the manipulation itself, which the model has to use;
- embeddings: the same probe on resid_pre layer 0 at the same token position (what the token and
  position embeddings alone carry), when the activations hold resid_pre:0.

`attach_baselines` copies each baseline's score onto the activation rows with the same (target,
train_on, eval_set, metric, test_set) as `baseline_*` columns; `add_best_baseline` (re)computes
`best_baseline`, `best_baseline_name` and `above_baseline` = score - best_baseline from whatever
`baseline_*` columns a table has (so a later stage can add one, e.g. a random-init twin:
`merge_twin` adds `baseline_random_init`, the same sweep's score on a random-init model).
"""

from __future__ import annotations

import re
from bisect import bisect_right
from collections.abc import Sequence

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float
from torch import Tensor

from tomlens.errors import TomlensError
from tomlens.stimuli.records import Stimulus

# features value of each baseline row -> its per-row column
BASELINE_COLUMNS: dict[str, str] = {
    "bag_of_words": "baseline_bow",
    "length": "baseline_length",
    "position": "baseline_position",
    "embeddings": "baseline_embeddings",
}
BASELINE_KEYS = ("target", "train_on", "eval_set", "metric", "test_set")
_WORD = re.compile(r"[A-Za-z0-9]+(?:'[A-Za-z]+)?")


def _standardise(X: Tensor, ref: Tensor) -> Tensor:
    mean = ref.mean(0, keepdim=True)
    std = ref.std(0, unbiased=False, keepdim=True)
    return (X - mean) / torch.where(std > 0, std, torch.ones_like(std))


def length_features(stimuli: Sequence[Stimulus], reference: Sequence[Stimulus] | None = None
                    ) -> Float[Tensor, "n 2"]:
    """Number of words and of characters of each prompt, standardised with the mean and spread of
    `reference` (default: these stimuli; pass the training set to encode a test set)."""
    def raw(st: Sequence[Stimulus]) -> Tensor:
        return torch.tensor([[len(_WORD.findall(s.text)), len(s.text)] for s in st], dtype=torch.float32)

    X = raw(stimuli)
    return _standardise(X, X if reference is None else raw(reference))


def word_index(text: str, char: int) -> int:
    """The index of the word of `text` that holds character offset `char` (the last word starting at
    or before it), so the first and the last character of a word give the same index."""
    return max(bisect_right([m.start() for m in _WORD.finditer(text)], char) - 1, 0)


def position_features(stimuli: Sequence[Stimulus], position: str = "final",
                      reference: Sequence[Stimulus] | None = None) -> Float[Tensor, "n 2"]:
    """The probed token's word index and that index over the prompt's word count, for the position
    selector `position` ("final" or a role selector such as "protagonist@2"), standardised with
    `reference` (default: these stimuli; pass the training set to encode a test set)."""
    from tomlens.models.positions import FINAL, selector_span

    def raw(st: Sequence[Stimulus]) -> Tensor:
        rows = []
        for s in st:
            n = max(len(_WORD.findall(s.text)), 1)
            if position == FINAL:
                index = n - 1
            else:
                span, first = selector_span(s, position)
                index = word_index(s.text, span.start if first else max(span.end - 1, span.start))
            rows.append([index, index / n])
        return torch.tensor(rows, dtype=torch.float32)

    X = raw(stimuli)
    return _standardise(X, X if reference is None else raw(reference))


def attach_baselines(table: pd.DataFrame) -> pd.DataFrame:
    """Copy each baseline row's score onto the activation rows (features == "activations") with
    the same target, train_on, eval_set, metric and test_set, as columns `baseline_bow`,
    `baseline_length`, `baseline_position`, `baseline_embeddings` (NaN where not run or on
    baseline rows), then `add_best_baseline`."""
    out = table.copy()
    acts = out["features"] == "activations"
    keys = list(BASELINE_KEYS)
    for features, column in BASELINE_COLUMNS.items():
        base = out.loc[out["features"] == features, keys + ["score"]]
        if base.duplicated(keys).any():
            raise TomlensError(f"several {features} rows share one (target, train_on, eval_set, metric, test_set)",
                               "run the sweep once per position")
        values = out.loc[acts, keys].merge(base.rename(columns={"score": column}), on=keys, how="left")[column]
        out[column] = np.nan
        out.loc[acts, column] = values.to_numpy(dtype=np.float64)
    return add_best_baseline(out)


def add_best_baseline(table: pd.DataFrame) -> pd.DataFrame:
    """(Re)compute `best_baseline` (the largest `baseline_*` value of a row, NaN ignored),
    `best_baseline_name` (its column without the prefix, "" where none) and `above_baseline`
    = score - best_baseline, from whatever `baseline_*` columns the table has. Returns a copy."""
    out = table.copy()
    cols = [c for c in out.columns if c.startswith("baseline_")]
    if not cols:
        out["best_baseline"] = np.nan
        out["best_baseline_name"] = ""
        out["above_baseline"] = np.nan
        return out
    vals = out[cols].to_numpy(dtype=np.float64)
    has = ~np.isnan(vals).all(1)
    filled = np.where(np.isnan(vals), -np.inf, vals)
    arg = filled.argmax(1)
    best = np.where(has, filled[np.arange(len(out)), arg], np.nan)
    names = np.array([c[len("baseline_"):] for c in cols], dtype=object)
    out["best_baseline"] = best
    out["best_baseline_name"] = np.where(has, names[arg], "")
    out["above_baseline"] = out["score"].to_numpy(dtype=np.float64) - best
    return out


TWIN_KEYS = ["kind", "layer", "head", "position", "target", "train_on", "eval_set", "metric"]


def merge_twin(table: pd.DataFrame, twin: pd.DataFrame) -> pd.DataFrame:
    """`baseline_random_init` on the activation rows of `table`: the twin's score on the row with
    the same (kind, layer, head, position, target, train_on, eval_set, metric); then the best
    baseline is recomputed over every `baseline_*` column."""
    t = twin[twin["features"] == "activations"][TWIN_KEYS + ["score"]].rename(columns={"score": "baseline_random_init"})
    if t.duplicated(TWIN_KEYS).any():
        raise TomlensError("the random-init twin's table has several rows per unit and evaluation",
                           "run the twin on one stimulus set and one position")
    out = table.copy()
    acts = (out["features"] == "activations").to_numpy()
    merged = out.loc[acts, TWIN_KEYS].merge(t, on=TWIN_KEYS, how="left")["baseline_random_init"]
    out["baseline_random_init"] = np.nan
    out.loc[acts, "baseline_random_init"] = merged.to_numpy(dtype=np.float64)
    return add_best_baseline(out)
