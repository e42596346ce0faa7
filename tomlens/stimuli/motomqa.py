"""Higher-order true/false statements after a social story, in the design of Street et al.'s MoToMQA.

Each story (about 200 words, 5 characters, one social situation of `TOPICS`) is built from a
sequence of `belief_state.Event`s: a plan is made at a first gathering, changed at a second one
that some characters miss, and then passed on: every character but one (the "keeper", who holds
the old plan to the end) learns the new plan from someone who knows it, in private or with one
who knows it listening, or by checking it. The text is written from those events, so who saw or
was told what is stated in the story, and the labels come from the recursive belief tracker over
the same events, never by hand.

Per story and per order n in 2..6 (Street et al.'s convention after Kinderman et al.: the reader's
own state is order 1, so "Omar thinks the party is at the boathouse" is order 2 and every further
embedded character adds one) there is one true and one false ToM statement about chains of n - 1
believers. Why the chains are chosen with care: drawn freely, the last two believers alone gave
the right answer for about 90% of statements at orders 4-6 (a chain's belief rests on what all
its members witnessed together, and a random chain rarely differs from its last two there), so
accuracy by order measured orders <= 3. Now the story is redrawn until, at every chain length,
it holds two chains of one profile (`chain_profile`: as many people named, the organiser at the
same places, as many of them at the second gathering) that every shortcut of `SHORTCUTS` reads
oppositely: the last believer alone, the last two, the first alone, the world (the current
plan), the least informed believer, and "whoever missed the change holds the old plan". One
such pair becomes the order's true and false statement, so that within every story each
shortcut answers exactly one of the two right, and which chain is the true one's keeps each
shortcut's answer at one half per order and truth class (`ShortcutBalance`): every shortcut
then scores 50% at every order it applies to, and no profile cue, with the claimed plan or
without, tells a true statement from its false one. What that takes: a chain whose members all
know the new plan but never heard it together (it believes the old plan, while its first, last
and last two believers hold the new one), against one whose members heard it together though
one of them missed the change. Five characters are the fewest with both at chains of three
(Street et al.'s stories have 3-5; with four, the only three people who know the new plan
either heard it together or not). The false statement makes the true one's claim about a chain
that differs in one believer (a minimal pair, `meta["false_kind"] = "one_believer"`, nearly
always) or about another chain ("other_chain"). Chains a reader would read otherwise than the
tracker (a level knows the new plan but the organiser, who made the change, is held to the old
one inside it) are never asked about. `meta["<shortcut>_true"]` gives each shortcut's answer
(None where it does not apply: the last two need three believers, the others but the world
two), the summary reports accuracy above each, and `RULES` / `CONTRASTS` hand them to
`tomlens audit`. Per level n in 2..6 there is one true and one false factual statement of n
atomic propositions about people (who organised, who was at which gathering, who told whom, who
checked, how people are related, who did what of the story's behavioural cues such as a raised
eyebrow), all true, or the same with one swapped for a false atom of the same kind (so that the
kinds of fact do not tell the two apart): labels come from the story's event model (`fact_truth`).
A false one never contradicts itself (`conflicts`), relation nouns fit the person's gender, and
"A told B" is only offered as false where B did not get the plan from A in another way.

Old news is never told to someone who knew of the change (the tracker trusts every teller, and a
reader would not). Human-style prompts end in "The statement is" so that a continuation can be
scored; the paper's models were scored right after its prompt.

Every statement is asked in the four prompt conditions: the human-style prompt (the instructions
human readers were given, ending in the answer stem "The statement is") or the simplified one
("Question:" / "Answer:" tags), crossed with "true or false" vs "false or true" in the question;
the options' order follows the question ("true", "false") or ("false", "true").

Labels: `answer` is the statement's literal truth ("true"/"false"). `world_state` is "true" when
the statement's embedded claim (for a factual statement, the statement) holds in the world, and
`protagonist_belief` is the family's belief-like label of a ToM statement: the literal truth (the
whole chain's belief agrees with the claim), so `belief_differs` marks ToM statements that
answering by reality gets wrong; a factual statement involves nobody's belief and has none (so a
contrast of false vs true belief is about ToM statements only). `meta` holds `stmt_type` ("tom" /
"fact"), `order_or_level`, `order` (ToM only), `level` (facts only), `truth` ("T"/"F"),
`statement_literal_true` (the probe target `statement_literal` reads it),
`statement_true_for_world` / `statement_true_for_protagonist` (the claim holds in the world / in
the outermost believer's own belief, as in `belief-statements`), `false_kind`, the shortcuts'
answers (`last_1_true`, `last_2_true`, `first_1_true`, `world_true`, `least_informed_true`,
`missed_change_true`), `chain`, `chain_belief`, `prompt_style`, `options_order`,
`prompt_condition`, the story's `events` (kind, location, perceivers, agent) and, for facts,
`propositions`, so that every label can be re-derived.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tomlens.errors import TomlensError
from tomlens.stimuli import lexicon
from tomlens.stimuli.belief_state import Event, belief, beliefs
from tomlens.stimuli.records import Span, Stimulus, find_mentions
from tomlens.stimuli.shortcuts import Contrast, Rule

FAMILY = "motomqa"
ORDERS: tuple[int, ...] = (2, 3, 4, 5, 6)
LEVELS: tuple[int, ...] = (2, 3, 4, 5, 6)
PROMPT_STYLES: tuple[str, ...] = ("human", "simplified")
OPTION_ORDERS: tuple[str, ...] = ("true-first", "false-first")
CONDITIONS: tuple[str, ...] = tuple(f"{p}/{o}" for p in PROMPT_STYLES for o in OPTION_ORDERS)
CHARACTER_COUNTS: tuple[int, ...] = (5,)
HUMAN_INTRO = "Please read the following story twice in your head."
HUMAN_INSTRUCTION = "Please answer using the information provided and your own interpretation of the story."
QUESTIONS: dict[str, str] = {
    "true-first": "Do you think the following statement is true or false?",
    "false-first": "Do you think the following statement is false or true?",
}
ANSWER_STEMS: dict[str, str] = {"human": "The statement is", "simplified": "Answer:"}
VERBS: tuple[str, ...] = ("thinks", "believes", "assumes")  # by depth, outermost first


@dataclass(frozen=True)
class Topic:
    """One social situation. `{P}` is the organiser, `{V}` a value of the plan; `claim` is the
    embedded proposition of a statement, `told` the same in reported speech."""

    name: str
    values: tuple[str, ...]
    intro: str
    roles: tuple[tuple[str, str], ...]  # (female, male) relation nouns to the organiser
    scene_1: str  # opens the first gathering's sentence
    scene_2: str
    place_1: str  # "was at <place_1>" (a fact)
    place_2: str
    decide: str
    change: str
    alone: str  # the change made with nobody else there
    setting: str  # a second scene-setting sentence
    told: str
    claim: str
    check: str  # a look at the current plan (`{L}` the looker)
    cues: tuple[tuple[str, str], ...]  # (sentence, fact) of behavioural cues that change nobody's
    # belief (`{X}` a character)
    close: str


TOPICS: dict[str, Topic] = {t.name: t for t in (
    Topic(
        "farewell", ("the boathouse", "the rooftop bar", "the old library", "the bowling alley",
                     "the tea room", "the jazz club"),
        "{P} had offered to organise a surprise farewell party for the office manager, who was "
        "retiring after twenty years at the firm and was not to hear a word about it.",
        (("deputy", "deputy"), ("assistant", "assistant"), ("office mate", "office mate"),
         ("intern", "intern"), ("team leader", "team leader")),
        "At the Monday meeting,", "At the Thursday meeting,", "the Monday meeting",
        "the Thursday meeting", "{P} booked {V} for the party", "{P} moved the booking to {V}",
        "On Thursday, alone at {pos} desk, {P} moved the booking to {V}.",
        "The office was small, gossip travelled fast, and {P} had sworn everyone to secrecy about the arrangements.",
        "the party would be at {V}", "the farewell party is at {V}",
        "{L} looked up the booking on the team calendar",
        (("{X} raised an eyebrow when the manager walked past the kitchen.", "{X} raised an eyebrow"),
         ("{X} complained that the coffee machine was broken again.", "{X} complained about the coffee machine"),
         ("{X} kept glancing at the clock during the afternoon briefing.", "{X} kept glancing at the clock"),
         ("{X} brought in a tin of home-made biscuits for the team.", "{X} brought in biscuits")),
        "Everyone hoped the manager would be genuinely surprised, and that nobody would let anything slip in the last few days before the party.",
    ),
    Topic(
        "birthday", ("the harbour café", "the garden centre", "the hotel restaurant",
                     "the village pub", "the Greek taverna", "the golf club"),
        "{P} was arranging a lunch for Grandma's eightieth birthday, a family tradition that had "
        "already caused two arguments about who should sit next to whom.",
        (("sister", "brother"), ("daughter", "son"), ("niece", "nephew"), ("cousin", "cousin"),
         ("aunt", "uncle")),
        "Over Sunday dinner,", "On Wednesday evening,", "Sunday dinner", "the Wednesday call",
        "{P} reserved a table at {V}", "{P} switched the reservation to {V} on a video call",
        "On Wednesday evening, without telling anyone, {P} switched the reservation to {V}.",
        "Grandma insisted she wanted no fuss at all, which in this family meant she expected a great deal of it.",
        "the lunch would be at {V}", "the birthday lunch is at {V}",
        "{L} scrolled back through the family group chat, where the latest booking was pinned",
        (("{X} sighed loudly at the mention of the seating plan.", "{X} sighed at the seating plan"),
         ("{X} rolled {pos} eyes when Grandma's hearing aid came up again.", "{X} rolled {pos} eyes"),
         ("{X} promised to bring the photo album.", "{X} promised to bring the photo album"),
         ("{X} offered to drive Grandma there and back.", "{X} offered to drive Grandma")),
        "Grandma, for her part, simply hoped that nobody would make a speech, and that the cake would not be chocolate again this year.",
    ),
    Topic(
        "interview", ("on Monday", "on Tuesday", "on Wednesday", "on Friday"),
        "{P}, the head of department, had to schedule the interviews for a promotion that "
        "several people in the team wanted badly, and the rivalry was no secret.",
        (("deputy", "deputy"), ("colleague", "colleague"), ("trainee", "trainee"),
         ("line manager", "line manager"), ("secretary", "secretary")),
        "At the morning briefing,", "At the afternoon briefing,", "the morning briefing",
        "the afternoon briefing", "{P} said the interviews would be held {V}",
        "{P} rescheduled the interviews to be held {V}",
        "That afternoon, alone in {pos} office, {P} rescheduled the interviews to be held {V}.",
        "Candidates were meant to hear the date officially, but in practice people passed on whatever they heard.",
        "the interviews would be {V}", "the interviews are {V}",
        "{L} checked the shared diary, which showed the current interview day",
        (("{X} raised an eyebrow at the word 'promotion'.", "{X} raised an eyebrow"),
         ("{X} smiled a little too widely when a rival's name came up.", "{X} smiled at a rival's name"),
         ("{X} stayed late to polish a presentation.", "{X} stayed late"),
         ("{X} took a long lunch and came back with a new haircut.", "{X} got a new haircut")),
        "Nobody said so out loud, but everyone was counting the days and quietly rehearsing answers to the questions they dreaded most.",
    ),
    Topic(
        "proposal", ("in the piano stool", "behind the clock", "in the bread tin",
                     "under the rug", "in the sewing box", "in the tea caddy"),
        "{P} had bought an engagement ring and planned to propose at the weekend, but the flat "
        "was full of visitors and keeping the ring hidden was harder than expected.",
        (("sister", "brother"), ("flatmate", "flatmate"), ("best friend", "best friend"),
         ("cousin", "cousin"), ("neighbour", "neighbour")),
        "On Friday night,", "On Saturday morning,", "the flat on Friday night",
        "the flat on Saturday morning", "{P} hid the ring {V}", "{P} moved the ring and hid it {V}",
        "Early on Saturday, while the flat was empty, {P} moved the ring and hid it {V}.",
        "{P} trusted the people in the flat, but nobody was to say a word to {pos} partner, who was away until Saturday night.",
        "the ring was hidden {V}", "the ring is hidden {V}",
        "{L} peeked into the hiding place {P} had last used and saw where the ring was",
        (("{X} winked at nobody in particular.", "{X} winked"),
         ("{X} raised an eyebrow when the word 'wedding' came up on the radio.", "{X} raised an eyebrow"),
         ("{X} was too nervous to eat breakfast.", "{X} skipped breakfast"),
         ("{X} tidied the whole kitchen without being asked.", "{X} tidied the kitchen")),
        "By the evening, everyone in the flat was pretending very hard that nothing was going on, and doing it rather badly.",
    ),
    Topic(
        "pickup", ("outside the cinema", "by the station", "at the petrol station",
                   "behind the sports hall", "at the bus shelter"),
        "{P} was worried about a teenager's first late night out and had insisted on a "
        "pick-up arranged in advance, which caused some eye-rolling in the family.",
        (("sister", "brother"), ("daughter", "son"), ("niece", "nephew"), ("neighbour", "neighbour"),
         ("friend", "friend")),
        "At breakfast,", "At teatime,", "breakfast", "teatime",
        "{P} fixed the pick-up {V}", "{P} changed the plan: the pick-up would now be {V}",
        "Later, alone in the car, {P} changed the plan: the pick-up would now be {V}.",
        "The teenager, who was not told the details, had promised to check the family chat before leaving the party.",
        "the pick-up would be {V}", "the pick-up is {V}",
        "{L} read the note {P} had left on the fridge about the pick-up",
        (("{X} sighed and said the fuss was embarrassing.", "{X} called the fuss embarrassing"),
         ("{X} raised an eyebrow at the word 'curfew'.", "{X} raised an eyebrow"),
         ("{X} offered to lend a phone charger.", "{X} offered a phone charger"),
         ("{X} laughed about {pos} own first night out.", "{X} laughed about a first night out")),
        "In the end, everyone agreed that a plan was better than none, even if nobody would admit to having lost sleep over it.",
    ),
)}


@dataclass(frozen=True)
class Person:
    name: str
    subj: str
    obj: str
    pos: str


@dataclass(frozen=True)
class StoryModel:
    """What happened in one story: the text is written from this, and labels are computed on it."""

    story_index: int
    task_id: str
    topic: Topic
    people: tuple[Person, ...]  # people[0] is the organiser
    relations: dict[str, str]  # name -> relation noun to the organiser
    values: tuple[str, str]  # (first plan, changed plan)
    events: tuple[Event, ...]
    text: str
    tellings: tuple[tuple[int, str, str], ...] = ()  # (event index, teller, hearer)
    cue_log: tuple[tuple[int, str], ...] = ()  # (index in topic.cues, who)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.people)

    @property
    def organiser(self) -> str:
        return self.people[0].name


def _join(names: Sequence[str]) -> str:
    names = list(names)
    if len(names) <= 1:
        return "".join(names)
    return ", ".join(names[:-1]) + " and " + names[-1]


def _was(names: Sequence[str]) -> str:
    return "was" if len(names) == 1 else "were"


DRAWS = 200  # stories drawn at most until the characters disagree (see `build_story`)


def build_story(story_index: int, seed: int, n_characters: int, topic: Topic) -> StoryModel:
    """One story: characters, relations, values and events drawn from the seed, then the text.

    Draws are repeated (deterministically) until the story is `balanceable`: at every chain length
    it holds two chains of one profile that every shortcut reads oppositely, so that each order's
    statements can defeat every shortcut (where, say, every chain of three believed what its last
    two believe, order 4 would measure order 3)."""
    return _build_story(story_index, seed, n_characters, topic).model


def _build_story(story_index: int, seed: int, n_characters: int, topic: Topic) -> StoryChains:
    rng = random.Random(f"{FAMILY}/{seed}/{story_index}")
    for _ in range(DRAWS):
        index = StoryChains(_draw_story(rng, story_index, seed, n_characters, topic))
        if balanceable(index.model, index):
            return index
    raise TomlensError(f"no story of topic {topic.name!r} with {n_characters} characters in which "
                       f"every shortcut can be defeated after {DRAWS} draws", "use another seed")


def _draw_story(rng: random.Random, story_index: int, seed: int, n_characters: int,
                topic: Topic) -> StoryModel:
    """Draw one story: its cast, the two gatherings, and how the others learn the new plan after
    them. The draws from `rng` come in one fixed order (a seed's stories depend on it)."""
    draft = _StoryDraft.cast(rng, topic, n_characters)
    keeper, rest, s1, s2 = draft.gatherings()
    draft.narrate(_later_steps(rng, draft, keeper, rest, s1, s2))
    return draft.story(story_index, seed)


class _StoryDraft:
    """A story while it is drawn: the cast (`p`, the organiser, and the `others`), the event model
    and sentences so far, and the shuffled cues with who each was said of."""

    def __init__(self, rng: random.Random, topic: Topic, people: tuple[Person, ...], relations: dict[str, str],
                 values: tuple[str, str]):
        self.rng, self.topic, self.people, self.relations, self.values = rng, topic, people, relations, values
        self.p = people[0]
        self.others = [q.name for q in people[1:]]
        self.events: list[Event] = []
        self.sentences: list[str] = []
        self.cues = list(topic.cues)
        self.cue_log: list[tuple[int, str]] = []  # (cue index in topic.cues, who)
        self.tellings: list[tuple[int, str, str]] = []  # (event index, teller, hearer)

    @classmethod
    def cast(cls, rng: random.Random, topic: Topic, n_characters: int) -> _StoryDraft:
        """Draw the people, their relations to the organiser and the two plans; the opening."""
        people = tuple(Person(*r) for r in rng.sample(lexicon.NAMES, n_characters))
        others = [q.name for q in people[1:]]
        roles = rng.sample(topic.roles, len(others))
        by_name = {q.name: q for q in people}
        relations = {name: (role[0] if by_name[name].subj == "she" else role[1])
                     for name, role in zip(others, roles, strict=True)}
        v1, v2 = rng.sample(topic.values, 2)
        draft = cls(rng, topic, people, relations, (v1, v2))
        rel = [f"{name} was {people[0].name}'s {relations[name]}" for name in others]
        draft.sentences += [draft.fmt(topic.intro), _join(rel) + ".", draft.fmt(topic.setting)]
        return draft

    def fmt(self, s: str, **k: str) -> str:
        return s.format(P=self.p.name, pos=self.p.pos, **k)

    def cue(self, k: int) -> None:
        x = self.rng.choice(self.people)
        self.cue_log.append((self.topic.cues.index(self.cues[k]), x.name))
        self.sentences.append(self.cues[k][0].format(X=x.name, pos=x.pos, P=self.p.name))

    def gatherings(self) -> tuple[str, list[str], list[str], list[str]]:
        """The two gatherings, with the first cue between them: (keeper, the rest, who was at each).
        Roles (see `build_story`): one character ("keeper") never hears of the change; the others
        learn it at the second gathering or afterwards, some of them separately."""
        rng, topic, others, (v1, v2) = self.rng, self.topic, self.others, self.values
        order = rng.sample(others, len(others))
        keeper, rest = order[0], order[1:]
        # First gathering: everyone but possibly the keeper (who then hears the old plan second-hand).
        s1 = sorted([*rest, *([keeper] if rng.random() < 0.75 else [])], key=others.index)
        absent1 = [o for o in others if o not in s1]
        self.events.append(Event("place", v1, frozenset({self.p.name, *s1})))
        self.sentences.append(f"{topic.scene_1} with {_join(s1)} there, {self.fmt(topic.decide, V=v1)}."
                              + (f" {_join(absent1)} {_was(absent1)} not there." if absent1 else ""))
        rng.shuffle(self.cues)
        self.cue(0)
        # Second gathering (possibly the organiser alone): the plan changes; at least one of the
        # others is not there.
        s2 = sorted(rng.sample(rest, rng.randint(0, len(rest) - 1)), key=others.index)
        self.events.append(Event("move", v2, frozenset({self.p.name, *s2})))
        if s2:
            self.sentences.append(f"{topic.scene_2} with only {_join(s2)} there, {self.fmt(topic.change, V=v2)}.")
        else:
            self.sentences.append(self.fmt(topic.alone, V=v2))
        return keeper, rest, s1, s2

    def narrate(self, steps: list[tuple[str, str, str, list[str]]]) -> None:
        """Tell each later step (a telling or a check, with its bystanders) in order, a further cue
        after each while cues remain, then the close."""
        openers = ["The next day,", "Soon after,", "Later that week,", "That evening,", "Afterwards,"]
        names = [q.name for q in self.people]
        topic, events = self.topic, self.events
        for i, (kind, agent, hearer, by) in enumerate(steps):
            opener = openers[i % len(openers)]
            by = sorted(by, key=names.index)
            if kind == "tell":
                told = belief((agent,), events)
                assert told is not None
                self.tellings.append((len(events), agent, hearer))
                events.append(Event("tell", told, frozenset({agent, hearer, *by})))
                listen = f", in front of {_join(by)}," if by else " in private"
                self.sentences.append(f"{opener} {agent} told {hearer}{listen} that {topic.told.format(V=told)}.")
            else:
                events.append(Event("look", None, frozenset({agent, *by}), agent=agent))
                watch = f", while {_join(by)} watched" if by else ", with nobody else around"
                self.sentences.append(f"{opener} {topic.check.format(L=agent, P=self.p.name)}{watch}.")
            if i + 1 < len(self.cues):  # each cue at most once
                self.cue(i + 1)
        self.sentences.append(topic.close)

    def story(self, story_index: int, seed: int) -> StoryModel:
        return StoryModel(story_index, f"{FAMILY}-{seed}-{story_index:03d}", self.topic, self.people, self.relations,
                          self.values, tuple(self.events), " ".join(self.sentences), tuple(self.tellings),
                          tuple(self.cue_log))


def _later_steps(rng: random.Random, draft: _StoryDraft, keeper: str, rest: list[str], s1: list[str],
                 s2: list[str]) -> list[tuple[str, str, str, list[str]]]:
    """After the gatherings, everyone but the keeper learns the new plan, each from one who knows
    it (in private, now and then with one who knows it listening) or by checking it; a keeper who
    missed the first gathering hears the old plan first from one who does not know of the change
    yet. (kind, teller or looker, hearer, bystanders) per step."""
    p, others = draft.p, draft.others
    knowers = {p.name, *s2}
    steps: list[tuple[str, str, str, list[str]]] = []
    learners = [n for n in rest if n not in knowers]
    rng.shuffle(learners)
    if keeper not in s1:
        stale_teller = rng.choice(learners)
        steps.append(("tell", stale_teller, keeper, []))
    for learner in learners:
        known = sorted(knowers, key=[p.name, *others].index)
        if rng.random() < 0.25:
            by = [rng.choice(known)] if rng.random() < 0.5 else []
            steps.append(("look", learner, "", by))
        else:
            teller = rng.choice(known)
            others_known = [n for n in known if n != teller]
            by = [rng.choice(others_known)] if others_known and rng.random() < 0.5 else []
            steps.append(("tell", teller, learner, by))
        knowers.add(learner)
    return steps


# ---------------------------------------------------------------------------------------------
# Factual propositions: atoms about people, true or false on the story's event model
# ---------------------------------------------------------------------------------------------

Atom = tuple[str, ...]  # (kind, *args)


def fact_truth(model: StoryModel, atom: Atom) -> bool:
    """Whether an atomic social fact holds in the story (computed on its events and relations)."""
    kind, *args = atom
    ev = model.events
    if kind == "organised":
        return args[0] == model.organiser
    if kind == "relation":
        return model.relations.get(args[0]) == args[1]
    if kind == "at_1":
        return args[0] in ev[0].perceivers
    if kind == "at_2":
        return args[0] in ev[1].perceivers and len(ev[1].perceivers) > 1
    if kind == "told":
        return any((t, h) == (args[0], args[1]) for _, t, h in model.tellings)
    if kind == "checked":
        return any(e.kind == "look" and e.agent == args[0] for e in ev)
    if kind == "cue":
        return (int(args[1]), args[0]) in model.cue_log
    raise TomlensError(f"unknown fact kind {kind!r}", "use organised, relation, at_1, at_2, told, checked, cue")


def render_fact(model: StoryModel, atom: Atom) -> str:
    kind, *args = atom
    t = model.topic
    if kind == "organised":
        return {"farewell": f"{args[0]} organised the farewell party",
                "birthday": f"{args[0]} arranged the birthday lunch",
                "interview": f"{args[0]} scheduled the interviews",
                "proposal": f"{args[0]} bought the engagement ring",
                "pickup": f"{args[0]} arranged the pick-up"}[t.name]
    if kind == "relation":
        return f"{args[0]} was {model.organiser}'s {args[1]}"
    if kind == "at_1":
        return f"{args[0]} was at {t.place_1}"
    if kind == "at_2":
        return f"{args[0]} was at {t.place_2}"
    if kind == "told":
        return f"{args[0]} told {args[1]} about the plan"
    if kind == "checked":
        return f"{args[0]} checked the plan"
    if kind == "cue":
        who = next(q for q in model.people if q.name == args[0])
        return t.cues[int(args[1])][1].format(X=who.name, pos=who.pos)
    raise TomlensError(f"unknown fact kind {kind!r}", "see fact_truth")


def relation_nouns(model: StoryModel, name: str) -> list[str]:
    """The topic's relation nouns (to the organiser) that fit `name`'s gender, sorted."""
    female = next(q for q in model.people if q.name == name).subj == "she"
    return sorted({role[0] if female else role[1] for role in model.topic.roles})


def conveyed_pairs(model: StoryModel) -> set[tuple[str, str]]:
    """(source, hearer) pairs where the hearer got the plan from the source in the story: the
    organiser's announcements at a gathering, and every telling to its hearer and bystanders."""
    out: set[tuple[str, str]] = set()
    for e in model.events[:2]:
        out |= {(model.organiser, n) for n in e.perceivers if n != model.organiser}
    for i, teller, _ in model.tellings:
        out |= {(teller, n) for n in model.events[i].perceivers if n != teller}
    return out


def conflicts(model: StoryModel, a: Atom, b: Atom) -> bool:
    """Whether atoms `a` and `b` cannot both hold for a reader, whatever the story (two organisers,
    the organiser with a relation to themself, one person with two relations, two people with one
    relation noun, one cue for two people): a false statement must not contradict itself."""
    if a == b:
        return False
    ka, kb = a[0], b[0]
    if ka == kb == "organised":
        return True
    if {ka, kb} == {"organised", "relation"}:
        org, rel = (a, b) if ka == "organised" else (b, a)
        return org[1] == rel[1]
    if ka == kb == "relation":
        return a[1] == b[1] or a[2] == b[2]
    if ka == kb == "cue":
        return a[2] == b[2]
    return False


def candidate_atoms(model: StoryModel) -> list[Atom]:
    """Every atom the story can be asked about (true and false ones), in a fixed order."""
    names, others = model.names, model.names[1:]
    atoms: list[Atom] = [("organised", n) for n in names]
    # only nouns of the person's own gender ("Tom was Ann's sister" is false by grammar alone), and
    # only nouns the story uses (a noun the story never says is a false statement's word alone)
    used = set(model.relations.values())
    atoms += [("relation", n, r) for n in others for r in relation_nouns(model, n) if r in used]
    atoms += [("at_1", n) for n in names]
    if len(model.events[1].perceivers) > 1:
        atoms += [("at_2", n) for n in names]
    pairs = {(t, h) for _, t, h in model.tellings}
    conveyed = conveyed_pairs(model)
    # "H told T" when T told H is left out (a reply could make it true in a reader's eyes), and so
    # is "A told B" where B heard it from A otherwise (A announced it with B there, or B stood by
    # while A told someone): a reader would count that as telling
    atoms += [("told", a, b) for a in names for b in names if a != b
              and ((a, b) in pairs or ((b, a) not in pairs and (a, b) not in conveyed))]
    if any(e.kind == "look" for e in model.events):
        atoms += [("checked", n) for n in names]
    atoms += [("cue", n, str(k)) for k, _ in model.cue_log for n in names]
    return atoms


# ---------------------------------------------------------------------------------------------
# Statements
# ---------------------------------------------------------------------------------------------


def wrap(claim: str, chain: Sequence[str]) -> str:
    """'Omar thinks that Nadia believes that <claim>.' (outermost first)."""
    if not chain:
        return claim[0].upper() + claim[1:] + "."
    out = claim
    for depth in range(len(chain) - 1, -1, -1):
        out = f"{chain[depth]} {VERBS[depth % len(VERBS)]} that {out}"
    return out + "."


@dataclass(frozen=True)
class Statement:
    """One statement about a story, with its label and where it came from."""

    kind: str  # "tom" / "fact"
    n: int  # ToM order or factual level
    truth: bool
    text: str
    chain: tuple[str, ...] = ()
    claim_value: str | None = None
    chain_belief: str | None = None
    false_kind: str | None = None
    atoms: tuple[Atom, ...] = ()
    paired_chain: tuple[str, ...] | None = None  # the other statement's chain (minimal pair)


def _one_swaps(chain: tuple[str, ...], names: Sequence[str]) -> list[tuple[str, ...]]:
    out = []
    for i in range(len(chain)):
        for n in names:
            c = chain[:i] + (n,) + chain[i + 1:]
            if n != chain[i] and all(c[j] != c[j + 1] for j in range(len(c) - 1)):
                out.append(c)
    return out


def reader_consistent(model: StoryModel, chain: Sequence[str]) -> bool:
    """False where a level of `chain` believes the new plan but the organiser inside it holds the
    old one: the organiser made the change, so whoever knows the new plan knows that the organiser
    does, and a reader would not follow the tracker there (it only counts shared perception)."""
    levels = beliefs(chain, model.events)  # [world, chain[:1], ...]
    new = model.values[1]
    for i, name in enumerate(chain):
        if name == model.organiser and levels[i + 1] != new and new in levels[1:i + 1]:
            return False
    return True


MAX_BELIEVERS = max(ORDERS) - 1
Table = dict[tuple[str, ...], tuple[str | None, bool]]


def belief_table(model: StoryModel, max_len: int = MAX_BELIEVERS) -> Table:
    """(belief, `reader_consistent`) of every chain of 1..`max_len` believers (no one directly
    nested in themself), the same as `belief` and `reader_consistent` chain by chain (tested).

    Why not call those per chain: a story of 5 characters has about 1,700 chains up to 5
    believers, and every draw of a story is checked on all of them (`balanceable`). Here a chain
    extends its prefix: its value after each event, given the events its members all perceived."""
    events = model.events
    world: list[str | None] = []
    value: str | None = None
    for e in events:
        if e.kind in ("place", "move"):
            value = e.location
        world.append(value)
    new, organiser = model.values[1], model.organiser
    out: Table = {}
    # (prefix, events all its members perceived, its value after each event, whether a level of
    # it holds the new plan, whether it is reader-consistent)
    stack: list[tuple[tuple[str, ...], list[bool], list[str | None], bool, bool]] = [
        ((), [True] * len(events), world, False, True)]
    while stack:
        prefix, seen_p, line_p, new_seen, consistent = stack.pop()
        if len(prefix) == max_len:
            continue
        for name in model.names:
            if prefix and prefix[-1] == name:
                continue
            seen = [s and name in e.perceivers for s, e in zip(seen_p, events, strict=True)]
            line: list[str | None] = []
            value = None
            for i, e in enumerate(events):
                if seen[i] and e.kind in ("place", "move", "tell"):
                    value = e.location
                elif seen[i] and e.kind == "look" and e.agent == name:
                    value = e.location if e.location is not None else line_p[i]
                line.append(value)
            chain = (*prefix, name)
            ok = consistent and not (name == organiser and value != new and new_seen)
            out[chain] = (value, ok)
            stack.append((chain, seen, line, new_seen or value == new, ok))
    return out


SHORTCUTS: tuple[str, ...] = ("last_1", "last_2", "first_1", "world", "least_informed", "missed_change")
SHORTCUT_READINGS: dict[str, str] = {
    "last_1": "the innermost believer's own belief (the chain cut to its last name)",
    "last_2": "the last two believers' belief (the chain cut to its last two names)",
    "first_1": "the outermost believer's own belief (the chain cut to its first name)",
    "world": "the world: the current plan",
    "least_informed": "the old plan if any believer still holds it, else the new one (first-order beliefs only)",
    "missed_change": "the old plan if any believer missed the second gathering, else the new one",
}
# a shortcut applies from this many believers on (with fewer, its cut is the whole chain)
MIN_BELIEVERS: dict[str, int] = {"last_1": 2, "last_2": 3, "first_1": 2, "world": 1,
                                 "least_informed": 2, "missed_change": 2}


def shortcut_value(events: Sequence[Event], values: Sequence[str], chain: Sequence[str], shortcut: str,
                   table: Table | None = None) -> str | None:
    """The plan a reader following `shortcut` (see `SHORTCUT_READINGS`) takes `chain` to believe,
    in a story of `events` whose plan went from `values[0]` to `values[1]` at the second gathering
    (`events[1]`); None where the shortcut does not apply to a chain this short."""
    if shortcut not in MIN_BELIEVERS:
        raise TomlensError(f"unknown shortcut {shortcut!r}", f"use one of {list(SHORTCUTS)}")
    chain = tuple(chain)
    if len(chain) < MIN_BELIEVERS[shortcut]:
        return None
    old, new = values

    def held(c: tuple[str, ...]) -> str | None:
        return table[c][0] if table is not None and c in table else belief(c, events)

    if shortcut == "world":
        return new
    if shortcut == "least_informed":
        return old if any(held((n,)) != new for n in chain) else new
    if shortcut == "missed_change":
        return old if any(n not in events[1].perceivers for n in chain) else new
    return held({"last_1": chain[-1:], "last_2": chain[-2:], "first_1": chain[:1]}[shortcut])


def shortcut_true(model: StoryModel, chain: Sequence[str], claim_value: str | None, shortcut: str,
                  table: Table | None = None) -> bool | None:
    """The answer `shortcut` gives the statement that `chain` believes `claim_value`: true where
    the plan it attributes is the claim; None where it does not apply."""
    if claim_value is None:
        return None
    value = shortcut_value(model.events, model.values, chain, shortcut, table)
    return None if value is None else value == claim_value


def stimulus_shortcut_true(s: Stimulus, shortcut: str) -> bool | None:
    """`shortcut_true` re-derived from a record's own meta (its events, plans, chain and claim), so
    that the audit checks the story a record tells, not a stored label; None for facts."""
    m = s.meta
    if m.get("stmt_type") != "tom" or m.get("claim_value") is None:
        return None
    value = shortcut_value(events_from_meta(m["events"]), m["values"], m["chain"], shortcut)
    return None if value is None else value == m["claim_value"]


def last_believers_true(model: StoryModel, chain: Sequence[str], claim_value: str | None, k: int) -> bool | None:
    """The last-k shortcut's answer: whether the last `k` believers of `chain` alone (the chain cut
    to its innermost k names) believe the claim; None when the chain is not longer than k."""
    return shortcut_true(model, chain, claim_value, f"last_{k}")


Misread = tuple[bool | None, ...]
Profile = tuple[int, tuple[int, ...], int]


def chain_profile(model: StoryModel, chain: Sequence[str]) -> Profile:
    """What a chain looks like without tracking anyone's mind: how many different people it names,
    where it names the organiser, and how many of its people were at the second gathering. The true
    and false statement of an order get chains of one profile, so that no such cue (combined with
    the claimed plan or not) tells them apart."""
    at_change = model.events[1].perceivers
    return (len(set(chain)), tuple(i for i, n in enumerate(chain) if n == model.organiser),
            sum(n in at_change for n in set(chain)))


@dataclass(frozen=True)
class ChainOption:
    """A chain that can be asked about, its belief, which shortcuts misread it, and its profile.

    `misread[k]`: shortcut `SHORTCUTS[k]` attributes another plan than the chain's (so it answers
    the true statement about the chain "false" and the false one "true"); None where it does not
    apply at this length. `profile`: `chain_profile`, None for one believer (order 2 is the
    baseline every reading starts from, and there the profile is the belief's own evidence)."""

    chain: tuple[str, ...]
    belief: str
    misread: Misread
    profile: Profile | None

    @property
    def pattern(self) -> tuple[Misread, Profile | None]:
        return self.misread, self.profile


class StoryChains:
    """A story's chains up to `MAX_BELIEVERS`, each with its `ChainOption` (computed once per
    length and kept: a story is checked at every length and then asked about at every order)."""

    def __init__(self, model: StoryModel) -> None:
        self.model = model
        self.table = belief_table(model)
        self._options: dict[int, list[ChainOption]] = {}

    def options(self, n_believers: int) -> list[ChainOption]:
        """Every chain of `n_believers` that holds a belief and that a reader reads as the tracker
        does (`reader_consistent`)."""
        if n_believers not in self._options:
            model, table = self.model, self.table
            out = []
            for chain, (value, ok) in table.items():
                if len(chain) != n_believers or value is None or not ok:
                    continue
                misread = tuple(None if (v := shortcut_value(model.events, model.values, chain, k, table)) is None
                                else v != value for k in SHORTCUTS)
                profile = chain_profile(model, chain) if n_believers > 1 else None
                out.append(ChainOption(chain, value, misread, profile))
            self._options[n_believers] = out
        return self._options[n_believers]


def chain_options(model: StoryModel, n_believers: int) -> list[ChainOption]:
    """`StoryChains(model).options(n_believers)`, for one look at one length."""
    return StoryChains(model).options(n_believers)


def _complement(misread: Misread) -> Misread:
    return tuple(None if m is None else not m for m in misread)


# Lengths 1..MAX_BELIEVERS in the order `balanceable` checks them: three believers first (where
# most draws fail, and cheaply), five last (about 1,300 chains).
_CHECK_ORDER: tuple[int, ...] = (3, 2, 1, 4, 5)
assert sorted(_CHECK_ORDER) == list(range(1, MAX_BELIEVERS + 1))


def balanceable(model: StoryModel, chains_: StoryChains | None = None) -> bool:
    """Whether the story has, at every chain length 1..MAX_BELIEVERS, two chains of one profile
    (`chain_profile`) that every shortcut reads oppositely (one right, one wrong): then each order's
    true and false statement can be drawn so that every shortcut answers exactly one of the two
    right, and no profile cue tells them apart."""
    index = chains_ if chains_ is not None else StoryChains(model)
    for n in _CHECK_ORDER:
        found = {o.pattern for o in index.options(n)}
        if not any((_complement(m), prof) in found for m, prof in found):
            return False
    return True


class ShortcutBalance:
    """Per order, how often each shortcut has misread the chains asked about so far, among true
    and among false statements. A shortcut answers a true statement right where it reads its chain
    right and a false one right where it misreads it, so it is at chance (its answer independent
    of the truth) where it misreads half of the chains of each truth class: the target."""

    def __init__(self) -> None:
        self.counts: dict[bool, list[list[int]]] = {t: [[0, 0] for _ in SHORTCUTS] for t in (True, False)}

    def _cost_after(self, truth: bool, misread: Misread) -> float:
        cost = 0.0
        for (n_mis, n), flag in zip(self.counts[truth], misread, strict=True):
            if flag is not None:
                n_mis, n = n_mis + flag, n + 1
            cost += abs(n_mis - n / 2)
        return cost

    def cost(self, true_misread: Misread, false_misread: Misread) -> float:
        return self._cost_after(True, true_misread) + self._cost_after(False, false_misread)

    def add(self, truth: bool, misread: Misread) -> None:
        for count, flag in zip(self.counts[truth], misread, strict=True):
            if flag is not None:
                count[0] += flag
                count[1] += 1


def tom_statements(model: StoryModel, order: int, rng: random.Random,
                   balance: ShortcutBalance | None = None,
                   chains_: StoryChains | None = None) -> tuple[Statement, Statement]:
    """One true and one false statement of `order` (a chain of order - 1 believers).

    The two chains are read oppositely by every shortcut (`SHORTCUTS`: the last one or two
    believers, the first, the world, the least informed believer, whoever missed the change), so
    that within the story each shortcut answers one of the two right; which of the two is the true
    statement's keeps `balance` (the order's running counts) nearest one half per shortcut and
    truth class. The false statement makes the true one's claim about a chain that differs in one
    believer where the story has one (a minimal pair), else about another chain ("other_chain");
    a story without opposite chains (not one `build_story` returns) falls back to the pair nearest
    the balance, then possibly the other value of a chain ("other_value", "other_chain_value")."""
    options = (chains_ if chains_ is not None else StoryChains(model)).options(order - 1)
    if not options:
        raise TomlensError(f"story {model.task_id} has no chain of {order - 1} believers with a belief",
                           "use lower orders")
    by_sig: dict[tuple, list[ChainOption]] = {}
    for o in options:
        by_sig.setdefault(o.pattern, []).append(o)
    by_chain = {o.chain: o for o in options}
    sigs = sorted(by_sig, key=repr)
    pairs = ([(a, (_complement(a[0]), a[1])) for a in sigs if (_complement(a[0]), a[1]) in by_sig]
             or [(a, b) for a in sigs for b in sigs])
    rng.shuffle(pairs)
    bal = balance if balance is not None else ShortcutBalance()
    best = min(bal.cost(a[0], b[0]) for a, b in pairs)
    tied = [(a, b) for a, b in pairs if bal.cost(a[0], b[0]) == best]

    def swaps(t: ChainOption, sig_f: tuple) -> list[ChainOption]:
        found = (by_chain.get(c) for c in _one_swaps(t.chain, model.names))
        return [f for f in found if f is not None and f.pattern == sig_f and f.belief != t.belief]

    true_opt: ChainOption | None = None
    false_opt: ChainOption | None = None
    kind = "one_believer"
    for sig_t, sig_f in tied:  # a minimal pair where any of the best patterns allows one
        paired = [t for t in by_sig[sig_t] if swaps(t, sig_f)]
        if paired:
            true_opt = rng.choice(paired)
            false_opt = rng.choice(swaps(true_opt, sig_f))
            break
    if true_opt is None or false_opt is None:
        sig_t, sig_f = tied[0]
        true_opt = rng.choice(by_sig[sig_t])
        same_claim = [f for f in by_sig[sig_f] if f.belief != true_opt.belief]
        if same_claim:
            false_opt, kind = rng.choice(same_claim), "other_chain"
        elif true_opt in by_sig[sig_f]:
            false_opt, kind = true_opt, "other_value"
        else:
            false_opt, kind = rng.choice(by_sig[sig_f]), "other_chain_value"
    bal.add(True, true_opt.misread)
    bal.add(False, false_opt.misread)
    old, new = model.values
    claim_t, claim_f = true_opt.belief, (old if false_opt.belief == new else new)
    claim = model.topic.claim
    pair_t = false_opt.chain if kind == "one_believer" else None
    pair_f = true_opt.chain if kind == "one_believer" else None
    t = Statement("tom", order, True, wrap(claim.format(V=claim_t), true_opt.chain), true_opt.chain,
                  claim_t, true_opt.belief, paired_chain=pair_t)
    f = Statement("tom", order, False, wrap(claim.format(V=claim_f), false_opt.chain), false_opt.chain,
                  claim_f, false_opt.belief, false_kind=kind, paired_chain=pair_f)
    return t, f


FACT_DRAWS = 50  # draws of the true atoms at most until one of them can be swapped for a false one


def fact_statements(model: StoryModel, level: int, rng: random.Random) -> tuple[Statement, Statement]:
    """A true conjunction of `level` distinct true atoms, and the same conjunction with one atom
    swapped for a false atom of the same kind ("Ana was at the Monday meeting" for "Ben was at the
    Monday meeting"), in the same place.

    Why the same kind: with the false atom drawn from all false atoms, kinds with many false
    instances ("A told B", a cue given to the wrong person) made up more of the false statements,
    and their words told false from true without reading the story. A false statement never
    contradicts itself (`conflicts`): it is false because the story says otherwise."""
    atoms = candidate_atoms(model)
    true_atoms = [a for a in atoms if fact_truth(model, a)]
    false_atoms = [a for a in atoms if not fact_truth(model, a)]
    if len(true_atoms) < level or not false_atoms:
        raise TomlensError(f"story {model.task_id} has {len(true_atoms)} true facts, fewer than "
                           f"level {level} needs", f"use levels up to {len(true_atoms)}")
    for _ in range(FACT_DRAWS):
        t_atoms = rng.sample(true_atoms, level)
        swaps = {i: [w for w in false_atoms if w[0] == t[0]
                     and not any(conflicts(model, w, o) for j, o in enumerate(t_atoms) if j != i)]
                 for i, t in enumerate(t_atoms)}
        where = [i for i, found in swaps.items() if found]
        if where:
            break
    else:
        raise TomlensError(f"story {model.task_id} has no true fact of level {level} with a false "
                           "fact of the same kind to swap in", "use lower levels")
    i = rng.choice(where)
    f_atoms = [*t_atoms[:i], rng.choice(swaps[i]), *t_atoms[i + 1:]]

    def say(parts: Sequence[Atom]) -> str:
        s = _join([render_fact(model, a) for a in parts])
        return s[0].upper() + s[1:] + "."

    return (Statement("fact", level, True, say(t_atoms), atoms=tuple(t_atoms)),
            Statement("fact", level, False, say(f_atoms), atoms=tuple(f_atoms)))


def _event_rows(events: Sequence[Event]) -> list[list[Any]]:
    return [[e.kind, e.location, sorted(e.perceivers), e.agent] for e in events]


def events_from_meta(rows: Sequence[Sequence[Any]]) -> list[Event]:
    """The events stored in a record's `meta["events"]`, as tracker events."""
    return [Event(k, loc, frozenset(per), agent=ag) for k, loc, per, ag in rows]


def prompt(model: StoryModel, statement: str, condition: str) -> tuple[str, dict[str, Span], tuple[str, str]]:
    """The prompt text of one condition, its spans (story, question, statement, query) and options."""
    style, order = condition.split("/")
    question, stem = QUESTIONS[order], ANSWER_STEMS[style]
    parts: list[tuple[str | None, str]] = []
    if style == "human":
        parts += [(None, HUMAN_INTRO + "\n\n"), ("story", model.text), (None, "\n\n"),
                  (None, HUMAN_INSTRUCTION + " "), ("question", question), (None, "\n\n"),
                  ("statement", statement), (None, "\n\n"), ("query", stem)]
    else:
        parts += [("story", model.text), (None, "\n\nQuestion: "), ("question", question),
                  (None, " "), ("statement", statement), (None, "\n"), ("query", stem)]
    text, spans = "", {}
    for role, piece in parts:
        if role:
            spans[role] = Span(len(text), len(text) + len(piece))
        text += piece
    options = ("true", "false") if order == "true-first" else ("false", "true")
    return text, spans, options


def _check(name: str, given: Sequence[int] | int, allowed: Sequence[int]) -> tuple[int, ...]:
    given = (given,) if isinstance(given, int) else tuple(given)
    if any(isinstance(g, bool) or g not in allowed for g in given) or len(set(given)) != len(given):
        raise TomlensError(f"{name}={list(given)!r} must be distinct values of {list(allowed)}",
                           f"e.g. {name}={tuple(allowed)}")
    return given


def motomqa(
    n: int = 7,
    seed: int = 0,
    *,
    conditions: Sequence[str] | str | None = None,
    orders: Sequence[int] | int = ORDERS,
    levels: Sequence[int] | int = LEVELS,
    topics: Sequence[str] | str | None = None,
    characters: Sequence[int] | int = CHARACTER_COUNTS,
) -> list[Stimulus]:
    """`n` stories, each with one true and one false ToM statement per order in `orders` and one
    true and one false factual statement per level in `levels`, in each prompt condition.

    Topics and character counts rotate over stories (so both are balanced); names, relations,
    values and who was where are drawn per story from `seed`."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise TomlensError(f"n={n!r} stories", "use n >= 1")
    conds = CONDITIONS if conditions is None else ((conditions,) if isinstance(conditions, str) else tuple(conditions))
    bad = [c for c in conds if c not in CONDITIONS]
    if bad or not conds or len(set(conds)) != len(conds):
        raise TomlensError(f"conditions={list(conds)!r}", f"use distinct values of {list(CONDITIONS)}")
    orders = _check("orders", orders, ORDERS) if orders not in ((), []) else ()
    levels = _check("levels", levels, LEVELS) if levels not in ((), []) else ()
    if not orders and not levels:
        raise TomlensError("no orders and no levels: nothing to ask", "keep at least one order or level")
    names = tuple(TOPICS) if topics is None else ((topics,) if isinstance(topics, str) else tuple(topics))
    if not names or any(t not in TOPICS for t in names):
        raise TomlensError(f"topics={list(names)!r}", f"use values of {list(TOPICS)}")
    counts = _check("characters", characters, CHARACTER_COUNTS)
    out: list[Stimulus] = []
    # per order: how often each shortcut has misread the chains asked about so far
    balances = {o: ShortcutBalance() for o in orders}
    for i in range(n):
        topic = TOPICS[names[i % len(names)]]
        index = _build_story(i, seed, counts[i % len(counts)], topic)
        model = index.model
        rng = random.Random(f"{FAMILY}/{seed}/{i}/statements")
        stmts: list[Statement] = []
        for order in orders:
            tom_rng = random.Random(f"{FAMILY}/{seed}/{i}/{order}/tom")
            stmts += tom_statements(model, order, tom_rng, balances[order], index)
        for level in levels:
            stmts += fact_statements(model, level, rng)
        for st in stmts:
            for cond in conds:
                out.append(_stimulus(model, st, cond))
    return out


ROLE_KEYS: tuple[str, ...] = ("protagonist", "other_agent", "third_agent", "fourth_agent", "fifth_agent")


def _stimulus(model: StoryModel, st: Statement, condition: str) -> Stimulus:
    text, spans, options = prompt(model, st.text, condition)
    style, order = condition.split("/")
    ev = model.events
    words = {role: name for role, name in zip(ROLE_KEYS, model.names, strict=False)}
    words.update(location_1=model.values[0], location_2=model.values[1])
    mentions = find_mentions(text, words)
    for role, found in mentions.items():
        spans.setdefault(role, found[0])
    if st.kind == "tom":
        world_true = st.claim_value == belief((), ev)
        holder_true = beliefs(st.chain, ev)[1] == st.claim_value
        s0 = spans["statement"].start
        at = 0
        for d, name in enumerate(st.chain):  # each believer's name in the statement
            m = re.compile(rf"(?<!\w){re.escape(name)}(?!\w)").search(st.text, at)
            assert m is not None  # the statement names every believer, in order
            spans[f"holder_{d + 1}"] = Span(s0 + m.start(), s0 + m.end())
            at = m.end()
        claim = st.claim_value
        assert claim is not None  # a ToM statement always claims a value
        c = st.text.rindex(claim)
        spans["statement_claim"] = Span(s0 + c, s0 + c + len(claim))
    else:
        world_true = holder_true = st.truth
    truth = "true" if st.truth else "false"
    tag = "t" if st.truth else "f"
    meta: dict[str, Any] = {
        "story_index": model.story_index, "topic": model.topic.name,
        "n_characters": len(model.people), "characters": list(model.names),
        "organiser": model.organiser, "relations": dict(model.relations),
        "values": list(model.values), "events": _event_rows(ev),
        "tellings": [[t, h] for _, t, h in model.tellings],
        "cues": [[k, who] for k, who in model.cue_log],
        "stmt_type": st.kind, "order_or_level": st.n,
        "order": st.n if st.kind == "tom" else None, "level": st.n if st.kind == "fact" else None,
        "truth": "T" if st.truth else "F", "statement": st.text,
        "statement_literal_true": st.truth, "statement_true_for_world": world_true,
        "statement_true_for_protagonist": holder_true,
        "chain": list(st.chain), "chain_belief": st.chain_belief, "claim_value": st.claim_value,
        **{f"{k}_true": shortcut_true(model, st.chain, st.claim_value, k) if st.kind == "tom" else None
           for k in SHORTCUTS},
        "false_kind": st.false_kind, "paired_chain": list(st.paired_chain) if st.paired_chain else None,
        "propositions": [{"atom": list(a), "text": render_fact(model, a), "true": fact_truth(model, a)}
                         for a in st.atoms],
        "prompt_style": style, "options_order": order, "prompt_condition": condition,
        "word_count": len(model.text.split()),
    }
    return Stimulus(
        id=f"{model.task_id}-{'tom' if st.kind == 'tom' else 'f'}{st.n}{tag}-{style}-{order}",
        text=text, options=options, answer=truth, family=FAMILY, task_id=model.task_id,
        template_id=model.topic.name, condition=condition, reversed=order == "false-first",
        prompt_type="belief", world_state="true" if world_true else "false",
        protagonist_belief=truth if st.kind == "tom" else None, reference_state=None, spans=spans,
        mentions=mentions, meta=meta,
    )


def minimal_pairs(n: int = 20, seed: int = 0, *, conditions: Sequence[str] | str = ("simplified/true-first",),
                  orders: Sequence[int] | int = ORDERS, **options: Any) -> list:
    """Clean/corrupted pairs for patching: the true ToM statement of an order and the false one
    that names one other believer (`false_kind == "one_believer"`), in the same prompt condition.

    The texts differ only in that name, which is the pair's `contrast` span; `clean.answer` is
    "true" and the corrupted prompt's answer "false". Cells whose false statement is not a
    one-believer swap have no pair. Returns `tomlens.stimuli.pairs.MinimalPair`s (unchecked: use
    `make_pairs("motomqa", ...)` for the checked, token-aligned set)."""
    from tomlens.stimuli.pairs import MinimalPair

    if "levels" in options:
        raise TomlensError("motomqa pairs are ToM statements only", "drop the levels option")
    stims = motomqa(n, seed, conditions=conditions, orders=orders, levels=(), **options)
    cells: dict[tuple[str, int, str], dict[str, Stimulus]] = {}
    for s in stims:
        cells.setdefault((s.task_id, s.meta["order"], s.condition), {})[s.answer] = s
    pairs = []
    for (task_id, order, cond), by in cells.items():
        t, f = by["true"], by["false"]
        if f.meta["false_kind"] != "one_believer":
            continue
        depth = next(d for d, (a, b) in enumerate(zip(t.meta["chain"], f.meta["chain"], strict=True)) if a != b)
        role = f"holder_{depth + 1}"
        clean = t.with_(spans={**t.spans, "contrast": t.spans[role]})
        corrupted = f.with_(spans={**f.spans, "contrast": f.spans[role]})
        pairs.append(MinimalPair(id=f"{task_id}-tom{order}-{cond.replace('/', '-')}", clean=clean,
                                 corrupted=corrupted, family=FAMILY, contrast="one_believer"))
    return pairs


# ---- what `tomlens audit` checks on this family ------------------------------------------------


def _tom_truth(order: int | None) -> Callable[[Stimulus], str | None]:
    def label(s: Stimulus) -> str | None:
        if s.meta.get("stmt_type") != "tom" or (order is not None and s.meta.get("order") != order):
            return None
        return s.answer
    return label


def _fact_truth(s: Stimulus) -> str | None:
    return s.answer if s.meta.get("stmt_type") == "fact" else None


def _shortcut_rule(shortcut: str) -> Callable[[Stimulus], bool | None]:
    def feature(s: Stimulus) -> bool | None:
        return stimulus_shortcut_true(s, shortcut)
    return feature


def _profile_and_claim(s: Stimulus) -> tuple | None:
    """The chain's profile (`chain_profile`: people named, where the organiser is, how many were at
    the second gathering) with whether the claim is the current plan."""
    m = s.meta
    if m.get("stmt_type") != "tom" or len(m.get("chain") or ()) < 2:
        return None
    chain, at_change = m["chain"], set(m["events"][1][2])
    profile = (len(set(chain)), tuple(i for i, n in enumerate(chain) if n == m["organiser"]),
               sum(n in at_change for n in set(chain)))
    return profile, m["claim_value"] == m["values"][1]


def _order(s: Stimulus) -> int | None:
    return s.meta.get("order") if s.meta.get("stmt_type") == "tom" else None


TOM_CONTRASTS: tuple[str, ...] = tuple(f"ToM statement truth, order {k}" for k in ORDERS)
CONTRASTS: tuple[Contrast, ...] = (
    *(Contrast(name, _tom_truth(k), f"true vs false ToM statements of order {k} (chains of {k - 1} "
               "believers): what accuracy at that order is about") for name, k in zip(TOM_CONTRASTS, ORDERS, strict=True)),
    Contrast("ToM statement truth", _tom_truth(None), "true vs false ToM statements, all orders"),
    Contrast("factual statement truth", _fact_truth, "true vs false factual statements, all levels"),
)
_TOM = (*TOM_CONTRASTS, "ToM statement truth")
RULES: tuple[Rule, ...] = (
    *(Rule(f"shortcut: {k}", _shortcut_rule(k), f"the answer given by {SHORTCUT_READINGS[k]}",
           (*(c for c, o in zip(TOM_CONTRASTS, ORDERS, strict=True) if o - 1 >= MIN_BELIEVERS[k]), "ToM statement truth"))
      for k in SHORTCUTS),
    Rule("chain profile and claimed plan", _profile_and_claim,
         "how many people the chain names, where it names the organiser and how many of them were "
         "at the second gathering, with whether the claim is the current plan",
         (*TOM_CONTRASTS[1:], "ToM statement truth")),
    Rule("order", _order, "the statement's order (a set whose truth varied with order would show here)",
         ("ToM statement truth",)),
)
