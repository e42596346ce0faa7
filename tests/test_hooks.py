"""Sites, hook names and per-head outputs mean what they say, on every tiny architecture."""

from __future__ import annotations

import pytest
import torch

from tomlens.errors import TomlensError
from tomlens.hooks import Site, attn_out_bias, capture, check_sites, head_out, hook_name, parse_sites, w_o
from tomlens.models import encode, load_model

TEXTS = ["Anne put the ball in the basket and left.", "Max moved it.", "Where will Anne look?"]


def _all_positions(batch) -> torch.Tensor:
    b, p = batch.input_ids.shape
    return torch.arange(p).expand(b, p).contiguous()


def _grab(model, sites, texts=TEXTS):
    batch = encode(model, texts)
    with torch.inference_mode():
        return batch, capture(model, batch, sites, _all_positions(batch))


# --- parsing and names -------------------------------------------------------------------------


def test_parse_sites_specs():
    assert parse_sites("resid_post", 3) == [Site("resid_post", i) for i in range(3)]
    assert parse_sites("resid_pre:1-2 z:0", 4) == [Site("resid_pre", 1), Site("resid_pre", 2), Site("z", 0)]
    assert parse_sites(["head_out:0,2", Site("mlp_out", 1), "head_out:2"], 3) == [
        Site("head_out", 0), Site("head_out", 2), Site("mlp_out", 1)]


@pytest.mark.parametrize(
    "spec, words",
    [("resid_postt", "unknown site kind"), ("resid_post:5", "layer 5 does not exist"),
     ("resid_post:3-1", "backwards"), ("resid_post:a", "not a layer"), ([], "no sites")],
)
def test_parse_sites_errors_name_the_problem(spec, words):
    with pytest.raises(TomlensError, match=words):
        parse_sites(spec, 4)


def test_site_validation_and_labels():
    assert Site.from_label("z:3.h2") == Site("z", 3, 2)
    assert Site.from_label(Site("resid_mid", 7).label()) == Site("resid_mid", 7)
    with pytest.raises(TomlensError, match="not per head"):
        Site("resid_post", 1, head=0)
    with pytest.raises(TomlensError, match="unknown site kind"):
        Site("resid", 0)


def test_hook_names_are_the_transformer_lens_aliases():
    assert hook_name(Site("resid_pre", 0)) == "blocks.0.hook_resid_pre"
    assert hook_name(Site("resid_mid", 2)) == "blocks.2.hook_resid_mid"
    assert hook_name(Site("resid_post", 1)) == "blocks.1.hook_resid_post"
    assert hook_name(Site("attn_out", 1)) == "blocks.1.hook_attn_out"
    assert hook_name(Site("mlp_out", 1)) == "blocks.1.hook_mlp_out"
    assert hook_name(Site("z", 3, 1)) == "blocks.3.attn.hook_z"
    assert hook_name(Site("head_out", 3)) == "blocks.3.attn.hook_z"


def test_every_site_has_a_hook_in_every_tiny_model(tiny_model):
    kinds = ["resid_pre", "resid_post", "attn_out", "mlp_out", "z", "head_out"]
    sites = parse_sites(kinds, tiny_model.cfg.n_layers)
    check_sites(tiny_model, sites)
    for s in sites:
        assert hook_name(s) in tiny_model.hook_dict


def test_resid_mid_in_a_parallel_block_is_an_error_naming_the_site(load_tiny):
    with pytest.raises(TomlensError, match=r"resid_mid:1.*parallel"):
        check_sites(load_tiny("tiny-neox"), [Site("resid_mid", 1)])
    check_sites(load_tiny("tiny-gpt2"), [Site("resid_mid", 1)])


# --- what the sites hold -----------------------------------------------------------------------


def test_head_contributions_plus_bias_sum_to_attn_out(tiny_model):
    n = tiny_model.cfg.n_layers
    sites = [Site(k, L) for L in range(n) for k in ("head_out", "attn_out", "z")]
    batch, out = _grab(tiny_model, sites)
    for L in range(n):
        heads = out[Site("head_out", L)]
        assert heads.shape[-2:] == (tiny_model.cfg.n_heads, tiny_model.cfg.d_model)
        total = heads.sum(-2) + attn_out_bias(tiny_model, L)
        # a sum of per-head projections vs the model's one projection: another reduction order
        torch.testing.assert_close(total, out[Site("attn_out", L)], atol=1e-5, rtol=1e-4)
        # head_out is z_h @ W_O[h], head by head, not a slice of the projected output
        h = 1
        manual = out[Site("z", L)][..., h, :] @ w_o(tiny_model, L)[h]
        # tomlens's projection vs a plain matmul (values ~0.05): fp32 rounding of two kernels
        torch.testing.assert_close(heads[..., h, :], manual, atol=1e-6, rtol=1e-5)


def test_output_bias_is_added_once_not_per_head():
    """GPT-2 initialises b_O to zero, so give a private copy a real bias and check the sum again."""
    model = load_model("tiny-gpt2", dtype="float32")
    with torch.no_grad():
        for block in model.blocks:
            block.attn.o.bias.copy_(torch.randn_like(block.attn.o.bias))
    assert attn_out_bias(model, 0).abs().sum() > 0
    _, out = _grab(model, [Site("head_out", 0), Site("attn_out", 0)])
    total = out[Site("head_out", 0)].sum(-2) + attn_out_bias(model, 0)
    torch.testing.assert_close(total, out[Site("attn_out", 0)], atol=1e-5, rtol=1e-4)  # reduction order


def test_bias_free_models_get_a_zero_bias(load_tiny):
    llama = load_tiny("tiny-llama")
    assert torch.equal(attn_out_bias(llama, 0), torch.zeros(llama.cfg.d_model))  # built as zeros, not computed


def test_residual_stream_sites_chain(tiny_model):
    n = tiny_model.cfg.n_layers
    kinds = ["resid_pre", "resid_post", "attn_out", "mlp_out"]
    sequential = "blocks.0.hook_resid_mid" in tiny_model.hook_dict
    if sequential:
        kinds.append("resid_mid")
    _, out = _grab(tiny_model, parse_sites(kinds, n))
    for L in range(n - 1):
        # exact: one forward, and block L's output is block L + 1's input with no arithmetic between
        torch.testing.assert_close(out[Site("resid_post", L)], out[Site("resid_pre", L + 1)], atol=0, rtol=0)
    for L in range(n):
        pre, post = out[Site("resid_pre", L)], out[Site("resid_post", L)]
        attn, mlp = out[Site("attn_out", L)], out[Site("mlp_out", L)]
        # the test's own additions in another order than the block's: fp32 rounding (values ~0.1)
        torch.testing.assert_close(pre + attn + mlp, post, atol=1e-5, rtol=1e-5)
        if sequential:
            torch.testing.assert_close(pre + attn, out[Site("resid_mid", L)], atol=1e-5, rtol=1e-5)


def test_gqa_shapes_follow_query_heads(load_tiny):
    model = load_tiny("tiny-llama")
    assert (model.cfg.n_heads, model.cfg.n_key_value_heads) == (4, 2)
    batch, out = _grab(model, [Site("z", 0), Site("head_out", 1), Site("z", 1, head=3)])
    b, p = batch.input_ids.shape
    assert out[Site("z", 0)].shape == (b, p, 4, model.cfg.d_head)
    assert out[Site("head_out", 1)].shape == (b, p, 4, model.cfg.d_model)
    assert out[Site("z", 1, 3)].shape == (b, p, model.cfg.d_head)
    assert w_o(model, 0).shape == (4, model.cfg.d_head, model.cfg.d_model)


def test_capture_matches_run_with_cache_at_the_chosen_positions(tiny_model):
    batch = encode(tiny_model, TEXTS)
    pos = torch.tensor([[batch.pad[r], batch.input_ids.shape[1] - 1] for r in range(len(TEXTS))])
    sites = [Site("resid_post", 1), Site("z", 0), Site("mlp_out", 0)]
    with torch.inference_mode():
        out = capture(tiny_model, batch, sites, pos)
        _, cache = tiny_model.run_with_cache(batch.input_ids, names_filter=[hook_name(s) for s in sites],
                                             **batch.forward_kwargs())
    for s in sites:
        full = cache[hook_name(s)]
        for r in range(len(TEXTS)):
            # two forwards (capture stops early and passes use_cache=False): BLAS kernels may round
            # differently (1.5e-8 on values ~0.4 with MKL on AMD EPYC), so fp32 tolerance, not equality
            torch.testing.assert_close(out[s][r], full[r, pos[r]], atol=1e-6, rtol=1e-5)


def test_capture_keeps_copies_and_stops_after_the_last_site(load_tiny):
    model = load_tiny("tiny-gpt2")
    batch = encode(model, TEXTS)
    later: list[str] = []
    with model.hooks(fwd_hooks=[("blocks.1.hook_resid_pre", lambda t, hook: later.append(hook.name)),
                                ("ln_final.hook_normalized", lambda t, hook: later.append(hook.name))]):
        with torch.inference_mode():
            out = capture(model, batch, [Site("resid_mid", 0)], torch.zeros(3, 1, dtype=torch.long))
    assert later == []  # block 1 and the final norm never ran
    kept = out[Site("resid_mid", 0)]
    assert kept.shape == (3, 1, model.cfg.d_model)
    # a fresh tensor of its own size, not a view holding the whole [batch, pos, d] activation
    assert kept.untyped_storage().nbytes() == kept.numel() * kept.element_size()


def test_head_out_passes_gradients_to_z_not_to_weights(load_tiny):
    model = load_tiny("tiny-llama")
    z = torch.randn(2, 3, 4, model.cfg.d_head, requires_grad=True)
    head_out(model, 0, z).pow(2).sum().backward()
    assert z.grad is not None and z.grad.abs().sum() > 0
    assert model.blocks[0].attn.o.weight.grad is None


@pytest.mark.parametrize("tiny_model", ["tiny-gpt2", "tiny-llama"], indirect=True)
def test_a_kept_prefix_cache_reproduces_the_plain_run(tiny_model):
    """The shared-prefix shortcut (patching, attribution, steering) needs the bridge to fill Hugging
    Face's KV cache. Where it does not (TransformerLens 4.3 with transformers 5.24, which renamed the
    attention's cache argument), every shortcut silently falls back to full forwards: same numbers,
    several times slower. pyproject pins transformers below that; this catches the next such stack."""
    from tomlens.hooks.patch import forward_last

    batch = encode(tiny_model, ["the cat sat on the mat and then", "a dog ran to the park and then"])
    kwargs = batch.forward_kwargs()
    with torch.inference_mode():
        plain, cache = forward_last(tiny_model, batch.input_ids, kwargs, keep_cache=True)
        assert cache is not None, "the bridge filled no KV cache: shared-prefix shortcuts are off on this stack"
        start = batch.input_ids.shape[1] - 1
        last, _ = forward_last(tiny_model, batch.input_ids, kwargs, prefix=cache, start=start)
    torch.testing.assert_close(last, plain, rtol=1e-4, atol=1e-4)
