"""The demo's stages run end to end (on a tiny model here; `make demo` uses the embedded one)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pandas as pd

from tomlens.cli.demo import demo_config, demo_file, main

ROOT = Path(__file__).resolve().parents[1]


def test_demo_writes_every_stage_and_one_report(tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["--model", "tiny-llama", "--out", str(out), "--n", "1", "--probe-tasks", "6", "--n-pairs", "3",
                 "--audit-tasks", "8"]) == 0
    printed = capsys.readouterr().out
    for stage in ("1/5 audit", "2/5 behaviour", "3/5 probes", "4/5 patching", "5/5 report"):
        assert stage in printed
    audit = json.loads((out / "audit" / "audit.json").read_text())
    assert {"order-only", "unexpected-transfer"} <= set(audit["families"]) and audit["verdict"]
    assert len(pd.read_csv(out / "behaviour" / "accuracy.csv")) > 0
    probes = pd.read_csv(out / "probes" / "probes.csv")
    assert set(probes["target"]) == {"protagonist_belief"}  # order-only: world_state is constant there
    assert {"activations", "bag_of_words", "length", "position", "embeddings"} <= set(probes["features"])
    # a random model's best unit, chosen on half the stories, is withheld on the other half
    selection = json.loads((out / "probes" / "selection.json").read_text())["protagonist_belief"]
    assert selection["verdict"] == "withheld" and selection["reason"] and "held-out evaluation" in printed
    # a random model's false-minus-true-belief gap fails the gate: patching is withheld, with its message
    # and the raw per-pair logit differences (issue #10)
    withheld = json.loads((out / "patching" / "summary.json").read_text())["withheld"]
    assert withheld.startswith("withheld:") and withheld in printed
    assert len(pd.read_csv(out / "patching" / "base.csv")) == 3 and not (out / "patching" / "heads.csv").exists()
    assert json.loads((out / "patching" / "summary.json").read_text())["pairs"]["n_aligned"] == 3  # odd --pairs too
    probes_result = json.loads((out / "probes" / "result.json").read_text())
    assert out / "activations" in Path(probes_result["activations"]).parents  # the demo keeps its activations
    report = (out / "report.html").read_text()
    assert "Probes: protagonist belief" in report and "Provenance" in report
    assert "selection-biased maxima" in report and "withheld" in report.split("Probes: protagonist belief")[1][:3000]
    # the patching figures and the ablation validation reach the report, not only the files
    assert "<h2>Patching (withheld: " in report and "Heads at" not in report
    # the title names the model that ran, from its provenance
    assert "<h1>tomlens demo: tiny-llama</h1>" in report and "smollm2" not in report.split("<h1>")[1].split("</h1>")[0]
    # the run folder describes itself: the resolved demo config with the flags applied
    config = json.loads((out / "config.json").read_text())
    assert config["models"][0]["name"] == "tiny-llama" and config["probes"]["stimuli"]["n"] == 6
    assert json.loads((out / "manifest.json").read_text())["models"][0]["model"]["model"] == "tiny-llama"


def test_the_example_demo_file_is_the_packaged_one():
    assert (ROOT / "examples" / "demo.toml").read_text(encoding="utf-8") == demo_file().read_text(encoding="utf-8")
    assert "-m tomlens demo --out demo-out" in (ROOT / "Makefile").read_text()


def test_demo_flags_set_the_pairs_and_the_activation_store(tmp_path):
    args = argparse.Namespace(model="tiny-llama", out=str(tmp_path / "d"), n=1, probe_tasks=5, n_pairs=5, seed=0,
                              prepend_bos=None, audit_tasks=16)
    config = demo_config(args)
    assert config.stage_config("audit", config.models[0]).min_tasks == 16
    pairs = config.stage_config("pairs", config.models[0])
    assert pairs.n == 3 and pairs.max_pairs == 5
    assert config.stage_config("probes", config.models[0]).store == str(tmp_path / "d" / "activations")
