"""Role-aligned pairs: a user's false- and true-belief stories worded differently (different lengths,
different word order) are patched from the clean story's role token into the corrupted story's
role token, and every number equals one unbatched forward per cell with a hook doing exactly that."""

from __future__ import annotations

import pytest
import torch
from helpers import tl_metric

from tomlens.errors import TomlensError
from tomlens.models import encode
from tomlens.models.positions import host_positions
from tomlens.patching.cells import hook_for
from tomlens.patching.exact import exact_patching
from tomlens.patching.pairs import prepare_pairs
from tomlens.stimuli.pairs import MinimalPair, check_pairs
from tomlens.stimuli.records import Span, Stimulus

pytestmark = pytest.mark.integration

NAMES = ("Anna", "Ben", "Cara")


def _story(i: int, condition: str, middle: str, answer: str) -> Stimulus:
    name, obj = NAMES[i], ("key", "coin", "cup")[i]
    head = f"{name} put the {obj} in the box. "
    middle = middle.format(name=name, obj=obj)
    query = f" {name} will look for the {obj} in the"
    text = head + middle + query
    q = len(head) + len(middle) + 1
    return Stimulus(id=f"s{i}-{condition}", text=text, options=("box", "bag"), answer=answer, condition=condition,
                    task_id=f"s{i}", spans={"protagonist": Span(0, len(name)), "query": Span(q, len(text)),
                                            "query_protagonist": Span(q, q + len(name)),
                                            "query_object": Span(q + len(f"{name} will look for the "),
                                                                 q + len(f"{name} will look for the {obj}"))})


def role_pairs(n: int = 3, alignment: str = "roles") -> list[MinimalPair]:
    """False belief ("While she was out, Tom moved ...") vs true belief ("She watched Tom move ..."):
    the second is shorter and puts the protagonist first."""
    out = []
    for i in range(n):
        clean = _story(i, "false_belief", "While {name} was out of the room, Tom moved the {obj} to the bag.", "box")
        corrupted = _story(i, "true_belief", "{name} watched Tom move the {obj} to the bag.", "box")
        out.append(MinimalPair(f"s{i}-true_belief", clean, corrupted, "user", "true_belief", alignment=alignment))
    return out


def _token(model, story: Stimulus, selector: str) -> int:
    batch = encode(model, [story.text])
    return host_positions([story], batch, [selector])[0][0] - batch.pad[0]


def _by_hand(model, pair: MinimalPair, hook: str, head: int | None, selector: str, direction: str) -> float:
    """One unpadded forward of the base story with the source story's activation at its own token."""
    base, source = (pair.corrupted, pair.clean) if direction == "denoise" else (pair.clean, pair.corrupted)
    src_ids, base_ids = (encode(model, [s.text]).input_ids for s in (source, base))
    t_src, t_base = _token(model, source, selector), _token(model, base, selector)
    with torch.inference_mode():
        _, cache = model.run_with_cache(src_ids, names_filter=lambda n: n == hook)
        value = cache[hook][0, t_src].clone()

        def put(act, hook=None):
            act = act.clone()
            if head is None:
                act[0, t_base] = value
            else:
                act[0, t_base, head] = value[head]
            return act

        logits = model.run_with_hooks(base_ids, fwd_hooks=[(hook, put)])
    return float(tl_metric(model, pair)(logits))


def test_role_aligned_pairs_differ_in_length_and_keep_their_role_tokens(load_tiny):
    model = load_tiny("tiny-llama")
    pairs = role_pairs()
    kept, report = check_pairs(pairs, model.tokenizer)
    assert len(kept) == 3, report.summary()
    prepared = prepare_pairs(model, kept, selectors=("protagonist", "query_protagonist", "final"), batch_pairs=3)
    group = prepared.groups[0]
    # left-padded: the shared question ends both stories, so it sits at the same columns; the first
    # mention sits after each story's own padding
    assert group.unequal == [True] * 3 and group.corrupted_cols is not None
    assert group.corrupted_cols["query_protagonist"] == group.position_cols["query_protagonist"]
    assert group.corrupted_cols["protagonist"] != group.position_cols["protagonist"]
    for j in range(group.g):  # each story's own token, not the clean story's column
        for sel in ("protagonist", "query_protagonist", "final"):
            story_c, story_k = prepared.pairs[group.index[j]].clean, prepared.pairs[group.index[j]].corrupted
            assert group.column(sel, j) - group.pad(j) == _token(model, story_c, sel)
            assert group.column(sel, group.g + j) - group.pad(group.g + j) == _token(model, story_k, sel)


@pytest.mark.parametrize("direction", ["denoise", "noise"])
def test_role_aligned_patching_equals_one_forward_per_cell_by_hand(load_tiny, direction):
    model = load_tiny("tiny-llama")
    pairs = role_pairs()
    sites = {"heads": ["query_protagonist", "final"], "resid": ["query_object", "protagonist"]}
    res = exact_patching(model, pairs, sites=sites, direction=direction, batch_pairs=2, progress=False)
    cells = res.cell_frame()
    L, H = model.cfg.n_layers, model.cfg.n_heads
    checked = 0
    for j, pair in enumerate(res.pair_ids):
        p = next(x for x in pairs if x.id == pair)
        for i, c in enumerate(cells.itertuples()):
            if (c.layer + c.head + j) % 3:  # a third of the cells, every kind and position, keeps it quick
                continue
            kind = "head" if c.kind == "head" else c.kind
            want = _by_hand(model, p, hook_for(kind, c.layer), c.head if c.head >= 0 else None, c.position, direction)
            assert float(res.values[i, j]) == pytest.approx(want, abs=1e-4), (c, pair)
            checked += 1
    assert checked >= L * H // 2
    # the clean and corrupted baselines are each story's own unpatched run
    assert not torch.allclose(res.clean, res.corrupted)


def test_role_aligned_pairs_refuse_column_positions_and_attribution(load_tiny):
    from tomlens.patching.attribution import attribution_patching

    model = load_tiny("tiny-llama")
    pairs = role_pairs(2)
    with pytest.raises(TomlensError, match="role-aligned"):
        exact_patching(model, pairs, sites={"heads": ["all"]}, progress=False)
    with pytest.raises(TomlensError, match="token-aligned pairs"):
        attribution_patching(model, pairs, sites=["heads"], positions=["final"], progress=False)


def test_token_aligned_pairs_of_different_lengths_are_still_refused(load_tiny):
    model = load_tiny("tiny-llama")
    pairs = role_pairs(2, alignment="tokens")
    kept, report = check_pairs(pairs, model.tokenizer)
    assert not kept and {r.split(":")[0] for _, r in report.dropped_pairs} <= {"outside_contrast", "missing_span"}
    with pytest.raises(TomlensError, match="not aligned"):
        prepare_pairs(model, pairs, selectors=("final",))


def test_a_role_aligned_pair_round_trips_through_a_pairs_file(tmp_path):
    from tomlens.stimuli.pairs import read_pairs, write_pairs

    pairs = role_pairs(2)
    path = write_pairs(pairs, tmp_path / "pairs.jsonl")
    back = read_pairs(path)
    assert [p.alignment for p in back] == ["roles", "roles"] and back == pairs
    with pytest.raises(TomlensError, match="alignment"):
        MinimalPair("x", pairs[0].clean, pairs[0].corrupted, "user", "true_belief", alignment="words")


def test_mean_ablation_runs_on_pairs_whose_corrupted_story_is_the_longer(load_tiny):
    """Right-aligned positions span the longest story of either kind: the true-belief versions here
    are longer than their false-belief ones, and ablating every position takes each head's mean at
    each right-aligned position of every story."""
    from tomlens.patching.heads import mean_ablation

    model = load_tiny("tiny-llama")
    pairs = []
    for i, p in enumerate(role_pairs(2)):
        longer = _story(i, "true_belief", "{name} watched, from across the whole big room, as Tom moved the {obj} "
                                          "to the bag.", "box")
        pairs.append(MinimalPair(p.id, p.clean, longer, "user", "true_belief", alignment="roles"))
    prepared = prepare_pairs(model, pairs, selectors=("final",), batch_pairs=2)
    assert prepared.n_aligned == max(prepared.groups[0].batch.lengths)
    for mode in ("final", "all"):
        ablation = mean_ablation(model, prepared, [(0, 0), (1, 1)], ks=[1, 2], n_random=2, mode=mode, progress=False)
        assert len(ablation.table) == 2 and ablation.table.fb_accuracy.notna().all()


def test_declared_role_pairs_of_equal_token_counts_are_patched_by_role_only(load_tiny):
    """Stories with the same number of tokens but words in another order: column k is not one token
    in both, so "all" and "each" and attribution are refused on the pair's declaration, not its length."""
    from tomlens.patching.attribution import attribution_patching
    from tomlens.patching.roles import mention_selectors

    model = load_tiny("tiny-llama")
    pairs = []
    for i, p in enumerate(role_pairs(2)):
        moved = _story(i, "true_belief", "Tom moved the {obj} to the bag while {name} was out of the room.", "box")
        pairs.append(MinimalPair(p.id, p.clean, moved, "user", "true_belief", alignment="roles"))
    with pytest.raises(TomlensError, match="role-aligned"):
        exact_patching(model, pairs, sites={"resid": ["each"]}, layers=[0], progress=False)
    with pytest.raises(TomlensError, match="token-aligned pairs"):
        attribution_patching(model, pairs, sites=["heads"], positions=["final"], progress=False)
    # mentions: each story's own token, so a mention after the stories part ways is kept
    kept, notes = mention_selectors(pairs, model.tokenizer)
    assert "query_protagonist" in kept and not any("left out" in n for n in notes)


def test_role_pairs_that_ask_different_questions_are_dropped_with_the_reason():
    """The metric reads the final token: two versions asking different questions (even ending in the
    same words, and with no query span given) are not one measurement."""
    clean = Stimulus(id="a-fb", text="Anna hid the key. Where will Anna look? In the", options=("box", "bag"),
                     answer="box", condition="false_belief", task_id="a")
    other = Stimulus(id="a-tb", text="Anna saw the move. Where will Ben look? In the", options=("box", "bag"),
                     answer="bag", condition="true_belief", task_id="a")
    pair = MinimalPair("a-true_belief", clean, other, "user", "true_belief", alignment="roles")
    kept, report = check_pairs([pair])
    assert not kept and report.dropped_pairs[0][1].startswith("query: the two stories ask different questions")
    same = MinimalPair("a-true_belief", clean, other.with_(text="Anna saw the move. Where will Anna look? In the"),
                       "user", "true_belief", alignment="roles")
    assert check_pairs([same])[0] == [same]
