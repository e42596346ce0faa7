"""The organism's training script: a reduced run is deterministic, writes a folder that boots as a
model, and the CLI reports the accuracy target honestly."""

from __future__ import annotations

import json

import torch

from tomlens.cli import main
from tomlens.organism.card import CARD, RECORD, meets_target, untested_families
from tomlens.organism.train import quick_config, train


def test_a_reduced_training_run_is_deterministic() -> None:
    cfg = quick_config()
    a, _, rec_a = train(cfg, progress=False, log_every=0)
    b, _, rec_b = train(cfg, progress=False, log_every=0)
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(x, y), name
    assert rec_a["test_accuracy"] == rec_b["test_accuracy"]
    assert set(k.split("/")[0] for k in rec_a["test_accuracy"]) == {
        "order-only", "false-belief-factorial", "unexpected-contents"}


def test_train_organism_cli_writes_a_folder_that_loads(tmp_path, capsys) -> None:
    from tomlens.behaviour import score
    from tomlens.models import load_model, provenance
    from tomlens.stimuli import generate

    out = tmp_path / "organism"
    code = main(["train-organism", "--quick", "--set", "echo=0", "--set", 'family_mix={"order-only": 1}',
                 "--out", str(out)])
    text = capsys.readouterr().out
    record = json.loads((out / RECORD).read_text())
    assert record["config"]["echo"] == 0 and record["config"]["family_mix"] == {"order-only": 1}
    assert code == (0 if meets_target(record) else 1)  # a 20-step run does not reach 0.97
    assert "lowest held-out accuracy" in text and (out / CARD).is_file()
    assert "| order-only/false_belief/belief |" in (out / CARD).read_text()
    model = load_model(str(out))
    assert provenance(model)["n_layers"] == 2
    stimuli = generate("order-only", n=2, seed=0)
    scored = score(model, stimuli)  # the word-level tokenizer works through behaviour scoring
    assert len(scored) == len(stimuli)
    assert main(["train-organism", "--quick", "--steps", "0", "--out", str(tmp_path / "x")]) == 2
    for bad in ("bogus=1", "routes"):  # not a setting; no value
        assert main(["train-organism", "--quick", "--set", bad, "--out", str(tmp_path / "x")]) == 2
    assert not (tmp_path / "x").exists()


def test_the_schedule_options_do_what_the_card_says() -> None:
    """The curriculum that ends once the swap is learnt, the family shares after it, fewer
    interchange pairs later, and the route attentions on held-out prompts; with routes and echo
    off the card does not describe them."""
    from dataclasses import replace

    from tomlens.organism.card import model_card

    mix = {"order-only": 1.0, "false-belief-factorial": 2.0, "unexpected-contents": 1.0}
    cfg = replace(quick_config(), steps=6, knockout_after=0.0, curriculum_until_swap=True, first_share=0.9,
                  family_mix=mix, later_interchange_batch=4)
    _, _, record = train(cfg, progress=False, log_every=0)
    assert record["swap_learnt_step"] == record["knockout_from_step"] == 2 and record["mixed_from_step"] == 2
    looks = record["test_route_attention"]
    assert set(looks) == {"cue", "told", "seen", "label", "fill", "mover"} and all(0.0 <= v <= 1.0 for v in looks.values())
    card = model_card(record)
    assert "until the swap is learnt" in card and "here until step 2" in card
    assert "false-belief-factorial 50%" in card and "on 4 pairs a step" in card
    assert "trained to look up their cues" in card and "The echo." in card and "The belief readout." in card
    assert "every word after the protagonist's name" in card and "the label's word" in card
    leaving = model_card({**record, "config": {**record["config"], "cue_families": ["order-only"], "cue_sentence": False}})
    assert "the word after the protagonist's name in their cue sentence (in order-only, the sentence where they leave)" \
        in leaving and "absent or present" not in leaving
    _, _, plain = train(replace(quick_config(), steps=2, routes=0.0, echo=0.0), progress=False, log_every=0)
    card = model_card(plain)
    assert plain["test_route_attention"] == {} and "look up their cues" not in card and "The echo." not in card
    assert "The belief readout." in card  # still on in this run
    _, _, bare = train(replace(quick_config(), steps=2, routes=0.0, echo=0.0, belief_readout=0.0),
                       progress=False, log_every=0)
    card = model_card(bare)
    assert "The belief readout." not in card
    share = bare["test_upstream_accuracy"]["order-only"]  # on by default
    assert 0.0 <= share <= 1.0 and f"keep their answer under that swap: order-only {share:.3f}" in card
    _, _, free = train(replace(quick_config(), steps=2, upstream_invariance=0.0), progress=False, log_every=0)
    assert free["test_upstream_accuracy"] == {} and "upstream invariance" not in model_card(free)


def test_a_run_without_a_family_does_not_meet_the_target() -> None:
    """Trained on the factorial and contents alone, every cell can be right and the organism still has
    not shown order-only: the target needs every family."""
    cells = {"false-belief-factorial/false_belief/belief": 1.0, "unexpected-contents/informed/belief": 1.0}
    assert untested_families({"test_accuracy": cells}) == ["order-only"]
    assert not meets_target({"test_accuracy": cells})
    assert meets_target({"test_accuracy": {**cells, "order-only/false_belief/belief": 0.98}})
    assert not meets_target({"test_accuracy": {**cells, "order-only/false_belief/belief": 0.96}})
