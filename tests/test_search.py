"""AtP*-guided search: the estimates equal naive references (GradDrop against a loop of detached
backward passes, the query/key fix against patched attention patterns), the fix recovers a saturated
head that plain attribution misses, verified cells equal exact patching, the search finds the exact
top k, and the false-negative bound is right."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch
from helpers import short_pairs, tl_metric
from jaxtyping import TypeCheckError
from scipy.stats import hypergeom

from tomlens.cli import main
from tomlens.errors import TomlensError
from tomlens.hooks.attention import attention_hooks
from tomlens.models import encode, load_model
from tomlens.patching.attribution import attribution_patching
from tomlens.patching.cells import Cell, hook_for
from tomlens.patching.exact import exact_patching
from tomlens.patching.heads import rank_heads
from tomlens.patching.pairs import prepare_pairs
from tomlens.patching.search import atp_star, cell_hook, hypergeom_upper, plan_search, search
from tomlens.stimuli.pairs import write_pairs


def _one_pair(model, pair):
    b = encode(model, [pair.clean.text, pair.corrupted.text])
    clean, corr = b.input_ids[:1], b.input_ids[1:]
    first = int((clean != corr).nonzero()[0, 1])
    return clean, corr, first


def _columns(cell: Cell, width: int, n_aligned: int, first: int) -> list[int] | None:
    """Unpadded columns a cell patches in one pair (None: the pair has no token there)."""
    if cell.position == "all":
        return list(range(first, width))
    col = width - n_aligned + cell.pos
    return None if col < 0 else ([col] if col >= first else [])


def _clean_cache(model, clean_ids, cells):
    names = sorted({cell_hook(model, c) for c in cells})
    with torch.inference_mode():
        return model.run_with_cache(clean_ids, names_filter=names)[1]


def _patched(model, clean, corr_ids, cell: Cell, cols: list[int], read: str | None = None):
    """A plain forward of the corrupted story with the cell's clean activations (from `clean`, a
    cache of the clean run) at `cols`: the logits, and the activation at `read` in that run."""
    name = cell_hook(model, cell)
    store = {}

    def patch(act, hook=None):
        act = act.clone()
        act[:, cols, cell.head] = clean[name][:, cols, cell.head]
        return act

    def keep(act, hook=None):
        store["act"] = act.clone()

    with torch.inference_mode():
        logits = model.run_with_hooks(corr_ids, fwd_hooks=[(name, patch)] + ([(read, keep)] if read else []))
    return logits, store.get("act")


def _pattern_changes(model, pair, cells, n_aligned) -> dict[int, torch.Tensor]:
    """For each query/key cell: its layer's attention pattern in a real patched run minus the
    unpatched one (the query/key fix's exact part)."""
    clean_ids, corr_ids, first = _one_pair(model, pair)
    clean = _clean_cache(model, clean_ids, cells)
    out = {}
    for i, cell in enumerate(cells):
        cols = _columns(cell, corr_ids.shape[1], n_aligned, first) if cell.kind in ("q", "k") else None
        if cols:
            name = attention_hooks(model, cell.layer).pattern
            _, before = _patched(model, clean, corr_ids, cell, [], read=name)
            _, after = _patched(model, clean, corr_ids, cell, cols, read=name)
            out[i] = after - before
    return out


def _reference(
    model, pair, cells: list[Cell], n_aligned: int, drop: tuple[int, int] | None, changes: dict[int, torch.Tensor]
) -> torch.Tensor:
    """One pair, no padding, no shortcuts: each cell's estimate from a plain forward of the corrupted
    story in which the attention and MLP outputs of layers `drop` = [first, end) are detached (so no
    gradient flows through them). Heads and residual cells: (clean - corrupted) . gradient over the
    cell's columns; query/key cells: `changes[cell]` (the pattern change of a real patched run)
    . d metric / d pattern."""
    clean_ids, corr_ids, first = _one_pair(model, pair)
    width = corr_ids.shape[1]
    metric = tl_metric(model, pair)
    plain = sorted({cell_hook(model, c) for c in cells if c.kind not in ("q", "k")})
    patterns = sorted({attention_hooks(model, c.layer).pattern for c in cells if c.kind in ("q", "k")})
    clean = _clean_cache(model, clean_ids, [c for c in cells if c.kind not in ("q", "k")])
    kept = {}

    def keep(name):
        def fn(act, hook=None):
            if not act.requires_grad:
                act.requires_grad_(True)
            kept[name] = act
            return act

        return fn

    hooks = [(n, keep(n)) for n in plain + patterns]  # recorded before any detach on the same hook
    if drop is not None:
        for layer in range(*drop):
            hooks += [(hook_for(k, layer), lambda act, hook=None: act.detach()) for k in ("attn_out", "mlp_out")]
    logits = model.run_with_hooks(corr_ids, fwd_hooks=hooks)
    names = plain + patterns
    grads = dict(zip(names, torch.autograd.grad(metric(logits), [kept[n] for n in names], allow_unused=True), strict=True))
    out = torch.full((len(cells),), float("nan"), dtype=torch.float64)
    for i, cell in enumerate(cells):
        cols = _columns(cell, width, n_aligned, first)
        if cols is None:
            continue
        name = attention_hooks(model, cell.layer).pattern if cell.kind in ("q", "k") else cell_hook(model, cell)
        grad = grads[name]
        if not cols or grad is None:
            out[i] = 0.0
        elif cell.kind in ("q", "k"):
            out[i] = float((changes[i] * grad).sum())
        else:
            score = ((clean[name] - kept[name].detach()) * grad).sum(-1)[0][cols]  # [cols(, head)]
            out[i] = float((score[:, cell.head] if cell.head >= 0 else score).sum())
    return out


def _cells(model, sites, n_aligned):
    """The model's cells of `sites`, "each" cells kept to layer 0 and every third position (fast references)."""
    cells = plan_search(model, sites, n_aligned=n_aligned)
    return [c for c in cells if c.position != "each" or (c.layer == 0 and c.pos % 3 == 0)]


@pytest.mark.parametrize(
    "name,sites",
    [
        ("tiny-gpt2", {"heads": ["all", "each"], "resid": ["each"], "mlp": ["all"]}),
        ("tiny-neox", {"heads": ["all"], "resid_post": ["each"], "attn": ["all"]}),
        ("tiny-llama", {"heads": ["all"], "q": ["all", "each"], "k": ["all", "each"], "resid_mid": ["each"]}),
    ],
)
@pytest.mark.parametrize("blocks", [None, 1])
def test_graddrop_and_qk_fix_equal_naive_references(load_tiny, name, sites, blocks):
    """Every estimate (full gradient and each GradDrop block), batched over padded pairs with the
    shared-prefix shortcut, equals a one-pair loop of plain forwards with detached layer outputs."""
    model = load_tiny(name)
    pairs = short_pairs(model.tokenizer, 2)
    prepared = prepare_pairs(model, pairs, batch_pairs=2)
    cells = _cells(model, sites, prepared.n_aligned)
    est = atp_star(model, prepared, cells=cells, graddrop_blocks=blocks, progress=False)
    assert est.dropped is not None and est.dropped.shape == (len(cells), len(est.blocks), 2)
    assert est.blocks == ([(0, 1), (1, 2)] if blocks is None else [(0, 2)])
    for j, pair in enumerate(pairs):
        changes = _pattern_changes(model, pair, cells, prepared.n_aligned)
        want = _reference(model, pair, cells, prepared.n_aligned, None, changes)
        torch.testing.assert_close(est.atp[:, j], want, atol=1e-5, rtol=1e-4, equal_nan=True)
        for b, drop in enumerate(est.blocks):
            got = est.dropped[:, b, j]
            ref = _reference(model, pair, cells, prepared.n_aligned, drop, changes)
            torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4, equal_nan=True)
            inside = [i for i, c in enumerate(cells) if drop[0] <= c.layer < drop[1] and c.kind in ("head", "q", "k")]
            assert torch.all(got[inside].nan_to_num() == 0)  # a head's only path to the output is its own layer's
        moved = [i for i, c in enumerate(cells) if c.layer == 0 and c.kind == "head"]
        if blocks is None:  # dropping layer 1 changes layer 0's gradients
            assert (est.dropped[moved, 1, j] - est.atp[moved, j]).nan_to_num().abs().max() > 1e-6


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama"])
def test_estimates_without_refinements_are_attribution_patching(load_tiny, name):
    model = load_tiny(name)
    pairs = short_pairs(model.tokenizer, 3)
    sites = {"heads": ["all", "each"], "resid": ["each"], "mlp": ["all"]}
    est = atp_star(model, pairs, sites=sites, graddrop=False, qk_fix=False, batch_pairs=2, progress=False)
    at = attribution_patching(model, pairs, sites=sites, batch_pairs=2, progress=False)
    assert est.cells == at.cells and est.dropped is None
    torch.testing.assert_close(est.result().values, at.values, atol=1e-6, rtol=1e-6, equal_nan=True)
    torch.testing.assert_close(est.clean, at.clean, atol=1e-6, rtol=0)


def test_qk_fix_recovers_a_saturated_head_that_attribution_misses():
    """Queries scaled 30x saturate every softmax: the gradient through it vanishes, so plain AtP
    misses most of a key or query patch; the fix, exact up to the pattern, stays within a few percent."""
    model = load_model("tiny-llama", dtype="float32", seed=0)  # a private copy: weights change below
    with torch.no_grad():
        for layer in model.original_model.model.layers:
            layer.self_attn.q_proj.weight.mul_(30)
    pairs = short_pairs(model.tokenizer, 2)
    prepared = prepare_pairs(model, pairs, batch_pairs=2, selectors=["final"])
    sites = {"q": ["all", "final"], "k": ["all", "each"]}
    fixed = atp_star(model, prepared, sites=sites, graddrop=False, progress=False)
    plain = atp_star(model, prepared, sites=sites, graddrop=False, qk_fix=False, progress=False)
    exact = torch.full_like(fixed.atp, float("nan"))
    for j, pair in enumerate(pairs):
        clean_ids, corr_ids, first = _one_pair(model, pair)
        clean = _clean_cache(model, clean_ids, fixed.cells)
        metric = tl_metric(model, pair)
        final = corr_ids.shape[1] - 1
        for i, cell in enumerate(fixed.cells):
            cols = [final] if cell.position == "final" else _columns(cell, corr_ids.shape[1], prepared.n_aligned, first)
            if cols is not None:
                logits, _ = _patched(model, clean, corr_ids, cell, [c for c in cols if c >= first])
                exact[i, j] = float(metric(logits)) - float(fixed.base[j])
    ok = ~torch.isnan(exact)
    e, f, p = exact[ok], fixed.atp[ok], plain.atp[ok]
    big = e.abs() > 0.3 * e.abs().max()
    assert big.sum() >= 2
    assert ((f - e).abs() / e.abs())[big].max() < 0.1  # the fix: within 10% on every large effect
    assert ((p - e).abs() / e.abs())[big].max() > 0.5  # plain AtP: off by more than half on one
    assert (f - e).abs().max() < 0.1 * (p - e).abs().max()


def test_verified_cells_equal_exact_patching(load_tiny):
    model = load_tiny("tiny-gpt2")
    pairs = short_pairs(model.tokenizer, 3)
    prepared = prepare_pairs(model, pairs, batch_pairs=2, selectors=["final"])
    sites = {"heads": ["all", "each"], "resid": ["final"]}
    res = search(model, prepared, sites=sites, k=3, budget=30, fn_samples=4, graddrop=True, progress=False)
    assert res.settings["graddrop"] and np.all(res.bound[~np.isnan(res.bound)] >= np.abs(res.estimate)[~np.isnan(res.bound)])
    ver = res.verified.nonzero().flatten().tolist()
    assert 9 <= len(ver) < len(res.cells)
    exact = exact_patching(model, prepared, cells=[res.cells[i] for i in ver], progress=False)
    torch.testing.assert_close(res.values[ver], exact.values, atol=1e-5, rtol=1e-5, equal_nan=True)
    torch.testing.assert_close(res.clean, exact.clean, atol=1e-5, rtol=1e-5)
    rest = [i for i in range(len(res.cells)) if i not in set(ver)]
    # cells left unverified keep their estimate: the very same tensor values, copied, so exact equality
    torch.testing.assert_close(res.values[rest], res.estimates.result().values[rest], atol=0, rtol=0, equal_nan=True)
    table = res.summary()
    assert table.verified.sum() == len(ver) and set(table.verified_as) <= {"rule", "sample", ""}
    assert table.graddrop.notna().any()
    assert table.exact_effect.notna().sum() <= len(ver) and table.loc[~table.verified, "exact_effect"].isna().all()
    np.testing.assert_allclose(table.loc[~table.verified, "effect"], table.loc[~table.verified, "estimate"], rtol=1e-9)
    assert res.per_pair().groupby("cell").verified.first().sum() == len(ver)


def test_verified_query_and_key_cells_equal_a_plain_patched_forward(load_tiny):
    model = load_tiny("tiny-llama")
    pairs = short_pairs(model.tokenizer, 2)
    prepared = prepare_pairs(model, pairs, batch_pairs=2)
    res = search(model, prepared, sites={"q": ["all", "each"], "k": ["all"]}, k=2, budget=12, fn_samples=2,
                 progress=False)
    ver = res.verified.nonzero().flatten().tolist()
    assert any(res.cells[i].kind == "k" for i in ver) and any(res.cells[i].kind == "q" for i in ver)
    for j, pair in enumerate(pairs):
        clean_ids, corr_ids, first = _one_pair(model, pair)
        clean = _clean_cache(model, clean_ids, res.cells)
        metric = tl_metric(model, pair)
        for i in ver:
            cols = _columns(res.cells[i], corr_ids.shape[1], prepared.n_aligned, first)
            if cols is None:
                assert torch.isnan(res.values[i, j])
                continue
            logits, _ = _patched(model, clean, corr_ids, res.cells[i], cols)
            assert float(res.values[i, j]) == pytest.approx(float(metric(logits)), abs=1e-5, rel=1e-5)


def _planted(seed: int = 1):
    """tiny-gpt2 with head L1H2's output scaled 20x: a clear top of the per-position head ranking."""
    model = load_model("tiny-gpt2", dtype="float32", seed=seed)
    d = model.cfg.d_head
    with torch.no_grad():
        model.original_model.transformer.h[1].attn.c_proj.weight[2 * d : 3 * d].mul_(20)
    return model


def test_search_finds_the_exact_top_k_with_a_fraction_of_the_patches():
    model = _planted()
    pairs = short_pairs(model.tokenizer, 4)
    prepared = prepare_pairs(model, pairs, batch_pairs=2)
    sites = {"heads": ["each"]}
    exact = exact_patching(model, prepared, sites=sites, progress=False)
    n = len(exact.cells)
    for k in (3, 5):
        res = search(model, prepared, sites=sites, k=k, budget=4 * k, fn_samples=5, progress=False)
        want = exact.summary().assign(i=np.abs(exact.summary().effect)).nlargest(k, "i")
        got = res.summary().assign(i=np.abs(res.summary().effect)).nlargest(k, "i")
        assert list(zip(got.layer, got["head"], got.pos, strict=True)) == list(zip(want.layer, want["head"], want.pos, strict=True))
        assert int(res.verified.sum()) <= 4 * k + 5 < n / 3
        assert (want.layer == 1).any() and (want["head"] == 2).any()  # the planted head is in the top


def test_hypergeometric_bound():
    assert hypergeom_upper(40, 40, 3, 0.95) == 3  # every cell seen: the count itself
    assert hypergeom_upper(40, 0, 0, 0.95) == 40  # none seen: no information
    assert hypergeom_upper(0, 0, 0, 0.95) == 0
    for n_pop, n, hits in ((100, 10, 0), (100, 10, 2), (57, 20, 1)):
        up = hypergeom_upper(n_pop, n, hits, 0.95)
        assert hypergeom.cdf(hits, n_pop, up, n) >= 0.05 > hypergeom.cdf(hits, n_pop, up + 1, n)
    # coverage: over random draws from a planted population, the bound falls below the truth
    # in at most 1 - confidence of them
    rng = np.random.default_rng(0)
    n_pop, bad, n = 60, 7, 12
    below = 0
    for _ in range(2000):
        hits = int((rng.choice(n_pop, size=n, replace=False) < bad).sum())
        below += hypergeom_upper(n_pop, n, hits, 0.9) < bad
    assert below / 2000 <= 0.1 + 0.02


def test_false_negative_bound_on_a_planted_case():
    """The rule patches the top 3 only (budget 3) and a low threshold leaves heads above it unpatched:
    sampling every left-out cell finds all of them and the bound is exact; a partial sample counts
    its hits right and bounds the rest."""
    model = _planted()
    pairs = short_pairs(model.tokenizer, 4)
    prepared = prepare_pairs(model, pairs, batch_pairs=2)
    sites = {"heads": ["each"]}
    exact = exact_patching(model, prepared, sites=sites, progress=False).summary()
    importance = np.abs(exact.effect.to_numpy())
    theta = float(np.nanquantile(importance, 0.9))
    res = search(model, prepared, sites=sites, k=3, budget=3, threshold=theta, fn_samples=10_000, progress=False)
    rule = np.array([v == "rule" for v in res.verified_as])
    left = ~rule & ~np.isnan(importance)
    truth = int((importance[left] >= theta).sum())
    (fn,) = res.false_negatives
    assert truth >= 3 and fn["n_left_out"] == left.sum() == fn["n_sampled"]
    assert fn["hits"] == fn["fn_count_upper"] == truth and fn["threshold"] == theta
    assert fn["unresolved_by_budget"] > 0 and res.settings["unresolved_by_budget"] > 0

    part = search(model, prepared, sites=sites, k=3, budget=3, threshold=theta, fn_samples=15, seed=3, progress=False)
    (fn,) = part.false_negatives
    drawn = np.array([v == "sample" for v in part.verified_as])
    assert fn["n_sampled"] == drawn.sum() == 15
    assert fn["hits"] == int((importance[drawn] >= theta).sum())
    assert fn["hits"] <= truth <= fn["fn_count_upper"] <= fn["n_left_out"]
    assert fn["fn_rate_upper"] == pytest.approx(fn["fn_count_upper"] / fn["n_left_out"])


def test_search_ranks_like_the_other_methods(load_tiny):
    """A search result is a patching result: rank_heads, select and grid read it like exact's."""
    model = load_tiny("tiny-gpt2")
    pairs = short_pairs(model.tokenizer, 3)
    res = search(model, pairs, k=2, budget=4, fn_samples=2, progress=False)
    ranked = rank_heads(res, by="abs")
    assert len(ranked) == 8 and res.grid("head", "all").shape == (2, 4)
    top = set(zip(ranked.layer[:2], ranked["head"][:2], strict=True))
    verified = {(c.layer, c.head) for c, v in zip(res.cells, res.verified.tolist(), strict=True) if v}
    assert top <= verified
    assert res.exact().values.shape == (int(res.verified.sum()), 3)
    assert res.report()["n_verified_rule"] >= 2


def test_search_user_errors(load_tiny):
    model = load_tiny("tiny-gpt2")
    pairs = short_pairs(model.tokenizer, 2)
    with pytest.raises(TomlensError, match="budget"):
        search(model, pairs, k=5, budget=3, progress=False)
    with pytest.raises(TomlensError, match="at least one"):
        search(model, pairs, k=0, progress=False)
    with pytest.raises(TomlensError, match="confidence"):
        search(model, pairs, confidence=1.5, progress=False)
    with pytest.raises(TomlensError, match="unknown patching site"):
        search(model, pairs, sites=["heds"], progress=False)
    with pytest.raises((TomlensError, TypeCheckError), match="direction"):  # the guard, or the annotation
        search(model, pairs, direction="sideways", progress=False)
    with pytest.raises(TomlensError, match="GradDrop blocks"):
        search(model, pairs, graddrop_blocks=5, progress=False)
    neox = load_tiny("tiny-neox")  # its rotary embedding is applied where no hook fires
    with pytest.raises(TomlensError, match="query/key fix"):
        atp_star(neox, short_pairs(neox.tokenizer, 1), sites=["q"], progress=False)


def test_patch_cli_search(load_tiny, tmp_path, capsys):
    tok = load_tiny("tiny-gpt2").tokenizer
    pairs_file = write_pairs(short_pairs(tok, 3), tmp_path / "pairs.jsonl")
    out = tmp_path / "out"
    code = main([
        "patch", "--model", "tiny-gpt2", "--pairs", str(pairs_file), "--method", "search", "--sites", "heads",
        "--top-k", "2", "--n-random", "2", "--search-budget", "5", "--search-samples", "2", "--out", str(out),
        "--no-progress", "--format", "csv", "--force",  # a random model's gap fails the gate
    ])
    assert code == 0
    printed = capsys.readouterr().out
    assert "top heads" in printed and "false negatives" in printed
    cells = pd.read_csv(out / "cells_search_denoise.csv")
    assert len(cells) == 8 and {"effect", "estimate", "exact_effect", "verified", "verified_as", "bound"} <= set(cells.columns)
    assert 2 <= cells.verified.sum() <= 7
    summary = json.loads((out / "summary.json").read_text())
    assert summary["methods"] == ["search"] and summary["search"]["denoise"]["budget"] == 5
    assert summary["search"]["denoise"]["false_negatives"][0]["n_sampled"] == 2
    heads = pd.read_csv(out / "heads.csv")
    assert len(heads) == 8 and {"patch_effect", "attribution_effect"} <= set(heads.columns)
    assert heads.patch_effect.notna().sum() == cells.verified.sum()
