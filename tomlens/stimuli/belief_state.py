"""A recursive belief tracker: who believes (that who believes ...) the object is where.

Why: a statement such as "Ben thinks that Anna believes the ring is in the drawer" is literally
true iff Ben's model of Anna's belief says "drawer", which is not Anna's belief and not the world
in general. Labelling it from the innermost clause alone (Anna's belief) is wrong whenever Ben
missed something Anna saw, or the other way round.

A story is a sequence of `Event`s, each with the set of agents who perceive it. The rule is the
usual one for nested beliefs with co-presence (as in ToMi-style trackers): what A_1 believes that
A_2 believes ... that A_n believes is computed from the events that every agent of the chain
perceived, in order. An event perceived by all of A_1..A_k updates the chain's first k levels;
an event missed by A_j leaves level j and every deeper level unchanged. Agents who perceive an
event together are taken to know that they all perceived it. Level 0 is the world.

Kinds of event:
* "place" / "move": the object is now at `location`; every perceiver learns it (world too).
* "tell": the speaker says the object is at `location`; every perceiver (speaker, hearer,
  bystanders within earshot) comes to believe it. Tellers are sincere and trusted.
* "look": `agent` looks where the object is (or reads a label: then `location` is what the label
  says); perceivers who are not the looker learn only that the looker now knows. Without a
  `location` the looker learns what the level above believes (the world for "A believes").
* "enter" / "leave": presence only; no belief changes (perceivers of later events say who saw).

A chain whose agents never perceived an event together has no belief (None): then every
statement "... believes the object is in X" is literally false.

>>> ev = [Event("place", "basket", frozenset({"Sally", "Anne"})),
...       Event("leave", None, frozenset({"Sally", "Anne"}), agent="Sally"),
...       Event("move", "box", frozenset({"Anne"}))]
>>> belief((), ev), belief(("Sally",), ev), belief(("Anne",), ev), belief(("Anne", "Sally"), ev)
('box', 'basket', 'box', 'basket')
>>> belief(("Sally", "Anne"), ev)  # Sally does not know Anne moved it
'basket'
>>> belief(("Carl",), ev) is None  # absent throughout
True
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from tomlens.errors import TomlensError

EventKind = Literal["place", "move", "tell", "look", "enter", "leave"]
EVENT_KINDS: tuple[str, ...] = ("place", "move", "tell", "look", "enter", "leave")
Chain = tuple[str, ...]


@dataclass(frozen=True)
class Event:
    """One thing that happens in a story, and who perceives it.

    `location`: where the object is put / said to be / what a read label says (None for a look at
    the object itself, and for enter / leave). `agent`: the looker for "look", the one who enters
    or leaves for "enter" / "leave" (optional otherwise)."""

    kind: EventKind
    location: str | None
    perceivers: frozenset[str]
    agent: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in EVENT_KINDS:
            raise TomlensError(f"unknown event kind {self.kind!r}", f"use one of {EVENT_KINDS}")
        if self.kind in ("place", "move", "tell") and not self.location:
            raise TomlensError(f"a {self.kind!r} event needs a location", "pass location=...")
        if self.kind in ("look", "enter", "leave") and not self.agent:
            raise TomlensError(f"a {self.kind!r} event needs its agent", "pass agent=...")
        if self.kind == "look" and self.agent not in self.perceivers:
            raise TomlensError(f"{self.agent!r} looks but is not among the perceivers",
                               "add the looker to `perceivers`")


def belief(chain: Sequence[str], events: Sequence[Event]) -> str | None:
    """Where `chain` believes the object is after `events`.

    `chain` = () is the world, ("A",) "A believes", ("B", "A") "B thinks that A believes", and so
    on to any depth. None: the chain never perceived anything about the object together.
    """
    return beliefs(chain, events)[-1]


def beliefs(chain: Sequence[str], events: Sequence[Event]) -> list[str | None]:
    """The beliefs of every prefix of `chain` after `events`: [world, chain[:1], ..., chain]."""
    chain = tuple(chain)
    if any(not isinstance(a, str) or not a for a in chain):
        raise TomlensError(f"chain {chain!r} must be agent names", "e.g. ('Ben', 'Anna')")
    values: list[str | None] = [None] * (len(chain) + 1)
    for event in events:
        if event.kind in ("enter", "leave"):
            continue
        if event.kind in ("place", "move"):
            values[0] = event.location
        for k in range(1, len(chain) + 1):
            if chain[k - 1] not in event.perceivers:
                break  # this level missed it, and so every deeper level keeps its old value
            if event.kind == "look":
                if chain[k - 1] == event.agent:
                    values[k] = event.location if event.location is not None else values[k - 1]
            else:
                values[k] = event.location
    return values


def chains(agents: Sequence[str], order: int) -> list[Chain]:
    """Every chain of `order` agents with no agent directly nested in itself ("Ben thinks that Ben
    believes" says nothing new), in a fixed order.

    >>> chains(("Anna", "Ben"), 2)
    [('Anna', 'Ben'), ('Ben', 'Anna')]
    """
    if order < 0:
        raise TomlensError(f"order={order} is negative", "use 0 (the world) or more")
    out: list[Chain] = [()]
    for _ in range(order):
        out = [c + (a,) for c in out for a in agents if not c or c[-1] != a]
    return out
