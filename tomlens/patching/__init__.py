"""Patching between matched stories: the cell vocabulary (cells), pairs made ready (pairs), the batched
engine (engine), exact and attribution sweeps (exact, attribution), their result (result), AtP*
search (search), the gate that must pass before heads are ranked (gate), head rankings with their
validations (heads), per-role views (roles), the plan and checkpoints of a sweep.

`__all__` is what a researcher calls. What only a whole patching run (tomlens.runs.patching) uses to
lay out, run, checkpoint and summarise a sweep (`Plan`, `calibrate`, the `*Sweep` classes,
`Checkpoints`, ...) is imported from its own module (plan, exact, heads, checkpoints, metric, cells)."""

from tomlens.patching.attribution import attribution_patching, compare
from tomlens.patching.exact import exact_patching
from tomlens.patching.gate import GateResult, gate_pairs, gate_table, run_gate, split_selection
from tomlens.patching.heads import head_table, mean_ablation, rank_heads, topk_recovery
from tomlens.patching.pairs import prepare_pairs
from tomlens.patching.result import PatchingResult
from tomlens.patching.roles import mention_selectors, role_aligned
from tomlens.patching.search import SearchResult, atp_star, search

__all__ = [
    "GateResult", "PatchingResult", "SearchResult", "atp_star", "attribution_patching", "compare", "exact_patching",
    "gate_pairs", "gate_table", "head_table", "mean_ablation", "mention_selectors", "prepare_pairs", "rank_heads",
    "role_aligned", "run_gate", "search", "split_selection", "topk_recovery",
]
