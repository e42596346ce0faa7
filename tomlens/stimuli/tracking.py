"""Sentence-by-sentence belief tracking (K24 Studies 1.4 and 2.4, Figs 1-2) as `Stimulus` records.

Every prefix of a false-belief story (from no sentence at all to the whole story) is followed by the
reality prompt and by the belief prompt, so a model's preference between the two answer words can
be read off at each step. For transfer stories the story's last sentence (the protagonist comes
back and wants the object) is placed before the belief prompt at every step, as in K24, because
"will look for it" makes little sense mid-story.

Labels per prefix, for probes at sentence boundaries: `meta["world_state_t"]` and
`meta["belief_t"]` are the object's place / the container's contents and the protagonist's belief
after that prefix, "unknown" before the story establishes them (`world_state` and
`protagonist_belief` hold the same values, None when unknown). They are computed from the same
per-sentence update rules that label the full stories, so the two families cannot disagree.
`answer` is the prefix's label when known, otherwise the full story's answer
(`meta["label_known"]` tells which).
"""

from __future__ import annotations

from collections.abc import Sequence

from tomlens.errors import TomlensError
from tomlens.stimuli.false_belief import (
    CONDITION_CODES,
    CONDITIONS,
    CONTENTS,
    CONTRAST_ROLES,
    EXTRA_CONTRASTS,
    PROMPT_TYPES,
    TRANSFER,
    Story,
    build_story,
    make_tasks,
)
from tomlens.stimuli.records import Span, Stimulus

FAMILY = "belief-tracking"
UNKNOWN = "unknown"


def belief_tracking(
    n: int = 20,
    seed: int = 0,
    family: str = TRANSFER,
    *,
    conditions: Sequence[str] = ("false_belief",),
    include_reversed: bool = True,
) -> list[Stimulus]:
    """Every sentence prefix of `n` stories x (reality, belief) prompts.

    The stories are the tasks of `unexpected_transfer` / `unexpected_contents` with the same
    `seed` (same task ids), in the false-belief condition by default (any of the family's
    conditions can be asked for) and, with `include_reversed`, in their reversed version too.
    """
    if family not in CONDITIONS:
        raise TomlensError(
            f"belief tracking has no story family {family!r}", f"use one of {list(CONDITIONS)}"
        )
    if isinstance(conditions, str):
        conditions = (conditions,)
    bad = [c for c in conditions if c not in CONDITIONS[family]]
    if bad or not conditions:
        raise TomlensError(
            f"conditions={list(conditions)!r} is not a non-empty subset of {family}'s conditions",
            f"choose from {list(CONDITIONS[family])}",
        )
    out: list[Stimulus] = []
    for task in make_tasks(family, n, seed):
        for condition in conditions:
            for rev in (False, True) if include_reversed else (False,):
                story = build_story(task, condition, rev)
                for k in range(len(story.sentences) + 1):
                    for prompt_type in PROMPT_TYPES:
                        out.append(prefix_stimulus(story, k, prompt_type))
    return out


def prefix_stimulus(story: Story, k: int, prompt_type: str) -> Stimulus:
    """The record for the first `k` sentences of `story` followed by one prompt."""
    task = story.task
    n_sent = len(story.sentences)
    last = n_sent - 1
    lead_in = (last,) if (story.family == TRANSFER and prompt_type == "belief" and k < n_sent) else ()
    r = story.render(range(k), prompt_type, lead_in=lead_in)
    world_t, belief_t = story.labels(k)
    world_final, belief_final = story.final_labels()
    label = world_t if prompt_type == "reality" else belief_t
    final = world_final if prompt_type == "reality" else belief_final

    spans = dict(r.spans)
    included = {story.sentences[i].role: r.sentences[i] for i in range(k)}
    # The contrast span covers the contrast sentences the prefix already holds (none: no span).
    present = [included[role] for role in CONTRAST_ROLES[story.family][story.condition]
               if role in included]
    if present:
        spans["contrast"] = Span.covering(present)
    for name, role in EXTRA_CONTRASTS[story.family].items():
        if role in included:
            spans[name] = included[role]
    if lead_in:
        lead_start = r.sentences[-1].end + 1 if k else 0
        spans["lead_in"] = Span(lead_start, r.query.start - 1)
    spans["query"] = r.query

    code = CONDITION_CODES[story.condition]
    version = "-rev" if story.reversed else ""
    return Stimulus(
        id=f"bt-{task.task_id}-{code}{version}-p{k:02d}-{prompt_type}",
        text=r.text,
        options=task.options,
        answer=label if label is not None else final,
        family=FAMILY,
        task_id=task.task_id,
        template_id=task.template_id,
        condition=story.condition,
        reversed=story.reversed,
        prompt_type=prompt_type,
        world_state=world_t,
        protagonist_belief=belief_t,
        reference_state=story.reference,
        spans=spans,
        meta={
            "story_family": story.family,
            "prefix_index": k,
            "n_sentences": n_sent,
            "sentence_role": story.sentences[k - 1].role if k else None,
            "world_state_t": world_t if world_t is not None else UNKNOWN,
            "belief_t": belief_t if belief_t is not None else UNKNOWN,
            "world_state_final": world_final,
            "belief_final": belief_final,
            "label_known": label is not None,
            "lead_in": bool(lead_in),
            "protagonist": task.protagonist[0],
            "other_agent": task.agent[0],
            "seed": task.seed,
            "task_index": task.index,
            **({"object": task.extra["obj"]} if story.family == TRANSFER
               else {"container": task.extra["C"]}),
        },
    )


__all__ = ["FAMILY", "UNKNOWN", "belief_tracking", "prefix_stimulus", "CONTENTS", "TRANSFER"]


# The audit leaves out the generic false vs true belief contrast here, with why (`tomlens audit`).
UNAUDITED: dict[str, str] = {
    "false vs true belief": "the rows are the prefixes of one story: whether the move has been told yet "
                            "decides the label, and the words show it; the family draws the curve over "
                            "prefixes (Kosinski's Figures 1-2), not a contrast between stories",
}
