"""The recursive belief tracker on hand-worked stories (Sally-Anne and variations)."""

from __future__ import annotations

import pytest

from tomlens.errors import TomlensError
from tomlens.stimuli.belief_state import Event, belief, beliefs, chains

S, A, C = "Sally", "Anne", "Carl"


def _ev(kind, location, perceivers, agent=None):
    return Event(kind, location, frozenset(perceivers), agent=agent)


def _sally_anne(sally_sees_move: bool, carl: set[str] = frozenset()) -> list[Event]:
    """Sally puts the marble in the basket with Anne there; Anne moves it to the box, with Sally
    watching or away. `carl` is the set of events ("put", "move") Carl was there for."""
    ev = [_ev("place", "basket", {S, A} | ({C} if "put" in carl else set()))]
    if not sally_sees_move:
        ev.append(_ev("leave", None, {S, A}, agent=S))
    ev.append(_ev("move", "box", {A} | ({S} if sally_sees_move else set())
                  | ({C} if "move" in carl else set())))
    return ev


def test_false_belief_orders_one_to_four():
    ev = _sally_anne(sally_sees_move=False)
    assert belief((), ev) == "box"  # the world
    assert belief((S,), ev) == "basket" and belief((A,), ev) == "box"
    # Anne knows Sally missed the move; Sally does not know there was one.
    assert belief((A, S), ev) == "basket" and belief((S, A), ev) == "basket"
    assert belief((A, S, A), ev) == "basket"  # Anne: Sally thinks Anne still thinks basket
    assert belief((S, A, S, A), ev) == "basket"
    assert beliefs((A, S, A), ev) == ["box", "box", "basket", "basket"]


def test_true_belief_orders_one_to_four():
    ev = _sally_anne(sally_sees_move=True)
    for chain in [(S,), (A,), (S, A), (A, S), (A, S, A), (S, A, S, A)]:
        assert belief(chain, ev) == "box", chain


def test_third_agent_absent_throughout_believes_nothing():
    ev = _sally_anne(sally_sees_move=False)
    for chain in [(C,), (S, C), (C, S), (A, C, A), (C, S, A, S)]:
        assert belief(chain, ev) is None, chain
    assert belief((S, A), ev) == "basket"  # the others are unaffected


def test_third_agent_who_saw_the_move_but_not_the_telling():
    # Carl sees the marble put away and moved; then Anne tells Sally, without Carl, where it is.
    ev = _sally_anne(sally_sees_move=False, carl={"put", "move"})
    ev.append(_ev("tell", "box", {A, S}))
    assert belief((S,), ev) == "box" and belief((A, S), ev) == "box"
    assert belief((S, A), ev) == "box"  # Sally heard Anne say it, so Sally knows Anne believes it
    assert belief((C,), ev) == "box"
    assert belief((C, S), ev) == "basket"  # Carl does not know Sally was told
    assert belief((S, C), ev) == "basket"  # Sally does not know Carl saw the move
    assert belief((C, A, S, A), ev) == "basket"  # order 4: along C-A-S only the put was shared
    assert beliefs((C, A, S, A), ev) == ["box", "box", "box", "basket", "basket"]


def test_bystanders_hear_a_telling_and_looks_reveal_only_to_the_looker():
    ev = [_ev("place", "jar", {A, C}),
          _ev("move", "tin", {A}),  # Carl misses this one
          _ev("enter", None, {S, C}, agent=S),
          _ev("look", "cookies", {S, C}, agent=S),  # Sally reads a label, Carl watches
          _ev("look", None, {S, C}, agent=S)]  # Sally looks inside, Carl watches
    assert belief((), ev) == "tin" and belief((S,), ev) == "tin"
    assert belief((C,), ev) == "jar"  # watching someone look teaches the watcher nothing
    assert belief((C, S), ev) == "jar"  # Carl thinks Sally saw what Carl thinks is there
    assert beliefs((C, S), ev[:4]) == ["tin", "jar", "cookies"]  # after the label only
    told = [*ev, _ev("tell", "tin", {A, S, C})]
    assert belief((C,), told) == "tin" and belief((S, C), told) == "tin"


def test_chains_and_bad_input():
    assert chains((S, A, C), 0) == [()]
    assert [len(chains((S, A, C), k)) for k in (1, 2, 3, 4)] == [3, 6, 12, 24]
    assert all(c[i] != c[i + 1] for c in chains((S, A, C), 4) for i in range(3))
    assert len(set(chains((S, A, C), 3))) == 12
    with pytest.raises(TomlensError, match="needs a location"):
        _ev("move", None, {A})
    with pytest.raises(TomlensError, match="needs its agent"):
        _ev("look", None, {A})
    with pytest.raises(TomlensError, match="not among the perceivers"):
        _ev("look", None, {A}, agent=S)
    with pytest.raises(TomlensError, match="unknown event kind"):
        _ev("sneeze", None, {A})
    with pytest.raises(TomlensError, match="agent names"):
        belief(("",), [])
