"""The developmental battery after Kosoy et al. (2023): classic child-development tasks as
forced-choice prompts, with the project's own text, characters and objects.

Why one family (`kosoy`, with a `tasks` option) rather than one family per task: the paper's unit
is the battery. Its rule (a task scores only when its control question is right) and its table
(cells grouped into four domains, ToM beside the non-ToM domains) need every task in one behaviour
table and one summary; `tomlens stimuli kosoy --tasks sally-anne` still selects a single task.

Every item is rendered in every condition of its task from the same words (so conditions of an
item are minimal pairs), and every story has one *test* question and one or two *control*
questions (reality / memory), each its own prompt that shares the story text up to the question,
so `story_id` links them in the behaviour table and `meta` links them by id (`test_id`,
`control_ids`). `meta["question"]` is "test" or "control"; `meta["control_kind"]` "reality" or
"memory". No control asks about anyone's mind (the test is a story's only belief question): the
controls ask where things are or were, what a container holds or shows on the outside, what
happened first, so gating on them checks the reading, not the answer the test asks for.

Cells (the `condition` of a prompt; the paper's Table rows, and the order twins):
- ToM: `sally-anne` (false belief: the owner goes off, then the other moves the object);
  Ullman's four alterations, true belief in the paper's reading: `ullman-transparent` (the
  containers have clear walls and the owner, still out, looks in through the window after the
  move), `ullman-relationship-change` (the container that holds the object is lifted onto the
  floor while the owner is away, the object still inside; its reality question asks which
  container is on the floor), `ullman-trusted-communication` (the mover phones the owner, who
  trusts them, and tells where the object is), `ullman-additional-actor` (the question asks about
  the mover, who knows); the paper gives no item details, so these readings are tomlens's own.
  `smarties` (unexpected contents: a sweets container holding other things; what will a newcomer
  think is inside?).
  Each has a twin (`TWINS`) with the same sentences in another order (or, in Sally-Anne's group,
  the other two roles), whose answer is the other option: the look, the call or the lift before
  the move, the newcomer in the room when the container is opened, the other character away while
  the owner moves the object. Every sentence after the first starts with "Then", so a twin changes
  no word and no n-gram but those spanning two sentences, and those only across names drawn from
  one pool: no word, length or cue position tells false from true belief (`tomlens audit kosoy`).
- Object and action: `object-permanence` (which of two toys is behind the screen: the one it hid,
  or the one that rolled out through the door), `addition` (Wynn's 1 + 1 and 2 - 1 behind a screen,
  two stories per item, with two kinds of bird: the number of the kind asked about), `rational-action`
  (Gergely: is a jump to the goal sensible? yes with a wall between the circles, no without one;
  wall and question polarity crossed), `woodward` (goal encoding with a human actor, wrapping
  `goal_encoding`) and `woodward-nonhuman` (the same with an inanimate mover: the paper's
  comparison; there "correct" reads as object bias, not as a right answer).
- Social: `helper-hinderer`; Warneken & Tomasello's altruism (Exp. 9), `altruism-out-of-reach` and
  `altruism-physical-obstacle`: one thing reaches its outcome by accident and another on purpose in
  every story (dropped out of reach; a cupboard door shut), in either order; should you help with
  the one asked about? Yes for the accident, no for the deliberate one.
- Causal: `gears-a-pushes-b`, `gears-symbiotic`, `blicket-categorisation`, `blicket-induction`,
  and Lucas et al.'s `lucas-{given,open}-{conjunctive,disjunctive}` (the same ambiguous test evidence
  in every cell, whose answer flips with the trained rule: `lucas_members` derives it).

Pairs-only twins (`PAIR_CELLS`, option `witnessed=True`; `minimal_pairs` for patching):
`sally-anne-witnessed` (the move, then the owner goes off: the two sentences swapped, which is the
pair's contrast span) and `smarties-looked` (the newcomer has already looked inside: one word).
Each has the same test question and options as its false-belief cell and is not a paper cell.

Labels. ToM prompts: `world_state` = where the object is (or what the container holds),
`protagonist_belief` = the belief of the character the test question asks about (the owner, or the
mover in `ullman-additional-actor`), `reference_state` = the starting location (or the label).
Non-ToM prompts have no mind at stake: `protagonist_belief` is None and `world_state` is the fact
the test question turns on (documented per task in `WORLD_FACTS`). Woodward prompts keep
goal-encoding's labels in `meta["woodward"]` (not at the top level, so goal-encoding's own
aggregates never mix these rows into their cells).

Renaming against contamination (the paper renamed Sally-Anne "Rose-Eliza" and the blicket
"Zerpda"): `rename` (default: `seed`) picks every name and object; `meta["rename"]` records the
mapping from the classic item's words to the ones used. No pool holds a classic word (`CLASSIC_WORDS`:
the originals' names and objects, and the paper's own renaming), and a draw that would use one is
rejected. Structure (option order, name and container order, which block, gear, toy or bird is asked
about, question polarity, which step a control asks about) comes from `seed` in blocks of 8 items,
each exactly balanced; every fixed answer word (yes/no, floor/table, spun/stayed still) has a twin question with
the other answer. The option orders of a story's test and controls are drawn crossed (`_cross`), so
always picking the first option passes 0.5 ** (1 + controls) of stories, as guessing does, and half
of the stories whose controls it passes. Whatever a control asks about (the first or the second
block, the hidden toy or the one that left) is tied into the same crossings, so the option a story
names first, last or most is the keyed one in exactly half of each task's prompts.

The audit (`CONTRASTS`, `RULES` at the end): the ToM test's keyed answer (the start or the label vs
the other option), a paper cell vs its twin, every yes/no test's answer, altruism's accident vs
purpose, addition's number; and the rules a reviewer would try (the one asked is the owner, is named
first, is named in the last sentence), each balanced by design within every task.
"""

from __future__ import annotations

import difflib
import itertools
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tomlens.errors import TomlensError
from tomlens.stimuli import lexicon
from tomlens.stimuli.false_belief import balanced_flags
from tomlens.stimuli.records import Span, Stimulus, find_mentions
from tomlens.stimuli.shortcuts import Contrast, Rule

FAMILY = "kosoy"
BLOCK = 8

# task -> (domain, Kosoy et al.'s experiment number, its cells in table order)
TASKS: dict[str, tuple[str, int, tuple[str, ...]]] = {
    "object-permanence": ("object", 1, ("object-permanence",)),
    "addition": ("object", 2, ("addition",)),
    "rational-action": ("object", 3, ("rational-action",)),
    "woodward": ("object", 4, ("woodward", "woodward-nonhuman")),
    "sally-anne": ("tom", 5, ("sally-anne", "sally-anne-twin")),
    "ullman": ("tom", 6, ("ullman-transparent", "ullman-transparent-twin", "ullman-relationship-change",
                          "ullman-relationship-change-twin", "ullman-trusted-communication",
                          "ullman-trusted-communication-twin", "ullman-additional-actor",
                          "ullman-additional-actor-twin")),
    "smarties": ("tom", 7, ("smarties", "smarties-twin")),
    "helper-hinderer": ("social", 8, ("helper-hinderer",)),
    "altruism": ("social", 9, ("altruism-out-of-reach", "altruism-physical-obstacle")),
    "gears": ("causal", 10, ("gears-a-pushes-b", "gears-symbiotic")),
    "blicket": ("causal", 11, ("blicket-categorisation", "blicket-induction")),
    "lucas": ("causal", 12, ("lucas-given-conjunctive", "lucas-given-disjunctive",
                             "lucas-open-conjunctive", "lucas-open-disjunctive")),
}
# Order twins: the same sentences as a paper's ToM cell in another order, which flips the keyed
# answer (twin -> (the paper's cell, what the order changes)). Not the paper's cells: they are there
# so that no word, n-gram or length tells false from true belief (every ingredient of Ullman's
# alterations, a phone call, clear walls, a lifted container, occurs in both), and so that always
# answering the start location (or the label) fails half of the ToM stories.
TWINS: dict[str, tuple[str, str]] = {
    "sally-anne-twin": ("sally-anne", "the other character goes off and the owner moves the object herself: "
                        "true belief (the same sentences as the additional actor's twin, asked of the owner)"),
    "ullman-transparent-twin": ("ullman-transparent", "the owner looks in before the move, not after it: false belief"),
    "ullman-relationship-change-twin": ("ullman-relationship-change", "the container is lifted before the owner "
                                        "goes off and the object moved after: false belief"),
    "ullman-trusted-communication-twin": ("ullman-trusted-communication", "the call comes before the move, not "
                                          "after it: false belief"),
    "ullman-additional-actor-twin": ("ullman-additional-actor", "the other character, not the owner, goes off, "
                                     "and the owner moves the object: the one asked was away, false belief"),
    "smarties-twin": ("smarties", "the newcomer walks in before the container is opened: true belief"),
}
DOMAINS: tuple[str, ...] = ("object", "tom", "social", "causal")
# Tasks whose every item is told as more than one story of its cell: Wynn's 1 + 1 and 2 - 1.
VARIANTS: dict[str, tuple[str, ...]] = {"addition": ("1+1", "2-1")}
CELLS: dict[str, str] = {cell: task for task, (_, _, cells) in TASKS.items() for cell in cells}
# Cells whose "correct" is a bias, not a right answer (kept out of domain means).
COMPARISON_CELLS: frozenset[str] = frozenset({"woodward-nonhuman"})
WORLD_FACTS: dict[str, str] = {
    "object-permanence": "the toy the screen hid (the one still behind it)",
    "addition": "the number of birds of the kind asked about behind the screen ('one' or 'two')",
    "rational-action": "'sensible' or 'pointless': whether the jump makes sense (a wall between the circles or not)",
    "helper-hinderer": "the helper's shape",
    "altruism": "the thing (the cupboard's colour) that met its outcome by accident: the one to help with",
    "gears": "the driving gear's colour ('both' when each needs the other)",
    "blicket": "the nonce word's members: the colour of the block asked about and whether it is one",
    "lucas": "the trained rule ('conjunctive' or 'disjunctive'), which decides the ambiguous block",
}

# The classic items' own words (and the paper's renaming, Rose-Eliza and Zerpda): no pool of this
# family holds them, and a draw that would use one is rejected, so a renamed item never leaks the
# text a model may have memorised.
CLASSIC_WORDS: frozenset[str] = frozenset({
    "sally", "anne", "rose", "eliza", "marble", "basket", "box", "smarties", "candy", "candies", "tube",
    "pencil", "car", "curtain", "blicket", "zerpda", "marker", "clothespin", "cabinet", "magazine"})


def is_classic(word: str) -> bool:
    """Whether `word` (any case, singular or plural) is one of the classic items' words."""
    w = word.lower()
    return any(x in CLASSIC_WORDS for x in (w, w[:-1] if w.endswith("s") else w, w[:-2] if w.endswith("es") else w))


def _clean(pool: Sequence[Any]) -> tuple[Any, ...]:
    return tuple(x for x in pool if not is_classic(x[0] if isinstance(x, tuple) else x))


PEOPLE: tuple[tuple[str, str, str, str], ...] = _clean(lexicon.NAMES)
OBJECTS: tuple[str, ...] = _clean(lexicon.TRANSFER_OBJECTS)
# Words of the classic items, so `meta["rename"]` can say what each became.
TRANSFER_CONTAINERS: tuple[str, ...] = ("tub", "bin", "bucket", "case", "jar", "crate", "hamper")
SWEETS: tuple[str, ...] = ("sweets", "toffees", "chocolates", "mints", "jellies", "gumdrops")
NON_FOOD: tuple[str, ...] = ("crayons", "buttons", "pins", "coins", "beads", "screws", "shells")
SWEET_CONTAINERS: tuple[str, ...] = ("tin", "packet", "carton", "pouch", "jar")
ROLLING_TOYS: tuple[str, ...] = ("truck", "train", "bus", "van", "tractor", "scooter", "ball", "hoop")
BIRDS: tuple[str, ...] = ("sparrow", "robin", "finch", "pigeon", "crow", "duck", "owl", "wren")
BARRIERS: tuple[str, ...] = ("wall", "fence", "hedge", "ridge")
LANDMARKS: tuple[str, ...] = ("flag", "tree", "lamp", "post")
COLOURS: tuple[str, ...] = ("red", "blue", "green", "yellow", "purple", "orange", "pink", "brown")
SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "star", "diamond")
# Warneken & Tomasello's helping items (a marker, clothespins, a cabinet, magazines) renamed.
TOOLS: tuple[str, ...] = ("crayon", "ruler", "brush", "eraser", "stamp", "sponge", "stapler", "ribbon")
CARRIED: tuple[str, ...] = ("books", "towels", "plates", "blankets", "folders", "cushions")
# Nonce words for "blicket" (the paper's renaming used "Zerpda"); the project's own.
NONCE: tuple[str, ...] = ("vorp", "tazzle", "mudge", "frell", "plimset", "quorn", "snib", "gorple")


@dataclass(frozen=True)
class _Q:
    """One question of a story: its kind, text, options and answer."""

    kind: str  # "test" | "reality" | "memory"
    text: str
    options: tuple[str, str]
    answer: str


def _order(pair: tuple[str, str], swap: bool) -> tuple[str, str]:
    return (pair[1], pair[0]) if swap else pair


def _pick(rng: random.Random, pool: Sequence[Any], k: int = 1) -> list[Any]:
    return rng.sample(list(pool), k)


def _balanced_flag(task: str, seed: int, i: int, what: str) -> bool:
    """A flag for item i, exactly balanced within each block of 8 items of a task."""
    block, pos = divmod(i, BLOCK)
    return balanced_flags(random.Random(f"{FAMILY}/{task}/{what}/{seed}/{block}"), BLOCK)[pos]


def _cross(task: str, seed: int, i: int, what: str, k: int) -> tuple[bool, ...]:
    """k flags for item i from a full crossing (k <= 3), each combination equally often within each
    block of 8 items of a task, so no flag predicts another (e.g. the test's option order says
    nothing about the controls', and a question's polarity nothing about which gear it asks about)."""
    block, pos = divmod(i, BLOCK)
    combos = list(itertools.product((False, True), repeat=k)) * (BLOCK // 2 ** k)
    random.Random(f"{FAMILY}/{task}/{what}/{seed}/{block}").shuffle(combos)
    return combos[pos]


def _first(answer: str, other: str, swap: bool) -> tuple[tuple[str, str], str]:
    """Options with the answer first unless `swap`: the answer's position is then the flag itself."""
    return _order((answer, other), swap), answer


def _yes_no(answer_yes: bool, swap: bool) -> tuple[tuple[str, str], str]:
    """Yes/no options with the right answer second when `swap`, so its position stays balanced
    whichever of yes or no is right."""
    ans, other = ("yes", "no") if answer_yes else ("no", "yes")
    return _order((ans, other), swap), ans


# --- the stories ------------------------------------------------------------------------------
# Each renderer takes (cell, words, option flags, item, seed): `sw[0]` orders the test's options and
# `sw[1:]` each control's, drawn crossed by `_build`.


def _a(word: str, capital: bool = False) -> str:
    """`word` with its article ("a tub", "an orange square"), for every slot a pool fills."""
    return f"{lexicon.article(word, capital)} {word}"


def _twin(cell: str) -> tuple[str, bool]:
    """(the paper's cell a cell renders, whether it is that cell's order twin)."""
    return (TWINS[cell][0], True) if cell in TWINS else (cell, False)


# The transfer story's sentences. Every sentence after the first starts with "Then", so reordering
# them (a cell and its twin) changes no word and no n-gram except across the names, which are
# drawn from one pool for owner and mover alike.
def _transfer_sentences(w: dict[str, Any], names_first: bool, start_first: bool, clear: bool) -> dict[str, str]:
    P, A, obj, L1, L2 = w["P"], w["A"], w["obj"], w["L1"], w["L2"]
    X, Y = (P, A) if names_first else (A, P)
    La, Lb = (L1, L2) if start_first else (L2, L1)
    walls = " with clear walls" if clear else ""
    return {
        "room": f"{X[0]} and {Y[0]} are in the {w['room']}, where {_a(La)} and {_a(Lb)}{walls} stand on the table.",
        "put": f"Then {P[0]} puts {P[3]} {obj} in the {L1}.",
        "depart": f"Then {P[0]} goes off to {w['place']}.",
        "move": f"Then {A[0]} takes the {obj} out of the {L1} and puts it in the {L2}.",
        # the additional actor's twin: the same sentences with the other two roles swapped (the
        # other character goes off and comes back, the owner moves the object herself)
        "depart_other": f"Then {A[0]} goes off to {w['place']}.",
        "move_own": f"Then {P[0]} takes the {obj} out of the {L1} and puts it in the {L2}.",
        "return_other": f"Then {A[0]} comes back to the {w['room']}, where {P[0]} is sitting.",
        # both characters in the last sentence, so "the one asked is named last" tells nothing
        "return": f"Then {P[0]} comes back to the {w['room']}, where {A[0]} is sitting.",
        "call": f"Then {A[0]} phones {P[0]}, who trusts {A[2]} completely, and tells {P[2]} where the {obj} is.",
        "lift": f"Then {A[0]} lifts the container that holds the {obj} and sets it down on the floor, "
                f"with the {obj} still inside.",
        # ends on a word no other sentence ends on: the same word before "Then" in both orders
        "look": f"Then {P[0]} looks in at the table through the window.",
        # the transparent cells' last sentence in both orders (the owner stays out of the room)
        "bench": f"Then {P[0]} sits down on a bench by the road.",
    }


# cell -> (sentence order after "room" and "put", the sentence that carries the cell's contrast, or
# the first and last of the sentences it spans).
# The paper's cell and its twin use the same sentences; only the order differs, and with it whether
# the owner saw (or was told about) the move. The pairs-only witnessed twin swaps one sentence.
TRANSFER_ORDERS: dict[str, tuple[tuple[str, ...], str | tuple[str, str]]] = {  # (order, contrast sentence(s))
    "sally-anne": (("depart", "move", "return"), "move"),  # the move while the owner is away
    # the other character goes off and the owner moves the object herself: she knows
    "sally-anne-twin": (("depart_other", "move_own", "return_other"), "move_own"),
    # pairs-only: Sally-Anne with the move before the owner goes off (the two sentences swapped,
    # which is the pair's contrast span)
    "sally-anne-witnessed": (("move", "depart", "return"), ("move", "depart")),
    # asked about the mover, who knows: Sally-Anne's own text with another question
    "ullman-additional-actor": (("depart", "move", "return"), "move"),
    # asked about the other character, who is away while the owner moves the object
    "ullman-additional-actor-twin": (("depart_other", "move_own", "return_other"), "move_own"),
    "ullman-transparent": (("depart", "move", "look", "bench"), "look"),  # looks in through clear walls after the move
    "ullman-transparent-twin": (("depart", "look", "move", "bench"), "look"),  # ... before it
    "ullman-relationship-change": (("move", "depart", "lift", "return"), "lift"),  # container moved, object inside
    "ullman-relationship-change-twin": (("lift", "depart", "move", "return"), "lift"),
    "ullman-trusted-communication": (("depart", "move", "call", "return"), "call"),  # told after the move
    "ullman-trusted-communication-twin": (("depart", "call", "move", "return"), "call"),  # told before it
}


def _transfer(cell, w, sw, i, seed):
    """Sally-Anne, Ullman's alterations and their twins (see TRANSFER_ORDERS). Sally-Anne's group is
    a 2 x 2: the owner goes off while the other moves the object, or the other goes off while the
    owner moves it, asked of either (Sally-Anne, its twin, the additional actor, its twin), so who
    leaves, who moves and who is asked each say nothing about the answer alone. The room sentence's
    name order and container order come from a crossed plan, so neither the first name nor the
    first container says who is asked or which is right."""
    P, A, obj, L1, L2 = w["P"], w["A"], w["obj"], w["L1"], w["L2"]
    task = "sally-anne" if cell.startswith("sally-anne") else "ullman"
    names_first, start_first, memory_probe = _cross(task, seed, i, "listing", 3)
    base, _ = _twin(cell)
    order, contrast = TRANSFER_ORDERS[cell]
    text = _transfer_sentences(w, names_first, start_first, base == "ullman-transparent")
    keys = ("room", "put", *order)
    s = [text[k] for k in keys]
    # who asks, who moved the object, who went off: the one asked knows where it is if they moved it,
    # were there when it moved, or learnt of it afterwards (a trusted call, a look through clear walls)
    queried = A if base == "ullman-additional-actor" else P
    move_key = next(k for k in keys if k in ("move", "move_own"))
    mover = P if move_key == "move_own" else A
    gone, left = (P, "depart") if "depart" in keys else (A, "depart_other")
    there = queried is mover or queried is not gone or keys.index(left) > keys.index(move_key)
    told = "call" in keys and keys.index("call") > keys.index(move_key)
    looked = "look" in keys and keys.index("look") > keys.index(move_key)
    belief = L2 if there or told or looked else L1
    ask = (f"Right now, {queried[0]} thinks the {obj} is in the" if base == "ullman-transparent"
           else f"{queried[0]} will look for the {obj} in the")
    # every cell of an item, twins included, has the same options (start location first unless
    # swapped), so a cell and its twin differ in the story only and pair for patching
    test_options = (_order((L1, L2), sw[0]), belief)
    extra: dict[str, Any] = {}
    if base == "ullman-relationship-change":
        # which container is on the floor (the one the object was in when it was lifted); the
        # question asks about either, half each, so "floor" is the answer half the time
        lifted = L2 if keys.index("lift") > keys.index("move") else L1
        on_floor = _balanced_flag("ullman", seed, i, "reality_probe")
        box = lifted if on_floor else (L1 if lifted == L2 else L2)
        reality = _Q("reality", f"Right now, the {box} is on the",
                     *_first("floor" if on_floor else "table", "table" if on_floor else "floor", sw[1]))
        extra["reality_probe"] = box
    else:
        reality = _Q("reality", f"Right now, the {obj} is in the", *_first(L2, L1, sw[1]))
    memory = _Q("memory", f"At the start, {P[0]} put the {obj} in the", *_first(L1, L2, sw[2]))
    if base == "ullman-relationship-change" and memory_probe:
        # its reality question asks about floor and table, so half its memory questions ask where
        # the object ended up: the start container is then the answer half the time, as elsewhere
        memory = _Q("memory", f"In the end, the {obj} is inside the", *_first(L2, L1, sw[2]))
    qs = [_Q("test", ask, *test_options), reality, memory]
    access = "told" if told else "saw" if belief == L2 else "absent"
    labels = {"world_state": L2, "protagonist_belief": belief, "reference_state": L1, "queried": queried[0],
              "protagonist_access": access, "arrangement": "/".join(order), **extra}
    roles = {"protagonist": P[0], "other_agent": A[0], "object": obj, "location_1": L1, "location_2": L2}
    span = (keys.index(contrast[0]), keys.index(contrast[1])) if isinstance(contrast, tuple) else keys.index(contrast)
    return s, span, qs, {"labels": labels, "roles": roles}


SMARTIES_ORDERS: dict[str, tuple[str, ...]] = {
    "smarties": ("open", "close", "enter", "shelf"),  # the newcomer comes in after the tin is shut
    "smarties-twin": ("enter", "open", "close", "shelf"),  # ... and is there when it is opened
    "smarties-looked": ("open", "close", "enter", "shelf"),  # pairs-only: has looked inside before
}


def _smarties(cell, w, sw, i, seed):
    """Perner et al.'s unexpected contents, and its order twin: the same sentences, the newcomer
    walking in after the container is shut again (false belief) or before it is opened (true
    belief). The controls are a reality question (what is inside) and a memory question about the
    outside of the container (what its pictures show), neither of them about anyone's mind."""
    P, A, C, label, contents = w["P"], w["A"], w["C"], w["label"], w["contents"]
    looked = cell == "smarties-looked"
    text = {
        "find": f"{P[0]} finds {_a(C)} with pictures of {label} all over it.",
        "open": f"Then {P[0]} holds the {C} up and opens it wide for all to see; there are no {label} inside: "
                f"the {C} is full of {contents}.",
        "close": f"Then {P[0]} closes the {C}.",
        "enter": f"Then {A[0]}, who has {'already' if looked else 'never'} looked inside the {C}, walks into the room.",
        "shelf": f"Then {P[0]} puts the {C} back on the shelf.",
    }
    keys = ("find", *SMARTIES_ORDERS[cell])
    saw = looked or keys.index("enter") < keys.index("open")
    belief = contents if saw else label
    # the same options in every cell of an item (label first unless swapped), so twins pair
    test = (_order((label, contents), sw[0]), belief)
    qs = [_Q("test", f"{A[0]} will think the {C} is full of", *test),
          _Q("reality", f"In fact, the {C} is full of", *_first(contents, label, sw[1])),
          _Q("memory", f"On the outside, the {C} has pictures of", *_first(label, contents, sw[2]))]
    labels = {"world_state": contents, "protagonist_belief": belief, "reference_state": label, "queried": A[0],
              "protagonist_access": "saw" if saw else "absent", "arrangement": "/".join(keys[1:])}
    roles = {"protagonist": A[0], "other_agent": P[0], "container": C, "location_1": label,
             "location_2": contents, "object": contents}
    return [text[k] for k in keys], keys.index("enter"), qs, {"labels": labels, "roles": roles}


def _object_permanence(cell, w, sw, i, seed):
    """Baillargeon's question (is the occluded toy still there behind the screen?) with a second
    toy that rolls out through the door: the question asks about either, so the answer depends on
    which toy the screen hid, not on the question's wording. Which toy is named first, and whether
    the screen or the door comes first, are crossed with the toy asked about."""
    P, (hidden, gone) = w["P"], w["toys"]
    named_hidden_first, screen_first, ask_hidden = _cross("object-permanence", seed, i, "plan", 3)
    t1, t2 = (hidden, gone) if named_hidden_first else (gone, hidden)
    screen = f"A screen is put down in front of the {hidden}, so nobody can see it any more."
    door = f"The {gone} rolls on, out through the open door."
    s = [f"{P[0]} watches two toys, {_a(t1)} and {_a(t2)}, roll slowly across the floor.",
         *((screen, door) if screen_first else (door, screen)),
         "Nobody touches the screen after that."]
    asked = hidden if ask_hidden else gone
    opts, ans = _yes_no(ask_hidden, sw[0])
    test = _Q("test", f"Question: Is the {asked} behind the screen now? Answer:", opts, ans)
    # the control asks which toy the screen hid or which rolled out, half each; tied to the plan so
    # that its answer is the toy named first (and the one named last) in exactly half of each block
    if named_hidden_first != screen_first:
        control = _Q("memory", "Question: Which toy did the screen hide? Answer: the", *_first(hidden, gone, sw[1]))
    else:
        control = _Q("memory", "Question: Which toy rolled out through the door? Answer: the",
                     *_first(gone, hidden, sw[1]))
    return s, 1 if screen_first else 2, [test, control], {
        "labels": {"world_state": hidden, "asked_about": asked, "other_candidate": gone if asked == hidden else hidden},
        "roles": {"protagonist": P[0], "object": hidden, "other_agent": gone, "location_1": "screen"}}


def _addition(cell, w, sw, i, seed):
    """Wynn's 1 + 1 and 2 - 1 behind a screen, with two kinds of bird: the question asks how many
    of one kind are behind the screen, and that kind is the one added to (or taken from) half the
    time, so neither the operation's words ("another", "flies out") nor the kind asked about say
    "one" or "two"; only which kind the operation touched does. No number word is in the story
    except the 2 - 1 story's "two", which is the answer half the time."""
    P, (b1, b2) = w["P"], w["birds"]
    plus = w["variant"] == "1+1"
    ask_changed, changed_first, probe = _cross("addition", seed, i, f"plan/{w['variant']}", 3)
    n1, n2 = (b1, b2) if changed_first else (b2, b1)  # which kind the story names first
    if plus:
        s = [f"{P[0]} watches {_a(n1)} fly behind a tall screen, and then {_a(n2)} flies behind it too.",
             f"Then another {b1} flies behind the screen.",
             "No bird comes out from behind the screen."]
        counts = {b1: "two", b2: "one"}
    else:
        s = [f"{P[0]} watches two {_plural(n1)} and two {_plural(n2)} fly behind a tall screen.",
             f"Then {_a(b1)} flies out and away.",
             "No other bird comes or goes."]
        counts = {b1: "one", b2: "two"}
    asked = b1 if ask_changed else b2
    ans = counts[asked]
    # the control asks about either kind, half each: which went behind the screen first or second
    # (1 + 1), which flew out or which all stayed (2 - 1)
    one, two = (n1, n2) if plus else (b1, b2)  # the right answer to each of the two control questions
    if probe:
        control = _Q("memory", "Question: Which kind of bird went behind the screen first? Answer: the"
                     if plus else "Question: Which kind of bird flew out? Answer: the", *_first(one, two, sw[1]))
    else:
        control = _Q("memory", "Question: Which kind of bird went behind the screen second? Answer: the"
                     if plus else "Question: Which kind of bird all stayed behind the screen? Answer: the",
                     *_first(two, one, sw[1]))
    qs = [_Q("test", f"When the screen is lowered, the number of {_plural(asked)} behind it is",
             *_first(ans, "one" if ans == "two" else "two", sw[0])), control]
    return s, 1, qs, {"labels": {"world_state": ans, "operation": "1+1" if plus else "2-1", "asked_about": asked,
                                 "other_candidate": b2 if asked == b1 else b1},
                      "roles": {"protagonist": P[0], "object": b1, "other_agent": b2}}


def _plural(noun: str) -> str:
    return noun + ("es" if noun.endswith(("ch", "sh", "s", "x")) else "s")


def _rational(cell, w, sw, i, seed):
    """Gergely's question, as the paper asks it: is the agent's way of reaching its goal sensible?
    The same jump is rational with a wall between the circles and pointless without one; the wall
    and the question's polarity are crossed per block, so yes and no are each right half the time."""
    a, b, barrier, mark = w["colour_a"], w["colour_b"], w["barrier"], w["landmark"]
    wall, sensible_q = _cross("rational-action", seed, i, "wall_polarity", 2)
    s = [f"On a screen, a small {a} circle and a big {b} circle sit a little way apart, "
         f"and {_a(mark)} stands far off to one side.",
         f"A low {barrier} stands between the two circles." if wall
         else f"A low {barrier} lies off to the other side, so nothing at all is between the two circles.",
         f"The small {a} circle wants to reach the big {b} circle, so it jumps high into the air "
         f"and lands beside the big {b} circle."]
    if sensible_q:
        opts, ans = _yes_no(wall, sw[0])
        test = _Q("test", f"Question: Does it make sense for the small {a} circle to jump like that to reach the "
                          f"big {b} circle? Answer:", opts, ans)
    else:
        opts, ans = _yes_no(not wall, sw[0])
        test = _Q("test", f"Question: Was jumping a pointless way for the small {a} circle to reach the "
                          f"big {b} circle? Answer:", opts, ans)
    copts, cans = _yes_no(wall, sw[1])
    qs = [test, _Q("memory", f"Question: Was there {_a(barrier)} between the two circles? Answer:", copts, cans)]
    return s, 1, qs, {"labels": {"world_state": "sensible" if wall else "pointless", "wall": wall,
                                 "polarity": "sensible" if sensible_q else "pointless"},
                      "roles": {"protagonist": "circle", "object": barrier, "other_agent": mark}}


def _helper(cell, w, sw, i, seed):
    (c0, climber), (ch, helper), (cd, hinderer) = w["climber"], w["helper"], w["hinderer"]
    help_s = f"{_a(ch, True)} {helper} comes up behind it and pushes it up to the top."
    hinder_s = f"{_a(cd, True)} {hinderer} comes down from above and pushes it back to the bottom."
    helper_first = _balanced_flag("helper-hinderer", seed, i, "helper_first")
    s = [f"{_a(c0, True)} {climber} is trying to climb a steep hill.",
         *((help_s, hinder_s) if helper_first else (hinder_s, help_s))]
    qs = [_Q("test", "You can play with one of the two who came along. You would rather play with the",
             *_first(helper, hinderer, sw[0])),
          _Q("memory", f"Question: Who pushed the {climber} back down? Answer: the", *_first(hinderer, helper, sw[1]))]
    return s, 1 if helper_first else 2, qs, {
        "labels": {"world_state": helper, "helper_first": helper_first},
        "roles": {"protagonist": climber, "other_agent": helper, "object": hinderer}}


def _gears(cell, w, sw, i, seed):
    P, a, b = w["P"], w["colour_a"], w["colour_b"]
    symbiotic = cell == "gears-symbiotic"
    s = [f"{P[0]} has a toy machine with a switch and two gears, {_a(a)} one and {_a(b)} one.",
         f"With both gears on the machine, {P[0]} flips the switch, and both gears spin.",
         f"{P[0]} takes off the {b} gear and flips the switch: the {a} gear "
         + ("stays still." if symbiotic else "spins on its own."),
         f"{P[0]} puts the {b} gear back, takes off the {a} gear and flips the switch: the {b} gear stays still."]
    # which gear is asked about and the question's polarity: one crossed 2x2 plan per block
    ask_a, need_q = _cross("gears", seed, i, "ask_polarity", 2)
    x, y = (a, b) if ask_a else (b, a)
    needs = symbiotic or not ask_a  # the follower needs the driver; symbiotic gears need each other
    if need_q:
        opts, ans = _yes_no(needs, sw[0])
        test = _Q("test", f"Question: Does the {x} gear need the {y} gear in order to spin? Answer:", opts, ans)
    else:
        opts, ans = _yes_no(not needs, sw[0])
        test = _Q("test", f"Question: Can the {x} gear spin without the {y} gear? Answer:", opts, ans)
    # the control asks about a step whose outcome is the same in both cells, "spun" or "stayed still"
    both = _balanced_flag("gears", seed, i, "control_probe")
    control = (_Q("memory", "With both gears on the machine and the switch flipped, the gears",
                  *_first("spun", "stayed still", sw[1])) if both else
               _Q("memory", f"With the {a} gear taken off and the switch flipped, the {b} gear",
                  *_first("stayed still", "spun", sw[1])))
    return s, 2, [test, control], {
        "labels": {"world_state": "both" if symbiotic else a, "asked_about": x, "other_candidate": y,
                   "polarity": "need" if need_q else "without"},
        "roles": {"protagonist": P[0], "object": a, "other_agent": b}}


def _blicket(cell, w, sw, i, seed):
    """Gopnik & Sobel: a block that makes the machine play is one of the nonce kind. Which block is
    tried (or, in induction, named) first and which is asked about are crossed, so "the first block"
    is the member half the time."""
    P, W, (c1, c2, c3, c4) = w["P"], w["nonce"], w["blocks"]
    member_first, ask_member = _cross("blicket", seed, i, "plan", 2)
    s = [f"{P[0]} has a machine that plays music when certain blocks are put on it; "
         f"blocks that do this are called {W}s."]
    induction = cell == "blicket-induction"
    if induction:
        s.append(f"{P[0]} says that the {c1} block is {_a(W)} and the {c2} block is not." if member_first else
                 f"{P[0]} says that the {c2} block is not {_a(W)} and the {c1} block is.")
    plays, silent = (c1, "it plays music"), (c2, "nothing happens")
    (x1, o1), (x2, o2) = (plays, silent) if member_first else (silent, plays)
    s.append(f"{P[0]} puts the {x1} block on the machine, and {o1}; then the {x2} block, and {o2}.")
    if induction:
        s.append(f"{P[0]} has two more blocks: the {c3} block is {_a(W)}, and the {c4} block is not." if member_first
                 else f"{P[0]} has two more blocks: the {c4} block is not {_a(W)}, and the {c3} block is.")
        x, y = (c3, c4) if ask_member else (c4, c3)
        opts, ans = _yes_no(ask_member, sw[0])
        test = _Q("test", f"Question: If the {x} block is put on the machine, will it play music? Answer:", opts, ans)
    else:
        x, y = (c1, c2) if ask_member else (c2, c1)
        opts, ans = _yes_no(ask_member, sw[0])
        test = _Q("test", f"Question: Is the {x} block {_a(W)}? Answer:", opts, ans)
    # the control asks which block went on first or second, half each
    first = _balanced_flag("blicket", seed, i, "control_probe")
    on_first, on_second = (c1, c2) if member_first else (c2, c1)
    qs = [test, _Q("memory", f"Question: Which block went on the machine {'first' if first else 'second'}? Answer: the",
                   *_first(on_first if first else on_second, on_second if first else on_first, sw[1]))]
    return s, len(s) - 1, qs, {
        "labels": {"world_state": f"{x}:{'yes' if ask_member else 'no'}", "asked_about": x, "other_candidate": y},
        "roles": {"protagonist": P[0], "object": c1, "other_agent": c2}}


def lucas_members(conjunctive: bool, trials: Sequence[tuple[frozenset[str], bool]],
                  blocks: Sequence[str]) -> dict[str, bool | None]:
    """Which blocks are nonce-word members under a rule (conjunctive: the machine plays when two or
    more members are on it; disjunctive: when one or more is), given (blocks on the machine, played)
    trials: True/False where every assignment consistent with the trials agrees, None where it is
    left open. Raises when no assignment fits (the trials contradict the rule)."""
    need = 2 if conjunctive else 1
    fits = [dict(zip(blocks, m, strict=True)) for m in itertools.product((False, True), repeat=len(blocks))
            if all((sum(dict(zip(blocks, m, strict=True))[x] for x in on) >= need) == played for on, played in trials)]
    if not fits:
        raise TomlensError(f"lucas trials {trials} contradict the {'conjunctive' if conjunctive else 'disjunctive'} "
                           "rule", "this is a generator bug: report it")
    return {x: fits[0][x] if all(f[x] == fits[0][x] for f in fits) else None for x in blocks}


def _lucas(cell, w, sw, i, seed):
    """Lucas et al.'s design: training shows (or states) whether the machine needs one member or two;
    the test evidence is the same in every cell (the {d} block alone does nothing, the {d} and {f}
    blocks together make it play), and whether the {d} block is a member flips with the rule."""
    P, W, (a, b, d, f) = w["P"], w["nonce"], w["blocks"]
    _, given, rule = cell.split("-")
    conj = rule == "conjunctive"
    s = [f"{P[0]} has a machine that plays music when {W}s are put on it."]
    if given == "given":
        s.append(f"{P[0]} explains: the machine plays only when two {W}s are on it together."
                 if conj else f"{P[0]} explains: the machine plays whenever at least one {W} is on it.")
    elif conj:
        s.append(f"First {P[0]} tries the {a} and {b} blocks: the {a} block alone does nothing, the {b} block alone "
                 f"does nothing, and the {a} and {b} blocks together make the machine play.")
    else:
        s.append(f"First {P[0]} tries the {a} and {b} blocks: the {a} block alone makes the machine play, and the "
                 f"{b} block alone does nothing.")
    s.append(f"Next, {P[0]} tries two new blocks: the {d} block alone does nothing, and the {d} and {f} blocks "
             f"together make the machine play.")
    member = lucas_members(conj, [(frozenset({d}), False), (frozenset({d, f}), True)], (d, f))[d]
    if member is None:  # the design's point is that the rule settles the ambiguous block
        raise TomlensError(f"lucas: the {rule} rule leaves the {d} block open", "this is a generator bug: report it")
    is_q = _balanced_flag("lucas", seed, i, "polarity")
    if is_q:
        opts, ans = _yes_no(member, sw[0])
        test = _Q("test", f"Question: Is the {d} block {_a(W)}? Answer:", opts, ans)
    else:
        opts, ans = _yes_no(not member, sw[0])
        test = _Q("test", f"Question: Is the {d} block an ordinary block, not {_a(W)}? Answer:", opts, ans)
    alone = _balanced_flag("lucas", seed, i, "control_probe")
    copts, cans = _yes_no(not alone, sw[1])  # alone: it did nothing; together: it played
    control = _Q("memory", f"Question: Did the machine play music with the {d} block on it by itself? Answer:"
                 if alone else f"Question: Did the machine play music with the {d} and {f} blocks on it together? "
                 "Answer:", copts, cans)
    return s, len(s) - 1, [test, control], {
        "labels": {"world_state": rule, "asked_about": d, "other_candidate": f, "member": member,
                   "polarity": "member" if is_q else "not-member"},
        "roles": {"protagonist": P[0], "object": d, "other_agent": f}}


def _altruism(cell, w, sw, i, seed):
    """Warneken & Tomasello (2006), as Kosoy et al. give it: an actor comes to an outcome by
    accident or on purpose; does the participant help only with the accident? Both outcomes happen
    in every story (two things out of reach, or two cupboard doors shut), one by accident and one on
    purpose, in either order, and the question asks about either: so "accident", "on purpose", their
    order and the asked thing each say nothing about the answer alone; only which thing met which
    outcome does. Help ("yes") is right for the accidental one (the paper's experimental
    condition), "no" for the deliberate one (its control). The control question asks which outcome
    came first or last (a memory question, no one's intention at stake)."""
    P = w["P"]
    # each cell its own plan, so the two stories of an item are two draws, not one
    accident_first, ask_accident, intro_accident_first = _cross("altruism", seed, i, f"{cell}/plan", 3)
    # first or last outcome: tied to the plan so that the answer is the thing introduced first in
    # exactly half of each block (and the thing named last in the other half)
    ask_first_outcome = accident_first != ask_accident
    if cell == "altruism-out-of-reach":
        acc, dlb = w["tools"]
        x1, x2 = (acc, dlb) if intro_accident_first else (dlb, acc)
        intro = f"{P[0]} is sitting at a desk, making a card with {_a(x1)} and {_a(x2)}."
        accident = (f"Then the {acc} slips out of {P[3]} hand by accident and falls to the floor, out of reach, "
                    f"and {P[0]} stretches for it but cannot get it.")
        deliberate = f"Then {P[0]} throws the {dlb} onto the floor on purpose, out of reach, and goes back to the card."
        ask = "Question: Should you pick up the {} and hand it to " + P[2] + "? Answer:"
        memory = "Question: Which one landed on the floor {}? Answer: the"
    else:
        acc, dlb = w["cupboards"]
        x1, x2 = (acc, dlb) if intro_accident_first else (dlb, acc)
        intro = (f"{P[0]} is carrying a tall pile of {w['things']} in both arms, past {_a(x1)} cupboard and "
                 f"{_a(x2)} cupboard.")
        accident = (f"Then the door of the {acc} cupboard swings shut by accident, and {P[0]}, who wants to put the "
                    f"{w['things']} inside, bumps against it but cannot open it with full arms.")
        deliberate = f"Then {P[0]} pushes the door of the {dlb} cupboard shut on purpose with one foot and walks on."
        ask = "Question: Should you open the door of the {} cupboard for " + P[2] + "? Answer:"
        memory = "Question: Which cupboard door was shut {}? Answer: the"
    events = [accident, deliberate] if accident_first else [deliberate, accident]
    asked, other = (acc, dlb) if ask_accident else (dlb, acc)
    opts, ans = _yes_no(ask_accident, sw[0])
    first, last = (acc, dlb) if accident_first else (dlb, acc)
    recalled = first if ask_first_outcome else last
    qs = [_Q("test", ask.format(asked), opts, ans),
          _Q("memory", memory.format("first" if ask_first_outcome else "last"),
             *_first(recalled, last if recalled == first else first, sw[1]))]
    return [intro, *events], 1 if accident_first else 2, qs, {
        "labels": {"world_state": acc, "asked_about": asked, "other_candidate": other,
                   "intent": "accidental" if ask_accident else "deliberate", "accident_first": accident_first},
        "roles": {"protagonist": P[0], "object": acc, "other_agent": dlb}}


# --- lexical draws (the rename seed) ----------------------------------------------------------


def _two_people(rng: random.Random) -> tuple[tuple, tuple]:
    p, a = _pick(rng, PEOPLE, 2)
    return p, a


def _words(task: str, rename: int, i: int) -> tuple[dict[str, Any], dict[str, str]]:
    """An item's words, drawn from (task, rename, i) only, and the classic-to-used mapping. A draw
    that uses a classic word (the pools hold none; this guards later edits to them) is rejected."""
    rng = random.Random(f"{FAMILY}/{task}/rename/{rename}/{i}")
    for _ in range(100):
        w, mapping = _draw(task, rng)
        if not any(is_classic(part) for v in mapping.values() for part in v.split()):
            return w, mapping
    raise TomlensError(f"kosoy: no draw for {task!r} without a classic word", "remove classic words from the pools")


def _draw(task: str, rng: random.Random) -> tuple[dict[str, Any], dict[str, str]]:
    P, A = _two_people(rng)
    if task in ("sally-anne", "ullman"):
        L1, L2 = _pick(rng, TRANSFER_CONTAINERS, 2)
        obj = rng.choice(OBJECTS)
        w = {"P": P, "A": A, "obj": obj, "L1": L1, "L2": L2, "room": rng.choice(lexicon.ROOMS),
             "place": rng.choice(lexicon.PLACES)}
        return w, {"Sally": P[0], "Anne": A[0], "marble": obj, "basket": L1, "box": L2}
    if task == "smarties":
        w = {"P": P, "A": A, "C": rng.choice(SWEET_CONTAINERS), "label": rng.choice(SWEETS),
             "contents": rng.choice(NON_FOOD)}
        return w, {"Smarties": w["label"], "pencils": w["contents"], "tube": w["C"], "child": P[0],
                   "newcomer": A[0]}
    if task == "object-permanence":
        w = {"P": P, "toys": tuple(_pick(rng, ROLLING_TOYS, 2))}
        return w, {"car": w["toys"][0], "curtain": "screen"}
    if task == "addition":
        w = {"P": P, "birds": tuple(_pick(rng, BIRDS, 2))}
        return w, {"bird": w["birds"][0]}
    if task == "rational-action":
        a, b = _pick(rng, COLOURS, 2)
        w = {"colour_a": a, "colour_b": b, "barrier": rng.choice(BARRIERS), "landmark": rng.choice(LANDMARKS)}
        return w, {"barrier": w["barrier"], "agent": f"{a} circle", "goal": f"{b} circle"}
    if task == "helper-hinderer":
        shapes, colours = _pick(rng, SHAPES, 3), _pick(rng, COLOURS, 3)
        w = {"climber": (colours[0], shapes[0]), "helper": (colours[1], shapes[1]),
             "hinderer": (colours[2], shapes[2])}
        return w, {"climber": " ".join(w["climber"]), "helper": " ".join(w["helper"]),
                   "hinderer": " ".join(w["hinderer"])}
    if task == "altruism":
        w = {"P": P, "tools": tuple(_pick(rng, TOOLS, 2)), "cupboards": tuple(_pick(rng, COLOURS, 2)),
             "things": rng.choice(CARRIED)}
        return w, {"experimenter": P[0], "marker": w["tools"][0], "cabinet": "cupboard", "magazines": w["things"]}
    if task == "gears":
        a, b = _pick(rng, COLOURS, 2)
        return {"P": P, "colour_a": a, "colour_b": b}, {"gear A": a, "gear B": b, "experimenter": P[0]}
    if task in ("blicket", "lucas"):
        w = {"P": P, "nonce": rng.choice(NONCE), "blocks": tuple(_pick(rng, COLOURS, 4))}
        return w, {"blicket": w["nonce"], "experimenter": P[0],
                   **{f"block {k}": c for k, c in zip("ABCD", w["blocks"], strict=True)}}
    raise TomlensError(f"kosoy has no task {task!r}", f"use one of {list(TASKS)}")


RENDER = {"sally-anne": _transfer, "ullman": _transfer, "smarties": _smarties,
          "object-permanence": _object_permanence, "addition": _addition, "rational-action": _rational,
          "helper-hinderer": _helper, "altruism": _altruism, "gears": _gears, "blicket": _blicket, "lucas": _lucas}


def _query_mentions(text: str, query: Span, roles: dict[str, str], queried: Any) -> dict[str, tuple[Span, ...]]:
    """`query_protagonist` (the character the question asks about) and `query_object` (the object,
    or the container a contents question asks about) inside the question, where `tomlens patch`'s
    default `roles` positions look; a role the question does not name is left out."""
    words = {"query_protagonist": queried if isinstance(queried, str) and queried else roles.get("protagonist"),
             "query_object": roles.get("container") or roles.get("object")}
    found = find_mentions(text, {k: v for k, v in words.items() if v})
    inside = {role: tuple(m for m in ms if m.start >= query.start) for role, ms in found.items()}
    return {role: ms for role, ms in inside.items() if ms}


def _build(task: str, cell: str, i: int, seed: int, rename: int, variant: str | None = None) -> list[Stimulus]:
    """One story's prompts: the test question and its controls (`variant`: one of the task's
    `VARIANTS`, each its own story of the item, with its own plan)."""
    w, mapping = _words(task, rename, i)
    w = {**w, "variant": variant}
    domain, exp, _ = TASKS[task]
    # one option-order flag per question (test, then each control), fully crossed per block, so
    # always choosing the first option passes half of the stories whose controls it passes
    sw = _cross(task, seed, i, "options" + (f"/{variant}" if variant else ""), 3 if domain == "tom" else 2)
    sentences, contrast, qs, extra = RENDER[task](cell, w, sw, i, seed)
    flags = dict(zip((q.kind for q in qs), sw, strict=True))
    story = " ".join(sentences) + " "
    # the classic words this story renames (a word the cell never uses is left out)
    mapping = {k: v for k, v in mapping.items() if all(find_mentions(story, {"w": (part, part + "s")}) for part in v.split())}
    starts, pos = [], 0
    for sent in sentences:
        starts.append(pos)
        pos += len(sent) + 1
    first, last = contrast if isinstance(contrast, tuple) else (contrast, contrast)
    contrast_span = Span(starts[first], starts[last] + len(sentences[last]))
    labels = dict(extra["labels"])
    task_id = f"kosoy-s{seed}-{task}-{i:04d}"
    story_key = f"{task_id}-{cell}" + (f"-{variant}" if variant else "")
    ids = {q.kind: f"{story_key}-{q.kind}" for q in qs}
    tom = domain == "tom"
    out = []
    for q in qs:
        text = story + q.text
        query = Span(len(story), len(text))
        found = find_mentions(story, extra["roles"])
        found.update(_query_mentions(text, query, extra["roles"], labels.get("queried")))
        spans = {role: ms[0] for role, ms in found.items()}
        spans.update(contrast=contrast_span, query=query)
        mentions = {role: ms for role, ms in found.items()}
        mentions.update(contrast=(contrast_span,), query=(query,))
        is_test = q.kind == "test"
        meta: dict[str, Any] = {
            "battery": FAMILY, "task": task, "cell": cell, "domain": domain, "kosoy_exp": exp,
            "question": "test" if is_test else "control", "control_kind": None if is_test else q.kind,
            "story": story_key, "test_id": ids["test"],
            "control_ids": [v for k, v in ids.items() if k != "test"],
            "rename": {"seed": rename, "map": dict(mapping)}, "options_swapped": flags[q.kind],
            "twin_of": TWINS[cell][0] if cell in TWINS else None,
            **{k: v for k, v in labels.items() if k not in ("world_state", "protagonist_belief", "reference_state")},
        }
        out.append(Stimulus(
            id=ids[q.kind], text=text, options=q.options, answer=q.answer, family=FAMILY,
            task_id=task_id, template_id=f"kosoy-{task}", condition=cell, reversed=flags[q.kind],
            prompt_type=("belief" if tom else "reality") if is_test else "reality",
            world_state=labels["world_state"], protagonist_belief=labels.get("protagonist_belief") if tom else None,
            reference_state=labels.get("reference_state"), spans=spans, meta=meta, mentions=mentions))
    return out


def _woodward(n: int, seed: int, rename: int, k: int) -> list[Stimulus]:
    """Woodward reaching through `goal_encoding` (human = animate, non-human = inanimate mover), each
    test prompt paired with a memory control on the test scene: where is the goal fruit now?
    goal_encoding draws words and placements from one seed, so `rename` seeds both here."""
    from tomlens.stimuli.goal_encoding import goal_encoding

    full = -(-n // BLOCK) * BLOCK  # whole blocks, so the control's order plan is prefix-stable
    base = goal_encoding(full, rename, ks=(k,), test_cases=("animate", "inanimate"), target_types=("fruit",),
                         anim_denotations=(False,))
    items = [int(s.task_id.rsplit("-", 1)[1]) for s in base]
    # goal encoding fixes the test's option order; the control's is balanced within each block
    # separately for tests whose answer comes first and second, so the two orders are crossed
    cflag: dict[tuple[int, str], bool] = {}
    # which fruit the control asks about: the goal fruit (its answer the new pillar) or the fruit now
    # on the habituated pillar (its answer the pillar the habituation reaches named), half each per
    # block, so the answer is the most-named pillar in half the controls
    probe: dict[tuple[int, str], bool] = {}
    for case in ("animate", "inanimate"):
        for block in range(full // BLOCK):
            for first in (0, 1):
                group = [i for s, i in zip(base, items, strict=True) if s.meta["test_case"] == case and i // BLOCK == block
                         and s.answer_index == first]
                flags = balanced_flags(random.Random(f"{FAMILY}/woodward/options/{seed}/{block}/{case}/{first}"),
                                       len(group))
                cflag.update({(i, case): f for i, f in zip(group, flags, strict=True)})
                asks = balanced_flags(random.Random(f"{FAMILY}/woodward/probe/{seed}/{block}/{case}/{first}"),
                                      len(group))
                probe.update({(i, case): f for i, f in zip(group, asks, strict=True)})
    out: list[Stimulus] = []
    for s, i in zip(base, items, strict=True):
        if i >= n:
            continue
        cell = "woodward" if s.meta["test_case"] == "animate" else "woodward-nonhuman"
        swap = cflag[(i, s.meta["test_case"])]
        if is_classic(s.meta["agent"]):
            # goal encoding draws from the shared name list, which holds the paper's own renaming;
            # a same-length, same-pronoun name keeps every span where it was
            s = _swap_name(s, s.meta["agent"])
        m = dict(s.meta)
        task_id = f"kosoy-s{seed}-woodward-{i:04d}"
        story_key = f"{task_id}-{cell}"
        ids = {"test": f"{story_key}-test", "memory": f"{story_key}-memory"}
        story = s.text[: s.spans["query"].start]
        asks_goal = probe[(i, s.meta["test_case"])]
        fruit, where, other = ((m["goal_object"], m["goal_location"], m["habituated_location"]) if asks_goal else
                               (m["location_target"], m["habituated_location"], m["goal_location"]))
        qtext = f"Right now, the {fruit} is on the"
        ctext = story + qtext
        cquery = Span(len(story), len(ctext))
        common = {"battery": FAMILY, "task": "woodward", "cell": cell, "domain": "object", "kosoy_exp": 4,
                  "story": story_key, "test_id": ids["test"], "control_ids": [ids["memory"]],
                  "rename": {"seed": rename, "map": {"actor": m["agent"], "goal toy": m["goal_object"]}},
                  "options_swapped": swap, "woodward": m}
        words = {"protagonist": m["agent"], "object": m["goal_object"]}
        test_mentions = find_mentions(s.text, words)
        test = s.with_(id=ids["test"], family=FAMILY, task_id=task_id, template_id="kosoy-woodward",
                       condition=cell, world_state=m["goal_location"], protagonist_belief=None,
                       reference_state=m["habituated_location"],
                       meta={**common, "question": "test", "control_kind": None},
                       mentions={**test_mentions, "query": (s.spans["query"],)})
        cspans = {r: sp for r, sp in s.spans.items() if sp.end <= len(story)}
        cspans["query"] = cquery
        control = Stimulus(
            id=ids["memory"], text=ctext, options=_order((where, other), swap),
            answer=where, family=FAMILY, task_id=task_id, template_id="kosoy-woodward",
            condition=cell, reversed=swap, prompt_type="reality", world_state=m["goal_location"],
            protagonist_belief=None, reference_state=m["habituated_location"], spans=cspans,
            meta={**common, "question": "control", "control_kind": "memory"},
            mentions={**find_mentions(story, words), "query": (cquery,)})
        out += [test, control]
    return out


NAME_SWAPS: dict[str, str] = {"Rose": "Nora", "Anne": "Jess", "Sally": "Wendy", "Eliza": "Norah"}


def _swap_name(s: Stimulus, name: str) -> Stimulus:
    new = NAME_SWAPS.get(name)
    if new is None or len(new) != len(name):
        raise TomlensError(f"kosoy: goal encoding drew the classic name {name!r}", "add it to NAME_SWAPS")
    meta = {**s.meta, "agent": new}
    return s.with_(text=re.sub(rf"\b{name}\b", new, s.text), meta=meta)


def _resolve(tasks: Sequence[str] | str | None) -> list[str]:
    if tasks is None:
        return list(TASKS)
    tasks = [tasks] if isinstance(tasks, str) else list(tasks)
    chosen: list[str] = []
    for t in tasks:
        if t in TASKS:
            names = [t]
        elif t in DOMAINS:
            names = [k for k, v in TASKS.items() if v[0] == t]
        elif t in ("non-tom", "controls"):
            names = [k for k, v in TASKS.items() if v[0] != "tom"]
        else:
            near = difflib.get_close_matches(str(t), [*TASKS, *DOMAINS, "non-tom"], n=1, cutoff=0.5)
            raise TomlensError(f"kosoy has no task or domain {t!r}" + (f": did you mean {near[0]!r}?" if near else ""),
                               f"tasks: {', '.join(TASKS)}; domains: {', '.join(DOMAINS)}, non-tom")
        chosen += [n for n in names if n not in chosen]
    if not chosen:
        raise TomlensError("kosoy: tasks is empty", f"pick from {', '.join(TASKS)} (or leave it out for all)")
    return [t for t in TASKS if t in chosen]


def kosoy(n: int = 8, seed: int = 0, tasks: Sequence[str] | str | None = None, rename: int | None = None,
          woodward_k: int = 3, witnessed: bool = False) -> list[Stimulus]:
    """`n` items per task, each rendered in every cell of its task, with one test prompt and its
    control prompt(s) per story. `tasks` picks tasks or whole domains ("tom", "object", "social",
    "causal", "non-tom"); `rename` seeds the names and objects (default `seed`); `woodward_k` is
    the number of habituation reaches before Woodward's test reach. Use n a multiple of 8 for exact
    balance of option order and question polarity. `witnessed` adds the pairs-only twins
    (`PAIR_CELLS`: the owner sees the move, the newcomer has looked inside) for patching and
    probes; they are not the paper's cells, so the battery summary
    (`tomlens.behaviour.kosoy.summary`) leaves them out and its notes say how many rows it left out."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise TomlensError(f"kosoy needs n >= 1 items per task, got {n!r}", "pass n=8 or more")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TomlensError(f"kosoy: seed must be an integer, got {seed!r}", "pass e.g. seed=0")
    if rename is None:
        rename = seed
    if not isinstance(rename, int) or isinstance(rename, bool):
        raise TomlensError(f"kosoy: rename must be an integer seed, got {rename!r}", "pass e.g. rename=1")
    if not isinstance(woodward_k, int) or isinstance(woodward_k, bool) or not 1 <= woodward_k <= 12:
        raise TomlensError(f"kosoy: woodward_k={woodward_k!r}", "use 1 to 12 habituation reaches (default 3)")
    if not isinstance(witnessed, bool):
        raise TomlensError(f"kosoy: witnessed must be true or false, got {witnessed!r}", "pass witnessed=True")
    out: list[Stimulus] = []
    for task in _resolve(tasks):
        if task == "woodward":
            out += _woodward(n, seed, rename, woodward_k)
            continue
        cells = TASKS[task][2] + (tuple(c for c, (t, _) in PAIR_CELLS.items() if t == task) if witnessed else ())
        for i in range(n):
            for cell in cells:
                for variant in VARIANTS.get(task, (None,)):
                    out += _build(task, cell, i, seed, rename, variant)
    return out


# Pairs-only cells: the twin of a false-belief cell in which the protagonist witnessed what the
# false-belief story hides, differing only inside its contrast span (two sentences swapped, or one
# word) with the same number of words. cell -> (task, the false-belief cell it twins);
# `PAIR_CONTRASTS` names each pairing.
PAIR_CELLS: dict[str, tuple[str, str]] = {
    "sally-anne-witnessed": ("sally-anne", "sally-anne"),
    "smarties-looked": ("smarties", "smarties"),
}
PAIR_CONTRASTS: dict[str, str] = {"witnessed": "sally-anne-witnessed", "looked": "smarties-looked"}


def _narrowed(clean: Stimulus, twin: Stimulus) -> Stimulus:
    """`clean` with its `contrast` span on the sentences its twin differs in (the twin's contrast;
    the texts before and after it are the same), so the pair's contrast is where the text differs."""
    t = twin.spans["contrast"]
    end = len(clean.text) - (len(twin.text) - t.end)
    if clean.text[: t.start] != twin.text[: t.start] or clean.text[end:] != twin.text[t.end:] or end <= t.start:
        raise TomlensError(f"kosoy pair {clean.id}: the twin {twin.id} differs outside its contrast sentence",
                           "report this: the twin cell's wording no longer matches its false-belief cell")
    span = Span(t.start, end)
    return clean.with_(spans={**clean.spans, "contrast": span}, mentions={**clean.mentions, "contrast": (span,)})


def minimal_pairs(n: int = 24, seed: int = 0, *, contrasts: Sequence[str] = ("witnessed", "looked"),
                  rename: int | None = None, **options: Any) -> list:
    """Clean/corrupted pairs for patching: the false-belief test prompt (Sally-Anne: the owner goes
    off, then the move; Smarties: the newcomer never looked inside) and its witnessed twin (the
    move, then the owner goes off: the same two sentences swapped, the pair's contrast spanning
    both, as order-only pairs do; the newcomer "has already looked inside": one word), with the
    same question and options. The
    clean answer is the start location (the label), the corrupted one the moved location (the
    contents). Returns unchecked `tomlens.stimuli.pairs.MinimalPair`s: use
    `make_pairs("kosoy", ...)` for the checked, token-aligned set. The default n = 24 per contrast is
    three whole blocks of 8, so the clean answer comes first in exactly half (keep n a multiple of 8)."""
    from tomlens.stimuli.pairs import MinimalPair

    if options:
        raise TomlensError(f"unknown option(s) {sorted(options)} for kosoy pairs", "pass only rename (and contrasts)")
    contrasts = (contrasts,) if isinstance(contrasts, str) else tuple(contrasts)
    bad = [c for c in contrasts if c not in PAIR_CONTRASTS]
    if bad or not contrasts:
        raise TomlensError(f"kosoy pairs: contrasts {list(contrasts)!r}", f"choose from {list(PAIR_CONTRASTS)}")
    cells = [PAIR_CONTRASTS[c] for c in contrasts]
    # the public generator, with its own n / seed / rename checks
    tests = [s for s in kosoy(n, seed, tasks=sorted({PAIR_CELLS[c][0] for c in cells}), rename=rename, witnessed=True)
             if s.meta["question"] == "test"]
    by = {(s.task_id, s.condition): s for s in tests}
    pairs = []
    for contrast, cell in zip(contrasts, cells, strict=True):
        task, base = PAIR_CELLS[cell]
        for s in tests:
            if s.condition == cell:
                clean = _narrowed(by[(s.task_id, base)], s)
                pairs.append(MinimalPair(id=f"{clean.task_id}-{contrast}", clean=clean, corrupted=s,
                                         family=FAMILY, contrast=contrast))
    return pairs


# --- what the shortcut audit tries on this battery (`tomlens audit kosoy`) ------------------------
# The audit's own contrasts (the keyed option's position, false vs true belief over every ToM row)
# run beside these; the rules below are what a reviewer would try on these stories without tracking
# anyone's mind or intention. Each reads only the text and the stimulus's own fields.

BELIEF_CONTRAST = "false vs true belief"  # the audit's generic contrast, which the ToM rules join
TOM_KEYED = "tom test: keyed answer is the start or the label"
TOM_TWIN = "tom: the paper's cell vs its order twin"
YES_NO = "yes/no test: keyed answer"
ALTRUISM = "altruism: the asked thing met its outcome by accident"
ADDITION = "addition: keyed number"
_TOM_CONTRASTS = (BELIEF_CONTRAST, TOM_KEYED, TOM_TWIN)
_ASKED_CONTRASTS = (YES_NO, ALTRUISM, ADDITION)


def _is_test(s: Stimulus) -> bool:
    return s.family == FAMILY and s.meta.get("question") == "test"


def _tom_keyed(s: Stimulus) -> str | None:
    """ToM test prompts: whether the keyed answer is the start location (or the label), the answer
    a false belief gives, or the other option."""
    if not _is_test(s) or s.meta.get("domain") != "tom" or s.reference_state is None:
        return None
    return "start or label" if s.answer == s.reference_state else "moved or contents"


def _tom_twin(s: Stimulus) -> str | None:
    """Every ToM row: the paper's cell or its order twin (the same words in another order)."""
    if s.family != FAMILY or s.meta.get("domain") != "tom" or s.condition not in CELLS:
        return None
    return "twin" if s.condition in TWINS else "paper"


def _yes_no_keyed(s: Stimulus) -> str | None:
    return s.answer if _is_test(s) and set(s.options) == {"yes", "no"} else None


def _altruism_keyed(s: Stimulus) -> str | None:
    return s.meta.get("intent") if _is_test(s) and s.meta.get("task") == "altruism" else None


def _addition_keyed(s: Stimulus) -> str | None:
    return s.answer if _is_test(s) and s.meta.get("task") == "addition" else None


def _story(s: Stimulus) -> str:
    q = s.spans.get("query")
    return s.text[: q.start] if q is not None else s.text


def _first_at(text: str, word: str) -> int | None:
    """Where `word` (or its plural) first occurs in `text`."""
    m = re.search(rf"(?<!\w){re.escape(word)}(?:e?s)?(?!\w)", text)
    return m.start() if m else None


def _last_sentence(text: str) -> str:
    parts = [p for p in re.split(r"(?<=[.!?])\s+", text.strip()) if p]
    return parts[-1] if parts else ""


def _asked_character(s: Stimulus) -> tuple[str, str] | None:
    """(the character the test asks about, the other character), for ToM rows."""
    queried = s.meta.get("queried")
    names = s.meta.get("rename", {}).get("map", {})
    owner, other = names.get("Sally") or names.get("child"), names.get("Anne") or names.get("newcomer")
    if not queried or not owner or not other:
        return None
    return (queried, other if queried == owner else owner)


def _asked_is_owner(s: Stimulus) -> bool | None:
    names = s.meta.get("rename", {}).get("map", {})
    owner = names.get("Sally") or names.get("child")
    return None if not owner or not s.meta.get("queried") else s.meta["queried"] == owner


def _asked_named_first(s: Stimulus) -> bool | None:
    pair = _asked_character(s) if s.meta.get("domain") == "tom" else _asked_thing(s)
    if pair is None:
        return None
    story = _story(s)
    a, b = _first_at(story, pair[0]), _first_at(story, pair[1])
    return None if a is None or b is None else a < b


def _asked_in_last_sentence(s: Stimulus) -> bool | None:
    pair = _asked_character(s) if s.meta.get("domain") == "tom" else _asked_thing(s)
    if pair is None:
        return None
    return _first_at(_last_sentence(_story(s)), pair[0]) is not None


def _asked_thing(s: Stimulus) -> tuple[str, str] | None:
    asked, other = s.meta.get("asked_about"), s.meta.get("other_candidate")
    return (asked, other) if asked and other else None


CONTRASTS: tuple[Contrast, ...] = (
    Contrast(TOM_KEYED, _tom_keyed, "ToM test prompts: is the keyed answer the start location (or the label), "
             "as a false belief answers, or the other option"),
    Contrast(TOM_TWIN, _tom_twin, "ToM rows: the paper's cell against its order twin, the same sentences in "
             "another order (which flips the keyed answer); a cue that tells them apart is a cue to the answer"),
    Contrast(YES_NO, _yes_no_keyed, "every yes/no test question (object permanence, rational action, altruism, "
             "gears, blicket, Lucas): is the keyed answer yes or no"),
    Contrast(ALTRUISM, _altruism_keyed, "altruism tests: is the thing asked about the one that fell (or shut) by "
             "accident (help: the paper's experimental condition) or on purpose (its control)"),
    Contrast(ADDITION, _addition_keyed, "addition tests: is the keyed number one or two"),
)
RULES: tuple[Rule, ...] = (
    Rule("asked character is the owner", _asked_is_owner,
         "the test asks about the one who put the object away (or found the container), not the other "
         "character: classic items ask the owner, who holds the false belief", _TOM_CONTRASTS),
    Rule("asked character or thing is named first", _asked_named_first,
         "the one the test asks about is named before the other one in the story", _TOM_CONTRASTS + _ASKED_CONTRASTS),
    Rule("asked character or thing is in the last sentence", _asked_in_last_sentence,
         "the one the test asks about is named in the story's last sentence (the last event, or who "
         "came back)", _TOM_CONTRASTS + _ASKED_CONTRASTS),
)
