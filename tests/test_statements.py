"""Belief statements (Zhu et al. style): literal truth from the recursive belief tracker."""

from __future__ import annotations

from collections import Counter

import pytest

from tomlens.errors import TomlensError
from tomlens.stimuli import generate, stimuli_hash
from tomlens.stimuli.belief_state import Event, belief, chains
from tomlens.stimuli.false_belief import unexpected_transfer
from tomlens.stimuli.order_only import order_only
from tomlens.stimuli.records import Span, Stimulus
from tomlens.stimuli.statements import (
    BELIEF_QUERY,
    MAX_ORDER,
    SOURCES,
    STATEMENT_QUERY,
    belief_statements,
    statements_for,
    story_events,
    third_agents,
)

GENERATORS = {"unexpected-transfer": lambda n, s: generate("unexpected-transfer", n=n, seed=s),
              "unexpected-contents": lambda n, s: generate("unexpected-contents", n=n, seed=s),
              "order-only": order_only}


def _belief_stories(source, n, seed):
    return [s for s in GENERATORS[source](n, seed) if s.prompt_type == "belief"]


def test_deterministic_and_counts():
    a = belief_statements(2, 5)
    assert stimuli_hash(a) == stimuli_hash(belief_statements(2, 5))
    assert stimuli_hash(a) != stimuli_hash(belief_statements(2, 6))
    assert generate("belief-statements", n=2, seed=5) == a
    stories = [s for s in unexpected_transfer(2, 5) if s.prompt_type == "belief"]
    per_story = Counter()
    for s in a:
        per_story[s.meta["source_id"]] += 1
    for story in stories:  # every chain of the story's believers x the two places
        k = len({c for s in a if s.meta["source_id"] == story.id for c in s.meta["chain"]})
        assert per_story[story.id] == 2 * (k + k * (k - 1))
    assert len({s.id for s in a}) == len(a)
    assert {s.task_id for s in a} == {s.task_id for s in stories}
    assert MAX_ORDER >= 4


def test_story_third_agent_and_the_question_asks_for_literal_truth():
    stories = {s.id: s for s in unexpected_transfer(2, 1) if s.prompt_type == "belief"}
    stims = belief_statements(2, 1, orders=(1,))
    for s in stims:
        src = stories[s.meta["source_id"]]
        story = src.text[: src.spans["query"].start].rstrip()
        third = s.meta["third_agent"]
        assert s.text.startswith(story + f" {third} saw ")
        assert s.text.endswith(f"\nStatement: {s.meta['statement']}\n{STATEMENT_QUERY}")
        assert s.span_text("statement") == s.meta["statement"]
        assert s.span_text("query") == STATEMENT_QUERY
        assert s.span_text("third_agent") == third and third not in story.split()
        assert s.span_text("statement_place") == s.meta["statement_place"]
        for role in ("protagonist", "other_agent", "object", "location_1", "location_2"):
            assert s.spans[role] == src.spans[role] and s.span_text(role) == src.span_text(role)
        assert s.condition == src.condition == s.meta["source_condition"]
        assert s.answer == ("true" if s.meta["statement_literal_true"] else "false")
    # one third agent per task, the same in all its stories; stays / leaves balanced
    by_task = {(s.task_id, s.meta["third_agent"], s.meta["third_agent_stays"]) for s in stims}
    assert len(by_task) == len({s.task_id for s in stims})
    thirds = third_agents(_belief_stories("unexpected-transfer", 8, 0))
    assert Counter(t.stays for t in thirds.values()) == {True: 4, False: 4}
    q = belief_statements(1, 0, orders=(1,), query=BELIEF_QUERY)
    assert all(s.text.endswith(BELIEF_QUERY) for s in q)


@pytest.mark.parametrize("source", list(SOURCES))
def test_labels_are_the_trackers(source):
    stories = _belief_stories(source, 2, 3)
    thirds = third_agents(stories)
    stims = belief_statements(2, 3, source=source, orders=(0, 1, 2, 3))
    by_id = {s.id: s for s in stories}
    for s in stims:
        src = by_id[s.meta["source_id"]]
        events = story_events(src, thirds[src.task_id])
        held = belief(tuple(s.meta["chain"]), events)
        assert s.meta["chain_belief"] == held
        assert s.meta["statement_literal_true"] == (held == s.meta["statement_place"])
        assert s.answer == ("true" if held == s.meta["statement_place"] else "false")
        # the second labels: the embedded claim against the world and the protagonist's belief
        assert s.meta["statement_true_for_world"] == (s.meta["statement_place"] == src.world_state)
        assert s.meta["statement_true_for_protagonist"] == \
            (s.meta["statement_place"] == src.protagonist_belief)
        assert s.world_state == ("true" if s.meta["statement_true_for_world"] else "false")
        # the words: "X thinks that Y believes <claim>." along the chain
        chain = s.meta["chain"]
        if chain:
            assert s.meta["statement"].startswith(
                "".join(f"{h} thinks that " for h in chain[:-1]) + f"{chain[-1]} believes the ")
        if s.meta["order"] == 1 and chain == [src.meta["protagonist"]]:
            assert s.meta["statement_literal_true"] == s.meta["statement_true_for_protagonist"]
    # order 0 is the world
    assert all(s.meta["statement_literal_true"] == s.meta["statement_true_for_world"]
               for s in stims if s.meta["order"] == 0)


@pytest.mark.parametrize("source", list(SOURCES))
def test_literal_truth_varies_within_every_condition_and_order(source):
    stims = belief_statements(2, 0, source=source, orders=tuple(range(MAX_ORDER + 1)))
    cells: dict[tuple[str, int], set[bool]] = {}
    for s in stims:
        cells.setdefault((s.condition, s.meta["order"]), set()).add(s.meta["statement_literal_true"])
    conditions = {s.condition for s in stims}
    assert len(conditions) >= 2
    assert set(cells) == {(c, o) for c in conditions for o in range(MAX_ORDER + 1)}
    assert all(v == {True, False} for v in cells.values()), cells
    # which place is true is not fixed by the place alone: in false-belief stories, statements
    # naming the start location are true for some chains and false for others (order >= 1)
    for order in range(1, MAX_ORDER + 1):
        start = {s.meta["statement_literal_true"] for s in stims
                 if s.condition == "false_belief" and s.meta["order"] == order
                 and s.meta["statement_place"] == s.meta["story_reference_state"]}
        assert start == {True, False}, order


def test_hand_checked_false_belief_example():
    stims = belief_statements(1, 0, orders=(1, 2), conditions=("false_belief",))
    fb = [s for s in stims if not s.reversed]
    src = next(s for s in unexpected_transfer(1, 0) if s.condition == "false_belief"
               and not s.reversed and s.prompt_type == "belief")
    p, a, obj = src.span_text("protagonist"), src.span_text("other_agent"), src.span_text("object")
    start, end = src.reference_state, src.world_state  # the object started in `start`, moved on
    assert src.protagonist_belief == start != end
    got = {s.meta["statement"]: s.answer for s in fb}
    assert got[f"{p} believes the {obj} is in the {start}."] == "true"
    assert got[f"{a} believes the {obj} is in the {end}."] == "true"
    assert got[f"{a} believes the {obj} is in the {start}."] == "false"
    # Mark knows Kate missed the move; Kate does not know there was one
    assert got[f"{a} thinks that {p} believes the {obj} is in the {start}."] == "true"
    assert got[f"{p} thinks that {a} believes the {obj} is in the {start}."] == "true"
    assert got[f"{p} thinks that {a} believes the {obj} is in the {end}."] == "false"
    third = fb[0].meta["third_agent"]
    saw_move = fb[0].meta["third_agent_stays"]
    assert got[f"{third} believes the {obj} is in the {end}."] == ("true" if saw_move else "false")
    assert got[f"{third} thinks that {p} believes the {obj} is in the {start}."] == "true"


def test_order_only_source_keeps_one_bag_of_words_per_task():
    stims = belief_statements(4, 0, source="order-only", orders=(1, 2))
    groups: dict[tuple, set] = {}
    for s in stims:
        key = (s.task_id, tuple(s.meta["chain"]), s.meta["statement_place"])
        groups.setdefault(key, set()).add((s.condition, tuple(sorted(s.text.split()))))
    for key, texts in groups.items():
        assert {c for c, _ in texts} == {"false_belief", "true_belief"}
        assert len({words for _, words in texts}) == 1, key  # same words, both conditions


def test_chains_per_order_rotates_across_tasks_not_conditions():
    stims = belief_statements(4, 0, orders=(2,), chains_per_order=2)
    per_task: dict[str, set] = {}
    for s in stims:
        per_task.setdefault(s.task_id, set()).add((s.condition, tuple(s.meta["chain_roles"])))
    seen = set()
    for items in per_task.values():
        by_cond: dict[str, set] = {}
        for cond, roles in items:
            by_cond.setdefault(cond, set()).add(roles)
        assert len({frozenset(v) for v in by_cond.values()}) == 1  # same chains in each condition
        assert all(len(v) == 2 for v in by_cond.values())
        seen |= next(iter(by_cond.values()))
    assert len(seen) > 2


def test_statements_for_hand_made_story_with_its_events():
    text = "Ida hangs the coat on the hook. Leo moves it to the chair. Ida looks on the"
    story = Stimulus(
        id="s", text=text, options=("hook", "chair"), answer="hook", condition="false_belief",
        world_state="chair", protagonist_belief="hook", reference_state="hook",
        spans={"protagonist": Span(0, 3), "other_agent": Span(32, 35), "object": Span(14, 18),
               "query": Span(text.index("Ida looks"), len(text))},
        meta={"preposition": {"hook": "on", "chair": "on"}},
    )
    assert story.span_text("other_agent") == "Leo" and story.span_text("object") == "coat"
    events = [Event("place", "hook", frozenset({"Ida", "Leo"})),
              Event("move", "chair", frozenset({"Leo"}))]
    with pytest.raises(TomlensError, match="events="):
        statements_for([story], orders=(2,))
    out = statements_for([story], orders=(2,), events=lambda s: events)
    assert [(s.meta["statement"], s.answer) for s in out] == [
        ("Ida thinks that Leo believes the coat is on the hook.", "true"),
        ("Ida thinks that Leo believes the coat is on the chair.", "false"),
        ("Leo thinks that Ida believes the coat is on the hook.", "true"),
        ("Leo thinks that Ida believes the coat is on the chair.", "false"),
    ]
    assert [s.protagonist_belief for s in out] == ["true", "false"] * 2
    assert [s.world_state for s in out] == ["false", "true"] * 2
    no_other = story.with_(spans={k: v for k, v in story.spans.items() if k != "other_agent"})
    with pytest.raises(TomlensError, match="other_agent"):
        statements_for([no_other], orders=(2,), events=lambda s: events)
    assert len(chains(("Ida", "Leo"), 2)) == 2


@pytest.mark.parametrize("kwargs", [
    {"orders": (MAX_ORDER + 1,)}, {"orders": ()}, {"orders": (1, 1)}, {"orders": (True,)},
    {"source": "bigtom"}, {"chains_per_order": 0},
    {"conditions": ("sleeping",)},
])
def test_bad_options_raise(kwargs):
    with pytest.raises(TomlensError):
        belief_statements(1, 0, **kwargs)


def test_a_third_agent_who_stays_hears_the_telling_in_text_and_labels():
    """The reviewer's case: a third agent who stayed, in an informed story. The text says it saw and
    heard everything after, and the tracker has it perceive the telling: it knows the protagonist
    was told, so "C thinks that P believes <new place>" is true."""
    for source in ("unexpected-transfer", "unexpected-contents"):
        stories = [s for s in _belief_stories(source, 8, 0) if s.condition == "informed"]
        stays = {t for t, third in third_agents(stories).items() if third.stays}
        rows = statements_for(stories, orders=(2,), claim="contents" if source.endswith("contents") else "transfer",
                              source=source)
        checked = 0
        for s in rows:
            if s.task_id not in stays or s.meta["chain_roles"] != ["third_agent", "protagonist"]:
                continue
            assert "seeing and hearing everything after" in s.text
            assert s.meta["chain_belief"] == s.meta["story_protagonist_belief"], s.id  # informed: knows
            assert s.meta["statement_literal_true"] == (s.meta["statement_place"] == s.meta["story_world_state"])
            checked += 1
        assert checked, source


def test_bystander_is_a_believer_only_where_the_story_names_them():
    from tomlens.stimuli.false_belief import unexpected_contents
    for gen in (unexpected_transfer, unexpected_contents):
        plain = [s for s in gen(8, seed=1, decoys=False) if s.prompt_type == "belief"]
        assert all(s.meta.get("bystander") for s in plain)
        rows = statements_for(plain, orders=(1,), claim="contents" if gen is unexpected_contents else "transfer")
        for s in rows:
            story = s.text.split("\nStatement:")[0]
            assert all(name in story for name in s.meta["chain"]), s.id  # nobody unnamed is asked about
            assert "bystander" not in s.meta["chain_roles"]
        thirds = third_agents(plain)
        assert all(thirds[s.task_id].name != s.meta["bystander"] for s in plain)
        decoy = [s for s in gen(4, seed=1) if s.prompt_type == "belief"]
        assert any("bystander" in s.meta["chain_roles"]
                   for s in statements_for(decoy, orders=(1,), claim="contents" if gen is unexpected_contents
                                           else "transfer"))


def test_contents_statements_record_their_place_mention():
    stories = _belief_stories("unexpected-contents", 2, 0)
    for s in statements_for(stories, orders=(0, 1), claim="contents"):
        place = s.spans["statement_place"]
        roles = [r for r in ("object", "location_1", "location_2") if place in s.mentions.get(r, ())]
        assert roles, s.id
        want = ("object", "location_2") if s.meta["statement_place"] == s.meta["story_world_state"] else ("location_1",)
        assert tuple(roles) == want, (s.id, roles)
