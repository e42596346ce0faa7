"""`tomlens store` (list, size, prune the activation store) and `tomlens runs` (the run index)."""

from __future__ import annotations

import fcntl
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from tomlens.activations import housekeeping as hk
from tomlens.activations import store as st
from tomlens.cli import main
from tomlens.errors import TomlensError
from tomlens.runs import index as ix
from tomlens.runs.files import finish_save

pytestmark = pytest.mark.unit

NOW = datetime(2026, 11, 27, 12, 0, tzinfo=UTC)


@pytest.fixture(autouse=True)
def own_index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test reads an index only its own runs were written to."""
    monkeypatch.setenv("TOMLENS_RUN_INDEX", str(tmp_path / "index" / "runs.jsonl"))


def _entry(root: Path, key: str, *, model: str = "smollm2-135m", days_old: float = 0, complete: bool = True,
           size: int = 1000) -> Path:
    folder = root / key
    folder.mkdir(parents=True)
    (folder / st.shard_file(0)).write_bytes(b"x" * size)
    if complete:
        created = (NOW - timedelta(days=days_old)).strftime("%Y-%m-%dT%H:%M:%S%z")
        manifest = {"format": st.FORMAT, "complete": True, "key": key, "created": created, "n": 8,
                    "model": {"model": model}, "layers": {"resid_post": [0, 1, 2]}, "positions": ["final"],
                    "shards": [{"file": st.shard_file(0), "start": 0, "stop": 8}]}
        (folder / st.MANIFEST).write_text(json.dumps(manifest))
    return folder


def _key(i: int) -> str:
    return f"{i:024x}"


@pytest.fixture
def store(tmp_path: Path) -> Path:
    root = tmp_path / "activations"
    _entry(root, _key(1), days_old=40, size=3000)
    _entry(root, _key(2), days_old=2, model="gemma3-270m")
    _entry(root, _key(3), complete=False)
    (root / "notes.txt").write_text("a user's file: never listed or removed")
    return root


def test_entries_are_listed_with_model_size_and_state(store: Path) -> None:
    entries = hk.list_entries(store)
    assert [e.key for e in entries if e.complete] == [_key(1), _key(2)]
    first = next(e for e in entries if e.key == _key(1))
    assert first.model == "smollm2-135m" and first.rows == 8 and first.sites == "resid_post x 3 layers"
    assert first.bytes >= 3000
    assert [e.key for e in entries if not e.complete] == [_key(3)]
    usage = hk.usage_by_model(entries)
    assert usage[0].model == "smollm2-135m" and usage[0].entries == 1


def test_prune_needs_a_criterion_and_criteria_combine(store: Path) -> None:
    entries = hk.list_entries(store)
    with pytest.raises(TomlensError, match="needs a criterion"):
        hk.select_for_pruning(entries)
    old = hk.select_for_pruning(entries, older_than=timedelta(days=30), now=NOW)
    assert [e.key for e in old] == [_key(1)]
    assert [e.key for e in hk.select_for_pruning(entries, incomplete=True, now=NOW)] == [_key(3)]
    assert hk.select_for_pruning(entries, older_than=timedelta(days=30), incomplete=True, now=NOW) == []
    assert len(hk.select_for_pruning(entries, everything=True)) == 3


def test_removing_skips_an_entry_another_process_writes(store: Path) -> None:
    entries = hk.select_for_pruning(hk.list_entries(store), everything=True)
    with open(store / _key(2) / st.LOCK, "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # a live writer (flock is per open file: this blocks the prune's)
        removed, busy = hk.remove_entries(entries)
    assert {e.key for e in removed} == {_key(1), _key(3)} and [e.key for e in busy] == [_key(2)]
    assert sorted(p.name for p in store.iterdir()) == [_key(2), "notes.txt"]


def test_a_run_folder_names_the_entries_it_used(store: Path, tmp_path: Path) -> None:
    run = tmp_path / "run" / "probes"
    run.mkdir(parents=True)
    (run / "result.json").write_text(json.dumps({"activations": str(store / _key(2)),
                                                 "hash": "f" * 64 + _key(1)[:10]}))  # not a key on its own
    assert hk.store_folders_named_in(tmp_path / "run", store) == {_key(2)}
    with pytest.raises(TomlensError, match="does not exist"):
        hk.store_folders_named_in(tmp_path / "nowhere", store)


@pytest.mark.parametrize("text, expected", [("30d", timedelta(days=30)), ("12h", timedelta(hours=12)),
                                            ("2w", timedelta(weeks=2)), ("1.5", timedelta(days=1.5))])
def test_ages_read_with_units(text: str, expected: timedelta) -> None:
    assert hk.parse_age(text) == expected


@pytest.mark.parametrize("text", ["month", "-3d", ""])
def test_a_bad_age_is_one_clear_error(text: str) -> None:
    with pytest.raises(TomlensError, match="older-than"):
        hk.parse_age(text)


def test_store_cli_lists_sizes_and_prunes(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["store", "--store", str(store), "ls"]) == 0
    out = capsys.readouterr().out
    assert _key(1) in out and "[unfinished]" in out and "3 entries" in out
    assert main(["store", "--store", str(store), "du"]) == 0
    assert "gemma3-270m" in capsys.readouterr().out
    assert main(["store", "--store", str(store), "prune", "--incomplete", "--dry-run"]) == 0
    assert "1 entries" in capsys.readouterr().out and (store / _key(3)).exists()
    assert main(["store", "--store", str(store), "prune", "--incomplete"]) == 0
    assert "removed 1 entries" in capsys.readouterr().out and not (store / _key(3)).exists()
    assert main(["store", "--store", str(store), "prune"]) == 2  # no criterion: nothing removed
    assert "needs a criterion" in capsys.readouterr().err and (store / _key(1)).exists()


def _stage(folder: Path, result: dict, model: str = "tiny-llama", argv: list[str] | None = None) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    finish_save(folder, None, {"model": {"model": model}, "argv": argv or ["tomlens", "patch"]}, result)


def test_every_finished_save_is_indexed_and_stages_fold_into_their_experiment(tmp_path: Path) -> None:
    exp = tmp_path / "exp"
    exp.mkdir()
    (exp / "config.json").write_text(json.dumps({"name": "study", "models": [{"name": "tiny-llama"}],
                                                 "probes": {}, "patching": {}}))
    _stage(exp / "probes", {"rows": 3})
    _stage(exp / "patching", {"withheld": "WITHHELD: the gate failed"})
    single = tmp_path / "patch-run"
    _stage(single, {"topk": []}, model="smollm2-135m")
    gone = tmp_path / "gone"
    _stage(gone, {})
    for p in gone.iterdir():
        p.unlink()
    gone.rmdir()
    runs = {e.folder.name: e for e in ix.list_runs()}
    assert set(runs) == {"exp", "patch-run"}  # stages folded, a deleted run dropped
    assert runs["exp"].kind == "experiment" and runs["exp"].stages == ("probes", "patching")
    assert runs["exp"].verdict == "patching withheld" and runs["exp"].models == ("tiny-llama",)
    assert runs["patch-run"].kind == "patch" and runs["patch-run"].models == ("smollm2-135m",)
    lines = ix.index_path().read_text().splitlines()
    assert len(lines) == 2  # compacted: one line per run still on disk


def test_an_experiment_with_a_stage_not_run_says_it_is_unfinished(tmp_path: Path) -> None:
    exp = tmp_path / "exp"
    exp.mkdir()
    (exp / "config.json").write_text(json.dumps({"name": "half", "models": [{"name": "m"}],
                                                 "probes": {}, "steering": {}}))
    _stage(exp / "probes", {})
    (entry,) = [e for e in ix.list_runs() if e.folder.name == "exp"]
    assert entry.unfinished == ("steering",) and entry.verdict == "unfinished"


def test_runs_cli_lists_and_finds_runs_under_a_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    elsewhere = tmp_path / "elsewhere" / "probe-run"
    elsewhere.mkdir(parents=True)
    (elsewhere / "result.json").write_text("{}")
    (elsewhere / "probes.json").write_text("{}")
    assert main(["runs", str(tmp_path / "elsewhere")]) == 0
    out = capsys.readouterr().out
    assert "probe-run" in out and "[probe]" in out


def test_an_index_that_cannot_be_written_never_fails_a_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("TOMLENS_RUN_INDEX", str(blocker / "runs.jsonl"))  # a folder that is a file
    _stage(tmp_path / "run", {})
    assert (tmp_path / "run" / "result.json").is_file()


def test_a_writer_whose_lock_file_was_pruned_under_it_locks_the_folder_again(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / _key(9)
    answers = iter([False, True])  # the first lock file taken is a pruned folder's, the second is current
    monkeypatch.setattr(st, "_still_the_folders", lambda handle, f: next(answers))
    entered = 0
    with st.writer_lock(folder):
        entered += 1
    assert entered == 1 and next(answers, "used up") == "used up"


def test_pruning_leaves_no_half_removed_folder(store: Path) -> None:
    hk.remove_entries(hk.select_for_pruning(hk.list_entries(store), everything=True))
    assert sorted(p.name for p in store.iterdir()) == ["notes.txt"]
