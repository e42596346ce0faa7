"""How the organism is given a known mechanism: the interchange of one head's final-token output
between stories."""

from __future__ import annotations

import pytest
import torch

from tomlens.errors import TomlensError
from tomlens.organism.interchange import head_outputs, patched_final_logits, usable
from tomlens.organism.train import OrganismConfig, encode, final_logits, llama_config, quick_config, swap_targets
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
    for bad in ({"interchange": -1.0}, {"interchange": float("nan")}, {"knockout_after": 1.5}):
        with pytest.raises(TomlensError, match="out of range"):
            OrganismConfig(**bad)
    assert OrganismConfig(interchange_families="order-only").interchange_families == ("order-only",)
