"""The cache stage: activations of stimuli at chosen sites and token positions, in the store.

The tensors live in the activation store (a folder named by the request's hash, shared by every
run that asks for the same thing); a run folder only records which store folder holds them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tomlens.activations import ActivationSet, cache_activations
from tomlens.errors import TomlensError
from tomlens.hooks.sites import KINDS, SHORTHANDS
from tomlens.models.positions import parse_selectors, refuse_near_misses
from tomlens.models.protocol import Model
from tomlens.provenance import run_manifest
from tomlens.runs.base import ModelSpec, StimuliSpec, split_items
from tomlens.runs.files import (
    begin_save,
    check_store_writable,
    finish_save,
    read_finished,
    summary_from_dict,
    summary_to_dict,
)
from tomlens.stimuli.records import stimuli_hash
from tomlens.vocabulary import unknown


def check_sites(sites: tuple[str, ...]) -> None:
    """Site specs (`kind[:layers]`) name known kinds; layer ranges are checked against the model."""
    if not sites:
        raise TomlensError("no sites were given", "name at least one, e.g. resid_post")
    for item in sites:
        kind = item.partition(":")[0]
        if kind not in KINDS:
            raise unknown("site kind", kind, KINDS, SHORTHANDS)


def _site_kind_name(item: str) -> str:
    """`item` (`kind[:layers]`) with a shorthand kind of `tomlens patch` (heads, resid, attn, mlp)
    written as the site kind it stands for, so every command takes the same site names."""
    kind, sep, layers = item.partition(":")
    return SHORTHANDS.get(kind, kind) + sep + layers


@dataclass(frozen=True)
class CacheConfig:
    """Which stimuli to run through which model, keeping `sites` at `positions`."""

    model: ModelSpec = ModelSpec()
    stimuli: StimuliSpec | None = None
    sites: tuple[str, ...] = ("resid_post",)
    positions: tuple[str, ...] = ("final",)
    store: str | None = None  # store root (default: $TOMLENS_HOME/activations or the user cache dir)
    batch_size: int | None = None  # prompts per forward (halves on out-of-memory)
    flush_seconds: float | None = None  # write a shard once this much work is pending

    def __post_init__(self) -> None:
        if self.stimuli is None:
            raise TomlensError("a cache run needs stimuli", "add stimuli = {path = \"...\"} or --stimuli FILE")
        object.__setattr__(self, "sites", tuple(_site_kind_name(s) for s in split_items(self.sites)))
        object.__setattr__(self, "positions", tuple(parse_selectors(split_items(self.positions))))
        refuse_near_misses(self.positions, user_spans=self.stimuli.path is not None)
        check_sites(self.sites)
        if self.flush_seconds is not None:
            object.__setattr__(self, "flush_seconds", float(self.flush_seconds))
        if self.batch_size is not None and self.batch_size < 1:
            raise TomlensError(f"batch_size = {self.batch_size} must be at least 1", "use 1 or more, or leave it out")


@dataclass(frozen=True, kw_only=True)
class CacheSummary:
    """What a run folder records about its activation set: where it is in the store and under which
    key, whether it was reused, how many prompts, their stimuli's hash, and its sites, positions,
    layers per site kind and dtype."""

    store: str
    key: str | None
    reused: bool
    n: int
    stimuli_hash: str | None
    sites: tuple[str, ...]
    positions: tuple[str, ...]
    layers: dict[str, list[int]]
    dtype: str | None


@dataclass
class CacheResult:
    """The activation set a cache run made or found, and where it lives."""

    activations: ActivationSet
    summary: CacheSummary
    config: CacheConfig | None = None
    manifest: dict[str, Any] = field(default_factory=dict)

    @property
    def path(self) -> Path:
        return self.activations.path

    def save(self, out: str | Path) -> Path:
        """config.json, manifest.json and result.json (store path, what it holds, reused or not)."""
        out = begin_save(out)
        return finish_save(out, self.config, self.manifest, summary_to_dict(self.summary))

    @classmethod
    def load(cls, out: str | Path) -> CacheResult:
        """Reopen the activation set the run folder names (the store must still hold it)."""
        out, config, manifest, data = read_finished(out, CacheConfig)
        summary = summary_from_dict(CacheSummary, data, folder=out, stage="cache")
        acts = ActivationSet.load(summary.store, reused=summary.reused)
        return cls(activations=acts, summary=summary, config=config, manifest=manifest)

    def describe(self) -> str:
        return self.activations.describe()


def summarise_activations(acts: ActivationSet) -> CacheSummary:
    """What a run folder records about an activation set."""
    m = acts.manifest
    return CacheSummary(store=str(acts.path), key=m.get("key"), reused=bool(acts.reused), n=len(acts),
                        stimuli_hash=m.get("stimuli_hash"), sites=tuple(m.get("sites", [])),
                        positions=tuple(m.get("positions", [])),
                        layers={k: list(v) for k, v in m.get("layers", {}).items()}, dtype=m.get("dtype"))


def run(config: CacheConfig, *, model: Model | None = None, progress: bool = True) -> CacheResult:
    """Cache (or find cached) the activations `config` asks for."""
    assert config.stimuli is not None  # checked in CacheConfig
    stimuli = config.stimuli.load()  # a bad file fails before the model loads
    check_store_writable(config)  # a read-only store: one clear error before the model loads
    if model is None:
        model = config.model.load()
    acts = cache_activations(model, stimuli, list(config.sites), list(config.positions), store=config.store,
                             batch_size=config.batch_size, flush_seconds=config.flush_seconds, progress=progress)
    manifest = run_manifest(model, config, stimuli_hash=stimuli_hash(stimuli))
    return CacheResult(activations=acts, summary=summarise_activations(acts), config=config, manifest=manifest)
