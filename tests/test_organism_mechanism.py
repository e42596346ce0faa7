"""How the organism is given a known mechanism: the interchange of one head's final-token output
between stories."""

from __future__ import annotations

import pytest
import torch

from tomlens.errors import TomlensError
from tomlens.organism.interchange import (
    head_outputs,
    layer_outputs,
    layers_patched_final_logits,
    patched_final_logits,
    usable,
)
from tomlens.organism.train import (
    OrganismConfig,
    encode,
    final_logits,
    llama_config,
    partners,
    quick_config,
    swap_targets,
    upstream_loss_and_right,
)
from tomlens.organism.vocab import build_tokenizer, words
from tomlens.stimuli import generate

pytestmark = pytest.mark.unit


def _model_and_prompts():
    from transformers import LlamaForCausalLM

    stimuli = [s for s in generate("order-only", n=4, seed=0) if s.prompt_type == "belief"]
    tok = build_tokenizer(sorted({w for s in stimuli for w in words(s.text + " " + " ".join(s.options))}))
    cfg = quick_config()
    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config(cfg, len(tok))).eval()
    return model, encode(tok, stimuli), stimuli, cfg


def test_patching_a_head_with_its_own_output_changes_nothing_and_with_another_story_it_does() -> None:
    model, enc, _, cfg = _model_and_prompts()
    d_head = cfg.d_model // cfg.n_heads
    own = head_outputs(model, enc.ids, enc.lengths, 1, 2, d_head)
    assert own.shape == (len(enc.ids), d_head)
    with torch.no_grad():
        plain = final_logits(model, enc.ids, enc.lengths)
        same = patched_final_logits(model, enc.ids, enc.lengths, 1, 2, d_head, own)
        other = patched_final_logits(model, enc.ids, enc.lengths, 1, 2, d_head, own.roll(1, dims=0))
    assert torch.allclose(plain, same, atol=1e-5)
    assert not torch.allclose(plain, other, atol=1e-3)


def test_patching_whole_layers_with_their_own_outputs_changes_nothing_and_matches_patching_each_head() -> None:
    """The upstream-invariance loss sets every head of the layers before the interchange head from
    another story: with the story's own outputs nothing changes, and setting one layer's heads is
    setting each of them."""
    model, enc, _, cfg = _model_and_prompts()
    d_head = cfg.d_model // cfg.n_heads
    own = layer_outputs(model, enc.ids, enc.lengths, range(1))
    assert set(own) == {0} and own[0].shape == (len(enc.ids), cfg.n_heads * d_head)
    assert torch.allclose(own[0][:, 2 * d_head:3 * d_head], head_outputs(model, enc.ids, enc.lengths, 0, 2, d_head))
    other = {0: own[0].roll(1, dims=0)}
    with torch.no_grad():
        plain = final_logits(model, enc.ids, enc.lengths)
        same = layers_patched_final_logits(model, enc.ids, enc.lengths, own)
        moved = layers_patched_final_logits(model, enc.ids, enc.lengths, other)
        one_head = patched_final_logits(model, enc.ids, enc.lengths, 0, 2, d_head, other[0][:, 2 * d_head:3 * d_head])
        only_head_2 = own[0].clone()
        only_head_2[:, 2 * d_head:3 * d_head] = other[0][:, 2 * d_head:3 * d_head]
        same_as_one = layers_patched_final_logits(model, enc.ids, enc.lengths, {0: only_head_2})
    assert torch.allclose(plain, same, atol=1e-5)
    assert not torch.allclose(plain, moved, atol=1e-3)
    assert torch.allclose(one_head, same_as_one, atol=1e-5)


def test_each_belief_prompt_is_paired_with_its_task_s_story_of_the_other_belief_asked_the_same_way() -> None:
    model, enc, stimuli, cfg = _model_and_prompts()
    for i, j in enumerate(enc.partner.tolist()):
        assert j >= 0, stimuli[i].id  # order-only: every belief prompt has its other-condition story
        assert stimuli[j].task_id == stimuli[i].task_id
        assert stimuli[j].belief_is_reference != stimuli[i].belief_is_reference
        assert len(enc.ids[j].nonzero()) == len(enc.ids[i].nonzero())  # the same sentences, reordered
    for family in ("false-belief-factorial", "unexpected-contents"):  # the same factor levels, version, question
        prompts = [s for s in generate(family, n=2, seed=0) if s.prompt_type == "belief"]
        got = partners(prompts)
        assert (got >= 0).any()
        for i, j in enumerate(got.tolist()):
            if j < 0:
                continue
            a, b = prompts[i], prompts[j]
            assert a.task_id == b.task_id and a.belief_is_reference != b.belief_is_reference
            assert a.id.split("-", 4)[4] == b.id.split("-", 4)[4], (a.id, b.id)  # "fs-rs-imp-belief", "rev-belief"
            assert a.text.rsplit(".", 1)[-1] == b.text.rsplit(".", 1)[-1] and a.options == b.options
    base = torch.arange(len(stimuli))
    loss, right = upstream_loss_and_right(model, enc, base, cfg)
    assert loss.requires_grad and right.shape == (len(stimuli),)
    from dataclasses import replace
    with pytest.raises(TomlensError, match="does not begin with its task id"):
        partners([replace(stimuli[0], id="renamed-by-hand")])
    reality = [s for s in generate("order-only", n=2, seed=0) if s.prompt_type == "reality"]
    tok = build_tokenizer(sorted({w for s in reality for w in words(s.text + " " + " ".join(s.options))}))
    assert (encode(tok, reality).partner == -1).all()  # no belief to swap


def test_the_swap_target_is_the_base_place_the_source_belief_picks() -> None:
    stimuli = generate("order-only", n=4, seed=0)
    tok = build_tokenizer(sorted({w for s in stimuli for w in words(s.text + " " + " ".join(s.options))}))
    enc = encode(tok, stimuli)
    assert not any(usable(s) for s in stimuli if s.prompt_type == "reality")
    fb = next(i for i, s in enumerate(stimuli) if usable(s) and s.condition == "false_belief")
    tb = next(i for i, s in enumerate(stimuli) if usable(s) and s.condition == "true_belief"
              and s.task_id != stimuli[fb].task_id)
    target, wrong = swap_targets(enc, torch.tensor([tb, fb]), torch.tensor([fb, tb]))

    def token(word: str) -> int:
        return tok(word, add_special_tokens=False)["input_ids"][0]

    # a false-belief source makes the base answer its start, a true-belief one its current place
    assert target.tolist() == [token(stimuli[tb].reference_state), token(stimuli[fb].world_state)]
    assert wrong.tolist() == [token(stimuli[tb].world_state), token(stimuli[fb].reference_state)]
    assert stimuli[fb].reference_state != stimuli[fb].world_state


def test_the_upstream_invariance_loss_takes_part_in_training_and_adds_no_random_draw(monkeypatch) -> None:
    """Reduced runs: with the loss the weights end elsewhere than without it (it reaches the
    optimiser); with the loss switched on but made zero they end exactly where a run without it
    does (it draws nothing from the batch generator, so every other draw is unchanged)."""
    from dataclasses import replace

    import tomlens.organism.train as training

    def o_proj(model) -> torch.Tensor:
        return model.model.layers[0].self_attn.o_proj.weight

    off = training.train(replace(quick_config(), steps=3, upstream_invariance=0.0), progress=False, log_every=0)[0]
    on = training.train(replace(quick_config(), steps=3), progress=False, log_every=0)[0]
    assert not torch.allclose(o_proj(on), o_proj(off))
    monkeypatch.setattr(training, "upstream_loss_and_right",
                        lambda *a, **k: (torch.zeros(()), torch.zeros(0, dtype=torch.bool)))
    zero = training.train(replace(quick_config(), steps=3), progress=False, log_every=0)[0]
    assert torch.equal(o_proj(zero), o_proj(off))


def test_the_knockout_runs_once_the_swap_is_learnt() -> None:
    from dataclasses import replace

    from tomlens.organism.train import train

    _, _, record = train(replace(quick_config(), knockout_after=0.0, steps=6), progress=False, log_every=0)
    assert record["knockout_from_step"] == 2  # reached at once: from the second step on
    _, _, never = train(replace(quick_config(), knockout_after=1.0, steps=6), progress=False, log_every=0)
    assert never["knockout_from_step"] is None


def test_an_interchange_head_the_model_lacks_is_refused() -> None:
    with pytest.raises(TomlensError, match="not in a model"):
        OrganismConfig(interchange=1.0, interchange_head=(5, 0))
    with pytest.raises(TomlensError, match="not the organism's"):
        OrganismConfig(interchange=1.0, interchange_families=("bigtom",))
    with pytest.raises(TomlensError, match="not a \\(layer, head\\) pair"):
        OrganismConfig(interchange_head=(2,))
    with pytest.raises(TomlensError, match="in the first layer"):
        OrganismConfig(interchange_head=(0, 1), upstream_invariance=1.0)
    assert OrganismConfig(interchange=0.0, interchange_head=(0, 1)).upstream_invariance == 1.0  # idle without it
    with pytest.raises(TomlensError, match="not true or false"):
        OrganismConfig(echo_containers="False")  # type: ignore[arg-type]
    for bad in ({"interchange": -1.0}, {"interchange": float("nan")}, {"knockout_after": 1.5},
                {"upstream_invariance": -0.5}, {"upstream_invariance": float("inf")}, {"upstream_invariance": "abc"},
                {"routes": "1"}, {"echo": float("inf")}, {"belief_readout": True}, {"routes": 10 ** 400}):
        with pytest.raises(TomlensError, match="out of range"):
            OrganismConfig(**bad)
    with pytest.raises(TomlensError, match="not a set of shares"):
        OrganismConfig(family_mix={"order-only": "1"})  # type: ignore[dict-item]
    assert OrganismConfig(interchange=0.0).keeps_upstream is False and OrganismConfig().keeps_upstream
    assert OrganismConfig(interchange_families="order-only").interchange_families == ("order-only",)
