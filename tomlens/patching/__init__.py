"""Patching between matched stories: the engine, exact and attribution sweeps, AtP* search, head
rankings with their validations, the plan and checkpoints of a sweep."""

from tomlens.patching.attribution import attribution_patching, compare
from tomlens.patching.engine import PatchingResult, exact_patching, prepare_pairs
from tomlens.patching.heads import head_table, mean_ablation, rank_heads, topk_recovery
from tomlens.patching.search import SearchResult, atp_star, search

__all__ = [
    "PatchingResult", "SearchResult", "atp_star", "attribution_patching", "compare", "exact_patching",
    "head_table", "mean_ablation", "prepare_pairs", "rank_heads", "search", "topk_recovery",
]
