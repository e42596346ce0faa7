"""Controls that say how much of a probe's accuracy is about the model rather than the probe or text.

- Shuffled labels (Hewitt & Liang's control task, simplified to rows): the same probe, same C
  search, trained on the training labels permuted within the training split and scored on the
  held-out stories. Row labels cannot carry over to held-out stories, so its expected accuracy
  is chance: it is the level a probe of this capacity reaches by fitting noise on these folds,
  with its interval, and selectivity (accuracy minus control) is paired on the same test stories.
  It does not measure how well the probe could learn arbitrary labels per word type (the full
  Hewitt & Liang control task); read the bag-of-words line for what the words alone give away.
- Bag of words: a logistic probe on word counts of the stimulus text. If the words alone give the
  label away (they often do: "while Anna was away" marks a false-belief story), a layer's accuracy
  means little until it beats this line.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence

import torch
from jaxtyping import Float, Int
from torch import Tensor

from tomlens.stimuli.records import Stimulus

_WORD = re.compile(r"[a-z0-9]+(?:'[a-z]+)?")


def shuffle_labels(y: Int[Tensor, " n"], seed: int, *, decorrelate: bool = True) -> Int[Tensor, " n"]:
    """A permutation of `y` (same class counts), deterministic given the seed.

    A plain permutation keeps a chance correlation with the true labels (about 1/sqrt(n)); where a
    feature carries the true label strongly, the control probe latches onto that correlation and
    scores far above or below chance on the test rows, by luck of the draw. With `decorrelate`
    (the default) the permutation is drawn so that every true class receives each control label in
    proportion to its frequency (up to rounding): the control labels carry no information about
    the true ones, and the control measures what it should, the probe's capacity to fit noise.
    """
    gen = torch.Generator().manual_seed(seed)
    n = y.numel()
    if not decorrelate or n == 0:
        return y[torch.randperm(n, generator=gen)]
    # Rows laid out class by class (random order inside each class) ...
    rows = torch.randperm(n, generator=gen)
    rows = rows[torch.argsort(y[rows], stable=True)]
    # ... receive a label sequence in which each class is spread evenly (systematic sampling with
    # a random offset per class), so every block of rows gets its proportional share of each label.
    keys = torch.empty(n, dtype=torch.float64)
    for c in torch.unique(y):
        members = (y == c).nonzero().squeeze(1)
        k = members.numel()
        offset = torch.rand(1, generator=gen, dtype=torch.float64)
        keys[members] = (torch.arange(k, dtype=torch.float64) + offset) / k
    keys += 1e-9 * torch.rand(n, generator=gen, dtype=torch.float64)  # random tie order
    labels = y[torch.argsort(keys)]
    out = torch.empty_like(y)
    out[rows] = labels
    return out


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
    X = torch.zeros(len(stimuli), max(len(vocab), 1), dtype=torch.float32)
    for i, t in enumerate(tokens):
        for w in t:
            j = index.get(w)
            if j is not None:
                X[i, j] += 1
    return X, vocab
