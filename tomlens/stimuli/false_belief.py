"""Kosinski-style false-belief tasks (unexpected transfer, unexpected contents) as `Stimulus` records.

Design (K24, Studies 1-2): one task = 8 scenarios (the false-belief story, three true-belief
controls, and the reversed version of each, which swaps the two answer words everywhere), each
followed by a reality prompt and a belief prompt: 16 prompts that all end where the next word is
one of two single-token nouns. The wording is the project's own, in several template variants
(`template_id`) so that splits grouped by template are meaningful.

Choices beyond K24, and why (issue #10: a bag of words must not read the label off the text):
- Cues come from paraphrase pools (`lexicon.CUE_POOLS`: eight phrasings each of absence,
  presence, being told, looking and the label). A task draws one cue group (balanced in blocks of
  8) and uses that phrasing of every kind; `cue_holdout` splits by group, so a probe can be trained
  on some phrasings and tested on others. Records carry `meta["cue_id"]` ("absence:3"),
  `meta["cue_kind"]` and a `cue` span on the deciding phrase.
- Decoys (on by default; `decoys=` a bool or the fraction of tasks): a transfer story adds the
  other cue with an object that is taken out and put back, a contents story has the protagonist
  look into a glass container, and someone else is told. With decoys every condition of a task
  has the same words: only which cue goes with which event, who is told and who is not, and
  what is looked into decide belief. Without them the conditions still match in sentences and
  answer-word mentions, and in length within WORD_TOLERANCE words (checked per task).
- Conditions differ only inside their contrast sentences, so false-belief vs control prompts
  are token-aligned minimal pairs for patching (`tomlens.stimuli.pairs`).
- Surface cues are counterbalanced across tasks in blocks of 8: which answer word comes first in
  `options`, which of the two is mentioned first in the story, and which is mentioned last, so none
  of them predicts the answer within a condition x prompt type. Each answer word is correct in 8 of
  a task's 16 prompts and wrong in the other 8. Contents stories draw the label and the true
  contents from things that come in that container (`lexicon.CONTAINER_CONTENTS`).

Every record carries the labels probes need (`world_state`, `protagonist_belief`,
`reference_state`), role spans (first mentions, the contrast sentence(s), the cue, the query and
the query's own mentions `query_protagonist` / `query_object`), every mention of each role in
`mentions` (story roles in the story, query roles in the prompt) and, in
`meta`, the lexical choices and the counterbalancing flags. `build_story` exposes the sentence
structure with per-sentence world/belief updates, which the sentence-by-sentence tracking family
reuses.
"""

from __future__ import annotations

import random
import re
from collections import Counter
from dataclasses import dataclass, field
from string import Formatter
from typing import Any, Sequence

from tomlens.errors import TomlensError
from tomlens.stimuli import lexicon
from tomlens.stimuli.records import Span, Stimulus, find_mentions

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
# {placeP}, {placeA}; contents: {C} container, {G} a glass container, {X} true contents, {Y} the
# other word, {LA},{LB} what the label says and says not.
# Composite slots filled from the cue pools (lexicon.CUE_POOLS) before rendering: {cue} an absence
# or presence phrase, {event} the handling of the object, {told} a telling phrase, {look} a
# looking phrase. Every condition of a task uses the same words: what decides belief is which cue
# goes with which event (transfer), who is told and who is not, and what is looked into.
# ---------------------------------------------------------------------------------------------

TRANSFER_TEMPLATES: dict[str, dict[str, str]] = {
    "ut-a": {
        "setting": "{P} and {A} are in the {room}.",
        "listing": "There is a {LX} and a {LY} in the {room}.",
        "put": "{P} puts {Pp} {obj} in the {L1}.",
        "frame": "While {P} {cue}, {A} {event}.",
        "move": "takes the {obj} out of the {L1} and, instead of putting it back, puts it in the {L2}",
        "back": "takes the {obj} out of the {L1} and, instead of putting it in the {L2}, puts it back",
        "pad": "For a while, nothing happens in the {room}.",
        "tell": "{A} {told} where the {obj} is now.",
        "closing": "The {LZ} and the {LW} are both closed.",
        "leave": "Then {P} goes to {placeP}, and {A} goes to {placeA}.",
        "return": "Later, {P} comes back and wants {Pp} {obj}.",
        "reality": "The {obj} is now in the",
        "belief": "{P} will look for the {obj} in the",
    },
    "ut-b": {
        "setting": "{P} and {A} are at home in the {room}.",
        "listing": "The {room} has a {LX} and a {LY}.",
        "put": "{P} places {Pp} {obj} inside the {L1}.",
        "frame": "{A} {event} while {P} {cue}.",
        "move": "lifts the {obj} out of the {L1} and, rather than setting it back, sets it in the {L2}",
        "back": "lifts the {obj} out of the {L1} and, rather than setting it in the {L2}, sets it back",
        "pad": "The {room} is quiet for a few minutes.",
        "tell": "Afterwards, {A} {told} where the {obj} is.",
        "closing": "Both the {LZ} and the {LW} are shut.",
        "leave": "{P} leaves for {placeP}, and {A} leaves for {placeA}.",
        "return": "In the evening, {P} returns and needs {Pp} {obj}.",
        "reality": "Right now, the {obj} is in the",
        "belief": "To get the {obj}, {P} first opens the",
    },
    "ut-c": {
        "setting": "{P} is in the {room} with {A}.",
        "listing": "In the {room} there is a {LX} and a {LY}.",
        "put": "{P} leaves {Pp} {obj} in the {L1}.",
        "frame": "{P} {cue} when {A} {event}.",
        "move": "picks the {obj} up from the {L1} and, instead of dropping it back, drops it into the {L2}",
        "back": "picks the {obj} up from the {L1} and, instead of dropping it into the {L2}, drops it back",
        "pad": "Some time passes in the {room}.",
        "tell": "{A} then {told} where the {obj} has ended up.",
        "closing": "The {LZ} is closed, and so is the {LW}.",
        "leave": "Afterwards, {P} heads to {placeP} and {A} heads to {placeA}.",
        "return": "When {P} gets back, {Ps} wants {Pp} {obj}.",
        "reality": "At this moment, the {obj} is inside the",
        "belief": "{P} thinks that the {obj} is in the",
    },
    "ut-d": {
        "setting": "{A} and {P} are spending the morning in the {room}.",
        "listing": "A {LX} and a {LY} stand in the {room}.",
        "put": "{P} drops {Pp} {obj} into the {L1}.",
        "frame": "As {P} {cue}, {A} {event}.",
        "move": "removes the {obj} from the {L1} and, rather than placing it back, places it in the {L2}",
        "back": "removes the {obj} from the {L1} and, rather than placing it in the {L2}, places it back",
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
        "fill_x1": "{A} fills a {C} with {X}.",
        "fill_x2": "There are no {Y} in the {C}.",
        "fill_y1": "{A} takes a {C} that has no {Y} in it.",
        "fill_y2": "{A} fills the {C} with {X}.",
        "find": "{P} finds the {C}.",
        "unseen": "{P} has never seen this {C} before.",
        "read": "{P} reads the label.",
        "closed": "{P} leaves the {C} shut.",
        "tell_y": "{A} {told} that the {C} holds {X}, not {Y}.",
        "tell_x": "{A} {told} that the {C} holds no {Y}, only {X}.",
        "reality": "{P} opens the {C} and looks inside. It is full of",
        "belief": "{P} expects the {C} to be full of",
    },
    "uc-b": {
        "fill_x1": "{A} packs a {C} with {X}.",
        "fill_x2": "The {C} holds no {Y}.",
        "fill_y1": "{A} has a {C} that holds no {Y}.",
        "fill_y2": "{A} packs the {C} with {X}.",
        "find": "Later, {P} comes across the {C}.",
        "unseen": "{P} does not know what is in it.",
        "read": "{P} looks at the label.",
        "closed": "{P} keeps the {C} closed.",
        "tell_y": "{A} {told} that the {C} contains {X}, not {Y}.",
        "tell_x": "{A} {told} that the {C} contains no {Y}, only {X}.",
        "reality": "{P} lifts the lid of the {C}. Inside, {Ps} sees lots of",
        "belief": "{P} believes that the {C} contains",
    },
    "uc-c": {
        "fill_x1": "{A} keeps {X} in a {C}.",
        "fill_x2": "There are no {Y} in it.",
        "fill_y1": "{A} has a {C} with no {Y} in it.",
        "fill_y2": "{A} keeps {X} in the {C}.",
        "find": "{P} sees the {C} on a shelf.",
        "unseen": "{P} has not seen this {C} before.",
        "read": "{P} reads what the label says.",
        "closed": "{P} does not open the {C}.",
        "tell_y": "{A} {told} that the {C} has {X} in it, not {Y}.",
        "tell_x": "{A} {told} that the {C} has no {Y} in it, only {X}.",
        "reality": "{P} takes the lid off the {C} and finds it full of",
        "belief": "{P} is sure that the {C} is full of",
    },
    "uc-d": {
        "fill_x1": "{A} puts {X} into a {C}.",
        "fill_x2": "The {C} contains no {Y}.",
        "fill_y1": "{A} empties a {C}, so it contains no {Y}.",
        "fill_y2": "Then {A} puts {X} into the {C}.",
        "find": "{P} picks up the {C}.",
        "unseen": "{P} has never seen it before.",
        "read": "{P} reads the label on it.",
        "closed": "{P} leaves the {C} unopened.",
        "tell_y": "{A} {told} that there are {X} in the {C}, not {Y}.",
        "tell_x": "{A} {told} that there are no {Y} in the {C}, only {X}.",
        "reality": "{P} opens the {C}. Looking inside, {Ps} sees that it holds",
        "belief": "{P} assumes that the {C} is filled with",
    },
}
# The look sentence of a contents story. With a decoy the protagonist looks into a glass container
# in every condition, and only the word order says whether the labelled one was looked into too.
LOOK_SENTENCES: dict[str, str] = {
    "decoy_seen": "{P} {look}, not the glass {G} next to it.",  # {tgt} = the {C}
    "decoy_unseen": "{P} {look}, not the {C} next to it.",  # {tgt} = the glass {G}
    "seen": "{P} {look}.",  # {tgt} = the {C}; without a decoy the unseen story uses "closed"
}
# Who is told: with a decoy someone is always told, and the protagonist always named.
HEARERS: dict[tuple[bool, bool], str] = {  # (decoy, protagonist told) -> {H}
    (True, True): "{P}, but not {B},", (True, False): "{B}, but not {P},",
    (False, True): "{P}", (False, False): NOBODY,
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
    extra: dict[str, str] = field(default_factory=dict)  # obj, room, places / container; B, G
    cue_group: int = 0  # index into every pool of lexicon.CUE_POOLS (balanced within blocks)
    decoy: bool = False  # the task's stories carry decoy cues (all its conditions alike)

    @property
    def options(self) -> tuple[str, str]:
        return self.words if self.options_ref_first else (self.words[1], self.words[0])


def balanced_flags(rng: random.Random, size: int) -> list[bool]:
    """`size` flags, half of them True, in an order shuffled by `rng` (counterbalancing blocks)."""
    flags = [True] * (size // 2) + [False] * (size - size // 2)
    rng.shuffle(flags)
    return flags


def _block_plan(family: str, seed: int, block: int, decoys: float = 1.0) -> list[dict[str, Any]]:
    """Flags, templates, cue groups and decoys for the tasks of one block; depends only on
    (family, seed, block, decoys), so the tasks of a smaller n are a prefix of a larger n. Every
    cue group is used once per block; `decoys` of the block's tasks (rounded) carry decoys."""
    rng = random.Random(f"{family}/plan/{seed}/{block}")
    names = list(TEMPLATES[family])
    templates = [names[i % len(names)] for i in range(BLOCK)]
    rng.shuffle(templates)
    opt, first, last = (balanced_flags(rng, BLOCK) for _ in range(3))
    cue_rng = random.Random(f"{family}/cues/{seed}/{block}")
    groups = list(range(lexicon.CUE_GROUPS))
    cue_rng.shuffle(groups)
    n_decoy = round(decoys * BLOCK)
    decoy = [True] * n_decoy + [False] * (BLOCK - n_decoy)
    cue_rng.shuffle(decoy)
    return [
        {"template": templates[j], "options_ref_first": opt[j], "first_ref": first[j],
         "last_ref": last[j], "cue_group": groups[j % len(groups)], "decoy": decoy[j]}
        for j in range(BLOCK)
    ]


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
            plan = _block_plan(family, seed, i // BLOCK, fraction)
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
                decoy=p["decoy"],
            )
        )
    return tasks


def _people(rng: random.Random) -> tuple[tuple[str, str, str, str], tuple[str, str, str, str]]:
    """Protagonist and other agent of opposite pronouns, so every pronoun has one referent."""
    protagonist = rng.choice(lexicon.NAMES)
    other = "he" if protagonist[1] == "she" else "she"
    return protagonist, rng.choice(lexicon.names_by_pronoun(other))


def _bystander(rng: random.Random, *people: tuple[str, str, str, str]) -> str:
    """Someone else who may be told (never referred to by a pronoun)."""
    return rng.choice([row for row in lexicon.NAMES if row[0] not in {p[0] for p in people}])[0]


def _draw_transfer(rng: random.Random) -> dict[str, Any]:
    protagonist, agent = _people(rng)
    obj = rng.choice(lexicon.TRANSFER_OBJECTS)
    start, other = rng.sample(lexicon.TRANSFER_LOCATIONS, 2)
    place_p, place_a = rng.sample(lexicon.PLACES, 2)
    room = rng.choice(lexicon.ROOMS)
    return {
        "key": (protagonist[0], obj, frozenset((start, other))),
        "protagonist": protagonist, "agent": agent, "words": (start, other),
        "extra": {"obj": obj, "room": room, "placeP": place_p, "placeA": place_a,
                  "B": _bystander(rng, protagonist, agent)},
    }


def _draw_contents(rng: random.Random) -> dict[str, Any]:
    protagonist, agent = _people(rng)
    container = rng.choice(lexicon.CONTAINERS)
    # label and true contents: two things that both come in this container
    label, contents = rng.sample(lexicon.CONTAINER_CONTENTS[container], 2)
    glass = rng.choice([g for g in lexicon.GLASS_CONTAINERS if g != container])
    return {
        "key": (protagonist[0], container, frozenset((label, contents))),
        "protagonist": protagonist, "agent": agent, "words": (label, contents),
        "extra": {"C": container, "B": _bystander(rng, protagonist, agent), "G": glass},
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
    return {"P": p[0], "Ps": p[1], "Po": p[2], "Pp": p[3], "A": a[0], "As": a[1], "Ao": a[2],
            "Ap": a[3]}


def _cue(kind: str, task: Task) -> str:
    return lexicon.CUE_POOLS[kind][task.cue_group]


def _told(task: Task, protagonist_told: bool) -> str:
    """The telling phrase: with a decoy someone is always told and the protagonist always named."""
    return _cue("told", task).replace("{H}", HEARERS[(task.decoy, protagonist_told)])


def _transfer_story(task: Task, condition: str, rev: bool, start: str, other: str) -> Story:
    t = TRANSFER_TEMPLATES[task.template_id]
    slots = {**_person_slots(task), **task.extra, "L1": start, "L2": other}
    slots["LX"], slots["LY"] = (start, other) if task.first_ref else (other, start)
    slots["LZ"], slots["LW"] = (other, start) if task.last_ref else (start, other)
    loc = {"L1": ("location_1",), "L2": ("location_2",)}
    roles = {
        "P": ("protagonist",), "A": ("other_agent",), "obj": ("object",), **loc,
        "LX": loc["L1"] if task.first_ref else loc["L2"],
        "LY": loc["L2"] if task.first_ref else loc["L1"],
        "LZ": loc["L2"] if task.last_ref else loc["L1"],
        "LW": loc["L1"] if task.last_ref else loc["L2"],
    }
    moves = condition != "no_transfer"
    # The deciding event: absent (or, when present, watching) while the object is moved (or, in
    # the no-transfer control, taken out and put back). The decoy before it pairs the other cue
    # with an object that is put back, so every condition holds both cues and both events.
    main_cue = _cue("presence" if condition == "present" else "absence", task)
    decoy_cue = _cue("absence" if condition == "present" else "presence", task)
    main = t["frame"].replace("{cue}", main_cue).replace("{event}", t["move"] if moves else t["back"])
    told = _told(task, condition == "informed")
    if task.decoy:
        decoy = StorySentence("decoy", t["frame"].replace("{cue}", decoy_cue).replace("{event}", t["back"]),
                              cue=decoy_cue)
    else:
        decoy = StorySentence("decoy", t["pad"])
    sentences = (
        StorySentence("setting", t["setting"]),
        StorySentence("listing", t["listing"]),
        StorySentence("put", t["put"], world="L1", belief="L1"),
        decoy,
        StorySentence("move", main, world="L2" if moves else None,
                      belief="L2" if condition == "present" else None, cue=main_cue),
        StorySentence("tell", t["tell"].replace("{told}", told),
                      belief=("L2" if moves else "L1") if condition == "informed" else None,
                      cue=told),
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
    seen = condition == "open_container"
    look_phrase = _cue("look", task)
    if task.decoy:  # looks into the glass container, or into the labelled one: same words
        look_phrase = look_phrase.replace("{tgt}", "the {C}" if seen else "the glass {G}")
        look = StorySentence("look", LOOK_SENTENCES["decoy_seen" if seen else "decoy_unseen"]
                             .replace("{look}", look_phrase), cue=look_phrase)
    elif seen:
        look_phrase = look_phrase.replace("{tgt}", "the {C}")
        look = StorySentence("look", LOOK_SENTENCES["seen"].replace("{look}", look_phrase),
                             cue=look_phrase)
    else:
        look = StorySentence("look", t["closed"], cue=t["closed"][:-1])
    told = _told(task, condition == "informed")
    label_sentence = _cue("label", task)
    sentences = (
        *fill,
        StorySentence("label", label_sentence, cue=label_sentence[:-1]),
        StorySentence("find", t["find"]),
        StorySentence("unseen", t["unseen"]),
        StorySentence("read", t["read"], belief="LA"),
        StorySentence("look", look.template, belief="X" if seen else None, cue=look.cue),
        StorySentence("tell", (t["tell_y"] if task.last_ref else t["tell_x"]).replace("{told}", told),
                      belief="X" if condition == "informed" else None, cue=told),
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
    TRANSFER: {"false_belief": ("decoy", "move", "tell"), "present": ("decoy", "move"),
               "informed": ("tell",), "no_transfer": ("decoy", "move", "tell")},
    CONTENTS: {"false_belief": ("look", "tell"), "open_container": ("look",),
               "informed": ("tell",), "correct_label": ("label",)},
}
# Extra span roles on every record: the single sentences pairs narrow `contrast` to.
EXTRA_CONTRASTS: dict[str, dict[str, str]] = {
    TRANSFER: {"contrast_seen": "move", "contrast_told": "tell"},
    CONTENTS: {"contrast_seen": "look", "contrast_told": "tell", "contrast_label": "label"},
}
# The sentences each extra span covers on a full story: a transfer story's "seen" contrast spans
# the decoy and the move, because the present control swaps their two cues.
EXTRA_CONTRAST_SPANS: dict[str, dict[str, tuple[str, ...]]] = {
    TRANSFER: {"contrast_seen": ("decoy", "move"), "contrast_told": ("tell",)},
    CONTENTS: {"contrast_seen": ("look",), "contrast_told": ("tell",), "contrast_label": ("label",)},
}
# The sentence whose cue decides the protagonist's belief, and the kind of that cue.
CUE_SENTENCE: dict[str, dict[str, tuple[str, str]]] = {
    TRANSFER: {"false_belief": ("move", "absence"), "present": ("move", "presence"),
               "informed": ("tell", "told"), "no_transfer": ("move", "absence")},
    CONTENTS: {"false_belief": ("look", "look"), "open_container": ("look", "look"),
               "informed": ("tell", "told"), "correct_label": ("label", "label")},
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
    # without a decoy the decoy slot holds a neutral sentence that no contrast needs
    def cover(roles: Sequence[str]) -> Span:
        return Span.covering([by_role[x] for x in roles if task.decoy or x != "decoy"])

    spans["contrast"] = cover(CONTRAST_ROLES[task.family][story.condition])
    for name, roles in EXTRA_CONTRAST_SPANS[task.family].items():
        spans[name] = cover(roles)
    spans["query"] = r.query
    spans.update(r.query_spans)
    story_text = r.text[: r.sentences[-1].end]
    cue_role, cue_kind = CUE_SENTENCE[task.family][story.condition]
    spans["cue"] = _cue_span(story, r, cue_role)
    order = mentions(story_text, task.words)
    code = CONDITION_CODES[story.condition]
    meta: dict[str, Any] = {
        "protagonist": task.protagonist[0], "other_agent": task.agent[0],
        "protagonist_access": ACCESS[story.condition],
        "first_mentioned": order[0], "last_mentioned": order[-1],
        "options_ref_first": task.options_ref_first, "first_ref": task.first_ref,
        "last_ref": task.last_ref, "task_index": task.index, "seed": task.seed,
        "cue_kind": cue_kind, "cue_id": _cue_id(task, cue_kind, story.condition),
        "cue_group": task.cue_group, "decoy": task.decoy, "bystander": task.extra["B"],
    }
    if task.decoy:
        decoy_kind = {"absence": "presence", "presence": "absence"}.get(cue_kind, cue_kind)
        meta["decoy_cue_id"] = (f"{decoy_kind}:{task.cue_group}" if task.family == TRANSFER
                                else f"look:{task.cue_group}")
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
        mentions=_all_mentions(story, r, spans["cue"]),
    )


def _cue_id(task: Task, kind: str, condition: str) -> str:
    """"kind:index" of the pooled phrasing that decides belief; a contents story without a decoy
    whose protagonist leaves the container shut has the template's own sentence instead, named by
    the task's cue group (a template id would join, under cue grouping, every task of a template)."""
    if task.family == CONTENTS and kind == "look" and condition != "open_container" and not task.decoy:
        return f"closed:{task.cue_group}"
    return f"{kind}:{task.cue_group}"


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
    their cue: same number of sentences, the same count of each answer word's mentions, and the
    same words (with decoys) or word counts within WORD_TOLERANCE (without)."""
    texts = [s.render().text for s in stories]
    task = stories[0].task
    shapes = {(len(s.sentences), tuple(sorted(Counter(mentions(t, task.words)).items())))
              for s, t in zip(stories, texts)}
    lengths = [len(t.split()) for t in texts]
    same_words = len({tuple(sorted(t.replace(",", " ").replace(".", " ").split())) for t in texts}) == 1
    if len(shapes) > 1 or max(lengths) - min(lengths) > WORD_TOLERANCE or (task.decoy and not same_words):
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
    fraction of tasks, balanced in blocks of 8) adds a decoy before the deciding event: the
    other cue with an object that is put back; decoy tasks also tell someone else, never nobody.
    """
    return _generate(TRANSFER, n, seed, conditions, decoys)


def unexpected_contents(n: int = 20, seed: int = 0, conditions: Sequence[str] | None = None,
                        decoys: bool | float = True) -> list[Stimulus]:
    """`n` unexpected-contents tasks x 16 prompts (4 conditions x original/reversed x reality/belief).

    Answers (original version; reversed swaps contents and label word): false belief reality = the
    true contents X, belief = the label word Y; open container, correct label and informed: X / X.
    `reference_state` is the word on the label (X in the correct-label control). `decoys` as in
    `unexpected_transfer`: the protagonist looks into a glass container in every condition
    (into the labelled one too only when it is opened), and someone else is told.
    """
    return _generate(CONTENTS, n, seed, conditions, decoys)


def cue_holdout(stimuli: Sequence[Stimulus], held_out: float = 0.5,
                seed: int = 0) -> tuple[list[int], list[int]]:
    """(train, test) row indices where the test rows' cue phrasings are used by no training row.

    Every pooled phrasing of a task comes from its cue group (`meta["cue_group"]`: index i of
    every pool in lexicon.CUE_POOLS), so holding out whole groups holds out their phrasings of
    every kind, decoys included, and every task lies wholly on one side. `held_out` is the
    fraction of the groups present that go to the test side (at least one group on each side).
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
