"""A killed probe sweep resumes its fits, not only its cache (issue 28, part 5).

The sweep saves each finished chunk of units under the run folder (`tomlens.probes.resume`); run
again with the same settings it reads those back, fits only the rest, says "resuming: N of M probe
fits done", and gives the table and directions an uninterrupted run gives, exactly. Here a sweep
is killed by making the chunk fit raise after some chunks.
"""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch
from helpers import TensorActivations

from tomlens.probes import sweep
from tomlens.probes.resume import PARTIAL, FitCheckpoints, remove_fit_checkpoints
from tomlens.probes.sweep import run_probe_sweep
from tomlens.stimuli import generate

pytestmark = pytest.mark.unit

# unit_budget_bytes=1: one unit per chunk, so the sweep has many chunks to be killed between
FAST = dict(folds=3, inner_folds=2, c_grid=(0.1, 1.0), n_boot=50, progress=False, device="cpu",
            unit_budget_bytes=1.0)
# resid_post (3 layers) + head_out (2 layers x 2 heads) + bag of words, length, position
CHUNKS = 3 + 4 + 3


REAL_FIT_CHUNK = sweep._fit_chunk


class Killed(Exception):
    """Stands in for the signal that stops a run."""


def planted_acts(stimuli, seed: int = 0, d: int = 8) -> TensorActivations:
    g = torch.Generator().manual_seed(seed)
    n = len(stimuli)
    belief = torch.tensor([2.0 * s.belief_is_reference - 1 for s in stimuli])
    resid = torch.randn(n, 3, d, generator=g)
    resid[:, 1, 0] += 2.5 * belief
    heads = torch.randn(n, 2, 2, d, generator=g)
    heads[:, 1, 1, 5] += 2.5 * belief
    return TensorActivations(list(stimuli), {("resid_post", "final"): resid, ("head_out", "final"): heads},
                             {"model": {"model": "planted"}})


@pytest.fixture(scope="module")
def acts():
    return planted_acts(generate("unexpected-transfer", n=8, seed=0))


@pytest.fixture(scope="module")
def uninterrupted(acts):
    return run_probe_sweep(acts, "protagonist_belief", sites=("resid_post", "head_out"), **FAST)


def counting_fits(monkeypatch, fail_after: int | None = None) -> list[str]:
    """Count `_fit_chunk` calls (by unit keys); with `fail_after`, the call after that many raises."""
    calls: list[str] = []

    def fit_chunk(layout, tl, fs, Xtr, Xte, unit_keys, dev):
        if fail_after is not None and len(calls) == fail_after:
            raise Killed
        calls.append(f"{fs.features}/{fs.kind}/{unit_keys}")
        return REAL_FIT_CHUNK(layout, tl, fs, Xtr, Xte, unit_keys, dev)

    monkeypatch.setattr(sweep, "_fit_chunk", fit_chunk)
    return calls


def run(acts, out, **kw):
    return run_probe_sweep(acts, "protagonist_belief", sites=("resid_post", "head_out"), resume_in=out,
                           **{**FAST, **kw})


def assert_same_result(a, b) -> None:
    pd.testing.assert_frame_equal(a.table, b.table)
    assert a.directions.keys() == b.directions.keys()
    for k in a.directions:
        assert a.directions[k].dtype == b.directions[k].dtype, k
        assert torch.equal(a.directions[k], b.directions[k]), k
    assert a.metadata["notes"] == b.metadata["notes"]


def test_a_killed_sweep_fits_only_what_it_had_left(acts, uninterrupted, tmp_path, monkeypatch, capsys):
    first = counting_fits(monkeypatch, fail_after=4)
    with pytest.raises(Killed):
        run(acts, tmp_path)
    assert len(first) == 4
    capsys.readouterr()
    second = counting_fits(monkeypatch)
    resumed = run(acts, tmp_path)
    assert len(second) == CHUNKS - 4 and not set(first) & set(second)  # the finished four are read back
    assert "resuming: 4 of 10 probe fits done" in capsys.readouterr().out
    assert_same_result(resumed, uninterrupted)


def test_a_finished_sweep_rerun_fits_nothing_and_a_fresh_one_says_nothing(acts, uninterrupted, tmp_path,
                                                                          monkeypatch, capsys):
    calls = counting_fits(monkeypatch)
    assert_same_result(run(acts, tmp_path), uninterrupted)
    assert len(calls) == CHUNKS and "resuming" not in capsys.readouterr().out
    again = run(acts, tmp_path)
    assert len(calls) == CHUNKS  # no new fit
    assert f"resuming: {CHUNKS} of {CHUNKS} probe fits done" in capsys.readouterr().out
    assert_same_result(again, uninterrupted)


def test_other_settings_or_other_activations_are_fitted_again(acts, tmp_path, monkeypatch):
    calls = counting_fits(monkeypatch)
    run(acts, tmp_path)
    run(acts, tmp_path, seed=1)  # another seed: another folder, every chunk fitted
    assert len(calls) == 2 * CHUNKS
    assert len(list((tmp_path / PARTIAL).iterdir())) == 2
    # the same stimuli and settings on other numbers at resid_post layer 0: that chunk alone is refitted
    changed = planted_acts(acts.stimuli)
    changed.tensors[("resid_post", "final")] = changed.tensors[("resid_post", "final")].clone()
    changed.tensors[("resid_post", "final")][:, 0] += 1.0
    del calls[:]
    run(changed, tmp_path)
    assert calls == ["activations/resid_post/[(0, -1)]"]


def test_a_damaged_chunk_is_fitted_again(acts, uninterrupted, tmp_path, monkeypatch):
    run(acts, tmp_path)
    folder = next((tmp_path / PARTIAL).iterdir())
    damaged = sorted(p for p in folder.glob("*.json") if p.name != "settings.json")[0]
    damaged.write_text(damaged.read_text()[:50])
    calls = counting_fits(monkeypatch)
    assert_same_result(run(acts, tmp_path), uninterrupted)
    assert len(calls) == 1
    assert json.loads(damaged.read_text())["name"] == damaged.stem  # rewritten whole


def test_checkpoints_are_keyed_by_what_changes_the_fits_and_removed_on_request(tmp_path):
    base = {"acts": {"stimuli": "abc"}, "config": {"folds": 3}}
    assert FitCheckpoints(tmp_path, base).key == FitCheckpoints(tmp_path, dict(base)).key
    assert FitCheckpoints(tmp_path, base).key != FitCheckpoints(tmp_path, {**base, "config": {"folds": 4}}).key
    folder = FitCheckpoints(tmp_path, base).folder
    folder.mkdir(parents=True)
    (folder / "x.json").write_text("{}")
    remove_fit_checkpoints(tmp_path)
    assert not folder.exists()


def test_progress_settings_do_not_change_the_key(acts, tmp_path, monkeypatch, capsys):
    run(acts, tmp_path)
    calls = counting_fits(monkeypatch)
    run(acts, tmp_path, budget_minutes=100.0)  # a budget or the progress bar changes no number
    assert calls == []
