"""Higher-order statements after Street et al. (motomqa): design, labels, scoring, probes, pairs."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pandas as pd
import pytest
import torch

from tomlens.behaviour.batteries import BATTERIES
from tomlens.behaviour.motomqa import (
    ALWAYS_TRUE_SHARE,
    CASE_VARIANTS,
    PAPER_COLUMNS,
    add_pooled,
    binomial_vs_chance,
    cochran_q,
    mcnemar,
    pooled_p_true,
    pooled_scores,
    subject_tests,
    summary,
    two_proportion_z,
)
from tomlens.errors import TomlensError
from tomlens.stimuli import generate, stimuli_hash
from tomlens.stimuli.motomqa import (
    ANSWER_STEMS,
    CONDITIONS,
    CONTRASTS,
    HUMAN_INTRO,
    LEVELS,
    MIN_BELIEVERS,
    ORDERS,
    QUESTIONS,
    RULES,
    SHORTCUTS,
    VERBS,
    belief_table,
    events_from_meta,
    minimal_pairs,
    motomqa,
    stimulus_shortcut_true,
)
from tomlens.stimuli.pairs import make_pairs, structural_problem


@pytest.fixture(scope="module")
def stims():
    return motomqa(10, 3)


def test_deterministic_registered_and_counted(stims):
    first = generate("motomqa", n=2, seed=3)  # a story depends on (seed, index) only
    assert first == stims[: len(first)] and stimuli_hash(first) == stimuli_hash(motomqa(2, 3))
    assert stimuli_hash(first) != stimuli_hash(motomqa(2, 4))
    assert len(stims) == 10 * (2 * len(ORDERS) + 2 * len(LEVELS)) * len(CONDITIONS)
    assert len({s.id for s in stims}) == len(stims)
    assert len(motomqa(2, 0, conditions="simplified/false-first", orders=(2, 6), levels=(3,))) == 2 * 6


def test_true_and_false_balanced_per_order_level_and_condition(stims):
    cells = Counter((s.task_id, s.meta["stmt_type"], s.meta["order_or_level"], s.condition, s.answer)
                    for s in stims)
    assert set(cells.values()) == {1}  # one true and one false per story x order/level x condition
    assert len(cells) == 10 * 10 * 4 * 2
    for cond in CONDITIONS:  # conditions fully crossed, options in the question's order
        rows = [s for s in stims if s.condition == cond]
        assert len(rows) == len(stims) // 4
        style, order = cond.split("/")
        first = "true" if order == "true-first" else "false"
        assert all(s.options[0] == first and set(s.options) == {"true", "false"} for s in rows)
        assert all(s.meta["prompt_style"] == style and s.meta["options_order"] == order for s in rows)
    # ToM truth does not follow the world: both world values occur with both answers at every order
    for order in ORDERS:
        combos = Counter((s.world_state, s.answer) for s in stims
                         if s.meta["stmt_type"] == "tom" and s.meta["order"] == order)
        assert len(combos) == 4, (order, combos)
    # names, topics and character counts vary
    assert len({n for s in stims for n in s.meta["characters"]}) >= 15
    assert {s.meta["n_characters"] for s in stims} == {5}  # the fewest that defeat every shortcut
    assert len({s.meta["topic"] for s in stims}) == 5


def _ref_belief(chain, events):
    """Independent recursive definition: the last value an event perceived by the whole chain gave
    its innermost believer (a look copies what the chain minus its innermost believer held)."""
    if not chain:
        vals = [e.location for e in events if e.kind in ("place", "move")]
        return vals[-1] if vals else None
    value = None
    for i, e in enumerate(events):
        if not set(chain) <= e.perceivers:
            continue
        if e.kind in ("place", "move", "tell"):
            value = e.location
        elif e.kind == "look" and e.agent == chain[-1]:
            value = e.location if e.location is not None else _ref_belief(chain[:-1], events[: i + 1])
    return value


def _ref_fact(s, atom):
    kind, *args = atom
    events = s.meta["events"]
    if kind == "organised":
        return args[0] == s.meta["organiser"]
    if kind == "relation":
        return s.meta["relations"].get(args[0]) == args[1]
    if kind == "at_1":
        return args[0] in events[0][2]
    if kind == "at_2":
        return args[0] in events[1][2] and len(events[1][2]) > 1
    if kind == "told":
        return [args[0], args[1]] in s.meta["tellings"]
    if kind == "checked":
        return any(e[0] == "look" and e[3] == args[0] for e in events)
    if kind == "cue":
        return [int(args[1]), args[0]] in s.meta["cues"]
    raise AssertionError(kind)


def test_labels_rederived_independently(stims):
    n_tom = n_fact = 0
    for s in stims:
        events = events_from_meta(s.meta["events"])
        if s.meta["stmt_type"] == "tom":
            chain = tuple(s.meta["chain"])
            assert len(chain) == s.meta["order"] - 1 and all(a != b for a, b in zip(chain, chain[1:], strict=False))
            assert (_ref_belief(chain, events) == s.meta["claim_value"]) == (s.answer == "true")
            assert (_ref_belief((), events) == s.meta["claim_value"]) == (s.world_state == "true")
            n_tom += 1
        else:
            props = s.meta["propositions"]
            assert len(props) == s.meta["level"] and len({tuple(p["atom"]) for p in props}) == len(props)
            truths = [_ref_fact(s, p["atom"]) for p in props]
            assert truths == [p["true"] for p in props]
            assert all(truths) == (s.answer == "true")
            assert sum(not t for t in truths) == (0 if s.answer == "true" else 1)
            for p in props:
                assert p["text"] in s.meta["statement"]
            n_fact += 1
        # the family's belief-like label is the literal truth of a ToM statement; a fact has none
        assert s.protagonist_belief == (s.answer if s.meta["stmt_type"] == "tom" else None)
        assert s.meta["statement_literal_true"] == (s.answer == "true")
    assert n_tom == n_fact == len(stims) // 2


def test_story_text_states_the_events(stims):
    for s in stims[:: 4 * 20]:  # one prompt per story
        story = s.span_text("story")
        ev = s.meta["events"]
        assert 130 <= s.meta["word_count"] <= 260 and s.meta["n_characters"] == 5
        for name in s.meta["characters"]:
            assert name in story
        absent = [n for n in s.meta["characters"] if n not in ev[0][2]]
        if absent:
            assert "not there." in story
        for teller, hearer in s.meta["tellings"]:
            assert f"{teller} told {hearer}" in story
        for value in s.meta["values"]:
            assert value in story
        events = events_from_meta(ev)
        world = _ref_belief((), events)
        # the characters disagree (else every order is settled by the first-order belief)
        assert {_ref_belief((n,), events) for n in s.meta["characters"]} - {None} == set(s.meta["values"])
        for i, e in enumerate(events):  # hearsay of the old plan never reaches someone who knew better
            if e.kind == "tell" and e.location != world:
                assert all(_ref_belief((n,), events[:i]) in (None, e.location) for n in e.perceivers)
    mean_words = np.mean([s.meta["word_count"] for s in stims[:: 80]])
    assert 160 <= mean_words <= 230  # "about 200 words"


def test_spans_point_at_the_right_words(stims):
    for s in stims:
        style, order = s.condition.split("/")
        assert s.span_text("statement") == s.meta["statement"]
        assert s.span_text("question") == QUESTIONS[order]
        assert s.span_text("query") == ANSWER_STEMS[style] and s.text.endswith(ANSWER_STEMS[style])
        assert s.text.startswith(HUMAN_INTRO) == (style == "human")
        assert s.span_text("protagonist") == s.meta["organiser"]
        assert s.spans["protagonist"].start < s.spans["statement"].start
        if s.meta["stmt_type"] == "tom":
            for d, name in enumerate(s.meta["chain"]):
                assert s.span_text(f"holder_{d + 1}") == name
                assert s.spans[f"holder_{d + 1}"].start >= s.spans["statement"].start
            assert s.span_text("statement_claim") == s.meta["claim_value"]
            assert s.meta["statement"].split()[1] == VERBS[0]


def test_bad_options_raise():
    for kwargs in ({"conditions": "human"}, {"orders": (1,)}, {"levels": (7,)}, {"topics": ("war",)},
                   {"characters": (2,)}, {"orders": (), "levels": ()}, {"n": 0}):
        with pytest.raises(TomlensError):
            motomqa(**{"n": 1, **kwargs})


# ---- scoring and aggregates -----------------------------------------------------------------


def test_pooled_p_true_is_street_et_al_formula():
    logps = {"True": math.log(0.3), "true": math.log(0.2), "TRUE": math.log(0.1),
             "False": math.log(0.2), "false": math.log(0.1), "FALSE": math.log(0.1)}
    assert pooled_p_true(logps) == pytest.approx(0.6 / 1.0)
    assert pooled_p_true({k: -50.0 for k in logps}) == pytest.approx(0.5)
    with pytest.raises(TomlensError):
        pooled_p_true({"True": 0.0})


def _table(rows):
    """A hand-made behaviour table: (task, stmt_type, n, options_order, answer, said_true)."""
    out = []
    for i, (task, kind, n, order, answer, said) in enumerate(rows):
        out.append({"id": f"r{i}", "family": "motomqa", "task_id": task, "stmt_type": kind,
                    "order_or_level": n, "options_order": order, "answer": answer,
                    "p_true_pooled": 0.8 if said else 0.2})
    return pd.DataFrame(out)


def test_summary_computes_the_papers_cells_on_a_known_table():
    rows = []
    for task in ("a", "b"):
        for order in ("true-first", "false-first"):
            # ToM order 2: right on true statements, wrong on false (always "true")
            rows += [(task, "tom", 2, order, "true", True), (task, "tom", 2, order, "false", True)]
            # ToM order 3: right on both
            rows += [(task, "tom", 3, order, "true", True), (task, "tom", 3, order, "false", False)]
            # facts level 2: right on both; says "true" only when offered first on false ones
            rows += [(task, "fact", 2, order, "true", True),
                     (task, "fact", 2, order, "false", order == "true-first")]
    df = _table(rows)
    out = summary(df).set_index(["metric", "stmt_type"])
    acc = summary(df)
    tom2 = acc[(acc.metric == "accuracy") & (acc.stmt_type == "tom") & (acc.order_or_level == 2)].iloc[0]
    tom3 = acc[(acc.metric == "accuracy") & (acc.stmt_type == "tom") & (acc.order_or_level == 3)].iloc[0]
    fact2 = acc[(acc.metric == "accuracy") & (acc.stmt_type == "fact") & (acc.order_or_level == 2)].iloc[0]
    assert (tom2.value, tom3.value, fact2.value) == (50.0, 100.0, 75.0)
    assert tom2.paper_other_items_humans == 96 and tom2.n == 8 and tom2.n_tasks == 2
    assert "paper" not in acc.columns and all(c.startswith("paper_other_items_") for c in PAPER_COLUMNS)
    assert out.loc[("accuracy_overall", "tom"), "value"] == 75.0
    assert out.loc[("tom_minus_fact", "both"), "value"] == 0.0
    # % true: true-first 5 of 6 per task, false-first 4 of 6 -> index 100 * (10 - 8) / 12
    assert out.loc[("anchoring_index", "both"), "value"] == pytest.approx(100 * 2 / 12)
    z, p = two_proportion_z(10, 12, 8, 12)
    assert out.loc[("anchoring_index", "both"), "statistic"] == pytest.approx(z)
    assert out.loc[("anchoring_index", "both"), "test"] == "two-proportion z"
    assert out.loc[("share_true", "both"), "value"] == pytest.approx(100 * 18 / 24)
    assert out.loc[("anchoring_index", "both"), "p_value"] == pytest.approx(p)
    assert z == pytest.approx((10 / 12 - 8 / 12) / math.sqrt(0.75 * 0.25 * (2 / 12)))
    assert out.loc[("share_true", "both"), "flag"] == ""
    assert set(out["scoring"]) == {"pooled case variants"}
    assert BATTERIES["motomqa"] is summary


def test_always_true_flag_and_two_option_fallback():
    rows = [(t, "tom", 2, o, a, True) for t in "abc" for o in ("true-first", "false-first") for a in ("true", "false")]
    df = _table(rows).drop(columns="p_true_pooled")
    df["option_a"] = np.where(df["options_order"] == "true-first", "true", "false")
    df["p_a"] = np.where(df["option_a"] == "true", 0.9, 0.1)  # always "true"
    out = summary(df).set_index("metric")
    assert out.loc["share_true", "value"] == 100.0 >= 100 * ALWAYS_TRUE_SHARE
    assert "LaMDA" in out.loc["share_true", "flag"]
    assert out.loc["accuracy_overall", "value"] == 50.0 and out.loc["anchoring_index", "value"] == 0.0
    assert set(out["scoring"]) == {"two options (true, false)"}
    df["p_a"] = 1 - df["p_a"]  # now always "false": the mirrored flag
    flipped = summary(df).set_index("metric")
    assert flipped.loc["share_true", "value"] == 0.0 and "answers 'false'" in flipped.loc["share_true", "flag"]
    with pytest.raises(TomlensError):
        summary(df.drop(columns="stmt_type"))


def test_pooled_scores_equal_a_direct_computation_on_tiny_llama(load_tiny):
    model = load_tiny("tiny-llama")
    stims = motomqa(1, 0, conditions=("simplified/true-first",), orders=(2,), levels=())
    pooled = pooled_scores(model, stims, progress=False)
    tok = model.tokenizer
    for s, row in zip(stims, pooled.itertuples(), strict=True):
        direct = {}
        prompt_ids = tok(s.text)["input_ids"]
        for side in ("true", "false"):
            for v in CASE_VARIANTS[side]:
                ids = tok(f"{s.text} {v}")["input_ids"]
                assert ids[: len(prompt_ids)] == prompt_ids
                with torch.inference_mode():
                    logits = model(torch.tensor([ids]))
                lp = torch.log_softmax(logits[0].float(), -1)
                direct[v] = sum(float(lp[t - 1, ids[t]]) for t in range(len(prompt_ids), len(ids)))
                assert getattr(row, f"logp_{v}") == pytest.approx(direct[v], abs=1e-4)
        assert row.p_true_pooled == pytest.approx(pooled_p_true(direct), abs=1e-5)
        assert row.correct_pooled == ((row.p_true_pooled > 0.5) == (s.answer == "true"))
        assert row.option_mass_pooled == pytest.approx(sum(math.exp(x) for x in direct.values()), rel=1e-4)
    table = pd.DataFrame({"id": [s.id for s in stims]})
    assert list(add_pooled(table, pooled)["p_true_pooled"]) == list(pooled["p_true_pooled"])


def test_probe_sweep_per_order_runs_on_tiny_llama(load_tiny, tmp_path):
    from tomlens.activations import cache_activations
    from tomlens.probes.sweep import run_probe_sweep
    from tomlens.probes.targets import make_target

    model = load_tiny("tiny-llama")
    stims = motomqa(6, 0, conditions=("simplified/true-first",), levels=())
    by_order = {}
    for order in (2, 6):  # one sweep per order: does decodability fall with order?
        sub_stims = [s for s in stims if s.meta["order"] == order]
        sub = cache_activations(model, sub_stims, "resid_post", ["final"], store=tmp_path, progress=False)
        keep = sub_stims
        y, keep_mask = make_target(list(sub.stimuli), "statement_literal")
        assert bool(keep_mask.all()) and int(y.sum()) == len(keep) // 2
        res = run_probe_sweep(sub, "statement_literal", sites=("resid_post",), folds=3, inner_folds=2,
                              c_grid=(1.0,), n_boot=50, progress=False, device="cpu", controls=False,
                              condition_split=False, bow=False, length=False, position=False,
                              embeddings=False, conditions=False, directions=False)
        t = res.table
        assert set(t["target"]) == {"statement_literal"} and len(t) > 0
        by_order[order] = t
    assert set(by_order) == {2, 6}


def test_minimal_pairs_flip_one_believer_and_align():
    pairs, report = make_pairs("motomqa", n=8, seed=0)
    assert pairs and report.aligned == len(pairs) == report.total
    for p in pairs:
        assert structural_problem(p) is None
        assert p.clean.answer == "true" and p.corrupted.answer == "false"
        assert p.clean.options == p.corrupted.options
        a, b = p.clean.meta["chain"], p.corrupted.meta["chain"]
        assert len(a) == len(b) and sum(x != y for x, y in zip(a, b, strict=True)) == 1
        assert p.clean.span_text("contrast") in a and p.corrupted.span_text("contrast") in b
    assert len(minimal_pairs(8, 0)) == len(pairs)


def test_minimal_pairs_align_on_the_tiny_llama_tokenizer(load_tiny):
    tok = load_tiny("tiny-llama").tokenizer
    pairs, report = make_pairs("motomqa", n=8, seed=0, tokenizer=tok)
    assert pairs and report.checked_with != "characters"
    assert report.aligned + report.dropped == report.total


# ---- review fixes: self-consistent facts, reader-level labels, balance, shortcut baselines ------

SEEDS = (0, 1, 2, 5, 11)


def _gender(name):
    from tomlens.stimuli import lexicon

    return next(r[1] for r in lexicon.NAMES if r[0] == name)


def _contradiction(s):
    """Why a factual statement contradicts itself whatever the story ('' if it does not): a check
    written from the statement's rendered propositions, not from the generator's `conflicts`."""
    import re as _re

    from tomlens.stimuli.motomqa import TOPICS

    texts = [p["text"] for p in s.meta["propositions"]]
    organisers = [p["atom"][1] for p in s.meta["propositions"] if p["atom"][0] == "organised"]
    if len(organisers) > 1:
        return "two organisers"
    rel = {}
    topic = TOPICS[s.meta["topic"]]
    for t in texts:
        m = _re.fullmatch(rf"(\w+) was {s.meta['organiser']}'s (.+)", t)
        if not m:
            continue
        who, noun = m.groups()
        if who in rel:
            return "one person, two relations"
        if noun in rel.values():
            return "two people, one relation noun"
        if who in organisers:
            return "the organiser given a relation"
        fem = {r[0] for r in topic.roles}
        male = {r[1] for r in topic.roles}
        if noun not in (fem if _gender(who) == "she" else male):
            return f"gender mismatch: {who} ... {noun}"
        rel[who] = noun
    cue_texts = {c[1].split("{X}")[-1]: c for c in topic.cues}
    seen = {}
    for t in texts:  # the same behavioural cue given to two people
        for tail in cue_texts:
            if tail and t.endswith(tail.format(pos="his")) or tail and t.endswith(tail.format(pos="her")):
                if tail in seen and seen[tail] != t:
                    return "one cue for two people"
                seen[tail] = t
    return ""


@pytest.mark.parametrize("seed", SEEDS)
def test_false_facts_never_contradict_themselves(seed):
    stims = motomqa(10, seed, conditions=("simplified/true-first",), orders=())
    assert stims
    for s in stims:
        assert _contradiction(s) == "", (s.meta["statement"], _contradiction(s))
        for p in s.meta["propositions"]:  # relation nouns of the person's gender, true or false
            if p["atom"][0] == "relation":
                from tomlens.stimuli.motomqa import TOPICS

                roles = TOPICS[s.meta["topic"]].roles
                assert p["atom"][2] in {r[0 if _gender(p["atom"][1]) == "she" else 1] for r in roles}


def test_contradiction_checker_catches_what_it_should():
    s = motomqa(1, 0, conditions=("simplified/true-first",), orders=(), levels=(2,))[1]
    org, other = s.meta["organiser"], [n for n in s.meta["characters"] if n != s.meta["organiser"]][0]
    noun = "sister" if _gender(other) == "he" else "brother"
    bad = {"propositions": [{"atom": ["relation", other, noun], "text": f"{other} was {org}'s {noun}"}]}
    if s.meta["topic"] in ("birthday", "proposal", "pickup"):  # topics with gendered nouns
        assert "gender" in _contradiction(s.with_(meta={**s.meta, **bad}))
    two = {"propositions": [{"atom": ["organised", a], "text": "x"} for a in s.meta["characters"][:2]]}
    assert _contradiction(s.with_(meta={**s.meta, **two})) == "two organisers"


@pytest.mark.parametrize("seed", SEEDS)
def test_told_is_false_only_where_nothing_else_conveyed_the_plan(seed):
    for s in motomqa(10, seed, conditions=("simplified/true-first",), orders=()):
        events, org = s.meta["events"], s.meta["organiser"]
        for p in s.meta["propositions"]:
            if p["atom"][0] != "told" or p["true"]:
                continue
            a, b = p["atom"][1:]
            assert not (a == org and any(b in e[2] for e in events[:2])), p["text"]  # announced with b there
            for i, (teller, _hearer) in zip([i for i, e in enumerate(events) if e[0] == "tell"], s.meta["tellings"], strict=True):
                assert not (teller == a and b in events[i][2]), p["text"]  # b heard a tell someone
            assert [b, a] not in s.meta["tellings"]


@pytest.mark.parametrize("seed", SEEDS)
def test_no_chain_holds_the_organiser_to_the_old_plan_inside_a_level_that_knows_the_new(seed):
    n_checked = 0
    for s in motomqa(10, seed, conditions=("simplified/true-first",), levels=()):
        events = events_from_meta(s.meta["events"])
        chain, org, new = s.meta["chain"], s.meta["organiser"], s.meta["values"][1]
        for i, name in enumerate(chain):
            if name != org:
                continue
            outer = [_ref_belief(tuple(chain[:j]), events) for j in range(1, i + 1)]
            if new in outer:
                assert _ref_belief(tuple(chain[: i + 1]), events) == new, (chain, s.meta["statement"])
                n_checked += 1
    assert n_checked > 0  # the case occurs, and is read as a reader would


@pytest.mark.parametrize("seed", SEEDS)
def test_claimed_value_does_not_predict_truth_at_any_order(seed):
    stims = motomqa(20, seed, conditions=("simplified/true-first",), levels=())
    for order in ORDERS:
        for answer in ("true", "false"):
            rows = [s for s in stims if s.meta["order"] == order and s.answer == answer]
            current = np.mean([s.meta["claim_value"] == s.meta["values"][1] for s in rows])
            assert abs(current - 0.5) <= 0.1, (order, answer, current)
    kinds = Counter(s.meta["false_kind"] for s in stims if s.answer == "false")
    assert set(kinds) <= {"one_believer", "other_chain", "other_value", "other_chain_value"}
    assert kinds["one_believer"] >= 0.8 * sum(kinds.values())  # minimal pairs nearly always


@pytest.mark.parametrize("seed", SEEDS[:3])
def test_shortcut_baselines_are_labelled_and_reported(seed):
    stims = motomqa(12, seed, conditions=("simplified/true-first",), levels=())
    for s in stims:
        events, chain, claim = events_from_meta(s.meta["events"]), s.meta["chain"], s.meta["claim_value"]
        for k in (1, 2):
            want = None if len(chain) <= k else _ref_belief(tuple(chain[-k:]), events) == claim
            assert s.meta[f"last_{k}_true"] == want
    # a hand-made table: a model that answers by the last two believers scores the baseline
    df = pd.DataFrame([{"id": s.id, "task_id": s.task_id, "stmt_type": "tom", "order_or_level": s.meta["order"],
                        "options_order": s.meta["options_order"], "answer": s.answer,
                        "last_1_true": s.meta["last_1_true"], "last_2_true": s.meta["last_2_true"],
                        "p_true_pooled": 0.9 if (s.meta["last_2_true"] if s.meta["order"] > 3 else s.answer == "true") else 0.1}
                       for s in stims])
    out = summary(df, n_boot=50)
    for order in (4, 5, 6):
        acc = out[(out.metric == "accuracy") & (out.order_or_level == order)].value.iloc[0]
        base = out[(out.metric == "baseline_last_2") & (out.order_or_level == order)].value.iloc[0]
        sub = df[df.order_or_level == order]
        assert acc == base == pytest.approx(100 * np.mean(sub.last_2_true == (sub.answer == "true")))
    assert set(out[out.metric == "baseline_last_1"].order_or_level) == {3, 4, 5, 6}
    assert set(out[out.metric == "baseline_last_2"].order_or_level) == {4, 5, 6}


# ---- issue 27: no shortcut explains accuracy at an order; the paper's tests --------------------

FRESH = (101, 202, 303)


def _tom_pairs(stims):
    """(true, false) statement of each story x order (one prompt condition)."""
    cells = {}
    for s in stims:
        if s.meta["stmt_type"] == "tom":
            cells.setdefault((s.task_id, s.meta["order"]), {})[s.answer] = s
    return [(c["true"], c["false"]) for c in cells.values()]


@pytest.mark.parametrize("seed", FRESH)
def test_every_shortcut_answers_half_of_every_order_right(seed):
    """Before (6bc1cca) the last two believers alone gave the right answer to about 90% of the
    statements at orders 4-6 (the fixture below); now every shortcut is right on exactly one of
    each story's true and false statement, so at 50% at every order it applies to."""
    stims = motomqa(32, seed, conditions=("simplified/true-first",), levels=())
    assert {s.meta["n_characters"] for s in stims} == {5}
    for order in ORDERS:
        rows = [s for s in stims if s.meta["order"] == order]
        assert Counter(s.answer for s in rows) == {"true": 32, "false": 32}
        for k in SHORTCUTS:
            said = [(s.meta[f"{k}_true"], s.answer == "true") for s in rows if s.meta[f"{k}_true"] is not None]
            if order - 1 < MIN_BELIEVERS[k]:
                assert not said, (order, k)
                continue
            assert np.mean([a == t for a, t in said]) == 0.5, (order, k)
            for truth in (True, False):  # and independent of the truth: half "true" in each class
                says_true = np.mean([a for a, t in said if t == truth])
                assert abs(says_true - 0.5) <= 0.05, (order, k, truth, says_true)
    for t, f in _tom_pairs(stims):
        for k in SHORTCUTS:
            if t.meta[f"{k}_true"] is not None:  # one of the two right, the other wrong
                assert (t.meta[f"{k}_true"] is True) + (f.meta[f"{k}_true"] is False) == 1, (t.id, k)
        if t.meta["order"] > 2:  # the same profile: no surface cue tells the two apart
            assert chain_profile_of(t) == chain_profile_of(f), (t.meta["chain"], f.meta["chain"])


def chain_profile_of(s):
    """People named, where the organiser is, how many were at the second gathering (from meta)."""
    chain, at_change = s.meta["chain"], set(s.meta["events"][1][2])
    return (len(set(chain)), tuple(i for i, n in enumerate(chain) if n == s.meta["organiser"]),
            sum(n in at_change for n in set(chain)))


def test_the_old_generator_fails_where_the_rules_say_and_the_rules_read_the_story():
    import gzip
    import json
    from pathlib import Path

    from tomlens.stimuli.records import Stimulus

    path = Path(__file__).parent / "data" / "audit" / "motomqa-6bc1cca.jsonl.gz"
    with gzip.open(path, "rt") as fh:
        before = [Stimulus.from_dict(json.loads(line)) for line in fh]
    rules = {r.name: r for r in RULES}
    for order in (4, 5, 6):  # the defect issue 27 names, read by the family's registered rule
        rows = [s for s in before if s.meta["stmt_type"] == "tom" and s.meta["order"] == order]
        right = [rules["shortcut: last_2"].feature(s) == (s.answer == "true") for s in rows]
        assert np.mean(right) >= 0.85, (order, np.mean(right))
    fresh = motomqa(4, 7, conditions=("human/false-first",))
    for s in fresh:  # the rules re-derive each shortcut from the story's events, not the stored label
        for k in SHORTCUTS:
            assert stimulus_shortcut_true(s, k) == s.meta[f"{k}_true"] == rules[f"shortcut: {k}"].feature(s)
    names = {c.name for c in CONTRASTS}
    assert {f"ToM statement truth, order {k}" for k in ORDERS} <= names
    assert all(r.contrasts and set(r.contrasts) <= names for r in RULES)
    assert "ToM statement truth, order 3" not in rules["shortcut: last_2"].contrasts


def test_belief_table_equals_the_tracker_chain_by_chain():
    from tomlens.stimuli.belief_state import belief, chains
    from tomlens.stimuli.motomqa import TOPICS, build_story, reader_consistent

    for i in range(3):
        model = build_story(i, 5, 5, TOPICS[list(TOPICS)[i]])
        table = belief_table(model)
        every = [c for n in range(1, 6) for c in chains(model.names, n)]
        assert set(table) == set(every)
        for c in every:
            assert table[c] == (belief(c, model.events), reader_consistent(model, c)), c


@pytest.mark.parametrize("seed", SEEDS[:3])
def test_a_false_fact_is_its_true_fact_with_one_atom_of_the_same_kind_swapped(seed):
    stims = motomqa(10, seed, conditions=("simplified/true-first",), orders=())
    cells = {}
    for s in stims:
        cells.setdefault((s.task_id, s.meta["level"]), {})[s.answer] = s
    for by in cells.values():
        t = [tuple(p["atom"]) for p in by["true"].meta["propositions"]]
        f = [tuple(p["atom"]) for p in by["false"].meta["propositions"]]
        differ = [i for i, (a, b) in enumerate(zip(t, f, strict=False)) if a != b]
        assert len(t) == len(f) and len(differ) == 1 and t[differ[0]][0] == f[differ[0]][0], (t, f)


def test_mcnemar_cochran_binomial_and_z_against_known_values():
    # exact binomial below 25 discordant pairs (SPSS): 1 vs 6 -> 2 * P(X <= 1 | 7, 1/2) = 16/128
    a = [True] * 1 + [False] * 6 + [True] * 5
    b = [False] * 1 + [True] * 6 + [True] * 5
    t = mcnemar(a, b)
    assert (t.statistic, t.discordant, t.n) == (None, 7, 12) and t.p_value == pytest.approx(16 / 128)
    # chi-square with continuity correction from 25 on: (|10 - 25| - 1)^2 / 35 = 5.6
    a, b = [True] * 10 + [False] * 25, [False] * 10 + [True] * 25
    t = mcnemar(a, b)
    assert t.statistic == pytest.approx(5.6) and t.df == 1 and t.p_value == pytest.approx(0.0179605, abs=1e-6)
    assert mcnemar([True, False], [True, False]).p_value == 1.0
    # Cochran's Q by hand: C = (5, 3, 1), R = (2, 1, 3, 0, 1, 2), N = 9, k = 3 -> Q = 48 / 8 = 6, p = e^-3
    blocks = [[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 0, 0], [1, 0, 0], [1, 1, 0]]
    q = cochran_q(blocks)
    assert q.statistic == pytest.approx(6.0) and q.df == 2 and q.p_value == pytest.approx(math.exp(-3))
    assert q.discordant == 4  # blocks neither all right nor all wrong
    # with two samples Q is McNemar's chi-square without the correction: (b - c)^2 / (b + c)
    rng = np.random.default_rng(0)
    x, y = rng.random(200) < 0.6, rng.random(200) < 0.4
    b, c = int((x & ~y).sum()), int((~x & y).sum())
    assert cochran_q(np.column_stack([x, y])).statistic == pytest.approx((b - c) ** 2 / (b + c))
    # Street et al.'s own numbers: GPT-3.5 147 of 280 vs chance p = 0.437, PaLM 166 of 280 p = 0.002;
    # GPT-4 order 3 (94.6% of 56) vs order 4 (73.2%) Z = 3.087; humans order 4 vs 5 Z = -2.858
    assert binomial_vs_chance(147, 280) == pytest.approx(0.437, abs=5e-4)
    assert binomial_vs_chance(166, 280) == pytest.approx(0.002, abs=5e-4)
    assert two_proportion_z(53, 56, 41, 56)[0] == pytest.approx(3.087, abs=5e-3)
    assert two_proportion_z(46, 56, 55, 56)[0] == pytest.approx(-2.858, abs=5e-3)
    with pytest.raises(TomlensError):
        cochran_q([[1], [0]])
    with pytest.raises(TomlensError):
        mcnemar([True, False], [True])


def test_subject_tests_compare_models_on_the_same_statements():
    ids = [f"s{i}" for i in range(40)]
    truth = ["true" if i % 2 else "false" for i in range(40)]

    def table(right):
        said = [(t == "true") == r for t, r in zip(truth, right, strict=True)]
        return pd.DataFrame({"id": ids, "stmt_type": "tom", "answer": truth,
                             "p_true_pooled": [0.9 if x else 0.1 for x in said]})

    right = {"good": [i % 10 != 0 for i in range(40)], "coin": [i % 2 == 0 for i in range(40)],
             "same": [i % 10 != 0 for i in range(40)]}
    res = subject_tests({k: table(v) for k, v in right.items()})
    assert res.n_statements == 40 and res.subjects == ("good", "coin", "same")
    assert res.overall.statistic == pytest.approx(cochran_q(np.column_stack(list(right.values()))).statistic)
    pairs = {(a, b): (pa, pb, t) for a, b, pa, pb, t in res.pairs}
    assert pairs[("good", "coin")][:2] == (90.0, 50.0)
    assert pairs[("good", "same")][2].p_value == 1.0 and pairs[("good", "same")][2].discordant == 0
    assert pairs[("good", "coin")][2].p_value == mcnemar(right["good"], right["coin"]).p_value
    assert len(res.table()) == 4
    with pytest.raises(TomlensError):
        subject_tests({"one": table(right["good"])})


def test_summary_puts_each_order_above_its_shortcuts_with_paired_tests():
    """A hand-made table of 3 stories x 2 conditions x {true, false} x orders 2-4 and levels 2-4:
    the model is right at orders 2 and 3, answers like the last two believers at order 4; every
    number below is counted by hand from that."""
    rows = []
    for task in ("a", "b", "c"):
        for cond in ("simplified/true-first", "simplified/false-first"):
            for answer in ("true", "false"):
                truth = answer == "true"
                last_2 = truth if task == "a" else not truth  # right on story a only
                for order in (2, 3, 4):
                    said = truth if order < 4 else last_2
                    rows.append({"task_id": task, "condition": cond, "stmt_type": "tom", "order_or_level": order,
                                 "answer": answer, "said": said, "last_2_true": last_2 if order == 4 else None})
                for level in (2, 3, 4):
                    rows.append({"task_id": task, "condition": cond, "stmt_type": "fact", "order_or_level": level,
                                 "answer": answer, "said": truth, "last_2_true": None})
    df = pd.DataFrame(rows)
    df["id"] = [f"r{i}" for i in range(len(df))]
    df["options_order"] = df["condition"].str.split("/").str[1]
    df["p_true_pooled"] = np.where(df["said"], 0.9, 0.1)
    df["option_mass_pooled"] = 0.3
    out = summary(df.drop(columns="said"), n_boot=200)
    row = lambda m, **kw: out[(out.metric == m) & np.logical_and.reduce(  # noqa: E731
        [out[k] == v for k, v in kw.items()] or [True])].iloc[0]
    acc4 = row("accuracy", stmt_type="tom", order_or_level=4)
    assert acc4.value == pytest.approx(100 / 3)
    assert "0.30 of the probability" in acc4.flag and acc4.mean_option_mass == pytest.approx(0.3)
    base = row("baseline_last_2", order_or_level=4)
    above = row("above_last_2", order_or_level=4)
    assert base.value == pytest.approx(100 / 3) and above.value == 0.0 and above.baseline == base.value
    assert above.test == "McNemar (exact binomial)" and above.p_value == 1.0  # the same answers
    # order 3 vs 4: 8 blocks right then wrong, none the other way
    step = row("level_step", stmt_type="tom", order_or_level=4)
    assert step.value == pytest.approx(-200 / 3) and step.p_value == pytest.approx(2 / 2 ** 8)
    q = row("cochran_q", stmt_type="tom")
    assert q.versus == "orders 2, 3, 4" and q.n == 36
    wide = np.array([[1, 1, 1]] * 4 + [[1, 1, 0]] * 8)  # story a right throughout, b and c not at 4
    assert q.statistic == pytest.approx(cochran_q(wide).statistic) and q.test == "Cochran's Q"
    paired = row("tom_minus_fact_paired", order_or_level=4)
    assert paired.value == pytest.approx(-200 / 3) and paired.n == 24
    assert row("tom_minus_fact_paired").value == pytest.approx(-200 / 9)  # over levels 2-4
    overall = row("accuracy_overall", stmt_type="tom")
    assert overall.test == "exact binomial vs 50%"
    assert overall.p_value == pytest.approx(binomial_vs_chance(28, 36))
    assert row("cochran_q", stmt_type="fact").p_value == 1.0  # always right: nothing differs


def test_the_audit_finds_no_shortcut_on_a_fresh_seed_at_64_stories():
    """`tomlens audit`'s battery (n-gram bags, length, option cues, the family's rules) on 64 fresh
    stories' ToM statements of orders 4-6 (the orders the last-two shortcut solved), each order and
    all together (every order is checked rule by rule above; kept to three orders for time).
    Measured on seeds 1-6 with every order and the factual statements: no shortcut on 2-6; on seed 1 one trigram bag of order 3 reads 0.62 (interval
    0.51-0.73), a draw of names: pooled over 768 stories (seeds 1000-1011) the same bag scores
    0.499 [0.478, 0.520], and swapping which statement of each pair is true gives 0.38-0.60 at 64
    stories, wider than the audit's interval assumes."""
    from tomlens.audit import audit_stimuli

    stims = motomqa(64, 5, conditions=("simplified/true-first",), orders=(4, 5, 6), levels=())
    report = audit_stimuli(stims, seed=0)
    assert not report.shortcuts, report.table()
    contrasts = {r.contrast for r in report.rows}
    assert {f"ToM statement truth, order {k}" for k in (4, 5, 6)} <= contrasts
    ran = {r.heuristic for r in report.rows}
    assert {f"rule: shortcut: {k}" for k in SHORTCUTS} <= ran and "3-gram bag (prompt)" in ran
    assert max(r.accuracy for r in report.rows if "bag" in r.heuristic) <= 0.60
