"""Token positions come from role spans through tokenizer offsets, never from fixed indices."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tomlens.errors import TomlensError
from tomlens.models import encode
from tomlens.models.positions import parse_selectors, resolve_positions
from tomlens.stimuli.records import Span, Stimulus


def story(i: int, name: str, obj: str, loc1: str, loc2: str, prefix: str = "") -> Stimulus:
    """A transfer story with its role spans found in the text (first mention of each word)."""
    text = (f"{prefix}{name} put the {obj} in the {loc1}. While {name} was away, Max moved the {obj} "
            f"to the {loc2}. {name} will look for the {obj} in the")

    def span(word: str, after: int = 0) -> Span:
        start = text.index(word, after)
        return Span(start, start + len(word))

    c0 = text.index("While")
    return Stimulus(
        id=f"story-{i}", text=text, options=(loc1, loc2), answer=loc1, family="test", condition="false_belief",
        world_state=loc2, protagonist_belief=loc1, reference_state=loc1,
        spans={"protagonist": span(name), "object": span(obj), "location_1": span(loc1),
               "location_2": span(loc2, c0), "contrast": Span(c0, text.index(".", c0) + 1)},
    )


STORIES = [
    story(0, "Anne", "ball", "basket", "box"),
    story(1, "Xiaoling", "marble", "cupboard", "drawer", prefix="Once upon a time, in a small town. "),
    story(2, "Li", "key", "bag", "jar"),
]


def _decode(model, batch, row: int, pos: int) -> str:
    return model.tokenizer.decode([int(batch.input_ids[row, pos])])


def test_positions_point_at_the_span_tokens_in_a_padded_batch(load_tiny):
    model = load_tiny("tiny-llama")
    batch = encode(model, [s.text for s in STORIES])
    assert len(set(batch.pad)) > 1  # rows really are padded by different amounts
    sels = ["final", "protagonist", "protagonist:first", "object", "location_1", "location_2", "contrast_end"]
    pos = resolve_positions(STORIES, batch, sels)
    assert pos.shape == (3, len(sels)) and pos.dtype == torch.long
    for row, s in enumerate(STORIES):
        got = {sel: _decode(model, batch, row, int(pos[row, j])) for j, sel in enumerate(sels)}
        assert int(pos[row, 0]) == batch.input_ids.shape[1] - 1 and got["final"] == " the"
        assert got["object"].strip() in s.span_text("object")
        assert s.span_text("location_1").endswith(got["location_1"].strip())
        assert s.span_text("location_2").endswith(got["location_2"].strip())
        assert got["contrast_end"] == "."
        assert int(pos[row, 1]) >= int(pos[row, 2]) >= batch.pad[row]
        # the tokens from first to last rebuild the protagonist's name
        first, last = int(pos[row, 2]), int(pos[row, 1])
        name = model.tokenizer.decode(batch.input_ids[row, first : last + 1].tolist()).strip()
        assert name == s.span_text("protagonist")


def test_a_multi_token_name_has_distinct_first_and_last_positions(load_tiny):
    model = load_tiny("tiny-gpt2")
    s = STORIES[1]  # " Xiaoling" is two tokens (" Xia", "oling") in the SmolLM2 tokenizer
    batch = encode(model, [s.text])
    pos = resolve_positions([s], batch, ["protagonist:first", "protagonist"])
    assert int(pos[0, 1]) == int(pos[0, 0]) + 1


def test_positions_do_not_depend_on_batch_company(load_tiny):
    model = load_tiny("tiny-gpt2")
    batch = encode(model, [s.text for s in STORIES])
    together = resolve_positions(STORIES, batch, ["object", "final"])
    for row, s in enumerate(STORIES):
        alone = encode(model, [s.text])
        single = resolve_positions([s], alone, ["object", "final"])
        assert (together[row] - batch.pad[row]).tolist() == single[0].tolist()


def test_a_span_no_token_covers_names_the_stimulus_and_the_span(load_tiny):
    model = load_tiny("tiny-gpt2")
    s = STORIES[0]
    batch = encode(model, [s.text])
    obj = s.spans["object"]
    # a tokenizer whose offsets skip the object word (as offset-trimming tokenizers can)
    holes = [(a, b) if b <= obj.start or a >= obj.end else (a, a) for a, b in batch.offsets[0]]
    broken = dataclasses.replace(batch, offsets=[holes])
    with pytest.raises(TomlensError, match=r"story-0.*'object'"):
        resolve_positions([s], broken, ["object"])
    resolve_positions([s], broken, ["protagonist"])  # other spans still resolve


def test_a_missing_role_names_the_stimulus(load_tiny):
    model = load_tiny("tiny-gpt2")
    s = STORIES[2].with_(spans={k: v for k, v in STORIES[2].spans.items() if k != "contrast"})
    batch = encode(model, [s.text])
    with pytest.raises(TomlensError, match=r"story-2.*'contrast'"):
        resolve_positions([s], batch, ["final", "contrast_end"])


def test_selector_parsing():
    assert parse_selectors("final protagonist:first") == ["final", "protagonist:first"]
    assert parse_selectors(["final", "final", "object"]) == ["final", "object"]
    for bad in ("object:middle", "final:first", ""):
        with pytest.raises(TomlensError):
            parse_selectors(bad)


# ---- mentions: <role>@<k>, <role>@last, role_mentions ------------------------------------------


def _mentioned(text: str, words: dict[str, str], sid: str = "m") -> Stimulus:
    from tomlens.stimuli.records import find_mentions

    found = find_mentions(text, words)
    return Stimulus(id=sid, text=text, options=("box", "bag"), answer="box",
                    spans={role: ms[0] for role, ms in found.items()}, mentions=found)


MENTIONED = _mentioned("Ann puts the key in the box. Ann leaves. Bo moves the key to the bag. Ann looks in the",
                       {"protagonist": "Ann", "object": "key", "location_1": "box", "location_2": "bag",
                        "other_agent": "Bo"})


def test_mention_selectors_pick_the_kth_and_the_last_mention():
    from tomlens.models.positions import selector_span

    text = MENTIONED.text
    starts = [i for i in range(len(text)) if text.startswith("Ann", i)]
    assert len(starts) == 3
    for k, start in enumerate(starts, 1):
        span, first = selector_span(MENTIONED, f"protagonist@{k}")
        assert (span.start, first) == (start, False) and span.of(text) == "Ann"
    assert selector_span(MENTIONED, "protagonist@last")[0].start == starts[-1]
    assert selector_span(MENTIONED, "protagonist@2:first") == (Span(starts[1], starts[1] + 3), True)
    assert selector_span(MENTIONED, "object@2")[0].start == text.rindex("key")
    # `@1` falls back to the span when a record has no mentions; the bare role is the first mention
    plain = STORIES[0]
    assert selector_span(plain, "protagonist@1")[0] == plain.spans["protagonist"]
    assert selector_span(MENTIONED, "protagonist")[0].start == starts[0]


def test_missing_mentions_fail_naming_the_role_and_the_count():
    from tomlens.models.positions import check_selectors, lacking, parse_selectors, selector_span

    with pytest.raises(TomlensError, match=r"has 3 mention\(s\) of 'protagonist'.*protagonist@4") as err:
        selector_span(MENTIONED, "protagonist@4")
    assert "protagonist@1..protagonist@3" in err.value.fix
    with pytest.raises(TomlensError, match=r"has 1 mention\(s\) of 'other_agent'"):
        check_selectors([MENTIONED], ["final", "other_agent@2"])
    with pytest.raises(TomlensError, match="records no mentions of 'protagonist'"):  # span only: last unknown
        selector_span(STORIES[0], "protagonist@last")
    with pytest.raises(TomlensError, match="a first-mention span only"):
        selector_span(STORIES[0], "protagonist@2")
    with pytest.raises(TomlensError, match="no span 'cue'"):
        selector_span(MENTIONED, "cue")
    assert lacking([MENTIONED, STORIES[0]], ["final", "protagonist@3", "protagonist@1", "object@last"]) == {
        "protagonist@3": 1, "object@last": 1}
    assert parse_selectors("protagonist@2:first object@last final") == ["protagonist@2:first", "object@last", "final"]
    for bad in ("protagonist@0", "protagonist@x", "final@1", "protagonist@2:middle", "@2"):
        with pytest.raises(TomlensError):
            parse_selectors([bad])


def test_role_mentions_list_every_mention_in_text_order():
    from tomlens.models.positions import role_mentions

    got = [(sel, span.of(MENTIONED.text)) for sel, span in role_mentions(MENTIONED)]
    assert got == [("protagonist@1", "Ann"), ("object@1", "key"), ("location_1@1", "box"), ("protagonist@2", "Ann"),
                   ("other_agent@1", "Bo"), ("object@2", "key"), ("location_2@1", "bag"), ("protagonist@3", "Ann")]
    # a record without mentions lists its word roles' first mentions (not sentence spans like contrast)
    assert [sel for sel, _ in role_mentions(STORIES[0])] == ["protagonist@1", "object@1", "location_1@1",
                                                            "location_2@1"]


def test_mention_positions_resolve_in_a_padded_batch(load_tiny):
    model = load_tiny("tiny-llama")
    other = _mentioned("Once upon a time. " + MENTIONED.text, {"protagonist": "Ann", "object": "key"}, "m2")
    batch = encode(model, [MENTIONED.text, other.text])
    pos = resolve_positions([MENTIONED, other], batch, ["protagonist@3", "object@last", "protagonist@2:first"])
    for row in range(2):
        words = [_decode(model, batch, row, int(p)).strip() for p in pos[row]]
        assert "Ann".endswith(words[0]) and "key".endswith(words[1]) and "Ann".startswith(words[2])
    assert int(pos[1, 0]) == int(pos[0, 0]) and batch.pad[0] > 0  # right-aligned: same column
