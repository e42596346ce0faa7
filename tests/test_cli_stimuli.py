"""`tomlens stimuli`: every family through the in-process CLI, summaries and errors."""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import pytest

from tomlens.cli import main
from tomlens.stimuli import generate, read_jsonl, stimuli_hash
from tomlens.stimuli.bigtom import load_bigtom

# CI checks the repository out with ../shared beside it; the data set is read there, never copied.
BIGTOM = Path(os.environ.get(
    "TOMLENS_BIGTOM",
    Path(__file__).resolve().parents[2] / "shared" / "data" / "bigtom" / "bigtom.csv",
))

GENERATED = ["unexpected-transfer", "unexpected-contents", "goal-encoding", "belief-tracking",
             "belief-statements", "order-only"]


def _summary_counts(line: str) -> dict[tuple[str, str], int]:
    cells = line[line.index("(") + 1 : line.index(")")].split(", ")
    out = {}
    for cell in cells:
        key, k = cell.split("=")
        cond, pt = key.split("/")
        out[(cond, pt)] = int(k)
    return out


@pytest.mark.parametrize("family", GENERATED)
def test_generated_family_writes_jsonl_and_summary(family, tmp_path, capsys):
    out = tmp_path / f"{family}.jsonl"
    assert main(["stimuli", family, "--n", "2", "--seed", "3", "--out", str(out)]) == 0
    line = capsys.readouterr().out.strip()
    assert "\n" not in line
    stims = read_jsonl(out)
    assert stims == generate(family, n=2, seed=3)
    expected = Counter((s.condition or "-", s.prompt_type) for s in stims)
    assert _summary_counts(line) == dict(expected)
    assert line.startswith(f"{family}: {len(stims)} stimuli") and stimuli_hash(stims) in line


def test_options_are_passed_to_the_generator(tmp_path, capsys):
    out = tmp_path / "g.jsonl"
    assert main(["stimuli", "goal-encoding", "--n", "3", "--out", str(out), "--set", "ks=[0,6]",
                 "--set", 'test_cases=["animate","control"]', "--set", "manner_scope=test"]) == 0
    stims = read_jsonl(out)
    assert len(stims) == 3 * 2 * 2 * 2 * 2
    assert {s.meta["k"] for s in stims} == {0, 6} and {s.condition for s in stims} == {
        "animate", "control"}
    assert {s.meta["manner_scope"] for s in stims} == {"test"}
    assert "animate/goal=24, control/goal=24" in capsys.readouterr().out


def test_bigtom_family(tmp_path, capsys):
    out = tmp_path / "b.jsonl"
    assert main(["stimuli", "bigtom", "--path", str(BIGTOM), "--out", str(out), "--set",
                 'conditions=["true_belief","false_belief","false_control"]']) == 0
    assert "600 stimuli (false_belief/belief=200, false_control/belief=200, " \
           "true_belief/belief=200)" in capsys.readouterr().out
    assert read_jsonl(out) == load_bigtom(
        BIGTOM, conditions=("true_belief", "false_belief", "false_control"))
    assert main(["stimuli", "bigtom", "--path", str(BIGTOM), "--n", "5"]) == 0
    assert "10 stimuli" in capsys.readouterr().out


def test_user_family_validates_and_converts(tmp_path, capsys):
    src = tmp_path / "mine.csv"
    src.write_text("id,text,option_a,option_b,answer,condition\n"
                   "a,Anna looks in the,box,bag,box,false_belief\n"
                   "b,Anna looks in the,box,bag,1,present\n")
    out = tmp_path / "mine.jsonl"
    assert main(["stimuli", "user", "--path", str(src), "--out", str(out)]) == 0
    line = capsys.readouterr().out
    assert "user: 2 stimuli (false_belief/belief=1, present/belief=1)" in line
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["answer"] for r in rows] == ["box", "bag"]
    assert main(["stimuli", "user", "--path", str(out)]) == 0  # the converted file reads back


def test_errors_exit_2_with_a_message(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "text": "t", "options": ["x", "y"], "answer": "z"}\n')
    assert main(["stimuli", "user", "--path", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"{bad}, line 1, field 'answer'" in err and "Traceback" not in err
    assert main(["stimuli", "user"]) == 2
    assert "needs --path" in capsys.readouterr().err
    assert main(["stimuli", "goal-encoding", "--set", "colour=red"]) == 2
    assert "has no option 'colour'" in capsys.readouterr().err
    assert main(["stimuli", "goal-encoding", "--set", "novalue"]) == 2
    assert "is not KEY=VALUE" in capsys.readouterr().err
    assert main(["stimuli", "goal-encoding", "--path", str(bad)]) == 2
    assert main(["stimuli", "bigtom", "--path", str(tmp_path / "none.csv")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["stimuli", "order-onyl"]) == 2  # one line with the nearest family, not argparse's usage
    err = capsys.readouterr().err
    assert "unknown stimulus family 'order-onyl': did you mean 'order-only'?" in err and "usage:" not in err
