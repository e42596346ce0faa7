"""The organism's training script: a reduced run is deterministic, writes a folder that boots as a
model, and the CLI reports the accuracy target honestly."""

from __future__ import annotations

import json

import torch

from tomlens.cli import main
from tomlens.organism.card import CARD, RECORD, meets_target
from tomlens.organism.train import quick_config, train


def test_a_reduced_training_run_is_deterministic() -> None:
    cfg = quick_config()
    a, _, rec_a = train(cfg, progress=False, log_every=0)
    b, _, rec_b = train(cfg, progress=False, log_every=0)
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), name
    assert rec_a["test_accuracy"] == rec_b["test_accuracy"]
    assert set(k.split("/")[0] for k in rec_a["test_accuracy"]) == {
        "order-only", "false-belief-factorial", "unexpected-contents"}


def test_train_organism_cli_writes_a_folder_that_loads(tmp_path, capsys) -> None:
    from tomlens.behaviour import score
    from tomlens.models import load_model, provenance
    from tomlens.stimuli import generate

    out = tmp_path / "organism"
    code = main(["train-organism", "--quick", "--out", str(out)])
    text = capsys.readouterr().out
    record = json.loads((out / RECORD).read_text())
    assert code == (0 if meets_target(record) else 1)  # a 20-step run does not reach 0.97
    assert "lowest held-out accuracy" in text and (out / CARD).is_file()
    assert "| order-only/false_belief/belief |" in (out / CARD).read_text()
    model = load_model(str(out))
    assert provenance(model)["n_layers"] == 2
    stimuli = generate("order-only", n=2, seed=0)
    scored = score(model, stimuli)  # the word-level tokenizer works through behaviour scoring
    assert len(scored) == len(stimuli)
    assert main(["train-organism", "--quick", "--steps", "0", "--out", str(tmp_path / "x")]) == 2
