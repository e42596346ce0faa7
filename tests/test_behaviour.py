"""Behavioural scoring: batched and left-padded scoring equals one prompt at a time, and equals a
direct computation from the model's logits."""

import math

import pytest
import torch

from tomlens.behaviour.scoring import score, score_options
from tomlens.models import load_model
from tomlens.stimuli.records import Stimulus


def _stimuli() -> list[Stimulus]:
    texts = [
        ("Anna puts the ring in the drawer and leaves. She will look for the ring in the", ("drawer", "jewelry box")),
        ("The cat jumps out of the", ("basket", "box")),
        ("A long story about a boy called Tom, who puts his ball in a cupboard, goes out to play in the garden, and then comes back home wanting his ball. Tom looks in the", ("cupboard", "garden shed")),
    ]
    return [Stimulus(id=f"s{i}", text=t, options=o, answer=o[i % 2]) for i, (t, o) in enumerate(texts)]


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama", "tiny-neox"])
def test_batched_scoring_equals_one_at_a_time(name):
    model = load_model(name)
    stimuli = _stimuli()
    batched = score_options(model, stimuli, batch_size=8, progress=False)
    single = [score_options(model, [s], batch_size=1, progress=False)[0] for s in stimuli]
    for (ba, bb), (sa, sb) in zip(batched, single, strict=True):
        for b, s in ((ba, sa), (bb, sb)):
            assert b.n_tokens == s.n_tokens
            # padded batch vs one prompt, log-probs ~ -10 to -22 in fp32 (ulp 1e-6 to 2e-6): tolerance
            assert b.logp_sum == pytest.approx(s.logp_sum, rel=1e-5, abs=1e-4)
            assert b.logp_first == pytest.approx(s.logp_first, rel=1e-5, abs=1e-4)


def test_scores_equal_direct_logit_computation():
    model = load_model("tiny-llama")
    s = _stimuli()[0]
    (a, b), = score_options(model, [s], batch_size=1, progress=False)
    tok = model.tokenizer
    for opt, got in zip(s.options, (a, b), strict=True):
        prompt_ids = tok(s.text)["input_ids"]
        full_ids = tok(f"{s.text} {opt}")["input_ids"]
        assert full_ids[: len(prompt_ids)] == prompt_ids
        cont = full_ids[len(prompt_ids):]
        with torch.inference_mode():
            logits = model(torch.tensor([full_ids]))
        lp = torch.log_softmax(logits[0].float(), -1)
        want = [lp[len(prompt_ids) - 1 + j, t].item() for j, t in enumerate(cont)]
        assert got.n_tokens == len(cont)
        # another forward (the prompt alone vs prompt + option): fp32 tolerance, as above
        assert got.logp_sum == pytest.approx(sum(want), rel=1e-5, abs=1e-4)
        assert got.logp_first == pytest.approx(want[0], rel=1e-5, abs=1e-4)


def test_score_table_normalises_two_options():
    model = load_model("tiny-gpt2")
    df = score(model, _stimuli(), progress=False)
    assert len(df) == 3 and df["id"].tolist() == ["s0", "s1", "s2"]
    for r in df.itertuples():
        assert 0 < r.p_a < 1
        assert r.p_a == pytest.approx(1 / (1 + math.exp(r.logp_b - r.logp_a)))
        assert r.correct == (r.p_answer > 0.5)
        assert (r.p_answer == r.p_a) == (r.answer == r.option_a)  # exact: p_answer is p_a itself or 1 - p_a


def test_belief_tracking_prompts_give_one_curve_point_per_prefix(load_tiny):
    from tomlens.runs.behaviour import run_behaviour
    from tomlens.stimuli import generate
    from tomlens.stimuli.tracking import belief_tracking

    stimuli = generate("belief-tracking", n=1, seed=0)
    contents = belief_tracking(1, seed=0, family="unexpected-contents", include_reversed=False)
    result = run_behaviour(load_tiny("tiny-gpt2"), stimuli + contents, progress=False)
    n_prefixes = len({s.meta["prefix_index"] for s in stimuli})
    curves = result.prefix_curves
    assert n_prefixes > 3
    # transfer and contents stories have their own curves, never averaged together
    assert set(curves["story_family"]) == {"unexpected-transfer", "unexpected-contents"}
    transfer = curves[curves.story_family == "unexpected-transfer"]
    for _, g in transfer.groupby(["family", "condition", "prompt_type"]):
        assert sorted(g["prefix_index"]) == list(range(n_prefixes))
    assert (curves[curves.story_family == "unexpected-contents"]["n"] == 1).all()
    assert curves["p_answer"].between(0, 1).all()
    # tracking prompts are left out of the strict whole-task rule
    assert result.strict.empty or "belief-tracking" not in set(result.strict["family"])


def test_prompt_ending_in_whitespace_is_refused(load_tiny):
    from dataclasses import replace

    from tomlens.behaviour.scoring import score
    from tomlens.errors import TomlensError
    from tomlens.stimuli import generate

    good = generate("unexpected-transfer", n=1, seed=0)[0]
    bad = replace(good, text=good.text + " ")
    with pytest.raises(TomlensError, match="ends in whitespace"):
        score(load_tiny("tiny-gpt2"), [bad], progress=False)


def test_behave_cli_names_an_empty_stimulus_file(tmp_path, capsys):
    from tomlens.cli import main

    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    rc = main(["behave", "--model", "tiny-gpt2", "--stimuli", str(empty), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2 and "empty.jsonl" in err and "fix:" in err
    assert not (tmp_path / "out").exists()


def test_reality_gating_and_knowledge_state_effect_on_scored_stories(load_tiny, tmp_path):
    """On real scored tables: reality and belief prompts of a story share a story id, the gated
    counts agree with the per-prompt table, the paired effect equals its recomputation from the
    options' log-probabilities, and the new tables save and load as their own files."""
    import numpy as np
    import pandas as pd

    from tomlens.runs.behaviour import BehaviourResult, run_behaviour
    from tomlens.stimuli import generate

    stimuli = generate("order-only", n=4, seed=0) + generate("false-belief-factorial", n=1, seed=0)
    result = run_behaviour(load_tiny("tiny-gpt2"), stimuli, progress=False, n_boot=100)
    t = result.table
    per_story = t.groupby("story_id")["prompt_type"].agg(lambda x: sorted(set(x)))
    assert (per_story.map(tuple) == ("belief", "reality")).all()

    oo = t[t.family == "order-only"]
    reality = oo[oo.prompt_type == "reality"].set_index("story_id")["correct"]
    belief = oo[oo.prompt_type == "belief"]
    kept = belief[belief.story_id.map(reality)]
    gated = result.reality_gated.set_index(["family", "condition"])
    for cond in ("false_belief", "true_belief"):
        row = gated.loc[("order-only", cond)]
        want = kept[kept.condition == cond]
        assert row.n_kept == len(want) and row.n_kept + row.n_dropped == 4 and row.n_unmatched == 0
        if len(want):
            assert row.accuracy == want.correct.mean()

    def log_odds(rows: pd.DataFrame) -> pd.Series:  # log p(location 1) - log p(location 2)
        start = rows.reference_state
        return pd.Series(np.where(rows.option_a == start, rows.logp_a - rows.logp_b, rows.logp_b - rows.logp_a),
                         index=rows.task_id)
    fb, tb = (log_odds(belief[belief.condition == c]) for c in ("false_belief", "true_belief"))
    effect = result.knowledge_state.set_index("family").loc["order-only"]
    assert effect.n_pairs == 4 and effect.effect == pytest.approx(float((fb - tb.loc[fb.index]).mean()))
    fac = result.knowledge_state.set_index("family").loc["false-belief-factorial"]
    assert fac.contrast == "true_belief" and fac.n_pairs == 8 and fac.n_tasks == 1

    out = result.save(tmp_path / "b")
    assert (out / "reality_gated.csv").is_file() and (out / "knowledge_state_effect.csv").is_file()
    back = BehaviourResult.load(out)
    pd.testing.assert_frame_equal(back.knowledge_state, result.knowledge_state, check_dtype=False)
    pd.testing.assert_frame_equal(back.reality_gated, result.reality_gated, check_dtype=False)
    text = back.describe()
    assert text == result.describe() and "gated on the reality prompt" in text and "knowledge-state effect" in text


def test_behave_cli_passes_n_boot_and_rejects_a_bad_one(tmp_path, capsys):
    import json

    from tomlens.cli import main
    from tomlens.stimuli import generate
    from tomlens.stimuli.records import write_jsonl

    path = write_jsonl(generate("order-only", n=2, seed=0), tmp_path / "s.jsonl")
    base = ["behave", "--model", "tiny-gpt2", "--stimuli", str(path), "--no-progress"]
    assert main([*base, "--out", str(tmp_path / "out"), "--n-boot", "50"]) == 0
    assert json.loads((tmp_path / "out" / "config.json").read_text())["n_boot"] == 50
    capsys.readouterr()
    assert main([*base, "--out", str(tmp_path / "bad"), "--n-boot", "0"]) == 2
    assert "n_boot = 0" in capsys.readouterr().err


@pytest.mark.slow
def test_first_word_scoring_runs_on_the_embedded_model(smollm2):
    """Kosinski's first-word mode end to end on SmolLM2-135M, one task of each of his families
    (16 prompts each): every prompt gets a greedy first word, right exactly when it is the keyed
    option's, off-key answers wrong, and his strict rule is applied to the first words. The model
    answers some reality prompts with a word that is neither option (the two-way choice still
    calls them right): what the first-word scoring is for."""
    from tomlens.behaviour.first_word import first_word
    from tomlens.runs.behaviour import run_behaviour
    from tomlens.stimuli import generate

    stimuli = generate("unexpected-transfer", n=1, seed=0) + generate("unexpected-contents", n=1, seed=0)
    result = run_behaviour(smollm2, stimuli, progress=False, n_boot=50, scoring="first-word")
    t = result.table
    assert t["first_word"].notna().all() and len(t) == 32
    keyed = t["answer"].map(lambda a: first_word(a).casefold())
    said = t["first_word"].str.casefold()
    assert (t["correct_first_word"].astype(bool) == (said == keyed)).all()
    on_key = said.isin(t["option_a"].str.casefold()) | said.isin(t["option_b"].str.casefold())
    assert (t["off_key"].astype(bool) == ~on_key).all()
    assert on_key.any() and (t["off_key"].astype(bool) & t["correct"].astype(bool)).any()
    strict = result.strict
    assert set(strict["scoring"]) == {"two-way log-prob", "first word (greedy)"}
    assert set(strict["family"]) == {"unexpected-transfer", "unexpected-contents"}
    assert len(result.first_word) == 16 and result.first_word["off_key"].between(0, 1).all()


def _assert_same_scores(got: list, want: list) -> None:
    for pair, ref in zip(got, want, strict=True):
        for g, w in zip(pair, ref, strict=True):
            assert (g.n_tokens, g.first_token) == (w.n_tokens, w.first_token)
            assert g.logp_sum == pytest.approx(w.logp_sum, abs=1e-4)
            assert g.logp_first == pytest.approx(w.logp_first, abs=1e-4)


def test_rows_without_a_shared_prefix_run_plainly(monkeypatch):
    """Prompts of different stories share no prefix worth a second forward: every batch is one
    plain forward, and `_forward_shared` is never called."""
    from tomlens.behaviour import scoring

    model = load_model("tiny-llama")
    stimuli = _stimuli()
    rows = scoring._rows(model, scoring._plan(model.tokenizer, stimuli))
    assert [b.prefix for b in scoring._plan_batches(rows, scoring._common_prefixes(rows), 8, True)] == [0]

    def no_sharing(*args):
        raise AssertionError("a batch without a shared prefix took the shared path")

    monkeypatch.setattr(scoring, "_forward_shared", no_sharing)
    score_options(model, stimuli, batch_size=8, progress=False)


def _one_story(n_questions: int = 4) -> list[Stimulus]:
    story = ("Tom puts his ball in the cupboard and goes out to play in the garden with his sister. While he "
             "is away, his mother moves the ball from the cupboard to the toy box under the bed. ")
    questions = ["Tom will look for his ball in the", "The ball is now in the", "Tom thinks his ball is in the",
                 "His mother knows the ball is in the"][:n_questions]
    return [Stimulus(id=f"q{i}", text=story + q, options=o, answer=o[0])
            for i, (q, o) in enumerate((q, o) for q in questions for o in (("cupboard", "box"), ("toy box", "garden shed")))]


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama"])
def test_a_cache_that_cannot_be_shared_falls_back_to_plain_forwards(name, monkeypatch):
    """Where the model's cache is not a plain one (`PrefixCache.from_output` gives None), the
    batches are planned again without sharing and the scores are the shared path's."""
    from tomlens.behaviour import scoring

    model = load_model(name)
    stimuli = _one_story()
    rows = scoring._rows(model, scoring._plan(model.tokenizer, stimuli))
    assert all(b.prefix for b in scoring._plan_batches(rows, scoring._common_prefixes(rows), 4, True))
    shared = score_options(model, stimuli, batch_size=4, progress=False)
    plain_rows: list[int] = []
    forward_plain = scoring._forward_plain
    monkeypatch.setattr(scoring.PrefixCache, "from_output", classmethod(lambda cls, cache: None))
    monkeypatch.setattr(scoring, "_forward_plain",
                        lambda m, plain, chunk, *a: plain_rows.append(len(chunk)) or forward_plain(m, plain, chunk, *a))
    _assert_same_scores(score_options(model, stimuli, batch_size=4, progress=False), shared)
    assert sum(plain_rows) == len(scoring._plan(model.tokenizer, stimuli))  # every row, once


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama"])
def test_unembedding_only_the_read_positions_changes_nothing(name, monkeypatch):
    """`logits_to_keep` (the last positions the targets read) gives the scores of a forward that
    unembeds every position, on the plain and the shared path alike."""
    from tomlens.behaviour import scoring
    from tomlens.hooks.logits import keeps_last_logits

    model = load_model(name)
    assert keeps_last_logits(model)  # the tiny models take it, so the trimmed path is what runs
    stimuli = _one_story() + _stimuli()
    trimmed = [score_options(model, stimuli, batch_size=b, progress=False) for b in (1, 4)]
    monkeypatch.setattr(scoring, "keeps_last_logits", lambda m: False)
    for b, got in zip((1, 4), trimmed, strict=True):
        _assert_same_scores(got, score_options(model, stimuli, batch_size=b, progress=False))
