"""Steering along belief directions: interventions in the residual stream (add a direction,
project it out, patch only its component from another run), dose-response tables, and the
controls that say whether a direction is special (norm-matched random directions, labels shuffled
so that each class splits evenly). Sits beside `tomlens.patching`; `tomlens.runs.steering` runs it as a stage."""

from tomlens.steering.directions import (
    METHODS,
    Direction,
    balanced_shuffle,
    check_finite,
    directions_from_file,
    fit_directions,
    mean_difference,
    probe_direction,
    random_directions,
    shuffled_direction,
)
from tomlens.steering.dose import CONDITIONS, condition_of, count_passes, dose_response, paired_sources
from tomlens.steering.interventions import MODES, POSITIONS, edit, row_hooks, steering, steering_hooks

__all__ = [
    "CONDITIONS", "METHODS", "MODES", "POSITIONS", "Direction", "check_finite", "condition_of", "count_passes",
    "directions_from_file", "dose_response", "edit", "fit_directions", "mean_difference", "paired_sources",
    "probe_direction", "random_directions", "row_hooks", "balanced_shuffle", "shuffled_direction",
    "steering", "steering_hooks",
]
