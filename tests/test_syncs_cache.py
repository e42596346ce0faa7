"""Host syncs of the caching path, counted on the CPU (tests/syncs.py): none per row, per batch or per
layer. On a GPU each one drains the queue; main at 156f474 made one per prompt in
`resolve_positions` (8 for 8 prompts, 16 for 16), which made caching slower than a plain forward."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from syncs import count_syncs, tiny_with_layers

from tomlens.activations.cache import cache_activations
from tomlens.hooks import capture
from tomlens.hooks.sites import Site
from tomlens.models import encode
from tomlens.models.positions import resolve_positions
from tomlens.stimuli import generate

pytestmark = pytest.mark.integration

POSITIONS = ["final", "protagonist", "object:first"]


def _stimuli(n: int) -> list[Any]:
    return generate("order-only", n=4, seed=3)[:n]


@pytest.mark.parametrize("n", [8, 16])
def test_positions_are_resolved_without_a_sync(load_tiny: Any, n: int) -> None:
    model, stimuli = load_tiny("tiny-llama"), _stimuli(n)
    batch = encode(model, [s.text for s in stimuli])
    with count_syncs() as c:
        pos = resolve_positions(stimuli, batch, POSITIONS)
    assert c.total == 0, c.summary()
    assert pos.shape == (n, len(POSITIONS)) and pos.device == batch.input_ids.device
    assert pos[:, 0].eq(batch.input_ids.shape[1] - 1).all()  # final: the last column (left padding)


def test_capture_makes_no_sync_at_any_depth(load_tiny: Any, tmp_path: Any) -> None:
    for model in (load_tiny("tiny-llama"), tiny_with_layers("tiny-llama", 6, tmp_path)):
        stimuli = _stimuli(8)
        batch = encode(model, [s.text for s in stimuli])
        pos = resolve_positions(stimuli, batch, POSITIONS)
        sites = [Site(k, layer) for k in ("resid_post", "head_out", "z") for layer in range(model.cfg.n_layers)]
        with count_syncs() as c, torch.inference_mode():
            capture(model, batch, sites, pos)
        assert c.total == 0, c.summary()


def _cache_syncs(model: Any, batch_size: int, store: Any) -> int:
    with count_syncs() as c:
        acts = cache_activations(model, _stimuli(16), "resid_post head_out", POSITIONS, store=store,
                                 batch_size=batch_size, progress=False)
    assert not acts.reused
    return c.total


def test_a_cache_call_makes_the_same_few_syncs_whatever_the_batch_size_and_depth(load_tiny: Any,
                                                                                 tmp_path: Any) -> None:
    """Every count left is a read of host data that a CUDA run would not wait on: the weights'
    fingerprint (one .cpu() and .numpy()), and reading back the finished shard (the row table, its
    sortedness and completeness checks, one scalar read per stored tensor). None of them is per
    batch, per row or per layer."""
    shallow, deep = load_tiny("tiny-llama"), tiny_with_layers("tiny-llama", 6, tmp_path / "deep")
    counts = {(name, b): _cache_syncs(m, b, tmp_path / f"{name}-{b}")
              for name, m in (("2 layers", shallow), ("6 layers", deep)) for b in (4, 8, 16)}
    assert len(set(counts.values())) == 1, counts
    per_call = next(iter(counts.values()))
    n_tensors = 2 * len(POSITIONS)  # kinds x positions, each read back once from the one shard
    assert per_call <= 5 + n_tensors, counts


def test_host_copies_are_plain_copies_off_cuda() -> None:
    from tomlens.activations.cache import to_host_async, wait_for_host_copies

    x = torch.arange(6.0).view(2, 3)
    y = to_host_async(x)
    wait_for_host_copies(torch.device("cpu"))
    assert torch.equal(x, y) and y.device.type == "cpu"
