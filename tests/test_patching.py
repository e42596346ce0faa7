"""Exact activation patching: batched sweeps equal TransformerLens's looped functions, shortcuts are
exact, identities hold (identity patch, clean into clean = 1, corrupted into corrupted = 0)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from helpers import short_pairs, tl_metric
from jaxtyping import TypeCheckError

from tomlens.errors import TomlensError
from tomlens.models import encode
from tomlens.patching.cells import hook_for
from tomlens.patching.engine import Patch, Run, base_pass, run_patched
from tomlens.patching.exact import exact_patching
from tomlens.patching.metric import summarise
from tomlens.patching.pairs import prepare_pairs
from tomlens.stimuli.pairs import MinimalPair


def _ours(result, kind, position, j):
    df = result.cell_frame()
    sel = ((df.kind == kind) & (df.position == position)).to_numpy()
    return result.values[torch.tensor(sel), j]


def _tl_cells(model, corr_ids, cache, metric, act: str, index: list[tuple[int, ...]]):
    """TransformerLens's looped patching (one forward per cell) over an explicit list of cells."""
    import pandas as pd
    from transformer_lens import patching

    if len(index[0]) == 3:
        df = pd.DataFrame(index, columns=["layer", "pos", "head_index"])
        setter = patching.layer_pos_head_vector_patch_setter
    else:
        df = pd.DataFrame(index, columns=["layer", "pos"])
        setter = patching.layer_pos_patch_setter
    return patching.generic_activation_patch(
        model, corr_ids, cache, metric, patch_setter=setter, activation_name=act, index_df=df
    ).double()


@pytest.mark.parametrize(
    "name,by_pos_heads", [("tiny-llama", True), ("tiny-gpt2", False), ("tiny-neox", False)]
)
def test_batched_equals_transformer_lens_looped(load_tiny, name, by_pos_heads):
    """Every cell of the batched sweep (left-padded groups, KV prefix, skipped blocks) equals
    TransformerLens's one-forward-per-cell functions, run one pair at a time (they pass no mask).

    Per-position cells are compared at a few positions around and after the first token where the
    pair differs and at the end (earlier cells are the corrupted run itself, checked in
    test_selector_positions), and the per-position kinds are split over the two pairs, to keep the
    looped reference affordable."""
    from transformer_lens import patching

    model = load_tiny(name)
    pairs = short_pairs(model.tokenizer, 2)
    sites = {"resid": ["each"], "heads": ["all"] + (["each"] if by_pos_heads else []), "attn": ["each"], "mlp": ["each"]}
    res = exact_patching(model, pairs, sites=sites, batch_pairs=2, progress=False)
    noise = exact_patching(model, pairs, sites={"heads": ["all"]}, direction="noise", progress=False)
    L, H = model.cfg.n_layers, model.cfg.n_heads
    n_al = max(encode(model, [p.clean.text]).lengths[0] for p in pairs)
    spread = []
    for j, pair in enumerate(pairs):
        b = encode(model, [pair.clean.text, pair.corrupted.text])
        clean_ids, corr_ids = b.input_ids[:1], b.input_ids[1:]
        n = b.lengths[0]
        off = n_al - n
        first = int((clean_ids[0] != corr_ids[0]).nonzero()[0])
        positions = sorted({first - 1, first, first + 1, (first + n) // 2, n - 2, n - 1})
        metric = tl_metric(model, pair)
        with torch.inference_mode():
            _, clean_cache = model.run_with_cache(clean_ids)
            _, corr_cache = model.run_with_cache(corr_ids)
            tl = patching.get_act_patch_attn_head_out_all_pos(model, corr_ids, clean_cache, metric).double()
            # one unpadded, unmasked forward per cell vs batched padded rows (logit differences < 0.3):
            # fp32 rounding, so a tolerance here and below
            torch.testing.assert_close(_ours(res, "head", "all", j).view(L, H), tl, atol=1e-4, rtol=0)
            spread.append(float(tl.max() - tl.min()))
            # noising: the clean run with corrupted activations
            tl = patching.get_act_patch_attn_head_out_all_pos(model, clean_ids, corr_cache, metric).double()
            torch.testing.assert_close(_ours(noise, "head", "all", j).view(L, H), tl, atol=1e-4, rtol=0)
            # per-position kinds split over the two pairs (the first is left-padded in the batch)
            kinds = [("resid_pre", "resid_pre")] if j == 0 else [("attn_out", "attn_out"), ("mlp_out", "mlp_out")]
            if by_pos_heads and j == 1:
                kinds.append(("head", "z"))
            for kind, act in kinds:
                mine = _ours(res, kind, "each", j).view((L, n_al, H) if kind == "head" else (L, n_al))
                assert torch.isnan(mine[:, :off]).all()  # this pair has no token there
                mine = mine[:, off:]
                if kind == "head":
                    index = [(l, p, h) for l in range(L) for p in positions for h in range(H)]
                else:
                    index = [(l, p) for l in range(L) for p in positions]
                tl = _tl_cells(model, corr_ids, clean_cache, metric, act, index)
                got = torch.stack([mine[i] for i in index])
                torch.testing.assert_close(got, tl, atol=1e-4, rtol=0, msg=f"{name} {kind}")
                spread.append(float(tl.max() - tl.min()))
    assert max(spread) > 1e-3  # the comparison is not between constants


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama", "tiny-neox"])
def test_shortcuts_and_padding_are_exact(load_tiny, name):
    """Shared KV prefix + skipped blocks equal plain full forwards; one group of padded pairs equals
    one pair per group."""
    model = load_tiny(name)
    pairs = short_pairs(model.tokenizer, 3)
    sites = {"heads": ["all", "final"], "resid": ["each"], "mlp": ["all"]}
    fast = exact_patching(model, pairs, sites=sites, batch_pairs=3, progress=False)
    plain = exact_patching(model, pairs, sites=sites, batch_pairs=3, reuse_prefix=False, progress=False)
    single = exact_patching(model, pairs, sites=sites, batch_pairs=1, progress=False)
    for other in (plain, single):  # other forwards (shapes, padding): fp32 tolerance on values < 0.3
        torch.testing.assert_close(fast.values, other.values, atol=1e-5, rtol=1e-5, equal_nan=True)
        torch.testing.assert_close(fast.clean, other.clean, atol=1e-5, rtol=1e-5)
    # a tiny memory budget: one run per forward, the same numbers to fp32 rounding
    chunked = exact_patching(model, pairs, sites=["heads"], positions=("all",), batch_pairs=3, memory_mb=1e-3,
                             progress=False)
    heads = torch.tensor([(c.kind, c.position) == ("head", "all") for c in fast.cells])
    torch.testing.assert_close(fast.values[heads], chunked.values, atol=1e-5, rtol=1e-5)


def test_identity_patch_changes_nothing(load_tiny):
    """Writing a run's own activations back into it (every head, the residual stream, all positions
    or just the last) leaves its metric unchanged, through the batched engine and its shortcuts."""
    model = load_tiny("tiny-llama")
    prepared = prepare_pairs(model, short_pairs(model.tokenizer, 3), batch_pairs=3)
    group = prepared.groups[0]
    L, H = model.cfg.n_layers, model.cfg.n_heads
    hooks = [hook_for("head", l) for l in range(L)] + [hook_for("resid_pre", l) for l in range(L)]
    bp = base_pass(model, group, hooks)
    runs = []
    for story in range(2 * group.g):
        pad = group.pad(story % group.g)
        every = list(range(pad, group.width))
        for cols, first in ((every, 0), ([group.width - 1], 0), (every[-3:], L - 1)):
            patches = [Patch(hook_for("head", l), l, h, cols, story) for l in range(first, L) for h in range(H)]
            patches += [Patch(hook_for("resid_pre", l), l, -1, cols, story) for l in range(max(first, 1), L)]
            runs.append(Run(story, patches))
    out = run_patched(model, group, runs, bp.sources, bp)
    want = bp.metric.cpu().repeat_interleave(3)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)  # patched forwards vs the base run: fp32 rounding


def test_clean_into_clean_is_one_and_corrupted_into_corrupted_is_zero(load_tiny):
    model = load_tiny("tiny-gpt2")
    pairs = short_pairs(model.tokenizer, 3)
    prepared = prepare_pairs(model, pairs, batch_pairs=3)
    group = prepared.groups[0]
    g, L, H = group.g, model.cfg.n_layers, model.cfg.n_heads
    bp = base_pass(model, group, [hook_for("head", l) for l in range(L)])
    runs = []
    for story in range(2 * g):  # every head of a story's own run, at every position
        cols = list(range(group.pad(story % g), group.width))
        runs.append(Run(story, [Patch(hook_for("head", l), l, h, cols, story) for l in range(L) for h in range(H)]))
    out = run_patched(model, group, runs, bp.sources, bp).double()
    clean, corrupted = bp.metric[:g].double().cpu(), bp.metric[g:].double().cpu()
    # raw logit differences (~0.1): patched forwards vs the base run, fp32 rounding
    torch.testing.assert_close(out[:g], clean, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[g:], corrupted, atol=1e-5, rtol=1e-5)
    values = torch.stack([out[:g], out[g:]])  # [clean into clean, corrupted into corrupted]
    s = summarise(values, clean, corrupted)
    # normalised effects divide by the clean - corrupted gap (~5e-4 on this random model), which
    # scales the raw rounding up by 1 / gap: the tolerance is the raw one in normalised units
    gap = abs(float((clean - corrupted).mean()))
    np.testing.assert_allclose(s.mean, [1.0, 0.0], atol=1e-5 / gap)
    # and the same through sweeps: restoring the whole residual stream entering block 0 gives 1
    # when denoising and 0 when noising (the corrupted run's own value)
    sites = {"resid": ["all"]}
    den = exact_patching(model, pairs, sites=sites, layers=[0], progress=False)
    noi = exact_patching(model, pairs, sites=sites, layers=[0], direction="noise", progress=False)
    torch.testing.assert_close(den.values[0], den.clean, atol=1e-5, rtol=1e-5)  # raw, as above
    torch.testing.assert_close(noi.values[0], noi.corrupted, atol=1e-5, rtol=1e-5)
    assert den.summary().effect.iloc[0] == pytest.approx(1.0, abs=1e-5 / abs(den.baselines()["gap"]))
    assert noi.summary().effect.iloc[0] == pytest.approx(0.0, abs=1e-5 / abs(noi.baselines()["gap"]))


def test_selector_positions(load_tiny):
    """A head patched at "final" equals the per-position sweep's last column; the protagonist's
    mention precedes the contrast, so patching there changes nothing (exactly the corrupted run)."""
    model = load_tiny("tiny-llama")
    pairs = short_pairs(model.tokenizer, 3)
    res = exact_patching(
        model, pairs, sites={"heads": ["final", "each"], "resid": ["protagonist"]}, progress=False
    )
    df = res.cell_frame()
    final = res.values[torch.tensor((df.position == "final").to_numpy())]
    n_al = int(df.pos.max()) + 1
    last = torch.tensor(((df.position == "each") & (df.pos == n_al - 1)).to_numpy())
    torch.testing.assert_close(final, res.values[last], atol=1e-5, rtol=1e-5)  # other runs of a chunk: fp32 rounding
    prot = res.values[torch.tensor((df.position == "protagonist").to_numpy())]
    # exact: cells patched only before the first differing token are never run; the engine copies
    # the corrupted run's own value
    torch.testing.assert_close(prot, res.corrupted.expand_as(prot), atol=0, rtol=0)
    s = res.summary()
    assert (s[s.position == "protagonist"].effect == 0).all()  # (v - corrupted) / gap with v the very same number
    assert s.token.str.len().gt(0).sum() == (df.position == "each").sum()


def test_gqa_heads_are_query_heads(load_tiny):
    model = load_tiny("tiny-llama")
    assert model.cfg.n_key_value_heads < model.cfg.n_heads
    res = exact_patching(model, short_pairs(model.tokenizer, 2), sites=["heads"], positions=("all",), progress=False)
    grid = res.grid("head", "all")
    assert grid.shape == (model.cfg.n_layers, model.cfg.n_heads) and np.isfinite(grid).all()
    # two query heads sharing a KV head still have their own effects: their raw logit differences
    # (~0.1) differ by far more than fp32 rounding (1e-7), in some pair
    per_kv = model.cfg.n_heads // model.cfg.n_key_value_heads
    row = {(c.layer, c.head): i for i, c in enumerate(res.cells) if c.position == "all"}
    for layer in range(model.cfg.n_layers):
        for h in range(0, model.cfg.n_heads, per_kv):
            for other in range(h + 1, h + per_kv):
                apart = (res.values[row[layer, h]] - res.values[row[layer, other]]).abs().max()
                assert apart > 1e-4, (layer, h, other)


def test_misaligned_and_degenerate_pairs_are_refused(load_tiny):
    model = load_tiny("tiny-gpt2")
    good = short_pairs(model.tokenizer, 1)[0]
    longer = good.corrupted.with_(text=good.corrupted.text.replace("was there", "was over there"))
    with pytest.raises(TomlensError, match="not aligned"):
        prepare_pairs(model, [MinimalPair("bad", good.clean, longer, good.family, good.contrast)])
    opts = ("red box", "red bag")
    same = MinimalPair("same", good.clean.with_(options=opts, answer="red box"),
                       good.corrupted.with_(options=opts, answer="red bag"), good.family, good.contrast)
    with pytest.raises(TomlensError, match="same token"):
        prepare_pairs(model, [same])
    with pytest.raises(TomlensError, match="unknown patching site"):
        exact_patching(model, [good], sites=["neurons"], progress=False)
    with pytest.raises(TomlensError, match="no span"):
        exact_patching(model, [good], sites={"heads": ["location_2"]}, progress=False)


def test_summary_statistics():
    clean = torch.tensor([2.0, 4.0, 3.0, 3.0])
    corrupted = torch.tensor([0.0, 0.0, 1.0, -1.0])
    values = torch.tensor([
        [1.0, 2.0, 2.0, 1.0],  # halfway for every pair
        [2.0, 4.0, 3.0, float("nan")],  # clean where present, one pair missing
    ])
    pooled = summarise(values, clean, corrupted, n_boot=500, seed=1)
    gap = float((clean - corrupted).mean())  # 3.0
    assert pooled.mean[0] == pytest.approx(float((values[0] - corrupted).mean()) / gap)
    assert pooled.n.tolist() == [4, 3]
    assert pooled.mean[1] == pytest.approx(float(((values[1] - corrupted)[:3]).mean()) / gap)
    assert pooled.ci_low[0] <= pooled.mean[0] <= pooled.ci_high[0]
    per = summarise(values, clean, corrupted, normalise="per_pair", n_boot=500)
    assert per.mean[0] == pytest.approx(0.5) and per.se[0] == pytest.approx(0.0, abs=1e-12)
    assert per.mean[1] == pytest.approx(1.0)
    assert per.ci_low[0] == pytest.approx(0.5) and per.ci_high[0] == pytest.approx(0.5)
    sd = float(((values[0] - corrupted) / gap).std())
    assert pooled.se[0] == pytest.approx(sd / math.sqrt(4))
    with pytest.raises((TomlensError, TypeCheckError), match="normalis"):  # the guard, or the annotation
        summarise(values, clean, corrupted, normalise="median")


def test_a_gap_indistinguishable_from_zero_is_warned():
    from tomlens.patching.metric import UnstableGapWarning, gap_is_unstable

    clean = torch.tensor([1.0, -1.0, 0.5, -0.4])
    corrupted = torch.zeros(4)
    values = torch.zeros(1, 4)
    assert gap_is_unstable(clean - corrupted) and not gap_is_unstable(torch.tensor([1.0, 1.1, 0.9, 1.0]))
    with pytest.warns(UnstableGapWarning, match="two standard errors"):
        summarise(values, clean, corrupted, n_boot=50)
    with pytest.warns(UnstableGapWarning, match="clean == corrupted"):
        summarise(values, torch.tensor([1.0, 0.0, 1.0, 1.0]), corrupted, normalise="per_pair", n_boot=50)
