"""Host syncs of exact patching, counted on the CPU (tests/syncs.py): none per pair, per group, per
layer, per head, per cell, per chunk or per forward, in every stage (the base runs, the sweeps over
cells, top-k recovery and mean ablation). On a GPU each one drains the queue. Main at 51b5ae2 made
71 for one pair and 99 for three (2 layers, every head), 87 and 147 at 6 layers, and 121 / 273 /
237 / 669 for the residual stream at every position: plans read off device tensors per cell and
pair, per-column token labels, one `.cpu()` per chunk and per group.

What is left per call is host data that a CUDA run would not wait on (see each bound)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import short_pairs
from syncs import assert_same_and_small, count_of, count_syncs, tiny_with_layers

from tomlens.hooks.attention import check_scores, score_error
from tomlens.models.positions import resolve_positions
from tomlens.patching.exact import exact_patching
from tomlens.patching.heads import mean_ablation, topk_recovery
from tomlens.patching.pairs import prepare_pairs

pytestmark = pytest.mark.integration

# exact_patching: the answer tokens read once into Python by prepare_pairs (a host tensor made by
# option_first_tokens); 1 more allowed for that helper reading its own result back once.
EXACT_BOUND = 2
# top-k recovery: the same 1, plus `summarise` on the host: values, clean and corrupted moved to the
# host (3 .cpu(), no-ops there), the gap check read once (1), the bootstrap block's "any cell" (1)
# and its five columns as numpy (5): 11; 1 spare as above.
TOPK_BOUND = 13  # one more on some CPUs: a host-side branch of the bootstrap summary depends on the data
# mean ablation: the same 1, the unablated accuracies and logit differences read once each (4 host
# floats) and six table columns as numpy (6): 11; 1 spare as above.
ABLATION_BOUND = 12


def _models(load_tiny: Any, tmp_path: Any) -> list[Any]:
    """tiny-llama at 2 and 6 layers, each warmed up: the engine checks its shortcuts once per model
    (one scalar read, never again), which a count per call must not see."""
    models = [load_tiny("tiny-llama"), tiny_with_layers("tiny-llama", 6, tmp_path / "deep")]
    for model in models:
        exact_patching(model, short_pairs(model.tokenizer, 1), positions=("all",), layers=[model.cfg.n_layers - 1],
                       progress=False)
    return models


SWEEPS: dict[str, dict[str, Any]] = {
    "heads": {"sites": ("heads",), "positions": ("all",)},  # every head at all positions
    "resid": {"sites": ("resid",), "positions": ("all",)},  # the residual stream at every token ("each")
    "heads at roles": {"sites": {"heads": ("final", "protagonist")}},
    "mlp and heads noising": {"sites": ("mlp", "heads"), "positions": ("all", "final"), "direction": "noise"},
}


@pytest.mark.parametrize("sweep", list(SWEEPS))
def test_exact_patching_makes_the_same_few_syncs_whatever_the_pairs_and_depth(load_tiny: Any, tmp_path: Any,
                                                                             sweep: str) -> None:
    counts = {}
    for model in _models(load_tiny, tmp_path):
        for n in (1, 3):
            pairs = short_pairs(model.tokenizer, n)
            counts[(model.cfg.n_layers, n)] = count_of(
                lambda: exact_patching(model, pairs, progress=False, **SWEEPS[sweep]))
    assert_same_and_small(counts, EXACT_BOUND)


def test_nothing_waits_between_groups_forwards_or_chunks(load_tiny: Any) -> None:
    """One group of 3 pairs or 3 groups of one; every chunk of runs in one forward or a forward of
    a few rows each (a tiny memory budget); one stage chunk or a chunk per two runs: the same count."""
    model = load_tiny("tiny-llama")
    exact_patching(model, short_pairs(model.tokenizer, 1), positions=("all",), layers=[1], progress=False)
    pairs = short_pairs(model.tokenizer, 3)
    settings = {
        "one group": {"batch_pairs": 3},
        "a group per pair": {"batch_pairs": 1},
        "a few rows per forward": {"memory_mb": 1.0},
        "a stage chunk per two runs": {"chunk_runs": 2},
    }
    counts = {name: count_of(lambda: exact_patching(model, pairs, sites=("heads", "resid"), positions=("all",),
                                                         progress=False, **kw))
              for name, kw in settings.items()}
    assert_same_and_small(counts, EXACT_BOUND)


def test_top_k_recovery_makes_the_same_few_syncs_whatever_the_pairs_and_depth(load_tiny: Any,
                                                                             tmp_path: Any) -> None:
    counts = {}
    for model in _models(load_tiny, tmp_path):
        last = model.cfg.n_layers - 1
        ranking = [(last, 0), (0, 1), (last, 2)]
        for n, batch_pairs in ((1, 8), (3, 8), (3, 1)):
            pairs = short_pairs(model.tokenizer, n)
            counts[(model.cfg.n_layers, n, batch_pairs)] = count_of(lambda: topk_recovery(
                model, pairs, ranking, k_max=2, n_random=4, n_boot=20, batch_pairs=batch_pairs, progress=False))
    assert_same_and_small(counts, TOPK_BOUND)


@pytest.mark.parametrize("mode", ["final", "all"])
def test_mean_ablation_makes_the_same_few_syncs_whatever_the_pairs_and_depth(load_tiny: Any, tmp_path: Any,
                                                                            mode: str) -> None:
    counts = {}
    for model in _models(load_tiny, tmp_path):
        ranking = [(model.cfg.n_layers - 1, 0), (0, 1)]
        for n, batch_pairs in ((1, 8), (3, 8), (3, 1)):
            pairs = short_pairs(model.tokenizer, n)
            counts[(model.cfg.n_layers, n, batch_pairs)] = count_of(lambda: mean_ablation(
                model, pairs, ranking, ks=[1, 2], n_random=3, mode=mode, batch_pairs=batch_pairs, progress=False))
    assert_same_and_small(counts, ABLATION_BOUND)


def test_the_host_plan_of_a_group_is_what_the_device_batch_says(load_tiny: Any) -> None:
    """The columns a sweep plans with are read off the tokenizer's output on the host; they equal
    what the device batch gives (first differing token, selector columns, answer tokens)."""
    model = load_tiny("tiny-llama")
    pairs = short_pairs(model.tokenizer, 4)
    prepared = prepare_pairs(model, pairs, selectors=["final", "protagonist"], batch_pairs=3)
    for group in prepared.groups:
        g, ids = group.g, group.batch.input_ids
        for j in range(g):
            diff = (ids[j] != ids[g + j]).nonzero().flatten()
            assert group.first_diff_cols[j] == (int(diff[0]) if len(diff) else ids.shape[1])
        stories = [pairs[i].clean for i in group.index] + [pairs[i].corrupted for i in group.index]
        pos = resolve_positions(stories, group.batch, ["final", "protagonist"])
        for s_i, sel in enumerate(["final", "protagonist"]):
            assert group.position_cols[sel] == pos[:g, s_i].tolist() == group.positions[sel].tolist()
        assert group.answer_ids == group.tokens.tolist()
        assert group.first_diff.tolist() == group.first_diff_cols


def test_attention_scores_are_checked_in_one_sync() -> None:
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(2, 3, 4, 4, generator=gen)
    scores = scores.masked_fill(torch.ones(4, 4, dtype=torch.bool).triu(1), torch.finfo(torch.float32).min)
    with count_syncs() as c:
        error = score_error(scores.clone(), scores)
    assert c.total == 0, c.summary()
    assert float(error) == 0.0
    with count_syncs() as c:
        check_scores(scores + 1e-7, scores, layer=0)
    assert c.total == 1, c.summary()  # the one read of the verdict
    from tomlens.errors import TomlensError

    with pytest.raises(TomlensError, match="differs from the model's scores by up to 0.5"):
        check_scores(scores + 0.5, scores, layer=0)
