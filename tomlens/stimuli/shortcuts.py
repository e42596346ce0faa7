"""What a family declares for `tomlens audit`: its headline contrasts and its own shortcut rules.

A number about belief means something only if no cheaper reading of the text explains it. The
audit (`tomlens.audit`) tries a battery of generic heuristics (n-gram bags, length, option order,
option mentions, the recency of presence and absence cues) on every contrast of a set; a family adds
here what only it knows:

- `Contrast`: a label a finding is about (false vs true belief, the keyed answer's polarity, ...).
  `label(s)` gives a stimulus's class, or None where the stimulus is not part of the contrast.
- `Rule`: a cue a reader could use without tracking anyone's mind (the subject type of a recursive
  statement, the last two believers of a chain, ...). `feature(s)` gives a categorical value; the
  audit learns which value goes with which class on training tasks and scores it on held-out tasks,
  so a rule says *what* it looks at, never what it predicts.

These live in the stimuli package, beside the generators (a generator module exports `CONTRASTS`
and `RULES`, and `UNAUDITED` for a generic contrast its task states openly by design, with why), so
that a family and its shortcuts are changed together; nothing here imports the audit.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass

from tomlens.stimuli.records import Stimulus


@dataclass(frozen=True)
class Contrast:
    """A labelled split of a set that a finding is about; `label` is None outside the contrast."""

    name: str
    label: Callable[[Stimulus], Hashable | None]
    description: str
    chance: float | None = None  # None: balanced accuracy's, 1 / classes; 0.5 where the split is by design


@dataclass(frozen=True)
class Rule:
    """A text cue a shortcut could read: `feature` is categorical (None = the cue is absent).
    `contrasts` names the contrasts it is tried on (empty: every contrast of the set)."""

    name: str
    feature: Callable[[Stimulus], Hashable | None]
    description: str
    contrasts: tuple[str, ...] = ()

    def applies_to(self, contrast: str) -> bool:
        return not self.contrasts or contrast in self.contrasts
