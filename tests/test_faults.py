"""Faults a long run meets: kill -9 in the middle of `tomlens cache` and `tomlens probe`, a
half-written manifest, and an out-of-memory error in caching and in behaviour scoring.

After each, the same command (or call) finishes, its results equal an uninterrupted run, and no
partial file ever loads as valid.

The killed commands run in subprocesses as `python -m tomlens` through a small wrapper that
injects the fault: it writes half of shard `k` to its temporary file, says so in a marker file and
sleeps, so the test kills a run that is provably mid-way (shards 0..k-1 finished, shard k half
written, no manifest) instead of racing a fast tiny model with a timer.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

import tomlens.activations.store as st
from tomlens.activations import ActivationSet, cache_activations, load_activations
from tomlens.behaviour.scoring import score_options
from tomlens.cli import main as cli_main
from tomlens.errors import TomlensError
from tomlens.stimuli import generate
from tomlens.stimuli.records import write_jsonl

WRAPPER = r'''
"""`python -m tomlens` with one injected fault (tests/test_faults.py), chosen by environment variables."""
import os, runpy, sys, time
from pathlib import Path

import tomlens.activations.cache as cache
import tomlens.activations.store as store

if "FAULT_FLUSH_SECONDS" in os.environ:  # small shards for commands that have no flag for it
    cache.FLUSH_SECONDS = float(os.environ["FAULT_FLUSH_SECONDS"])
hang_at = int(os.environ.get("FAULT_HANG_IN_SHARD", "-1"))
real_save, saved = store.save_file, []


def save_half_then_hang(tensors, filename, metadata=None):
    if len(saved) == hang_at:  # half a shard in its temporary file, a marker, then wait for kill -9
        real_save(tensors, filename, metadata=metadata)
        data = Path(filename).read_bytes()
        Path(filename).write_bytes(data[: len(data) // 2])
        marker = Path(os.environ["FAULT_MARKER"])
        marker.with_suffix(".tmp").write_text(filename)
        marker.with_suffix(".tmp").replace(marker)
        time.sleep(600)
    real_save(tensors, filename, metadata=metadata)
    saved.append(filename)


store.save_file = save_half_then_hang
sys.argv[0] = "tomlens"
runpy.run_module("tomlens", run_name="__main__", alter_sys=True)
'''

HANG_IN_SHARD = 3  # the killed run has finished shards 0, 1 and 2 and is writing shard 3


@pytest.fixture(scope="module")
def stimulus_file(tmp_path_factory) -> tuple[Path, list]:
    stimuli = generate("unexpected-transfer", n=3, seed=0)  # 48 prompts, 3 stories
    return write_jsonl(stimuli, tmp_path_factory.mktemp("stimuli") / "ut.jsonl"), stimuli


def _start(tmp_path: Path, args: list[str], env: dict[str, str]) -> subprocess.Popen:
    wrapper = tmp_path / "fault_tomlens.py"
    wrapper.write_text(WRAPPER)
    return subprocess.Popen([sys.executable, str(wrapper), *args], env={**os.environ, **env},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _kill_when_mid_way(proc: subprocess.Popen, marker: Path, timeout: float = 300.0) -> Path:
    """Wait for the marker (the run is writing shard HANG_IN_SHARD), then kill -9; return the
    half-written temporary file it names."""
    deadline = time.monotonic() + timeout
    while not marker.exists():
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"the run ended (rc {proc.returncode}) before reaching the fault:\n{out}\n{err}")
        if time.monotonic() > deadline:
            proc.kill()
            proc.communicate()
            pytest.fail("the run did not reach the fault in time")
        time.sleep(0.05)
    proc.kill()  # SIGKILL: no cleanup handler runs
    proc.communicate()
    assert proc.returncode == -9
    return Path(marker.read_text())


def _finish(tmp_path: Path, args: list[str], env: dict[str, str] | None = None) -> str:
    proc = _start(tmp_path, args, env or {})
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err
    return out


def _check_killed_store(store: Path, half: Path) -> tuple[Path, dict[str, tuple[int, int]], dict[str, dict]]:
    """The killed run's folder: finished shards 0..k-1, half of shard k in a temporary file, no
    manifest; nothing of it loads as a finished cache. Returns the folder, each finished shard's
    (inode, mtime) and its tensors."""
    (folder,) = [p for p in store.iterdir() if p.is_dir()]
    assert half.parent == folder and half.name.startswith(f".{st.shard_file(HANG_IN_SHARD)}.")
    finished = sorted(p.name for p in folder.glob("shard-*.safetensors"))
    assert finished == [st.shard_file(i) for i in range(HANG_IN_SHARD)]
    assert not (folder / st.MANIFEST).exists()
    with pytest.raises(TomlensError, match="no finished activation cache"):
        load_activations(folder)
    with pytest.raises(SafetensorError):  # half a shard is no safetensors file: it can never load as one
        safe_open(str(half), framework="pt", device="cpu")
    stats = {name: ((folder / name).stat().st_ino, (folder / name).stat().st_mtime_ns) for name in finished}
    tensors = {name: load_file(str(folder / name)) for name in finished}
    return folder, stats, tensors


def _check_resumed_store(folder: Path, stats: dict[str, tuple[int, int]], tensors: dict[str, dict],
                         reference: ActivationSet, kinds: list[str]) -> None:
    """The finished store: the killed run's shards kept as they were (loaded, not recomputed, and
    their bytes come back exactly), the half shard gone, every row once and in order, and the
    numbers equal to an uninterrupted run's."""
    acts = load_activations(folder)
    assert not list(folder.glob(".*.tmp"))
    assert {n: ((folder / n).stat().st_ino, (folder / n).stat().st_mtime_ns) for n in stats} == stats
    assert acts.ids == reference.ids and len(set(acts.ids)) == len(acts)
    shards = acts.manifest["shards"]
    assert shards[0]["start"] == 0 and shards[-1]["stop"] == len(acts)
    assert all(a["stop"] == b["start"] for a, b in zip(shards, shards[1:], strict=False))
    for kind in kinds:
        got = acts.get(kind, "final")
        for saved in tensors.values():  # bytes that were only loaded come back exactly
            assert torch.equal(got[saved[st.ROWS]], saved[st.tensor_name(kind, "final")])
        # another process, maybe other batches than the reference: equal to fp32 tolerance
        torch.testing.assert_close(got, reference.get(kind, "final"), rtol=1e-5, atol=1e-5)


def test_kill_9_mid_cache_then_the_same_command_finishes_as_if_never_killed(tmp_path, stimulus_file, capsys):
    path, stimuli = stimulus_file
    request = ["cache", "--model", "tiny-llama", "--stimuli", str(path), "--sites", "resid_post", "head_out:1",
               "--positions", "final", "--no-progress"]
    args = [*request, "--store", str(tmp_path / "store"), "--batch-size", "4", "--flush-seconds", "0"]
    marker = tmp_path / "marker"
    proc = _start(tmp_path, args, {"FAULT_HANG_IN_SHARD": str(HANG_IN_SHARD), "FAULT_MARKER": str(marker)})
    try:
        assert cli_main([*request, "--store", str(tmp_path / "reference")]) == 0  # meanwhile, uninterrupted
        (ref_folder,) = (tmp_path / "reference").iterdir()
        reference = load_activations(ref_folder)
        assert len(reference.manifest["shards"]) == 1  # default batches of 16 and default flushing: one shard
        half = _kill_when_mid_way(proc, marker)
    finally:
        proc.kill()  # never leave the hanging child behind when an assertion fails first
    folder, stats, tensors = _check_killed_store(tmp_path / "store", half)
    assert sum(len(t[st.ROWS]) for t in tensors.values()) == HANG_IN_SHARD * 4  # one batch of 4 per shard

    out = _finish(tmp_path, args)
    assert f"{len(stimuli)} rows" in out and "reused" not in out
    _check_resumed_store(folder, stats, tensors, reference, ["resid_post", "head_out"])
    assert len(load_activations(folder).manifest["shards"]) == len(stimuli) // 4
    assert cli_main(args) == 0  # and now it is simply loaded
    assert "reused, model not run" in capsys.readouterr().out


def test_kill_9_mid_probe_then_the_same_command_writes_the_same_table(tmp_path, stimulus_file):
    path, _ = stimulus_file

    def args(name: str) -> list[str]:
        return ["probe", "--model", "tiny-llama", "--stimuli", str(path), "--sites", "resid_post",
                "--store", str(tmp_path / f"store-{name}"), "--out", str(tmp_path / f"out-{name}"),
                "--batch-size", "4", "--folds", "3", "--inner-folds", "2", "--n-boot", "20", "--no-progress",
                "--no-random-twin"]  # one model in each store: the twin is tested in test_runs_stages

    marker = tmp_path / "marker"
    fault = {"FAULT_FLUSH_SECONDS": "0", "FAULT_HANG_IN_SHARD": str(HANG_IN_SHARD), "FAULT_MARKER": str(marker)}
    proc = _start(tmp_path, args("killed"), fault)
    try:
        assert cli_main(args("reference")) == 0  # meanwhile, the uninterrupted run
        half = _kill_when_mid_way(proc, marker)
    finally:
        proc.kill()  # never leave the hanging child behind when an assertion fails first
    folder, stats, tensors = _check_killed_store(tmp_path / "store-killed", half)
    assert not (tmp_path / "out-killed").exists()  # no result of any kind before the sweep ran

    out = _finish(tmp_path, args("killed"), {"FAULT_FLUSH_SECONDS": "0"})
    assert "wrote" in out
    (ref_folder,) = (tmp_path / "store-reference").iterdir()
    _check_resumed_store(folder, stats, tensors, load_activations(ref_folder), ["resid_post"])

    got = pd.read_parquet(tmp_path / "out-killed" / "probes.parquet")
    want = pd.read_parquet(tmp_path / "out-reference" / "probes.parquet")
    assert list(got.columns) == list(want.columns) and len(got) == len(want) > 0
    for col in got.columns:
        if pd.api.types.is_float_dtype(want[col]):  # fits on activations from another process
            np.testing.assert_allclose(got[col].to_numpy(), want[col].to_numpy(), rtol=1e-5, atol=1e-6)
        else:
            assert got[col].tolist() == want[col].tolist(), col
    got_dirs = load_file(str(tmp_path / "out-killed" / "directions.safetensors"))
    want_dirs = load_file(str(tmp_path / "out-reference" / "directions.safetensors"))
    assert got_dirs.keys() == want_dirs.keys()
    for name in want_dirs:
        torch.testing.assert_close(got_dirs[name], want_dirs[name], rtol=1e-5, atol=1e-6)


def test_a_half_written_manifest_is_ignored_and_the_rerun_runs_nothing(load_tiny, tmp_path, stimulus_file):
    _, stimuli = stimulus_file
    model = load_tiny("tiny-llama")
    acts = cache_activations(model, stimuli, ["resid_post"], ["final"], store=tmp_path, batch_size=8,
                             flush_seconds=0, progress=False)
    good = acts.get("resid_post", "final").clone()
    manifest = acts.path / st.MANIFEST
    manifest.write_bytes(manifest.read_bytes()[: manifest.stat().st_size // 2])
    with pytest.raises(TomlensError, match="no finished activation cache"):
        load_activations(acts.path)
    with forwards(model) as rerun:
        again = cache_activations(model, stimuli, ["resid_post"], ["final"], store=tmp_path, progress=False)
    assert rerun == []  # every shard was finished: only the manifest is written again
    assert torch.equal(again.get("resid_post", "final"), good)  # the same bytes, loaded


@contextmanager
def forwards(model, *, oom_on: int | None = None, every: bool = False):
    """A hook on the first block that records the batch size of each forward and raises the
    accelerator's out-of-memory error on forward number `oom_on` (and on every later one when `every`)."""
    sizes: list[int] = []

    def hook(tensor, hook):
        sizes.append(tensor.shape[0])
        if oom_on is not None and (len(sizes) == oom_on or (every and len(sizes) > oom_on)):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")

    with model.hooks(fwd_hooks=[("blocks.0.hook_resid_pre", hook)]):
        yield sizes


def test_out_of_memory_while_caching_halves_the_batch_and_changes_no_number(load_tiny, tmp_path, stimulus_file):
    _, stimuli = stimulus_file
    model = load_tiny("tiny-llama")
    sites = ["resid_post", "z:0"]
    reference = cache_activations(model, stimuli, sites, ["final", "protagonist"], store=tmp_path / "ref",
                                  batch_size=8, progress=False)
    with forwards(model, oom_on=3) as sizes:  # in the middle of the run, after two shards
        acts = cache_activations(model, stimuli, sites, ["final", "protagonist"], store=tmp_path / "oom",
                                 batch_size=8, flush_seconds=0, progress=False)
    assert sizes == [8, 8, 8] + [4] * 8 and acts.manifest["batch_size"] == 4
    assert [s["stop"] - s["start"] for s in acts.manifest["shards"]] == [8, 8] + [4] * 8
    assert acts.ids == reference.ids == [s.id for s in stimuli]  # same order, none lost or twice
    for kind in ("resid_post", "z"):
        for pos in ("final", "protagonist"):  # other batches, other padding: fp32 tolerance
            torch.testing.assert_close(acts.get(kind, pos), reference.get(kind, pos), rtol=1e-5, atol=1e-5)


def test_out_of_memory_with_one_prompt_is_a_clear_error_and_keeps_finished_shards(load_tiny, tmp_path,
                                                                                   stimulus_file):
    _, stimuli = stimulus_file
    model = load_tiny("tiny-llama")
    with forwards(model, oom_on=3, every=True), pytest.raises(TomlensError, match="batch of one prompt"):
        cache_activations(model, stimuli, ["resid_post"], ["final"], store=tmp_path, batch_size=4,
                          flush_seconds=0, progress=False)
    (folder,) = tmp_path.iterdir()
    assert sorted(p.name for p in folder.glob("shard-*")) == [st.shard_file(0), st.shard_file(1)]
    assert not (folder / st.MANIFEST).exists()


def test_out_of_memory_while_scoring_halves_the_batch_and_changes_no_score(load_tiny, stimulus_file):
    _, stimuli = stimulus_file
    model = load_tiny("tiny-gpt2")
    with forwards(model) as ref_sizes:
        reference = score_options(model, stimuli, batch_size=4, progress=False)
    # Forwards alternate: a batch's shared story (one row), then the rest of its rows.
    assert ref_sizes[:2] == [1, 4] and max(ref_sizes) == 4
    with forwards(model, oom_on=2) as sizes:  # the first batch's rows run out of memory
        got = score_options(model, stimuli, batch_size=4, progress=False)
    assert sizes[:2] == [1, 4] and max(sizes[2:]) == 2  # halved once, then kept
    assert sum(s for s in sizes[2:] if s > 1) == len(stimuli)  # the failed rows ran again, every row once
    assert len(got) == len(reference) == len(stimuli)
    for (ga, gb), (ra, rb) in zip(got, reference, strict=True):  # same order; other padding, so fp tolerance
        for g, r in ((ga, ra), (gb, rb)):
            assert g.n_tokens == r.n_tokens
            assert g.logp_sum == pytest.approx(r.logp_sum, rel=1e-5, abs=1e-5)
            assert g.logp_first == pytest.approx(r.logp_first, rel=1e-5, abs=1e-5)


def test_out_of_memory_scoring_one_prompt_is_a_clear_error(load_tiny, stimulus_file, capsys):
    _, stimuli = stimulus_file
    model = load_tiny("tiny-gpt2")
    with forwards(model, oom_on=1, every=True) as sizes, pytest.raises(TomlensError, match="single prompt"):
        score_options(model, stimuli[:4], batch_size=4, progress=False)
    # batch sizes 4, 2 and 1, one failed forward each (the first forward of 4 or 2 rows of one
    # story is their shared prefix, one row)
    assert len(sizes) == 3
    err = capsys.readouterr().err
    assert "batch size now 2" in err and "batch size now 1" in err


def test_two_writers_of_one_request_take_turns(tmp_path):
    """The store's writer lock: a second process (here a thread with its own open file) caching the
    same request waits until the first has finished, instead of deleting or overwriting its shards."""
    import threading

    folder = tmp_path / "request"
    first_in, release, second_in = threading.Event(), threading.Event(), threading.Event()

    def first() -> None:
        with st.writer_lock(folder):
            first_in.set()
            release.wait(10)

    def second() -> None:
        first_in.wait(10)
        with st.writer_lock(folder):
            second_in.set()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    assert first_in.wait(10)
    assert not second_in.wait(0.3)  # blocked while the first writer holds the folder
    release.set()
    for t in threads:
        t.join(10)
    assert second_in.is_set()
