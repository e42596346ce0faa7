"""Sites: one tomlens name for each place in a model that can be read or patched.

A `Site` (kind, layer, head) is the only vocabulary the rest of tomlens uses; `hook_name` is the
one place that turns it into a TransformerLens hook name, so a TransformerLens rename touches
this file alone. The names are the HookedTransformer-style aliases that `TransformerBridge`
keeps for every architecture (`blocks.L.hook_resid_pre`, `blocks.L.attn.hook_z`, ...).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from tomlens.errors import TomlensError
from tomlens.models.protocol import Model
from tomlens.vocabulary import unknown

# kind -> what it is. Order is the order sites fire inside a block (used only for display).
KINDS: dict[str, str] = {
    "resid_pre": "residual stream entering the block",
    "z": "each query head's attention-weighted values, d_head (GQA: per query head)",
    "head_out": "each head's own write to the residual stream, z_h @ W_O[h] (d_model, no bias; "
                "Gemma 2/3: its share before the post-attention norm)",
    "attn_out": "attention output as added to the residual stream (sum of head_out plus b_O; "
                "Gemma 2/3 then apply their post-attention norm)",
    "resid_mid": "residual stream between attention and MLP (sequential blocks only)",
    "mlp_out": "MLP output",
    "resid_post": "residual stream leaving the block",
}
PER_HEAD_KINDS: frozenset[str] = frozenset({"z", "head_out"})
# `tomlens patch`'s shorthands, each the site kind it patches: a misspelt kind suggests the kind.
SHORTHANDS: dict[str, str] = {"heads": "head_out", "head": "head_out", "resid": "resid_pre",
                              "attn": "attn_out", "mlp": "mlp_out"}

# kind -> TransformerLens alias, relative to `blocks.{layer}.`. head_out is computed from z.
_TL_NAMES: dict[str, str] = {
    "resid_pre": "hook_resid_pre",
    "resid_mid": "hook_resid_mid",
    "resid_post": "hook_resid_post",
    "attn_out": "hook_attn_out",
    "mlp_out": "hook_mlp_out",
    "z": "attn.hook_z",
    "head_out": "attn.hook_z",
}


@dataclass(frozen=True)
class Site:
    """A place in the model: `kind` at block `layer`, optionally one query `head`.

    For per-head kinds (`z`, `head_out`) `head=None` means every head.
    """

    kind: str
    layer: int
    head: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise unknown("site kind", self.kind, KINDS, SHORTHANDS)
        if not isinstance(self.layer, int) or self.layer < 0:
            raise TomlensError(f"site {self.kind!r}: layer {self.layer!r} is not a layer index",
                               "layers are integers from 0 to n_layers - 1")
        if self.head is not None and self.kind not in PER_HEAD_KINDS:
            raise TomlensError(
                f"site {self.kind}:{self.layer} was given head {self.head}, but {self.kind!r} is not per head",
                f"heads apply to {sorted(PER_HEAD_KINDS)} only",
            )

    @property
    def per_head(self) -> bool:
        return self.kind in PER_HEAD_KINDS

    def label(self) -> str:
        """A stable, human-readable name: `resid_post:3`, `z:5.h2`."""
        return f"{self.kind}:{self.layer}" + ("" if self.head is None else f".h{self.head}")

    def __str__(self) -> str:
        return self.label()

    @classmethod
    def from_label(cls, label: str) -> Site:
        m = re.fullmatch(r"([a-z_]+):(\d+)(?:\.h(\d+))?", label.strip())
        if not m:
            raise TomlensError(f"{label!r} is not a site label", "write it as kind:layer or kind:layer.hHEAD")
        return cls(m.group(1), int(m.group(2)), None if m.group(3) is None else int(m.group(3)))


def hook_name(site: Site) -> str:
    """The TransformerLens hook that carries `site` (for `head_out`, the `z` hook it is computed from)."""
    return f"blocks.{site.layer}.{_TL_NAMES[site.kind]}"


def _parse_layers(text: str, n_layers: int, spec: str) -> list[int]:
    layers: list[int] = []
    for part in text.split(","):
        part = part.strip()
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not m:
            raise TomlensError(
                f"site spec {spec!r}: {part!r} is not a layer, a range a-b or a comma list",
                "write e.g. resid_post, resid_post:3, resid_post:0-5 or resid_post:0,4,8",
            )
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) is not None else lo
        if lo > hi:
            raise TomlensError(f"site spec {spec!r}: range {part!r} runs backwards", "write the lower layer first")
        if hi >= n_layers:
            raise TomlensError(
                f"site spec {spec!r}: layer {hi} does not exist (the model has {n_layers} layers)",
                f"use layers 0-{n_layers - 1}",
            )
        layers.extend(range(lo, hi + 1))
    return layers


def parse_sites(spec: str | Site | Sequence[str | Site], n_layers: int) -> list[Site]:
    """Turn `"resid_post"`, `"resid_post:0-5"`, `"head_out:3,7"`, `Site`s or a list of them into sites.

    A bare kind means every layer. A single string may hold several specs separated by spaces.
    The result keeps first-seen order and drops duplicates.
    """
    if isinstance(spec, (str, Site)):
        items: list[str | Site] = [spec]
    else:
        items = list(spec)
    out: list[Site] = []
    for item in items:
        if isinstance(item, Site):
            if item.layer >= n_layers:
                raise TomlensError(f"site {item} does not exist (the model has {n_layers} layers)",
                                   f"use layers 0-{n_layers - 1}")
            out.append(item)
            continue
        for token in str(item).split():
            kind, _, layers = token.partition(":")
            if kind not in KINDS:
                raise unknown("site kind", kind, KINDS, SHORTHANDS)
            chosen = _parse_layers(layers, n_layers, token) if layers else list(range(n_layers))
            out.extend(Site(kind, layer) for layer in chosen)
    if not out:
        raise TomlensError("no sites were given", "name at least one, e.g. resid_post")
    return list(dict.fromkeys(out))


def check_sites(model: Model, sites: Sequence[Site]) -> None:
    """Fail early, naming the site, when `model` has no hook for it (e.g. resid_mid in a parallel block)."""
    hooks = model.hook_dict
    n_layers = model.cfg.n_layers
    for site in sites:
        if site.layer >= n_layers:
            raise TomlensError(f"site {site} does not exist (the model has {n_layers} layers)",
                               f"use layers 0-{n_layers - 1}")
        if site.head is not None and site.head >= model.cfg.n_heads:
            raise TomlensError(f"site {site}: head {site.head} does not exist ({model.cfg.n_heads} heads)",
                               f"use heads 0-{model.cfg.n_heads - 1}")
        if hook_name(site) not in hooks:
            why = (
                " (this architecture runs attention and MLP in parallel, so no residual stream lies between them)"
                if site.kind == "resid_mid"
                else ""
            )
            raise TomlensError(
                f"site {site} has no hook in this model{why}",
                "choose another site kind, e.g. resid_pre or resid_post",
            )
