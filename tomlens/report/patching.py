"""Patching figures: per-head heatmap, residual-stream heatmap over the story's tokens, attribution
against exact patching, and the top-k recovery curve. Plotly, written as self-contained HTML
(plotly.js inlined, so a figure opens offline)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from tomlens.errors import TomlensError
from tomlens.messages import say
from tomlens.patching import PatchingResult
from tomlens.patching.cells import canonical_kind
from tomlens.patching.gate import FORCED_PREFIX
from tomlens.report.html import subtitle, write_figure

if TYPE_CHECKING:
    from tomlens.runs.patching import PatchingRunResult


def _go():
    import plotly.graph_objects as go

    return go


def _effect_scale(values: np.ndarray, direction: str = "denoise") -> dict[str, Any]:
    """Diverging colours centred on the unpatched run (white): 0 when denoising (the corrupted
    run), 1 when noising (the clean run), symmetric around it."""
    centre = 0.0 if direction == "denoise" else 1.0
    finite = values[np.isfinite(values)]
    bound = float(np.max(np.abs(finite - centre))) if finite.size else 1.0
    bound = bound or 1.0
    return {"colorscale": "RdBu", "reversescale": True, "zmin": centre - bound, "zmax": centre + bound, "zmid": centre}


def _title(result: PatchingResult, what: str) -> str:
    b = result.baselines()
    return (
        f"{what}: {result.method} patching ({result.direction}), effect 0 = corrupted, 1 = clean"
        f"<br><sup>{b['n_pairs']} pairs; logit diff clean {b['clean_logit_diff']:.2f}, "
        f"corrupted {b['corrupted_logit_diff']:.2f}</sup>"
    )


def head_heatmap(result: PatchingResult, position: str | None = None) -> Any:
    """Layer x head grid of the normalised patching effect (hover: interval and pairs), at
    `position` (None: `PatchingResult.head_position`)."""
    go = _go()
    position = position or result.head_position()
    df = result.select("head", position)
    grid = result.grid("head", position)
    lo = result.grid("head", position, "ci_low")
    hi = result.grid("head", position, "ci_high")
    layers = sorted(df.layer.unique())
    heads = sorted(df["head"].unique())
    text = [[f"[{a:.2f}, {b:.2f}]" for a, b in zip(r1, r2, strict=True)] for r1, r2 in zip(lo, hi, strict=True)]
    fig = go.Figure(
        go.Heatmap(
            z=grid, x=[f"H{h}" for h in heads], y=[f"L{l}" for l in layers], text=text,
            hovertemplate="%{y} %{x}<br>effect %{z:.3f}<br>95% CI %{text}<extra></extra>",
            colorbar={"title": "effect"}, **_effect_scale(grid, result.direction),
        )
    )
    fig.update_layout(
        title=_title(result, f"Heads at {position!r} positions"), xaxis_title="head",
        yaxis_title="layer", yaxis={"autorange": "reversed"},
    )
    return fig


def resid_heatmap(result: PatchingResult, kind: str = "resid_pre", *, pairs: Any = None, tokenizer: Any = None) -> Any:
    """Layer x token grid for a per-position sweep, with the story's tokens on the x axis
    (right-aligned across pairs; "clean|corrupted" where the two stories differ). Given the sweep's
    `pairs` and the `tokenizer`, whether a column mixes roles is read from each pair's role tokens
    (`tomlens.patching.roles.role_columns`), and a column that is one role in every pair says so;
    without them (or when no pair has a role mention, or the role tokens cannot be read, which the title
    says), pairs of different lengths are taken to mix roles."""
    go = _go()
    kind = canonical_kind(kind)
    df = result.select(kind, "each")
    grid = result.grid(kind, "each")
    layers = sorted(df.layer.unique())
    pos = sorted(df.pos.unique())
    longest = [result.token_labels[p] for p in pos]
    n_al = len(result.token_labels)
    roles: dict[int, str] = {}
    unread = None  # why the role tokens could not be read, when they could not
    by_length = bool((df.n_pairs < len(result.pair_ids)).any())  # the length rule: columns mix when lengths differ
    if pairs is not None and tokenizer is not None:
        from tomlens.patching.roles import role_columns

        by_id = {p.id: p for p in pairs}
        try:
            roles, mixed = role_columns([by_id[i] for i in result.pair_ids if i in by_id], tokenizer, n_al)
        except TomlensError as e:  # e.g. a tokenizer without offsets, or a span no token covers
            unread, mixed = e.problem, by_length
    else:  # no role tokens to read: different lengths are taken to mean the columns mix roles
        mixed = by_length
    # Mixed: a column is a distance from the final token, not a role, and is labelled so (the longest
    # pair's token on hover), unless every pair has the same role mention there.
    labels = [f"{p - n_al + 1}" if p < n_al - 1 else "0 (final)" for p in pos] if mixed else longest
    labels = [f"{lab} {roles[p]}" if p in roles and p < n_al - 1 else lab for lab, p in zip(labels, pos, strict=True)]
    fig = go.Figure(
        go.Heatmap(
            z=grid, x=labels, y=[f"L{l}" for l in layers], customdata=[longest] * len(layers),
            hovertemplate="%{y} token %{x}<br>longest pair: %{customdata}<br>effect %{z:.3f}<extra></extra>",
            colorbar={"title": "effect"}, **_effect_scale(grid, result.direction),
        )
    )
    title = _title(result, f"{kind} by layer and position")
    if mixed:
        title += (subtitle("columns are right-aligned tokens (0 = final); the pairs differ in length,")
                  + subtitle("so a column mixes roles across pairs: see the role-aligned figure (<kind>_roles_...),")
                  + subtitle("or patch --positions mentions, for columns by role"))
    if unread is not None:  # said on the figure: which columns are roles was not checked
        title += subtitle(f"columns are right-aligned tokens: the role tokens could not be read ({unread}), "
                          "so no column is labelled with a role")
    fig.update_layout(
        title=title, xaxis_title="tokens before the final one" if mixed else "token",
        yaxis_title="layer", yaxis={"autorange": "reversed"}, xaxis={"tickangle": -60, "type": "category"},
        width=max(800, 14 * len(labels)),
    )
    return fig


def role_aligned_heatmap(result: PatchingResult, pairs: Any, tokenizer: Any, kind: str = "resid_pre") -> Any:
    """Layer x role mention for a per-position ("each") sweep re-read by role
    (`tomlens.patching.roles.role_aligned`): each column is one role mention at each pair's own token,
    the effect averaged over pairs (equal to patching those roles by name)."""
    from tomlens.patching.roles import role_aligned

    _go()  # plotly is there before the pairs are re-read
    kind = canonical_kind(kind)
    by_id = {p.id: p for p in pairs}
    table = role_aligned(result, [by_id[i] for i in result.pair_ids if i in by_id], tokenizer)
    df = table[table.kind == kind]
    if df.empty:
        raise TomlensError(f"the result has no {kind} cells at every position", "run the sweep with --positions each")
    return _layer_by_position(df, result, f"{kind} by layer and role (role-aligned: each pair's own token)",
                              "role mention")


def position_heatmap(result: PatchingResult, kind: str = "resid_pre") -> Any:
    """Layer x named position (final token, contrast, the question's mentions, role mentions such
    as "protagonist@2", ...) for a sweep at role positions rather than at every token: each column
    is one role, at each pair's own token."""
    kind = canonical_kind(kind)
    df = result.summary()
    df = df[(df.kind == kind) & ~df.position.isin(["all", "each"])]
    if df.empty:
        raise ValueError(f"the result has no {kind} cells at named positions")
    return _layer_by_position(df, result, f"{kind} by layer and position", "position")


def _layer_by_position(df: Any, result: PatchingResult, what: str, xaxis_title: str) -> Any:
    """Layer x position heatmap of `df`'s effects (rows: layer, position, effect), columns in the
    order the positions first occur."""
    go = _go()
    grid = df.pivot_table(index="layer", columns="position", values="effect", sort=False, dropna=False)
    grid = grid[list(dict.fromkeys(df.position))].sort_index()
    z = grid.to_numpy(dtype=float)
    fig = go.Figure(
        go.Heatmap(
            z=z, x=list(grid.columns), y=[f"L{l}" for l in grid.index],
            hovertemplate="%{y} at %{x}<br>effect %{z:.3f}<extra></extra>",
            colorbar={"title": "effect"}, **_effect_scale(z, result.direction),
        )
    )
    fig.update_layout(title=_title(result, what), xaxis_title=xaxis_title, yaxis_title="layer",
                      yaxis={"autorange": "reversed"}, xaxis={"type": "category"})
    return fig


def attribution_scatter(exact: PatchingResult, attribution: PatchingResult, stats: Mapping[str, Any],
                        position: str | None = None) -> Any:
    """One point per head: attribution estimate against exact effect, with the y = x line; `stats`
    is `tomlens.patching.compare` of the two (Spearman and top-k overlap, in the title)."""
    go = _go()
    position = position or exact.head_position()
    a = exact.select("head", position).set_index(["layer", "head"]).effect
    b = attribution.select("head", position).set_index(["layer", "head"]).effect
    j = a.to_frame("exact").join(b.to_frame("attribution"), how="inner").dropna()
    lo = float(min(j.exact.min(), j.attribution.min(), 0.0)) if len(j) else 0.0
    hi = float(max(j.exact.max(), j.attribution.max(), 1.0)) if len(j) else 1.0
    names = [f"L{l}H{h}" for l, h in j.index]
    fig = go.Figure(
        [
            go.Scatter(
                x=j.exact, y=j.attribution, mode="markers", text=names, name="heads",
                hovertemplate="%{text}<br>exact %{x:.3f}<br>attribution %{y:.3f}<extra></extra>",
            ),
            go.Scatter(x=[lo, hi], y=[lo, hi], mode="lines", name="y = x", line={"dash": "dash", "color": "grey"}),
        ]
    )
    fig.update_layout(
        title=(
            f"Attribution vs exact patching, heads at {position!r} ({exact.direction})"
            f"<br><sup>Spearman {stats['spearman']:.2f}"
            + (f" (over the {stats['n_active']} heads that matter {stats['spearman_active']:.2f})"
               if "spearman_active" in stats else "")
            + f", top-{stats['k']} overlap {stats['topk_overlap']:.2f}</sup>"
        ),
        xaxis_title="exact effect", yaxis_title="attribution estimate",
    )
    return fig


def recovery_curve(table: Any) -> Any:
    """Fraction of the logit difference recovered by the top-k heads against k random heads."""
    go = _go()
    k = list(table.k)
    fig = go.Figure(
        [
            go.Scatter(
                x=k + k[::-1], y=list(table.random_high) + list(table.random_low)[::-1], fill="toself",
                line={"width": 0}, fillcolor="rgba(150,150,150,0.3)", name="random 95% range", hoverinfo="skip",
            ),
            go.Scatter(x=k, y=table.random_mean, mode="lines+markers", name="random heads (mean)", line={"color": "grey"}),
            go.Scatter(
                x=k + k[::-1], y=list(table.top_ci_high) + list(table.top_ci_low)[::-1], fill="toself",
                line={"width": 0}, fillcolor="rgba(31,119,180,0.25)", name="top-k 95% CI", hoverinfo="skip",
            ),
            go.Scatter(
                x=k, y=table.top_effect, mode="lines+markers", name="top-k heads", text=list(table.heads),
                hovertemplate="k=%{x}: %{y:.3f}<br>%{text}<extra></extra>", line={"color": "rgb(31,119,180)"},
            ),
        ]
    )
    noising = "direction" in table and set(table["direction"]) == {"noise"}
    fig.update_layout(
        title="Top-k heads patched together: "
        + ("the clean run's logit difference left (noising; lower = heads matter more)" if noising
           else "fraction of the logit difference recovered (denoising)"),
        xaxis_title="k (heads patched)", yaxis_title="recovered (0 = corrupted, 1 = clean)",
    )
    return fig


def _stem(position: str) -> str:
    return re.sub(r"[^A-Za-z0-9_]+", "-", position)


def write_patching_figures(result: PatchingRunResult, out: str | Path) -> dict[str, Any]:
    """The run's figures as HTML under `out/figures/`: per-head heatmaps (`heads_<method>_<direction>`
    at the ranking position, `heads_<position>_...` at the others), per-layer heatmaps of the other
    sites (`<site>_...` over every token, `<site>_roles_...` the same re-read by role when the run's pairs
    carry role spans, `<site>_positions_...` at named positions), attribution
    against exact (`attribution_vs_exact_<direction>`) and the top-k recovery curve. Returns them by
    file stem (for a report). Needs the sweeps of the run itself (`load` does not restore them)."""
    if result.dry_run:
        raise TomlensError("a dry run has no results to draw", "run again without dry_run (--dry-run)")
    if result.summary.withheld:
        return {}  # the gate withheld every sweep: nothing to draw (the message says why)
    if not result.sweeps:
        raise TomlensError("this patching result holds no sweeps (a result read back with `load`)",
                           "draw the figures from the result `run` returns, or open the saved figures/")
    summary = result.summary
    spec = summary.positions or {}
    rank_position = summary.rank_position
    folder = Path(out) / "figures"
    figures: dict[str, Any] = {}
    pairs, tokenizer = getattr(result, "pairs", None), getattr(result, "tokenizer", None)
    has_roles = bool(pairs and tokenizer is not None and any(p.clean.spans or p.clean.mentions for p in pairs))

    def add(fig: Any, stem: str) -> None:
        if summary.forced:  # a run past a failed gate (--force): every figure says so
            fig.update_layout(title_text=FORCED_PREFIX + (fig.layout.title.text or ""))
        figures[stem] = fig
        write_figure(fig, folder / f"{stem}.html")

    for (m, d), res in result.sweeps.items():
        for p in spec.get("head", ()):
            if p != "each":
                add(head_heatmap(res, p), f"heads_{m}_{d}" if p == rank_position else f"heads_{_stem(p)}_{m}_{d}")
        for kind in summary.sites or ():
            if kind == "head":
                continue
            if "each" in spec[kind]:
                full = isinstance(res, PatchingResult)  # a search result has no full "each" grid per pair
                add(resid_heatmap(res, kind, pairs=pairs if full else None, tokenizer=tokenizer),
                    f"{kind}_{m}_{d}")
                if has_roles and full:
                    try:
                        add(role_aligned_heatmap(res, pairs, tokenizer, kind), f"{kind}_roles_{m}_{d}")
                    except TomlensError as e:  # e.g. a tokenizer without offsets: say so, draw the rest
                        say(f"role-aligned {kind} figure ({m}, {d}) not drawn: {e}")
            if any(p not in ("all", "each") for p in spec[kind]):
                add(position_heatmap(res, kind), f"{kind}_positions_{m}_{d}")
    for d in summary.directions or ():
        if ("exact", d) in result.sweeps and ("attribution", d) in result.sweeps and rank_position is not None:
            stats = result.compare(d, kind="head", position=rank_position)
            add(attribution_scatter(result.sweeps[("exact", d)], result.sweeps[("attribution", d)], stats,
                                    rank_position), f"attribution_vs_exact_{d}")
    if "topk" in result.tables:
        add(recovery_curve(result.tables["topk"]), "topk_recovery")
    return figures
