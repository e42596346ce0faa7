"""Token positions come from role spans through tokenizer offsets, never from fixed indices."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tomlens.errors import TomlensError
from tomlens.models.positions import parse_selectors, resolve_positions
from tomlens.models import encode
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
