"""Belief statements after a story, for probing in the style of Zhu et al. (2024).

A story (the story part of an unexpected-transfer, unexpected-contents or order-only belief
prompt) is followed by one statement about where the object is (or what the container holds),
wrapped in `order` mental-state verbs along a chain of believers:

    order 0: "The ring is in the drawer."                           (a plain fact)
    order 1: "Anna believes the ring is in the drawer."
    order 2: "Ben thinks that Anna believes the ring is in the drawer."

Why it is built this way: labels come from a recursive belief tracker
(`tomlens.stimuli.belief_state`), so "Ben thinks that Anna believes X" is labelled with what Ben
takes Anna to believe, not with Anna's belief; and the question asks for exactly that literal truth
("Is this statement true or false? Answer:"), so `answer` is the statement's literal truth. The
believers vary within every story (the protagonist, the other agent and, by default, a third agent
who saw the object put away and then either stayed or left, balanced across tasks), and every
chain is asked about both places, so within every condition and every order some statements are
true and some false, and which place is true depends on who the chain is.

Labels on every record (`meta`):
* `statement_literal_true`: the tracker's belief for the chain is the place named (the answer);
* `statement_true_for_world` / `statement_true_for_protagonist`: the embedded claim ("the ring is
  in the drawer") agrees with the world / with the protagonist's own belief (Zhu et al.'s oracle
  and protagonist labels; kept as second labels). `world_state` / `protagonist_belief` hold these
  two as "true"/"false", so `belief_differs` marks statements whose two views disagree.
* `chain` (names, outermost first), `chain_roles`, `order`, `source_condition`.
A chain whose agents never perceived anything together (e.g. about each other) believes nothing:
both its statements are false.
"""

from __future__ import annotations

import importlib
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from tomlens.errors import TomlensError
from tomlens.stimuli import lexicon
from tomlens.stimuli.belief_state import Event, beliefs, chains
from tomlens.stimuli.records import Span, Stimulus, find_mentions

SOURCES: dict[str, tuple[str, str]] = {
    "unexpected-transfer": ("tomlens.stimuli.false_belief", "unexpected_transfer"),
    "unexpected-contents": ("tomlens.stimuli.false_belief", "unexpected_contents"),
    "order-only": ("tomlens.stimuli.order_only", "order_only"),
}
CLAIMS: dict[str, Literal["transfer", "contents"]] = {"unexpected-contents": "contents"}  # others: "transfer"
FAMILY = "belief-statements"
MAX_ORDER = 4
STATEMENT_QUERY = "Is this statement true or false? Answer:"
BELIEF_QUERY = "Is this belief true or false? Answer:"  # old default; ambiguous for order >= 1
_DETERMINERS = ("the ", "a ", "an ", "his ", "her ", "their ", "its ", "my ", "your ", "our ")
THIRD_BLOCK = 8  # stays / leaves is balanced within every block of 8 tasks

# The third agent's sentence, appended to the story: the same words in every condition of a task
# (so order-only stories keep their bag of words), and it saw the object put away either way. One
# who stays says it saw and heard everything after, so the tracker lets it perceive every later
# event, tellings included (`story_events`): the text and the labels agree.
THIRD_SENTENCES: dict[str, dict[bool, str]] = {
    "transfer": {
        True: "{C} saw {P} put the {obj} {prep} the {L1} and stayed, seeing and hearing everything after.",
        False: "{C} saw {P} put the {obj} {prep} the {L1} and then left the {room} for good.",
    },
    "contents": {
        True: "{C} saw {A} fill the {container} and stayed, seeing and hearing everything after.",
        False: "{C} saw {A} fill the {container} and then went away for good.",
    },
}


@dataclass(frozen=True)
class ThirdAgent:
    """A third believer added to a story: `stays` = present for everything after the object was
    put away (else it saw that and then left)."""

    name: str
    stays: bool


def belief_statements(
    n: int = 20,
    seed: int = 0,
    source: str = "unexpected-transfer",
    orders: Sequence[int] | int = (1, 2),
    *,
    conditions: Sequence[str] | None = None,
    query: str | None = None,
    third_agent: bool = True,
    chains_per_order: int | None = None,
) -> list[Stimulus]:
    """Statements of the given `orders` after the stories of `n` tasks of `source`.

    Stories are the source generator's belief prompts (`n`, `seed` and `conditions` are passed
    to it). Per story and order: every chain of believers (or `chains_per_order` of them, the
    same in all stories of a task, rotating across tasks) x the two places, in story order.
    Believers: the protagonist, the other agent, the story's bystander (who may be told, where the
    source has one) and, with `third_agent`, a third agent of `third_agents`.
    """
    if source not in SOURCES:
        raise TomlensError(f"unknown statement source {source!r}", f"use one of {list(SOURCES)}")
    orders = _check_orders(orders)
    if isinstance(conditions, str):
        conditions = (conditions,)
    module, fn = SOURCES[source]
    generated = getattr(importlib.import_module(module), fn)(n=n, seed=seed, conditions=conditions)
    stories = [s for s in generated if s.prompt_type == "belief"]
    if not stories:
        raise TomlensError(
            f"{source} gave no belief prompts",
            "check `conditions` against the source's condition names",
        )
    return statements_for(stories, orders, claim=CLAIMS.get(source, "transfer"), query=query,
                          source=source, third_agent=third_agent,
                          chains_per_order=chains_per_order)


def statements_for(
    stories: Sequence[Stimulus],
    orders: Sequence[int] | int = (1, 2),
    *,
    claim: Literal["transfer", "contents"] = "transfer",
    query: str | None = None,
    source: str = "",
    third_agent: bool = True,
    chains_per_order: int | None = None,
    events: Callable[[Stimulus], Sequence[Event]] | None = None,
) -> list[Stimulus]:
    """Statements after any belief prompts whose two options are the two possible states.

    `claim="transfer"` says "the <object span> is in the <option>", `claim="contents"` says "the
    <container span> contains <option>". The story is the text before the `query` span. Labels
    come from `story_events(story)` (the built-in families), or from `events(story)` for other
    stories (then no third agent is added: the believers are the protagonist and other agent).
    """
    orders = _check_orders(orders)
    if claim not in ("transfer", "contents"):
        raise TomlensError(f"claim={claim!r}", "use 'transfer' or 'contents'")
    if chains_per_order is not None and (not isinstance(chains_per_order, int)
                                         or isinstance(chains_per_order, bool)
                                         or chains_per_order < 1):
        raise TomlensError(f"chains_per_order={chains_per_order!r}", "use None (all) or >= 1")
    thirds = third_agents(stories) if third_agent and events is None else {}
    task_pos: dict[str, int] = {}
    for story in stories:
        task_pos.setdefault(story.task_id, len(task_pos))
    out: list[Stimulus] = []
    for r, story in enumerate(stories):
        third = thirds.get(story.task_id)
        evs = list(events(story)) if events is not None else story_events(story, third)
        agents = _agents(story, third)
        prefix = _prefix(story, claim, dict(agents), third)
        for order in orders:
            if order >= 1 and not agents:
                raise TomlensError(f"story {story.id!r} has no `protagonist` span, needed for "
                                   f"order {order}", "use order 0 for these stories")
            if order >= 2 and len(agents) < 2:
                raise TomlensError(
                    f"story {story.id!r} has no `other_agent` span, needed for order {order}",
                    "use orders 0 and 1 for these stories",
                )
            all_chains = chains([name for name, _ in agents], order)
            if chains_per_order is not None and chains_per_order < len(all_chains):
                # the same chains in every story of a task (so conditions ask the same), rotating
                # across tasks
                first = (task_pos[story.task_id] * chains_per_order) % len(all_chains)
                all_chains = [all_chains[(first + j) % len(all_chains)]
                              for j in range(chains_per_order)]
            for ci, chain in enumerate(all_chains):
                for li, place in enumerate(story.options):
                    flip = bool((r + order + ci + li) % 2)
                    out.append(_statement(story, prefix, claim, chain, dict(agents), place,
                                          flip, query, source, evs, third))
    return out


def third_agents(stories: Sequence[Stimulus]) -> dict[str, ThirdAgent]:
    """One third agent per task (the same in all its stories): a name that is neither of the two
    people nor any word of the task's stories; `stays` balanced within blocks of 8 tasks."""
    tasks: dict[str, list[Stimulus]] = {}
    for s in stories:
        tasks.setdefault(s.task_id, []).append(s)
    ids = list(tasks)
    out: dict[str, ThirdAgent] = {}
    for b in range(0, len(ids), THIRD_BLOCK):
        block = ids[b: b + THIRD_BLOCK]
        rng = random.Random(f"{FAMILY}/third/{'|'.join(block)}")
        stays = [k % 2 == 0 for k in range(len(block))]
        rng.shuffle(stays)
        for task_id, stay in zip(block, stays, strict=True):
            words = {w.strip(".,;:!?") for s in tasks[task_id] for w in s.text.split()}
            # nor the bystander, who may be a believer without being named in the text
            words |= {s.meta["bystander"] for s in tasks[task_id] if isinstance(s.meta.get("bystander"), str)}
            names = [row[0] for row in lexicon.NAMES if row[0] not in words]
            if not names:  # pragma: no cover - the lexicon has far more names than a story uses
                raise TomlensError(f"no unused name for a third agent in {task_id}",
                                   "pass third_agent=False")
            pick = random.Random(f"{FAMILY}/third-name/{task_id}").choice(names)
            out[task_id] = ThirdAgent(pick, stay)
    return out


def story_events(story: Stimulus, third: ThirdAgent | None = None) -> list[Event]:
    """The events of a built-in story (unexpected transfer / contents, order-only), with who
    perceived each, for the belief tracker; `third` adds the third agent of `third_agents`."""
    family = story.family
    m = story.meta
    try:
        p, a = m["protagonist"], m["other_agent"]
    except KeyError as e:
        raise TomlensError(f"story {story.id!r} has no meta {e.args[0]!r}",
                           "pass events= to statements_for for stories of other families") from e
    c = [third.name] if third else []
    stays = [third.name] if third and third.stays else []
    cond = story.condition
    ev: list[Event] = []
    if family == "order-only":
        present = {p, a, *c}
        for role in m["order"]:
            if role == "put":
                ev.append(Event("place", m["location_1"], frozenset(present)))
                if third and not third.stays:
                    ev.append(Event("leave", None, frozenset(present), agent=third.name))
                    present.discard(third.name)
            elif role == "leave":
                ev.append(Event("leave", None, frozenset(present), agent=p))
                present.discard(p)
            elif role == "move":
                ev.append(Event("move", m["location_2"], frozenset(present)))
            elif role == "return":
                present.add(p)
                ev.append(Event("enter", None, frozenset(present), agent=p))
            else:
                raise TomlensError(f"order-only story {story.id!r} has an unknown sentence {role!r}",
                                   "extend story_events for it")
        return ev
    # Transfer and contents: a telling (a note, a whisper) reaches the speaker, the hearer and a third
    # agent who stayed ("seeing and hearing everything after"): the hearer is the protagonist when
    # informed, else the story's bystander where the story has one (told in the text).
    hearer = p if cond == "informed" else story_bystander(story)
    if family == "unexpected-transfer":
        if cond not in ("false_belief", "present", "informed", "no_transfer"):
            raise _no_rule(story)
        l1, l2 = m["location_1"], m["location_2"]
        ev.append(Event("place", l1, frozenset({p, a, *c})))
        if third and not third.stays:
            ev.append(Event("leave", None, frozenset({p, a, *c}), agent=third.name))
        # The decoy (the other agent's own thing moved between two other places) changes nobody's
        # belief about the object, and the protagonist's comings and goings around it decide only
        # whether they saw the object's own event: both left out.
        watching = {a, *stays} | ({p} if cond == "present" else set())
        if cond != "present":
            ev.append(Event("leave", None, frozenset({p, a, *stays}), agent=p))
        now = l1 if cond == "no_transfer" else l2
        ev.append(Event("move", now, frozenset(watching)))
        if hearer:
            ev.append(Event("tell", now, frozenset({a, hearer, *stays})))
        return ev
    if family == "unexpected-contents":
        if cond not in ("false_belief", "open_container", "correct_label", "informed"):
            raise _no_rule(story)
        ev.append(Event("place", m["contents"], frozenset({a, *c})))
        if third and not third.stays:
            ev.append(Event("leave", None, frozenset({a, *c}), agent=third.name))
        with_p = frozenset({p, *stays})
        ev.append(Event("enter", None, with_p, agent=p))
        ev.append(Event("look", m["label"], with_p, agent=p))  # reads the label
        if cond == "open_container":
            ev.append(Event("look", None, with_p, agent=p))
        if hearer:
            ev.append(Event("tell", m["contents"], frozenset({a, hearer, *stays})))
        return ev
    raise TomlensError(f"no event rules for stories of family {family!r} ({story.id!r})",
                       f"use a source in {list(SOURCES)} or pass events= to statements_for")


def story_bystander(story: Stimulus) -> str | None:
    """The story's bystander where the story has one: meta names them and they occur in the story
    (a decoy story tells them). Generators set meta "bystander" even without a decoy, when the
    person never appears; statements about them would then get labels the text cannot support."""
    name = story.meta.get("bystander")
    if not isinstance(name, str) or not name:
        return None
    q = story.spans.get("query")
    text = story.text[: q.start] if q is not None else story.text
    return name if story.meta.get("decoy") is True or find_mentions(text, {"b": name}).get("b") else None


def _no_rule(story: Stimulus) -> TomlensError:
    return TomlensError(f"no event rules for {story.family} condition {story.condition!r}",
                        "extend tomlens.stimuli.statements.story_events for it")


def _check_orders(orders: Sequence[int] | int) -> list[int]:
    orders = [orders] if isinstance(orders, int) else list(orders)
    if (not orders or any(not isinstance(o, int) or isinstance(o, bool) or not 0 <= o <= MAX_ORDER
                          for o in orders) or len(set(orders)) != len(orders)):
        raise TomlensError(
            f"orders={orders!r} must be distinct integers from 0 to {MAX_ORDER}",
            "e.g. orders=(1, 2); order 0 is a plain fact, 1 'Anna believes ...', "
            "2 'Ben thinks that Anna believes ...'",
        )
    return orders


def _agents(story: Stimulus, third: ThirdAgent | None) -> list[tuple[str, str]]:
    """(name, role) of the believers a statement may name."""
    out: list[tuple[str, str]] = [(story.span_text(r), r) for r in ("protagonist", "other_agent") if r in story.spans]
    bystander = story_bystander(story)
    if out and bystander and bystander not in dict(out):
        out.append((bystander, "bystander"))
    if third is not None and out:
        out.append((third.name, "third_agent"))
    return out


def _bare(phrase: str) -> str:
    """'the blue box' -> 'blue box', so the statement can say 'the blue box' exactly once."""
    low = phrase.lower()
    for d in _DETERMINERS:
        if low.startswith(d):
            return phrase[len(d):]
    return phrase


def _claim(story: Stimulus, claim: str, place: str) -> str:
    """The embedded proposition, e.g. 'the ring is in the drawer'."""
    role = "container" if claim == "contents" else "object"
    if role not in story.spans:
        raise TomlensError(f"story {story.id!r} has no {role!r} span, which the statement names",
                           f"give the story an {role!r} span")
    if claim == "contents":
        return f"the {_bare(story.span_text(role))} contains {place}"
    return f"the {_bare(story.span_text(role))} is {_preposition(story, place)} the {_bare(place)}"


def _preposition(story: Stimulus, place: str) -> str:
    """'in' unless the story's meta names another one (a string, or a dict place -> word)."""
    given = story.meta.get("preposition")
    if isinstance(given, dict):
        given = given.get(place)
    return given if isinstance(given, str) and given else "in"


def _wrap(claim: str, chain: Sequence[str]) -> str:
    """'Ben thinks that Anna believes <claim>.' for chain ('Ben', 'Anna')."""
    if not chain:
        return claim[0].upper() + claim[1:] + "."
    sentence = f"{chain[-1]} believes {claim}"
    for holder in reversed(chain[:-1]):
        sentence = f"{holder} thinks that {sentence}"
    return sentence + "."


def _third_sentence(story: Stimulus, claim: str, third: ThirdAgent) -> str:
    m = story.meta
    slots = {"C": third.name, "P": m["protagonist"], "A": m["other_agent"]}
    if claim == "transfer":
        slots.update(obj=m["object"], L1=m["location_1"], room=m["room"],
                     prep=_preposition(story, m["location_1"]))
    else:
        slots.update(container=m["container"])
    return THIRD_SENTENCES[claim][third.stays].format(**slots)


@dataclass(frozen=True)
class _Prefix:
    """A story's text up to the statement (story, then the third agent's sentence), with its spans
    and mentions: the same for every statement after that story, so computed once."""

    text: str
    spans: dict[str, Span]
    mentions: dict[str, tuple[Span, ...]]
    words: dict[str, str]


def _prefix(story: Stimulus, claim: str, roles: dict[str, str],
            third: ThirdAgent | None) -> _Prefix:
    q = story.spans.get("query")
    story_text = (story.text[: q.start] if q is not None else story.text).rstrip()
    spans = {k: v for k, v in story.spans.items()
             if v.end <= len(story_text) and k != "query" and not k.startswith("query_")}
    text = story_text
    if third is not None:
        text += " " + _third_sentence(story, claim, third)
        at = text.rindex(third.name, len(story_text))
        spans["third_agent"] = Span(at, at + len(third.name))
    words: dict[str, str] = {r: n for n, r in roles.items()}
    words.update({k: story.meta[k] for k in ("object", "location_1", "location_2", "container")
                  if isinstance(story.meta.get(k), str)})
    # contents stories name their roles differently (as the contents family's mentions do): the
    # object and location_2 are the true contents, location_1 the other word
    for role, key in (("object", "contents"), ("location_2", "contents"), ("location_1", "other_word")):
        if role not in words and isinstance(story.meta.get(key), str):
            words[role] = story.meta[key]
    mentions = {k: tuple(m for m in v if m.end <= len(story_text))
                for k, v in story.mentions.items() if not k.startswith("query")}
    mentions.update(find_mentions(text, words))
    return _Prefix(text, spans, {k: v for k, v in mentions.items() if v}, words)


def _statement(story: Stimulus, prefix: _Prefix, claim: str, chain: tuple[str, ...],
               roles: dict[str, str], place: str, flip: bool, query: str | None, source: str,
               events: Sequence[Event], third: ThirdAgent | None) -> Stimulus:
    spans = dict(prefix.spans)
    statement = _wrap(_claim(story, claim, place), chain)
    question = query if query is not None else STATEMENT_QUERY

    text = prefix.text + "\nStatement: "
    stmt_span = Span(len(text), len(text) + len(statement))
    text += statement + "\n"
    query_span = Span(len(text), len(text) + len(question))
    text += question
    spans["statement"] = stmt_span
    at = statement.rindex(_bare(place))
    spans["statement_place"] = Span(stmt_span.start + at, stmt_span.start + at + len(_bare(place)))
    spans["query"] = query_span

    tracked = beliefs(chain, events)
    literal = tracked[-1] == place
    for_world = place == story.world_state
    for_protagonist = place == story.protagonist_belief
    truth = lambda b: "true" if b else "false"  # noqa: E731
    options = ("false", "true") if flip else ("true", "false")
    mentions = dict(prefix.mentions)
    for role, found in find_mentions(statement, prefix.words).items():
        shifted = tuple(Span(m.start + stmt_span.start, m.end + stmt_span.start) for m in found)
        mentions[role] = mentions.get(role, ()) + shifted
    return Stimulus(
        id=f"{story.id}-o{len(chain)}-{'-'.join(roles[c][0] for c in chain) or 'w'}-{_slug(place)}",
        text=text,
        options=options,
        answer=truth(literal),
        family=FAMILY,
        task_id=story.task_id,
        template_id=story.template_id,
        condition=story.condition,
        reversed=story.reversed,
        prompt_type="belief",
        world_state=truth(for_world),
        protagonist_belief=truth(for_protagonist),
        reference_state=None,
        spans=spans,
        mentions=mentions,
        meta={
            "order": len(chain),
            "chain": list(chain),
            "chain_roles": [roles[c] for c in chain],
            "chain_belief": tracked[-1],
            "statement": statement,
            "statement_place": place,
            "statement_literal_true": literal,
            "statement_true_for_protagonist": for_protagonist,
            "statement_true_for_world": for_world,
            "options_order": "false-first" if flip else "true-first",
            "source": source or story.family,
            "source_id": story.id,
            "source_condition": story.condition,
            "third_agent": third.name if third else None,
            "third_agent_stays": third.stays if third else None,
            "story_world_state": story.world_state,
            "story_protagonist_belief": story.protagonist_belief,
            "story_reference_state": story.reference_state,
        },
    )


def _slug(s: str) -> str:
    return "-".join("".join(c if c.isalnum() else " " for c in s.lower()).split()) or "x"
