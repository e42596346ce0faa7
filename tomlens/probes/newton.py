"""Many small L2-penalised logistic regressions solved at once by Newton's method (IRLS).

A probe sweep fits one probe per layer, head, label set (true and shuffled) and class; each is a
small problem, and a loop over them spends its time in Python. Here they are one batch: every
Newton step forms all Hessians with one batched matmul and solves them with one batched LU.
Newton needs a handful of steps where first-order solvers need hundreds, and the features are
already reduced to at most min(n_train, d) columns (`tomlens.probes.reduce`), so the Hessians
are small.

Problems come as a grid: `u` feature matrices, each shared by `j` target vectors (a layer's true
labels, its shuffled labels, each class of a one-vs-rest fit), so logits and gradients for all
`j` targets of a unit are one matmul against the shared features.

The objective is scikit-learn's: sum_i logloss(y_i, z_i.w + b) + ||w||^2 / (2 C), intercept not
penalised. The full Newton step is tried first; problems where it does not decrease the objective
enough (Armijo) get a backtracking search over halved steps, so the method converges from any
start.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor
from torch.nn.functional import softplus

_ARMIJO = 1e-4
_HALVINGS = 30


@dataclass(frozen=True)
class NewtonResult:
    """Solutions: weights, then the intercept in the last entry of `beta`."""

    beta: Float[Tensor, "u j r1"]
    n_iter: Int[Tensor, "u j"]
    converged: Bool[Tensor, "u j"]


def _objective(f: Tensor, y: Tensor, w2: Tensor, inv_c: Tensor) -> Tensor:
    """Penalised log-loss per problem; `f`, `y` [..., m, j] (m summed), `w2` = ||w||^2."""
    return (softplus(f) - y * f).sum(-2) + 0.5 * inv_c * w2


def newton_logistic(
    Z: Float[Tensor, "u m r"],
    y: Float[Tensor, "u m j"],
    inv_c: Float[Tensor, "u j"],
    *,
    beta0: Float[Tensor, "u j r1"] | None = None,
    max_iter: int = 100,
    tol: float = 1e-10,
    solve_dtype: torch.dtype = torch.float32,
) -> NewtonResult:
    """Fit, for every unit `a` and column `c`, logits `Z[a] @ w + b` to 0/1 targets `y[a, :, c]`
    with penalty `inv_c[a, c]` = 1/C.

    Runs in float64 on Z's device, except that Hessians are formed and solved in `solve_dtype`
    (float32 by default: twice as fast, and an inexact Newton direction still converges because
    gradients, objectives and the line search stay in float64). A problem stops when its Newton decrement falls below
    `tol * (1 + objective)` or when no step size decreases its objective any more; stopped
    problems keep their weights while the others go on.
    """
    dev = Z.device
    f64 = torch.float64
    Z = Z.to(f64)
    u, m, r = Z.shape
    j = y.shape[2]
    y = y.to(dev, f64)
    inv_c = inv_c.to(dev, f64)
    zt = torch.cat([Z, torch.ones(u, m, 1, dtype=f64, device=dev)], dim=2)  # intercept column last
    ztt = zt.transpose(1, 2)
    zs = zt.to(solve_dtype)
    beta = torch.zeros(u, j, r + 1, dtype=f64, device=dev) if beta0 is None else beta0.to(dev, f64).clone()
    n_iter = torch.zeros(u, j, dtype=torch.long, device=dev)
    done = torch.zeros(u, j, dtype=torch.bool, device=dev)
    pen = torch.cat([inv_c.unsqueeze(2).expand(u, j, r), torch.zeros(u, j, 1, dtype=f64, device=dev)], 2)
    ridge = torch.zeros(r + 1, dtype=f64, device=dev)
    ridge[r] = 1e-12 * m  # keeps the intercept's row regular when every sample is certain
    f = torch.bmm(zt, beta.transpose(1, 2))  # [u, m, j]
    for _ in range(max_iter):
        p = torch.sigmoid(f)
        g = torch.bmm(ztt, p - y).transpose(1, 2) + pen * beta  # [u, j, r+1]
        sw = (p * (1 - p)).sqrt().transpose(1, 2).unsqueeze(3).to(solve_dtype)  # [u, j, m, 1]
        a = zs.unsqueeze(1) * sw  # [u, j, m, r+1]
        h = torch.matmul(a.transpose(2, 3), a)  # [u, j, r+1, r+1]
        h.diagonal(dim1=2, dim2=3).add_((pen + ridge).to(solve_dtype))
        delta = -torch.linalg.solve(h, g.unsqueeze(3).to(solve_dtype)).squeeze(3).to(f64)  # [u, j, r+1]
        slope = (g * delta).sum(2)  # -(Newton decrement), <= 0
        w = beta[..., :r]
        dw = delta[..., :r]
        ww, wd, dd = (w * w).sum(2), (w * dw).sum(2), (dw * dw).sum(2)
        obj0 = _objective(f, y, ww, inv_c)
        df = torch.bmm(zt, delta.transpose(1, 2))  # [u, m, j]
        obj1 = _objective(f + df, y, ww + 2 * wd + dd, inv_c)
        t = torch.where(obj1 <= obj0 + _ARMIJO * slope, torch.ones_like(obj0), torch.zeros_like(obj0))
        stuck = (t == 0) & ~done
        if bool(stuck.any()):
            t = _backtrack(t, stuck, f, df, y, ww, wd, dd, inv_c, obj0, slope)
        t = torch.where(done, torch.zeros_like(t), t)
        beta = beta + t.unsqueeze(2) * delta
        f = f + df * t.unsqueeze(1)
        n_iter += (~done).long()
        done |= (-slope <= 2 * tol * (1 + obj0.abs())) | (t == 0)
        if bool(done.all()):
            break
    return NewtonResult(beta=beta, n_iter=n_iter, converged=done)


def _backtrack(t: Tensor, stuck: Tensor, f: Tensor, df: Tensor, y: Tensor, ww: Tensor, wd: Tensor,
               dd: Tensor, inv_c: Tensor, obj0: Tensor, slope: Tensor) -> Tensor:
    """Largest step 2^-k (k = 1..30) meeting the Armijo condition, for the units with stuck problems."""
    units = stuck.any(1).nonzero().squeeze(1)
    steps = 2.0 ** -torch.arange(1, _HALVINGS + 1, dtype=f.dtype, device=f.device)
    s = steps.view(-1, 1, 1, 1)
    fu, dfu, yu = f[units], df[units], y[units]  # [k, m, j]
    objt = _objective(fu.unsqueeze(0) + s * dfu.unsqueeze(0), yu.unsqueeze(0),
                      ww[units] + 2 * steps.view(-1, 1, 1) * wd[units] + steps.view(-1, 1, 1) ** 2 * dd[units],
                      inv_c[units])  # [T, k, j]
    ok = objt <= obj0[units] + _ARMIJO * steps.view(-1, 1, 1) * slope[units]
    first = ok.to(torch.int8).argmax(0)
    found = torch.where(ok.any(0), steps[first], torch.zeros_like(obj0[units]))
    t = t.clone()
    t[units] = torch.where(stuck[units], found, t[units])
    return t
