"""Belief statements (Zhu et al. style): labels from the protagonist's and the world's view."""

from __future__ import annotations

from collections import Counter

import pytest

from tomlens.errors import TomlensError
from tomlens.stimuli import generate, stimuli_hash
from tomlens.stimuli.false_belief import unexpected_transfer
from tomlens.stimuli.records import Span, Stimulus
from tomlens.stimuli.statements import (
    BELIEF_QUERY, STATEMENT_QUERY, belief_statements, statements_for,
)


def _by_source(stims):
    return {s.meta["source_id"]: [x for x in stims if x.meta["source_id"] == s.meta["source_id"]]
            for s in stims}


def test_deterministic_and_counts():
    a = belief_statements(3, 5)
    assert stimuli_hash(a) == stimuli_hash(belief_statements(3, 5))
    assert stimuli_hash(a) != stimuli_hash(belief_statements(3, 6))
    assert generate("belief-statements", n=3, seed=5) == a
    stories = [s for s in unexpected_transfer(3, 5) if s.prompt_type == "belief"]
    assert len(a) == len(stories) * 2 * 2  # orders (1, 2) x the two places
    assert Counter(s.meta["order"] for s in a) == {1: len(stories) * 2, 2: len(stories) * 2}
    assert len({s.id for s in a}) == len(a)
    assert {s.task_id for s in a} == {s.task_id for s in stories}


def test_story_is_the_belief_prompt_story_and_spans_carry_over():
    stories = {s.id: s for s in unexpected_transfer(2, 1) if s.prompt_type == "belief"}
    for s in belief_statements(2, 1, orders=(1,)):
        src = stories[s.meta["source_id"]]
        story = src.text[: src.spans["query"].start].rstrip()
        assert s.text == f"{story}\nStatement: {s.meta['statement']}\n{BELIEF_QUERY}"
        assert s.span_text("statement") == s.meta["statement"]
        assert s.span_text("query") == BELIEF_QUERY
        for role in ("protagonist", "other_agent", "object", "location_1", "location_2",
                     "contrast"):
            assert s.spans[role] == src.spans[role] and s.span_text(role) == src.span_text(role)
        assert s.condition == src.condition and s.reversed == src.reversed


def test_labels_false_belief_views_disagree_true_belief_agree():
    stims = belief_statements(4, 0, orders=(0, 1, 2))
    assert {s.condition for s in stims} == {"false_belief", "present", "informed", "no_transfer"}
    for s in stims:
        m = s.meta
        place, world, belief = m["statement_place"], m["story_world_state"], \
            m["story_protagonist_belief"]
        assert m["statement_true_for_world"] == (place == world)
        assert m["statement_true_for_protagonist"] == (place == belief)
        assert s.answer == ("true" if m["statement_true_for_world"] else "false")
        assert s.world_state == s.answer
        assert s.protagonist_belief == ("true" if m["statement_true_for_protagonist"] else "false")
        if s.condition == "false_belief":
            assert m["statement_true_for_protagonist"] != m["statement_true_for_world"]
            assert s.belief_differs
        else:
            assert m["statement_true_for_protagonist"] == m["statement_true_for_world"]
            assert not s.belief_differs


def test_hand_checked_false_belief_example():
    stims = belief_statements(1, 0, orders=(1, 2), conditions=("false_belief",))
    fb = [s for s in stims if not s.reversed]
    src = next(s for s in unexpected_transfer(1, 0) if s.condition == "false_belief"
               and not s.reversed and s.prompt_type == "belief")
    p, a, obj = src.span_text("protagonist"), src.span_text("other_agent"), src.span_text("object")
    start, end = src.reference_state, src.world_state  # the object started in `start`, moved on
    assert src.protagonist_belief == start != end
    got = {s.meta["statement"]: (s.answer, s.protagonist_belief) for s in fb}
    assert got == {
        f"{p} believes the {obj} is in the {start}.": ("false", "true"),
        f"{p} believes the {obj} is in the {end}.": ("true", "false"),
        f"{a} thinks that {p} believes the {obj} is in the {start}.": ("false", "true"),
        f"{a} thinks that {p} believes the {obj} is in the {end}.": ("true", "false"),
    }


def test_balanced_truth_and_option_order():
    stims = belief_statements(4, 2, orders=(1, 2))
    for cond in {s.condition for s in stims}:
        cell = [s for s in stims if s.condition == cond]
        assert Counter(s.answer for s in cell) == {"true": len(cell) // 2, "false": len(cell) // 2}
        assert Counter(s.answer_index for s in cell) == {0: len(cell) // 2, 1: len(cell) // 2}
    for group in _by_source(stims).values():
        for order in (1, 2):
            pair = [s for s in group if s.meta["order"] == order]
            assert sorted(s.answer for s in pair) == ["false", "true"]
    assert {s.options for s in stims} == {("true", "false"), ("false", "true")}


def test_order_zero_contents_source_and_custom_query():
    facts = belief_statements(1, 0, orders=0, query=STATEMENT_QUERY)
    for s in facts:
        assert s.meta["statement"].startswith("The ") and s.text.endswith(STATEMENT_QUERY)
    contents = belief_statements(2, 0, source="unexpected-contents", orders=(1,))
    for s in contents:
        container = s.span_text("container")
        assert f"believes the {container} contains {s.meta['statement_place']}." in \
            s.meta["statement"]
        if s.condition == "false_belief":
            assert s.belief_differs


def test_statements_for_hand_made_story():
    text = "Ida hangs the coat on the hook. Leo moves it to the chair. Ida looks on the"
    story = Stimulus(
        id="s", text=text, options=("hook", "chair"), answer="hook", condition="false_belief",
        world_state="chair", protagonist_belief="hook", reference_state="hook",
        spans={"protagonist": Span(0, 3), "other_agent": Span(32, 35), "object": Span(14, 18),
               "query": Span(text.index("Ida looks"), len(text))},
        meta={"preposition": {"hook": "on", "chair": "on"}},
    )
    assert story.span_text("other_agent") == "Leo" and story.span_text("object") == "coat"
    out = statements_for([story], orders=(2,))
    assert [s.meta["statement"] for s in out] == [
        "Leo thinks that Ida believes the coat is on the hook.",
        "Leo thinks that Ida believes the coat is on the chair.",
    ]
    assert [(s.answer, s.protagonist_belief) for s in out] == [("false", "true"),
                                                                ("true", "false")]
    no_other = story.with_(spans={k: v for k, v in story.spans.items() if k != "other_agent"})
    with pytest.raises(TomlensError, match="other_agent"):
        statements_for([no_other], orders=(2,))


@pytest.mark.parametrize("kwargs", [
    {"orders": (9,)}, {"orders": ()}, {"orders": (1, 1)}, {"orders": (True,)},
    {"source": "bigtom"},
    {"conditions": ("sleeping",)},
])
def test_bad_options_raise(kwargs):
    with pytest.raises(TomlensError):
        belief_statements(1, 0, **kwargs)
