"""Minimal pairs: construction, token alignment for the SmolLM2 tokenizer, reports, files, CLI."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tomlens.cli import main
from tomlens.errors import TomlensError
from tomlens.stimuli.pairs import (
    MinimalPair,
    align_pairs,
    check_pairs,
    diff_positions,
    make_pairs,
    read_pairs,
    write_pairs,
)
from tomlens.stimuli.records import Span, Stimulus

BIGTOM = Path(os.environ.get(
    "TOMLENS_BIGTOM",
    Path(__file__).resolve().parents[2] / "shared" / "data" / "bigtom" / "bigtom.csv",
))


@pytest.fixture(scope="module")
def tok(load_tiny):
    return load_tiny("tiny-gpt2").tokenizer  # the SmolLM2 tokenizer, shared by all tiny models


@pytest.mark.parametrize("family,contrasts", [
    ("unexpected-transfer", ("present", "informed")),
    ("unexpected-contents", ("open_container", "informed")),
])
def test_false_belief_pairs_align_for_smollm2(tok, family, contrasts):
    pairs, report = make_pairs(family, 40, seed=1, tokenizer=tok)
    assert report.total == 40 * 2 * len(contrasts)
    assert report.aligned == len(pairs) and report.aligned_fraction >= 0.9
    assert report.counts == {"total": report.total, "aligned": len(pairs),
                             "dropped": report.total - len(pairs)}
    assert {p.contrast for p in pairs} == set(contrasts)
    assert len({p.id for p in pairs}) == len(pairs)
    for p in pairs:
        c, k = p.clean, p.corrupted
        assert c.condition == "false_belief" and k.condition == p.contrast
        assert c.task_id == k.task_id and c.reversed == k.reversed
        assert c.prompt_type == k.prompt_type == "belief"
        assert c.options == k.options and c.span_text("query") == k.span_text("query")
        # clean answer = the belief-consistent one; the control's answer = the world's
        assert c.answer == c.protagonist_belief != c.world_state == p.other_answer == k.answer
        # the swapped tokens lie inside the (narrowed) contrast of both prompts; with decoys the
        # informed control swaps two names (who is told, who is not) and the present control swaps
        # the absence and presence cues between the decoy and the move (two sentences)
        enc_c = tok(c.text, return_offsets_mapping=True)
        positions = diff_positions(p, tok)
        assert positions and (len(positions) == 2 or p.contrast != "informed")
        for i in positions:
            start, end = enc_c["offset_mapping"][i]
            assert c.spans["contrast"].start <= start and end <= c.spans["contrast"].end
        # the contrast spans the sentences the swap touches: a transfer's present control swaps the
        # cues of the decoy and the move (as far apart as the layout puts them); the open container
        # and the informed control swap two sentences in one frame
        episode = c.meta.get("episode", ())
        n = {"present": abs(episode.index("decoy") - episode.index("move")) + 1 if "decoy" in episode else 2,
             "open_container": 2, "informed": 2}.get(p.contrast, 1)
        assert c.span_text("contrast").count(".") == n
        # the control's deciding cue lies inside the contrast
        assert k.spans["contrast"].start <= k.spans["cue"].start < k.spans["cue"].end <= k.spans["contrast"].end


def test_without_a_tokenizer_only_characters_are_checked():
    pairs, report = make_pairs("unexpected-contents", 4, seed=0,
                               contrasts=("open_container", "informed", "correct_label"))
    assert report.checked_with == "characters" and report.aligned == report.total == 24
    assert {p.contrast for p in pairs} == {"open_container", "informed", "correct_label"}


def test_unalignable_controls_are_reported_and_dropped(tok):
    # without decoys the present control swaps an absence phrase for a presence phrase, which
    # often differ in length; the informed control swaps "nobody" for a name and always aligns
    pairs, report = make_pairs("unexpected-transfer", 8, seed=0, tokenizer=tok,
                               contrasts=("present", "informed"), decoys=False)
    assert report.total == 32 and report.aligned == len(pairs) and 0 < report.dropped < 16
    assert sum(p.contrast == "informed" for p in pairs) == 16
    assert report.reason_counts() == {"token_count": report.dropped}
    assert all(pid.endswith("present") for pid, _ in report.dropped_pairs)
    assert "token_count" in report.summary()
    # with decoys (the default) every control of these tasks aligns, no transfer included
    pairs, report = make_pairs("unexpected-transfer", 8, seed=0, tokenizer=tok,
                               contrasts=("present", "informed", "no_transfer"))
    assert report.aligned == report.total == 48


def test_order_only_pairs_differ_only_in_sentence_order(tok):
    pairs, report = make_pairs("order-only", 40, seed=1, tokenizer=tok)
    assert report.total == 40 and report.aligned == len(pairs) and report.aligned_fraction >= 0.9
    for p in pairs:
        c, k = p.clean, p.corrupted
        assert (c.condition, k.condition, p.contrast) == ("false_belief", "true_belief", "true_belief")
        assert c.prompt_type == k.prompt_type == "belief" and c.task_id == k.task_id
        assert sorted(c.text.split()) == sorted(k.text.split()) and c.text != k.text
        assert c.answer == c.meta["location_1"] and p.other_answer == k.answer == c.meta["location_2"]
        for s in (c, k):  # the contrast covers exactly the two sentences that trade places
            first, second = sorted([s.spans["contrast_leave"], s.spans["contrast_move"]],
                                   key=lambda span: span.start)
            assert s.spans["contrast"] == Span(first.start, second.end) and second.start == first.end + 1
        assert c.spans["contrast"] == k.spans["contrast"]
        offsets = tok(c.text, return_offsets_mapping=True)["offset_mapping"]
        for i in diff_positions(p, tok):
            start, end = offsets[i]
            start += len(c.text[start:end]) - len(c.text[start:end].lstrip())
            assert c.spans["contrast"].start <= start and end <= c.spans["contrast"].end
    # the character-level check alone accepts them too
    unchecked, rep = make_pairs("order-only", 4, seed=1)
    assert rep.checked_with == "characters" and rep.aligned == rep.total == 4 == len(unchecked)
    with pytest.raises(TomlensError, match="contrasts"):
        make_pairs("order-only", 2, 0, contrasts=("present",))


def _pair(clean_text: str, corrupted_text: str, clean_span: tuple[int, int],
          corrupted_span: tuple[int, int], pid: str = "hand-made") -> MinimalPair:
    def stim(i: str, text: str, span: tuple[int, int]) -> Stimulus:
        q = text.rindex("Tom will look")
        return Stimulus(id=i, text=text, options=("box", "bag"), answer="box",
                        condition="false_belief", spans={"contrast": Span(*span),
                                                         "query": Span(q, len(text))})

    return MinimalPair(pid, stim(pid + "-c", clean_text, clean_span),
                       stim(pid + "-k", corrupted_text, corrupted_span), "user", "present")


def _at(text: str, word: str) -> tuple[int, int]:
    i = text.index(word)
    return i, i + len(word)


def test_deliberately_misaligned_pairs_are_dropped_with_reasons(tok):
    base = "Tom puts the ball in the box. While Tom is {}, Ann moves it to the bag. " \
           "Tom will look for the ball in the"
    good_c, good_k = base.format("away"), base.format("watching")
    sent = "While Tom is {}, Ann moves it to the bag."
    good = _pair(good_c, good_k, _at(good_c, sent.format("away")),
                 _at(good_k, sent.format("watching")), "good")
    # an extra word inside the contrast: one more token
    longer_k = base.format("fast asleep")
    longer = _pair(good_c, longer_k, _at(good_c, sent.format("away")),
                   _at(longer_k, sent.format("fast asleep")), "longer")
    # same length, but the changed word lies outside the contrast span
    outside_k = good_c.replace("in the box.", "in the bag.")
    outside = _pair(good_c, outside_k, _at(good_c, sent.format("away")),
                    _at(outside_k, sent.format("away")), "outside")
    # characters agree outside the spans, but a token crosses the span's edge ("nobody"/"anybody")
    edge_c = "Tom sat. Ann told nobody. Tom will look for the ball in the"
    edge_k = "Tom sat. Ann told anybody. Tom will look for the ball in the"
    edge = _pair(edge_c, edge_k, _at(edge_c, "no"), _at(edge_k, "any"), "edge")
    kept, report = check_pairs([good, longer, outside, edge], tok)
    assert [p.id for p in kept] == ["good"]
    reasons = dict(report.dropped_pairs)
    assert set(reasons) == {"longer", "outside", "edge"}
    assert reasons["longer"].startswith("token_count")
    assert reasons["outside"].startswith("outside_contrast") and "before" in reasons["outside"]
    assert reasons["edge"].startswith("outside_contrast: token")
    assert report.counts == {"total": 4, "aligned": 1, "dropped": 3}
    # align_pairs alone (no character check) catches the token-level problems too
    aligned, rep2 = align_pairs([good, longer, edge], tok)
    assert [p.id for p in aligned] == ["good"] and rep2.reason_counts() == {
        "token_count": 1, "outside_contrast": 1}
    with pytest.raises(TomlensError, match="not token-aligned"):
        diff_positions(longer, tok)


def test_goal_encoding_pairs_animate_vs_accidental(tok):
    pairs, report = make_pairs("goal-encoding", 6, seed=0, tokenizer=tok)
    assert report.total == 6 * 2 * 2 and report.aligned == report.total  # targets x wording
    for p in pairs:
        assert p.clean.meta["test_case"] == "animate" and p.corrupted.meta["test_case"] == "control"
        assert p.clean.options == p.corrupted.options and p.clean.answer == p.clean.meta[
            "object_target"]
        assert p.clean.meta["k"] == 6
        assert len(diff_positions(p, tok)) == 1
    # an inanimate mover changes every habituation sentence: never a minimal pair
    pairs, report = make_pairs("goal-encoding", 3, seed=0, tokenizer=tok, contrasts=("inanimate",))
    assert pairs == [] and report.reason_counts() == {"outside_contrast": 12}


# One story of our own in BigToM's format, with a same-length percept swap ("sees"/"misses").
ROW = ";".join([
    "Ida bakes bread in a small bakery. Ida wants to sell rye bread today. "
    "Ida puts a rye loaf on the top shelf. Ida believes the top shelf holds rye bread. "
    "A helper swaps the rye loaf for a wheat loaf.",
    "Ida sees the helper swapping the loaf.",
    "Ida misses the helper swapping the loaf.",
    "Ida bakes another rye loaf.", "Ida sells the loaf from the top shelf.",
    "Does Ida believe the top shelf holds rye bread or wheat bread?",
    "Does Ida want to sell rye bread?", "What will Ida do?",
    "Ida believes the top shelf holds wheat bread.", "Ida wants to sell rye bread.",
    "Ida will bake another rye loaf.", "Ida believes the top shelf holds rye bread.",
    "Ida wants to sell rye bread.", "Ida will sell the loaf from the top shelf.",
    "A cat walks past the window.", "Ida sees the cat.", "Ida does not see the cat.", "auto", "0",
])


def test_bigtom_pairs(tok, tmp_path):
    csv = tmp_path / "mini.csv"
    csv.write_text(ROW + "\n" + ROW.replace("Ida misses the helper", "Ida does not see the helper")
                   + "\n", encoding="utf-8")
    # by default the aware sentence is the unaware one with "not" -> "indeed": one word apart
    pairs, report = make_pairs("bigtom", None, 0, tokenizer=tok, path=csv)
    assert report.total == 2 and report.aligned == 2
    assert pairs[1].corrupted.span_text("contrast") == "Ida does indeed see the helper swapping the loaf."
    assert pairs[1].corrupted.meta["percept"] == "aligned" and pairs[0].corrupted.meta["percept"] == "original"
    # BigToM's own wording ("sees" vs "does not see") differs in length: reported and left out
    pairs, report = make_pairs("bigtom", None, 0, tokenizer=tok, path=csv, percept="original")
    assert report.total == 2 and [p.id for p in pairs] == ["bigtom-001-true_belief"]
    p = pairs[0]
    assert p.clean.condition == "false_belief" and p.corrupted.condition == "true_belief"
    assert p.clean.answer == "rye bread" and p.other_answer == "wheat bread"
    assert report.dropped_pairs[0][0] == "bigtom-002-true_belief"
    assert report.dropped_pairs[0][1].startswith("token_count")
    with pytest.raises(TomlensError, match="BigToM file"):
        make_pairs("bigtom", None, 0)


def test_real_bigtom_file_reports_every_story(tok):
    pairs, report = make_pairs("bigtom", None, 0, tokenizer=tok, path=BIGTOM)
    assert report.total == 200 and report.aligned + report.dropped == 200
    assert report.aligned >= 190  # the "does indeed" percept form aligns nearly every story
    assert all(reason.split(":")[0] in {"token_count", "outside_contrast", "options_share_first_token"}
               for _, reason in report.dropped_pairs)
    for p in pairs:  # aligned pairs really differ in the percept sentence only
        offsets = tok(p.clean.text, return_offsets_mapping=True)["offset_mapping"]
        contrast = p.clean.spans["contrast"]
        for i in diff_positions(p, tok):
            assert contrast.start <= offsets[i][0] and offsets[i][1] <= contrast.end


def test_pairs_file_round_trip(tmp_path):
    pairs, _ = make_pairs("unexpected-transfer", 2, seed=0)
    path = write_pairs(pairs, tmp_path / "p.jsonl")
    back = read_pairs(path)
    assert back == pairs
    path.write_text(path.read_text() + "{\"id\": \"x\"}\n")
    with pytest.raises(TomlensError, match="line 9"):
        read_pairs(path)
    with pytest.raises(TomlensError, match="does not exist"):
        read_pairs(tmp_path / "missing.jsonl")


def test_bad_requests():
    with pytest.raises(TomlensError, match="no minimal pairs"):
        make_pairs("belief-statements", 2, 0)
    with pytest.raises(TomlensError, match="contrasts"):
        make_pairs("unexpected-transfer", 2, 0, contrasts=("open_container",))
    with pytest.raises(TomlensError, match="unknown option"):
        make_pairs("unexpected-contents", 2, 0, colour="red")


def test_cli_writes_aligned_pairs_and_report(tmp_path, capsys):
    out = tmp_path / "pairs.jsonl"
    rc = main(["pairs", "unexpected-contents", "--model", "tiny-gpt2", "--n", "4", "--seed", "2",
               "--out", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "16 of 16 pairs aligned" in text
    pairs = read_pairs(out)
    assert len(pairs) == 16
    report = json.loads((tmp_path / "pairs.report.json").read_text())
    assert report["aligned"] == 16 and report["model"] == "tiny-gpt2" and report["seed"] == 2
    # a family whose pairs cannot align for this tokenizer: reasons printed, exit code 2
    rc = main(["pairs", "goal-encoding", "--model", "tiny-gpt2", "--n", "2",
               "--contrast", "inanimate", "--out", str(tmp_path / "g.jsonl")])
    captured = capsys.readouterr()
    assert rc == 2 and "outside_contrast" in captured.out and "no goal-encoding pair" in captured.err
    assert not (tmp_path / "g.jsonl").exists()
    assert main(["pairs", "bigtom", "--model", "tiny-gpt2", "--out", str(out)]) == 2
    assert "needs --path" in capsys.readouterr().err
