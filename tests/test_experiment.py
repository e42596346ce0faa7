"""Experiments as files: `tomlens run` on every example (tiny model, small sizes), reuse on rerun,
misspelt keys named with the nearest valid one, and a report that names the model it ran."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pandas as pd
import pytest

from tomlens.cli import main
from tomlens.errors import TomlensError
from tomlens.runs.base import ModelSpec
from tomlens.runs.experiment import ExperimentConfig, apply_overrides, model_slug, run_experiment

pytestmark = pytest.mark.integration

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

# Per example: the overrides that put it on a tiny random model at test size, and the stage folders.
SMALL = {
    "probe-study": (["models.0.name=tiny-llama", "models.1.name=tiny-llama", "probes.stimuli.n=5",
                     "probes.folds=4", "probes.inner_folds=3", "probes.n_boot=50", "probes.c_grid=[0.1, 1.0]"],
                    ["tiny-llama/probes", "tiny-llama-bos/probes"]),
    "patching-study": (["model.name=tiny-llama", "pairs.n=1", "patching.top_k=2", "patching.n_random=2", "patching.ks=[1, 2]",
                        "patching.force=true"],  # a random model's gap fails the gate: forced, flagged
                       ["pairs", "patching"]),
    "validity-study": (["model.name=tiny-llama", *(f"behaviour.stimuli.{i}.n=1" for i in range(4)),
                        "probes.stimuli.n=6", "probes.folds=3", "probes.inner_folds=2", "probes.n_boot=50",
                        "probes.n_permutations=19", "pairs.n=3", "patching.top_k=2", "patching.ks=[1, 2]",
                        "patching.n_random=2", "patching.force=true"],
                       ["behaviour", "probes", "pairs", "patching"]),
}


def _run(tmp_path: Path, name: str, capsys: pytest.CaptureFixture, *extra: str) -> tuple[Path, str]:
    out = tmp_path / name
    overrides, _ = SMALL[name]
    argv = ["run", str(EXAMPLES / f"{name}.toml"), "--out", str(out), "--no-progress",
            "--set", f"probes.store={tmp_path / 'store'}" if name == "probe-study" else "seed=0"]
    for o in [*overrides, *extra]:
        argv += ["--set", o]
    assert main(argv) == 0
    return out, capsys.readouterr().out


def test_every_example_is_a_valid_experiment():
    files = sorted(EXAMPLES.glob("*.toml"))
    assert {f.stem for f in files} == {"demo", "probe-study", "patching-study", "validity-study", "family-study",
                                      "battery-study"}
    for f in files:
        config = ExperimentConfig.load(f)
        assert config.name == f.stem and config.stages and config.description


@pytest.mark.parametrize("name", sorted(SMALL))
def test_run_example_then_rerun_reuses_every_stage(name, tmp_path, capsys, monkeypatch):
    out, printed = _run(tmp_path, name, capsys)
    _, folders = SMALL[name]
    for folder in folders:
        assert (out / folder / "result.json").is_file() and (out / folder / "config.json").is_file()
    resolved = json.loads((out / "config.json").read_text())
    assert ExperimentConfig.from_dict(resolved).to_dict() == resolved  # the resolved config reads back
    manifest = json.loads((out / "manifest.json").read_text())
    assert [m["model"]["model"] for m in manifest["models"]] == ["tiny-llama"] * len(manifest["models"])
    assert manifest["argv"] and manifest["name"] == name
    report = (out / "report.html").read_text()
    title = re.search(r"<h1>(.*?)</h1>", report).group(1)
    assert title.startswith(f"tomlens {name}: tiny-llama") and "smollm2" not in title
    assert "reused" not in printed

    def no_model(self):  # noqa: ANN001, ANN202 - a stand-in that must not be called
        raise AssertionError("a reused run loaded a model")

    monkeypatch.setattr(ModelSpec, "load", no_model)
    monkeypatch.setattr(ModelSpec, "load_tokenizer", no_model)
    stamps = {f: (out / f / "result.json").stat().st_mtime_ns for f in folders}
    _, again = _run(tmp_path, name, capsys)
    assert again.count(": reused ") == len(folders)
    assert {f: (out / f / "result.json").stat().st_mtime_ns for f in folders} == stamps
    assert (out / "report.html").is_file()


def test_a_changed_setting_reruns_its_stage_and_what_reads_it(tmp_path, capsys):
    out, _ = _run(tmp_path, "patching-study", capsys)
    before = pd.read_csv(out / "patching" / "topk.csv") if (out / "patching" / "topk.csv").exists() \
        else pd.read_parquet(out / "patching" / "topk.parquet")
    assert before["k"].max() == 2
    _, printed = _run(tmp_path, "patching-study", capsys, "patching.top_k=1")
    assert "pairs: reused" in printed and "patching: reused" not in printed
    after = pd.read_parquet(out / "patching" / "topk.parquet")
    assert after["k"].max() == 1
    # a new pairs setting reruns the pairs and the patching that reads them
    _, printed = _run(tmp_path, "patching-study", capsys, "patching.top_k=1", "pairs.seed=3")
    assert ": reused" not in printed


def test_cache_and_behaviour_stages_and_the_probe_table_link(tmp_path, capsys):
    text = f"""
name = "small"
[model]
name = "tiny-llama"
[[behaviour.stimuli]]
family = "unexpected-transfer"
n = 1
[cache]
stimuli = {{family = "unexpected-transfer", n = 1}}
sites = ["resid_post"]
positions = ["final", "protagonist"]
store = "{tmp_path / 'store'}"
[probes]
stimuli = {{family = "unexpected-transfer", n = 4, seed = 1}}
sites = ["head_out"]
folds = 4
inner_folds = 3
n_boot = 20
store = "{tmp_path / 'store'}"
format = "csv"
[pairs]
n = 1
contrasts = ["present"]
[patching]
sites = ["heads"]
top_k = 1
n_random = 1
force = true
probe_table = "probes"
"""
    path = tmp_path / "small.toml"
    path.write_text(text)
    assert main(["run", str(path), "--out", str(tmp_path / "out"), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    out = tmp_path / "out"
    for stage in ("behaviour", "cache", "probes", "pairs", "patching"):
        assert (out / stage / "result.json").is_file()
        assert f"\n== {stage} ==" in printed
    heads = pd.read_parquet(out / "patching" / "heads.parquet")
    assert heads["probe_accuracy"].between(0, 1).all()  # the probes stage's table reached patching
    saved = json.loads((out / "patching" / "config.json").read_text())
    assert saved["probe_table"] == str(out / "probes" / "probes.csv")
    report = (out / "report.html").read_text()
    for heading in ("Behaviour", "Activations", "Probes: protagonist belief", "Minimal pairs",
                    "Patching (forced past its gate: not a result)"):
        assert f"<h2>{heading}" in report
    assert "<h2>Mean ablation" in report
    # `format` is not hashed: a switch reuses the probes, and patching keeps reading the table they wrote
    assert main(["run", str(path), "--out", str(out), "--no-progress", "--set", "probes.format=parquet"]) == 0
    printed = capsys.readouterr().out
    assert "probes: reused" in printed and "patching: reused" in printed
    assert json.loads((out / "patching" / "config.json").read_text())["probe_table"] == str(out / "probes" / "probes.csv")


def test_only_the_stages_that_ran_get_sections(tmp_path, capsys):
    text = '''name = "beh"
[model]
name = "tiny-llama"
[behaviour]
stimuli = [{family = "unexpected-contents", n = 1}]
'''
    (tmp_path / "b.toml").write_text(text)
    assert main(["run", str(tmp_path / "b.toml"), "--out", str(tmp_path / "o"), "--no-progress"]) == 0
    report = (tmp_path / "o" / "report.html").read_text()
    assert "<h2>Behaviour</h2>" in report and "Probes" not in report and "Patching" not in report


def test_steering_and_validate_stages_run_reload_and_report(tmp_path, capsys, monkeypatch):
    """[steering] and [validate] as experiment stages: each runs, saves, is reused on a rerun (no
    model loaded), and the report has its section with the numbers the stage saved."""
    from tomlens.runs.steering import SteeringResult
    from tomlens.runs.validate import ValidationResult

    store = tmp_path / "store"
    text = f"""name = "steer-validate"
[model]
name = "tiny-llama"
[steering]
stimuli = {{family = "order-only", n = 4}}
layers = [1]
alphas = [-2, 0, 2]
n_random = 3
store = "{store}"
[validate]
n_tasks = 4
n_permutations = 20
n_random_heads = 5
n_random_directions = 3
steering_layers = [1]
alphas = [-2, 0, 2]
store = "{store}"
[validate.thresholds]
min_probe = 0.9
"""
    path = tmp_path / "sv.toml"
    path.write_text(text)
    out = tmp_path / "out"
    rc = main(["run", str(path), "--out", str(out), "--no-progress"])
    printed = capsys.readouterr().out
    assert "\n== steering ==" in printed and "\n== validate ==" in printed
    steer, valid = SteeringResult.load(out / "steering"), ValidationResult.load(out / "validate")
    assert rc == (0 if valid.passed else 1)  # `tomlens run` exits as `tomlens validate` does
    assert ("validation FAILED for tiny-llama" in printed) == (not valid.passed)
    assert steer.config.alphas == (-2.0, 0.0, 2.0) and [d.layer for d in steer.summary.layers] == [1]
    assert valid.config.thresholds.min_probe == 0.9 and valid.config.thresholds.max_bow == 0.6
    assert (out / "steering" / "steering_dose.html").is_file() and (out / "steering" / "steering_flips.html").is_file()
    resolved = json.loads((out / "config.json").read_text())
    assert ExperimentConfig.from_dict(resolved).to_dict() == resolved
    assert resolved["validate"]["thresholds"]["min_probe"] == 0.9

    def report_says(report: str) -> None:
        assert "<h2>Steering along the belief direction</h2>" in report
        assert "<h2>Validation of the methods</h2>" in report
        layer = steer.summary.layers[0]
        assert f"<td>{layer.verdict}</td>" in report
        if layer.verdict == "withheld":
            assert "No layer passed: every layer is withheld" in report
        n_pass = int(valid.table["passed"].sum())
        assert f"{n_pass} of 5 checks pass on tiny-llama" in report
        assert report.count("<td>PASS</td>") == n_pass and report.count("<td>FAIL</td>") == 5 - n_pass

    report_says((out / "report.html").read_text())

    def no_model(self):  # noqa: ANN001, ANN202 - a stand-in that must not be called
        raise AssertionError("a reused run loaded a model")

    monkeypatch.setattr(ModelSpec, "load", no_model)
    assert main(["run", str(path), "--out", str(out), "--no-progress"]) == rc
    again = capsys.readouterr().out
    assert "steering: reused" in again and "validate: reused" in again
    report_says((out / "report.html").read_text())


@pytest.mark.parametrize("text, key, near", [
    ('name = "x"\nseeed = 1\n[model]\nname = "tiny-llama"\n[pairs]\nn = 1\n', "seeed", "seed"),
    ('name = "x"\n[model]\nname = "tiny-llama"\n[probs]\nn_boot = 5\n', "probs", "probes"),
    ('name = "x"\n[model]\nnmae = "tiny-llama"\n[pairs]\nn = 1\n', "model.nmae", "name"),
    ('name = "x"\n[model]\nname = "tiny-llama"\n[probes]\nstimuli = {family = "unexpected-transfer"}\n'
     'n_boots = 5\n', "probes.n_boots", "n_boot"),
    ('name = "x"\n[model]\nname = "tiny-llama"\n[patching]\npairs = {famliy = "unexpected-transfer"}\n',
     "patching.pairs.famliy", "family"),
    ('name = "x"\n[model]\nname = "tiny-llama"\n[steering]\nalphass = [-1, 0, 1]\n', "steering.alphass", "alphas"),
    ('name = "x"\n[model]\nname = "tiny-llama"\n[steering]\nstimuli = {famly = "order-only"}\n',
     "steering.stimuli.famly", "family"),
    ('name = "x"\n[model]\nname = "tiny-llama"\n[validate]\nn_task = 8\n', "validate.n_task", "n_tasks"),
    ('name = "x"\n[model]\nname = "tiny-llama"\n[validate.thresholds]\nmin_prob = 0.9\n',
     "validate.thresholds.min_prob", "min_probe"),
])
def test_a_misspelt_key_names_the_nearest_valid_one(tmp_path, capsys, text, key, near):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(TomlensError) as e:
        ExperimentConfig.load(path)
    assert repr(key) in e.value.problem and f"did you mean {near!r}" in e.value.problem
    assert main(["run", str(path), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and repr(key) in err
    assert not (tmp_path / "o").exists()  # nothing is written for a bad file


@pytest.mark.parametrize("text, says", [
    ('name = "x"\n[pairs]\nn = 1\n', "names no model"),
    ('name = "x"\n[model]\nname = "tiny-llama"\n', "no stage"),
    ('[model]\nname = "tiny-llama"\n[pairs]\nn = 1\n', "no `name`"),
    ('name = "x"\n[model]\nname = "a"\n[[models]]\nname = "b"\n[pairs]\nn = 1\n', "both [model] and [[models]]"),
    ('name = "x"\n[model]\nname = "tiny-llama"\n[patching]\npairs_path = "p.jsonl"\nprobe_table = "probes"\n',
     "no [probes] stage"),
    ('name = "x"\n[model]\nname = "tiny-llama"\n[pairs]\nmodel = "tiny-gpt2"\n', "sets `model`"),
    ('name = "x"\n[[models]]\nname = "tiny-llama"\n[[models]]\nname = "tiny-llama"\n[pairs]\nn = 1\n',
     "share a folder"),
    ('name = "x"\n[model]\nname = "tiny-llama"\n[pairs\n', "not valid TOML"),
    ('name = "x"\n[model]\nname = "tiny-llama"\n[probes]\nstimuli = {family = "unexpected-transfer"}\n'
     'sites = ["resid_post"]\n[patching]\npairs_path = "p.jsonl"\nprobe_table = "probes"\n', "no head_out"),
    ('name = "x"\n[model]\nname = "tiny-llama"\n[patching]\npairs_path = "p.jsonl"\ndry_run = true\n',
     "dry_run"),
])
def test_bad_files_fail_with_one_clear_error(tmp_path, text, says):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(TomlensError, match=re.escape(says)):
        ExperimentConfig.load(path)


def test_overrides_edit_tables_and_lists_of_tables():
    data = {"name": "x", "behaviour": {"stimuli": [{"family": "a", "n": 8}, {"family": "b", "n": 8}]}}
    new = apply_overrides(data, ["behaviour.stimuli.1.n=2", "model.name=tiny-gpt2", "probes.c_grid=[0.1, 1]",
                                 "model.prepend_bos=true"])
    assert new["behaviour"]["stimuli"][1]["n"] == 2 and new["behaviour"]["stimuli"][0]["n"] == 8
    assert new["model"] == {"name": "tiny-gpt2", "prepend_bos": True} and new["probes"]["c_grid"] == [0.1, 1]
    assert data["behaviour"]["stimuli"][1]["n"] == 8  # the input is left as it was
    for bad in ("behaviour.stimuli.5.n=1", "name.x=1", "noequals"):
        with pytest.raises(TomlensError):
            apply_overrides(data, [bad])


def test_model_folders_differ_by_the_settings_that_differ():
    assert model_slug(ModelSpec("smollm2-135m")) == "smollm2-135m"
    assert model_slug(ModelSpec("org/model", revision="abc", prepend_bos=True)) == "org-model@abc-bos"
    assert model_slug(ModelSpec("tiny-llama", dtype="float32", seed=2)) == "tiny-llama-float32-seed2"


def test_several_models_get_a_folder_each(tmp_path, capsys):
    config = ExperimentConfig.from_dict({
        "name": "two", "models": [{"name": "tiny-llama"}, {"name": "tiny-gpt2"}],
        "pairs": {"n": 1, "contrasts": ["present"]}})
    result = run_experiment(config, tmp_path, progress=False)
    assert [r.folder.name for r in result.runs] == ["tiny-llama", "tiny-gpt2"]
    assert all((tmp_path / m / "pairs" / "result.json").is_file() for m in ("tiny-llama", "tiny-gpt2"))
    assert [m["model"]["model"] for m in result.manifest["models"]] == ["tiny-llama", "tiny-gpt2"]


def _cache_experiment(tmp_path: Path, stimuli: Path) -> ExperimentConfig:
    return ExperimentConfig.from_dict({
        "name": "inputs", "model": {"name": "tiny-llama"},
        "cache": {"stimuli": {"path": str(stimuli)}, "sites": ["resid_post:0"], "store": str(tmp_path / "store")}})


def test_reuse_checks_input_files_the_store_and_the_resolved_model(tmp_path, capsys, monkeypatch):
    import torch

    import tomlens.devices
    from tomlens.io import read_json
    from tomlens.runs.experiment import stage_inputs, stale_reason
    from tomlens.stimuli import generate, write_jsonl

    stimuli = tmp_path / "stimuli.jsonl"
    write_jsonl(generate("unexpected-transfer", n=1, seed=0)[:2], stimuli)
    config = _cache_experiment(tmp_path, stimuli)
    first = run_experiment(config, tmp_path / "out", progress=False)
    folder = tmp_path / "out" / "cache"
    saved = read_json(folder / "inputs.json")
    assert list(saved["files"]) == [str(stimuli)]
    hashes = first.manifest["models"][0]["stimuli_hash"]  # the top-level manifest names each stage's stimuli
    assert hashes == {"cache": first.result("cache").summary.stimuli_hash} and hashes["cache"]
    assert run_experiment(config, tmp_path / "out", progress=False).runs[0].reused["cache"]

    # the same path with other stimuli in it: the hash of the config is the same, the inputs are not
    write_jsonl(generate("unexpected-transfer", n=1, seed=1)[:2], stimuli)
    again = run_experiment(config, tmp_path / "out", progress=False)
    assert not again.runs[0].reused["cache"] and "its inputs changed" in capsys.readouterr().out
    assert again.result("cache").summary.stimuli_hash != hashes["cache"]

    # a store that is gone is cached again
    store = Path(again.result("cache").summary.store)
    shutil.rmtree(store)
    third = run_experiment(config, tmp_path / "out", progress=False)
    assert not third.runs[0].reused["cache"] and "store" in capsys.readouterr().out
    assert Path(third.result("cache").summary.store).is_dir()

    # dtype None resolves per machine: on a GPU it would load bf16, not the fp32 this run used
    spec = config.models[0]
    cache_cfg = config.stage_config("cache", spec, {"cache": folder})
    inputs = stage_inputs(cache_cfg, {"cache": folder}, set())
    assert stale_reason("cache", folder, cache_cfg, inputs, spec) is None
    monkeypatch.setattr(tomlens.devices, "default_device", lambda: torch.device("cuda"))
    assert "bfloat16" in stale_reason("cache", folder, cache_cfg, inputs, spec)
