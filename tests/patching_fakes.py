"""Synthetic patching summaries (`PatchingSummary`) for tests of the readers (validate, compare,
findings, the report) that need no model: every required field filled with a plain stand-in, the
fields a test is about given."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from tomlens.runs.patching_summary import (
    AblationBaseline,
    AblationRow,
    AblationSummary,
    Comparison,
    GateSummary,
    PairCounts,
    PairHalf,
    PatchingSummary,
    TopKRow,
)


def topk_row(k: int = 1, heads: str = "L3H1", top_effect: float = 0.9, random_mean: float = 0.05,
             **extra: Any) -> TopKRow:
    fields: dict[str, Any] = {"top_se": 0.01, "top_ci_low": top_effect - 0.1, "top_ci_high": top_effect + 0.1,
                              "random_low": 0.0, "random_high": 0.3, "random_reach": 0.0, "p_random": 0.01,
                              "n_random": 200, "n_distinct": 300, "position": "final", "direction": "denoise"}
    return TopKRow(k=k, heads=heads, top_effect=top_effect, random_mean=random_mean, **{**fields, **extra})


def comparison(position: str = "final", spearman: float | None = 0.9, **extra: Any) -> Comparison:
    fields: dict[str, Any] = {"direction": "denoise", "kind": "head", "n_cells": 32, "pearson": spearman,
                              "spearman_active": spearman, "n_active": 32, "active": 0.01, "k": 10, "by": "abs",
                              "topk_overlap": 0.7, "exact_top": None, "exact_top_rank": None, "max_abs_diff": 0.1}
    return Comparison(position=position, spearman=spearman, **{**fields, **extra})


def ablation(k: int = 1, fb: float = 0.4, random_drop: float = 0.02, base_fb: float = 1.0,
             mode: str = "final") -> AblationSummary:
    row = AblationRow(k=k, heads="L3H1", fb_accuracy=fb, tb_accuracy=1.0, fb_drop=base_fb - fb, clean_logit_diff=1.0,
                      random_fb_drop_mean=random_drop, random_fb_drop_low=0.0, random_fb_drop_high=0.1,
                      random_tb_accuracy_mean=1.0, random_reach=0.0, p_random=0.01, n_random=200, n_distinct=300,
                      mode=mode)
    base = AblationBaseline(fb_accuracy=base_fb, tb_accuracy=1.0, clean_logit_diff=1.0, corrupted_logit_diff=-1.0)
    return AblationSummary(mode=mode, mean="each ablated head's z replaced by its mean", baseline=base, table=(row,))


def patching_summary(**fields: Any) -> PatchingSummary:
    """A summary of a run that patched, 12 selection and 12 evaluation pairs, with `fields` set."""
    gate = GateSummary(method="t", contrasts={}, passed=("present",), dropped_contrasts=(), message="gate passed",
                       forced=bool(fields.get("forced")), n_gated=24, n_passed_pairs=24, n_patched=24,
                       half_gaps={}, power={})
    pairs = PairCounts(n_given=24, n_aligned=24, n_kept=24, hash="h", contrasts=("present",), dropped=(),
                       selection=PairHalf(n=12, hash="s", tasks=4),
                       evaluation=PairHalf(n=12, hash="e", tasks=4, same_as_selection=False))
    base = PatchingSummary(command="patch", provenance={}, seed=0, gate=gate, notes=(), pairs=pairs, metric="m",
                           directions=("denoise",), seconds=0.0, files=())
    return replace(base, **fields)
