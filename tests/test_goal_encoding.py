"""Goal encoding (Ruis et al. 2023 after Woodward 1998): cells, targets, habituations, pairs."""

from __future__ import annotations

import re
from collections import Counter

import pytest

from tomlens.errors import TomlensError
from tomlens.stimuli import generate, stimuli_hash
from tomlens.stimuli.goal_encoding import FRUITS, MOVERS, ORDINALS, goal_encoding

SCENE = re.compile(
    r"There is an? (\w+) on the (\w+) pillar, an? (\w+) on the (\w+) pillar, and an? (\w+) on the (\w+) pillar\."
)


def _parse(text: str):
    """Independent reading of a prompt: the scenes (fruits by pillar, whichever order a scene lists
    them in) and the habituation reaches."""
    scenes = []
    for m in SCENE.finditer(text):
        fruit_at = {m.group(2 * j + 2): m.group(2 * j + 1) for j in range(3)}
        assert list(fruit_at) in (list(ORDINALS), list(ORDINALS)[::-1])
        scenes.append([fruit_at[o] for o in ORDINALS])
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
        # the option order alternates from cell to cell within an item, shared by a cell's test cases
        assert Counter(s.answer_index for s in group) == {0: len(group) // 2, 1: len(group) // 2}
        by_cell = Counter((s.meta["k"], s.template_id, s.reversed) for s in group)
        assert len(by_cell) == len(ks) * 4 and set(by_cell.values()) == {3}
    assert all(s.prompt_type == "goal" and s.condition == s.meta["test_case"] for s in stims)


@pytest.mark.parametrize("habituation_reach", ["crossed", "ruis"])
def test_targets_are_the_object_and_location_bias_continuations(habituation_reach):
    for s in goal_encoding(12, 3, ks=(0, 2, 6), habituation_reach=habituation_reach):
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
        # Ruis et al.'s reaches name what the test asks for; crossed ones name the other kind
        names_pillar = (m["target_type"] == "pillar") == (habituation_reach == "ruis")
        for _scene, reach in zip(scenes[:-1], reaches, strict=True):
            assert reach == (ORDINALS[hab] if names_pillar else m["goal_object"])
        # the two other fruits swap from one habituation to the next
        for s1, s2 in zip(scenes[:-1], scenes[1:-1], strict=False):
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
        first = SCENE.search(s.text).group(2)
        assert first == ("third" if m["scene_order"] == "descending" else "first")


def test_scene_order_and_option_order_vary_within_an_item_and_independently():
    """Each item lists its pillars both ways and keys both option positions, and neither order
    follows the other: which target a scene names first is no cue of the answer's position."""
    stims = goal_encoding(24, 0, ks=(1, 2))
    for task in {s.task_id for s in stims}:
        group = [s for s in stims if s.task_id == task]
        assert Counter(s.meta["scene_order"] for s in group) == {"ascending": 12, "descending": 12}
        cell = {(s.meta["k"], s.template_id): (s.meta["scene_order"], s.reversed) for s in group}
        assert all(len({(x.meta["scene_order"], x.reversed) for x in group
                        if (x.meta["k"], x.template_id) == key}) == 1 for key in cell)  # a cell's cases agree
    joint = Counter((s.meta["scene_order"], s.reversed) for s in stims)
    assert len(joint) == 4 and max(joint.values()) <= 1.5 * min(joint.values())


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
                start = next(i for i, (x, y) in enumerate(zip(a, c, strict=False)) if x != y)
                span = s.spans["contrast"]
                assert span.start <= start and a[:span.start] == c[:span.start]
                assert s.text.count("accidentally") == 1
    matched = goal_encoding(1, 0, ks=(1,), wording="matched", animate_adverb=None,
                            test_cases=("animate",), target_types=("pillar",),
                            anim_denotations=(False,))
    (s,) = matched
    assert f"{s.meta['agent']} deliberately grasps the {s.meta['goal_object']}." in s.text
    (s,) = goal_encoding(1, 0, ks=(1,), animate_adverb="purposely", test_cases=("animate",),
                         target_types=("pillar",), anim_denotations=(False,))
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


def _mentions(s, option: str) -> int:
    return len(re.findall(rf"\b{option}\b", s.text[: s.spans["query"].start]))


def test_crossed_reaches_repeat_no_option_and_ruis_reaches_repeat_one():
    """By default no option is the word the habituation reaches repeat (every option is named once
    per scene); with Ruis et al.'s reaches one is, k more times: the ordinal of the habituated
    pillar (the location answer) or the goal fruit (the object answer)."""
    from tomlens.stimuli.goal_encoding import reach_named_option

    for s in goal_encoding(6, 5, ks=(0, 3)):
        k = s.meta["k"]
        assert [_mentions(s, o) for o in s.options] == [k + 1, k + 1]
        assert reach_named_option(s) is None and s.meta["habituation_reach"] == "crossed"
    for s in goal_encoding(6, 5, ks=(3,), habituation_reach="ruis"):
        repeated = s.meta["location_target"] if s.meta["target_type"] == "pillar" else s.meta["object_target"]
        assert _mentions(s, repeated) == 7 and reach_named_option(s) == s.options.index(repeated)
    with pytest.raises(TomlensError, match="habituation_reach"):
        goal_encoding(1, 0, habituation_reach="both")


def test_the_family_declares_its_audit_contrasts_and_rules():
    from tomlens.stimuli import goal_encoding as module

    stims = goal_encoding(12, 0, ks=(1, 2))
    for contrast in module.CONTRASTS:
        labels = [contrast.label(s) for s in stims]
        kept = [x for x in labels if x is not None]
        assert len(kept) == len(stims) // 2 and Counter(kept) == {0: len(kept) // 2, 1: len(kept) // 2}
        assert contrast.chance == 0.5
    (rule,) = module.RULES
    assert {rule.feature(s) for s in stims} == {None}
    ruis = goal_encoding(12, 0, ks=(2,), habituation_reach="ruis")
    pillar, fruit = (module.CONTRASTS[i] for i in (0, 1))
    # on Ruis et al.'s reaches the rule gives the keyed answer away: never on pillars, always on fruits
    assert all(rule.feature(s) != pillar.label(s) for s in ruis if pillar.label(s) is not None)
    assert all(rule.feature(s) == fruit.label(s) for s in ruis if fruit.label(s) is not None)
