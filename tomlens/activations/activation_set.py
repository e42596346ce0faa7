"""What a finished cache holds: memory-mapped activations with the stimulus of every row.

Rows keep the order of the stimuli given to `cache_activations` (batches are sorted by length for
speed, then put back), so `ids[i]`, `stimuli[i]` and row `i` of every tensor belong together.

Loading maps each shard (safetensors; pages are read only when touched) after checking that the
shards the manifest lists are whole, belong to this request and hold every row once: a damaged
store is refused with a message, never half-loaded. `get` on a store with one shard (the usual
case: shards hold thousands of prompts or minutes of work) returns the mapped tensor itself; with
several shards it places each shard's rows into one new tensor for that one (kind, position) (one
copy of what was asked for, not of the store).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from tomlens.activations import store as st
from tomlens.devices import parse_dtype
from tomlens.errors import TomlensError
from tomlens.hooks.sites import PER_HEAD_KINDS, Site
from tomlens.stimuli.records import Stimulus

# Labels kept for every row in the manifest (and in `labels()`), so results trace to their stimulus.
LABEL_FIELDS: tuple[str, ...] = (
    "family", "task_id", "template_id", "condition", "prompt_type", "reversed", "answer",
    "answer_index", "world_state", "protagonist_belief", "reference_state", "belief_differs",
    "world_is_reference", "belief_is_reference",
)


def row_labels(s: Stimulus) -> dict[str, Any]:
    return {"id": s.id, **{k: getattr(s, k) for k in LABEL_FIELDS}}


@dataclass
class ActivationSet:
    """Activations of `stimuli` at `sites` and `positions`, as stored under `path`.

    `get(kind, position)` gives `[n, layer, d_model]` for resid_pre/resid_mid/resid_post/attn_out/
    mlp_out, `[n, layer, head, d_head]` for `z` and `[n, layer, head, d_model]` for `head_out`;
    `layers(kind)` lists which model layers the layer axis holds.
    """

    path: Path
    manifest: dict[str, Any]
    stimuli: list[Stimulus]
    reused: bool = False
    _shards: list[tuple[Tensor, dict[str, Tensor]]] | None = field(default=None, repr=False)  # (rows, tensors)

    @classmethod
    def load(cls, path: str | Path, stimuli: list[Stimulus] | None = None, *, reused: bool = False) -> ActivationSet:
        """Open a finished store folder; `stimuli` (same records, same order) saves re-reading them."""
        folder = Path(path)
        if not st.is_complete(folder):
            raise TomlensError(
                f"{folder} holds no finished activation cache (no complete manifest)",
                "run cache_activations / `tomlens cache` with the same request; it resumes from finished shards",
            )
        manifest = st.read_manifest(folder) or {}
        if stimuli is None:
            lines = (folder / st.STIMULI).read_text(encoding="utf-8").splitlines()
            stimuli = [Stimulus.from_dict(json.loads(line)) for line in lines if line.strip()]
        ids = [r["id"] for r in manifest["rows"]]
        if [s.id for s in stimuli] != ids:
            raise TomlensError(f"the stimuli do not match the rows stored in {folder}",
                               "load the store without passing stimuli")
        loaded = cls(path=folder, manifest=manifest, stimuli=list(stimuli), reused=reused)
        loaded._open()  # refuse a damaged store now, not at the first `get`
        return loaded

    def __len__(self) -> int:
        return len(self.stimuli)

    @property
    def ids(self) -> list[str]:
        return [s.id for s in self.stimuli]

    @property
    def positions(self) -> list[str]:
        return list(self.manifest["positions"])

    @property
    def sites(self) -> list[Site]:
        return [Site.from_label(label) for label in self.manifest["sites"]]

    @property
    def kinds(self) -> list[str]:
        return list(self.manifest["layers"])

    @property
    def dtype(self) -> torch.dtype:
        return parse_dtype(self.manifest["dtype"])

    @property
    def nbytes(self) -> int:
        return st.folder_bytes(self.path)

    def layers(self, kind: str) -> list[int]:
        """The model layers stored for `kind`, in the order of the layer axis."""
        self._check_kind(kind)
        return list(self.manifest["layers"][kind])

    def get(self, kind: str, position: str) -> Float[Tensor, "n layer *d"]:
        """Activations of `kind` at `position` for every row: `[n, layer, d]` or `[n, layer, head, d]`."""
        self._check_kind(kind)
        if position not in self.manifest["positions"]:
            raise TomlensError(
                f"position {position!r} is not in this cache (it has {self.manifest['positions']})",
                "cache it, or choose one of the cached positions",
            )
        name = st.tensor_name(kind, position)
        shards = self._open()
        if len(shards) == 1:  # one shard holds every row in the caller's order (checked in `_open`)
            return shards[0][1][name]
        first = shards[0][1][name]
        out = torch.empty((len(self), *first.shape[1:]), dtype=first.dtype)
        for rows, tensors in shards:
            out[rows] = tensors[name]
        return out

    def labels(self):  # -> pandas.DataFrame
        """One row per stimulus: id and labels (condition, world state, belief, ...), row order."""
        import pandas as pd

        return pd.DataFrame(self.manifest["rows"])

    def _check_kind(self, kind: str) -> None:
        if kind not in self.manifest["layers"]:
            raise TomlensError(
                f"site kind {kind!r} is not in this cache (it has {self.kinds})",
                "cache it, or choose one of the cached kinds",
            )

    def _open(self) -> list[tuple[Tensor, dict[str, Tensor]]]:
        """Map every shard after checking it: whole, this request's, the stretch the manifest lists,
        and all shards together holding each row exactly once."""
        if self._shards is None:
            shards, stop, key = [], 0, self.manifest["key"]
            for i, s in enumerate(self.manifest["shards"]):
                path = self.path / s["file"]
                got = st.read_finished_shard(path, st.shard_meta(key, i, stop, s["stop"]), self._shapes, load=True)
                if (got is None or got[3] is None or s["start"] != stop  # (load=True: never None)
                        or not bool((got[2][1:] > got[2][:-1]).all())):
                    raise st.DamagedStore(
                        f"{path} is damaged or does not hold the rows its manifest lists (written by another run?)",
                        f"run the same cache request again (it recomputes what is damaged), or delete {self.path}",
                    )
                stop = got[1]
                shards.append((got[2], got[3]))
            rows = torch.cat([r for r, _ in shards]) if shards else torch.empty(0, dtype=torch.long)
            if stop != len(self) or not torch.equal(torch.sort(rows).values, torch.arange(len(self))):
                raise st.DamagedStore(f"the shards in {self.path} do not hold every row exactly once",
                                      f"run the same cache request again, or delete {self.path}")
            self._shards = shards
        return self._shards

    def _shapes(self, n_rows: int) -> dict[str, tuple[int, ...]]:
        return {name: (n_rows, *shape[1:]) for name, shape in self.manifest["shapes"].items()}

    def describe(self) -> str:
        """A few lines saying where the store is and what it holds."""
        m = self.manifest
        lines = [
            f"store:     {self.path}" + ("  (reused, model not run)" if self.reused else ""),
            f"model:     {m['model']['model']} (revision {m['model']['revision']}, run in {m['model']['dtype']})",
            f"stimuli:   {len(self)} rows, hash {m['stimuli_hash']}",
            f"positions: {', '.join(m['positions'])}",
            f"dtype:     {m['dtype']}; {len(m['shards'])} shard(s), {self.nbytes / 2**20:.1f} MiB",
        ]
        for kind, layers in m["layers"].items():
            shape = m["shapes"][st.tensor_name(kind, m["positions"][0])]
            axes = "n layer head d" if kind in PER_HEAD_KINDS else "n layer d"
            lines.append(f"  {kind:<10} layers {_ranges(layers)}  [{axes}] = {shape}")
        return "\n".join(lines)


def _ranges(xs: list[int]) -> str:
    """Runs of consecutive layers as ranges: [0, 1, 2, 5] -> "0-2,5"."""
    runs: list[list[int]] = []  # [first, last] of each run
    for x in xs:
        if runs and x == runs[-1][1] + 1:
            runs[-1][1] = x
        else:
            runs.append([x, x])
    return ",".join(f"{a}-{b}" if a != b else str(a) for a, b in runs)


def load_activations(path: str | Path) -> ActivationSet:
    """Open a finished store folder (as printed by `tomlens cache`)."""
    return ActivationSet.load(path, reused=True)
