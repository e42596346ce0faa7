"""Many small L2-penalised logistic regressions solved at once by Newton's method (IRLS).

A probe sweep fits one probe per layer, head, label set (the target, a control task, a condition split) and class; each is a
small problem, and a loop over them spends its time in Python. Here they are one batch: every
Newton step forms all Hessians with one batched matmul and factorises them with one batched
Cholesky. Newton needs a handful of steps where first-order solvers need hundreds, and the
features are already reduced to at most min(n_train, d) columns (`tomlens.probes.reduce`), so the
Hessians are small.

Problems come as a grid: `u` feature matrices, each shared by `j` target vectors (a layer's true
labels, its control-task labels, each class of a one-vs-rest fit), so logits and gradients for all
`j` targets of a unit are one matmul against the shared features.

The objective is scikit-learn's: sum_i logloss(y_i, z_i.w + b) + ||w||^2 / (2 C), intercept not
penalised. The full Newton step is tried first; problems where it does not decrease the objective
enough (Armijo) get a backtracking search over halved steps, so the method converges from any
start.

No input makes the batch fail. Real activations are badly scaled (one residual dimension of a
135M model reaches |x| ~ 750), separable (d > n) and rank-deficient, so a Hessian can be
numerically singular; an LU solve of such a matrix raises, or under MKL reads invalid pivots, and
one bad problem takes the whole batch down. Here Hessians are formed and factorised in float64 by
`cholesky_ex`, which reports failures per matrix; a matrix that does not factorise is retried with
growing Levenberg damping (H + lambda I stays a descent direction, the line search does the rest).
Non-finite values never reach a factorisation, and each problem carries a status (`FIT_STATUS`):
a problem that cannot be solved stops with NaN weights and a reason while the others go on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor
from torch.nn.functional import softplus

from tomlens.errors import TomlensError

_ARMIJO = 1e-4
_HALVINGS = 30
# Levenberg damping tried, in turn, on a Hessian whose Cholesky factorisation fails: lambda relative
# to its largest diagonal entry. Rounding makes a PSD matrix indefinite by ~1e-16 of that at most,
# so the first rungs already succeed; the last one is a scaled gradient step.
_DAMPING = (1e-12, 1e-9, 1e-6, 1e-3, 1.0)

# Why a fit ended, worst last: a unit's status over several fits is the largest code.
OK, NOT_CONVERGED, SOLVER_FAILED, NON_FINITE_INPUT = 0, 1, 2, 3
FIT_STATUS: tuple[str, ...] = ("ok", "not_converged", "solver_failed", "non_finite_input")


@dataclass(frozen=True)
class NewtonResult:
    """Solutions: weights, then the intercept in the last entry of `beta` (NaN where `status` is
    SOLVER_FAILED or NON_FINITE_INPUT); `status` indexes `FIT_STATUS`."""

    beta: Float[Tensor, "u j r1"]
    n_iter: Int[Tensor, "u j"]
    converged: Bool[Tensor, "u j"]
    status: Int[Tensor, "u j"]


def _objective(fs: Tensor, w2: Tensor, inv_c: Tensor) -> Tensor:
    """Penalised log-loss per problem from signed logits `fs` [..., m, j] (m summed), `w2` = ||w||^2.

    With fs = (1 - 2y) f the log-loss softplus(f) - y f of a 0/1 target is softplus(fs): no term
    cancels, so at the margins of a separable fit (|f| ~ 40, loss ~1e-17 of f) the line search
    still sees the loss decrease."""
    return softplus(fs).sum(-2) + 0.5 * inv_c * w2


def newton_logistic(
    Z: Float[Tensor, "u m r"],
    y: Float[Tensor, "u m j"],
    inv_c: Float[Tensor, "u j"],
    *,
    beta0: Float[Tensor, "u j r1"] | None = None,
    max_iter: int = 100,
    tol: float = 1e-10,
    solve_dtype: torch.dtype = torch.float64,
) -> NewtonResult:
    """Fit, for every unit `a` and column `c`, logits `Z[a] @ w + b` to 0/1 targets `y[a, :, c]`
    with penalty `inv_c[a, c]` = 1/C.

    Runs in float64 on Z's device. Hessians are formed and factorised in `solve_dtype`: float64 by
    default; float32 is cheaper (a GPU's float64 may be slow) and still safe (a factorisation that
    fails is damped, and an inexact direction still converges because gradients, objectives and the
    line search stay in float64), but its directions are poorer on ill-conditioned problems. Targets
    other than 0 and 1 are refused (`TomlensError`). A problem stops when
    its Newton decrement falls below `tol * (1 + objective)` or when no step size decreases its
    objective any more; stopped problems keep their weights while the others go on. Problems with
    non-finite features, targets or penalty, and problems whose Hessian or gradient overflows,
    stop at once with NaN weights and their reason in `status`.
    """
    dev = Z.device
    f64 = torch.float64
    Z = Z.to(f64)
    u, m, r = Z.shape
    j = y.shape[2]
    y = y.to(dev, f64)
    inv_c = inv_c.to(dev, f64)
    bad_z = ~torch.isfinite(Z).all(2).all(1)  # [u]
    bad_in = bad_z.unsqueeze(1) | ~torch.isfinite(y).all(1) | ~torch.isfinite(inv_c)  # [u, j]
    if bool(bad_in.any()):  # keep their arithmetic finite; their weights become NaN at the end
        Z = torch.where(bad_z.view(u, 1, 1), torch.zeros_like(Z), Z)
        y = torch.where(torch.isfinite(y), y, torch.zeros_like(y))
        inv_c = torch.where(torch.isfinite(inv_c), inv_c, torch.ones_like(inv_c))
    if not bool(((y == 0) | (y == 1)).all()):
        raise TomlensError("logistic targets must be 0 or 1", "encode each decision column as 0/1 targets")
    sign = 1 - 2 * y  # [u, m, j]: logits signed so that positive means wrong
    status = torch.where(bad_in, NON_FINITE_INPUT, OK)
    zt = torch.cat([Z, torch.ones(u, m, 1, dtype=f64, device=dev)], dim=2)  # intercept column last
    ztt = zt.transpose(1, 2)
    zs = zt.to(solve_dtype)
    beta = torch.zeros(u, j, r + 1, dtype=f64, device=dev)
    if beta0 is not None:  # a warm start from a failed fit starts from zero instead
        b0 = beta0.to(dev, f64)
        beta = torch.where(torch.isfinite(b0).all(2, keepdim=True), b0, beta)
    n_iter = torch.zeros(u, j, dtype=torch.long, device=dev)
    done = bad_in.clone()
    pen = torch.cat([inv_c.unsqueeze(2).expand(u, j, r), torch.zeros(u, j, 1, dtype=f64, device=dev)], 2)
    ridge = torch.zeros(r + 1, dtype=f64, device=dev)
    ridge[r] = 1e-12 * m  # keeps the intercept's row regular when every sample is certain
    fs = sign * torch.bmm(zt, beta.transpose(1, 2))  # [u, m, j] signed logits
    for _ in range(max_iter):
        e = torch.sigmoid(fs)  # the probability of the wrong class, exact however small
        g = torch.bmm(ztt, sign * e).transpose(1, 2) + pen * beta  # [u, j, r+1]; sign * e = p - y
        sw = (e * (1 - e)).sqrt().transpose(1, 2).contiguous().unsqueeze(3).to(solve_dtype)  # [u, j, m, 1]
        w = beta[..., :r]
        ww = (w * w).sum(2)
        obj0 = _objective(fs, ww, inv_c)
        # Hessians only for units with a problem still running (the bulk of the work)
        live = (~done).any(1).nonzero().squeeze(1)
        zl, swl = (zs, sw) if live.numel() == u else (zs[live], sw[live])
        a = (zl.unsqueeze(1) * swl).reshape(-1, m, r + 1)  # [live * j, m, r+1], contiguous already
        h = torch.bmm(a.transpose(1, 2), a).view(-1, j, r + 1, r + 1)
        h.diagonal(dim1=2, dim2=3).add_((pen[live] + ridge).to(solve_dtype))
        dl, sl = newton_direction(h, g[live].to(solve_dtype), (~done & torch.isfinite(obj0))[live])
        delta = torch.zeros_like(beta)
        delta[live] = dl.to(f64)
        solved = torch.zeros_like(done)
        solved[live] = sl
        failed = ~done & ~solved
        status = torch.where(failed, SOLVER_FAILED, status)
        done |= failed
        slope = (g * delta).sum(2)  # -(Newton decrement), <= 0; 0 for stopped problems (delta 0)
        dw = delta[..., :r]
        wd, dd = (w * dw).sum(2), (dw * dw).sum(2)
        dfs = sign * torch.bmm(zt, delta.transpose(1, 2))  # [u, m, j]
        obj1 = _objective(fs + dfs, ww + 2 * wd + dd, inv_c)
        t = torch.where(obj1 <= obj0 + _ARMIJO * slope, torch.ones_like(obj0), torch.zeros_like(obj0))
        stuck = (t == 0) & ~done
        if bool(stuck.any()):
            t = _backtrack(t, stuck, fs, dfs, ww, wd, dd, inv_c, obj0, slope)
        t = torch.where(done, torch.zeros_like(t), t)
        beta = beta + t.unsqueeze(2) * delta
        fs = fs + dfs * t.unsqueeze(1)
        n_iter += (~done).long()
        done |= (-slope <= 2 * tol * (1 + obj0.abs())) | (t == 0)
        if bool(done.all()):
            break
    status = torch.where(done, status, NOT_CONVERGED)
    beta = torch.where((status >= SOLVER_FAILED).unsqueeze(2), torch.full_like(beta, torch.nan), beta)
    return NewtonResult(beta=beta, n_iter=n_iter, converged=status == OK, status=status)


def newton_direction(h: Float[Tensor, "*batch r1 r1"], g: Float[Tensor, "*batch r1"],
                     active: Bool[Tensor, "*batch"]) -> tuple[Float[Tensor, "*batch r1"], Bool[Tensor, "*batch"]]:
    """Solve `h @ delta = -g` for every active problem with a symmetric positive (semi-)definite
    `h`; returns the directions (zero where not solved) and which problems were solved.

    Cholesky first, for the active problems only; matrices that do not factorise are retried,
    alone, with Levenberg damping `h + lambda I` (lambda from `_DAMPING` x their largest diagonal
    entry). Non-finite matrices or gradients are never factorised: they count as not solved, as
    do directions that overflow. (A PSD matrix with a finite diagonal is finite, |h_ij| <=
    sqrt(h_ii h_jj), so the diagonal is what is checked.)
    """
    batch = h.shape[:-2]
    r1 = h.shape[-1]
    hf = h.reshape(-1, r1, r1)
    gf = g.reshape(-1, r1)
    diag = hf.diagonal(dim1=1, dim2=2)
    todo = active.reshape(-1) & torch.isfinite(diag).all(1) & torch.isfinite(gf).all(1)
    delta = torch.zeros_like(gf)
    solved = torch.zeros_like(todo)
    idx = todo.nonzero().squeeze(1)
    everything = idx.numel() == hf.shape[0]
    scale = diag.abs().amax(1)  # 0 only for a zero matrix: no curvature to damp, not solved
    eye = torch.eye(r1, dtype=h.dtype, device=h.device)
    for damping in (0.0, *_DAMPING):
        if idx.numel() == 0:
            break
        hk, gk = (hf, gf) if damping == 0 and everything else (hf[idx], gf[idx])
        if damping:
            hk = hk + (damping * scale[idx]).view(-1, 1, 1) * eye
        L, info = torch.linalg.cholesky_ex(hk)
        ok = info == 0
        if not bool(ok.all()):
            L = torch.where(ok.view(-1, 1, 1), L, eye)  # a failed factor may hold garbage: solve with I
        d = -torch.cholesky_solve(gk.unsqueeze(2), L).squeeze(2)
        ok &= torch.isfinite(d).all(1)
        delta[idx] = torch.where(ok.unsqueeze(1), d, torch.zeros_like(d))
        solved[idx] = ok
        idx = idx[~ok]
    return delta.view(*batch, r1), solved.view(batch)


def _backtrack(t: Tensor, stuck: Tensor, fs: Tensor, dfs: Tensor, ww: Tensor, wd: Tensor,
               dd: Tensor, inv_c: Tensor, obj0: Tensor, slope: Tensor) -> Tensor:
    """Largest step 2^-k (k = 1..30) meeting the Armijo condition, for the units with stuck problems."""
    units = stuck.any(1).nonzero().squeeze(1)
    steps = 2.0 ** -torch.arange(1, _HALVINGS + 1, dtype=fs.dtype, device=fs.device)
    s = steps.view(-1, 1, 1, 1)
    fu, dfu = fs[units], dfs[units]  # [k, m, j]
    objt = _objective(fu.unsqueeze(0) + s * dfu.unsqueeze(0),
                      ww[units] + 2 * steps.view(-1, 1, 1) * wd[units] + steps.view(-1, 1, 1) ** 2 * dd[units],
                      inv_c[units])  # [T, k, j]
    ok = objt <= obj0[units] + _ARMIJO * steps.view(-1, 1, 1) * slope[units]
    first = ok.to(torch.int8).argmax(0)
    found = torch.where(ok.any(0), steps[first], torch.zeros_like(obj0[units]))
    t = t.clone()
    t[units] = torch.where(stuck[units], found, t[units])
    return t
