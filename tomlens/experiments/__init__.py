"""Experiments over models and stimuli: behaviour, probe sweeps, activation and attribution
patching, attribution-guided search (AtP*), and the head-level analyses built on them. Each function returns a table or a result
object; the CLI commands are thin layers over these."""

from tomlens.experiments.attribution import attribution_patching, compare
from tomlens.experiments.behaviour import score, score_options
from tomlens.experiments.behaviour_run import BehaviourResult, run_behaviour, write_behaviour
from tomlens.experiments.heads import head_table, mean_ablation, rank_heads, topk_recovery
from tomlens.experiments.patching import PatchingResult, exact_patching, prepare_pairs
from tomlens.experiments.probe_sweep import ProbeSweepResult, SweepConfig, run_probe_sweep, write_probe_sweep
from tomlens.experiments.search import SearchResult, atp_star, search

__all__ = [
    "BehaviourResult", "PatchingResult", "ProbeSweepResult", "SearchResult", "SweepConfig", "atp_star",
    "attribution_patching", "compare", "exact_patching", "head_table", "mean_ablation", "prepare_pairs",
    "rank_heads", "run_behaviour", "run_probe_sweep", "score", "score_options", "search", "topk_recovery",
    "write_behaviour", "write_probe_sweep",
]
