"""The probe interface: scikit-learn's estimator vocabulary over a batch of units.

A probe is fitted on activations `[unit, n, d]`: one independent linear classifier per unit
(a layer, or a layer x head), all trained together. After `fit`, a probe is the linear map it
learned on raw activations (`coef_`, `intercept_`), so it can score any activations of the same
kind, and its `direction` is the unit vector that patching and steering use.

Binary targets have one decision column (k = 1, like scikit-learn's `coef_` of shape (1, d));
targets with K > 2 classes have K one-vs-rest columns and predict the class with the largest
decision value.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor

from tomlens.devices import to_device
from tomlens.errors import TomlensError


class Probe(ABC):
    """Base class: subclasses implement `fit`; prediction is shared (a linear map per unit)."""

    coef_: Float[Tensor, "unit k d"]
    intercept_: Float[Tensor, "unit k"]
    classes_: Int[Tensor, " c"]

    @abstractmethod
    def fit(self, X: Float[Tensor, "unit n d"], y: Int[Tensor, " n"],
            groups: Sequence[Any] | Tensor | None = None) -> Probe:
        """Fit one classifier per unit; `groups` (e.g. task ids) keep stories together in any
        internal cross-validation."""

    # ----------------------------------------------------------------------------------------
    def _check_fitted(self) -> None:
        if not hasattr(self, "coef_"):
            raise TomlensError(f"this {type(self).__name__} is not fitted yet", "call fit(X, y) first")

    def _check_X(self, X: Tensor) -> None:
        self._check_fitted()
        if X.ndim != 3 or X.shape[0] != self.coef_.shape[0] or X.shape[2] != self.coef_.shape[2]:
            raise TomlensError(
                f"activations of shape {tuple(X.shape)} do not match a probe fitted on "
                f"{self.coef_.shape[0]} units of dimension {self.coef_.shape[2]}",
                "pass [unit, n, d] activations of the kind and layers the probe was fitted on",
            )

    def decision_function(self, X: Float[Tensor, "unit n d"]) -> Float[Tensor, "unit n k"]:
        """Signed distance to the decision boundary: one column (binary) or one per class."""
        self._check_X(X)
        coef = to_device(self.coef_, X.device)  # queued, not waited for, where X is on a GPU
        Xc = X.to(coef.dtype) if X.dtype != coef.dtype else X
        return torch.bmm(Xc, coef.transpose(1, 2)) + to_device(self.intercept_, X.device).unsqueeze(1)

    def predict_proba(self, X: Float[Tensor, "unit n d"]) -> Float[Tensor, "unit n c"]:
        """Class probabilities (one-vs-rest probabilities normalised, as scikit-learn does)."""
        return scores_to_proba(self.decision_function(X))

    def predict(self, X: Float[Tensor, "unit n d"]) -> Int[Tensor, "unit n"]:
        index = scores_to_index(self.decision_function(X))
        return self.classes_.to(X.device)[index]

    def score(self, X: Float[Tensor, "unit n d"], y: Int[Tensor, " n"]) -> Float[Tensor, " unit"]:
        """Accuracy of each unit's probe."""
        return (self.predict(X) == y.to(X.device).unsqueeze(0)).to(torch.float64).mean(1)

    @property
    def direction(self) -> Float[Tensor, "unit k d"]:
        """Unit-norm weight vectors in raw activation space (one per decision column)."""
        self._check_fitted()
        return self.coef_ / self.coef_.norm(dim=-1, keepdim=True).clamp_min(1e-30)

    def metadata(self) -> dict[str, Any]:
        """What a saved direction needs to say about the probe that made it."""
        return {"probe": type(self).__name__, "classes": [int(c) for c in self.classes_.tolist()],
                "n_units": int(self.coef_.shape[0]), "d": int(self.coef_.shape[2])}


def scores_to_index(s: Float[Tensor, "... k"]) -> Int[Tensor, " ..."]:
    """Index of the predicted class: sign for one column, argmax otherwise."""
    if s.shape[-1] == 1:
        return (s[..., 0] > 0).long()
    return s.argmax(-1)


def scores_to_proba(s: Float[Tensor, "... k"]) -> Float[Tensor, "... c"]:
    p = torch.sigmoid(s)
    if s.shape[-1] == 1:
        return torch.cat([1 - p, p], dim=-1)
    return p / p.sum(-1, keepdim=True).clamp_min(1e-300)


def encode_labels(y: Tensor) -> tuple[Int[Tensor, " c"], Int[Tensor, " n"]]:
    """Sorted classes and each row's class index; at least two classes are required."""
    y = torch.as_tensor(y)
    if y.ndim != 1:
        raise TomlensError(f"labels must be one-dimensional, got shape {tuple(y.shape)}",
                           "pass one label per row")
    classes, index = torch.unique(y.long(), sorted=True, return_inverse=True)
    if classes.numel() < 2:
        raise TomlensError(
            f"a probe needs at least two classes, but every training label is {int(classes[0]) if classes.numel() else 'missing'}",
            "train on rows where the target varies (e.g. both true- and false-belief stories)",
        )
    return classes, index


def one_vs_rest(index: Int[Tensor, " n"], n_classes: int) -> Float[Tensor, "k n"]:
    """0/1 targets per decision column: one column (class 1) when binary, one per class otherwise."""
    if n_classes == 2:
        return (index == 1).to(torch.float64).unsqueeze(0)
    return torch.nn.functional.one_hot(index, n_classes).T.to(torch.float64)
