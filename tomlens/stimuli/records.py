"""The one record type that flows through every stage: a prompt, its two options and its labels.

Spans are character offsets into `text` (start inclusive, end exclusive), so later stages can find
token positions through the tokenizer's offsets without hard-coded indices.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal

from tomlens import io
from tomlens.errors import TomlensError

PromptType = Literal["reality", "belief", "goal"]
PROMPT_TYPES: tuple[str, ...] = ("reality", "belief", "goal")

# Role names used in `spans`. Generators use these; user files may add their own.
ROLE_NAMES: tuple[str, ...] = (
    "protagonist",  # first mention of the protagonist
    "other_agent",  # first mention of the other agent (mover, informant)
    "object",  # first mention of the object (or the container's contents)
    "location_1",  # first mention of the starting location / container / label word
    "location_2",  # first mention of the second location / true contents
    "container",  # the container in unexpected contents
    "contrast",  # the sentence that carries the FB / TB contrast
    "query",  # the final query (prompt) sentence
)


@dataclass(frozen=True)
class Span:
    """Character offsets `[start, end)` into a stimulus text."""

    start: int
    end: int

    def of(self, text: str) -> str:
        return text[self.start : self.end]

    @staticmethod
    def covering(spans: Sequence[Span]) -> Span:
        """The smallest span that covers all of `spans` (e.g. a contrast sentence's role mentions)."""
        return Span(min(s.start for s in spans), max(s.end for s in spans))


@dataclass(frozen=True)
class Stimulus:
    """One prompt with two answer options and the labels that probes and patching need.

    `world_state` is what is true, `protagonist_belief` what the protagonist believes;
    `reference_state` is the story-relative anchor (the object's starting location in a transfer
    story, the label word in a contents story) so that binary targets such as "the protagonist
    believes the object is where it started" mean the same thing in every item.
    `meta` holds family-specific labels (k habituations, agent type, prefix index, ...).
    `spans` holds one span per role (a role's first mention); `mentions` every mention of a role,
    in text order (so a position can name the protagonist's mention after the cue, not only the
    first one). Records from files without mentions have an empty `mentions`.
    """

    id: str
    text: str
    options: tuple[str, str]
    answer: str
    family: str = "user"
    task_id: str = ""
    template_id: str = ""
    condition: str = ""
    reversed: bool = False
    prompt_type: str = "belief"
    world_state: str | None = None
    protagonist_belief: str | None = None
    reference_state: str | None = None
    spans: dict[str, Span] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    mentions: dict[str, tuple[Span, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        problems = validate(self)
        if problems:
            raise TomlensError(
                f"stimulus {self.id!r}: " + "; ".join(problems),
                "fix the generator or the input row",
            )

    @property
    def answer_index(self) -> int:
        return self.options.index(self.answer)

    @property
    def belief_differs(self) -> bool:
        """True when the protagonist's belief and the world disagree (false-belief items)."""
        return (
            self.world_state is not None
            and self.protagonist_belief is not None
            and self.world_state != self.protagonist_belief
        )

    @property
    def world_is_reference(self) -> bool | None:
        if self.world_state is None or self.reference_state is None:
            return None
        return self.world_state == self.reference_state

    @property
    def belief_is_reference(self) -> bool | None:
        if self.protagonist_belief is None or self.reference_state is None:
            return None
        return self.protagonist_belief == self.reference_state

    def span_text(self, role: str) -> str:
        return self.spans[role].of(self.text)

    def with_(self, **changes: Any) -> Stimulus:
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """The record as JSON-able values, fields in declaration order (`meta` copied all the way down).

        Written out field by field: `dataclasses.asdict` recursed into every span and mention and
        took about a millisecond a record, which was a third of caching 256 prompts on a tiny model."""
        d: dict[str, Any] = {name: getattr(self, name) for name in _DICT_FIELDS}
        d["options"] = list(self.options)
        d["spans"] = {k: [s.start, s.end] for k, s in self.spans.items()}
        d["meta"] = _copied(self.meta)
        d["belief_differs"] = self.belief_differs
        if self.mentions:  # absent when empty, so records without mentions keep their hash
            d["mentions"] = {k: [[s.start, s.end] for s in v] for k, v in self.mentions.items()}
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Stimulus:
        d = dict(d)
        d.pop("belief_differs", None)
        d["options"] = tuple(d["options"])
        d["spans"] = {k: Span(int(v[0]), int(v[1])) for k, v in (d.get("spans") or {}).items()}
        d["meta"] = dict(d.get("meta") or {})
        d["mentions"] = {k: tuple(Span(int(a), int(b)) for a, b in v) for k, v in (d.get("mentions") or {}).items()}
        return cls(**d)


# The keys of `to_dict`, in order, before `belief_differs` and `mentions` (which it appends).
_DICT_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(Stimulus) if f.name != "mentions")



def _copied(value: Any) -> Any:
    """A copy of a value in `meta` exactly as `dataclasses.asdict` made it (plain dicts, lists and
    tuples rebuilt here, fast; anything else, a dataclass, a namedtuple or a dict subclass, by
    `asdict` itself), so a caller may change `to_dict`'s meta freely."""
    kind = type(value)
    if kind in _LEAVES:
        return value
    if kind is dict:
        return {k: v if type(v) in _LEAVES else _copied(v) for k, v in value.items()}
    if kind is list or kind is tuple:
        return kind(v if type(v) in _LEAVES else _copied(v) for v in value)
    return asdict(_Holder(value))["value"]


@dataclass(frozen=True)
class _Holder:
    """One value, for `asdict` to copy the way it copies a field."""

    value: Any


_LEAVES: frozenset[type] = frozenset({str, int, float, bool, type(None)})

def validate(s: Stimulus) -> list[str]:
    """Return a list of problems with a record (empty when it is well-formed)."""
    problems: list[str] = []
    if not s.id:
        problems.append("empty id")
    if not s.text:
        problems.append("empty text")
    if len(s.options) != 2 or not all(isinstance(o, str) and o for o in s.options):
        problems.append(f"options must be two non-empty strings, got {s.options!r}")
    elif s.options[0] == s.options[1]:
        problems.append(f"the two options are identical ({s.options[0]!r})")
    elif s.answer not in s.options:
        problems.append(f"answer {s.answer!r} is not one of the options {list(s.options)!r}")
    if s.prompt_type not in PROMPT_TYPES:
        problems.append(f"prompt_type {s.prompt_type!r} is not one of {PROMPT_TYPES}")
    for role, span in [*s.spans.items(), *((r, m) for r, ms in s.mentions.items() for m in ms)]:
        if not (0 <= span.start < span.end <= len(s.text)):
            problems.append(
                f"span {role!r} [{span.start}, {span.end}) is outside the text (length {len(s.text)})"
            )
    for role, ms in s.mentions.items():
        if list(ms) != sorted(ms, key=lambda m: m.start):
            problems.append(f"mentions of {role!r} are not in text order")
    return problems


def find_mentions(text: str, words: Mapping[str, str | Sequence[str]]) -> dict[str, tuple[Span, ...]]:
    """Every whole-word occurrence of each role's word(s) in `text`, in text order.

    `words` maps a role to its surface form(s), e.g. {"protagonist": "Mia", "location_1": "the
    basket"}; a role whose words never occur is left out. Used by generators to fill `mentions`."""
    out: dict[str, tuple[Span, ...]] = {}
    for role, given in words.items():
        forms = [given] if isinstance(given, str) else list(given)
        found: set[tuple[int, int]] = set()
        for form in forms:
            if not form:
                continue
            pattern = (r"(?<!\w)" if form[0].isalnum() else "") + re.escape(form) + (r"(?!\w)" if form[-1].isalnum() else "")
            found.update((m.start(), m.end()) for m in re.finditer(pattern, text))
        if found:
            out[role] = tuple(Span(a, b) for a, b in sorted(found))
    return out


def write_jsonl(stimuli: Iterable[Stimulus], path: str | Path) -> Path:
    """Write records as JSON lines, atomically (temporary name, then rename)."""
    return io.write_jsonl((s.to_dict() for s in stimuli), path)


def stimuli_hash(stimuli: Sequence[Stimulus]) -> str:
    """A content hash over the records, in order: provenance and cache keys use it."""
    return io.records_hash((s.to_dict() for s in stimuli), 16)

