"""The patching stage's typed summary (`PatchingSummary`): a real run's result saves and loads to an
equal summary, result.json keeps the keys it had, and a folder written without one of its fields
says to rerun the stage."""

from __future__ import annotations

import json

import pytest

from tomlens.errors import TomlensError
from tomlens.runs.base import ModelSpec
from tomlens.runs.pairs import PairsConfig
from tomlens.runs.patching import PatchingConfig, PatchingRunResult, run
from tomlens.runs.patching_summary import PatchingSummary, TopKRow, summary_dict

pytestmark = pytest.mark.integration  # tiny models
TINY = ModelSpec("tiny-llama")
UT = PairsConfig(model=TINY, family="unexpected-transfer", n=3, seed=0, contrasts=("present",))  # 6 pairs, 3 tasks


def test_a_real_runs_summary_round_trips_and_an_old_shaped_folder_says_rerun(load_tiny, tmp_path):
    config = PatchingConfig(model=TINY, pairs=UT, method="both", sites=("heads", "resid"), positions=("final",),
                            top_k=2, n_random=2, ks=(1, 2), force=True, format="csv")
    result = run(config, model=load_tiny("tiny-llama"), progress=False)
    s = result.summary
    assert isinstance(s, PatchingSummary) and s.forced and s.topk and isinstance(s.topk[0], TopKRow)
    assert s.baselines and s.comparisons and s.ablation is not None and s.plan is not None
    folder = result.save(tmp_path / "run")
    back = PatchingRunResult.load(folder)
    assert back.summary == s and back.describe() == result.describe()
    saved = json.loads((folder / "result.json").read_text())
    assert saved == summary_dict(s) and saved == json.loads((folder / "summary.json").read_text())
    assert "withheld" not in saved and "search" not in saved and saved["forced"] is True  # unrun parts: no key
    assert list(saved)[:3] == ["command", "provenance", "seed"] and saved["topk"][0]["k"] == 1

    del saved["notes"]  # a folder written before the field existed
    (folder / "result.json").write_text(json.dumps(saved))
    with pytest.raises(TomlensError) as e:
        PatchingRunResult.load(folder)
    assert "rerun the patching stage" in e.value.fix and "notes" in e.value.problem


def test_a_withheld_runs_summary_round_trips(load_tiny, tmp_path):
    config = PatchingConfig(model=TINY, pairs=UT, sites=("heads",), positions=("final",), top_k=1, n_random=2)
    held = run(config, model=load_tiny("tiny-llama"), progress=False)  # a random model: the gate fails
    assert held.withheld and held.summary.base is not None and held.summary.baselines is None
    back = PatchingRunResult.load(held.save(tmp_path / "held"))
    assert back.summary == held.summary and back.withheld == held.withheld
    saved = json.loads((tmp_path / "held" / "result.json").read_text())
    assert {"withheld", "base", "gate", "pairs"} <= set(saved) and "topk" not in saved and "forced" not in saved
