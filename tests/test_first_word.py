"""Kosinski's first-word scoring: the first word of a batched greedy completion equals the one a
prompt decoded alone gives, an answer is right only when that word is the keyed option's first word
(off-key answers wrong), and his strict rule is applied to it in the behaviour run and the CLI."""

from __future__ import annotations

from dataclasses import replace

import pandas as pd
import pytest

from tomlens.behaviour import first_word as fw
from tomlens.errors import TomlensError
from tomlens.stimuli import generate

pytestmark = pytest.mark.integration

PROMPTS = [
    "The cat jumps out of the",
    "Anna puts the ring in the drawer and leaves. She will look for the ring in the",
    "Tom puts his ball in the cupboard and goes out to play. Tom looks in the",
    "Hi",
]


@pytest.mark.parametrize("text,word,status", [
    (" box.", "box", fw.ENDED), (" box", "box", None), ("\n\n box and", "box", fw.ENDED),
    (" Sam's hat", "Sam's", fw.ENDED), (" Sam'", "Sam", None), (" jack-in-the-box,", "jack-in-the-box", fw.ENDED),
    (" ...", "", fw.NOT_A_WORD), ("   ", "", None), ("", "", None), (" _x", "", fw.NOT_A_WORD),
])
def test_first_word_and_when_it_has_ended(text, word, status):
    assert fw.first_word(text) == word and fw.word_status(text) == status


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2"])
def test_batched_first_words_equal_each_prompt_decoded_alone(load_tiny, name):
    """Left padding, rows leaving the batch as their word ends, and length sorting change nothing:
    each completion is the prefix of the prompt's own greedy continuation."""
    from tomlens.behaviour.generate import greedy_with_reason

    model = load_tiny(name)
    batched = fw.greedy_first_words(model, PROMPTS, batch_size=8, progress=False)
    assert [fw.greedy_first_words(model, [p], batch_size=1, progress=False)[0] for p in PROMPTS] == batched
    for prompt, c in zip(PROMPTS, batched, strict=True):
        text, toks, _ = greedy_with_reason(model, prompt, max_new_tokens=c.n_new_tokens, stop=None)
        assert c.text == text.strip() and c.first_word == fw.first_word(model.tokenizer.decode(toks.tolist()))
        assert c.stop in (fw.ENDED, fw.NOT_A_WORD, fw.EOS, fw.MAX_TOKENS)
    capped = fw.greedy_first_words(model, PROMPTS, max_new_tokens=1, progress=False)
    assert all(c.n_new_tokens <= 1 for c in capped)
    with pytest.raises(TomlensError, match="max_new_tokens"):
        fw.greedy_first_words(model, PROMPTS, max_new_tokens=0, progress=False)


def _transfer(n: int = 1) -> list:
    return generate("unexpected-transfer", n=n, seed=0)


def _said(words: dict[str, str]):
    """A stand-in for the decoder: each prompt's completion by its stimulus id (first word = the text's)."""
    def decode(model, prompts, **kwargs):
        return [fw.Completion(words[p].strip(), fw.first_word(words[p]), 2, fw.ENDED) for p in prompts]
    return decode


def test_right_only_when_the_first_word_is_the_keyed_options(monkeypatch):
    stimuli = _transfer()[:4]
    s0, s1, s2, s3 = stimuli
    other = lambda s: s.options[1 - s.answer_index]  # noqa: E731
    said = {s0.text: f" {s0.answer.upper()}.",  # the keyed word, any case: right
            s1.text: f" {other(s1)} and",  # the other option: wrong, on key
            s2.text: " store.",  # neither option: wrong and off-key
            s3.text: f" the {s3.answer}"}  # the keyed word, but not first: off-key
    monkeypatch.setattr(fw, "greedy_first_words", _said(said))
    table = pd.DataFrame({"id": [s.id for s in stimuli], "family": [s.family for s in stimuli]})
    got = fw.first_word_columns(None, stimuli, table)
    assert got["correct_first_word"].tolist() == [True, False, False, False]
    assert got["off_key"].tolist() == [False, False, True, True]
    assert [x if isinstance(x, str) else None for x in got["first_word_option"]] == [s0.answer, other(s1), None, None]
    assert got["first_word"].tolist() == [s0.answer.upper(), other(s1), "store", "the"]


def test_options_must_differ_in_their_first_word_and_the_set_needs_kosinskis_families():
    s = _transfer()[0]
    assert fw.option_first_words(replace(s, options=("jewelry box", "Cooler"), answer="Cooler")) == ("jewelry", "cooler")
    with pytest.raises(TomlensError, match="first word"):
        fw.check_set([replace(s, options=("red box", "red bag"), answer="red box")])
    with pytest.raises(TomlensError, match="Kosinski"):
        fw.check_set(generate("goal-encoding", n=1, seed=0, ks=(0,)))
    tracking = [x for x in generate("belief-tracking", n=1, seed=0) if x.meta.get("prefix_index") is not None]
    with pytest.raises(TomlensError, match="whole-story"):  # prefixes are curve points, not trials
        fw.check_set([replace(x, family="unexpected-transfer") for x in tracking])


def test_the_run_refuses_a_set_first_words_cannot_score_before_loading_the_model():
    from tomlens.runs.base import ModelSpec, StimuliSpec
    from tomlens.runs.behaviour import BehaviourConfig, run

    config = BehaviourConfig(model=ModelSpec(name="no-such-model"), scoring="first-word",
                             stimuli=(StimuliSpec(family="goal-encoding", n=1, options={"ks": (0,)}),))
    with pytest.raises(TomlensError, match="Kosinski"):
        run(config, progress=False)
    with pytest.raises(TomlensError, match="scoring"):
        BehaviourConfig(stimuli=config.stimuli, scoring="first-letter")


def test_the_strict_rule_is_applied_to_first_words(load_tiny, monkeypatch):
    """One task answered with every keyed word, one with a single off-key answer: the strict rule
    over first words solves exactly the first; the first-word table counts the off-key answer."""
    from tomlens.runs.behaviour import run_behaviour

    stimuli = _transfer(2)
    wrong = next(s for s in stimuli if s.task_id.endswith("1"))
    said = {s.text: f" {s.answer}." for s in stimuli} | {wrong.text: " nowhere."}
    monkeypatch.setattr(fw, "greedy_first_words", _said(said))
    others = generate("goal-encoding", n=1, seed=0, ks=(0,))  # not Kosinski's: no first word, never counted
    result = run_behaviour(load_tiny("tiny-gpt2"), stimuli + others, progress=False, n_boot=20, scoring="first-word")
    strict = result.strict.set_index("scoring")
    first = strict.loc["first word (greedy)"]
    assert first.solved == 1 and first.tasks == 2 and first.family == "unexpected-transfer"
    assert "two-way log-prob" in strict.index
    goal = result.table[result.table["family"] == "goal-encoding"]
    assert goal["correct_first_word"].isna().all() and goal["first_word"].isna().all()
    table = result.first_word
    assert set(table["family"]) == {"unexpected-transfer"} and (table["off_key"] * table["n"]).sum() == pytest.approx(1)
    assert {"mean_option_mass_first", "low_option_mass"} <= set(table.columns)
    assert "first word of a greedy completion" in result.describe()


def test_behave_cli_scores_first_words_and_saves_them(tmp_path, capsys):
    import json

    from tomlens.cli import main
    from tomlens.runs.behaviour import BehaviourResult
    from tomlens.stimuli.records import write_jsonl

    path = write_jsonl(_transfer(), tmp_path / "s.jsonl")
    out = tmp_path / "out"
    assert main(["behave", "--model", "tiny-gpt2", "--stimuli", str(path), "--out", str(out), "--no-progress",
                 "--n-boot", "20", "--scoring", "first-word"]) == 0
    printed = capsys.readouterr().out
    assert "first word of a greedy completion" in printed and "first word (greedy)" in printed
    assert json.loads((out / "config.json").read_text())["scoring"] == "first-word"
    back = BehaviourResult.load(out)
    assert len(back.first_word) and back.table["first_word"].notna().all()
    assert back.describe() == printed.split("\nwrote ")[0].rstrip("\n")
