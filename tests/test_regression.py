"""The move of issue #9 kept the numbers: a small behaviour + probe + patching run through the runs
layer (configs and `run`) gives what the code before the move gave (tests/data/regression_tiny.json,
made by the pre-move code on tiny-llama: same models, stimuli, seeds and settings as below).

Tolerances hold across BLAS kernels and thread counts (`make test THREADS=2`): rtol 1e-4 and
atol 1e-5 on log-probabilities, probabilities and raw logit differences."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

pytestmark = pytest.mark.integration

GOLDEN = json.loads((Path(__file__).parent / "data" / "regression_tiny.json").read_text())
RTOL, ATOL = 1e-4, 1e-5
# The tiny model barely separates the paired stories: the clean - corrupted gap is about -4e-5, so
# a normalised effect = change / gap turns a 1e-7 change in logit difference (float32 reduction
# order) into 0.003. Effects are compared here as the raw change they stand for (effect x gap)
# with a tolerance of 2e-7 in logit difference, and everything else through the raw `logit_diff`.
CHANGE_ATOL = 2e-7


def _close(a, b, rtol: float = RTOL, atol: float = ATOL) -> bool:
    if a is None or b is None or (isinstance(a, float) and math.isnan(a)):
        return (a is None or math.isnan(a)) and (b is None or (isinstance(b, float) and math.isnan(b)))
    return math.isclose(float(a), float(b), rel_tol=rtol, abs_tol=atol)


def _assert_frame(got: pd.DataFrame, want: list[dict], keys: list[str], cols: list[str], **tol) -> None:
    want_df = pd.DataFrame(want)
    assert len(got) == len(want_df), (len(got), len(want_df))
    merged = want_df.merge(got, on=keys, how="left", suffixes=("_want", ""), indicator=True)
    assert (merged["_merge"] == "both").all(), merged.loc[merged["_merge"] != "both", keys]
    for col in cols:
        w, g = merged[f"{col}_want"].to_numpy(float), merged[col].to_numpy(float)
        ok = np.isclose(g, w, rtol=tol.get("rtol", RTOL), atol=tol.get("atol", ATOL), equal_nan=True)
        assert ok.all(), (col, merged.loc[~ok, keys + [f"{col}_want", col]])


@pytest.fixture(scope="module")
def model():
    from tomlens.runs.base import ModelSpec

    spec = ModelSpec("tiny-llama", dtype="float32", seed=0)
    return spec, spec.load()


def test_behaviour_numbers_are_unchanged(model):
    from tomlens.runs.base import StimuliSpec
    from tomlens.runs.behaviour import BehaviourConfig, run

    spec, loaded = model
    config = BehaviourConfig(model=spec, seed=0, stimuli=(
        StimuliSpec(family="unexpected-transfer", n=2, seed=0),
        StimuliSpec(family="goal-encoding", n=2, seed=0, options={"ks": (0, 6)})))
    result = run(config, model=loaded, progress=False)
    want = GOLDEN["behaviour"]
    _assert_frame(result.table, want["prompts"], ["id"], want["numeric"])
    _assert_frame(result.accuracy, want["accuracy"], ["family", "condition", "prompt_type"],
                  ["n", "accuracy", "ci_low", "ci_high", "mean_p_answer"])
    _assert_frame(result.object_bias, want["object_bias"], ["target_type", "anim_denotation", "k", "test_case"],
                  ["n", "o_b", "sd", "ci_low", "ci_high"])


def test_probe_scores_and_controls_are_unchanged(model, tmp_path):
    from tomlens.runs.base import StimuliSpec
    from tomlens.runs.probes import ProbesConfig, run

    spec, loaded = model
    config = ProbesConfig(model=spec, stimuli=StimuliSpec(family="unexpected-transfer", n=5, seed=1),
                          targets=("protagonist_belief", "world_state"), sites=("resid_post", "head_out"),
                          positions=("final",), folds=4, inner_folds=3, c_grid=(0.01, 0.1, 1.0), n_boot=50,
                          seed=0, store=str(tmp_path / "store"))
    table = run(config, model=loaded, progress=False).table
    table = table[table["metric"] == "accuracy"]
    want = GOLDEN["probes"]
    # The pre-move table called the bag-of-words rows kind "bow"; they are features "bag_of_words" now.
    want = [{**row, "kind": "" if row["kind"] == "bow" else row["kind"]} for row in want]
    _assert_frame(table, want, ["target", "train_on", "eval_set", "kind", "layer", "head"], ["score", "control"])


def test_patching_logit_diffs_heads_and_topk_are_unchanged(model):
    from tomlens.runs import patching
    from tomlens.runs.pairs import PairsConfig, run as make_pairs

    spec, loaded = model
    # The pre-move run took the first two pairs of two tasks (`make_pairs(n=2)[:2]`).
    pairs = make_pairs(PairsConfig(model=spec, family="unexpected-transfer", n=2, seed=2, contrasts=("present",)),
                       model=loaded).pairs[:2]
    config = patching.PatchingConfig(model=spec, method="both", sites=("heads", "resid"), top_k=2, n_random=2,
                                     seed=0, format="csv")
    result = patching.run(config, model=loaded, pairs=pairs, progress=False)
    want = GOLDEN["patching"]

    for name, base in result.summary["baselines"].items():  # raw logit differences of the unpatched runs
        for key in ("clean_logit_diff", "corrupted_logit_diff", "gap"):
            assert _close(base[key], want["baselines"][name][key]), (name, key)
        assert base["n_pairs"] == want["baselines"][name]["n_pairs"]
    assert set(result.summary["baselines"]) == set(want["baselines"])

    keys = ["kind", "layer", "head", "position"]
    for method in ("exact", "attribution"):  # every cell's raw patched logit difference
        cells = result.tables[f"cells_{method}_denoise"]
        _assert_frame(cells, want[f"cells_{method}"], keys, ["logit_diff"])

    gap = want["baselines"]["exact_denoise"]["gap"]
    heads = result.heads.merge(pd.DataFrame(want["heads"]), on=["layer", "head"], suffixes=("", "_want"))
    assert len(heads) == len(want["heads"])
    for col in ("patch_effect", "attribution_effect"):  # effects as the raw change they stand for
        np.testing.assert_allclose(heads[col] * gap, heads[f"{col}_want"] * gap, rtol=0, atol=CHANGE_ATOL)

    assert result.summary["top_heads"] == want["top_heads"]
    topk = result.tables["topk"].merge(pd.DataFrame(want["topk"]), on="k", suffixes=("", "_want"))
    assert len(topk) == len(want["topk"]) and (topk["heads"] == topk["heads_want"]).all()
    for col in ("top_effect", "random_mean", "random_low", "random_high"):
        np.testing.assert_allclose(topk[col] * gap, topk[f"{col}_want"] * gap, rtol=0, atol=CHANGE_ATOL)
