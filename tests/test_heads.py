"""Heads that carry belief: ranking, top-k recovery, mean ablation and the per-head table, each
checked against a direct hook-by-hook computation on a tiny model."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
from helpers import probe_table, short_pairs, tl_metric
from jaxtyping import TypeCheckError

from tomlens.errors import TomlensError
from tomlens.models import encode
from tomlens.patching.attribution import attribution_patching
from tomlens.patching.cells import hook_for
from tomlens.patching.exact import exact_patching
from tomlens.patching.heads import head_table, mean_ablation, probe_accuracy_by_head, rank_heads, topk_recovery
from tomlens.patching.pairs import prepare_pairs


@pytest.fixture(scope="module")
def setup(load_tiny):
    model = load_tiny("tiny-llama")
    pairs = short_pairs(model.tokenizer, 3)
    prepared = prepare_pairs(model, pairs, batch_pairs=2)  # two groups: exercises the group loop
    exact = exact_patching(model, prepared, sites=["heads"], positions=("all",), progress=False)
    return model, pairs, prepared, exact


def test_rank_heads(setup):
    model, pairs, prepared, exact = setup
    r = rank_heads(exact)
    assert len(r) == model.cfg.n_layers * model.cfg.n_heads
    assert r["rank"].tolist() == list(range(1, len(r) + 1))
    assert r.effect.is_monotonic_decreasing
    a = rank_heads(exact, by="abs")
    assert a.importance.is_monotonic_decreasing and (a.importance >= 0).all()
    noise = exact_patching(model, prepared, sites=["heads"], positions=("all",), direction="noise", progress=False)
    rn = rank_heads(noise)
    np.testing.assert_allclose(rn.importance, 1 - rn.effect)
    assert rn.importance.is_monotonic_decreasing


def _patch_heads_directly(model, pair, heads):
    """Metric of the corrupted run with the given heads' clean z written at every position."""
    b = encode(model, [pair.clean.text, pair.corrupted.text])
    with torch.inference_mode():
        _, cache = model.run_with_cache(b.input_ids[:1])
        hooks = []
        for layer in sorted({l for l, _ in heads}):
            hs = [h for l, h in heads if l == layer]
            name = hook_for("head", layer)

            def put(act, hook=None, name=name, hs=hs):
                act = act.clone()
                act[:, :, hs] = cache[name][:, :, hs]
                return act

            hooks.append((name, put))
        return float(tl_metric(model, pair)(model.run_with_hooks(b.input_ids[1:], fwd_hooks=hooks)))


def test_topk_recovery(setup):
    model, pairs, prepared, exact = setup
    ranking = list(zip(*[rank_heads(exact)[c] for c in ("layer", "head")], strict=True))
    n_heads = len(ranking)
    rec = topk_recovery(model, prepared, ranking, k_max=n_heads, n_random=4, seed=3, progress=False)
    t = rec.table
    assert t.k.tolist() == list(range(1, n_heads + 1))
    # Effects are raw logit differences (fp32, ~0.1) over the clean - corrupted gap (3e-4 on this
    # random model): a raw tolerance of 1e-5 (fp32 rounding of other forwards) is 1e-5 / gap here.
    gap = float((exact.clean - exact.corrupted).mean())
    tol = 1e-5 / abs(gap)
    # k = 1 is the best single head's own exact effect
    assert t.top_effect.iloc[0] == pytest.approx(rank_heads(exact).effect.iloc[0], abs=tol)
    # k = all heads: every head patched together, as a direct hook computation gives it
    direct = torch.tensor([_patch_heads_directly(model, p, ranking) for p in pairs], dtype=torch.float64)
    want = float((direct - exact.corrupted).mean()) / gap
    assert t.top_effect.iloc[-1] == pytest.approx(want, abs=tol)
    # with all heads drawn, the random sets are the same set: same effect
    assert t.random_mean.iloc[-1] == pytest.approx(want, abs=tol)
    assert (t.random_low <= t.random_mean + 1e-12).all() and (t.random_mean <= t.random_high + 1e-12).all()
    # distinct layer-matched sets, all of them where there are at most 4 (exact null)
    assert (t.n_random == t.n_distinct.clip(upper=4)).all() and len(rec.draws) == t.n_random.sum()
    assert t.n_distinct.iloc[-1] == 1 and (t.p_random >= 1 / (1 + t.n_distinct)).all()
    assert rec.draws.heads.str.count("L").tolist() == [k for k, n in zip(t.k, t.n_random, strict=True) for _ in range(n)]
    for k in t.k:
        sets = rec.draws[rec.draws.k == k].heads.map(lambda h: frozenset(h.split(";")))
        assert sets.nunique() == len(sets)  # no set drawn twice
    again = topk_recovery(model, prepared, ranking, k_max=2, n_random=4, seed=3, progress=False)
    assert again.draws.heads.tolist() == rec.draws[rec.draws.k <= 2].heads.tolist()  # seeded
    some = topk_recovery(model, prepared, ranking, k_max=n_heads, ks=[1, 3, 99], n_random=6, seed=3, progress=False)
    assert some.table.k.tolist() == [1, 3]  # a k above the ranked heads is left out
    assert some.table.top_effect.tolist() == pytest.approx(t.set_index("k").loc[[1, 3]].top_effect.tolist())
    for row in some.table.itertuples():  # random sets take the top set's layers; reach share by hand
        draws = some.draws[some.draws.k == row.k]
        layers = sorted(h.split("H")[0] for h in row.heads.split(";"))
        assert all(sorted(h.split("H")[0] for h in d.split(";")) == layers for d in draws.heads)
        assert row.random_reach == pytest.approx(float((draws.effect >= row.top_effect).mean()))
        assert row.p_random == pytest.approx((1 + (draws.effect >= row.top_effect).sum()) / (1 + len(draws)))


def _ablate_directly(model, pairs, heads, mode):
    """Logit differences [clean, corrupted] x pair with the heads' z replaced by their mean."""
    stories = [s for p in pairs for s in (p.clean, p.corrupted)]
    with torch.inference_mode():
        zs = []
        for s in stories:
            _, cache = model.run_with_cache(encode(model, [s.text]).input_ids)
            zs.append({l: cache[hook_for("head", l)][0] for l in range(model.cfg.n_layers)})
        n_al = max(z[0].shape[0] for z in zs)
        means = {}
        for l in range(model.cfg.n_layers):
            if mode == "final":
                means[l] = torch.stack([z[l][-1] for z in zs]).mean(0)
            else:  # right-aligned per-position mean over the stories that have that position
                acc = torch.zeros((n_al,) + tuple(zs[0][l].shape[1:]))
                cnt = torch.zeros(n_al)
                for z in zs:
                    acc[n_al - z[l].shape[0]:] += z[l]
                    cnt[n_al - z[l].shape[0]:] += 1
                means[l] = acc / cnt[:, None, None]
        out = torch.empty(2, len(pairs), dtype=torch.float64)
        for i, s in enumerate(stories):
            ids = encode(model, [s.text]).input_ids
            n = ids.shape[1]
            hooks = []
            for layer in sorted({l for l, _ in heads}):
                hs = [h for l, h in heads if l == layer]

                def put(act, hook=None, layer=layer, hs=hs):
                    act = act.clone()
                    if mode == "final":
                        act[:, -1, hs] = means[layer][hs]
                    else:
                        act[:, :, hs] = means[layer][n_al - n:, hs]
                    return act

                hooks.append((hook_for("head", layer), put))
            pair = pairs[i // 2]
            out[i % 2, i // 2] = float(tl_metric(model, pair)(model.run_with_hooks(ids, fwd_hooks=hooks)))
        return out


@pytest.mark.parametrize("mode", ["final", "all"])
def test_mean_ablation(setup, mode):
    model, pairs, prepared, exact = setup
    ranking = list(zip(*[rank_heads(exact)[c] for c in ("layer", "head")], strict=True))
    ab = mean_ablation(model, prepared, ranking, ks=[1, 3], n_random=3, seed=0, mode=mode, progress=False)
    # accuracies count signs computed by other forwards: equal only while no logit difference sits
    # within fp32 rounding of 0, so check that margin first (here and for each k below)
    assert float(torch.cat([exact.clean, exact.corrupted]).abs().min()) > 1e-4
    assert ab.baseline["fb_accuracy"] == pytest.approx(float((exact.clean > 0).double().mean()))
    assert ab.baseline["tb_accuracy"] == pytest.approx(float((exact.corrupted < 0).double().mean()))
    for k in (1, 3):
        direct = _ablate_directly(model, pairs, ranking[:k], mode)
        assert float(direct.abs().min()) > 1e-4
        row = ab.table[ab.table.k == k].iloc[0]
        # batched ablation vs one story per forward (values ~0.1): fp32 tolerance
        assert row.clean_logit_diff == pytest.approx(float(direct[0].mean()), abs=1e-5)
        assert row.fb_accuracy == pytest.approx(float((direct[0] > 0).double().mean()))
        assert row.tb_accuracy == pytest.approx(float((direct[1] < 0).double().mean()))
        assert row.fb_drop == pytest.approx(ab.baseline["fb_accuracy"] - row.fb_accuracy)
    assert len(ab.draws) == ab.table.n_random.sum() and set(ab.draws.k) == {1, 3}
    assert (ab.table.n_random == ab.table.n_distinct.clip(upper=3)).all()
    for row in ab.table.itertuples():
        draws = ab.draws[ab.draws.k == row.k]
        assert row.random_reach == pytest.approx(float((draws.fb_drop >= row.fb_drop).mean()))
    with pytest.raises((TomlensError, TypeCheckError), match="mode"):  # the guard, or the annotation
        mean_ablation(model, prepared, ranking, ks=[1], mode="median", progress=False)


def test_head_table(setup):
    model, pairs, prepared, exact = setup
    attr = attribution_patching(model, prepared, sites=["heads"], positions=("all",), progress=False)
    table = head_table(exact, attr, probe_table())
    assert len(table) == model.cfg.n_layers * model.cfg.n_heads
    assert table.patch_rank.tolist() == list(range(1, len(table) + 1))
    want = {(l, h): 0.5 + 0.05 * (4 * l + h) for l in range(2) for h in range(4)}
    got = {(int(r.layer), int(r.head)): r.probe_accuracy for r in table.itertuples()}
    assert got == pytest.approx(want)
    fb = {(int(r.layer), int(r.head)): r.probe_accuracy_false_belief for r in table.itertuples()}
    assert fb == pytest.approx({k: v / 2 for k, v in want.items()})
    assert set(table.probe_position) == {"final"} and set(table.probe_selectivity) == {0.2}
    eff = exact.select("head", "all").set_index(["layer", "head"]).effect
    for r in table.itertuples():
        assert r.patch_effect == pytest.approx(eff[(r.layer, r.head)])
        assert np.isfinite(r.attribution_effect) and 1 <= r.attribution_rank <= len(table)
    prot = probe_accuracy_by_head(probe_table(), position="protagonist")
    assert (prot.probe_accuracy == 0.1).all()
    with pytest.raises(TomlensError, match="lacks columns"):
        head_table(exact, probe=pd.DataFrame({"layer": [0]}))
    with pytest.raises(TomlensError, match="no head_out accuracy rows"):
        head_table(exact, probe=probe_table().assign(target="goal"))
