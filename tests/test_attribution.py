"""Attribution patching: the batched gradient-times-difference equals a one-pair-at-a-time gradient
reference and a finite difference, and is reported in the same shape as exact patching."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import short_pairs, tl_metric

from tomlens.models import encode
from tomlens.patching.attribution import attribution_patching, compare
from tomlens.patching.cells import hook_for
from tomlens.patching.exact import exact_patching


def _reference_scores(model, pair, hook: str) -> torch.Tensor:
    """(clean - corrupted) * d metric / d activation on the corrupted run, one pair, no padding,
    the gradient taken through a zero perturbation added at the hook (summed over the last axis)."""
    b = encode(model, [pair.clean.text, pair.corrupted.text])
    metric = tl_metric(model, pair)
    with torch.inference_mode():
        _, cache = model.run_with_cache(b.input_ids[:1], names_filter=[hook])
    clean_act = cache[hook].clone()
    delta = torch.zeros_like(clean_act, requires_grad=True)
    kept = {}

    def add(act, hook=None):
        kept["corrupted"] = act.detach().clone()
        return act + delta

    logits = model.run_with_hooks(b.input_ids[1:], fwd_hooks=[(hook, add)])
    (grad,) = torch.autograd.grad(metric(logits), delta)  # no .backward(): the shared model keeps no weight grads
    return ((clean_act - kept["corrupted"]) * grad).sum(-1)[0]  # [pos(, head)]


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2"])
def test_attribution_equals_per_pair_gradient_reference(load_tiny, name):
    model = load_tiny(name)
    pairs = short_pairs(model.tokenizer, 2)
    res = attribution_patching(
        model, pairs, sites={"heads": ["all", "each"], "resid": ["each"], "attn": ["all"], "mlp": ["each"]},
        batch_pairs=2, progress=False,
    )
    df = res.cell_frame()
    L, H = model.cfg.n_layers, model.cfg.n_heads
    n_al = int(df.pos.max()) + 1
    est = res.values - res.corrupted[None, :]  # the attribution score itself
    checked = []
    for j, pair in enumerate(pairs):
        n = encode(model, [pair.clean.text]).lengths[0]
        for layer in range(L):
            z = _reference_scores(model, pair, hook_for("head", layer))  # [pos, head]
            for position, want in (("all", z.sum(0)),):
                sel = ((df.kind == "head") & (df.layer == layer) & (df.position == position)).to_numpy()
                # batched, padded gradients vs a one-pair reference: fp32 rounding in both
                torch.testing.assert_close(est[torch.tensor(sel), j], want.double(), atol=1e-5, rtol=1e-4)
            sel = ((df.kind == "head") & (df.layer == layer) & (df.position == "each")).to_numpy()
            got = est[torch.tensor(sel), j].view(n_al, H)[n_al - n:]
            torch.testing.assert_close(got, z.double(), atol=1e-5, rtol=1e-4)
            for kind, position in (("resid_pre", "each"), ("attn_out", "all"), ("mlp_out", "each")):
                ref = _reference_scores(model, pair, hook_for(kind, layer))  # [pos]
                sel = ((df.kind == kind) & (df.layer == layer) & (df.position == position)).to_numpy()
                got = est[torch.tensor(sel), j]
                want = ref.sum(0, keepdim=True) if position == "all" else ref
                if position == "each":
                    got = got[n_al - n:]
                torch.testing.assert_close(got, want.double(), atol=1e-5, rtol=1e-4)
            checked.append(float(z.abs().max()))
    assert max(checked) > 1e-4  # gradients and differences are not all zero


def _reference_ig_scores(model, pair, hook: str, steps: int, path: str = "embeddings") -> torch.Tensor:
    """Integrated gradients by hand, one pair, no padding: the gradient at the hook averaged over
    corrupted runs moved 0, 1/steps, .. of the way to the clean story (its token embeddings, or
    with `path="sites"` the hook's own activation), times (clean - corrupted) activation."""
    b = encode(model, [pair.clean.text, pair.corrupted.text])
    metric = tl_metric(model, pair)
    with torch.inference_mode():
        _, cache = model.run_with_cache(b.input_ids[:1], names_filter=[hook, "hook_embed"])
    clean_act, clean_embed = cache[hook].clone(), cache["hook_embed"].clone()
    total, kept = None, {}
    for i in range(steps):
        delta = torch.zeros_like(clean_act, requires_grad=True)

        def add(act, hook=None, a=i / steps):
            kept.setdefault("corrupted", act.detach().clone())
            moved = act + a * (clean_act - act) if path == "sites" else act
            return moved + delta

        def mix(act, hook=None, a=i / steps):
            return act + a * (clean_embed - act) if path == "embeddings" else act

        logits = model.run_with_hooks(b.input_ids[1:], fwd_hooks=[("hook_embed", mix), (hook, add)])
        (grad,) = torch.autograd.grad(metric(logits), delta)
        total = grad if total is None else total + grad
    return ((clean_act - kept["corrupted"]) * total / steps).sum(-1)[0]  # [pos(, head)]


@pytest.mark.parametrize("name,path", [("tiny-llama", "embeddings"), ("tiny-gpt2", "embeddings"),
                                       ("tiny-llama", "sites"), ("tiny-gpt2", "sites")])
def test_integrated_gradient_attribution_equals_a_one_pair_reference(load_tiny, name, path):
    """steps > 1, batched and on the shared-prefix and skipped-block shortcuts, equals the
    hand-written path average along either path; steps = 1 is plain attribution; fewer than 1
    step, or an unknown path, is refused."""
    from jaxtyping import TypeCheckError

    from tomlens.errors import TomlensError

    model = load_tiny(name)
    pairs = short_pairs(model.tokenizer, 2)
    res = attribution_patching(model, pairs, sites={"heads": ["each"]}, batch_pairs=2, steps=4, path=path,
                               progress=False)
    plain = attribution_patching(model, pairs, sites={"heads": ["each"]}, batch_pairs=2, progress=False)
    df = res.cell_frame()
    H, n_al = model.cfg.n_heads, int(df.pos.max()) + 1
    est = res.values - res.corrupted[None, :]
    assert torch.equal(res.corrupted, plain.corrupted) and torch.equal(res.clean, plain.clean)
    assert not torch.allclose(est, plain.values - plain.corrupted[None, :], atol=1e-6)  # not the plain scores
    for j, pair in enumerate(pairs):
        n = encode(model, [pair.clean.text]).lengths[0]
        for layer in range(model.cfg.n_layers):
            want = _reference_ig_scores(model, pair, hook_for("head", layer), 4, path)  # [pos, head]
            sel = ((df.kind == "head") & (df.layer == layer)).to_numpy()
            got = est[torch.tensor(sel), j].view(n_al, H)[n_al - n:]
            torch.testing.assert_close(got, want.double(), atol=1e-5, rtol=1e-4)
    with pytest.raises(TomlensError, match="steps"):
        attribution_patching(model, pairs, sites={"heads": ["each"]}, steps=0, progress=False)
    with pytest.raises((TomlensError, TypeCheckError), match="path"):
        attribution_patching(model, pairs, sites={"heads": ["each"]}, steps=2, path="heads", progress=False)


def _site_path_errors(load_tiny, sites) -> dict[int, float]:
    """The largest gap between attribution along the sites and exact patching of `sites`, on two
    tiny-llama pairs, at 1 (plain), 8 and 64 steps."""
    model = load_tiny("tiny-llama")
    pairs = short_pairs(model.tokenizer, 2)
    exact = exact_patching(model, pairs, sites=sites, progress=False).values
    return {steps: (attribution_patching(model, pairs, sites=sites, steps=steps, path="sites", progress=False).values
                    - exact).abs().max().item() for steps in (1, 8, 64)}


def test_integrated_gradients_along_a_site_converge_to_patching_it(load_tiny):
    """Along the sites, a hook whose one cell is the whole moved activation (the residual stream at
    every differing token) is integrated from the corrupted run to the clean one: with many steps the
    estimate is exact patching's value (the left sum's error shrinks as 1/steps), which plain
    attribution, a tangent at the corrupted run, is not held to."""
    errors = _site_path_errors(load_tiny, {"resid_pre": ["all"]})
    assert errors[1] > 1e-3  # the tangent is off: there is something to converge
    assert errors[64] < 0.2 * errors[8] < 0.2 * errors[1]  # the left Riemann sum closing in, not a fixed offset


def test_integrated_gradients_at_a_position_converge_to_patching_that_position_alone(load_tiny):
    """A cell at one position (the residual stream at the final token) is integrated along a path
    that moves its hook at that position alone, as patching it does: with many steps the estimate
    is exact patching's value. A path that moved every differing token converged to what they do
    together instead (the previous organism's layer-0 heads at the final token: 0.15 and 0.24 of the gap,
    0.01 each patched alone)."""
    errors = _site_path_errors(load_tiny, {"resid_pre": ["final"]})
    assert errors[1] > 1e-4  # the tangent is off (2.2e-4 here)
    assert errors[64] < 0.2 * errors[8] < 0.2 * errors[1]  # moving every token: 9e-5 at 64 steps, 5e-5 at 8


def test_a_head_path_at_a_token_before_the_stories_differ_scores_zero(load_tiny):
    """A selector that every pair has before its first differing token (the protagonist's first
    mention, in the first sentence) makes no path runs, and each of its head cells scores 0, with
    the head axis kept (a skipped path once gave a one-head score table, which a head past the
    first indexed out of)."""
    from tomlens.stimuli.pairs import make_pairs

    model = load_tiny("tiny-llama")
    pairs, _ = make_pairs("unexpected-transfer", n=2, seed=3, tokenizer=model.tokenizer)
    got = attribution_patching(model, pairs, sites={"heads": ["protagonist"]}, steps=2, path="sites", progress=False)
    assert got.values.shape[0] == model.cfg.n_layers * model.cfg.n_heads
    torch.testing.assert_close(got.values, got.corrupted[None, :].expand_as(got.values))


def test_attribution_matches_a_finite_difference(load_tiny):
    """The score is the derivative of the metric along (clean - corrupted) at the corrupted run."""
    model = load_tiny("tiny-llama")
    pair = short_pairs(model.tokenizer, 1)[0]
    res = attribution_patching(model, [pair], sites=["heads"], positions=("all",), progress=False)
    b = encode(model, [pair.clean.text, pair.corrupted.text])
    metric = tl_metric(model, pair)
    layer, head = 0, 1
    hook = hook_for("head", layer)
    with torch.inference_mode():
        _, clean = model.run_with_cache(b.input_ids[:1], names_filter=[hook])
        _, corr = model.run_with_cache(b.input_ids[1:], names_filter=[hook])
        delta = (clean[hook] - corr[hook])[:, :, head]
        eps = 1e-2

        def at(sign):
            def shift(act, hook=None):
                act = act.clone()
                act[:, :, head] += sign * eps * delta
                return act

            return float(metric(model.run_with_hooks(b.input_ids[1:], fwd_hooks=[(hook, shift)])))

        slope = (at(1) - at(-1)) / (2 * eps)
    df = res.cell_frame()
    i = int(np.flatnonzero(((df.layer == layer) & (df["head"] == head)).to_numpy())[0])
    score = float(res.values[i, 0] - res.corrupted[0])
    assert abs(score) > 1e-4
    assert score == pytest.approx(slope, rel=2e-2, abs=2e-5)


def test_attribution_beside_exact(load_tiny):
    """Same cells, same scale as exact patching; the comparison reports rank agreement."""
    model = load_tiny("tiny-gpt2")
    pairs = short_pairs(model.tokenizer, 3)
    sites = {"heads": ["all", "final"], "resid": ["each"]}
    ex = exact_patching(model, pairs, sites=sites, progress=False)
    at = attribution_patching(model, pairs, sites=sites, direction="denoise", progress=False)
    assert ex.cells == at.cells and ex.pair_ids == at.pair_ids
    # baselines from two engines' own forwards (logit differences ~0.05): fp32 tolerance
    torch.testing.assert_close(ex.clean, at.clean, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ex.corrupted, at.corrupted, atol=1e-5, rtol=1e-5)
    # NaN (no token at that position) in the same places
    assert torch.equal(torch.isnan(ex.values), torch.isnan(at.values))
    # starting the grad-enabled run at the first differing token loses nothing (to fp32 rounding:
    # a shorter forward)
    full = attribution_patching(model, pairs, sites=sites, reuse_prefix=False, progress=False)
    torch.testing.assert_close(at.values, full.values, atol=1e-5, rtol=1e-5, equal_nan=True)
    c = compare(ex, at, kind="head", position="all", k=3)
    assert c["n_cells"] == model.cfg.n_layers * model.cfg.n_heads and c["k"] == 3
    assert -1 <= c["spearman"] <= 1 and 0 <= c["topk_overlap"] <= 1
    # on a two-layer model the linear estimate ranks single heads well
    assert c["spearman"] > 0.5
    # noising attribution: estimates of the clean run with corrupted activations
    noise = attribution_patching(model, pairs, sites=["heads"], positions=("all",), direction="noise", progress=False)
    exact_noise = exact_patching(model, pairs, sites=["heads"], positions=("all",), direction="noise", progress=False)
    torch.testing.assert_close(noise.clean, ex.clean, atol=1e-5, rtol=1e-5)  # two engines' forwards, as above
    assert compare(exact_noise, noise, k=3)["spearman"] > 0.5


def _synthetic(method: str, direction: str, effects: list[float], n_pairs: int = 4):
    from tomlens.patching.cells import Cell
    from tomlens.patching.result import PatchingResult

    cells = [Cell("head", 0, h, "all", -1) for h in range(len(effects))]
    values = torch.tensor(effects, dtype=torch.float32)[:, None].repeat(1, n_pairs)
    values += 0.01 * torch.arange(n_pairs)[None, :]  # pairs differ a little
    return PatchingResult(method, direction, cells, values, torch.ones(n_pairs), torch.zeros(n_pairs),
                          [f"p{i}" for i in range(n_pairs)], ["tok"])


def test_compare_takes_a_spearman_over_the_cells_that_matter():
    """Many cells that do nothing in both methods carry a Spearman over all cells: here attribution
    ranks the three that matter backwards, yet agrees on the 20 near-zero ones."""
    quiet = [-0.015 + 0.0002 * i for i in range(20)]  # effects under 0.004 once the pairs' 0.015 is added
    exact = _synthetic("exact", "denoise", [0.9, 0.5, 0.2, *quiet])
    attr = _synthetic("attribution", "denoise", [0.2, 0.5, 0.9, *quiet])
    c = compare(exact, attr, kind="head", position="all", k=3)
    assert c["spearman"] > 0.9 and c["n_active"] == 3 and c["spearman_active"] == pytest.approx(-1.0)
    head = exact.select("head", "all").iloc[0]  # the cell exact patching ranks first, third in attribution
    assert c["exact_top"] == f"L{head.layer}H{head['head']}" and c["exact_top_rank"] == 3
    assert compare(exact, attr, kind="head", position="all", active=0.3)["n_active"] == 3  # either method counts
    assert np.isnan(compare(exact, attr, kind="head", position="all", active=0.6)["spearman_active"])  # 2 cells


def test_compare_ranks_noising_by_what_the_patch_destroys():
    """Noising: the unpatched value is 1 and an important head pulls the effect towards 0."""
    exact = _synthetic("exact", "noise", [0.98, 0.97, 0.99, 0.10, 0.95])
    attribution = _synthetic("attribution", "noise", [1.0, 0.96, 0.98, 0.20, 0.99])
    assert compare(exact, attribution, k=1)["topk_overlap"] == 1.0
    assert compare(exact, attribution, k=1)["exact_top_rank"] == 1
    tied = _synthetic("attribution", "noise", [0.2, 0.96, 0.98, 0.20, 0.99])  # ties exact's top head
    assert compare(exact, tied, k=1)["exact_top_rank"] == 1  # a tie counts in its favour
    flat = _synthetic("attribution", "noise", [1.0] * 5)
    flat.values[:] = 1.0
    assert np.isnan(compare(exact, flat, k=1)["topk_overlap"])  # nothing to rank is not agreement
    assert compare(exact, flat, k=1)["exact_top_rank"] is None
    with pytest.raises(Exception, match="same direction"):
        compare(exact, _synthetic("attribution", "denoise", [0.0] * 5), k=1)
