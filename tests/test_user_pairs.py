"""A researcher's own stories as minimal pairs: grouping by task, role spans found or named as
missing, every error with its cause, the CLI, the pairs stage's config and an experiment's [pairs]."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tomlens.cli import main
from tomlens.errors import TomlensError
from tomlens.runs.pairs import PairsConfig, PairsResult
from tomlens.stimuli.pairs import make_pairs, read_pairs
from tomlens.stimuli.records import Span
from tomlens.stimuli.user import load_user_file, write_user_csv
from tomlens.stimuli.user_pairs import (
    FILLED,
    MISSING,
    fill_role_spans,
    query_span,
    read_user_pairs,
    role_span_report,
    user_pairs,
)

pytestmark = pytest.mark.unit

DOC = Path(__file__).resolve().parents[1] / "docs" / "stimulus-format.md"
WHO = {"protagonist": "Anna", "object": "key"}


def _row(rid: str, task: str, condition: str, text: str, answer: str, options: tuple[str, str] = ("drawer", "box"),
         **extra: object) -> dict:
    return {"id": rid, "task_id": task, "condition": condition, "text": text, "options": list(options),
            "answer": answer, **extra}


def _stories() -> list[dict]:
    """Five tasks told twice, the versions of different lengths and word order; what each row gives
    differs (see the comments), and task `anna` also has an `informed` version and a reality row."""
    q = " Anna comes back. Anna will look for the key in the"
    fb, tb, inf = ("While Anna is out, her brother moves the key from the drawer to the box.",
                   "Anna watches her brother move the key from the drawer to the box.",
                   "Her brother moves the key from the drawer to the box and texts Anna about it.")
    ben_q = "\nQuestion: Where will Ben look for the ball?\nAnswer: Ben will look in the"
    cara_fb = "Cara hides the coin under the cup. Dr. Ng swaps the coin to the bowl while Cara naps. Cara lifts the"
    cara_tb = "Cara hides the coin under the cup. Cara sees Dr. Ng put the coin in the bowl. Cara lifts the"
    return [
        # anna: contrast spans as substrings, names in meta
        _row("anna-fb", "anna", "false_belief", f"Anna puts the key in the drawer. {fb}{q}", "drawer",
             spans={"contrast": fb}, meta=WHO),
        _row("anna-tb", "anna", "true_belief", f"Anna puts the key in the drawer. {tb}{q}", "box",
             spans={"contrast": tb}, meta=WHO),
        _row("anna-inf", "anna", "informed", f"Anna puts the key in the drawer. {inf}{q}", "box",
             spans={"contrast": inf}, meta=WHO),
        _row("anna-where", "anna", "false_belief", "Anna puts the key in the drawer. Where is the key now? In the",
             "box", prompt_type="reality"),
        # ben: a Question/Answer prompt, no contrast span (never guessed), names in CSV-style meta
        _row("ben-fb", "ben", "false_belief", f"Ben leaves his ball in the basket. Li moves it to the crate while Ben sleeps.{ben_q}",
             "basket", options=("basket", "crate"), meta={"protagonist": "Ben", "object": "ball"}),
        _row("ben-tb", "ben", "true_belief", f"Ben leaves his ball in the basket. Ben sees Li move it to the crate.{ben_q}",
             "crate", options=("basket", "crate"), meta={"protagonist": "Ben", "object": "ball"}),
        # cara: every span given as offsets or substrings (nothing to fill but the question's mentions)
        _row("cara-fb", "cara", "false_belief", cara_fb, "cup", options=("cup", "bowl"),
             spans={"protagonist": "Cara", "object": "coin", "contrast": "Dr. Ng swaps the coin to the bowl while Cara naps.",
                    "query": [cara_fb.index("Cara lifts"), len(cara_fb)]}),
        _row("cara-tb", "cara", "true_belief", cara_tb, "bowl", options=("cup", "bowl"),
             spans={"protagonist": "Cara", "object": "coin", "contrast": "Cara sees Dr. Ng put the coin in the bowl.",
                    "query": [cara_tb.index("Cara lifts"), len(cara_tb)]}),
        # dan: the control lists the options the other way round
        _row("dan-fb", "dan", "false_belief", "Dan puts the pen in the desk. Mia moves the pen to the shelf while Dan is out. "
             "Dan will look for the pen in the", "desk", options=("desk", "shelf"),
             spans={"contrast": "Mia moves the pen to the shelf while Dan is out."}, meta={"protagonist": "Dan", "object": "pen"}),
        _row("dan-tb", "dan", "true_belief", "Dan puts the pen in the desk. Dan watches Mia move the pen to the shelf. "
             "Dan will look for the pen in the", "shelf", options=("shelf", "desk"),
             spans={"contrast": "Dan watches Mia move the pen to the shelf."}, meta={"protagonist": "Dan", "object": "pen"}),
        # eve: no object named anywhere, and a question that says "she"
        _row("eve-fb", "eve", "false_belief", "Eve puts the cake in the fridge. Tom moves it to the oven while Eve is away. "
             "She will look for it in the", "fridge", options=("fridge", "oven"),
             spans={"contrast": "Tom moves it to the oven while Eve is away."}, meta={"protagonist": "Eve"}),
        _row("eve-tb", "eve", "true_belief", "Eve puts the cake in the fridge. Eve sees Tom move it to the oven. "
             "She will look for it in the", "oven", options=("fridge", "oven"),
             spans={"contrast": "Eve sees Tom move it to the oven."}, meta={"protagonist": "Eve"}),
    ]


def _write(tmp_path: Path, rows: list[dict], name: str = "stories.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def stories(tmp_path: Path) -> Path:
    return _write(tmp_path, _stories())


def _by_id(pairs: list) -> dict:
    return {p.id: p for p in pairs}


# -- pairs and their spans ---------------------------------------------------------------------------------
def test_five_tasks_give_five_role_aligned_pairs(stories):
    built = read_user_pairs(stories)
    pairs = list(built.pairs)
    assert [p.id for p in pairs] == ["anna-true_belief", "ben-true_belief", "cara-true_belief", "dan-true_belief",
                                     "eve-true_belief"]
    assert built.conditions == ("true_belief", "informed")
    for p in pairs:
        assert (p.family, p.contrast, p.alignment) == ("user", "true_belief", "roles")
        assert p.clean.condition == "false_belief" and p.corrupted.condition == "true_belief"
        assert p.clean.options == p.corrupted.options and p.clean.answer != p.other_answer
        assert len(p.clean.text) != len(p.corrupted.text)  # worded differently: never token-aligned
    assert _by_id(pairs)["anna-true_belief"].clean.answer == "drawer"
    dan = _by_id(pairs)["dan-true_belief"]
    assert dan.corrupted.options == ("desk", "shelf") and dan.corrupted.answer == "shelf"
    assert any("dan-tb's options put in dan-fb's order" in n for n in built.notes)
    assert any("1 row(s) with prompt_type other than belief" in n for n in built.notes)
    assert user_pairs(stories) == pairs


def test_spans_are_found_from_the_row_and_recorded(stories):
    pairs = _by_id(user_pairs(stories))
    anna = pairs["anna-true_belief"]
    for s in (anna.clean, anna.corrupted):
        assert s.span_text("query") == "Anna will look for the key in the"
        q = s.spans["query"]
        assert s.spans["query_protagonist"] == Span(q.start, q.start + 4)  # the question's own "Anna"
        assert s.span_text("query_object") == "key" and q.start < s.spans["query_object"].start
        assert s.spans["protagonist"] == Span(0, 4) and s.span_text("object") == "key"
        assert set(s.meta[FILLED]) == {"query", "query_protagonist", "query_object", "protagonist", "object"}
        assert MISSING not in s.meta and s.meta["protagonist"] == "Anna"  # the row's own meta is kept
    assert anna.clean.spans["query"].start != anna.corrupted.spans["query"].start  # each story's own offsets
    ben = pairs["ben-true_belief"].clean
    assert ben.span_text("query") == "Question: Where will Ben look for the ball?\nAnswer: Ben will look in the"
    assert ben.spans["query_protagonist"].start == ben.text.rindex("Ben")  # the last mention in the query
    assert ben.span_text("query_object") == "ball" and "contrast" not in ben.spans
    assert "does not guess" in ben.meta[MISSING]["contrast"]
    cara = pairs["cara-true_belief"].corrupted
    assert set(cara.meta[FILLED]) == {"query_protagonist"}  # the rest was given, or is not in the question
    assert cara.span_text("query") == "Cara lifts the" and cara.span_text("query_protagonist") == "Cara"
    assert "'coin' (spans.object) does not occur in the query" in cara.meta[MISSING]["query_object"]
    eve = pairs["eve-true_belief"].clean
    assert "'Eve' (meta.protagonist) does not occur in the query" in eve.meta[MISSING]["query_protagonist"]
    assert "no object span and no meta.object" in eve.meta[MISSING]["object"]
    assert {"object", "query_object"} <= set(eve.meta[MISSING]) and "query_object" not in eve.spans


def test_the_span_report_counts_given_filled_and_missing(stories):
    report = role_span_report(user_pairs(stories))
    counts = {r.role: r for r in report.roles}
    assert report.stories == 10
    assert (counts["contrast"].given, counts["contrast"].filled, counts["contrast"].missing) == (8, 0, ("ben-fb", "ben-tb"))
    assert (counts["query"].given, counts["query"].filled) == (2, 8)
    assert counts["query_object"].missing == ("cara-fb", "cara-tb", "eve-fb", "eve-tb")
    assert counts["query_protagonist"].missing == ("eve-fb", "eve-tb") and counts["query_protagonist"].filled == 8
    assert report.missing_roles == ("contrast", "query_protagonist", "query_object", "object")
    text = "\n".join(report.lines())
    assert "contrast" in text and "missing in 2 (ben-fb, ben-tb): not given" in text


def test_a_row_that_gives_every_span_is_left_as_it_is(stories):
    s = load_user_file(stories)[0]
    full = fill_role_spans(s)
    assert fill_role_spans(full.with_(meta={})).spans == full.spans
    assert fill_role_spans(full.with_(meta={})).meta == {}


def test_contrasts_pick_the_conditions_and_n_the_tasks(stories, capsys):
    pairs = user_pairs(stories, contrasts=["informed"])
    assert [p.id for p in pairs] == ["anna-informed"] and pairs[0].contrast == "informed"
    assert "note: task 'ben' has no informed belief row: no pair from it" in capsys.readouterr().out
    both = user_pairs(stories, contrasts=("true_belief", "informed"), n=2)
    assert [p.id for p in both] == ["anna-true_belief", "anna-informed", "ben-true_belief"]
    assert both[0].clean is both[1].clean  # one clean story, filled once, for both controls


# -- the query rule ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, query", [
    ("Anna comes back. Anna will look for the key in the", "Anna will look for the key in the"),
    ("Anna comes back. Where will Anna look for the key?  ", "Where will Anna look for the key?"),
    ("Mr. Li comes back. Mr. Li will look in the", "Mr. Li will look in the"),
    ("Li hid it. Where is it?\nAnswer:", "Where is it?\nAnswer:"),
    ("Li hid it. Where is it? A: It is in the", "Where is it? A: It is in the"),
    ("Li hid it.\nNote: Li will look in the", "Note: Li will look in the"),  # no question before the label
    ('She said "Go." Li will look in the', "Li will look in the"),
    ("Li will look in the", "Li will look in the"),
    ("Li hid it. Where will Anna look? In the", "Where will Anna look? In the"),  # the question, not "In the"
])
def test_the_query_is_the_final_sentence(text, query):
    span = query_span(text)
    assert span is not None and span.of(text) == query
    assert query_span("  \n") is None


def test_the_query_rule_finds_the_built_in_families_own_queries():
    """Every generated family's and BigToM's query span is the one the rule finds, so a user's file
    written like them gets the same positions."""
    for family in ("unexpected-transfer", "unexpected-contents", "order-only", "kosoy"):
        pairs, _ = make_pairs(family, 3, 0)
        for s in (x for p in pairs for x in (p.clean, p.corrupted)):
            assert query_span(s.text) == s.spans["query"], (family, s.id)
    text = ("Noor fills a pitcher with oat milk. A coworker swaps it for almond milk.\nQuestion: Does Noor believe the "
            "milk pitcher contains oat milk or almond milk?\nAnswer: Noor believes the milk pitcher contains")
    assert query_span(text).of(text).startswith("Question: Does Noor")


# -- errors ------------------------------------------------------------------------------------------------
def _error(tmp_path: Path, rows: list[dict], **kwargs: object) -> TomlensError:
    with pytest.raises(TomlensError) as e:
        user_pairs(_write(tmp_path, rows), **kwargs)
    return e.value


def test_rows_without_task_or_condition_are_named(tmp_path):
    rows = _stories()
    del rows[4]["task_id"]
    e = _error(tmp_path, rows)
    assert "stories.jsonl" in e.problem and "no task_id" in e.problem and "ben-fb" in e.problem
    assert "task_id" in e.fix
    rows = _stories()
    del rows[5]["condition"]
    e = _error(tmp_path, rows)
    assert "no condition" in e.problem and "ben-tb" in e.problem and "false_belief" in e.fix


def test_a_task_without_one_false_belief_story_is_named(tmp_path):
    rows = _stories()
    rows[4]["condition"] = "true_belief"
    e = _error(tmp_path, rows)
    assert "task 'ben' has no false_belief belief row" in e.problem and "ben-fb (true_belief)" in e.problem
    e = _error(tmp_path, [*_stories(), _row("anna-fb2", "anna", "false_belief", "Anna looks in the", "drawer")])
    assert "task 'anna' has 2 belief rows with condition 'false_belief'" in e.problem and "anna-fb2" in e.problem


def test_a_contrast_no_task_has_lists_the_files_conditions(tmp_path):
    e = _error(tmp_path, _stories(), contrasts=["informd"])
    assert "no task has a belief row with condition 'informd': did you mean 'informed'?" in e.problem
    assert "true_belief, informed" in e.problem and "--contrast" in e.fix
    e = _error(tmp_path, _stories(), contrasts=["false_belief"])
    assert "clean story's condition" in e.problem
    only_clean = [r for r in _stories() if r["condition"] == "false_belief"]
    e = _error(tmp_path, only_clean)
    assert "every belief row is false_belief" in e.problem and "true_belief" in e.fix


def test_stories_with_different_options_are_refused(tmp_path):
    rows = _stories()
    rows[9]["options"] = ["shelf", "drawer"]
    e = _error(tmp_path, rows)
    assert "task 'dan'" in e.problem and "'dan-fb' and 'dan-tb' have different options" in e.problem
    assert "same two options" in e.fix


def test_a_file_without_pairs_is_refused(tmp_path):
    reality = [_row("r1", "t", "false_belief", "Where is the key? In the", "box", prompt_type="reality")]
    e = _error(tmp_path, reality)
    assert "no belief row" in e.problem and "no pair" in e.problem


def test_a_csv_file_gives_the_same_pairs(stories, tmp_path):
    csv_path = write_user_csv(load_user_file(stories), tmp_path / "stories.csv")
    assert user_pairs(csv_path) == user_pairs(stories)


def test_the_documented_example_builds_two_pairs(tmp_path):
    section = DOC.read_text().split("## Your own stories as minimal pairs", 1)[1]
    block = re.search(r"```jsonl\n(.*?)```", section, re.S).group(1)
    pairs = user_pairs(_write(tmp_path, [json.loads(x) for x in block.splitlines() if x.strip()]))
    assert [p.id for p in pairs] == ["key-true_belief", "ball-true_belief"]
    report = role_span_report(pairs)
    assert report.missing_roles == () and all(r.given + r.filled == 4 for r in report.roles)
    assert all(p.clean.span_text("query") == p.corrupted.span_text("query") for p in pairs)


# -- through make_pairs, the pairs stage and the CLI -----------------------------------------------------
@pytest.fixture(scope="module")
def tok():
    from tomlens.runs.base import ModelSpec

    return ModelSpec("tiny-gpt2").load_tokenizer()  # the SmolLM2 tokenizer (no weights)


def test_make_pairs_keeps_role_aligned_pairs_for_a_tokenizer(stories, tok):
    pairs, report = make_pairs("user", None, tokenizer=tok, path=stories)
    assert [p.id for p in pairs] == [p.id for p in user_pairs(stories)]
    assert report.aligned == report.total == 5 and report.family == "user"
    two, _ = make_pairs("user", 2, tokenizer=tok, path=stories, contrasts=("true_belief", "informed"))
    assert [p.id for p in two] == ["anna-true_belief", "anna-informed", "ben-true_belief"]


def test_the_pairs_config_takes_a_file_and_its_own_conditions(stories):
    config = PairsConfig(family="user", path=str(stories), contrasts=("informed", "my_own_condition"))
    assert config.contrasts == ("informed", "my_own_condition") and config.n_resolved is None
    with pytest.raises(TomlensError, match="`tomlens pairs user` needs --path") as e:
        PairsConfig(family="user")
    assert "docs/stimulus-format.md" in e.value.fix
    with pytest.raises(TomlensError, match="take no generator options"):
        PairsConfig(family="user", path=str(stories), options={"decoys": False})
    with pytest.raises(TomlensError, match="for `bigtom` and `user`"):
        PairsConfig(family="order-only", path=str(stories))
    with pytest.raises(TomlensError, match="did you mean 'present'"):
        PairsConfig(family="unexpected-transfer", contrasts=("presnt",))


def test_cli_writes_role_aligned_pairs_and_says_which_spans_are_missing(stories, tmp_path, capsys):
    out = tmp_path / "pairs.jsonl"
    assert main(["pairs", "user", "--path", str(stories), "--model", "tiny-gpt2", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "5 pairs role-aligned" in printed and "patches them at role positions" in printed
    assert "query_object       given 0, filled 6, missing in 4 (cara-fb, cara-tb, eve-fb, eve-tb)" in printed
    assert "contrast           given 8, filled 0, missing in 2 (ben-fb, ben-tb)" in printed
    assert "note: task 'dan'" in printed and f"wrote 5 pairs to {out}" in printed
    pairs = read_pairs(out)
    assert [p.alignment for p in pairs] == ["roles"] * 5 and pairs == user_pairs(stories)
    assert all(json.loads(line)["alignment"] == "roles" for line in out.read_text().splitlines())
    report = json.loads((tmp_path / "pairs.report.json").read_text())
    assert report["family"] == "user" and report["path"] == str(stories) and report["aligned"] == 5
    loaded = PairsResult.load(out)  # a pairs file read back keeps its settings and its alignment
    assert loaded.config.path == str(stories) and loaded.pairs == pairs
    assert "role-aligned" in loaded.describe()
    # a free-form contrast, checked against the file: one line with the nearest, nothing written
    bad = tmp_path / "bad.jsonl"
    assert main(["pairs", "user", "--path", str(stories), "--contrast", "informd", "--model", "tiny-gpt2",
                 "--out", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "did you mean 'informed'?" in err and "usage:" not in err and not bad.exists()
    assert main(["pairs", "user", "--model", "tiny-gpt2", "--out", str(bad)]) == 2
    assert "needs --path" in capsys.readouterr().err


def test_no_usable_pair_names_the_cause(tmp_path, capsys):
    rows = [_row("a-fb", "a", "false_belief", "Ann hid it. Ann looks at 5 AM, at", "5 AM", options=("5 AM", "3 AM")),
            _row("a-tb", "a", "true_belief", "Ann saw it. Ann looks at 5 AM, at", "3 AM", options=("5 AM", "3 AM"))]
    path = _write(tmp_path, rows)
    assert main(["pairs", "user", "--path", str(path), "--model", "tiny-gpt2", "--out", str(tmp_path / "p.jsonl")]) == 2
    err = capsys.readouterr().err
    assert "no user pair from" in err and "is usable for tiny-gpt2's tokenizer (1 x options_share_first_token)" in err
    assert "options whose first tokens differ" in err


# -- an experiment's [pairs] table -----------------------------------------------------------------------
def _experiment(folder: Path, path: str) -> Path:
    toml = folder / "own.toml"
    toml.write_text(f'name = "own"\n[model]\nname = "tiny-gpt2"\n[pairs]\nfamily = "user"\npath = "{path}"\n'
                    'contrasts = ["informed"]\n')
    return toml


def test_an_experiment_builds_pairs_from_the_users_file(tmp_path, capsys):
    from tomlens.runs.experiment import ExperimentConfig

    stories = _write(tmp_path, _stories(), name="my.jsonl")
    toml = _experiment(tmp_path, str(stories))
    config = ExperimentConfig.load(toml)
    pairs_config = config.stage_config("pairs", config.models[0])
    assert (pairs_config.family, pairs_config.path, pairs_config.contrasts) == ("user", str(stories), ("informed",))
    out = tmp_path / "out"
    assert main(["run", str(toml), "--out", str(out), "--no-progress"]) == 0
    assert "1 pair role-aligned" in capsys.readouterr().out
    (pair,) = read_pairs(out / "pairs" / "pairs.jsonl")
    assert (pair.id, pair.alignment) == ("anna-informed", "roles")
    # a contrast is checked against the file when the stage reads it, before any tokenizer loads
    typo = ExperimentConfig.load(toml, ['pairs.contrasts=["informd"]'])
    assert typo.stage_config("pairs", config.models[0]).contrasts == ("informd",)
    assert main(["run", str(toml), "--out", str(tmp_path / "o2"), "--set", 'pairs.contrasts=["informd"]']) == 2
    assert "did you mean 'informed'?" in capsys.readouterr().err
    assert not (tmp_path / "o2").exists()  # refused before anything is written


def test_an_experiments_relative_path_is_read_from_the_experiments_folder(tmp_path, monkeypatch):
    from tomlens.runs.experiment import ExperimentConfig

    study = tmp_path / "study"
    study.mkdir()
    _write(study, _stories(), name="my.jsonl")
    toml = _experiment(study, "my.jsonl")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # a relative path is the experiment file's, not the shell's
    config = ExperimentConfig.load(toml)
    path = config.stage_config("pairs", config.models[0]).path
    assert Path(path).resolve() == (study / "my.jsonl").resolve()
    assert Path(path).is_absolute()  # the same run, whatever folder it is started from


def test_an_experiment_written_for_the_working_folder_rule_still_finds_its_file(tmp_path, monkeypatch, caplog):
    """A relative path that is not beside the experiment file but is in the folder tomlens runs in
    (the rule before) is read from there, with a line saying to write it relative to the file."""
    from tomlens.runs.experiment import ExperimentConfig

    (tmp_path / "examples").mkdir()
    _write(tmp_path / "examples", _stories(), name="my.jsonl")
    toml = _experiment(tmp_path / "examples", "examples/my.jsonl")
    monkeypatch.chdir(tmp_path)
    with caplog.at_level("WARNING", logger="tomlens"):
        config = ExperimentConfig.load(toml)
    path = config.stage_config("pairs", config.models[0]).path
    assert Path(path) == (tmp_path / "examples" / "my.jsonl").resolve()
    assert "read from the file's own folder" in caplog.text
