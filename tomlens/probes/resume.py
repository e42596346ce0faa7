"""Finished chunks of a probe sweep on disk, so a killed probe run resumes its fits, not only its cache.

The activation store already makes a second run skip the model; without this, it still re-fitted
every probe. Here each chunk of a sweep (one target x feature set x chunk of units: the unit
`sweep.fit_layout` fits in one batch) is saved as it finishes, into
`<root>/.partial/probes-<key>/`, where `key` hashes everything that decides the fits: the
activations (stimuli hash, store key and model of each set), the targets, sites, position, probe,
seed and every `SweepConfig` field that can change a number. A changed request gets another folder
and never reads stale fits.

A chunk is `<name>.safetensors` (its probe directions, when it keeps them) and then, written last
and atomically, `<name>.json` (its rows of the table, its notes, and the sha256 of the chunk's
inputs: activations, labels and groups exactly as fitted). The JSON marks a finished chunk: a kill
leaves at most a temporary file, and a chunk whose JSON is missing or damaged, or whose inputs'
hash differs from the chunk about to be fitted, is fitted again. Floats go through JSON as
`repr` (NaN as `NaN`), so a resumed table equals an uninterrupted one exactly.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from tomlens.io import atomic_path, json_key, write_atomic
from tomlens.stimuli.records import stimuli_hash

FORMAT = 1  # bump when a chunk file's contents change meaning
PARTIAL = ".partial"
PREFIX = "probes-"
UNUSED_SETTINGS = ("progress", "show_plan", "budget_minutes")  # SweepConfig fields that change no number


@dataclass(frozen=True)
class ChunkFit:
    """What one chunk of a sweep adds to the result: table rows, notes and (maybe) directions."""

    rows: tuple[dict[str, Any], ...]
    notes: tuple[str, ...] = ()
    directions: dict[str, Tensor] = field(default_factory=dict)  # empty: the chunk keeps none


def inputs_hash(*tensors: Tensor) -> str:
    """sha256 over the dtype, shape and bytes of each tensor (read on the host): what a chunk fits."""
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().cpu().contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)};".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def activations_identity(acts: Any) -> dict[str, Any] | None:
    """Which activations a sweep reads, for the checkpoint key: the stimuli, and the store's key and
    model where the set has a manifest (the chunk hash checks the numbers themselves)."""
    if acts is None:
        return None
    manifest = getattr(acts, "manifest", None) or {}
    return {"stimuli": stimuli_hash(acts.stimuli), "store_key": manifest.get("key"), "model": manifest.get("model")}


def fit_settings(config: Mapping[str, Any]) -> dict[str, Any]:
    """The sweep settings that can change a fit (`config` as `dataclasses.asdict` gives it)."""
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in config.items() if k not in UNUSED_SETTINGS}


class FitCheckpoints:
    """Finished chunks of one sweep (one settings key) under `root/.partial/probes-<key>/`."""

    def __init__(self, root: str | Path, settings: Mapping[str, Any]) -> None:
        self.settings = {"format": FORMAT, **settings}
        self.key = json_key(self.settings, 20)
        self.folder = Path(root) / PARTIAL / f"{PREFIX}{self.key}"

    def _json(self, name: str) -> Path:
        return self.folder / f"{name}.json"

    def _tensors(self, name: str) -> Path:
        return self.folder / f"{name}.safetensors"

    def finished(self, names: Sequence[str]) -> int:
        """How many of `names` have a finished chunk on disk (their inputs are checked on load)."""
        return sum(self._json(n).is_file() for n in names)

    def load(self, name: str, inputs: str) -> ChunkFit | None:
        """The chunk `name` fitted on inputs hashing to `inputs`, or None (missing, damaged, other inputs)."""
        try:
            data = json.loads(self._json(name).read_text(encoding="utf-8"))
            if data.get("name") != name or data.get("inputs") != inputs or data.get("key") != self.key:
                return None
            directions = load_file(str(self._tensors(name))) if data["directions"] else {}
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return ChunkFit(rows=tuple(data["rows"]), notes=tuple(data["notes"]), directions=directions)

    def save(self, name: str, inputs: str, fit: ChunkFit) -> None:
        """Write the chunk: its directions first, then the JSON that marks it finished."""
        self.folder.mkdir(parents=True, exist_ok=True)
        if fit.directions:
            with atomic_path(self._tensors(name)) as tmp:
                save_file({k: v.detach().cpu().contiguous() for k, v in fit.directions.items()}, str(tmp))
        data = {"key": self.key, "name": name, "inputs": inputs, "directions": bool(fit.directions),
                "rows": list(fit.rows), "notes": list(fit.notes)}
        if not (self.folder / "settings.json").is_file():  # for a reader: what these fits are of
            write_atomic(json.dumps(self.settings, sort_keys=True, default=str), self.folder / "settings.json")
        write_atomic(json.dumps(data), self._json(name))


def remove_fit_checkpoints(root: str | Path) -> None:
    """Remove every probe sweep's finished chunks under `root` (once the run's result is complete)."""
    for folder in (Path(root) / PARTIAL).glob(f"{PREFIX}*"):
        shutil.rmtree(folder, ignore_errors=True)
    try:
        (Path(root) / PARTIAL).rmdir()  # only when nothing else (another stage's checkpoints) is left there
    except OSError:
        pass
