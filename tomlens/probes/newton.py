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

The host looks at the batch every `check_every` steps (`tomlens.probes.cadence`: every step on the
CPU, where it costs nothing; every few on a GPU, where each look drains the queue). Between looks,
what it used to decide per step is computed on the device: finished problems stand still, a
Hessian that does not factorise is retried with the next damping rung at the next step, and the
backtracking search is run for every problem at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor
from torch.nn.functional import softplus

from tomlens.devices import to_device
from tomlens.errors import TomlensError
from tomlens.probes.cadence import check_every as check_every_steps

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


class Workspace:
    """Scratch tensors reused across Newton steps and solves (the batch's Hessians and the matrix
    they are formed from). On the CPU every large new tensor is fresh memory from the kernel, whose
    pages are zeroed on first touch: allocating them at every step cost a third of a sweep's time."""

    def __init__(self) -> None:
        self._buffers: dict[str, Tensor] = {}

    def take(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
        """A contiguous tensor of `shape` (contents undefined), reusing this name's memory when it fits."""
        n = 1
        for k in shape:
            n *= k
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < n or buf.dtype != dtype or buf.device != device:
            buf = torch.empty(max(n, 1), dtype=dtype, device=device)
            self._buffers[name] = buf
        return buf[:n].view(shape)


def cholesky_solve(b: Float[Tensor, "*batch r1 k"], L: Float[Tensor, "*batch r1 r1"]) -> Float[Tensor, "*batch r1 k"]:
    """(L L^T)^-1 b by two triangular solves: what `torch.cholesky_solve` computes (LAPACK's potrs is
    these two solves), without the copy of L it makes on every call."""
    return torch.linalg.solve_triangular(L.mT, torch.linalg.solve_triangular(L, b, upper=False), upper=True)


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
    check_every: int | None = None,
    validate: bool = True,
    workspace: Workspace | None = None,
) -> NewtonResult:
    """Fit, for every unit `a` and column `c`, logits `Z[a] @ w + b` to 0/1 targets `y[a, :, c]`
    with penalty `inv_c[a, c]` = 1/C.

    Runs in float64 on Z's device. Hessians are formed and factorised in `solve_dtype`: float64 by
    default; float32 is cheaper (a GPU's float64 may be slow) and still safe (a factorisation that
    fails is damped, and an inexact direction still converges because gradients, objectives and the
    line search stay in float64), but its directions are poorer on ill-conditioned problems. Targets
    other than 0 and 1 are refused (`TomlensError`; `validate=False` skips that check, which reads
    the targets on the host, for callers that built them as 0/1). A problem stops when
    its Newton decrement falls below `tol * (1 + objective)` or when no step size decreases its
    objective any more; stopped problems keep their weights while the others go on. Problems with
    non-finite features, targets or penalty, and problems whose Hessian or gradient overflows,
    stop at once with NaN weights and their reason in `status`.

    The host looks at the batch every `check_every` steps (`tomlens.probes.cadence`: every step on
    the CPU, every few on a GPU); in between nothing is read back. A Hessian that does not
    factorise is retried with the next Levenberg damping rung at the next step, the problem
    standing still meanwhile, so the iterates (and `n_iter`, which counts steps taken) are those
    of trying every rung at once.

    Kept as one function (about 130 lines) on purpose: its loop is the hot path, and its dozen
    tensors of state (iterate, signed logits, rung, done, capped, live units) change together each
    step; split into steps they would travel in and out of helpers as a mutable bundle, and the one
    host read per `check_every` steps would no longer sit visibly beside the loop that it gates.
    """
    dev = Z.device
    ws = workspace if workspace is not None else Workspace()
    every = min(check_every_steps(dev, check_every), max(max_iter, 1))  # at least one look within max_iter steps
    f64 = torch.float64
    Z = Z.to(f64)
    u, m, r = Z.shape
    j = y.shape[2]
    y = y.to(dev, f64)
    inv_c = inv_c.to(dev, f64)
    bad_z = ~torch.isfinite(Z).all(2).all(1)  # [u]
    bad_in = bad_z.unsqueeze(1) | ~torch.isfinite(y).all(1) | ~torch.isfinite(inv_c)  # [u, j]
    # keep their arithmetic finite (no host branch: a no-op where all is finite); NaN weights at the end
    Z = torch.where(bad_z.view(u, 1, 1), torch.zeros_like(Z), Z)
    y = torch.where(torch.isfinite(y), y, torch.zeros_like(y))
    inv_c = torch.where(torch.isfinite(inv_c), inv_c, torch.ones_like(inv_c))
    if validate and not bool(((y == 0) | (y == 1)).all()):
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
    done = bad_in.clone()  # converged or failed
    capped = torch.zeros_like(done)  # stopped by max_iter
    rung = torch.zeros(u, j, dtype=torch.long, device=dev)  # damping rung to try at the next step
    damping = torch.tensor((0.0, *_DAMPING), dtype=f64).to(dev, non_blocking=dev.type == "cuda")
    pen = torch.cat([inv_c.unsqueeze(2).expand(u, j, r), torch.zeros(u, j, 1, dtype=f64, device=dev)], 2)
    ridge = torch.zeros(r + 1, dtype=f64, device=dev)
    ridge[r] = 1e-12 * m  # keeps the intercept's row regular when every sample is certain
    fs = sign * torch.bmm(zt, beta.transpose(1, 2))  # [u, m, j] signed logits
    live: Tensor | None = None  # units with a problem still running when the host last looked (None: all)
    for step in range(max_iter * (len(_DAMPING) + 1)):
        e = torch.sigmoid(fs)  # the probability of the wrong class, exact however small
        g = torch.bmm(ztt, sign * e).transpose(1, 2) + pen * beta  # [u, j, r+1]; sign * e = p - y
        sw = (e * (1 - e)).sqrt().transpose(1, 2).contiguous().unsqueeze(3).to(solve_dtype)  # [u, j, m, 1]
        w = beta[..., :r]
        ww = (w * w).sum(2)
        obj0 = _objective(fs, ww, inv_c)
        running = ~done & ~capped
        # Hessians only for units with a problem still running (the bulk of the work)
        zl, swl, gl, pl = (zs, sw, g, pen) if live is None else (zs[live], sw[live], g[live], pen[live])
        b = zl.shape[0]
        a = torch.mul(zl.unsqueeze(1), swl, out=ws.take("a", (b, j, m, r + 1), solve_dtype, dev))
        a = a.view(-1, m, r + 1)  # [live * j, m, r+1]
        h = torch.bmm(a.transpose(1, 2), a, out=ws.take("h", (b * j, r + 1, r + 1), solve_dtype, dev))
        h = h.view(-1, j, r + 1, r + 1)
        h.diagonal(dim1=2, dim2=3).add_((pl + ridge).to(solve_dtype))
        active = running & torch.isfinite(obj0)
        act_l, rung_l = (active, rung) if live is None else (active[live], rung[live])
        if every == 1:  # the host looks anyway: factorise the active problems only, every rung at once
            dl, sl = newton_direction(h, gl.to(solve_dtype), act_l, workspace=ws)
            rl = torch.zeros_like(sl)
        else:  # one rung per step, decided on the device
            dl, sl, rl = damped_direction(h, gl.to(solve_dtype), act_l, damping[rung_l].to(solve_dtype))
            rl &= rung_l < len(_DAMPING)  # a further rung exists
        if live is None:
            delta, solved, retry = dl.to(f64), sl, rl
        else:
            delta, solved, retry = torch.zeros_like(beta), torch.zeros_like(done), torch.zeros_like(done)
            delta[live], solved[live], retry[live] = dl.to(f64), sl, rl
        failed = running & ~solved & ~retry
        status = torch.where(failed, SOLVER_FAILED, status)
        done = done | failed
        moving = running & solved
        rung = torch.where(retry, rung + 1, torch.zeros_like(rung))
        slope = (g * delta).sum(2)  # -(Newton decrement), <= 0; 0 for problems standing still (delta 0)
        dw = delta[..., :r]
        wd, dd = (w * dw).sum(2), (dw * dw).sum(2)
        dfs = sign * torch.bmm(zt, delta.transpose(1, 2))  # [u, m, j]
        obj1 = _objective(fs + dfs, ww + 2 * wd + dd, inv_c)
        t = torch.where(obj1 <= obj0 + _ARMIJO * slope, torch.ones_like(obj0), torch.zeros_like(obj0))
        if every == 1:  # the host looks anyway: search shorter steps only where the full one failed
            stuck = (t == 0) & moving
            if bool(stuck.any()):
                t = _backtrack(t, stuck, fs, dfs, ww, wd, dd, inv_c, obj0, slope)
        else:  # every problem's shorter steps on the device (cheap next to its Hessian)
            t = torch.where(t == 0, _shorter_step(fs, dfs, ww, wd, dd, inv_c, obj0, slope), t)
        t = torch.where(moving, t, torch.zeros_like(t))
        beta = beta + t.unsqueeze(2) * delta
        fs = fs + dfs * t.unsqueeze(1)
        n_iter += moving.long()
        done |= moving & ((-slope <= 2 * tol * (1 + obj0.abs())) | (t == 0))
        capped |= ~done & (n_iter >= max_iter)
        if (step + 1) % every == 0:
            still = (~done & ~capped).any(1).tolist()  # the one host read of this check
            if not any(still):
                break
            live = None if all(still) else to_device([i for i, s in enumerate(still) if s], dev)
    status = torch.where(done, status, NOT_CONVERGED)
    beta = torch.where((status >= SOLVER_FAILED).unsqueeze(2), torch.full_like(beta, torch.nan), beta)
    return NewtonResult(beta=beta, n_iter=n_iter, converged=status == OK, status=status)


def damped_direction(h: Float[Tensor, "*batch r1 r1"], g: Float[Tensor, "*batch r1"], active: Bool[Tensor, "*batch"],
                     damping: Float[Tensor, "*batch"]) -> tuple[Float[Tensor, "*batch r1"], Bool[Tensor, "*batch"],
                                                               Bool[Tensor, "*batch"]]:
    """One factorisation per problem, with no host read: solve `(h + lambda I) @ delta = -g`, lambda
    = `damping` x the largest diagonal entry (0: plain Newton). Returns the directions (zero where
    not solved), which active problems were solved, and which may be retried with more damping
    (active, finite, but not factorised or with an overflowing direction). `h` is damped in place.

    Non-finite matrices or gradients are never factorised (an identity stands in): they count as
    neither solved nor retriable. (A PSD matrix with a finite diagonal is finite, |h_ij| <=
    sqrt(h_ii h_jj), so the diagonal is what is checked.)"""
    diag = h.diagonal(dim1=-2, dim2=-1)
    todo = active & torch.isfinite(diag).all(-1) & torch.isfinite(g).all(-1)
    scale = diag.abs().amax(-1)  # 0 only for a zero matrix: no curvature to damp, not solved
    diag.add_((damping * scale).unsqueeze(-1))
    eye = torch.eye(h.shape[-1], dtype=h.dtype, device=h.device)
    L, info = torch.linalg.cholesky_ex(torch.where(todo.unsqueeze(-1).unsqueeze(-1), h, eye))
    ok = (info == 0) & todo
    L = torch.where(ok.unsqueeze(-1).unsqueeze(-1), L, eye)  # a failed factor may hold garbage: solve with I
    rhs = torch.where(todo.unsqueeze(-1), g, torch.zeros_like(g))  # nothing non-finite reaches LAPACK
    d = -cholesky_solve(rhs.unsqueeze(-1), L).squeeze(-1)
    ok &= torch.isfinite(d).all(-1)
    return torch.where(ok.unsqueeze(-1), d, torch.zeros_like(d)), ok, todo & ~ok


def newton_direction(h: Float[Tensor, "*batch r1 r1"], g: Float[Tensor, "*batch r1"], active: Bool[Tensor, "*batch"],
                     *, workspace: Workspace | None = None) -> tuple[Float[Tensor, "*batch r1"], Bool[Tensor, "*batch"]]:
    """Solve `h @ delta = -g` for every active problem with a symmetric positive (semi-)definite
    `h`; returns the directions (zero where not solved) and which problems were solved.

    Cholesky first, for the active problems only; matrices that do not factorise are retried,
    alone, with Levenberg damping `h + lambda I` (lambda from `_DAMPING` x their largest diagonal
    entry). Non-finite matrices or gradients are never factorised: they count as not solved, as
    do directions that overflow. (A PSD matrix with a finite diagonal is finite, |h_ij| <=
    sqrt(h_ii h_jj), so the diagonal is what is checked.)

    The host picks the problems (free on the CPU, where `newton_logistic` uses this);
    `damped_direction` is the same step with nothing read back, one rung per call.
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
    ws = workspace if workspace is not None else Workspace()
    for damping in (0.0, *_DAMPING):
        if idx.numel() == 0:
            break
        k = idx.numel()
        if damping == 0 and everything:
            hk, gk = hf, gf
        else:
            hk = torch.index_select(hf, 0, idx, out=ws.take("hk", (k, r1, r1), hf.dtype, hf.device))
            gk = gf[idx]
        if damping:
            hk = hk + (damping * scale[idx]).view(-1, 1, 1) * eye
        # factorised into reused column-major memory (LAPACK's layout: no copy, no fresh pages)
        L, info = torch.linalg.cholesky_ex(hk, out=(ws.take("L", (k, r1, r1), hf.dtype, hf.device).mT,
                                                    ws.take("info", (k,), torch.int32, hf.device)))
        ok = info == 0
        if not bool(ok.all()):
            L = torch.where(ok.view(-1, 1, 1), L, eye)  # a failed factor may hold garbage: solve with I
        d = -cholesky_solve(gk.unsqueeze(2), L).squeeze(2)
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


def _shorter_step(fs: Tensor, dfs: Tensor, ww: Tensor, wd: Tensor, dd: Tensor, inv_c: Tensor, obj0: Tensor,
                  slope: Tensor) -> Tensor:
    """Per problem, the largest step 2^-k (k = 1..30) meeting the Armijo condition, 0 where none
    does: `_backtrack` for every problem at once, with nothing read back."""
    steps = 2.0 ** -torch.arange(1, _HALVINGS + 1, dtype=fs.dtype, device=fs.device)
    s = steps.view(-1, 1, 1)
    objt = _objective(fs.unsqueeze(0) + steps.view(-1, 1, 1, 1) * dfs.unsqueeze(0),
                      ww + 2 * s * wd + s ** 2 * dd, inv_c)  # [T, u, j]
    ok = objt <= obj0 + _ARMIJO * s * slope
    first = ok.to(torch.int8).argmax(0)
    return torch.where(ok.any(0), steps[first], torch.zeros_like(obj0))
