"""The behaviour, cache and probes stages of the runs layer: configs that round-trip through plain
dicts, results that save and load back equal, misspelt keys named, and their thin CLI commands."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch

from tomlens.errors import TomlensError
from tomlens.runs import behaviour, cache, patching, probes
from tomlens.runs.base import ModelSpec, StimuliSpec, config_from_dict, config_hash, config_to_dict
from tomlens.runs.files import summary_to_dict
from tomlens.stimuli import generate, write_jsonl

TINY = ModelSpec(name="tiny-llama", dtype="float32")
FAST_PROBES = dict(folds=3, inner_folds=2, c_grid=(0.1, 1.0), n_boot=20)


def _missing_as_none(df: pd.DataFrame) -> pd.DataFrame:
    """Parquet reads a missing value of an object column back as None where pandas had NaN."""
    return df.astype(object).where(df.notna(), None)


@pytest.fixture
def model(load_tiny):
    return load_tiny("tiny-llama")


def _configs(tmp_path):
    transfer = StimuliSpec(family="unexpected-transfer", n=2, seed=0)
    goal = StimuliSpec(family="goal-encoding", n=2, seed=0, options={"ks": [0, 6]})
    return [
        behaviour.BehaviourConfig(model=TINY, stimuli=(transfer, goal), batch_size=4, seed=1),
        cache.CacheConfig(model=TINY, stimuli=transfer, sites=("resid_post:0,1", "head_out:1"),
                          positions=("final", "protagonist"), store=str(tmp_path / "store"), flush_seconds=0.0),
        probes.ProbesConfig(model=TINY, stimuli=StimuliSpec(family="unexpected-transfer", n=3, seed=1),
                            test_stimuli=StimuliSpec(family="unexpected-transfer", n=2, seed=9),
                            targets=("protagonist_belief", "world_state"), sites=("resid_post",),
                            store=str(tmp_path / "store"), format="csv", select_fraction=0.4,
                            n_permutations=9, random_twin=True, **FAST_PROBES),
    ]


@pytest.mark.unit
def test_configs_round_trip_through_plain_dicts(tmp_path):
    for config in _configs(tmp_path):
        data = json.loads(json.dumps(config_to_dict(config)))  # what config.json holds
        back = config_from_dict(type(config), data)
        assert back == config and config_hash(back) == config_hash(config)


@pytest.mark.unit
@pytest.mark.parametrize("cls, data, near", [
    (behaviour.BehaviourConfig, {"stimuli": [{"family": "unexpected-transfer"}], "batch_sise": 2}, "batch_size"),
    (cache.CacheConfig, {"stimuli": {"path": "s.jsonl"}, "position": ["final"]}, "positions"),
    (probes.ProbesConfig, {"stimuli": {"path": "s.jsonl"}, "n_bot": 10}, "n_boot"),
    (probes.ProbesConfig, {"stimuli": {"path": "s.jsonl", "sed": 3}}, "seed"),
])
def test_a_misspelt_key_names_the_nearest_one(cls, data, near):
    with pytest.raises(TomlensError, match=f"did you mean {near!r}"):
        config_from_dict(cls, data)


@pytest.mark.unit
@pytest.mark.parametrize("cls, data, setting, expected", [
    (StimuliSpec, {"family": "unexpected-transfer", "n": "five"}, "n", "an integer"),
    (patching.PatchingConfig, {"top_k": "3"}, "top_k", "an integer"),
    (patching.PatchingConfig, {"sites": 3}, "sites", "a list of strings"),
    (patching.PatchingConfig, {"dry_run": "yes"}, "dry_run", "true or false"),
    (probes.ProbesConfig, {"stimuli": {"path": "s.jsonl"}, "c_grid": ["a", 1]}, "c_grid", "a list of numbers"),
    (probes.ProbesConfig, {"stimuli": {"path": "s.jsonl", "options": 3}}, "stimuli.options", "a table"),
    (ModelSpec, {"revision": 7}, "revision", "a string"),
])
def test_a_value_of_the_wrong_type_names_the_setting(cls, data, setting, expected):
    with pytest.raises(TomlensError, match=f"setting '{setting}' = .* must be {expected}"):
        config_from_dict(cls, data)


@pytest.mark.unit
@pytest.mark.parametrize("spec, message", [
    (dict(family="unexpected-transfr"), "unknown stimulus family 'unexpected-transfr': did you mean 'unexpected-transfer'"),
    (dict(family="goal-encoding", options={"kss": [0, 6]}), "no option 'kss': did you mean 'ks'"),
    (dict(family="goal-encoding", options={"seed": 3}), "no option 'seed'"),
    (dict(path="s.jsonl", options={"ks": [0]}), "a stimulus file takes no options"),
])
def test_stimuli_specs_are_checked_when_built(spec, message):
    with pytest.raises(TomlensError, match=message):
        StimuliSpec(**spec)


@pytest.mark.unit
def test_stimuli_n_defaults_to_20_tasks_of_a_family_and_every_row_of_a_file(tmp_path):
    assert StimuliSpec(family="unexpected-transfer").n == 20
    assert config_to_dict(StimuliSpec(family="unexpected-transfer"))["n"] == 20  # the hash of a default is unchanged
    path = tmp_path / "s.jsonl"
    stimuli = generate("unexpected-transfer", n=3, seed=0)
    write_jsonl(stimuli, path)
    assert StimuliSpec(path=str(path)).n is None and StimuliSpec(path=str(path)).load() == stimuli
    assert StimuliSpec(path=str(path), n=5).load() == stimuli[:5]


@pytest.mark.unit
def test_an_integer_is_accepted_where_a_number_is_needed():
    config = config_from_dict(patching.PatchingConfig, {"memory_mb": 512, "search_threshold": None})
    assert config.memory_mb == 512.0 and isinstance(config.memory_mb, float)


@pytest.mark.unit
def test_bad_settings_fail_when_the_config_is_built():
    s = StimuliSpec(path="s.jsonl")
    with pytest.raises(TomlensError, match="one position"):
        probes.ProbesConfig(stimuli=s, positions=("final", "protagonist"))
    with pytest.raises(TomlensError, match="not a site kind"):
        probes.ProbesConfig(stimuli=s, sites=("resid_post:0-3",))
    with pytest.raises(TomlensError, match="unknown probe target"):
        probes.ProbesConfig(stimuli=s, targets=("protagonist_beleif",))
    with pytest.raises(TomlensError, match="evaluation"):
        probes.ProbesConfig(stimuli=s, evaluation="cross")
    with pytest.raises(TomlensError, match="unknown site kind 'resid_pst'"):
        cache.CacheConfig(stimuli=s, sites=("resid_pst",))
    with pytest.raises(TomlensError, match="needs stimuli"):
        cache.CacheConfig()
    with pytest.raises(TomlensError, match="needs stimuli"):
        behaviour.BehaviourConfig(stimuli=())
    # one list syntax: commas and spaces, a layer list staying with its site
    c = cache.CacheConfig(stimuli=s, sites=("resid_post:0,1,head_out",), positions=("final protagonist",))
    assert c.sites == ("resid_post:0,1", "head_out") and c.positions == ("final", "protagonist")


@pytest.mark.integration
def test_behaviour_run_save_load(tmp_path, model):
    config = _configs(tmp_path)[0]
    result = behaviour.run(config, model=model, progress=False)
    assert result.manifest["stimuli_hash"] == result.summary.provenance["stimuli_hash"]
    assert len(result.object_bias) and len(result.strict)
    out = result.save(tmp_path / "behaviour")
    assert {"prompts.parquet", "accuracy.csv", "summary.json", "config.json", "manifest.json",
            "result.json"} <= {p.name for p in out.iterdir()}
    back = behaviour.BehaviourResult.load(out)
    assert back.config == config and back.summary == result.summary
    assert summary_to_dict(back.summary) == json.loads((out / "result.json").read_text())
    pd.testing.assert_frame_equal(_missing_as_none(back.table), _missing_as_none(result.table))
    for name in ("accuracy", "strict", "object_bias", "selective", "prefix_curves"):
        want, got = getattr(result, name), getattr(back, name)
        if want.empty:  # an empty table is not written, and loads back empty
            assert got.empty
        else:
            pd.testing.assert_frame_equal(got, want, check_dtype=False, check_exact=True)
    assert back.describe() == result.describe() and "accuracy [95% CI]" in back.describe()
    # the same numbers as the engine function on the same stimuli
    engine = behaviour.run_behaviour(model, behaviour.load_stimuli(config.stimuli), batch_size=4,
                                     progress=False, seed=1)
    pd.testing.assert_frame_equal(engine.table, result.table)


@pytest.mark.integration
def test_an_unfinished_folder_does_not_load(tmp_path, model):
    result = behaviour.run(_configs(tmp_path)[0], model=model, progress=False)
    out = result.save(tmp_path / "b")
    (out / "result.json").unlink()
    with pytest.raises(TomlensError, match="no finished run"):
        behaviour.BehaviourResult.load(out)


@pytest.mark.integration
def test_cache_run_save_load_and_reuse(tmp_path, model):
    config = _configs(tmp_path)[1]
    first = cache.run(config, model=model, progress=False)
    assert not first.summary.reused and first.summary.sites == ("resid_post:0", "resid_post:1", "head_out:1")
    out = first.save(tmp_path / "cache")
    back = cache.CacheResult.load(out)
    assert back.path == first.path and back.config == config and back.describe() == first.describe()
    for kind in ("resid_post", "head_out"):
        for pos in ("final", "protagonist"):
            assert torch.equal(back.activations.get(kind, pos), first.activations.get(kind, pos))
    again = cache.run(config, model=model, progress=False)
    assert again.summary.reused and again.path == first.path and "reused, model not run" in again.describe()


@pytest.mark.integration
def test_probes_run_save_load(tmp_path, model):
    config = _configs(tmp_path)[2]
    result = probes.run(config, model=model, progress=False)
    assert set(result.table["test_set"]) != {"same"}  # tested on the second stimulus set
    out = result.save(tmp_path / "probes")
    assert (out / "probes.csv").is_file() and (out / "directions.safetensors").is_file()
    back = probes.ProbesResult.load(out)
    assert back.config == config and back.summary == result.summary
    pd.testing.assert_frame_equal(back.table, result.table, check_exact=True)  # csv read back exactly
    assert back.directions.keys() == result.directions.keys()
    assert all(torch.equal(back.directions[k], result.directions[k]) for k in result.directions)
    assert back.metadata["notes"] == result.metadata["notes"]
    assert back.describe() == result.describe() and "protagonist_belief" in back.describe()
    assert back.manifest["test_stimuli_hash"] == result.manifest["test_stimuli_hash"]
    # the unit chosen on `stimuli` and scored on `test_stimuli`, with the random-init twin as a baseline
    assert (out / "selection.json").is_file() and back.selection == result.selection
    assert set(result.selection) == {"protagonist_belief", "world_state"}
    sel = result.selection["protagonist_belief"]
    assert sel.n_perm == 9 and sel.n_evaluation == 32 and "random_init" in sel.baselines
    assert result.describe().startswith("selected unit, scored on held-out evaluation stories:")
    assert result.summary.selection["world_state"].verdict in ("found", "withheld")
    acts = result.table[result.table["features"] == "activations"]
    assert acts["baseline_random_init"].notna().all()
    assert (acts["best_baseline"] >= acts["baseline_random_init"]).all()  # the best is taken over the twin too


@pytest.mark.unit
def test_probe_cli_selection_flags_reach_the_config(monkeypatch, tmp_path):
    from tomlens.cli import build_parser, probe
    from tomlens.runs import probes as stage

    seen = []

    def stop(config, **kwargs):
        seen.append(config)
        raise SystemExit(0)

    monkeypatch.setattr(stage, "run", stop)
    stimuli = write_jsonl(generate("order-only", n=1, seed=1), tmp_path / "s.jsonl")
    base = ["probe", "--stimuli", str(stimuli), "--out", str(tmp_path / "o")]
    for flags in ([], ["--no-selection", "--n-permutations", "7", "--no-random-twin", "--selection-fraction", "0.3"]):
        with pytest.raises(SystemExit):
            probe.run(build_parser().parse_args(base + flags))
    default, chosen = seen
    assert (default.selection, default.n_permutations, default.random_twin) == (True, 1000, True)
    assert (chosen.selection, chosen.n_permutations, chosen.random_twin, chosen.select_fraction) == \
        (False, 7, False, 0.3)
    with pytest.raises(TomlensError, match="select_fraction"):
        probes.ProbesConfig(stimuli=StimuliSpec(path="s.jsonl"), select_fraction=1.0)


@pytest.mark.integration
def test_probe_cli_end_to_end(tmp_path, capsys):
    from tomlens.cli import main

    # 6 tasks: the selection half needs >= 3 (3 tasks would leave it 2: a clear error)
    stimuli = write_jsonl(generate("unexpected-transfer", n=6, seed=1), tmp_path / "s.jsonl")
    args = ["probe", "--model", "tiny-llama", "--stimuli", str(stimuli), "--sites", "resid_post,head_out",
            "--positions", "final", "--store", str(tmp_path / "store"), "--out", str(tmp_path / "out"),
            "--folds", "3", "--inner-folds", "2", "--c-grid", "0.1", "1", "--n-boot", "20", "--no-progress"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    out = tmp_path / "out"
    assert "head_out" in printed and f"{out}/probes.parquet" in printed and "layers_resid_post.html" in printed
    back = probes.ProbesResult.load(out)
    assert back.config.sites == ("resid_post", "head_out") and back.config.c_grid == (0.1, 1.0)
    assert back.describe() in printed
    assert (out / "heads_head_out_protagonist_belief.html").is_file()


@pytest.mark.integration
@pytest.mark.parametrize("flags, problem", [
    (["--positions", "final", "protagonist"], "one position"),
    (["--sites", "resid_pst"], "unknown site kind 'resid_pst': did you mean 'resid_post'?"),
    (["--sites", "resid_post:3"], "not a site kind"),
    (["--targets", "world"], "unknown probe target 'world': did you mean 'world_state'?"),
])
def test_probe_cli_refuses_bad_input_before_the_model_loads(flags, problem, tmp_path, capsys, monkeypatch):
    import tomlens.models
    from tomlens.cli import main

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(tomlens.models, "load_model", no_model)
    stimuli = write_jsonl(generate("unexpected-transfer", n=1, seed=1), tmp_path / "s.jsonl")
    assert main(["probe", "--stimuli", str(stimuli), "--out", str(tmp_path / "o"), *flags]) == 2
    assert problem in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


@pytest.mark.integration
def test_cache_and_behave_cli_write_run_folders(tmp_path, capsys):
    from tomlens.cli import main

    stimuli = write_jsonl(generate("unexpected-transfer", n=1, seed=0)[:4], tmp_path / "s.jsonl")
    base = ["--model", "tiny-llama", "--stimuli", str(stimuli), "--no-progress"]
    assert main(["cache", *base, "--sites", "resid_post:0", "--store", str(tmp_path / "store"),
                 "--out", str(tmp_path / "c")]) == 0
    loaded = cache.CacheResult.load(tmp_path / "c")
    assert loaded.config.sites == ("resid_post:0",) and loaded.activations.get("resid_post", "final").shape[:2] == (4, 1)
    assert main(["behave", *base, "--out", str(tmp_path / "b")]) == 0
    printed = capsys.readouterr().out
    b = behaviour.BehaviourResult.load(tmp_path / "b")
    assert b.describe() in printed and b.config.stimuli == (StimuliSpec(path=str(stimuli)),)
