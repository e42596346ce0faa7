"""The patching vocabulary: site kinds with their aliases and default positions, the cells of a
sweep (kind, layer, head, position) and the padded columns a cell patches in a pair.

A kind here is a site kind of `tomlens.hooks`, except that `head` (a head's output) is patched
through the site `z`. Positions:
  - "all": every token at once;
  - a selector from `tomlens.models.positions` ("final", a span role, "protagonist@2", ...),
    resolved in every pair to that pair's own token: a column means one role in every pair;
  - "mentions": a keyword, not a cell position: expanded (`tomlens.patching.roles.mention_selectors`)
    to one selector per role mention every pair has, plus "final", before cells are planned;
  - "each": one cell per token, indexing tokens right-aligned across pairs (pairs of different
    lengths share their ending), so when pairs differ in length a column holds different roles in
    different pairs.
Which to use: selectors or "mentions" to say what a role's token does (a column is a role in
every pair); "each" to scan every token for where an effect sits at all, then re-read it by role
with `tomlens.patching.roles.role_aligned`, or patch the roles it points to.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tomlens.errors import TomlensError
from tomlens.models.protocol import Model
from tomlens.patching.pairs import Group, PreparedPairs

KIND_ALIASES: dict[str, str] = {
    "heads": "head", "head": "head", "z": "head", "head_out": "head",
    "resid": "resid_pre", "resid_pre": "resid_pre", "resid_mid": "resid_mid",
    "resid_post": "resid_post",
    "attn": "attn_out", "attn_out": "attn_out", "mlp": "mlp_out", "mlp_out": "mlp_out",
}
# Patching the whole residual stream at every position restores the clean run outright, so the
# residual stream is swept per position; heads, attention and MLP outputs at all positions. This is
# what `plan_cells` gives a kind listed without positions, and what the position `all` means per kind
# (`tomlens.patching.plan.parse_positions`); `tomlens patch` and the Python sweeps (`exact_patching`,
# `attribution_patching`) default to the role positions instead.
MENTIONS = "mentions"  # keyword expanded per pair set (tomlens.patching.roles)
DEFAULT_POSITIONS: dict[str, tuple[str, ...]] = {
    "head": ("all",), "resid_pre": ("each",), "resid_mid": ("each",), "resid_post": ("each",),
    "attn_out": ("all",), "mlp_out": ("all",),
}


def canonical_kind(name: str) -> str:
    """The canonical patching kind of a site name or alias ("heads" -> "head", "resid" -> "resid_pre")."""
    try:
        return KIND_ALIASES[name.strip()]
    except KeyError:
        raise TomlensError(
            f"unknown patching site {name!r}", f"use one of {sorted(set(KIND_ALIASES))}"
        ) from None


def hook_for(kind: str, layer: int) -> str:
    """TransformerLens hook name for a patching kind; a head's output is patched through its z."""
    from tomlens.hooks import Site, hook_name

    return hook_name(Site("z" if kind == "head" else kind, layer))


@dataclass(frozen=True)
class Cell:
    """One patched site: kind ("head", "resid_pre", "attn_out", "mlp_out", ...), layer, head (-1
    when not a head), position ("all", a selector or "each") and aligned token index (-1 unless
    position is "each")."""

    kind: str
    layer: int
    head: int
    position: str
    pos: int


def layer_list(model: Model, layers: Sequence[int] | None) -> list[int]:
    """The layers a sweep patches (None: every layer), refused when the model lacks one."""
    n_layers = model.cfg.n_layers
    layers = list(range(n_layers)) if layers is None else list(layers)
    bad = [l for l in layers if not 0 <= l < n_layers]
    if bad:
        raise TomlensError(f"layers {bad} do not exist (the model has {n_layers})", "pick layers in range")
    return layers


def plan_cells(
    model: Model,
    sites: Sequence[str] | Mapping[str, Sequence[str]],
    positions: Sequence[str] = (),
    *,
    n_aligned: int,
    layers: Sequence[int] | None = None,
) -> list[Cell]:
    """Cells of a sweep. `sites` lists kinds (each with its default positions) or maps kinds to
    their own position lists; `positions` are added to every kind."""
    if isinstance(sites, str):
        sites = [s for s in sites.split(",") if s.strip()]
    if isinstance(sites, Mapping):
        spec = {canonical_kind(k): tuple(dict.fromkeys(tuple(v) + tuple(positions))) for k, v in sites.items()}
    else:
        spec = {}
        for name in sites:
            kind = canonical_kind(name)
            spec[kind] = tuple(dict.fromkeys(DEFAULT_POSITIONS[kind] + tuple(positions)))
    layers = layer_list(model, layers)
    from tomlens.hooks import Site, check_sites

    check_sites(model, [Site("z" if kind == "head" else kind, l) for kind in spec for l in layers[:1]])
    unexpanded = [k for k, v in spec.items() if MENTIONS in v]
    if unexpanded:
        raise TomlensError(
            f"position {MENTIONS!r} (for {unexpanded}) names the pairs' role mentions, which depend on the pairs",
            "expand it first: positions = tomlens.patching.roles.mention_selectors(pairs)[0] "
            "(a run does this itself)",
        )
    cells: list[Cell] = []
    for kind, poss in spec.items():
        heads = range(model.cfg.n_heads) if kind == "head" else [-1]
        for position in poss:
            ks = range(n_aligned) if position == "each" else [-1]
            for layer in layers:
                for k in ks:
                    for h in heads:
                        cells.append(Cell(kind, layer, h, position, k))
    return cells


def cell_columns(cell: Cell, group: Group, j: int, n_aligned: int) -> list[int] | None:
    """Padded columns the cell patches in pair `j` of a group of token-aligned pairs (the same
    columns in its two rows), dropping columns before the first differing token (identical in
    both runs). None when the pair has no token at that position. `cell_patch` is the general form,
    for pairs whose stories hold a role at different tokens; this one reads row `j` only, so it also
    serves a group remade with one row per pair (search's base runs)."""
    if group.any_role_aligned:
        raise TomlensError("these pairs hold roles at different tokens in their two stories (role-aligned pairs)",
                           "patch them with exact patching (cell_patch); this path needs token-aligned pairs")
    found = cell_patch(cell, group, j, n_aligned, base=j, source=j)
    return None if found is None else found[0]


def cell_patch(cell: Cell, group: Group, j: int, n_aligned: int, *, base: int, source: int
               ) -> tuple[list[int], list[int]] | None:
    """(columns written in row `base`, columns read in row `source`) of the cell in pair `j`, padded;
    ([], []) when the patch changes nothing (the cell lies before the pair's first differing token,
    at the same token in both stories) and None when the pair has no token at that position.

    A selector is resolved in each row: a role-aligned pair (stories of different wording) carries
    the clean story's value at its own role token to the corrupted story's role token. "all" and
    "each" index columns, which mean the same token in both stories only for token-aligned pairs,
    so a role-aligned pair (declared so, or of different token counts) is refused there.

    Read off the group's host lists only: a sweep calls this for every cell and pair before it
    runs, and a read of a device value there would make the host wait for the GPU each time."""
    assert group.first_diff_cols is not None and group.position_cols is not None
    width, fd = group.width, group.first_diff_cols[j]
    if cell.position in ("all", "each") and group.role_aligned(j):
        raise TomlensError(
            f"pair {group.index[j]} (of the prepared pairs) is role-aligned (its stories are worded differently), "
            f"so position {cell.position!r} would patch one word of one story into another word of the other",
            "patch role-aligned pairs at role positions (roles, mentions, final, query_protagonist, ...)",
        )
    if cell.position == "all":
        cols = list(range(fd, width))
        return cols, cols
    if cell.position == "each":
        col = width - n_aligned + cell.pos
        if col < group.pad(j):
            return None
        return ([col], [col]) if col >= fd else ([], [])
    into, take = group.column(cell.position, base), group.column(cell.position, source)
    token = into - group.pad(base)
    if token == take - group.pad(source) and token < group.first_diff_token(j):
        return [], []
    return [into], [take]


def cell_hooks(cells: Sequence[Cell]) -> list[str]:
    """Hook names the cells patch (sorted, once each): what a base pass must record."""
    return sorted({hook_for(c.kind, c.layer) for c in cells})


def selectors_in(sites: Any, positions: Sequence[str]) -> tuple[str, ...]:
    """Selector positions (not "all" or "each") named by `positions` or by a kind -> positions
    mapping of sites: those `prepare_pairs` must resolve."""
    found = list(positions)
    if isinstance(sites, Mapping):
        for v in sites.values():
            found.extend(v)
    return tuple(dict.fromkeys(s for s in found if s not in ("all", "each", MENTIONS)))


def check_selectors(cells: Sequence[Cell], prepared: PreparedPairs) -> None:
    """Fail before any forward when a cell's selector was not resolved for the prepared pairs."""
    missing = {c.position for c in cells if c.position not in ("all", "each")} - set(prepared.selectors)
    if missing:
        raise TomlensError(
            f"positions {sorted(missing)} were not resolved when the pairs were prepared",
            "pass them as `selectors` to prepare_pairs",
        )
