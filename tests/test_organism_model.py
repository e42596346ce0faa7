"""The shipped model organism: it loads offline by name, its model card's accuracies hold on fresh
held-out stories, and the methods find on it what its random twin does not have."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tomlens.behaviour import score
from tomlens.models import load_model, provenance
from tomlens.models.organism import ORGANISM_NAME, organism_dir
from tomlens.organism.card import RECORD
from tomlens.organism.data import held_out_stories
from tomlens.organism.train import ACCURACY_TARGET
from tomlens.runs.validate import CHECKS, ValidationResult, fast_config

def test_the_organism_loads_offline_and_its_twin_has_its_shape_but_not_its_weights() -> None:
    model = load_model(ORGANISM_NAME)
    prov = provenance(model)
    assert prov["source"] == "organism" and prov["revision"].startswith("sha256:")
    twin = load_model(f"random:{ORGANISM_NAME}")
    tprov = provenance(twin)
    assert tprov["base"] == ORGANISM_NAME and tprov["n_layers"] == prov["n_layers"]
    assert tprov["n_heads"] == prov["n_heads"] and tprov["d_vocab"] == prov["d_vocab"]
    w, tw = (next(m.parameters()) for m in (model, twin))
    assert w.shape == tw.shape and not torch.equal(w, tw)


def test_fresh_held_out_stories_confirm_the_model_card() -> None:
    """Held-out tasks drawn anew (other generator seeds than the card's test split, the same held-out
    keys, every word in the vocabulary): the cells the card says reach the target (order-only, every
    reality question) reach it here too, and those it says do not, do not."""
    record = json.loads((organism_dir() / RECORD).read_text())
    cfg = record["config"]
    model = load_model(ORGANISM_NAME)
    vocab = set(model.tokenizer.get_vocab())
    options = {"unexpected-contents": {"decoys": cfg["contents_decoys"]}}
    stories, _ = held_out_stories({"order-only": 500, "false-belief-factorial": 150, "unexpected-contents": 250}, vocab,
                              share=cfg["held_out_share"], seed=cfg["seed"], options=options, generator_seed=9000)
    scored = score(model, stories, batch_size=64, progress=False)
    scored["cell"] = [f"{s.family}/{s.condition}/{s.prompt_type}" for s in stories]
    accuracy = scored.groupby("cell")["correct"].mean()
    card = record["test_accuracy"]
    assert set(accuracy.index) == set(card)
    for cell, value in accuracy.items():  # the card's verdict per cell holds on fresh stories
        if card[cell] >= ACCURACY_TARGET:
            assert value >= ACCURACY_TARGET - 0.03, (cell, value)  # a smaller sample than the card's
        else:
            assert value < ACCURACY_TARGET, (cell, value)
    assert all(card[c] >= ACCURACY_TARGET for c in card if c.startswith("order-only/") or c.endswith("/reality"))


def _validate(name: str, tmp_path: Path) -> ValidationResult:
    from tomlens.runs.validate import run

    result = run(fast_config(name, n_tasks=48, store=str(tmp_path / "store")), progress=False)  # 48: a probe needs rows
    result.save(tmp_path / name.replace(":", "_"))
    return result


def test_the_methods_find_on_the_organism_what_its_random_twin_does_not_have(tmp_path: Path) -> None:
    """Every check runs on both; the twin passes none, and on the organism the probe and the head
    ranking find belief well above their nulls and above the twin (whether every threshold is met is
    the organism's model card and the README's table, not this test's)."""
    organism = _validate(ORGANISM_NAME, tmp_path).table.set_index("check")
    twin = _validate(f"random:{ORGANISM_NAME}", tmp_path).table.set_index("check")
    assert list(organism.index) == list(CHECKS) == list(twin.index)
    assert not twin["passed"].any()
    assert organism.loc["probe", "value"] >= 0.7 and organism.loc["probe", "value"] > twin.loc["probe", "value"] + 0.15
    assert organism.loc["topk_recovery", "value"] >= organism.loc["topk_recovery", "null"] + 0.3
    assert organism.loc["attribution", "value"] >= 0.8
