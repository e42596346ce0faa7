"""Score one heuristic on one contrast: task-held-out folds, a cluster interval, a verdict.

Why these choices:
- Folds hold out whole tasks. Prompts of one task share their names, objects and frame, so a
  heuristic scored on a task it was fitted on would learn the task, not the cue.
- The cue -> class mapping (and the bag's classifier) is fitted on the training tasks only; a rule
  never states what it predicts, so a rule that happens to point the wrong way is not "below
  chance" by construction, and one that points the right way has earned it on unseen tasks.
- The interval is a normal interval with a cluster-robust (task) standard error, at the battery's
  Bonferroni-corrected level: a battery of some 40 rows at 95% each would call two of them shortcuts
  on a perfect set. A bootstrap at that level would need tens of thousands of draws per row.
- Accuracy is balanced (each class weighs the same, chance 1/classes) unless the contrast states
  its chance: a contrast such as the keyed option's position is balanced *by design*, and its
  imbalance is the shortcut, so there plain accuracy is scored against the stated chance.
- Logistic regression by liblinear (one-vs-rest for more classes): lbfgs took 20 s per fold on a
  512-row trigram bag, liblinear 0.1 s.
- A row the interval calls a shortcut is confirmed against a permutation null (`permutation_null`):
  the task-level interval treats tasks as independent, which a cross-validated accuracy is not.
- Verdict "shortcut" when the interval lies above chance at the battery's level and the null agrees.
  An n-gram bag over `BAG_CEILING` from `CEILING_TASKS` tasks on that is not significant is marked
  OVER_CEILING: visible, but not a shortcut. A cross-validated bag's accuracy varies between fresh
  sets of one generator more than any within-set spread says (the factorial's 3-gram bag: 0.61,
  0.50 and 0.42 on seeds 101, 303 and 404; one Kosoy task alone 0.609 [0.41, 0.81]), so a 0.60
  ceiling judged at 95% per row would call noise a shortcut on one seed in a few.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy import stats
from sklearn.linear_model import LogisticRegression
from sklearn.multiclass import OneVsRestClassifier

N_FOLDS = 5
MIN_TASKS = 8  # fewer held-out tasks than this cannot tell a cue from luck
BAG_CEILING = 0.60
CEILING_TASKS = 64
_EPS = 1e-9  # an exact-chance row (every task scored alike) must not read as above or below by rounding
SHORTCUT, AT_CHANCE, BELOW, TOO_FEW = "shortcut", "at chance", "below chance", "too few tasks"
OVER_CEILING = "over 0.60, not significant"


@dataclass(frozen=True)
class Score:
    """Held-out accuracy of one heuristic on one contrast, with its interval over tasks."""

    accuracy: float
    ci_low: float
    ci_high: float
    n_rows: int
    n_tasks: int
    se: float = float("nan")  # the cluster-robust standard error


def task_folds(tasks: Sequence[str], seed: int, n_folds: int = N_FOLDS) -> np.ndarray:
    """The fold of each row: whole tasks, shuffled by `seed`, dealt round-robin into folds."""
    unique = sorted(set(tasks))
    order = np.random.default_rng(seed).permutation(len(unique))
    fold_of = {unique[j]: i % min(n_folds, len(unique)) for i, j in enumerate(order)}
    return np.array([fold_of[t] for t in tasks])


def class_weights(labels: Sequence[Hashable], balanced: bool) -> np.ndarray:
    """Each row's weight: 1 / (classes x its class's rows) when balanced (so every class weighs the
    same and the weights sum to 1), else 1 / rows."""
    if not balanced:
        return np.full(len(labels), 1.0 / len(labels))
    counts = Counter(labels)
    return np.array([1.0 / (len(counts) * counts[v]) for v in labels])


def _best(votes: dict[Hashable, float]) -> Hashable:
    top = max(votes.values())
    return min((label for label, w in votes.items() if w == top), key=repr)  # ties: a fixed pick


def _predict_cue(values: list[Hashable | None], labels: list[Hashable], weights: np.ndarray,
                 train: np.ndarray, test: np.ndarray) -> list[Hashable]:
    """Each cue value's (weighted) majority class on the training rows; absent or unseen values get
    the training rows' majority class."""
    overall: dict[Hashable, float] = {}
    by_value: dict[Hashable, dict[Hashable, float]] = {}
    for i in train:
        overall[labels[i]] = overall.get(labels[i], 0.0) + weights[i]
        if values[i] is not None:
            votes = by_value.setdefault(values[i], {})
            votes[labels[i]] = votes.get(labels[i], 0.0) + weights[i]
    default = _best(overall)
    mapping = {v: _best(votes) for v, votes in by_value.items()}
    return [mapping.get(values[i], default) if values[i] is not None else default for i in test]


def _predict_bag(X: Any, labels: list[Hashable], balanced: bool, train: np.ndarray,
                 test: np.ndarray) -> list[Hashable]:
    y = [labels[i] for i in train]
    if len(set(y)) == 1:
        return [y[0]] * len(test)
    keys = sorted(set(y), key=repr)
    clf = LogisticRegression(C=1.0, solver="liblinear", class_weight="balanced" if balanced else None)
    model = clf if len(keys) == 2 else OneVsRestClassifier(clf)
    model.fit(X[train], [keys.index(v) for v in y])
    return [keys[int(k)] for k in model.predict(X[test])]


def held_out_correct(features: list[Hashable | None] | Any, labels: list[Hashable], folds: np.ndarray,
                     *, balanced: bool = True) -> np.ndarray:
    """Whether each row's held-out prediction is its label. `features` is a cue value per row (a
    list) or a feature matrix (rows x features, dense or sparse); fitted with balanced classes if asked."""
    correct = np.zeros(len(labels), dtype=bool)
    weights = class_weights(labels, balanced)
    for fold in np.unique(folds):
        test, train = np.flatnonzero(folds == fold), np.flatnonzero(folds != fold)
        if len(train) == 0:
            continue
        if isinstance(features, list):
            predicted = _predict_cue(features, labels, weights, train, test)
        else:
            predicted = _predict_bag(features, labels, balanced, train, test)
        correct[test] = [p == labels[i] for p, i in zip(predicted, test, strict=True)]
    return correct


def cluster_interval(correct: np.ndarray, tasks: Sequence[str], level: float,
                     weights: np.ndarray | None = None) -> Score:
    """(Weighted) accuracy with a normal interval whose standard error treats tasks as the sampled
    units: a ratio estimator over task totals."""
    index = {t: i for i, t in enumerate(sorted(set(tasks)))}
    t_idx = np.array([index[t] for t in tasks])
    w = np.ones(len(correct)) if weights is None else weights
    total = np.bincount(t_idx, weights=w * correct)
    count = np.bincount(t_idx, weights=w)
    n, acc = len(count), float(total.sum() / count.sum())
    if n < 2:
        return Score(acc, float("nan"), float("nan"), len(correct), n)
    resid = total - acc * count
    se = float(np.sqrt(n / (n - 1) * (resid**2).sum()) / count.sum())
    z = float(stats.norm.ppf(0.5 + level / 2))
    return Score(acc, max(0.0, acc - z * se), min(1.0, acc + z * se), len(correct), n, se)


def verdict(score: Score, chance: float, *, ngram_bag: bool) -> str:
    if score.n_tasks < MIN_TASKS:
        return TOO_FEW
    if score.ci_low > chance + _EPS:
        return SHORTCUT
    if score.ci_high < chance - _EPS:
        return BELOW
    return not_significant(score, chance, ngram_bag=ngram_bag)


def not_significant(score: Score, chance: float, *, ngram_bag: bool) -> str:
    """The verdict of a row that is no shortcut: OVER_CEILING for an n-gram bag over the ceiling
    from enough tasks (also where the interval cleared chance but the permutation null did not
    confirm it), else AT_CHANCE."""
    if ngram_bag and score.n_tasks >= CEILING_TASKS and score.accuracy > max(BAG_CEILING, chance + 0.10):
        return OVER_CEILING
    return AT_CHANCE


NULL_PERMUTATIONS = 30  # enough for the null's mean and spread; the verdict reads them as a normal


def shuffled_labels(labels: Sequence[Hashable], tasks: Sequence[str], rng: np.random.Generator) -> list[Hashable]:
    """Labels shuffled the way the design allows: within each task that holds several classes, its
    classes are renamed among themselves (a random permutation of the task's classes), and among the
    tasks that hold one class, whole tasks' labels move across those tasks.

    Why renaming rather than shuffling rows: a generator draws which class goes where once per
    task or version (which option is listed first, which story is the false-belief one), and the
    rows that share a label share it by design (the prefixes of one story all key the same option).
    Renaming keeps that structure and redraws only what the generator drew, so the null carries the
    spread a fresh seed would; shuffled rows break it, and the null came out narrower than the
    spread between seeds (belief-tracking's contents stories: a 2-gram bag reading which option a
    word tends to be listed as scored 0.63, 0.69, 0.40 and 0.43 on four seeds, and the row-shuffled
    null confirmed 0.63 as a shortcut). For a task of one story per class the two are the same.
    Shuffling only within tasks would leave single-class tasks with their true labels, and a null
    near the observed accuracy (a real cue then looks like chance)."""
    by_task: dict[str, list[int]] = {}
    for i, t in enumerate(tasks):
        by_task.setdefault(t, []).append(i)
    out = list(labels)
    single = [idx for idx in by_task.values() if len({labels[i] for i in idx}) == 1]
    for idx in by_task.values():
        classes = list(dict.fromkeys(labels[i] for i in idx))
        if len(classes) > 1:
            renamed = dict(zip(classes, (classes[j] for j in rng.permutation(len(classes))), strict=True))
            for i in idx:
                out[i] = renamed[labels[i]]
    donors = rng.permutation(len(single))
    for idx, j in zip(single, donors, strict=True):
        for i in idx:
            out[i] = labels[single[j][0]]
    return out


def permutation_null(features: list[Hashable | None] | Any, labels: Sequence[Hashable], tasks: Sequence[str],
                     folds: np.ndarray, *, balanced: bool, seed: int,
                     n_permutations: int = NULL_PERMUTATIONS) -> tuple[float, float]:
    """Mean and spread of the held-out accuracy with the labels shuffled (`shuffled_labels`).

    Why: a cross-validated accuracy is not a mean of independent task scores. Each fold's classifier
    is shared by its tasks, and where each task holds one story of each class most tasks score
    exactly one half, so the task-level standard error can be far too small (a 3-gram bag on MoToMQA
    at chance, 0.499 over 768 stories, read 0.62 with a narrow interval at 64). The shuffled runs
    carry both sources of spread."""
    rng = np.random.default_rng([seed, 7919])
    accs = []
    for _ in range(n_permutations):
        y = shuffled_labels(labels, tasks, rng)
        w = class_weights(y, balanced)
        accs.append(float((w * held_out_correct(features, y, folds, balanced=balanced)).sum() / w.sum()))
    return float(np.mean(accs)), float(np.std(accs, ddof=1))


def confirmed(score: Score, null_mean: float, null_sd: float, level: float) -> str:
    """SHORTCUT when the accuracy also clears the permutation null at the battery's level, else
    AT_CHANCE (`not_significant` says how such a row is shown). The spread is the larger of the
    null's and the task-level standard error: the first carries the folds' shared classifiers, the
    second the sampling of tasks (fresh sets of one generator vary more than shuffles of one set). A
    null with no spread and no task spread confirms whatever lies above its mean."""
    spread = max(v for v in (null_sd, score.se, 0.0) if np.isfinite(v))
    if spread <= 0:
        return SHORTCUT if score.accuracy > null_mean + _EPS else AT_CHANCE
    z = (score.accuracy - null_mean) / spread
    return SHORTCUT if z > float(stats.norm.ppf(0.5 + level / 2)) else AT_CHANCE


def chance_of(labels: Sequence[Hashable], fixed: float | None) -> float:
    """The contrast's stated chance, else that of balanced accuracy: 1 / classes."""
    return fixed if fixed is not None else 1.0 / len(set(labels))
