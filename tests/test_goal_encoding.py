"""Goal encoding (Ruis et al. 2023 after Woodward 1998): cells, targets, habituations, pairs."""

from __future__ import annotations

import re
from collections import Counter

import pytest

from tomlens.errors import TomlensError
from tomlens.stimuli import generate, stimuli_hash
from tomlens.stimuli.goal_encoding import FRUITS, MOVERS, ORDINALS, goal_encoding

SCENE = re.compile(
    r"There is an? (\w+) on the first pillar, an? (\w+) on the second pillar, and an? (\w+) on "
    r"the third pillar\."
)


def _parse(text: str):
    """Independent reading of a prompt: the scenes and the habituation reaches."""
    scenes = [list(m.groups()) for m in SCENE.finditer(text)]
    reaches = re.findall(r"(?:grasps|touches) the (?:item on the (\w+) pillar|(\w+))\.", text)
    return scenes, [a or b for a, b in reaches]


def test_deterministic_and_seed_dependent():
    a = goal_encoding(4, 7, ks=(0, 3))
    assert stimuli_hash(a) == stimuli_hash(goal_encoding(4, 7, ks=(0, 3)))
    assert stimuli_hash(a) != stimuli_hash(goal_encoding(4, 8, ks=(0, 3)))
    # items of a smaller n are a prefix of a larger n
    small = goal_encoding(2, 7, ks=(0, 3))
    assert [s for s in a if s.task_id in {x.task_id for x in small}] == small
    assert generate("goal-encoding", n=4, seed=7, ks=(0, 3)) == a


def test_counts_per_cell_and_shared_task_ids():
    n, ks = 6, (0, 1, 2, 3, 4, 5, 6)
    stims = goal_encoding(n, 0, ks=ks)
    assert len(stims) == n * 3 * len(ks) * 2 * 2
    cells = Counter((s.meta["test_case"], s.meta["k"], s.meta["target_type"],
                     s.meta["anim_denotation"]) for s in stims)
    assert len(cells) == 3 * len(ks) * 4 and set(cells.values()) == {n}
    assert len({s.id for s in stims}) == len(stims)
    assert len({s.task_id for s in stims}) == n
    for task in {s.task_id for s in stims}:
        group = [s for s in stims if s.task_id == task]
        assert len(group) == 3 * len(ks) * 4
        assert len({s.meta["goal_object"] for s in group}) == 1
        assert len({s.meta["habituated_location"] for s in group}) == 1
        assert len({s.reversed for s in group}) == 1
    assert all(s.prompt_type == "goal" and s.condition == s.meta["test_case"] for s in stims)


def test_targets_are_the_object_and_location_bias_continuations():
    for s in goal_encoding(12, 3, ks=(0, 2, 6)):
        m = s.meta
        scenes, reaches = _parse(s.text)
        assert len(scenes) == m["k"] + 1 and len(reaches) == m["k"]
        test = scenes[-1]
        hab = ORDINALS.index(m["habituated_location"])
        goal_at = test.index(m["goal_object"])
        assert goal_at != hab and ORDINALS[goal_at] == m["goal_location"]
        if m["target_type"] == "pillar":
            assert m["object_target"] == ORDINALS[goal_at]
            assert m["location_target"] == ORDINALS[hab]
            assert s.text.endswith(" the item on the")
        else:
            assert m["object_target"] == m["goal_object"]
            assert m["location_target"] == test[hab] != m["goal_object"]
            assert s.text.endswith(" the") and not s.text.endswith("on the")
        assert s.answer == m["object_target"]
        assert set(s.options) == {m["object_target"], m["location_target"]}
        assert s.options[0] == (m["location_target"] if s.reversed else m["object_target"])
        # habituations: goal always on the habituated pillar, reached there
        for scene in scenes[:-1]:
            assert scene[hab] == m["goal_object"]
        for scene, reach in zip(scenes[:-1], reaches):
            assert reach == (ORDINALS[hab] if m["target_type"] == "pillar" else m["goal_object"])
        # the two other fruits swap from one habituation to the next
        for s1, s2 in zip(scenes[:-1], scenes[1:-1]):
            others = [p for p in range(3) if p != hab]
            assert [s1[p] for p in others] == [s2[p] for p in others][::-1]
        assert all(f in FRUITS for f in test)
        # spans
        assert s.span_text("object") == m["goal_object"]
        assert s.span_text("location_1") == m["habituated_location"]
        assert s.span_text("location_2") == m["goal_location"]
        assert s.span_text("protagonist") == m["agent"]
        assert s.spans["contrast"].end == len(s.text) == s.spans["query"].end
        assert s.spans["object"].start > s.text.rfind("There is")


def test_k0_has_no_habituation_sentences():
    for s in goal_encoding(5, 1, ks=(0,)):
        assert s.text.count("There is") == 1 and s.text.count(".") == 1
        assert s.spans["protagonist"].start > s.spans["location_2"].start


def test_targets_spread_evenly_and_options_counterbalanced():
    stims = [s for s in goal_encoding(12, 0, ks=(1,)) if s.condition == "animate"
             and s.meta["target_type"] == "pillar" and not s.meta["anim_denotation"]]
    assert Counter(s.meta["object_target"] for s in stims) == {o: 4 for o in ORDINALS}
    assert Counter(s.meta["location_target"] for s in stims) == {o: 4 for o in ORDINALS}
    assert Counter(s.answer_index for s in stims) == {0: 6, 1: 6}
    placements = Counter((s.meta["habituated_location"], s.meta["goal_location"], s.reversed)
                         for s in stims)
    assert len(placements) == 12  # each of the 6 placements in both option orders


def test_agent_wording_per_test_case_is_ruis_by_default():
    stims = goal_encoding(3, 0, ks=(2,))
    assert not any("deliberately" in s.text for s in stims)
    for s in stims:
        reach = s.span_text("contrast")
        anim, agent = s.meta["anim_denotation"], s.meta["agent"]
        assert s.meta["wording"] == "ruis"
        if s.condition == "inanimate":
            assert agent in MOVERS
            assert reach.startswith("An inanimate " if anim else "A")
            assert "moves to and touches" in reach
            continue
        assert reach.startswith("A person named " if anim else agent)
        if s.condition == "animate":
            assert f"{agent} grasps" in reach and s.meta["manner"] is None
            assert s.text.count(f"{agent} grasps") == 3  # every reach, habituations included
        else:  # R23: the accidental agent touches a fruit but grasps the item on a pillar
            verb = "touches" if s.meta["target_type"] == "fruit" else "grasps"
            assert f"{agent} accidentally {verb}" in reach and s.meta["reach_verb"] == verb
            assert s.text.count(f"accidentally {verb}") == 3


def test_r23_table_sentences_word_for_word():
    """The four test-reach sentences of Ruis et al.'s table, with Wendy and a kiwi or the first pillar."""
    stims = goal_encoding(12, 0, ks=(0,))
    seen = set()
    for s in stims:
        if s.condition == "inanimate":
            continue
        m = s.meta
        reach = s.span_text("contrast").replace(m["agent"], "Wendy")
        head = ("A person named Wendy" if m["anim_denotation"] else "Wendy")
        if s.condition == "animate":
            want = f"{head} grasps the"
        elif m["target_type"] == "fruit":
            want = f"{head} accidentally touches the"
        else:
            want = f"{head} accidentally grasps the"
        assert reach == want + (" item on the" if m["target_type"] == "pillar" else "")
        seen.add((s.condition, m["target_type"], m["anim_denotation"]))
    assert len(seen) == 8


def test_animate_control_pairs_differ_by_one_same_length_word_with_matched_wording():
    stims = goal_encoding(4, 2, ks=(0, 3), wording="matched")
    key = lambda s: (s.task_id, s.meta["k"], s.template_id)  # noqa: E731
    animate = {key(s): s for s in stims if s.condition == "animate"}
    for s in stims:
        if s.condition != "control":
            continue
        a = animate[key(s)]
        assert a.options == s.options and a.answer == s.answer
        assert len(a.text) == len(s.text)
        assert a.text.replace("deliberately", "accidentally") == s.text
        assert a.spans == s.spans
        assert "touches" not in s.text


def test_manner_scope_test_and_adverb_overrides():
    for wording in ("ruis", "matched"):
        stims = goal_encoding(2, 0, ks=(3,), manner_scope="test", wording=wording)
        key = lambda s: (s.task_id, s.template_id)  # noqa: E731
        animate = {key(s): s for s in stims if s.condition == "animate"}
        for s in stims:
            if s.condition == "control":
                a, c = animate[key(s)].text, s.text
                # the texts agree up to the test reach, which lies inside the contrast span
                start = next(i for i, (x, y) in enumerate(zip(a, c)) if x != y)
                span = s.spans["contrast"]
                assert span.start <= start and a[:span.start] == c[:span.start]
                assert s.text.count("accidentally") == 1
    matched = goal_encoding(1, 0, ks=(1,), wording="matched", animate_adverb=None,
                            test_cases=("animate",), target_types=("fruit",),
                            anim_denotations=(False,))
    (s,) = matched
    assert f"{s.meta['agent']} deliberately grasps the {s.meta['goal_object']}." in s.text
    (s,) = goal_encoding(1, 0, ks=(1,), animate_adverb="purposely", test_cases=("animate",),
                         target_types=("fruit",), anim_denotations=(False,))
    assert f"{s.meta['agent']} purposely grasps the {s.meta['goal_object']}." in s.text
    assert goal_encoding(1, 0, ks=2, test_cases="control", target_types="pillar",
                         anim_denotations=True) == [
        x for x in goal_encoding(1, 0, ks=(2,)) if x.condition == "control"
        and x.template_id == "pillar-anim"]


@pytest.mark.parametrize("kwargs", [
    {"n": 0}, {"ks": (-1,)}, {"ks": ()}, {"ks": (1, 1)}, {"ks": (1.5,)}, {"test_cases": ("robot",)},
    {"target_types": ("shelf",)}, {"anim_denotations": ("yes",)}, {"manner_scope": "some"},
    {"wording": "woodward"}, {"control_adverb": ""},
])
def test_bad_options_raise(kwargs):
    args = {"n": 2, "seed": 0, **kwargs}
    with pytest.raises(TomlensError):
        goal_encoding(**args)
