"""`tomlens compare`: runs of models with different layer counts side by side on relative depth,
patching effects normalised per model, withheld results never listed as found, missing models and
stages reported, the CLI end to end and bad folders refused with exit 2."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from tomlens.cli import main
from tomlens.errors import TomlensError
from tomlens.report.compare import compare_findings, write_compare_report
from tomlens.runs.compare import NORMALISED, CompareResult, compare_runs, relative_depth
from tomlens.runs.compare_summary import CompareSummary
from tomlens.runs.experiment import ExperimentConfig, run_experiment

pytestmark = pytest.mark.integration

STAGES = {
    "behaviour": {"stimuli": [{"family": "order-only", "n": 2}], "n_boot": 20},
    "probes": {"stimuli": {"family": "order-only", "n": 6, "seed": 1}, "sites": ["resid_post"], "folds": 3,
               "inner_folds": 2, "c_grid": [1.0], "n_boot": 20, "n_permutations": 19, "random_twin": False},
}
PATCHING = {
    "pairs": {"family": "unexpected-transfer", "n": 2, "contrasts": ["present"]},
    # a random model's gap fails the gate: forced, so heads exist to normalise, and the ranking is withheld
    "patching": {"method": "exact", "sites": ["heads"], "positions": ["final"], "top_k": 1, "ks": [1],
                 "n_random": 2, "force": True},
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two runs made once: tiny-llama (2 layers) and tom-organism (5 layers) in one folder with
    behaviour, probes and patching, and tiny-gpt2 (2 layers) alone with behaviour only."""
    root = tmp_path_factory.mktemp("compare")
    store = {"probes": {**STAGES["probes"], "store": str(root / "store")}}
    two = ExperimentConfig.from_dict({"name": "two", "models": [{"name": "tiny-llama"}, {"name": "tom-organism"}],
                                      **STAGES, **store, **PATCHING})
    run_experiment(two, root / "two", progress=False)
    one = ExperimentConfig.from_dict({"name": "one", "model": {"name": "tiny-gpt2"}, "behaviour": STAGES["behaviour"]})
    run_experiment(one, root / "one", progress=False)
    return {"root": root, "two": root / "two", "one": root / "one"}


@pytest.fixture(scope="module")
def result(runs: dict[str, Path]) -> CompareResult:
    return compare_runs([runs["two"], runs["one"]], missing=["tiny-neox"])


def test_each_model_is_found_with_its_layer_count(result):
    models = result.tables["models"].set_index("model")
    assert list(models.index) == ["tiny-llama", "tom-organism", "tiny-gpt2"]
    assert models["n_layers"].to_dict() == {"tiny-llama": 2, "tom-organism": 5, "tiny-gpt2": 2}


def test_probe_layers_are_on_relative_depth(result):
    probes = result.tables["probes"]
    assert {"baseline_bow", "baseline_random_init", "control", "selectivity", "gate"} <= set(probes.columns)
    for model, n in (("tiny-llama", 2), ("tom-organism", 5)):
        mine = probes[(probes["model"] == model) & (probes["kind"] == "resid_post")]
        assert sorted(mine["layer"]) == list(range(n))
        np.testing.assert_allclose(mine["relative_depth"], mine["layer"] / (n - 1))
    organism = probes[(probes["model"] == "tom-organism") & (probes["kind"] == "resid_post")]
    assert sorted(organism["relative_depth"]) == [0.0, 0.25, 0.5, 0.75, 1.0]
    best = result.tables["probe_best"].set_index("model")
    b = best.loc["tom-organism"]
    assert b["best_layer_relative_depth"] == pytest.approx(b["best_layer"] / 4)
    assert relative_depth(19, 30) == pytest.approx(19 / 29) and relative_depth(0, 1) == 0.0


def test_patching_effects_are_normalised_per_model_and_withheld_is_not_found(result):
    patching = result.tables["patching"]
    assert set(patching["model"]) == {"tiny-llama", "tom-organism"}  # tiny-gpt2 ran no patching
    for _model, g in patching.groupby("model"):
        assert g[NORMALISED].abs().max() == pytest.approx(1.0)
        np.testing.assert_allclose(g[NORMALISED], g["effect"] / g["effect"].abs().max())
        np.testing.assert_allclose(g["relative_depth"], g["layer"] / (g["n_layers"] - 1))
    assert not patching["found"].any() and set(patching["gate"]) == {"withheld"}  # forced past a failed gate
    gates = result.tables["gates"]
    ranking = gates[gates["claim"] == "head ranking"].set_index("model")
    assert ranking.loc["tiny-llama", "status"] == "withheld" and "forced" in ranking.loc["tiny-llama", "reason"]
    assert ranking.loc["tiny-gpt2", "status"] == "not run"
    assert set(gates[gates["model"] == "tiny-gpt2"]["status"]) == {"not run"}  # no probes, no patching
    findings = compare_findings(result)
    heads = [f for f in findings if "heads" in f.claim and f.model == "tom-organism"]
    assert heads and all(f.status == "withheld" and "not shown" in f.claim for f in heads)


def test_findings_state_only_what_passed_its_gate(result):
    findings = compare_findings(result)
    best = result.tables["probe_best"]
    for _, b in best.iterrows():
        mine = [f for f in findings if f.model == b["model"] and b["target"] in f.claim]
        assert len(mine) == 1
        if b["gate"] == "found":
            assert mine[0].status == "found" and f"{b['selected_relative_depth']:.2f}" in mine[0].claim
        else:  # a withheld probe is never phrased as a result
            assert mine[0].status == "withheld" and "not shown" in mine[0].claim and mine[0].test == b["reason"]
    assert all(f.status != "found" for f in findings if f.model in ("tiny-llama", "tiny-gpt2"))


def test_missing_models_and_stages_are_listed(result, runs, tmp_path):
    missing = result.tables["missing"]
    assert list(missing["model"]) == ["tiny-neox"] and "tiny-neox" in result.describe()
    # a stage that did not finish (no result.json) is missing, not an error and not dropped
    copy = tmp_path / "two"
    shutil.copytree(runs["two"], copy)
    (copy / "tom-organism" / "patching" / "result.json").unlink()
    r = compare_runs([copy])
    row = r.tables["missing"].set_index("model").loc["tom-organism"]
    assert row["stage"] == "patching" and "did not finish" in row["reason"]
    assert set(r.tables["patching"]["model"]) == {"tiny-llama"}
    gates = r.tables["gates"].set_index(["model", "claim"])
    assert gates.loc[("tom-organism", "head ranking"), "status"] == "not run"


def test_a_model_without_a_layer_count_is_a_clear_error(runs, tmp_path):
    copy = tmp_path / "one"
    shutil.copytree(runs["one"], copy)
    (copy / "manifest.json").unlink()
    for stage in ("behaviour",):
        m = json.loads((copy / stage / "manifest.json").read_text())
        m["model"].pop("n_layers")
        (copy / stage / "manifest.json").write_text(json.dumps(m))
        s = json.loads((copy / stage / "result.json").read_text())
        s.get("provenance", {}).pop("n_layers", None)
        (copy / stage / "result.json").write_text(json.dumps(s))
    (copy / "behaviour" / "summary.json").unlink()
    with pytest.raises(TomlensError, match="layer count"):
        compare_runs([copy])


def test_save_load_round_trip_and_report(result, tmp_path):
    back = CompareResult.load(result.save(tmp_path / "saved"))
    assert set(back.tables) == set(result.tables)
    for name, df in result.tables.items():
        if len(df):
            pd.testing.assert_frame_equal(back.tables[name].reset_index(drop=True), df.reset_index(drop=True),
                                          check_dtype=False)
    summary = json.loads((tmp_path / "saved" / "result.json").read_text())
    assert summary["versions"]["tomlens"] and len(summary["runs"]) == 2 and summary["runs"][0]["manifest"]
    path = write_compare_report(result, tmp_path / "report")
    html = path.read_text()
    listed = html[html.index("<ul class='findings'>"):]
    listed = listed[:listed.index("</ul>")]  # the findings list, not the page's CSS
    assert "withheld" in listed and "not shown" in listed
    assert html.index("<ul class='findings'>") < html.index("Probes on relative depth")  # findings come first
    assert "relative depth" in html and "tiny-neox" in html and "<script src=" not in html
    assert (tmp_path / "report" / "probes.csv").is_file() and (tmp_path / "report" / "patching.parquet").is_file()


def test_cli_end_to_end_and_bad_folders(runs, tmp_path, capsys):
    out = tmp_path / "cmp"
    assert main(["compare", str(runs["two"]), str(runs["one"]), "--out", str(out), "--label", "pair",
                 "--label", "gpt"]) == 0
    printed = capsys.readouterr().out
    assert "pair:tom-organism: 5 layers" in printed and "gpt: 2 layers" in printed
    saved = CompareResult.load(out)
    assert saved.models == ["pair:tiny-llama", "pair:tom-organism", "gpt"] and (out / "report.html").is_file()
    assert main(["compare", str(runs["root"] / "store"), "--out", str(tmp_path / "x")]) == 2
    assert "is not a tomlens run" in capsys.readouterr().err
    assert main(["compare", str(tmp_path / "nowhere"), "--out", str(tmp_path / "x")]) == 2
    assert main(["compare", str(runs["one"]), "--out", str(tmp_path / "x"), "--label", "a", "--label", "b"]) == 2
    assert not (tmp_path / "x" / "report.html").exists()


def test_validation_checks_side_by_side(runs, tmp_path):
    """A validate stage's checks (saved as `tomlens validate` saves them) join the comparison: the
    table, one gate row per check, a finding only for the check that passed, and the grid figure."""
    from tomlens.report.compare import validation_grid
    from tomlens.runs.validate import Check, ValidationResult, ValidationSummary, table_of

    copy = tmp_path / "one"
    shutil.copytree(runs["one"], copy)
    nan = float("nan")
    rows = (Check("probe", 0.97, 0.95, ">=", True, 0.5, 0.6, "<=", "held-out probe"),
            Check("topk_recovery", 0.3, 0.8, ">=", False, 0.1, 0.2, "<=", "value 0.3 is not >= 0.8"),
            Check("attribution", nan, 0.8, ">=", False, nan, nan, "-", "withheld: no ranking"))
    summary = ValidationSummary(command="validate", model="tiny-gpt2", provenance={}, n_tasks=8, n_stories=24, k=1,
                                heads=8, k_above_5_percent=False, passed=False, checks=rows, stages={}, seconds=0.0)
    ValidationResult(None, table_of(list(rows)), summary, {}).save(copy / "validate")
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["models"][0]["stages"]["validate"] = str(copy / "validate")
    (copy / "manifest.json").write_text(json.dumps(manifest))
    r = compare_runs([copy])
    v = r.tables["validation"]
    assert list(v["check"]) == ["probe", "topk_recovery", "attribution"] and list(v["passed"]) == [True, False, False]
    assert {"value", "threshold", "null", "passed"} <= set(v.columns)
    gates = r.tables["gates"].set_index("claim")
    assert gates.loc["validation: probe", "status"] == "found"
    assert gates.loc["validation: topk_recovery", "status"] == "withheld"
    found = [f.claim for f in compare_findings(r) if f.status == "found"]
    assert found == ["validation check probe passes"]
    fig = validation_grid(v)
    assert [list(row) for row in fig.data[0].z] == [[1.0], [0.0], [0.0]]


def test_models_asked_for_in_config_or_a_study_are_missing(runs, tmp_path):
    """A crashed multi-model run (no manifest, one model never started) and a study's failed job
    are rows of `missing`, named from config.json and the job list, never silently dropped; the
    folder here is one `tomlens sweep` (the study's old name) wrote, with sweep.json and
    sweep-failed.json, and reads the same."""
    crashed = tmp_path / "two"
    shutil.copytree(runs["two"], crashed)
    (crashed / "manifest.json").unlink()
    shutil.rmtree(crashed / "tom-organism")
    r = compare_runs([crashed])
    assert r.models == ["tiny-llama"]
    row = r.tables["missing"].set_index("model").loc["tom-organism"]
    assert row["stage"] == "all" and "config.json" in row["reason"] and "no folder" in row["reason"]
    (crashed / "tom-organism").mkdir()
    (crashed / "tom-organism" / "sweep-failed.json").write_text(json.dumps({"error": "CUDA out of memory"}))
    (crashed / "sweep.json").write_text(json.dumps({"jobs": [
        {"slug": "tiny-llama", "state": "done", "folder": str(crashed / "tiny-llama")},
        {"slug": "tom-organism", "state": "failed", "folder": "/elsewhere/tom-organism", "error": "?"}]}))
    r = compare_runs([crashed], missing=["tom-organism"])
    rows = r.tables["missing"]
    assert list(rows["model"]) == ["tom-organism"]  # once, with the study's reason
    assert "study job failed" in rows["reason"].iloc[0] and "CUDA out of memory" in rows["reason"].iloc[0]


def _summary(ks_rows, **extra):
    from patching_fakes import patching_summary, topk_row

    return patching_summary(validated_on="4 held-out evaluation pairs", **extra, topk=tuple(
        topk_row(k, heads, eff, rnd, n_random=5, n_distinct=5) for k, eff, rnd, heads in ks_rows))


def test_ranking_gate_is_judged_at_validates_k():
    from tomlens.runs.compare import gate_k, patching_gate
    from tomlens.runs.validate import ValidationSummary

    validated = ValidationSummary(command="validate", model="m", provenance={}, n_tasks=8, n_stories=24, k=3,
                                  heads=40, k_above_5_percent=True, passed=True, checks=(), stages={}, seconds=0.0)
    assert gate_k(40) == (2, "5% of the model's 40 heads") and gate_k(40, validated)[0] == 3
    # recovery passes at k = 1 and k = 3 only: 5% of 40 heads is k = 2, which was not run -> withheld
    s = _summary([(1, 0.95, 0.05, "L1H2"), (3, 0.9, 0.1, "L1H2;L0H1;L3H3")])
    g = patching_gate(s, 40)
    assert g.status == "withheld" and "no top-k recovery at k = 2" in g.reason and "1, 3" in g.reason
    g = patching_gate(s, 40, k=3, k_source="the validate stage's k")
    assert g.status == "found" and g.k == 3 and g.heads == "L1H2;L0H1;L3H3"
    assert "L1H2, L0H1, L3H3" in g.reason and "0.90" in g.reason and "validate" in g.reason
    s = _summary([(2, 0.9, 0.5, "L1H2;L0H1")])  # random sets recover as much: withheld
    assert patching_gate(s, 40).status == "withheld"


def test_a_noising_run_is_read_on_the_denoising_scale(runs, tmp_path):
    from tomlens.runs.compare import patching_direction, patching_gate

    assert patching_direction(_summary([], directions=("noise", "denoise"))) == "noise"
    with pytest.raises(TomlensError, match="direction"):
        patching_direction(_summary([], directions=("sideways",)))
    assert patching_gate(_summary([(2, 0.9, 0.1, "L1H2;L0H1")], directions=("noise",)), 40).status == "withheld"
    before = compare_runs([runs["two"]]).tables["patching"]
    copy = tmp_path / "two"
    shutil.copytree(runs["two"], copy)
    path = copy / "tom-organism" / "patching" / "result.json"
    data = json.loads(path.read_text())
    data["directions"] = ["noise"]
    path.write_text(json.dumps(data))
    after = compare_runs([copy]).tables["patching"]
    a, b = (t[t["model"] == "tom-organism"].reset_index(drop=True) for t in (after, before))
    np.testing.assert_allclose(a["effect"], 1.0 - b["effect"])
    assert set(a["direction"]) == {"noise"} and set(b["direction"]) == {"denoise"}


def test_patching_keeps_each_models_scale(result):
    from tomlens.report.compare import patching_depth_figure

    patching = result.tables["patching"]
    fig = patching_depth_figure(patching)
    for trace, (_model, g) in zip(fig.data, patching.groupby("model", sort=False), strict=True):
        np.testing.assert_allclose(trace.y, g["effect"])  # not stretched to +-1
        assert f"peak |effect| {g['effect'].abs().max():.2f}" in trace.name


def _found_tables() -> CompareResult:
    """Synthetic tables of one model whose probe and head ranking both passed their gates."""
    best = pd.DataFrame([{"model": "m", "target": "belief", "n_layers": 6, "selected_unit": "resid_post:4",
                          "selected_layer": 4, "selected_relative_depth": 0.8, "held_out_score": 0.91,
                          "held_out_ci_low": 0.86, "held_out_ci_high": 0.95, "chance": 0.5,
                          "best_baseline_name": "bow", "best_baseline": 0.51, "random_init": float("nan"),
                          "p_max": 0.001, "gate": "found", "reason": "held-out interval above chance and the "
                          "baselines that ran (bow, length)"}])
    heads = pd.DataFrame([{"model": "m", "layer": la, "head": h, "n_layers": 6, "relative_depth": la / 5,
                           "effect": e, NORMALISED: e / 0.6, "rank": r, "gate": "found", "gate_reason": "top-2 ok",
                           "gate_k": 2, "gate_heads": "L3H1;L5H0", "found": True, "in_gate_set": r <= 2}
                          for la, h, e, r in ((3, 1, 0.6, 1), (5, 0, 0.4, 2), (1, 1, 0.3, 3))])
    gates = pd.DataFrame([{"model": "m", "claim": "probe (belief)", "stage": "probes", "status": "found", "reason": ""},
                          {"model": "m", "claim": "head ranking", "stage": "patching", "status": "found",
                           "reason": "top-2 recovery of L3H1, L5H0: 0.90 >= 0.8"}])
    models = pd.DataFrame([{"model": "m", "n_layers": 6}])
    tables = {"models": models, "probe_best": best, "patching": heads, "gates": gates,
              "missing": pd.DataFrame(columns=["model", "stage", "reason", "folder"])}
    summary = CompareSummary(command="compare", axis="relative depth", normalisation="", layers="0-based", models=(),
                             missing=(), runs=(), versions={}, time="", tables=tuple(tables))
    return CompareResult(tables, summary)


def test_found_findings_carry_number_interval_baseline_and_k():
    found = [f for f in compare_findings(_found_tables()) if f.status == "found"]
    probe = next(f for f in found if "decodable" in f.claim)
    assert "0.91 [0.86, 0.95]" in probe.claim and "0.40 above the best baseline (bow 0.51)" in probe.claim
    assert "layer 4 (0-based) of 6" in probe.claim and "relative depth 0.80" in probe.claim
    assert "bow, length" in probe.test and "every baseline" not in probe.test
    heads = next(f for f in found if "heads" in f.claim)
    assert heads.claim.startswith("the top-2 heads") and "L3H1" in heads.claim and "L5H0" in heads.claim
    assert "L1H1" not in heads.claim and "+0.60 of the gap" in heads.claim and "0.90" in heads.test


def test_a_found_probe_without_a_baseline_is_withheld():
    from tomlens.probes.selection import Estimate, SelectionResult
    from tomlens.runs.compare import _probe_gate

    class R:
        selection = {"belief": SelectionResult("belief", {"kind": "resid_post", "layer": 1, "head": -1},
                                               0.9, Estimate(0.9, 0.8, 0.95, 0.5), verdict="found", n_perm=99,
                                               p_max=0.01)}

    status, reason = _probe_gate(R, "belief")
    assert status == "withheld" and "no baseline ran" in reason
    R.selection["belief"].baselines = {"bow": Estimate(0.55, 0.5, 0.6, 0.5)}
    status, reason = _probe_gate(R, "belief")
    assert status == "found" and "(bow)" in reason and "99 permutations" in reason and "no type-level control" in reason


def test_describe_marks_withheld_best_layers_and_tables_carry_context(result):
    text = result.describe()
    best = result.tables["probe_best"]
    assert {"best_layer_baseline", "best_layer_control", "best_layer_selectivity"} <= set(best.columns)
    for _, b in best.iterrows():
        if b["gate"] != "found":
            assert f"withheld: best layer of the sweep (selection-biased) for {b['model']}" in text
    assert "(0-based) of" in text
    gated = result.tables["behaviour"]
    gated = gated[gated["measure"] == "reality-gated belief accuracy"]
    assert len(gated) and {"n_belief", "n_dropped", "joint_accuracy"} <= set(gated.columns)
    assert gated["n_belief"].notna().all()


def test_out_inside_a_run_is_refused_and_old_figures_cleared(result, runs, tmp_path, capsys):
    assert main(["compare", str(runs["one"]), "--out", str(runs["one"] / "cmp")]) == 2
    assert "inside the compared run folder" in capsys.readouterr().err and not (runs["one"] / "cmp").exists()
    out = tmp_path / "cmp"
    out.mkdir()
    (out / "probes_gone_resid_post.html").write_text("old")
    write_compare_report(result, out)
    assert not (out / "probes_gone_resid_post.html").exists() and (out / "patching.html").is_file()


def test_a_corrupt_stage_is_one_clear_error(runs, tmp_path):
    copy = tmp_path / "one"
    shutil.copytree(runs["one"], copy)
    (copy / "behaviour" / "result.json").write_text("{not json")
    with pytest.raises(TomlensError, match="behaviour stage") as e:
        compare_runs([copy])
    assert "tiny-gpt2" in str(e.value) and "rerun that stage" in e.value.fix
