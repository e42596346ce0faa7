"""The false-belief factorial: Jones, Trott & Bergen's design, with stories written for tomlens.

Why: in the transfer family the belief label is the condition and a word or two gives it away;
nothing separates belief from "the location named first" or "named last". Here each task is one
story template rendered in 16 versions, one per cell of knowledge state (false / true belief) x
first mention (the passage names Start or End first) x recent mention (it names Start or End last
before the question) x knowledge cue (implicit "X goes to get the OBJ from the" / explicit "X
thinks the OBJ is in the"). Primacy and recency are crossed with the label inside every task, so
neither predicts the answer, and a probe or patching result can be checked against them.

How the factors are written, so that versions differ only where the design says:
- first mention: the opening sentence names both locations; the two words trade places;
- recent mention: the move sentence names both locations; each move phrasing is a pair of
  orderings made of the same words ("from the Start to the End" / "to the End from the Start");
- knowledge state: two cue sentences, a paired absence and presence phrasing (pools of 10, dealt
  to tasks in seeded shuffled blocks of 10), one about the protagonist and one about a bystander;
  the protagonist's decides belief (absence = false belief, presence = true belief). Which of the
  two comes first is balanced in blocks of 8 tasks;
- knowledge cue: the final, incomplete sentence.
So within a task every story version has the same words (the two states swap the protagonist's and
the bystander's names), the same length in words and characters, and the same mentions of every
role (Start and End 3 times each in the story): a bag of words cannot decode belief.

Labels are the transfer family's: `world_state` = End, `protagonist_belief` = Start (false
belief) or End (true belief), `reference_state` = Start. Per task: 16 belief prompts (one per
cell) and 8 reality prompts ("The OBJ is now in the", one per story: the knowledge cue only changes
the final sentence, so a reality prompt per cue would repeat a text). Which option comes first is
balanced in blocks of 8 tasks; templates are dealt in a seeded order without repeats until all
have been used.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import product
from string import Formatter
from typing import Any

from tomlens.errors import TomlensError
from tomlens.stimuli import lexicon
from tomlens.stimuli.false_belief import balanced_flags
from tomlens.stimuli.records import Span, Stimulus, find_mentions
from tomlens.stimuli.shortcuts import Contrast, Rule

FAMILY = "false-belief-factorial"
PREFIX = "fbf"
BLOCK = 8  # the option order is exactly balanced within each block of 8 tasks
CONDITIONS: tuple[str, ...] = ("false_belief", "true_belief")
CONDITION_CODES: dict[str, str] = {"false_belief": "fb", "true_belief": "tb"}
MENTIONS: tuple[str, ...] = ("start", "end")
KNOWLEDGE_CUES: tuple[str, ...] = ("implicit", "explicit")
PROMPT_TYPES: tuple[str, str] = ("reality", "belief")
CUE_KINDS: dict[str, str] = {"false_belief": "absence", "true_belief": "presence"}
ACCESS: dict[str, str] = {"false_belief": "absent", "true_belief": "saw"}


@dataclass(frozen=True)
class Template:
    """One story setting: its opening (naming both locations, {LA} first), the room word the
    cue sentences may use, and objects and locations that all go together."""

    id: str
    room: str
    opening: str
    objects: tuple[str, ...]
    locations: tuple[str, ...]


def _t(id: str, room: str, opening: str, objects: str, locations: str) -> Template:
    return Template(id, room, opening, tuple(objects.split()), tuple(locations.split()))


# Slots: {P} protagonist, {A} other agent, {LA}/{LB} the locations in the order the opening names
# them. Every location takes "in the"; every object is singular ("the OBJ is in the").
TEMPLATES: tuple[Template, ...] = (
    _t("kitchen", "kitchen", "{P} and {A} are cooking in the kitchen, where there is a {LA} beside a {LB}.",
       "spoon knife ladle whisk mug", "drawer pantry basket tray pot"),
    _t("office", "office", "{P} and {A} share an office with a {LA} in one corner and a {LB} in the other.",
       "stapler pen folder calculator envelope", "drawer cabinet tray box bag"),
    _t("classroom", "classroom", "After the lesson, {P} and {A} tidy the classroom, which has a {LA} and a {LB}.",
       "chalk eraser marker ruler crayon", "closet box tray bin bag"),
    _t("garage", "garage", "{P} and {A} are fixing a bike in the garage, next to a {LA} and a {LB}.",
       "wrench hammer screwdriver drill torch", "toolbox bucket bin cabinet drawer"),
    _t("bathroom", "bathroom", "{P} and {A} are cleaning the bathroom, where a {LA} stands near a {LB}.",
       "toothbrush comb razor soap", "cabinet drawer basket cup"),
    _t("bedroom", "bedroom", "{P} and {A} are in the bedroom, which has a {LA} by the bed and a {LB} by the door.",
       "watch necklace ring bracelet scarf", "drawer box closet chest bag"),
    _t("shed", "shed", "{P} and {A} are potting plants in the shed, with a {LA} and a {LB} on the floor.",
       "trowel spade sprayer glove", "bucket bin basket sack"),
    _t("library", "library", "{P} and {A} work at the library desk, which has a {LA} on one side and a {LB} on the other.",
       "book bookmark map magazine notebook", "drawer cart box basket cabinet"),
    _t("campsite", "campsite", "{P} and {A} set up camp, unpacking a {LA} and a {LB} beside the tent.",
       "flashlight compass map knife lighter", "backpack bag cooler box bucket"),
    _t("beach", "beach", "{P} and {A} spend the day at the beach with a {LA} and a {LB} on the sand.",
       "frisbee towel ball book sunscreen", "bag cooler bucket basket"),
    _t("clinic", "clinic", "{P} and {A} are nurses at a clinic, where a {LA} sits beside a {LB}.",
       "thermometer chart stethoscope badge", "drawer cabinet tray cart box"),
    _t("bakery", "bakery", "Before opening, {P} and {A} prepare the bakery, which has a {LA} and a {LB} by the oven.",
       "spatula whisk knife scoop", "drawer jar bowl tin pantry"),
    _t("music", "music room", "{P} and {A} practise in the music room, between a {LA} and a {LB}.",
       "flute harmonica tuner metronome", "case box cabinet drawer bag"),
    _t("studio", "studio", "{P} and {A} paint in the studio, where a {LA} stands next to a {LB}.",
       "brush pencil palette sponge", "jar box drawer tray tin"),
    _t("laboratory", "lab", "{P} and {A} run an experiment in the lab, next to a {LA} and a {LB}.",
       "beaker pipette thermometer magnet", "drawer cabinet tray fridge box"),
    _t("gym", "gym", "{P} and {A} train in the gym, where a {LA} and a {LB} stand by the wall.",
       "ball whistle stopwatch racket towel", "bag cart basket bin box"),
    _t("car", "car", "{P} and {A} stop for a break on a road trip, and their car holds a {LA} and a {LB}.",
       "phone wallet map charger", "console trunk bag box"),
    _t("hotel", "hotel room", "{P} and {A} unpack in their hotel room, next to a {LA} and a {LB}.",
       "passport wallet key watch", "safe drawer closet bag purse"),
    _t("playroom", "playroom", "{P} and {A} tidy the playroom, which has a {LA} under the window and a {LB} by the door.",
       "doll teddy rattle puzzle ball", "box basket chest closet tub"),
    _t("restaurant", "restaurant", "{P} and {A} set the tables at the restaurant, near a {LA} and a {LB}.",
       "menu corkscrew ladle candle", "drawer cabinet pantry box basket"),
    _t("mailroom", "mailroom", "{P} and {A} sort the post in the mailroom, beside a {LA} and a {LB}.",
       "parcel letter stamp envelope", "bag box tray sack cabinet"),
    _t("barn", "barn", "{P} and {A} feed the animals in the barn, where a {LA} stands by a {LB}.",
       "lantern brush rope bell", "barrel sack bucket chest box"),
    _t("boat", "cabin", "{P} and {A} are aboard their moored boat, whose cabin has a {LA} and a {LB}.",
       "rope compass lantern map", "trunk chest bag box"),
    _t("living", "living room", "{P} and {A} relax in the living room, which has a {LA} by the sofa and a {LB} by the door.",
       "remote book magazine candle photo", "basket drawer cabinet box chest"),
    _t("attic", "attic", "{P} and {A} sort through the attic, where a {LA} sits beside a {LB}.",
       "photo diary letter medal album", "trunk chest box drawer case"),
    _t("laundry", "laundry room", "{P} and {A} fold clothes in the laundry room, next to a {LA} and a {LB}.",
       "sock shirt scarf towel", "hamper basket dryer drawer bag"),
    _t("workshop", "workshop", "{P} and {A} build a shelf in the workshop, with a {LA} and a {LB} by the bench.",
       "chisel clamp hammer level", "toolbox drawer bucket bin"),
    _t("station", "station", "{P} and {A} wait at the station with a {LA} and a {LB} at their feet.",
       "ticket wallet book umbrella", "bag backpack purse basket"),
)

# Placing the object at the start; each phrasing names both locations once (the start as the
# choice, the end as the one passed over), so that with the opening and the move every story names
# Start and End three times each and the more-named location never gives the answer away.
PLACE: tuple[str, ...] = (
    "{P} puts the {obj} in the {L1}, not the {L2}.",
    "{P} places the {obj} inside the {L1} instead of the {L2}.",
    "{P} stores the {obj} in the {L1} rather than the {L2}.",
    "{P} tucks the {obj} into the {L1} and not the {L2}.",
)
# Knowledge-setting sentences, paired by index: ABSENCE[i] and PRESENCE[i] have the same slots and
# the same number of words and characters, and neither names a location or the other agent. Every
# story holds BOTH sentences of its pair, one about the protagonist and one about a bystander
# ({P}/{Pp} below become the bystander's name and possessive in the bystander's sentence): false
# belief = the protagonist gets the absence sentence, true belief = the presence sentence. The two
# states of a task therefore have the same words (the names trade places), so a bag of words cannot
# decode belief; which sentence comes first is balanced across tasks. Slots: {P}, {Pp}, {room}, {place}.
ABSENCE: tuple[str, ...] = (
    "{P} wanders out on an errand.",
    "{P} steps away to answer a call.",
    "{P} leaves the {room} for a few minutes.",
    "{P} lies down and falls asleep.",
    "{P} heads off to {place} alone.",
    "{P} has {Pp} back turned and notes nothing.",
    "{P} is away for quite a while.",
    "{P} heads out for a long walk.",
    "{P} shuts {Pp} eyes and dozes off.",
    "{P} is busy somewhere else.",
)
PRESENCE: tuple[str, ...] = (
    "{P} stays and watches it all.",
    "{P} stays close and sees it all.",
    "{P} never leaves the {room} and sees it.",
    "{P} sits close and watches all.",
    "{P} skips {place} and stays on.",
    "{P} has {Pp} eyes open and sees everything.",
    "{P} is nearby and sees it all.",
    "{P} stays put and sees it all.",
    "{P} looks on, {Pp} eyes wide open.",
    "{P} observes it all happen.",
)
# The move, as pairs of orderings of the same words: [0] ends on the end location (recent mention
# = end), [1] on the start (recent mention = start).
MOVE: tuple[tuple[str, str], ...] = (
    ("{A} moves the {obj} from the {L1} to the {L2}.", "{A} moves the {obj} to the {L2} from the {L1}."),
    ("{A} carries the {obj} away from the {L1}, over to the {L2}.",
     "{A} carries the {obj} over to the {L2}, away from the {L1}."),
    ("{A} transfers the {obj} from the {L1} into the {L2}.", "{A} transfers the {obj} into the {L2} from the {L1}."),
    ("{A} shifts the {obj} over from the {L1} to the {L2}.", "{A} shifts the {obj} over to the {L2} from the {L1}."),
)
# After the move: the protagonist wants the object (names no location, reads right in both states).
LATER: tuple[str, ...] = (
    "Later, {P} wants the {obj} again.",
    "After a while, {P} needs the {obj}.",
    "Some time later, {P} wants to use the {obj}.",
    "A little later, {P} needs the {obj} again.",
)
QUERIES: dict[str, str] = {
    "implicit": "{P} goes to get the {obj} from the",
    "explicit": "{P} thinks the {obj} is in the",
    "reality": "The {obj} is now in the",
}
SLOT_ROLES: dict[str, str] = {"P": "protagonist", "A": "other_agent", "obj": "object",
                              "L1": "location_1", "L2": "location_2"}
QUERY_ROLES: dict[str, str] = {"P": "query_protagonist", "obj": "query_object"}


@dataclass(frozen=True)
class FactorialTask:
    """One template instance: the words and phrasings shared by its 16 versions."""

    index: int
    seed: int
    task_id: str
    template: Template
    protagonist: tuple[str, str, str, str]
    agent: tuple[str, str, str, str]
    obj: str
    locations: tuple[str, str]  # (start, end)
    place: str
    bystander: tuple[str, str, str, str]
    absence_first: bool  # the absence sentence comes before the presence sentence
    phrasing: dict[str, int]  # part -> index into PLACE / ABSENCE+PRESENCE ("cue") / MOVE / LATER
    options_start_first: bool

    @property
    def options(self) -> tuple[str, str]:
        return self.locations if self.options_start_first else self.locations[::-1]

    @property
    def template_id(self) -> str:
        return f"{PREFIX}-{self.template.id}"

    def slots(self, first_mention: str) -> dict[str, str]:
        start, end = self.locations
        la, lb = (start, end) if first_mention == "start" else (end, start)
        return {"P": self.protagonist[0], "Pp": self.protagonist[3], "A": self.agent[0],
                "B": self.bystander[0], "Bp": self.bystander[3],
                "obj": self.obj, "L1": start, "L2": end, "LA": la, "LB": lb,
                "room": self.template.room, "place": self.place}


def _template_order(seed: int, cycle: int) -> list[int]:
    rng = random.Random(f"{FAMILY}/templates/{seed}/{cycle}")
    order = list(range(len(TEMPLATES)))
    rng.shuffle(order)
    return order


def _option_layout(seed: int, block: int, what: str = "options") -> list[bool]:
    return balanced_flags(random.Random(f"{FAMILY}/{what}/{seed}/{block}"), BLOCK)


def _cue_layout(seed: int, block: int) -> list[int]:
    """Cue pair indices dealt in seeded shuffled blocks of the pool size, so every pair is used
    equally often (an independent draw per task is lopsided)."""
    rng = random.Random(f"{FAMILY}/cues/{seed}/{block}")
    order = list(range(len(ABSENCE)))
    rng.shuffle(order)
    return order


def make_factorial_tasks(n: int, seed: int) -> list[FactorialTask]:
    """`n` tasks, deterministic given `seed`; task i depends only on (seed, i), so a smaller n is
    a prefix of a larger one. Templates come in seeded rounds of all templates (no repeat before
    every template has been used once)."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise TomlensError(f"{FAMILY} needs n >= 1 tasks, got {n!r}", "pass n=1 or more")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TomlensError(f"{FAMILY} needs an integer seed, got {seed!r}", "pass seed=0 (or any integer)")
    tasks: list[FactorialTask] = []
    for i in range(n):
        template = TEMPLATES[_template_order(seed, i // len(TEMPLATES))[i % len(TEMPLATES)]]
        rng = random.Random(f"{FAMILY}/task/{seed}/{i}")
        protagonist = rng.choice(lexicon.NAMES)
        other = "he" if protagonist[1] == "she" else "she"  # one referent per pronoun
        agent = rng.choice(lexicon.names_by_pronoun(other))
        obj = rng.choice(template.objects)
        start, end = rng.sample(template.locations, 2)
        phrasing = {"place": rng.randrange(len(PLACE)),
                    "cue": _cue_layout(seed, i // len(ABSENCE))[i % len(ABSENCE)],
                    "move": rng.randrange(len(MOVE)), "later": rng.randrange(len(LATER))}
        bystander = rng.choice([row for row in lexicon.NAMES if row[0] not in (protagonist[0], agent[0])])
        tasks.append(FactorialTask(
            index=i, seed=seed, task_id=f"{PREFIX}-s{seed}-{i:04d}", template=template,
            protagonist=protagonist, agent=agent, obj=obj, locations=(start, end),
            place=rng.choice(lexicon.PLACES), bystander=bystander,
            absence_first=_option_layout(seed, i // BLOCK, "cue-order")[i % BLOCK], phrasing=phrasing,
            options_start_first=_option_layout(seed, i // BLOCK)[i % BLOCK],
        ))
    return tasks


def _fill(template: str, slots: dict[str, str], offset: int) -> tuple[str, dict[str, Span]]:
    """`template` with its slots filled, and the span of each slot's first use (offset by `offset`)."""
    text = ""
    spans: dict[str, Span] = {}
    for literal, name, _spec, _conv in Formatter().parse(template):
        text += literal
        if name is not None:
            spans.setdefault(name, Span(offset + len(text), offset + len(text) + len(slots[name])))
            text += slots[name]
    return text, spans


@dataclass(frozen=True)
class Version:
    """One cell of the design."""

    knowledge_state: str  # "false_belief" | "true_belief"
    first_mention: str  # "start" | "end"
    recent_mention: str  # "start" | "end"

    @property
    def code(self) -> str:
        return f"{CONDITION_CODES[self.knowledge_state]}-f{self.first_mention[0]}-r{self.recent_mention[0]}"


def _about_bystander(template: str) -> str:
    return template.replace("{Pp}", "{Bp}").replace("{P}", "{B}")


def story_parts(task: FactorialTask, version: Version) -> list[tuple[str, str]]:
    """The story's sentences as (part, template) in order: opening, place, the two cue sentences
    ("cue" about the protagonist, "bystander_cue" about the bystander, in the task's order), move,
    later."""
    absence, presence = ABSENCE[task.phrasing["cue"]], PRESENCE[task.phrasing["cue"]]
    if version.knowledge_state == "false_belief":
        absence_part, presence_part = ("cue", absence), ("bystander_cue", _about_bystander(presence))
    else:
        absence_part, presence_part = ("bystander_cue", _about_bystander(absence)), ("cue", presence)
    cues = [absence_part, presence_part] if task.absence_first else [presence_part, absence_part]
    move = MOVE[task.phrasing["move"]][0 if version.recent_mention == "end" else 1]
    return [("opening", task.template.opening), ("place", PLACE[task.phrasing["place"]]),
            *cues, ("move", move), ("later", LATER[task.phrasing["later"]])]


def factorial_stimulus(task: FactorialTask, version: Version, query: str) -> Stimulus:
    """The record for one version's belief prompt (`query` "implicit" / "explicit") or its
    reality prompt (`query` "reality")."""
    if query not in QUERIES:
        raise TomlensError(f"unknown {FAMILY} query {query!r}", f"use one of {list(QUERIES)}")
    slots = task.slots(version.first_mention)
    text = ""
    first: dict[str, Span] = {}  # role -> its first mention
    sentences: dict[str, Span] = {}  # story part -> its sentence
    for part, template in [*story_parts(task, version), ("query", QUERIES[query])]:
        if text:
            text += " "
        sentence, found = _fill(template, slots, len(text))
        sentences[part] = Span(len(text), len(text) + len(sentence))
        text += sentence
        if part == "query":
            query_spans = {QUERY_ROLES[k]: v for k, v in found.items() if k in QUERY_ROLES}
        for slot, span in found.items():
            role = SLOT_ROLES.get(slot)
            if slot in ("LA", "LB"):  # the opening's locations, by what they stand for
                role = "location_1" if slots[slot] == slots["L1"] else "location_2"
            if role:
                first.setdefault(role, span)
    start, end = task.locations
    world = end
    belief = start if version.knowledge_state == "false_belief" else end
    spans = dict(first)
    # the contrast covers both cue sentences: the states swap the names between them
    both = sorted((sentences["cue"], sentences["bystander_cue"]), key=lambda sp: sp.start)
    contrast = Span(both[0].start, both[1].end)
    spans.update(cue=sentences["cue"], contrast=contrast, query=sentences["query"], **query_spans)
    found_all = find_mentions(text, {"protagonist": slots["P"], "other_agent": slots["A"], "object": task.obj,
                                     "location_1": start, "location_2": end, "bystander": slots["B"]})
    query_start = sentences["query"].start  # story roles in the story; the query has its own roles
    mentions: dict[str, tuple[Span, ...]] = {
        role: kept for role, spans_ in found_all.items()
        if (kept := tuple(m for m in spans_ if m.end <= query_start))}
    spans["bystander"] = mentions["bystander"][0]
    mentions.update({"cue": (sentences["cue"],), "contrast": (contrast,),
                     "query": (sentences["query"],)})
    mentions.update({role: (span,) for role, span in query_spans.items()})
    prompt_type = "reality" if query == "reality" else "belief"
    meta: dict[str, Any] = {
        "knowledge_state": version.knowledge_state, "first_mention": version.first_mention,
        "recent_mention": version.recent_mention, "knowledge_cue": None if query == "reality" else query,
        "template": task.template.id, "story": f"{task.task_id}-{version.code}",
        "protagonist": slots["P"], "other_agent": slots["A"], "object": task.obj,
        "location_1": start, "location_2": end, "room": task.template.room,
        "protagonist_access": ACCESS[version.knowledge_state],
        "cue_kind": CUE_KINDS[version.knowledge_state],
        "cue_id": f"pair:{task.phrasing['cue']}", "bystander": slots["B"],
        "cue_order": "absence_first" if task.absence_first else "presence_first",
        "phrasing": dict(task.phrasing), "options_start_first": task.options_start_first,
        "task_index": task.index, "seed": task.seed,
    }
    suffix = "reality" if query == "reality" else f"{query[:3]}-belief"
    return Stimulus(
        id=f"{task.task_id}-{version.code}-{suffix}",
        text=text,
        options=task.options,
        answer=world if query == "reality" else belief,
        family=FAMILY,
        task_id=task.task_id,
        template_id=task.template_id,
        condition=version.knowledge_state,
        prompt_type=prompt_type,
        world_state=world,
        protagonist_belief=belief,
        reference_state=start,
        spans=spans,
        meta=meta,
        mentions=mentions,
    )


VERSIONS: tuple[Version, ...] = tuple(Version(k, f, r) for k, f, r in product(CONDITIONS, MENTIONS, MENTIONS))


def task_stimuli(task: FactorialTask, prompt_types: Sequence[str] = PROMPT_TYPES) -> list[Stimulus]:
    """A task's prompts: per story version (8), its reality prompt and its two belief prompts."""
    out: list[Stimulus] = []
    for version in VERSIONS:
        if "reality" in prompt_types:
            out.append(factorial_stimulus(task, version, "reality"))
        if "belief" in prompt_types:
            out.extend(factorial_stimulus(task, version, cue) for cue in KNOWLEDGE_CUES)
    _check_design(task, out)
    return out


def _check_design(task: FactorialTask, stimuli: Sequence[Stimulus]) -> None:
    """The design's promises, checked on every task so that a template edit cannot silently break
    them: the story names the locations first and last as meta says, and every version has the
    same number of words and the same number of mentions of every named role."""
    shape = set()
    for s in stimuli:
        story = s.text[: s.spans["query"].start]
        named = [m for role in ("location_1", "location_2") for m in s.mentions.get(role, ())
                 if m.end <= len(story)]
        named.sort(key=lambda m: m.start)
        words = {s.meta["location_1"]: "start", s.meta["location_2"]: "end"}
        first, last = words[named[0].of(s.text)], words[named[-1].of(s.text)]
        if (first, last) != (s.meta["first_mention"], s.meta["recent_mention"]):
            raise RuntimeError(f"{s.id}: the story names {first} first and {last} last, "
                               f"but meta says {s.meta['first_mention']} / {s.meta['recent_mention']}")
        counts = tuple(sorted((r, len(m)) for r, m in s.mentions.items()))
        shape.add((s.prompt_type, s.meta["knowledge_cue"], len(story.split()), counts))
    if len(shape) != len({(s.prompt_type, s.meta["knowledge_cue"]) for s in stimuli}):
        raise RuntimeError(f"{task.task_id}: versions differ in word count or role mentions: {sorted(shape)}")


def false_belief_factorial(n: int = 20, seed: int = 0,
                           prompt_types: Sequence[str] | None = None) -> list[Stimulus]:
    """`n` factorial tasks x (16 belief prompts + 8 reality prompts).

    Belief answers: Start in false belief, End in true belief; reality answers: End.
    `prompt_types` keeps only "belief" or "reality" prompts (default both).
    """
    if isinstance(prompt_types, str):
        prompt_types = (prompt_types,)
    if prompt_types is not None and (not prompt_types or any(p not in PROMPT_TYPES for p in prompt_types)):
        raise TomlensError(f"prompt_types={list(prompt_types)!r} is not a non-empty subset of {list(PROMPT_TYPES)}",
                           "pass prompt_types=['belief'], ['reality'] or leave it out")
    chosen = tuple(prompt_types) if prompt_types is not None else PROMPT_TYPES
    return [s for task in make_factorial_tasks(n, seed) for s in task_stimuli(task, chosen)]


# ---- what `tomlens audit` checks on this family ------------------------------------------------


def _belief_prompt_state(s: Stimulus) -> str | None:
    """The knowledge state of a belief prompt (reality prompts ask where the object is, so the
    state is not their answer's contrast)."""
    return s.meta.get("knowledge_state") if s.prompt_type == "belief" else None


def _protagonist_cue_position(s: Stimulus) -> str | None:
    """Whether the protagonist's cue sentence is the first or the second of the two (the second is
    the one just before the move): a reader who took "the sentence nearest the move is about the
    protagonist" as a cue would read this."""
    if "cue" not in s.spans or "contrast" not in s.spans:
        return None
    return "first" if s.spans["cue"].start == s.spans["contrast"].start else "second"


def _cue_before_move(s: Stimulus) -> str | None:
    """Absence or presence: the kind of the cue sentence just before the move, whoever it is
    about (the last presence/absence cue, read from the design instead of a word list)."""
    state, order = s.meta.get("knowledge_state"), s.meta.get("cue_order")
    if state not in CUE_KINDS or order not in ("absence_first", "presence_first"):
        return None
    return "presence" if order == "absence_first" else "absence"


CONTRASTS: tuple[Contrast, ...] = (
    Contrast("false vs true belief (belief prompts)", _belief_prompt_state,
             "the protagonist was away (false belief) or saw the move (true belief), on the 16 "
             "belief prompts of each task"),
)
RULES: tuple[Rule, ...] = (
    Rule("protagonist's cue sentence position", _protagonist_cue_position,
         "whether the sentence about the protagonist comes first or second of the two cue "
         "sentences (the names trade places between the states; the order is balanced per block)"),
    Rule("cue just before the move", _cue_before_move,
         "absence or presence: the sentence nearest the move, whoever it is about"),
)
