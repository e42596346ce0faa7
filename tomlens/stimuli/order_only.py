"""Order-only false-belief tasks: false- and true-belief stories made of the same sentences.

Why: in the unexpected-transfer family one or two words ("watching", "nobody") give the condition
away, so a bag of words decodes the belief label. Here every task has one fixed set of four
sentences: (a) the protagonist puts the object in location 1 with the other agent there; (b) the
protagonist leaves; (c) the other agent moves the object to location 2; (d) the protagonist comes
back. False belief tells them as a, b, c, d (the protagonist is away during the move); true belief
as a, c, b, d (the move happens before the protagonist leaves, so the protagonist saw it). Only the
order differs: the words, their counts and the length are identical across conditions, so a bag of
words is at chance by construction (the generator checks this for every task).

Labels are the unexpected-transfer family's: `world_state` = location 2, `protagonist_belief` =
location 1 (false belief) or location 2 (true belief), `reference_state` = location 1, so the
existing targets and probes apply unchanged. Each sentence role and each question has several
phrasings, drawn per task; which option comes first and whether the move sentence ends on
location 1 or location 2 are balanced in blocks of 8 tasks. Records carry every mention of each
role (`mentions`) and a `cue` span on the leaving sentence, whose place relative to the move is
what decides belief (`meta["cue_kind"] = "order"`); `tomlens.stimuli.pairs` pairs the two orders.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from string import Formatter
from typing import Any

from tomlens.errors import TomlensError
from tomlens.stimuli import lexicon
from tomlens.stimuli.false_belief import BLOCK, balanced_flags, mentions
from tomlens.stimuli.records import Span, Stimulus, find_mentions

FAMILY = "order-only"
PREFIX = "oo"
CONDITIONS: tuple[str, ...] = ("false_belief", "true_belief")
PROMPT_TYPES: tuple[str, str] = ("reality", "belief")
# Sentence order per condition, by role: the only thing that differs between the conditions.
ORDERS: dict[str, tuple[str, ...]] = {
    "false_belief": ("put", "leave", "move", "return"),
    "true_belief": ("put", "move", "leave", "return"),
}
CONDITION_CODES: dict[str, str] = {"false_belief": "fb", "true_belief": "tb"}
ACCESS: dict[str, str] = {"false_belief": "absent", "true_belief": "saw"}

# Slots: {P} protagonist, {Ps}/{Po}/{Pp} her/his pronouns, {A} other agent, {obj}, {L1} start,
# {L2} destination, {room}, {placeP} where the protagonist goes. Each sentence names its people
# (no pronoun reaches across sentences), and none says when it happens relative to the others,
# so every order reads right. No sentence uses an absence or presence cue word.
PHRASINGS: dict[str, tuple[str, ...]] = {
    "put": (
        "{P} and {A} are in the {room}, where {P} puts {Pp} {obj} in the {L1}.",
        "In the {room}, {P} puts {Pp} {obj} into the {L1} while {A} looks on.",
        "{P} and {A} are together in the {room}, and {P} places {Pp} {obj} inside the {L1}.",
        "With {A} beside {Po} in the {room}, {P} drops {Pp} {obj} into the {L1}.",
    ),
    "leave": (
        "{P} leaves the {room}.",
        "{P} leaves the {room} for {placeP}.",
        "{P} steps out of the {room} for a while.",
        "{P} walks out of the {room} and heads to {placeP}.",
    ),
    # The first four end on location 2, the last four on location 1 (`last_ref`).
    "move": (
        "{A} takes the {obj} out of the {L1} and puts it in the {L2}.",
        "{A} moves the {obj} from the {L1} to the {L2}.",
        "{A} lifts the {obj} out of the {L1} and drops it into the {L2}.",
        "{A} transfers the {obj} from the {L1} into the {L2}.",
        "{A} puts the {obj} in the {L2}, taking it out of the {L1}.",
        "{A} moves the {obj} into the {L2} from the {L1}.",
        "{A} places the {obj} in the {L2} after taking it from the {L1}.",
        "{A} shifts the {obj} into the {L2}, out of the {L1}.",
    ),
    "return": (
        "{P} comes back to the {room} and wants {Pp} {obj}.",
        "{P} returns to the {room}, wanting {Pp} {obj}.",
        "Later, {P} comes back into the {room} to get {Pp} {obj}.",
        "{P} walks back into the {room} and needs {Pp} {obj}.",
    ),
    "belief": (
        "{P} will look for the {obj} in the",
        "{P} thinks that the {obj} is in the",
        "To find the {obj}, {P} first looks in the",
        "{P} goes to get the {obj} from the",
    ),
    "reality": (
        "The {obj} is now in the",
        "Right now, the {obj} is in the",
        "At this moment, the {obj} is inside the",
        "The {obj} is currently in the",
    ),
}
MOVE_ENDS_ON_L2 = 4  # PHRASINGS["move"][:4] end on the destination, the rest on the start
# Span roles of the story's first mentions, and of the question's own mentions.
SLOT_ROLES: dict[str, str] = {"P": "protagonist", "A": "other_agent", "obj": "object",
                              "L1": "location_1", "L2": "location_2"}
QUERY_ROLES: dict[str, str] = {"P": "query_protagonist", "obj": "query_object"}
# Extra span roles: the two sentences whose order is the contrast.
SENTENCE_ROLES: dict[str, str] = {"leave": "contrast_leave", "move": "contrast_move"}


@dataclass(frozen=True)
class OrderTask:
    """One task's lexical choices, phrasings and counterbalancing flags (shared by its 4 prompts).

    `options_ref_first`: the options list location 1 first; `last_ref`: the move sentence ends
    on location 1 (so the last location named in the story is the start). Both are balanced
    within every block of 8 tasks.
    """

    index: int
    seed: int
    task_id: str
    protagonist: tuple[str, str, str, str]
    agent: tuple[str, str, str, str]
    obj: str
    locations: tuple[str, str]  # (start, destination)
    room: str
    place: str
    phrasing: dict[str, int]  # role -> index into PHRASINGS[role]
    options_ref_first: bool
    last_ref: bool

    @property
    def options(self) -> tuple[str, str]:
        return self.locations if self.options_ref_first else self.locations[::-1]

    @property
    def template_id(self) -> str:
        """The phrasings drawn, e.g. "oo-p1l0m5r2b3w0" (put, leave, move, return, belief, world)."""
        p = self.phrasing
        return (f"{PREFIX}-p{p['put']}l{p['leave']}m{p['move']}r{p['return']}"
                f"b{p['belief']}w{p['reality']}")

    @property
    def slots(self) -> dict[str, str]:
        p = self.protagonist
        return {"P": p[0], "Ps": p[1], "Po": p[2], "Pp": p[3], "A": self.agent[0],
                "obj": self.obj, "L1": self.locations[0], "L2": self.locations[1],
                "room": self.room, "placeP": self.place}

    def sentence(self, role: str) -> str:
        return PHRASINGS[role][self.phrasing[role]]


def _block_layout(seed: int, block: int) -> list[tuple[bool, bool]]:
    """(options_ref_first, last_ref) for the tasks of one block; depends only on (seed, block),
    so the tasks of a smaller n are a prefix of a larger n."""
    rng = random.Random(f"{FAMILY}/plan/{seed}/{block}")
    return list(zip(balanced_flags(rng, BLOCK), balanced_flags(rng, BLOCK), strict=True))


def make_order_tasks(n: int, seed: int) -> list[OrderTask]:
    """`n` distinct tasks, deterministic given `seed` (task i never depends on n)."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise TomlensError(f"{FAMILY} needs n >= 1 tasks, got {n!r}", "pass n=1 or more")
    tasks: list[OrderTask] = []
    seen: set[tuple] = set()
    plan: list[tuple[bool, bool]] = []
    for i in range(n):
        if i % BLOCK == 0:
            plan = _block_layout(seed, i // BLOCK)
        options_ref_first, last_ref = plan[i % BLOCK]
        rng = random.Random(f"{FAMILY}/task/{seed}/{i}")
        for _attempt in range(1000):
            protagonist = rng.choice(lexicon.NAMES)
            other = "he" if protagonist[1] == "she" else "she"  # one referent per pronoun
            agent = rng.choice(lexicon.names_by_pronoun(other))
            obj = rng.choice(lexicon.TRANSFER_OBJECTS)
            start, dest = rng.sample(lexicon.TRANSFER_LOCATIONS, 2)
            key = (protagonist[0], obj, frozenset((start, dest)))
            if key not in seen:
                break
        else:  # pragma: no cover - only reachable with far more tasks than the lexicon allows
            raise TomlensError(f"cannot draw {n} distinct {FAMILY} tasks from the lexicon",
                               "ask for fewer tasks or extend tomlens/stimuli/lexicon.py")
        seen.add(key)
        room = rng.choice(lexicon.ROOMS)
        place = rng.choice(lexicon.PLACES)
        phrasing = {role: rng.randrange(len(PHRASINGS[role])) for role in PHRASINGS if role != "move"}
        half = rng.randrange(MOVE_ENDS_ON_L2)
        phrasing["move"] = half + (MOVE_ENDS_ON_L2 if last_ref else 0)
        tasks.append(OrderTask(
            index=i, seed=seed, task_id=f"{PREFIX}-s{seed}-{i:04d}", protagonist=protagonist,
            agent=agent, obj=obj, locations=(start, dest), room=room, place=place,
            phrasing=phrasing, options_ref_first=options_ref_first, last_ref=last_ref,
        ))
    return tasks


class _Text:
    """A text built sentence by sentence, with the first mention of each slot role and the
    mentions of the latest sentence."""

    def __init__(self, slots: dict[str, str]):
        self.slots = slots
        self.text = ""
        self.first: dict[str, Span] = {}
        self.latest: dict[str, Span] = {}

    def add(self, template: str) -> Span:
        if self.text:
            self.text += " "
        start = len(self.text)
        self.latest = {}
        for literal, name, _spec, _conv in Formatter().parse(template):
            self.text += literal
            if name is not None:
                span = Span(len(self.text), len(self.text) + len(self.slots[name]))
                self.text += self.slots[name]
                self.latest.setdefault(name, span)
                if name in SLOT_ROLES:
                    self.first.setdefault(SLOT_ROLES[name], span)
        return Span(start, len(self.text))


def order_stimulus(task: OrderTask, condition: str, prompt_type: str) -> Stimulus:
    """The record for one condition's reality or belief prompt of a task."""
    order = ORDERS[condition]
    b = _Text(task.slots)
    sentences = {role: b.add(task.sentence(role)) for role in order}
    story_end = len(b.text)
    query = b.add(task.sentence(prompt_type))
    spans = dict(b.first)
    spans["contrast"] = Span.covering([sentences["leave"], sentences["move"]])
    spans.update({name: sentences[role] for role, name in SENTENCE_ROLES.items()})
    spans["query"] = query
    spans.update({QUERY_ROLES[slot]: span for slot, span in b.latest.items() if slot in QUERY_ROLES})
    # what decides belief is where the protagonist's leaving falls relative to the move
    spans["cue"] = sentences["leave"]
    start, dest = task.locations
    world, belief = dest, (start if condition == "false_belief" else dest)
    named = mentions(b.text[:story_end], task.locations)
    meta: dict[str, Any] = {
        "order": [*order], "protagonist": task.protagonist[0], "other_agent": task.agent[0],
        "protagonist_access": ACCESS[condition], "object": task.obj, "location_1": start,
        "location_2": dest, "room": task.room, "protagonist_goes_to": task.place,
        "phrasing": dict(task.phrasing), "first_mentioned": named[0], "last_mentioned": named[-1],
        "options_ref_first": task.options_ref_first, "last_ref": task.last_ref,
        "task_index": task.index, "seed": task.seed, "cue_kind": "order",
        # the leaving sentence's phrasing recurs across tasks (template ids do not), so the
        # type-level control and group_by="cue" have cells that occur on both sides of a split
        "cue_id": f"leave:{task.phrasing['leave']}",
    }
    return Stimulus(
        id=f"{task.task_id}-{CONDITION_CODES[condition]}-{prompt_type}",
        text=b.text,
        options=task.options,
        answer=world if prompt_type == "reality" else belief,
        family=FAMILY,
        task_id=task.task_id,
        template_id=task.template_id,
        condition=condition,
        prompt_type=prompt_type,
        world_state=world,
        protagonist_belief=belief,
        reference_state=start,
        spans=spans,
        meta=meta,
        mentions=_mentions(task, b.text, story_end, spans["cue"]),
    )


def _mentions(task: OrderTask, text: str, story_end: int, cue: Span) -> dict[str, tuple[Span, ...]]:
    """Every mention of each story role in the story, and of the question's roles in the prompt."""
    slots = task.slots
    found = find_mentions(text, {role: slots[slot] for slot, role in SLOT_ROLES.items()})
    out = {role: tuple(m for m in ms if m.end <= story_end) for role, ms in found.items()}
    out = {role: ms for role, ms in out.items() if ms}
    for slot, role in QUERY_ROLES.items():
        inside = tuple(m for m in found.get(SLOT_ROLES[slot], ()) if m.start > story_end)
        if inside:
            out[role] = inside
    out["cue"] = (cue,)
    return out


def task_stimuli(task: OrderTask, conditions: Sequence[str] = CONDITIONS) -> list[Stimulus]:
    """A task's prompts (condition x prompt type), checked to share their words across conditions."""
    out = [order_stimulus(task, c, pt) for c in conditions for pt in PROMPT_TYPES]
    _check_same_words(task, out)
    return out


def _check_same_words(task: OrderTask, stimuli: Sequence[Stimulus]) -> None:
    """The design's promise: per prompt type, every condition's text has the same words and
    length. A phrasing edit that breaks it fails here instead of reintroducing a word cue."""
    for pt in PROMPT_TYPES:
        texts = [s.text for s in stimuli if s.prompt_type == pt]
        if len({(len(t), tuple(sorted(t.split()))) for t in texts}) > 1:
            raise RuntimeError(f"{task.task_id} {pt}: the conditions' texts differ in words: {texts}")


def order_only(n: int = 20, seed: int = 0, conditions: Sequence[str] | None = None,
               prompt_types: Sequence[str] | None = None) -> list[Stimulus]:
    """`n` order-only tasks x 4 prompts (false / true belief x reality / belief).

    Answers: reality = location 2 in both conditions; belief = location 1 in false belief,
    location 2 in true belief. `reference_state` is location 1. `prompt_types` keeps only those
    questions (e.g. ["belief"]: a belief probe is read where the belief question is asked).
    """
    if isinstance(prompt_types, str):
        prompt_types = (prompt_types,)
    if prompt_types is not None and (not prompt_types or any(t not in PROMPT_TYPES for t in prompt_types)):
        raise TomlensError(f"prompt_types={list(prompt_types)!r} is not a non-empty subset of {list(PROMPT_TYPES)}",
                           f"choose from {list(PROMPT_TYPES)}")
    if isinstance(conditions, str):
        conditions = (conditions,)
    if conditions is not None and (not conditions or any(c not in CONDITIONS for c in conditions)):
        raise TomlensError(
            f"conditions={list(conditions)!r} is not a non-empty subset of {FAMILY}'s conditions",
            f"choose from {list(CONDITIONS)}",
        )
    chosen = tuple(conditions) if conditions is not None else CONDITIONS
    return [s for task in make_order_tasks(n, seed) for s in task_stimuli(task, chosen)
            if prompt_types is None or s.prompt_type in prompt_types]
