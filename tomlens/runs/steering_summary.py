"""The steering stage's typed summary (`SteeringResult.summary`, its `result.json`): one
`SteeringLayer` row per steered layer and the run's settings and sizes around them.

Field names are the JSON keys the stage wrote before its summary was typed, so those folders load
unchanged, through `tomlens.runs.files.summary_from_dict`. Two things a dict got for free are said
here instead: JSON has no NaN (a flip rate that could not be measured is written as null, and the
codec reads null back as NaN in every field annotated `float`), and the selection-half columns are
None in rows written before the selection half ran random directions (`runs.steering.chosen_layer`
then falls back to the older columns).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class SteeringLayer:
    """One layer at its chosen dose: the evaluation half's flip rates, the random directions' summary
    numbers (`runs.steering.RandomFlips`), the verdict and why, and the selection half's numbers
    that chose the dose and the layer (None in rows from before they were kept)."""

    layer: int
    alpha: float
    flip_false_belief: float
    flip_true_belief: float
    flip_reality: float
    random_mean: float
    random_p95: float
    random_max: float
    p_random: float
    n_random: int
    shuffled: float
    verdict: str
    reason: str
    selection_flip: float | None = None
    selection_random_p95: float | None = None
    selection_random_max: float | None = None  # shown, not chosen by
    selection_margin: float | None = None  # what picks the layer: never an evaluation number
    selection_flip_max: float | None = None
    selection_reached: bool | None = None


@dataclass(frozen=True, kw_only=True)
class SteeringSummary:
    """The steering run: per-layer rows, how directions were fitted and applied, the two halves'
    sizes, the evaluation directions' norms per layer, and the verdict of the layer chosen on the
    selection half (`layer`: not the best held-out one)."""

    layers: tuple[SteeringLayer, ...]
    mode: str
    positions: str
    method: str
    target: str
    alphas: tuple[float, ...]
    n_random: int
    n_selection_prompts: int
    n_evaluation_prompts: int
    selection_tasks: tuple[str, ...]
    forward_passes: int
    norms: dict[str, float]
    # the rule: margins and verdicts over the random directions' mean and this quantile, never their
    # maximum (None: a result from before that rule)
    random_quantile: float | None = None
    verdict: str  # the selection half's layer, not the best held-out one
    layer: int
    notes: tuple[str, ...]


__all__ = ["SteeringLayer", "SteeringSummary"]
