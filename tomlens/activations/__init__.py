"""Activation caching: chosen sites at chosen token positions, in a content-addressed shard store."""

from tomlens.activations.activation_set import ActivationSet, load_activations
from tomlens.activations.cache import cache_activations
from tomlens.activations.store import default_store

__all__ = ["ActivationSet", "cache_activations", "default_store", "load_activations"]
