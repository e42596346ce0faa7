"""Every single command (`tomlens behave`, `probe`, `patch`, `steer`) writes `report.html` into its
--out folder beside its tables: the stage's findings first, its sections, titled with the model."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from helpers import short_pairs

from tomlens.cli import main
from tomlens.stimuli import generate
from tomlens.stimuli.pairs import write_pairs
from tomlens.stimuli.records import write_jsonl

pytestmark = pytest.mark.integration


def _page(out: Path, command: str, model: str, heading: str) -> str:
    text = (out / "report.html").read_text()
    assert re.search(rf"<h1>tomlens {command}: {re.escape(model)}</h1>", text), text[:2000]
    assert text.index("<h2 id='findings'>") < text.index(f"<h2>{heading}")
    assert "<script src=" not in text and "<h2 id='provenance'>" in text
    return text


def test_behave_writes_a_report_with_its_tables_collapsed(tmp_path, capsys):
    stimuli = write_jsonl(generate("order-only", n=2, seed=0), tmp_path / "s.jsonl")
    out = tmp_path / "b"
    assert main(["behave", "--model", "tiny-gpt2", "--stimuli", str(stimuli), "--out", str(out), "--n-boot", "20",
                 "--no-progress", "--no-prepend-bos"]) == 0
    assert f"wrote {out / 'report.html'}" in capsys.readouterr().out
    text = _page(out, "behave", "tiny-gpt2 (no bos)", "Behaviour")
    assert "<details><summary>accuracy per family, condition and prompt type" in text
    assert "class='finding withheld'" in text and "order-only" in text


def test_probe_writes_a_report_with_its_figures(tmp_path):
    stimuli = write_jsonl(generate("order-only", n=6, seed=0), tmp_path / "s.jsonl")
    out = tmp_path / "p"
    assert main(["probe", "--model", "tiny-gpt2", "--stimuli", str(stimuli), "--out", str(out), "--sites", "resid_post",
                 "--folds", "2", "--inner-folds", "2", "--c-grid", "1.0", "--n-boot", "20", "--permutations", "20",
                 "--no-random-twin", "--store", str(tmp_path / "store"), "--no-progress", "--format", "csv"]) == 0
    text = _page(out, "probe", "tiny-gpt2", "Probes")
    assert text.count('class="plotly-graph-div"') >= 1 and "probes</span>" in text


def test_patch_writes_a_report_even_when_forced(load_tiny, tmp_path):
    pairs = write_pairs(short_pairs(load_tiny("tiny-gpt2").tokenizer, 3), tmp_path / "pairs.jsonl")
    out = tmp_path / "x"
    assert main(["patch", "--model", "tiny-gpt2", "--pairs", str(pairs), "--method", "exact", "--sites", "heads",
                 "--positions", "final", "--top-k", "2", "--n-random", "2", "--ks", "1,2", "--out", str(out),
                 "--no-progress", "--format", "csv", "--force"]) == 0
    text = _page(out, "patch", "tiny-gpt2", "Patching (forced past its gate: not a result)")
    assert "patching</span>" in text and "class='finding withheld'" in text


def test_steer_writes_a_report_with_its_dose_figures(tmp_path):
    out = tmp_path / "s"
    assert main(["steer", "--model", "tiny-llama", "--n", "4", "--layers", "1", "--alphas=-2,0,2", "--n-random", "3",
                 "--store", str(tmp_path / "store"), "--no-progress", "--out", str(out)]) == 0
    text = _page(out, "steer", "tiny-llama", "Steering along the belief direction")
    assert text.count('class="plotly-graph-div"') == 2 and "steering</span>" in text
