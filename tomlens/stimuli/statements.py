"""Belief statements after a story, for probing in the style of Zhu et al. (2024).

A false- or true-belief story (the story part of an unexpected-transfer or unexpected-contents
belief prompt) is followed by one statement about where the object is (or what the container
holds), wrapped in `order` mental-state verbs:

    order 0: "The ring is in the drawer."                           (a plain fact)
    order 1: "Anna believes the ring is in the drawer."
    order 2: "Ben thinks that Anna believes the ring is in the drawer."

The innermost believer is always the protagonist. Each statement is labelled from two points of
view, on its embedded claim ("the ring is in the drawer"), as Zhu et al. label the protagonist's
and the oracle's belief:

* `statement_true_for_protagonist`: the claim agrees with what the protagonist believes;
* `statement_true_for_world`: the claim agrees with the world (the oracle's view).

In a false-belief story the two disagree for every statement; in true-belief stories they agree.
`answer` is the world's view. So that the question asked matches that answer, the default query
for order >= 1 asks about the belief ("Is this belief true or false?"): the literal truth of "Anna
believes the ring is in the drawer" would be the protagonist's view instead. Pass `query=` to ask
"Is this statement true or false? Answer:" (S26's wording) or anything else.

For each story and order there is one statement naming each of the two places, so exactly half the
statements are true for the world; the option order ("true"/"false" vs "false"/"true") is
counterbalanced. `world_state` / `protagonist_belief` hold the two labels as "true"/"false" (so
`belief_differs` marks the statements where the views disagree); the story's own labels move to
`meta`.
"""

from __future__ import annotations

import importlib
from typing import Literal, Sequence

from tomlens.errors import TomlensError
from tomlens.stimuli.records import Span, Stimulus

SOURCES: dict[str, tuple[str, str]] = {
    "unexpected-transfer": ("tomlens.stimuli.false_belief", "unexpected_transfer"),
    "unexpected-contents": ("tomlens.stimuli.false_belief", "unexpected_contents"),
}
FAMILY = "belief-statements"
MAX_ORDER = 4
STATEMENT_QUERY = "Is this statement true or false? Answer:"
BELIEF_QUERY = "Is this belief true or false? Answer:"
_DETERMINERS = ("the ", "a ", "an ", "his ", "her ", "their ", "its ", "my ", "your ", "our ")


def belief_statements(
    n: int = 20,
    seed: int = 0,
    source: str = "unexpected-transfer",
    orders: Sequence[int] | int = (1, 2),
    *,
    conditions: Sequence[str] | None = None,
    query: str | None = None,
) -> list[Stimulus]:
    """Statements of the given `orders` after the stories of `n` tasks of `source`.

    Stories are the source generator's belief prompts (`n`, `seed` and `conditions` are passed
    to it; by default all its conditions, original and reversed versions).
    Returns, per story and order, two statements (one per place), in story order.
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
    claim = "contents" if source == "unexpected-contents" else "transfer"
    return statements_for(stories, orders, claim=claim, query=query, source=source)


def statements_for(
    stories: Sequence[Stimulus],
    orders: Sequence[int] | int = (1, 2),
    *,
    claim: Literal["transfer", "contents"] = "transfer",
    query: str | None = None,
    source: str = "",
) -> list[Stimulus]:
    """Statements after any belief prompts whose two options are the two possible states.

    `claim="transfer"` says "the <object span> is in the <option>", `claim="contents"` says "the
    <container span> contains <option>". The story is the text before the `query` span.
    """
    orders = _check_orders(orders)
    if claim not in ("transfer", "contents"):
        raise TomlensError(f"claim={claim!r}", "use 'transfer' or 'contents'")
    out: list[Stimulus] = []
    for r, story in enumerate(stories):
        for order in orders:
            if order >= 1 and "protagonist" not in story.spans:
                raise TomlensError(f"story {story.id!r} has no `protagonist` span, needed for "
                                   f"order {order}", "use order 0 for these stories")
            if order >= 2 and "other_agent" not in story.spans:
                raise TomlensError(
                    f"story {story.id!r} has no `other_agent` span, needed for order {order}",
                    "use orders 0 and 1 for these stories",
                )
            for li, place in enumerate(story.options):
                flip = bool((r + order + li) % 2)
                out.append(_statement(story, claim, order, place, flip, query, source))
    return out


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


def _wrap(claim: str, order: int, protagonist: str, other: str | None) -> str:
    if order == 0:
        return claim[0].upper() + claim[1:] + "."
    sentence = f"{protagonist} believes {claim}"
    holders = [other if k % 2 == 1 else protagonist for k in range(1, order)]
    for h in holders:
        sentence = f"{h} thinks that {sentence}"
    return sentence + "."


def _statement(story: Stimulus, claim: str, order: int, place: str, flip: bool,
               query: str | None, source: str) -> Stimulus:
    q = story.spans.get("query")
    story_text = (story.text[: q.start] if q is not None else story.text).rstrip()
    protagonist = story.span_text("protagonist") if "protagonist" in story.spans else None
    other = story.span_text("other_agent") if "other_agent" in story.spans else None
    statement = _wrap(_claim(story, claim, place), order, protagonist or "", other)
    question = query if query is not None else (STATEMENT_QUERY if order == 0 else BELIEF_QUERY)

    text = story_text + "\nStatement: "
    stmt_span = Span(len(text), len(text) + len(statement))
    text += statement + "\n"
    query_span = Span(len(text), len(text) + len(question))
    text += question

    for_world = place == story.world_state
    for_protagonist = place == story.protagonist_belief
    truth = lambda b: "true" if b else "false"  # noqa: E731
    options = ("false", "true") if flip else ("true", "false")
    spans = {k: v for k, v in story.spans.items() if v.end <= len(story_text) and k != "query"}
    spans["statement"] = stmt_span
    spans["query"] = query_span
    return Stimulus(
        id=f"{story.id}-o{order}-{_slug(place)}",
        text=text,
        options=options,
        answer=truth(for_world),
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
        meta={
            "order": order,
            "statement": statement,
            "statement_place": place,
            "statement_true_for_protagonist": for_protagonist,
            "statement_true_for_world": for_world,
            "options_order": "false-first" if flip else "true-first",
            "source": source or story.family,
            "source_id": story.id,
            "story_world_state": story.world_state,
            "story_protagonist_belief": story.protagonist_belief,
            "story_reference_state": story.reference_state,
        },
    )


def _slug(s: str) -> str:
    return "-".join("".join(c if c.isalnum() else " " for c in s.lower()).split()) or "x"
