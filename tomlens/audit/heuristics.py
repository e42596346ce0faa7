"""The generic shortcut battery: what a reader who tracks nobody's mind could use, on any set.

Each heuristic turns stimuli into features and nothing else; which feature value goes with which
class is learned on training tasks by `tomlens.audit.evaluate`, so a heuristic never encodes a
guess about the answer. Two kinds:

- `CueHeuristic`: one categorical value per stimulus (None = the cue is absent), e.g. which option
  the story mentions last, or whether the last presence/absence cue says the protagonist is there.
  Family rules (`tomlens.stimuli.shortcuts.Rule`) are wrapped as these.
- `BagHeuristic`: a vector per stimulus (n-gram counts, lengths), classified by a logistic
  regression fitted on the training tasks. The n-gram vocabulary is read from all audited rows at
  once, which uses no label: an n-gram that no training row holds gets weight zero under the L2
  penalty, so the held-out predictions are those of a vocabulary read from the training rows alone,
  at a fifth of the cost.

"Story" is the text before the question (the `query` span's start, else the last sentence); "prompt"
is the whole text. A bag of n-grams on the prompt sees the question's wording too, which is where
some generators let the condition show.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from sklearn.feature_extraction.text import CountVectorizer

from tomlens.stimuli.records import Stimulus
from tomlens.stimuli.shortcuts import Rule

_WORD = r"(?u)\b[\w']+\b"
_SENTENCE_END = re.compile(r"[.!?][\"')\]]*\s+")


@dataclass(frozen=True)
class CueHeuristic:
    """A categorical cue per stimulus; `family_rule` marks rules a family registered."""

    name: str
    description: str
    feature: Callable[[Stimulus], Hashable | None]
    family_rule: bool = False

    def values(self, stimuli: Sequence[Stimulus]) -> list[Hashable | None]:
        """The cue of each stimulus; a rule that cannot read a row (a user file without the meta
        field it needs) gives None there, so one odd row does not sink the audit."""
        out: list[Hashable | None] = []
        for s in stimuli:
            try:
                out.append(self.feature(s))
            except (KeyError, AttributeError, IndexError, TypeError, ValueError):
                out.append(None)
        return out


@dataclass(frozen=True)
class BagHeuristic:
    """A feature matrix for the audited rows (no label is read): rows x features."""

    name: str
    description: str
    encode: Callable[[Sequence[Stimulus]], Any]  # a numpy array or a scipy sparse matrix
    is_ngram_bag: bool = False


Heuristic = CueHeuristic | BagHeuristic


def story_of(s: Stimulus) -> str:
    """The text before the question: up to the `query` span; else up to the sentence that holds the
    last question mark; else up to the last sentence (a prompt that ends in a cloze)."""
    if "query" in s.spans:
        return s.text[: s.spans["query"].start]
    text = s.text.rstrip()
    question = text.rfind("?")
    limit = question if question >= 0 else len(text)
    ends = [m.end() for m in _SENTENCE_END.finditer(text) if m.end() <= limit]
    return text[: ends[-1]] if ends else text


def _ngram_encoder(n: int, part: Callable[[Stimulus], str]) -> Callable[[Sequence[Stimulus]], Any]:
    def encode(rows: Sequence[Stimulus]) -> Any:
        vec = CountVectorizer(ngram_range=(1, n), binary=True, lowercase=True, token_pattern=_WORD)
        try:
            return vec.fit_transform([part(s) for s in rows])
        except ValueError:  # no words at all
            return np.zeros((len(rows), 1), dtype=np.float32)

    return encode


def length_features(rows: Sequence[Stimulus]) -> np.ndarray:
    """Words and characters of each prompt, standardised over the rows (a scale, not a label)."""
    raw = np.array([[len(re.findall(_WORD, s.text)), len(s.text)] for s in rows], dtype=np.float64)
    std = raw.std(0)
    std[std == 0] = 1.0
    return (raw - raw.mean(0)) / std


def _mention_order(s: Stimulus) -> list[int]:
    """Option indices in the order the story mentions them (every mention)."""
    story = story_of(s).lower()
    hits: list[tuple[int, int]] = []
    for i, option in enumerate(s.options):
        words = option.lower().strip().rstrip(".")
        words = re.sub(r"^(the|a|an|in the|on the|at the|in|on|at)\s+", "", words)
        if words:
            hits += [(m.start(), i) for m in re.finditer(r"(?<!\w)" + re.escape(words) + r"(?!\w)", story)]
    return [i for _, i in sorted(hits)]


def first_mentioned(s: Stimulus) -> int | None:
    order = _mention_order(s)
    return order[0] if order else None


def last_mentioned(s: Stimulus) -> int | None:
    order = _mention_order(s)
    return order[-1] if order else None


def most_mentioned(s: Stimulus) -> int | None:
    counts = Counter(_mention_order(s))
    if not counts or len(set(counts.values())) == 1 and len(counts) > 1:
        return None  # a tie says nothing
    return counts.most_common(1)[0][0]


# Words that say an agent is, or is not, there to see: a reader who never asks *who* is away, or
# *when*, can still bet on the last one it meets.
ABSENCE_CUES: tuple[str, ...] = (
    "leaves", "left", "goes out", "went out", "goes away", "went away", "is away", "was away", "away",
    "outside", "elsewhere", "gone", "not there", "is out", "steps out", "walks out", "exits",
    "does not see", "doesn't see", "did not see", "not watching", "not looking", "asleep", "falls asleep",
    "is busy", "cannot see", "can't see", "unaware",
)
PRESENCE_CUES: tuple[str, ...] = (
    "returns", "returned", "comes back", "came back", "back in", "is back", "watches", "watching",
    "watched", "sees", "saw", "looks on", "stays", "stayed", "remains", "present", "notices", "noticed",
    "is there", "in the room", "observes", "tells", "told", "informs", "shows", "aware",
)
_CUE_PATTERN = re.compile(
    r"(?<!\w)(" + "|".join(re.escape(c) for c in sorted(ABSENCE_CUES + PRESENCE_CUES, key=len, reverse=True))
    + r")(?!\w)", re.IGNORECASE)
_ABSENT = frozenset(ABSENCE_CUES)


def last_cue_polarity(s: Stimulus) -> str | None:
    """"absent" or "present" by the last presence/absence cue of the story (None: no cue)."""
    cues = _CUE_PATTERN.findall(story_of(s))
    if not cues:
        return None
    return "absent" if cues[-1].lower() in _ABSENT else "present"


def option_order(s: Stimulus) -> str:
    """One value for every row: the rule "the keyed option always sits in the same place", which the
    audit's learned mapping turns into "always the majority position"."""
    return "same"


def generic_battery() -> list[Heuristic]:
    """The heuristics tried on every contrast of every set."""
    bags: list[Heuristic] = []
    for part_name, part in (("story", story_of), ("prompt", lambda s: s.text)):
        for n in (1, 2, 3):
            bags.append(BagHeuristic(f"{n}-gram bag ({part_name})",
                                     f"n-grams up to length {n} of the {part_name}, logistic regression",
                                     _ngram_encoder(n, part), is_ngram_bag=True))
    return [
        *bags,
        BagHeuristic("length", "the prompt's length in words and characters, logistic regression", length_features),
        CueHeuristic("option order", "the keyed option always in the majority position", option_order),
        CueHeuristic("first-mentioned option", "the option the story mentions first", first_mentioned),
        CueHeuristic("last-mentioned option", "the option the story mentions last", last_mentioned),
        CueHeuristic("most-mentioned option", "the option the story mentions most often", most_mentioned),
        CueHeuristic("last presence/absence cue", "the polarity of the story's last presence or absence "
                     "word (leaves, away, returns, watches, ...), wherever it sits", last_cue_polarity),
    ]


def rule_heuristic(rule: Rule) -> CueHeuristic:
    return CueHeuristic(f"rule: {rule.name}", rule.description, rule.feature, family_rule=True)
