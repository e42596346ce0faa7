"""Per-position patching read by role: which role mention each column is, in every pair.

Why: the "each" view indexes tokens right-aligned across pairs, so when pairs differ in length one
column holds the protagonist's name in one pair and a comma in another. Two ways to read positions
by role instead:

- patch at role mentions (`--positions mentions`, `mention_selectors`): one cell per role mention
  that every pair has ("protagonist@2", "cue", "query_object", ..., "final"), resolved in each pair
  to that pair's own token;
- re-read an existing "each" result by role (`role_aligned`): each pair's per-token effects are
  looked up at that pair's own token for every role mention, then averaged over pairs.

For a token-aligned pair a patch swaps one column in both runs, so a mention is only patchable where
it sits at the same token in the pair's two stories; mentions inside sentences whose order differs
between the stories (order-only pairs) are left out with a note. A role-aligned pair (a user's
stories worded differently) is patched from each story's own mention token, so none is left out.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd
import torch

from tomlens.errors import TomlensError
from tomlens.models.positions import FINAL, lacking, role_mentions, selector_span, split_selector, token_index
from tomlens.patching.cells import MENTIONS

__all__ = ["MENTIONS", "mention_selectors", "role_aligned", "role_columns"]


def _offsets(tokenizer: Any, text: str) -> list[tuple[int, int]]:
    """Character offsets of each token of `text`, with the tokenizer's own special tokens (as
    `tomlens.models.tokens.encode` tokenises)."""
    if not getattr(tokenizer, "is_fast", False):
        raise TomlensError(f"the tokenizer ({type(tokenizer).__name__}) gives no character offsets",
                           "use a fast (Rust) tokenizer: roles are found through offsets")
    enc = tokenizer(text, return_offsets_mapping=True, padding=False, truncation=False)
    return [(int(a), int(b)) for a, b in enc["offset_mapping"]]


def _candidates(stories: Sequence[Any]) -> list[str]:
    """Role-mention selectors every story has: `role` when every story mentions the role once,
    `role@1..@n` when all mention it n times, else `role@1..@(m-1)` and `role@last` (m = fewest)."""
    counts: dict[str, list[int]] = {}
    for s in stories:
        per: dict[str, int] = {}
        for sel, _ in role_mentions(s):
            role = sel.rpartition("@")[0]
            per[role] = per.get(role, 0) + 1
        for role, n in per.items():
            counts.setdefault(role, []).append(n)
    out: list[str] = []
    for role, ns in counts.items():
        if len(ns) < len(stories):
            continue  # some story never mentions it
        if len(set(ns)) == 1:
            out.extend([role] if ns[0] == 1 else [f"{role}@{k}" for k in range(1, ns[0] + 1)])
        else:
            m = min(ns)
            out.extend([f"{role}@{k}" for k in range(1, max(m - 1, 1) + 1)] + [f"{role}@last"])
    missing = lacking(stories, out)
    return [sel for sel in out if sel not in missing]


def _same_token(clean: Any, corrupted: Any, sel: str, tokenizer: Any = None) -> bool:
    """Whether `sel` is the same token in a pair's two stories (exactly, with a tokenizer; else
    from the text: the same text before the token's word, or after it)."""
    if tokenizer is not None:
        return token_index(clean, _offsets(tokenizer, clean.text), sel) == token_index(
            corrupted, _offsets(tokenizer, corrupted.text), sel)
    (a, first), (b, _) = selector_span(clean, sel), selector_span(corrupted, sel)
    c, r = clean.text, corrupted.text
    if first:
        return c[: a.start] == r[: b.start] or c[a.start :] == r[b.start :]
    return c[a.end :] == r[b.end :] or c[: a.end] == r[: b.end]


def mention_selectors(pairs: Sequence[Any], tokenizer: Any = None) -> tuple[list[str], list[str]]:
    """(selectors, notes): one selector per role mention shared by every story of every pair, in
    the order the mentions occur in the first pair's clean story, then `final`. A mention at
    different tokens in a pair's two stories is left out with a note (a patch swaps one column in
    both runs). With `tokenizer` the token check is exact; without it, it is read from the text."""
    pairs = list(pairs)
    if not pairs:
        raise TomlensError("no pairs to find role mentions in", "pass the pairs being patched")
    stories = [s for p in pairs for s in (p.clean, p.corrupted)]
    notes: list[str] = []
    if not any(s.mentions for s in stories):
        notes.append("the stories record no `mentions`: only first mentions (their spans) are used; "
                     "regenerate them with a tomlens that fills mentions for every mention")
    keep = []
    # a role-aligned pair (stories worded differently) is patched from each story's own token; a
    # token-aligned pair swaps one column in both runs, so its mentions must sit at the same token
    fixed = [p for p in pairs if getattr(p, "alignment", "tokens") != "roles"]
    for sel in _candidates(stories):
        moved = sum(not _same_token(p.clean, p.corrupted, sel, tokenizer) for p in fixed)
        if moved:
            notes.append(f"position {sel!r} left out: it is at different tokens in the two stories of {moved} "
                         f"of {len(pairs)} token-aligned pairs (such a patch swaps one column in both runs)")
        else:
            keep.append(sel)
    # two names for one token in every story (object@4 and query_object): patch it once, by its
    # plainer name (the role itself rather than a mention count)
    by_token: dict[tuple, str] = {}
    for sel in sorted(keep, key=lambda x: ("@" in x, keep.index(x))):
        key = tuple((selector_span(s, sel)[0], selector_span(s, sel)[1]) for s in stories)
        if key in by_token:
            notes.append(f"position {sel!r} is {by_token[key]!r} in every story: patched once, as {by_token[key]!r}")
        else:
            by_token[key] = sel
    keep = [sel for sel in keep if sel in by_token.values()]
    first = pairs[0].clean
    keep.sort(key=lambda sel: (selector_span(first, sel)[0].start, sel))
    return [*keep, FINAL], notes


def role_columns(pairs: Sequence[Any], tokenizer: Any, n_aligned: int) -> tuple[dict[int, str], bool]:
    """Which right-aligned columns of an "each" sweep are a role: ({column: role mentions every pair has
    at that token, e.g. "protagonist@1"}, mixed). `mixed` is True when some role mention sits at
    different columns in different pairs (or only some pairs have it), so a column read across pairs
    mixes roles; decided from each pair's own role token indices, not from the pairs' lengths. Where no
    pair has a role mention there are no role tokens to read, so pairs of different lengths are taken to
    mix roles (the length rule) rather than called unmixed."""
    per_col: dict[int, list[set[str]]] = {}
    pairs = list(pairs)
    lengths: set[int] = set()
    for p in pairs:
        offsets = _offsets(tokenizer, p.clean.text)
        lengths.add(len(offsets))
        shift = n_aligned - len(offsets)
        here: dict[int, set[str]] = {}
        for sel, _ in role_mentions(p.clean):
            here.setdefault(token_index(p.clean, offsets, sel) + shift, set()).add(sel)
        for col, names in here.items():
            per_col.setdefault(col, []).append(names)
    roles: dict[int, str] = {}
    mixed = False
    for col, sets in sorted(per_col.items()):
        common = set.intersection(*sets) if len(sets) == len(pairs) else set()
        mixed |= set.union(*sets) != common
        if common:
            roles[col] = "/".join(sorted(common))
    if not per_col:  # no role mentions in any pair: only the lengths say whether columns line up
        mixed = len(lengths) > 1
    return roles, mixed


def _each_rows(per_pair_table: pd.DataFrame | Any) -> tuple[Any, pd.DataFrame]:
    """(the `PatchingResult` or None, its per-pair rows at position "each"), refused where the
    table is not a per-pair table of an "each" sweep."""
    from tomlens.patching.result import PatchingResult

    result = per_pair_table if isinstance(per_pair_table, PatchingResult) else None
    table = result.per_pair() if result is not None else per_pair_table
    need = {"kind", "layer", "head", "position", "pos", "pair_id", "logit_diff", "effect"}
    if not need <= set(table.columns):
        raise TomlensError(f"the table lacks columns {sorted(need - set(table.columns))}",
                           "pass PatchingResult.per_pair() of a sweep at position 'each'")
    each = table[table.position == "each"]
    if each.empty:
        raise TomlensError("the result has no cells at position 'each'",
                           "re-read a per-position sweep (--positions each, or resid's default)")
    return result, each


def _aligned_positions(
    ids: Sequence[Any], pairs: Sequence[Any], tokenizer: Any, selectors: Sequence[str], n_aligned: int
) -> dict[tuple[Any, str], int]:
    """The aligned index of every (pair, selector): the pair's own token, right-aligned as "each"
    indexes it."""
    by_id = {p.id: p for p in pairs}
    unknown = [i for i in ids if i not in by_id]
    if unknown:
        raise TomlensError(f"{len(unknown)} pair(s) of the result are not among `pairs` (e.g. {unknown[0]!r})",
                           "pass the pairs the sweep was run on")
    aligned: dict[tuple[Any, str], int] = {}
    for pid in ids:
        clean = by_id[pid].clean
        offsets = _offsets(tokenizer, clean.text)
        shift = n_aligned - len(offsets)
        if shift < 0:
            raise TomlensError(f"pair {pid!r} has {len(offsets)} tokens, more than the result's {n_aligned} positions",
                               "pass the tokenizer of the model the sweep was run with")
        for sel in selectors:
            t = len(offsets) - 1 if sel == FINAL else token_index(clean, offsets, sel)
            aligned[(pid, sel)] = t + shift
    return aligned


def _by_role(
    each: pd.DataFrame, ids: Sequence[Any], selectors: Sequence[str], aligned: dict[tuple[Any, str], int]
) -> tuple[pd.DataFrame, np.ndarray, np.ndarray]:
    """(one row per (kind, layer, head, selector), per-pair effects, per-pair logit differences),
    the arrays `[row, pair]` read at each pair's own token (NaN where the pair has none)."""
    keys = ["kind", "layer", "head"]
    units = each[keys].drop_duplicates().itertuples(index=False, name=None)
    lookup_raw = each.set_index([*keys, "pos", "pair_id"])["logit_diff"]
    lookup_eff = each.set_index([*keys, "pos", "pair_id"])["effect"]
    rows, raw_rows = [], []
    for unit in units:
        for sel in selectors:
            idx = [(*unit, aligned[(pid, sel)], pid) for pid in ids]
            rows.append((*unit, sel, lookup_eff.reindex(idx).to_numpy(dtype=float)))
            raw_rows.append(lookup_raw.reindex(idx).to_numpy(dtype=float))
    eff = np.stack([r[-1] for r in rows]) if rows else np.empty((0, len(ids)))
    raw = np.stack(raw_rows) if raw_rows else np.empty((0, len(ids)))
    return pd.DataFrame([r[:-1] for r in rows], columns=[*keys, "position"]), eff, raw


def role_aligned(
    per_pair_table: pd.DataFrame | Any,
    pairs: Sequence[Any],
    tokenizer: Any,
    selectors: Sequence[str] | None = None,
    *,
    n_boot: int = 1000,
    seed: int = 0,
) -> pd.DataFrame:
    """An "each" result re-read by role: one row per (kind, layer, head, role mention) with the
    mean effect over pairs at each pair's own token, its standard error and 95% interval.

    `per_pair_table`: `PatchingResult.per_pair()` of a sweep with position "each", or the
    `PatchingResult` itself (then the interval is `summarise`'s, gap uncertainty included, and
    equals a run patched at those selectors by name; from the table alone it is a percentile
    bootstrap over pairs of the per-pair effects, the normaliser held fixed: column `interval`
    says which). `selectors`: the role mentions (default `mention_selectors(pairs, tokenizer)`).
    Columns: kind, layer, head, position (the selector), effect, se, ci_low, ci_high, n_pairs,
    logit_diff, interval."""
    from tomlens.patching.metric import summarise

    result, each = _each_rows(per_pair_table)
    pairs = list(pairs)
    if selectors is None:
        selectors, _ = mention_selectors(pairs, tokenizer)
    selectors = list(selectors)
    for sel in selectors:
        split_selector(sel)
    ids = list(dict.fromkeys(each.pair_id))
    aligned = _aligned_positions(ids, pairs, tokenizer, selectors, int(each.pos.max()) + 1)
    out, eff, raw = _by_role(each, ids, selectors, aligned)
    if result is not None:
        order = [result.pair_ids.index(pid) for pid in ids]
        s = summarise(torch.from_numpy(raw), result.clean.double()[order], result.corrupted.double()[order],
                      normalise=result.normalise, n_boot=n_boot, seed=seed)
        mean, se, lo, hi, n = s.mean, s.se, s.ci_low, s.ci_high, s.n
        interval = "bootstrap over pairs, gap included"
    else:
        mean, se, lo, hi, n = _bootstrap(eff, n_boot, seed)
        interval = "bootstrap over pairs, normaliser fixed"
    out["effect"], out["se"], out["ci_low"], out["ci_high"], out["n_pairs"] = mean, se, lo, hi, n
    with np.errstate(all="ignore"):
        out["logit_diff"] = np.nanmean(raw, axis=1) if len(raw) else []
    out["interval"] = interval
    return out


def _bootstrap(eff: np.ndarray, n_boot: int, seed: int) -> tuple[np.ndarray, ...]:
    """Mean, SE and percentile-bootstrap 95% interval over pairs of per-pair effects [cell, pair]."""
    have = ~np.isnan(eff)
    n = have.sum(1)
    with np.errstate(all="ignore"):
        mean = np.where(n > 0, np.nansum(eff, 1) / np.maximum(n, 1), np.nan)
        se = np.where(n > 1, np.nanstd(eff, 1, ddof=1) / np.sqrt(np.maximum(n, 1)), np.nan)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, eff.shape[1], (n_boot, eff.shape[1])) if eff.shape[1] else np.empty((n_boot, 0), int)
    lo, hi = np.full(len(eff), np.nan), np.full(len(eff), np.nan)
    for i, row in enumerate(eff):
        if n[i] == 0:
            continue
        sample = row[idx]
        with np.errstate(all="ignore"):
            boots = np.nanmean(np.where(np.isnan(sample), np.nan, sample), 1)
        boots = boots[~np.isnan(boots)]
        if boots.size:
            lo[i], hi[i] = np.quantile(boots, [0.025, 0.975])
    return mean, se, lo, hi, n
