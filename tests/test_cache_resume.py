"""An interrupted cache keeps its early shards, says truthfully what it kept and lost, and its rerun
says what it resumes (issue 29 part 5)."""

from __future__ import annotations

import pytest
import torch

from tomlens.activations import cache as cache_mod
from tomlens.activations import cache_activations
from tomlens.activations import store as st
from tomlens.cli import main as cli_main
from tomlens.stimuli import generate
from tomlens.stimuli.records import write_jsonl

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def stimuli():
    return generate("unexpected-transfer", n=3, seed=0)  # 48 prompts


def _interrupt_on_batch(monkeypatch, n: int, *, seconds_per_batch: float | None = None) -> list[int]:
    """Forward batch number `n` raises KeyboardInterrupt (a Ctrl-C); with `seconds_per_batch`, the
    flush clock advances that much per finished batch instead of the wall clock's."""
    calls: list[int] = []
    now = [0.0]
    real = cache_mod._Runner._run_batch

    def run_batch(self, rows):
        calls.append(len(rows))
        if len(calls) == n:
            raise KeyboardInterrupt
        out = real(self, rows)
        now[0] += seconds_per_batch or 0.0
        return out

    monkeypatch.setattr(cache_mod._Runner, "_run_batch", run_batch)
    if seconds_per_batch is not None:
        monkeypatch.setattr(cache_mod, "work_clock", lambda: now[0])
    return calls


def test_the_first_shards_come_early_and_a_ctrl_c_says_what_it_kept_and_lost(load_tiny, tmp_path, stimuli,
                                                                             monkeypatch, capsys):
    model = load_tiny("tiny-llama")
    # 10 s per batch of 4: the first shard after 15 s (2 batches), the next 30 s later (3 batches)
    _interrupt_on_batch(monkeypatch, 7, seconds_per_batch=10.0)
    with pytest.raises(KeyboardInterrupt):
        cache_activations(model, stimuli, ["resid_post"], ["final"], store=tmp_path, batch_size=4, progress=False)
    (folder,) = tmp_path.iterdir()
    assert sorted(p.name for p in folder.glob("shard-*")) == [st.shard_file(0), st.shard_file(1)]
    err = capsys.readouterr().err
    assert "stopped: 20 of 48 prompts kept in finished shards" in err  # 2 + 3 batches of 4
    assert "the 4 run since the last shard are lost" in err  # batch 6 finished, in no shard yet


def test_a_ctrl_c_before_any_shard_says_nothing_was_kept(load_tiny, tmp_path, stimuli, monkeypatch, capsys):
    _interrupt_on_batch(monkeypatch, 2)
    with pytest.raises(KeyboardInterrupt):
        cache_activations(load_tiny("tiny-llama"), stimuli, ["resid_post"], ["final"], store=tmp_path,
                          batch_size=4, flush_seconds=1000, progress=False)
    assert "stopped: nothing kept (4 of 48 prompts had run" in capsys.readouterr().err


def test_an_interrupted_cache_command_resumes_and_says_so(load_tiny, tmp_path, stimuli, monkeypatch, capsys):
    path = write_jsonl(stimuli, tmp_path / "ut.jsonl")
    args = ["cache", "--model", "tiny-llama", "--stimuli", str(path), "--store", str(tmp_path / "store"),
            "--batch-size", "4", "--flush-seconds", "0", "--device", "cpu", "--dtype", "float32", "--no-progress"]
    with monkeypatch.context() as m:
        _interrupt_on_batch(m, 4)
        assert cli_main(args) == 130
    first = capsys.readouterr()
    assert "stopped: 12 of 48 prompts kept in finished shards" in first.err
    assert "finished work is kept" not in first.err  # the generic line would repeat it, less exactly
    calls = _interrupt_on_batch(monkeypatch, 0)  # counts the rerun's forwards, interrupts none
    assert cli_main(args) == 0
    assert "resuming: 12 of 48 prompts done (in 3 finished shards" in capsys.readouterr().out
    assert sum(calls) == 36  # only the prompts the first run had not kept
    reference = cache_activations(load_tiny("tiny-llama"), stimuli, ["resid_post"], ["final"],
                                  store=tmp_path / "reference", batch_size=4, progress=False)
    (folder,) = (tmp_path / "store").iterdir()
    resumed = cache_activations(load_tiny("tiny-llama"), stimuli, ["resid_post"], ["final"],
                                store=tmp_path / "store", progress=False)
    assert resumed.path == folder and resumed.reused
    torch.testing.assert_close(resumed.get("resid_post", "final"), reference.get("resid_post", "final"))
