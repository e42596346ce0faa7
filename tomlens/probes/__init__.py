"""Linear probes for many layers and heads at once, leak-free splits, targets, controls and intervals.

    from tomlens.probes import LogisticProbe, make_target, group_codes
    y, keep = make_target(stimuli, "protagonist_belief")
    probe = LogisticProbe().fit(X[:, keep], y[keep], groups=group_codes(kept_stimuli))  # X: [unit, n, d]
    probe.score(X_test, y_test)    # accuracy per unit
    probe.direction                # [unit, k, d] unit vectors in activation space

The sweep over cached activations lives in `tomlens.probes.sweep`.
"""

from tomlens.probes.base import Probe
from tomlens.probes.baselines import (
    BASELINE_COLUMNS,
    add_best_baseline,
    attach_baselines,
    length_features,
    position_features,
)
from tomlens.probes.controls import (
    bag_of_words,
    condition_split,
    split_labels,
    type_cells,
    type_control_labels,
)
from tomlens.probes.directions import load_directions, save_directions
from tomlens.probes.logistic import C_GRID, LogisticFit, LogisticProbe, fit_logistic
from tomlens.probes.mass_mean import MassMeanProbe
from tomlens.probes.splits import Split, group_codes, group_kfold, holdout, leaked_groups
from tomlens.probes.stats import Interval, bootstrap_auroc, bootstrap_mean
from tomlens.probes.targets import TARGETS, false_belief_mask, make_target, true_belief_mask

__all__ = [
    "BASELINE_COLUMNS", "C_GRID", "Interval", "LogisticFit", "LogisticProbe", "MassMeanProbe", "Probe", "Split",
    "TARGETS", "add_best_baseline", "attach_baselines", "bag_of_words", "bootstrap_auroc", "bootstrap_mean",
    "condition_split", "false_belief_mask", "fit_logistic", "group_codes", "group_kfold", "holdout",
    "leaked_groups", "length_features", "load_directions", "make_target", "position_features",
    "save_directions", "split_labels", "true_belief_mask", "type_cells", "type_control_labels",
]
