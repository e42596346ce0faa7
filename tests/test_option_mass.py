"""Every prompt records how much of the model's probability its two options get, and every behaviour
table reports it per cell and flags cells where the options get little of it: a model that would say
neither option must not look like one that chose."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest
import torch

from tomlens.behaviour.scoring import score
from tomlens.stimuli.records import Stimulus

pytestmark = pytest.mark.integration

STORY = "Anna puts the ring in the drawer and leaves. She will look for the ring in the"


def _next_word_probs(model, text: str, options: tuple[str, str]) -> tuple[list[float], list[float]]:
    """Per option, straight from the model's logits: its first token's probability after the
    prompt and the probability of its whole continuation."""
    tok = model.tokenizer
    prompt_ids = tok(text)["input_ids"]
    firsts, wholes = [], []
    for opt in options:
        full = tok(f"{text} {opt}")["input_ids"]
        assert full[: len(prompt_ids)] == prompt_ids
        with torch.inference_mode():
            lp = torch.log_softmax(model(torch.tensor([full]))[0].float(), -1)
        cont = full[len(prompt_ids):]
        lps = [lp[len(prompt_ids) - 1 + j, t].item() for j, t in enumerate(cont)]
        firsts.append(math.exp(lps[0]))
        wholes.append(math.exp(sum(lps)))
    return firsts, wholes


@pytest.mark.parametrize("options", [("drawer", "box"), ("drawer", "jewelry box")])
def test_option_mass_equals_the_models_own_probabilities(load_tiny, options):
    """Single-token options (scored from the prompt's forward) and a multi-token one (scored joint)."""
    model = load_tiny("tiny-llama")
    row = score(model, [Stimulus(id="s", text=STORY, options=options, answer=options[0])], progress=False).iloc[0]
    firsts, wholes = _next_word_probs(model, STORY, options)
    assert row.option_mass_first == pytest.approx(sum(firsts), rel=1e-4)
    assert row.option_mass == pytest.approx(sum(wholes), rel=1e-4)
    assert 0 < row.option_mass <= row.option_mass_first <= 1


def test_a_first_token_two_options_share_is_counted_once(load_tiny):
    model = load_tiny("tiny-llama")
    options = ("jewelry box", "jewelry store")
    row = score(model, [Stimulus(id="s", text=STORY, options=options, answer=options[0])], progress=False).iloc[0]
    firsts, wholes = _next_word_probs(model, STORY, options)
    assert firsts[0] == pytest.approx(firsts[1], rel=1e-5)  # the same token after the same prompt
    assert row.option_mass_first == pytest.approx(firsts[0], rel=1e-4)
    assert row.option_mass == pytest.approx(sum(wholes), rel=1e-4)


def test_the_behaviour_run_reports_and_saves_mass_per_cell_and_flags_by_the_threshold(load_tiny, tmp_path):
    from tomlens.runs.behaviour import BehaviourResult, run_behaviour
    from tomlens.stimuli import generate

    stimuli = generate("unexpected-transfer", n=2, seed=0) + generate("goal-encoding", n=2, seed=0, ks=(0, 1))
    model = load_tiny("tiny-gpt2")
    result = run_behaviour(model, stimuli, progress=False, n_boot=20)
    t = result.table
    assert t[["option_mass_first", "option_mass"]].notna().all().all()
    acc = result.accuracy.set_index(["family", "condition", "prompt_type"])
    for key, g in t.groupby(["family", "condition", "prompt_type"]):
        assert acc.loc[key, "mean_option_mass_first"] == pytest.approx(g["option_mass_first"].mean())
        assert acc.loc[key, "mean_option_mass"] == pytest.approx(g["option_mass"].mean())
    # a random tiny model spreads its next word over the whole vocabulary: every cell is flagged
    assert acc["low_option_mass"].all()
    for table in (result.strict, result.reality_gated, result.knowledge_state, result.object_bias, result.selective):
        assert len(table) and "low_option_mass" in table and table["low_option_mass"].all()
    assert (result.object_bias["unclassified"] > 0.99).all()
    text = result.describe()
    assert "option mass" in text and "would more likely say neither" in text

    out = result.save(tmp_path / "b")
    saved = pd.read_csv(out / "accuracy.csv")
    assert {"mean_option_mass_first", "mean_option_mass", "low_option_mass"} <= set(saved.columns)
    assert "option_mass" in json.loads((out / "summary.json").read_text())["provenance"]
    assert BehaviourResult.load(out).describe() == text

    none = run_behaviour(model, stimuli[:16], progress=False, n_boot=20, min_option_mass=0.0)
    assert not none.accuracy["low_option_mass"].any() and "would more likely say neither" not in none.describe()


def test_behave_cli_takes_the_threshold_and_refuses_a_bad_one(tmp_path, capsys):
    from tomlens.cli import main
    from tomlens.stimuli import generate
    from tomlens.stimuli.records import write_jsonl

    path = write_jsonl(generate("unexpected-transfer", n=1, seed=0), tmp_path / "s.jsonl")
    base = ["behave", "--model", "tiny-gpt2", "--stimuli", str(path), "--no-progress", "--n-boot", "20"]
    assert main([*base, "--out", str(tmp_path / "out"), "--min-option-mass", "0.25"]) == 0
    printed = capsys.readouterr().out
    assert "option mass" in printed and "under 0.25 of the next word" in printed
    assert json.loads((tmp_path / "out" / "config.json").read_text())["min_option_mass"] == 0.25
    assert main([*base, "--out", str(tmp_path / "bad"), "--min-option-mass", "2"]) == 2
    assert "share of probability" in capsys.readouterr().err


def test_the_report_shows_option_mass_in_the_behaviour_tables(load_tiny):
    from tomlens.report.experiment import _behaviour_sections
    from tomlens.runs.behaviour import run_behaviour
    from tomlens.stimuli import generate

    result = run_behaviour(load_tiny("tiny-gpt2"), generate("goal-encoding", n=2, seed=0, ks=(0,)), progress=False,
                           n_boot=20)
    sections = _behaviour_sections(result)
    assert "option mass" in sections[0].text and "low_option_mass" in sections[0].text
    goal = next(s for s in sections if "object bias" in s.heading)

    def tables(section):  # shown, or folded under a one-line summary
        return [*section.tables, *(t for _, ts in section.collapsed for t in ts)]

    assert "unclassified" in goal.text and any("unclassified" in t.columns for t in tables(goal))
    assert any("near_half" in t.columns for t in tables(goal))  # the k = 0 check
    assert all("low_option_mass" in t.columns for s in sections for t in tables(s) if len(t))
