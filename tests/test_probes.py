"""Batched probes against scikit-learn, planted signals, splits, targets, bootstrap and directions.

Their tensor shape annotations are checked at run time by conftest's jaxtyping hook.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import roc_auc_score
from sklearn.multiclass import OneVsRestClassifier
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from tomlens.errors import TomlensError
from tomlens.probes.base import Probe
from tomlens.probes.controls import bag_of_words
from tomlens.probes.directions import load_directions, save_directions
from tomlens.probes.logistic import LogisticProbe, choose_c, fit_logistic, inner_folds
from tomlens.probes.mass_mean import MassMeanProbe
from tomlens.probes.splits import group_codes, group_kfold, holdout, leaked_groups
from tomlens.probes.stats import auroc, bootstrap_auroc, bootstrap_mean
from tomlens.probes.targets import (
    false_belief_mask,
    label_variation,
    make_target,
    true_belief_mask,
)
from tomlens.stimuli import generate
from tomlens.stimuli.records import Stimulus


def planted(u: int = 3, n: int = 240, d: int = 20, signal_unit: int = 1, seed: int = 0, strength: float = 3.0):
    """Features where only `signal_unit` carries the label, along one direction, plus nuisance scale."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 2, (n,), generator=g)
    X = torch.randn(u, n, d, generator=g) * (0.5 + torch.rand(u, 1, d, generator=g)) + 5 * torch.randn(u, 1, d, generator=g)
    direction = torch.randn(d, generator=g)
    X[signal_unit] += strength * (2 * y.float() - 1).unsqueeze(1) * direction / direction.norm()
    groups = torch.arange(n) // 8  # 8 prompts per "story"
    return X, y, groups


def sklearn_reference(X, y, groups_tr, tr, te, folds, c_grid, multiclass=False):
    """The same protocol with scikit-learn: per unit, grouped inner CV over the C grid (same folds,
    same selection rule), refit on the training split, accuracy on the test split."""
    accs, chosen = [], []
    for k in range(X.shape[0]):
        Xk = X[k].double().numpy()
        Xtr, ytr = Xk[tr], y[tr].numpy()
        cv_acc = np.zeros(len(c_grid))
        cv_nll = np.zeros(len(c_grid))
        for f in folds:
            a, b = f.train.numpy(), f.test.numpy()
            for ci, C in enumerate(c_grid):
                lr = LogisticRegression(C=C, solver="newton-cholesky", max_iter=200, tol=1e-10)
                m = make_pipeline(StandardScaler(), OneVsRestClassifier(lr) if multiclass else lr)
                m.fit(Xtr[a], ytr[a])
                cv_acc[ci] += (m.predict(Xtr[b]) == ytr[b]).mean() / len(folds)
                proba = np.clip(m.predict_proba(Xtr[b]), 1e-15, 1 - 1e-15)
                idx = np.searchsorted(m.classes_, ytr[b])
                cv_nll[ci] += -np.log(proba[np.arange(len(b)), idx]).mean() / len(folds)
        best = int(choose_c(torch.tensor(cv_acc), torch.tensor(cv_nll), c_grid))
        lr = LogisticRegression(C=c_grid[best], solver="newton-cholesky", max_iter=200, tol=1e-10)
        m = make_pipeline(StandardScaler(), OneVsRestClassifier(lr) if multiclass else lr).fit(Xtr, ytr)
        accs.append((m.predict(Xk[te]) == y[te].numpy()).mean())
        chosen.append(c_grid[best])
    return np.array(accs), np.array(chosen)


# ------------------------------------------------------------------------------------------ probes
def test_logistic_finds_planted_signal_and_chance_on_shuffled_labels():
    X, y, groups = planted()
    split = holdout(groups, 0.25, seed=0)
    tr, te = split.train, split.test
    probe = LogisticProbe(C=(0.01, 0.1, 1.0), cv=3, device="cpu").fit
    p = probe(X[:, tr], y[tr], groups[tr])
    acc = p.score(X[:, te], y[te])
    assert acc[1] > 0.9
    assert abs(float(acc[0]) - 0.5) < 0.2 and abs(float(acc[2]) - 0.5) < 0.2
    shuffled = LogisticProbe(C=(0.01, 0.1, 1.0), cv=3, device="cpu").fit(
        X[:, tr], y[tr][torch.randperm(tr.numel(), generator=torch.Generator().manual_seed(1))], groups[tr])
    assert abs(float(shuffled.score(X[:, te], y[te])[1]) - 0.5) < 0.2
    proba = p.predict_proba(X[:, te])
    assert torch.allclose(proba.sum(-1), torch.ones_like(proba[..., 0]))
    assert p.predict(X[:, te]).shape == (3, te.numel())
    assert p.direction.shape == (3, 1, 20)
    assert torch.allclose(p.direction.norm(dim=-1), torch.ones(3, 1, dtype=p.direction.dtype))


@pytest.mark.parametrize("d", [12, 60])  # primal (n_train > d) and reduced (n_train < d) problems
def test_batched_logistic_matches_sklearn_accuracy_on_same_splits(d):
    X, y, groups = planted(u=3, n=96, d=d, strength=1.2)
    split = holdout(groups, 0.25, seed=3)
    tr, te = split.train, split.test
    c_grid = (0.01, 0.1, 1.0, 10.0)
    res = fit_logistic(X[:, tr], y[tr].unsqueeze(0), groups=groups[tr], c_grid=c_grid, cv=3,
                                seed=0, device="cpu")
    probe = LogisticProbe.from_fit(res)
    ours = probe.score(X[:, te], y[te]).numpy()
    folds = inner_folds(groups[tr], tr.numel(), 3, 0)
    ref, ref_c = sklearn_reference(X, y, groups[tr], tr, te, folds, c_grid)
    assert np.abs(ours - ref).max() <= 0.01
    assert np.array_equal(probe.C_.numpy(), ref_c)


def test_one_vs_rest_multiclass_matches_sklearn():
    g = torch.Generator().manual_seed(5)
    n, d = 120, 10
    y = torch.randint(0, 4, (n,), generator=g)
    centres = torch.randn(4, d, generator=g) * 1.5
    X = (torch.randn(2, n, d, generator=g) + centres[y]).float()
    groups = torch.arange(n) // 6
    split = holdout(groups, 0.25, seed=0)
    tr, te = split.train, split.test
    c_grid = (0.1, 1.0)
    probe = LogisticProbe(C=c_grid, cv=3, device="cpu").fit(X[:, tr], y[tr], groups[tr])
    assert probe.coef_.shape == (2, 4, d)
    folds = inner_folds(groups[tr], tr.numel(), 3, 0)
    ref, _ = sklearn_reference(X, y, groups[tr], tr, te, folds, c_grid, multiclass=True)
    assert np.abs(probe.score(X[:, te], y[te]).numpy() - ref).max() <= 0.01


@pytest.mark.parametrize("low_rank", [False, True])
def test_coefficients_match_sklearn_well_conditioned(low_rank):
    g = torch.Generator().manual_seed(1)
    n, d = 80, 40
    if low_rank:  # like a head's output: rank 8 inside a 120-dimensional space, fewer rows than d
        d = 120
        X = torch.bmm(torch.randn(2, n, 8, generator=g, dtype=torch.float64),
                      torch.randn(2, 8, d, generator=g, dtype=torch.float64))
    else:
        X = torch.randn(2, n, d, generator=g, dtype=torch.float64) * 2 + 1
    w = torch.randn(d, generator=g, dtype=torch.float64)
    y = ((X[0] @ w) / (X[0] @ w).std() + 0.5 * torch.randn(n, generator=g, dtype=torch.float64) > 0).long()
    probe = LogisticProbe(C=0.5, device="cpu").fit(X, y)
    for k in range(2):
        sc = StandardScaler().fit(X[k].numpy())
        m = LogisticRegression(C=0.5, solver="newton-cholesky", tol=1e-12, max_iter=500)
        m.fit(sc.transform(X[k].numpy()), y.numpy())
        coef = m.coef_[0] / sc.scale_
        intercept = m.intercept_[0] - coef @ sc.mean_
        np.testing.assert_allclose(probe.coef_[k, 0].numpy(), coef, rtol=1e-4, atol=1e-6 * np.abs(coef).max())
        assert abs(float(probe.intercept_[k, 0]) - intercept) < 1e-4 * (1 + abs(intercept))


def test_low_rank_path_gives_the_same_probes_as_per_fold_reduction():
    # heads: rank-6 rows in 50 dimensions, plus one unit of full rank (a "dead head" whose
    # standardised rounding noise fills the space) that must take the per-fold route
    g = torch.Generator().manual_seed(4)
    n, d = 60, 50
    y = torch.randint(0, 2, (n,), generator=g)
    Z = torch.randn(4, n, 6, generator=g, dtype=torch.float64) + 0.8 * y.view(1, n, 1)
    X = torch.bmm(Z, torch.randn(4, 6, d, generator=g, dtype=torch.float64)) + 3.0
    X[3] = torch.randn(n, d, generator=g, dtype=torch.float64)
    groups = torch.arange(n) // 4
    kw = dict(groups=groups, c_grid=(0.01, 1.0, 10.0), cv=3, device="cpu")
    fast = fit_logistic(X, y.unsqueeze(0), low_rank=True, **kw)
    slow = fit_logistic(X, y.unsqueeze(0), low_rank=False, **kw)
    assert torch.equal(fast.C, slow.C)
    assert torch.allclose(fast.cv_accuracy, slow.cv_accuracy)
    assert torch.allclose(fast.coef, slow.coef, rtol=1e-6, atol=1e-8 * float(slow.coef.abs().max()))
    assert torch.allclose(fast.intercept, slow.intercept, rtol=1e-6, atol=1e-7)


def test_mass_mean_probe_direction_and_accuracy():
    X, y, groups = planted(strength=3.0)
    split = holdout(groups, 0.25, seed=1)
    p = MassMeanProbe(device="cpu").fit(X[:, split.train], y[split.train])
    Xt = X[:, split.train].double()
    yt = y[split.train]
    diff = Xt[:, yt == 1].mean(1) - Xt[:, yt == 0].mean(1)
    expected = diff / diff.norm(dim=-1, keepdim=True)
    assert torch.allclose(p.direction[:, 0], expected, atol=1e-10)
    acc = p.score(X[:, split.test], y[split.test])
    assert acc[1] > 0.9
    assert isinstance(p, Probe) and isinstance(LogisticProbe(), Probe)


def test_probe_errors_are_user_errors():
    X, y, _ = planted(u=1, n=40, d=5, signal_unit=0)
    with pytest.raises(TomlensError, match="two classes"):
        LogisticProbe(C=1.0, device="cpu").fit(X, torch.zeros(40, dtype=torch.long))
    with pytest.raises(TomlensError, match="not fitted"):
        LogisticProbe().predict(X)
    p = LogisticProbe(C=1.0, device="cpu").fit(X, y)
    with pytest.raises(TomlensError, match="do not match"):
        p.predict(X[:, :, :3])


def test_runtime_shape_check_catches_mismatched_rows():
    X, y, groups = planted(u=2, n=40, d=5)
    with pytest.raises(Exception) as info:
        fit_logistic(X, y[:30].unsqueeze(0), c_grid=(1.0,), device="cpu")
    assert not isinstance(info.value, TomlensError)  # the annotation check fired before the code ran
    assert "n" in str(info.value)


# ------------------------------------------------------------------------------------------ splits
@pytest.fixture(scope="module")
def transfer() -> list[Stimulus]:
    return generate("unexpected-transfer", n=8, seed=0)


def test_grouped_folds_leak_no_task_and_template_split_no_template(transfer):
    codes = group_codes(transfer, "task")
    folds = group_kfold(codes, 4, seed=0)
    seen = torch.zeros(len(transfer), dtype=torch.long)
    for f in folds:
        assert not leaked_groups(f, codes)
        tasks_tr = {transfer[i].task_id for i in f.train.tolist()}
        tasks_te = {transfer[i].task_id for i in f.test.tolist()}
        assert not tasks_tr & tasks_te
        seen[f.test] += 1
    assert torch.equal(seen, torch.ones_like(seen))  # every row tested exactly once
    tcodes = group_codes(transfer, "template")
    assert len(set(s.template_id for s in transfer)) >= 2
    for f in group_kfold(tcodes, 2, seed=0):
        tr = {transfer[i].template_id for i in f.train.tolist()}
        te = {transfer[i].template_id for i in f.test.tolist()}
        assert not tr & te
        assert not {transfer[i].task_id for i in f.train.tolist()} & {transfer[i].task_id for i in f.test.tolist()}
    # deterministic by seed, and the seed matters
    a = [f.test.tolist() for f in group_kfold(codes, 4, seed=0)]
    assert a == [f.test.tolist() for f in group_kfold(codes, 4, seed=0)]
    assert a != [f.test.tolist() for f in group_kfold(codes, 4, seed=1)]
    with pytest.raises(TomlensError, match="groups"):
        group_kfold(codes, 20, seed=0)


# ----------------------------------------------------------------------------------------- targets
def test_targets_come_apart_across_conditions(transfer):
    belief, keep_b = make_target(transfer, "protagonist_belief")
    world, keep_w = make_target(transfer, "world_state")
    assert keep_b.all() and keep_w.all()
    fb = false_belief_mask(transfer)
    tb = true_belief_mask(transfer)
    assert fb.any() and tb.any() and not (fb & tb).any()
    assert torch.equal(belief[tb], world[tb])  # true belief: belief and world agree
    assert (belief[fb] != world[fb]).all()  # false belief: they disagree on every row
    assert belief.float().std() > 0 and world.float().std() > 0
    joint, _ = make_target(transfer, "joint")
    assert torch.equal(joint, 2 * world + belief)
    unlabelled = transfer[0].with_(id="x", world_state=None)
    _, keep = make_target([unlabelled, transfer[1]], "world_state")
    assert keep.tolist() == [False, True]
    with pytest.raises(TomlensError, match="unknown probe target"):
        make_target(transfer, "belief")
    with pytest.raises(TomlensError, match="no stimulus carries"):
        make_target(transfer, "statement_protagonist")


def test_statement_targets_follow_the_two_points_of_view():
    st = generate("belief-statements", n=2, seed=0)
    p, kp = make_target(st, "statement_protagonist")
    w, kw = make_target(st, "statement_world")
    assert kp.all() and kw.all()
    fb = false_belief_mask(st)
    assert fb.any() and (~fb).any()
    assert (p[fb] != w[fb]).all() and torch.equal(p[~fb], w[~fb])
    lit, kl = make_target(st, "statement_literal")
    assert kl.all() and lit.tolist() == [int(s.answer == "true") for s in st]
    assert (lit[fb] != p[fb]).any() and (lit[fb] != w[fb]).any()  # neither embedded view


def test_label_variation_flags_targets_constant_within_a_condition(transfer):
    table = label_variation(transfer, "protagonist_belief")
    assert list(table.columns) == ["condition", "n", "share_1", "share_top", "varies"]
    assert set(table["condition"]) == {s.condition for s in transfer}
    assert int(table["n"].sum()) == len(transfer)
    fb = table.set_index("condition").loc["false_belief"]
    labels = [s.belief_is_reference for s in transfer if s.condition == "false_belief"]
    assert fb["share_1"] == pytest.approx(sum(labels) / len(labels))
    assert bool(fb["varies"]) == (len(set(labels)) > 1)
    st = generate("belief-statements", n=2, seed=0)
    lit = label_variation(st, "statement_literal")
    assert lit["varies"].all() and (lit["share_top"] < 1).all()
    with pytest.raises(TomlensError, match="no stimulus carries"):
        label_variation(transfer, "statement_literal")
    with pytest.raises(TomlensError, match="unknown probe target"):
        label_variation(transfer, "belief")


# ------------------------------------------------------------------------------------------- stats
def test_group_bootstrap_interval_covers_the_truth():
    # 400 simulated experiments (as units) of 30 stories x 6 prompts; a story effect makes prompts
    # of one story correlated, which a prompt-level bootstrap would ignore.
    g = torch.Generator().manual_seed(0)
    sims, stories, per = 400, 30, 6
    groups = torch.arange(stories).repeat_interleave(per)
    effect = torch.randn(sims, stories, generator=g)[:, groups] * 1.0
    p = torch.sigmoid(torch.logit(torch.tensor(0.7)) + effect)
    values = (torch.rand(sims, stories * per, generator=g) < p).double()
    truth = float(torch.sigmoid(torch.logit(torch.tensor(0.7)) + torch.randn(2_000_000, generator=g)).mean())
    iv = bootstrap_mean(values, groups, n_boot=400, seed=1)
    coverage = ((iv.low <= truth) & (truth <= iv.high)).double().mean()
    assert 0.88 <= float(coverage) <= 0.99


def test_auroc_matches_sklearn_with_ties_and_bootstrap_brackets_it():
    g = torch.Generator().manual_seed(2)
    y = torch.randint(0, 2, (60,), generator=g)
    scores = torch.stack([y + torch.randn(60, generator=g), torch.randint(0, 3, (60,), generator=g).double()])
    ours = auroc(scores, y)[0]
    for k in range(2):
        assert abs(float(ours[k]) - roc_auc_score(y.numpy(), scores[k].numpy())) < 1e-12
    iv = bootstrap_auroc(scores, y, torch.arange(60) // 3, n_boot=200, seed=0)
    assert (iv.low <= iv.estimate).all() and (iv.estimate <= iv.high).all()


# -------------------------------------------------------------------------------- controls, files
def test_bag_of_words(transfer):
    X, vocab = bag_of_words(transfer[:5])
    assert X.shape == (5, len(vocab)) and "the" in vocab
    X2, _ = bag_of_words(transfer[5:7], vocab)
    assert X2.shape[1] == len(vocab)


def test_directions_round_trip_through_safetensors(tmp_path):
    X, y, _ = planted(u=2, n=60, d=6)
    p = LogisticProbe(C=1.0, device="cpu").fit(X, y)
    tensors = {"belief/resid_post/final/direction": p.direction.float(),
               "belief/resid_post/final/coef": p.coef_, "belief/resid_post/final/layers": torch.arange(2)}
    meta = {**p.metadata(), "model": "fake"}
    path = save_directions(tmp_path / "dirs.safetensors", tensors, meta)
    back, meta_back = load_directions(path)
    assert set(back) == set(tensors)
    for k in tensors:
        assert torch.equal(back[k], tensors[k]) and back[k].dtype == tensors[k].dtype
    assert meta_back["model"] == "fake" and meta_back["C"] == [1.0, 1.0]
    assert not list(tmp_path.glob("*.tmp"))
    with pytest.raises(TomlensError):
        save_directions(tmp_path / "dirs.pt", tensors, meta)
