"""`tomlens patch` end to end on a tiny model: tables, summary with provenance, offline figures."""

from __future__ import annotations

import json

import pandas as pd
import pytest
from helpers import probe_table, short_pairs

from tomlens.cli import main
from tomlens.stimuli.pairs import write_pairs


def test_patch_cli_end_to_end(load_tiny, tmp_path, capsys):
    tok = load_tiny("tiny-gpt2").tokenizer
    pairs_file = write_pairs(short_pairs(tok, 3), tmp_path / "pairs.jsonl")
    probe_file = tmp_path / "probe.csv"
    probe_table().to_csv(probe_file, index=False)
    out = tmp_path / "out"
    code = main([
        "patch", "--model", "tiny-gpt2", "--pairs", str(pairs_file), "--method", "both",
        "--sites", "heads,resid", "--positions", "all,final", "--top-k", "2", "--n-random", "2",
        "--probe-table", str(probe_file), "--out", str(out), "--no-progress", "--format", "csv", "--force",
    ])  # a random model's gap fails the gate, and 3 pairs cannot be split: forced, every output flagged
    assert code == 0
    printed = capsys.readouterr().out
    assert "3 pairs" in printed and "top heads" in printed and "Spearman" in printed and "FORCED" in printed
    assert "plan (3 pairs" in printed and "estimated" in printed

    summary = json.loads((out / "summary.json").read_text())
    prov = summary["provenance"]
    assert prov["model"] == "tiny-gpt2" and prov["revision"] and set(prov["versions"]) >= {"tomlens", "torch", "transformer_lens"}
    assert summary["seed"] == 0 and len(summary["pairs"]["hash"]) == 16 and summary["pairs"]["n_aligned"] == 3
    assert "logit_diff" in summary["metric"] and "contrast" in summary["corruption"]
    assert {c["kind"] for c in summary["comparisons"]} == {"head", "resid_pre"}
    assert len(summary["topk"]) == 2 and summary["ablation"]["mode"] == "final"
    assert summary["positions"] == {"head": ["all", "final"], "resid_pre": ["each", "final"]}
    assert summary["rank_position"] == "all" and summary["plan"]["total_runs"] > 0
    assert summary["forced"] is True and summary["forced_message"].startswith("FORCED")
    assert summary["pairs"]["evaluation"]["same_as_selection"] and summary["topk"][0]["n_random"] == 2

    cells = pd.read_csv(out / "cells_exact_denoise.csv")
    assert set(cells.kind) == {"head", "resid_pre"} and set(cells.position) >= {"all", "each", "final"}
    assert {"effect", "se", "ci_low", "ci_high", "n_pairs", "logit_diff"} <= set(cells.columns)
    per_pair = pd.read_csv(out / "pairs_attribution_denoise.csv")
    assert set(per_pair.pair_id) == {"p0", "p1", "p2"}
    heads = pd.read_csv(out / "heads.csv")
    assert len(heads) == 8 and {"patch_effect", "attribution_effect", "probe_accuracy"} <= set(heads.columns)
    for name in ("topk", "topk_random", "ablation", "ablation_random"):
        assert len(pd.read_csv(out / f"{name}.csv")) > 0
    for name in summary["files"]:
        assert pd.read_csv(out / name)["forced"].all(), name
    figures = sorted(p.name for p in (out / "figures").iterdir())
    assert figures == [
        "attribution_vs_exact_denoise.html", "heads_attribution_denoise.html", "heads_exact_denoise.html",
        "heads_final_attribution_denoise.html", "heads_final_exact_denoise.html",
        "resid_pre_attribution_denoise.html", "resid_pre_exact_denoise.html",
        "resid_pre_positions_attribution_denoise.html", "resid_pre_positions_exact_denoise.html",
        "resid_pre_roles_attribution_denoise.html", "resid_pre_roles_exact_denoise.html",  # role-aligned "each"
        "topk_recovery.html",
    ]
    html = (out / "figures" / "heads_exact_denoise.html").read_text()
    assert "FORCED (gate failed): " in html
    assert "plotly" in html and '<script src="https://cdn' not in html  # plotly.js inlined, no network
    assert sorted(summary["files"]) == sorted(p.name for p in out.iterdir() if p.suffix == ".csv")
    assert json.loads((out / "result.json").read_text()) == summary
    config = json.loads((out / "config.json").read_text())
    assert config["pairs_path"] == str(pairs_file) and config["sites"] == ["heads", "resid"]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["model"]["model"] == "tiny-gpt2" and manifest["pairs_hash"] == summary["pairs"]["hash"]


def test_patch_cli_withholds_when_the_gate_fails(load_tiny, tmp_path, capsys):
    load_tiny("tiny-llama")  # built offline once per session
    pairs_file = tmp_path / "pairs.jsonl"
    assert main(["pairs", "unexpected-transfer", "--model", "tiny-llama", "--n", "3", "--contrast", "present", "--out",
                 str(pairs_file)]) == 0
    out = tmp_path / "out"
    code = main(["patch", "--model", "tiny-llama", "--pairs", str(pairs_file), "--sites", "heads", "--positions",
                 "final", "--ks", "1,2", "--out", str(out), "--no-progress", "--format", "csv"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "withheld: head ranking" in printed and "lower bound" in printed and "power" in printed
    assert "plan (" not in printed
    summary = json.loads((out / "summary.json").read_text())
    assert summary["withheld"].startswith("withheld:") and summary["gate"]["passed"] == []
    assert sorted(summary["files"]) == ["base.csv", "gate.csv"] and not (out / "figures").exists()
    base = pd.read_csv(out / "base.csv")
    assert len(base) == 6 and base.gap.tolist() == pytest.approx((base.clean_logit_diff - base.corrupted_logit_diff).tolist())
    code = main(["patch", "--model", "tiny-llama", "--pairs", str(pairs_file), "--ks", "1,x",
                 "--out", str(tmp_path / "o"), "--no-progress"])
    assert code == 2 and "whole numbers" in capsys.readouterr().err


def test_patch_cli_user_errors(load_tiny, tmp_path, capsys):
    tok = load_tiny("tiny-gpt2").tokenizer
    pairs_file = write_pairs(short_pairs(tok, 1), tmp_path / "pairs.jsonl")
    code = main(["patch", "--model", "tiny-gpt2", "--pairs", str(pairs_file), "--sites", "neurons",
                 "--out", str(tmp_path / "o"), "--no-progress"])
    assert code == 2 and "unknown patching site 'neurons'" in capsys.readouterr().err
    code = main(["patch", "--model", "tiny-gpt2", "--pairs", str(tmp_path / "missing.jsonl"),
                 "--out", str(tmp_path / "o"), "--no-progress"])
    assert code == 2 and "does not exist" in capsys.readouterr().err
    code = main(["patch", "--model", "tiny-gpt2", "--pairs", str(pairs_file), "--positions", "nowhere",
                 "--out", str(tmp_path / "o"), "--no-progress", "--top-k", "0"])
    err = capsys.readouterr().err
    assert code == 2 and "nowhere" in err
    assert not (tmp_path / "o" / "summary.json").exists()
