"""Cue paraphrase pools, cue-held-out splits, decoys, matched conditions, plausible contents and
role mentions in the unexpected-transfer / unexpected-contents families (issue #10, item 1)."""

from __future__ import annotations

import re
from collections import Counter, defaultdict

import numpy as np
import pytest
from sklearn.feature_extraction.text import CountVectorizer
from sklearn.linear_model import LogisticRegression

from tomlens.errors import TomlensError
from tomlens.stimuli import lexicon
from tomlens.stimuli.false_belief import (
    EPISODE_POOLS,
    WORD_TOLERANCE,
    cue_holdout,
    mentions,
    unexpected_contents,
    unexpected_transfer,
)
from tomlens.stimuli.order_only import order_only
from tomlens.stimuli.records import Stimulus

GENERATORS = {"unexpected-transfer": unexpected_transfer, "unexpected-contents": unexpected_contents}
KINDS = {"unexpected-transfer": ("absence", "presence", "told"),
         "unexpected-contents": ("look", "told", "label")}


@pytest.fixture(scope="module")
def transfer() -> list[Stimulus]:
    return unexpected_transfer(32, seed=0)


@pytest.fixture(scope="module")
def contents() -> list[Stimulus]:
    return unexpected_contents(32, seed=0)


def _words(text: str) -> list[str]:
    return sorted(re.findall(r"\w+", text))


def _story(s: Stimulus) -> str:
    return s.text[: s.spans["query"].start]


def test_every_pool_has_at_least_eight_distinct_phrasings():
    assert {"absence", "presence", "told", "look"} <= set(lexicon.CUE_POOLS)
    for kind, pool in lexicon.CUE_POOLS.items():
        assert len(pool) == lexicon.CUE_GROUPS >= 8 and len(set(pool)) == len(pool), kind


@pytest.mark.parametrize("family", list(GENERATORS))
def test_cue_ids_name_the_phrasing_in_the_cue_span(family, transfer, contents):
    stims = transfer if family == "unexpected-transfer" else contents
    used = defaultdict(set)
    for s in stims:
        pool, index = s.meta["cue_id"].split(":")
        kind = {"leave": "absence"}.get(pool, pool)  # the protagonist leaving is an absence cue
        assert kind == s.meta["cue_kind"] in KINDS[family] and int(index) == s.meta["cue_group"]
        cue = s.span_text("cue")
        assert s.mentions["cue"] == (s.spans["cue"],)
        assert s.spans["contrast"].start <= s.spans["cue"].start < s.spans["cue"].end <= s.spans["contrast"].end
        # the span is the pool's phrasing with its slots filled (a label names its word last in the
        # odd cue groups, in both versions)
        pools = EPISODE_POOLS if pool in EPISODE_POOLS else lexicon.CUE_POOLS
        g = s.meta["cue_group"]
        if pool == "label":
            assert s.meta["label_last"] == (g % 2 == 1)
        phrasing = lexicon.label_sentence(g, s.meta["label_last"]) if pool == "label" else pools[pool][g]
        pattern = re.sub(r"\\\{\w+\\\}", r".+", re.escape(phrasing.rstrip(".")))
        assert re.fullmatch(pattern, cue), (s.id, cue)
        used[kind].add(s.meta["cue_group"])
    # 32 tasks = 4 blocks, each using every cue group once: every phrasing appears
    assert all(groups == set(range(lexicon.CUE_GROUPS)) for groups in used.values())
    per_group = Counter(s.meta["cue_group"] for s in stims)
    assert set(per_group.values()) == {len(stims) // lexicon.CUE_GROUPS}


@pytest.mark.parametrize("held_out", [0.25, 0.5, 0.75])
def test_cue_holdout_keeps_phrasings_and_tasks_apart(transfer, held_out):
    train, test = cue_holdout(transfer, held_out=held_out, seed=3)
    assert sorted(train + test) == list(range(len(transfer))) and train and test
    side = {i: "train" for i in train} | {i: "test" for i in test}
    by_task = defaultdict(set)
    for i, s in enumerate(transfer):
        by_task[s.task_id].add(side[i])
    assert all(len(sides) == 1 for sides in by_task.values())

    def phrasings(rows: list[int]) -> set[str]:
        out = set()
        for i in rows:
            out |= {transfer[i].meta["cue_id"], transfer[i].meta.get("decoy_cue_id", "")}
        return out - {""}

    assert not phrasings(train) & phrasings(test)
    groups = {transfer[i].meta["cue_group"] for i in test}
    assert len(groups) == round(held_out * lexicon.CUE_GROUPS)
    assert cue_holdout(transfer, held_out, seed=3) == (train, test)
    assert cue_holdout(transfer, held_out, seed=4) != (train, test)


def test_cue_holdout_refuses_what_it_cannot_split():
    with pytest.raises(TomlensError, match="cue group"):
        cue_holdout(order_only(2, seed=0))
    with pytest.raises(TomlensError, match="held_out"):
        cue_holdout(unexpected_transfer(2, seed=0), held_out=1.0)
    with pytest.raises(TomlensError, match="only 1 cue group"):
        cue_holdout(unexpected_transfer(1, seed=0))


@pytest.mark.parametrize("family", list(GENERATORS))
def test_with_decoys_every_condition_of_a_task_has_the_same_words(family, transfer, contents):
    """Decoys put every cue word in every condition: a bag of words sees nothing to decode."""
    stims = transfer if family == "unexpected-transfer" else contents
    cells = defaultdict(set)
    for s in stims:
        assert s.meta["decoy"] is True and "decoy_cue_id" in s.meta
        cells[(s.task_id, s.reversed, s.prompt_type)].add(tuple(_words(s.text)))
    assert cells and all(len(bags) == 1 for bags in cells.values())


def test_decoys_are_optional_and_balanced_in_both_conditions():
    none = unexpected_transfer(8, seed=1, decoys=False)
    assert not any(s.meta["decoy"] for s in none) and "nobody" in none[0].text
    assert all("decoy_cue_id" not in s.meta for s in none)
    half = unexpected_transfer(16, seed=1, decoys=0.5)
    for cond in ("false_belief", "present", "informed", "no_transfer"):
        rows = [s for s in half if s.condition == cond]
        assert Counter(s.meta["decoy"] for s in rows) == {True: len(rows) // 2, False: len(rows) // 2}
    # the decoy is the other cue with an object put back: presence words in false-belief stories
    fb = next(s for s in half if s.meta["decoy"] and s.condition == "false_belief")
    g = fb.meta["cue_group"]
    assert fb.meta["decoy_cue_id"] == f"presence:{g}"
    assert lexicon.CUE_POOLS["presence"][g].split(" {")[0] in _story(fb)
    with pytest.raises(TomlensError, match="decoys"):
        unexpected_transfer(2, decoys=1.5)
    with pytest.raises(TomlensError, match="decoys"):
        unexpected_contents(2, decoys="yes")


@pytest.mark.parametrize("family", list(GENERATORS))
@pytest.mark.parametrize("decoys", [True, False])
def test_conditions_of_a_task_match_in_sentences_words_and_mentions(family, decoys):
    """Sentence count and each answer word's mention count are equal across a task's conditions;
    word counts differ by at most WORD_TOLERANCE (3) words, and by none with decoys."""
    cells = defaultdict(list)
    for s in GENERATORS[family](16, seed=2, decoys=decoys):
        if s.prompt_type == "belief":
            cells[(s.task_id, s.reversed)].append(s)
    assert WORD_TOLERANCE == 3
    for key, group in cells.items():
        assert len(group) == 4
        stories = [_story(s) for s in group]
        assert len({len(re.split(r"(?<=\.) ", t.strip())) for t in stories}) == 1, key
        counts = [len(t.split()) for t in stories]
        assert max(counts) - min(counts) <= (0 if decoys else WORD_TOLERANCE), key
        assert len({tuple(sorted(Counter(mentions(t, s.options)).items()))
                    for s, t in zip(group, stories, strict=True)}) == 1, key


def test_contents_label_and_contents_come_in_that_container(contents):
    for s in contents:
        allowed = lexicon.CONTAINER_CONTENTS[s.meta["container"]]
        assert s.meta["label"] in allowed and s.meta["contents"] in allowed, s.id
        assert s.meta["container"] in s.span_text("contrast_label")
    assert ("packet", "grapes") not in {(c, w) for c, ws in lexicon.CONTAINER_CONTENTS.items() for w in ws}


STORY_ROLES = {
    "unexpected-transfer": ("protagonist", "other_agent", "object", "location_1", "location_2"),
    "unexpected-contents": ("protagonist", "other_agent", "container", "object", "location_1",
                            "location_2"),
    "order-only": ("protagonist", "other_agent", "object", "location_1", "location_2"),
}


@pytest.mark.parametrize("family", list(STORY_ROLES))
def test_every_role_has_every_mention(family, transfer, contents):
    stims = {"unexpected-transfer": transfer, "unexpected-contents": contents,
             "order-only": order_only(8, seed=0)}[family]
    for s in stims:
        query = s.spans["query"]
        asks_protagonist = re.search(rf"\b{s.span_text('protagonist')}\b", s.span_text("query"))
        for role in (*STORY_ROLES[family], "query_object", "cue",
                     *(("query_protagonist",) if asks_protagonist else ())):
            assert s.mentions.get(role), (s.id, role)
        for role in STORY_ROLES[family]:
            ms = s.mentions[role]
            word = s.span_text(role)
            assert ms[0] == s.spans[role] and all(m.of(s.text) == word for m in ms), (s.id, role)
            # every whole-word occurrence in the story, none in the prompt
            want = [m.start() for m in re.finditer(rf"(?<!\w){re.escape(word)}(?!\w)", s.text[: query.start])]
            assert [m.start for m in ms] == want, (s.id, role)
        for role in ("query_protagonist", "query_object"):
            assert all(query.start <= m.start and m.end <= query.end for m in s.mentions.get(role, ()))
        assert Stimulus.from_dict(s.to_dict()) == s


def _bag_of_words_accuracy(stims: list[Stimulus], seeds: int = 4) -> float:
    """Held-out accuracy of CountVectorizer + logistic regression predicting "the protagonist
    believes the object is where it started", trained on some cue phrasings and tested on the
    others (cue_holdout), averaged over `seeds` splits."""
    rows = [s for s in stims if s.prompt_type == "belief"]
    y = np.array([int(s.belief_is_reference) for s in rows])
    accs = []
    for seed in range(seeds):
        train, test = cue_holdout(rows, held_out=0.5, seed=seed)
        vec = CountVectorizer()
        X = vec.fit_transform([rows[i].text for i in train])
        model = LogisticRegression(max_iter=2000).fit(X, y[train])
        accs.append(float((model.predict(vec.transform([rows[i].text for i in test])) == y[test]).mean()))
    return float(np.mean(accs))


def test_bag_of_words_on_held_out_cues_is_at_chance_with_decoys():
    """Measured on 64 tasks, seed 0: before this change 0.96 (folds holding out the template,
    which then carried the cue words; 1.00 with a random half of the tasks held out), after it
    0.50 with decoys (every condition has the same words) and 0.71 without decoys."""
    stims = unexpected_transfer(64, seed=0)
    assert _bag_of_words_accuracy(stims) <= 0.6
    # without decoys the cue-held-out split still removes most of the signal, not all of it
    assert _bag_of_words_accuracy(unexpected_transfer(64, seed=0, decoys=False), seeds=1) <= 0.85


def test_contents_without_decoys_keeps_its_cue_groups_apart():
    """A closed-container cue is named by the task's cue group, not its template: with the template
    id, cue grouping joined every task of a template (16 tasks gave 1 group, fold splitting failed)."""
    from tomlens.probes.splits import group_codes, group_kfold

    st = unexpected_contents(16, seed=0, decoys=False)
    assert {s.meta["cue_id"].split(":")[1] for s in st if s.meta["cue_id"].startswith("closed:")} <= {
        str(g) for g in range(8)}
    codes = group_codes(st, "cue")
    assert len(set(codes.tolist())) == 8
    import torch

    group_kfold(codes, 5, seed=0)  # enough groups to fill the folds
    with pytest.raises(TomlensError) as err:  # one group: the advice never asks for 1 fold
        group_kfold(torch.zeros(len(st), dtype=torch.long), 2, seed=0)
    assert "or less" not in str(err.value) and "group by task" in str(err.value)


def test_tellings_reach_a_protagonist_who_is_away():
    """An informed protagonist is elsewhere ("at the shops"): every telling is a call, text, email,
    message or note, never a whisper or showing, in every condition (so no word marks informed)."""
    remote = re.compile(r"\b(phones|calls|texts|emails|messages|writes|note|message)\b")
    assert all(remote.search(p) for p in lexicon.CUE_POOLS["told"])
    for gen in (unexpected_transfer, unexpected_contents):
        informed = [s for s in gen(8, seed=0) if s.condition == "informed" and s.prompt_type == "belief"]
        assert informed
        for s in informed:
            assert remote.search(s.span_text("cue")), s.id
            assert not re.search(r"\b(whispers|shows|explains|mentions)\b", s.text), s.id
