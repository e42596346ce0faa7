"""`tomlens export`: stimuli and result tables as Hugging Face datasets and Parquet, read back equal."""

from __future__ import annotations

import json
import shutil
import socket

import pandas as pd
import pytest

from tomlens.cli import main
from tomlens.errors import TomlensError
from tomlens.io import read_table
from tomlens.runs.export import export_run, export_stimuli, read_exported_stimuli, stimulus_row
from tomlens.stimuli import generate, write_jsonl
from tomlens.stimuli.records import Span, Stimulus, stimuli_hash

datasets = pytest.importorskip("datasets", reason="the `datasets` extra is not installed (pip install 'tomlens[datasets]')")


@pytest.fixture(autouse=True)
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test here (each touches datasets): datasets offline for this test only (its config
    constant too, read when datasets was imported), and any network connection fails the test."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True, raising=False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True, raising=False)

    def refuse(self: socket.socket, address: object) -> None:
        if self.family in (socket.AF_INET, socket.AF_INET6):
            pytest.fail(f"the export tried to reach the network ({address!r})")
        return real(self, address)

    real = socket.socket.connect
    monkeypatch.setattr(socket.socket, "connect", refuse)


def _stimuli() -> list[Stimulus]:
    user = Stimulus(id="u1", text="Ana put the key in the drawer. Where will Ana look?", options=("drawer", "box"),
                    answer="drawer", family="user", condition="false_belief", world_state="box",
                    protagonist_belief="drawer", spans={"protagonist": Span(0, 3), "object": Span(12, 15)},
                    mentions={"protagonist": (Span(0, 3), Span(46, 49))}, meta={"k": 2, "tags": ["a", "b"]})
    return generate("unexpected-transfer", n=1) + generate("goal-encoding", n=1, ks=[0]) + [user]


def test_stimuli_round_trip_keeps_spans_labels_and_hash(tmp_path):
    stimuli = _stimuli()
    written = export_stimuli(stimuli, tmp_path / "x")
    assert set(written) == {"datasets", "parquet", "provenance"}
    for source in (tmp_path / "x", written["datasets"], written["parquet"]):
        back = read_exported_stimuli(source)
        assert back == stimuli and stimuli_hash(back) == stimuli_hash(stimuli)
    ds = datasets.load_from_disk(str(written["datasets"]))
    assert ds.num_rows == len(stimuli)
    row = ds[len(stimuli) - 1]
    assert row["spans"] == [{"role": "protagonist", "start": 0, "end": 3, "text": "Ana"},
                            {"role": "object", "start": 12, "end": 15, "text": "key"}]
    assert [m["start"] for m in row["mentions"]] == [0, 46]
    assert (row["world_state"], row["protagonist_belief"], row["belief_differs"]) == ("box", "drawer", True)
    assert json.loads(row["meta"]) == {"k": 2, "tags": ["a", "b"]}
    assert row["stimulus_hash"] == stimulus_row(stimuli[-1])["stimulus_hash"] != ds[0]["stimulus_hash"]
    assert "MIT" in ds.info.license and "user: unknown" in ds.info.description
    assert pd.read_parquet(written["parquet"])["id"].tolist() == [s.id for s in stimuli]
    prov = json.loads(written["provenance"].read_text())
    assert prov["stimuli_hash"] == stimuli_hash(stimuli) and prov["versions"]["datasets"] == datasets.__version__


def test_bigtom_rows_carry_its_licence_and_citation(tmp_path):
    s = Stimulus(id="b1", text="Noor fills the pitcher. Noor believes it holds", options=("oat milk", "almond milk"),
                 answer="oat milk", family="bigtom")
    ds = datasets.load_from_disk(str(export_stimuli([s], tmp_path, formats=("datasets",))["datasets"]))
    assert ds.info.license == "MIT" and "Gandhi" in ds.info.citation
    assert not (tmp_path / "stimuli.parquet").exists()


def test_unknown_format_and_a_non_empty_folder_are_refused(tmp_path):
    with pytest.raises(TomlensError, match="unknown export format"):
        export_stimuli(_stimuli(), tmp_path / "a", formats=("arrow",))
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "keep.txt").write_text("mine")
    with pytest.raises(TomlensError, match="not empty"):
        export_stimuli(_stimuli(), tmp_path / "b")
    with pytest.raises(TomlensError, match="holds no earlier tomlens export"):  # force needs an export to replace
        export_stimuli(_stimuli(), tmp_path / "b", force=True)
    export_stimuli(_stimuli(), tmp_path / "c")
    (tmp_path / "c" / "keep.txt").write_text("mine")
    export_stimuli(_stimuli()[:2], tmp_path / "c", force=True, formats=("datasets",))
    assert not (tmp_path / "c" / "stimuli.parquet").exists()  # no stale file beside the new export
    assert len(read_exported_stimuli(tmp_path / "c")) == 2
    assert (tmp_path / "c" / "keep.txt").read_text() == "mine"  # what is not an export's stays
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == ["keep.txt", "provenance.json", "stimuli"]


def test_force_never_deletes_a_users_own_files(tmp_path, run_folder):
    """--force replaces only what an earlier export's provenance.json lists; a user's README.md or
    stimuli/ folder is refused, not deleted."""
    user = tmp_path / "u"
    (user / "stimuli").mkdir(parents=True)
    (user / "stimuli" / "notes.txt").write_text("my notes")
    (user / "README.md").write_text("# my project")
    with pytest.raises(TomlensError, match="holds no earlier tomlens export"):
        export_stimuli(_stimuli(), user, force=True)
    with pytest.raises(TomlensError, match="holds no earlier tomlens export"):
        export_run(run_folder, user, force=True)
    (user / "provenance.json").write_text(json.dumps({"kind": "notes", "files": {"x": "stimuli"}}))
    with pytest.raises(TomlensError, match="holds no earlier tomlens export"):  # not an export's provenance
        export_stimuli(_stimuli(), user, force=True)
    assert (user / "stimuli" / "notes.txt").read_text() == "my notes" and (user / "README.md").read_text() == "# my project"
    # an earlier stimuli export (no card) with a user's README.md beside it: a run export's card may not overwrite it
    export_stimuli(_stimuli(), tmp_path / "e")
    (tmp_path / "e" / "README.md").write_text("# mine")
    with pytest.raises(TomlensError, match="overwrite README.md"):
        export_run(run_folder, tmp_path / "e", force=True)
    assert (tmp_path / "e" / "README.md").read_text() == "# mine" and read_exported_stimuli(tmp_path / "e") == _stimuli()
    export_run(run_folder, tmp_path / "e", force=True, formats=("datasets",))  # no card: allowed, the stimuli export goes
    assert sorted(p.name for p in (tmp_path / "e").iterdir()) == ["README.md", "datasets", "provenance.json"]
    assert (tmp_path / "e" / "README.md").read_text() == "# mine"


def test_a_failed_export_leaves_the_earlier_one_and_names_the_file(tmp_path, run_folder):
    export_run(run_folder, tmp_path / "e", formats=("parquet",))
    before = {p.relative_to(tmp_path / "e"): p.read_bytes() for p in (tmp_path / "e").rglob("*") if p.is_file()}
    broken = tmp_path / "run"
    shutil.copytree(run_folder, broken)
    (broken / "probes" / "scores.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(TomlensError, match=r"cannot export probes/scores\.parquet") as err:
        export_run(broken, tmp_path / "e", force=True)
    assert "earlier export" in err.value.fix
    after = {p.relative_to(tmp_path / "e"): p.read_bytes() for p in (tmp_path / "e").rglob("*") if p.is_file()}
    assert after == before  # nothing deleted, nothing half-written, no build folder left behind


def test_licences_come_from_the_stimulus_families(monkeypatch):
    """Every built-in family (and one added later to FAMILIES) is labelled MIT; a user's family is unknown."""
    from tomlens.runs.export import source_info
    from tomlens.stimuli import FAMILIES

    monkeypatch.setitem(FAMILIES, "added-later", ("tomlens.stimuli.order_only", "order_only"))
    for family in [*FAMILIES, "bigtom"]:
        s = Stimulus(id="x", text="a b", options=("a", "b"), answer="a", family=family)
        assert source_info([s])["license"] == "MIT", family
    assert {"motomqa", "kosoy"} <= set(FAMILIES)
    s = Stimulus(id="x", text="a b", options=("a", "b"), answer="a", family="mine")
    assert source_info([s])["license"] == "unknown"


RUN = """name = "export-small"
[model]
name = "tiny-llama"
[behaviour]
n_boot = 50
[[behaviour.stimuli]]
family = "unexpected-transfer"
n = 1
[probes]
stimuli = {family = "order-only", n = 4, seed = 1}
sites = ["resid_post"]
folds = 2
inner_folds = 2
n_boot = 10
n_permutations = 20
c_grid = [1.0]
bow = false
random_twin = false
"""


@pytest.fixture(scope="module")
def run_folder(tmp_path_factory: pytest.TempPathFactory) -> object:
    """A behaviour + probes run of tiny-llama (a few seconds), shared by the run tests."""
    from tomlens.runs.experiment import ExperimentConfig, run_experiment

    root = tmp_path_factory.mktemp("export-run")
    (root / "small.toml").write_text(RUN)
    run_experiment(ExperimentConfig.load(root / "small.toml"), root / "run", progress=False)
    return root / "run"


def test_a_run_exports_every_table_and_reads_back_equal(run_folder, tmp_path):
    written = export_run(run_folder, tmp_path / "e")
    prov = json.loads(written["provenance"].read_text())
    splits = prov["splits"]
    tables = {name for name, i in splits.items() if i["kind"] == "table"}
    assert {"behaviour.prompts", "behaviour.accuracy", "probes.probes"} <= tables
    sources = {f"{p.parent.name}.{p.stem}": p for p in run_folder.glob("*/*") if p.suffix in (".csv", ".parquet")}
    assert tables == set(sources)
    dd = datasets.load_from_disk(str(written["datasets"]))
    assert set(dd) == set(splits)
    for name in tables:
        source = read_table(sources[name])
        assert len(source) > 0, f"{name} is empty: the round trip would check no rows"
        pd.testing.assert_frame_equal(dd[name].to_pandas(), source)
        pd.testing.assert_frame_equal(pd.read_parquet(written["parquet"] / f"{name}.parquet"), source)
    # the stimuli each stage ran on, regenerated and checked against the hash its manifest recorded
    for stage in ("behaviour", "probes"):
        recorded = json.loads((run_folder / stage / "manifest.json").read_text())["stimuli_hash"]
        back = read_exported_stimuli(written["parquet"] / f"{stage}.stimuli.parquet")
        assert stimuli_hash(back) == recorded == splits[f"{stage}.stimuli"]["stimuli_hash"]
        assert dd[f"{stage}.stimuli"].num_rows == len(back)
    assert prov["run_manifest"] == json.loads((run_folder / "manifest.json").read_text())
    # every file of the run is accounted for: a split, a JSON file inside provenance.json, or skipped with why
    exported = {i["file"] for i in splits.values() if "file" in i} | set(prov["json_files"]) | {"manifest.json", "config.json"}
    skipped = {s["what"]: s["why"] for s in prov["skipped"]}
    everything = {str(p.relative_to(run_folder)) for p in run_folder.glob("*/*")} | {p.name for p in run_folder.iterdir() if p.is_file()}
    assert everything - exported == set(skipped) and not exported & set(skipped)
    assert skipped["probes/directions.safetensors"].startswith("not a table (.safetensors)")
    assert "probes/selection.json" in prov["json_files"] and "behaviour/result.json" in prov["json_files"]
    assert prov["json_files"]["probes/selection.json"] == json.loads((run_folder / "probes" / "selection.json").read_text())
    # the stimuli back from the whole export, by split; a missing split lists the ones there are
    for source in (tmp_path / "e", written["datasets"], written["parquet"]):
        assert stimuli_hash(read_exported_stimuli(source, split="probes.stimuli")) == splits["probes.stimuli"]["stimuli_hash"]
        with pytest.raises(TomlensError, match="its stimuli splits: behaviour.stimuli, probes.stimuli"):
            read_exported_stimuli(source, split="probes.probes")
        with pytest.raises(TomlensError, match="no split given"):
            read_exported_stimuli(source)
    # the card names each Parquet file as a config, so `load_dataset(<export folder>, <split>)` finds it
    probes = datasets.load_dataset(str(tmp_path / "e"), "probes.probes", split="train", cache_dir=str(tmp_path / "cache"))
    pd.testing.assert_frame_equal(probes.to_pandas(), read_table(sources["probes.probes"]))


def test_a_changed_stimulus_file_is_reported_not_exported(tmp_path):
    """Stimuli that no longer hash to what the run recorded are skipped with the reason, never passed off."""
    from tomlens.runs.base import ModelSpec, StimuliSpec
    from tomlens.runs.behaviour import BehaviourConfig
    from tomlens.runs.behaviour import run as run_behaviour

    path = tmp_path / "s.jsonl"
    write_jsonl(generate("unexpected-contents", n=1)[:4], path)
    (tmp_path / "run").mkdir()
    result = run_behaviour(BehaviourConfig(model=ModelSpec(name="tiny-llama"), stimuli=(StimuliSpec(path=str(path)),),
                                           n_boot=10), progress=False)
    result.save(tmp_path / "run" / "behaviour")
    (tmp_path / "run" / "manifest.json").write_text(json.dumps({"name": "x", "models": []}))
    write_jsonl(generate("unexpected-contents", n=1)[4:8], path)  # the file changes after the run
    prov = json.loads(export_run(tmp_path / "run", tmp_path / "e", formats="parquet")["provenance"].read_text())
    assert "behaviour.stimuli" not in prov["splits"] and "behaviour.prompts" in prov["splits"]
    assert prov["skipped"][0]["what"] == "behaviour stimuli" and "not the recorded" in prov["skipped"][0]["why"]
    assert not (tmp_path / "e" / "datasets").exists()


def test_cli_exports_a_run_and_a_family(run_folder, tmp_path, capsys):
    assert main(["export", str(run_folder), "--out", str(tmp_path / "r"), "--format", "parquet", "--no-progress"]) == 0
    said = capsys.readouterr().out
    assert "wrote parquet" in said and "not exported (listed with why under `skipped`" in said
    assert (tmp_path / "r" / "parquet" / "probes.probes.parquet").is_file() and not (tmp_path / "r" / "datasets").exists()
    assert main(["export", "--family", "order-only", "--n", "2", "--seed", "3", "--out", str(tmp_path / "f"),
                 "--no-progress"]) == 0
    assert read_exported_stimuli(tmp_path / "f") == generate("order-only", n=2, seed=3)
    path = tmp_path / "s.jsonl"
    write_jsonl(_stimuli(), path)
    assert main(["export", "--stimuli", str(path), "--out", str(tmp_path / "j"), "--format", "datasets"]) == 0
    assert read_exported_stimuli(tmp_path / "j") == _stimuli()


@pytest.mark.parametrize("argv, problem", [
    (["{tmp}", "--out", "{tmp}/o"], "not a run folder"),
    (["{tmp}/missing", "--out", "{tmp}/o"], "does not exist"),
    (["--family", "order-only", "--out", "{tmp}/o", "--format", "arrow"], "unknown --format"),
    (["--out", "{tmp}/o"], "either RUN_FOLDER or a stimulus source"),
    (["--family", "order-only", "--n", "1", "--out", "{tmp}/full"], "not empty"),
    (["--family", "no-such-family", "--out", "{tmp}/o"], "no-such-family"),
])
def test_cli_bad_input_exits_2_with_the_fix(tmp_path, capsys, argv, problem):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    assert main(["export", *[a.format(tmp=tmp_path) for a in argv]]) == 2
    err = capsys.readouterr().err
    assert problem in err and "fix:" in err


def test_a_multi_model_run_gets_one_split_per_model_and_says_what_did_not_finish(run_folder, tmp_path):
    """`<out>/<model>/<stage>/` (several models): splits are named by model; an unfinished stage is
    listed under `skipped` with why, not exported."""
    run = tmp_path / "multi"
    for slug in ("tiny-llama", "tiny-llama-bos"):
        for stage in ("behaviour", "probes"):
            shutil.copytree(run_folder / stage, run / slug / stage)
    shutil.copy(run_folder / "manifest.json", run / "manifest.json")
    (run / "tiny-llama-bos" / "probes" / "result.json").unlink()  # as a run stopped mid-stage leaves it
    written = export_run(run, tmp_path / "e", formats=("datasets",))
    prov = json.loads(written["provenance"].read_text())
    unfinished = [s for s in prov["skipped"] if s["what"].startswith("tiny-llama-bos/probes")]
    assert unfinished == [{"what": "tiny-llama-bos/probes", "why": "the stage did not finish (no result.json)"}]
    assert {"tiny-llama/probes/directions.safetensors", "tiny-llama-bos/behaviour/result.json"} <= (
        {s["what"] for s in prov["skipped"]} | set(prov["json_files"]))
    dd = datasets.load_from_disk(str(written["datasets"]))
    assert {"tiny_llama.probes.probes", "tiny_llama_bos.behaviour.prompts", "tiny_llama_bos.behaviour.stimuli"} <= set(dd)
    assert not any(name.startswith("tiny_llama_bos.probes") for name in dd)
    assert prov["splits"]["tiny_llama_bos.behaviour.prompts"]["model"] == "tiny-llama-bos"
    pd.testing.assert_frame_equal(dd["tiny_llama_bos.behaviour.prompts"].to_pandas(),
                                  read_table(run_folder / "behaviour" / "prompts.parquet"))


def test_the_pairs_stages_stimuli_keep_their_pair_labels(tmp_path):
    """A pair's two prompts mean nothing apart: the pairs stage's split carries pair_id, contrast and side."""
    from tomlens.runs.base import ModelSpec
    from tomlens.runs.pairs import PairsConfig
    from tomlens.runs.pairs import run as run_pairs
    from tomlens.stimuli.pairs import read_pairs

    run_pairs(PairsConfig(model=ModelSpec(name="tiny-llama"), family="unexpected-transfer", n=1),
              progress=False).save(tmp_path / "run" / "pairs")
    (tmp_path / "run" / "manifest.json").write_text(json.dumps({"name": "pairs-only"}))
    written = export_run(tmp_path / "run", tmp_path / "e")
    pairs = read_pairs(tmp_path / "run" / "pairs" / "pairs.jsonl")
    for df in (datasets.load_from_disk(str(written["datasets"]))["pairs.stimuli"].to_pandas(),
               pd.read_parquet(written["parquet"] / "pairs.stimuli.parquet")):
        assert df["pair_id"].tolist() == [p.id for p in pairs for _ in (0, 1)]
        assert df["side"].tolist() == ["clean", "corrupted"] * len(pairs)
        assert df["contrast"].tolist() == [p.contrast for p in pairs for _ in (0, 1)]
        assert df["id"].tolist() == [s.id for p in pairs for s in (p.clean, p.corrupted)]
    assert read_exported_stimuli(tmp_path / "e", split="pairs.stimuli") == [s for p in pairs for s in (p.clean, p.corrupted)]
    prov = json.loads(written["provenance"].read_text())
    assert prov["splits"]["pairs.stimuli"]["file"] == "pairs/pairs.jsonl"
    assert "pairs/pairs.jsonl" not in {s["what"] for s in prov["skipped"]}
    assert "pairs/pairs.report.json" in prov["json_files"]


def test_split_name_collisions_get_distinct_names_that_say_why(run_folder, tmp_path):
    """A csv and a parquet table with one stem, "a-b" beside "a_b", a stage table named stimuli: every
    source becomes its own split, each named in the index, none silently dropped."""
    run = tmp_path / "run"
    shutil.copytree(run_folder, run)
    prompts = read_table(run / "behaviour" / "prompts.parquet")
    prompts.head(3).to_csv(run / "behaviour" / "prompts.csv", index=False)  # the same stem in another format
    pd.DataFrame({"x": [1, 2]}).to_csv(run / "behaviour" / "a-b.csv", index=False)
    pd.DataFrame({"x": [3]}).to_parquet(run / "behaviour" / "a_b.parquet")
    pd.DataFrame({"y": ["s"]}).to_csv(run / "behaviour" / "stimuli.csv", index=False)
    written = export_run(run, tmp_path / "e")
    splits = json.loads(written["provenance"].read_text())["splits"]
    dd = datasets.load_from_disk(str(written["datasets"]))
    files = [i["file"] for i in splits.values() if i["kind"] == "table"]
    assert len(files) == len(set(files)) and {f"behaviour/{n}" for n in (
        "prompts.csv", "prompts.parquet", "a-b.csv", "a_b.parquet", "stimuli.csv")} <= set(files)
    by_file = {i["file"]: name for name, i in splits.items() if "file" in i}
    assert by_file["behaviour/prompts.parquet"] == "behaviour.prompts"  # the stage's own format keeps the name
    assert by_file["behaviour/prompts.csv"] == "behaviour.prompts_csv"
    assert splits["behaviour.prompts_csv"]["renamed"] == "split behaviour.prompts is behaviour/prompts.parquet's"
    assert {by_file["behaviour/a-b.csv"], by_file["behaviour/a_b.parquet"]} == {"behaviour.a_b", "behaviour.a_b_2"}
    assert splits["behaviour.stimuli"]["kind"] == "stimuli" and by_file["behaviour/stimuli.csv"] == "behaviour.stimuli_2"
    for file, name in by_file.items():
        if file.endswith((".csv", ".parquet")):
            pd.testing.assert_frame_equal(dd[name].to_pandas(), read_table(run / file))
            pd.testing.assert_frame_equal(pd.read_parquet(written["parquet"] / f"{name}.parquet"), read_table(run / file))
    assert len(read_exported_stimuli(written["parquet"], split="behaviour.stimuli")) == splits["behaviour.stimuli"]["rows"]
