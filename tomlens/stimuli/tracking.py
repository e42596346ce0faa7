"""Sentence-by-sentence belief tracking (K24 Studies 1.4 and 2.4, Figs 1-2) as `Stimulus` records.

Every prefix of a false-belief story (from no sentence at all to the whole story) is followed by the
reality prompt and by the belief prompt, so a model's preference between the two answer words can
be read off at each step. For transfer stories the story's last sentence (the protagonist comes
back and wants the object) is placed before the belief prompt at every step, as in K24, because
"will look for it" makes little sense mid-story.

Three choices beyond K24 keep the order in which a transfer story names its two places from
giving the answer away (issue #27). The full story names them last in an order balanced across
tasks (its closing sentence, "The box and the basket are both closed.", by `Task.last_ref`), and as
often each; its earlier sentences name them in an order fixed by the plot ("The <other> is empty",
"puts it in the <start>", "instead of the <start>, in the <other>"). So a prefix cut before the
closing named the start place (the belief answer) last at the put and before the move, and the
other place after it: "the last-mentioned option" (or its opposite) read the keyed answer at about
0.63, and "the most-mentioned one" read it on every prefix that stops at "The <other> is empty".
- The belief prompt's lead-in also carries the closing sentence where the prefix has not reached it
  (`lead_in_sentences`): the last place named before every belief prompt is the closing's, so the
  keyed option is the last-mentioned one in half the stories at every prefix. The closing states no
  place of the object and nothing anyone saw, so no label moves.
- The put comes before "The <other> is empty" in one version of each task (`put_first`): the one
  prefix where one place has been named more often than the other then names the start place more
  often in half the stories, the other place in the others. Only the put updates a label.
- The reversed version names the places in the listing and the closing in the other order than the
  original (`tracked_task`), so each task keys the first- and the last-mentioned option in one
  version each. Balanced across tasks alone, a cue that is the same in all of a task's prompts
  reads *below* chance on held-out tasks (the held-out fold holds the majority the training folds
  lack): "last-mentioned" at about 0.41, under chance's interval on one fresh seed in ten.
A contents story's label sentence was its last naming of the two words before the tellings, and
every phrasing named the other word last ("says pins, not sweets"): "the last-mentioned option" read
the answer off every prefix between the label and the tellings (0.79-0.82). Half the phrasings now
name the label's word last ("says not sweets but pins"), and the reversed version words the label
in the other order (`tracked_task`), so each task keys the last-named word in one version.
The original version of a transfer task is therefore the `unexpected_transfer` story of its task
(put and empty sentence swapped in half the tasks), the reversed one that of its task with the
listing and closing orders flipped (swapped in the others).

Labels per prefix, for probes at sentence boundaries: `meta["world_state_t"]` and
`meta["belief_t"]` are the object's place / the container's contents and the protagonist's belief
after that prefix, "unknown" before the story establishes them (`world_state` and
`protagonist_belief` hold the same values, None when unknown). They are computed from the same
per-sentence update rules that label the full stories, so the two families cannot disagree.
`answer` is the prefix's label when known, otherwise the full story's answer
(`meta["label_known"]` tells which).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import replace

from tomlens.errors import TomlensError
from tomlens.stimuli.false_belief import (
    BLOCK,
    CONDITION_CODES,
    CONDITIONS,
    CONTENTS,
    CONTRAST_ROLES,
    EXTRA_CONTRASTS,
    PROMPT_TYPES,
    TRANSFER,
    Story,
    Task,
    balanced_flags,
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
    conditions can be asked for) and, with `include_reversed`, in their reversed version too
    (`tracked_story`: a transfer story's place-naming orders vary between versions and tasks).
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
                story = tracked_story(task, condition, rev)
                for k in range(len(story.sentences) + 1):
                    for prompt_type in PROMPT_TYPES:
                        out.append(prefix_stimulus(story, k, prompt_type))
    return out


def put_first(task: Task, reversed: bool) -> bool:
    """Whether this version of a transfer task tells the put before "The <other> is empty": the
    original version in half the tasks of every block of 8 (its own random stream, so no other
    flag of the seed moves), the reversed version in the others, so each task tells both orders
    and neither goes with the keyed option's position."""
    rng = random.Random(f"{FAMILY}/put-first/{task.seed}/{task.index // BLOCK}")
    return balanced_flags(rng, BLOCK)[task.index % BLOCK] != reversed


def tracked_task(task: Task, reversed: bool) -> Task:
    """The task a version is told from: a transfer task's reversed version names the two places in
    the listing and in the closing in the other order (`Task.first_ref` / `last_ref` flipped); a
    contents task's reversed version words its label in the other order (`Task.label_last`), so the
    label's word, the belief answer, is named last in one version of each task."""
    if not reversed:
        return task
    if task.family == CONTENTS:
        return replace(task, label_order_flipped=not task.label_order_flipped)
    return replace(task, first_ref=not task.first_ref, last_ref=not task.last_ref)


def tracked_story(task: Task, condition: str, reversed: bool) -> Story:
    """The story whose prefixes are told: `build_story`'s of `tracked_task`, with a transfer
    story's put sentence before its empty sentence where `put_first` says so (the module docstring
    says why)."""
    story = build_story(tracked_task(task, reversed), condition, reversed)
    if story.family != TRANSFER or not put_first(task, reversed):
        return story
    order = list(story.sentences)
    empty, put = story.index("empty"), story.index("put")
    order[empty], order[put] = order[put], order[empty]
    return replace(story, sentences=tuple(order))


def lead_in_sentences(story: Story, k: int, prompt_type: str) -> tuple[int, ...]:
    """The sentences told between the first `k` sentences of `story` and its `prompt_type` prompt.

    A transfer story's belief prompt gets its last sentence (K24: the protagonist comes back and
    wants the object) and, where the prefix stops before it, its closing sentence, which names both
    places in the task's balanced order (see the module docstring: without it the last place named
    before the prompt follows the plot, and so the answer). Reality prompts, contents stories and
    the whole story get none."""
    if story.family != TRANSFER or prompt_type != "belief" or k >= len(story.sentences):
        return ()
    return tuple(i for i in (story.index("closing"), len(story.sentences) - 1) if i >= k)


def prefix_stimulus(story: Story, k: int, prompt_type: str) -> Stimulus:
    """The record for the first `k` sentences of `story` followed by one prompt."""
    task = story.task
    n_sent = len(story.sentences)
    lead_in = lead_in_sentences(story, k, prompt_type)
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


__all__ = ["FAMILY", "UNKNOWN", "belief_tracking", "lead_in_sentences", "prefix_stimulus", "put_first",
           "tracked_story", "tracked_task", "CONTENTS", "TRANSFER"]


# The audit leaves out the generic false vs true belief contrast here, with why (`tomlens audit`).
UNAUDITED: dict[str, str] = {
    "false vs true belief": "the rows are the prefixes of one story: whether the move has been told yet "
                            "decides the label, and the words show it; the family draws the curve over "
                            "prefixes (Kosinski's Figures 1-2), not a contrast between stories",
}
