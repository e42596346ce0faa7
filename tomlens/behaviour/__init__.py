"""Behaviour: answer options scored by log-probability, and the papers' aggregate rules."""

from tomlens.behaviour.scoring import score, score_options

__all__ = ["score", "score_options"]
