"""`tomlens freetext`: greedy answers on tiny-llama with a coding sheet (cut-off flag, rubric, allowed
values), provenance, determinism, and scoring a filled sheet (the summary `free_text_summary`
computes directly; one error naming the rows of a sheet with invalid codes)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from tomlens.behaviour import epitome as E
from tomlens.behaviour.generate import generate_answers
from tomlens.cli import main
from tomlens.runs import freetext
from tomlens.runs.files import read_finished
from tomlens.stimuli.epitome import strange_stories_items

ITEMS = "1,2,3,4,17,18"  # two mental stories and the first control story (sts-09)


def _answer(out: Path, *extra: str) -> int:
    return main(["freetext", "answer", "--model", "tiny-llama", "--family", "strange-stories", "--out", str(out),
                 "--max-new-tokens", "4", "--items", ITEMS, "--no-progress", *extra])


@pytest.fixture(scope="module")
def answered(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ft") / "run"
    assert _answer(out) == 0
    return out


def test_answer_writes_answers_coding_sheet_and_manifest(answered, load_tiny, capsys):
    sheet = pd.read_csv(answered / "coding.csv", dtype={"code": str})
    answers = pd.read_csv(answered / "answers.csv")
    items = freetext.select_items("strange-stories", ITEMS.split(","))
    assert list(sheet.columns) == E.CODING_COLUMNS
    assert sheet["id"].tolist() == [it.id for it in items] == answers["id"].tolist()
    assert sheet["code"].isna().all()
    # cut_off: true exactly where decoding hit the 4-token limit (most rows, with a random model)
    hit = answers["stop_reason"].isin(["max_new_tokens", "context"])
    assert hit.sum() >= len(hit) // 2
    assert (sheet["cut_off"].astype(str).str.lower() == hit.map({True: "true", False: "false"})).all()
    assert (answers["cut_off"] == hit).all() and (answers.loc[hit, "n_new_tokens"] == 4).all()
    for it, (_, r) in zip(items, sheet.iterrows(), strict=True):
        assert r["rubric"].endswith(it.rubric_text())
        assert r["rubric"].startswith(E.CUT_OFF_NOTE) == (str(r["cut_off"]).lower() == "true")
        assert r["allowed"] == ", ".join(str(k) for k in range(it.max_score + 1)) and r["max_score"] == it.max_score
    # the same answers as generate_answers on the same model, directly
    direct = generate_answers(load_tiny("tiny-llama"), items, max_new_tokens=4, seed=0, progress=False)
    assert answers["answer"].fillna("").tolist() == direct["answer"].tolist()
    # the runs layer's manifest, read back as every stage's is (runs.files.read_finished)
    assert not (answered / "provenance.json").exists()
    _, config, prov, _ = read_finished(answered, freetext.FreeTextConfig)
    assert prov["model"]["model"] == "tiny-llama" and prov["model"]["dtype"] == "float32"
    assert prov["seed"] == 0 and "torch" in prov["versions"] and prov["items"] == [it.id for it in items]
    assert prov["config"]["max_new_tokens"] == 4 and config.max_new_tokens == 4
    assert prov["stimuli_hash"] == freetext.items_hash(items) != freetext.items_hash(items[:-1])
    assert json.loads((answered / "result.json").read_text())["n_cut_off"] == int(hit.sum())
    back = freetext.FreeTextResult.load(answered)
    assert back.config.items == tuple(ITEMS.split(",")) and len(back.answers) == len(items)


def test_answer_says_how_many_prompts_and_how_long_first(tmp_path, capsys):
    assert main(["freetext", "answer", "--model", "tiny-llama", "--family", "short-story", "--out", str(tmp_path),
                 "--max-new-tokens", "2", "--items", "shs-01", "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "generating 1 answers of at most 2 tokens" in err and "roughly" in err


def test_two_runs_give_the_same_answers(answered, tmp_path):
    assert _answer(tmp_path / "again") == 0
    a = pd.read_csv(answered / "answers.csv")
    b = pd.read_csv(tmp_path / "again" / "answers.csv")
    assert a["answer"].fillna("").tolist() == b["answer"].fillna("").tolist()
    assert a["stop_reason"].tolist() == b["stop_reason"].tolist()
    assert (answered / "coding.csv").read_bytes() == (tmp_path / "again" / "coding.csv").read_bytes()


def _filled(answered: Path, tmp_path: Path) -> Path:
    """A copy of the run folder (config.json says which items, manifest.json which model) with codes filled by a rule."""
    run = tmp_path / "coded"
    run.mkdir()
    for name in ("config.json", "manifest.json"):
        (run / name).write_bytes((answered / name).read_bytes())
    sheet = pd.read_csv(answered / "coding.csv", dtype={"code": str})
    # comprehension: right on sts-01 only; justifications: 2, 1 and 0 for the three stories
    codes = {"sts-01-comp": 1, "sts-01-just": 2, "sts-02-comp": 0, "sts-02-just": 1, "sts-09-comp": 0,
             "sts-09-just": 0}
    sheet["code"] = sheet["id"].map(codes)
    sheet.to_csv(run / "coding.csv", index=False)
    return run / "coding.csv"


def test_score_gives_the_summary_free_text_summary_computes(answered, tmp_path, capsys):
    path = _filled(answered, tmp_path)
    capsys.readouterr()
    assert main(["freetext", "score", str(path), "--out", str(tmp_path / "scores"), "--n-boot", "200"]) == 0
    printed = capsys.readouterr().out
    got = pd.read_csv(tmp_path / "scores" / "summary.csv")
    items = freetext.select_items("strange-stories", ITEMS.split(","))
    want = E.free_text_summary(E.import_codes(path, items), n_boot=200, seed=0)
    pd.testing.assert_frame_equal(got, pd.read_csv(io.StringIO(want.to_csv(index=False))))  # as a CSV holds it
    s = got.set_index("cell")
    assert s.loc["comprehension", "value"] == pytest.approx(1 / 3)
    assert s.loc["justification, mental", "value"] == pytest.approx((1.0 + 0.5) / 2)
    assert s.loc["justification, mental, comprehension right", "value"] == 1.0
    assert s.loc["justification, control", "value"] == 0.0 and s.loc["justification, control", "n"] == 1
    assert "justification, mental" in printed and "comprehension" in printed
    meta = json.loads((tmp_path / "scores" / "score.json").read_text())
    assert meta["n_boot"] == 200 and len(meta["sheet_sha256"]) == 64
    # the score names the items (hash of prompts and rubrics) and the model that answered them
    assert meta["stimuli_hash"] == freetext.items_hash(items)
    assert meta["model"]["model"] == "tiny-llama" and meta["answers_config"]["family"] == "strange-stories"


def test_the_printed_next_step_is_a_command_that_works(tmp_path, capsys):
    """`answer` ends by printing the score command; run as printed (DIR filled in) it scores the sheet."""
    out = tmp_path / "run"
    assert main(["freetext", "answer", "--model", "tiny-llama", "--family", "short-story", "--out", str(out),
                 "--max-new-tokens", "2", "--items", "1", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    hint = f"tomlens freetext score {out / 'coding.csv'} --out DIR"
    assert hint in printed
    sheet = pd.read_csv(out / "coding.csv", dtype={"code": str}).assign(code="0")
    sheet.to_csv(out / "coding.csv", index=False)
    argv = hint.replace("DIR", str(tmp_path / "scores")).split()[1:]
    assert main(argv) == 0 and (tmp_path / "scores" / "summary.csv").is_file()


def test_a_sheet_with_invalid_codes_is_one_error_naming_the_rows(answered, tmp_path, capsys):
    path = _filled(answered, tmp_path)
    sheet = pd.read_csv(path, dtype={"code": str})
    sheet.loc[sheet["id"] == "sts-02-just", "code"] = "3"  # above the maximum of 2
    sheet.loc[sheet["id"] == "sts-09-comp", "code"] = ""  # uncoded
    sheet.to_csv(path, index=False)
    capsys.readouterr()
    assert main(["freetext", "score", str(path), "--out", str(tmp_path / "scores")]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "Traceback" not in err
    assert "line 5 (sts-02-just: '3', allowed 0, 1, 2)" in err
    assert "line 6 (sts-09-comp: blank, allowed 0, 1)" in err
    assert not (tmp_path / "scores" / "summary.csv").exists()


def test_a_deleted_row_of_a_partial_export_is_caught_through_its_config(answered, tmp_path, capsys):
    path = _filled(answered, tmp_path)
    pd.read_csv(path).iloc[1:].to_csv(path, index=False)
    assert main(["freetext", "score", str(path), "--out", str(tmp_path / "scores")]) == 2
    assert "missing ['sts-01-comp']" in capsys.readouterr().err


def test_a_bad_item_fails_before_the_model_loads(tmp_path, capsys):
    assert main(["freetext", "answer", "--model", "no-such-model", "--family", "short-story", "--out",
                 str(tmp_path), "--items", "99"]) == 2
    err = capsys.readouterr().err
    assert "'99' is not an item of 'short-story'" in err and "1..13" in err


def test_an_old_sheet_without_cut_off_still_imports(tmp_path):
    items = strange_stories_items()[:2]
    old = pd.DataFrame([{"id": it.id, "family": it.family, "story_id": it.story_id, "kind": it.meta["kind"],
                         "question_type": it.question_type, "question": it.question, "answer": "x",
                         "rubric": it.rubric_text(), "max_score": it.max_score, "code": 1} for it in items])
    old.to_csv(tmp_path / "old.csv", index=False)
    assert E.import_codes(tmp_path / "old.csv", items)["code"].tolist() == [1, 1]
    # an answers table with neither cut_off nor stop_reason says "unknown", never a guess
    E.export_for_coding(old.drop(columns="code"), tmp_path / "sheet.csv")
    assert set(pd.read_csv(tmp_path / "sheet.csv")["cut_off"]) == {"unknown"}
    assert np.all(pd.read_csv(tmp_path / "sheet.csv")["allowed"] == ["0, 1", "0, 1, 2"])


class _Scripted:
    """tiny-llama's tokenizer and config with a scripted greedy choice: step k of an answer puts all
    the probability on `script[k]`, so each stop (newline, EOS, the token limit) is reached on purpose."""

    def __init__(self, base, prompt: str, script: list[int]):
        import torch

        from tomlens.models.tokens import encode

        self._base, self._script, self._torch = base, script, torch
        self._start = int(encode(base, [prompt]).input_ids.shape[1])
        self._vocab = int(base(encode(base, [prompt]).input_ids).shape[-1])

    def __getattr__(self, name):
        return getattr(self._base, name)

    def __call__(self, ids, **kwargs):
        logits = self._torch.zeros(ids.shape[0], ids.shape[1], self._vocab)
        step = ids.shape[1] - self._start
        logits[:, -1, self._script[min(step, len(self._script) - 1)]] = 10.0
        return logits


@pytest.mark.parametrize("ending,reason,cut", [("newline", "stop", False), ("eos", "eos", False),
                                               ("none", "max_new_tokens", True)])
def test_cut_off_is_false_exactly_when_the_answer_ended_itself(load_tiny, tmp_path, ending, reason, cut):
    from tomlens.stimuli.epitome import short_story_items

    base = load_tiny("tiny-llama")
    tok = base.tokenizer
    item = short_story_items()[0]
    words = tok.encode(" She is sad", add_special_tokens=False)
    end = {"newline": tok.encode("\n", add_special_tokens=False)[-1:], "eos": [tok.eos_token_id],
           "none": words}[ending]
    model = _Scripted(base, item.prompt, words + end)
    row = generate_answers(model, [item], max_new_tokens=len(words) + 1, progress=False).iloc[0]
    assert row["stop_reason"] == reason and bool(row["cut_off"]) is cut
    assert row["answer"] == "She is sad" if ending != "none" else row["answer"].startswith("She is sad")
    sheet = E.export_for_coding(pd.DataFrame([row]), tmp_path / "s.csv")
    back = pd.read_csv(sheet, dtype={"cut_off": str}).iloc[0]
    assert back["cut_off"] == ("true" if cut else "false")
    assert back["rubric"].startswith(E.CUT_OFF_NOTE) is cut


def test_cut_off_strings_and_blanks_map_explicitly(tmp_path):
    """A CSV round trip gives "false" strings and blanks: neither may read as cut off."""
    items = strange_stories_items()[:4]
    t = pd.DataFrame([{"id": it.id, "family": it.family, "story_id": it.story_id, "kind": it.meta["kind"],
                       "question_type": it.question_type, "question": it.question, "answer": "x",
                       "rubric": it.rubric_text(), "max_score": it.max_score} for it in items])
    t["cut_off"] = ["false", "true", np.nan, False]
    path = E.export_for_coding(t, tmp_path / "s.csv")
    assert pd.read_csv(path, dtype={"cut_off": str})["cut_off"].tolist() == ["false", "true", "unknown", "false"]
