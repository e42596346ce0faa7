"""Minimal pairs from a researcher's own stories: their false- and true-belief versions of each task.

People write the two versions of a story in their own words ("While Anna is out, her brother
moves the key ..." / "Anna watches her brother move the key ..."), so the two texts differ in
length and word order and can never be token-aligned. Such pairs are *role-aligned*
(`MinimalPair.alignment == "roles"`): patching reads the same roles in both stories (the final
token, the end of the contrast sentence, the question's mentions of the protagonist and of the
object), each resolved in its own story through the spans this module makes sure are there.

Grouping (`read_user_pairs`): the rows of a stimulus file (`tomlens.stimuli.user.load_user_file`)
are grouped by `task_id`; in each task the belief row (`prompt_type == "belief"`) whose condition
is `false_belief` is the clean story, and each other belief row whose condition is one of
`contrasts` (default `true_belief`) is a corrupted story. Pair id `<task_id>-<condition>`.

Spans a row does not give are found from the row itself where that is safe (`fill_role_spans`):
`query` is the final sentence (`query_span`), `protagonist` / `object` the first whole-word
mention of `meta["protagonist"]` / `meta["object"]`, and `query_protagonist` / `query_object` the
last mention of the protagonist's / object's name inside the query. The `contrast` span is never
guessed: which sentence carries the belief is the researcher's claim. What was filled and what is
missing is recorded in each story's `meta` (`FILLED`, `MISSING`), so the pairs file itself says
where every role position came from, and `role_span_report` summarises it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tomlens.errors import TomlensError
from tomlens.stimuli.pairs import MinimalPair
from tomlens.stimuli.records import Span, Stimulus
from tomlens.vocabulary import nearest

__all__ = ["CLEAN_CONDITION", "DEFAULT_USER_CONTRASTS", "FILLED", "MISSING", "ROLE_SPANS", "RoleSpanCount",
           "RoleSpanReport", "UserPairs", "fill_role_spans", "query_span", "read_user_pairs", "role_span_report",
           "user_pairs"]

CLEAN_CONDITION = "false_belief"
DEFAULT_USER_CONTRASTS: tuple[str, ...] = ("true_belief",)
# The spans role positions are read from (patching's default positions are final, contrast,
# query_protagonist and query_object; query, protagonist and object are where those come from).
ROLE_SPANS: tuple[str, ...] = ("contrast", "query", "query_protagonist", "query_object", "protagonist", "object")
FILLED = "filled_spans"  # meta key: span role -> how tomlens found it
MISSING = "missing_spans"  # meta key: span role -> why it is not there
FORMAT_DOC = "see docs/stimulus-format.md, 'Your own stories as minimal pairs'"

# A sentence ends at . ! or ? (closing quotes or brackets may follow) before whitespace, except
# after a title such as "Mr."; a line break always ends one.
_TITLES = ("Mr", "Mrs", "Ms", "Dr", "St", "Prof")
_SENTENCE_END = re.compile("".join(rf"(?<!\b{t})" for t in _TITLES) + r"[.!?][\"'\u201d\u2019)\]]*\s+|\s*\n\s*")
_LABEL = re.compile(r"\w+:")  # "Answer:", "A:" opening the final line


@dataclass(frozen=True)
class UserPairs:
    """The pairs built from a file, with `notes` on what was left out or changed (tasks without a
    row of a requested condition, options put in the clean story's order, the same answer in both
    stories) and `conditions`, the conditions the file's control belief rows have."""

    pairs: tuple[MinimalPair, ...]
    notes: tuple[str, ...]
    conditions: tuple[str, ...]


def user_pairs(path: str | Path, *, contrasts: Sequence[str] | None = None,
               n: int | None = None) -> list[MinimalPair]:
    """Role-aligned minimal pairs from a user's stimulus file (JSONL or CSV); see the module doc.

    `contrasts`: the control conditions to pair the false-belief story with (default
    `true_belief`); `n`: the first n tasks (in file order) that give a pair (None: all).
    The notes (`read_user_pairs(...).notes`: tasks left out, options reordered) are said, one line
    each; which spans were filled or are missing is in each story's meta and in
    `role_span_report(pairs)`.
    """
    from tomlens.messages import say

    built = read_user_pairs(path, contrasts=contrasts, n=n)
    for note in built.notes:
        say(f"note: {note}")
    return list(built.pairs)


def read_user_pairs(path: str | Path, *, contrasts: Sequence[str] | None = None,
                    n: int | None = None) -> UserPairs:
    """`user_pairs` with its notes. Raises TomlensError (naming the file, task and row ids) for a
    belief row without task_id or condition, a task without exactly one false-belief belief row, two
    rows of one condition in a task, a contrast no task has, two stories with different options,
    and a file that gives no pair."""
    from tomlens.stimuli.user import load_user_file

    path = Path(path)
    if n is not None and n < 1:
        raise TomlensError(f"n = {n} must be at least 1", "pass n=1 or more, or None for every task")
    stimuli = load_user_file(path)
    tasks = _tasks(stimuli, path)
    conditions = tuple(dict.fromkeys(s.condition for rows in tasks.values() for s in rows
                                     if s.condition != CLEAN_CONDITION))
    wanted = _check_contrasts(contrasts, conditions, path)
    pairs: list[MinimalPair] = []
    notes: list[str] = []
    skipped = len(stimuli) - sum(len(rows) for rows in tasks.values())
    if skipped:
        notes.append(f"{skipped} row(s) with prompt_type other than belief left out: pairs compare belief questions")
    used = 0
    for task_id, rows in tasks.items():
        if n is not None and used >= n:
            break
        made = _task_pairs(task_id, rows, wanted, path, notes)
        used += bool(made)
        pairs.extend(made)
    if not pairs:  # every task lacked the contrasts (the contrast check makes this rare)
        raise TomlensError(f"{path}: no task has both a {CLEAN_CONDITION} belief row and a "
                           f"{' or '.join(wanted)} belief row, so there is no pair",
                           f"give both versions of each story the same task_id; {FORMAT_DOC}")
    return UserPairs(tuple(pairs), tuple(notes), conditions)


def _ids(rows: Iterable[Stimulus | str], limit: int = 6) -> str:
    ids = [r if isinstance(r, str) else r.id for r in rows]
    return ", ".join(ids[:limit]) + (f" and {len(ids) - limit} more" if len(ids) > limit else "")


def _tasks(stimuli: Sequence[Stimulus], path: Path) -> dict[str, list[Stimulus]]:
    """The belief rows by task, in file order, each task checked for exactly one false-belief row and
    at most one row per condition."""
    belief = [s for s in stimuli if s.prompt_type == "belief"]
    if not belief:
        raise TomlensError(f"{path}: no belief row ({len(stimuli)} rows, none with prompt_type belief), so there is no pair",
                           f"pairs need the false- and true-belief versions of each story as belief rows; {FORMAT_DOC}")
    for field, what in (("task_id", "task_id (or group)"), ("condition", "condition")):
        lacking = [s for s in belief if not getattr(s, field)]
        if lacking:
            raise TomlensError(
                f"{path}: {len(lacking)} belief row(s) have no {what} (ids {_ids(lacking)}), so tomlens cannot "
                "tell which stories are versions of one another",
                f"give every belief row a task_id shared by the versions of one story and a condition "
                f"({CLEAN_CONDITION!r} for the clean story, e.g. 'true_belief' for its control); {FORMAT_DOC}")
    tasks: dict[str, list[Stimulus]] = {}
    for s in belief:
        tasks.setdefault(s.task_id, []).append(s)
    for task_id, rows in tasks.items():
        _check_task(task_id, rows, path)
    return tasks


def _check_task(task_id: str, rows: Sequence[Stimulus], path: Path) -> None:
    clean = [s for s in rows if s.condition == CLEAN_CONDITION]
    listed = ", ".join(f"{s.id} ({s.condition})" for s in rows)
    if not clean:
        raise TomlensError(f"{path}: task {task_id!r} has no {CLEAN_CONDITION} belief row (its belief rows: {listed})",
                           f"add the false-belief version with condition {CLEAN_CONDITION!r} and task_id {task_id!r}, "
                           "or correct the condition of the row that is the false-belief story")
    seen: dict[str, list[Stimulus]] = {}
    for s in rows:
        seen.setdefault(s.condition, []).append(s)
    twice = {c: rs for c, rs in seen.items() if len(rs) > 1}
    if twice:
        cond, rs = next(iter(twice.items()))
        raise TomlensError(f"{path}: task {task_id!r} has {len(rs)} belief rows with condition {cond!r} "
                           f"(ids {_ids(rs)}), so the pair is ambiguous",
                           "give each version of a story its own condition, or put different stories in different tasks")


def _check_contrasts(contrasts: Sequence[str] | str | None, conditions: Sequence[str],
                     path: Path) -> tuple[str, ...]:
    """The requested control conditions, each one the file has (else an error listing them)."""
    wanted = DEFAULT_USER_CONTRASTS if contrasts is None else (
        (contrasts,) if isinstance(contrasts, str) else tuple(contrasts))
    if not wanted:
        raise TomlensError("no contrast was given", f"name a control condition the file has: {', '.join(conditions)}")
    have = ", ".join(conditions) if conditions else "none (every belief row is false_belief)"
    for c in wanted:
        if c == CLEAN_CONDITION:
            raise TomlensError(f"contrast {c!r} is the clean story's condition, not a control",
                               f"pair it with a control condition of the file: {have}")
        if c not in conditions:
            near = nearest(c, conditions)
            raise TomlensError(
                f"{path}: no task has a belief row with condition {c!r}"
                + (f": did you mean {near!r}?" if near else "") + f" (the file's control conditions: {have})",
                ("pass --contrast (contrasts = [...]) with one of the file's conditions"
                 if conditions else "add the true-belief version of each story, with condition 'true_belief'")
                + f"; {FORMAT_DOC}")
    return tuple(dict.fromkeys(wanted))


def _task_pairs(task_id: str, rows: Sequence[Stimulus], wanted: Sequence[str], path: Path,
                notes: list[str]) -> list[MinimalPair]:
    """The task's pairs (one per wanted condition it has), stories filled; notes appended."""
    by_condition = {s.condition: s for s in rows}
    clean = fill_role_spans(by_condition[CLEAN_CONDITION])
    absent = [c for c in wanted if c not in by_condition]
    if absent:
        notes.append(f"task {task_id!r} has no {' or '.join(absent)} belief row: "
                     + ("no pair from it" if len(absent) == len(wanted) else f"no {task_id}-{absent[0]} pair"))
    pairs = []
    for c in wanted:
        if c in by_condition:
            corrupted = _same_options(clean, by_condition[c], task_id, path, notes)
            if corrupted.answer == clean.answer:
                notes.append(f"task {task_id!r}: the {CLEAN_CONDITION} and {c} stories ({clean.id}, {corrupted.id}) "
                             f"both answer {clean.answer!r}; a control usually answers the other option")
            pairs.append(MinimalPair(id=f"{task_id}-{c}", clean=clean, corrupted=fill_role_spans(corrupted),
                                     family="user", contrast=c, alignment="roles"))
    return pairs


def _same_options(clean: Stimulus, other: Stimulus, task_id: str, path: Path, notes: list[str]) -> Stimulus:
    """`other` with its options in the clean story's order; different options are an error, since
    the metric compares the same two answer words in both runs."""
    if other.options == clean.options:
        return other
    if set(other.options) != set(clean.options):
        raise TomlensError(
            f"{path}: task {task_id!r}: the stories {clean.id!r} and {other.id!r} have different options "
            f"({list(clean.options)} vs {list(other.options)}); patching compares the logits of the same two "
            "answer words in both stories",
            "give both versions of a story the same two options (the answer of each may differ)")
    notes.append(f"task {task_id!r}: {other.id}'s options put in {clean.id}'s order {list(clean.options)}")
    return other.with_(options=clean.options)


# ---------------------------------------------------------------------------------------------
# Role spans
# ---------------------------------------------------------------------------------------------


def query_span(text: str) -> Span | None:
    """The question the story ends with: its final sentence, found as the text after the last
    sentence end (`.`, `!` or `?` before whitespace, not after a title such as "Mr.") or line break,
    trailing whitespace left out. When the sentence before it is a question (ends with `?`), or the
    final sentence is only a one-word label (`Answer:`, `A:`), the query starts at that sentence
    instead: BigToM's "Question: ...?\\nAnswer: Noor believes ...", or "Where will Anna look? In
    the", whose question is what makes two stories' prompts the same measurement.
    None for a blank text."""
    body = text.rstrip()
    if not body:
        return None
    starts = [0] + [m.end() for m in _SENTENCE_END.finditer(body) if m.end() < len(body)]
    start = starts[-1]
    final = body[start:]
    if len(starts) > 1:
        label = _LABEL.match(final)
        question = body[starts[-2]:start].rstrip()
        if question.endswith("?") or (label and final[label.end():].strip() == ""):
            start = starts[-2]
    return Span(start, len(body))


def _whole_word(name: str) -> re.Pattern[str]:
    return re.compile((r"(?<!\w)" if name[0].isalnum() else "") + re.escape(name)
                      + (r"(?!\w)" if name[-1].isalnum() else ""))


def _name(s: Stimulus, role: str) -> tuple[str | None, str]:
    """A role's words (the span's text, else `meta[role]`) and where they came from."""
    if role in s.spans:
        return s.span_text(role), f"spans.{role}"
    value = s.meta.get(role)
    if isinstance(value, str) and value.strip():
        return value.strip(), f"meta.{role}"
    return None, ""


def _has(s: Stimulus, role: str) -> bool:
    return role in s.spans or bool(s.mentions.get(role))


def fill_role_spans(s: Stimulus) -> Stimulus:
    """The story with the role spans it lacks found from its own text and meta (module doc), and
    `meta[FILLED]` (role -> how it was found) and `meta[MISSING]` (role -> why it is not there) for
    the roles of `ROLE_SPANS`. Spans and mentions the row gives are kept as they are."""
    spans = dict(s.spans)
    filled: dict[str, str] = {}
    missing: dict[str, str] = {}
    if not _has(s, "contrast"):
        missing["contrast"] = ("not given, and tomlens does not guess it: add spans.contrast, the sentence that "
                               "makes the belief false or true")
    if "query" not in spans:
        q = query_span(s.text)
        if q is None:
            missing["query"] = "the text is blank"
        else:
            spans["query"] = q
            filled["query"] = "the final sentence (with the question before an `Answer:` line)"
    for role in ("protagonist", "object"):
        _fill_role(s, role, spans, filled, missing)
    if not filled and not missing:
        return s
    meta = dict(s.meta)
    for key, value in ((FILLED, filled), (MISSING, missing)):
        meta.pop(key, None)
        if value:
            meta[key] = value
    return s.with_(spans=spans, meta=meta)


def _fill_role(s: Stimulus, role: str, spans: dict[str, Span], filled: dict[str, str],
               missing: dict[str, str]) -> None:
    """Fill `role` (first mention) and `query_<role>` (last mention inside the query) from the role's
    name; say why where it cannot be found."""
    name, source = _name(s, role)
    q_role = f"query_{role}"
    if name is None:
        why = f"no {role} span and no meta.{role} to find it by: add either to the row"
        if not _has(s, role):
            missing[role] = why
        if not _has(s, q_role):
            missing[q_role] = why
        return
    pattern = _whole_word(name)
    if not _has(s, role):
        m = pattern.search(s.text)
        if m is None:
            missing[role] = f"{source} {name!r} does not occur in the text"
        else:
            spans[role] = Span(m.start(), m.end())
            filled[role] = f"the first mention of {name!r} ({source})"
    if _has(s, q_role):
        return
    if "query" not in spans:
        missing[q_role] = "no query span to look in"
        return
    q = spans["query"]
    found = list(pattern.finditer(s.text, q.start, q.end))
    if found:
        spans[q_role] = Span(found[-1].start(), found[-1].end())
        filled[q_role] = f"the last mention of {name!r} ({source}) in the query"
    else:
        missing[q_role] = (f"{name!r} ({source}) does not occur in the query {q.of(s.text)!r}: add spans.{q_role} "
                           "(the question's word for it) or give the query span")


# ---------------------------------------------------------------------------------------------
# What the pairs carry
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RoleSpanCount:
    """How many stories give a role's span, how many had it filled by tomlens, and which lack it
    (story ids) with the first reason recorded."""

    role: str
    given: int
    filled: int
    missing: tuple[str, ...]
    why: str = ""


@dataclass(frozen=True)
class RoleSpanReport:
    """Role spans over the distinct stories of a set of pairs (`role_span_report`)."""

    stories: int
    roles: tuple[RoleSpanCount, ...]

    @property
    def missing_roles(self) -> tuple[str, ...]:
        return tuple(r.role for r in self.roles if r.missing)

    def lines(self) -> list[str]:
        """One line per role: given / filled / missing, with story ids and the reason."""
        out = [f"role spans in the {self.stories} stories (given in the file / filled by tomlens / missing):"]
        width = max(len(r.role) for r in self.roles)
        for r in self.roles:
            parts = [f"given {r.given}", f"filled {r.filled}"]
            if r.missing:
                parts.append(f"missing in {len(r.missing)} ({_ids(r.missing, 4)}): {r.why}")
            out.append(f"  {r.role:<{width}}  " + ", ".join(parts))
        if self.missing_roles:
            out.append(f"  a role position whose span some story lacks ({', '.join(self.missing_roles)}) is left out "
                       "of `tomlens patch`'s default positions, with a note")
        return out


def role_span_report(pairs: Iterable[MinimalPair], roles: Sequence[str] = ROLE_SPANS) -> RoleSpanReport:
    """Which role spans the pairs' stories carry, given or filled (`meta[FILLED]`), and which they
    lack (with `meta[MISSING]`'s reason); each story counted once."""
    stories: dict[str, Stimulus] = {}
    for p in pairs:
        for s in (p.clean, p.corrupted):
            stories.setdefault(s.id, s)
    counts = []
    for role in roles:
        filled = [s for s in stories.values() if role in s.meta.get(FILLED, {})]
        lacking = [s for s in stories.values() if not _has(s, role)]
        why = next((s.meta.get(MISSING, {}).get(role, "") for s in lacking if role in s.meta.get(MISSING, {})),
                   f"no {role!r} span")
        counts.append(RoleSpanCount(role, len(stories) - len(filled) - len(lacking), len(filled),
                                    tuple(s.id for s in lacking), why))
    return RoleSpanReport(len(stories), tuple(counts))
