"""Numbers that must not move by accident: a small behaviour + probe + patching run on tiny-llama
gives what `tests/data/regression_tiny.json` holds.

The file was first written by the code before issue #9's restructuring (which kept every number),
and rewritten at issue #10, which changed the numbers on purpose (new stimulus texts, a type-level
control, baselines, a gate before patching). A change that moves them on purpose rewrites the file
with `TOMLENS_WRITE_GOLDEN=1 pytest tests/test_regression.py` and says why in its commit.

Tolerances hold across BLAS kernels and thread counts (`make test THREADS=2`): rtol 1e-4 and
atol 1e-5 on log-probabilities, probabilities, scores and raw logit differences."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

pytestmark = pytest.mark.integration

GOLDEN_PATH = Path(__file__).parent / "data" / "regression_tiny.json"
WRITE = os.environ.get("TOMLENS_WRITE_GOLDEN") == "1"
GOLDEN: dict[str, Any] = {} if WRITE else json.loads(GOLDEN_PATH.read_text())
RTOL, ATOL = 1e-4, 1e-5
# The tiny model barely separates the paired stories (a clean - corrupted gap near 1e-4), so a
# normalised effect = change / gap turns a 1e-7 change in logit difference (float32 reduction
# order) into 0.001 or more. Effects are compared as the raw change they stand for (effect x gap)
# with a tolerance of 2e-7 in logit difference, and everything else through the raw `logit_diff`.
CHANGE_ATOL = 2e-7
_WRITTEN: dict[str, Any] = {}


def _records(frame: pd.DataFrame, cols: list[str]) -> list[dict[str, Any]]:
    return json.loads(frame[cols].to_json(orient="records"))


def _check(section: str, numbers: dict[str, Any]) -> dict[str, Any]:
    """In write mode, store `numbers` under `section` (the file is written when all three ran);
    otherwise return the stored section to compare with."""
    if not WRITE:
        return GOLDEN[section]
    _WRITTEN[section] = json.loads(json.dumps(numbers, default=float))
    if {"behaviour", "probes", "patching"} <= set(_WRITTEN):
        _WRITTEN["_about"] = ("Written by tests/test_regression.py with TOMLENS_WRITE_GOLDEN=1 (issue #10: new "
                              "stimulus texts, type-level control, baselines, gate); see its docstring.")
        GOLDEN_PATH.write_text(json.dumps(_WRITTEN, indent=1, sort_keys=True) + "\n")
    pytest.skip(f"wrote the {section} numbers")


def _assert_frame(got: pd.DataFrame, want: list[dict], keys: list[str], cols: list[str], **tol) -> None:
    want_df = pd.DataFrame(want)
    assert len(got) == len(want_df), (len(got), len(want_df))
    merged = want_df.merge(got, on=keys, how="left", suffixes=("_want", ""), indicator=True)
    assert (merged["_merge"] == "both").all(), merged.loc[merged["_merge"] != "both", keys]
    for col in cols:
        w, g = merged[f"{col}_want"].to_numpy(float), merged[col].to_numpy(float)
        ok = np.isclose(g, w, rtol=tol.get("rtol", RTOL), atol=tol.get("atol", ATOL), equal_nan=True)
        assert ok.all(), (col, merged.loc[~ok, keys + [f"{col}_want", col]])


def _close(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return math.isclose(float(a), float(b), rel_tol=RTOL, abs_tol=ATOL)


@pytest.fixture(scope="module")
def model():
    from tomlens.runs.base import ModelSpec

    spec = ModelSpec("tiny-llama", dtype="float32", seed=0)
    return spec, spec.load()


BEHAVIOUR_FLOATS = ["logp_a", "logp_b", "logp_a_first", "logp_b_first", "p_a", "p_answer", "option_mass_first",
                    "option_mass"]
ACCURACY_COLS = ["n", "accuracy", "ci_low", "ci_high", "mean_p_answer", "mean_option_mass_first", "mean_option_mass"]
BIAS_KEYS = ["target_type", "anim_denotation", "k", "test_case"]


def test_behaviour_numbers_are_unchanged(model):
    from tomlens.runs.base import StimuliSpec
    from tomlens.runs.behaviour import BehaviourConfig, run

    spec, loaded = model
    config = BehaviourConfig(model=spec, seed=0, n_boot=200, stimuli=(
        StimuliSpec(family="unexpected-transfer", n=2, seed=0),
        StimuliSpec(family="order-only", n=2, seed=0),
        StimuliSpec(family="goal-encoding", n=2, seed=0, options={"ks": (0, 6)})))
    result = run(config, model=loaded, progress=False)
    want = _check("behaviour", {
        "prompts": _records(result.table, ["id", *BEHAVIOUR_FLOATS]),
        "accuracy": _records(result.accuracy, ["family", "condition", "prompt_type", *ACCURACY_COLS]),
        "object_bias": _records(result.object_bias, [*BIAS_KEYS, "n", "o_b", "ci_low", "ci_high"]),
    })
    _assert_frame(result.table, want["prompts"], ["id"], BEHAVIOUR_FLOATS)
    _assert_frame(result.accuracy, want["accuracy"], ["family", "condition", "prompt_type"], ACCURACY_COLS)
    _assert_frame(result.object_bias, want["object_bias"], BIAS_KEYS, ["n", "o_b", "ci_low", "ci_high"])


PROBE_KEYS = ["features", "target", "train_on", "eval_set", "kind", "layer", "head"]
PROBE_COLS = ["score", "control", "control_chance", "best_baseline"]


def test_probe_scores_controls_and_baselines_are_unchanged(model, tmp_path):
    from tomlens.runs.base import StimuliSpec
    from tomlens.runs.probes import ProbesConfig, run

    spec, loaded = model
    config = ProbesConfig(model=spec, stimuli=StimuliSpec(family="unexpected-transfer", n=8, seed=1),
                          targets=("protagonist_belief", "world_state"), sites=("resid_post", "head_out"),
                          positions=("final",), folds=4, inner_folds=3, c_grid=(0.01, 0.1, 1.0), n_boot=50,
                          seed=0, n_permutations=5, store=str(tmp_path / "store"))
    result = run(config, model=loaded, progress=False)
    table = result.table[result.table["metric"] == "accuracy"]
    selection = {t: {k: r.to_dict()[k] for k in ("unit", "verdict")} for t, r in result.selection.items()}
    want = _check("probes", {"table": _records(table, [*PROBE_KEYS, *PROBE_COLS]), "selection": selection})
    _assert_frame(table, want["table"], PROBE_KEYS, PROBE_COLS)
    assert json.loads(json.dumps(selection, default=float)) == want["selection"]


def test_patching_logit_diffs_gate_heads_and_topk_are_unchanged(model):
    from tomlens.runs import patching
    from tomlens.runs.files import summary_to_dict
    from tomlens.runs.pairs import PairsConfig
    from tomlens.runs.pairs import run as make_pairs

    spec, loaded = model
    pairs = make_pairs(PairsConfig(model=spec, family="unexpected-transfer", n=4, seed=2, contrasts=("present",)),
                       model=loaded).pairs[:6]
    config = patching.PatchingConfig(model=spec, method="both", sites=("heads", "resid"), top_k=2, n_random=4,
                                     ks=(1, 2), seed=0, format="csv", force=True)
    result = patching.run(config, model=loaded, pairs=pairs, progress=False)
    baselines = {name: summary_to_dict(b) for name, b in result.summary.baselines.items()}
    cells = {m: result.tables[f"cells_{m}_denoise"] for m in ("exact", "attribution")}
    keys = ["kind", "layer", "head", "position"]
    want = _check("patching", {
        "gate": _records(result.tables["gate"], ["contrast", "n", "mean", "sd", "lower", "passed"]),
        "baselines": baselines,
        "cells_exact": _records(cells["exact"], [*keys, "logit_diff"]),
        "cells_attribution": _records(cells["attribution"], [*keys, "logit_diff"]),
        "top_heads": list(result.summary.top_heads),
        "topk": _records(result.tables["topk"], ["k", "heads", "top_effect", "random_mean"]),
    })
    _assert_frame(result.tables["gate"], want["gate"], ["contrast"], ["n", "mean", "sd", "lower"])
    assert result.tables["gate"]["passed"].tolist() == [r["passed"] for r in want["gate"]]
    assert set(baselines) == set(want["baselines"])
    for name, base in baselines.items():  # raw logit differences of the unpatched runs
        for key in ("clean_logit_diff", "corrupted_logit_diff", "gap", "n_pairs"):
            assert _close(base[key], want["baselines"][name][key]), (name, key)
    for method in ("exact", "attribution"):  # every cell's raw patched logit difference
        _assert_frame(cells[method], want[f"cells_{method}"], keys, ["logit_diff"])
    assert list(result.summary.top_heads) == want["top_heads"]
    gap = want["baselines"]["exact_denoise"]["gap"]
    topk = result.tables["topk"].merge(pd.DataFrame(want["topk"]), on="k", suffixes=("", "_want"))
    assert len(topk) == len(want["topk"]) and (topk["heads"] == topk["heads_want"]).all()
    for col in ("top_effect", "random_mean"):
        np.testing.assert_allclose(topk[col] * gap, topk[f"{col}_want"] * gap, rtol=0, atol=CHANGE_ATOL)
