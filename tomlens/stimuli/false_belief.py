"""Kosinski-style false-belief tasks (unexpected transfer, unexpected contents) as `Stimulus` records.

Design (K24, Studies 1-2): one task = 8 scenarios (the false-belief story, three true-belief
controls, and the reversed version of each, which swaps the two answer words everywhere), each
followed by a reality prompt and a belief prompt: 16 prompts that all end where the next word is
one of two single-token nouns. The wording is the project's own, in several template variants
(`template_id`) so that splits grouped by template are meaningful.

Choices beyond K24, and why (issues #10 and #27: nothing cheaper than tracking who saw what may
read the condition off the text, neither a bag of words nor where a cue stands):
- Cues come from paraphrase pools (`lexicon.CUE_POOLS`: eight phrasings each of absence,
  presence, being told, looking and the label; `EPISODE_POOLS` here: leaving and coming back,
  matched to the absence phrasings). A task draws one cue group (balanced in blocks of 8) and
  uses that phrasing of every kind; `cue_holdout` splits by group, so a probe can be trained on
  some phrasings and tested on others. Records carry `meta["cue_id"]` ("absence:3"),
  `meta["cue_kind"]` and a `cue` span on the deciding phrase.
- Decoys (on by default; `decoys=` a bool or the fraction of tasks). A transfer story has two
  handling events, the object's own (moved, or put back in the no-transfer control) and the other
  agent's own thing moved between two other places (the decoy), one while the protagonist sees it
  and one while they do not; the conditions swap which event goes where. A contents story has
  the protagonist look into one of two containers and leave the other shut; the conditions swap
  which is the labelled one. Two people are named in two telling sentences of one frame, one
  told and one not ("As for Tom, Anna then phones him to say ... As for Ben, Anna then tells him
  nothing."): the protagonist and a bystander of the same pronoun, swapped by the informed
  control. So every condition of a task has the same words, and only which cue goes with which
  event, who is told, and which container is opened decide belief. Without decoys the conditions still match in
  sentences and answer-word mentions, and in length within WORD_TOLERANCE words (checked per
  task), but their cue words differ: that setting is an ablation, and a bag of words reads it.
- Word order (`layout`, balanced in blocks of 8, the same in every condition of a task version,
  mirrored in the reversed version): a transfer episode is one of four orders of the seen and the
  unseen event (seen first, unseen first, "watches one event, leaves, the other event happens,
  comes back", "is away for one event, comes back, watches the other"), so the last (or first)
  presence/absence cue, whether a return cue appears, whether the decoy comes before the move and
  where the move stands (from the start or the end of the episode) go with no condition; a
  contents story looks first or leaves the other container shut first; the telling comes before
  or after the not-telling (`told_first`). The decoy is the other agent's own thing, so seeing it
  handled after the move reveals nothing about the object. A word whose role the conditions swap
  (a container, a name, a place) has the same neighbours in either role, and over a task's two
  versions every condition has the same word 1- to 3-grams as the false belief (tests check it).
- Conditions differ only inside their contrast sentences, so false-belief vs control prompts
  are token-aligned minimal pairs for patching (`tomlens.stimuli.pairs`).
- Surface cues are counterbalanced across tasks in blocks of 8, crossed (each of the 8
  combinations once per block): which answer word comes first in `options`, which of the two is
  mentioned first in the story, and which is mentioned last; both
  are mentioned equally often in every story, so none of them predicts the answer within a
  condition x prompt type. Each answer word is correct in 8 of a task's 16 prompts and wrong in
  the other 8. Contents stories draw the label, the true contents and the second container from
  things that go together (`lexicon.CONTAINER_CONTENTS`).
- `CONTRASTS_BY_FAMILY` / `RULES_BY_FAMILY` declare, for `tomlens audit`, the false belief vs
  each control and the shortcuts a reviewer would try on these stories (`stimuli.shortcuts`).

Every record carries the labels probes need (`world_state`, `protagonist_belief`,
`reference_state`), role spans (first mentions, the contrast sentence(s), the cue, the query and
the query's own mentions `query_protagonist` / `query_object`), every mention of each role in
`mentions` (story roles in the story, query roles in the prompt) and, in
`meta`, the lexical choices, the counterbalancing flags and the layout. `build_story` exposes the
sentence structure with per-sentence world/belief updates, which the sentence-by-sentence
tracking family reuses.
"""

from __future__ import annotations

import random
import re
from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from string import Formatter
from typing import Any

from tomlens.errors import TomlensError
from tomlens.stimuli import lexicon
from tomlens.stimuli.records import Span, Stimulus, find_mentions
from tomlens.stimuli.shortcuts import Contrast, Rule

TRANSFER = "unexpected-transfer"
CONTENTS = "unexpected-contents"

TRANSFER_CONDITIONS: tuple[str, ...] = ("false_belief", "present", "informed", "no_transfer")
CONTENTS_CONDITIONS: tuple[str, ...] = ("false_belief", "open_container", "correct_label", "informed")
CONDITIONS: dict[str, tuple[str, ...]] = {TRANSFER: TRANSFER_CONDITIONS, CONTENTS: CONTENTS_CONDITIONS}
CONDITION_CODES: dict[str, str] = {
    "false_belief": "fb", "present": "present", "informed": "informed",
    "no_transfer": "notransfer", "open_container": "open", "correct_label": "label",
}
# What the protagonist had access to (seeds-notes §6.3: saw / told / absent).
ACCESS: dict[str, str] = {
    "false_belief": "absent", "present": "saw", "informed": "told", "no_transfer": "absent",
    "open_container": "saw", "correct_label": "label",
}
PREFIX: dict[str, str] = {TRANSFER: "ut", CONTENTS: "uc"}
PROMPT_TYPES: tuple[str, str] = ("reality", "belief")
BLOCK = 8  # counterbalancing block: every flag is exactly balanced within each block of 8 tasks
NOBODY = "nobody"

# ---------------------------------------------------------------------------------------------
# Templates. Slots: {P} protagonist, {Ps}/{Po}/{Pp} her/his pronouns, {A} the other agent,
# {As}/{Ao}/{Ap}, {B} a bystander (someone else who may be told); transfer: {obj}, {L1} start
# location, {L2} other location, {LX},{LY} the listing order, {LZ},{LW} the closing order, {room},
# {placeP}, {placeA}, and the decoy's {obj2} (the other agent's own thing), {L3} and {L4};
# contents: {C} container, {D} the second container, {X} true contents, {Y} the other word,
# {LA},{LB} what the label says and says not.
# Composite slots filled before rendering: {cue} an absence or presence phrase, {event} a handling
# (from the template's "event" with {thing} what is handled, {X} where it is not put, {Y} where it
# is), {told} a telling phrase, {look} a looking phrase, {leave} / {return} the protagonist leaving
# and coming back (EPISODE_POOLS). Every condition of a task uses the same words: what decides
# belief is which cue goes with which event (transfer), who is told and who is not, and which
# container is looked into.
# A transfer "event" names both places it is not / is put in, so moving the object (not in the
# start, in the other place) and putting it back (not in the other place, in the start) have the
# same words and the same mentions of each place; so does the decoy, with the decoy's places. It
# ends on two or more words that are the same whatever it handles (no place name within two words
# of a sentence's edge, where its neighbours would differ with the slot the event stands in), and
# the put sentence ends away from its place too.
# ---------------------------------------------------------------------------------------------

TRANSFER_TEMPLATES: dict[str, dict[str, str]] = {
    "ut-a": {
        "lead": "As for",
        "adverb": "then",
        "what": "where the {obj} is now",
        "setting": "{P} and {A} are in the {room}.",
        "listing": "There is a {LX} and a {LY} in the {room}.",
        "empty": "The {L2} is empty.",
        "put": "{P} puts {Pp} {obj} in the {L1} and closes it.",
        "frame": "While {P} {cue}, {A} {event}.",
        "bare": "{A} {event}.",
        "event": "takes {thing} and, instead of putting it in the {X}, puts it in the {Y}, then shuts it",
        "pad": "For a while, nothing happens in the {room}.",
        "tell": "{A} {told} where the {obj} is now.",
        "closing": "The {LZ} and the {LW} are both closed.",
        "leave": "Then {P} goes to {placeP}, and {A} goes to {placeA}.",
        "return": "Later, {P} comes back and wants {Pp} {obj}.",
        "reality": "The {obj} is now in the",
        "belief": "{P} will look for the {obj} in the",
    },
    "ut-b": {
        "lead": "When it comes to",
        "adverb": "later",
        "what": "where the {obj} is",
        "setting": "{P} and {A} are at home in the {room}.",
        "listing": "The {room} has a {LX} and a {LY}.",
        "empty": "Nothing is in the {L2} yet.",
        "put": "{P} places {Pp} {obj} inside the {L1}, then shuts it.",
        "frame": "{A} {event} while {P} {cue}.",
        "bare": "{A} {event}.",
        "event": "picks up {thing} and, rather than setting it down in the {X}, sets it down in the {Y} with care",
        "pad": "The {room} is quiet for a few minutes.",
        "tell": "Afterwards, {A} {told} where the {obj} is.",
        "closing": "Both the {LZ} and the {LW} are shut.",
        "leave": "{P} leaves for {placeP}, and {A} leaves for {placeA}.",
        "return": "In the evening, {P} returns and needs {Pp} {obj}.",
        "reality": "Right now, the {obj} is in the",
        "belief": "To get the {obj}, {P} first opens the",
    },
    "ut-c": {
        "lead": "As to",
        "adverb": "afterwards",
        "what": "where the {obj} has ended up",
        "setting": "{P} is in the {room} with {A}.",
        "listing": "In the {room} there is a {LX} and a {LY}.",
        "empty": "The {L2} has nothing in it.",
        "put": "{P} leaves {Pp} {obj} in the {L1} for later.",
        "frame": "{P} {cue} when {A} {event}.",
        "bare": "{A} {event}.",
        "event": "picks {thing} up and, instead of dropping it into the {X}, drops it into the {Y} at once",
        "pad": "Some time passes in the {room}.",
        "tell": "{A} then {told} where the {obj} has ended up.",
        "closing": "The {LZ} is closed, and so is the {LW}.",
        "leave": "Afterwards, {P} heads to {placeP} and {A} heads to {placeA}.",
        "return": "When {P} gets back, {Ps} wants {Pp} {obj}.",
        "reality": "At this moment, the {obj} is inside the",
        "belief": "{P} thinks that the {obj} is in the",
    },
    "ut-d": {
        "lead": "Speaking of",
        "adverb": "soon",
        "what": "where the {obj} is now",
        "setting": "{A} and {P} are spending the morning in the {room}.",
        "listing": "A {LX} and a {LY} stand in the {room}.",
        "empty": "The {L2} is still empty.",
        "put": "{P} drops {Pp} {obj} into the {L1} and closes the lid.",
        "frame": "As {P} {cue}, {A} {event}.",
        "bare": "{A} {event}.",
        "event": "grabs {thing} and, rather than placing it in the {X}, places it in the {Y} right away",
        "pad": "The morning goes by slowly in the {room}.",
        "tell": "Later, {A} {told} where the {obj} is now.",
        "closing": "Neither the {LZ} nor the {LW} is open.",
        "leave": "Then {P} goes off to {placeP}, while {A} goes to {placeA}.",
        "return": "Later that day, {P} comes home and wants to find {Pp} {obj}.",
        "reality": "The {obj} is currently in the",
        "belief": "{P} goes to look for the {obj} in the",
    },
}

CONTENTS_TEMPLATES: dict[str, dict[str, str]] = {
    "uc-a": {
        "lead": "As for",
        "adverb": "then",
        "fill_x1": "{A} fills a {C} with {X}.",
        "fill_x2": "There are no {Y} in the {C}.",
        "fill_y1": "{A} takes a {C} that has no {Y} in it.",
        "fill_y2": "{A} fills the {C} with {X}.",
        "find": "{P} finds the {C} next to a {D}.",
        "unseen": "{P} has never seen this {C} before.",
        "read": "{P} reads the label.",
        "closed": "{P} leaves the {T} shut.",
        "access": "As for the {T}, {P} then {act}.",
        "shut": "leaves it shut",
        "tell_y": "{A} {told} that the {C} holds {X} and no {Y}.",
        "tell_x": "{A} {told} that the {C} holds no {Y}, only {X}.",
        "reality": "{P} opens the {C} and looks inside. It is full of",
        "belief": "{P} expects the {C} to be full of",
    },
    "uc-b": {
        "lead": "When it comes to",
        "adverb": "later",
        "fill_x1": "{A} packs a {C} with {X}.",
        "fill_x2": "The {C} holds no {Y}.",
        "fill_y1": "{A} has a {C} that holds no {Y}.",
        "fill_y2": "{A} packs the {C} with {X}.",
        "find": "Later, {P} comes across the {C} and a {D}.",
        "unseen": "{P} does not know what the {C} holds.",
        "read": "{P} looks at the label.",
        "closed": "{P} keeps the {T} closed.",
        "access": "Turning to the {T}, {P} simply {act}.",
        "shut": "keeps it closed",
        "tell_y": "{A} {told} that the {C} contains {X} and no {Y}.",
        "tell_x": "{A} {told} that the {C} contains no {Y}, only {X}.",
        "reality": "{P} lifts the lid of the {C}. Inside, {Ps} sees lots of",
        "belief": "{P} believes that the {C} contains",
    },
    "uc-c": {
        "lead": "As to",
        "adverb": "afterwards",
        "fill_x1": "{A} keeps {X} in a {C}.",
        "fill_x2": "There are no {Y} in it.",
        "fill_y1": "{A} has a {C} with no {Y} in it.",
        "fill_y2": "{A} keeps {X} in the {C}.",
        "find": "{P} sees the {C} on a shelf beside a {D}.",
        "unseen": "{P} has not seen this {C} before.",
        "read": "{P} reads what the label says.",
        "closed": "{P} does not open the {T}.",
        "access": "When it comes to the {T}, {P} just {act}.",
        "shut": "keeps the lid on it",
        "tell_y": "{A} {told} that the {C} has {X} in it and no {Y}.",
        "tell_x": "{A} {told} that the {C} has no {Y} in it, only {X}.",
        "reality": "{P} takes the lid off the {C} and finds it full of",
        "belief": "{P} is sure that the {C} is full of",
    },
    "uc-d": {
        "lead": "Speaking of",
        "adverb": "soon",
        "fill_x1": "{A} puts {X} into a {C}.",
        "fill_x2": "The {C} contains no {Y}.",
        "fill_y1": "{A} empties a {C}, so it contains no {Y}.",
        "fill_y2": "Then {A} puts {X} into the {C}.",
        "find": "{P} picks up the {C}, which stands by a {D}.",
        "unseen": "{P} has never seen the {C} before.",
        "read": "{P} reads the label on it.",
        "closed": "{P} leaves the {T} unopened.",
        "access": "With the {T}, {P} quietly {act}.",
        "shut": "leaves it unopened",
        "tell_y": "{A} {told} that there are {X} in the {C} and no {Y}.",
        "tell_x": "{A} {told} that there are no {Y} in the {C}, only {X}.",
        "reality": "{P} opens the {C}. Looking inside, {Ps} sees that it holds",
        "belief": "{P} assumes that the {C} is filled with",
    },
}
# The look sentence of a contents story ({look} with {tgt} the container looked into).
LOOK_SENTENCE = "{P} {look}."
# Who is told in a story without a decoy: the protagonist, or nobody.
HEARERS: dict[bool, str] = {True: "{P}", False: NOBODY}  # protagonist told -> {H}
# With a decoy two people are named, each in its own sentence in the same frame, one told and one
# not ("As for Tom, Anna then phones him to say where ... . As for Ben, Anna then tells him
# nothing."), in the task's order (`told_first`): the protagonist is one of them, the bystander (of
# the protagonist's pronoun) the other, so a name's neighbours are the same told or not.
UNTOLD = "{lead} {N}, {A} {adverb} tells {Po} nothing."

TEMPLATES: dict[str, dict[str, dict[str, str]]] = {TRANSFER: TRANSFER_TEMPLATES,
                                                   CONTENTS: CONTENTS_TEMPLATES}

# The protagonist leaving and coming back, phrasing i matched to phrasing i of the absence pool
# (lexicon.CUE_POOLS["absence"]: "is asleep upstairs" -> "goes upstairs to sleep" / "wakes up and
# comes back down"), so one cue group holds every phrasing of a task. Verb phrases after the name.
EPISODE_POOLS: dict[str, tuple[str, ...]] = {
    "leave": ("goes away", "goes upstairs to sleep", "goes out into the garden", "turns {Pp} back",
              "leaves the room", "goes to take a shower", "goes out to the shops",
              "goes next door to make a call"),
    "return": ("comes back", "wakes up and comes back down", "comes back in from the garden",
               "turns around again", "comes back into the room", "comes out of the shower",
               "gets back from the shops", "finishes the call and comes back"),
}
# Which kind of cue each pool is: absence (the protagonist does not see what happens) or presence.
POLARITY: dict[str, str] = {"absence": "absence", "leave": "absence", "presence": "presence",
                            "return": "presence"}

# Transfer episodes: the order of the event the protagonist sees ("seen", in a presence frame) and
# the one they do not ("unseen": in an absence frame, or bare between leaving and coming back),
# with the leaving ("away"), the coming back ("back") and a pause where the layout has them. In the
# four layouts the unseen event stands at episode positions 1, 0, 2, 0 and the seen one at 0, 1,
# 0, 2 (and likewise counted from the end), so where the object's event stands says nothing about
# whether the protagonist saw it; the false belief puts the object's event in the unseen slot,
# the present control in the seen slot, and every condition of a task has the task's layout.
LAYOUTS: dict[str, tuple[str, ...]] = {
    "seen_first": ("seen", "unseen"),
    "unseen_first": ("unseen", "seen"),
    "leaves_and_returns": ("seen", "away", "unseen", "back"),  # watches one, leaves, comes back
    "away_then_returns": ("unseen", "back", "seen", "pause"),  # away for one, comes back, watches
}
SINGLE = "single"  # the layout of a story without decoys: a pause, then the one deciding event
# Contents: whether the look sentence comes before or after the shut sentence.
ACCESS_LAYOUTS: tuple[str, str] = ("look_first", "shut_first")
# The reversed version tells its episode in the mirror layout (the object's event where the
# original has the decoy's, seen or unseen alike), so within every task each position of the
# object's event, and each order of look and shut, goes with each condition: a rule on them learns
# nothing from one task that another task's held-out prompts could use against it.
MIRROR: dict[str, str] = {
    "seen_first": "unseen_first", "unseen_first": "seen_first",
    "leaves_and_returns": "away_then_returns", "away_then_returns": "leaves_and_returns",
    "look_first": "shut_first", "shut_first": "look_first", SINGLE: SINGLE,
}


# ---------------------------------------------------------------------------------------------
# Tasks: the lexical choices and counterbalancing flags of one task (shared by its 16 prompts)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Task:
    """One task's choices. `words` = (reference word, other word) in the ORIGINAL version:
    transfer (start location, second location), contents (label word Y, true contents X).

    Flags (each balanced within every block of 8 tasks; the first three crossed):
    `options_ref_first`: options list the original reference word first;
    `first_ref`: the story mentions the reference role's word before the other one;
    `last_ref`: the story's last mention of either word is the reference role's word;
    `layout`: the order of the original version's episode (LAYOUTS / ACCESS_LAYOUTS; SINGLE
    without decoys), mirrored in the reversed version (`layout_for`);
    `told_first`: of the two telling sentences of a decoy story, the telling comes first.
    Flags are in terms of roles, so in the reversed version (words swapped) they still hold.
    """

    family: str
    index: int
    seed: int
    task_id: str
    template_id: str
    protagonist: tuple[str, str, str, str]
    agent: tuple[str, str, str, str]
    words: tuple[str, str]
    options_ref_first: bool
    first_ref: bool
    last_ref: bool
    extra: dict[str, str] = field(default_factory=dict)  # obj, room, places, decoy / containers; B
    cue_group: int = 0  # index into every pool of lexicon.CUE_POOLS (balanced within blocks)
    decoy: bool = False  # the task's stories carry decoy cues (all its conditions alike)
    layout: str = SINGLE
    told_first: bool = True  # with a decoy: the told person's sentence comes first
    label_order_flipped: bool = False  # a contents label names its word in the other order (see label_last)

    @property
    def options(self) -> tuple[str, str]:
        """The same two options, in the same order, for all 16 prompts (the reversed version swaps
        the answer words in the story, not in the options), so every task keys each option in half
        of its prompts."""
        return self.words if self.options_ref_first else (self.words[1], self.words[0])

    @property
    def label_last(self) -> bool:
        """Whether a contents story's label names its own word last ("says not sweets but pins"):
        in the odd cue groups, unless `label_order_flipped`. The same in both versions and every
        condition, so conditions share their words and word pairs; belief tracking flips it in the
        reversed version (`tracking.tracked_task`)."""
        return (self.cue_group % 2 == 1) != self.label_order_flipped

    def layout_for(self, reversed: bool) -> str:
        """The layout of one version: the task's, or its mirror (MIRROR) in the reversed one."""
        return MIRROR[self.layout] if reversed else self.layout


def balanced_flags(rng: random.Random, size: int) -> list[bool]:
    """`size` flags, half of them True, in an order shuffled by `rng` (counterbalancing blocks)."""
    flags = [True] * (size // 2) + [False] * (size - size // 2)
    rng.shuffle(flags)
    return flags


def _block_layout(family: str, seed: int, block: int, decoys: float = 1.0) -> list[dict[str, Any]]:
    """Flags, templates, cue groups, decoys and layouts for the tasks of one block; depends only
    on (family, seed, block, decoys), so the tasks of a smaller n are a prefix of a larger n. Every
    cue group is used once per block; `decoys` of the block's tasks (rounded) carry decoys, and
    every layout is used equally often (among a block's decoy tasks as far as their count allows)."""
    rng = random.Random(f"{family}/plan/{seed}/{block}")
    names = list(TEMPLATES[family])
    templates = [names[i % len(names)] for i in range(BLOCK)]
    rng.shuffle(templates)
    opt, first, last = _crossed_flags(rng)
    cue_rng = random.Random(f"{family}/cues/{seed}/{block}")
    groups = list(range(lexicon.CUE_GROUPS))
    cue_rng.shuffle(groups)
    n_decoy = round(decoys * BLOCK)
    decoy = [True] * n_decoy + [False] * (BLOCK - n_decoy)
    cue_rng.shuffle(decoy)
    layouts = _layouts(family, seed, block, decoy)
    told_first = balanced_flags(random.Random(f"{family}/told/{seed}/{block}"), BLOCK)
    return [
        {"template": templates[j], "options_ref_first": opt[j], "first_ref": first[j],
         "last_ref": last[j], "cue_group": groups[j % len(groups)], "decoy": decoy[j],
         "layout": layouts[j], "told_first": told_first[j]}
        for j in range(BLOCK)
    ]


def _crossed_flags(rng: random.Random) -> tuple[list[bool], list[bool], list[bool]]:
    """(options_ref_first, first_ref, last_ref) for a block: the 8 combinations once each, in an
    order shuffled by `rng`. Crossed, not merely balanced one by one, so that within every block
    the flags the text shows (which word the story names first and last) say nothing about the
    one it does not (which option is keyed)."""
    combos = [(o, f, la) for o in (True, False) for f in (True, False) for la in (True, False)]
    rng.shuffle(combos)
    opt, first, last = (list(x) for x in zip(*combos, strict=True))
    return opt, first, last


def _layouts(family: str, seed: int, block: int, decoy: Sequence[bool]) -> list[str]:
    """One layout per task of a block: each of the family's layouts equally often among the
    decoy tasks (cycled, then shuffled), SINGLE for the others. Its own random stream, so the
    other flags of a seed are what they were before layouts existed."""
    names = list(LAYOUTS) if family == TRANSFER else list(ACCESS_LAYOUTS)
    rng = random.Random(f"{family}/layout/{seed}/{block}")
    chosen = [names[i % len(names)] for i in range(sum(decoy))]
    rng.shuffle(chosen)
    it = iter(chosen)
    return [next(it) if d else SINGLE for d in decoy]


def _decoy_fraction(decoys: Any) -> float:
    """`decoys` as the fraction of tasks that carry decoys (True = all, False = none)."""
    if isinstance(decoys, bool):
        return 1.0 if decoys else 0.0
    if isinstance(decoys, (int, float)) and 0.0 <= decoys <= 1.0:
        return float(decoys)
    raise TomlensError(f"decoys={decoys!r} is neither a bool nor a fraction in [0, 1]",
                       "pass decoys=True, decoys=False or e.g. decoys=0.5")


def _check_n(n: Any, family: str) -> None:
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise TomlensError(f"{family} needs n >= 1 tasks, got {n!r}", "pass n=1 or more")


def make_tasks(family: str, n: int, seed: int, decoys: bool | float = True) -> list[Task]:
    """`n` distinct tasks of a family, deterministic given `seed` (task i depends on seed and i and
    on the tasks before it, never on n); `decoys` as in `unexpected_transfer`."""
    if family not in TEMPLATES:
        raise TomlensError(f"unknown false-belief family {family!r}", f"use one of {list(TEMPLATES)}")
    _check_n(n, family)
    fraction = _decoy_fraction(decoys)
    tasks: list[Task] = []
    seen: set[tuple] = set()
    plan: list[dict[str, Any]] = []
    for i in range(n):
        if i % BLOCK == 0:
            plan = _block_layout(family, seed, i // BLOCK, fraction)
        rng = random.Random(f"{family}/task/{seed}/{i}")
        for _attempt in range(1000):
            choice = _draw_transfer(rng) if family == TRANSFER else _draw_contents(rng)
            if choice["key"] not in seen:
                break
        else:  # pragma: no cover - only reachable with far more tasks than the lexicon allows
            raise TomlensError(
                f"cannot draw {n} distinct {family} tasks from the lexicon",
                "ask for fewer tasks or extend tomlens/stimuli/lexicon.py",
            )
        seen.add(choice["key"])
        p = plan[i % BLOCK]
        tasks.append(
            Task(
                family=family, index=i, seed=seed, task_id=f"{PREFIX[family]}-s{seed}-{i:04d}",
                template_id=p["template"], protagonist=choice["protagonist"],
                agent=choice["agent"], words=choice["words"],
                options_ref_first=p["options_ref_first"], first_ref=p["first_ref"],
                last_ref=p["last_ref"], extra=choice["extra"], cue_group=p["cue_group"],
                decoy=p["decoy"], layout=p["layout"], told_first=p["told_first"],
            )
        )
    return tasks


def _people(rng: random.Random) -> tuple[tuple[str, str, str, str], tuple[str, str, str, str]]:
    """Protagonist and other agent of opposite pronouns, so every pronoun has one referent."""
    protagonist = rng.choice(lexicon.NAMES)
    other = "he" if protagonist[1] == "she" else "she"
    return protagonist, rng.choice(lexicon.names_by_pronoun(other))


def _bystander(rng: random.Random, protagonist: tuple[str, str, str, str]) -> str:
    """Someone else who may be told, of the protagonist's pronoun: the two telling sentences of a
    decoy story then read alike ("tells him") whichever of them is told."""
    return rng.choice([row for row in lexicon.names_by_pronoun(protagonist[1])
                       if row[0] != protagonist[0]])[0]


def _draw_transfer(rng: random.Random) -> dict[str, Any]:
    """People, object, places; then the decoy: the other agent's own thing and two other places,
    drawn from the same lists as the object and its places (so neither the words nor a bag of
    their contexts tells the object's event from the decoy's)."""
    protagonist, agent = _people(rng)
    obj = rng.choice(lexicon.TRANSFER_OBJECTS)
    start, other = rng.sample(lexicon.TRANSFER_LOCATIONS, 2)
    place_p, place_a = rng.sample(lexicon.PLACES, 2)
    room = rng.choice(lexicon.ROOMS)
    bystander = _bystander(rng, protagonist)
    obj2 = rng.choice([o for o in lexicon.TRANSFER_OBJECTS if o != obj])
    l3, l4 = rng.sample([x for x in lexicon.TRANSFER_LOCATIONS if x not in (start, other)], 2)
    return {
        "key": (protagonist[0], obj, frozenset((start, other))),
        "protagonist": protagonist, "agent": agent, "words": (start, other),
        "extra": {"obj": obj, "room": room, "placeP": place_p, "placeA": place_a,
                  "B": bystander, "obj2": obj2, "L3": l3, "L4": l4},
    }


def _draw_contents(rng: random.Random) -> dict[str, Any]:
    """People, container, label and contents; then the second container, from the same list as
    the labelled one (so a bag of the words around "looks into the ..." cannot tell them apart)."""
    protagonist, agent = _people(rng)
    container = rng.choice(lexicon.CONTAINERS)
    # label and true contents: two things that both come in this container
    label, contents = rng.sample(lexicon.CONTAINER_CONTENTS[container], 2)
    second = rng.choice([c for c in lexicon.CONTAINERS if c != container])
    return {
        "key": (protagonist[0], container, frozenset((label, contents))),
        "protagonist": protagonist, "agent": agent, "words": (label, contents),
        "extra": {"C": container, "B": _bystander(rng, protagonist), "D": second},
    }


# ---------------------------------------------------------------------------------------------
# Stories: sentences with the world / belief update each one makes, rendered with role spans
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StorySentence:
    """One sentence of a story. `world` / `belief` name the slot whose word the object's place
    (transfer) or the container's contents (contents) / the protagonist's belief becomes after
    this sentence; None = unchanged."""

    role: str
    template: str
    world: str | None = None
    belief: str | None = None
    cue: str | None = None  # the cue phrase inside this sentence (a template), if it has one
    cue_pool: str | None = None  # the pool the cue phrase comes from ("absence", "leave", ...)


@dataclass(frozen=True)
class Rendered:
    text: str
    spans: dict[str, Span]  # first mentions of slot roles
    sentences: list[Span]  # one per rendered story sentence, in order
    query: Span
    query_spans: dict[str, Span] = field(default_factory=dict)  # QUERY_ROLES mentioned in the prompt


@dataclass(frozen=True)
class Story:
    """One scenario (task x condition x reversed): its sentences, prompts and slot values."""

    task: Task
    condition: str
    reversed: bool
    sentences: tuple[StorySentence, ...]
    prompts: dict[str, str]
    slots: dict[str, str]
    roles: dict[str, tuple[str, ...]]

    @property
    def family(self) -> str:
        return self.task.family

    def index(self, role: str) -> int:
        return next(i for i, s in enumerate(self.sentences) if s.role == role)

    def has(self, role: str) -> bool:
        return any(s.role == role for s in self.sentences)

    def labels(self, upto: int | None = None) -> tuple[str | None, str | None]:
        """(world, belief) words after the first `upto` sentences (all by default); None = not
        yet established by the story."""
        world = belief = None
        for s in self.sentences[: len(self.sentences) if upto is None else upto]:
            if s.world:
                world = self.slots[s.world]
            if s.belief:
                belief = self.slots[s.belief]
        return world, belief

    def final_labels(self) -> tuple[str, str]:
        """(world, belief) words at the story's end, which every template establishes (`_check_labels`
        holds each story to its condition's expected pair)."""
        world, belief = self.labels()
        if world is None or belief is None:
            raise RuntimeError(f"{self.task.task_id} {self.condition}: the story leaves the world or belief unset")
        return world, belief

    @property
    def reference(self) -> str:
        """Transfer: the object's starting location; contents: the word on the label."""
        return self.slots["L1"] if self.family == TRANSFER else self.slots["LA"]

    def render(self, which: Sequence[int] | None = None, prompt_type: str | None = None,
               lead_in: Sequence[int] = ()) -> Rendered:
        """Text of the sentences `which` (all by default), then the sentences `lead_in` (the
        transfer story's last sentence before a mid-story belief prompt), then the prompt."""
        b = _Builder(self.slots, self.roles)
        idx = range(len(self.sentences)) if which is None else which
        spans = [b.sentence(self.sentences[i].template) for i in idx]
        for i in lead_in:
            b.sentence(self.sentences[i].template)
        query = Span(0, 0)
        query_spans: dict[str, Span] = {}
        if prompt_type is not None:
            query = b.sentence(self.prompts[prompt_type])
            roles = QUERY_ROLES[self.family]
            query_spans = {roles[slot]: span for slot, span in b.mentions.items() if slot in roles}
        return Rendered(b.text(), dict(b.spans), spans, query, query_spans)


class _Builder:
    """Builds a text sentence by sentence and records where each role is first mentioned, and
    where each slot is last mentioned in the latest sentence (`mentions`)."""

    def __init__(self, slots: dict[str, str], roles: dict[str, tuple[str, ...]]):
        self.slots, self.roles = slots, roles
        self.parts: list[str] = []
        self.length = 0
        self.spans: dict[str, Span] = {}
        self.mentions: dict[str, Span] = {}

    def _put(self, piece: str) -> Span:
        span = Span(self.length, self.length + len(piece))
        self.parts.append(piece)
        self.length += len(piece)
        return span

    def sentence(self, template: str) -> Span:
        if self.length:
            self._put(" ")
        start = self.length
        self.mentions = {}
        for literal, name, _spec, _conv in Formatter().parse(template):
            if literal:
                self._put(literal)
            if name is not None:
                span = self._put(self.slots[name])
                self.mentions[name] = span
                for role in self.roles.get(name, ()):
                    self.spans.setdefault(role, span)
        return Span(start, self.length)

    def text(self) -> str:
        return "".join(self.parts)


def build_story(task: Task, condition: str, reversed: bool = False) -> Story:
    """The sentences, prompts and slot values of one scenario of a task."""
    conditions = CONDITIONS[task.family]
    if condition not in conditions:
        raise TomlensError(
            f"unknown {task.family} condition {condition!r}", f"use one of {list(conditions)}"
        )
    ref, other = task.words[::-1] if reversed else task.words
    if task.family == TRANSFER:
        return _transfer_story(task, condition, reversed, ref, other)
    return _contents_story(task, condition, reversed, ref, other)


def _person_slots(task: Task) -> dict[str, str]:
    p, a = task.protagonist, task.agent
    return {"P": p[0], "Ps": p[1], "Po": p[2], "Pp": p[3], "A": a[0], "As": a[1], "Ao": a[2],
            "Ap": a[3]}


def _cue(kind: str, task: Task) -> str:
    pools = EPISODE_POOLS if kind in EPISODE_POOLS else lexicon.CUE_POOLS
    return pools[kind][task.cue_group]


def _told(task: Task, protagonist_told: bool) -> str:
    """The telling phrase: without a decoy the protagonist or nobody is told; with one, "him" or
    "her" (the told person is named at the head of the sentence, see `_tellings`)."""
    return _cue("told", task).replace("{H}", "{Po}" if task.decoy else HEARERS[protagonist_told])


def _tellings(t: dict[str, str], task: Task, protagonist_told: bool, sentence: str,
              belief: str | None) -> tuple[StorySentence, ...]:
    """The telling sentence(s): without a decoy the template's own (`sentence`, "{A} {told} ...");
    with one, the told and the untold person's sentences in the task's order, in one frame."""
    told = _told(task, protagonist_told)
    if not task.decoy:
        return (StorySentence("tell", sentence.replace("{told}", told), belief=belief, cue=told,
                              cue_pool="told"),)
    head = t["lead"] + " {N}, {A} " + t["adverb"] + " "
    told_name, untold_name = ("{P}", "{B}") if protagonist_told else ("{B}", "{P}")
    body = sentence.split("{told}", 1)[1]
    tell = StorySentence("tell", (head + "{told}" + body).replace("{N}", told_name).replace(
        "{told}", told), belief=belief, cue=told, cue_pool="told")
    untold = StorySentence("untold", UNTOLD.replace("{lead}", t["lead"]).replace(
        "{adverb}", t["adverb"]).replace("{N}", untold_name))
    return (tell, untold) if task.told_first else (untold, tell)


def _event(t: dict[str, str], thing: str, places: tuple[str, str]) -> str:
    """A handling: `thing` is not put in the first place of `places` but in the second."""
    return t["event"].replace("{thing}", thing).replace("{X}", "{" + places[0] + "}").replace(
        "{Y}", "{" + places[1] + "}")


def _framed(t: dict[str, str], role: str, kind: str, event: str, task: Task,
            **update: str | None) -> StorySentence:
    """"While P <cue>, A <event>." (in the template's own order) with the pool `kind`'s cue."""
    cue = _cue(kind, task)
    return StorySentence(role, t["frame"].replace("{cue}", cue).replace("{event}", event),
                         cue=cue, cue_pool=kind, **update)


def _protagonist_does(role: str, kind: str, task: Task) -> StorySentence:
    """The protagonist leaving or coming back: "P goes upstairs to sleep." (EPISODE_POOLS)."""
    cue = _cue(kind, task)
    return StorySentence(role, "{P} " + cue + ".", cue=cue, cue_pool=kind)


def _transfer_story(task: Task, condition: str, rev: bool, start: str, other: str) -> Story:
    t = TRANSFER_TEMPLATES[task.template_id]
    slots = {**_person_slots(task), **task.extra, "L1": start, "L2": other}
    slots["LX"], slots["LY"] = (start, other) if task.first_ref else (other, start)
    slots["LZ"], slots["LW"] = (other, start) if task.last_ref else (start, other)
    loc = {"L1": ("location_1",), "L2": ("location_2",)}
    roles: dict[str, tuple[str, ...]] = {
        "P": ("protagonist",), "A": ("other_agent",), "obj": ("object",), **loc,
        "LX": loc["L1"] if task.first_ref else loc["L2"],
        "LY": loc["L2"] if task.first_ref else loc["L1"],
        "LZ": loc["L2"] if task.last_ref else loc["L1"],
        "LW": loc["L1"] if task.last_ref else loc["L2"],
    }
    moves = condition != "no_transfer"
    # The object's event: moved (not in the start, in the other place) or, in the no-transfer
    # control, put back (not in the other place, in the start): the same words either way.
    own = _event(t, "the {obj}", ("L1", "L2") if moves else ("L2", "L1"))
    update = {"world": "L2" if moves else None, "belief": "L2" if condition == "present" else None}
    if task.decoy:
        episode = _transfer_episode(t, task, condition, rev, own, update)
    else:  # one event, with the cue that decides; a pause where the decoy would be
        kind = "presence" if condition == "present" else "absence"
        episode = (StorySentence("decoy", t["pad"]), _framed(t, "move", kind, own, task, **update))
    sentences = (
        StorySentence("setting", t["setting"]),
        StorySentence("listing", t["listing"]),
        StorySentence("empty", t["empty"]),
        StorySentence("put", t["put"], world="L1", belief="L1"),
        *episode,
        *_tellings(t, task, condition == "informed", t["tell"],
                   ("L2" if moves else "L1") if condition == "informed" else None),
        StorySentence("closing", t["closing"]),
        StorySentence("leave", t["leave"]),
        StorySentence("return", t["return"]),
    )
    prompts = {"reality": t["reality"], "belief": t["belief"]}
    return Story(task, condition, rev, sentences, prompts, slots, roles)


def _transfer_episode(t: dict[str, str], task: Task, condition: str, rev: bool, own: str,
                      update: dict[str, str | None]) -> tuple[StorySentence, ...]:
    """The task's layout with the object's event in the slot the condition gives it (seen in the
    present control, unseen otherwise) and the decoy (the other agent's own thing, moved between
    two other places) in the other slot."""
    decoy = _event(t, "{Ap} {obj2}", ("L3", "L4"))
    seen_role = "move" if condition == "present" else "decoy"
    unseen_role = "decoy" if condition == "present" else "move"
    events = {"move": own, "decoy": decoy}
    layout = LAYOUTS[task.layout_for(rev)]
    between = "away" in layout  # the unseen event happens while they are gone
    out = []
    for slot in layout:
        if slot == "seen":
            out.append(_framed(t, seen_role, "presence", events[seen_role], task,
                               **(update if seen_role == "move" else {})))
        elif slot == "unseen" and between:
            out.append(StorySentence(unseen_role, t["bare"].replace("{event}", events[unseen_role]),
                                     **(update if unseen_role == "move" else {})))
        elif slot == "unseen":
            out.append(_framed(t, unseen_role, "absence", events[unseen_role], task,
                               **(update if unseen_role == "move" else {})))
        elif slot == "away":
            out.append(_protagonist_does("away", "leave", task))
        elif slot == "back":
            out.append(_protagonist_does("back", "return", task))
        else:
            out.append(StorySentence("pause", t["pad"]))
    return tuple(out)


def _contents_story(task: Task, condition: str, rev: bool, label: str, contents: str) -> Story:
    t = CONTENTS_TEMPLATES[task.template_id]
    slots = {**_person_slots(task), **task.extra, "X": contents, "Y": label}
    correct = condition == "correct_label"
    slots["LA"], slots["LB"] = (contents, label) if correct else (label, contents)
    roles = {"P": ("protagonist",), "A": ("other_agent",), "C": ("container",),
             "X": ("object", "location_2"), "Y": ("location_1",)}
    # "Y first" stories open with the container's missing contents; the last mention is set by
    # the order of the other agent's statement (the last sentence naming either word).
    if task.first_ref:
        fill = (StorySentence("missing", t["fill_y1"]),
                StorySentence("fill", t["fill_y2"], world="X"))
    else:
        fill = (StorySentence("fill", t["fill_x1"], world="X"),
                StorySentence("missing", t["fill_x2"]))
    label_sentence = lexicon.label_sentence(task.cue_group, task.label_last)
    sentences = (
        *fill,
        StorySentence("label", label_sentence, cue=label_sentence[:-1], cue_pool="label"),
        StorySentence("find", t["find"]),
        StorySentence("unseen", t["unseen"]),
        StorySentence("read", t["read"], belief="LA"),
        *_contents_access(t, task, rev, condition == "open_container"),
        *_tellings(t, task, condition == "informed", t["tell_y"] if task.last_ref else t["tell_x"],
                   "X" if condition == "informed" else None),
    )
    prompts = {"reality": t["reality"], "belief": t["belief"]}
    return Story(task, condition, rev, sentences, prompts, slots, roles)


def _contents_access(t: dict[str, str], task: Task, rev: bool, seen: bool) -> tuple[StorySentence, ...]:
    """What the protagonist opens. With a decoy: one container is looked into and the other left
    shut, in the task's order, each in the template's "access" frame ("As for the box, Anna looks
    into it."), so a container's word has the same neighbours whether it is opened or not and
    only the whole sentence says which; looking into the labelled one ({C}) is the open-container
    control, into the second one ({D}) every other condition, so the words are the same. Without a
    decoy: the protagonist looks into the labelled container, or leaves it shut."""
    look = _cue("look", task)
    if not task.decoy:
        if seen:
            phrase = look.replace("{tgt}", "the {C}")
            return (StorySentence("look", LOOK_SENTENCE.replace("{look}", phrase), belief="X",
                                  cue=phrase, cue_pool="look"),)
        closed = t["closed"].replace("{T}", "{C}")
        return (StorySentence("look", closed, cue=closed[:-1], cue_pool="closed"),)
    opened, shut = ("{C}", "{D}") if seen else ("{D}", "{C}")
    phrase = look.replace("{tgt}", "it")
    sentences = {
        "look": StorySentence("look", t["access"].replace("{T}", opened).replace("{act}", phrase),
                              belief="X" if seen else None, cue=phrase, cue_pool="look"),
        "shut": StorySentence("shut", t["access"].replace("{T}", shut).replace("{act}", t["shut"])),
    }
    order = ("look", "shut") if task.layout_for(rev) == "look_first" else ("shut", "look")
    return tuple(sentences[role] for role in order)


# Expected (world, belief) per condition, in roles: "ref" = reference word of the ORIGINAL version
# (transfer: start location; contents: the false-belief label word Y), "other" = the other word.
EXPECTED: dict[str, dict[str, tuple[str, str]]] = {
    TRANSFER: {"false_belief": ("other", "ref"), "present": ("other", "other"),
               "informed": ("other", "other"), "no_transfer": ("ref", "ref")},
    CONTENTS: {"false_belief": ("other", "ref"), "open_container": ("other", "other"),
               "correct_label": ("other", "other"), "informed": ("other", "other")},
}

# The prompt's own mentions of the protagonist and of what it asks about (the transfer object; the
# container whose contents a contents prompt asks for), as span roles: the question's tokens are
# where a model can gather the belief for the answer, so patching sweeps target them by default.
QUERY_ROLES: dict[str, dict[str, str]] = {
    TRANSFER: {"P": "query_protagonist", "obj": "query_object"},
    CONTENTS: {"P": "query_protagonist", "C": "query_object"},
}

# Story roles whose sentences carry each condition's contrast with the false-belief story (a
# span covers them and what lies between; roles a story lacks are skipped).
CONTRAST_ROLES: dict[str, dict[str, tuple[str, ...]]] = {
    TRANSFER: {"false_belief": ("decoy", "move", "tell", "untold"), "present": ("decoy", "move"),
               "informed": ("tell", "untold"), "no_transfer": ("decoy", "move", "tell", "untold")},
    CONTENTS: {"false_belief": ("look", "shut", "tell", "untold"), "open_container": ("look", "shut"),
               "informed": ("tell", "untold"), "correct_label": ("label",)},
}
# Extra span roles on every record: the single sentences pairs narrow `contrast` to.
EXTRA_CONTRASTS: dict[str, dict[str, str]] = {
    TRANSFER: {"contrast_seen": "move", "contrast_told": "tell"},
    CONTENTS: {"contrast_seen": "look", "contrast_told": "tell", "contrast_label": "label"},
}
# The sentences each extra span covers on a full story: a transfer story's "seen" contrast spans
# the decoy and the move (the present control swaps their slots), a contents story's the look
# and the shut sentence (the open-container control swaps their containers); the told contrast
# spans both telling sentences (the informed control swaps their names).
EXTRA_CONTRAST_SPANS: dict[str, dict[str, tuple[str, ...]]] = {
    TRANSFER: {"contrast_seen": ("decoy", "move"), "contrast_told": ("tell", "untold")},
    CONTENTS: {"contrast_seen": ("look", "shut"), "contrast_told": ("tell", "untold"),
               "contrast_label": ("label",)},
}
# The episode's sentence roles, in story order, recorded in meta["episode"].
EPISODE_ROLES: dict[str, tuple[str, ...]] = {
    TRANSFER: ("decoy", "move", "away", "back", "pause"),
    CONTENTS: ("look", "shut"),
}


def mentions(text: str, words: Sequence[str]) -> list[str]:
    """The occurrences of `words` in `text`, in order (whole words, case-sensitive)."""
    pattern = re.compile(r"\b(" + "|".join(re.escape(w) for w in words) + r")\b")
    return [m.group(1) for m in pattern.finditer(text)]


def deciding_cue(story: Story) -> tuple[str, str, str]:
    """(sentence role, cue kind, pool) of the phrase that decides the protagonist's belief: the
    telling when informed, the label in the correct-label control; otherwise the cue of the
    object's event (transfer), or the protagonist's leaving where that event is told bare between
    leaving and coming back, and the look (or shut) sentence (contents)."""
    condition = story.condition
    if condition == "informed":
        return "tell", "told", "told"
    if condition == "correct_label":
        return "label", "label", "label"
    role = "move" if story.family == TRANSFER else "look"
    sentence = story.sentences[story.index(role)]
    if sentence.cue_pool is None:  # bare: the protagonist left before it
        return "away", "absence", "leave"
    kind = {"closed": "look"}.get(sentence.cue_pool, POLARITY.get(sentence.cue_pool, sentence.cue_pool))
    return role, kind, sentence.cue_pool


def story_stimulus(story: Story, prompt_type: str) -> Stimulus:
    """The record for one scenario's reality or belief prompt."""
    task = story.task
    r = story.render(prompt_type=prompt_type)
    by_role = {s.role: span for s, span in zip(story.sentences, r.sentences, strict=True)}
    world, belief = story.final_labels()
    spans = dict(r.spans)

    # without a decoy the decoy slot holds a neutral sentence that no contrast needs
    def cover(roles: Sequence[str]) -> Span:
        return Span.covering([by_role[x] for x in roles
                              if x in by_role and (task.decoy or x != "decoy")])

    spans["contrast"] = cover(CONTRAST_ROLES[task.family][story.condition])
    for name, roles in EXTRA_CONTRAST_SPANS[task.family].items():
        spans[name] = cover(roles)
    spans["query"] = r.query
    spans.update(r.query_spans)
    story_text = r.text[: r.sentences[-1].end]
    cue_role, cue_kind, cue_pool = deciding_cue(story)
    spans["cue"] = _cue_span(story, r, cue_role)
    order = mentions(story_text, task.words)
    code = CONDITION_CODES[story.condition]
    meta: dict[str, Any] = {
        "protagonist": task.protagonist[0], "other_agent": task.agent[0],
        "protagonist_access": ACCESS[story.condition],
        "first_mentioned": order[0], "last_mentioned": order[-1],
        "options_ref_first": task.options_ref_first, "first_ref": task.first_ref,
        "last_ref": task.last_ref, "task_index": task.index, "seed": task.seed,
        "cue_kind": cue_kind, "cue_id": f"{cue_pool}:{task.cue_group}",
        "cue_group": task.cue_group, "decoy": task.decoy, "bystander": task.extra["B"],
        "layout": task.layout_for(story.reversed),
        "episode": [s.role for s in story.sentences if s.role in EPISODE_ROLES[task.family]],
    }
    if task.decoy:
        meta["decoy_cue_id"] = _decoy_cue_id(story)
    if task.family == TRANSFER:
        meta.update(object=task.extra["obj"], location_1=story.slots["L1"],
                    location_2=story.slots["L2"], room=task.extra["room"],
                    protagonist_goes_to=task.extra["placeP"], other_goes_to=task.extra["placeA"])
        if task.decoy:
            meta.update(decoy_object=task.extra["obj2"],
                        decoy_places=[task.extra["L3"], task.extra["L4"]])
    else:
        meta.update(container=task.extra["C"], contents=story.slots["X"],
                    label=story.slots["LA"], other_word=story.slots["Y"],
                    second_container=task.extra["D"], label_last=task.label_last)
    return Stimulus(
        id=f"{task.task_id}-{code}{'-rev' if story.reversed else ''}-{prompt_type}",
        text=r.text,
        options=task.options,
        answer=world if prompt_type == "reality" else belief,
        family=task.family,
        task_id=task.task_id,
        template_id=task.template_id,
        condition=story.condition,
        reversed=story.reversed,
        prompt_type=prompt_type,
        world_state=world,
        protagonist_belief=belief,
        reference_state=story.reference,
        spans=spans,
        meta=meta,
        mentions=_all_mentions(story, r, spans["cue"]),
    )


def _decoy_cue_id(story: Story) -> str:
    """"pool:group" of the cue that goes with the decoy: the transfer decoy's frame (or the
    leaving, where it happens bare while the protagonist is gone); a contents story's look."""
    g = story.task.cue_group
    if story.family == CONTENTS:
        return f"look:{g}"
    sentence = story.sentences[story.index("decoy")]
    return f"{sentence.cue_pool or 'leave'}:{g}"


def _cue_span(story: Story, r: Rendered, role: str) -> Span:
    """Where the deciding cue phrase lies inside its sentence."""
    i = story.index(role)
    sentence, where = story.sentences[i], r.sentences[i]
    phrase = sentence.cue.format(**story.slots) if sentence.cue else where.of(r.text)
    at = r.text.find(phrase, where.start, where.end)
    if at < 0:  # pragma: no cover - a template edit that loses the cue fails loudly
        raise RuntimeError(f"{story.task.task_id}: cue {phrase!r} not in {where.of(r.text)!r}")
    return Span(at, at + len(phrase))


def _all_mentions(story: Story, r: Rendered, cue: Span) -> dict[str, tuple[Span, ...]]:
    """Every mention of each role: story roles in the story, query roles in the prompt."""
    slots = story.slots
    words: dict[str, str] = {"protagonist": slots["P"], "other_agent": slots["A"],
                             "bystander": slots["B"]}
    if story.family == TRANSFER:
        words.update(object=slots["obj"], location_1=slots["L1"], location_2=slots["L2"])
    else:
        words.update(container=slots["C"], object=slots["X"], location_1=slots["Y"],
                     location_2=slots["X"])
    end = r.sentences[-1].end
    found = find_mentions(r.text, words)
    out = {role: tuple(m for m in ms if m.end <= end) for role, ms in found.items()}
    out = {role: ms for role, ms in out.items() if ms}
    asked = "object" if story.family == TRANSFER else "container"
    for role, source in (("query_protagonist", "protagonist"), ("query_object", asked)):
        inside = tuple(m for m in found.get(source, ()) if m.start >= r.query.start)
        if inside:
            out[role] = inside
    out["cue"] = (cue,)
    return out


def task_stimuli(task: Task, conditions: Sequence[str] | None = None) -> list[Stimulus]:
    """The 16 prompts of one task (or fewer with `conditions`): condition x version x prompt."""
    chosen = conditions or CONDITIONS[task.family]
    stories = {(c, rev): build_story(task, c, rev) for c in chosen for rev in (False, True)}
    for rev in (False, True):
        _check_matched([stories[(c, rev)] for c in chosen])
    out: list[Stimulus] = []
    for (_condition, _rev), story in stories.items():
        _check_labels(story)
        for prompt_type in PROMPT_TYPES:
            out.append(story_stimulus(story, prompt_type))
    return out


WORD_TOLERANCE = 3  # most words by which two conditions of a task without decoys may differ


def _check_matched(stories: Sequence[Story]) -> None:
    """The conditions of one task version must not differ in what a bag of words sees beyond
    their cue: same number of sentences, the same count of each answer word's mentions (and, with
    decoys, equal counts of the two), and the same words (with decoys) or word counts within
    WORD_TOLERANCE (without)."""
    texts = [s.render().text for s in stories]
    task = stories[0].task
    counts = [Counter(mentions(t, task.words)) for t in texts]
    shapes = {(len(s.sentences), tuple(sorted(c.items()))) for s, c in zip(stories, counts, strict=True)}
    lengths = [len(t.split()) for t in texts]
    same_words = len({tuple(sorted(t.replace(",", " ").replace(".", " ").split())) for t in texts}) == 1
    tied = all(c[task.words[0]] == c[task.words[1]] for c in counts)
    if (len(shapes) > 1 or max(lengths) - min(lengths) > WORD_TOLERANCE
            or (task.decoy and not (same_words and tied))):
        raise RuntimeError(f"{task.task_id}: conditions are not matched in sentences, mentions or "
                           f"words: {texts}")


def _check_labels(story: Story) -> None:
    """The story's own update rules must give K24's answer table; a template edit that breaks it
    fails here, loudly, instead of producing mislabelled stimuli."""
    ref, other = story.task.words[::-1] if story.reversed else story.task.words
    role_word = {"ref": ref, "other": other}
    want = tuple(role_word[r] for r in EXPECTED[story.family][story.condition])
    if story.labels() != want:
        raise RuntimeError(
            f"{story.task.task_id} {story.condition}: labels {story.labels()} != expected {want}"
        )


def _check_conditions(family: str, conditions: Sequence[str] | None) -> None:
    if conditions is None:
        return
    bad = [c for c in conditions if c not in CONDITIONS[family]]
    if bad or not conditions:
        raise TomlensError(
            f"conditions={list(conditions)!r} is not a non-empty subset of {family}'s conditions",
            f"choose from {list(CONDITIONS[family])}",
        )


def _generate(family: str, n: int, seed: int, conditions: Sequence[str] | None,
              decoys: bool | float = True) -> list[Stimulus]:
    if isinstance(conditions, str):
        conditions = (conditions,)
    _check_conditions(family, conditions)
    out: list[Stimulus] = []
    for task in make_tasks(family, n, seed, decoys):
        out.extend(task_stimuli(task, conditions))
    return out


def unexpected_transfer(n: int = 20, seed: int = 0, conditions: Sequence[str] | None = None,
                        decoys: bool | float = True) -> list[Stimulus]:
    """`n` unexpected-transfer tasks x 16 prompts (4 conditions x original/reversed x reality/belief).

    Answers (original version; reversed swaps the two locations): false belief reality = second
    location, belief = start; present and informed: second / second; no transfer: start / start.
    `reference_state` is the start location of that version. `decoys` (True, False or the
    fraction of tasks, balanced in blocks of 8) adds the decoy: the other agent's own thing moved
    between two other places, seen where the object's event is not and unseen where it is seen,
    in one of four balanced orders (LAYOUTS); decoy tasks also tell someone else, never nobody.
    """
    return _generate(TRANSFER, n, seed, conditions, decoys)


def unexpected_contents(n: int = 20, seed: int = 0, conditions: Sequence[str] | None = None,
                        decoys: bool | float = True) -> list[Stimulus]:
    """`n` unexpected-contents tasks x 16 prompts (4 conditions x original/reversed x reality/belief).

    Answers (original version; reversed swaps contents and label word): false belief reality = the
    true contents X, belief = the label word Y; open container, correct label and informed: X / X.
    `reference_state` is the word on the label (X in the correct-label control). `decoys` as in
    `unexpected_transfer`: the protagonist looks into one of two containers and leaves the other
    shut in every condition (the labelled one is the one opened only in the open-container
    control), in either order (balanced), and someone else is told.
    """
    return _generate(CONTENTS, n, seed, conditions, decoys)


def cue_holdout(stimuli: Sequence[Stimulus], held_out: float = 0.5,
                seed: int = 0) -> tuple[list[int], list[int]]:
    """(train, test) row indices where the test rows' cue phrasings are used by no training row.

    Every pooled phrasing of a task comes from its cue group (`meta["cue_group"]`: index i of
    every pool in lexicon.CUE_POOLS and EPISODE_POOLS), so holding out whole groups holds out
    their phrasings of every kind, decoys included, and every task lies wholly on one side.
    `held_out` is the fraction of the groups present that go to the test side (at least one group
    on each side).
    """
    if not 0.0 < held_out < 1.0:
        raise TomlensError(f"held_out={held_out!r} is not a fraction strictly between 0 and 1",
                           "pass e.g. held_out=0.5")
    groups = []
    for s in stimuli:
        g = s.meta.get("cue_group")
        if not isinstance(g, int) or isinstance(g, bool):
            raise TomlensError(f"stimulus {s.id!r} records no cue group",
                               "use unexpected-transfer or unexpected-contents stimuli")
        groups.append(g)
    present = sorted(set(groups))
    if len(present) < 2:
        raise TomlensError(f"only {len(present)} cue group(s) among {len(stimuli)} rows",
                           "generate at least 2 tasks (one block of 8 uses all 8 groups)")
    rng = random.Random(f"cue-holdout/{seed}")
    rng.shuffle(present)
    k = min(max(1, round(held_out * len(present))), len(present) - 1)
    test_groups = set(present[:k])
    train = [i for i, g in enumerate(groups) if g not in test_groups]
    test = [i for i, g in enumerate(groups) if g in test_groups]
    return train, test


# ---------------------------------------------------------------------------------------------
# What `tomlens audit` tries on these families (tomlens.stimuli.shortcuts): the false belief vs
# each control, and the cues a reader could use without tracking who saw what. Rules read the
# text (the pooled cue phrasings, the container words) where they can, so they apply to stories
# from before the layouts too; the layout rules read meta["episode"], None where it is absent.
# ---------------------------------------------------------------------------------------------


def _condition_contrast(family: str, control: str) -> Contrast:
    """False belief vs one control: the class is the condition, None outside the two."""
    def label(s: Stimulus) -> Hashable | None:
        if s.family != family or s.condition not in ("false_belief", control):
            return None
        return s.condition

    return Contrast(f"false_belief_vs_{control}", label,
                    f"{family}: the false-belief story vs the {control.replace('_', ' ')} control "
                    "(belief and reality prompts)")


CONTRASTS_BY_FAMILY: dict[str, tuple[Contrast, ...]] = {
    family: tuple(_condition_contrast(family, c) for c in conditions[1:])
    for family, conditions in CONDITIONS.items()
}


def _phrase_pattern(phrase: str) -> str:
    """A pooled phrasing as a regular expression, its slots ({Pp}, {Ao}) any one word."""
    return re.sub(r"\\\{\w+\\\}", r"\\w+", re.escape(phrase))


_CUE_PATTERNS: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(r"\b" + _phrase_pattern(phrase) + r"\b"), POLARITY[pool])
    for pools in (lexicon.CUE_POOLS, EPISODE_POOLS) for pool in ("absence", "presence", "leave", "return")
    if pool in pools for phrase in pools[pool]
)
_RETURN_PATTERNS: tuple[re.Pattern[str], ...] = tuple(
    re.compile(r"\b" + _phrase_pattern(p) + r"\b") for p in EPISODE_POOLS["return"])
_CONTAINER_WORDS = re.compile(
    r"\b(" + "|".join(sorted({*lexicon.CONTAINERS, *lexicon.GLASS_CONTAINERS}, key=len, reverse=True))
    + r")\b")


def _seen_text(s: Stimulus) -> str | None:
    """The text of the story's seen-or-not contrast (the decoy and the object's event, or the look
    and shut sentences), where the record has that span."""
    span = s.spans.get("contrast_seen")
    return None if span is None else span.of(s.text)


def _episode_cues(s: Stimulus) -> list[str]:
    """The polarity ("absence" / "presence") of every pooled cue phrasing in the episode, in order."""
    text = _seen_text(s)
    if text is None:
        return []
    hits = sorted((m.start(), polarity) for pattern, polarity in _CUE_PATTERNS
                  for m in pattern.finditer(text))
    return [polarity for _, polarity in hits]


def _last_episode_cue(s: Stimulus) -> Hashable | None:
    cues = _episode_cues(s)
    return cues[-1] if cues else None


def _first_episode_cue(s: Stimulus) -> Hashable | None:
    cues = _episode_cues(s)
    return cues[0] if cues else None


def _return_cue(s: Stimulus) -> Hashable | None:
    text = _seen_text(s)
    return None if text is None else any(p.search(text) for p in _RETURN_PATTERNS)


def _episode(s: Stimulus) -> list[str] | None:
    episode = s.meta.get("episode")
    return list(episode) if isinstance(episode, (list, tuple)) else None


def _decoy_before_move(s: Stimulus) -> Hashable | None:
    episode = _episode(s)
    if not episode or "decoy" not in episode or "move" not in episode or not s.meta.get("decoy"):
        return None
    return episode.index("decoy") < episode.index("move")


def _move_position(s: Stimulus) -> Hashable | None:
    episode = _episode(s)
    return episode.index("move") if episode and "move" in episode else None


def _move_from_end(s: Stimulus) -> Hashable | None:
    episode = _episode(s)
    return len(episode) - 1 - episode.index("move") if episode and "move" in episode else None


def _access_containers(s: Stimulus) -> list[bool]:
    """For every container word in the look (and shut) sentences, in order: is it the labelled one?"""
    text, container = _seen_text(s), s.meta.get("container")
    if text is None or not isinstance(container, str):
        return []
    return [m.group(1) == container for m in _CONTAINER_WORDS.finditer(text)]


def _labelled_container_named_last(s: Stimulus) -> Hashable | None:
    named = _access_containers(s)
    return named[-1] if named else None


def _labelled_container_named_first(s: Stimulus) -> Hashable | None:
    named = _access_containers(s)
    return named[0] if named else None


def _look_before_shut(s: Stimulus) -> Hashable | None:
    episode = _episode(s)
    if not episode or "shut" not in episode:
        return None
    return episode.index("look") < episode.index("shut")


def _label_names_first_mentioned(s: Stimulus) -> Hashable | None:
    """Whether the label's word is the answer word the story names first."""
    label, query = s.meta.get("label"), s.spans.get("query")
    if not isinstance(label, str) or query is None:
        return None
    named = mentions(s.text[: query.start], s.options)
    return named[0] == label if named else None


RULES_BY_FAMILY: dict[str, tuple[Rule, ...]] = {
    TRANSFER: (
        Rule("last_episode_cue", _last_episode_cue,
             "the last absence or presence phrasing in the decoy-and-move sentences wins (before "
             "issue #27 the decoy always came first, so this solved every condition)"),
        Rule("first_episode_cue", _first_episode_cue,
             "the first absence or presence phrasing in the decoy-and-move sentences"),
        Rule("return_cue", _return_cue,
             "whether the protagonist comes back within those sentences"),
        Rule("decoy_before_move", _decoy_before_move,
             "whether the decoy's event comes before the object's (meta episode)"),
        Rule("move_position", _move_position,
             "how many episode sentences come before the object's event (meta episode)"),
        Rule("move_from_end", _move_from_end,
             "how many episode sentences come after the object's event (meta episode)"),
    ),
    CONTENTS: (
        Rule("labelled_container_named_last", _labelled_container_named_last,
             "whether the labelled container is the last container the look (and shut) sentences "
             "name (before issue #27: 'the glass jar, not the box next to it' or the reverse)"),
        Rule("labelled_container_named_first", _labelled_container_named_first,
             "whether the labelled container is the first container those sentences name"),
        Rule("look_before_shut", _look_before_shut,
             "whether the look sentence comes before the shut sentence (meta episode)"),
        Rule("label_names_first_mentioned", _label_names_first_mentioned,
             "whether the label's word is the answer word the story names first",
             contrasts=("false_belief_vs_correct_label",)),
    ),
}
