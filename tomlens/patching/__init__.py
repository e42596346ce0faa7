"""Patching between matched stories: the cell vocabulary (cells), pairs made ready (pairs), the batched
engine (engine), exact and attribution sweeps (exact, attribution), their result (result), AtP*
search (search), the gate that must pass before heads are ranked (gate), head rankings with their
validations (heads), per-role views (roles), the plan and checkpoints of a sweep."""

from tomlens.patching.attribution import attribution_patching, compare
from tomlens.patching.exact import exact_patching
from tomlens.patching.pairs import prepare_pairs
from tomlens.patching.result import PatchingResult
from tomlens.patching.heads import head_table, mean_ablation, rank_heads, topk_recovery
from tomlens.patching.search import SearchResult, atp_star, search
from tomlens.patching.gate import GateResult, gate_pairs, gate_table, run_gate, split_selection
from tomlens.patching.roles import mention_selectors, role_aligned
# What a whole patching run (tomlens.runs.patching) lays out, runs, checkpoints and summarises:
from tomlens.patching.checkpoints import Checkpoints
from tomlens.patching.cells import canonical_kind, plan_cells
from tomlens.patching.exact import ExactSweep
from tomlens.patching.heads import AblationSweep, HeadSetSweep, topk_settings
from tomlens.patching.metric import METRIC_NAME, gap_note, gap_warnings_silenced
from tomlens.patching.plan import AttributionSweep, Plan, calibrate, drop_missing_roles, parse_positions, plan_stages

__all__ = [
    "GateResult", "PatchingResult", "SearchResult", "atp_star", "attribution_patching", "compare", "exact_patching",
    "gate_pairs", "gate_table", "head_table", "mean_ablation", "mention_selectors", "prepare_pairs", "rank_heads",
    "role_aligned", "run_gate", "search", "split_selection", "topk_recovery",
]
__all__ += [
    "METRIC_NAME", "AblationSweep", "AttributionSweep", "Checkpoints", "ExactSweep", "HeadSetSweep", "Plan",
    "calibrate", "canonical_kind", "drop_missing_roles", "gap_note", "gap_warnings_silenced", "parse_positions",
    "plan_cells", "plan_stages", "topk_settings",
]
