"""Per-position views aligned by role: `mentions` cells and `role_aligned` land on each pair's own token."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from patching_fakes import patching_summary

from tomlens.errors import TomlensError
from tomlens.models.positions import selector_span
from tomlens.patching import attribution_patching, exact_patching, prepare_pairs
from tomlens.patching.cells import plan_cells
from tomlens.patching.plan import expand_mentions, parse_positions
from tomlens.patching.roles import mention_selectors, role_aligned
from tomlens.stimuli.order_only import order_only
from tomlens.stimuli.pairs import MinimalPair, check_pairs
from tomlens.stimuli.records import find_mentions


def _with_mentions(s):
    m = s.meta
    words = {"protagonist": m["protagonist"], "other_agent": m["other_agent"], "object": m["object"],
             "location_1": m["location_1"], "location_2": m["location_2"]}
    return s.with_(mentions=find_mentions(s.text, words))


@pytest.fixture(scope="module")
def order_pairs(load_tiny):
    """Order-only belief prompts as pairs (false belief clean, true belief corrupted), with every
    mention of each role recorded; tasks differ in length, so right-aligned columns mix roles."""
    model = load_tiny("tiny-llama")
    stimuli = {s.id: _with_mentions(s) for s in order_only(n=6, seed=1) if s.prompt_type == "belief"}
    pairs = [MinimalPair(f"{s.task_id}-pair", s, stimuli[s.id.replace("-fb-", "-tb-")], "order-only", "true_belief")
             for s in stimuli.values() if s.condition == "false_belief"]
    aligned, _ = check_pairs(pairs, model.tokenizer)
    assert len(aligned) >= 4
    return model, aligned


def _decode(model, ids, col: int) -> str:
    return model.tokenizer.decode([int(ids[col])]).strip()


def test_mention_cells_point_at_each_pairs_own_role_word(order_pairs):
    model, pairs = order_pairs
    sels, notes = mention_selectors(pairs, model.tokenizer)
    assert sels[-1] == "final" and {"protagonist@1", "query_protagonist", "query_object"} <= set(sels)
    # the mentions inside the swapped sentences (leave / move) are at different tokens: left out, said so
    assert any(n.startswith("position 'location_2' left out: it is at different tokens") for n in notes)
    assert not any(s.startswith("location_2") for s in sels)
    # one token named twice (the question's object is also the object's last mention): patched once
    assert any("patched once, as 'query_object'" in n for n in notes) and "object@last" not in sels
    assert sels == mention_selectors(pairs)[0]  # the text-only check agrees with the tokenizer's
    prepared = prepare_pairs(model, pairs, selectors=sels[:-1])
    lengths = set(prepared.lengths)
    assert len(lengths) > 1  # pairs differ in length: a right-aligned column would mix roles
    mixed = False
    for grp in prepared.groups:
        for j, i in enumerate(grp.index):
            pair = pairs[i]
            for sel in sels[:-1]:
                col = int(grp.positions[sel][j])
                for story, row in ((pair.clean, j), (pair.corrupted, grp.g + j)):
                    word = selector_span(story, sel)[0].of(story.text)
                    tok = _decode(model, grp.batch.input_ids[row], col)
                    assert tok and word.endswith(tok), (pair.id, sel, word, tok)
            # the same right-aligned column holds different words in different pairs
            k = grp.width - int(grp.positions[sels[0]][j])
            if k < min(lengths):
                other = prepared.groups[-1]
                mixed |= _decode(model, other.batch.input_ids[other.g - 1], other.width - k) != _decode(
                    model, grp.batch.input_ids[j], grp.width - k)
    assert mixed


def test_mentions_keyword_expands_per_pair_set_and_refuses_unexpanded(order_pairs):
    model, pairs = order_pairs
    pos = parse_positions("resid=mentions,heads=mentions", ["head", "resid_pre"])
    assert pos.spec == {"head": ("mentions",), "resid_pre": ("mentions",)} and pos.selectors == []
    with pytest.raises(TomlensError, match="expand it first"):
        plan_cells(model, pos.spec, n_aligned=10)
    full = expand_mentions(pos, pairs, model.tokenizer)
    sels, notes = mention_selectors(pairs, model.tokenizer)
    assert full.spec == {"head": tuple(sels), "resid_pre": tuple(sels)} and full.notes == notes
    assert full.rank_position() == "final"
    mixed = expand_mentions(parse_positions("mentions,resid=each", ["resid_pre"]), pairs)
    assert mixed.spec["resid_pre"][-1] == "each" and "final" in mixed.spec["resid_pre"]


def test_role_aligned_each_run_equals_patching_the_roles_by_name(order_pairs):
    model, pairs = order_pairs
    sels, _ = mention_selectors(pairs, model.tokenizer)
    each = exact_patching(model, pairs, sites={"resid": ["each"]}, layers=[1], progress=False)
    named = exact_patching(model, pairs, sites={"resid": sels}, layers=[1], progress=False)
    want = named.summary().set_index("position")
    got = role_aligned(each, pairs, model.tokenizer).set_index("position")
    assert list(got.index) == sels == list(want.index)
    for col in ("effect", "se", "ci_low", "ci_high", "logit_diff"):
        np.testing.assert_allclose(got[col].to_numpy(float), want[col].to_numpy(float), atol=1e-4, err_msg=col)
    assert (got.n_pairs == len(pairs)).all()
    # from the per-pair table alone: the same means, an interval that holds the normaliser fixed
    table = role_aligned(each.per_pair(), pairs, model.tokenizer).set_index("position")
    np.testing.assert_allclose(table.effect.to_numpy(float), want.effect.to_numpy(float), atol=1e-4)
    assert set(table.interval) == {"bootstrap over pairs, normaliser fixed"}
    assert (table.ci_low <= table.effect + 1e-9).all() and (table.effect <= table.ci_high + 1e-9).all()
    # the effect moves with the role, not with the column: the per-pair values differ from "each" read
    # at one right-aligned column for at least one role
    per = each.per_pair()
    first = per[per.pos == int(per.pos.max())]  # the final column: the same role in every pair
    np.testing.assert_allclose(got.loc["final", "effect"], first.effect.mean(), atol=1e-6)
    with pytest.raises(TomlensError, match="not among `pairs`"):
        role_aligned(each, pairs[:1], model.tokenizer)
    # figures: role columns for the named run; the "each" view says its columns mix roles
    from tomlens.report.patching import position_heatmap, resid_heatmap

    assert list(position_heatmap(named, "resid").data[0].x) == sels
    fig = resid_heatmap(each, "resid")
    assert "mixes roles across pairs" in fig.layout.title.text and fig.data[0].x[-1] == "0 (final)"
    same = exact_patching(model, pairs[:1], sites={"resid": ["each"]}, layers=[1], progress=False)
    fig = resid_heatmap(same, "resid")  # one pair: columns are its tokens
    assert "mixes roles" not in fig.layout.title.text and fig.data[0].x[-1] == same.token_labels[-1]


def test_mixed_columns_are_read_from_role_tokens_and_the_run_draws_the_role_aligned_view(order_pairs, tmp_path):
    from tomlens.patching.roles import role_columns
    from tomlens.report.patching import resid_heatmap, role_aligned_heatmap, write_patching_figures
    from tomlens.runs.patching import PatchingConfig, PatchingRunResult

    model, pairs = order_pairs
    tok = model.tokenizer
    each = exact_patching(model, pairs, sites={"resid": ["each"]}, layers=[1], progress=False)
    n_al = len(each.token_labels)
    roles, mixed = role_columns(pairs, tok, n_al)
    assert mixed  # the role mentions sit at different right-aligned columns in different pairs
    # the same pair twice under two ids: equal lengths and equal role tokens, so no column mixes roles
    twin = MinimalPair(pairs[0].id + "-twin", pairs[0].clean, pairs[0].corrupted, pairs[0].family, pairs[0].contrast)
    roles1, mixed1 = role_columns([pairs[0], twin], tok, n_al)
    assert not mixed1 and roles1 and all("@" in r for r in roles1.values())
    # pairs of EQUAL length whose roles sit at different tokens: the old length check called them unmixed
    lengths = {}
    for p in pairs:
        lengths.setdefault(len(tok(p.clean.text)["input_ids"]), []).append(p)
    same_len = next((ps for ps in lengths.values() if len(ps) >= 2), None)
    if same_len is not None:
        n_same = len(tok(same_len[0].clean.text)["input_ids"])
        cols = [role_columns([q], tok, n_same)[0] for q in same_len]
        assert role_columns(same_len, tok, n_same)[1] == any(c != cols[0] for c in cols[1:])
    fig = resid_heatmap(each, "resid", pairs=pairs, tokenizer=tok)
    assert "mixes roles" in fig.layout.title.text and fig.data[0].x[-1] == "0 (final)"
    roles_fig = role_aligned_heatmap(each, pairs, tok, "resid")
    sels, _ = mention_selectors(pairs, tok)
    assert list(roles_fig.data[0].x) == sels and "role-aligned" in roles_fig.layout.title.text
    summary = patching_summary(positions={"resid_pre": ["each"]}, sites=("resid_pre",), directions=("denoise",))
    run_result = PatchingRunResult(PatchingConfig(sites=("resid",), positions=("each",)), summary,
                                   sweeps={("exact", "denoise"): each}, pairs=pairs, tokenizer=tok)
    figures = write_patching_figures(run_result, tmp_path)
    assert sorted(figures) == ["resid_pre_exact_denoise", "resid_pre_roles_exact_denoise"]
    np.testing.assert_allclose(np.asarray(figures["resid_pre_roles_exact_denoise"].data[0].z, float),
                               np.asarray(roles_fig.data[0].z, float))
    bare = PatchingRunResult(run_result.config, summary, sweeps=run_result.sweeps)  # no pairs: no role view
    assert sorted(write_patching_figures(bare, tmp_path / "bare")) == ["resid_pre_exact_denoise"]


def test_role_aligned_heads_by_attribution_equal_heads_at_the_named_roles(order_pairs):
    model, pairs = order_pairs
    sels, _ = mention_selectors(pairs, model.tokenizer)
    each = attribution_patching(model, pairs, sites={"heads": ["each"]}, progress=False)
    named = attribution_patching(model, pairs, sites={"heads": sels}, progress=False)
    want = named.summary().set_index(["layer", "head", "position"]).effect
    got = role_aligned(each, pairs, model.tokenizer).set_index(["layer", "head", "position"]).effect
    assert len(got) == model.cfg.n_layers * model.cfg.n_heads * len(sels)
    np.testing.assert_allclose(got.loc[want.index].to_numpy(float), want.to_numpy(float), atol=1e-4)
    assert torch.isfinite(torch.tensor(want.to_numpy(float))).all()


def _roleless(s):
    """The stimulus with no role mentions at all (no mentions, no word-role spans)."""
    from tomlens.models.positions import MENTION_ROLES

    return s.with_(mentions={}, spans={k: v for k, v in s.spans.items() if k not in MENTION_ROLES})


class _NoOffsets:
    """A tokenizer that gives no character offsets (a slow tokenizer): role tokens cannot be read."""

    is_fast = False

    def __init__(self, tok):
        self._tok = tok

    def __call__(self, *a, **k):
        return self._tok(*a, **k)


def test_each_view_falls_back_to_the_length_rule_without_role_tokens(order_pairs, tmp_path):
    from tomlens.patching.roles import role_columns
    from tomlens.report.patching import resid_heatmap

    model, pairs = order_pairs
    tok = model.tokenizer
    each = exact_patching(model, pairs, sites={"resid": ["each"]}, layers=[1], progress=False)
    n_al = len(each.token_labels)
    assert len({len(tok(p.clean.text)["input_ids"]) for p in pairs}) > 1  # the pairs differ in length
    # no pair has a role mention: nothing says the columns line up, and the lengths say they do not
    bare = [MinimalPair(p.id, _roleless(p.clean), _roleless(p.corrupted), p.family, p.contrast) for p in pairs]
    roles, mixed = role_columns(bare, tok, n_al)
    assert roles == {} and mixed
    fig = resid_heatmap(each, "resid", pairs=bare, tokenizer=tok)
    assert "mixes roles across pairs" in fig.layout.title.text and fig.data[0].x[-1] == "0 (final)"
    # equal lengths and no role mentions: the columns are the pair's tokens, unmixed
    assert role_columns(bare[:1], tok, len(tok(bare[0].clean.text)["input_ids"])) == ({}, False)


def test_each_view_is_drawn_when_role_tokens_cannot_be_read(order_pairs, tmp_path):
    from tomlens.report.patching import resid_heatmap, write_patching_figures
    from tomlens.runs.patching import PatchingConfig, PatchingRunResult

    model, pairs = order_pairs
    each = exact_patching(model, pairs, sites={"resid": ["each"]}, layers=[1], progress=False)
    # a tokenizer without offsets: the "each" figure is still drawn, by the length rule, and says so
    slow = _NoOffsets(model.tokenizer)
    fig = resid_heatmap(each, "resid", pairs=pairs, tokenizer=slow)
    assert "mixes roles across pairs" in fig.layout.title.text and "could not be read" in fig.layout.title.text
    summary = patching_summary(positions={"resid_pre": ["each"]}, sites=("resid_pre",), directions=("denoise",))
    run_result = PatchingRunResult(PatchingConfig(sites=("resid",), positions=("each",)), summary,
                                   sweeps={("exact", "denoise"): each}, pairs=pairs, tokenizer=slow)
    figures = write_patching_figures(run_result, tmp_path)  # the role-aligned view is skipped, not fatal
    assert sorted(figures) == ["resid_pre_exact_denoise"]
