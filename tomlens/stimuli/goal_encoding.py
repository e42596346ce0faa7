"""Goal encoding after Woodward (1998), in the text form of Ruis et al. (2023).

An agent reaches k times for the same fruit on the same pillar (the other two fruits swap places),
then the goal fruit moves to another pillar and the prompt stops at the test reach. Continuing with
the goal fruit's new place is *object bias*; continuing with the habituated pillar (or the fruit now
standing on it) is *location bias*. A selective goal encoder shows object bias for an intending
agent and not for an inanimate mover or an agent acting by accident.

Every item (one `task_id`) is rendered in every cell: test case (animate / inanimate / control) x
k x target type (pillar / fruit) x animacy wording, from the same fruits, places and agent, so cells
can be compared item by item and animate vs control prompts form minimal pairs.

Wording. By default (`wording="ruis"`) the reach sentences are Ruis et al.'s: the animate agent
"grasps", the inanimate mover "moves to and touches", and the accidental agent "accidentally
grasps" the item on a pillar but "accidentally touches" a fruit (their Table: fruit control
"touches"). `wording="matched"` keeps tomlens's older same-length variant for minimal pairs: the
animate agent "deliberately grasps" and the control agent "accidentally grasps" for both target
types, one token each in SmolLM2's tokenizer, so animate and control prompts differ only in that
adverb (`make_pairs("goal-encoding")` asks for it). `animate_adverb` / `control_adverb` override the
adverb of either wording. With `manner_scope="all"` (R23) every reach sentence carries the case's
wording; with `manner_scope="test"` only the test reach does (the habituation reaches are plain
"grasps"), so animate and control prompts differ only inside the `contrast` span.

What the habituation reaches name. In Ruis et al.'s prompts a habituation reach names the kind of
thing the test asks for ("grasps the item on the first pillar" before a pillar question, "grasps the
kiwi" before a fruit question), so one option is repeated k times in the story: the habituated
pillar's ordinal (the location answer) or the goal fruit (the object answer). A model that copies the
word it has seen most, as small models readily do, then shows location bias on pillars and object
bias on fruits in every case, and a shortcut audit reads the keyed answer off the mention counts
alone. By default (`habituation_reach="crossed"`) a habituation reach names the other kind ("grasps
the kiwi" before a pillar question, "grasps the item on the first pillar" before a fruit question),
which identifies the same reach while every option is mentioned once per scene; `"ruis"` keeps the
paper's. Either way, reading the reach binds one answer to what was reached (that is what object
vs location bias is), so a single prompt's o_b is never evidence of goal encoding by itself: the
paradigm's test is the difference between test cases, whose prompts of one item share every word
but the agent's wording, their options and their option order.

Option order alternates within an item, from one (k, target type, animacy wording) cell to the next
(the three test cases of a cell share it, so they stay minimal pairs), and across items: an item's
answers sit in both positions, so a position preference averages out within items as well as over
them. For the same reason a scene lists the pillars from the first up in some cells and from the
third down in others (`meta["scene_order"]`), so which target a story names first or last varies
within an item too.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from typing import Literal

from tomlens.errors import TomlensError
from tomlens.stimuli.lexicon import NAMES, article
from tomlens.stimuli.records import Span, Stimulus
from tomlens.stimuli.shortcuts import Contrast, Rule

# Single-token fruits in common tokenizers, so first-token scores of the fruit targets differ.
FRUITS: tuple[str, ...] = (
    "kiwi", "orange", "fig", "pear", "plum", "lime", "peach", "mango", "lemon", "banana",
    "cherry", "grape", "apple", "papaya", "coconut",
)
# Things that can move to and touch an item without wanting it.
MOVERS: tuple[str, ...] = (
    "rod", "pole", "stick", "ball", "rock", "stone", "block", "brick", "cube", "pipe",
)
ORDINALS: tuple[str, str, str] = ("first", "second", "third")
# (habituated pillar, goal's new pillar): all six ordered pairs, cycled so targets spread evenly.
PLACEMENTS: tuple[tuple[int, int], ...] = ((0, 1), (0, 2), (1, 0), (1, 2), (2, 0), (2, 1))

TEST_CASES: tuple[str, ...] = ("animate", "inanimate", "control")
TARGET_TYPES: tuple[str, ...] = ("pillar", "fruit")
WORDINGS: tuple[str, ...] = ("ruis", "matched")
HABITUATION_REACHES: tuple[str, ...] = ("crossed", "ruis")
FAMILY = "goal-encoding"
MAX_K = 50


def goal_encoding(
    n: int = 20,
    seed: int = 0,
    ks: Sequence[int] | int = (0, 1, 2, 3, 4, 5, 6),
    *,
    test_cases: Sequence[str] = TEST_CASES,
    target_types: Sequence[str] = TARGET_TYPES,
    anim_denotations: Sequence[bool] | bool = (False, True),
    wording: Literal["ruis", "matched"] = "ruis",
    animate_adverb: str | None = None,
    control_adverb: str | None = None,
    manner_scope: Literal["all", "test"] = "all",
    habituation_reach: Literal["crossed", "ruis"] = "crossed",
) -> list[Stimulus]:
    """`n` items, each rendered in every cell (test case x k x target type x animacy wording).

    `options` = (object-bias target, location-bias target), reversed for every other item
    (`reversed=True` means the location target comes first). `answer` is the object-bias target:
    the goal-consistent option, which a selective goal encoder picks in the animate case (in the
    inanimate and control cases it is still the object target, so accuracy there reads as object
    bias, not as correctness). Pillar targets are ordinals ("first"/"second"/"third"), fruit
    targets are fruit names; the habituated and new pillars cycle through all six placements.
    `wording` picks the reach sentences (module docstring): Ruis et al.'s by default;
    `animate_adverb` / `control_adverb`, when given, replace that wording's adverbs.
    `habituation_reach` says what a habituation reach names (module docstring): "crossed" (the
    kind the test does not ask for, so no option is repeated) or "ruis" (the kind it asks for).
    The option order alternates from cell to cell within an item (module docstring).
    """
    ks = [ks] if isinstance(ks, int) else list(ks)
    test_cases = (test_cases,) if isinstance(test_cases, str) else tuple(test_cases)
    target_types = (target_types,) if isinstance(target_types, str) else tuple(target_types)
    anim_denotations = ((anim_denotations,) if isinstance(anim_denotations, bool)
                        else tuple(anim_denotations))
    _check(n, ks, test_cases, target_types, anim_denotations, manner_scope, wording, control_adverb)
    if habituation_reach not in HABITUATION_REACHES:
        raise TomlensError(f"habituation_reach={habituation_reach!r}",
                           "use 'crossed' (a reach names what the test does not ask for) or 'ruis' (the paper's)")
    if animate_adverb is None and wording == "matched":
        animate_adverb = "deliberately"
    if control_adverb is None:
        control_adverb = "accidentally"
    out: list[Stimulus] = []
    for i in range(n):
        item = _item(seed, i)
        for target_type in target_types:
            for anim in anim_denotations:
                for k in ks:
                    for test_case in test_cases:
                        out.append(
                            _render(item, seed, i, test_case, k, target_type, bool(anim),
                                    animate_adverb, control_adverb, manner_scope, wording, habituation_reach)
                        )
    return out


def _check(n, ks, test_cases, target_types, anim_denotations, manner_scope, wording,
           control_adverb) -> None:
    if not isinstance(n, int) or n < 1:
        raise TomlensError(f"goal-encoding needs n >= 1 items, got {n!r}", "pass n=1 or more")
    if (not ks or any(not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= MAX_K
                      for k in ks) or len(set(ks)) != len(ks)):
        raise TomlensError(
            f"habituation counts ks={list(ks)!r} must be distinct integers from 0 to {MAX_K}",
            "e.g. ks=(0, 1, 2, 3, 4, 5, 6)",
        )
    for name, values, allowed in (
        ("test_cases", test_cases, TEST_CASES), ("target_types", target_types, TARGET_TYPES),
    ):
        bad = [v for v in values if v not in allowed]
        if bad or not values:
            raise TomlensError(f"{name}={list(values)!r} is not a non-empty subset of {allowed}",
                               f"choose from {list(allowed)}")
    if not anim_denotations or any(not isinstance(a, bool) for a in anim_denotations):
        raise TomlensError(f"anim_denotations={list(anim_denotations)!r} must be booleans",
                           "use (False, True), (False,) or (True,)")
    if manner_scope not in ("all", "test"):
        raise TomlensError(f"manner_scope={manner_scope!r}", "use 'all' (R23) or 'test'")
    if wording not in WORDINGS:
        raise TomlensError(f"wording={wording!r}",
                           "use 'ruis' (Ruis et al.'s sentences) or 'matched' (same-length adverbs)")
    if control_adverb is not None and not control_adverb:
        raise TomlensError("control_adverb is empty", "use e.g. 'accidentally', or leave it out")


def _item(seed: int, i: int) -> dict:
    """One item's lexical choices and placements; depends only on (seed, i), so items of a
    smaller n are a prefix of a larger n."""
    rng = random.Random(f"goal-encoding/{seed}/{i}")
    goal, d1, d2 = rng.sample(FRUITS, 3)
    hab, new = PLACEMENTS[(i + seed) % len(PLACEMENTS)]
    third = 3 - hab - new
    # At test one distractor takes the habituated pillar, the other the remaining one.
    at_hab, at_third = (d1, d2) if rng.random() < 0.5 else (d2, d1)
    test_scene = [""] * 3
    test_scene[new], test_scene[hab], test_scene[third] = goal, at_hab, at_third
    return {
        "goal": goal, "distractors": (d1, d2), "hab": hab, "new": new,
        "test_scene": test_scene,
        "name": rng.choice(NAMES)[0],
        "mover": rng.choice(MOVERS),
        # The item's base option order alternates item by item, and over 12 items each placement
        # gets both orders; `_reversed` alternates it again from cell to cell within the item.
        "reversed": bool((i + i // len(PLACEMENTS)) % 2),
        "scene_flip": rng.random() < 0.5,  # drawn last: the draws above are the same as before it
    }


def _habituation_scene(item: dict, j: int) -> list[str]:
    scene = [""] * 3
    scene[item["hab"]] = item["goal"]
    others = [p for p in range(3) if p != item["hab"]]
    d1, d2 = item["distractors"] if j % 2 == 0 else item["distractors"][::-1]
    scene[others[0]], scene[others[1]] = d1, d2
    return scene


class _Text:
    """Builds a text piece by piece and remembers where named pieces landed."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.length = 0

    def add(self, piece: str) -> Span:
        span = Span(self.length, self.length + len(piece))
        self.parts.append(piece)
        self.length += len(piece)
        return span

    def text(self) -> str:
        return "".join(self.parts)


def _scene(t: _Text, fruits: list[str], descending: bool = False) -> tuple[list[Span], list[Span]]:
    """'There is a kiwi on the first pillar, an orange on the second pillar, and ...', or from the
    third pillar down when `descending`; the spans are indexed by pillar either way."""
    fruit_spans: list[Span] = [Span(0, 0)] * 3
    ordinal_spans: list[Span] = [Span(0, 0)] * 3
    for n, p in enumerate((2, 1, 0) if descending else (0, 1, 2)):
        t.add("There is " if n == 0 else (", and " if n == 2 else ", "))
        t.add(article(fruits[p]) + " ")
        fruit_spans[p] = t.add(fruits[p])
        t.add(" on the ")
        ordinal_spans[p] = t.add(ORDINALS[p])
        t.add(" pillar")
    t.add(".")
    return fruit_spans, ordinal_spans


def _descending(item: dict, target_type: str, anim: bool) -> bool:
    """Whether a cell's scenes list the pillars from the third down: alternated within an item (by
    target type and animacy wording) from the item's own random start, so which target a scene
    names first or last is no fixed cue of the answer's position, within an item or over items, and
    the scene order says nothing about the option order (a bag of words could read the one off the
    other if both followed the item's index)."""
    return item["scene_flip"] ^ bool((TARGET_TYPES.index(target_type) + int(anim)) % 2)


def _verb(test_case: str, target_type: str, wording: str) -> str:
    """The reach verb of an agent: Ruis et al.'s accidental agent "touches" a fruit target."""
    if test_case == "control" and target_type == "fruit" and wording == "ruis":
        return "touches"
    return "grasps"


def _agent(t: _Text, item: dict, test_case: str, anim: bool, adverb: str | None,
           verb: str = "grasps") -> Span:
    """The reach's subject and verb; returns the span of the agent word (name or mover)."""
    if test_case == "inanimate":
        t.add("An inanimate " if anim else article(item["mover"], capital=True) + " ")
        span = t.add(item["mover"])
        t.add(" moves to and touches")
        return span
    if anim:
        t.add("A person named ")
    span = t.add(item["name"])
    t.add(f" {adverb} {verb}" if adverb else f" {verb}")
    return span


def _reversed(item: dict, k: int, target_type: str, anim: bool) -> bool:
    """The option order of one cell: the item's base order, flipped for every other (k, target type,
    animacy wording) cell, so each item keys both positions; the test cases of a cell share it.
    Read from the cell's values, not its place in the request, so a cell's prompt is the same
    whichever other cells are generated."""
    return item["reversed"] ^ bool((k + TARGET_TYPES.index(target_type) + int(anim)) % 2)


def _habituation_object(item: dict, target_type: str, habituation_reach: str, scene: list[str]) -> str:
    """What a habituation reach names after "grasps": the habituated pillar or the goal fruit there."""
    names_pillar = (target_type == "pillar") == (habituation_reach == "ruis")
    return f" the item on the {ORDINALS[item['hab']]} pillar." if names_pillar else f" the {scene[item['hab']]}."


def _render(item: dict, seed: int, i: int, test_case: str, k: int, target_type: str, anim: bool,
            animate_adverb: str | None, control_adverb: str, manner_scope: str,
            wording: str, habituation_reach: str = "crossed") -> Stimulus:
    adverb = {"animate": animate_adverb, "control": control_adverb, "inanimate": None}[test_case]
    verb = _verb(test_case, target_type, wording)
    habituation_adverb = adverb if manner_scope == "all" else None
    habituation_verb = verb if manner_scope == "all" else "grasps"
    hab, new = item["hab"], item["new"]
    descending = _descending(item, target_type, anim)
    t = _Text()
    for j in range(k):
        scene = _habituation_scene(item, j)
        _scene(t, scene, descending)
        t.add(" ")
        _agent(t, item, test_case, anim, habituation_adverb, habituation_verb)
        t.add(_habituation_object(item, target_type, habituation_reach, scene))
        t.add("\n")
    fruit_spans, ordinal_spans = _scene(t, item["test_scene"], descending)
    t.add(" ")
    reach_start = t.length
    agent_span = _agent(t, item, test_case, anim, adverb, verb)
    t.add(" the item on the" if target_type == "pillar" else " the")
    reach = Span(reach_start, t.length)

    if target_type == "pillar":
        object_target, location_target = ORDINALS[new], ORDINALS[hab]
    else:
        object_target, location_target = item["goal"], item["test_scene"][hab]
    reversed_ = _reversed(item, k, target_type, anim)
    options = (location_target, object_target) if reversed_ else (object_target, location_target)
    template = f"{target_type}-{'anim' if anim else 'plain'}"
    task_id = f"goal-s{seed}-{i:04d}"
    return Stimulus(
        id=f"{task_id}-{test_case}-k{k}-{template}",
        text=t.text(),
        options=options,
        answer=object_target,
        family=FAMILY,
        task_id=task_id,
        template_id=template,
        condition=test_case,
        reversed=reversed_,
        prompt_type="goal",
        spans={
            "protagonist": agent_span,
            "object": fruit_spans[new],
            "location_1": ordinal_spans[hab],
            "location_2": ordinal_spans[new],
            "contrast": reach,
            "query": reach,
        },
        meta={
            "test_case": test_case,
            "k": k,
            "target_type": target_type,
            "anim_denotation": anim,
            "goal_object": item["goal"],
            "habituated_location": ORDINALS[hab],
            "goal_location": ORDINALS[new],
            "object_target": object_target,
            "location_target": location_target,
            "agent": item["mover"] if test_case == "inanimate" else item["name"],
            "manner": adverb,
            "manner_scope": manner_scope,
            "wording": wording,
            "reach_verb": "moves to and touches" if test_case == "inanimate" else verb,
            "habituation_reach": habituation_reach,
            "scene_order": "descending" if descending else "ascending",
            "test_scene": list(item["test_scene"]),
        },
    )


# ---- What the shortcut audit checks on this family (`tomlens.audit`) ---------------------------

_REACH = re.compile(r"(?:grasps|touches) the (?:item on the (\w+) pillar|(\w+))\.")


def _keyed_position(target_type: str):
    def label(s: Stimulus) -> int | None:
        return s.answer_index if s.meta.get("target_type") == target_type else None
    return label


def reach_named_option(s: Stimulus) -> int | None:
    """The option a habituation reach names, read from the text (None: the reaches name neither
    option, or there is none). With Ruis et al.'s reaches it is one option, repeated k times."""
    test_scene = s.text.rfind("There is")
    named = {a or b for a, b in _REACH.findall(s.text[: max(test_scene, 0)])}
    hits = [i for i, option in enumerate(s.options) if option in named]
    return hits[0] if len(hits) == 1 else None


CONTRASTS: tuple[Contrast, ...] = tuple(
    Contrast(f"goal object's option position, {tt} targets", _keyed_position(tt),
             f"which option is the goal object's ({tt} targets): the answer o_b counts as object bias. A surface "
             "cue that finds it explains a cell's o_b without any goal; the test cases of an item share their "
             "options and order, so no such cue explains a difference between cases", chance=0.5)
    for tt in TARGET_TYPES)
RULES: tuple[Rule, ...] = (
    Rule("option the habituation reaches name", reach_named_option,
         "the option named by the habituation reaches, k times over: a reader that copies the most repeated "
         "word gives it, the location answer on pillars and the object answer on fruits, with no goal"),
)
