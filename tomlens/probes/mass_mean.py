"""The difference-of-means (mass-mean) probe: a direction from class means alone, no optimiser.

Marks & Tegmark's mass-mean probe: theta = mean(X | class) - mean(X | rest), in raw activation
space, so its direction is the one steering and patching add. Scores are projections onto theta
measured from the midpoint of the two means; a one-dimensional logistic fit on the training
projections turns them into probabilities. With K > 2 classes there is one direction per class
(one-vs-rest) and the prediction is the class with the highest calibrated score.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor

from tomlens.devices import resolve_device
from tomlens.probes.base import Probe, encode_labels, one_vs_rest
from tomlens.probes.newton import newton_logistic


def mass_mean_directions(X: Float[Tensor, "unit n d"], targets: Float[Tensor, "k n"]
                         ) -> tuple[Float[Tensor, "unit k d"], Float[Tensor, "unit k d"]]:
    """Per unit and column: theta = mean over target rows - mean over the others, and the midpoint."""
    t = targets.to(X.device, X.dtype)
    pos = t / t.sum(1, keepdim=True).clamp_min(1)
    neg = (1 - t) / (1 - t).sum(1, keepdim=True).clamp_min(1)
    Xe = X
    mu_pos = torch.matmul(pos.unsqueeze(0), Xe)  # [u, k, d]
    mu_neg = torch.matmul(neg.unsqueeze(0), Xe)
    return mu_pos - mu_neg, (mu_pos + mu_neg) / 2


class MassMeanProbe(Probe):
    """Difference of class means per unit, with a 1-D logistic calibration of the projection."""

    def __init__(self, *, device: str | torch.device | None = None, calibrate: bool = True):
        self.device = device
        self.calibrate = calibrate

    def fit(self, X: Float[Tensor, "unit n d"], y: Int[Tensor, " n"],
            groups: Sequence[Any] | Tensor | None = None) -> MassMeanProbe:
        from tomlens.probes.logistic import cpu_threads_for

        dev = resolve_device(self.device)
        with cpu_threads_for(float(X.numel()), dev):
            return self._fit(X, y, dev)

    def _fit(self, X: Tensor, y: Tensor, dev: torch.device) -> MassMeanProbe:
        classes, index = encode_labels(torch.as_tensor(y))
        T = one_vs_rest(index, classes.numel())  # [k, n]
        Xd = X.to(dev, torch.float64)
        theta, mid = mass_mean_directions(Xd, T)
        proj = torch.bmm(Xd, theta.transpose(1, 2)) - (theta * mid).sum(-1).unsqueeze(1)  # [u, n, k]
        u, n, k = proj.shape
        if self.calibrate:
            # logit = a * proj + b, fitted per unit and column (tiny penalty keeps separable data finite)
            scale = proj.abs().amax(1, keepdim=True).clamp_min(1e-30)  # [u, 1, k]
            z = (proj / scale).permute(0, 2, 1).reshape(u * k, n, 1)
            y_ = T.to(dev).unsqueeze(0).expand(u, k, n).reshape(u * k, n, 1)
            res = newton_logistic(z, y_, torch.full((u * k, 1), 1e-4, dtype=torch.float64, device=dev),
                                  validate=False)  # one-vs-rest targets: 0/1 by construction
            a = res.beta[:, 0, 0].view(u, k) / scale.squeeze(1)
            b = res.beta[:, 0, 1].view(u, k)
        else:
            a = torch.ones(u, k, dtype=torch.float64, device=dev)
            b = torch.zeros(u, k, dtype=torch.float64, device=dev)
        # decision = a * (theta . x - theta . mid) + b  ->  linear map on raw activations
        coef = a.unsqueeze(2) * theta
        intercept = b - a * (theta * mid).sum(-1)
        host = torch.cat([coef.flatten(), intercept.flatten(), theta.flatten()]).cpu()  # one copy to the host
        self.coef_ = host[:coef.numel()].view(coef.shape).clone()
        self.intercept_ = host[coef.numel():coef.numel() + intercept.numel()].view(intercept.shape).clone()
        self.theta_ = host[coef.numel() + intercept.numel():].view(theta.shape).clone()
        self.classes_ = classes
        return self

    @property
    def direction(self) -> Float[Tensor, "unit k d"]:
        """Unit-norm difference of means (sign: towards the class, away from the rest)."""
        self._check_fitted()
        return self.theta_ / self.theta_.norm(dim=-1, keepdim=True).clamp_min(1e-30)

    def metadata(self) -> dict[str, Any]:
        return {**super().metadata(), "calibrate": self.calibrate,
                "objective": "difference of class means; 1-D logistic calibration of the projection"}
