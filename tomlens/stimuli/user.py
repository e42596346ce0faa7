"""Stimulus files written by users (or by `write_jsonl`): JSONL and CSV, checked row by row.

A bad row stops the load with the file, the line and the field named, because a silently dropped
or half-read stimulus would shift every later number without anyone noticing. The format is
documented in docs/stimulus-format.md; `write_jsonl` output loads back into identical records.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from tomlens.errors import TomlensError
from tomlens.io import atomic_path
from tomlens.stimuli.records import PROMPT_TYPES, Span, Stimulus

JSONL_SUFFIXES: tuple[str, ...] = (".jsonl", ".ndjson")
CSV_SUFFIXES: tuple[str, ...] = (".csv",)

REQUIRED: tuple[str, ...] = ("id", "text", "options", "answer")
STRING_FIELDS: tuple[str, ...] = ("family", "task_id", "template_id", "condition")
OPTIONAL_STATE_FIELDS: tuple[str, ...] = ("world_state", "protagonist_belief", "reference_state")
KNOWN: frozenset[str] = frozenset(
    REQUIRED
    + STRING_FIELDS
    + OPTIONAL_STATE_FIELDS
    + ("reversed", "prompt_type", "spans", "mentions", "meta", "group", "belief_differs")
)
CSV_ONLY: frozenset[str] = frozenset({"option_a", "option_b"})
FORMAT_DOC = "see docs/stimulus-format.md"

_TRUE = {"true", "1", "yes", "y", "t"}
_FALSE = {"false", "0", "no", "n", "f", ""}


class _RowError(Exception):
    """A problem in one field of one row; `load_user_file` adds the file and line."""

    def __init__(self, field: str, problem: str, fix: str | None = None):
        super().__init__(problem)
        self.field = field
        self.problem = problem
        self.fix = fix


def load_user_file(path: str | Path) -> list[Stimulus]:
    """Read stimuli from a JSONL (`.jsonl`, `.ndjson`) or CSV (`.csv`) file, chosen by extension.

    Every row becomes one `Stimulus`; any malformed row or a repeated id raises `TomlensError`
    naming the file, the line and the field. Nothing is skipped except blank JSONL lines.
    """
    path = Path(path)
    if not path.is_file():
        raise TomlensError(
            f"stimulus file {str(path)!r} does not exist",
            "check the path (generate a file with `tomlens stimuli FAMILY --out FILE.jsonl`)",
        )
    suffix = path.suffix.lower()
    if suffix in JSONL_SUFFIXES:
        rows: Iterable[tuple[int, dict[str, Any]]] = _jsonl_rows(path)
        is_csv = False
    elif suffix in CSV_SUFFIXES:
        rows = _csv_rows(path)
        is_csv = True
    else:
        raise TomlensError(
            f"stimulus file {str(path)!r} has extension {path.suffix!r}, which tomlens cannot read",
            f"use a JSONL file ({', '.join(JSONL_SUFFIXES)}) or a CSV file (.csv); {FORMAT_DOC}",
        )

    out: list[Stimulus] = []
    seen: dict[str, int] = {}
    for line, row in rows:
        try:
            stim = _row_to_stimulus(row, is_csv=is_csv)
        except _RowError as e:
            raise TomlensError(
                f"{path}, line {line}, field {e.field!r}: {e.problem}", e.fix or FORMAT_DOC
            ) from None
        if stim.id in seen:
            raise TomlensError(
                f"{path}, line {line}, field 'id': id {stim.id!r} repeats the id on line "
                f"{seen[stim.id]}",
                "give every stimulus a unique id",
            )
        seen[stim.id] = line
        out.append(stim)
    return out


def write_user_csv(stimuli: Sequence[Stimulus], path: str | Path) -> Path:
    """Write records in the documented CSV format (options as two columns, spans/meta as JSON).

    Written to a temporary name and renamed, so an interrupted write never looks complete.
    """
    columns = [
        "id", "text", "option_a", "option_b", "answer", "family", "task_id", "template_id",
        "condition", "reversed", "prompt_type", "world_state", "protagonist_belief",
        "reference_state", "spans", "mentions", "meta",
    ]
    with atomic_path(path) as tmp, tmp.open("w", encoding="utf-8", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns)
        w.writeheader()
        for s in stimuli:
            w.writerow({
                "id": s.id, "text": s.text, "option_a": s.options[0], "option_b": s.options[1],
                "answer": s.answer, "family": s.family, "task_id": s.task_id,
                "template_id": s.template_id, "condition": s.condition,
                "reversed": "true" if s.reversed else "false", "prompt_type": s.prompt_type,
                "world_state": _none_marker(s.world_state),
                "protagonist_belief": _none_marker(s.protagonist_belief),
                "reference_state": _none_marker(s.reference_state),
                "spans": json.dumps({k: [v.start, v.end] for k, v in s.spans.items()}),
                "mentions": json.dumps({k: [[m.start, m.end] for m in v] for k, v in s.mentions.items()}),
                "meta": json.dumps(s.meta, ensure_ascii=False),
            })
    return Path(path)


# --------------------------------------------------------------------------------------------
# Reading rows


def _jsonl_rows(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    with path.open(encoding="utf-8-sig") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise TomlensError(
                    f"{path}, line {line_no}, field '(row)': not valid JSON ({e.msg} at column "
                    f"{e.colno})",
                    "write one JSON object per line; " + FORMAT_DOC,
                ) from None
            if not isinstance(obj, dict):
                raise TomlensError(
                    f"{path}, line {line_no}, field '(row)': expected a JSON object, got "
                    f"{type(obj).__name__}",
                    "write one JSON object per line; " + FORMAT_DOC,
                )
            yield line_no, obj


def _csv_rows(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    with path.open(encoding="utf-8-sig", newline="") as f:
        reader = csv.reader(f)
        try:
            header = next(reader)
        except StopIteration:
            return
        header = [h.strip() for h in header]
        dupes = sorted({h for h in header if header.count(h) > 1})
        if dupes:
            raise TomlensError(
                f"{path}, line 1, field {dupes[0]!r}: the header names this column twice",
                "give every column a unique name",
            )
        start = reader.line_num + 1
        for values in reader:
            line = start
            start = reader.line_num + 1
            if not values:
                continue  # a blank line, not a row
            if len(values) != len(header):
                raise TomlensError(
                    f"{path}, line {line}, field '(row)': {len(values)} values for "
                    f"{len(header)} columns",
                    "quote values that contain commas or newlines; " + FORMAT_DOC,
                )
            yield line, dict(zip(header, values, strict=True))


# --------------------------------------------------------------------------------------------
# One row -> one Stimulus


def _row_to_stimulus(row: dict[str, Any], *, is_csv: bool) -> Stimulus:
    row = dict(row)
    meta = _pop_meta_columns(row, is_csv)
    options = _options(row, is_csv)
    for name in REQUIRED:
        if name != "options" and name not in row:
            raise _RowError(name, "required field is missing")
    sid = _string(row, "id", required=True, allow_int=True)
    text = row["text"]
    if not isinstance(text, str) or not text:
        raise _RowError("text", "must be a non-empty string")
    answer = _answer(row["answer"], options)
    kwargs = _optional_fields(row, text, is_csv)
    kwargs["meta"] = _merged_meta(row, meta, is_csv)
    try:
        stim = Stimulus(id=sid, text=text, options=options, answer=answer, **kwargs)
    except TomlensError as e:  # the record's own checks; fields were checked above
        raise _RowError("(row)", e.problem) from None
    if "belief_differs" in row and row["belief_differs"] not in (None, ""):
        given = _bool(row["belief_differs"], "belief_differs")
        if given != stim.belief_differs:
            raise _RowError(
                "belief_differs",
                f"says {given} but world_state {stim.world_state!r} and protagonist_belief "
                f"{stim.protagonist_belief!r} make it {stim.belief_differs}",
                "drop the field (it is derived) or fix the two states",
            )
    return stim


def _pop_meta_columns(row: dict[str, Any], is_csv: bool) -> dict[str, Any]:
    """Take the `meta.<label>` columns out of `row` as labels, then refuse any field left that the
    format does not know."""
    meta: dict[str, Any] = {}
    for key in list(row):
        if key.startswith("meta."):
            name = key[len("meta."):]
            if not name:
                raise _RowError(key, "a `meta.` column needs a label name after the dot")
            meta[name] = row.pop(key)
    allowed = KNOWN | CSV_ONLY if is_csv else KNOWN
    unknown = sorted(k for k in row if k not in allowed)
    if unknown:
        raise _RowError(
            unknown[0],
            "unknown field",
            f"keep extra labels under `meta` (JSON object) or as `meta.{unknown[0]}` "
            f"columns; {FORMAT_DOC}",
        )
    return meta


def _optional_fields(row: dict[str, Any], text: str, is_csv: bool) -> dict[str, Any]:
    """The row's optional fields, checked, as `Stimulus` keywords (`group` is `task_id`)."""
    kwargs: dict[str, Any] = {}
    for name in STRING_FIELDS:
        if name in row:
            kwargs[name] = _string(row, name)
    if "group" in row:
        group = _string(row, "group")
        if kwargs.get("task_id") and group and kwargs["task_id"] != group:
            raise _RowError(
                "group",
                f"group {group!r} disagrees with task_id {kwargs['task_id']!r}",
                "give one of the two (`group` is another name for `task_id`)",
            )
        if group:
            kwargs["task_id"] = group
    for name in OPTIONAL_STATE_FIELDS:
        if name in row:
            kwargs[name] = _optional_string(row[name], name, is_csv)
    if "reversed" in row:
        kwargs["reversed"] = _bool(row["reversed"], "reversed")
    if "prompt_type" in row:
        pt = _string(row, "prompt_type")
        if not pt:
            pt = "belief"
        if pt not in PROMPT_TYPES:
            raise _RowError("prompt_type", f"{pt!r} is not one of {list(PROMPT_TYPES)}")
        kwargs["prompt_type"] = pt
    if "spans" in row:
        kwargs["spans"] = _spans(row["spans"], text, is_csv)
    if "mentions" in row:
        kwargs["mentions"] = _mentions(row["mentions"], text, is_csv)
    return kwargs


def _merged_meta(row: dict[str, Any], meta: dict[str, Any], is_csv: bool) -> dict[str, Any]:
    """The `meta` object (JSON, or a CSV cell holding JSON) with the `meta.<label>` columns; a label
    given both ways is refused."""
    if "meta" not in row:
        return meta
    base = _json_object(row["meta"], "meta", is_csv)
    clash = sorted(set(base) & set(meta))
    if clash:
        raise _RowError(
            f"meta.{clash[0]}", "this label is given both in `meta` and as its own column"
        )
    return {**base, **meta}

def _options(row: dict[str, Any], is_csv: bool) -> tuple[str, str]:
    has_pair = "option_a" in row or "option_b" in row
    if has_pair:
        if "options" in row and str(row["options"]).strip():
            raise _RowError("options", "give either `options` or `option_a`/`option_b`, not both")
        for name in ("option_a", "option_b"):
            if name not in row:
                raise _RowError(name, "required field is missing (options come in pairs)")
            if not isinstance(row[name], str) or not row[name]:
                raise _RowError(name, "must be a non-empty string")
        return (row["option_a"], row["option_b"])
    if "options" not in row:
        raise _RowError("options", "required field is missing",
                        "give `options` as a list of two strings (CSV: `option_a`, `option_b`)")
    value = row["options"]
    if is_csv:
        value = _parse_json_text(value, "options")
    if (
        not isinstance(value, (list, tuple))
        or len(value) != 2
        or not all(isinstance(v, str) and v for v in value)
    ):
        raise _RowError("options", f"must be a list of two non-empty strings, got {value!r}")
    if value[0] == value[1]:
        raise _RowError("options", f"the two options are identical ({value[0]!r})")
    return (value[0], value[1])


def _answer(value: Any, options: tuple[str, str]) -> str:
    if isinstance(value, str):
        if value in options:
            return value
        if value.strip() in ("0", "1"):
            return options[int(value.strip())]
    elif isinstance(value, int) and not isinstance(value, bool) and value in (0, 1):
        return options[value]
    raise _RowError(
        "answer",
        f"{value!r} is neither one of the options {list(options)!r} nor an index 0 or 1",
    )


def _string(
    row: dict[str, Any], name: str, *, required: bool = False, allow_int: bool = False
) -> str:
    value = row[name]
    if allow_int and isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str):
        raise _RowError(name, f"must be a string, got {type(value).__name__}")
    if required and not value:
        raise _RowError(name, "must not be empty")
    return value


def _optional_string(value: Any, name: str, is_csv: bool) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise _RowError(name, f"must be a string or null, got {type(value).__name__}")
    if is_csv and value == "":
        return None
    return value


def _none_marker(value: str | None) -> str:
    return "" if value is None else value


def _bool(value: Any, name: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise _RowError(name, f"must be true or false, got {value!r}")


def _parse_json_text(value: Any, name: str) -> Any:
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as e:
        raise _RowError(name, f"is not valid JSON ({e.msg} at column {e.colno})") from None


def _json_object(value: Any, name: str, is_csv: bool) -> dict[str, Any]:
    if is_csv:
        if isinstance(value, str) and not value.strip():
            return {}
        value = _parse_json_text(value, name)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _RowError(name, f"must be a JSON object, got {type(value).__name__}")
    return dict(value)


def _mentions(value: Any, text: str, is_csv: bool) -> dict[str, tuple[Span, ...]]:
    """Every mention of each role: {role: [[start, end], ...]}, as offsets (a substring would be
    ambiguous: the same name occurs several times), distinct and put in text order."""
    raw = _json_object(value, "mentions", is_csv)
    out: dict[str, tuple[Span, ...]] = {}
    for role, spans in raw.items():
        field = f"mentions.{role}"
        if not isinstance(spans, list):
            raise _RowError(field, f"must be a list of [start, end] offsets, got {spans!r}")
        if not spans:
            continue  # a role with no mention (the writer leaves it out)
        found: list[Span] = []
        for i, v in enumerate(spans):
            if isinstance(v, str):
                raise _RowError(f"{field}[{i}]", f"{v!r} is text; a mention needs its offsets",
                                "give every mention as [start, end] character offsets into `text`")
            found.append(_offset_span(v, f"{field}[{i}]", text))
        if len(set(found)) != len(found):
            raise _RowError(field, "the same mention is listed twice", "list each mention's offsets once")
        out[role] = tuple(sorted(found, key=lambda m: m.start))
    return out


def _spans(value: Any, text: str, is_csv: bool) -> dict[str, Span]:
    raw = _json_object(value, "spans", is_csv)
    spans: dict[str, Span] = {}
    for role, v in raw.items():
        field = f"spans.{role}"
        if isinstance(v, str):
            start = text.find(v) if v else -1
            if start < 0:
                raise _RowError(field, f"the text {v!r} does not occur in `text`",
                                "give the span as [start, end] character offsets or as a "
                                "substring of the text")
            spans[role] = Span(start, start + len(v))
            continue
        spans[role] = _offset_span(v, field, text)
    return spans


def _offset_span(v: Any, field: str, text: str) -> Span:
    """A span given as [start, end] (or {"start", "end"}), checked against the text."""
    if isinstance(v, dict) and set(v) == {"start", "end"}:
        v = [v["start"], v["end"]]
    if (
        not isinstance(v, (list, tuple))
        or len(v) != 2
        or not all(isinstance(x, int) and not isinstance(x, bool) for x in v)
    ):
        raise _RowError(field, f"must be [start, end] (two integers), got {v!r}")
    start, end = v
    if not (0 <= start < end <= len(text)):
        raise _RowError(
            field, f"[{start}, {end}) is outside the text (length {len(text)}) or empty"
        )
    return Span(start, end)
