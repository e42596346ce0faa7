"""The bridge-free forward that caching uses for the residual stream (`tomlens.models.plain`).

It must compute what the bridge computes, stand aside whenever the bridge has to run (a hook
attached, an architecture whose wrappers own weights of their own), share the bridge's weights
rather than copy them, and leave the bridge as it was. And it must be what makes a cache cheap on
a GPU: no more ops than transformers' own forward, plus one gather per site (counted on the CPU)."""

from __future__ import annotations

import gc
import importlib
import weakref
from typing import Any

import pytest
import torch
from syncs import OpCounter, tiny_with_layers

from tomlens.hooks import capture
from tomlens.hooks.capture import _capture_bridge
from tomlens.hooks.sites import Site
from tomlens.models import encode, load_model
from tomlens.models.plain import forward_logits, plain_forward
from tomlens.models.positions import resolve_positions
from tomlens.stimuli import generate

pytestmark = pytest.mark.integration

POSITIONS = ["final", "protagonist", "object:first"]


def _batch(model: Any, n: int = 8) -> tuple[Any, torch.Tensor]:
    stimuli = generate("order-only", n=4, seed=3)[:n]
    batch = encode(model, [s.text for s in stimuli])
    return batch, resolve_positions(stimuli, batch, POSITIONS)


def _residual_sites(model: Any) -> list[Site]:
    return [Site(k, layer) for layer in range(model.cfg.n_layers) for k in ("resid_pre", "resid_post")]


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma3", "tom-organism"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_plain_forward_reads_the_residual_stream_the_bridge_does(name: str, dtype: str) -> None:
    model = load_model(name, dtype=dtype, device="cpu")
    batch, pos = _batch(model)
    sites = _residual_sites(model)
    assert plain_forward(model) is not None
    with torch.inference_mode():
        got = capture(model, batch, sites, pos)
        want = _capture_bridge(model, batch, sites, pos, None)
    for site in sites:
        assert got[site].dtype == want[site].dtype and got[site].shape == want[site].shape
        torch.testing.assert_close(got[site], want[site], msg=lambda m, s=site: f"{s}: {m}")


def test_capture_keeps_the_requested_dtype_and_stops_after_the_last_site(load_tiny: Any) -> None:
    model = load_tiny("tiny-llama")
    batch, pos = _batch(model)
    plain = plain_forward(model)
    assert plain is not None
    ran: list[int] = []
    handles = [layer.register_forward_pre_hook(lambda m, a, i=i: ran.append(i)) for i, layer in enumerate(plain.layers)]
    try:
        with torch.inference_mode():
            got = capture(model, batch, [Site("resid_pre", 0)], pos, dtype=torch.float16)
    finally:
        for h in handles:
            h.remove()
    assert ran == [0]  # the pre-hook of layer 0 raised before layer 0 or 1 ran any further
    assert got[Site("resid_pre", 0)].dtype == torch.float16


def test_an_architecture_whose_wrappers_own_weights_stays_on_the_bridge(load_tiny: Any) -> None:
    """The GPT-2 bridge splits the fused query-key-value weight into weights of its own and computes
    attention with those: a rebuilt transformers GPT-2 would not be what the bridge runs."""
    model = load_tiny("tiny-gpt2")
    assert plain_forward(model) is None
    batch, pos = _batch(model)
    sites = _residual_sites(model)
    with torch.inference_mode():
        got = capture(model, batch, sites, pos)
        want = _capture_bridge(model, batch, sites, pos, None)
    for site in sites:
        torch.testing.assert_close(got[site], want[site])


def test_a_hook_on_the_bridge_keeps_capture_on_the_bridge(load_tiny: Any) -> None:
    model = load_tiny("tiny-llama")
    batch, pos = _batch(model)
    site = Site("resid_post", 1)
    with torch.inference_mode():
        plain = capture(model, batch, [site], pos)[site]
        with model.hooks(fwd_hooks=[("blocks.0.hook_resid_pre", lambda t, hook: t + 1.0)]):
            assert plain_forward(model) is None
            hooked = capture(model, batch, [site], pos)[site]
        assert plain_forward(model) is not None
        again = capture(model, batch, [site], pos)[site]
    assert (hooked - plain).abs().max() > 0.1  # the steering-like hook ran
    torch.testing.assert_close(again, plain, rtol=0, atol=0)


def test_the_plain_forward_shares_the_bridges_weights_and_leaves_it_as_it_was() -> None:
    model = load_model("tiny-llama", device="cpu")
    batch, pos = _batch(model)
    with torch.inference_mode():
        before = model(batch.input_ids, **batch.forward_kwargs())
    hooks_before = _hooks_of(model)
    plain = plain_forward(model)
    assert plain is not None and plain_forward(model) is plain  # built once per bridge
    assert {p.data_ptr() for p in plain.model.parameters()} == {p.data_ptr() for p in model.parameters()}
    assert _hooks_of(model) == hooks_before  # the twin got hook dictionaries of its own
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in plain.model.modules())
    site = Site("resid_post", 1)
    with torch.no_grad():
        next(iter(plain.layers[0].parameters())).mul_(3.0)  # a weight changed in place: both see it
    with torch.inference_mode():
        got = capture(model, batch, [site], pos)[site]
        want = _capture_bridge(model, batch, [site], pos, None)[site]
        after = model(batch.input_ids, **batch.forward_kwargs())
    torch.testing.assert_close(got, want)
    assert (after - before).abs().max() > 0  # the bridge ran the changed weight too
    assert len(model.hook_dict) > 0 and plain_forward(model) is plain


def _hooks_of(model: Any) -> list[tuple[int, int]]:
    return [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in model.modules()]


def _plain_transformers_ops(model: Any, batch: Any) -> int:
    """Ops of transformers' own forward (same config, no bridge) up to the last decoder layer's
    output, where a capture of every layer stops too: the baseline."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_config(model.original_model.config).eval()
    last = hf.get_decoder().layers[-1]

    class Stop(Exception):
        pass

    def stop(*_: Any) -> None:
        raise Stop

    handle = last.register_forward_hook(stop)
    with OpCounter() as c, torch.inference_mode():
        try:
            hf(batch.input_ids, use_cache=False, **batch.forward_kwargs())
        except Stop:
            pass
    handle.remove()
    return c.total


def test_caching_the_residual_stream_costs_a_plain_forward_plus_one_op_per_site(load_tiny: Any, tmp_path: Any) -> None:
    """Through the bridge, every layer of tiny Llama dispatched about 16 ops more than transformers'
    own (its norms' scale computed again for a hook, casts and copies around each wrapper): on a
    GPU, where a small model's forward is bound by launches, that made caching 2.4x a plain forward."""
    for model in (load_tiny("tiny-llama"), tiny_with_layers("tiny-llama", 6, tmp_path), load_tiny("tiny-gemma3")):
        batch, pos = _batch(model)
        sites = [Site("resid_post", layer) for layer in range(model.cfg.n_layers)]
        with OpCounter() as c, torch.inference_mode():
            capture(model, batch, sites, pos)
        baseline = _plain_transformers_ops(model, batch)
        # one gather per site, and the row index all gathers share (an arange and its view)
        assert c.total <= baseline + len(sites) + 2, (model.cfg.n_layers, c.total, baseline, c.counts.most_common(8))


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma3"])
def test_option_scores_through_the_plain_forward_are_the_bridges(name: str, load_tiny: Any) -> None:
    """Scoring reads logits only, so it runs the plain forward (the shared-prefix batches too, whose
    key/value cache is then transformers' own); a hook attached puts it back on the bridge."""
    from tomlens.behaviour.scoring import score_options

    model = load_tiny(name)
    stimuli = generate("unexpected-transfer", n=2, seed=1)[:12]
    with OpCounter() as plain_ops:
        plain = score_options(model, stimuli, batch_size=4, progress=False)
    with model.hooks(fwd_hooks=[("blocks.0.hook_resid_pre", lambda t, hook: t)]), OpCounter() as bridge_ops:
        bridge = score_options(model, stimuli, batch_size=4, progress=False)
    for got, want in zip(plain, bridge, strict=True):
        for a, b in zip(got, want, strict=True):
            assert a.logp_first == pytest.approx(b.logp_first, abs=1e-5) and a.n_tokens == b.n_tokens
            assert a.logp_sum == pytest.approx(b.logp_sum, abs=1e-5) and a.first_token == b.first_token
    assert plain_ops.total < bridge_ops.total, (plain_ops.total, bridge_ops.total)


def _changes_resid(model: Any, batch: Any, pos: torch.Tensor) -> None:
    """`plain_forward` stands aside and capture sees what the bridge computes under the change."""
    site = Site("resid_post", model.cfg.n_layers - 1)
    assert plain_forward(model) is None
    with torch.inference_mode():
        got = capture(model, batch, [site], pos)[site]
        want = _capture_bridge(model, batch, [site], pos, None)[site]
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def _add_one(module: Any, args: Any, output: Any) -> Any:
    return output + 1.0 if isinstance(output, torch.Tensor) else (output[0] + 1.0, *output[1:])


def test_a_hook_anywhere_in_the_bridge_puts_the_bridge_back() -> None:
    """On a wrapper, on the module it wraps, or on every module at once: the twin would skip each."""
    model = load_model("tiny-llama", device="cpu")
    batch, pos = _batch(model)
    with torch.inference_mode():
        clean = capture(model, batch, [Site("resid_post", 1)], pos)[Site("resid_post", 1)]
    for target in (model.blocks[0].mlp, model.blocks[0].mlp.original_component, model.original_model.model.norm):
        handle = target.register_forward_hook(_add_one)
        try:
            _changes_resid(model, batch, pos)
        finally:
            handle.remove()
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, a, o: None)
    try:
        assert plain_forward(model) is None
    finally:
        handle.remove()
    handle = model.blocks[0].register_full_backward_hook(lambda m, gi, go: None)
    try:
        assert plain_forward(model) is None
    finally:
        handle.remove()
    assert plain_forward(model) is not None
    with torch.inference_mode():
        again = capture(model, batch, [Site("resid_post", 1)], pos)[Site("resid_post", 1)]
    torch.testing.assert_close(again, clean, rtol=0, atol=0)


def test_train_mode_a_replaced_forward_or_the_bridges_own_attention_put_the_bridge_back() -> None:
    model = load_model("tiny-llama", device="cpu")
    batch, pos = _batch(model)
    assert plain_forward(model) is not None
    model.blocks[1].mlp.original_component.train()
    assert plain_forward(model) is None
    model.eval()
    lm = model.original_model.lm_head.original_component
    object.__setattr__(lm, "forward", lambda hidden: torch.zeros(()))  # as `logits_of` narrows it
    assert plain_forward(model) is None
    object.__delattr__(lm, "forward")
    assert plain_forward(model) is not None  # a passing override does not turn the twin off for good
    model.set_use_attn_result(True)
    try:
        _changes_resid(model, batch, pos)
    finally:
        model.set_use_attn_result(False)
    assert plain_forward(model) is not None


def test_a_module_swapped_in_the_bridge_is_run_by_the_rebuilt_twin() -> None:
    model = load_model("tiny-llama", device="cpu")
    batch, pos = _batch(model)
    first = plain_forward(model)
    assert first is not None
    down = model.blocks[0].mlp.original_component.down_proj
    old = down.original_component
    new = torch.nn.Linear(old.in_features, old.out_features, bias=False).eval()
    with torch.no_grad():
        new.weight.copy_(old.weight * 2.0)
    down.set_original_component(new)
    second = plain_forward(model)
    assert second is not None and second is not first
    site = Site("resid_post", 1)
    with torch.inference_mode():
        got = capture(model, batch, [site], pos)[site]
        want = _capture_bridge(model, batch, [site], pos, None)[site]
    torch.testing.assert_close(got, want)


def test_capturing_no_site_runs_nothing(load_tiny: Any) -> None:
    model = load_tiny("tiny-llama")
    batch, pos = _batch(model)
    with OpCounter() as c:
        assert capture(model, batch, [], pos) == {}
    assert c.total == 0


def test_a_hook_or_a_swap_on_the_wrapped_models_containers_puts_the_bridge_back() -> None:
    """The causal LM and its decoder model are no modules of the bridge, but the bridge's forward runs
    through them: a hook there, or a module swapped into them, must reach the twin's decision too."""
    model = load_model("tiny-llama", device="cpu")
    batch, pos = _batch(model)
    hf = model.original_model
    for target in (hf, hf.model):
        handle = target.register_forward_pre_hook(lambda m, a: None)
        try:
            assert plain_forward(model) is None
        finally:
            handle.remove()
    first = plain_forward(model)
    assert first is not None
    final_norm = hf.model.norm
    hf.model.norm = torch.nn.Identity().eval()
    try:
        second = plain_forward(model)
        assert second is not None and second is not first
        with torch.inference_mode():
            got = forward_logits(model, second, batch.input_ids, **batch.forward_kwargs())
            want = model(batch.input_ids, **batch.forward_kwargs())
        real = batch.attention_mask.bool()
        torch.testing.assert_close(got[real], want[real])
    finally:
        hf.model.norm = final_norm


def _reaches(start: Any, target: Any, limit: int = 500_000) -> bool:
    """Whether `target` can be reached from `start` by references, tensors, classes and modules left
    out; a function is followed through its closure and defaults only (its globals reach everything)."""
    import types

    seen, todo = {id(start)}, [start]
    while todo:
        obj = todo.pop()
        if isinstance(obj, types.FunctionType):
            refs: list[Any] = [*(c.cell_contents for c in obj.__closure__ or () if c.cell_contents is not None),
                               obj.__defaults__, obj.__kwdefaults__]
        else:
            refs = gc.get_referents(obj)
        for ref in refs:
            if ref is target:
                return True
            if ref is None or id(ref) in seen or isinstance(ref, torch.Tensor | type | types.ModuleType):
                continue
            seen.add(id(ref))
            todo.append(ref)
        assert len(seen) < limit, "the walk grew past its limit"
    return False


def test_the_twin_does_not_keep_its_bridge_alive() -> None:
    """Nothing the twin's record refers to leads back to the bridge, so the record adds no cycle, and
    the bridge goes with its last reference once collected (a freshly loaded TransformerBridge
    already sits in cycles of its own closures), also when a permanent hook's closure holds it."""
    from tomlens.models.plain import _KEPT_ON_THE_BRIDGE

    model = load_model("tiny-llama", device="cpu")
    assert plain_forward(model) is not None
    record = model.__dict__[_KEPT_ON_THE_BRIDGE]
    assert not _reaches(record, model)
    assert _reaches(model.blocks[0], model.blocks[0].attn)  # the walk does follow references
    del record
    gone = weakref.ref(model)
    del model
    gc.collect()
    assert gone() is None
    model = load_model("tiny-llama", device="cpu")
    assert plain_forward(model) is not None
    model.add_perma_hook("blocks.0.hook_resid_pre", lambda t, hook, m=model: t)
    gone = weakref.ref(model)
    del model
    gc.collect()
    assert gone() is None


def test_an_attribute_reassigned_after_the_build_needs_forget() -> None:
    """The twin's modules copy the originals' attributes: `forget` rebuilds it from the model as it is;
    the wrapped model replaced as a whole is seen without it."""
    from tomlens.models.plain import forget

    model = load_model("tiny-llama", device="cpu")
    batch, pos = _batch(model)
    site = Site("resid_post", 1)
    first = plain_forward(model)
    attention = model.blocks[0].attn.original_component
    attention.scaling = attention.scaling * 4.0
    assert plain_forward(model) is first  # not seen: the documented limit
    forget(model)
    second = plain_forward(model)
    assert second is not None and second is not first
    with torch.inference_mode():
        got = capture(model, batch, [site], pos)[site]
        want = _capture_bridge(model, batch, [site], pos, None)[site]
    torch.testing.assert_close(got, want)


def test_stateful_rotary_scaling_stays_on_the_bridge() -> None:
    """Dynamic rotary scaling keeps the length it last saw in plain attributes, which a copy does not share."""
    model = load_model("tiny-llama", device="cpu")
    config = model.original_model.config
    config.rope_parameters = {**(config.rope_parameters or {}), "rope_type": "dynamic", "factor": 2.0}
    assert plain_forward(model) is None
    gemma = load_model("tiny-gemma3", device="cpu")
    per_type = gemma.original_model.config.rope_parameters  # Gemma 3: one set per attention type
    assert set(per_type) >= {"sliding_attention", "full_attention"}
    per_type["full_attention"] = {**per_type["full_attention"], "rope_type": "dynamic", "factor": 2.0}
    assert plain_forward(gemma) is None


def test_a_cache_call_and_a_scoring_call_each_decide_once(load_tiny: Any, tmp_path: Any, monkeypatch: Any) -> None:
    """The decision walks every module, so a batch loop makes it once, not per batch."""
    from tomlens.activations import cache
    from tomlens.behaviour import scoring

    capture_module = importlib.import_module("tomlens.hooks.capture")  # the package's `capture` is the function
    model = load_tiny("tiny-llama")
    stimuli = generate("order-only", n=4, seed=3)
    asked: list[str] = []
    decide = plain_forward
    monkeypatch.setattr(capture_module, "plain_forward", lambda m: asked.append("cache") or decide(m))
    monkeypatch.setattr(scoring, "plain_forward", lambda m: asked.append("scoring") or decide(m))
    acts = cache.cache_activations(model, stimuli, "resid_post", ["final"], store=tmp_path, batch_size=2,
                                   progress=False)
    scoring.score_options(model, stimuli, batch_size=2, progress=False)
    assert not acts.reused and len(stimuli) >= 8
    assert asked == ["cache", "scoring"]


def test_a_forward_that_asked_for_attentions_leaves_the_twin_in_use() -> None:
    """transformers 5 leaves a recording hook on every layer once a forward asks for attentions or
    hidden states (search and the attention views do); it records nothing otherwise, so the twin
    stays in use. Found in the full suite, where a shared model had run such a forward first."""
    model = load_model("tiny-llama", device="cpu")
    batch, pos = _batch(model)
    with torch.inference_mode():
        model(batch.input_ids, output_attentions=True, **batch.forward_kwargs())
    assert any(m._forward_hooks for m in model.original_model.modules())
    assert plain_forward(model) is not None
    site = Site("resid_post", 1)
    with torch.inference_mode():
        got = capture(model, batch, [site], pos)[site]
        want = _capture_bridge(model, batch, [site], pos, None)[site]
    torch.testing.assert_close(got, want)
