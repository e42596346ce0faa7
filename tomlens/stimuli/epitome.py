"""EPITOME's tasks after Jones, Trott & Bergen (2023), with stories written for tomlens.

The false-belief factorial (EPITOME's first task) lives in `tomlens.stimuli.factorial`. Here:

* `recursive-mindreading`: a hope is passed along a chain of eight people (each tells the next
  everything they know, including who told them), the same people are linked by a chain of distinct
  relations (tutor, coach, ...), and an outsider who has never met any of them holds one relation
  towards every member (the landlord of every one of them) and is phoned by the seventh member before
  the eighth is told; the outsider hopes the same thing in half the stories. A level-k mental
  statement has k mental verbs ("Gus knows that Fay knows that ... Dana hopes ..."), a level-k
  non-mental statement k relations ("Hana is the coach of the tutor of ... Dana"). A statement is
  true when every link holds (each knower was told after the person they know about; the last
  person hopes; each relation leads to the next), and a false one fails at exactly one link, drawn
  over the links it can fail at (the outer one, those inside, the innermost hope or base person), so
  checking any one link leaves the rest unchecked. The two continuations differ only in the outer
  verb's polarity. Per story x kind x level the four prompts are insider / outsider subject x
  affirmative / negated consistent option, each in its own story format x continuation format
  (narrative / script), so neither the subject's type, nor its place in the chain (a true and a
  false statement share it), nor "not", nor length gives the answer (mental level 1, "X hopes that
  H": the two outsider prompts follow whether the outsider hopes, the insider ones the other way;
  balanced over blocks of 8 stories). Before (tomlens <= 6bc1cca) every outsider statement was
  negated and every insider one affirmative, so "outsider <-> not" scored 1.00 at every level.
  Labels: `world_state` = `protagonist_belief` = the consistent continuation (there is no
  belief/world contrast here); meta `level`, `mental`, `subject_type`, `keyed_polarity`
  (`consistent_negated`), `violated_link` (0 when the consistent option is affirmative). The
  prompt's story-free tail is meta `story_free_text`, for PMI_DC.
* `indirect-request`: a speaker says something that could be a request ("I'm so thirsty") after
  an obstacle, always an event (a park worker switches off the fountain); the speaker is aware /
  unaware of it, by an explicit or an implicit cue. Implicit: the speaker steps away and comes back,
  and the event happens in front of everyone there while they are away (unaware) or after they are
  back (aware), the same sentences in another order. Explicit: who knows of the obstacle and who
  does not, the speaker and hearer swapping places. Before (<= 6bc1cca) the only unaware implicit
  cue was "While S is away ..., H notices that ..." and 6 of 16 obstacles were standing states the
  speaker may have known already. "Is X making a request?" Yes/No; answer Yes when unaware, No when
  aware. Labels: `world_state` = "blocked" (the request cannot be met), `protagonist_belief` = the
  speaker's view ("blocked" when aware, "open" when unaware), `reference_state` = "open", so the
  probe target `protagonist_belief` reads "the speaker does not know of the obstacle" (meta
  `speaker_aware` is its negation). Option `matched_cue` words the explicit cue "{H} notices that
  ... {S} knows all / nothing about ..." for the minimal pairs of `ir_minimal_pairs`.
* `scalar-implicature`: three things that almost always have a property; the speaker has looked at
  a of 3 and says n have it ("Some" in E1, 1 <= n <= a in E2). The question "How many ... (0, 1, 2,
  or 3)" is asked before the utterance (one prompt per story) and after it (one per condition).
  The four bets "0".."3" are in meta `bets` and are scored by `tomlens.behaviour.epitome`; the two
  options are a coarse view only: the count a rational listener bets most on, against "3" (or,
  when that count is 3, "2" or "1", three each per story). "3" is the answer in 6 of a story's 10
  prompts, so a model that always prefers "3" scores 0.6 on this view (no choice of foils avoids
  it; these foils keep every fixed ranking of the counts at or below 0.6); the summary prints that
  chance beside the view's accuracy and uses the change-in-bets criteria as the SI numbers.
  Labels: `world_state` = "complete" (the world fixes all three), `protagonist_belief` = the
  speaker's access ("complete" when a = 3, else "partial").

Short Story and Strange Stories items (free-text answers coded by a human with a rubric) are
`FreeTextItem`s from `short_story_items()` and `strange_stories_items()`: the stories and rubrics
are the project's own, not the paper's (which uses Hemingway's text and Happé's items).

`CONTRASTS_BY_FAMILY` / `RULES_BY_FAMILY` (end of the module) declare what `tomlens audit` checks on
recursive mindreading (the consistent option's polarity; subject type, level, the subject's place in
the chain, formats) and indirect requests (awareness; the cue's wording, the obstacle's kind).
"""

from __future__ import annotations

import functools
import itertools
import random
import re
from dataclasses import dataclass, field
from typing import Any

from tomlens.errors import TomlensError
from tomlens.stimuli import lexicon
from tomlens.stimuli.false_belief import balanced_flags
from tomlens.stimuli.records import Span, Stimulus, find_mentions
from tomlens.stimuli.shortcuts import Contrast, Rule

RM_FAMILY = "recursive-mindreading"
IR_FAMILY = "indirect-request"
SI_FAMILY = "scalar-implicature"
SHORT_STORY_FAMILY = "short-story"
STRANGE_STORIES_FAMILY = "strange-stories"
BLOCK = 8  # option order balanced within blocks of 8 prompts of a cell
LEVELS: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7)
FORMATS: tuple[str, str] = ("narrative", "script")


def _check_n_seed(n: Any, seed: Any, family: str) -> None:
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise TomlensError(f"{family} needs n >= 1 stories, got {n!r}", "pass n=1 or more")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TomlensError(f"{family} needs an integer seed, got {seed!r}", "pass seed=0 (or another integer)")


def _people(rng: random.Random, k: int) -> list[tuple[str, str, str, str]]:
    return rng.sample(list(lexicon.NAMES), k)


def _option_flags(family: str, seed: int, cell: str, count: int) -> list[bool]:
    """`count` option-order flags for one cell, exactly balanced within each block of BLOCK."""
    out: list[bool] = []
    block = 0
    while len(out) < count:
        out.extend(balanced_flags(random.Random(f"{family}/options/{seed}/{cell}/{block}"), BLOCK))
        block += 1
    return out[:count]


# ---- recursive mindreading ----------------------------------------------------------------------

@dataclass(frozen=True)
class RMSetting:
    """A story setting: what the first person hopes (as a clause), and the scene's opening."""

    id: str
    hope: str  # clause after "hopes that"
    opening: str  # slot {P1}


RM_SETTINGS: tuple[RMSetting, ...] = (
    RMSetting("trip", "the school trip to the lake goes ahead",
              "It is the week before the school trip, and {P1} cannot stop thinking about it."),
    RMSetting("cafe", "the little cafe on the corner stays open",
              "Rumours are going round the street that the corner cafe might close, and {P1} is worried."),
    RMSetting("match", "the football match on Sunday is moved indoors",
              "Rain is forecast for the weekend, and {P1} keeps checking the sky."),
    RMSetting("choir", "the choir gets a place at the town festival",
              "The town festival is choosing its acts, and {P1} sings in the choir."),
    RMSetting("garden", "the old garden behind the library is kept",
              "The council is deciding what to do with the land behind the library, and {P1} walks there every day."),
    RMSetting("play", "the drama club puts on a comedy this year",
              "The drama club is picking its next play, and {P1} has strong views."),
    RMSetting("market", "the night market returns in the spring",
              "The night market closed last autumn, and {P1} misses it."),
    RMSetting("band", "the band plays one more concert before the summer",
              "The local band has been quiet for months, and {P1} is their biggest fan."),
)
# Relations of the non-mental recursion. None is symmetric (a cousin's cousin would make "the cousin
# of X" ambiguous), and each can be held towards someone never met, so the outsider holds one towards
# every member of the group. A story draws 8: 7 for the chain (P_{i+1} is the relations[i] of P_i)
# and 1 for the outsider, so no word belongs to one role.
RELATIONS: tuple[str, ...] = ("landlord", "accountant", "lawyer", "boss", "tutor", "coach", "mentor", "agent",
                              "editor", "sponsor")
CHAIN = 8  # people in the chain; P1 hopes, each tells the next
OUT = 0  # the outsider in a statement's sequence of people (chain members are 1..CHAIN)
PHONES_OUTSIDER = 7  # the chain member who phones the outsider, before telling the next one
OUTSIDER_RELATION = CHAIN - 1  # index of the outsider's relation in RMStory.relations
SUBJECT_TYPES: tuple[str, str] = ("insider", "outsider")
KINDS: tuple[str, str] = ("mental", "non_mental")


def _told_at(person: int) -> float:
    """When a person learns the hope: chain member i at step i, the outsider between the step of
    the member who phones them and the next step."""
    return PHONES_OUTSIDER + 0.5 if person == OUT else float(person)


def _knows_link(a: int, b: int) -> bool | None:
    """Whether `a` knows everything `b` knows (True: `a` was told after `b`, and the chain passes on
    who told whom), clearly does not (False: `b` was told later, by someone else), or None where the
    story leaves it open (`a` told `b` themselves; anything about the outsider, whom nobody is told
    about). Statements with an open link are never generated."""
    if b == OUT or (a != OUT and b == a + 1):
        return None
    return _told_at(a) > _told_at(b)


def _relation_step(person: int | None, relation: int) -> int | None:
    """Who is the `relation`-th relation of `person` (None: nobody in the story)."""
    if person is None or person == OUT:
        return None
    if relation == OUTSIDER_RELATION:
        return OUT
    return person + 1 if person == relation + 1 else None


@dataclass(frozen=True)
class RMStatement:
    """A level-k statement as indices, before names are put in. Mental: `people` = (s_1, ..., s_k),
    "s_1 knows that s_2 knows that ... s_k hopes that H" (level 1: "s_1 hopes that H"). Non-mental:
    `people` = (subject, base) and `relations` (outermost first, indices into the story's relations),
    "subject is the r_1 of the r_2 of ... of the r_k of base"."""

    kind: str
    people: tuple[int, ...]
    relations: tuple[int, ...] = ()

    @property
    def level(self) -> int:
        return len(self.people) if self.kind == "mental" else len(self.relations)

    @property
    def subject(self) -> int:
        return self.people[0]

    def links(self, outsider_hopes: bool) -> list[bool | None]:
        """The truth of each link, outermost first: mental, each "s_i knows that s_{i+1} ..." and
        last whether s_k hopes; non-mental, each relation walked from the base, the outermost one
        being whether the subject is who the walk reaches. The statement is true iff all are."""
        if self.kind == "mental":
            *knowers, hoper = self.people
            pairs = [_knows_link(a, b) for a, b in zip(self.people, self.people[1:], strict=False)]
            return pairs + [hoper == 1 or (hoper == OUT and outsider_hopes)]
        subject, base = self.people
        reached: list[int | None] = [base]
        for r in reversed(self.relations):
            reached.append(_relation_step(reached[-1], r))
        ok = [x is not None for x in reached[1:]]
        ok[-1] = reached[-1] == subject
        return list(reversed(ok))

    def true(self, outsider_hopes: bool) -> bool:
        return all(self.links(outsider_hopes))


@functools.cache
def _mental_pool(level: int, outsider: bool) -> dict[tuple[int, int], tuple[tuple[int, ...], ...]]:
    """Every mental sequence of `level` people (the outsider first when `outsider`, chain members
    otherwise, no one twice, no open link), keyed by (subject, violation): violation 0 for a true
    statement, p for one false at exactly its p-th link (p = level: the hoper is wrong). Level >= 2."""
    pool: dict[tuple[int, int], list[tuple[int, ...]]] = {}
    heads = [(OUT,)] if outsider else [(x,) for x in range(1, CHAIN + 1)]
    for head in heads:
        rest = [x for x in range(1, CHAIN + 1) if x not in head]
        for tail in itertools.permutations(rest, level - 1):
            links = RMStatement("mental", head + tail).links(False)
            if None in links:
                continue
            false = [i + 1 for i, ok in enumerate(links) if not ok]
            if len(false) <= 1:
                pool.setdefault((head[0], false[0] if false else 0), []).append(head + tail)
    return {k: tuple(v) for k, v in pool.items()}


def _mental_pair(rng: random.Random, level: int, outsider: bool) -> tuple[RMStatement, RMStatement, int]:
    """A true and a false mental statement (level >= 2) about the same subject, and the false one's
    violated link: the subject is drawn from those both can have (so the subject's place in the
    chain says nothing about the answer), the violated link uniformly from those it can have (never
    the one just above the hope: "X knows that P1 hopes" holds for everyone, all being told)."""
    pool = _mental_pool(level, outsider)
    subjects = sorted({x for x, p in pool if p == 0} & {x for x, p in pool if p > 0})
    x = rng.choice(subjects)
    violation = rng.choice(sorted(p for s, p in pool if s == x and p > 0))
    true = RMStatement("mental", rng.choice(pool[(x, 0)]))
    false = RMStatement("mental", rng.choice(pool[(x, violation)]))
    return true, false, violation


def _relation_pair(rng: random.Random, level: int, outsider: bool) -> tuple[RMStatement, RMStatement, int]:
    """A true and a false non-mental statement about the same subject, and the false one's
    violated link. True: the chain's first relations walked from P1 (the outsider's own relation
    outermost for the outsider). False at level 1: the insider's and the outsider's relation words
    swapped; above: two neighbouring relations swapped (link p = 1..level-1) or a wrong base person
    (link p = level), p uniform."""
    chain = list(range(level - 1, -1, -1))
    rels = ([OUTSIDER_RELATION] + chain[1:]) if outsider else chain
    subject = OUT if outsider else level + 1
    true = RMStatement("non_mental", (subject, 1), tuple(rels))
    if level == 1:
        return true, RMStatement("non_mental", (subject, 1), (0 if outsider else OUTSIDER_RELATION,)), 1
    violation = rng.randint(1, level)
    if violation < level:
        rels[violation - 1], rels[violation] = rels[violation], rels[violation - 1]
        return true, RMStatement("non_mental", (subject, 1), tuple(rels)), violation
    base = rng.choice([x for x in range(2, CHAIN + 1) if x != subject])
    return true, RMStatement("non_mental", (subject, base), tuple(rels)), violation


@dataclass(frozen=True)
class RMItem:
    """One prompt of a story: its statement, whether the consistent option is the negated one,
    the false statement's violated link (0 when the statement is true), the formats and whether the
    consistent option comes first."""

    statement: RMStatement
    subject_type: str
    negated: bool
    violation: int
    story_format: str
    question_format: str
    answer_first: bool


@dataclass(frozen=True)
class RMStory:
    index: int
    seed: int
    task_id: str
    setting: RMSetting
    people: tuple[tuple[str, str, str, str], ...]  # the chain P1..P8, then the outsider
    relations: tuple[str, ...]  # 7 for the chain (P_{i+1} is the relations[i] of P_i), the outsider's
    outsider_hopes: bool  # whether the outsider hopes the same thing (balanced over blocks of stories)
    items: tuple[RMItem, ...]  # 2 kinds x 7 levels x 4 (subject type x polarity, one per format pair)


def _rm_cells(kind: str, level: int, outsider_hopes: bool) -> list[tuple[str, bool]]:
    """(subject type, consistent option negated) of a story's 4 prompts at one kind x level: each of
    insider / outsider x affirmative / negated once, so subject type says nothing about polarity.
    Mental level 1 is "X hopes that H", and the outsider either hopes it or not in the whole story:
    there the two outsider prompts share a polarity and the two insider prompts take the other
    (balanced over stories by `outsider_hopes`, which is balanced in blocks of 8)."""
    if kind == "mental" and level == 1:
        return [("outsider", not outsider_hopes)] * 2 + [("insider", outsider_hopes)] * 2
    return [(t, neg) for t in SUBJECT_TYPES for neg in (False, True)]


def _answer_first(seed: int, index: int, cell: str) -> bool:
    """Whether the consistent option comes first in story `index`'s prompt of `cell`: exactly half
    of each cell's prompts over every block of BLOCK stories (a set's chance imbalance in one cell
    is a cue that cell's own rule would find)."""
    block = random.Random(f"{RM_FAMILY}/options/{seed}/{cell}/{index // BLOCK}")
    return balanced_flags(block, BLOCK)[index % BLOCK]


def _rm_items(rng: random.Random, seed: int, index: int, outsider_hopes: bool) -> tuple[RMItem, ...]:
    items: list[RMItem] = []
    for kind in KINDS:
        for level in LEVELS:
            cells = _rm_cells(kind, level, outsider_hopes)
            formats = [(s, q) for s in FORMATS for q in FORMATS]
            rng.shuffle(formats)
            pairs = {t: _rm_pair(rng, kind, level, t == "outsider") for t in SUBJECT_TYPES}
            seen: set[tuple[str, bool]] = set()
            for (subject_type, negated), (sfmt, qfmt) in zip(cells, formats, strict=True):
                true, false, violation = pairs[subject_type]
                if kind == "mental" and level == 1 and subject_type == "insider":
                    true, false, violation = _rm_pair(rng, kind, level, False)  # each its own non-hoper
                # a cell twice in one story (mental level 1): the second prompt takes the other order
                first = _answer_first(seed, index, f"{kind}/{level}/{subject_type}/{negated}") != (
                    (subject_type, negated) in seen)
                seen.add((subject_type, negated))
                items.append(RMItem(false if negated else true, subject_type, negated, violation if negated else 0,
                                    sfmt, qfmt, first))
    return tuple(items)


def _rm_pair(rng: random.Random, kind: str, level: int, outsider: bool) -> tuple[RMStatement, RMStatement, int]:
    if kind == "non_mental":
        return _relation_pair(rng, level, outsider)
    if level > 1:
        return _mental_pair(rng, level, outsider)
    if outsider:
        return RMStatement("mental", (OUT,)), RMStatement("mental", (OUT,)), 1
    return RMStatement("mental", (1,)), RMStatement("mental", (rng.randint(2, CHAIN),)), 1


def _rm_story(index: int, seed: int) -> RMStory:
    rng = random.Random(f"{RM_FAMILY}/story/{seed}/{index}")
    order = list(range(len(RM_SETTINGS)))
    random.Random(f"{RM_FAMILY}/settings/{seed}/{index // len(RM_SETTINGS)}").shuffle(order)
    setting = RM_SETTINGS[order[index % len(RM_SETTINGS)]]
    people = tuple(_people(rng, CHAIN + 1))
    relations = tuple(rng.sample(list(RELATIONS), CHAIN))
    hopes = balanced_flags(random.Random(f"{RM_FAMILY}/outsider-hopes/{seed}/{index // BLOCK}"), BLOCK)[index % BLOCK]
    return RMStory(index, seed, f"rm-{seed}-{index}", setting, people, relations, hopes,
                   _rm_items(rng, seed, index, hopes))


def _name(story: RMStory, person: int) -> str:
    return story.people[CHAIN if person == OUT else person - 1][0]


def _rm_story_text(story: RMStory, fmt: str) -> str:
    """The story: the outsider (never met, but holds one relation towards every member), the chain
    of relations, P1's hope (nobody else in the group hopes it; the outsider does or does not), and
    the telling chain, in which P7 phones the outsider before telling P8."""
    p = [x[0] for x in story.people]
    pro = [x[1] for x in story.people]
    obj = [x[2] for x in story.people]
    rel, hope, o = story.relations, story.setting.hope, CHAIN
    outsider = (f"{p[o]} has never met any of them in person, but {pro[o]} is the "
                f"{rel[OUTSIDER_RELATION]} of every one of them.")
    only = (f"Of the group, only {p[0]} hopes for it; {p[o]} hopes for it too." if story.outsider_hopes else
            f"Of the group, only {p[0]} hopes for it; {p[o]} does not hope for it.")
    told = PHONES_OUTSIDER - 1
    if fmt == "narrative":
        lines = [story.setting.opening.format(P1=p[0]), outsider]
        lines += [f"{p[i + 1]} is the {rel[i]} of {p[i]}." for i in range(CHAIN - 1)]
        lines += [f"{p[0]} hopes that {hope}, and {pro[0]} tells {p[1]} so.", only]
        for i in range(1, CHAIN - 1):
            if i == told:
                lines.append(f"{p[i]} then phones {p[o]} and tells {obj[o]} everything {pro[i]} knows about it, "
                             f"including who told {obj[i]}.")
                lines.append(f"After that, {p[i]} tells {p[i + 1]} everything {pro[i]} knows about it, "
                             f"including who told {obj[i]}.")
            else:
                lines.append(f"{p[i]} then tells {p[i + 1]} everything {pro[i]} knows about it, "
                             f"including who told {obj[i]}.")
        return " ".join(lines)
    said = '"Here is everything I know about it, and who told me."'
    lines = [story.setting.opening.format(P1=p[0]), outsider]
    lines += [f'{p[i].upper()}: "{p[i + 1]}, you are my {rel[i]}."' for i in range(CHAIN - 1)]
    lines += [f'{p[0].upper()} (to {p[1]}): "I hope that {hope}."', only]
    for i in range(1, CHAIN - 1):
        if i == told:
            lines.append(f"{p[i].upper()} (on the phone to {p[o]}): {said}")
        lines.append(f"{p[i].upper()} (to {p[i + 1]}): {said}")
    return "\n".join(lines)


def _statement_text(story: RMStory, st: RMStatement, negate: bool) -> str:
    """The clause; only the outer verb's polarity differs between a prompt's two options."""
    if st.kind == "mental":
        hope = story.setting.hope
        if st.level == 1:
            return f"{_name(story, st.subject)} {'does not hope' if negate else 'hopes'} that {hope}"
        clause = f"{_name(story, st.people[-1])} hopes that {hope}"
        for person in reversed(st.people[1:-1]):
            clause = f"{_name(story, person)} knows that {clause}"
        return f"{_name(story, st.subject)} {'does not know' if negate else 'knows'} that {clause}"
    chain = " of the ".join(story.relations[r] for r in st.relations)
    return f"{_name(story, st.subject)} {'is not' if negate else 'is'} the {chain} of {_name(story, st.people[1])}"


def _continuation(story: RMStory, st: RMStatement, fmt: str, negate: bool) -> str:
    clause = _statement_text(story, st, negate)
    if fmt == "narrative":
        return f"Later that week, it is clear that {clause}."
    return f'NARRATOR: "As it turns out, {clause}."'


RM_TAIL = "\n\nWhat happens in the next scene?\n"


def rm_story_stimuli(story: RMStory) -> list[Stimulus]:
    """The 56 prompts of one story: 2 kinds x 7 levels x 4, the four being insider / outsider
    subject x affirmative / negated consistent option (mental level 1: see `_rm_cells`), each in
    its own story format x continuation format, the consistent option first in one of each
    polarity's two."""
    out: list[Stimulus] = []
    texts = {fmt: _rm_story_text(story, fmt) for fmt in FORMATS}
    names = {f"person_{i + 1}": x[0] for i, x in enumerate(story.people[:CHAIN])}
    for item in story.items:
        st = item.statement
        if st.true(story.outsider_hopes) == item.negated:
            raise AssertionError(f"{story.task_id}: a statement's truth disagrees with its plan")  # generator bug
        good = _continuation(story, st, item.question_format, item.negated)
        bad = _continuation(story, st, item.question_format, not item.negated)
        tail = RM_TAIL + ("Scene:" if item.question_format == "narrative" else "Script:")
        text = texts[item.story_format] + tail
        options = (good, bad) if item.answer_first else (bad, good)
        story_end = len(texts[item.story_format])
        found = find_mentions(texts[item.story_format], {"protagonist": story.people[0][0],
                                                         "other_agent": story.people[1][0]})
        spans = {role: ms[0] for role, ms in found.items()}
        spans["query"] = Span(story_end, len(text))
        kind, level = st.kind, st.level
        meta = {"level": level, "mental": kind == "mental", "story_format": item.story_format,
                "question_format": item.question_format, "consistent_option": good,
                "consistent_negated": item.negated, "keyed_polarity": "negated" if item.negated else "affirmative",
                "subject_type": item.subject_type, "subject": _name(story, st.subject),
                "violated_link": item.violation, "story_free_text": tail.strip(), "setting": story.setting.id,
                "foil": "the outer verb's polarity flipped", "outsider": story.people[CHAIN][0],
                "outsider_hopes": story.outsider_hopes, "people": list(names.values()),
                "story_index": story.index, "seed": story.seed}
        out.append(Stimulus(
            id=f"{story.task_id}-{kind}-l{level}-{item.story_format[0]}{item.question_format[0]}-{item.subject_type}",
            text=text, options=options, answer=good, family=RM_FAMILY, task_id=story.task_id,
            template_id=f"rm-{story.setting.id}", condition=kind, prompt_type="belief",
            world_state=good, protagonist_belief=good, reference_state=None,
            spans=spans, meta=meta, mentions={**found, "query": (spans["query"],)}))
    return out


def recursive_mindreading(n: int = 4, seed: int = 0) -> list[Stimulus]:
    """`n` stories x 56 prompts (2 kinds x 7 levels x insider / outsider subject x affirmative /
    negated consistent option). Settings come in seeded rounds without repeats; story i depends only
    on (seed, i)."""
    _check_n_seed(n, seed, RM_FAMILY)
    return [s for i in range(n) for s in rm_story_stimuli(_rm_story(i, seed))]


# ---- indirect request ---------------------------------------------------------------------------

@dataclass(frozen=True)
class IRTemplate:
    """A scene: where it happens, the obstacle as an event (something that happens at one moment,
    so a speaker who is away at that moment cannot know of it) and as a noun phrase, the utterance."""

    id: str
    scene: str  # slots {S} {H}
    event: str  # "the printer beeps and stops, out of ink"
    noun: str  # "the empty printer"
    utterance: str


IR_TEMPLATES: tuple[IRTemplate, ...] = (
    IRTemplate("printer", "{S} and {H} are finishing a report in the study.", "the printer beeps and stops, out of ink",
               "the empty printer", "I really need a paper copy of this."),
    IRTemplate("window", "{S} and {H} are working in a small office on a hot afternoon.",
               "the catch on the only window snaps off", "the broken window catch", "It's so stuffy in here."),
    IRTemplate("heater", "{S} and {H} are sitting in the living room on a cold evening in January.",
               "the heater gives a bang and stops working", "the broken heater", "I'm freezing in here."),
    IRTemplate("radio", "{S} and {H} are cleaning the kitchen together on Saturday.",
               "the radio crackles and dies, its batteries flat", "the flat batteries", "It's very quiet in here."),
    IRTemplate("fan", "{S} and {H} are sitting in the flat during a heatwave.",
               "the electric fan gives a bang and stops working", "the broken fan", "I'm boiling today."),
    IRTemplate("charger", "{S} and {H} are staying at a cabin for the weekend.",
               "the only phone charger sparks and stops working", "the broken charger", "My phone is nearly dead."),
    IRTemplate("kettle", "{S} and {H} are at home on a cold, grey morning.", "the kettle sparks and stops working",
               "the broken kettle", "I could really do with a cup of tea."),
    IRTemplate("dishwasher", "{S} and {H} are tidying up after a big dinner.",
               "the dishwasher gives a bang and breaks down", "the broken dishwasher",
               "There are so many dirty plates."),
    IRTemplate("umbrella", "{S} and {H} are about to walk to the station.",
               "the only umbrella in the house snaps in half", "the broken umbrella", "It's pouring out there."),
    IRTemplate("remote", "{S} and {H} are watching television on the sofa.",
               "the remote control falls off the arm of the sofa and breaks", "the broken remote",
               "This show is so boring."),
    IRTemplate("oven", "{S} and {H} are home after a long walk.", "the oven clicks off and stops heating",
               "the broken oven", "I'm absolutely starving."),
    IRTemplate("speaker", "{S} and {H} are having friends round for the evening.",
               "the speaker for the music crackles and breaks", "the broken speaker", "This party needs some music."),
    IRTemplate("tap", "{S} and {H} are finishing a long run in the park.",
               "a park worker switches off the drinking fountain", "the dry fountain", "I'm so thirsty."),
    IRTemplate("blind", "{S} and {H} are trying to watch a film in the sunny front room.",
               "the cord of the blind snaps, leaving the blind stuck open", "the stuck blind",
               "I can hardly see the screen."),
    IRTemplate("torch", "{S} and {H} are putting up their tent as it gets dark.",
               "the torch flickers and dies, its battery flat", "the dead torch", "I can't see what I'm doing."),
    IRTemplate("chair", "{S} and {H} are waiting for a long meeting to start.",
               "a leg of the spare chair cracks", "the broken chair", "My feet are killing me."),
)
IR_CELLS: tuple[tuple[bool, str], ...] = ((True, "explicit"), (True, "implicit"), (False, "explicit"),
                                          (False, "implicit"))
# The implicit cue: the speaker steps away and comes back, and the obstacle happens in front of
# everyone there, either while the speaker is away (unaware) or after they are back (aware). The two
# versions are the same sentences in another order: each leave / return pair ends on the same two
# words, and the utterance begins like the return ("{S} comes ..."), so every n-gram up to 3 words,
# across sentence ends too, is the same in both, and the last presence cue before the utterance is a
# presence cue in both.
IR_ABSENCES: tuple[tuple[str, str], ...] = (
    ("{S} steps away for a few minutes.", "{S} comes back after a few minutes."),
    ("{S} goes off to take a phone call.", "{S} comes back from the phone call."),
    ("{S} heads out to fetch something from the car.", "{S} comes back from the car."),
)
IR_WITNESS_FRAMES: tuple[str, ...] = (
    "{Event}, and everyone there sees it happen.",
    "Everyone who is there sees it when {event}.",
    "{Event}, in front of everyone who is there.",
)
# The explicit cue names who knows of the obstacle and who does not, the knower first in half the
# wordings and second in the other half; aware and unaware swap the two names, so their words are the
# same and neither the speaker's place in the sentence nor a negation gives the answer.
IR_KNOWLEDGE_FRAMES: tuple[str, ...] = (
    "{A} knows about {noun}, but {B} does not.",
    "{B} does not know about {noun}, but {A} does.",
    "{A} has been told about {noun}; {B} has not.",
    "{B} has not been told about {noun}; {A} has.",
)
IR_SAYS = '{S} comes over to {H} and says, "{utterance}"'


@dataclass(frozen=True)
class IRFrames:
    """The wordings one passage uses in all four of its versions (indices into the pools)."""

    absence: int
    witness: int
    knowledge: int


def _capital(text: str) -> str:
    return text[0].upper() + text[1:]


def _ir_cue(t: IRTemplate, S: str, H: str, aware: bool, cue: str, frames: IRFrames,
            matched_cue: bool) -> tuple[list[str], str]:
    """The cue's sentences, and the frame id it used (meta `cue_frame`)."""
    if cue == "implicit":
        leave, back = (x.format(S=S) for x in IR_ABSENCES[frames.absence])
        event = IR_WITNESS_FRAMES[frames.witness].format(Event=_capital(t.event), event=t.event)
        return ([leave, back, event] if aware else [leave, event, back]), \
            f"absence-{frames.absence}/witness-{frames.witness}"
    if matched_cue:  # one word apart, so aware and unaware prompts align token by token
        return [f"{H} notices that {t.event}.", f"{S} knows {'all' if aware else 'nothing'} about {t.noun}."], "matched"
    a, b = (S, H) if aware else (H, S)
    return [f"{_capital(t.event)}.", IR_KNOWLEDGE_FRAMES[frames.knowledge].format(A=a, B=b, noun=t.noun)], \
        f"knowledge-{frames.knowledge}"


def _ir_text(t: IRTemplate, s: tuple[str, str, str, str], h: tuple[str, str, str, str], aware: bool,
             cue: str, frames: IRFrames, matched_cue: bool = False) -> tuple[str, dict[str, str], str]:
    S, H = s[0], h[0]
    sentences, frame = _ir_cue(t, S, H, aware, cue, frames, matched_cue)
    parts = {"scene": t.scene.format(S=S, H=H), "cue": " ".join(sentences),
             "utterance": IR_SAYS.format(S=S, H=H, utterance=t.utterance),
             "query": f"Question: Is {S} making a request?\nAnswer:"}
    return "\n".join([parts["scene"] + " " + parts["cue"] + " " + parts["utterance"], parts["query"]]), parts, frame


def _ir_frames(seed: int, index: int) -> IRFrames:
    """Each pool's wordings in seeded rounds, so every wording serves a third of the passages."""
    picks = []
    for pool, size in (("absence", len(IR_ABSENCES)), ("witness", len(IR_WITNESS_FRAMES)),
                       ("knowledge", len(IR_KNOWLEDGE_FRAMES))):
        order = list(range(size))
        random.Random(f"{IR_FAMILY}/{pool}/{seed}/{index // size}").shuffle(order)
        picks.append(order[index % size])
    return IRFrames(*picks)


def indirect_request(n: int = 16, seed: int = 0, matched_cue: bool = False) -> list[Stimulus]:
    """`n` passages x 4 versions (speaker aware / unaware x explicit / implicit cue). Answer "Yes"
    (a request) when the speaker does not know of the obstacle, "No" when they do.

    The obstacle is always an event. Implicit cue: the speaker steps away and comes back, and the
    event happens in front of everyone there while they are away (unaware) or after they are back
    (aware): the same sentences in another order (`IR_ABSENCES`, `IR_WITNESS_FRAMES`). Explicit cue:
    the event, then who knows of it and who does not (`IR_KNOWLEDGE_FRAMES`), the speaker and the
    hearer swapping places between aware and unaware. A passage's four versions share its wordings.

    `matched_cue` (for minimal pairs; off in the battery) words the explicit cue "{H} notices that
    ... {S} knows all / nothing about ...", one word apart; meta `matched_cue` records it and the ids
    end in "-matched", so they never collide with the battery's prompts (whose summary leaves them
    out)."""
    _check_n_seed(n, seed, IR_FAMILY)
    if not isinstance(matched_cue, bool):
        raise TomlensError(f"{IR_FAMILY}: matched_cue must be true or false, got {matched_cue!r}",
                           "pass matched_cue=True")
    out: list[Stimulus] = []
    flags = {cell: _option_flags(IR_FAMILY, seed, f"{cell}", n) for cell in IR_CELLS}
    for i in range(n):
        order = list(range(len(IR_TEMPLATES)))
        random.Random(f"{IR_FAMILY}/templates/{seed}/{i // len(IR_TEMPLATES)}").shuffle(order)
        t = IR_TEMPLATES[order[i % len(IR_TEMPLATES)]]
        s, h = _people(random.Random(f"{IR_FAMILY}/people/{seed}/{i}"), 2)
        frames = _ir_frames(seed, i)
        task_id = f"ir-{seed}-{i}"
        for aware, cue in IR_CELLS:
            text, parts, frame = _ir_text(t, s, h, aware, cue, frames, matched_cue)
            spans: dict[str, Span] = {}
            pos = 0
            for role, key in (("scene", "scene"), ("contrast", "cue"), ("utterance", "utterance"), ("query", "query")):
                start = text.index(parts[key], pos)
                spans[role] = Span(start, start + len(parts[key]))
                pos = spans[role].end
            found = find_mentions(text[: spans["query"].start], {"protagonist": s[0], "other_agent": h[0]})
            # the query's own words (where a patching sweep looks by default): the speaker asked
            # about, and "request", the thing the question asks whether the utterance is
            asked = find_mentions(text, {"query_protagonist": s[0], "query_object": "request"})
            found.update({role: tuple(m for m in ms if m.start >= spans["query"].start) for role, ms in asked.items()})
            spans.update({role: ms[0] for role, ms in found.items()})
            options = ("Yes", "No") if flags[(aware, cue)][i] else ("No", "Yes")
            belief = "blocked" if aware else "open"
            out.append(Stimulus(
                id=f"{task_id}-{'aware' if aware else 'unaware'}-{cue[:3]}" + ("-matched" if matched_cue else ""),
                text=text, options=options,
                answer="No" if aware else "Yes", family=IR_FAMILY, task_id=task_id, template_id=f"ir-{t.id}",
                condition="aware" if aware else "unaware", prompt_type="belief", world_state="blocked",
                protagonist_belief=belief, reference_state="open", spans=spans,
                meta={"speaker_aware": aware, "knowledge_cue": cue, "cue_frame": frame, "obstacle_kind": "event",
                      "template": t.id, "speaker": s[0], "hearer": h[0], "obstacle": t.noun, "seed": seed,
                      "task_index": i, **({"matched_cue": True} if matched_cue else {})},
                mentions={**found, **{r: (spans[r],) for r in ("scene", "contrast", "utterance", "query")}}))
    return out


def ir_minimal_pairs(n: int = 24, seed: int = 0, **options: Any) -> list:
    """Clean/corrupted pairs for patching: the unaware speaker (clean, answer "Yes": a request) and
    the aware one (corrupted, answer "No"), explicit cue worded with `matched_cue` so the prompts
    differ in one word ("nothing" / "all") inside the cue, the pair's `contrast` span. The aware
    prompt takes the unaware one's option order (the battery balances each cell's order apart).
    Returns unchecked `tomlens.stimuli.pairs.MinimalPair`s: use `make_pairs("indirect-request",
    ...)` for the checked, token-aligned set. The default n = 24 is three whole blocks of 8, so the
    clean answer comes first in exactly half the pairs (a multiple of 8 keeps that balance)."""
    from tomlens.stimuli.pairs import MinimalPair

    if options:
        raise TomlensError(f"unknown option(s) {sorted(options)} for {IR_FAMILY} pairs",
                           "pass only n and seed (the cue is always the matched one)")
    by_task: dict[str, dict[bool, Stimulus]] = {}
    for st in indirect_request(n, seed, matched_cue=True):
        if st.meta["knowledge_cue"] == "explicit":
            by_task.setdefault(st.task_id, {})[st.meta["speaker_aware"]] = st
    pairs = []
    for task_id, by in by_task.items():
        clean, aware = by[False], by[True]
        pairs.append(MinimalPair(id=f"{task_id}-aware", clean=clean, corrupted=aware.with_(options=clean.options),
                                 family=IR_FAMILY, contrast="aware"))
    return pairs


# ---- scalar implicature -------------------------------------------------------------------------

@dataclass(frozen=True)
class SITemplate:
    """Three things that almost always have a property: plural noun, where from, the property as a
    predicate ("have cheese in the crust") and how the speaker got them."""

    id: str
    things: str
    source: str
    prop: str
    got: str


SI_TEMPLATES: tuple[SITemplate, ...] = (
    SITemplate("apples", "apples", "the orchard on Mill Lane", "are sweet", "picked"),
    SITemplate("eggs", "eggs", "the farm up the hill", "have double yolks", "bought"),
    SITemplate("tomatoes", "tomatoes", "the greenhouse at the school", "are ripe", "picked"),
    SITemplate("letters", "letters", "the lawyer's office", "have a stamp on them", "received"),
    SITemplate("shirts", "shirts", "the shop on the high street", "have a spare button", "bought"),
    SITemplate("cakes", "cakes", "the bakery by the station", "have a cherry on top", "ordered"),
    SITemplate("plants", "plants", "the garden centre", "have flowers", "bought"),
    SITemplate("books", "books", "the library sale", "have a signature inside", "bought"),
    SITemplate("kittens", "kittens", "the shelter's latest litter", "have white paws", "adopted"),
    SITemplate("lamps", "lamps", "the factory outlet", "come with a bulb", "ordered"),
    SITemplate("oranges", "oranges", "the stall at the market", "are seedless", "bought"),
    SITemplate("jars", "jars of jam", "the village fair", "have a cloth lid", "won"),
)
E1_CELLS: tuple[tuple[int, str], ...] = ((1, "Some"), (2, "Some"), (3, "Some"))
E2_CELLS: tuple[tuple[int, str], ...] = ((3, "3"), (3, "2"), (3, "1"), (2, "2"), (2, "1"), (1, "1"))
BETS: tuple[str, ...] = ("0", "1", "2", "3")
WORDS = {"1": "One", "2": "Two", "3": "All three", "Some": "Some"}


def _singular(prop: str) -> str:
    """The predicate after "One of the ...": "are sweet" -> "is sweet", "have a stamp on them" ->
    "has a stamp on it", "come with a bulb" -> "comes with a bulb"."""
    verb, _, rest = prop.partition(" ")
    verb = {"are": "is", "have": "has"}.get(verb, verb + "s")
    return f"{verb} {rest.replace(' on them', ' on it').replace('double yolks', 'a double yolk')}"


def expected_count(access: int | None, said: str | None) -> str:
    """The count a rational listener bets most on (Goodman & Stuhlmüller's reading): before the
    utterance the prior ("almost always": 3); at full access the literal count ("Some" = 2, the
    implicature "not all"); at partial access the seen count plus the unseen, which almost always
    have the property ("Some" cancels the implicature: 3)."""
    if access is None or said is None:  # before the utterance (both unset together)
        return "3"
    if said == "Some":
        return "2" if access == 3 else "3"
    return str(int(said) + (3 - access))


def _si_foils(seed: int, index: int, cells: list[tuple[str | None, int | None, str | None]]) -> dict[Any, str]:
    """The coarse view's foil per cell of one story: "3" when the answer is not 3; when it is (6
    cells), "2" in three and "1" in three, shuffled. Then no fixed ranking of the counts beats 0.6
    (always "3"); with "2" as the only foil, ranking "1" over "3" over "2" would score 0.7."""
    threes = [c for c in cells if expected_count(c[1], c[2]) == "3"]
    foils = ["2", "1"] * (len(threes) // 2) + ["2"] * (len(threes) % 2)
    random.Random(f"{SI_FAMILY}/foils/{seed}/{index}").shuffle(foils)
    out: dict[Any, str] = {c: "3" for c in cells}
    out.update(zip(threes, foils, strict=True))
    return out


def _si_options(answer: str, foil: str, first: bool) -> tuple[str, str]:
    return (answer, foil) if first else (foil, answer)


def scalar_implicature(n: int = 12, seed: int = 0) -> list[Stimulus]:
    """`n` stories x (1 before-utterance prompt + 3 E1 and 6 E2 after-utterance prompts).

    meta: `experiment` (None for the before prompt, "E1" / "E2"), `timing` ("before" / "after"),
    `access` (a), `said` (n: "Some" or a digit), `speaker_knows` (a == 3), `bets` ("0".."3"),
    `story` (pairs an after prompt with its story's before prompt)."""
    _check_n_seed(n, seed, SI_FAMILY)
    out: list[Stimulus] = []
    cells: list[tuple[str | None, int | None, str | None]] = [(None, None, None)]
    cells += [("E1", a, s) for a, s in E1_CELLS] + [("E2", a, s) for a, s in E2_CELLS]
    flags = {c: _option_flags(SI_FAMILY, seed, str(c), n) for c in cells}
    for i in range(n):
        order = list(range(len(SI_TEMPLATES)))
        random.Random(f"{SI_FAMILY}/templates/{seed}/{i // len(SI_TEMPLATES)}").shuffle(order)
        t = SI_TEMPLATES[order[i % len(SI_TEMPLATES)]]
        (sp,) = _people(random.Random(f"{SI_FAMILY}/people/{seed}/{i}"), 1)
        task_id = f"si-{seed}-{i}"
        foils = _si_foils(seed, i, cells)
        usually = f"are almost always {t.prop[4:]}" if t.prop.startswith("are ") else f"almost always {t.prop}"
        intro = (f"The {t.things} from {t.source} {usually}. "
                 f"{sp[0]} {t.got} 3 {t.things} from {t.source}.")
        question = f"Q: How many of the 3 {t.things} do you think {t.prop}? (0, 1, 2, or 3)\nA:"
        for exp, a, said in cells:
            if exp is None or said is None:  # the before prompt: (None, None, None)
                text = f"{intro}\n{question}"
                utter = ""
                suffix = "before"
            else:
                utter = (f'{sp[0]} tells you: "I have looked at {a} of the 3 {t.things}. '
                         f'{WORDS[said]} of the {t.things} {_singular(t.prop) if said == "1" else t.prop}."')
                text = f"{intro}\n{utter}\n{question}"
                suffix = f"{exp.lower()}-a{a}-n{said.lower()}"
            answer = expected_count(a, said)
            options = _si_options(answer, foils[(exp, a, said)], flags[(exp, a, said)][i])
            spans = {"scene": Span(0, len(intro)), "query": Span(text.index(question), len(text))}
            if utter:
                u0 = text.index(utter)
                spans["utterance"] = Span(u0, u0 + len(utter))
            found = find_mentions(text[: spans["query"].start], {"protagonist": sp[0], "object": t.things})
            spans.update({role: ms[0] for role, ms in found.items()})
            out.append(Stimulus(
                id=f"{task_id}-{suffix}", text=text, options=options, answer=answer, family=SI_FAMILY,
                task_id=task_id, template_id=f"si-{t.id}", condition="before" if exp is None else f"{exp}-a{a}-n{said}",
                prompt_type="belief", world_state="complete",
                protagonist_belief=None if a is None else ("complete" if a == 3 else "partial"),
                reference_state="complete", spans=spans,
                meta={"experiment": exp, "timing": "before" if exp is None else "after", "access": a,
                      "said": said, "speaker_knows": None if a is None else a == 3, "bets": list(BETS),
                      "story": task_id, "template": t.id, "speaker": sp[0], "seed": seed, "task_index": i},
                mentions={**found, **{r: (spans[r],) for r in ("scene", "query", "utterance") if r in spans}}))
    return out


# ---- free-text tasks: Short Story and Strange Stories -------------------------------------------

@dataclass(frozen=True)
class FreeTextItem:
    """A free-text question for human coding: the prompt the model continues, the question's kind
    (RC / EMSR / SMSI for the short story; mental / control, comprehension / justification for the
    strange stories), the rubric (score -> what earns it) and the highest score."""

    id: str
    family: str
    prompt: str
    question: str
    question_type: str
    rubric: dict[int, str]
    story_id: str = ""
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def max_score(self) -> int:
        return max(self.rubric)

    def rubric_text(self) -> str:
        return "; ".join(f"{k} = {v}" for k, v in sorted(self.rubric.items(), reverse=True))


SHORT_STORY = (
    "The Lighthouse Road\n\n"
    "Ines and Tomas had walked the lighthouse road every Sunday for three years. This Sunday Ines "
    "walked a little ahead. The wind came off the sea and she pulled her coat tight, and when Tomas "
    "caught up and asked if she was cold, she said she was fine.\n"
    "At the top they sat on the wall where they always sat. Tomas unwrapped the sandwiches he had "
    "made and held one out. Ines looked at it for a moment and said she wasn't hungry. He put it "
    "back in the paper and folded the paper very carefully, corner to corner.\n"
    "\"The boat's late,\" he said, nodding at the ferry.\n"
    "\"It's always late,\" Ines said. \"Everything here is always the same.\"\n"
    "Tomas laughed, but she did not. He picked up a stone and turned it over in his hand. \"My "
    "brother says there's work in the city,\" she said. \"He says I could stay with him.\"\n"
    "\"That's good,\" Tomas said. \"That's really good news.\" He threw the stone a long way out, "
    "further than he needed to.\n"
    "They watched the ferry come in. When it was time to go, Tomas said he would stay a bit longer. "
    "Ines waited, then started down the road alone. Halfway down she turned round. He was still on "
    "the wall, with the sandwiches beside him, looking at the sea."
)

_SS_QUESTIONS: tuple[tuple[str, str, dict[int, str]], ...] = (
    ("RC", "How long had Ines and Tomas been walking the lighthouse road?",
     {1: "three years (or every Sunday for three years)", 0: "any other answer"}),
    ("RC", "What did Tomas bring to eat?", {1: "sandwiches", 0: "any other answer"}),
    ("RC", "Who offered Ines a place to stay in the city?", {1: "her brother", 0: "any other answer"}),
    ("RC", "What did Tomas do when it was time to go?",
     {1: "stayed behind on the wall / let Ines go alone", 0: "any other answer"}),
    ("EMSR", "Why does Ines say she is fine when Tomas asks if she is cold?",
     {2: "she does not want his care or closeness now AND is preoccupied with something she has not said "
         "(the move / ending things)",
      1: "she is distant, upset or distracted, with no link to what she is holding back",
      0: "she really is not cold; she is just polite; irrelevant facts"}),
    ("EMSR", "Why does Tomas fold the sandwich paper so carefully?",
     {2: "he is hurt or anxious at her refusal AND is keeping his feelings in / steadying himself",
      1: "he is upset, nervous or disappointed (feeling only, no link to hiding it)",
      0: "he is tidy; he wants to save the sandwich; irrelevant facts"}),
    ("EMSR", 'What does Ines mean when she says, "Everything here is always the same"?',
     {2: "she is tired of this life, including the relationship, AND is preparing him for her leaving",
      1: "she is bored or unhappy with the place or routine (no link to him or to leaving)",
      0: "a literal reading about the ferry; irrelevant facts"}),
    ("EMSR", 'How does Tomas feel when he says, "That\'s really good news"?',
     {2: "he is hurt or sad that she may leave AND hides it / pretends to be glad for her sake",
      1: "he is sad or hurt, OR he is pretending (one without the other)",
      0: "he is happy for her; irrelevant feelings"}),
    ("EMSR", "Why does Tomas throw the stone further than he needs to?",
     {2: "he is frustrated or upset by her news AND lets it out in the throw rather than in words",
      1: "he is frustrated, angry or upset (feeling only)",
      0: "he is playing; showing off; irrelevant facts"}),
    ("EMSR", "Why does Tomas say he will stay a bit longer?",
     {2: "he wants to be alone with his feelings AND understands (or fears) the relationship is ending",
      1: "he is sad or wants to be alone (no link to the relationship)",
      0: "he wants to watch the sea or the ferry; irrelevant facts"}),
    ("EMSR", "Why does Ines turn round halfway down the road?",
     {2: "she feels regret, guilt or sadness about leaving him AND wonders how he is / still cares",
      1: "she feels sad or guilty (feeling only)",
      0: "she forgot something; to check the weather; irrelevant facts"}),
    ("EMSR", "What does Tomas think Ines is going to do?",
     {2: "he thinks she will move to the city AND that it means the end of their relationship",
      1: "he thinks she will move to the city (no inference about them)",
      0: "wrong or irrelevant"}),
    ("SMSI", "Describe what happened in the story in two or three sentences.",
     {1: "the summary mentions a mental state (feelings, wants, thoughts) of either character",
      0: "events only"}),
)


def short_story_items() -> list[FreeTextItem]:
    """The project's own short story with 4 RC, 8 EMSR and 1 SMSI questions and their rubric (the
    Dodell-Feder structure; scores 0/1 for RC and SMSI, 0/1/2 for EMSR). The paper's task has 5 RC
    questions (14 in all); this story has 4 (13 in all), so the RC share moves in steps of 1/4."""
    out = []
    for i, (kind, q, rubric) in enumerate(_SS_QUESTIONS):
        prompt = f"{SHORT_STORY}\n\nQuestion: {q}\nAnswer:"
        out.append(FreeTextItem(f"shs-{i + 1:02d}", SHORT_STORY_FAMILY, prompt, q, kind, dict(rubric),
                                story_id="lighthouse-road"))
    return out


# (kind, story, speaker, the comprehension answer, justification rubric)
_STRANGE: tuple[tuple[str, str, str, str, dict[int, str]], ...] = (
    ("white_lie", 'Noor\'s friend Caleb has spent all week knitting her a scarf. It is lumpy and the colours '
     'clash, and Noor knows she will never wear it. When Caleb asks if she likes it, Noor says, "I love it!"',
     "Noor", "No", {2: "to spare Caleb's feelings / not hurt him after his effort (his feelings named)",
                    1: "she is being nice or polite; she is lying (no reference to his feelings)",
                    0: "she really likes it; irrelevant or wrong reasons"}),
    ("sarcasm", 'Viktor spends an hour washing his car. As soon as he finishes, a lorry drives through a '
     'puddle and splashes mud all over it. Viktor says to his neighbour, "Well, that went perfectly."',
     "Viktor", "No", {2: "he is being sarcastic: he means the opposite because he is annoyed or frustrated",
                      1: "he is annoyed; or it is a joke (no reference to meaning the opposite)",
                      0: "he thinks it went well; irrelevant or wrong reasons"}),
    ("pretend", 'Ayla and her little brother are playing in the garden. Ayla holds up a long stick and says, '
     '"Stand back, I have a magic sword!"', "Ayla", "No",
     {2: "they are playing a pretend game / she is pretending for fun with her brother",
      1: "she is playing (no reference to pretence)", 0: "she thinks it is a sword; irrelevant reasons"}),
    ("joke", 'Rafael is six foot six. When he ducks through the door of the tiny cafe, the waiter grins '
     'and says, "Ah, our shortest customer!"', "the waiter", "No",
     {2: "he is joking / teasing in a friendly way, saying the opposite of the obvious",
      1: "he is being funny or friendly (no reference to saying the opposite)",
      0: "he thinks Rafael is short; irrelevant reasons"}),
    ("persuasion", 'Mila wants her father to take her to the fair. She says, "Everyone in my class is going, '
     'every single person." In fact only three of her classmates are going.', "Mila", "No",
     {2: "to persuade her father / make him feel she would be left out, so he says yes",
      1: "she wants to go (no reference to changing her father's mind)",
      0: "she thinks everyone is going; irrelevant reasons"}),
    ("double_bluff", 'During a card game, Hugo has a very weak hand. He smiles, taps his cards and tells the '
     'table, "You should all fold now, this hand is unbeatable."', "Hugo", "No",
     {2: "to make the others believe he has a strong hand so they give up (their beliefs named)",
      1: "he is bluffing or lying (no reference to what the others will think)",
      0: "he thinks his hand is strong; irrelevant reasons"}),
    ("misunderstanding", 'Greta\'s grandfather asks her to fetch "the glasses from the table". Greta brings '
     'two drinking glasses, but he meant his reading glasses. He laughs and says, "Those will help me read '
     'the paper nicely!"', "her grandfather", "No",
     {2: "he is gently joking about her misunderstanding what he meant",
      1: "he is joking or being kind (no reference to her misunderstanding)",
      0: "he thinks the drinking glasses help him read; irrelevant reasons"}),
    ("figure_of_speech", 'Jonah has been revising for exams every evening for a month. When his aunt asks how '
     'he is, he says, "My brain is completely full."', "Jonah", "No",
     {2: "it is a figure of speech: he means he is tired / has learnt so much he feels overloaded",
      1: "he is tired or stressed (no reference to not meaning it literally)",
      0: "his brain really is full; irrelevant reasons"}),
    ("control", 'A storm blew down the old oak tree by the road overnight. In the morning workers came with '
     'saws and cut it into logs, and a truck took the logs to the sawmill.', "", "",
     {2: "because the tree had fallen / was blocking the road and had to be cleared",
      1: "to use the wood (no reference to the fallen tree)", 0: "irrelevant or wrong reasons"}),
    ("control", 'The river by the village rose after a week of rain. The farmers moved their sheep up to the '
     'high field, where the grass was dry.', "", "",
     {2: "because the low fields would flood / the river was rising",
      1: "because of the rain (no reference to the flood risk)", 0: "irrelevant or wrong reasons"}),
    ("control", 'The bakery\'s oven broke on Friday night. On Saturday morning the shelves were empty and a '
     'sign on the door said the shop would open late.', "", "",
     {2: "because the oven was broken so no bread could be baked",
      1: "because something went wrong (no reference to the oven)", 0: "irrelevant or wrong reasons"}),
)
_CONTROL_QUESTIONS: tuple[tuple[str, str], ...] = (
    ("Was the tree cut up by the workers?", "Why did the workers cut up the tree?"),
    ("Did the farmers move the sheep?", "Why did the farmers move the sheep?"),
    ("Were the bakery's shelves full on Saturday morning?", "Why were the shelves empty?"),
)
_CONTROL_ANSWERS: tuple[str, ...] = ("Yes", "Yes", "No")
STRANGE_INSTRUCTIONS = ("Read each story and answer the questions in a sentence.\n\n"
                        "Example story: Pia puts on a raincoat before going out, because the sky is dark.\n"
                        "Question: Why does Pia put on a raincoat?\n"
                        "Answer: Because it looks as if it is going to rain and she wants to stay dry.\n\n")


def strange_stories_items() -> list[FreeTextItem]:
    """The project's own strange stories: 8 non-literal (mental) stories and 3 physical controls,
    each with a comprehension question (scored 1/0 against the expected Yes/No) and a
    justification question (0/1/2 rubric). As in EPITOME the justification prompt carries the
    comprehension question with its correct answer."""
    out: list[FreeTextItem] = []
    ci = 0
    for i, (kind, story, speaker, answer, rubric) in enumerate(_STRANGE):
        sid = f"sts-{i + 1:02d}"
        mental = kind != "control"
        if mental:
            q1, q2, a1 = f"Was it true, what {speaker} said?", f"Why did {speaker} say that?", answer
        else:
            (q1, q2), a1 = _CONTROL_QUESTIONS[ci], _CONTROL_ANSWERS[ci]
            ci += 1
        base = f"{STRANGE_INSTRUCTIONS}Story: {story}\n"
        meta = {"kind": kind, "mental": mental, "expected": a1}
        out.append(FreeTextItem(f"{sid}-comp", STRANGE_STORIES_FAMILY, f"{base}Question: {q1}\nAnswer:", q1,
                                "comprehension", {1: f"{a1}", 0: f"not {a1}"}, sid, dict(meta)))
        out.append(FreeTextItem(f"{sid}-just", STRANGE_STORIES_FAMILY,
                                f"{base}Question: {q1}\nAnswer: {a1}\nQuestion: {q2}\nAnswer:", q2,
                                "justification", dict(rubric), sid, dict(meta)))
    return out


def free_text_items(family: str) -> list[FreeTextItem]:
    """The free-text items of `family` ("short-story" or "strange-stories")."""
    if family == SHORT_STORY_FAMILY:
        return short_story_items()
    if family == STRANGE_STORIES_FAMILY:
        return strange_stories_items()
    raise TomlensError(f"no free-text family {family!r}",
                       f"use {SHORT_STORY_FAMILY!r} or {STRANGE_STORIES_FAMILY!r}")


# ---- what `tomlens audit` checks on these families ----------------------------------------------

_NEGATED = re.compile(r"\b(does not|is not)\b")
_CLAUSE = re.compile(r"(?:it is clear that|As it turns out,) (\w+)")


def rm_keyed_polarity(s: Stimulus) -> str | None:
    """"negated" or "affirmative": the consistent option's outer verb (read from its text, so the
    contrast also labels sets made before the meta field existed)."""
    if s.family != RM_FAMILY:
        return None
    return "negated" if _NEGATED.search(s.answer) else "affirmative"


def rm_subject_type(s: Stimulus) -> str | None:
    """"outsider" when the consistent option's statement is about the person who never met the
    group (meta `outsider`), else "insider"; None without that meta."""
    m = _CLAUSE.search(s.answer)
    if s.family != RM_FAMILY or not m or not s.meta.get("outsider"):
        return None
    return "outsider" if m.group(1) == s.meta["outsider"] else "insider"


def _rm_subject_place(s: Stimulus) -> tuple[Any, ...] | None:
    """The statement's subject's place in the chain (1..8, or "outsider"), with kind and level;
    None at level 1, where who the subject is *is* the statement's one fact."""
    kind = rm_subject_type(s)
    m = _CLAUSE.search(s.answer)
    if kind is None or m is None or s.meta.get("level") == 1:
        return None
    people = list(s.meta.get("people") or [])
    place = "outsider" if kind == "outsider" else (people.index(m.group(1)) + 1 if m.group(1) in people else None)
    return (s.condition, s.meta.get("level"), place)


def _mental_only(label):
    return lambda s: label(s) if s.condition == "mental" else None


def _non_mental_only(label):
    return lambda s: label(s) if s.condition == "non_mental" else None


IR_OLD_CUES: dict[str, str] = {r"\bboth notice that\b": "both notice", r"\bWhile \w+ is away\b": "while away",
                               r"\bknows all about\b": "knows all about", r"\bdoes not know about\b": "does not know"}
# The templates whose obstacle was a standing state (before the obstacles were all events).
IR_OLD_STANDING: frozenset[str] = frozenset({"window", "charger", "shop", "umbrella", "tap", "chair"})


def ir_awareness(s: Stimulus) -> str | None:
    """"aware" / "unaware" for the battery's prompts (minimal-pair wordings are outside the contrast)."""
    if s.family != IR_FAMILY or s.meta.get("matched_cue") or s.condition not in ("aware", "unaware"):
        return None
    return s.condition


def ir_cue_frame(s: Stimulus) -> str | None:
    """Which wording the knowledge cue uses (meta `cue_frame`; for sets made before it existed, the
    old fixed frames read from the cue's text)."""
    if s.family != IR_FAMILY:
        return None
    if s.meta.get("cue_frame"):
        return str(s.meta["cue_frame"])
    cue = s.span_text("contrast") if "contrast" in s.spans else s.text
    return next((name for pattern, name in IR_OLD_CUES.items() if re.search(pattern, cue)), None)


def ir_obstacle_kind(s: Stimulus) -> str | None:
    """"event" (it happens at one moment, so an absent speaker cannot know of it) or "standing" (a
    state the speaker may have known all along)."""
    if s.family != IR_FAMILY:
        return None
    if s.meta.get("obstacle_kind"):
        return str(s.meta["obstacle_kind"])
    template = s.meta.get("template")
    return None if template is None else ("standing" if template in IR_OLD_STANDING else "event")


CONTRASTS_BY_FAMILY: dict[str, tuple[Contrast, ...]] = {
    RM_FAMILY: (
        Contrast("keyed_polarity", rm_keyed_polarity,
                 "whether the consistent continuation is the negated or the affirmative statement"),
        Contrast("keyed_polarity_mental", _mental_only(rm_keyed_polarity),
                 "the same, mental statements only (the paper's RM number)"),
        Contrast("keyed_polarity_non_mental", _non_mental_only(rm_keyed_polarity),
                 "the same, non-mental (relation) statements only"),
    ),
    IR_FAMILY: (
        Contrast("speaker_aware", ir_awareness,
                 "whether the speaker knows of the obstacle (the answer: a request only when unaware)"),
    ),
}
# Contrasts the audit leaves out, with why: what the task tells openly by design is no shortcut.
UNAUDITED_BY_FAMILY: dict[str, dict[str, str]] = {
    "scalar-implicature": {
        "false vs true belief": "the speaker states their access ('I have looked at 2 of the 3'): the task is to "
                                "use what is said, so the words must give the access away",
    },
}
RULES_BY_FAMILY: dict[str, tuple[Rule, ...]] = {
    RM_FAMILY: (
        Rule("subject_type", rm_subject_type,
             "the statement is about the outsider (who never met the group) or about a member of it"),
        Rule("level", lambda s: s.meta.get("level") if s.family == RM_FAMILY else None,
             "the number of mental verbs / relations"),
        Rule("subject_type_by_level", lambda s: (rm_subject_type(s), s.condition, s.meta.get("level"))
             if rm_subject_type(s) else None, "subject type within each kind x level"),
        Rule("subject_place", _rm_subject_place,
             "where the subject stands in the telling chain (later people know more), per kind x level"),
        Rule("formats", lambda s: (s.meta.get("story_format"), s.meta.get("question_format"))
             if s.family == RM_FAMILY else None, "story format x continuation format (narrative / script)"),
    ),
    IR_FAMILY: (
        Rule("cue_frame", ir_cue_frame, "which wording the awareness cue uses"),
        Rule("obstacle_kind", ir_obstacle_kind, "whether the obstacle is an event or a standing state"),
        Rule("cue_type", lambda s: s.meta.get("knowledge_cue") if s.family == IR_FAMILY else None,
             "explicit or implicit cue"),
    ),
}
