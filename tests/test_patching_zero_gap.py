"""A pair's clean - corrupted gap is zero when it is within float32 rounding of the logit
differences' own scale (`tomlens.patching.metric.zero_gaps`), not only when it is exactly 0."""

from __future__ import annotations

import warnings

import pytest
import torch

from tomlens.patching.metric import UnstableGapWarning, normalised_effects, summarise, zero_gaps

pytestmark = pytest.mark.unit


def test_a_gap_left_by_rounding_counts_as_zero_and_a_small_real_one_does_not():
    big = torch.tensor([10.0, 10.0, 1e-5, 1e-2, 2.0], dtype=torch.float64)
    gaps = torch.tensor([1e-6, 0.0, 1e-6, 1e-3, 1.0], dtype=torch.float64)
    # 1e-6 of 10 is rounding; so is 1e-6 between differences of 1e-5 (the logits they come from are
    # larger and rounded to their own size); 1e-3 between differences of 1e-2 is a real gap
    assert zero_gaps(big + gaps, big).tolist() == [True, True, True, False, False]
    assert zero_gaps(torch.zeros(1), torch.zeros(1)).tolist() == [True]


def test_per_pair_effects_leave_a_near_zero_gap_out_and_warn():
    clean = torch.tensor([10.000001, 2.0, 3.0], dtype=torch.float64)  # pair 0: a float gap of 1e-6 at size 10
    corrupted = torch.tensor([10.0, 0.0, 1.0], dtype=torch.float64)
    values = torch.tensor([[11.0, 1.0, 2.0]], dtype=torch.float64)
    effect = normalised_effects(values, clean, corrupted, "per_pair")
    assert torch.isnan(effect[0, 0]) and effect[0, 1:].tolist() == pytest.approx([0.5, 0.5])  # not 1e6
    with pytest.warns(UnstableGapWarning, match="1 pair\\(s\\) have clean == corrupted"):
        out = summarise(values, clean, corrupted, normalise="per_pair", n_boot=20)
    assert out.mean[0] == pytest.approx(0.5) and out.n[0] == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnstableGapWarning)  # a real gap of 1e-3 between small numbers: no warning
        summarise(values * 1e-3, clean * 1e-3, corrupted * 1e-3 - 1e-3, normalise="per_pair", n_boot=20)
