"""The organism's stories and its held-out split.

Training and test stories come from the project's own generators (order-only, the false-belief
factorial, unexpected contents), belief and reality prompts, every condition. A task is held out
by two keys, each hashed into a held-out share: its *template* (the combination of the generator's
template, phrasings and cue phrasings: every phrasing and template is seen in training, never in
this combination) and its *cast* (people, object, places or container, contents, label).
Training tasks have neither key held out; test tasks have both, so no test story's combination
of template and phrasings, nor its combination of names, objects and places, was seen in training. A test task with a
word that training never had is dropped (and counted), so every test word was seen.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tomlens.organism.vocab import words
from tomlens.stimuli import generate
from tomlens.stimuli.records import Stimulus

FAMILIES: tuple[str, ...] = ("order-only", "false-belief-factorial", "unexpected-contents")
_CAST_FIELDS = ("protagonist", "other_agent", "bystander", "object", "location_1", "location_2",
                "container", "contents", "label")


def template_key(task: Sequence[Stimulus]) -> str:
    """The task's template, phrasings and cue phrasings (the same for all its prompts)."""
    first = task[0]
    cues = sorted({str(s.meta.get("cue_id")) for s in task} | {str(s.meta.get("decoy_cue_id")) for s in task})
    phrasing = first.meta.get("phrasing") or {}
    return "|".join([first.family, first.template_id or "", *(f"{k}={v}" for k, v in sorted(phrasing.items())), *cues])


def cast_key(task: Sequence[Stimulus]) -> str:
    """The task's people, object and places (or container, contents and label)."""
    meta = task[0].meta
    return "|".join(f"{k}={meta.get(k)}" for k in _CAST_FIELDS)


def held_out(key: str, share: float, salt: str) -> bool:
    """Whether `key` falls in the held-out share (a hash, so the split needs no list)."""
    digest = hashlib.sha256(f"{salt}:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < share


def by_task(stimuli: Sequence[Stimulus]) -> list[list[Stimulus]]:
    tasks: dict[str, list[Stimulus]] = defaultdict(list)
    for s in stimuli:
        tasks[s.task_id].append(s)
    return list(tasks.values())


@dataclass(frozen=True)
class Split:
    """Training and test prompts, and what the split dropped."""

    train: list[Stimulus]
    test: list[Stimulus]
    dropped_unseen_words: int  # test tasks with a word training never had
    words: list[str]  # every word of the training prompts and options, sorted: the vocabulary

    def summary(self) -> dict[str, Any]:
        def counts(rows: Sequence[Stimulus]) -> dict[str, int]:
            out: dict[str, int] = defaultdict(int)
            for s in rows:
                out[f"{s.family}/{s.condition}/{s.prompt_type}"] += 1
            return dict(sorted(out.items()))

        return {"train_prompts": len(self.train), "test_prompts": len(self.test),
                "train_tasks": len({s.task_id for s in self.train}), "test_tasks": len({s.task_id for s in self.test}),
                "test_tasks_dropped_for_unseen_words": self.dropped_unseen_words,
                "train_counts": counts(self.train), "test_counts": counts(self.test)}


def story_words(s: Stimulus) -> list[str]:
    """The words of a prompt and of its options."""
    return [*words(s.text), *(w for o in s.options for w in words(o))]


def training_stories(counts: dict[str, int], *, share: float = 0.3, seed: int = 0,
                     options: dict[str, dict[str, Any]] | None = None) -> list[Stimulus]:
    """Of `counts[family]` generated tasks per family, those with neither key held out."""
    salt = f"tom-organism:{seed}"
    out: list[Stimulus] = []
    for i, family in enumerate(FAMILIES):
        for task in by_task(generate(family, n=counts[family], seed=1000 + 10 * seed + i, **(options or {}).get(family, {}))):
            if not held_out(template_key(task), share, salt + ":t") and not held_out(cast_key(task), share, salt + ":c"):
                out.extend(task)
    return out


def held_out_stories(counts: dict[str, int], known_words: set[str], *, share: float = 0.3, seed: int = 0,
                 options: dict[str, dict[str, Any]] | None = None,
                 generator_seed: int = 5000) -> tuple[list[Stimulus], int]:
    """Of `counts[family]` tasks generated from other seeds (from `generator_seed`), those with both
    keys held out and every word in `known_words`; and how many held-out tasks were dropped for an
    unknown word."""
    salt = f"tom-organism:{seed}"
    out: list[Stimulus] = []
    dropped = 0
    for i, family in enumerate(FAMILIES):
        for task in by_task(generate(family, n=counts[family], seed=generator_seed + 10 * seed + i, **(options or {}).get(family, {}))):
            if held_out(template_key(task), share, salt + ":t") and held_out(cast_key(task), share, salt + ":c"):
                if all(w in known_words for s in task for w in story_words(s)):
                    out.extend(task)
                else:
                    dropped += 1
    return out, dropped


def make_split(train_tasks: dict[str, int], test_tasks: dict[str, int], *, share: float = 0.3,
               seed: int = 0, options: dict[str, dict[str, Any]] | None = None) -> Split:
    """Training stories (no held-out key) and test stories (both keys held out, every word seen)."""
    train = training_stories(train_tasks, share=share, seed=seed, options=options)
    seen = {w for s in train for w in story_words(s)}
    test, dropped = held_out_stories(test_tasks, seen, share=share, seed=seed, options=options)
    return Split(train, test, dropped, sorted(seen))
