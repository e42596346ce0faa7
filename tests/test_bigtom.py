"""BigToM loader: the real 200-story file and hand-made rows in its format."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import pytest
from helpers import BIGTOM_ROW as ROW

from tomlens.errors import TomlensError
from tomlens.stimuli import load_bigtom as load_bigtom_reexport
from tomlens.stimuli.bigtom import CONDITIONS, load_bigtom

# CI checks the repository out with ../shared beside it; the data set is read there, never copied.
BIGTOM = Path(os.environ.get(
    "TOMLENS_BIGTOM",
    Path(__file__).resolve().parents[2] / "shared" / "data" / "bigtom" / "bigtom.csv",
))


def _write(tmp_path, *rows: str) -> Path:
    p = tmp_path / "mini.csv"
    p.write_text("\n".join(rows) + "\n", encoding="utf-8")
    return p


def test_real_file_loads_200_stories_per_condition():
    stims = load_bigtom(BIGTOM, conditions=tuple(CONDITIONS))
    assert len(stims) == 200 * 4
    assert Counter(s.condition for s in stims) == {c: 200 for c in CONDITIONS}
    assert len({s.task_id for s in stims}) == 200 and len({s.id for s in stims}) == 800
    by_cond = {c: [s for s in stims if s.condition == c] for c in CONDITIONS}
    assert all(s.belief_differs for s in by_cond["false_belief"])
    assert not any(s.belief_differs for c in ("true_belief", "true_control", "false_control")
                   for s in by_cond[c])
    # Counterbalanced: the belief answer is first in half of the false-belief prompts.
    assert sum(s.answer_index == 0 for s in by_cond["false_belief"]) == 100
    # The loader re-exported from tomlens.stimuli gives the same records.
    assert load_bigtom_reexport(BIGTOM) == [s for s in stims if s.condition in
                                            ("true_belief", "false_belief")]


def test_real_file_spot_check_row_against_csv():
    lines = BIGTOM.read_text(encoding="utf-8").splitlines()
    line_no = 37
    f = [x.strip() for x in lines[line_no - 1].split(";")]
    stims = {s.condition: s for s in load_bigtom(BIGTOM, conditions=tuple(CONDITIONS))
             if s.task_id == f"bigtom-{line_no:03d}"}
    fb, tb, fc = stims["false_belief"], stims["true_belief"], stims["false_control"]
    prefix = fb.meta["answer_prefix"]
    new, old = f[8].rstrip("."), f[11].rstrip(".")
    assert f"{prefix} {fb.world_state}" == new and f"{prefix} {fb.protagonist_belief}" == old
    assert fb.answer == fb.protagonist_belief and fb.reference_state == fb.protagonist_belief
    assert tb.answer == tb.world_state == fb.world_state and tb.belief_is_reference is False
    assert fc.world_state == fc.answer == fb.reference_state
    assert fb.options == tb.options == fc.options and set(fb.options) == {fb.world_state,
                                                                          fb.protagonist_belief}
    story = f[0]
    assert fb.text.startswith(story[: story.index(". ", story.index(". ") + 2)])
    assert f[3] not in fb.text  # field 4 (action if aware) is not part of the prompt
    assert fb.span_text("contrast") == f[2] and tb.span_text("contrast") == f[1]
    assert fc.span_text("contrast") == f[16] and fc.span_text("event") == f[14]
    assert fb.text.endswith(f"Question: {f[5]}\nAnswer: {prefix}")
    assert fb.span_text("query").startswith("Question: ")
    assert fb.span_text("protagonist") == f[0].split()[0].rstrip(",")
    # true and false belief prompts differ only inside the contrast span
    a, b = fb.spans["contrast"], tb.spans["contrast"]
    assert fb.text[: a.start] == tb.text[: b.start] and fb.text[a.end:] == tb.text[b.end:]


def test_labels_and_layout_on_own_row(tmp_path):
    p = _write(tmp_path, ROW, ROW.replace("Mina", "Omar"))
    stims = load_bigtom(p, conditions=tuple(CONDITIONS))
    assert len(stims) == 8
    fb = next(s for s in stims if s.id == "bigtom-001-false_belief")
    assert fb.text == (
        "Mina is a gardener in a walled garden. Mina wants to water the roses with rainwater. "
        "Mina fills the green can with rainwater. A neighbour empties the can and refills it with "
        "tap water. Mina does not see the neighbour refilling the can.\n"
        "Question: Does Mina believe the green can holds rainwater or tap water?\n"
        "Answer: Mina believes the green can holds"
    )
    assert fb.options == ("tap water", "rainwater") and fb.answer == "rainwater"
    assert (fb.world_state, fb.protagonist_belief, fb.reference_state) == (
        "tap water", "rainwater", "rainwater")
    assert not fb.reversed
    omar = [s for s in stims if s.task_id == "bigtom-002"]
    assert all(s.options == ("rainwater", "tap water") and s.reversed for s in omar)
    tc = next(s for s in stims if s.id == "bigtom-001-true_control")
    assert "A bird lands on the garden wall. Mina sees the bird landing." in tc.text
    assert "tap water." not in tc.text.split("\n")[0]
    assert tc.world_state == tc.protagonist_belief == "rainwater"


def test_initial_belief_sentence_sentence_answers_and_limit(tmp_path):
    p = _write(tmp_path, ROW, ROW, ROW)
    (s,) = load_bigtom(p, conditions="false_belief", include_initial_belief=True,
                       answer_format="sentence", limit=1)
    assert "Mina believes the green can holds rainwater. A neighbour" in s.text
    assert s.template_id == "forward_belief_initial"
    assert s.options == ("Mina believes the green can holds tap water",
                         "Mina believes the green can holds rainwater")
    assert s.text.endswith("Answer:")


@pytest.mark.parametrize(
    "row, words",
    [
        (";".join(ROW.split(";")[:10]), "10 fields"),
        (ROW.replace("Mina is a gardener in a walled garden. ", ""), "4 sentences"),
        (ROW.replace("Mina believes the green can holds tap water.", ""), "field 9 is empty"),
        (ROW.replace("Mina believes the green can holds tap water.",
                     "Mina believes the green can holds rainwater."), "do not differ"),
    ],
)
def test_malformed_row_names_file_and_line(tmp_path, row, words):
    p = _write(tmp_path, ROW, row)
    with pytest.raises(TomlensError) as e:
        load_bigtom(p)
    assert f"{p}, line 2:" in str(e.value) and words in str(e.value)


def test_bad_arguments(tmp_path):
    with pytest.raises(TomlensError, match="does not exist"):
        load_bigtom(tmp_path / "nope.csv")
    with pytest.raises(TomlensError, match="positive number"):
        load_bigtom(_write(tmp_path, ROW), limit=0)
    with pytest.raises(TomlensError, match="unknown BigToM condition"):
        load_bigtom(_write(tmp_path, ROW), conditions=("fb",))


def test_stimuli_spec_n_counts_stories_and_defaults_to_all(tmp_path):
    from tomlens.runs.base import StimuliSpec

    path = _write(tmp_path, ROW, ROW.replace("Mina", "Omar"), ROW.replace("Mina", "Lena"))
    every = load_bigtom(path)
    assert len(every) == 6  # three stories, two conditions each
    assert StimuliSpec(family="bigtom", path=str(path)).load() == every
    two = StimuliSpec(family="bigtom", path=str(path), n=2).load()
    assert two == load_bigtom(path, limit=2) and len({s.task_id for s in two}) == 2 and len(two) == 4
    with pytest.raises(TomlensError, match="no option 'limit'"):
        StimuliSpec(family="bigtom", path=str(path), options={"limit": 2})
    with pytest.raises(TomlensError, match="did you mean 'percept'"):
        StimuliSpec(family="bigtom", path=str(path), options={"percpet": "aligned"})
