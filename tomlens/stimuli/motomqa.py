"""Higher-order true/false statements after a social story, in the design of Street et al.'s MoToMQA.

Each story (about 200 words, 3-5 characters, one social situation of `TOPICS`) is built from a
sequence of `belief_state.Event`s: a plan is made at a first gathering (some characters present,
the others named as absent), changed at a second one, then told, overheard and checked. The text
is written from those events, so who saw or was told what is stated in the story, and the labels
come from the recursive belief tracker over the same events, never by hand.

Per story and per order n in 2..6 (Street et al.'s convention after Kinderman et al.: the reader's
own state is order 1, so "Omar thinks the party is at the boathouse" is order 2 and every further
embedded character adds one) there is one true and one false ToM statement: the chain of n - 1
believers is drawn from the story's characters, and the false statement makes the same claim about
a chain that differs in one believer (so the pair flips one embedded clause and the claim alone
cannot give the answer); where no such chain exists it names any chain with another belief
("other_chain"), or failing that the same chain with the other value ("other_value"), which is
also chosen where it keeps the claimed value balanced (`meta["false_kind"]`: "one_believer",
"other_chain" or "other_value"). Per order, the share of statements that claim the current plan
is kept near one half among true and among false statements, so the claimed value does not give
the answer. Chains a reader would read otherwise than the tracker (a level knows the new plan but
the organiser, who made the change, is held to the old one inside it) are never asked about. At
orders 4-6 many statements still reduce to a shorter chain: `last_1_true` / `last_2_true` in
`meta` give the answer of the last one / two believers alone, and the summary reports them as
baselines. Per level n in 2..6 there is one true and one false factual statement of n
atomic propositions about people (who organised, who was at which gathering, who told whom, who
checked, how people are related, who did what of the story's behavioural cues such as a raised
eyebrow), all true, or all but one: labels come from the story's event model (`fact_truth`).
A false one never contradicts itself (`conflicts`), relation nouns fit the person's gender, and
"A told B" is only offered as false where B did not get the plan from A in another way.

Stories are redrawn (deterministically) until the characters disagree at the first and second
order, and old news is never told to someone who knew of the change (the tracker trusts every
teller, and a reader would not). Human-style prompts end in "The statement is" so that a
continuation can be scored; the paper's models were scored right after its prompt.

Every statement is asked in the four prompt conditions: the human-style prompt (the instructions
human readers were given, ending in the answer stem "The statement is") or the simplified one
("Question:" / "Answer:" tags), crossed with "true or false" vs "false or true" in the question;
the options' order follows the question ("true", "false") or ("false", "true").

Labels: `answer` is the statement's literal truth ("true"/"false"). `world_state` is "true" when
the statement's embedded claim (for a factual statement, the statement) holds in the world, and
`protagonist_belief` is the family's belief-like label: the literal truth (the whole chain's
belief agrees with the claim), so `belief_differs` marks ToM statements that answering by reality
gets wrong. `meta` holds `stmt_type` ("tom" / "fact"), `order_or_level`, `order` (ToM only),
`level` (facts only), `truth` ("T"/"F"), `statement_literal_true` (the probe target
`statement_literal` reads it), `statement_true_for_world` / `statement_true_for_protagonist` (the
claim holds in the world / in the outermost believer's own belief, as in `belief-statements`),
`false_kind`, `last_1_true`, `last_2_true`, `chain`, `chain_belief`, `prompt_style`, `options_order`,
`prompt_condition`, the story's `events` (kind, location, perceivers, agent) and, for facts,
`propositions`, so that every label can be re-derived.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any, Sequence

from tomlens.errors import TomlensError
from tomlens.stimuli import lexicon
from tomlens.stimuli.belief_state import Event, belief, beliefs, chains
from tomlens.stimuli.records import Span, Stimulus, find_mentions

FAMILY = "motomqa"
ORDERS: tuple[int, ...] = (2, 3, 4, 5, 6)
LEVELS: tuple[int, ...] = (2, 3, 4, 5, 6)
PROMPT_STYLES: tuple[str, ...] = ("human", "simplified")
OPTION_ORDERS: tuple[str, ...] = ("true-first", "false-first")
CONDITIONS: tuple[str, ...] = tuple(f"{p}/{o}" for p in PROMPT_STYLES for o in OPTION_ORDERS)
CHARACTER_COUNTS: tuple[int, ...] = (3, 4, 5)
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

    Draws are repeated (deterministically) until the characters end up disagreeing, both about
    the plan and about what one another believe (beliefs at chain lengths 1 and 2 take both
    values): where everyone agrees, a higher-order statement is settled by the first-order belief
    and the orders measure nothing."""
    rng = random.Random(f"{FAMILY}/{seed}/{story_index}")
    for _ in range(DRAWS):
        model = _draw_story(rng, story_index, seed, n_characters, topic)
        if all(len({belief(c, model.events) for c in chains(model.names, k)} - {None}) == 2
               for k in (1, 2)):
            return model
    raise TomlensError(f"no story of topic {topic.name!r} with {n_characters} characters in which "
                       f"the characters disagree after {DRAWS} draws", "use another seed")


def _draw_story(rng: random.Random, story_index: int, seed: int, n_characters: int,
                topic: Topic) -> StoryModel:
    rows = rng.sample(lexicon.NAMES, n_characters)
    people = tuple(Person(*r) for r in rows)
    p = people[0]
    others = [q.name for q in people[1:]]
    roles = rng.sample(topic.roles, len(others))
    by_name = {q.name: q for q in people}
    relations = {name: (role[0] if by_name[name].subj == "she" else role[1])
                 for name, role in zip(others, roles)}
    v1, v2 = rng.sample(topic.values, 2)
    fmt = lambda s, **k: s.format(P=p.name, pos=p.pos, **k)  # noqa: E731
    events: list[Event] = []

    sentences = [fmt(topic.intro)]
    rel = [f"{name} was {p.name}'s {relations[name]}" for name in others]
    sentences.append(_join(rel) + ".")
    sentences.append(fmt(topic.setting))
    # First gathering: at least one other present; the rest named as absent.
    s1 = sorted(rng.sample(others, rng.randint(1, len(others))), key=others.index)
    absent1 = [o for o in others if o not in s1]
    events.append(Event("place", v1, frozenset({p.name, *s1})))
    sentences.append(f"{topic.scene_1} with {_join(s1)} there, {fmt(topic.decide, V=v1)}."
                     + (f" {_join(absent1)} {_was(absent1)} not there." if absent1 else ""))
    cues = list(topic.cues)
    rng.shuffle(cues)
    cue_log: list[tuple[int, str]] = []  # (cue index in topic.cues, who)

    def cue(k: int) -> None:
        x = rng.choice(people)
        cue_log.append((topic.cues.index(cues[k]), x.name))
        sentences.append(cues[k][0].format(X=x.name, pos=x.pos, P=p.name))

    cue(0)
    # Second gathering (possibly the organiser alone): the plan changes.
    s2 = sorted(rng.sample(others, rng.randint(0, len(others) - 1)), key=others.index)
    events.append(Event("move", v2, frozenset({p.name, *s2})))
    if s2:
        sentences.append(f"{topic.scene_2} with only {_join(s2)} there, {fmt(topic.change, V=v2)}.")
    else:
        sentences.append(fmt(topic.alone, V=v2))
    # Then two or three of: a telling (possibly in front of someone), a check of the current plan.
    # Tellers who hold the old plan and hearers who think otherwise are favoured, so that the
    # characters end up disagreeing (a story where everyone agrees has no higher-order contrast).
    kinds = ["tell", rng.choice(["tell", "look"])] + (["tell"] if rng.random() < 0.5 else [])
    rng.shuffle(kinds)
    openers = ["The next day,", "Soon after,", "Later that week,", "That evening,"]
    tellings: list[tuple[int, str, str]] = []
    names = [q.name for q in people]
    for i, kind in enumerate(kinds):
        opener = openers[i % len(openers)]
        # A stale plan is only passed to people who hold no plan or the same one: someone who
        # knows of the change would not take it back on hearsay, and the tracker (tellers are
        # trusted) must not have them do so.
        def can_hear(n: str, told: str) -> bool:
            return told == v2 or belief((n,), events) in (None, told)

        combos = [(t, h) for t in names for h in names
                  if t != h and belief((t,), events) is not None and can_hear(h, belief((t,), events))]
        if kind == "tell" and combos:
            stale = [c for c in combos if belief((c[0],), events) != v2]
            pool = stale if stale and rng.random() < 0.7 else combos
            differ = [c for c in pool if belief((c[1],), events) != belief((c[0],), events)]
            teller, hearer = rng.choice(differ if differ and rng.random() < 0.7 else pool)
            told = belief((teller,), events)
            rest = [n for n in names if n not in (teller, hearer) and can_hear(n, told)]
            by = sorted(rng.sample(rest, 1), key=names.index) if rest and rng.random() < 0.4 else []
            tellings.append((len(events), teller, hearer))
            events.append(Event("tell", told, frozenset({teller, hearer, *by})))
            listen = f", in front of {_join(by)}," if by else " in private"
            sentences.append(f"{opener} {teller} told {hearer}{listen} that "
                             f"{topic.told.format(V=told)}.")
        else:
            looker = rng.choice(names[1:])  # the organiser knows the plan already
            rest = [n for n in names if n != looker]
            by = sorted(rng.sample(rest, 1), key=names.index) if rng.random() < 0.5 else []
            events.append(Event("look", None, frozenset({looker, *by}), agent=looker))
            watch = f", while {_join(by)} watched" if by else ", with nobody else around"
            sentences.append(f"{opener} {topic.check.format(L=looker, P=p.name)}{watch}.")
        if i + 1 < len(cues):  # each cue at most once
            cue(i + 1)
    sentences.append(topic.close)
    text = " ".join(sentences)
    return StoryModel(story_index, f"{FAMILY}-{seed}-{story_index:03d}", topic, people, relations,
                      (v1, v2), tuple(events), text, tuple(tellings),
                      tuple(cue_log))


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
    # only nouns of the person's own gender ("Tom was Ann's sister" is false by grammar alone)
    atoms += [("relation", n, r) for n in others for r in relation_nouns(model, n)]
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


def last_believers_true(model: StoryModel, chain: Sequence[str], claim_value: str | None, k: int) -> bool | None:
    """The shortcut answer: whether the last `k` believers of `chain` alone (the chain cut to its
    innermost k names) believe the claim; None when the chain is not longer than k."""
    if claim_value is None or len(chain) <= k:
        return None
    return belief(tuple(chain)[-k:], model.events) == claim_value


def tom_statements(model: StoryModel, order: int, rng: random.Random, want_world: bool,
                   other_value: bool = False) -> tuple[Statement, Statement]:
    """One true and one false statement of `order` (chain of order - 1 believers).

    The true chain is drawn among chains whose claim is the world's value when `want_world` (else
    the old plan), where such chains exist; the false statement keeps the claim and changes one
    believer so that the tracker's belief differs (or, failing that, any chain; or the other value,
    which `other_value` asks for). Chains a reader would read otherwise are left out
    (`reader_consistent`)."""
    ev = model.events
    all_chains = [c for c in chains(model.names, order - 1)
                  if belief(c, ev) is not None and reader_consistent(model, c)]
    world = belief((), ev)
    want = [c for c in all_chains if (belief(c, ev) == world) == want_world]
    pool = want or all_chains
    # prefer chains that have a one-believer swap with a different belief (a minimal pair)
    swappable = [c for c in pool if any(belief(s, ev) not in (None, belief(c, ev)) and reader_consistent(model, s)
                                        for s in _one_swaps(c, model.names))]
    true_chain = rng.choice(swappable or pool)
    value = belief(true_chain, ev)
    claim = model.topic.claim.format(V=value)
    swaps = [s for s in _one_swaps(true_chain, model.names)
             if belief(s, ev) not in (None, value) and reader_consistent(model, s)]
    if other_value:  # asked for: the same chain with the other value (balances claimed values)
        swaps, all_chains = [], [c for c in all_chains if belief(c, ev) == value]
    if swaps:
        false_chain, kind, fclaim, fvalue = rng.choice(swaps), "one_believer", claim, value
    else:
        others = [c for c in all_chains if belief(c, ev) != value]
        if others:
            false_chain, kind, fclaim, fvalue = rng.choice(others), "other_chain", claim, value
        else:
            other = model.values[0] if value == model.values[1] else model.values[1]
            false_chain, kind = true_chain, "other_value"
            fclaim, fvalue = model.topic.claim.format(V=other), other
    t = Statement("tom", order, True, wrap(claim, true_chain), true_chain, value, value,
                  paired_chain=false_chain if kind == "one_believer" else None)
    f = Statement("tom", order, False, wrap(fclaim, false_chain), false_chain, fvalue,
                  belief(false_chain, ev), false_kind=kind,
                  paired_chain=true_chain if kind == "one_believer" else None)
    assert belief(true_chain, ev) == value and belief(false_chain, ev) != fvalue
    return t, f


def _balanced_tom(model: StoryModel, order: int, seed: int, story: int, prefer_world: bool,
                  counts: list[int]) -> tuple[Statement, Statement]:
    """The ToM pair of one story and order whose claimed values keep the order's running shares
    of "claims the current plan" closest to one half among true and among false statements, so
    that the claimed value does not predict the answer (fallbacks in `tom_statements` would break
    a plain alternation). `counts` ([true current, false current, pairs]) is updated in place; the
    choice depends on earlier stories only, so a story's statements depend on (seed, index)."""
    world = model.values[1]
    best: tuple[float, int, tuple[Statement, Statement]] | None = None
    options = [(w, o) for o in (False, True) for w in (prefer_world, not prefer_world)]
    for rank, (want, other) in enumerate(options):
        rng = random.Random(f"{FAMILY}/{seed}/{story}/{order}/{want}/{other}")
        pair = tom_statements(model, order, rng, want_world=want, other_value=other)
        t_cur = counts[0] + (pair[0].claim_value == world)
        f_cur, m = counts[1] + (pair[1].claim_value == world), counts[2] + 1
        cost = abs(t_cur - m / 2) + abs(f_cur - m / 2)
        if best is None or cost < best[0]:
            best = (cost, rank, pair)
    assert best is not None
    pair = best[2]
    counts[0] += pair[0].claim_value == world
    counts[1] += pair[1].claim_value == world
    counts[2] += 1
    return pair


def fact_statements(model: StoryModel, level: int, rng: random.Random) -> tuple[Statement, Statement]:
    """A true conjunction of `level` distinct true atoms, and a false one with one false atom."""
    atoms = candidate_atoms(model)
    true_atoms = [a for a in atoms if fact_truth(model, a)]
    false_atoms = [a for a in atoms if not fact_truth(model, a)]
    if len(true_atoms) < level or not false_atoms:
        raise TomlensError(f"story {model.task_id} has {len(true_atoms)} true facts, fewer than "
                           f"level {level} needs", f"use levels up to {len(true_atoms)}")
    t_atoms = rng.sample(true_atoms, level)
    # the false atom first, then true atoms that do not contradict it (a false statement is false
    # because the story says otherwise, not because it contradicts itself)
    order = rng.sample(false_atoms, len(false_atoms))
    for wrong in order:
        fits = [a for a in true_atoms if not conflicts(model, wrong, a)]
        if len(fits) >= level - 1:
            break
    else:
        raise TomlensError(f"story {model.task_id} has no false fact with {level - 1} true facts "
                           "that do not contradict it", "use lower levels")
    f_atoms = rng.sample(fits, level - 1)
    f_atoms.insert(rng.randrange(level), wrong)

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
    counts = _check("characters", characters, (3, 4, 5))
    out: list[Stimulus] = []
    # per order: how many true / false statements so far claim the current plan, and how many
    claimed: dict[int, list[int]] = {o: [0, 0, 0] for o in orders}
    for i in range(n):
        topic = TOPICS[names[i % len(names)]]
        model = build_story(i, seed, counts[i % len(counts)], topic)
        rng = random.Random(f"{FAMILY}/{seed}/{i}/statements")
        stmts: list[Statement] = []
        for k, order in enumerate(orders):
            stmts += _balanced_tom(model, order, seed, i, (i + k) % 2 == 0, claimed[order])
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
    words = {role: name for role, name in zip(ROLE_KEYS, model.names)}
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
        c = st.text.rindex(st.claim_value)
        spans["statement_claim"] = Span(s0 + c, s0 + c + len(st.claim_value))
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
        "last_1_true": last_believers_true(model, st.chain, st.claim_value, 1) if st.kind == "tom" else None,
        "last_2_true": last_believers_true(model, st.chain, st.claim_value, 2) if st.kind == "tom" else None,
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
        protagonist_belief=truth, reference_state=None, spans=spans, mentions=mentions, meta=meta,
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
        depth = next(d for d, (a, b) in enumerate(zip(t.meta["chain"], f.meta["chain"])) if a != b)
        role = f"holder_{depth + 1}"
        clean = t.with_(spans={**t.spans, "contrast": t.spans[role]})
        corrupted = f.with_(spans={**f.spans, "contrast": f.spans[role]})
        pairs.append(MinimalPair(id=f"{task_id}-tom{order}-{cond.replace('/', '-')}", clean=clean,
                                 corrupted=corrupted, family=FAMILY, contrast="one_believer"))
    return pairs
