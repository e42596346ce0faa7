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
"memory".

Cells (the `condition` of a prompt; the paper's Table rows):
- ToM: `sally-anne` (false belief: the owner is away while the object moves); Ullman's four
  alterations, each a true-belief twin of the same story: `ullman-transparent` (the containers have
  clear walls and the owner comes back to see them), `ullman-relationship-change` (the container is
  moved with the object still inside, so object and container keep their relation; its reality
  question asks where the container is now, since the object's place is the starting one),
  `ullman-trusted-communication` (the mover phones the owner, who trusts them, to say where the
  object went), `ullman-additional-actor` (the question asks about the mover, who knows); the paper
  gives no item details, so these readings are tomlens's own. `smarties` (unexpected contents: a
  sweets container holding pencil-like things; what will a newcomer think is inside?).
- Object and action: `object-permanence`, `addition` (1+1 or 2-1 behind a screen, balanced),
  `rational-action` (Gergely: is a jump to the goal sensible? yes with a wall between the circles,
  no without one; wall and question polarity crossed), `woodward` (goal encoding with a
  human actor, wrapping `goal_encoding`) and `woodward-nonhuman` (the same with an inanimate mover:
  the paper's comparison; there "correct" reads as object bias, not as a right answer).
- Social: `helper-hinderer`.
- Causal: `gears-a-pushes-b`, `gears-symbiotic`, `blicket-categorisation`, `blicket-induction`,
  and Lucas et al.'s `lucas-{given,open}-{conjunctive,disjunctive}` (the same ambiguous test evidence
  in every cell, whose answer flips with the trained rule: `lucas_members` derives it).

Pairs-only twins (`PAIR_CELLS`, option `witnessed=True`; `minimal_pairs` for patching):
`sally-anne-witnessed` (the owner sees the move before leaving: belief = world = the moved-to
container) and `smarties-looked` (the newcomer has already looked inside: belief = the contents).
Each differs from its false-belief cell inside one sentence of the same number of words, with the
same test question and options, and is not one of the paper's cells.

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
rejected. Structure (option order, which block or gear is asked about, question polarity, addition
vs subtraction, which step a control asks about) comes from `seed` in blocks of 8 items, each exactly
balanced; every fixed answer word (yes/no, floor/table, spun/stayed still) has a twin question with
the other answer. The option orders of a story's test and controls are drawn crossed (`_cross`), so
always picking the first option passes 0.5 ** (1 + controls) of stories, as guessing does, and half
of the stories whose controls it passes.
"""

from __future__ import annotations

import difflib
import itertools
import random
import re
from dataclasses import dataclass
from typing import Any, Sequence

from tomlens.errors import TomlensError
from tomlens.stimuli import lexicon
from tomlens.stimuli.false_belief import balanced_flags
from tomlens.stimuli.records import Span, Stimulus, find_mentions

FAMILY = "kosoy"
BLOCK = 8

# task -> (domain, Kosoy et al.'s experiment number, its cells in table order)
TASKS: dict[str, tuple[str, int, tuple[str, ...]]] = {
    "object-permanence": ("object", 1, ("object-permanence",)),
    "addition": ("object", 2, ("addition",)),
    "rational-action": ("object", 3, ("rational-action",)),
    "woodward": ("object", 4, ("woodward", "woodward-nonhuman")),
    "sally-anne": ("tom", 5, ("sally-anne",)),
    "ullman": ("tom", 6, ("ullman-transparent", "ullman-relationship-change",
                          "ullman-trusted-communication", "ullman-additional-actor")),
    "smarties": ("tom", 7, ("smarties",)),
    "helper-hinderer": ("social", 8, ("helper-hinderer",)),
    "gears": ("causal", 10, ("gears-a-pushes-b", "gears-symbiotic")),
    "blicket": ("causal", 11, ("blicket-categorisation", "blicket-induction")),
    "lucas": ("causal", 12, ("lucas-given-conjunctive", "lucas-given-disjunctive",
                             "lucas-open-conjunctive", "lucas-open-disjunctive")),
}
DOMAINS: tuple[str, ...] = ("object", "tom", "social", "causal")
CELLS: dict[str, str] = {cell: task for task, (_, _, cells) in TASKS.items() for cell in cells}
# Cells whose "correct" is a bias, not a right answer (kept out of domain means).
COMPARISON_CELLS: frozenset[str] = frozenset({"woodward-nonhuman"})
WORLD_FACTS: dict[str, str] = {
    "object-permanence": "'present': the hidden toy is still behind the screen",
    "addition": "the number of animals behind the screen ('one' or 'two')",
    "rational-action": "'sensible' or 'pointless': whether the jump makes sense (a wall between the circles or not)",
    "helper-hinderer": "the helper's shape",
    "gears": "the driving gear's colour ('both' when each needs the other)",
    "blicket": "the nonce word's members: the colour of the block asked about and whether it is one",
    "lucas": "the trained rule ('conjunctive' or 'disjunctive'), which decides the ambiguous block",
}

# The classic items' own words (and the paper's renaming, Rose-Eliza and Zerpda): no pool of this
# family holds them, and a draw that would use one is rejected, so a renamed item never leaks the
# text a model may have memorised.
CLASSIC_WORDS: frozenset[str] = frozenset({
    "sally", "anne", "rose", "eliza", "marble", "basket", "box", "smarties", "candy", "candies", "tube",
    "pencil", "car", "curtain", "blicket", "zerpda"})


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
VEHICLES: tuple[str, ...] = ("truck", "train", "bus", "van", "tractor", "scooter")
TOYS: tuple[str, ...] = ("ball", "doll", "drum", "kite", "puzzle", "teddy")
BIRDS: tuple[str, ...] = ("sparrow", "robin", "finch", "pigeon", "crow", "duck", "owl")
GROUND_ANIMALS: tuple[str, ...] = ("cat", "dog", "rabbit", "mouse", "frog", "goat")
BARRIERS: tuple[str, ...] = ("wall", "fence", "hedge", "ridge")
LANDMARKS: tuple[str, ...] = ("flag", "tree", "lamp", "post")
COLOURS: tuple[str, ...] = ("red", "blue", "green", "yellow", "purple", "orange", "pink", "brown")
SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "star", "diamond")
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


def _plan(task: str, seed: int, i: int, what: str) -> bool:
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


def _transfer(cell, w, sw, i, seed):
    P, A, obj, L1, L2 = w["P"], w["A"], w["obj"], w["L1"], w["L2"]
    clear = cell == "ullman-transparent"
    s = [f"{P[0]} and {A[0]} are in the {w['room']}, where a {L1} and a {L2} stand on the table"
         + (", both with clear walls that anyone can see through." if clear else "."),
         f"{P[0]} puts {P[3]} {obj} in the {L1}.",
         f"Then {P[0]} goes off to {w['place']}."]
    if cell == "ullman-relationship-change":
        s.append(f"While {P[1]} is away, {A[0]} picks up the {L1}, with the {obj} still inside it, "
                 f"and puts it down on the floor.")
    elif cell == "sally-anne-witnessed":
        # Sally-Anne's move sentence with the owner there and watching, word for word as long
        # ("While he is away, X takes ... puts" -> "But first, he sees X take ... put": the owner
        # watches before the "goes off" sentence before it takes him away)
        s.append(f"But first, {P[1]} sees {A[0]} take the {obj} out of the {L1} and put it in the {L2}.")
    else:
        s.append(f"While {P[1]} is away, {A[0]} takes the {obj} out of the {L1} and puts it in the {L2}.")
    contrast = len(s) - 1
    if cell == "ullman-trusted-communication":
        s.append(f"Then {A[0]} phones {P[0]}, who trusts {A[2]} completely, and says the {obj} is now in the {L2}.")
        contrast = len(s) - 1
    s.append(f"Later, {P[0]} comes back to the {w['room']}"
             + (f" and sees the {L1} and the {L2} on the table." if clear else "."))
    world = L1 if cell == "ullman-relationship-change" else L2
    queried = A if cell == "ullman-additional-actor" else P
    belief = {"sally-anne": L1}.get(cell, world)
    # the witnessed twin keeps Sally-Anne's option order (start location first unless swapped),
    # so the two test prompts share their options and pair for patching
    test_options = (_order((L1, L2), sw[0]), belief) if cell == "sally-anne-witnessed" else \
        _first(belief, L2 if belief == L1 else L1, sw[0])
    extra: dict[str, Any] = {}
    if cell == "ullman-relationship-change":
        # the moved container is on the floor, the other still on the table: asking about either
        # (balanced) keeps "floor" from being the reality answer every time
        moved = _plan("ullman", seed, i, "reality_probe")
        box, where = (L1, "floor") if moved else (L2, "table")
        reality = _Q("reality", f"Right now, the {box} is on the", *_first(where, "table" if moved else "floor", sw[1]))
        extra["reality_probe"] = box
    else:
        reality = _Q("reality", f"Right now, the {obj} is in the", *_first(world, L2 if world == L1 else L1, sw[1]))
    qs = [_Q("test", f"{queried[0]} will look for the {obj} in the", *test_options),
          reality,
          _Q("memory", f"At the start, {P[0]} put the {obj} in the", *_first(L1, L2, sw[2]))]
    labels = {"world_state": world, "protagonist_belief": belief, "reference_state": L1,
              "queried": queried[0], "protagonist_access": "told" if cell == "ullman-trusted-communication"
              else ("saw" if clear or queried is A or cell == "sally-anne-witnessed" else "absent"), **extra}
    roles = {"protagonist": P[0], "other_agent": A[0], "object": obj, "location_1": L1, "location_2": L2}
    return s, contrast, qs, {"labels": labels, "roles": roles}


def _smarties(cell, w, sw, i, seed):
    P, A, C, label, contents = w["P"], w["A"], w["C"], w["label"], w["contents"]
    looked = cell == "smarties-looked"
    s = [f"{P[0]} finds a {C} with pictures of {label} all over it.",
         f"When {P[1]} opens it, there are no {label} inside: the {C} is full of {contents}.",
         f"{P[0]} closes the {C} and puts it back on the shelf.",
         f"Then {A[0]}, who has {'already' if looked else 'never'} looked inside the {C}, walks into the room."]
    # the looked-inside twin keeps the label first unless swapped, as Smarties does, so they pair
    test = (_order((label, contents), sw[0]), contents) if looked else _first(label, contents, sw[0])
    qs = [_Q("test", f"{A[0]} will think the {C} is full of", *test),
          _Q("reality", f"In fact, the {C} is full of", *_first(contents, label, sw[1])),
          _Q("memory", f"Before opening it, {P[0]} expected the {C} to be full of", *_first(label, contents, sw[2]))]
    labels = {"world_state": contents, "protagonist_belief": contents if looked else label,
              "reference_state": label, "queried": A[0], "protagonist_access": "saw" if looked else "absent"}
    roles = {"protagonist": A[0], "other_agent": P[0], "container": C, "location_1": label,
             "location_2": contents, "object": contents}
    # the looked-inside twin differs from Smarties in the newcomer's sentence only: that is its contrast
    return s, 3 if looked else 1, qs, {"labels": labels, "roles": roles}


def _object_permanence(cell, w, sw, i, seed):
    P, toy, other = w["P"], w["vehicle"], w["toy"]
    s = [f"{P[0]} watches a toy {toy} roll across the floor, past a {other} lying by the wall.",
         f"A screen is put down in front of the {toy}, so nobody can see it any more.",
         f"Nobody touches the {toy} or the screen after that."]
    if _plan("object-permanence", seed, i, "polarity"):
        opts, ans = _yes_no(True, sw[0])
        test = _Q("test", f"Question: Is the {toy} still there behind the screen? Answer:", opts, ans)
    else:
        opts, ans = _yes_no(False, sw[0])
        test = _Q("test", f"Question: Has the {toy} stopped existing now that it is hidden? Answer:", opts, ans)
    qs = [test, _Q("memory", "Question: What did the screen hide? Answer: the", *_first(toy, other, sw[1]))]
    return s, 1, qs, {"labels": {"world_state": "present"},
                      "roles": {"protagonist": P[0], "object": toy, "location_1": "screen"}}


def _addition(cell, w, sw, i, seed):
    P, bird, animal = w["P"], w["bird"], w["animal"]
    plus = _plan("addition", seed, i, "operation")
    s = [f"{P[0]} sits in a field where a {animal} is asleep on the grass."]
    if plus:
        s += [f"One {bird} flies behind a tall screen, and then a second {bird} flies behind it too.",
              f"No {bird} comes out from behind the screen."]
        ans, wrong = "two", "one"
    else:
        s += [f"Two {bird}s fly behind a tall screen, and then one {bird} flies out and away.",
              f"No other {bird} comes or goes."]
        ans, wrong = "one", "two"
    qs = [_Q("test", f"When the screen is lowered, the number of {bird}s behind it is", *_first(ans, wrong, sw[0])),
          _Q("memory", "The animals that flew behind the screen were", *_first(f"{bird}s", f"{animal}s", sw[1]))]
    return s, 1, qs, {"labels": {"world_state": ans, "operation": "1+1" if plus else "2-1"},
                      "roles": {"protagonist": P[0], "object": bird, "other_agent": animal}}


def _rational(cell, w, sw, i, seed):
    """Gergely's question, as the paper asks it: is the agent's way of reaching its goal sensible?
    The same jump is rational with a wall between the circles and pointless without one; the wall
    and the question's polarity are crossed per block, so yes and no are each right half the time."""
    a, b, barrier, mark = w["colour_a"], w["colour_b"], w["barrier"], w["landmark"]
    wall, sensible_q = _cross("rational-action", seed, i, "wall_polarity", 2)
    s = [f"On a screen, a small {a} circle and a big {b} circle sit a little way apart, "
         f"and a {mark} stands far off to one side.",
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
    qs = [test, _Q("memory", f"Question: Was there a {barrier} between the two circles? Answer:", copts, cans)]
    return s, 1, qs, {"labels": {"world_state": "sensible" if wall else "pointless", "wall": wall,
                                 "polarity": "sensible" if sensible_q else "pointless"},
                      "roles": {"protagonist": "circle", "object": barrier, "other_agent": mark}}


def _helper(cell, w, sw, i, seed):
    (c0, climber), (ch, helper), (cd, hinderer) = w["climber"], w["helper"], w["hinderer"]
    help_s = f"A {ch} {helper} comes up behind it and pushes it up to the top."
    hinder_s = f"A {cd} {hinderer} comes down from above and pushes it back to the bottom."
    helper_first = _plan("helper-hinderer", seed, i, "helper_first")
    s = [f"A {c0} {climber} is trying to climb a steep hill.",
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
    s = [f"{P[0]} has a toy machine with a switch and two gears, {lexicon.article(a)} {a} one and {lexicon.article(b)} {b} one.",
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
    both = _plan("gears", seed, i, "control_probe")
    control = (_Q("memory", "With both gears on the machine and the switch flipped, the gears",
                  *_first("spun", "stayed still", sw[1])) if both else
               _Q("memory", f"With the {a} gear taken off and the switch flipped, the {b} gear",
                  *_first("stayed still", "spun", sw[1])))
    return s, 2, [test, control], {
        "labels": {"world_state": "both" if symbiotic else a, "asked_about": x,
                   "polarity": "need" if need_q else "without"},
        "roles": {"protagonist": P[0], "object": a, "other_agent": b}}


def _blicket(cell, w, sw, i, seed):
    P, W, (c1, c2, c3, c4) = w["P"], w["nonce"], w["blocks"]
    s = [f"{P[0]} has a machine that plays music when certain blocks are put on it; "
         f"blocks that do this are called {W}s."]
    induction = cell == "blicket-induction"
    if induction:
        s.append(f"{P[0]} says that the {c1} block is a {W} and the {c2} block is not.")
    s.append(f"{P[0]} puts the {c1} block on the machine, and it plays music; then the {c2} block, and nothing happens.")
    ask_first = _plan("blicket", seed, i, "ask_first")
    if induction:
        s.append(f"{P[0]} has two more blocks: the {c3} block is a {W}, and the {c4} block is not.")
        x = c3 if ask_first else c4
        opts, ans = _yes_no(ask_first, sw[0])
        test = _Q("test", f"Question: If the {x} block is put on the machine, will it play music? Answer:", opts, ans)
    else:
        x = c1 if ask_first else c2
        opts, ans = _yes_no(ask_first, sw[0])
        test = _Q("test", f"Question: Is the {x} block a {W}? Answer:", opts, ans)
    qs = [test, _Q("memory", "Question: Which block went on the machine first? Answer: the", *_first(c1, c2, sw[1]))]
    return s, len(s) - 1, qs, {"labels": {"world_state": f"{x}:{'yes' if ask_first else 'no'}", "asked_about": x},
                               "roles": {"protagonist": P[0], "object": c1, "other_agent": c2}}


def lucas_members(conjunctive: bool, trials: Sequence[tuple[frozenset[str], bool]],
                  blocks: Sequence[str]) -> dict[str, bool | None]:
    """Which blocks are nonce-word members under a rule (conjunctive: the machine plays when two or
    more members are on it; disjunctive: when one or more is), given (blocks on the machine, played)
    trials: True/False where every assignment consistent with the trials agrees, None where it is
    left open. Raises when no assignment fits (the trials contradict the rule)."""
    need = 2 if conjunctive else 1
    fits = [dict(zip(blocks, m)) for m in itertools.product((False, True), repeat=len(blocks))
            if all((sum(dict(zip(blocks, m))[x] for x in on) >= need) == played for on, played in trials)]
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
    is_q = _plan("lucas", seed, i, "polarity")
    if is_q:
        opts, ans = _yes_no(member, sw[0])
        test = _Q("test", f"Question: Is the {d} block a {W}? Answer:", opts, ans)
    else:
        opts, ans = _yes_no(not member, sw[0])
        test = _Q("test", f"Question: Is the {d} block an ordinary block, not a {W}? Answer:", opts, ans)
    alone = _plan("lucas", seed, i, "control_probe")
    copts, cans = _yes_no(not alone, sw[1])  # alone: it did nothing; together: it played
    control = _Q("memory", f"Question: Did the machine play music with the {d} block on it by itself? Answer:"
                 if alone else f"Question: Did the machine play music with the {d} and {f} blocks on it together? "
                 "Answer:", copts, cans)
    return s, len(s) - 1, [test, control], {
        "labels": {"world_state": rule, "asked_about": d, "member": member,
                   "polarity": "member" if is_q else "not-member"},
        "roles": {"protagonist": P[0], "object": d, "other_agent": f}}


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
        w = {"P": P, "vehicle": rng.choice(VEHICLES), "toy": rng.choice(TOYS)}
        return w, {"car": w["vehicle"], "curtain": "screen"}
    if task == "addition":
        w = {"P": P, "bird": rng.choice(BIRDS), "animal": rng.choice(GROUND_ANIMALS)}
        return w, {"bird": w["bird"]}
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
    if task == "gears":
        a, b = _pick(rng, COLOURS, 2)
        return {"P": P, "colour_a": a, "colour_b": b}, {"gear A": a, "gear B": b, "experimenter": P[0]}
    if task in ("blicket", "lucas"):
        w = {"P": P, "nonce": rng.choice(NONCE), "blocks": tuple(_pick(rng, COLOURS, 4))}
        return w, {"blicket": w["nonce"], "experimenter": P[0],
                   **{f"block {k}": c for k, c in zip("ABCD", w["blocks"])}}
    raise TomlensError(f"kosoy has no task {task!r}", f"use one of {list(TASKS)}")


RENDER = {"sally-anne": _transfer, "ullman": _transfer, "smarties": _smarties,
          "object-permanence": _object_permanence, "addition": _addition, "rational-action": _rational,
          "helper-hinderer": _helper, "gears": _gears, "blicket": _blicket, "lucas": _lucas}


def _query_mentions(text: str, query: Span, roles: dict[str, str], queried: Any) -> dict[str, tuple[Span, ...]]:
    """`query_protagonist` (the character the question asks about) and `query_object` (the object,
    or the container a contents question asks about) inside the question, where `tomlens patch`'s
    default `roles` positions look; a role the question does not name is left out."""
    words = {"query_protagonist": queried if isinstance(queried, str) and queried else roles.get("protagonist"),
             "query_object": roles.get("container") or roles.get("object")}
    found = find_mentions(text, {k: v for k, v in words.items() if v})
    inside = {role: tuple(m for m in ms if m.start >= query.start) for role, ms in found.items()}
    return {role: ms for role, ms in inside.items() if ms}


def _build(task: str, cell: str, i: int, seed: int, rename: int) -> list[Stimulus]:
    """One story's prompts: the test question and its controls."""
    w, mapping = _words(task, rename, i)
    domain, exp, _ = TASKS[task]
    # one option-order flag per question (test, then each control), fully crossed per block, so
    # always choosing the first option passes half of the stories whose controls it passes
    sw = _cross(task, seed, i, "options", 3 if domain == "tom" else 2)
    sentences, contrast, qs, extra = RENDER[task](cell, w, sw, i, seed)
    flags = dict(zip((q.kind for q in qs), sw))
    story = " ".join(sentences) + " "
    # the classic words this story renames (a word the cell never uses is left out)
    mapping = {k: v for k, v in mapping.items() if all(find_mentions(story, {"w": (part, part + "s")}) for part in v.split())}
    starts, pos = [], 0
    for sent in sentences:
        starts.append(pos)
        pos += len(sent) + 1
    contrast_span = Span(starts[contrast], starts[contrast] + len(sentences[contrast]))
    labels = dict(extra["labels"])
    task_id = f"kosoy-s{seed}-{task}-{i:04d}"
    story_key = f"{task_id}-{cell}"
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
    for case in ("animate", "inanimate"):
        for block in range(full // BLOCK):
            for first in (0, 1):
                group = [i for s, i in zip(base, items) if s.meta["test_case"] == case and i // BLOCK == block
                         and s.answer_index == first]
                flags = balanced_flags(random.Random(f"{FAMILY}/woodward/options/{seed}/{block}/{case}/{first}"),
                                       len(group))
                cflag.update({(i, case): f for i, f in zip(group, flags)})
    out: list[Stimulus] = []
    for s, i in zip(base, items):
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
        qtext = f"Right now, the {m['goal_object']} is on the"
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
            id=ids["memory"], text=ctext, options=_order((m["goal_location"], m["habituated_location"]), swap),
            answer=m["goal_location"], family=FAMILY, task_id=task_id, template_id="kosoy-woodward",
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
                out += _build(task, cell, i, seed, rename)
    return out


# Pairs-only cells: the twin of a false-belief cell in which the protagonist witnessed what the
# false-belief story hides, worded so the two differ inside one sentence with the same number of
# words. cell -> (task, the false-belief cell it twins); `PAIR_CONTRASTS` names each pairing.
PAIR_CELLS: dict[str, tuple[str, str]] = {
    "sally-anne-witnessed": ("sally-anne", "sally-anne"),
    "smarties-looked": ("smarties", "smarties"),
}
PAIR_CONTRASTS: dict[str, str] = {"witnessed": "sally-anne-witnessed", "looked": "smarties-looked"}


def _narrowed(clean: Stimulus, twin: Stimulus) -> Stimulus:
    """`clean` with its `contrast` span on the sentence its twin differs in (the twin's contrast;
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
    """Clean/corrupted pairs for patching: the false-belief test prompt (Sally-Anne: the owner is
    away during the move; Smarties: the newcomer never looked inside) and its witnessed twin (the
    owner sees the move: "While he is away, X takes ... puts" -> "But first, he sees X take
    ... put"; the newcomer "has already looked inside"), with the same question and options. The
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
    for contrast, cell in zip(contrasts, cells):
        task, base = PAIR_CELLS[cell]
        for s in tests:
            if s.condition == cell:
                clean = _narrowed(by[(s.task_id, base)], s)
                pairs.append(MinimalPair(id=f"{clean.task_id}-{contrast}", clean=clean, corrupted=s,
                                         family=FAMILY, contrast=contrast))
    return pairs
