"""The probe sweep on planted activations, its files and figures, and the `tomlens probe` command."""

from __future__ import annotations

import json
import re

import pandas as pd
import pytest
import torch
from helpers import TensorActivations

from tomlens.errors import TomlensError
from tomlens.probes import splits
from tomlens.probes.directions import load_directions
from tomlens.probes.sweep import COLUMNS, ActivationsLike, run_probe_sweep, write_probe_sweep
from tomlens.report import write_figure
from tomlens.report.layers import head_heatmap, layer_figure, write_probe_figures
from tomlens.stimuli import generate, write_jsonl

FAST = dict(folds=3, inner_folds=2, c_grid=(0.1, 1.0), n_boot=200, progress=False, device="cpu")


def probe_sweep(acts, target, **kwargs) -> pd.DataFrame:
    """The tidy table of `run_probe_sweep`."""
    return run_probe_sweep(acts, target, **kwargs).table


def planted_acts(stimuli, seed=0, d=16):
    """resid_post: layer 1 carries the protagonist's belief, layer 2 the world state, layer 0
    nothing; head_out: head 1 of layer 2 carries the belief."""
    g = torch.Generator().manual_seed(seed)
    n = len(stimuli)
    belief = torch.tensor([2.0 * s.belief_is_reference - 1 for s in stimuli])
    world = torch.tensor([2.0 * s.world_is_reference - 1 for s in stimuli])
    resid = torch.randn(n, 3, d, generator=g)
    resid[:, 1, 0] += 2.5 * belief
    resid[:, 2, 3] += 2.5 * world
    heads = torch.randn(n, 3, 2, d, generator=g)
    heads[:, 2, 1, 5] += 2.5 * belief
    acts = TensorActivations(list(stimuli), {("resid_post", "final"): resid, ("head_out", "final"): heads},
                             {"model": {"model": "planted"}})
    assert isinstance(acts, ActivationsLike)
    return acts


@pytest.fixture(scope="module")
def stimuli():
    return generate("unexpected-transfer", n=12, seed=0)  # 12 tasks: the 4 templates' cells recur across folds


@pytest.fixture(scope="module")
def result(stimuli):
    return run_probe_sweep(planted_acts(stimuli), ["protagonist_belief", "world_state"], **FAST)


def pick(table, **kw):
    rows = table
    for k, v in kw.items():
        rows = rows[rows[k] == v]
    return rows


def score(table, **kw):
    rows = pick(table, metric="accuracy", **kw)
    assert len(rows) == 1, kw
    return rows.iloc[0]


def test_sweep_table_is_tidy_and_finds_the_planted_layers(result, stimuli):
    t = result.table
    assert list(t.columns) == COLUMNS
    assert set(t["metric"]) == {"accuracy", "auroc"}
    assert not t.duplicated(["features", "kind", "layer", "head", "target", "train_on", "eval_set", "metric"]).any()
    b = score(t, kind="resid_post", layer=1, target="protagonist_belief", train_on="all", eval_set="all")
    assert b["score"] > 0.85 and b["ci_low"] <= b["score"] <= b["ci_high"]
    # the type-level control is scored on its own labels: planted belief features cannot fit random cell labels
    assert b["selectivity"] > 0.3 and abs(b["control"] - b["control_chance"]) < 0.25
    assert b["control_chance"] == pytest.approx(0.5, abs=0.15)
    assert b["baseline_bow"] == score(t, features="bag_of_words", target="protagonist_belief", train_on="all",
                                      eval_set="all")["score"]
    assert b["best_baseline"] == max(b[c] for c in ("baseline_bow", "baseline_length", "baseline_position"))
    assert b["above_baseline"] == pytest.approx(b["score"] - b["best_baseline"])
    assert b["condition_split"] == b["condition_split"]  # four conditions: a split is decoded (not NaN)
    assert b["n_test"] == len(stimuli) and b["n_test_groups"] == 12 and b["chance"] == pytest.approx(0.5)
    assert b["C"] in (0.1, 1.0)
    noise = score(t, kind="resid_post", layer=0, target="protagonist_belief", train_on="all", eval_set="all")
    assert abs(noise["score"] - 0.5) < 0.2
    w = score(t, kind="resid_post", layer=2, target="world_state", train_on="all", eval_set="all")
    assert w["score"] > 0.85
    heads = pick(t, kind="head_out", target="protagonist_belief", train_on="all", eval_set="all", metric="accuracy")
    best = heads.loc[heads["score"].idxmax()]
    assert (best["layer"], best["head"]) == (2, 1) and len(heads) == 6
    # one row: the train_on / eval sets where belief has one class are dropped (see below)
    assert len(pick(t, features="bag_of_words", target="protagonist_belief", metric="accuracy")) == 1


def test_belief_and_world_probes_come_apart_on_false_belief_stories(result, stimuli):
    t = result.table
    # trained on true-belief stories (belief == world), tested on false-belief stories of held-out tasks
    # belief has one class on false-belief rows of this family: accuracy there is accuracy on one
    # class (baselines tie at 0), so the true -> false-belief rows are dropped with a note
    assert pick(t, target="protagonist_belief", train_on="true_belief").empty
    assert any("eval set false_belief (train_on=true_belief) dropped" in n for n in result.metadata["notes"])
    assert {r["condition"] for r in result.metadata["label_variation"]["protagonist_belief"]} == \
        {s.condition for s in stimuli}
    # belief is one class on false-belief rows: that eval set of the all-condition probe is accuracy on
    # one class (a constant guess scores 0 or 1), so it is dropped with a note
    assert pick(t, target="protagonist_belief", train_on="all", eval_set="false_belief").empty
    assert any("eval set false_belief (train_on=all) dropped" in n for n in result.metadata["notes"])
    # belief never varies on false-belief rows, so that training set is skipped with a note
    assert any("train_on=false_belief skipped" in note for note in result.metadata["notes"])


def test_sweep_writes_table_provenance_directions_and_figures(result, tmp_path):
    out = write_probe_sweep(result, tmp_path / "run")
    table = pd.read_parquet(out / "probes.parquet")
    assert len(table) == len(result.table)
    meta = json.loads((out / "probes.json").read_text())
    prov = meta["provenance"]
    assert prov["model"] == {"model": "planted"} and prov["stimuli_hash"] and prov["config"]["folds"] == 3
    assert "torch" in prov["versions"]
    tensors, dmeta = load_directions(out / "directions.safetensors")
    d = tensors["protagonist_belief/resid_post/final/direction"]
    assert d.shape == (3, 1, 16)
    assert abs(float(d[1, 0, 0])) > 0.8 and int(d[1, 0].abs().argmax()) == 0  # the planted axis
    assert tensors["protagonist_belief/head_out/final/coef"].shape == (3, 2, 1, 16)
    assert "provenance" in dmeta
    figures = write_probe_figures(result.table, out)
    names = {f"{stem}.html" for stem in figures}
    assert all((out / name).is_file() for name in names)
    assert {"layers_resid_post.html", "heads_head_out_protagonist_belief.html"} <= names
    html = (out / "layers_resid_post.html").read_text()
    assert "Plotly.newPlot" in html and len(html) > 1_000_000  # plotly.js inline
    assert not re.search(r"<script[^>]*\bsrc=", html)  # nothing fetched from the network
    fig = layer_figure(result.table, targets=["protagonist_belief"])
    assert any("control task (own labels)" in (tr.name or "") for tr in fig.data)
    assert any("best baseline" in (tr.name or "") for tr in fig.data)
    assert any((tr.name or "").startswith("chance") for tr in fig.data)
    hm = head_heatmap(result.table, target="protagonist_belief", value="selectivity")
    assert hm.data[0].z.shape == (3, 2)
    assert write_figure(hm, tmp_path / "hm.html").exists()
    with pytest.raises(TomlensError):
        layer_figure(result.table, kind="mlp_out")


def test_cross_set_generalisation_and_mass_mean(stimuli):
    other = generate("unexpected-transfer", n=3, seed=7)
    t = probe_sweep(planted_acts(stimuli), "protagonist_belief", sites=("resid_post",),
                    test_acts=planted_acts(other, seed=1), probe="mass_mean", bow=False, **FAST)
    row = score(t, kind="resid_post", layer=1, train_on="all", eval_set="all")
    assert row["score"] > 0.85 and row["n_test"] == len(other) and row["n_train"] == len(stimuli)
    assert row["test_set"].startswith("stimuli:") and row["C"] != row["C"]  # mass-mean has no C
    with pytest.raises(TomlensError, match="share"):
        probe_sweep(planted_acts(stimuli), "protagonist_belief", test_acts=planted_acts(stimuli[:20]), **FAST)
    other_model = planted_acts(other, seed=1)
    other_model.manifest["model"] = {"model": "another-model", "revision": "abc"}
    with pytest.raises(TomlensError, match="same model"):
        probe_sweep(planted_acts(stimuli), "protagonist_belief", test_acts=other_model, **FAST)


def test_holdout_and_template_grouping(stimuli):
    t = probe_sweep(planted_acts(stimuli), "world_state", sites=("resid_post",), evaluation="holdout",
                    group_by="template", controls=False, conditions=False, bow=False, folds=2, inner_folds=2,
                    c_grid=(1.0,), n_boot=100, progress=False, device="cpu")
    row = score(t, kind="resid_post", layer=2, train_on="all", eval_set="all")
    assert row["n_test"] < len(stimuli) and row["control"] != row["control"]  # no control: NaN
    assert set(t["train_on"]) == {"all"}


def test_holdout_evaluation_tests_on_the_split_of_splits_holdout(stimuli, monkeypatch):
    import tomlens.probes.sweep as sweep

    calls = []

    def recorded(groups, test_size, seed):
        calls.append(test_size)
        return splits.holdout(groups, test_size, seed)

    monkeypatch.setattr(sweep, "holdout", recorded)
    t = probe_sweep(planted_acts(stimuli), "world_state", sites=("resid_post",), evaluation="holdout",
                    controls=False, conditions=False, bow=False, **{**FAST, "n_boot": 50})
    groups = splits.group_codes(stimuli, "task")
    split = splits.holdout(groups, 1 / 3, 0)
    assert calls == [1 / 3] and torch.equal(split.test, splits.group_kfold(groups, 3, 0)[0].test)
    assert set(t.loc[t["eval_set"] == "all", "n_test"]) == {int(split.test.numel())}


def test_sites_and_positions_are_the_sweeps_vocabulary(stimuli):
    acts = planted_acts(stimuli)
    result = run_probe_sweep(acts, "protagonist_belief", sites=("resid_post",), positions=("final",),
                             controls=False, conditions=False, bow=False, length=False, position=False,
                             directions=False, **FAST)
    assert set(result.table["kind"]) == {"resid_post"} and set(result.table["position"]) == {"final"}
    assert result.metadata["provenance"]["sites"] == ["resid_post"]
    assert result.metadata["provenance"]["positions"] == ["final"]
    assert "sklearn" in result.metadata["provenance"]["versions"]
    with pytest.raises(TomlensError, match="one position"):
        run_probe_sweep(acts, "protagonist_belief", positions=("final", "protagonist"), **FAST)
    with pytest.raises(TomlensError, match="not one string"):
        run_probe_sweep(acts, "protagonist_belief", sites="resid_post", **FAST)


def test_probe_command_end_to_end_on_a_tiny_model(tmp_path, stimuli):
    from tomlens.cli import main

    path = write_jsonl(stimuli, tmp_path / "ut.jsonl")
    out = tmp_path / "out"
    rc = main(["probe", "--model", "tiny-gpt2", "--stimuli", str(path), "--targets", "protagonist_belief",
               "--out", str(out), "--store", str(tmp_path / "store"), "--folds", "3", "--inner-folds", "2",
               "--c-grid", "0.1", "1", "--n-boot", "100", "--no-progress", "--device", "cpu", "--format", "csv"])
    assert rc == 0
    table = pd.read_csv(out / "probes.csv").fillna({"kind": ""})  # the baseline's empty kind reads as NaN
    assert {"resid_post", "head_out", ""} <= set(table["kind"]) <= {"resid_post", "head_out", "", "resid_pre"}
    assert set(table.loc[table["kind"] == "", "features"]) == {"bag_of_words", "length", "position"}
    act = table[table["features"] == "activations"]
    assert act[["baseline_bow", "baseline_length", "baseline_position", "best_baseline"]].notna().any().all()
    assert (out / "layers_resid_post.html").exists() and (out / "directions.safetensors").exists()
    # the table feeds the per-head table of `tomlens patch` as written
    from tomlens.patching.heads import probe_accuracy_by_head

    per_head = probe_accuracy_by_head(table).set_index(["layer", "head"])
    want = table[(table["kind"] == "head_out") & (table["metric"] == "accuracy") & (table["train_on"] == "all")
                 & (table["eval_set"] == "all")].set_index(["layer", "head"])["score"]
    assert len(per_head) == len(want) > 0
    assert per_head["probe_accuracy"].sort_index().tolist() == want.sort_index().tolist()  # the same numbers, copied
    # belief is one class on false-belief rows here: that eval set is dropped, so no such column
    assert "probe_accuracy_false_belief" not in per_head
    assert main(["probe", "--model", "tiny-gpt2", "--stimuli", str(path), "--targets", "belief",
                 "--out", str(out)]) == 2
