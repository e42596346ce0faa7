"""Kosinski-style false-belief tasks (unexpected transfer, unexpected contents) as `Stimulus` records.

Design (K24, Studies 1-2): one task = 8 scenarios (the false-belief story, three true-belief
controls, and the reversed version of each, which swaps the two answer words everywhere), each
followed by a reality prompt and a belief prompt: 16 prompts that all end where the next word is
one of two single-token nouns. The wording is the project's own, in several template variants
(`template_id`) so that splits grouped by template are meaningful.

Two choices go beyond K24, and why:
- The false-belief story and its witnessed / informed controls differ by one-word swaps inside one
  sentence ("While Anna is away" / "... is watching"; "Ben tells nobody" / "Ben tells Anna"), so
  false-belief vs control prompts are token-aligned minimal pairs for patching
  (`tomlens.stimuli.pairs`).
- Surface cues are counterbalanced across tasks in blocks of 8: which answer word comes first in
  `options`, which of the two is mentioned first in the story, and which is mentioned last, so none
  of them predicts the answer within a condition x prompt type. Each answer word is correct in 8 of
  a task's 16 prompts and wrong in the other 8.

Every record carries the labels probes need (`world_state`, `protagonist_belief`,
`reference_state`), role spans (first mentions, the contrast sentence(s), the query and the
query's own mentions `query_protagonist` / `query_object`) and, in
`meta`, the lexical choices and the counterbalancing flags. `build_story` exposes the sentence
structure with per-sentence world/belief updates, which the sentence-by-sentence tracking family
reuses.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from string import Formatter
from typing import Any, Sequence

from tomlens.errors import TomlensError
from tomlens.stimuli import lexicon
from tomlens.stimuli.records import Span, Stimulus

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
# Templates. Slots: {P} protagonist, {Ps}/{Pp} her/his pronoun and possessive, {A} the other
# agent, {As}/{Ap}; transfer: {obj}, {L1} start location, {L2} other location, {LX},{LY} the
# listing order, {LZ},{LW} the closing order, {room}, {placeP}, {placeA}, {absent}, {hearer};
# contents: {C} container, {X} true contents, {Y} the other word, {LA},{LB} what the label says
# and says not, {conj}, {look}, {hearer}. Each template's word pairs ("away"/"watching",
# "nobody"/name, "never"/"also", "Yet"/"And") are single tokens in SmolLM2's vocabulary.
# ---------------------------------------------------------------------------------------------

TRANSFER_TEMPLATES: dict[str, dict[str, str]] = {
    "ut-a": {
        "setting": "{P} and {A} are in the {room}.",
        "listing": "There is a {LX} and a {LY} in the {room}.",
        "put": "{P} puts {Pp} {obj} in the {L1}.",
        "move": "While {P} is {absent}, {A} takes the {obj} out of the {L1} and puts it in the {L2}.",
        "stay": "While {P} is {absent}, {A} takes the {obj} out of the {L1}, looks at it, and puts "
                "it back in the {L1}.",
        "tell": "{A} tells {hearer} that the {obj} is now in the {L2}.",
        "tell_stay": "{A} tells {hearer} that {As} looked at the {obj}.",
        "closing": "The {LZ} and the {LW} are both closed.",
        "leave": "Then {P} goes to {placeP}, and {A} goes to {placeA}.",
        "return": "Later, {P} comes back and wants {Pp} {obj}.",
        "reality": "The {obj} is now in the",
        "belief": "{P} will look for the {obj} in the",
        "absent_fb": "away", "absent_tb": "watching",
    },
    "ut-b": {
        "setting": "{P} and {A} are at home in the {room}.",
        "listing": "The {room} has a {LX} and a {LY}.",
        "put": "{P} places {Pp} {obj} inside the {L1}.",
        "move": "{A} moves the {obj} from the {L1} to the {L2} while {P} is {absent}.",
        "stay": "{A} takes the {obj} from the {L1}, holds it for a moment, and returns it to the "
                "{L1} while {P} is {absent}.",
        "tell": "Afterwards, {A} tells {hearer} that {As} put the {obj} in the {L2}.",
        "tell_stay": "Afterwards, {A} tells {hearer} that {As} held the {obj}.",
        "closing": "Both the {LZ} and the {LW} are shut.",
        "leave": "{P} leaves for {placeP}, and {A} leaves for {placeA}.",
        "return": "In the evening, {P} returns and needs {Pp} {obj}.",
        "reality": "Right now, the {obj} is in the",
        "belief": "To get the {obj}, {P} first opens the",
        "absent_fb": "asleep", "absent_tb": "watching",
    },
    "ut-c": {
        "setting": "{P} is in the {room} with {A}.",
        "listing": "In the {room} there is a {LX} and a {LY}.",
        "put": "{P} leaves {Pp} {obj} in the {L1}.",
        "move": "{P} is {absent} when {A} takes the {obj} from the {L1} and drops it into the {L2}.",
        "stay": "{P} is {absent} when {A} takes the {obj} from the {L1} and then drops it back "
                "into the {L1}.",
        "tell": "{A} tells {hearer} that the {obj} is in the {L2} now.",
        "tell_stay": "{A} tells {hearer} that {As} touched the {obj}.",
        "closing": "The {LZ} is closed, and so is the {LW}.",
        "leave": "Afterwards, {P} heads to {placeP} and {A} heads to {placeA}.",
        "return": "When {P} gets back, {Ps} wants {Pp} {obj}.",
        "reality": "At this moment, the {obj} is inside the",
        "belief": "{P} thinks that the {obj} is in the",
        "absent_fb": "outside", "absent_tb": "watching",
    },
    "ut-d": {
        "setting": "{A} and {P} are spending the morning in the {room}.",
        "listing": "A {LX} and a {LY} stand in the {room}.",
        "put": "{P} drops {Pp} {obj} into the {L1}.",
        "move": "With {P} {absent}, {A} moves the {obj} out of the {L1} and into the {L2}.",
        "stay": "With {P} {absent}, {A} lifts the {obj} out of the {L1} and puts it back into "
                "the {L1}.",
        "tell": "{A} tells {hearer} that the {obj} has been moved to the {L2}.",
        "tell_stay": "{A} tells {hearer} that {As} lifted the {obj}.",
        "closing": "Neither the {LZ} nor the {LW} is open.",
        "leave": "Then {P} goes off to {placeP}, while {A} goes to {placeA}.",
        "return": "Later that day, {P} comes home and wants to find {Pp} {obj}.",
        "reality": "The {obj} is currently in the",
        "belief": "{P} goes to look for the {obj} in the",
        "absent_fb": "asleep", "absent_tb": "watching",
    },
}

CONTENTS_TEMPLATES: dict[str, dict[str, str]] = {
    "uc-a": {
        "fill_x1": "{A} fills a {C} with {X}.",
        "fill_x2": "There are no {Y} in the {C}.",
        "fill_y1": "{A} takes a {C} that has no {Y} in it.",
        "fill_y2": "{A} fills the {C} with {X}.",
        "label": "{conj} the label on the {C} says {LA}, not {LB}.",
        "find": "{P} finds the {C}.",
        "unseen": "{P} has never seen this {C} before.",
        "read": "{P} reads the label.",
        "look": "{P} {look} looks inside the {C}.",
        "tell_y": "{A} tells {hearer} that the {C} holds {X}, not {Y}.",
        "tell_x": "{A} tells {hearer} that the {C} holds no {Y}, only {X}.",
        "reality": "{P} opens the {C} and looks inside. It is full of",
        "belief": "{P} expects the {C} to be full of",
        "conj_fb": "Yet", "conj_tb": "And", "look_fb": "never", "look_tb": "also",
    },
    "uc-b": {
        "fill_x1": "{A} packs a {C} with {X}.",
        "fill_x2": "The {C} holds no {Y}.",
        "fill_y1": "{A} has a {C} that holds no {Y}.",
        "fill_y2": "{A} packs the {C} with {X}.",
        "label": "{conj}, the {C} has a label that reads {LA}, not {LB}.",
        "find": "Later, {P} comes across the {C}.",
        "unseen": "{P} does not know what is in it.",
        "read": "{P} looks at the label.",
        "look": "{P} {look} peeks inside the {C}.",
        "tell_y": "{A} explains to {hearer} that the {C} contains {X}, not {Y}.",
        "tell_x": "{A} explains to {hearer} that the {C} contains no {Y}, only {X}.",
        "reality": "{P} lifts the lid of the {C}. Inside, {Ps} sees lots of",
        "belief": "{P} believes that the {C} contains",
        "conj_fb": "However", "conj_tb": "Also", "look_fb": "never", "look_tb": "then",
    },
    "uc-c": {
        "fill_x1": "{A} keeps {X} in a {C}.",
        "fill_x2": "There are no {Y} in it.",
        "fill_y1": "{A} has a {C} with no {Y} in it.",
        "fill_y2": "{A} keeps {X} in the {C}.",
        "label": "{conj} the {C} is labelled {LA}, not {LB}.",
        "find": "{P} sees the {C} on a shelf.",
        "unseen": "{P} has not seen this {C} before.",
        "read": "{P} reads what the label says.",
        "look": "{P} {look} opens the {C}.",
        "tell_y": "{A} tells {hearer} that the {C} has {X} in it, not {Y}.",
        "tell_x": "{A} tells {hearer} that the {C} has no {Y} in it, only {X}.",
        "reality": "{P} takes the lid off the {C} and finds it full of",
        "belief": "{P} is sure that the {C} is full of",
        "conj_fb": "But", "conj_tb": "And", "look_fb": "never", "look_tb": "also",
    },
    "uc-d": {
        "fill_x1": "{A} puts {X} into a {C}.",
        "fill_x2": "The {C} contains no {Y}.",
        "fill_y1": "{A} empties a {C}, so it contains no {Y}.",
        "fill_y2": "Then {A} puts {X} into the {C}.",
        "label": "{conj} the {C} carries a label saying {LA}, not {LB}.",
        "find": "{P} picks up the {C}.",
        "unseen": "{P} has never seen it before.",
        "read": "{P} reads the label on it.",
        "look": "{P} {look} checks what is inside.",
        "tell_y": "{A} tells {hearer} that there are {X} in the {C}, not {Y}.",
        "tell_x": "{A} tells {hearer} that there are no {Y} in the {C}, only {X}.",
        "reality": "{P} opens the {C}. Looking inside, {Ps} sees that it holds",
        "belief": "{P} assumes that the {C} is filled with",
        "conj_fb": "Yet", "conj_tb": "And", "look_fb": "never", "look_tb": "also",
    },
}

TEMPLATES: dict[str, dict[str, dict[str, str]]] = {TRANSFER: TRANSFER_TEMPLATES,
                                                   CONTENTS: CONTENTS_TEMPLATES}


# ---------------------------------------------------------------------------------------------
# Tasks: the lexical choices and counterbalancing flags of one task (shared by its 16 prompts)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Task:
    """One task's choices. `words` = (reference word, other word) in the ORIGINAL version:
    transfer (start location, second location), contents (label word Y, true contents X).

    Flags (each balanced within every block of 8 tasks):
    `options_ref_first`: options list the original reference word first;
    `first_ref`: the story mentions the reference role's word before the other one;
    `last_ref`: the story's last mention of either word is the reference role's word.
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
    extra: dict[str, str] = field(default_factory=dict)  # obj, room, places / container

    @property
    def options(self) -> tuple[str, str]:
        return self.words if self.options_ref_first else (self.words[1], self.words[0])


def _balanced(rng: random.Random, size: int) -> list[bool]:
    flags = [True] * (size // 2) + [False] * (size - size // 2)
    rng.shuffle(flags)
    return flags


def _block_plan(family: str, seed: int, block: int) -> list[dict[str, Any]]:
    """Flags and templates for the tasks of one block; depends only on (family, seed, block), so
    the tasks of a smaller n are a prefix of a larger n."""
    rng = random.Random(f"{family}/plan/{seed}/{block}")
    names = list(TEMPLATES[family])
    templates = [names[i % len(names)] for i in range(BLOCK)]
    rng.shuffle(templates)
    opt, first, last = (_balanced(rng, BLOCK) for _ in range(3))
    return [
        {"template": templates[j], "options_ref_first": opt[j], "first_ref": first[j],
         "last_ref": last[j]}
        for j in range(BLOCK)
    ]


def _check_n(n: Any, family: str) -> None:
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise TomlensError(f"{family} needs n >= 1 tasks, got {n!r}", "pass n=1 or more")


def make_tasks(family: str, n: int, seed: int) -> list[Task]:
    """`n` distinct tasks of a family, deterministic given `seed` (task i depends on seed and i and
    on the tasks before it, never on n)."""
    if family not in TEMPLATES:
        raise TomlensError(f"unknown false-belief family {family!r}", f"use one of {list(TEMPLATES)}")
    _check_n(n, family)
    tasks: list[Task] = []
    seen: set[tuple] = set()
    plan: list[dict[str, Any]] = []
    for i in range(n):
        if i % BLOCK == 0:
            plan = _block_plan(family, seed, i // BLOCK)
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
                last_ref=p["last_ref"], extra=choice["extra"],
            )
        )
    return tasks


def _people(rng: random.Random) -> tuple[tuple[str, str, str, str], tuple[str, str, str, str]]:
    """Protagonist and other agent of opposite pronouns, so every pronoun has one referent."""
    protagonist = rng.choice(lexicon.NAMES)
    other = "he" if protagonist[1] == "she" else "she"
    return protagonist, rng.choice(lexicon.names_by_pronoun(other))


def _draw_transfer(rng: random.Random) -> dict[str, Any]:
    protagonist, agent = _people(rng)
    obj = rng.choice(lexicon.TRANSFER_OBJECTS)
    start, other = rng.sample(lexicon.TRANSFER_LOCATIONS, 2)
    place_p, place_a = rng.sample(lexicon.PLACES, 2)
    room = rng.choice(lexicon.ROOMS)
    return {
        "key": (protagonist[0], obj, frozenset((start, other))),
        "protagonist": protagonist, "agent": agent, "words": (start, other),
        "extra": {"obj": obj, "room": room, "placeP": place_p, "placeA": place_a},
    }


def _draw_contents(rng: random.Random) -> dict[str, Any]:
    protagonist, agent = _people(rng)
    container = rng.choice(lexicon.CONTAINERS)
    label, contents = rng.sample(lexicon.CONTENTS, 2)
    return {
        "key": (protagonist[0], container, frozenset((label, contents))),
        "protagonist": protagonist, "agent": agent, "words": (label, contents),
        "extra": {"C": container},
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
    return {"P": p[0], "Ps": p[1], "Pp": p[3], "A": a[0], "As": a[1], "Ap": a[3]}


def _transfer_story(task: Task, condition: str, rev: bool, start: str, other: str) -> Story:
    t = TRANSFER_TEMPLATES[task.template_id]
    slots = {**_person_slots(task), **task.extra, "L1": start, "L2": other}
    slots["LX"], slots["LY"] = (start, other) if task.first_ref else (other, start)
    slots["LZ"], slots["LW"] = (other, start) if task.last_ref else (start, other)
    slots["absent"] = t["absent_tb"] if condition == "present" else t["absent_fb"]
    slots["hearer"] = task.protagonist[0] if condition == "informed" else NOBODY
    loc = {"L1": ("location_1",), "L2": ("location_2",)}
    roles = {
        "P": ("protagonist",), "A": ("other_agent",), "obj": ("object",), **loc,
        "LX": loc["L1"] if task.first_ref else loc["L2"],
        "LY": loc["L2"] if task.first_ref else loc["L1"],
        "LZ": loc["L2"] if task.last_ref else loc["L1"],
        "LW": loc["L1"] if task.last_ref else loc["L2"],
    }
    moves = condition != "no_transfer"
    sentences = (
        StorySentence("setting", t["setting"]),
        StorySentence("listing", t["listing"]),
        StorySentence("put", t["put"], world="L1", belief="L1"),
        StorySentence("move", t["move"] if moves else t["stay"], world="L2" if moves else None,
                      belief="L2" if condition == "present" else None),
        StorySentence("tell", t["tell"] if moves else t["tell_stay"],
                      belief="L2" if condition == "informed" else None),
        StorySentence("closing", t["closing"]),
        StorySentence("leave", t["leave"]),
        StorySentence("return", t["return"]),
    )
    prompts = {"reality": t["reality"], "belief": t["belief"]}
    return Story(task, condition, rev, sentences, prompts, slots, roles)


def _contents_story(task: Task, condition: str, rev: bool, label: str, contents: str) -> Story:
    t = CONTENTS_TEMPLATES[task.template_id]
    slots = {**_person_slots(task), **task.extra, "X": contents, "Y": label}
    correct = condition == "correct_label"
    slots["LA"], slots["LB"] = (contents, label) if correct else (label, contents)
    slots["conj"] = t["conj_tb"] if correct else t["conj_fb"]
    slots["look"] = t["look_tb"] if condition == "open_container" else t["look_fb"]
    slots["hearer"] = task.protagonist[0] if condition == "informed" else NOBODY
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
    sentences = (
        *fill,
        StorySentence("label", t["label"]),
        StorySentence("find", t["find"]),
        StorySentence("unseen", t["unseen"]),
        StorySentence("read", t["read"], belief="LA"),
        StorySentence("look", t["look"], belief="X" if condition == "open_container" else None),
        StorySentence("tell", t["tell_y"] if task.last_ref else t["tell_x"],
                      belief="X" if condition == "informed" else None),
    )
    prompts = {"reality": t["reality"], "belief": t["belief"]}
    return Story(task, condition, rev, sentences, prompts, slots, roles)


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

# Story roles whose sentences carry each condition's contrast with the false-belief story.
CONTRAST_ROLES: dict[str, dict[str, tuple[str, ...]]] = {
    TRANSFER: {"false_belief": ("move", "tell"), "present": ("move",), "informed": ("tell",),
               "no_transfer": ("move", "tell")},
    CONTENTS: {"false_belief": ("look", "tell"), "open_container": ("look",),
               "informed": ("tell",), "correct_label": ("label",)},
}
# Extra span roles on every record: the single sentences pairs narrow `contrast` to.
EXTRA_CONTRASTS: dict[str, dict[str, str]] = {
    TRANSFER: {"contrast_seen": "move", "contrast_told": "tell"},
    CONTENTS: {"contrast_seen": "look", "contrast_told": "tell", "contrast_label": "label"},
}


def mentions(text: str, words: Sequence[str]) -> list[str]:
    """The occurrences of `words` in `text`, in order (whole words, case-sensitive)."""
    pattern = re.compile(r"\b(" + "|".join(re.escape(w) for w in words) + r")\b")
    return [m.group(1) for m in pattern.finditer(text)]


def story_stimulus(story: Story, prompt_type: str) -> Stimulus:
    """The record for one scenario's reality or belief prompt."""
    task = story.task
    r = story.render(prompt_type=prompt_type)
    by_role = {s.role: span for s, span in zip(story.sentences, r.sentences)}
    world, belief = story.labels()
    spans = dict(r.spans)
    spans["contrast"] = Span.covering([by_role[x] for x in CONTRAST_ROLES[task.family][story.condition]])
    for name, role in EXTRA_CONTRASTS[task.family].items():
        spans[name] = by_role[role]
    spans["query"] = r.query
    spans.update(r.query_spans)
    story_text = r.text[: r.sentences[-1].end]
    order = mentions(story_text, task.words)
    code = CONDITION_CODES[story.condition]
    meta: dict[str, Any] = {
        "protagonist": task.protagonist[0], "other_agent": task.agent[0],
        "protagonist_access": ACCESS[story.condition],
        "first_mentioned": order[0], "last_mentioned": order[-1],
        "options_ref_first": task.options_ref_first, "first_ref": task.first_ref,
        "last_ref": task.last_ref, "task_index": task.index, "seed": task.seed,
    }
    if task.family == TRANSFER:
        meta.update(object=task.extra["obj"], location_1=story.slots["L1"],
                    location_2=story.slots["L2"], room=task.extra["room"],
                    protagonist_goes_to=task.extra["placeP"], other_goes_to=task.extra["placeA"])
    else:
        meta.update(container=task.extra["C"], contents=story.slots["X"],
                    label=story.slots["LA"], other_word=story.slots["Y"])
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
    )


def task_stimuli(task: Task, conditions: Sequence[str] | None = None) -> list[Stimulus]:
    """The 16 prompts of one task (or fewer with `conditions`): condition x version x prompt."""
    out: list[Stimulus] = []
    for condition in conditions or CONDITIONS[task.family]:
        for rev in (False, True):
            story = build_story(task, condition, rev)
            _check_labels(story)
            for prompt_type in PROMPT_TYPES:
                out.append(story_stimulus(story, prompt_type))
    return out


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


def _generate(family: str, n: int, seed: int, conditions: Sequence[str] | None) -> list[Stimulus]:
    if isinstance(conditions, str):
        conditions = (conditions,)
    _check_conditions(family, conditions)
    out: list[Stimulus] = []
    for task in make_tasks(family, n, seed):
        out.extend(task_stimuli(task, conditions))
    return out


def unexpected_transfer(n: int = 20, seed: int = 0,
                        conditions: Sequence[str] | None = None) -> list[Stimulus]:
    """`n` unexpected-transfer tasks x 16 prompts (4 conditions x original/reversed x reality/belief).

    Answers (original version; reversed swaps the two locations): false belief reality = second
    location, belief = start; present and informed: second / second; no transfer: start / start.
    `reference_state` is the start location of that version.
    """
    return _generate(TRANSFER, n, seed, conditions)


def unexpected_contents(n: int = 20, seed: int = 0,
                        conditions: Sequence[str] | None = None) -> list[Stimulus]:
    """`n` unexpected-contents tasks x 16 prompts (4 conditions x original/reversed x reality/belief).

    Answers (original version; reversed swaps contents and label word): false belief reality = the
    true contents X, belief = the label word Y; open container, correct label and informed: X / X.
    `reference_state` is the word on the label (X in the correct-label control).
    """
    return _generate(CONTENTS, n, seed, conditions)
