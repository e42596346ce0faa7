"""User stimulus files: JSONL/CSV round trips and one clear error per kind of malformed row."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tomlens.errors import TomlensError
from tomlens.stimuli import read_jsonl
from tomlens.stimuli.goal_encoding import goal_encoding
from tomlens.stimuli.records import Span, Stimulus, write_jsonl
from tomlens.stimuli.user import load_user_file, write_user_csv

DOC = Path(__file__).resolve().parents[1] / "docs" / "stimulus-format.md"


def _records() -> list[Stimulus]:
    text = "Anna puts the ring in the drawer. Ben moves it to the box. Anna looks in the"
    base = Stimulus(
        id="fb-1", text=text, options=("drawer", "box"), answer="drawer", family="custom",
        task_id="t1", template_id="tpl", condition="false_belief", reversed=False,
        prompt_type="belief", world_state="box", protagonist_belief="drawer",
        reference_state="drawer",
        spans={"protagonist": Span(0, 4), "contrast": Span(34, 59)},
        meta={"k": 3, "tags": ["a", "b"], "nested": {"x": 1.5}, "flag": True, "none": None},
    )
    tb = base.with_(id="tb-1", condition="present", protagonist_belief="box", answer="box",
                    reversed=True, options=("box", "drawer"))
    plain = Stimulus(id="u-3", text="Is the sky blue? Answer:", options=("yes", "no"), answer="yes")
    return [base, tb, plain] + goal_encoding(1, 0, ks=(0, 2))


def test_jsonl_round_trip_is_identical(tmp_path):
    recs = _records()
    path = write_jsonl(recs, tmp_path / "s.jsonl")
    assert load_user_file(path) == recs
    assert read_jsonl(path) == recs


def test_csv_round_trip_is_identical(tmp_path):
    recs = _records()
    path = write_user_csv(recs, tmp_path / "s.csv")
    back = load_user_file(path)
    assert back == recs
    assert back[0].belief_differs and not back[1].belief_differs


def test_answer_by_index_group_alias_and_substring_spans(tmp_path):
    p = tmp_path / "a.jsonl"
    rows = [
        {"id": 1, "text": "Sam hides the key. Where is the key? In the", "options": ["box", "bag"],
         "answer": 1, "group": "g1", "spans": {"protagonist": "Sam", "query": [19, 43]}},
        {"id": "2", "text": "Pick a number:", "options": ["1", "2"], "answer": "1"},
    ]
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    a, b = load_user_file(p)
    assert a.id == "1" and a.answer == "bag" and a.task_id == "g1"
    assert a.span_text("protagonist") == "Sam" and a.span_text("query") == "Where is the key? In the"
    assert b.answer == "1"  # an answer equal to an option is that option, not an index

    c = tmp_path / "a.csv"
    c.write_text(
        "id,text,options,answer,reversed,meta.source,world_state\n"
        'x,"Anna, then Ben.","[""yes"", ""no""]",0,yes,hand,\n'
    )
    (s,) = load_user_file(c)
    assert s.options == ("yes", "no") and s.answer == "yes" and s.reversed is True
    assert s.meta == {"source": "hand"} and s.world_state is None


def test_doc_examples_load(tmp_path):
    doc = DOC.read_text()
    jsonl = re.search(r"```json\n(.*?)```", doc, re.S).group(1)
    csv_text = re.search(r"```csv\n(.*?)```", doc, re.S).group(1)
    (tmp_path / "d.jsonl").write_text(jsonl)
    (tmp_path / "d.csv").write_text(csv_text)
    (j,) = load_user_file(tmp_path / "d.jsonl")
    (c,) = load_user_file(tmp_path / "d.csv")
    assert j.span_text("contrast") == "Anne moves the ball to the box."
    for s in (j, c):
        assert s.answer == "basket" and s.belief_differs and s.task_id == "sally"
        assert s.span_text("protagonist") == "Sally"
    assert c.meta == {"source": "hand-written"}


GOOD = {"id": "a", "text": "Anna looks in the", "options": ["box", "bag"], "answer": "box"}


def _jsonl(tmp_path, *rows, name="bad.jsonl"):
    p = tmp_path / name
    p.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return p


@pytest.mark.parametrize(
    "row, field, words",
    [
        ({k: v for k, v in GOOD.items() if k != "text"}, "text", "missing"),
        ({k: v for k, v in GOOD.items() if k != "options"}, "options", "missing"),
        ({**GOOD, "options": ["box"]}, "options", "two non-empty strings"),
        ({**GOOD, "options": ["box", "box"]}, "options", "identical"),
        ({**GOOD, "answer": "cupboard"}, "answer", "neither one of the options"),
        ({**GOOD, "answer": 2}, "answer", "index 0 or 1"),
        ({**GOOD, "text": ""}, "text", "non-empty"),
        ({**GOOD, "id": ""}, "id", "empty"),
        ({**GOOD, "spans": {"protagonist": [5, 400]}}, "spans.protagonist", "outside the text"),
        ({**GOOD, "spans": {"protagonist": "Zed"}}, "spans.protagonist", "does not occur"),
        ({**GOOD, "spans": {"protagonist": [1]}}, "spans.protagonist", "[start, end]"),
        ({**GOOD, "prompt_type": "opinion"}, "prompt_type", "not one of"),
        ({**GOOD, "reversed": "maybe"}, "reversed", "true or false"),
        ({**GOOD, "meta": [1, 2]}, "meta", "JSON object"),
        ({**GOOD, "conditon": "fb"}, "conditon", "unknown field"),
        ({**GOOD, "world_state": 3}, "world_state", "string or null"),
        ({**GOOD, "group": "g", "task_id": "h"}, "group", "disagrees"),
        ({**GOOD, "world_state": "box", "protagonist_belief": "bag", "belief_differs": False},
         "belief_differs", "derived"),
    ],
)
def test_malformed_jsonl_row_names_file_line_and_field(tmp_path, row, field, words):
    p = _jsonl(tmp_path, {**GOOD, "id": "first"}, row)
    with pytest.raises(TomlensError) as e:
        load_user_file(p)
    msg = str(e.value)
    assert f"{p}, line 2, field {field!r}" in msg
    assert words in msg


def test_bad_json_and_duplicate_ids(tmp_path):
    p = _jsonl(tmp_path, GOOD, "{not json")
    with pytest.raises(TomlensError, match=r"line 2, field '\(row\)': not valid JSON"):
        load_user_file(p)
    p = _jsonl(tmp_path, GOOD, {**GOOD, "id": "b"}, GOOD, name="dup.jsonl")
    with pytest.raises(TomlensError, match=r"dup.jsonl, line 3, field 'id': id 'a' repeats the id on line 1"):
        load_user_file(p)


@pytest.mark.parametrize(
    "header, row, field, words",
    [
        ("id,text,option_a,answer", 'a,"t x",box,box', "option_b", "missing"),
        ("id,text,option_a,option_b,answer", "a,t x,box,bag,cup", "answer", "neither"),
        ("id,text,option_a,option_b,answer,spans", 'a,t x,box,bag,0,"{bad"', "spans", "valid JSON"),
        ("id,text,options,answer", 'a,t x,"[""box""]",0', "options", "two non-empty"),
        ("id,text,option_a,option_b,answer,story", "a,t x,box,bag,0,s1", "story", "meta.story"),
        ("id,text,option_a,option_b,answer", "a,t x,box,bag", "(row)", "4 values for 5 columns"),
        ("id,text,option_a,option_b,answer,meta,meta.k", 'a,t x,box,bag,0,"{""k"": 1}",2',
         "meta.k", "both"),
    ],
)
def test_malformed_csv_row_names_file_line_and_field(tmp_path, header, row, field, words):
    p = tmp_path / "bad.csv"
    p.write_text(f"{header}\n\n{row}\n")  # the blank line 2 is skipped, the row is line 3
    with pytest.raises(TomlensError) as e:
        load_user_file(p)
    msg = str(e.value)
    assert f"{p}, line 3, field {field!r}" in msg, msg
    assert words in msg


def test_csv_line_numbers_count_physical_lines(tmp_path):
    p = tmp_path / "multi.csv"
    p.write_text('id,text,option_a,option_b,answer\nok,"two\nlines",box,bag,0\nbad,t,box,bag,cup\n')
    with pytest.raises(TomlensError, match=r"multi.csv, line 4, field 'answer'"):
        load_user_file(p)
    p.write_text('id,text,option_a,option_b,answer\nok,"two\nlines",box,bag,0\n')
    (s,) = load_user_file(p)
    assert s.text == "two\nlines"


def test_unreadable_inputs(tmp_path):
    with pytest.raises(TomlensError, match="does not exist"):
        load_user_file(tmp_path / "missing.jsonl")
    (tmp_path / "x.txt").write_text("hi")
    with pytest.raises(TomlensError, match="extension '.txt'"):
        load_user_file(tmp_path / "x.txt")
    p = _jsonl(tmp_path, "[1, 2]")
    with pytest.raises(TomlensError, match="expected a JSON object"):
        load_user_file(p)


def test_mentions_are_read_as_offsets_in_text_order(tmp_path):
    from tomlens.stimuli.records import find_mentions

    text = "Anna put the ball in the box. Anna left. Where will Anna look for the ball? Answer:"
    mentions = find_mentions(text, {"protagonist": "Anna", "object": "the ball"})
    row = {"id": "a", "text": text, "options": ["box", "basket"], "answer": "box",
           "mentions": {k: [[m.start, m.end] for m in reversed(v)] for k, v in mentions.items()}}
    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps(row) + "\n")
    (s,) = load_user_file(path)
    assert s.mentions == mentions and [m.of(text) for m in s.mentions["protagonist"]] == ["Anna"] * 3
    for bad, why in (({"protagonist": ["Anna", "Anna"]}, "mentions.protagonist[0]"),
                     ({"protagonist": [[0, 4], [0, 4]]}, "listed twice"),
                     ({"protagonist": [[0, 400]]}, "outside the text")):
        path.write_text(json.dumps({**row, "mentions": bad}) + "\n")
        with pytest.raises(TomlensError, match=re.escape(why)):
            load_user_file(path)
