"""Sentence-by-sentence belief tracking: prefixes, lead-in sentences, per-prefix labels."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import replace

import pytest

from tomlens.errors import TomlensError
from tomlens.stimuli import generate
from tomlens.stimuli.false_belief import make_tasks, task_stimuli, unexpected_contents, unexpected_transfer
from tomlens.stimuli.tracking import UNKNOWN, belief_tracking, put_first

# Sentences around the episode (which has 2 or 4 sentences, by the task's layout) and the two
# telling sentences of a false-belief story with decoys.
FIXED = {"unexpected-transfer": ("setting", "listing", "empty", "put", "closing", "leave", "return"),
         "unexpected-contents": ("fill", "missing", "label", "find", "unseen", "read")}


def _sentences(text: str) -> list[str]:
    return re.split(r"(?<=\.) ", text)


def _full_fb(stims, task_id, rev, prompt_type):
    return next(s for s in stims if s.task_id == task_id and s.condition == "false_belief"
                and s.reversed == rev and s.prompt_type == prompt_type)


def _n_sentences(ref) -> int:
    """Sentences of a full false-belief story: the fixed ones, its episode, two tellings."""
    return len(FIXED[ref.family]) + len(ref.meta["episode"]) + 2


def _tracked(sentences: list[str], swapped: bool) -> list[str]:
    """A transfer story as belief tracking tells it: the put (4th sentence) before "The <other> is
    empty" (3rd) where `put_first` says so."""
    return sentences[:2] + sentences[3:1:-1] + sentences[4:] if swapped else sentences


def _references(family, gen, n, seed):
    """The full false-belief items belief tracking tells: the family's own, except that a reversed
    version is that of the task with a transfer story's listing and closing orders, or a contents
    story's label order, flipped."""
    full = gen(n, seed=seed, conditions=("false_belief",))
    tasks = make_tasks(family, n, seed)
    flipped = [replace(t, first_ref=not t.first_ref, last_ref=not t.last_ref) if family == "unexpected-transfer"
               else replace(t, label_order_flipped=True) for t in tasks]
    reversed_ = [s for t in flipped for s in task_stimuli(t, ("false_belief",)) if s.reversed]
    return [s for s in full if not s.reversed] + reversed_


@pytest.mark.parametrize("family,gen", [
    ("unexpected-transfer", unexpected_transfer),
    ("unexpected-contents", unexpected_contents),
])
def test_every_prefix_with_both_prompts(family, gen):
    track = belief_tracking(4, seed=4, family=family)
    full = _references(family, gen, 4, 4)
    tasks = {t.task_id: t for t in make_tasks(family, 4, 4)}
    lengths = {s.task_id: _n_sentences(s) for s in full}
    assert len(set(lengths.values())) > 1 or family == "unexpected-contents"  # layouts differ in length
    assert len(track) == sum(2 * (n + 1) * 2 for n in lengths.values())
    assert len({s.id for s in track}) == len(track)
    assert Counter((s.task_id, s.meta["prefix_index"]) for s in track) == {
        (t, k): 2 * 2 for t, n in lengths.items() for k in range(n + 1)}
    for s in track:
        assert s.family == "belief-tracking" and s.meta["story_family"] == family
        assert s.condition == "false_belief"
        ref = _full_fb(full, s.task_id, s.reversed, s.prompt_type)
        assert s.options == ref.options and s.template_id == ref.template_id
        transfer = family == "unexpected-transfer"
        swapped = transfer and put_first(tasks[s.task_id], s.reversed)
        story = _tracked(_sentences(ref.text[: ref.spans["query"].start].rstrip()), swapped)
        n_sent = lengths[s.task_id]
        assert len(story) == n_sent == s.meta["n_sentences"]
        k = s.meta["prefix_index"]
        query = s.span_text("query")
        assert s.text.endswith(query) and query == ref.span_text("query")
        body = s.text[: s.spans["query"].start].rstrip()
        got = _sentences(body) if body else []
        lead_in = transfer and s.prompt_type == "belief" and k < n_sent
        assert s.meta["lead_in"] == lead_in
        if lead_in:  # K24: the story's last sentence before the belief prompt, and the closing
            closing = n_sent - 3  # (closing, leave, return) end every transfer story
            tail = story[closing:closing + 1] * (k <= closing) + story[-1:]
            assert got == story[:k] + tail
            assert s.span_text("lead_in") == " ".join(tail)
        else:
            assert got == story[:k]
        if k == n_sent:  # the whole story: the full false-belief item's text (the put and the
            # empty sentence swapped in one version of a transfer task) and its labels
            if transfer and s.reversed:  # the place-naming orders flipped: not the family's item
                family_item = _full_fb(gen(4, seed=4, conditions=("false_belief",)), s.task_id, True, s.prompt_type)
                assert family_item.text != ref.text and sorted(family_item.text) == sorted(ref.text)
            assert s.text == " ".join(story + [query]) and (s.text == ref.text) != swapped
            assert (s.world_state, s.protagonist_belief) == (ref.world_state,
                                                             ref.protagonist_belief)
            assert s.answer == ref.answer


def _labels(track, prompt_type="reality", rev=False):
    first = track[0].task_id
    rows = sorted((s for s in track if s.task_id == first and s.prompt_type == prompt_type
                   and s.reversed == rev), key=lambda s: s.meta["prefix_index"])
    return rows


def test_transfer_labels_follow_the_story():
    track = belief_tracking(2, seed=0, family="unexpected-transfer")
    for rev in (False, True):
        rows = _labels(track, rev=rev)
        roles = [r.meta["sentence_role"] for r in rows]
        full = unexpected_transfer(2, seed=0, conditions=("false_belief",))
        ref = next(s for s in full if s.task_id == rows[0].task_id and s.reversed == rev)  # mirror layout
        tellings = ["tell", "untold"] if roles.index("tell") < roles.index("untold") else ["untold", "tell"]
        opening = ["put", "empty"] if put_first(make_tasks("unexpected-transfer", 2, 0)[0], rev) else ["empty", "put"]
        assert roles[0] is None and roles[1:] == ["setting", "listing", *opening, *ref.meta["episode"],
                                                  *tellings, "closing", "leave", "return"]
        start = rows[-1].reference_state
        other = next(o for o in rows[-1].options if o != start)
        world = [r.meta["world_state_t"] for r in rows]
        belief = [r.meta["belief_t"] for r in rows]
        put, move = roles.index("put"), roles.index("move")
        assert world[:put] == [UNKNOWN] * put and belief[:put] == [UNKNOWN] * put
        assert world[put:move] == [start] * (move - put)
        assert world[move:] == [other] * (len(rows) - move)  # reality flips at the transfer...
        assert belief[put:] == [start] * (len(rows) - put)  # ...belief stays at the start
        for r in rows:
            assert (r.world_state is None) == (r.meta["world_state_t"] == UNKNOWN)
            assert r.meta["label_known"] == (r.world_state is not None)
            assert r.answer == (r.world_state if r.world_state else rows[-1].answer)
            if r.world_state and r.protagonist_belief:
                assert r.belief_differs == (r.meta["prefix_index"] >= move)
        # reversed stories are the mirror image
        if rev:
            fwd = _labels(track, rev=False)
            assert fwd[-1].reference_state == other and rows[-1].reference_state == start


def test_contents_labels_follow_the_story():
    track = belief_tracking(4, seed=0, family="unexpected-contents")
    for rev in (False, True):
        rows = _labels(track, prompt_type="belief", rev=rev)
        roles = [r.meta["sentence_role"] for r in rows]
        label = rows[-1].reference_state
        contents = next(o for o in rows[-1].options if o != label)
        fill, read = roles.index("fill"), roles.index("read")
        world = [r.meta["world_state_t"] for r in rows]
        belief = [r.meta["belief_t"] for r in rows]
        assert world[:fill] == [UNKNOWN] * fill and world[fill:] == [contents] * (len(rows) - fill)
        # the protagonist believes nothing until reading the label, then the label
        assert belief[:read] == [UNKNOWN] * read
        assert belief[read:] == [label] * (len(rows) - read)
        assert rows[-1].answer == label and rows[0].answer == label  # unknown -> final answer
        assert not rows[0].meta["label_known"] and rows[-1].meta["label_known"]
        assert "contrast" in rows[-1].spans and "contrast" not in rows[read].spans


def test_true_belief_controls_and_options():
    track = belief_tracking(1, seed=0, family="unexpected-transfer", conditions=("present",),
                            include_reversed=False)
    rows = _labels(track)
    move = [r.meta["sentence_role"] for r in rows].index("move")
    assert rows[move].meta["belief_t"] == rows[move].meta["world_state_t"] != rows[move - 1].meta[
        "world_state_t"]
    assert all(not r.belief_differs for r in track)
    assert {s.condition for s in track} == {"present"} and not any(s.reversed for s in track)


def test_deterministic_and_dispatch():
    a = [s.to_dict() for s in belief_tracking(2, seed=5, family="unexpected-contents")]
    assert a == [s.to_dict() for s in belief_tracking(2, seed=5, family="unexpected-contents")]
    assert a != [s.to_dict() for s in belief_tracking(2, seed=6, family="unexpected-contents")]
    b = [s.to_dict() for s in generate("belief-tracking", n=2, seed=5)]
    assert b == [s.to_dict() for s in belief_tracking(2, seed=5)]


def test_bad_arguments():
    with pytest.raises(TomlensError, match="no story family"):
        belief_tracking(2, seed=0, family="goal-encoding")
    with pytest.raises(TomlensError, match="conditions"):
        belief_tracking(2, seed=0, conditions=("open_container",))
    with pytest.raises(TomlensError, match="n >= 1"):
        belief_tracking(0, seed=0)
