"""The batched logistic solver on inputs that crashed it: singular, separable, constant, duplicated,
badly scaled and non-finite problems, alone and next to good ones, down to `tomlens probe`.

On an AMD EPYC machine with MKL, `torch.linalg.solve` on a float32 Hessian that was singular or
held NaN read invalid pivots and took the whole batch down. The BLAS here may not raise where MKL
did, so every test runs under `strict_linalg`: LAPACK-backed functions raise on non-finite input,
as MKL effectively does, and a singular float32 Hessian (the other trigger) raises by itself.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from sklearn.linear_model import LogisticRegression
from sklearn.preprocessing import StandardScaler

from tomlens.errors import TomlensError
from tomlens.probes.logistic import LogisticProbe, ProbeFitWarning, fit_logistic
from tomlens.probes.newton import (
    FIT_STATUS,
    NON_FINITE_INPUT,
    OK,
    SOLVER_FAILED,
    newton_direction,
    newton_logistic,
)

LAPACK = ("cholesky", "cholesky_ex", "solve", "solve_ex", "solve_triangular", "lstsq", "inv", "eigh", "pinv",
          "svd", "qr", "lu_factor", "lu_factor_ex")


@pytest.fixture(autouse=True)
def strict_linalg(monkeypatch: pytest.MonkeyPatch) -> None:
    """LAPACK-backed calls refuse NaN/inf input, as MKL's did (SLASWP: invalid pivots)."""
    def strict(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
        def wrapped(A: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if not bool(torch.isfinite(A).all()):
                raise RuntimeError(f"{name}: non-finite input reached LAPACK")
            return fn(A, *args, **kwargs)
        return wrapped

    for name in LAPACK:
        monkeypatch.setattr(torch.linalg, name, strict(getattr(torch.linalg, name), name))
    monkeypatch.setattr(torch, "cholesky_solve", strict(torch.cholesky_solve, "cholesky_solve"))


M = 40  # rows per problem


def degenerate_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[str]]:
    """Units [u, M, r] that break an LU solve of a float32 Hessian, with 0/1 targets and 1/C."""
    g = torch.Generator().manual_seed(0)
    y = (torch.arange(M) % 2).double()
    sign = 2 * y - 1
    base = lambda r=6: torch.randn(M, r, generator=g, dtype=torch.float64)  # noqa: E731
    units = {"plain": base() + 0.8 * sign.unsqueeze(1)}
    units["singular"] = torch.zeros(M, 6, dtype=torch.float64)  # no feature at all
    sep = base()
    sep[:, 0] = 50 * sign
    units["separable"] = sep
    const = base()
    const[:, 2] = 748.0  # the embedded model's massive residual dimension, held constant
    units["constant_feature"] = const
    dup = base()
    dup[:, 3:] = dup[:, :3]
    units["duplicated"] = dup
    units["scale_1e4"] = 1e4 * (base() + 0.3 * sign.unsqueeze(1))
    # the case that crashed the float32 LU: as many columns as rows (a reduced d > n problem),
    # two of them equal, at |x| ~ 1e3
    square = 1e3 * torch.randn(M, M, generator=g, dtype=torch.float64)
    square[:, 1] = square[:, 0]
    units["square_duplicated_1e3"] = square
    r = max(z.shape[1] for z in units.values())
    Z = torch.stack([torch.nn.functional.pad(z, (0, r - z.shape[1])) for z in units.values()])
    u = Z.shape[0]
    Y = torch.stack([y, 1 - y], 1).unsqueeze(0).expand(u, M, 2).contiguous()  # two target columns
    inv_c = torch.tensor([0.1, 10.0], dtype=torch.float64).expand(u, 2).contiguous()
    return Z, Y, inv_c, list(units)


def kkt_residual(Z: torch.Tensor, Y: torch.Tensor, inv_c: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """Largest |gradient| of the penalised objective at `beta`, relative to the size of its terms
    (0 at the exact optimum; scale-free, so 1e4-scaled features are judged like the others)."""
    zt = torch.cat([Z, torch.ones(*Z.shape[:2], 1, dtype=Z.dtype)], 2)
    f = torch.bmm(zt, beta.transpose(1, 2))
    resid = (1 - Y) * torch.sigmoid(f) - Y * torch.sigmoid(-f)  # p - y, exact at large margins
    r = Z.shape[2]
    pen = torch.cat([inv_c.unsqueeze(2).expand(-1, -1, r), torch.zeros(*inv_c.shape, 1, dtype=Z.dtype)], 2)
    grad = torch.bmm(zt.transpose(1, 2), resid).transpose(1, 2) + pen * beta
    size = torch.bmm(zt.abs().transpose(1, 2), resid.abs()).transpose(1, 2) + (pen * beta).abs()
    return (grad.abs() / (size + 1e-300)).amax(2)


@pytest.mark.parametrize("solve_dtype", [torch.float64, torch.float32])
def test_degenerate_problems_are_solved_to_their_optimum(solve_dtype):
    Z, Y, inv_c, names = degenerate_batch()
    res = newton_logistic(Z, Y, inv_c, solve_dtype=solve_dtype, max_iter=200, tol=1e-16)
    assert res.status.shape == (len(names), 2)
    assert (res.status == OK).all(), dict(zip(names, res.status.tolist(), strict=True))
    assert torch.isfinite(res.beta).all()
    assert res.converged.all()
    # the optimum, not just any finite answer: the gradient vanishes relative to its terms (float32
    # Hessians give poorer directions; the line search then stops near 1e-9 on some BLAS kernels)
    assert float(kkt_residual(Z, Y, inv_c, res.beta).max()) < (1e-9 if solve_dtype == torch.float64 else 1e-7)
    # duplicated columns share their weight equally (the L2 optimum is symmetric)
    dup = names.index("duplicated")
    torch.testing.assert_close(res.beta[dup, :, :3], res.beta[dup, :, 3:6], rtol=1e-5, atol=1e-8)
    # a unit without features predicts the base rate through its intercept alone
    sing = names.index("singular")
    assert float(res.beta[sing, :, :-1].abs().max()) == 0.0
    assert torch.allclose(res.beta[sing, :, -1], torch.zeros(2, dtype=torch.float64), atol=1e-8)


def test_each_unit_is_solved_as_if_alone():
    Z, Y, inv_c, names = degenerate_batch()
    together = newton_logistic(Z, Y, inv_c)
    for k, name in enumerate(names):
        alone = newton_logistic(Z[k:k + 1], Y[k:k + 1], inv_c[k:k + 1])
        # same problem, only the batch around it differs: BLAS may block a batch of one otherwise,
        # and the constant 748 column (nearly the intercept's) amplifies fp64 rounding to ~1e-10
        torch.testing.assert_close(together.beta[k:k + 1], alone.beta, rtol=1e-8, atol=1e-9, msg=name)


def test_non_finite_units_fail_alone_and_leave_their_neighbours_untouched():
    Z, Y, inv_c, names = degenerate_batch()
    good = newton_logistic(Z, Y, inv_c)
    u = Z.shape[0]
    bad_z = Z[:3].clone()
    bad_z[0, 5, 1] = math.nan
    bad_z[1, 0, 0] = math.inf
    bad_y = Y[:3].clone()
    bad_y[2, 4, 1] = math.nan  # only the second target column of this unit is unusable
    Zb = torch.cat([Z[:2], bad_z[:2], Z[2:], Z[2:3]])  # NaN and inf units in the middle
    Yb = torch.cat([Y[:2], Y[:2], Y[2:], bad_y[2:3]])
    ib = torch.cat([inv_c[:2], inv_c[:2], inv_c[2:], inv_c[2:3]])
    res = newton_logistic(Zb, Yb, ib)
    keep = [0, 1] + list(range(4, u + 2))
    torch.testing.assert_close(res.beta[keep], good.beta, rtol=1e-8, atol=1e-9)
    assert (res.status[keep] == OK).all()
    assert (res.status[2:4] == NON_FINITE_INPUT).all() and torch.isnan(res.beta[2:4]).all()
    assert res.status[-1].tolist() == [OK, NON_FINITE_INPUT]
    torch.testing.assert_close(res.beta[-1, 0], good.beta[2, 0], rtol=1e-8, atol=1e-9)
    assert torch.isnan(res.beta[-1, 1]).all()
    # a warm start from a failed fit (NaN weights) starts that problem from zero instead
    beta0 = good.beta.clone()
    beta0[0] = math.nan
    warm = newton_logistic(Z, Y, inv_c, beta0=beta0)
    torch.testing.assert_close(warm.beta[0], good.beta[0], rtol=1e-8, atol=1e-9)


def test_targets_other_than_0_and_1_are_refused():
    Z, Y, inv_c, _ = degenerate_batch()
    with pytest.raises(TomlensError, match="0 or 1"):
        newton_logistic(Z, Y * 0.5, inv_c)


def test_overflowing_problem_is_reported_as_solver_failure():
    Z, Y, inv_c, _ = degenerate_batch()
    Zb = Z[:3].clone()
    Zb[1] = 1e200 * torch.sign(Z[0])  # finite features whose Hessian overflows to inf
    res = newton_logistic(Zb, Y[:3], inv_c[:3])
    assert res.status[1].tolist() == [SOLVER_FAILED] * 2 and torch.isnan(res.beta[1]).all()
    assert not res.converged[1].any()
    alone = newton_logistic(Z[[0, 2]], Y[[0, 2]], inv_c[[0, 2]])
    torch.testing.assert_close(res.beta[[0, 2]], alone.beta, rtol=1e-8, atol=1e-9)


def test_newton_direction_damps_what_cholesky_cannot_factorise():
    g = torch.Generator().manual_seed(3)
    A = torch.randn(5, 5, generator=g, dtype=torch.float64)
    spd = A @ A.T + torch.eye(5, dtype=torch.float64)
    v = torch.randn(5, 1, generator=g, dtype=torch.float64)
    rank1 = v @ v.T  # PSD and singular: Cholesky fails, damping does not
    indefinite = torch.diag(torch.tensor([1.0, 1.0, 1.0, 1.0, -1e-14], dtype=torch.float64))  # rounding-sized
    nan = spd.clone()
    nan[0, 0] = math.nan
    # a zero matrix has no curvature to damp: not solved, like a NaN matrix or an inf gradient
    h = torch.stack([spd, rank1, indefinite, torch.zeros(5, 5, dtype=torch.float64), nan, spd])
    grad = torch.randn(6, 5, generator=g, dtype=torch.float64)
    grad[5, 0] = math.inf
    active = torch.tensor([True, True, True, True, True, True])
    delta, solved = newton_direction(h, grad, active)
    assert solved.tolist() == [True, True, True, False, False, False]
    torch.testing.assert_close(delta[0], -torch.linalg.solve(spd, grad[0]), rtol=1e-10, atol=1e-12)
    assert ((grad[:3] * delta[:3]).sum(1) < 0).all()  # every damped direction still goes downhill
    assert (delta[3:] == 0).all()
    inactive = newton_direction(h, grad, torch.tensor([False, True, True, True, True, True]))
    assert not bool(inactive[1][0]) and (inactive[0][0] == 0).all()


# ------------------------------------------------------------------------------------ fit_logistic
def planted(u: int = 4, n: int = 96, d: int = 30, seed: int = 0, scale: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 2, (n,), generator=g)
    X = torch.randn(u, n, d, generator=g, dtype=torch.float64)
    X[:, :, 0] += 1.2 * (2 * y - 1)
    return X * scale, y, torch.arange(n) // 4


def test_fit_logistic_reports_non_finite_units_and_fits_the_rest_as_alone():
    X, y, groups = planted(u=5, d=40)  # n_train < d in the inner folds: the reduced path
    X[3] *= 1e3
    X[3, :, 5] = 748.0  # a constant massive dimension
    X[4, :, 20:] = X[4, :, :20]  # duplicated features
    kw = dict(groups=groups, c_grid=(0.01, 0.1, 1.0, 10.0), cv=3, device="cpu")
    alone = fit_logistic(X, y.unsqueeze(0), **kw)
    assert (alone.status == OK).all() and torch.isfinite(alone.coef).all()
    torch.testing.assert_close(alone.coef[0, 4, 0, :20], alone.coef[0, 4, 0, 20:], rtol=1e-5, atol=1e-9)
    Xb = torch.cat([X[:2], X[:2], X[2:]])
    Xb[2, 7, 3] = math.nan
    Xb[3, 0, 0] = -math.inf
    with pytest.warns(ProbeFitWarning, match="2 could not be fitted .*2 non_finite_input"):
        res = fit_logistic(Xb, y.unsqueeze(0), **kw)
    assert [FIT_STATUS[c] for c in res.status[0].tolist()] == \
        ["ok", "ok", "non_finite_input", "non_finite_input", "ok", "ok", "ok"]
    keep = [0, 1, 4, 5, 6]
    assert torch.isnan(res.coef[0, 2:4]).all() and torch.isnan(res.intercept[0, 2:4]).all()
    assert torch.isnan(res.C[0, 2:4]).all()
    assert torch.equal(res.C[0, keep], alone.C[0])
    torch.testing.assert_close(res.coef[0, keep], alone.coef[0], rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(res.intercept[0, keep], alone.intercept[0], rtol=1e-6, atol=1e-9)
    probe = LogisticProbe.from_fit(res)
    assert probe.fit_status_.tolist() == res.status[0].tolist()


def test_a_failed_c_that_is_not_chosen_does_not_mark_the_unit(monkeypatch):
    """Cross-validation tries every C; a failure at one C disqualifies that C, not the unit."""
    import tomlens.probes.logistic as logistic

    X, y, groups = planted(u=3, d=10)
    kw = dict(groups=groups, c_grid=(0.1, 1.0, 1e6), cv=3, device="cpu")
    clean = fit_logistic(X, y.unsqueeze(0), **kw)
    real = logistic.newton_logistic

    def failing_at_huge_c(Z, y_, inv_c, **kwargs):  # noqa: ANN001, ANN202 - same signature
        res = real(Z, y_, inv_c, **kwargs)
        huge = (inv_c < 1e-5).all(1)  # every fit of a unit at C = 1e6
        if bool(huge.any()):
            status = res.status.clone()
            status[huge] = SOLVER_FAILED
            return type(res)(beta=res.beta, n_iter=res.n_iter, converged=res.converged, status=status)
        return res

    monkeypatch.setattr(logistic, "newton_logistic", failing_at_huge_c)
    res = fit_logistic(X, y.unsqueeze(0), **kw)
    assert (res.status == OK).all(), res.status
    assert bool((res.C != 1e6).all()) and torch.isfinite(res.coef).all()
    chose_huge_before = clean.C == 1e6
    keep = ~chose_huge_before  # units that did not want C = 1e6 get the same probe as before
    torch.testing.assert_close(res.coef[keep], clean.coef[keep], rtol=1e-6, atol=1e-9)


def test_features_at_scale_1e4_give_the_same_probe_as_unscaled():
    X, y, groups = planted(u=2, d=12)
    kw = dict(groups=groups, c_grid=(0.1, 1.0), cv=3, device="cpu")
    small = fit_logistic(X, y.unsqueeze(0), **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ProbeFitWarning)  # no unit fails or stalls
        big = fit_logistic(1e4 * X + 3e4, y.unsqueeze(0), **kw)
    assert torch.equal(big.C, small.C)
    torch.testing.assert_close(big.coef * 1e4, small.coef, rtol=1e-6, atol=1e-9)


def test_float32_statistics_survive_values_whose_squares_overflow():
    # float32 standardisation sums squares: |x| = 1e20 overflows them, 1e-25 underflows them
    X, y, groups = planted(u=3, d=50)  # d > n_train: the row-basis and per-fold paths
    X = X.float()
    kw = dict(groups=groups, c_grid=(0.1, 1.0), cv=3, device="cpu", dtype=torch.float32)
    ref = fit_logistic(X, y.unsqueeze(0), **kw)
    scale = torch.tensor([1.0, 1e20, 1e-25]).view(3, 1, 1)
    res = fit_logistic(X * scale, y.unsqueeze(0), **kw)
    assert (res.status == OK).all() and torch.equal(res.C, ref.C)
    # float32 Gram matrices: agreement to float32 rounding, amplified by the weak penalty
    torch.testing.assert_close(res.coef * scale.view(1, 3, 1, 1).double(), ref.coef, rtol=1e-3, atol=1e-5)
    torch.testing.assert_close(res.intercept, ref.intercept, rtol=1e-3, atol=1e-5)


def test_sklearn_agreement_holds_on_badly_scaled_planted_data():
    # like the embedded model's residual stream: |x| ~ 1e3 and one dimension near 748
    X, y, _ = planted(u=2, n=120, d=20, seed=5, scale=1e3)
    X[:, :, 7] = 748.0 + torch.randn(2, 120, dtype=torch.float64)
    tr, te = torch.arange(90), torch.arange(90, 120)
    probe = LogisticProbe(C=0.5, device="cpu").fit(X[:, tr], y[tr])
    assert (probe.fit_status_ == OK).all()
    ours = probe.score(X[:, te], y[te]).numpy()
    for k in range(2):
        sc = StandardScaler().fit(X[k, tr].numpy())
        m = LogisticRegression(C=0.5, solver="newton-cholesky", tol=1e-12, max_iter=500)
        m.fit(sc.transform(X[k, tr].numpy()), y[tr].numpy())
        coef = m.coef_[0] / sc.scale_
        np.testing.assert_allclose(probe.coef_[k, 0].numpy(), coef, rtol=1e-4, atol=1e-6 * np.abs(coef).max())
        ref = m.score(sc.transform(X[k, te].numpy()), y[te].numpy())
        assert abs(ours[k] - ref) <= 0.01


# ------------------------------------------------------------------------ the repro, fixture-sized
class _Scaled:
    """Activations as the embedded model has them (|x| ~ 1e3, one massive dimension at ~750),
    with NaN in one head of the last layer."""

    def __init__(self, acts: Any):
        self._acts = acts

    def __getattr__(self, name: str) -> Any:
        return getattr(self._acts, name)

    def get(self, kind: str, position: str) -> torch.Tensor:
        X = self._acts.get(kind, position).float()
        X = X / X.abs().amax().clamp_min(1e-12) * 1e3
        X[..., 0] = 748.0 + 1e-2 * X[..., 0]
        if kind == "head_out":
            X[3, -1, 1, 2] = math.nan
        return X


def test_probe_command_on_scaled_tiny_llama_activations_prints_a_table(tmp_path, monkeypatch, capsys):
    import pandas as pd

    import tomlens.activations as activations
    import tomlens.runs.probes as probe_run
    from tomlens.cli import main
    from tomlens.stimuli import generate, write_jsonl

    real = activations.cache_activations  # the probe run caches through tomlens.runs.probes
    monkeypatch.setattr(probe_run, "cache_activations", lambda *a, **k: _Scaled(real(*a, **k)))
    run_probes, resumed_in = probe_run.run, []  # `tomlens probe` keeps its fits in --out, so a killed run resumes
    monkeypatch.setattr(probe_run, "run", lambda config, **k: resumed_in.append(k.get("out")) or run_probes(config, **k))
    path = write_jsonl(generate("unexpected-transfer", n=4, seed=7), tmp_path / "ut.jsonl")
    out = tmp_path / "P"
    rc = main(["probe", "--model", "tiny-llama", "--stimuli", str(path), "--targets", "protagonist_belief",
               "--out", str(out), "--store", str(tmp_path / "S"), "--folds", "3", "--inner-folds", "2",
               "--n-boot", "50", "--no-progress", "--device", "cpu", "--format", "csv"])
    printed = capsys.readouterr()
    assert rc == 0, printed.err
    assert "Traceback" not in printed.out + printed.err
    assert resumed_in == [str(out)]
    table = pd.read_csv(out / "probes.csv").fillna({"kind": ""})  # the baseline's empty kind reads as NaN
    assert {"resid_post", "head_out", ""} <= set(table["kind"]) <= {"resid_post", "head_out", "", "resid_pre"}
    assert set(table.loc[table["kind"] == "", "features"]) == {"bag_of_words", "length", "position"}
    assert set(table.loc[table["kind"] == "resid_pre", "features"]) <= {"embeddings"}
    bad = (table["kind"] == "head_out") & (table["layer"] == table["layer"].max()) & (table["head"] == 1)
    assert (table.loc[bad, "fit_status"] == "non_finite_input").all() and table.loc[bad, "score"].isna().all()
    assert table.loc[bad, "selectivity"].isna().all()
    rest = table[~bad]
    assert set(rest["fit_status"]) <= {"ok", "not_converged"}
    assert rest["score"].notna().all()
    # the directions say which units they could not fit
    from tomlens.probes.directions import load_directions

    tensors, meta = load_directions(out / "directions.safetensors")
    status = tensors["protagonist_belief/head_out/final/fit_status"]
    assert meta["fit_status_codes"] == list(FIT_STATUS)
    assert int(status[-1, 1]) == NON_FINITE_INPUT and int((status != OK).sum()) == 1
    assert torch.isnan(tensors["protagonist_belief/head_out/final/coef"][-1, 1]).all()
    # one line says how many failed and why
    lines = [ln for ln in printed.out.splitlines() if "could not be fitted" in ln]
    n_units = table.groupby(["features", "target", "kind", "layer", "head"]).ngroups
    assert len(lines) == 1 and f"1 of {n_units} probe units could not be fitted (1 non_finite_input)" in lines[0]
