"""The result of a patching sweep (exact, attribution or search): the raw patched metric of every
cell and pair with the clean and corrupted baselines, and the tables read from it (per cell with
intervals, per pair, baselines, grids for figures)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd
from jaxtyping import Float
from torch import Tensor

from tomlens.errors import TomlensError
from tomlens.patching.cells import Cell, canonical_kind
from tomlens.patching.metric import Normalise, gap_is_unstable, normalised_effects, summarise


@dataclass
class PatchingResult:
    """Raw patched metric for every cell and pair, with the clean and corrupted baselines.

    `values[c, p]` is the logit difference of pair p with cell c patched (for attribution: the
    first-order estimate of it); NaN where the pair has no token at that position.
    """

    method: str
    direction: str
    cells: list[Cell]
    values: Float[Tensor, "cell pair"]
    clean: Float[Tensor, " pair"]
    corrupted: Float[Tensor, " pair"]
    pair_ids: list[str]
    token_labels: list[str]
    normalise: Normalise = "pooled"
    seed: int = 0  # of the bootstrap
    _summaries: dict[tuple[int, int], pd.DataFrame] = field(default_factory=dict, repr=False)

    def cell_frame(self) -> pd.DataFrame:
        return pd.DataFrame(
            {
                "kind": [c.kind for c in self.cells],
                "layer": [c.layer for c in self.cells],
                "head": [c.head for c in self.cells],
                "position": [c.position for c in self.cells],
                "pos": [c.pos for c in self.cells],
            }
        )

    def summary(self, *, n_boot: int = 1000, seed: int | None = None) -> pd.DataFrame:
        """One row per cell: normalised effect (mean over pairs), SE, bootstrap 95% interval,
        number of pairs and the mean raw logit difference after the patch."""
        seed = self.seed if seed is None else seed
        if (n_boot, seed) in self._summaries:
            return self._summaries[(n_boot, seed)]
        s = summarise(self.values, self.clean, self.corrupted, normalise=self.normalise, n_boot=n_boot, seed=seed)
        df = self.cell_frame()
        df.insert(0, "direction", self.direction)
        df.insert(0, "method", self.method)
        df["token"] = [self.token_labels[c.pos] if c.pos >= 0 else "" for c in self.cells]
        df["effect"] = s.mean
        df["se"] = s.se
        df["ci_low"] = s.ci_low
        df["ci_high"] = s.ci_high
        df["n_pairs"] = s.n
        with np.errstate(all="ignore"):
            df["logit_diff"] = np.nanmean(self.values.double().numpy(), axis=1) if len(self.cells) else []
        self._summaries[(n_boot, seed)] = df
        return df

    def per_pair(self) -> pd.DataFrame:
        """Long table: one row per (cell, pair) with the raw and the normalised value."""
        norm = normalised_effects(self.values, self.clean, self.corrupted, self.normalise).numpy()
        n_cell, n_pair = self.values.shape
        df = self.cell_frame().loc[np.repeat(np.arange(n_cell), n_pair)].reset_index(drop=True)
        df.insert(0, "cell", np.repeat(np.arange(n_cell), n_pair))
        df["pair_id"] = np.tile(np.array(self.pair_ids, dtype=object), n_cell)
        df["logit_diff"] = self.values.double().numpy().reshape(-1)
        df["effect"] = norm.reshape(-1)
        return df

    def baselines(self) -> dict[str, float]:
        """Mean clean and corrupted metric, and their gap (the normaliser) with its standard error:
        when the gap is within about two standard errors of 0, normalised effects are unstable."""
        gap = (self.clean - self.corrupted).double()
        n = len(self.pair_ids)
        se = float(gap.std() / n**0.5) if n > 1 else float("nan")
        return {
            "clean_logit_diff": float(self.clean.double().mean()),
            "corrupted_logit_diff": float(self.corrupted.double().mean()),
            "gap": float(gap.mean()),
            "gap_se": se,
            "gap_unstable": gap_is_unstable(gap),
            "n_pairs": n,
        }

    def head_position(self) -> str:
        """Where a head ranking reads this result by default: every position at once when the
        sweep patched heads there, else the final token, else the first head position (a role-
        position sweep, the default of `exact_patching` and `tomlens patch`, has no "all")."""
        found = list(dict.fromkeys(c.position for c in self.cells if c.kind == "head"))
        if not found:
            raise TomlensError(f"the {self.method} result has no head cells",
                               "run the sweep with sites including 'heads'")
        return next((p for p in ("all", "final") if p in found), found[0])

    def select(self, kind: str, position: str) -> pd.DataFrame:
        df = self.summary()
        return df[(df.kind == canonical_kind(kind)) & (df.position == position)]

    def grid(self, kind: str, position: str, column: str = "effect") -> np.ndarray:
        """`[layer, head]` for heads, `[layer, pos]` for position "each", `[layer, 1]` otherwise."""
        df = self.select(kind, position)
        if df.empty:
            raise TomlensError(f"the result has no cells of kind {kind!r} at position {position!r}")
        col = "head" if canonical_kind(kind) == "head" and position != "each" else "pos"
        if canonical_kind(kind) == "head" and position == "each":
            raise TomlensError("a per-position head sweep has three axes; use select() instead")
        layers = sorted(df.layer.unique())
        keys = sorted(df[col].unique())
        out = np.full((len(layers), len(keys)), np.nan)
        li = {l: i for i, l in enumerate(layers)}
        ki = {k: i for i, k in enumerate(keys)}
        for l, k, v in zip(df.layer, df[col], df[column], strict=True):
            out[li[l], ki[k]] = v
        return out
